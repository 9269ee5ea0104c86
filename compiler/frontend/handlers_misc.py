"""Handlers for ONNX ops built from other IR ops or constants: the window functions (HannWindow,
HammingWindow, BlackmanWindow), the losses (NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss),
AffineGrid, Col2Im, MaxUnpool, Optional / OptionalHasElement / OptionalGetElement, TfIdfVectorizer
of integer tokens (composed from Gather, Equal, reductions and a MatMul), the training domain's
optimizer updates (Adagrad, Momentum, Adam: element-wise), and ai.onnx.ml's Binarizer and
ArrayFeatureExtractor.

Windows depend only on their size, which must be known at import; they become constants. The
losses are composed from LogSoftmax, GatherElements, Gather, Where, Reduce and element-wise ops,
following the function bodies of the ONNX schemas. AffineGrid is a constant base grid times
theta (MatMul); Col2Im is a grouped ConvTranspose with one-hot kernels; MaxUnpool scatters into
zeros (ScatterElements). An optional graph input of a tensor or sequence type is compiled as present (the
program takes the tensor or the sequence's items; onnx_importer.py), so an optional's element is its value and
it has one exactly when the node names an input; an ``Optional`` node with an input is that input (one
without, an empty optional, is refused).
"""
from __future__ import annotations

import math

import numpy as np

from ..ir.graph import Tensor
from ..ops.conv import ConvTranspose
from ..ops.elementwise import Binary, Identity, Unary, Where
from ..ops.linalg import MatMul
from ..ops.reduce import Reduce, Softmax
from ..ops.transform import Full, Gather, GatherElements, Reshape, ScatterElements, Transpose
from .registry import FLOATS, EmptyOptional, NodeContext, TensorSeq, onnx_dtype, onnx_op



# Window functions -------------------------------------------------------------------------------

#: ``w[n] = a0 - a1 cos(2 pi n / N) + a2 cos(4 pi n / N)`` with these ``(a0, a1, a2)``.
_WINDOWS = {"HannWindow": (0.5, 0.5, 0.0), "HammingWindow": (25 / 46, 21 / 46, 0.0),
            "BlackmanWindow": (0.42, 0.5, 0.08)}


def _window_values(kind: str, size: int, periodic: bool) -> np.ndarray:
    """The ``kind`` window (an ONNX op type of :data:`_WINDOWS`) of ``size`` points, in float64.

    ``N = size`` (periodic) or ``size - 1`` (symmetric), as the schemas' function bodies. A
    symmetric window of one point is ``0 / 0``, i.e. NaN, as in onnxruntime and the ONNX reference.
    """
    a0, a1, a2 = _WINDOWS[kind]
    with np.errstate(all="ignore"):
        angle = np.arange(size, dtype=np.float64) * (2 * np.pi / np.float64(size if periodic else size - 1))
        return a0 - a1 * np.cos(angle) + a2 * np.cos(2 * angle)


def _window_handler(kind: str):
    def handler(ctx: NodeContext):
        size = np.asarray(ctx.const(0))
        if size.size != 1 or size.dtype.kind not in "iu":
            raise ctx.invalid(f"size must be one integer, got {size.tolist()!r}")
        size = int(size.item())
        if size < 1:
            raise ctx.invalid(f"size must be positive, got {size}")
        dtype = onnx_dtype(int(ctx.attr("output_datatype", 1)), f"node {ctx.name} attribute 'output_datatype'")
        if dtype == "bool":
            raise ctx.invalid("output_datatype bool is not allowed by the schema")
        w = _window_values(kind, size, ctx.flag("periodic", 1))
        if dtype not in FLOATS:
            if np.isnan(w).any():
                raise ctx.invalid(f"a symmetric window of size {size} is NaN (0/0), which has no {dtype} value")
            # the cast truncates the exact values: where those are integers (the peak 1 at n = N/2,
            # and 0s), float rounding must not give 0.999... or -1e-17
            r = np.round(w)
            w = np.where(np.abs(w - r) < 1e-9, r, w)
        return [ctx.constant(w.astype(dtype))]
    return handler


for _kind in _WINDOWS:
    onnx_op(_kind, since=17)(_window_handler(_kind))


# Losses -----------------------------------------------------------------------------------------

