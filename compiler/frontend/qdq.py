"""Integer matmuls out of QDQ models, for the cpu target.

A model in the QDQ format (onnxruntime's ``quantize_static`` default, and most quantization tools)
keeps its MatMuls in float and marks the quantized values with ``DequantizeLinear``: ``MatMul(
DequantizeLinear(xq, sx, zx), DequantizeLinear(Wq, sw, zw))``. Imported as it is, the weight's
dequantization folds into a float weight and the product runs the float GEMM. :func:`fuse_qdq_matmuls`
rewrites each such MatMul, before import, into the integer product it stands for,

    Mul(Cast(MatMulInteger(xq, Wq, zx, zw), float), sx * sw)

which is the same value, ``sum_k sx (xq - zx) sw (Wq - zw)``, with the sum exact in int32 instead of
rounded in float32; the cpu target runs it on the integer GEMM (``PackedMatMulInteger``). The driver
applies it for the cpu target only (the cuda target has no integer GEMM template).

A Conv of a DequantizeLinear'd activation and weight becomes ``ConvInteger`` (its attributes) the same
way, the scales' product one per output channel, and its bias (any float tensor) added after: the weight
an int8/uint8 initializer ``[OC, C/group, *kernel]`` (1 or 2 spatial dims) with at least
:data:`~shardflow.compiler.ops.conv.INT8_CONV_MIN_K` products per output (depthwise convs stay float), its
scale and zero point per tensor or per output channel (``axis`` 0). The cpu target runs it on the integer conv
(``PackedConvInteger``).

A MatMul, or a Gemm without ``transA`` (``alpha`` joins the scales, ``beta * C`` is added after),
is rewritten when both inputs come from DequantizeLinear nodes of this graph (not a subgraph)
whose scales and zero points are initializers: the activation's per tensor, int8 or uint8, with a
zero point; the weight a 2-D int8/uint8 initializer, per tensor or per output column (``axis`` 1,
or 0 under ``transB``, whose weight is stored transposed once more), without ``block_size``; both
scales float32. Anything else is left as it is.

:func:`drop_requantizations` (all targets) removes the other half of the format's cost: the
quantizer wraps data-movement ops (Reshape, Transpose, Gather of an embedding...) in
``QuantizeLinear(move(DequantizeLinear(q, s, z)), s, z)`` with the same scale and zero point, and
that is ``move(q)`` exactly: ``(q - z) * s / s`` in float32 is within ``|q - z| * 2^-23`` of the
integer ``q - z`` (at most 65535 * 2^-23 < 0.5 for 8- and 16-bit types, for a normal scale), so it
rounds back to it, and ``q`` is inside the clamp. Each such pair cost a multiplication, a
division, a rounding and two clamps per element in the fused kernels.
It also drops ``DequantizeLinear(QuantizeLinear(pads(DequantizeLinear(q, s, z)), s, z), s, z)`` where the
pads (with moves between) pad with a value on the grid of ``s`` and ``z`` (zero; a value the quantizer
quantized with them; ``edge``/``reflect`` copies): every value is already on the grid, which the pair keeps
(HF's MobileNetV2 pads each depthwise conv's input explicitly: the zero pad then folds into the conv), except
where a product or conv that :func:`fuse_qdq_matmuls` can make integer reads the DequantizeLinear.

:func:`four_bit_matmuls` (all targets) keeps 4-bit QDQ weights packed: ``MatMul(x,
DequantizeLinear(Wq, s, z))`` with ``Wq`` a 2-D int4/uint4 initializer ``[K, N]`` dequantized in
blocks along K (``axis`` 0, ``block_size`` a power of two of 16 or more; what
``MatMulNBitsQuantizer`` writes in its QDQ format) becomes onnxruntime's ``MatMulNBits`` on the same
codes, ``sum_k x[k] (Wq[k, n] - z[k / bs, n]) s[k / bs, n]``: the value the pair defines, with the
weight stored in half a byte a code instead of dequantized into float32 when constants fold.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..ops.conv import INT8_CONV_MIN_K
from ..ops.linalg import pack_bits
from .external_data import initializer_array

__all__ = ["FOUR_BIT", "drop_requantizations", "four_bit_codes", "four_bit_matmuls", "fuse_qdq_matmuls"]

log = logging.getLogger(__name__)

_INT8 = (TensorProto.INT8, TensorProto.UINT8)
_INT16 = (TensorProto.INT16, TensorProto.UINT16)
#: ops whose first input's elements pass to the output unchanged (moved, repeated or dropped)
_MOVES = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Gather"})


def _dq_parts(node, inits: dict, weight):
    """``(x, scale, zero point)`` of a DequantizeLinear node this rewrite takes (arrays for the
    initializers; ``x`` a name), or ``None``. ``weight``: ``False`` for the activation, ``True`` for a
    ``[K, N]`` weight, ``"transposed"`` for an ``[N, K]`` one (a Gemm's ``transB``)."""
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("block_size", 0):
        return None
    names = list(node.input) + [""] * (3 - len(node.input))
    x, s, z = names[:3]
    if s not in inits or inits[s].data_type != TensorProto.FLOAT or (z and z not in inits):
        return None
    scale = initializer_array(inits[s])
    zp = initializer_array(inits[z]) if z else None
    if not weight:
        if scale.size != 1 or zp is None or zp.size != 1 or inits[z].data_type not in _INT8:
            return None
        return x, scale.reshape(()), zp
    if x not in inits or inits[x].data_type not in _INT8 or len(inits[x].dims) != 2:
        return None
    n_axis = 0 if weight == "transposed" else 1  # the output columns' axis of the stored weight
    n = inits[x].dims[n_axis]
    if scale.size != 1 and (scale.shape != (n,) or attrs.get("axis", 1) not in (n_axis, n_axis - 2)):
        return None
    if zp is not None and (zp.shape != scale.shape or inits[z].data_type != inits[x].data_type):
        return None
    return x, scale, zp


def _dq_conv_weight(node, inits: dict):
    """``(w, scale, zero point)`` of a DequantizeLinear node of a conv weight :func:`fuse_qdq_matmuls`
    takes (an int8/uint8 initializer ``[OC, C/group, *kernel]`` of 1 or 2 spatial dims, float32 scale and
    its zero point per tensor or per output channel), or ``None``."""
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    names = list(node.input) + [""] * (3 - len(node.input))
    w, s, z = names[:3]
    if attrs.get("block_size", 0) or w not in inits or inits[w].data_type not in _INT8 \
            or len(inits[w].dims) not in (3, 4) or s not in inits or inits[s].data_type != TensorProto.FLOAT \
            or (z and (z not in inits or inits[z].data_type != inits[w].data_type)):
        return None
    oc = inits[w].dims[0]
    if int(np.prod(inits[w].dims[1:])) < INT8_CONV_MIN_K:  # (depthwise and thin groups: float, the faster)
        return None
    scale = initializer_array(inits[s])
    zp = initializer_array(inits[z]) if z else None
    if scale.size != 1 and (scale.shape != (oc,) or attrs.get("axis", 1) not in (0, -len(inits[w].dims))):
        return None
    if zp is not None and zp.shape != scale.shape:
        return None
    return w, scale, zp


def _conv_plan(node, producer: dict, inits: dict):
    """``(x parts, w parts)`` of a QDQ Conv :func:`fuse_qdq_matmuls` rewrites, or ``None``."""
    if len(node.input) < 2:
        return None
    a = _dq_parts(producer.get(node.input[0]), inits, weight=False)
    b = _dq_conv_weight(producer.get(node.input[1]), inits)
    return None if a is None or b is None else (a, b + (len(inits[b[0]].dims) - 2,))


def _integer_conv(g, node, x, sx, zx, w, sw, zw, n_sp) -> list:
    """The nodes of the QDQ Conv ``node`` (``n_sp`` spatial dims) as ``ConvInteger`` (its attributes), the
    scales' product per output channel and the bias after (initializers added to ``g``)."""
    base = (node.name or node.output[0]) + "_int8"
    g.initializer.append(numpy_helper.from_array(np.asarray(zx).reshape(()), f"{base}.x_zero_point"))
    scale = (sx.astype(np.float32) * sw.astype(np.float32)).astype(np.float32)
    g.initializer.append(numpy_helper.from_array(scale.reshape((-1,) + (1,) * n_sp) if scale.size > 1 else
                                                 scale.reshape(()), f"{base}.scale"))
    ins = [x, w, f"{base}.x_zero_point"]
    if zw is not None and np.any(zw):
        g.initializer.append(numpy_helper.from_array(zw.reshape(-1) if zw.ndim else zw, f"{base}.w_zero_point"))
        ins.append(f"{base}.w_zero_point")
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else ""
    scaled = f"{base}.scaled" if bias else node.output[0]
    nodes = [helper.make_node("ConvInteger", ins, [f"{base}.int32"], name=base,
                              **{a.name: helper.get_attribute_value(a) for a in node.attribute}),
             helper.make_node("Cast", [f"{base}.int32"], [f"{base}.float"], name=f"{base}.cast", to=TensorProto.FLOAT),
             helper.make_node("Mul", [f"{base}.float", f"{base}.scale"], [scaled], name=f"{base}.mul")]
    if bias:  # [OC] along the channels
        g.initializer.append(numpy_helper.from_array(np.array([-1] + [1] * n_sp, np.int64), f"{base}.bias_shape"))
        nodes += [helper.make_node("Reshape", [bias, f"{base}.bias_shape"], [f"{base}.bias"], name=f"{base}.bias"),
                  helper.make_node("Add", [scaled, f"{base}.bias"], [node.output[0]], name=f"{base}.add")]
    return nodes


def fuse_qdq_matmuls(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` (a copy) with each QDQ MatMul, Gemm and Conv as an integer product (module docstring);
    ``proto`` itself when there is none."""
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    plans = []
    convs = {}
    for k, node in enumerate(g.node):
        if node.domain in ("", "ai.onnx") and node.op_type == "Conv":
            c = _conv_plan(node, producer, inits)
            if c is not None:
                convs[k] = c
            continue
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "MatMul" and len(node.input) != 2 or attrs.get("transA", 0):
            continue
        a = _dq_parts(producer.get(node.input[0]), inits, weight=False)
        b = _dq_parts(producer.get(node.input[1]), inits, weight="transposed" if attrs.get("transB", 0) else True)
        if a is None or b is None:
            continue
        plans.append((k, a, b, attrs))
    if not plans and not convs:
        return proto
    out = _copy(proto)
    g = out.graph
    replaced: dict[int, list] = {k: _integer_conv(g, g.node[k], *a, *b) for k, (a, b) in convs.items()}
    for k, (x, sx, zx), (w, sw, zw), attrs in plans:
        mm = g.node[k]
        base = (mm.name or mm.output[0]) + "_int8"
        zx_name, scale_name = f"{base}.x_zero_point", f"{base}.scale"
        alpha = np.float32(attrs.get("alpha", 1.0))
        g.initializer.append(numpy_helper.from_array(np.asarray(zx).reshape(()), zx_name))
        g.initializer.append(numpy_helper.from_array(
            (sx.astype(np.float32) * sw.astype(np.float32) * alpha).astype(np.float32), scale_name))
        if attrs.get("transB", 0):  # MatMulInteger takes [K, N]: a transposed copy of the int8 weight
            w_t = f"{base}.weight_t"
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(initializer_array(inits[w]).T), w_t))
            w = w_t
        ins = [x, w, zx_name]
        if zw is not None and np.any(zw):
            zw_name = f"{base}.w_zero_point"
            g.initializer.append(numpy_helper.from_array(zw.reshape(-1) if zw.ndim else zw, zw_name))
            ins.append(zw_name)
        bias = mm.input[2] if mm.op_type == "Gemm" and len(mm.input) > 2 and mm.input[2] else ""
        beta = float(attrs.get("beta", 1.0))
        scaled = f"{base}.scaled" if bias and beta != 0 else mm.output[0]
        replaced[k] = [
            helper.make_node("MatMulInteger", ins, [f"{base}.int32"], name=f"{base}"),
            helper.make_node("Cast", [f"{base}.int32"], [f"{base}.float"], name=f"{base}.cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"{base}.float", scale_name], [scaled], name=f"{base}.mul"),
        ]
        if scaled != mm.output[0]:  # Gemm's beta * C
            if beta != 1.0:
                g.initializer.append(numpy_helper.from_array(np.array(beta, np.float32), f"{base}.beta"))
                replaced[k].append(helper.make_node("Mul", [bias, f"{base}.beta"], [f"{base}.bias"],
                                                    name=f"{base}.beta_mul"))
                bias = f"{base}.bias"
            replaced[k].append(helper.make_node("Add", [scaled, bias], [mm.output[0]], name=f"{base}.add"))
    _splice(g, replaced)
    log.info("%d QDQ MatMuls as integer products (MatMulInteger), %d Convs (ConvInteger)", len(plans), len(convs))
    return out


#: ONNX's 4-bit integer types (their initializers import as int8/uint8 values: onnx_importer)
FOUR_BIT = {TensorProto.INT4: "int4", TensorProto.UINT4: "uint4"}


def four_bit_codes(values: np.ndarray, zero_points: np.ndarray | None, kind: str,
                   zp_shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    """int4/uint4 ``values`` as unsigned codes 0..15 (uint8) and their zero points as float32
    ``zp_shape``: int4's codes and zero points moved up by 8 (their differences stay); a missing
    zero point is the type's 0, made explicit."""
    shift = 8 if kind == "int4" else 0
    codes = (np.asarray(values).astype(np.int16) + shift).astype(np.uint8)
    zp = np.zeros(zp_shape, np.float32) if zero_points is None else np.asarray(zero_points, np.float32)
    return codes, zp + np.float32(shift)


def _four_bit_weight(node, inits: dict):
    """``(codes [K, N] as uint8 0..15, scales [blocks, N], zero points [blocks, N] as float32, block)``
    of a DequantizeLinear node :func:`four_bit_matmuls` takes, or ``None``. int4 codes and zero points
    are moved up by 8 (their differences stay)."""
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    block, axis = int(attrs.get("block_size", 0)), int(attrs.get("axis", 1))
    names = list(node.input) + [""] * (3 - len(node.input))
    w, s, z = (inits.get(n) for n in names[:3])
    if w is None or w.data_type not in FOUR_BIT or len(w.dims) != 2 or axis not in (0, -2) \
            or block < 16 or block & (block - 1) or attrs.get("output_dtype", 0) not in (0, TensorProto.FLOAT):
        return None
    k, n = w.dims
    blocks = -(-k // block)
    if s is None or s.data_type != TensorProto.FLOAT or list(s.dims) != [blocks, n]:
        return None
    if names[2] and (z is None or z.data_type != w.data_type or list(z.dims) != [blocks, n]):
        return None
    codes, zp = four_bit_codes(initializer_array(w), initializer_array(z) if names[2] else None,
                               FOUR_BIT[w.data_type], (blocks, n))
    return codes, initializer_array(s).astype(np.float32), zp, block


def four_bit_matmuls(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` (a copy) with each MatMul of a blockwise-dequantized 4-bit weight as a ``MatMulNBits``
    on the packed codes (module docstring); ``proto`` itself when there is none. A DequantizeLinear
    whose only reader was such a MatMul goes too."""
    g = proto.graph
    if not any(t.data_type in FOUR_BIT for t in g.initializer):
        return proto
    inits = {t.name: t for t in g.initializer}
    producer = {o: (k, n) for k, n in enumerate(g.node) for o in n.output}
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    outputs = {o.name for o in g.output}
    plans = []
    for k, node in enumerate(g.node):
        if node.domain not in ("", "ai.onnx") or node.op_type != "MatMul" or len(node.input) != 2:
            continue
        k_dq, dq = producer.get(node.input[1], (None, None))
        weight = _four_bit_weight(dq, inits)
        if weight is not None:
            plans.append((k, k_dq, weight))
    if not plans:
        return proto
    out = _copy(proto)
    g = out.graph
    replaced: dict[int, list] = {}
    for k, k_dq, (codes, scales, zp, block) in plans:
        mm = g.node[k]
        base = (mm.name or mm.output[0]) + "_nbits"
        kk, n = codes.shape
        blocks = -(-kk // block)
        padded = np.zeros((blocks * block, n), np.uint8)
        padded[:kk] = codes
        packed = pack_bits(padded.T.reshape(n, blocks, block), 4)  # column n's codes, block by block
        g.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(packed), f"{base}.codes"),
                              numpy_helper.from_array(np.ascontiguousarray(scales.T), f"{base}.scales"),
                              numpy_helper.from_array(np.ascontiguousarray(zp.T), f"{base}.zero_points")])
        replaced[k] = [helper.make_node("MatMulNBits", [mm.input[0], f"{base}.codes", f"{base}.scales",
                                                        f"{base}.zero_points"], list(mm.output), name=base,
                                        domain="com.microsoft", K=kk, N=n, bits=4, block_size=block)]
        if readers.get(mm.input[1], 0) == 1 and mm.input[1] not in outputs:
            replaced[k_dq] = []  # its only reader is gone
    if not any(o.domain == "com.microsoft" for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _splice(g, replaced)
    log.info("%d MatMuls of 4-bit QDQ weights kept packed (MatMulNBits)", len(plans))
    return out


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    return out


def _splice(graph: onnx.GraphProto, replaced: dict[int, list]) -> None:
    """``graph``'s node ``k`` replaced by the nodes ``replaced[k]``, in place, in order."""
    nodes = list(graph.node)
    del graph.node[:]
    for k, node in enumerate(nodes):
        graph.node.extend(replaced.get(k, [node]))


def _scalar_init(name: str, inits: dict):
    """The value of ``name`` when it is a one-element initializer (an array of its type), else None."""
    t = inits.get(name)
    if t is None or int(np.prod(t.dims)) != 1:
        return None
    return initializer_array(t).reshape(())


def _same_quantization(dq, q, inits: dict) -> bool:
    """Whether DequantizeLinear ``dq`` and QuantizeLinear ``q`` use one per-tensor float32 scale,
    normal and finite after times 65535, and one explicit 8- or 16-bit integer zero point (which
    also makes ``q``'s output type ``dq``'s input type)."""
    for n in (dq, q):
        if n.domain not in ("", "ai.onnx") or len(n.input) < 3 or not n.input[2]:
            return False
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if attrs.get("block_size", 0) or attrs.get("output_dtype", 0) or attrs.get("precision", 0) not in (
                0, TensorProto.FLOAT):
            return False
    s1, s2 = _scalar_init(dq.input[1], inits), _scalar_init(q.input[1], inits)
    z1, z2 = _scalar_init(dq.input[2], inits), _scalar_init(q.input[2], inits)
    if s1 is None or s2 is None or z1 is None or z2 is None:
        return False
    t1, t2 = inits[dq.input[2]].data_type, inits[q.input[2]].data_type
    if t1 != t2 or t1 not in _INT8 + _INT16 or int(z1) != int(z2):
        return False
    if inits[dq.input[1]].data_type != TensorProto.FLOAT or inits[q.input[1]].data_type != TensorProto.FLOAT:
        return False
    s = np.float32(s1)
    with np.errstate(over="ignore"):  # (a scale past float32's max / 65535: inf, no warning)
        return bool(s == np.float32(s2) and np.isfinite(s * np.float32(65535))
                    and abs(s) >= np.finfo(np.float32).tiny)


def drop_requantizations(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` (a copy) with each ``QuantizeLinear(move(DequantizeLinear(q, s, z)), s, z)`` as
    ``move(q)`` (module docstring): ``move`` a chain of zero or more :data:`_MOVES` ops and ``Pad``s
    through their first input, scale and zero point the same per-tensor initializer values. The moves are
    copied onto ``q`` (a constant pad's value as ``QuantizeLinear`` quantizes it; the float ones stay for
    their other readers, or go as dead code), after :func:`_padded_round_trips`' pairs around pads that
    float convs read; ``proto`` itself when there is none."""
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    # (first the pairs around pads a float conv reads: dropping them lets the pads fold into the conv)
    padded, padded_q = _padded_round_trips(g, inits, producer)
    plans: dict[int, list] = {}
    new_inits: list = []
    for k, node in enumerate(g.node):
        if node.op_type != "QuantizeLinear" or node.domain not in ("", "ai.onnx") or id(node) in padded_q:
            continue
        chain, p = [], producer.get(node.input[0])
        while p is not None and (p.op_type in _MOVES or p.op_type == "Pad") and p.domain in ("", "ai.onnx") \
                and p.input:
            chain.append(p)
            p = producer.get(p.input[0])
        if p is None or p.op_type != "DequantizeLinear" or not _same_quantization(p, node, inits):
            continue
        y, src = node.output[0], p.input[0]
        if not chain:
            plans[k] = [helper.make_node("Identity", [src], [y], name=f"{node.name or y}.requantized")]
            continue
        copies, inits_k = [], []
        for i, m in enumerate(reversed(chain)):
            out = y if i == len(chain) - 1 else f"{y}.requantized.{i}"
            c = onnx.NodeProto()
            c.CopyFrom(m)
            c.input[0] = src
            del c.output[:]
            c.output.append(out)
            c.name = f"{m.name or m.output[0]}.on_{y}"
            if m.op_type == "Pad" and len(m.input) < 2:
                break  # (Pad-2 takes float types only)
            if m.op_type == "Pad" and _pad_mode(m) == b"constant":
                # the integers pad with the value's quantization, which QuantizeLinear gives the float pads
                value = _quantized_pad_value(m, node, inits, producer)
                if value is None:
                    break
                inits_k.append(numpy_helper.from_array(value, f"{c.name}.value"))
                while len(c.input) < 3:
                    c.input.append("")
                c.input[2] = inits_k[-1].name
            elif m.op_type == "Pad" and _pad_mode(m) not in (b"edge", b"reflect"):
                break
            copies.append(c)
            src = out
        else:
            plans[k] = copies
            new_inits += inits_k
    if not plans and not padded:
        return proto
    out = _copy(proto)
    out.graph.initializer.extend(new_inits)
    _splice(out.graph, {**plans, **padded})
    log.info("%d QuantizeLinear(DequantizeLinear) round trips with one scale dropped, %d around pads",
             len(plans), len(padded))
    return out


def _quantize(v, s, z: int, ztype: int) -> np.ndarray:
    """``saturate(round(v / s) + z)`` of a float32 scalar as QuantizeLinear computes it (float32 division,
    ties to even), in the zero point's ONNX type ``ztype``."""
    dtype = helper.tensor_dtype_to_np_dtype(ztype)
    info = np.iinfo(dtype)
    with np.errstate(all="ignore"):
        return np.array(np.clip(np.rint(np.float32(v) / np.float32(s)) + int(z), info.min, info.max), dtype)


def _pad_mode(pad) -> bytes:
    return next((helper.get_attribute_value(a) for a in pad.attribute if a.name == "mode"), b"constant")


def _pad_value(pad, inits: dict, producer: dict) -> np.float32 | None:
    """The float32 value a constant-mode ``pad`` pads with (its third input, or before opset 11 its ``value``
    attribute; 0 without one), or None when it is not a constant."""
    if len(pad.input) < 2:  # (Pad-2: pads and value as attributes)
        return np.float32(next((helper.get_attribute_value(a) for a in pad.attribute if a.name == "value"), 0.0))
    value = pad.input[2] if len(pad.input) > 2 and pad.input[2] else None
    return np.float32(0) if value is None else _float_scalar(value, inits, producer)


def _quantized_pad_value(pad, q, inits: dict, producer: dict) -> np.ndarray | None:
    """The value the constant-mode ``pad``'s pads take through QuantizeLinear ``q`` (per-tensor scale and zero
    point): ``saturate(round(v / s) + z)`` in the zero point's type, as ``q`` computes it; None when the float
    value is not a finite constant."""
    v = _pad_value(pad, inits, producer)
    if v is None or not np.isfinite(v):
        return None
    return _quantize(v, _scalar_init(q.input[1], inits), _scalar_init(q.input[2], inits), inits[q.input[2]].data_type)


def _scalar_value(name: str, inits: dict, producer: dict, depth: int = 0):
    """``(value, onnx type)`` of ``name`` when it is one constant value: a one-element initializer or
    ``Constant``, or a Quantize/DequantizeLinear of such values (a quantized pad value, as the quantizer
    writes it: ``DequantizeLinear(QuantizeLinear(0.0, s, z), s, z)``), computed as those ops do in float32;
    else None."""
    v = _scalar_init(name, inits)
    if v is not None:
        return v, inits[name].data_type
    p = producer.get(name)
    if p is None or p.domain not in ("", "ai.onnx") or depth > 4:
        return None
    if p.op_type == "Constant":
        t = next((helper.get_attribute_value(a) for a in p.attribute if a.name == "value"), None)
        if not isinstance(t, TensorProto) or int(np.prod(t.dims)) != 1:
            return None
        return numpy_helper.to_array(t).reshape(()), t.data_type
    if p.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(p.input) < 3 or not p.input[2] \
            or any(a.name != "axis" for a in p.attribute):
        return None
    x, sc, z = (_scalar_value(i, inits, producer, depth + 1) for i in p.input[:3])
    if x is None or sc is None or z is None or sc[1] != TensorProto.FLOAT or z[1] not in _INT8 + _INT16:
        return None
    s32 = np.float32(sc[0])
    if p.op_type == "DequantizeLinear":
        return (np.float32(np.float32(int(x[0]) - int(z[0])) * s32) if x[1] in _INT8 + _INT16 else None), \
            TensorProto.FLOAT
    return (_quantize(x[0], s32, z[0], z[1]), z[1]) if x[1] == TensorProto.FLOAT else None


def _float_scalar(name: str, inits: dict, producer: dict) -> np.float32 | None:
    """The float32 value of ``name`` (:func:`_scalar_value`), or None."""
    v = _scalar_value(name, inits, producer)
    return np.float32(v[0]) if v is not None and v[0] is not None and v[1] == TensorProto.FLOAT else None


def _on_the_grid(v: np.float32 | None, q, inits: dict) -> bool:
    """Whether the float32 ``v`` is a value QuantizeLinear ``q`` (a per-tensor scale and zero point) gives back
    exactly through its DequantizeLinear: ``(n - z) * s == v``, bit for bit, for the ``n`` it quantizes to."""
    if v is None or not np.isfinite(v):
        return False
    s, z = np.float32(_scalar_init(q.input[1], inits)), int(_scalar_init(q.input[2], inits))
    n = int(_quantize(v, s, z, inits[q.input[2]].data_type))
    return np.float32(np.float32(n - z) * s).view(np.uint32) == np.float32(v).view(np.uint32)


def _padded_round_trips(g: onnx.GraphProto, inits: dict, producer: dict) -> tuple[dict[int, list], set]:
    """Plans dropping ``DequantizeLinear(QuantizeLinear(moves(DequantizeLinear(q, s, z)), s, z), s, z)`` where
    ``moves`` (a chain of :data:`_MOVES` ops and ``Pad``s, at least one ``Pad``) pads with a value the
    quantization holds exactly (zero: the zero point) or copies values (``edge``, ``reflect``): every value is
    then on the grid of ``s`` and ``z``, which the round trip keeps, so its output is the moves' own. HF's
    MobileNetV2 pads each depthwise conv's input explicitly, and the quantizer wraps the ``Pad``: with the pair
    gone the zero pad folds into the conv, and the padded image is not written by a requantization kernel.
    Not where a reader is a product or conv that :func:`fuse_qdq_matmuls` can make integer (it reads the
    DequantizeLinear). Returns the plans and the QuantizeLinear nodes (by id) whose every reader they drop."""
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    plans: dict[int, list] = {}
    dropped: dict[int, list] = {}  # QuantizeLinear (by id) -> [the node, its readers dropped]
    for k, dq2 in enumerate(g.node):
        if dq2.op_type != "DequantizeLinear" or dq2.domain not in ("", "ai.onnx"):
            continue
        q2 = producer.get(dq2.input[0])
        if q2 is None or q2.op_type != "QuantizeLinear" or not _same_quantization(dq2, q2, inits):
            continue
        chain, p = [], producer.get(q2.input[0])
        while p is not None and (p.op_type in _MOVES or p.op_type == "Pad") and p.domain in ("", "ai.onnx") \
                and p.input and len(consumers.get(p.output[0], [])) == 1:
            chain.append(p)
            p = producer.get(p.input[0])
        pads = [m for m in chain if m.op_type == "Pad"]
        if not pads or p is None or p.op_type != "DequantizeLinear" or not _same_quantization(p, q2, inits):
            continue
        # (a conv or product that fuse_qdq_matmuls makes integer reads the DequantizeLinear: kept for it)
        if any(r.op_type in ("MatMul", "Gemm") or (r.op_type == "Conv" and len(r.input) > 1 and
                                                  _dq_conv_weight(producer.get(r.input[1]), inits) is not None)
               for r in consumers.get(dq2.output[0], [])):
            continue
        ok = True
        for pad in pads:
            mode = _pad_mode(pad)
            if mode == b"constant":
                ok &= _on_the_grid(_pad_value(pad, inits, producer), q2, inits)
            else:
                ok &= mode in (b"edge", b"reflect")
        if ok:
            plans[k] = [helper.make_node("Identity", [chain[0].output[0]], [dq2.output[0]],
                                         name=f"{dq2.name or dq2.output[0]}.on_the_grid")]
            dropped.setdefault(id(q2), [q2, 0])[1] += 1
    return plans, {k for k, (q2, n) in dropped.items() if n == len(consumers.get(q2.output[0], []))}
