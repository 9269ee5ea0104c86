"""Handlers for linear quantization: ``QuantizeLinear``, ``DequantizeLinear``, ``ConvInteger`` and
``QLinearConv``.

Both are composed from the elementwise ops the other handlers build (``Cast``, ``Sub``, ``Mul``,
``Div``, ``Round``, ``Add``, ``Clip``), so they get compute definitions, sharding rules and
kernels like any elementwise chain, and a dequantized constant weight is folded at import:

* ``DequantizeLinear``: ``y = (float32(x) - float32(zero_point)) * scale``, in float32, cast to
  the scale's type (or ``output_dtype``);
* ``QuantizeLinear``: ``y = clip(round_half_even(x / scale) + zero_point, qmin, qmax)``, the
  division in the wider of the input and scale types (or ``precision``), the result in the zero
  point's type (or ``output_dtype``, default uint8); saturating as onnxruntime does (infinities
  and values past the int32 range to the nearer end; NaN to ``qmin`` on x86; the ONNX reference
  evaluator casts to int32 first and gets ``qmin`` for all of them).

* ``ConvInteger``: an int32 ``Conv`` of ``int32(x) - x_zero_point`` and ``int32(w) - w_zero_point``
  (the weight's zero point one value or one per output channel), padding with zeros after the
  shift, as the ONNX reference computes it;
* ``QLinearConv``: that int32 convolution plus the int32 bias ``B`` (added after it), times
  ``x_scale * w_scale / y_scale`` (formed in the scales' type, ``w_scale`` one value or one per
  output channel) in float64, rounded half to even, plus ``y_zero_point``, clipped to the output
  type's range (that of ``y_zero_point``).

Scales and zero points are per tensor (one value), per axis (a vector along ``axis``) or blocked
(``block_size`` consecutive entries along ``axis`` share one; opset 21+), as the ONNX reference
computes them. The element types are those Shardflow has (8-, 16- and 32-bit integers); 2-, 4-,
6- and 8-bit float types raise :class:`~shardflow.compiler.errors.DtypeError` at import.
"""
from __future__ import annotations

import numpy as np

from ..ir.graph import Tensor
from ..ops.conv import Conv
from .handlers_elementwise import cast_op
from .handlers_linalg import _conv_operands, _forward_pads
from .registry import NodeContext, onnx_dtype, onnx_op