def _loss_reduction(ctx: NodeContext) -> str:
    red = ctx.attr("reduction", "mean")
    if red not in ("none", "sum", "mean"):
        raise ctx.invalid(f"reduction must be 'none', 'sum' or 'mean', got {red!r}")
    return red


def _check_loss_operands(ctx: NodeContext, x: Tensor, target: Tensor, weight: Tensor | None) -> None:
    if x.dtype not in FLOATS:
        raise ctx.unsupported(f"dtype {x.dtype} (expected a floating-point input)")
    if x.ndim < 2:
        raise ctx.shape_error(f"input of shape {x.shape} has no class dim (expected [N, C, d1, ...])")
    if target.dtype not in ("int32", "int64"):
        raise ctx.invalid(f"target must be int32 or int64, got {target.dtype}")
    want = (x.shape[0],) + x.shape[2:]
    if target.shape != want:
        raise ctx.shape_error(f"target has shape {target.shape}; expected {want} for an input of shape {x.shape}")
    if weight is not None and (weight.shape != (x.shape[1],) or weight.dtype != x.dtype):
        raise ctx.shape_error(f"weight is {weight.dtype}{list(weight.shape)}; expected {x.dtype}[{x.shape[1]}]")


def _nll_loss(ctx: NodeContext, logp: Tensor, target: Tensor, weight: Tensor | None) -> Tensor:
    """The negative log-likelihood of log-probabilities ``logp`` [N, C, d...] at the classes
    ``target`` [N, d...], weighted, with ``ignore_index`` and the node's reduction (the function
    body of NegativeLogLikelihoodLoss)."""
    reduction = _loss_reduction(ctx)
    name, dt, ti = ctx.name, logp.dtype, target.dtype
    last = reduction == "none"
    ignore = ctx.attr("ignore_index", None)
    if ignore is not None and not np.iinfo(ti).min <= ignore <= np.iinfo(ti).max:
        ignore = None  # no target value can equal it
    column = (target.shape[0], 1) + target.shape[1:]
    mask = None
    if ignore is not None:
        mask = ctx.add(Binary([target, ctx.constant(np.asarray(ignore).astype(ti))], name=f"{name}/ignored",
                              fn="eq"))
        # ignored positions read class 0 (any index in range), then their loss is zeroed
        target = ctx.add(Where([mask, ctx.constant(np.zeros((), ti)), target], name=f"{name}/target"))
    picked = ctx.add(GatherElements([logp, ctx.add(Reshape([target], name=f"{name}/column", shape=column))],
                                    name=f"{name}/pick", axis=1))
    picked = ctx.add(Reshape([picked], name=f"{name}/picked", shape=target.shape))
    zero = ctx.constant(np.zeros((), dt))
    if mask is not None:
        picked = ctx.add(Where([mask, zero, picked], name=f"{name}/unignored"))
    weights = None
    if weight is not None:
        weights = ctx.add(Gather([weight, target], name=f"{name}/weights", axis=0))
        if mask is not None:
            weights = ctx.add(Where([mask, zero, weights], name=f"{name}/weights_unignored"))
    elif mask is not None and reduction == "mean":
        weights = ctx.add(Where([mask, zero, ctx.constant(np.ones((), dt))], name=f"{name}/counted"))
    loss = ctx.add(Unary([picked], name=name if last and weight is None else f"{name}/neg", fn="neg"))
    if weight is not None:
        loss = ctx.add(Binary([loss, weights], name=name if last else f"{name}/weighted", fn="mul"))
    if last:
        return loss
    axes = tuple(range(loss.ndim))
    if reduction == "mean" and weights is None:
        return ctx.add(Reduce([loss], name=name, kind="mean", axes=axes, keepdims=False))
    total = ctx.add(Reduce([loss], name=name if reduction == "sum" else f"{name}/sum", kind="sum", axes=axes,
                           keepdims=False))
    if reduction == "sum":
        return total
    count = ctx.add(Reduce([weights], name=f"{name}/weight_sum", kind="sum", axes=axes, keepdims=False))
    return ctx.add(Binary([total, count], name=name, fn="div"))


