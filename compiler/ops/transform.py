"""Data-movement and shape operators: reshape, transpose, slice, concat, pad, tile, expand, the
gather/scatter family, shape queries and small generators (full, range, eye).

Index expressions are kept affine wherever the data movement allows it, because the sharding
planner splits a dim only where it is read as a plain (or affinely scaled) axis variable:

* :class:`Reshape` groups input and output dims into the smallest blocks with equal products, so
  ``(B, S, 768) -> (B, S, 12, 64)`` reads ``x[b, s, h*64 + d]`` and the reverse reads
  ``x[b, s, c // 64, c % 64]``; only a block that mixes several dims on both sides goes through a
  linear index.
* Padding, tiling and reflection use ``//``/``%``/selects only on the dims they touch.
* Gathers and scatters read data-dependent positions (``x[..., indices[j], ...]``) along their
  indexed axis only.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import ShapeError
from ..ir.expr import (Cast, Const, Expr, as_expr, dtype_kind, eq, if_then_else, infer_dtype, logical_and,
                       logical_or, maximum, minimum, numpy_type)
from ..ir.graph import Operator
from ..ir.task import compute, reduce
from .elementwise import Identity, broadcast_read, broadcast_shape

__all__ = [
    "reshape_indices", "normalize_slice", "fit_affine", "Reshape", "Transpose", "Slice", "Concat", "Pad", "Tile",
    "Expand", "AffineGather", "Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND", "IndexCheck",
    "ValuesInRange", "ShapeOf", "SizeOf", "Full", "Range", "Eye", "Trilu", "OneHot", "DepthToSpace", "SpaceToDepth",
    "ReverseSequence",
    "PAD_MODES", "SCATTER_REDUCTIONS",
]

PAD_MODES = ("constant", "reflect", "edge", "wrap")
SCATTER_REDUCTIONS = ("none", "add", "mul", "max", "min")


# index helpers ---------------------------------------------------------------------------
def _linear(axes: Sequence[Expr], extents: Sequence[int]) -> Expr:
    """Row-major linear position of ``axes`` within a block of ``extents``."""
    res: Expr | None = None
    stride = 1
    for ax, ext in zip(reversed(axes), reversed(extents)):
        term = ax if stride == 1 else ax * stride
        res = term if res is None else term + res
        stride *= ext
    return res if res is not None else as_expr(0)


def _unravel(lin: Expr, extents: Sequence[int]) -> list[Expr]:
    """Indices of the row-major position ``lin`` (which stays below ``prod(extents)``, so the
    first index needs no ``%``) in ``extents``."""
    strides = [int(np.prod(extents[k + 1:], dtype=np.int64)) for k in range(len(extents))]
    res = []
    for k, (ext, st) in enumerate(zip(extents, strides)):
        e = lin if st == 1 else lin // st
        res.append(e if k == 0 else e % ext)
    return res


def reshape_indices(in_shape: Sequence[int], out_shape: Sequence[int], axes: Sequence[Expr]) -> tuple[Expr, ...]:
    """Input indices of a row-major reshape from ``in_shape`` to ``out_shape`` at output ``axes``.

    Dims of extent 1 are read at 0 and otherwise ignored; the remaining dims are grouped into the
    smallest blocks with equal products. A block with one input dim reads it affinely
    (``h*64 + d``); a block with one output dim unravels that axis (``c // 64, c % 64``); a block
    mixing several dims on both sides goes through the linear position.
    """
    idx: list[Expr] = [as_expr(0)] * len(in_shape)
    if int(np.prod(in_shape, dtype=np.int64)) == 0:
        return tuple(idx)
    ins = [d for d, e in enumerate(in_shape) if e != 1]
    outs = [d for d, e in enumerate(out_shape) if e != 1]
    i = j = 0
    while i < len(ins):
        bi, bo = [ins[i]], [outs[j]]
        pi, po = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while pi != po:
            if pi < po:
                bi.append(ins[i])
                pi *= in_shape[ins[i]]
                i += 1
            else:
                bo.append(outs[j])
                po *= out_shape[outs[j]]
                j += 1
        lin = _linear([axes[d] for d in bo], [out_shape[d] for d in bo])   # one axis var when len(bo) == 1
        for d, e in zip(bi, _unravel(lin, [in_shape[d] for d in bi])):  # lin itself when len(bi) == 1
            idx[d] = e
    return tuple(idx)


def _affine(ax: Expr, scale: int, offset: int) -> Expr:
    """``ax * scale + offset`` without the trivial factors."""
    e = ax if scale == 1 else ax * scale
    return e + offset if offset else e


def _int64(v: Expr) -> Expr:
    """``v`` as int64 (a cast only when it is not int64 already)."""
    return v if infer_dtype(v) == "int64" else Cast(v, "int64")


def _wrap_index(v: Expr, extent: int) -> Expr:
    """An index read from a tensor as int64, with negative values counted from the end."""
    v = _int64(v)
    return if_then_else(v < 0, v + extent, v)


def _np_wrap(indices: np.ndarray, extent: int, where: str) -> np.ndarray:
    """Numpy counterpart of :func:`_wrap_index`, rejecting indices outside ``[-extent, extent)``."""
    idx = np.asarray(indices).astype(np.int64)
    if idx.size and (idx.min() < -extent or idx.max() >= extent):
        bad = idx[(idx < -extent) | (idx >= extent)].ravel()[0]
        raise ShapeError(f"{where}: index {bad} is out of range for an axis of size {extent}")
    return np.where(idx < 0, idx + extent, idx)


def _indices_of_axis(extent: int) -> dict[int, tuple[int, int]]:
    """:meth:`~shardflow.compiler.ir.graph.Operator.index_ranges` of an op whose input 1 indexes an axis
    of ``extent`` (negative indices counting from the end)."""
    return {1: (-extent, extent - 1)}


def _indices_of_axes(extents: Sequence[int]) -> dict[int, tuple]:
    """:meth:`~shardflow.compiler.ir.graph.Operator.index_ranges` of an op whose input 1's last dim
    addresses the axes of ``extents`` (GatherND, ScatterND): one range when they are equal, else a
    tuple of bounds per column."""
    if len(set(extents)) <= 1:
        return _indices_of_axis(extents[0]) if extents else {}
    return {1: (tuple(-n for n in extents), tuple(n - 1 for n in extents))}


def _const(value, dtype: str) -> Const:
    """A typed constant holding ``value`` converted to ``dtype``."""
    return Const(np.asarray(value).astype(dtype).item(), dtype)


def _table(values: Sequence[int], i: Expr, dtype: str) -> Expr:
    """``values[i]`` for a constant table, as a chain of selects."""
    if not values:
        return _const(0, dtype)
    res: Expr = _const(values[-1], dtype)
    for k in range(len(values) - 2, -1, -1):
        res = if_then_else(eq(i, k), _const(values[k], dtype), res)
    return res


def _all(conds: Sequence[Expr]) -> Expr | None:
    res = None
    for c in conds:
        res = c if res is None else logical_and(res, c)
    return res


def _reduction_identity(op: str, dtype: str) -> Const:
    k = dtype_kind(dtype)
    if op == "add":
        return _const(0, dtype)
    if op == "mul":
        return _const(1, dtype)
    if k == "b":
        return _const(op == "min", dtype)
    if k in "iu":
        info = np.iinfo(dtype)
        return _const(info.min if op == "max" else info.max, dtype)
    return _const(-np.inf if op == "max" else np.inf, dtype)


def _combine(op: str, a: Expr, b: Expr) -> Expr:
    if op == "add":
        return a + b
    if op == "mul":
        return a * b
    return maximum(a, b) if op == "max" else minimum(a, b)


_NP_AT = {"add": np.add.at, "mul": np.multiply.at, "max": np.maximum.at, "min": np.minimum.at}


# reshaping and permuting ----------------------------------------------------------------------
class Reshape(Operator):
    """Row-major reshape to the static ``shape`` (also Flatten, Squeeze and Unsqueeze)."""

    injective = True

    def compute(self, x):
        shape = tuple(self.attrs["shape"])
        if int(np.prod(shape, dtype=np.int64)) != int(np.prod(x.shape, dtype=np.int64)):
            raise ShapeError(f"{self.name}: cannot reshape {x.shape} to {shape}")
        return compute("y", shape, lambda *i: x[reshape_indices(x.shape, shape, i)], dtype=x.dtype)

    def numpy(self, x):
        return [x.reshape(self.attrs["shape"])]

    def passthrough_input(self):
        return 0 if tuple(self.attrs["shape"]) == self.inputs[0].shape else None


class Transpose(Operator):
    """``y = x.transpose(perm)``: output dim ``d`` is input dim ``perm[d]``."""

    injective = True

    def compute(self, x):
        perm = tuple(self.attrs["perm"])
        if sorted(perm) != list(range(x.ndim)):
            raise ShapeError(f"{self.name}: perm {perm} is not a permutation of {x.ndim} dims")

        def f(*i):
            idx = [None] * x.ndim
            for d, p in enumerate(perm):
                idx[p] = i[d]
            return x[tuple(idx)]
        return compute("y", tuple(x.shape[p] for p in perm), f, dtype=x.dtype)

    def numpy(self, x):
        return [np.transpose(x, self.attrs["perm"])]

    def passthrough_input(self):
        return 0 if tuple(self.attrs["perm"]) == tuple(range(len(self.attrs["perm"]))) else None


def normalize_slice(start: int, end: int, step: int, extent: int) -> tuple[int, int]:
    """ONNX/Python slice semantics on one axis: the clamped first index and the element count."""
    first, stop, step = slice(int(start), int(end), int(step)).indices(int(extent))
    return first, len(range(first, stop, step))


class Slice(Operator):
    """``y[i] = x[starts + i * steps]`` with per-dim ``starts``, ``steps`` and output ``sizes``
    (already normalized: see :func:`normalize_slice`)."""

    injective = True

    def compute(self, x):
        starts, steps, sizes = self.attrs["starts"], self.attrs["steps"], self.attrs["sizes"]
        for d, n in enumerate(x.shape):
            if sizes[d] and not (0 <= starts[d] < n and 0 <= starts[d] + steps[d] * (sizes[d] - 1) < n):
                raise ShapeError(f"{self.name}: slice of dim {d} leaves the input's extent {x.shape[d]}")

        def f(*i):
            return x[tuple(_affine(ax, st, s) for ax, s, st in zip(i, starts, steps))]
        return compute("y", tuple(sizes), f, dtype=x.dtype)

    def numpy(self, x):
        sl = []
        for s, st, n in zip(self.attrs["starts"], self.attrs["steps"], self.attrs["sizes"]):
            stop = s + st * n
            sl.append(slice(s, stop if stop >= 0 else None, st) if n else slice(0, 0))
        return [x[tuple(sl)]]

    def passthrough_input(self):
        x = self.inputs[0]
        full = all(s == 0 and st == 1 for s, st in zip(self.attrs["starts"], self.attrs["steps"]))
        return 0 if full and tuple(self.attrs["sizes"]) == x.shape else None


class Concat(Operator):
    """Concatenation of the inputs along ``axis`` (non-negative)."""

    injective = True

    def compute(self, *xs):
        axis = self.attrs["axis"]
        first = xs[0]
        for x in xs[1:]:
            if x.ndim != first.ndim or any(a != b for d, (a, b) in enumerate(zip(x.shape, first.shape)) if d != axis):
                raise ShapeError(f"{self.name}: cannot concatenate shapes {[t.shape for t in xs]} on axis {axis}")
        parts = [(x, sum(t.shape[axis] for t in xs[:k])) for k, x in enumerate(xs) if x.shape[axis]]
        shape = first.shape[:axis] + (sum(x.shape[axis] for x in xs),) + first.shape[axis + 1:]

        def read(x, off, i):
            return x[i[:axis] + ((i[axis] - off) if off else i[axis],) + i[axis + 1:]]

        def pick(i, lo, hi):  # a balanced tree of tests on i[axis]: the depth grows with log(parts)
            if hi - lo == 1:
                return read(*parts[lo], i)
            mid = (lo + hi) // 2
            return if_then_else(i[axis] < parts[mid][1], pick(i, lo, mid), pick(i, mid, hi))

        def f(*i):
            return pick(i, 0, len(parts)) if parts else xs[0][i]
        return compute("y", shape, f, dtype=first.dtype)

    def numpy(self, *xs):
        return [np.concatenate(xs, axis=self.attrs["axis"])]

    def passthrough_input(self):
        # one input, or one that is not empty along the axis (Phi-3's rotary embedding concatenates
        # the rotated half with an empty pass-through slice when it rotates every dim)
        full = [k for k, t in enumerate(self.inputs) if t.shape[self.attrs["axis"]]]
        if len(full) == 1 and self.inputs[full[0]].shape == self.outputs[0].shape:
            return full[0]
        return 0 if len(self.inputs) == 1 else None


class Pad(Operator):
    """Padding by ``begin``/``end`` per dim (negative values crop) with ``mode`` in
    :data:`PAD_MODES` and the fill ``value`` of constant mode.

    Cropping applies first, then padding (the numpy ``np.pad`` meaning of each mode on the
    cropped extent). The fill is the attribute ``value``, or the one element of an optional second
    input (a fill only known at run time).
    """

    injective = True

    def compute(self, x, *fill_input):
        begin, end, mode = self.attrs["begin"], self.attrs["end"], self.attrs["mode"]
        if mode not in PAD_MODES:
            raise ShapeError(f"{self.name}: unknown pad mode {mode!r}")
        shape = tuple(n + b + e for n, b, e in zip(x.shape, begin, end))
        if any(d < 0 for d in shape):
            raise ShapeError(f"{self.name}: pads {begin}/{end} crop more than the shape {x.shape}")
        if fill_input:
            (v,) = fill_input
            fill = v[(0,) * v.ndim]
        else:
            fill = _const(self.attrs.get("value", 0), x.dtype)

        def f(*i):
            idx, inside = [], []
            for ax, n, b, e in zip(i, x.shape, begin, end):
                crop, pad = max(-b, 0), max(b, 0)
                m = n - crop - max(-e, 0)             # extent after cropping
                j = ax - pad if pad else ax           # position within the cropped range
                if b > 0 or e > 0:
                    if mode == "constant":
                        if b > 0:
                            inside.append(j >= 0)
                        if e > 0:
                            inside.append(j < m)
                    elif mode == "edge":
                        j = minimum(maximum(j, 0), m - 1)
                    elif mode == "wrap":
                        j = j % m
                    elif m == 1:                       # reflect on a single element
                        j = as_expr(0)
                    else:
                        r = j % (2 * m - 2)
                        j = minimum(r, (2 * m - 2) - r)
                idx.append(j + crop if crop else j)
            v = x[tuple(idx)]
            cond = _all(inside)
            return v if cond is None else if_then_else(cond, v, fill)
        return compute("y", shape, f, dtype=x.dtype)

    def numpy(self, x, *fill_input):
        begin, end, mode = self.attrs["begin"], self.attrs["end"], self.attrs["mode"]
        fill = np.asarray(fill_input[0] if fill_input else self.attrs.get("value", 0)).ravel()[0]
        x = x[tuple(slice(max(-b, 0), n - max(-e, 0)) for n, b, e in zip(x.shape, begin, end))]
        width = [(max(b, 0), max(e, 0)) for b, e in zip(begin, end)]
        if mode == "constant":
            return [np.pad(x, width, mode="constant", constant_values=np.asarray(fill).astype(x.dtype))]
        return [np.pad(x, width, mode=mode)]

    def passthrough_input(self):
        return 0 if not any(self.attrs["begin"]) and not any(self.attrs["end"]) else None


class Tile(Operator):
    """``np.tile(x, repeats)`` with one repeat count per dim."""

    injective = True

    def compute(self, x):
        reps = self.attrs["repeats"]

        def f(*i):
            return x[tuple(ax if r == 1 else (as_expr(0) if n == 1 else ax % n)
                           for ax, n, r in zip(i, x.shape, reps))]
        return compute("y", tuple(n * r for n, r in zip(x.shape, reps)), f, dtype=x.dtype)

    def numpy(self, x):
        return [np.tile(x, self.attrs["repeats"])]

    def passthrough_input(self):
        return 0 if all(r == 1 for r in self.attrs["repeats"]) else None


class Expand(Operator):
    """Broadcast ``x`` against ``shape`` (numpy rules in both directions, as ONNX Expand)."""

    injective = True

    def compute(self, x):
        shape = broadcast_shape([x.shape, tuple(self.attrs["shape"])], self.name)
        return compute("y", shape, lambda *i: broadcast_read(x, shape, i), dtype=x.dtype)

    def numpy(self, x):
        return [np.broadcast_to(x, self.outputs[0].shape)]

    def passthrough_input(self):
        return 0 if self.outputs[0].shape == self.inputs[0].shape else None


class DepthToSpace(Operator):
    """Move ``blocksize``² channel blocks of an NCHW tensor into space (``mode`` DCR or CRD)."""

    injective = True

    def compute(self, x):
        bs, mode = self.attrs["blocksize"], self.attrs["mode"]
        n, c, h, w = x.shape
        if c % (bs * bs):
            raise ShapeError(f"{self.name}: channels {c} are not divisible by blocksize² = {bs * bs}")
        co = c // (bs * bs)

        def f(b, ch, y, z):
            r, s = y % bs, z % bs
            cin = r * (bs * co) + s * co + ch if mode == "DCR" else ch * (bs * bs) + r * bs + s
            return x[b, cin, y // bs, z // bs]
        return compute("y", (n, co, h * bs, w * bs), f, dtype=x.dtype)

    def numpy(self, x):
        bs, mode = self.attrs["blocksize"], self.attrs["mode"]
        n, c, h, w = x.shape
        if mode == "DCR":
            t = x.reshape(n, bs, bs, c // (bs * bs), h, w).transpose(0, 3, 4, 1, 5, 2)
        else:
            t = x.reshape(n, c // (bs * bs), bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
        return [t.reshape(n, c // (bs * bs), h * bs, w * bs)]


class SpaceToDepth(Operator):
    """Move ``blocksize``² spatial blocks of an NCHW tensor into channels (``mode`` DCR or CRD)."""

    injective = True

    def compute(self, x):
        bs, mode = self.attrs["blocksize"], self.attrs["mode"]
        n, c, h, w = x.shape
        if h % bs or w % bs:
            raise ShapeError(f"{self.name}: spatial dims {(h, w)} are not divisible by blocksize {bs}")

        def f(b, ch, y, z):
            if mode == "DCR":       # ch = (r * bs + s) * c + cin
                cin, r, s = ch % c, ch // (c * bs), (ch // c) % bs
            else:                   # ch = cin * bs² + r * bs + s
                cin, r, s = ch // (bs * bs), (ch // bs) % bs, ch % bs
            return x[b, cin, y * bs + r, z * bs + s]
        return compute("y", (n, c * bs * bs, h // bs, w // bs), f, dtype=x.dtype)

    def numpy(self, x):
        bs, mode = self.attrs["blocksize"], self.attrs["mode"]
        n, c, h, w = x.shape
        t = x.reshape(n, c, h // bs, bs, w // bs, bs)
        t = t.transpose(0, 3, 5, 1, 2, 4) if mode == "DCR" else t.transpose(0, 1, 3, 5, 2, 4)
        return [t.reshape(n, c * bs * bs, h // bs, w // bs)]


class ReverseSequence(Operator):
    """Reverse the first ``lens[b]`` steps along ``time_axis`` of every batch entry ``b``
    (``batch_axis``); inputs ``x`` and the integer ``lens``."""

    def compute(self, x, lens):
        ta, ba = self.attrs["time_axis"], self.attrs["batch_axis"]

        def f(*i):
            n = _int64(lens[i[ba]])
            t = i[ta]
            return x[i[:ta] + (if_then_else(t < n, n - 1 - t, t),) + i[ta + 1:]]
        return compute("y", x.shape, f, dtype=x.dtype)

    def index_ranges(self):
        return {1: (0, self.inputs[0].shape[self.attrs["time_axis"]])}

    def numpy(self, x, lens):
        ta, ba = self.attrs["time_axis"], self.attrs["batch_axis"]
        lens = np.asarray(lens, np.int64)
        if lens.size and (lens.min() < 0 or lens.max() > x.shape[ta]):
            raise ShapeError(f"{self.name}: sequence_lens {lens.tolist()} leave the range [0, {x.shape[ta]}] of the "
                             "time axis")
        t = np.arange(x.shape[ta]).reshape([-1 if d == ta else 1 for d in range(x.ndim)])
        n = lens.reshape([-1 if d == ba else 1 for d in range(x.ndim)])
        src = np.broadcast_to(np.where(t < n, n - 1 - t, t), x.shape)
        return [np.take_along_axis(x, src, axis=ta)]


# gathers and scatters ------------------------------------------------------------------------
def fit_affine(values: np.ndarray) -> tuple[tuple[int, ...], int] | None:
    """Coefficients ``c`` and offset ``b`` with ``values[j] == b + sum(c[d] * j[d])`` for every
    position ``j``, or ``None`` when the integer array ``values`` is not affine in its position."""
    values = np.asarray(values, dtype=np.int64)
    if values.size == 0:
        return None
    offset = int(values.flat[0])
    coefs = tuple(int(values[tuple(1 if k == d else 0 for k in range(values.ndim))]) - offset if n > 1 else 0
                  for d, n in enumerate(values.shape))
    grid = np.full(values.shape, offset, dtype=np.int64)
    for d, c in enumerate(coefs):
        if c:
            grid = grid + c * np.arange(values.shape[d], dtype=np.int64).reshape(
                [-1 if k == d else 1 for k in range(values.ndim)])
    return (coefs, offset) if np.array_equal(grid, values) else None


class AffineGather(Operator):
    """A gather at positions that are an affine function of the output position:
    ``y[i] = x[..., sum(coefs[d][j] * i[j]) + offsets[d], ...]`` for each input dim ``d``.

    What a Gather, GatherND or GatherElements with constant indices becomes when the indices
    follow such a pattern (broadcast aranges of attention masks, strided picks).
    """

    injective = True

    def compute(self, x):
        shape, coefs, offsets = tuple(self.attrs["shape"]), self.attrs["coefs"], self.attrs["offsets"]
        if len(coefs) != x.ndim or len(offsets) != x.ndim or any(len(c) != len(shape) for c in coefs):
            raise ShapeError(f"{self.name}: index map does not match input rank {x.ndim} / output rank {len(shape)}")
        if 0 not in shape:
            for d, (c, b) in enumerate(zip(coefs, offsets)):
                lo = b + sum(min(0, k * (n - 1)) for k, n in zip(c, shape))
                hi = b + sum(max(0, k * (n - 1)) for k, n in zip(c, shape))
                if lo < 0 or hi >= x.shape[d]:
                    raise ShapeError(f"{self.name}: positions [{lo}, {hi}] leave dim {d} of extent {x.shape[d]}")

        def f(*i):
            idx = []
            for c, b in zip(coefs, offsets):
                e: Expr | None = None
                for ax, k in zip(i, c):
                    if k:
                        term = _affine(ax, k, 0)
                        e = term if e is None else e + term
                idx.append(as_expr(b) if e is None else (e + b if b else e))
            return x[tuple(idx)]
        return compute("y", shape, f, dtype=x.dtype)

    def numpy(self, x):
        shape = tuple(self.attrs["shape"])
        axes = [np.arange(n, dtype=np.int64).reshape([-1 if k == j else 1 for k in range(len(shape))])
                for j, n in enumerate(shape)]
        idx = []
        for c, b in zip(self.attrs["coefs"], self.attrs["offsets"]):
            v = np.full((1,) * len(shape), b, dtype=np.int64)
            for ax, k in zip(axes, c):
                if k:
                    v = v + k * ax
            idx.append(v)
        return [np.broadcast_to(x[tuple(idx)] if idx else x, shape)]

    def passthrough_input(self):
        n = len(self.attrs["shape"])
        identity = all(b == 0 and tuple(c) == tuple(int(j == d) for j in range(n))
                       for d, (c, b) in enumerate(zip(self.attrs["coefs"], self.attrs["offsets"])))
        return 0 if identity and tuple(self.attrs["shape"]) == self.inputs[0].shape else None


class Gather(Operator):
    """``y = take(data, indices, axis)`` (negative indices count from the end).

    With ``start`` and ``extent`` set (:meth:`offset_attrs`), ``data`` holds the rows ``start`` to
    ``start + data.shape[axis]`` of a table of ``extent`` rows, and an index outside them reads
    zero: the row-split ranks' outputs add up to the whole gather (a vocab-parallel embedding)."""

    def compute(self, data, indices):
        axis, q, n = self.attrs["axis"], indices.ndim, data.shape[self.attrs["axis"]]
        start, extent = self.attrs.get("start", 0), self.attrs.get("extent")

        def f(*i):
            if extent is None:
                j = _wrap_index(indices[i[axis:axis + q]], n)
                return data[i[:axis] + (j,) + i[axis + q:]]
            j = _wrap_index(indices[i[axis:axis + q]], extent) - start
            zero = Const(np.zeros((), numpy_type(data.dtype)).item(), data.dtype)
            return if_then_else(logical_and(j >= 0, j < n), data[i[:axis] + (j,) + i[axis + q:]], zero)
        return compute("y", data.shape[:axis] + indices.shape + data.shape[axis + 1:], f, dtype=data.dtype)

    def numpy(self, data, indices):
        axis, extent = self.attrs["axis"], self.attrs.get("extent")
        if extent is None:
            return [np.take(data, _np_wrap(indices, data.shape[axis], self.name), axis=axis)]
        j = _np_wrap(indices, extent, self.name) - self.attrs["start"]
        inside = (j >= 0) & (j < data.shape[axis])
        y = np.take(data, np.where(inside, j, 0), axis=axis) if data.shape[axis] else \
            np.zeros(data.shape[:axis] + j.shape + data.shape[axis + 1:], data.dtype)
        mask = inside.reshape((1,) * axis + j.shape + (1,) * (data.ndim - axis - 1))
        return [np.where(mask, y, np.zeros((), y.dtype))]

    def index_ranges(self):
        return _indices_of_axis(self.attrs.get("extent") or self.inputs[0].shape[self.attrs["axis"]])

    def offset_split_dims(self):
        return ((0, self.attrs["axis"]),) if self.attrs.get("extent") is None else ()

    def offset_attrs(self, start):
        if not self.offset_split_dims():
            return super().offset_attrs(start)
        return {"start": int(start), "extent": self.inputs[0].shape[self.attrs["axis"]]}


class GatherElements(Operator):
    """``y[i] = data[i with dim axis replaced by indices[i]]``; ``y`` has the shape of ``indices``."""

    def compute(self, data, indices):
        axis, n = self.attrs["axis"], data.shape[self.attrs["axis"]]
        if indices.ndim != data.ndim or any(a > b for d, (a, b) in enumerate(zip(indices.shape, data.shape))
                                            if d != axis):
            raise ShapeError(f"{self.name}: indices of shape {indices.shape} do not fit data of shape {data.shape}")

        def f(*i):
            return data[i[:axis] + (_wrap_index(indices[i], n),) + i[axis + 1:]]
        return compute("y", indices.shape, f, dtype=data.dtype)

    def index_ranges(self):
        return _indices_of_axis(self.inputs[0].shape[self.attrs["axis"]])

    def numpy(self, data, indices):
        axis = self.attrs["axis"]
        idx = _np_wrap(indices, data.shape[axis], self.name)
        sub = data[tuple(slice(None) if d == axis else slice(0, e) for d, e in enumerate(idx.shape))]
        return [np.take_along_axis(sub, idx, axis=axis)]


class GatherND(Operator):
    """ONNX GatherND: the last dim of ``indices`` addresses the leading dims of ``data`` after
    ``batch_dims`` shared batch dims."""

    def compute(self, data, indices):
        b = self.attrs["batch_dims"]
        q, k = indices.ndim, indices.shape[-1]
        if k > data.ndim - b or indices.shape[:b] != data.shape[:b]:
            raise ShapeError(f"{self.name}: indices {indices.shape} do not fit data {data.shape} "
                             f"with batch_dims={b}")
        shape = indices.shape[:-1] + data.shape[b + k:]

        def f(*i):
            pos = tuple(_wrap_index(indices[i[:q - 1] + (t,)], data.shape[b + t]) for t in range(k))
            return data[i[:b] + pos + i[q - 1:]]
        return compute("y", shape, f, dtype=data.dtype)

    def index_ranges(self):
        b, k = self.attrs["batch_dims"], self.inputs[1].shape[-1]
        return _indices_of_axes(self.inputs[0].shape[b:b + k])

    def numpy(self, data, indices):
        b = self.attrs["batch_dims"]
        k = indices.shape[-1]
        nb = int(np.prod(data.shape[:b], dtype=np.int64))
        d = data.reshape((nb,) + data.shape[b:])
        ind = indices.reshape(nb, -1, k)
        pos = tuple(_np_wrap(ind[..., t], data.shape[b + t], self.name) for t in range(k))
        res = d[(np.arange(nb)[:, None],) + pos]
        return [res.reshape(self.outputs[0].shape)]


class ScatterElements(Operator):
    """``data`` with ``updates[j]`` written at ``j`` with dim ``axis`` replaced by ``indices[j]``,
    combined by ``reduction`` in :data:`SCATTER_REDUCTIONS` (``none``: the last write wins)."""

    def compute(self, data, indices, updates):
        axis, red = self.attrs["axis"], self.attrs["reduction"]
        n, m = data.shape[axis], indices.shape[axis]
        if indices.shape != updates.shape or indices.ndim != data.ndim or any(
                a > b for d, (a, b) in enumerate(zip(indices.shape, data.shape)) if d != axis):
            raise ShapeError(f"{self.name}: indices {indices.shape} / updates {updates.shape} do not fit "
                             f"data {data.shape}")

        def f(*i):
            if 0 in indices.shape:
                return data[i]
            inside = _all([i[d] < e for d, e in enumerate(indices.shape) if d != axis and e < data.shape[d]])

            def pos(k):
                return i[:axis] + (k,) + i[axis + 1:]

            def hit(k):
                return eq(_wrap_index(indices[pos(k)], n), i[axis])
            if red == "none":
                last = reduce((m,), lambda k: if_then_else(hit(k), k, -1), "max")
                res = if_then_else(last >= 0, updates[pos(last)], data[i])
            else:
                ident = _reduction_identity(red, data.dtype)
                res = _combine(red, data[i], reduce((m,), lambda k: if_then_else(hit(k), updates[pos(k)], ident),
                                                    _red_op(red)))
            # positions beyond the extent of indices in a non-scatter dim are never written
            return res if inside is None else if_then_else(inside, res, data[i])
        return compute("y", data.shape, f, dtype=data.dtype)

    def index_ranges(self):
        return _indices_of_axis(self.inputs[0].shape[self.attrs["axis"]])

    def numpy(self, data, indices, updates):
        axis, red = self.attrs["axis"], self.attrs["reduction"]
        out = data.copy()
        idx = _np_wrap(indices, data.shape[axis], self.name)
        grid = list(np.indices(idx.shape, sparse=True))
        grid[axis] = idx
        if red == "none":
            out[tuple(grid)] = updates
        else:
            _NP_AT[red](out, tuple(grid), updates)
        return [out]


def _red_op(red: str) -> str:
    """The :class:`Reduce` op that accumulates a scatter reduction."""
    return {"add": "sum", "mul": "prod", "max": "max", "min": "min"}[red]


class ScatterND(Operator):
    """ONNX ScatterND: ``updates[j]`` written at the position ``indices[j]`` (addressing the
    leading dims of ``data``), combined by ``reduction`` (``none``: the last write wins)."""

    def compute(self, data, indices, updates):
        red = self.attrs["reduction"]
        k = indices.shape[-1]
        upd = indices.shape[:-1]
        if k > data.ndim or updates.shape != upd + data.shape[k:]:
            raise ShapeError(f"{self.name}: indices {indices.shape} / updates {updates.shape} do not fit "
                             f"data {data.shape}")

        def f(*i):
            if 0 in upd:
                return data[i]

            def hit(j):
                return _all([eq(_wrap_index(indices[tuple(j) + (t,)], data.shape[t]), i[t]) for t in range(k)])

            def upd_at(j):
                return updates[tuple(j) + i[k:]]
            if not upd:                 # a single update
                if red == "none":
                    return if_then_else(hit(()), upd_at(()), data[i])
                return _combine(red, data[i], if_then_else(hit(()), upd_at(()), _reduction_identity(red, data.dtype)))
            if red == "none":
                last = reduce(upd, lambda *j: if_then_else(hit(j), _linear(j, upd), -1), "max")
                return if_then_else(last >= 0, upd_at(_unravel(last, upd)), data[i])
            ident = _reduction_identity(red, data.dtype)
            return _combine(red, data[i], reduce(upd, lambda *j: if_then_else(hit(j), upd_at(j), ident), _red_op(red)))
        return compute("y", data.shape, f, dtype=data.dtype)

    def index_ranges(self):
        return _indices_of_axes(self.inputs[0].shape[:self.inputs[1].shape[-1]])

    def numpy(self, data, indices, updates):
        red = self.attrs["reduction"]
        k = indices.shape[-1]
        out = data.copy()
        ind = indices.reshape(-1, k)
        pos = tuple(_np_wrap(ind[:, t], data.shape[t], self.name) for t in range(k))
        upd = updates.reshape((ind.shape[0],) + data.shape[k:])
        if red == "none":
            out[pos] = upd
        else:
            _NP_AT[red](out, pos, upd)
        return [out]


class IndexCheck(Operator):
    """How many values of the integer tensor ``x`` lie outside ``[lo, hi]``: an int64 scalar, the
    run-time check of an index computed in the graph, which the ops ``nodes`` (a tuple of names)
    read as indices (their compiled kernels clamp an index into its axis; the runtime raises when
    this output is not zero: passes/index_checks.py). With ``column`` set, only ``x[..., column]``
    is checked (a GatherND's indices address a different axis with each column)."""

    def compute(self, x):
        lo, hi, col = int(self.attrs["lo"]), int(self.attrs["hi"]), self.attrs.get("column")
        shape = x.shape if col is None else x.shape[:-1]
        zero, one = Const(0, "int64"), Const(1, "int64")
        if 0 in x.shape:
            return compute("y", (), lambda: zero, dtype="int64")

        def outside(*k):
            v = _int64(x[k if col is None else k + (int(col),)])
            return if_then_else(logical_or(v < lo, v > hi), one, zero)
        return compute("y", (), lambda: reduce(shape, outside, "sum") if shape else outside(), dtype="int64")

    def numpy(self, x):
        v = np.asarray(x).astype(np.int64)
        if self.attrs.get("column") is not None:
            v = v[..., int(self.attrs["column"])]
        return [np.asarray(np.count_nonzero((v < int(self.attrs["lo"])) | (v > int(self.attrs["hi"]))), np.int64)]


class ValuesInRange(Identity):
    """``y = x`` for an integer ``x`` whose values an imported op takes in ``[lo, hi]`` only (its input
    ``what``: onnxruntime's GroupQueryAttention refuses a ``seqlens_k`` past the total sequence length),
    written where a decomposition would otherwise give a plausible value for it: the evaluator raises a
    ``ShapeError`` naming this op (named after the imported one), and compiled programs check it as an
    index (:meth:`index_ranges`; passes/index_checks.py). Never bypassed as a no-op; two of one tensor
    and range are one (the layers of a model reading one ``seqlens_k``)."""

    def index_ranges(self):
        return {0: (int(self.attrs["lo"]), int(self.attrs["hi"]))}

    def passthrough_input(self):
        return None

    def numpy(self, x):
        lo, hi = int(self.attrs["lo"]), int(self.attrs["hi"])
        v = np.asarray(x)
        if v.size and (v.min() < lo or v.max() > hi):
            bad = v[(v < lo) | (v > hi)].ravel()[0]
            raise ShapeError(f"{self.name}: {self.attrs['what']} holds {bad}, outside [{lo}, {hi}]")
        return [x]


# shape queries and generators ---------------------------------------------------------------------
class ShapeOf(Operator):
    """The int64 vector ``x.shape[start:end]``; ``x`` is read for graph structure only."""

    op_type = "Shape"

    def compute(self, x):
        dims = x.shape[self.attrs["start"]:self.attrs["end"]]
        return compute("y", (len(dims),), lambda i: _table(dims, i, "int64"), dtype="int64")

    def numpy(self, x):
        return [np.array(x.shape[self.attrs["start"]:self.attrs["end"]], dtype=np.int64)]


class SizeOf(Operator):
    """The int64 scalar ``x.size``; ``x`` is read for graph structure only."""

    op_type = "Size"

    def compute(self, x):
        return compute("y", (), lambda: _const(int(np.prod(x.shape, dtype=np.int64)), "int64"), dtype="int64")

    def numpy(self, x):
        return [np.array(x.size, dtype=np.int64)]


class Full(Operator):
    """A tensor of ``shape`` filled with ``value`` of ``dtype`` (ONNX ConstantOfShape); no inputs."""

    def compute(self):
        dt = self.attrs["dtype"]
        return compute("y", tuple(self.attrs["shape"]), lambda *i: _const(self.attrs["value"], dt), dtype=dt)

    def numpy(self):
        return [np.full(tuple(self.attrs["shape"]), self.attrs["value"], dtype=self.attrs["dtype"])]


class Range(Operator):
    """``start + i * delta`` for ``i < size``, in ``dtype``; no inputs."""

    def compute(self):
        dt, start, delta = self.attrs["dtype"], self.attrs["start"], self.attrs["delta"]
        wide = "int64" if dtype_kind(dt) in "iu" else "float64"
        return compute("y", (self.attrs["size"],),
                       lambda i: Cast(_const(start, wide) + Cast(i, wide) * _const(delta, wide), dt), dtype=dt)

    def numpy(self):
        dt = self.attrs["dtype"]
        wide = np.int64 if dtype_kind(dt) in "iu" else np.float64
        i = np.arange(self.attrs["size"], dtype=wide)
        return [(wide(self.attrs["start"]) + i * wide(self.attrs["delta"])).astype(dt)]


class Eye(Operator):
    """A ``shape`` (2-D) matrix of ``dtype`` with ones where ``col - row == k``; no inputs."""

    def compute(self):
        dt, k = self.attrs["dtype"], self.attrs["k"]
        return compute("y", tuple(self.attrs["shape"]),
                       lambda r, c: if_then_else(eq(c - r, k), _const(1, dt), _const(0, dt)), dtype=dt)

    def numpy(self):
        n, m = self.attrs["shape"]
        return [np.eye(n, m, k=self.attrs["k"], dtype=self.attrs["dtype"])]


class Trilu(Operator):
    """Keep the upper (``upper``) or lower triangle of the last two dims relative to diagonal ``k``
    (the attribute, or the one element of an optional int64 second input known at run time)."""

    injective = True

    def compute(self, x, *k_input):
        upper = self.attrs["upper"]
        zero = _const(0, x.dtype)
        k = k_input[0][(0,) * k_input[0].ndim] if k_input else self.attrs["k"]

        def f(*i):
            d = i[-1] - i[-2]
            return if_then_else(d >= k if upper else d <= k, x[i], zero)
        return compute("y", x.shape, f, dtype=x.dtype)

    def numpy(self, x, *k_input):
        f = np.triu if self.attrs["upper"] else np.tril
        k = int(np.asarray(k_input[0]).ravel()[0]) if k_input else self.attrs["k"]
        return [f(x, k).astype(x.dtype)]


class OneHot(Operator):
    """``values[1]`` where the position along the new dim ``axis`` equals ``indices`` (negative
    indices count from ``depth``), ``values[0]`` elsewhere. Inputs: ``indices``, ``values``."""

    def compute(self, indices, values):
        axis, depth = self.attrs["axis"], self.attrs["depth"]
        shape = indices.shape[:axis] + (depth,) + indices.shape[axis:]

        def f(*i):
            v = _int64(indices[i[:axis] + i[axis + 1:]])
            v = if_then_else(v < 0, v + depth, v)
            return if_then_else(eq(v, i[axis]), values[1], values[0])
        return compute("y", shape, f, dtype=values.dtype)

    def numpy(self, indices, values):
        axis, depth = self.attrs["axis"], self.attrs["depth"]
        v = np.asarray(indices).astype(np.int64)
        v = np.expand_dims(np.where(v < 0, v + depth, v), axis)
        pos = np.arange(depth).reshape([-1 if d == axis else 1 for d in range(v.ndim)])
        return [np.where(v == pos, values[1], values[0])]


def examples(rng: np.random.Generator):
    """Small instances of every op in this module: ``(op class, input arrays, attrs)``."""
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    big = rng.standard_normal((2, 3, 12)).astype(np.float32)
    img = rng.standard_normal((1, 8, 2, 3)).astype(np.float32)
    ints = rng.integers(-9, 9, (3, 4)).astype(np.int64)
    res = [
        (Reshape, [big], {"shape": (2, 3, 3, 4)}),            # split: x[b, s, h*4 + d]
        (Reshape, [big.reshape(2, 3, 3, 4)], {"shape": (2, 3, 12)}),  # merge: x[b, s, c//4, c%4]
        (Reshape, [big], {"shape": (4, 9, 2)}),               # mixed block: linear index
        (Reshape, [x], {"shape": (1, 2, 1, 12, 1)}),
        (Reshape, [x[:1]], {"shape": (3, 4)}),
        (Reshape, [np.zeros((0, 3), np.float32)], {"shape": (3, 0)}),
        (Reshape, [np.float32(2.5).reshape(1, 1)], {"shape": ()}),
        (Transpose, [x], {"perm": (2, 0, 1)}),
        (Transpose, [ints], {"perm": (1, 0)}),
        (Slice, [x], {"starts": (0, 1, 3), "steps": (1, 1, -2), "sizes": (2, 2, 2)}),
        (Slice, [x], {"starts": (1, 0, 0), "steps": (1, 2, 1), "sizes": (0, 2, 4)}),
        (Concat, [x, x[:, :1], x[:, :0], x], {"axis": 1}),
        (Concat, [ints, ints], {"axis": 0}),
        (Pad, [x], {"begin": (0, 1, 2), "end": (1, 0, -1), "mode": "constant", "value": 1.5}),
        (Pad, [ints > 0], {"begin": (1, 1), "end": (0, 1), "mode": "constant", "value": True}),
        (Pad, [x, np.array([-2.0], np.float32)], {"begin": (1, 0, 2), "end": (0, -1, 1), "mode": "constant"}),
        (Pad, [x], {"begin": (0, 2, 3), "end": (0, 2, 7), "mode": "reflect"}),
        (Pad, [x], {"begin": (1, 2, -1), "end": (0, 3, 2), "mode": "edge"}),
        (Pad, [x], {"begin": (0, 4, 1), "end": (3, 1, 5), "mode": "wrap"}),
        (Pad, [x[:, :1]], {"begin": (0, 2, 0), "end": (0, 1, 0), "mode": "reflect"}),
        (Tile, [x], {"repeats": (2, 1, 3)}),
        (Tile, [x[:, :1]], {"repeats": (1, 3, 1)}),
        (Expand, [x[:, :1]], {"shape": (3, 2, 3, 1)}),
        (Expand, [ints[:1]], {"shape": (3, 1)}),
        (DepthToSpace, [img], {"blocksize": 2, "mode": "DCR"}),
        (DepthToSpace, [img], {"blocksize": 2, "mode": "CRD"}),
        (SpaceToDepth, [rng.standard_normal((1, 2, 4, 6)).astype(np.float32)], {"blocksize": 2, "mode": "DCR"}),
        (SpaceToDepth, [rng.standard_normal((1, 2, 4, 6)).astype(np.float32)], {"blocksize": 2, "mode": "CRD"}),
        (ReverseSequence, [x, np.array([3, 1], np.int64)], {"time_axis": 1, "batch_axis": 0}),
        (ReverseSequence, [x.transpose(1, 0, 2).copy(), np.array([0, 3], np.int64)], {"time_axis": 0, "batch_axis": 1}),
        (AffineGather, [x], {"shape": (2, 2, 2), "coefs": ((0, 1, 0), (1, 0, -1), (0, 0, 2)), "offsets": (0, 1, 0)}),
        (AffineGather, [x], {"shape": (4,), "coefs": ((0,), (0,), (1,)), "offsets": (1, 2, 0)}),
        (AffineGather, [x[0, 0]], {"shape": (), "coefs": ((),), "offsets": (3,)}),
        (Gather, [x, np.array([[2, -1], [0, 1]], np.int64)], {"axis": 1}),
        (Gather, [x, np.array(-2, np.int32)], {"axis": 2}),
        # rows 2..4 of a 7-row table (a rank of a vocab-parallel embedding): 5 and -1 read zeros
        (Gather, [x, np.array([[5, -1], [2, 3], [4, -4]], np.int64)], {"axis": 1, "start": 2, "extent": 7}),
        (GatherElements, [x, rng.integers(-3, 3, (2, 2, 4))], {"axis": 1}),
        (GatherElements, [ints, rng.integers(0, 4, (3, 2)).astype(np.int32)], {"axis": 1}),
        (GatherND, [x, np.array([[0, 2], [1, -1]], np.int64)], {"batch_dims": 0}),
        (GatherND, [x, np.array([[[1], [0]], [[2], [2]]], np.int64)], {"batch_dims": 1}),
        (GatherND, [x, np.array([[0, 1, 2], [1, 2, 3]], np.int64)], {"batch_dims": 0}),
        (IndexCheck, [rng.integers(-6, 6, (4, 5))], {"lo": -4, "hi": 3, "nodes": ("g",)}),
        (IndexCheck, [rng.integers(-6, 6, (3, 2, 3)).astype(np.int32)], {"lo": -2, "hi": 1, "column": 1,
                                                                       "nodes": ("g",)}),
        (IndexCheck, [np.array(5, np.int64)], {"lo": 0, "hi": 4, "nodes": ("g",)}),
        (ValuesInRange, [np.array([3, 0, 7], np.int32)], {"lo": 0, "hi": 7, "what": "seqlens_k"}),
        (ShapeOf, [x], {"start": 1, "end": 3}),
        (ShapeOf, [x], {"start": 2, "end": 1}),
        (SizeOf, [x], {}),
        (Full, [], {"shape": (2, 3), "value": 1.5, "dtype": "float32"}),
        (Full, [], {"shape": (), "value": 7, "dtype": "int32"}),
        (Range, [], {"start": 10, "delta": -3, "size": 4, "dtype": "int32"}),
        (Range, [], {"start": 0.5, "delta": 0.25, "size": 5, "dtype": "float32"}),
        (Eye, [], {"shape": (3, 4), "k": 1, "dtype": "float32"}),
        (Eye, [], {"shape": (4, 3), "k": -2, "dtype": "int64"}),
        (Trilu, [x], {"k": 1, "upper": True}),
        (Trilu, [ints], {"k": -1, "upper": False}),
        (Trilu, [x, np.array([-1], np.int64)], {"k": 0, "upper": True}),
        (OneHot, [np.array([[1, -1], [5, 0]], np.int64), np.array([0.5, 3.0], np.float32)], {"axis": 1, "depth": 3}),
        (OneHot, [np.array([2.7, 0.0, -1.0], np.float32), np.array([0, 1], np.int64)], {"axis": 1, "depth": 4}),
    ]
    data = rng.standard_normal((3, 4, 2)).astype(np.float32)
    elem_idx = np.array([[[0, 1], [2, 0], [-1, 1]], [[1, 0], [1, 0], [0, 0]]], np.int64)  # (2, 3, 2)
    for red in SCATTER_REDUCTIONS:
        res.append((ScatterElements, [data, elem_idx, rng.standard_normal((2, 3, 2)).astype(np.float32)],
                    {"axis": 0, "reduction": red}))
    res.append((ScatterElements, [ints, np.array([[1, 1], [0, -1]], np.int64), np.array([[5, 6], [7, 8]], np.int64)],
                {"axis": 1, "reduction": "none"}))
    nd_idx = np.array([[[0, 1]], [[2, 3]], [[0, 1]]], np.int64)  # (3, 1, 2): duplicates
    for red in SCATTER_REDUCTIONS:
        res.append((ScatterND, [data, nd_idx, rng.standard_normal((3, 1, 2)).astype(np.float32)], {"reduction": red}))
    res += [(ScatterND, [data, np.array([-1], np.int64), np.ones((4, 2), np.float32)], {"reduction": "none"}),
            (ScatterND, [data, np.array([1], np.int64), np.ones((4, 2), np.float32)], {"reduction": "mul"}),
            (ScatterND, [ints, np.array([[0, 0], [2, 3]], np.int64), np.array([10, 20], np.int64)],
             {"reduction": "max"})]
    return res
