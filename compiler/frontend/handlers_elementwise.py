"""Handlers for element-wise ONNX ops: math, logic, comparison, bitwise, activations, casts."""
from __future__ import annotations

import numpy as np

from ..ir.expr import numpy_type
from ..ir.graph import Tensor
from ..ops.elementwise import Activation, BitCast, Binary, CastOp, Clip, Identity, Unary, Where
from ..ops.random import Random
from .handlers_random import random_key
from .registry import FLOATS, EmptyOptional, NodeContext, TensorSeq, onnx_dtype, onnx_op


_UNARY = {
    "Neg": "neg", "Abs": "abs", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Sin": "sin", "Cos": "cos",
    "Tan": "tan", "Asin": "asin", "Acos": "acos", "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh", "Tanh": "tanh",
    "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh", "Erf": "erf", "Floor": "floor", "Ceil": "ceil",
    "Round": "round", "Sign": "sign", "Not": "not", "BitwiseNot": "bitnot", "IsNaN": "isnan",
    "Reciprocal": "reciprocal",
}
_UNARY_SINCE = {"BitwiseNot": 18, "Round": 11, "Sign": 9, "IsNaN": 9, "Erf": 9, "Asinh": 9, "Acosh": 9,
                "Atanh": 9, "Sinh": 9, "Cosh": 9, "Sin": 7, "Cos": 7, "Tan": 7, "Asin": 7, "Acos": 7, "Atan": 7}

_BINARY = {
    "Add": "add", "Sub": "sub", "Mul": "mul", "Pow": "pow", "And": "and", "Or": "or", "Xor": "xor",
    "Less": "lt", "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge", "Equal": "eq",
    "BitwiseAnd": "bitand", "BitwiseOr": "bitor", "BitwiseXor": "bitxor",
}
_BINARY_SINCE = {"LessOrEqual": 12, "GreaterOrEqual": 12, "BitwiseAnd": 18, "BitwiseOr": 18, "BitwiseXor": 18}


def _check_broadcast(ctx):
    # Opsets before 7 used an explicit `broadcast` attribute with different semantics.
    if ctx.opset < 7 and ctx.flag("broadcast", 0):
        raise ctx.unsupported("legacy broadcast attribute (opset < 7)")


def _unary_handler(fn):
    def handler(ctx):
        return [ctx.add(Unary([ctx.input(0)], name=ctx.name, fn=fn))]
    return handler


def _binary_handler(fn):
    def handler(ctx):
        _check_broadcast(ctx)
        a, b = ctx.input(0), ctx.input(1)
        if a.dtype != b.dtype:
            raise ctx.invalid(f"inputs have different dtypes ({a.dtype}, {b.dtype})")
        return [ctx.add(Binary([a, b], name=ctx.name, fn=fn))]
    return handler


for _op, _fn in _UNARY.items():
    onnx_op(_op, since=_UNARY_SINCE.get(_op, 1))(_unary_handler(_fn))
for _op, _fn in _BINARY.items():
    onnx_op(_op, since=_BINARY_SINCE.get(_op, 1))(_binary_handler(_fn))


@onnx_op("Pow", since=7)
def pow_(ctx):
    a, b = ctx.input(0), ctx.input(1)
    if a.dtype not in FLOATS and b.dtype in FLOATS:
        # an integer base to a float power (3 ** 0.5): the power in float64, truncated to the base's type,
        # as the reference computes it (np.power(a, b).astype(a.dtype)), not the exponent truncated first
        a64 = ctx.add(CastOp([a], name=ctx.name + "/cast_base", to="float64"))
        b64 = ctx.add(CastOp([b], name=ctx.name + "/cast_exp", to="float64"))
        y = ctx.add(Binary([a64, b64], name=ctx.name + "/pow", fn="pow"))
        return [ctx.add(CastOp([y], name=ctx.name, to=a.dtype))]
    if b.dtype != a.dtype:  # Pow allows a different exponent type; compute in the base's type
        b = ctx.add(CastOp([b], name=ctx.name + "/cast_exp", to=a.dtype))
    return [ctx.add(Binary([a, b], name=ctx.name, fn="pow"))]


@onnx_op("Div")
def div(ctx):
    _check_broadcast(ctx)
    a, b = ctx.input(0), ctx.input(1)
    fn = "div" if a.dtype in FLOATS else "truncdiv"
    return [ctx.add(Binary([a, b], name=ctx.name, fn=fn))]


@onnx_op("Mod", since=10)
def mod(ctx):
    fmod = ctx.flag("fmod", 0)
    a = ctx.input(0)
    if a.dtype in FLOATS and not fmod and ctx.opset < 28:  # opset 28 defines the floored modulo of floats
        raise ctx.invalid("fmod must be 1 for floating-point inputs before opset 28")
    return [ctx.add(Binary([a, ctx.input(1)], name=ctx.name, fn="fmod" if fmod else "mod"))]


