"""Weights packed at compile time for the cpu GEMM.

The cpu target's GEMM (``codegen/templates_cpu.py``) copies ``B`` into panels of its kernel's
width on every call before it multiplies (BLIS-style packing). When ``B`` is a constant, that copy
is the same on every call: :class:`PrepackWeights` does it once, here, and stores the weight packed
in panels of :data:`~shardflow.compiler.ops.linalg.PANEL` (16) columns
(:func:`~shardflow.compiler.ops.linalg.pack_panels`), so the kernel reads the panels straight from
the weights. A MatMul ``a @ B`` or Gemm ``alpha * a @ op(B) + beta * c`` (``trans_a`` unset) on
float32 with a constant 2-D ``B`` becomes a
:class:`~shardflow.compiler.ops.linalg.PackedMatMul` of the same name and output.

It runs on each rank's graph after partition (the plan sees the MatMul; the weight is packed
shard by shard; a weight the ranks hold whole is packed once per compile, :class:`PackCache`), for
the cpu target only. A weight that another kind of op also reads, or that
one Gemm reads transposed and another not, stays as it is, so that the rank never stores a weight
twice (except a ``Gather`` of its rows as a table when the products read it transposed: a tied output
layer that is the token table itself; the gather then reads the rows from the panels,
:class:`~shardflow.compiler.passes.precision.TablesInTiedWeights`); the packed copy is shared by all
the contractions reading the same weight. Values are unchanged where ``M > 1``: the same products are
summed in the same order as with packing per call. A single row (``M == 1``) is summed in four partial
sums by ``k mod 4`` (a difference of rounding).

A weight of float16 values read by a product of float16 values (a float16 model's, computed in float32 by
``HalfModelInFloat32``; or ``optimization_config["precision"] = "float16"``, whose weight is a ``Cast`` of a
float16 constant) is packed as float16 panels in the same layout: half the bytes, which the GEMM widens
as it reads them (``SfHalfPrepacked``, ``cpu_library/gemm.h``), the same values.

A MatMulInteger ``(a - azp) @ (B - bzp)`` with a constant 2-D int8/uint8 ``B`` (and a constant or no
``bzp``) that only such ops read becomes a
:class:`~shardflow.compiler.ops.linalg.PackedMatMulInteger`: ``B`` in panels of 16 columns and
groups of 4 along ``K`` (:func:`~shardflow.compiler.ops.linalg.pack_int8_panels`, the layout of
the integer GEMM's VNNI kernel), signed, with its column sums. The int32 results are the same.

An integer Conv (``ConvInteger`` and ``QLinearConv`` import as an int32 Conv of ``int32(x) - x_zero_point``
and the constant ``w - w_zero_point``) over 1 or 2 spatial dims, with no bias and at least
:data:`~shardflow.compiler.ops.conv.INT8_CONV_MIN_K` products per output, whose input is an int8/uint8
image so widened (the zero point one value, constant or computed) and whose weight spans at most 255 per
output channel becomes a :class:`~shardflow.compiler.ops.conv.PackedConvInteger` on the image itself: the
weight as the integer GEMM's rows (:func:`~shardflow.compiler.ops.conv.pack_int8_conv`), each image the
GEMM of those rows by its im2col matrix (``cpu_library/conv_int8.h``). The int32 results are the same.

A float32 Conv of bfloat16 values (a widened bfloat16 image and a weight of bfloat16 values: precision
``bfloat16``, or a bfloat16 model) over 1 or 2 spatial dims with at least :data:`BF16_CONV_MIN_K` products per
output becomes a :class:`~shardflow.compiler.ops.conv.PackedConvBf16` on the bfloat16 image: the weight as
bfloat16 rows (:func:`~shardflow.compiler.ops.conv.pack_bf16_conv`), each image the bfloat16 GEMM of those
rows by its im2col matrix (``cpu_library/conv_bf16.h``; each product exact in float32, the sums' order
another). Its image may also be a float32 tensor of bfloat16 values (a bfloat16 model computed in float32:
``HalfModelInFloat32``'s rounding, or a Relu, max pool or reshape of rounded values), which it reads cast to
bfloat16 (exactly; the element-wise ops that also read that tensor read the bfloat16 copy widened, so it is
stored once); the same goes for the bfloat16 products below. A Relu and a rounding to bfloat16 that follow
such a conv on the way to the next one's copy are applied as it stores (``lo``, ``hi``, ``to``; a Clip too).

A float32 1×1 Conv of one group on small images (at most :data:`CONV_MAX_PIXELS` output pixels per
image) with a constant weight becomes a
:class:`~shardflow.compiler.ops.conv.PackedConv`: its weight ``[OC, C, 1, 1]`` is stored as the
panels of ``Wᵀ[C, OC]``, and its kernel computes each image as ``x(im2col)ᵀ @ Wᵀ`` with the
prepacked GEMM, pixels as rows, then transposes back (rfcs/0002, "1×1 convs on small images").

A float32 1-D or 2-D Conv of one group with a window wider than 1×1, at least :data:`STRIDED_MIN_K` products
per output (``C·KH·KW``) and (horizontal) stride 2 (a speech model's feature extractor: wav2vec2's Conv1d
512→512 of kernel 3, 0.80-0.82× the conv template's time; rfcs/0002, "1-D convs"), or 3×3 of stride 1
with at least :data:`SMALL_MIN_K` on images of at most :data:`SMALL_MAX_PIXELS` output pixels (before the
Winograd rule below), with a constant weight also becomes a PackedConv: on an AVX-512 or AVX2 host its
kernel reads the image blocked by 16 channels, the output channels as vector lanes, with no im2col, GEMM
packing or phase copies (so do the 1×1 PackedConvs of at least twice as many output channels as input
channels, with AVX-512; rfcs/0002, "Strided convs as PackedConv"); elsewhere it runs as im2col and the
prepacked GEMM.

A float32 3×3 Conv of stride 1, dilation 1 and one group with a constant weight, at least
:data:`WINOGRAD_MIN_CHANNELS` input and output channels and enough output pixels
(:func:`winograd_tile`) becomes a :class:`~shardflow.compiler.ops.conv.WinogradConv`: Winograd's
F(4×4, 3×3) or F(2×2, 3×3), its weight stored transformed (``G w Gᵀ``, 36 or 16 values per 3×3
filter, in GEMM panels). Its rounding differs from the direct sum (rfcs/0002, "Winograd").

A conv weight is rewritten only when nothing but convs taking the same form (PackedConv, or
WinogradConv of the same tile) reads it; those share the one rewritten copy (equal constants, such
as the onnx package's light models' fills, are one tensor after import).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np

from ..ir.graph import FlowGraph, Operator, Tensor, const_tensor
from .base import GraphPass, splice
from .precision import _looked_up

__all__ = ["PrepackWeights", "PackCache", "cached"]

log = logging.getLogger(__name__)


def _int8_weight(op: Operator) -> tuple[Tensor, Tensor | None] | None:
    """The constant 2-D weight and constant zero point (or ``None``) of a MatMulInteger this pass
    packs for the integer GEMM, or ``None``."""
    if op.op_type != "MatMulInteger" or len(op.outputs) != 1:
        return None
    a, b = op.inputs[0], op.inputs[1]
    has_azp = bool(op.attrs.get("has_azp", False))
    zps = list(op.inputs[2:])
    bzp = zps[1] if has_azp and len(zps) > 1 else (zps[0] if not has_azp and zps else None)
    if not b.is_constant or b.ndim != 2 or a.ndim < 1 or (bzp is not None and not bzp.is_constant) \
            or 0 in b.shape or 0 in a.shape:
        return None
    return b, bzp


def _int8_conv(op: Operator, producer: dict[int, Operator]) -> tuple[Tensor, np.ndarray, Tensor | None] | None:
    """``(image, weight, zero point)`` of an integer Conv this pass runs on the image's bytes: the int8/uint8
    image its input widens (``Cast`` to int32, less a one-value zero point: a constant, or a ``Cast`` of the
    image's type), the value of its constant int32 weight (or ``Cast`` of constant bytes), spanning at most 255
    per output channel, and the zero point in the image's type (``None``: none); or ``None``."""
    if op.op_type != "Conv" or len(op.inputs) != 2 or len(op.outputs) != 1 or op.outputs[0].dtype != "int32" \
            or op.attrs.get("blocked_in") or op.attrs.get("blocked_out") or op.inputs[0].ndim not in (3, 4):
        return None
    from ..ops.conv import INT8_CONV_MIN_K

    x, w = op.inputs
    if w.dtype != "int32" or 0 in w.shape or 0 in x.shape or math.prod(w.shape[1:]) < INT8_CONV_MIN_K:
        return None
    def widened(t: Tensor) -> Tensor | None:  # the int8/uint8 tensor t widens
        return _widened(t, producer, ("int8", "uint8"))
    # (a weight without zero point: the widening of its bytes is not folded)
    wq = w if w.is_constant else widened(w)
    if wq is None or not wq.is_constant:
        return None
    value = np.asarray(wq.value).astype(np.int32)
    zp = None
    p = producer.get(id(x))
    if p is not None and p.op_type == "Binary" and p.attrs.get("fn") == "sub" and p.inputs[1].size == 1 \
            and p.inputs[0].shape == x.shape:
        xq, z = widened(p.inputs[0]), p.inputs[1]
        if xq is None:
            return None
        if z.is_constant:
            v = int(np.asarray(z.value).reshape(-1)[0])
            info = np.iinfo(xq.dtype)
            if not info.min <= v <= info.max:
                return None
            zp = const_tensor(np.array(v, xq.dtype), f"{op.name}.x_zero_point")
        else:
            zp = widened(z)
            if zp is None or zp.dtype != xq.dtype:
                return None
    else:
        xq = widened(x)
    if xq is None:
        return None
    flat = value.reshape(w.shape[0], -1).astype(np.int64)
    return (xq, value, zp) if np.all(flat.max(axis=1) - flat.min(axis=1) <= 255) else None


#: A float32 conv of bfloat16 values runs the bfloat16 GEMM (PackedConvBf16) from this many products per
#: output on (one AMX tile deep); below it (depthwise convs) the float32 conv.
BF16_CONV_MIN_K = 32

#: ... and from this many output channels per group on (one AMX tile of rows): a depthwise conv of a wide
#: window (ConvNeXt's 7x7: 49 products per output) is a GEMM of one row per group there, 10x the float32
#: depthwise kernels' time (ConvNeXt-tiny in bfloat16: 45 ms of 67 in its 18 depthwise convs).
BF16_CONV_MIN_GROUP_OC = 16

#: A conv of fewer products per output than this runs on the bfloat16 GEMM only when its image comes from
#: the bfloat16 GEMM (another such conv or product, through roundings, clamps, pools, moves and adds) or from a
#: graph input: on a float32 kernel's output its copy to bfloat16 is a kernel of its own, and shallow
#: convs gain little on AMX (the im2col packing into pairs, the 32 x 32 block stores): MobileNetV2's 1x1s of
#: K = 384 at 14x14 took 0.061 ms there against 0.038 on the float32 kernels with their fused residual. A
#: plain K threshold lost ResNet-50 4 ms to the casts between mixed convs (rfcs/0002).
BF16_CONV_DEEP_K = 512


def _from_bf16_gemm(t: Tensor, producer: dict[int, Operator], is_bf16: Callable[[Operator], bool],
                    depth: int = 24) -> bool:
    """Whether the float32 ``t`` comes from a bfloat16 product or conv (``is_bf16``) or from a graph input (a
    bfloat16 one widened, or a float32 one rounded: copied once either way), through roundings, clamps, pools,
    moves and the inputs of adds."""
    from .precision import exact_on_values

    p = producer.get(id(t))
    if p is None:
        return True
    if depth == 0:
        return False
    if p.op_type == "Cast":
        return p.inputs[0].dtype == "bfloat16" and producer.get(id(p.inputs[0])) is None
    if p.op_type in ("Conv", "MatMul", "Gemm"):
        return is_bf16(p)
    if p.op_type == "Binary" and p.attrs.get("fn") == "add":
        return any(_from_bf16_gemm(u, producer, is_bf16, depth - 1) for u in p.inputs if u.dtype == "float32")
    if p.op_type in ("RoundHalf", "Activation", "Clip", "Pool") or exact_on_values(p):
        return bool(p.inputs) and _from_bf16_gemm(p.inputs[0], producer, is_bf16, depth - 1)
    return False


def _bf16_conv(op: Operator, producer: dict[int, Operator], memo: dict[int, bool] | None = None
               ) -> tuple[Tensor, np.ndarray] | None:
    """``(image, value)`` of a float32 Conv of bfloat16 values this pass runs on the bfloat16 GEMM: its input
    an image of bfloat16 values (``image``: :func:`_bf16_image`), its weight a Cast of a bfloat16 constant or
    a float32 constant holding bfloat16 values, at least :data:`BF16_CONV_MIN_K` products per output and
    (grouped) :data:`BF16_CONV_MIN_GROUP_OC` output channels per group, 1 or 2 spatial dims; ``value`` the
    weight's values. ``None`` for any other op."""
    if op.op_type != "Conv" or len(op.outputs) != 1 or len(op.inputs) not in (2, 3) \
            or op.attrs.get("blocked_in") or op.attrs.get("blocked_out") or op.inputs[0].ndim not in (3, 4):
        return None
    x, w = op.inputs[0], op.inputs[1]
    group = int(op.attrs.get("group", 1))
    if any(t.dtype != "float32" for t in list(op.inputs) + op.outputs) or 0 in x.shape or 0 in w.shape \
            or math.prod(w.shape[1:]) < BF16_CONV_MIN_K \
            or (group > 1 and w.shape[0] // group < BF16_CONV_MIN_GROUP_OC):
        return None
    a = _bf16_image(x, producer)
    wb = _half_constant(w, producer) if a is not None else None
    if wb is None:
        return None
    if math.prod(w.shape[1:]) < BF16_CONV_DEEP_K and a.dtype == "float32":
        memo = {} if memo is None else memo

        def is_bf16(q: Operator) -> bool:
            if id(q) not in memo:  # (PrepackWeights.run records each conv it decides, in order)
                memo[id(q)] = (_bf16_conv(q, producer, memo) if q.op_type == "Conv"
                               else _bf16_operands(q, producer)) is not None
            return memo[id(q)]
        if not _from_bf16_gemm(x, producer, is_bf16):
            return None
    return a, np.asarray(wb.value)


def _transposed(op: Operator) -> bool:
    return op.op_type == "Gemm" and bool(op.attrs.get("trans_b", False))


def _weight(op: Operator) -> Tensor | None:
    """The constant ``B`` of a MatMul/Gemm this pass can pack, or ``None``."""
    if op.op_type not in ("MatMul", "Gemm") or len(op.outputs) != 1:
        return None
    a, b = op.inputs[0], op.inputs[1]
    if not b.is_constant or b.ndim != 2 or any(t.dtype != "float32" for t in list(op.inputs) + op.outputs):
        return None
    if op.op_type == "Gemm" and (op.attrs.get("trans_a", False) or a.ndim != 2):
        return None
    if a.ndim < 1 or 0 in b.shape:
        return None
    return b


def _holds_bfloat16(value: np.ndarray) -> bool:
    """Whether every value of the float32 array ``value`` is a bfloat16 value (its low 16 bits zero)."""
    v = np.ascontiguousarray(value, np.float32).view(np.uint32)
    return not np.any(v & np.uint32(0xFFFF))


def _widened(t: Tensor, producer: dict[int, Operator], dtypes: tuple[str, ...] = ("bfloat16",)) -> Tensor | None:
    """The tensor of one of ``dtypes`` that ``t`` is the widening ``Cast`` of, or ``None``."""
    p = producer.get(id(t))
    if p is None or p.op_type != "Cast" or len(p.inputs) != 1 or p.inputs[0].dtype not in dtypes:
        return None
    return p.inputs[0]


def _bf16_image(t: Tensor, producer: dict[int, Operator]) -> Tensor | None:
    """The operand a bfloat16 product reads for its float32 operand ``t``: the bfloat16 tensor ``t`` widens,
    or ``t`` itself when it holds bfloat16 values by construction (:func:`_half_values`: a bfloat16 model
    computed in float32, ``HalfModelInFloat32``), which the product reads cast to bfloat16 (exactly: the
    ``bf16`` of :meth:`PrepackWeights.run`); else ``None``."""
    a = _widened(t, producer)
    if a is not None:
        return a
    return t if _half_values(t, producer, "bfloat16") else None


def _holds_float16(value: np.ndarray) -> bool:
    """Whether every value of the float32 array ``value`` is a float16 value (the round trip keeps its bits)."""
    v = np.ascontiguousarray(value, np.float32)
    with np.errstate(over="ignore"):
        return np.array_equal(v.astype(np.float16).astype(np.float32).view(np.uint32), v.view(np.uint32))


def _half_constant(t: Tensor, producer: dict[int, Operator], half: str = "bfloat16") -> Tensor | None:
    """The constant of ``half`` values behind the float32 ``t``: the ``half`` constant ``t`` widens (as
    ``optimization_config["precision"]`` writes a weight, and ``HalfModelInFloat32`` a float16 model's product
    weight), or ``t`` itself when its values are all ``half``'s (a bfloat16 model's weight, widened by
    ``WidenHalfProducts``); else ``None``."""
    w = _widened(t, producer, (half,))
    if w is not None:
        return w if w.is_constant else None
    holds = _holds_bfloat16 if half == "bfloat16" else _holds_float16
    return t if t.is_constant and holds(np.asarray(t.value)) else None


def _float32_product(op: Operator) -> tuple[Tensor, Tensor] | None:
    """``(x, b)`` of a float32 MatMul/Gemm (``trans_a`` unset) with a 2-D ``B`` and no empty dim, or ``None``:
    what the half-operand forms below ask first."""
    if op.op_type not in ("MatMul", "Gemm") or len(op.outputs) != 1 or len(op.inputs) < 2:
        return None
    x, b = op.inputs[0], op.inputs[1]
    if any(t.dtype != "float32" for t in list(op.inputs) + op.outputs) or b.ndim != 2 or 0 in b.shape \
            or x.ndim < 1 or 0 in x.shape:
        return None
    if op.op_type == "Gemm" and (op.attrs.get("trans_a", False) or x.ndim != 2):
        return None
    return x, b


def _half_values(t: Tensor, producer: dict[int, Operator], half: str = "float16") -> bool:
    """Whether the float32 ``t`` holds ``half`` values by construction: widened from ``half`` by a Cast,
    rounded to ``half`` (``RoundHalf``, ``passes/precision.HalfModelInFloat32``), or moved (a reshape, a
    transpose: :func:`~shardflow.compiler.passes.precision.exact_on_values`) from such values."""
    from .precision import exact_on_values

    for _ in range(16):
        p = producer.get(id(t))
        if p is None:
            return False
        if _widened(t, producer, (half,)) is not None or (p.op_type == "RoundHalf" and p.attrs["to"] == half):
            return True
        if len(p.outputs) != 1 or not p.inputs or p.inputs[0].dtype != "float32" or not exact_on_values(p):
            return False
        t = p.inputs[0]
    return False


def _float16_weight(op: Operator, producer: dict[int, Operator]) -> tuple[Tensor, Tensor] | None:
    """``(b, w)`` of a float32 MatMul/Gemm (:func:`_float32_product`) whose ``A`` holds float16 values
    (:func:`_half_values`) and whose ``B`` (``b``) holds float16 values (``w``: :func:`_half_constant`; ``b``
    itself for a float16 model's weight). ``None`` for any other op."""
    xb = _float32_product(op)
    if xb is None or not _half_values(xb[0], producer):
        return None
    w = _half_constant(xb[1], producer, "float16")
    return (xb[1], w) if w is not None else None


def _packed_form(op: Operator, a: Tensor, panels: Tensor, n: int) -> tuple[list[Tensor], dict]:
    """The inputs and attributes of the packed product (PackedMatMul, PackedMatMulBf16) that replaces the
    MatMul/Gemm ``op``, reading ``a`` and ``panels`` (``n`` columns), plus Gemm's scales and bias."""
    attrs: dict = {"n": n}
    inputs = [a, panels]
    if op.op_type == "Gemm":
        attrs.update(alpha=float(op.attrs.get("alpha", 1.0)), beta=float(op.attrs.get("beta", 1.0)))
        if len(op.inputs) > 2 and attrs["beta"] != 0:
            inputs.append(op.inputs[2])
    return inputs, attrs


def _bf16_operands(op: Operator, producer: dict[int, Operator]) -> tuple[Tensor, Tensor] | None:
    """``(a, w)`` of a float32 MatMul/Gemm (:func:`_float32_product`) whose ``A`` holds bfloat16 values (``a``:
    :func:`_bf16_image`) and whose ``B`` is a constant holding bfloat16 values (``w``:
    :func:`_half_constant`: a Cast of a bfloat16 constant, ``optimization_config["precision"] = "bfloat16"``,
    or a bfloat16 model's weight widened by ``WidenHalfProducts``). ``None`` for any other op."""
    xb = _float32_product(op)
    a = _bf16_image(xb[0], producer) if xb is not None else None
    w = _half_constant(xb[1], producer) if a is not None else None
    return (a, w) if w is not None and w.ndim == 2 else None


#: A 1x1 conv whose output has at most this many pixels per image becomes a PackedConv (module docstring).
CONV_MAX_PIXELS = 196


def _conv_weight(op: Operator) -> Tensor | None:
    """The constant weight of a float32 Conv of one group and one output with no empty dim, or ``None``:
    what both conv rewrites below ask first."""
    if op.op_type != "Conv" or len(op.outputs) != 1 or int(op.attrs.get("group", 1)) != 1:
        return None
    x, w = op.inputs[0], op.inputs[1]
    if not w.is_constant or any(t.dtype != "float32" for t in list(op.inputs) + op.outputs):
        return None
    return None if 0 in x.shape or 0 in w.shape else w


#: A conv with a window wider than 1x1 becomes a PackedConv from this many products per output (C * KH *
#: KW) on, at horizontal stride 2: measured on an AVX-512 Xeon, ResNet-50's 3x3 stride-2 convs (K =
#: 1152..4608) took 0.72-0.84x the conv template's time, 3x3s of K = 288..864 0.78-0.85x (with AVX2 forced,
#: its AVX2 kernel 0.77-0.94x), the 7x7 stride-2 stem (K = 147) 1.3x.
STRIDED_MIN_K = 256

#: A 3x3 stride-1 conv with at least this many products per output (C * 9) on small images (below) becomes a
#: PackedConv (measured for ResNet-50's 512 -> 512 at 7x7).
SMALL_MIN_K = 1024

#: A 3x3 stride-1 conv with at least SMALL_MIN_K products per output becomes a
#: PackedConv (instead of a WinogradConv or the conv template) on images of at most this many output
#: pixels: Winograd's F(2x2) weights, 16/9 of the 3x3 ones, are each used by a few tiles only, and read
#: from memory in a whole model (measured on an AVX-512 Xeon: ResNet-50's 512->512 3x3s at 7x7 0.81-0.82x
#: the WinogradConv's time, the model 0.97; its 256->256 3x3s at 14x14 1.14-1.26x, kept as Winograd's).
SMALL_MAX_PIXELS = 64


def _packed_conv(op: Operator, max_pixels: int, windows: bool = False) -> Tensor | None:
    """The weight of a Conv this pass turns into a PackedConv (1x1 of at most ``max_pixels`` pixels per
    image; with ``windows``, also a 1-D or 2-D window wider than 1x1 with at least :data:`STRIDED_MIN_K`
    products per output at (horizontal) stride 2, or 3x3 at stride 1 with at least :data:`SMALL_MIN_K` on
    images of at most :data:`SMALL_MAX_PIXELS` output pixels), or ``None``."""
    w = _conv_weight(op)
    if w is None or op.inputs[0].ndim not in (3, 4):
        return None
    pixels = math.prod(op.outputs[0].shape[2:])
    if math.prod(w.shape[2:]) == 1:
        return w if pixels <= max_pixels else None
    strides = tuple(op.attrs.get("strides") or (1,) * (w.ndim - 2))
    k = math.prod(w.shape[1:])
    if not windows:
        return None
    if w.ndim == 3 and strides[0] == 2 and k >= STRIDED_MIN_K:  # a 1-D window (rfcs/0002, "1-D convs")
        return w
    if w.ndim == 4 and ((strides[1] == 2 and k >= STRIDED_MIN_K) or (
            strides == (1, 1) and w.shape[2:] == (3, 3) and pixels <= SMALL_MAX_PIXELS and k >= SMALL_MIN_K)):
        return w
    return None


#: Winograd needs at least this many input and output channels: below, the transforms (per channel)
#: cost more than the products they save (measured on Zen 3: 16 -> 16 channels at 56x56 1.8x slower
#: with F(4x4), 32 -> 32 at 112x112 1.15x; 64 -> 64 at 56x56 1.2x faster).
WINOGRAD_MIN_CHANNELS = 64


#: With the blocked layout between convs, Winograd's ``F(m x m)`` also needs this much work, tiles (over all
#: images) x input channels x output channels: the direct conv on blocked tensors runs at 300-390 GFLOP/s
#: on 2 AVX-512 cores, and Winograd's transforms and GEMMs of few rows only beat it on more work
#: (``benchmarks/cpu_winograd.py``, the 3x3 between blocked 1x1s, Winograd / direct time: 64->64 at 28x28
#: F(4x4) 1.25, 64->96 0.77, 64->64 at 56x56 0.79; at 14x14 F(2x2) 64->64 2.06, 128->128 1.23, 128->192
#: 1.00, 192->192 0.97, 192->256 0.84, 256->256 0.83, 512->512 0.68; rfcs/0002, "Winograd against the
#: blocked direct conv").
WINOGRAD_MIN_WORK = {4: 250_000, 2: 2_000_000}


def winograd_tile(c: int, oc: int, oh: int, ow: int, images: int = 1, blocked: bool = False) -> int:
    """The output tile ``m`` of the Winograd ``F(m x m, 3 x 3)`` that a 3x3 stride-1 conv of ``c -> oc``
    channels with ``images`` images of ``oh x ow`` output pixels gets; 0 keeps the direct conv.

    Each transformed weight is used once per tile (its GEMM's rows), and F(4x4)'s weights are 4x the
    3x3 ones (36 / 9; F(2x2)'s 16 / 9): F(4x4) where there are at least 40 of its tiles, else F(2x2)
    where there are at least 16 of its tiles, else none (rfcs/0002, "Winograd"); with ``blocked`` (the
    direct conv would run on the blocked layout, ``optimization_config["blocked"]``) each also needs
    :data:`WINOGRAD_MIN_WORK`."""
    if min(c, oc) < WINOGRAD_MIN_CHANNELS:
        return 0
    for m, least in ((4, 40), (2, 16)):
        tiles = images * -(-oh // m) * -(-ow // m)
        if tiles >= least and (not blocked or tiles * c * oc >= WINOGRAD_MIN_WORK[m]):
            return m
    return 0


def _winograd(op: Operator, blocked: bool) -> tuple[Tensor, int] | None:
    """The constant weight and tile size of a Conv this pass turns into a WinogradConv (``blocked``: as
    :func:`winograd_tile`), or ``None``."""
    w = _conv_weight(op)
    if w is None:
        return None
    x, y = op.inputs[0], op.outputs[0]
    if x.ndim != 4 or tuple(w.shape[2:]) != (3, 3) \
            or any(v != 1 for v in tuple(op.attrs.get("strides") or ()) + tuple(op.attrs.get("dilations") or ())):
        return None
    m = winograd_tile(int(x.shape[1]), int(w.shape[0]), int(y.shape[2]), int(y.shape[3]), int(x.shape[0]), blocked)
    return (w, m) if m else None


def _memory_key(a: np.ndarray) -> tuple:
    """Where ``a``'s values are: its first byte's address, shape, strides and type (a view of another
    array's whole memory has its key)."""
    return (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)


class PackCache:
    """The packed forms of weights that the ranks of one compile hold whole, made once for all of them.

    A replicated weight reaches each rank's graph as a view of the imported array (``partition``), so
    each rank packed it again (GPT-2 small on 4 cpu ranks, its plan replicating every weight: 1.3 s of
    a 6.2 s compile under cProfile, session 86). ``sources`` are the arrays the
    ranks slice, the planned graph's constants: a pack is kept only where every array it is made of
    is one of them, whole (same address, shape, strides and type), so the cache never holds more
    than one rank's packs of those weights (shards, and values a rank pass made, are packed per rank
    as before). The packs are made read-only: ranks share them (and :func:`~shardflow.compiler.driver.compile`
    writes a rank's weights as a link to an earlier rank's file when they are the same arrays)."""

    def __init__(self, sources):
        self._whole = {_memory_key(np.asarray(a)): a for a in sources}
        self._packs: dict[tuple, object] = {}
        self._pack_keys: set = set()

    def pinned_key(self, a: np.ndarray) -> tuple | None:
        """``a``'s memory (address, shape, strides, type) where it is that of an array this cache
        keeps alive for the whole compile (an imported constant, whole, or a pack), so that the key
        names its bytes; else ``None``."""
        k = _memory_key(a)
        return k if k in self._whole or k in self._pack_keys else None

    def get(self, kind: tuple, sources: tuple, make: Callable[[], object]):
        """``make()``, or what it returned for equal ``kind`` and the same memory of ``sources`` (arrays
        with a :meth:`pinned_key`, or ``None`` for an absent one) earlier in this compile. Arrays it
        returns (alone or in a tuple) are kept read-only; other values (a test's answer) as they are."""
        keys = tuple(None if a is None else self.pinned_key(a) for a in sources)
        if any(k is None and a is not None for k, a in zip(keys, sources)):
            return make()
        key = (kind, keys)
        if key in self._packs:
            return self._packs[key]
        out = make()
        for a in out if isinstance(out, tuple) else (out,):
            if isinstance(a, np.ndarray):
                a.setflags(write=False)
                self._pack_keys.add(_memory_key(a))
        self._packs[key] = out
        return out


def cached(cache: PackCache | None, kind: tuple, sources: tuple, make: Callable[[], object]):
    """``make()``, through ``cache`` where there is one (:meth:`PackCache.get`)."""
    return make() if cache is None else cache.get(kind, sources, make)


class PrepackWeights(GraphPass):
    """Replace each float32 MatMul/Gemm with a constant 2-D weight by a PackedMatMul reading the
    weight packed in panels, each float32 1x1 Conv on small images and each wider window
    :func:`_packed_conv` names by a PackedConv, and each float32 3x3 stride-1 Conv that
    :func:`winograd_tile` picks by a WinogradConv (see the module docstring).

    Parameters
    ----------
    conv_max_pixels
        1x1 convs whose output images have at most this many pixels are packed; default
        :data:`CONV_MAX_PIXELS`; 0 packs none.
    winograd
        Turn the 3x3 convs :func:`winograd_tile` picks into WinogradConvs (``optimization_config["winograd"]``).
    gemm
        Pack the MatMul/Gemm weights.
    windows
        Make PackedConvs of the convs with windows wider than 1x1 that :func:`_packed_conv` names (stride
        2, or 3x3 on small images; module docstring).
    blocked
        The blocked layout between convs follows (``optimization_config["blocked"]``): Winograd's rule
        weighs it against the direct blocked conv (:func:`winograd_tile`).
    cache
        A :class:`PackCache` the ranks of one compile share: the weights they hold whole packed once.
    """

    def __init__(self, conv_max_pixels: int = CONV_MAX_PIXELS, winograd: bool = True, gemm: bool = True,
                 windows: bool = True, blocked: bool = False, cache: PackCache | None = None):
        self.conv_max_pixels = conv_max_pixels
        self.winograd = winograd
        self.gemm = gemm
        self.windows = windows
        self.blocked = blocked
        self.cache = cache

    def _conv_form(self, op: Operator) -> tuple[Tensor, int] | None:
        """``(weight, m)`` of a Conv this pass rewrites (``m``: 0 for a PackedConv, the tile of a
        WinogradConv; the PackedConv rules first: small images), or ``None``."""
        w = _packed_conv(op, self.conv_max_pixels, self.windows)
        if w is not None:
            return w, 0
        return _winograd(op, self.blocked) if self.winograd else None

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.conv import (PackedConv, PackedConvBf16, PackedConvInteger, WinogradConv, pack_bf16_conv,
                                pack_int8_conv, winograd_weights)
        from ..ops.elementwise import CastOp
        from ..ops.linalg import (PackedMatMul, PackedMatMulBf16, PackedMatMulInteger, pack_bf16_panels,
                                  pack_int8_panels, pack_panels)

        consumers = graph.consumers()
        producer = {id(t): op for op in graph.nodes for t in op.outputs}
        packed_bf16: dict[int, Tensor] = {}  # (the float32 B a product reads, by id) -> its bfloat16 panels
        outputs = {id(t) for t in graph.outputs}
        packed: dict[int, Tensor] = {}  # weight (by id) -> its panels
        packed_int8: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (weight, zero point) -> bp, bc
        conv_weights: dict[tuple[int, int], Tensor] = {}  # (weight, Winograd tile or 0) -> its new form
        forms = {id(op): self._conv_form(op) for op in graph.nodes}
        after: dict[int, list[Operator]] = {}
        replace: dict[int, Tensor] = {}
        # (once per op: a float32 weight's test of its values reads all of it)
        bf16_forms = {id(op): _bf16_operands(op, producer) for op in graph.nodes} if self.gemm else {}
        half_forms = {id(op): f for op in graph.nodes if (f := _float16_weight(op, producer))} if self.gemm else {}
        conv_int8: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (weight, group) -> wa, wc
        conv_bf16: dict[tuple[int, int], Tensor] = {}  # (the float32 weight a conv reads, group) -> bfloat16 rows
        # (a float32 operand of bfloat16 values, by id) -> the op after which its bfloat16 copy is placed, the copy
        as_bf16: dict[int, tuple[Tensor, Operator, Operator]] = {}
        bf16_products: set[int] = set()  # the products and convs that read such a copy
        bf16_memo: dict[int, bool] = {}  # (a conv or product, by id) -> whether it runs on the bfloat16 GEMM

        def bf16(a: Tensor) -> Tensor:
            """The bfloat16 operand ``a`` of a product, or the exact cast of the float32 ``a`` (which holds bfloat16
            values, :func:`_bf16_image`) to bfloat16, placed right after ``a``'s producer: once per tensor, of a
            ``RoundHalf``'s input (which it rounds the same) in place of its output."""
            if a.dtype == "bfloat16":
                return a
            if id(a) not in as_bf16:
                p = producer[id(a)]
                src = p.inputs[0] if p.op_type == "RoundHalf" else a
                cast = CastOp([replace.get(id(src), src)], name=f"{a.name}.bfloat16", to="bfloat16")
                after.setdefault(id(p), []).append(cast)
                as_bf16[id(a)] = (a, p, cast)
            return as_bf16[id(a)][2].outputs[0]

        for op in graph.nodes:
            bc = _bf16_conv(op, producer, bf16_memo) if self.gemm else None
            if op.op_type == "Conv":
                bf16_memo[id(op)] = bc is not None
            if bc is not None:
                a, value = bc
                a = bf16(a)
                bf16_products.add(id(op))
                w, group = op.inputs[1], int(op.attrs.get("group", 1))
                if (id(w), group) not in conv_bf16:
                    rows = cached(self.cache, ("bf16conv", group), (value,), lambda: pack_bf16_conv(value, group))
                    conv_bf16[(id(w), group)] = const_tensor(rows, f"{op.name}.bf16rows")
                inputs = [a, conv_bf16[(id(w), group)]] + list(op.inputs[2:])
                new = PackedConvBf16([replace.get(id(t), t) for t in inputs], name=op.name,
                                     **dict(op.attrs, oc=int(w.shape[0]), kernel=tuple(int(k) for k in w.shape[2:])))
                after[id(op)] = [new]
                replace[id(op.outputs[0])] = new.outputs[0]
                continue
            ic = _int8_conv(op, producer)
            if ic is not None:
                xq, value, zp = ic
                w, group = op.inputs[1], int(op.attrs.get("group", 1))
                if (id(w), group) not in conv_int8:
                    wa, wc = cached(self.cache, ("int8conv", group), (value,), lambda: pack_int8_conv(value, group))
                    conv_int8[(id(w), group)] = (const_tensor(wa, f"{op.name}.i8rows"),
                                                 const_tensor(wc, f"{op.name}.i8terms"))
                inputs = [xq, *conv_int8[(id(w), group)]] + ([zp] if zp is not None else [])
                new = PackedConvInteger([replace.get(id(t), t) for t in inputs], name=op.name,
                                        **dict(op.attrs, oc=int(w.shape[0]), kernel=tuple(int(k) for k in w.shape[2:])))
                after[id(op)] = [new]
                replace[id(op.outputs[0])] = new.outputs[0]
                continue
            h = bf16_forms.get(id(op))
            b = op.inputs[1] if h is not None else None
            # every reader of B (the float32 values: a Cast's output, or the constant) takes this form, so
            # that the rank stores no float32 copy beside the panels
            if h is not None and id(b) not in outputs and all(
                    (bf16_forms.get(id(c)) or (None, None))[1] is h[1] and _transposed(c) == _transposed(op)
                    for c in consumers.get(id(b), [])):
                a, w = h
                a = bf16(a)
                bf16_products.add(id(op))
                trans = _transposed(op)
                if id(b) not in packed_bf16:
                    value = np.asarray(w.value)
                    value = value.T if trans else value
                    panels = cached(self.cache, ("bf16",), (value,), lambda: pack_bf16_panels(value))
                    packed_bf16[id(b)] = const_tensor(panels, f"{w.name}.bf16panels" + (".T" if trans else ""))
                inputs, attrs = _packed_form(op, a, packed_bf16[id(b)], int(w.shape[0] if trans else w.shape[1]))
                new = PackedMatMulBf16([replace.get(id(t), t) for t in inputs], name=op.name, **attrs)
                after[id(op)] = [new]
                replace[id(op.outputs[0])] = new.outputs[0]
                continue
            q = _int8_weight(op) if self.gemm else None
            if q is not None and id(q[0]) not in outputs \
                    and all((_int8_weight(c) or (None,))[0] is q[0] for c in consumers.get(id(q[0]), [])):
                b, bzp = q
                key = (id(b), id(bzp))
                if key not in packed_int8:
                    bv, zv = np.asarray(b.value), None if bzp is None else np.asarray(bzp.value)
                    bp, bc = cached(self.cache, ("int8",), (bv, zv), lambda: pack_int8_panels(bv, zv))
                    packed_int8[key] = (const_tensor(bp, f"{b.name}.i8panels"), const_tensor(bc, f"{b.name}.i8cols"))
                inputs = [op.inputs[0], *packed_int8[key]] + ([op.inputs[2]] if op.attrs.get("has_azp") else [])
                new = PackedMatMulInteger([replace.get(id(t), t) for t in inputs], name=op.name, n=int(b.shape[1]))
                after[id(op)] = [new]
                replace[id(op.outputs[0])] = new.outputs[0]
                continue
            form = forms[id(op)]
            w = form[0] if form is not None else None
            # a weight several convs read (equal constants deduplicated at import) is rewritten once when
            # every reader takes the same form
            if w is not None and id(w) not in outputs and all(
                    (f := forms.get(id(c))) is not None and f[0] is w and f[1] == form[1]
                    for c in consumers.get(id(w), [])):
                m = form[1]
                if (id(w), m) not in conv_weights:
                    value = np.asarray(w.value, np.float32)
                    made = cached(self.cache, ("conv", m), (value,), lambda: winograd_weights(value, m) if m else
                                   pack_panels(value.reshape(value.shape[0], -1).T))  # G w G^T, or W^T's panels
                    conv_weights[(id(w), m)] = const_tensor(made, f"{w.name}.winograd{m}" if m else f"{w.name}.panels")
                weight = conv_weights[(id(w), m)]
                if m:
                    cls, attrs = WinogradConv, dict(op.attrs, oc=int(w.shape[0]), m=m)
                else:  # the weight as GEMM panels of W^T
                    kernel = tuple(int(k) for k in w.shape[2:])
                    cls, attrs = PackedConv, dict(op.attrs, oc=int(w.shape[0]), kernel=kernel)
                inputs = [replace.get(id(t), t) for t in [op.inputs[0], weight] + list(op.inputs[2:])]
                new = cls(inputs, name=op.name, **attrs)
                after[id(op)] = [new]
                replace[id(op.outputs[0])] = new.outputs[0]
                continue
            # the weight, or (half) the float32 B of float16 values that a product of widened float16 values
            # reads, which is packed as float16 panels (read as float32 exactly)
            half = half_forms.get(id(op))
            b = half[0] if half is not None else _weight(op) if self.gemm else None
            weight_of = (lambda c: (half_forms.get(id(c)) or (None,))[0]) if half is not None else _weight
            # (a Gather of the weight's rows as a table, the product reading it transposed: a tied output layer
            # that is the table itself; the gather then reads the panels, precision.TablesInTiedWeights)
            readers = [c for c in consumers.get(id(b), []) if not (_transposed(op) and _looked_up(c) is b)]
            if b is None or id(b) in outputs or any(weight_of(c) is not b or _transposed(c) != _transposed(op)
                                                    for c in readers):
                continue
            trans = _transposed(op)
            if id(b) not in packed:
                src = np.asarray(half[1].value) if half is not None else np.asarray(b.value, np.float32)

                def make(src=src, trans=trans, half=half is not None):
                    value = src.astype(np.float16) if half else src
                    return pack_panels(value.T if trans else value)
                panels = cached(self.cache, ("f16" if half is not None else "f32", trans), (src,), make)
                packed[id(b)] = const_tensor(panels, f"{b.name}.panels" + ("16" if half is not None else "")
                                             + (".T" if trans else ""))
            inputs, attrs = _packed_form(op, op.inputs[0], packed[id(b)], b.shape[0] if trans else b.shape[1])
            # splice redirects the graph's ops, not the new ones: read the earlier replacements here
            inputs = [replace.get(id(t), t) for t in inputs]
            new = PackedMatMul(inputs, name=op.name, **attrs)
            after[id(op)] = [new]
            replace[id(op.outputs[0])] = new.outputs[0]
        for a, p, cast in as_bf16.values():
            # its element-wise readers read the copy widened (the same values, half the bytes), which leaves the
            # float32 tensor to the kernel that computes it (unrounded, if at all) and writes the copy
            others = [r for r in consumers.get(id(a), []) if id(r) not in bf16_products]
            if others and id(a) not in outputs and all(type(r).injective for r in others):
                after[id(p)].append(CastOp([cast.outputs[0]], name=f"{a.name}.widened", to="float32"))
                replace[id(a)] = after[id(p)][-1].outputs[0]
        if after:
            log.debug("packed %d GEMM weights (%d bfloat16); %d ops rewritten", len(packed) + len(packed_bf16),
                      len(packed_bf16), len(after))
        return _bf16_conv_epilogues(splice(graph, after, replace))


def _clamp_bounds(op: Operator) -> tuple[float | None, float | None] | None:
    """``(lo, hi)`` of a Relu (``(0, None)``) or a Clip whose bounds are bfloat16 values (so that it commutes
    with a rounding to bfloat16; ``None``: unbounded), else ``None``."""
    from ..ir.expr import numpy_type

    if op.op_type == "Activation" and op.attrs.get("kind") == "relu":
        return 0.0, None
    if op.op_type != "Clip":
        return None
    lo, hi = op.attrs.get("lo"), op.attrs.get("hi")
    exact = all(v is None or float(np.float32(v).astype(numpy_type("bfloat16"))) == float(v) for v in (lo, hi))
    return (lo, hi) if exact else None


def _bf16_conv_epilogues(graph: FlowGraph) -> FlowGraph:
    """Each PackedConvBf16 whose float32 output reaches a cast to bfloat16 through ops of one reader each that
    round to bfloat16 (``RoundHalf``) or apply a Relu or a Clip to bfloat16 bounds (a bfloat16 model's conv, its
    rounding, its Relu and the next conv's copy of the result; precision ``bfloat16``'s conv, Relu and cast)
    writes the cast's output itself: the clamp and the rounding applied as its kernel stores (attributes
    ``lo``, ``hi`` and ``to``). So does one whose chain rounds and ends at element-wise readers (a residual
    Add), which then read its bfloat16 output widened. The same values (rounding to nearest even is monotone,
    so it commutes with the clamp). A PackedMatMulBf16 likewise, without the clamps (``to``: a bfloat16
    model's logits written as bfloat16 by the GEMM, its MLP's hidden values stored so for the GELU)."""
    from ..ops.elementwise import CastOp

    readers = graph.consumers()
    outputs = {id(t) for t in graph.outputs}
    after: dict[int, list[Operator]] = {}
    replace: dict[int, Tensor] = {}
    for op in graph.nodes:
        conv = op.op_type == "PackedConvBf16"
        if not (conv or op.op_type == "PackedMatMulBf16") or any(op.attrs.get(k) is not None for k in ("lo", "hi")) \
                or op.attrs.get("to", "float32") != "float32":
            continue
        t, bounds, rounded, cast = op.outputs[0], None, False, None
        chain: list[tuple[Tensor, tuple | None]] = []  # (a tensor of bfloat16 values on the way, the bounds before)
        while cast is None and id(t) not in outputs and len(rs := readers.get(id(t), [])) == 1:
            r, clamp = rs[0], _clamp_bounds(rs[0]) if conv else None
            if r.op_type == "Cast" and r.attrs["to"] == "bfloat16":
                cast = r
            elif (r.op_type == "RoundHalf" and r.attrs["to"] == "bfloat16") or (clamp is not None and bounds is None):
                bounds = bounds or clamp
                rounded = rounded or r.op_type == "RoundHalf"
                t = r.outputs[0]
                if rounded:
                    chain.append((t, bounds))
            else:
                break
        # else the chain's last tensor of rounded values read by element-wise ops only (a residual Add, a Clip
        # before a depthwise conv), which read the conv's bfloat16 output widened
        widen = cast is None and next(((u, b) for u, b in reversed(chain) if id(u) not in outputs and all(
            type(r).injective for r in readers.get(id(u), []))), None)
        if widen:
            t, bounds = widen
        if cast is not None or widen:
            # (splice redirects the graph's ops, not the new ones: a folded conv may read the one before)
            lo, hi = bounds or (None, None)
            attrs = dict(op.attrs, lo=lo, hi=hi, to="bfloat16") if conv else dict(op.attrs, to="bfloat16")
            new = type(op)([replace.get(id(u), u) for u in op.inputs], name=op.name, **attrs)
            after[id(op)] = [new]
            if widen:
                after[id(op)].append(CastOp([new.outputs[0]], name=f"{op.name}.widened", to="float32"))
                replace[id(t)] = after[id(op)][-1].outputs[0]
            else:
                replace[id(cast.outputs[0])] = new.outputs[0]
    if after:
        log.debug("%d bfloat16 products and convs store bfloat16 values", len(after))
    return splice(graph, after, replace)
