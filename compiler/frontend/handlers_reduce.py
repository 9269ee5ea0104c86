"""Handlers for reductions, arg-reductions, the softmax family, CumSum, CumProd, TopK and normalizations."""
from __future__ import annotations

from typing import Iterable

import numpy as np

from ..ops.norm import LRN, BatchNorm, GroupNorm, InstanceNorm, LayerNorm, LpNorm, MeanVarianceNorm, RMSNorm
from ..ops.reduce import ArgReduce, CumProd, CumSum, Hardmax, Reduce, Softmax, TopK
from .registry import FLOATS, NodeContext, onnx_dtype, onnx_op



def _axis(ctx: NodeContext, a, rank: int, what: str = "axis") -> int:
    """``a`` as a non-negative axis of a rank-``rank`` tensor, or a typed error."""
    try:
        a = int(a)
    except (TypeError, ValueError):
        raise ctx.invalid(f"{what} must be an integer, got {a!r}") from None
    if not -rank <= a < rank:
        raise ctx.invalid(f"{what} {a} is out of range for an input of rank {rank}")
    return a % rank


def _axes(ctx: NodeContext, axes: Iterable, rank: int) -> tuple[int, ...]:
    res = [_axis(ctx, a, rank, "axes entry") for a in axes]
    if len(set(res)) != len(res):
        raise ctx.invalid(f"axes {list(axes)} name an axis twice")
    return tuple(sorted(res))


def _require_float(ctx: NodeContext, *tensors) -> None:
    for t in tensors:
        if t.dtype not in FLOATS:
            raise ctx.unsupported(f"dtype {t.dtype} (expected a floating-point input)")


def _stash(ctx: NodeContext) -> str:
    st = onnx_dtype(ctx.attr("stash_type", 1), f"node {ctx.name} attribute 'stash_type'")
    if st not in FLOATS:
        raise ctx.invalid(f"stash_type must be a floating-point type, got {st}")
    return st


def _stage_one(stash: str, x_dtype: str) -> str:
    """The type a normalization's statistics are computed in: ``stash_type``, widened to the input's
    type where that is wider (a float64 input's default stash_type, float32, would lose its precision:
    onnxruntime and onnx's reference compute such an input in float64 too), float32 for the other half
    type."""
    if stash == x_dtype:
        return stash
    return "float64" if "float64" in (stash, x_dtype) else "float32"


def _wants_output(ctx: NodeContext, k: int) -> bool:
    return len(ctx.node.output) > k and bool(ctx.node.output[k])


# Reduce* ----------------------------------------------------------------------------------------

_REDUCE = {"ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "max", "ReduceMin": "min", "ReduceProd": "prod",
           "ReduceSumSquare": "sum_square", "ReduceL1": "l1", "ReduceL2": "l2", "ReduceLogSum": "log_sum",
           "ReduceLogSumExp": "log_sum_exp"}


def _reduce_handler(kind: str, axes_as_input: bool):
    def handler(ctx):
        x = ctx.input(0)
        if x.dtype == "bool" and kind not in ("max", "min"):
            raise ctx.invalid("bool input (only ReduceMax and ReduceMin take bool)")
        if kind in ("log_sum", "log_sum_exp") and x.dtype not in FLOATS:
            raise ctx.unsupported(f"dtype {x.dtype} (the log of an integer reduction)")
        if axes_as_input:
            axes = ctx.const(1, None)
            if axes is not None:
                axes = np.asarray(axes).reshape(-1).tolist()
            noop = ctx.flag("noop_with_empty_axes", 0)
        else:
            axes, noop = ctx.attr("axes", None), False
        if not axes:
            axes = () if noop else range(x.ndim)
        keepdims = ctx.flag("keepdims", 1)
        return [ctx.add(Reduce([x], name=ctx.name, kind=kind, axes=_axes(ctx, axes, x.ndim), keepdims=keepdims))]
    return handler


for _op, _kind in _REDUCE.items():
    _since = 13 if _op == "ReduceSum" else 18
    onnx_op(_op, since=1, until=_since - 1)(_reduce_handler(_kind, False))
    onnx_op(_op, since=_since)(_reduce_handler(_kind, True))