@onnx_op("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss(ctx):
    x, target = ctx.input(0), ctx.input(1)
    weight = ctx.input(2) if ctx.has_input(2) else None
    _check_loss_operands(ctx, x, target, weight)
    return [_nll_loss(ctx, x, target, weight)]


@onnx_op("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss(ctx):
    """The loss of ``LogSoftmax(scores, axis=1)``; the log-probabilities are the optional second
    output."""
    x, target = ctx.input(0), ctx.input(1)
    weight = ctx.input(2) if ctx.has_input(2) else None
    _check_loss_operands(ctx, x, target, weight)
    log_prob = ctx.add(Softmax([x], name=f"{ctx.name}/log_prob", axes=(1,), log=True))
    return [_nll_loss(ctx, log_prob, target, weight), log_prob]


# AffineGrid -------------------------------------------------------------------------------------

def _grid_coords(n: int, align_corners: bool) -> np.ndarray:
    """``n`` evenly spaced positions in [-1, 1]: pixel centres (``align_corners``: the corner
    pixels' centres are -1 and 1; otherwise their outer edges are)."""
    k = np.arange(n, dtype=np.float64)
    if align_corners:
        return k * (2.0 / (n - 1)) - 1.0
    return (2.0 * k + 1.0) / n - 1.0


@onnx_op("AffineGrid", since=20)
def affine_grid(ctx):
    """``grid[n, (d,) h, w] = theta[n] @ (x_w, y_h, (z_d,) 1)``: a constant homogeneous base grid
    [(D*)H*W, 3 or 4] times the transposed theta, reshaped."""
    theta = ctx.input(0)
    size = np.asarray(ctx.const(1))
    if theta.dtype not in FLOATS:
        raise ctx.unsupported(f"dtype {theta.dtype} (expected a floating-point theta)")
    if size.ndim != 1 or size.size not in (4, 5) or size.dtype.kind not in "iu":
        raise ctx.invalid(f"size must be 4 or 5 integers [N, C, (D,) H, W], got {size.tolist()!r}")
    n, spatial = int(size[0]), [int(v) for v in size[2:]]
    nd = len(spatial)
    if theta.shape != (n, nd, nd + 1):
        raise ctx.shape_error(f"theta has shape {theta.shape}; expected {(n, nd, nd + 1)} for size {size.tolist()}")
    if min(spatial) < 1:
        raise ctx.shape_error(f"size {size.tolist()} has an empty spatial dim")
    align = ctx.flag("align_corners", 0)
    if align and 1 in spatial:
        # 2 / (n - 1) positions apart: one position has none (onnxruntime puts it at 1, the
        # ONNX reference and PyTorch at -1)
        raise ctx.unsupported(f"align_corners=1 with a spatial extent of 1 (size {size.tolist()}), whose "
                              "position the spec leaves undefined,")
    # the homogeneous coordinates (x, y, (z,) 1): x runs along the last dim, z along the first
    axes = np.meshgrid(*[_grid_coords(e, align) for e in spatial], indexing="ij")
    base = np.stack(list(axes)[::-1] + [np.ones(spatial)], axis=-1).reshape(-1, nd + 1).astype(theta.dtype)
    theta_t = ctx.add(Transpose([theta], name=f"{ctx.name}/theta_t", perm=(0, 2, 1)))
    grid = ctx.add(MatMul([ctx.constant(base), theta_t], name=f"{ctx.name}/grid"))
    return [ctx.add(Reshape([grid], name=ctx.name, shape=(n, *spatial, nd)))]


# Col2Im -----------------------------------------------------------------------------------------

def _int_list(ctx: NodeContext, i: int, what: str) -> list[int]:
    v = np.asarray(ctx.const(i))
    if v.ndim != 1 or v.dtype.kind not in "iu":
        raise ctx.invalid(f"{what} must be a 1-D integer tensor, got {v.tolist()!r}")
    return [int(e) for e in v]


def _attr_ints(ctx: NodeContext, name: str, n: int, default: int) -> tuple[int, ...]:
    v = [int(e) for e in ctx.attr(name, [default] * n)]
    if len(v) != n:
        raise ctx.invalid(f"{name}={v} must have {n} values")
    return tuple(v)


@onnx_op("Col2Im", since=18)
def col2im(ctx):
    """Sum the columns of ``x`` [N, C*prod(block), L] back into images [N, C, *image_shape]: a
    ConvTranspose (group C) of ``x`` viewed as [N, C*K, *blocks] with one-hot kernels, kernel
    channel ``c*K + k`` selecting kernel position ``k`` (row-major)."""
    x = ctx.input(0)
    image, block = _int_list(ctx, 1, "image_shape"), _int_list(ctx, 2, "block_shape")
    nd = len(image)
    if x.dtype not in FLOATS:
        raise ctx.unsupported(f"dtype {x.dtype} (expected a floating-point input)")
    if nd < 1 or len(block) != nd or x.ndim != 3:
        raise ctx.shape_error(f"input {x.shape}, image_shape {image} and block_shape {block} do not fit "
                              "(expected [N, C*prod(block_shape), L] and two lists of the same length)")
    if min(image + block) < 1:
        raise ctx.invalid(f"image_shape {image} and block_shape {block} must be positive")
    strides, dil = _attr_ints(ctx, "strides", nd, 1), _attr_ints(ctx, "dilations", nd, 1)
    pads = _attr_ints(ctx, "pads", 2 * nd, 0)
    if min(strides + dil) < 1 or min(pads) < 0:
        raise ctx.invalid(f"strides {strides} and dilations {dil} must be positive, pads {pads} non-negative")
    blocks = [(image[d] + pads[d] + pads[nd + d] - dil[d] * (block[d] - 1) - 1) // strides[d] + 1
              for d in range(nd)]
    k = math.prod(block)
    if x.shape[1] % k or min(blocks) < 1 or x.shape[2] != math.prod(blocks):
        raise ctx.shape_error(f"input {x.shape} does not fit image_shape {image}, block_shape {block}, strides "
                              f"{list(strides)}, dilations {list(dil)}, pads {list(pads)}: expected dim 1 a multiple "
                              f"of {k} and dim 2 = {' * '.join(map(str, blocks))} blocks")
    c = x.shape[1] // k
    onehot = np.eye(k, dtype=x.dtype).reshape(k, 1, *block)
    weight = ctx.constant(np.tile(onehot, (c,) + (1,) * (nd + 1)))
    cols = ctx.add(Reshape([x], name=f"{ctx.name}/blocks", shape=(x.shape[0], x.shape[1], *blocks)))
    return [ctx.add(ConvTranspose([cols, weight], name=ctx.name, group=c, strides=strides, dilations=dil,
                                  pads=pads, output_shape=tuple(image)))]


# MaxUnpool --------------------------------------------------------------------------------------

@onnx_op("MaxUnpool", since=9)
def max_unpool(ctx):
    """Zeros of the unpooled shape with ``x`` written at the flat indices ``I`` (over the whole
    output, as MaxPool's indices): a ScatterElements of the flattened tensors."""
    x, idx = ctx.input(0), ctx.input(1)
    if x.ndim < 3:
        raise ctx.shape_error(f"input must be [N, C, spatial...], got shape {x.shape}")
    if idx.shape != x.shape or idx.dtype != "int64":
        raise ctx.shape_error(f"indices are {idx.dtype}{list(idx.shape)}; expected int64{list(x.shape)}")
    nd = x.ndim - 2
    kernel = _attr_ints(ctx, "kernel_shape", nd, 0) if ctx.has_attr("kernel_shape") else None
    if kernel is None:
        raise ctx.invalid("required attribute 'kernel_shape' is missing")
    strides, pads = _attr_ints(ctx, "strides", nd, 1), _attr_ints(ctx, "pads", 2 * nd, 0)
    if min(kernel + strides) < 1 or min(pads) < 0:
        raise ctx.invalid(f"kernel_shape {kernel} and strides {strides} must be positive, pads {pads} non-negative")
    shape = tuple(x.shape[:2]) + tuple((x.shape[2 + d] - 1) * strides[d] - pads[d] - pads[nd + d] + kernel[d]
                                       for d in range(nd))
    if ctx.has_input(2):
        given = tuple(_int_list(ctx, 2, "output_shape"))
        if given != shape:
            # onnxruntime flattens the indices over output_shape, the ONNX reference (and the backend
            # test data) over the inferred shape, padded at the end: the spec does not say which
            raise ctx.unsupported(f"output_shape {list(given)} different from the inferred shape {list(shape)} "
                                  "(the spec leaves the layout of the indices ambiguous)")
    if min(shape) < 1:
        raise ctx.shape_error(f"the unpooled shape {list(shape)} is empty")
    total = math.prod(shape)
    zeros = ctx.add(Full([], name=f"{ctx.name}/zeros", shape=(total,), value=0, dtype=x.dtype))
    flat_x = ctx.add(Reshape([x], name=f"{ctx.name}/flat_x", shape=(x.size,)))
    flat_i = ctx.add(Reshape([idx], name=f"{ctx.name}/flat_i", shape=(x.size,)))
    flat = ctx.add(ScatterElements([zeros, flat_i, flat_x], name=f"{ctx.name}/scatter", axis=0, reduction="none"))
    return [ctx.add(Reshape([flat], name=ctx.name, shape=shape))]


# Optional values ---------------------------------------------------------------------------------

@onnx_op("Optional", since=15)
def optional(ctx):
    """An optional holding its input (a tensor or a sequence): that value, as an optional graph input
    compiled as present is its tensor. Without an input, an empty optional (:class:`EmptyOptional`),
    which only the Optional ops and Identity read."""
    if not ctx.has_input(0):
        return [EmptyOptional(ctx.name)]
    return [ctx.input(0)]


@onnx_op("OptionalHasElement", since=15)
def optional_has_element(ctx):
    """Whether the optional holds a value, known at import: false for no input or an empty optional."""
    present = ctx.has_input(0) and not isinstance(ctx.input(0), EmptyOptional)
    return [ctx.constant(np.array(present))]


@onnx_op("OptionalGetElement", since=15)
def optional_get_element(ctx):
    if isinstance(ctx.input(0), EmptyOptional):
        raise ctx.invalid(f"reads the empty optional {ctx.input(0).name!r}, which has no element (onnxruntime "
                          "fails there at run time)")
    if isinstance(ctx.input(0), TensorSeq):  # (an optional sequence: the sequence itself)
        return [ctx.input(0)]
    return [ctx.add(Identity([ctx.input(0)], name=ctx.name))]


# ops composed from emitted default-domain ops (opset 18: the reductions take their axes as an input)

def _e(ctx: NodeContext, op: str, *inputs: Tensor, **attrs) -> Tensor:
    return ctx.emit(op, list(inputs), 18, **attrs)


def _c(ctx: NodeContext, value, dtype: str) -> Tensor:
    return ctx.constant(np.asarray(value, dtype=dtype))


# TfIdfVectorizer ----------------------------------------------------------------------------------

_TFIDF_MODES = ("TF", "IDF", "TFIDF")


def _tfidf_pool(ctx: NodeContext, pool: list[int], counts: list[int], lo: int, hi: int) -> dict[int, list]:
    """The pool's n-grams of the counted sizes ``lo..hi``, by size: ``[(gram, pool index)]`` in the
    reference's numbering (every n-gram of the pool has an index, counted or not; a repeated n-gram
    counts under its last index, as the reference's map keeps it)."""
    by_size: dict[int, dict[tuple, int]] = {}
    k = 0
    for size, start in enumerate(counts, 1):
        end = counts[size] if size < len(counts) else len(pool)
        if end < start or (end - start) % size:
            raise ctx.invalid(f"ngram_counts {counts}: the {size}-grams [{start}, {end}) of the pool of {len(pool)} "
                              f"are not whole {size}-grams")
        for s in range(start, end, size):
            if lo <= size <= hi:
                by_size.setdefault(size, {})[tuple(pool[s:s + size])] = k
            k += 1
    return {n: sorted(((list(g), i) for g, i in grams.items()), key=lambda e: e[1]) for n, grams in by_size.items()}


@onnx_op("TfIdfVectorizer", since=9)
def tfidf_vectorizer(ctx):
    """``TfIdfVectorizer`` of integer tokens (``pool_int64s``; a string pool is refused), as the
    reference counts: for each skip distance ``d`` in ``1 .. max_skip_count + 1`` (unigrams at
    ``d = 1`` only) and each start ``p``, the pool's n-grams matching ``x[p], x[p + d], ...`` (all
    inside the row). Per n-gram size: the row's candidate n-grams gathered at constant positions
    ``[B, starts, n]``, compared with the pool's ``[K, n]``, all-equal and inside the row, summed
    over the starts: counts ``[B, K]``; a constant 0/1 matrix maps the pool's n-grams to their
    ``ngram_indexes`` (MatMul), then the weighting (TF: the counts; IDF: the weight, or 1, where
    the count is positive; TFIDF: the weight times the count)."""
    x = ctx.input(0)
    if ctx.has_attr("pool_strings"):
        raise ctx.unsupported("a pool of strings (pool_int64s is)")
    if x.dtype not in ("int32", "int64"):
        raise ctx.unsupported(f"{x.dtype} tokens (int32 and int64 are)")
    if x.ndim not in (1, 2):
        raise ctx.shape_error(f"X must be [C] or [N, C], got shape {list(x.shape)}")
    mode = ctx.attr("mode")
    if mode not in _TFIDF_MODES:
        raise ctx.invalid(f"mode must be one of {', '.join(_TFIDF_MODES)}, got {mode!r}")
    lo, hi, skip = int(ctx.attr("min_gram_length")), int(ctx.attr("max_gram_length")), int(ctx.attr("max_skip_count"))
    pool = [int(v) for v in ctx.attr("pool_int64s")]
    counts = [int(v) for v in ctx.attr("ngram_counts")]
    indexes = [int(v) for v in ctx.attr("ngram_indexes")]
    weights = [float(v) for v in ctx.attr("weights", [])]
    if not 1 <= lo <= hi or skip < 0:
        raise ctx.invalid(f"min_gram_length {lo}, max_gram_length {hi} and max_skip_count {skip} must satisfy "
                          "1 <= min <= max and skip >= 0")
    if not indexes or min(indexes) < 0:
        raise ctx.invalid(f"ngram_indexes {indexes} must be non-empty and not negative")
    size = max(indexes) + 1
    if weights and len(weights) != size:
        raise ctx.invalid(f"{len(weights)} weights for {size} outputs (max(ngram_indexes) + 1)")
    grams = _tfidf_pool(ctx, pool, counts, lo, hi)
    ids = [k for entries in grams.values() for _, k in entries]
    if ids and max(ids) >= len(indexes):
        raise ctx.invalid(f"{len(indexes)} ngram_indexes for a pool of more n-grams")

    rows = _e(ctx, "Reshape", ctx.cast(x, "int64"), _c(ctx, [-1, x.shape[-1]], "int64"))  # [B, L]
    b, length = (1 if x.ndim == 1 else x.shape[0]), x.shape[-1]
    total = None  # the counts [B, size], summed over the n-gram sizes
    for n, entries in sorted(grams.items()):
        dists = [1] if n == 1 else list(range(1, skip + 2))
        pos = np.array([[p + i * d for i in range(n)] for d in dists for p in range(length)], np.int64).reshape(-1, n)
        inside = pos[:, -1] < length
        if not inside.any():
            continue
        pos = pos[inside]
        cand = _e(ctx, "Gather", rows, _c(ctx, pos, "int64"), axis=1)                        # [B, S, n]
        want = _c(ctx, [g for g, _ in entries], "int64")                                     # [K, n]
        same = _e(ctx, "Equal", _e(ctx, "Unsqueeze", cand, _c(ctx, [2], "int64")), want)    # [B, S, K, n]
        hit = _e(ctx, "ReduceMin", ctx.cast(same, "int32"), _c(ctx, [3], "int64"), keepdims=0)  # [B, S, K]
        found = _e(ctx, "ReduceSum", hit, _c(ctx, [1], "int64"), keepdims=0)                 # [B, K]
        scatter = np.zeros((len(entries), size), np.float32)
        for row, (_, k) in enumerate(entries):
            scatter[row, indexes[k]] = 1.0
        counted = _e(ctx, "MatMul", ctx.cast(found, "float32"), _c(ctx, scatter, "float32"))
        total = counted if total is None else _e(ctx, "Add", total, counted)
    if total is None:  # (no n-gram of the counted sizes fits in a row)
        total = _c(ctx, np.zeros((b, size)), "float32")
    if mode == "IDF":
        total = _e(ctx, "Where", _e(ctx, "Greater", total, _c(ctx, 0, "float32")),
                   _c(ctx, weights or np.ones(size), "float32"), _c(ctx, 0, "float32"))
    elif mode == "TFIDF" and weights:
        total = _e(ctx, "Mul", total, _c(ctx, weights, "float32"))
    out = (size,) if x.ndim == 1 else (b, size)
    return [ctx.add(Reshape([total], name=ctx.name, shape=out))]


# Optimizer updates of the training domain ---------------------------------------------------------

_TRAINING = "ai.onnx.preview.training"


def _optimizer_groups(ctx: NodeContext, groups: int) -> tuple[Tensor, Tensor, list[list[Tensor]]]:
    """The learning rate ``R``, the iteration ``T`` and ``groups`` lists of n tensors each (X, G,
    then the optimizer's states), checked: floating tensors of one shape per position."""
    n_in = ctx.num_inputs - 2
    if n_in < groups or n_in % groups:
        raise ctx.invalid(f"expects R, T and {groups} groups of tensors of one count each, got {ctx.num_inputs} "
                          "inputs")
    n = n_in // groups
    lists = [[ctx.input(2 + g * n + i) for i in range(n)] for g in range(groups)]
    for i in range(n):
        x = lists[0][i]
        if x.dtype not in FLOATS or any(l[i].shape != x.shape or l[i].dtype != x.dtype for l in lists):
            raise ctx.shape_error(f"tensor group {i}: X, G and the states must share one floating type and shape, "
                                  f"got {[(str(l[i].dtype), list(l[i].shape)) for l in lists]}")
    r, t = ctx.input(0), ctx.input(1)
    if r.size != 1 or t.size != 1 or r.dtype not in FLOATS or t.dtype != "int64":
        raise ctx.shape_error(f"R must be a floating scalar and T an int64 scalar, got {r.dtype}{list(r.shape)} "
                              f"and {t.dtype}{list(t.shape)}")
    return r, t, lists


class _Emit:
    """Element-wise arithmetic on tensors and Python numbers (constants of ``dtype``), emitted as
    default-domain ONNX ops."""

    def __init__(self, ctx: NodeContext, dtype: str):
        self.ctx, self.dtype = ctx, dtype

    def op(self, op: str, *xs) -> Tensor:
        return _e(self.ctx, op, *(x if isinstance(x, Tensor) else _c(self.ctx, x, self.dtype) for x in xs))


def _optimizer_scalars(e: _Emit, r: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``R`` and ``T`` in the tensors' type (0-d), and whether ``T > 0``."""
    scalar = _c(e.ctx, [], "int64")
    rt = e.op("Reshape", e.ctx.cast(r, e.dtype), scalar)
    tt = e.op("Reshape", e.ctx.cast(t, e.dtype), scalar)
    return rt, tt, e.op("Greater", tt, 0)


@onnx_op("Adagrad", since=1, domain=_TRAINING)
def adagrad(ctx):
    """``Adagrad``: ``r = R / (1 + T decay)``, ``g = norm X + G``, ``H' = H + g^2``,
    ``X' = X - r g / (sqrt(H') + eps)``; outputs X'..., H'...."""
    r, t, (xs, gs, hs) = _optimizer_groups(ctx, 3)
    norm, decay, eps = (float(ctx.attr(a, 0.0)) for a in ("norm_coefficient", "decay_factor", "epsilon"))
    e = _Emit(ctx, xs[0].dtype)
    rt, tt, _ = _optimizer_scalars(e, r, t)
    rate = e.op("Div", rt, e.op("Add", 1, e.op("Mul", tt, decay)))
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs):
        g = e.op("Add", e.op("Mul", norm, x), g)
        h = e.op("Add", h, e.op("Mul", g, g))
        new_x.append(e.op("Sub", x, e.op("Div", e.op("Mul", rate, g), e.op("Add", e.op("Sqrt", h), eps))))
        new_h.append(h)
    return new_x + new_h


@onnx_op("Momentum", since=1, domain=_TRAINING)
def momentum(ctx):
    """``Momentum`` (``standard`` or ``nesterov``): ``g = norm X + G``, ``V' = alpha V + b g`` with
    ``b = beta`` after the first iteration (``T > 0``), else 1; ``X' = X - R V'`` (nesterov:
    ``X - R (g + alpha V')``); outputs X'..., V'...."""
    r, t, (xs, gs, vs) = _optimizer_groups(ctx, 3)
    mode = ctx.attr("mode")
    if mode not in ("standard", "nesterov"):
        raise ctx.invalid(f"mode must be 'standard' or 'nesterov', got {mode!r}")
    alpha, beta, norm = (float(ctx.attr(a)) for a in ("alpha", "beta", "norm_coefficient"))
    e = _Emit(ctx, xs[0].dtype)
    rt, _, later = _optimizer_scalars(e, r, t)
    b = e.op("Where", later, beta, 1)
    new_x, new_v = [], []
    for x, g, v in zip(xs, gs, vs):
        g = e.op("Add", e.op("Mul", norm, x), g)
        v = e.op("Add", e.op("Mul", alpha, v), e.op("Mul", b, g))
        step = v if mode == "standard" else e.op("Add", g, e.op("Mul", alpha, v))
        new_x.append(e.op("Sub", x, e.op("Mul", rt, step)))
        new_v.append(v)
    return new_x + new_v


@onnx_op("Adam", since=1, domain=_TRAINING)
def adam(ctx):
    """``Adam``: ``g = norm X + G``, ``V' = alpha V + (1 - alpha) g``, ``H' = beta H + (1 - beta)
    g^2``, ``r = R sqrt(1 - beta^T) / (1 - alpha^T)`` after the first iteration (``T > 0``), else
    ``R``; ``X' = (1 - norm_post) (X - r V' / (sqrt(H') + eps))``; outputs X'..., V'..., H'...."""
    r, t, (xs, gs, vs, hs) = _optimizer_groups(ctx, 4)
    alpha, beta, eps = (float(ctx.attr(a, d)) for a, d in (("alpha", 0.9), ("beta", 0.999), ("epsilon", 0.0)))
    norm, post = float(ctx.attr("norm_coefficient", 0.0)), float(ctx.attr("norm_coefficient_post", 0.0))
    e = _Emit(ctx, xs[0].dtype)
    rt, tt, later = _optimizer_scalars(e, r, t)
    fixed = e.op("Div", e.op("Mul", rt, e.op("Sqrt", e.op("Sub", 1, e.op("Pow", beta, tt)))),
                 e.op("Sub", 1, e.op("Pow", alpha, tt)))
    rate = e.op("Where", later, fixed, rt)
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        g = e.op("Add", e.op("Mul", norm, x), g)
        v = e.op("Add", e.op("Mul", alpha, v), e.op("Mul", 1 - alpha, g))
        h = e.op("Add", e.op("Mul", beta, h), e.op("Mul", 1 - beta, e.op("Mul", g, g)))
        x = e.op("Sub", x, e.op("Mul", rate, e.op("Div", v, e.op("Add", e.op("Sqrt", h), eps))))
        new_x.append(e.op("Mul", 1 - post, x))
        new_v.append(v)
        new_h.append(h)
    return new_x + new_v + new_h


# ai.onnx.ml: the element-wise and gathering ones ----------------------------------------------------

@onnx_op("Binarizer", since=1, domain="ai.onnx.ml")
def binarizer(ctx):
    """``Binarizer``: 1 where ``X > threshold``, else 0, in X's type."""
    x = ctx.input(0)
    if x.dtype not in ("float32", "float64", "int32", "int64"):
        raise ctx.unsupported(f"{x.dtype} inputs (float32, float64, int32 and int64 are)")
    return [ctx.cast(_e(ctx, "Greater", x, _c(ctx, ctx.attr("threshold", 0.0), x.dtype)), x.dtype)]


@onnx_op("ArrayFeatureExtractor", since=1, domain="ai.onnx.ml")
def array_feature_extractor(ctx):
    """``ArrayFeatureExtractor``: the entries of X's last axis at ``Y`` (flattened), as onnxruntime and
    the reference lay it out: ``[..., len(Y)]``, ``[1, len(Y)]`` for a 1-D X."""
    x, idx = ctx.input(0), ctx.input(1)
    if idx.dtype != "int64":
        raise ctx.invalid(f"Y must be int64, got {idx.dtype}")
    if x.ndim == 0 or idx.size == 0:
        raise ctx.shape_error(f"X {list(x.shape)} and Y {list(idx.shape)}: a non-scalar X and some indices needed")
    picked = _e(ctx, "Gather", x, _e(ctx, "Reshape", idx, _c(ctx, [-1], "int64")), axis=x.ndim - 1)
    shape = (1, idx.size) if x.ndim == 1 else x.shape[:-1] + (idx.size,)
    return [_e(ctx, "Reshape", picked, _c(ctx, shape, "int64"))]