@onnx_op("BitShift", since=11)
def bitshift(ctx):
    d = ctx.attr("direction")
    if d not in ("LEFT", "RIGHT"):
        raise ctx.invalid(f"direction must be LEFT or RIGHT, got {d!r}")
    return [ctx.add(Binary([ctx.input(0), ctx.input(1)], name=ctx.name, fn="shl" if d == "LEFT" else "shr"))]


@onnx_op("IsInf", since=10)
def isinf(ctx):
    pos, neg = ctx.flag("detect_positive", 1), ctx.flag("detect_negative", 1)
    fn = {(1, 1): "isinf", (1, 0): "isposinf", (0, 1): "isneginf"}.get((pos, neg))
    x = ctx.input(0)
    if fn is None:  # detects nothing: all False
        y = ctx.add(Unary([x], name=ctx.name + "/isnan", fn="isnan"))
        return [ctx.add(Binary([y, ctx.constant(False)], name=ctx.name, fn="and"))]
    return [ctx.add(Unary([x], name=ctx.name, fn=fn))]


def _variadic(fn):
    def handler(ctx):
        ins = [t for t in ctx.inputs if t is not None]
        if not ins:
            raise ctx.invalid("needs at least one input")
        acc = ins[0]
        for k, t in enumerate(ins[1:]):
            acc = ctx.add(Binary([acc, t], name=f"{ctx.name}/{k}" if k < len(ins) - 2 else ctx.name, fn=fn))
        if len(ins) == 1:
            acc = ctx.add(Identity([acc], name=ctx.name))
        return [acc]
    return handler


onnx_op("Sum", since=8)(_variadic("add"))
onnx_op("Max", since=8)(_variadic("max"))
onnx_op("Min", since=8)(_variadic("min"))


@onnx_op("Mean", since=8)
def mean(ctx):
    total = _variadic("add")(ctx)[0]
    n = sum(t is not None for t in ctx.inputs)
    return [ctx.add(Binary([total, ctx.constant(np.asarray(n, total.dtype))], name=ctx.name + "/mean", fn="div"))]


def _activation(kind, **defaults):
    def handler(ctx):
        x = ctx.input(0)
        if x.dtype not in FLOATS:
            raise ctx.unsupported(f"dtype {x.dtype}")
        params = {k: float(ctx.attr(k, v)) for k, v in defaults.items()}
        return [ctx.add(Activation([x], name=ctx.name, kind=kind, **params))]
    return handler


onnx_op("Relu", since=6)(_activation("relu"))
onnx_op("LeakyRelu", since=6)(_activation("leaky_relu", alpha=0.01))
onnx_op("Elu", since=6)(_activation("elu", alpha=1.0))
onnx_op("Selu", since=6)(_activation("selu", alpha=1.67326319217681884765625, gamma=1.05070102214813232421875))
onnx_op("Celu", since=12)(_activation("celu", alpha=1.0))
onnx_op("Sigmoid", since=6)(_activation("sigmoid"))
onnx_op("HardSigmoid", since=6)(_activation("hard_sigmoid", alpha=0.2, beta=0.5))
onnx_op("HardSwish", since=14)(_activation("hard_swish"))
onnx_op("Softplus", since=1)(_activation("softplus"))
onnx_op("Softsign", since=1)(_activation("softsign"))
onnx_op("Mish", since=18)(_activation("mish"))
onnx_op("ThresholdedRelu", since=10)(_activation("thresholded_relu", alpha=1.0))
onnx_op("Shrink", since=9)(_activation("shrink", lambd=0.5, bias=0.0))


@onnx_op("Relu", since=14)
def relu14(ctx):
    x = ctx.input(0)
    if x.dtype in FLOATS:
        return _activation("relu")(ctx)
    return [ctx.add(Binary([x, ctx.constant(np.zeros((), x.dtype))], name=ctx.name, fn="max"))]


@onnx_op("Gelu", since=20)
def gelu(ctx):
    approx = ctx.attr("approximate", "none")
    if approx not in ("none", "tanh"):
        raise ctx.invalid(f"approximate must be 'none' or 'tanh', got {approx!r}")
    return _activation("gelu" if approx == "none" else "gelu_tanh")(ctx)


def swish(ctx: NodeContext, x: Tensor, alpha: float, name: str) -> Tensor:
    """Add ``x * sigmoid(alpha * x)`` (ONNX Swish, the gate of SwiGLU) to the graph as Mul, Sigmoid, Mul;
    ``name`` names the final op. Floating-point ``x`` only."""
    if x.dtype not in FLOATS:
        raise ctx.unsupported(f"dtype {x.dtype}")
    scaled = x
    if alpha != 1.0:
        scaled = ctx.add(Binary([x, ctx.constant(np.asarray(alpha, x.dtype))], name=name + "/scaled", fn="mul"))
    gate = ctx.add(Activation([scaled], name=name + "/sigmoid", kind="sigmoid"))
    return ctx.add(Binary([x, gate], name=name, fn="mul"))