_OPSET = 13  # of the elementwise nodes emitted
#: the scale (and dequantized output) types: float16 and bfloat16 computed in float32
_SCALES = ("float32", "float16", "bfloat16")
_RANGES = {"uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535), "int16": (-32768, 32767)}


def _spread(ctx: NodeContext, v: Tensor, x: Tensor, axis: int, block: int, what: str) -> Tensor:
    """``v`` (a scale or zero point) broadcastable against ``x``: one value as is, a vector along
    ``axis``, or with ``block_size`` > 0 each entry repeated over its block along ``axis``."""
    if v.size == 1:
        return v if v.ndim == 0 else ctx.emit("Reshape", [v, ctx.constant(np.array([], np.int64))], _OPSET)
    if not -x.ndim <= axis < x.ndim:  # the axis matters only here, not for one value
        raise ctx.invalid(f"axis {axis} is out of range for an input of rank {x.ndim}")
    axis %= x.ndim
    if not block:
        if v.ndim != 1 or v.shape[0] != x.shape[axis]:
            raise ctx.shape_error(f"{what} of shape {list(v.shape)} is neither one value nor a vector of the "
                                  f"{x.shape[axis]} entries of axis {axis} of the input {list(x.shape)}")
        dims = [1] * x.ndim
        dims[axis] = v.shape[0]
        return ctx.emit("Reshape", [v, ctx.constant(np.array(dims, np.int64))], _OPSET)
    if block < 0:
        raise ctx.invalid(f"block_size must be positive, got {block}")
    want = list(x.shape)
    want[axis] = -(-x.shape[axis] // block)
    if list(v.shape) != want:
        raise ctx.shape_error(f"{what} of shape {list(v.shape)} does not block the input {list(x.shape)} by "
                              f"{block} along axis {axis} (expected {want})")
    rows = ctx.constant(np.arange(x.shape[axis], dtype=np.int64) // block)
    return ctx.emit("Gather", [v, rows], _OPSET, axis=axis)


def _layout(ctx: NodeContext) -> tuple[Tensor, int, int]:
    return ctx.input(0), int(ctx.attr("axis", 1)), int(ctx.attr("block_size", 0))


def _attr_dtype(ctx: NodeContext, name: str) -> str | None:
    code = int(ctx.attr(name, 0))
    return onnx_dtype(code, f"node {ctx.name} attribute {name!r}") if code else None


@onnx_op("DequantizeLinear", since=10)
def dequantize_linear(ctx):
    x, axis, block = _layout(ctx)
    scale = ctx.input(1)
    if x.dtype not in ("int8", "uint8", "int16", "uint16", "int32") and not x.dtype.startswith("float8"):
        raise ctx.unsupported(f"quantized input type {x.dtype}")
    out = _attr_dtype(ctx, "output_dtype") or scale.dtype
    if scale.dtype not in _SCALES or out not in _SCALES:
        raise ctx.unsupported(f"scale type {scale.dtype} with output type {out} ({', '.join(_SCALES)} are)")
    y = ctx.cast(x, "float32")
    if ctx.has_input(2):
        zp = ctx.input(2)
        if zp.dtype != x.dtype:
            raise ctx.invalid(f"the zero point's type {zp.dtype} differs from the input's {x.dtype}")
        y = ctx.emit("Sub", [y, ctx.cast(_spread(ctx, zp, x, axis, block, "the zero point"), "float32")], _OPSET)
    y = ctx.emit("Mul", [y, ctx.cast(_spread(ctx, scale, x, axis, block, "the scale"), "float32")], _OPSET)
    return [ctx.cast(y, out)]


@onnx_op("QuantizeLinear", since=10)
def quantize_linear(ctx):
    x, axis, block = _layout(ctx)
    scale = ctx.input(1)
    out = _attr_dtype(ctx, "output_dtype")
    if ctx.has_input(2):
        if out and out != ctx.input(2).dtype:
            raise ctx.invalid(f"output_dtype {out} differs from the zero point's type {ctx.input(2).dtype}")
        out = ctx.input(2).dtype
    out = out or "uint8"
    if out not in _RANGES and not out.startswith("float8"):
        raise ctx.unsupported(f"quantized output type {out} ({sorted(_RANGES)} and the float8 types are)")
    div = _attr_dtype(ctx, "precision") or ("float32" if "bfloat16" in (x.dtype, scale.dtype) else
                                            str(np.result_type(np.dtype(x.dtype), np.dtype(scale.dtype))))
    if div not in ("float32", "float16", "float64"):
        raise ctx.unsupported(f"a division in {div}")
    q = ctx.emit("Div", [ctx.cast(x, div), ctx.cast(_spread(ctx, scale, x, axis, block, "the scale"), div)],
                 _OPSET)
    zp = _spread(ctx, ctx.input(2), x, axis, block, "the zero point") if ctx.has_input(2) else None
    if out.startswith("float8"):  # rounded (to nearest even) and saturated by the cast itself
        # (a float8 zero point must be zero, and the reference leaves it out: a constant one is
        # checked and not added, which keeps -0.0 negative as the reference does)
        if zp is not None and zp.is_constant:
            if np.any(np.asarray(zp.value).astype(np.float32) != 0):
                raise ctx.invalid("a float8 zero point must be zero")
        elif zp is not None:
            q = ctx.emit("Add", [q, ctx.cast(zp, div)], _OPSET)
        return [cast_op(ctx, q, out)]
    return [_saturate(ctx, ctx.emit("Round", [q], _OPSET), zp, out)]


def _saturate(ctx: NodeContext, r: Tensor, zp: Tensor | None, out: str) -> Tensor:
    """``clip(r + zp, qmin, qmax)`` as ``out`` for the rounded float ``r``, saturating as
    onnxruntime does: values beyond the int32 range and infinities to the nearer end. ``r`` is
    clamped to +-2^24 in float first, so that its int32 conversion is in range (C++ and numpy
    leave out-of-range conversions undefined; x86 gives INT32_MIN, which turned +inf into
    ``qmin``); past 2^24 every result saturates anyway. NaN stays NaN through the clamp and
    converts as the machine does (x86: INT32_MIN, hence ``qmin``, onnxruntime's answer); a
    select for it kept GCC from vectorizing a QDQ model's fused kernels (17x slower GELU)."""
    big = float(1 << 24)
    if r.dtype == "float16":
        r = ctx.cast(r, "float32")
    r = ctx.emit("Clip", [r, ctx.constant(np.array(-big, r.dtype)), ctx.constant(np.array(big, r.dtype))], _OPSET)
    q = ctx.cast(r, "int32")
    if zp is not None:
        q = ctx.emit("Add", [q, ctx.cast(zp, "int32")], _OPSET)
    lo, hi = _RANGES[out]
    q = ctx.emit("Clip", [q, ctx.constant(np.int32(lo)), ctx.constant(np.int32(hi))], _OPSET)
    return ctx.cast(q, out)


def _shifted(ctx: NodeContext, t: Tensor, zp: Tensor | None, what: str) -> Tensor:
    """``int32(t) - int32(zp)``; ``zp`` one value, or for the weight (``what`` "w") one per
    output channel."""
    if t.dtype not in ("int8", "uint8"):
        raise ctx.unsupported(f"{t.dtype} {what} (int8/uint8 expected)")
    y = ctx.cast(t, "int32")
    if zp is None:
        return y
    if zp.dtype != t.dtype:
        raise ctx.invalid(f"{what}_zero_point has type {zp.dtype}, {what} has {t.dtype}")
    if zp.size != 1 and what != "w":
        raise ctx.shape_error(f"{what}_zero_point must be one value, got shape {list(zp.shape)}")
    return ctx.emit("Sub", [y, ctx.cast(_spread(ctx, zp, t, 0, 0, f"{what}_zero_point"), "int32")], _OPSET)


def _conv_int32(ctx: NodeContext, x: Tensor, w: Tensor, bias: Tensor | None, name: str) -> Tensor:
    """The node's convolution (its attributes) of int32 operands, accumulated in int32."""
    x, w, bias, _, kernel, strides, dil = _conv_operands(ctx, (x, w, bias), dtypes=("int32",))
    pads = _forward_pads(ctx, x.shape[2:], kernel, strides, dil)
    return ctx.add(Conv([x, w] + ([bias] if bias is not None else []), name=name,
                        group=int(ctx.attr("group", 1)), strides=strides, dilations=dil, pads=pads))


@onnx_op("ConvInteger", since=10)
def conv_integer(ctx):
    x, w = ctx.input(0), ctx.input(1)
    xzp = ctx.inputs[2] if ctx.has_input(2) else None
    wzp = ctx.inputs[3] if ctx.has_input(3) else None
    return [_conv_int32(ctx, _shifted(ctx, x, xzp, "x"), _shifted(ctx, w, wzp, "w"), None, ctx.name)]


@onnx_op("QLinearConv", since=10)
def qlinear_conv(ctx):
    x, xs, xzp, w, ws, wzp, ys, yzp = (ctx.input(i) for i in range(8))
    bias = ctx.input(8) if ctx.has_input(8) else None
    if any(t.dtype not in ("float32", "float16", "float64") for t in (xs, ws, ys)):
        raise ctx.invalid("scales must be floating point")
    if xs.size != 1 or ys.size != 1:
        raise ctx.shape_error("x_scale and y_scale must be one value each")
    if bias is not None and (bias.dtype != "int32" or bias.shape != (w.shape[0],)):
        raise ctx.invalid(f"B must be an int32 vector of the {w.shape[0]} output channels, got {bias.dtype} "
                          f"{list(bias.shape)}")
    out = yzp.dtype
    if out not in ("int8", "uint8"):
        raise ctx.unsupported(f"{out} output (int8/uint8 expected)")
    acc = _conv_int32(ctx, _shifted(ctx, x, xzp, "x"), _shifted(ctx, w, wzp, "w"), None, f"{ctx.name}/conv_int32")
    if bias is not None:  # (added after the conv, so that the cpu target's integer conv takes the conv alone)
        acc = ctx.emit("Add", [acc, _spread(ctx, bias, acc, 1, 0, "B")], _OPSET)
    # the multiplier in the scales' type, per output channel along the output's axis 1
    mult = ctx.emit("Div", [ctx.emit("Mul", [_spread(ctx, xs, acc, 1, 0, "x_scale"),
                                             _spread(ctx, ws, acc, 1, 0, "w_scale")], _OPSET),
                            _spread(ctx, ys, acc, 1, 0, "y_scale")], _OPSET)
    r = ctx.emit("Mul", [ctx.cast(acc, "float64"), ctx.cast(mult, "float64")], _OPSET)
    return [_saturate(ctx, ctx.emit("Round", [r], _OPSET), _spread(ctx, yzp, acc, 1, 0, "y_zero_point"), out)]