# ArgMax / ArgMin --------------------------------------------------------------------------------

def _arg_handler(kind: str):
    def handler(ctx):
        x = ctx.input(0)
        if x.dtype == "bool":
            raise ctx.invalid("bool input")
        axis = _axis(ctx, ctx.attr("axis", 0), x.ndim)
        if x.shape[axis] == 0:
            raise ctx.shape_error(f"axis {axis} has extent 0: the {kind} of an empty set is undefined")
        last = ctx.flag("select_last_index", 0) if ctx.opset >= 12 else False
        return [ctx.add(ArgReduce([x], name=ctx.name, kind=kind, axis=axis, keepdims=ctx.flag("keepdims", 1),
                                  select_last=last))]
    return handler


onnx_op("ArgMax")(_arg_handler("argmax"))
onnx_op("ArgMin")(_arg_handler("argmin"))


# Softmax family ---------------------------------------------------------------------------------

def _softmax_axes(ctx: NodeContext, x) -> tuple[int, ...]:
    """One axis from opset 13 on; before, the input is coerced to 2-D at ``axis`` (default 1)."""
    if x.ndim == 0:
        raise ctx.invalid("input is a scalar; it has no axis to normalize")
    if ctx.opset >= 13:
        return (_axis(ctx, ctx.attr("axis", -1), x.ndim),)
    return tuple(range(_axis(ctx, ctx.attr("axis", 1), x.ndim), x.ndim))


def _softmax_handler(log: bool):
    def handler(ctx):
        x = ctx.input(0)
        _require_float(ctx, x)
        return [ctx.add(Softmax([x], name=ctx.name, axes=_softmax_axes(ctx, x), log=log))]
    return handler


onnx_op("Softmax")(_softmax_handler(False))
onnx_op("LogSoftmax")(_softmax_handler(True))


@onnx_op("Hardmax")
def hardmax(ctx):
    x = ctx.input(0)
    _require_float(ctx, x)
    return [ctx.add(Hardmax([x], name=ctx.name, axes=_softmax_axes(ctx, x)))]


# CumSum, TopK -----------------------------------------------------------------------------------

def _cumulative_handler(cls):
    """CumSum (opset 11+) and CumProd (opset 26+): ``axis`` is a constant scalar input."""
    def handler(ctx):
        x = ctx.input(0)
        if x.dtype == "bool":
            raise ctx.invalid("bool input")
        axis = np.asarray(ctx.const(1))
        if axis.size != 1 or axis.dtype.kind not in "iu":
            raise ctx.invalid(f"axis must be one integer, got {axis.tolist()!r}")
        return [ctx.add(cls([x], name=ctx.name, axis=_axis(ctx, axis.item(), x.ndim),
                            exclusive=ctx.flag("exclusive", 0), reverse=ctx.flag("reverse", 0)))]
    return handler


onnx_op("CumSum", since=11)(_cumulative_handler(CumSum))
onnx_op("CumProd", since=26)(_cumulative_handler(CumProd))


@onnx_op("TopK")
def topk(ctx):
    x = ctx.input(0)
    if ctx.opset >= 10:
        k = np.asarray(ctx.const(1))
        if k.size != 1 or k.dtype.kind not in "iu":
            raise ctx.invalid(f"K must be one integer, got {k.tolist()!r}")
        k = int(k.item())
    else:
        k = int(ctx.attr("k"))
    axis = _axis(ctx, ctx.attr("axis", -1), x.ndim)
    if k < 0:
        raise ctx.invalid(f"K must be non-negative, got {k}")
    if k > x.shape[axis]:
        raise ctx.shape_error(f"K={k} exceeds the extent {x.shape[axis]} of axis {axis}")
    largest = ctx.flag("largest", 1) if ctx.opset >= 11 else True
    op = TopK([x], name=ctx.name, k=k, axis=axis, largest=largest)
    ctx.add(op)
    return op.outputs


# Normalizations ---------------------------------------------------------------------------------

