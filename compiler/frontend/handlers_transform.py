"""Handlers for ONNX data-movement and shape ops: Reshape, Flatten, Squeeze, Unsqueeze, Transpose,
Slice, Split, Concat, Pad, Tile, Expand, the Gather/Scatter family, Shape, Size, Constant,
ConstantOfShape, Range, OneHot, Trilu, DepthToSpace, SpaceToDepth, EyeLike, NonZero, Compress,
ReverseSequence, Unique, NonMaxSuppression and CenterCropPad.

Shape arguments (target shapes, axes, pads, repeats, slice bounds...) must be known at import
(``ctx.const``); ops whose output shape depends on data values (NonZero, Compress, Unique,
NonMaxSuppression) are accepted only when those values are constants.
"""
from __future__ import annotations

import math

import numpy as np

from ..ir.graph import Tensor
from ..ops.transform import (PAD_MODES, AffineGather, Concat, DepthToSpace, Expand, Eye, Full, Gather,
                             GatherElements, GatherND, OneHot, Pad, Range, Reshape, ReverseSequence, ScatterElements,
                             ScatterND, ShapeOf, SizeOf, Slice, SpaceToDepth, Tile, Transpose, Trilu, fit_affine,
                             normalize_slice)
from .registry import NodeContext, onnx_dtype, onnx_op

_INDEX_DTYPES = ("int32", "int64")


# helpers -------------------------------------------------------------------------------------
def _ints(ctx: NodeContext, values, what: str) -> list[int]:
    """``values`` (an attribute list or a constant input) as Python ints."""
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu" and not (arr.dtype.kind == "f" and arr.size == 0):
        raise ctx.invalid(f"{what} must be integers, got {arr.dtype}")
    return [int(v) for v in arr.ravel()]