@onnx_op("Swish", since=24)
def swish24(ctx):
    return [swish(ctx, ctx.input(0), float(ctx.attr("alpha", 1.0)), ctx.name)]


@onnx_op("PRelu", since=7)
def prelu(ctx):
    x, slope = ctx.input(0), ctx.input(1)
    zero = ctx.constant(np.zeros((), x.dtype))
    neg = ctx.add(Binary([x, slope], name=ctx.name + "/scaled", fn="mul"))
    cond = ctx.add(Binary([x, zero], name=ctx.name + "/negative", fn="lt"))
    return [ctx.add(Where([cond, neg, x], name=ctx.name))]


@onnx_op("Cast", since=6)
def cast(ctx):
    to = onnx_dtype(ctx.attr("to"), f"node {ctx.name} attribute 'to'")
    return [cast_op(ctx, ctx.input(0), to)]


def cast_op(ctx: NodeContext, x: Tensor, to: str) -> Tensor:
    """``x`` cast to ``to`` by a CastOp named after the node; to a float8 type with the node's
    ``saturate`` (default 1)."""
    extra = {"saturate": ctx.flag("saturate", 1)} if to.startswith("float8") else {}
    return ctx.add(CastOp([x], name=ctx.name, to=to, **extra))


@onnx_op("BitCast", since=26)
def bitcast(ctx):
    to = onnx_dtype(ctx.attr("to"), f"node {ctx.name} attribute 'to'")
    x = ctx.input(0)
    width, src = numpy_type(to).itemsize, numpy_type(x.dtype).itemsize
    if width != src:
        raise ctx.invalid(f"'to' = {to} is not as wide as the input's {x.dtype} ({width} and {src} bytes)")
    return [ctx.add(BitCast([x], name=ctx.name, to=to))]


@onnx_op("CastLike", since=15)
def castlike(ctx):
    return [cast_op(ctx, ctx.input(0), ctx.input(1).dtype)]


@onnx_op("Where", since=9)
def where(ctx):
    return [ctx.add(Where([ctx.input(0), ctx.input(1), ctx.input(2)], name=ctx.name))]


@onnx_op("Clip", since=6, until=10)
def clip6(ctx):
    return [ctx.add(Clip([ctx.input(0)], name=ctx.name, lo=float(ctx.attr("min", -3.4028234663852886e38)),
                         hi=float(ctx.attr("max", 3.4028234663852886e38))))]


@onnx_op("Clip", since=11)
def clip11(ctx):
    lo = ctx.const(1, None)
    hi = ctx.const(2, None)
    return [ctx.add(Clip([ctx.input(0)], name=ctx.name, lo=None if lo is None else lo.item(),
                         hi=None if hi is None else hi.item()))]


@onnx_op("Identity")
def identity(ctx):
    if isinstance(ctx.input(0), (TensorSeq, EmptyOptional)):  # (a sequence or an empty optional: itself)
        return [ctx.input(0)]
    return [ctx.add(Identity([ctx.input(0)], name=ctx.name))]


@onnx_op("Dropout")
def dropout(ctx):
    """Inference: the identity (a mask of ones). Training mode (``training_mode`` true, a constant)
    with a ratio ``r`` > 0: ``x / (1 - r)`` where a Bernoulli mask of ``1 - r`` keeps it, else 0; the
    mask from the random ops' generator (handlers_random.py: new every run; seeded by the node's
    ``seed`` or its output's name)."""
    x = ctx.input(0)
    keep_mask = len(ctx.node.output) > 1 and ctx.node.output[1]
    if ctx.has_input(2) and bool(np.asarray(ctx.const(2)).item()):
        ratio = float(np.asarray(ctx.const(1)).item()) if ctx.has_input(1) else 0.5
        if not 0 <= ratio < 1:
            raise ctx.invalid(f"ratio {ratio} is outside [0, 1)")
        if ratio > 0:
            if x.dtype not in FLOATS:
                raise ctx.invalid(f"training mode needs a float input, got {x.dtype}")
            mask = ctx.add(Random([ctx.rng_step()], name=f"{ctx.name}/mask", kind="bernoulli", shape=x.shape,
                                  dtype="bool", key=random_key(ctx), p=1.0 - ratio))
            scaled = ctx.add(Binary([x, ctx.constant(np.asarray(1.0 / (1.0 - ratio), numpy_type(x.dtype)))],
                                    name=f"{ctx.name}/scaled", fn="mul"))
            y = ctx.add(Where([mask, scaled, ctx.constant(np.zeros((), numpy_type(x.dtype)))], name=ctx.name))
            return [y, mask] if keep_mask else [y]
    y = ctx.add(Identity([x], name=ctx.name))
    if keep_mask:
        return [y, ctx.constant(np.ones(x.shape, bool))]
    return [y]