@onnx_op("LayerNormalization", since=17)
def layer_normalization(ctx):
    x, scale = ctx.input(0), ctx.input(1)
    _require_float(ctx, x)
    if x.ndim == 0:
        raise ctx.invalid("input is a scalar")
    axis = _axis(ctx, ctx.attr("axis", -1), x.ndim)
    stats = _wants_output(ctx, 1) or _wants_output(ctx, 2)
    ins = [x, scale] + ([ctx.input(2)] if ctx.has_input(2) else [])
    stash = _stash(ctx)
    op = LayerNorm(ins, name=ctx.name, axis=axis, epsilon=float(ctx.attr("epsilon", 1e-5)),
                   stash=_stage_one(stash, x.dtype), stats=stats)
    ctx.add(op)
    if len(op.outputs) == 1 or op.outputs[1].dtype == stash:
        return op.outputs
    # the statistics are outputs of type stash_type, computed wider
    return [op.outputs[0]] + [ctx.emit("Cast", [t], 19, to=ctx.attr("stash_type", 1)) for t in op.outputs[1:]]


@onnx_op("RMSNormalization", since=23)
def rms_normalization(ctx):
    x = ctx.input(0)
    _require_float(ctx, x)
    if x.ndim == 0:
        raise ctx.invalid("input is a scalar")
    axis = _axis(ctx, ctx.attr("axis", -1), x.ndim)
    return [ctx.add(RMSNorm([x, ctx.input(1)], name=ctx.name, axis=axis, epsilon=float(ctx.attr("epsilon", 1e-5)),
                            stash=_stage_one(_stash(ctx), x.dtype)))]


@onnx_op("BatchNormalization")
def batch_normalization(ctx):
    x = ctx.input(0)
    _require_float(ctx, x)
    if ctx.opset >= 14:
        training = ctx.flag("training_mode", 0)
    elif ctx.opset >= 7:
        training = any(_wants_output(ctx, k) for k in range(1, 5))
    else:
        training = not ctx.flag("is_test", 0) or any(_wants_output(ctx, k) for k in range(1, 5))
    if training and ctx.opset < 14:
        raise ctx.unsupported("training mode before opset 14 (its saved-statistics outputs)")
    if x.ndim < 2:
        raise ctx.shape_error(f"input of shape {x.shape} has no channel dim")
    params = [ctx.input(k) for k in range(1, 5)]
    if ctx.opset < 9 and ctx.flag("spatial", 1) == 0:
        want = x.shape[1:]
    else:
        want = (x.shape[1],)
    for name, t in zip(("scale", "B", "input_mean", "input_var"), params):
        if t.shape != want:
            raise ctx.shape_error(f"{name} has shape {t.shape}; expected {want} for an input of shape {x.shape}")
    if training:
        return _batch_norm_training(ctx, x, *params)
    return [ctx.add(BatchNorm([x] + params, name=ctx.name, epsilon=float(ctx.attr("epsilon", 1e-5))))]


def _batch_norm_training(ctx: NodeContext, x, scale, bias, mean, var) -> list:
    """Training mode (opset 14+): normalize with the batch's mean and population variance per
    channel, and return the running statistics updated with ``momentum`` (as the ONNX reference)."""
    axes = [a for a in range(x.ndim) if a != 1]
    batch_mean = ctx.emit("ReduceMean", [x], 13, axes=axes, keepdims=0)
    per_channel = ctx.constant(np.array([x.shape[1]] + [1] * (x.ndim - 2), np.int64))
    centered = ctx.emit("Sub", [x, ctx.emit("Reshape", [batch_mean, per_channel], 13)], 13)
    batch_var = ctx.emit("ReduceMean", [ctx.emit("Mul", [centered, centered], 13)], 13, axes=axes, keepdims=0)
    y = ctx.add(BatchNorm([x, scale, bias, batch_mean, batch_var], name=ctx.name,
                          epsilon=float(ctx.attr("epsilon", 1e-5))))
    momentum = float(ctx.attr("momentum", 0.9))

    def running(old, new):
        kept = ctx.emit("Mul", [old, ctx.constant(np.asarray(momentum, x.dtype))], 13)
        return ctx.emit("Add", [kept, ctx.emit("Mul", [new, ctx.constant(np.asarray(1 - momentum, x.dtype))], 13)],
                        13)

    return [y, running(mean, batch_mean), running(var, batch_var)]