def _axis(ctx: NodeContext, axis: int, rank: int, what: str = "axis") -> int:
    """Normalize ``axis`` into ``[0, rank)``."""
    if not -rank <= axis < rank:
        raise ctx.invalid(f"{what} {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def _axes(ctx: NodeContext, axes, rank: int, what: str = "axes") -> list[int]:
    res = [_axis(ctx, a, rank, what) for a in axes]
    if len(set(res)) != len(res):
        raise ctx.invalid(f"{what} {list(axes)} repeat an axis")
    return res


def _index_input(ctx: NodeContext, i: int) -> Tensor:
    t = ctx.input(i)
    if t.dtype not in _INDEX_DTYPES:
        raise ctx.invalid(f"indices must be int32 or int64, got {t.dtype}")
    return t


def _reshape(ctx: NodeContext, x: Tensor, shape, name: str | None = None) -> Tensor:
    return ctx.add(Reshape([x], name=name or ctx.name, shape=tuple(int(d) for d in shape)))


def _slice(ctx: NodeContext, x: Tensor, bounds: dict[int, tuple[int, int, int]], name: str | None = None) -> Tensor:
    """Slice ``x`` with ``bounds[axis] = (start, end, step)`` in ONNX semantics (clamped)."""
    starts, steps, sizes = [], [], []
    for d, n in enumerate(x.shape):
        s, e, st = bounds.get(d, (0, n, 1))
        if st == 0:
            raise ctx.invalid("slice steps must not be 0")
        first, size = normalize_slice(s, e, st, n)
        starts.append(first if size else 0)
        steps.append(st if size > 1 else 1)
        sizes.append(size)
    return ctx.add(Slice([x], name=name or ctx.name, starts=tuple(starts), steps=tuple(steps), sizes=tuple(sizes)))


def _const_indices(ctx: NodeContext, indices: np.ndarray, extent: int) -> np.ndarray:
    """Constant indices as int64 with negative values wrapped; out-of-range ones are an error."""
    idx = np.asarray(indices).astype(np.int64)
    if idx.size and (idx.min() < -extent or idx.max() >= extent):
        raise ctx.shape_error(f"indices {idx.ravel().tolist()[:8]} are out of range for an axis of size {extent}")
    return np.where(idx < 0, idx + extent, idx)


def _affine_gather(ctx: NodeContext, data: Tensor, out_shape, maps: list, name: str | None = None) -> Tensor | None:
    """An :class:`AffineGather` for ``maps[d]``: either ``("axis", j)`` (data dim ``d`` is output
    dim ``j``) or ``(first, values)`` (constant positions over output dims ``first...``); ``None``
    when some ``values`` are not affine in their position."""
    coefs, offsets = [], []
    for m in maps:
        c = [0] * len(out_shape)
        if m[0] == "axis":
            c[m[1]], b = 1, 0
        else:
            fit = fit_affine(m[1])
            if fit is None:
                return None
            c[m[0]:m[0] + m[1].ndim], b = fit[0], fit[1]
        coefs.append(tuple(c))
        offsets.append(b)
    return ctx.add(AffineGather([data], name=name or ctx.name, shape=tuple(out_shape), coefs=tuple(coefs),
                                offsets=tuple(offsets)))


def _gather_const(ctx: NodeContext, data: Tensor, indices: np.ndarray, axis: int, name: str | None = None) -> Tensor:
    """Gather along ``axis`` at constant ``indices``: a strided Slice for a 1-D arithmetic
    progression, an AffineGather for indices affine in their position, else a Gather."""
    idx = _const_indices(ctx, indices, data.shape[axis])
    q = idx.ndim
    if q == 1 and idx.size:
        step = int(idx[1] - idx[0]) if idx.size > 1 else 1
        if step and np.array_equal(idx, idx[0] + step * np.arange(idx.size)):
            end = int(idx[-1]) + (1 if step > 0 else -1)      # -1 (before the first) is -n-1 in slice terms
            return _slice(ctx, data, {axis: (int(idx[0]), end if end >= 0 else -data.shape[axis] - 1, step)}, name)
    out_shape = data.shape[:axis] + idx.shape + data.shape[axis + 1:]
    maps = [("axis", d) for d in range(axis)] + [(axis, idx)] + [("axis", d + q - 1)
                                                                 for d in range(axis + 1, data.ndim)]
    res = _affine_gather(ctx, data, out_shape, maps, name)
    return res if res is not None else ctx.add(Gather([data, ctx.constant(idx)], name=name or ctx.name, axis=axis))


def _scalar(ctx: NodeContext, i: int, what: str):
    v = np.asarray(ctx.const(i))
    if v.size != 1:
        raise ctx.invalid(f"{what} must be a scalar, got shape {v.shape}")
    return v.reshape(())


# reshaping -----------------------------------------------------------------------------------
def _resolve_shape(ctx: NodeContext, in_shape, spec, allowzero: bool) -> list[int]:
    """The static output shape of ONNX Reshape: ``0`` copies the input dim (unless
    ``allowzero``), one ``-1`` is inferred."""
    if allowzero and 0 in spec and -1 in spec:
        raise ctx.invalid(f"shape {spec} has both 0 and -1 with allowzero=1")
    out, infer = [], None
    for k, s in enumerate(spec):
        if s == -1:
            if infer is not None:
                raise ctx.invalid(f"shape {spec} has more than one -1")
            infer = k
            out.append(1)
        elif s == 0 and not allowzero:
            if k >= len(in_shape):
                raise ctx.shape_error(f"shape {spec} copies dim {k}, but the input has rank {len(in_shape)}")
            out.append(in_shape[k])
        elif s < 0:
            raise ctx.invalid(f"shape {spec} has a negative dim {s}")
        else:
            out.append(s)
    total = math.prod(in_shape)
    if infer is not None:
        rest = math.prod(out)
        if rest == 0 or total % rest:
            raise ctx.shape_error(f"cannot infer the -1 in {spec} for an input of shape {tuple(in_shape)}")
        out[infer] = total // rest
    if math.prod(out) != total:
        raise ctx.shape_error(f"cannot reshape {tuple(in_shape)} ({total} elements) to {spec}")
    return out


@onnx_op("Reshape", since=1, until=4)
def reshape1(ctx):
    x = ctx.input(0)
    return [_reshape(ctx, x, _resolve_shape(ctx, x.shape, list(ctx.attr("shape")), False))]


@onnx_op("Reshape", since=5)
def reshape5(ctx):
    x = ctx.input(0)
    spec = _ints(ctx, ctx.const(1), "shape")
    return [_reshape(ctx, x, _resolve_shape(ctx, x.shape, spec, ctx.flag("allowzero", 0)))]


@onnx_op("Flatten")
def flatten(ctx):
    x = ctx.input(0)
    axis = ctx.attr("axis", 1)
    if not -x.ndim <= axis <= x.ndim:
        raise ctx.invalid(f"axis {axis} is out of range for rank {x.ndim}")
    axis = axis + x.ndim if axis < 0 else axis
    return [_reshape(ctx, x, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))]


def _squeeze(ctx: NodeContext, axes) -> list[Tensor]:
    x = ctx.input(0)
    if axes is None:
        axes = [d for d, n in enumerate(x.shape) if n == 1]
    axes = _axes(ctx, axes, x.ndim)
    for a in axes:
        if x.shape[a] != 1:
            raise ctx.shape_error(f"cannot squeeze dim {a} of shape {x.shape}: its extent is not 1")
    return [_reshape(ctx, x, [n for d, n in enumerate(x.shape) if d not in axes])]


def _unsqueeze(ctx: NodeContext, axes) -> list[Tensor]:
    x = ctx.input(0)
    rank = x.ndim + len(axes)
    axes = _axes(ctx, axes, rank)
    dims = iter(x.shape)
    return [_reshape(ctx, x, [1 if d in axes else next(dims) for d in range(rank)])]


@onnx_op("Squeeze", since=1, until=12)
def squeeze1(ctx):
    axes = ctx.attr("axes", None)
    return _squeeze(ctx, None if axes is None else list(axes))


@onnx_op("Squeeze", since=13)
def squeeze13(ctx):
    return _squeeze(ctx, _ints(ctx, ctx.const(1), "axes") if ctx.has_input(1) else None)


@onnx_op("Unsqueeze", since=1, until=12)
def unsqueeze1(ctx):
    return _unsqueeze(ctx, list(ctx.attr("axes")))


@onnx_op("Unsqueeze", since=13)
def unsqueeze13(ctx):
    return _unsqueeze(ctx, _ints(ctx, ctx.const(1), "axes"))


@onnx_op("Transpose")
def transpose(ctx):
    x = ctx.input(0)
    perm = ctx.attr("perm", None)
    perm = list(range(x.ndim))[::-1] if perm is None else [int(p) for p in perm]
    if sorted(perm) != list(range(x.ndim)):
        raise ctx.invalid(f"perm {perm} is not a permutation of the {x.ndim} dims")
    return [ctx.add(Transpose([x], name=ctx.name, perm=tuple(perm)))]


# slicing, splitting, joining -------------------------------------------------------------------
def _slice_node(ctx: NodeContext, starts, ends, axes, steps) -> list[Tensor]:
    x = ctx.input(0)
    if axes is None:
        axes = list(range(len(starts)))
    if steps is None:
        steps = [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ctx.invalid(f"starts {starts}, ends {ends}, axes {axes} and steps {steps} differ in length")
    axes = _axes(ctx, axes, x.ndim)
    return [_slice(ctx, x, {a: (s, e, st) for a, s, e, st in zip(axes, starts, ends, steps)})]


@onnx_op("Slice", since=1, until=9)
def slice1(ctx):
    axes = ctx.attr("axes", None)
    return _slice_node(ctx, list(ctx.attr("starts")), list(ctx.attr("ends")),
                       None if axes is None else list(axes), None)


@onnx_op("Slice", since=10)
def slice10(ctx):
    def opt(i, what):
        return _ints(ctx, ctx.const(i), what) if ctx.has_input(i) else None
    return _slice_node(ctx, _ints(ctx, ctx.const(1), "starts"), _ints(ctx, ctx.const(2), "ends"), opt(3, "axes"),
                       opt(4, "steps"))


def _split(ctx: NodeContext, sizes: list[int] | None, num_outputs: int | None = None) -> list[Tensor]:
    x = ctx.input(0)
    axis = _axis(ctx, ctx.attr("axis", 0), x.ndim)
    n, count = x.shape[axis], len(ctx.node.output)
    if sizes is None:
        parts = num_outputs or count
        if num_outputs is not None and num_outputs != count:
            raise ctx.invalid(f"num_outputs={num_outputs}, but the node has {count} outputs")
        if n % parts == 0:
            sizes = [n // parts] * parts
        elif num_outputs is None:
            raise ctx.shape_error(f"dim {axis} of extent {n} does not split evenly into {parts} outputs")
        else:
            chunk = -(-n // parts)
            sizes = [chunk] * (parts - 1) + [n - chunk * (parts - 1)]
            if sizes[-1] < 0:
                raise ctx.shape_error(f"dim {axis} of extent {n} cannot be split into {parts} chunks of {chunk}")
    if len(sizes) != count:
        raise ctx.invalid(f"split {sizes} has {len(sizes)} entries for {count} outputs")
    if any(s < 0 for s in sizes) or sum(sizes) != n:
        raise ctx.shape_error(f"split {sizes} does not add up to the extent {n} of dim {axis}")
    res, off = [], 0
    for k, s in enumerate(sizes):
        res.append(_slice(ctx, x, {axis: (off, off + s, 1)}, name=f"{ctx.name}:{k}"))
        off += s
    return res


@onnx_op("Split", since=1, until=1)
def split1(ctx):
    if ctx.has_input(1):
        return _split(ctx, _ints(ctx, ctx.const(1), "split"))
    split = ctx.attr("split", None)
    return _split(ctx, None if split is None else list(split))


@onnx_op("Split", since=2, until=12)
def split2(ctx):
    split = ctx.attr("split", None)
    return _split(ctx, None if split is None else list(split))


@onnx_op("Split", since=13, until=17)
def split13(ctx):
    return _split(ctx, _ints(ctx, ctx.const(1), "split") if ctx.has_input(1) else None)


@onnx_op("Split", since=18)
def split18(ctx):
    num = ctx.attr("num_outputs", None)
    if ctx.has_input(1):
        if num is not None:
            raise ctx.invalid("both the split input and the num_outputs attribute are given")
        return _split(ctx, _ints(ctx, ctx.const(1), "split"))
    if num is None:
        raise ctx.invalid("needs either the split input or the num_outputs attribute")
    if num < 1:
        raise ctx.invalid(f"num_outputs={num} must be positive")
    return _split(ctx, None, num_outputs=int(num))


@onnx_op("Concat")
def concat(ctx):
    xs = [t for t in ctx.inputs if t is not None]
    if not xs:
        raise ctx.invalid("needs at least one input")
    axis = _axis(ctx, ctx.attr("axis", 1) if ctx.opset < 4 else ctx.attr("axis"), xs[0].ndim)
    for t in xs:
        if t.dtype != xs[0].dtype:
            raise ctx.invalid(f"inputs have different dtypes ({xs[0].dtype}, {t.dtype})")
        if t.ndim != xs[0].ndim or any(a != b for d, (a, b) in enumerate(zip(t.shape, xs[0].shape)) if d != axis):
            raise ctx.shape_error(f"cannot concatenate shapes {[u.shape for u in xs]} along axis {axis}")
    return [ctx.add(Concat(xs, name=ctx.name, axis=axis))]


# padding, tiling, broadcasting -------------------------------------------------------------------
def _pad(ctx: NodeContext, x: Tensor, pads: list[int], mode: str, value, axes: list[int] | None = None) -> Tensor:
    """Pad by ONNX ``pads`` (all begins, then all ends, over ``axes``); ``value`` is the constant
    fill, or a one-element tensor known only at run time."""
    if mode not in PAD_MODES:
        raise ctx.invalid(f"mode must be one of {PAD_MODES}, got {mode!r}")
    axes = list(range(x.ndim)) if axes is None else _axes(ctx, axes, x.ndim)
    if len(pads) != 2 * len(axes):
        raise ctx.invalid(f"pads {pads} must have 2 entries per padded axis ({len(axes)} axes)")
    begin, end = [0] * x.ndim, [0] * x.ndim
    for k, a in enumerate(axes):
        begin[a], end[a] = pads[k], pads[k + len(axes)]
    for d, (n, b, e) in enumerate(zip(x.shape, begin, end)):
        kept = n - max(-b, 0) - max(-e, 0)
        if kept < 0 or n + b + e < 0:
            raise ctx.shape_error(f"pads {pads} crop more than the extent {n} of dim {d}")
        if mode != "constant" and kept == 0 and (b > 0 or e > 0):
            raise ctx.shape_error(f"{mode} padding of dim {d}, which is empty")
    if isinstance(value, Tensor):
        if value.size != 1 or value.dtype != x.dtype:
            raise ctx.invalid(f"constant_value must be one {x.dtype} element, got {value.dtype}{list(value.shape)}")
        return ctx.add(Pad([x, value], name=ctx.name, begin=tuple(begin), end=tuple(end), mode=mode))
    value = np.asarray(value).astype(x.dtype).item()
    return ctx.add(Pad([x], name=ctx.name, begin=tuple(begin), end=tuple(end), mode=mode, value=value))


@onnx_op("Pad", since=1, until=10)
def pad1(ctx):
    pads = ctx.attr("paddings" if ctx.opset < 2 else "pads")
    return [_pad(ctx, ctx.input(0), [int(p) for p in pads], ctx.attr("mode", "constant"), ctx.attr("value", 0.0))]


@onnx_op("Pad", since=11)
def pad11(ctx):
    x = ctx.input(0)
    value = 0
    if ctx.has_input(2):
        value = _scalar(ctx, 2, "constant_value") if ctx.is_const(2) else ctx.input(2)
    axes = _ints(ctx, ctx.const(3), "axes") if ctx.has_input(3) else None
    return [_pad(ctx, x, _ints(ctx, ctx.const(1), "pads"), ctx.attr("mode", "constant"), value, axes)]


def _tile(ctx: NodeContext, reps: list[int]) -> list[Tensor]:
    x = ctx.input(0)
    if len(reps) != x.ndim or any(r < 0 for r in reps):
        raise ctx.invalid(f"repeats {reps} must be {x.ndim} non-negative counts")
    return [ctx.add(Tile([x], name=ctx.name, repeats=tuple(reps)))]


@onnx_op("Tile", since=1, until=5)
def tile1(ctx):
    x = ctx.input(0)
    axis = _axis(ctx, int(_scalar(ctx, 2, "axis")), x.ndim)
    return _tile(ctx, [int(_scalar(ctx, 1, "tiles")) if d == axis else 1 for d in range(x.ndim)])


@onnx_op("Tile", since=6)
def tile6(ctx):
    return _tile(ctx, _ints(ctx, ctx.const(1), "repeats"))


@onnx_op("Expand", since=8)
def expand(ctx):
    x = ctx.input(0)
    shape = _ints(ctx, ctx.const(1), "shape")
    if any(d < 0 for d in shape):
        raise ctx.invalid(f"shape {shape} has a negative dim")
    return [ctx.add(Expand([x], name=ctx.name, shape=tuple(shape)))]


@onnx_op("CenterCropPad", since=18)
def center_crop_pad(ctx):
    x = ctx.input(0)
    shape = _ints(ctx, ctx.const(1), "shape")
    axes = _axes(ctx, ctx.attr("axes", list(range(x.ndim))), x.ndim)
    if len(shape) != len(axes) or any(s < 0 for s in shape):
        raise ctx.invalid(f"shape {shape} must give one non-negative extent per axis {axes}")
    begin, end = [0] * x.ndim, [0] * x.ndim
    for a, s in zip(axes, shape):
        diff = s - x.shape[a]
        # crop: drop floor(d/2) at the start; pad: add floor(d/2) at the start
        begin[a] = -((-diff) // 2) if diff < 0 else diff // 2
        end[a] = diff - begin[a]
    return [ctx.add(Pad([x], name=ctx.name, begin=tuple(begin), end=tuple(end), mode="constant", value=0))]


# gathers and scatters --------------------------------------------------------------------------
@onnx_op("Gather")
def gather(ctx):
    data = ctx.input(0)
    indices = _index_input(ctx, 1)
    axis = _axis(ctx, ctx.attr("axis", 0), data.ndim)
    if indices.value is not None:
        return [_gather_const(ctx, data, indices.value, axis)]
    return [ctx.add(Gather([data, indices], name=ctx.name, axis=axis))]


@onnx_op("GatherElements", since=11)
def gather_elements(ctx):
    data = ctx.input(0)
    indices = _index_input(ctx, 1)
    axis = _axis(ctx, ctx.attr("axis", 0), data.ndim)
    if indices.ndim != data.ndim or any(a > b for d, (a, b) in enumerate(zip(indices.shape, data.shape)) if d != axis):
        raise ctx.shape_error(f"indices of shape {indices.shape} do not fit data of shape {data.shape} on axis {axis}")
    if indices.value is not None:
        idx = _const_indices(ctx, indices.value, data.shape[axis])
        maps = [(0, idx) if d == axis else ("axis", d) for d in range(data.ndim)]
        res = _affine_gather(ctx, data, idx.shape, maps)
        if res is not None:
            return [res]
    return [ctx.add(GatherElements([data, indices], name=ctx.name, axis=axis))]


@onnx_op("GatherND", since=11)
def gather_nd(ctx):
    data = ctx.input(0)
    indices = _index_input(ctx, 1)
    b = ctx.attr("batch_dims", 0)
    if indices.ndim < 1 or not 0 <= b < min(data.ndim, indices.ndim):
        raise ctx.invalid(f"batch_dims={b} is out of range for data rank {data.ndim}, indices rank {indices.ndim}")
    if indices.shape[-1] > data.ndim - b or indices.shape[:b] != data.shape[:b]:
        raise ctx.shape_error(f"indices of shape {indices.shape} do not fit data of shape {data.shape} "
                              f"with batch_dims={b}")
    if indices.value is not None:
        q, k = indices.ndim, indices.shape[-1]
        idx = [_const_indices(ctx, indices.value[..., t], data.shape[b + t]) for t in range(k)]
        maps = ([("axis", d) for d in range(b)] + [(0, v) for v in idx]
                + [("axis", q - 1 + j) for j in range(data.ndim - b - k)])
        res = _affine_gather(ctx, data, indices.shape[:-1] + data.shape[b + k:], maps)
        if res is not None:
            return [res]
    return [ctx.add(GatherND([data, indices], name=ctx.name, batch_dims=b))]


def _reduction(ctx: NodeContext) -> str:
    red = ctx.attr("reduction", "none")
    allowed = ("none",) + (("add", "mul") if ctx.opset >= 16 else ()) + (("max", "min") if ctx.opset >= 18 else ())
    if red not in allowed:
        raise ctx.invalid(f"reduction must be one of {allowed} at opset {ctx.opset}, got {red!r}")
    return red


def _scatter_elements(ctx: NodeContext, reduction: str) -> list[Tensor]:
    data, indices, updates = ctx.input(0), _index_input(ctx, 1), ctx.input(2)
    axis = _axis(ctx, ctx.attr("axis", 0), data.ndim)
    if updates.dtype != data.dtype:
        raise ctx.invalid(f"updates have dtype {updates.dtype}, data {data.dtype}")
    if indices.shape != updates.shape or indices.ndim != data.ndim or any(
            a > b for d, (a, b) in enumerate(zip(indices.shape, data.shape)) if d != axis):
        raise ctx.shape_error(f"indices {indices.shape} and updates {updates.shape} do not fit data {data.shape}")
    return [ctx.add(ScatterElements([data, indices, updates], name=ctx.name, axis=axis, reduction=reduction))]


@onnx_op("Scatter", since=9)
def scatter(ctx):
    return _scatter_elements(ctx, "none")


@onnx_op("ScatterElements", since=11)
def scatter_elements(ctx):
    return _scatter_elements(ctx, _reduction(ctx))


@onnx_op("ScatterND", since=11)
def scatter_nd(ctx):
    data, indices, updates = ctx.input(0), _index_input(ctx, 1), ctx.input(2)
    red = _reduction(ctx)
    if updates.dtype != data.dtype:
        raise ctx.invalid(f"updates have dtype {updates.dtype}, data {data.dtype}")
    if indices.ndim < 1 or indices.shape[-1] > data.ndim or \
            updates.shape != indices.shape[:-1] + data.shape[indices.shape[-1]:]:
        raise ctx.shape_error(f"indices {indices.shape} and updates {updates.shape} do not fit data {data.shape}")
    return [ctx.add(ScatterND([data, indices, updates], name=ctx.name, reduction=red))]


# shape queries, constants and generators --------------------------------------------------------------
@onnx_op("Shape")
def shape(ctx):
    x = ctx.input(0)
    r = x.ndim
    start, end = ctx.attr("start", 0), ctx.attr("end", r)
    start = min(max(start + r if start < 0 else start, 0), r)
    end = min(max(end + r if end < 0 else end, 0), r)
    y = ctx.add(ShapeOf([x], name=ctx.name, start=start, end=max(start, end)))
    y.value = np.array(x.shape[start:end], dtype=np.int64)  # known from the static shape
    return [y]


@onnx_op("Size")
def size(ctx):
    x = ctx.input(0)
    y = ctx.add(SizeOf([x], name=ctx.name))
    y.value = np.array(x.size, dtype=np.int64)
    return [y]


@onnx_op("Constant")
def constant(ctx):
    given = [a.name for a in ctx.node.attribute]
    if len(given) != 1:
        raise ctx.invalid(f"needs exactly one value attribute, got {given}")
    name = given[0]
    if name == "value":
        return [ctx.constant(ctx.attr("value"))]
    if name in ("value_float", "value_floats"):
        return [ctx.constant(np.asarray(ctx.attr(name), np.float32))]
    if name in ("value_int", "value_ints"):
        return [ctx.constant(np.asarray(ctx.attr(name), np.int64))]
    if name in ("sparse_value", "value_string", "value_strings"):
        raise ctx.unsupported(f"attribute {name!r} (sparse or string constants)")
    raise ctx.invalid(f"unknown value attribute {name!r}")


@onnx_op("ConstantOfShape", since=9)
def constant_of_shape(ctx):
    shape = _ints(ctx, ctx.const(0), "shape")
    if any(d < 0 for d in shape):
        raise ctx.invalid(f"shape {shape} has a negative dim")
    value = ctx.attr("value", None)
    if value is None:
        value = np.zeros((1,), np.float32)
    if value.size != 1:
        raise ctx.invalid(f"value must hold one element, got shape {value.shape}")
    return [ctx.add(Full([], name=ctx.name, shape=tuple(shape), value=value.ravel()[0].item(),
                         dtype=str(value.dtype)))]


@onnx_op("Range", since=11)
def range_(ctx):
    start, limit, delta = (_scalar(ctx, k, w) for k, w in enumerate(("start", "limit", "delta")))
    dt = str(start.dtype)
    if limit.dtype != start.dtype or delta.dtype != start.dtype:
        raise ctx.invalid(f"start, limit and delta have different dtypes ({start.dtype}, {limit.dtype}, "
                          f"{delta.dtype})")
    if delta == 0:
        raise ctx.invalid("delta must not be 0")
    if start.dtype.kind in "iu":
        s, lim, d = int(start), int(limit), int(delta)
        n = max(-((s - lim) // d), 0)                           # ceil((limit - start) / delta)
    else:
        s, lim, d = float(start), float(limit), float(delta)
        n = max(math.ceil((lim - s) / d), 0)
    return [ctx.add(Range([], name=ctx.name, start=s, delta=d, size=int(n), dtype=dt))]


@onnx_op("EyeLike", since=9)
def eye_like(ctx):
    x = ctx.input(0)
    if x.ndim != 2:
        raise ctx.invalid(f"input must be 2-D, got shape {x.shape}")
    dt = onnx_dtype(ctx.attr("dtype"), f"node {ctx.name} attribute 'dtype'") if ctx.has_attr("dtype") else x.dtype
    return [ctx.add(Eye([], name=ctx.name, shape=x.shape, k=int(ctx.attr("k", 0)), dtype=dt))]


@onnx_op("Trilu", since=14)
def trilu(ctx):
    x = ctx.input(0)
    if x.ndim < 2:
        raise ctx.invalid(f"input must have rank >= 2, got shape {x.shape}")
    upper = ctx.flag("upper", 1)
    if ctx.has_input(1) and not ctx.is_const(1):     # a diagonal known only at run time
        k = ctx.input(1)
        if k.size != 1 or k.dtype != "int64":
            raise ctx.invalid(f"k must be one int64 element, got {k.dtype}{list(k.shape)}")
        return [ctx.add(Trilu([x, k], name=ctx.name, upper=upper))]
    k = int(_scalar(ctx, 1, "k")) if ctx.has_input(1) else 0
    return [ctx.add(Trilu([x], name=ctx.name, k=k, upper=upper))]


@onnx_op("OneHot", since=9)
def one_hot(ctx):
    indices, values = ctx.input(0), ctx.input(2)
    depth = _scalar(ctx, 1, "depth")
    depth = int(depth)
    if depth < 1:
        raise ctx.invalid(f"depth must be positive, got {depth}")
    if values.shape != (2,):
        raise ctx.invalid(f"values must be [off_value, on_value], got shape {values.shape}")
    axis = ctx.attr("axis", -1)
    r = indices.ndim
    if not -r - 1 <= axis <= r:
        raise ctx.invalid(f"axis {axis} is out of range for rank {r + 1}")
    axis = axis + r + 1 if axis < 0 else axis
    return [ctx.add(OneHot([indices, values], name=ctx.name, axis=axis, depth=depth))]


def _block_op(ctx: NodeContext, cls, mode: str) -> list[Tensor]:
    x = ctx.input(0)
    bs = ctx.attr("blocksize")
    if mode not in ("DCR", "CRD"):
        raise ctx.invalid(f"mode must be DCR or CRD, got {mode!r}")
    if x.ndim != 4 or bs < 1:
        raise ctx.invalid(f"needs a 4-D NCHW input and a positive blocksize, got shape {x.shape}, blocksize {bs}")
    if cls is DepthToSpace and x.shape[1] % (bs * bs):
        raise ctx.shape_error(f"channels {x.shape[1]} are not divisible by blocksize² = {bs * bs}")
    if cls is SpaceToDepth and (x.shape[2] % bs or x.shape[3] % bs):
        raise ctx.shape_error(f"spatial dims {x.shape[2:]} are not divisible by blocksize {bs}")
    return [ctx.add(cls([x], name=ctx.name, blocksize=int(bs), mode=mode))]


@onnx_op("DepthToSpace")
def depth_to_space(ctx):
    return _block_op(ctx, DepthToSpace, ctx.attr("mode", "DCR") if ctx.opset >= 11 else "DCR")


@onnx_op("SpaceToDepth")
def space_to_depth(ctx):
    return _block_op(ctx, SpaceToDepth, ctx.attr("mode", "DCR") if ctx.opset >= 28 else "DCR")


@onnx_op("ReverseSequence", since=10)
def reverse_sequence(ctx):
    x, lens = ctx.input(0), ctx.input(1)
    ba, ta = ctx.attr("batch_axis", 1), ctx.attr("time_axis", 0)
    if {ba, ta} != {0, 1} or x.ndim < 2:
        raise ctx.invalid(f"batch_axis={ba} and time_axis={ta} must be 0 and 1 (in some order) on a rank >= 2 input")
    if lens.shape != (x.shape[ba],) or lens.dtype != "int64":
        raise ctx.invalid(f"sequence_lens must be int64 of shape ({x.shape[ba]},), got {lens.dtype}{list(lens.shape)}")
    if lens.value is not None and (lens.value.min(initial=0) < 0 or lens.value.max(initial=0) > x.shape[ta]):
        raise ctx.shape_error(f"sequence_lens {lens.value.tolist()} leave the range [0, {x.shape[ta]}]")
    return [ctx.add(ReverseSequence([x, lens], name=ctx.name, time_axis=ta, batch_axis=ba))]


# ops whose output shape depends on values: constants only ---------------------------------------------
@onnx_op("NonZero", since=9)
def non_zero(ctx):
    x = np.asarray(ctx.const(0))
    if x.ndim == 0:
        raise ctx.unsupported("NonZero of a scalar")
    return [ctx.constant(np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1))]


@onnx_op("Compress", since=9)
def compress(ctx):
    x = ctx.input(0)
    cond = np.asarray(ctx.const(1))
    if cond.ndim != 1:
        raise ctx.invalid(f"condition must be 1-D, got shape {cond.shape}")
    picked = np.nonzero(cond.astype(bool))[0]
    if ctx.has_attr("axis"):
        axis = _axis(ctx, ctx.attr("axis"), x.ndim)
    else:
        axis = 0
        x = _reshape(ctx, x, (x.size,), name=f"{ctx.name}/flatten")
    if picked.size and picked[-1] >= x.shape[axis]:
        raise ctx.shape_error(f"condition selects index {picked[-1]} beyond the extent {x.shape[axis]}")
    return [_gather_const(ctx, x, picked, axis)]


@onnx_op("Unique", since=11)
def unique(ctx):
    x = np.asarray(ctx.const(0))
    axis = ctx.attr("axis", None)
    if axis is not None:
        axis = _axis(ctx, axis, x.ndim)
    y, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True, axis=axis)
    if not ctx.flag("sorted", 1):
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        first, counts, inverse = first[order], counts[order], rank[inverse.reshape(-1)]
        y = np.take(x.reshape(-1) if axis is None else x, first, axis=0 if axis is None else axis)
    outs = [y, first, inverse.reshape(-1), counts]
    return [ctx.constant(np.asarray(v, dtype=None if k == 0 else np.int64)) for k, v in enumerate(outs)]


def _iou_above(a: np.ndarray, b: np.ndarray, center: bool, threshold) -> bool:
    """Whether boxes ``a`` and ``b`` overlap by more than ``threshold`` (intersection over union),
    in the boxes' type and in the ONNX reference's order of operations; corner boxes may give their
    corners in either order. No overlap, or an empty box, is never above."""
    if center:
        ax0, ax1, ay0, ay1 = a[0] - a[2] / 2, a[0] + a[2] / 2, a[1] - a[3] / 2, a[1] + a[3] / 2
        bx0, bx1, by0, by1 = b[0] - b[2] / 2, b[0] + b[2] / 2, b[1] - b[3] / 2, b[1] + b[3] / 2
    else:
        (ax0, ax1), (bx0, bx1) = sorted((a[1], a[3])), sorted((b[1], b[3]))
        (ay0, ay1), (by0, by1) = sorted((a[0], a[2])), sorted((b[0], b[2]))
    ix0, ix1 = max(ax0, bx0), min(ax1, bx1)
    iy0, iy1 = max(ay0, by0), min(ay1, by1)
    if ix1 <= ix0 or iy1 <= iy0:
        return False
    inter = (ix1 - ix0) * (iy1 - iy0)
    area_a, area_b = (ax1 - ax0) * (ay1 - ay0), (bx1 - bx0) * (by1 - by0)
    union = area_a + area_b - inter
    if inter <= 0 or area_a <= 0 or area_b <= 0 or union <= 0:
        return False
    return inter / union > threshold


@onnx_op("NonMaxSuppression", since=10)
def non_max_suppression(ctx):
    """``NonMaxSuppression`` (its output's length depends on the values: constants only, like
    NonZero): per batch and class, the boxes scoring above ``score_threshold`` (when given) by
    descending score (ties: lower index first), each kept unless it overlaps a kept one by more
    than ``iou_threshold``, at most ``max_output_boxes_per_class`` of them; rows ``[batch, class,
    box]``."""
    boxes, scores = np.asarray(ctx.const(0)), np.asarray(ctx.const(1))
    if boxes.ndim != 3 or boxes.shape[2] != 4 or scores.ndim != 3 or scores.shape[0] != boxes.shape[0] \
            or scores.shape[2] != boxes.shape[1]:
        raise ctx.shape_error(f"boxes [B, N, 4] and scores [B, C, N] expected, got {list(boxes.shape)} and "
                              f"{list(scores.shape)}")
    center = int(ctx.flag("center_point_box", 0))
    if center not in (0, 1):
        raise ctx.invalid(f"center_point_box must be 0 or 1, got {center}")
    limit = np.asarray(ctx.const(2, np.zeros(0, np.int64))).reshape(-1)
    iou = np.asarray(ctx.const(3, np.zeros(0, np.float32))).reshape(-1)
    floor = np.asarray(ctx.const(4, np.zeros(0, np.float32))).reshape(-1)
    limit = max(int(limit[0]), 0) if limit.size else 0
    iou = iou[0] if iou.size else boxes.dtype.type(0)
    picked = []
    for b in range(boxes.shape[0]):
        for c in range(scores.shape[1]):
            s = scores[b, c]
            order = [i for i in np.argsort(-s, kind="stable") if not floor.size or s[i] > floor[0]]
            kept: list[int] = []
            for i in order:
                if len(kept) >= limit:
                    break
                if not any(_iou_above(boxes[b, i], boxes[b, j], bool(center), iou) for j in kept):
                    kept.append(int(i))
                    picked.append((b, c, int(i)))
    return [ctx.constant(np.array(picked, np.int64).reshape(-1, 3))]