@onnx_op("InstanceNormalization")
def instance_normalization(ctx):
    x = ctx.input(0)
    _require_float(ctx, x)
    return [ctx.add(InstanceNorm([x, ctx.input(1), ctx.input(2)], name=ctx.name,
                                 epsilon=float(ctx.attr("epsilon", 1e-5))))]


@onnx_op("GroupNormalization", since=18)
def group_normalization(ctx):
    """Opset 18: scale and bias per group, computed in the input dtype; opset 21: per channel,
    computed in ``stash_type``."""
    x = ctx.input(0)
    _require_float(ctx, x)
    groups = int(ctx.attr("num_groups"))
    if groups < 1:
        raise ctx.invalid(f"num_groups must be positive, got {groups}")
    per_channel = ctx.opset >= 21
    stash = _stage_one(_stash(ctx), x.dtype) if per_channel else x.dtype
    eps = float(ctx.attr("epsilon", 1e-5))
    scale, bias = ctx.input(1), ctx.input(2)
    if not per_channel or x.ndim < 2 or x.shape[1] % groups or (x.shape[1],) != scale.shape or \
            (x.shape[1],) != bias.shape:
        # the op checks its operands and names what is wrong (opset 18's per-group form: onnx's checker
        # refuses it as deprecated before this)
        return [ctx.add(GroupNorm([x, scale, bias], name=ctx.name, groups=groups, epsilon=eps, stash=stash,
                                  per_channel=per_channel))]
    # as a LayerNorm over each group, [N, G, C/G * spatial] (GroupNorm's own definition computes the
    # group's statistics again for every channel of it: 3.4x onnxruntime's time on a diffusion UNet's
    # 320 x 64 x 64, 0.16x as a LayerNorm), then the per-channel affine: the same operations in the same
    # order
    n, c = x.shape[:2]
    rows = ctx.emit("Reshape", [x, ctx.constant(np.array([n, groups, x.size // max(n * groups, 1)], np.int64))], 14)
    normed = ctx.add(LayerNorm([rows, ctx.constant(np.ones(1, x.dtype))], name=f"{ctx.name}/normalize", axis=2,
                               epsilon=eps, stash=stash))
    y = ctx.emit("Reshape", [normed, ctx.constant(np.array(x.shape, np.int64))], 14)
    shape = ctx.constant(np.array((c,) + (1,) * (x.ndim - 2), np.int64))
    y = ctx.emit("Mul", [y, ctx.emit("Reshape", [scale, shape], 14)], 14)
    return [ctx.emit("Add", [y, ctx.emit("Reshape", [bias, shape], 14)], 14)]


@onnx_op("LpNormalization")
def lp_normalization(ctx):
    x = ctx.input(0)
    _require_float(ctx, x)
    p = int(ctx.attr("p", 2))
    if p not in (1, 2):
        raise ctx.invalid(f"p must be 1 or 2, got {p}")
    return [ctx.add(LpNorm([x], name=ctx.name, axis=_axis(ctx, ctx.attr("axis", -1), x.ndim), p=p))]


@onnx_op("MeanVarianceNormalization", since=9)
def mean_variance_normalization(ctx):
    x = ctx.input(0)
    _require_float(ctx, x)
    axes = _axes(ctx, ctx.attr("axes", [0, 2, 3]), x.ndim)
    return [ctx.add(MeanVarianceNorm([x], name=ctx.name, axes=axes))]


@onnx_op("LRN")
def lrn(ctx):
    x = ctx.input(0)
    _require_float(ctx, x)
    size = int(ctx.attr("size"))
    if size < 1:
        raise ctx.invalid(f"size must be positive, got {size}")
    if x.ndim < 2:
        raise ctx.shape_error(f"input of shape {x.shape} has no channel dim")
    return [ctx.add(LRN([x], name=ctx.name, size=size, alpha=float(ctx.attr("alpha", 1e-4)),
                        beta=float(ctx.attr("beta", 0.75)), bias=float(ctx.attr("bias", 1.0))))]
