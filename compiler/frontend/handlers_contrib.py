"""Handlers for onnxruntime's contrib operators (domain ``com.microsoft``, and
``SimplifiedLayerNormalization``, which onnxruntime registers in the default domain): what
``onnxruntime.transformers.optimizer`` writes into a model (fused layer norms, GELUs, BERT's
``Attention``, ``MultiHeadAttention``, ``RotaryEmbedding``), what ``onnxruntime.quantization``'s
``MatMulNBitsQuantizer`` writes (4-bit block-quantized weights), and what onnxruntime-genai's model
builder writes (``GroupQueryAttention`` with a KV cache, ``GatherBlockQuantized`` for an embedding that
shares the ``lm_head``'s 4-bit weight). A model optimized or quantized that way for
onnxruntime, or an onnxruntime-genai LLM, imports here.

Each is composed from library ops (element-wise arithmetic, LayerNorm, RMSNorm, Attention, MatMul),
after onnxruntime's ``docs/ContribOperators.md`` and checked against onnxruntime's CPU kernels.
``MatMulNBits`` on float32 activations becomes the library's op of that name, its weight kept packed
(the cpu target computes on the packed bytes; the cuda target dequantizes it per rank); on half
activations, or with an act-order ``g_idx``, its weight is dequantized at import;
``GatherBlockQuantized`` keeps its table packed too. The operators of the
NCHWc layout (``com.microsoft.nchwc``), which onnxruntime writes only for the machine it optimized on,
are not contrib operators and stay refused.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from ..ir.expr import numpy_type
from ..ir.graph import Tensor
from ..ops.linalg import Attention, ExpertMatMul, GatherBlockQuantized, MatMulNBits, pack_bits, unpack_bits
from ..ops.transform import Transpose, ValuesInRange
from .qdq import four_bit_codes
from .registry import FLOATS, NodeContext, onnx_op

log = logging.getLogger(__name__)

_MS = "com.microsoft"
_OPSET = 23  # of the default-domain nodes emitted (Gelu 20, LayerNormalization 17, RMSNormalization 23)


def _float_input(ctx: NodeContext, i: int) -> Tensor:
    t = ctx.input(i)
    if t.dtype not in FLOATS:
        raise ctx.unsupported(f"dtype {t.dtype} of input {i}")
    return t


def _only_outputs(ctx: NodeContext, allowed: tuple[int, ...]) -> None:
    """Refuse the node when it names an output outside ``allowed`` (optional statistics that the
    composition does not compute), naming the output."""
    for i, name in enumerate(ctx.node.output):
        if name and i not in allowed:
            raise ctx.unsupported(f"output {i} ({name!r}; onnxruntime's training statistics)")


def _add(ctx: NodeContext, a: Tensor, b: Tensor | None) -> Tensor:
    return a if b is None else ctx.emit("Add", [a, b], _OPSET)


def _optional(ctx: NodeContext, i: int) -> Tensor | None:
    return ctx.input(i) if ctx.has_input(i) else None


def _i64(ctx: NodeContext, value) -> Tensor:
    return ctx.constant(np.asarray(value, np.int64))


def _slice_last(ctx: NodeContext, t: Tensor, lo: int, hi: int) -> Tensor:
    """``t[..., lo:hi]``."""
    return ctx.emit("Slice", [t, _i64(ctx, [lo]), _i64(ctx, [hi]), _i64(ctx, [t.ndim - 1])], _OPSET)


def _heads_first(ctx: NodeContext, t: Tensor, heads: int, head: int, what: str) -> Tensor:
    """``[b, s, heads * head]`` -> ``[b, heads, s, head]``."""
    b, s, _ = t.shape
    r = ctx.emit("Reshape", [t, _i64(ctx, [b, s, heads, head])], _OPSET)
    return ctx.add(Transpose([r], name=f"{ctx.name}/{what}_bnsh", perm=(0, 2, 1, 3)))


def _heads_last(ctx: NodeContext, y: Tensor) -> Tensor:
    """``[b, heads, s, head]`` -> ``[b, s, heads * head]``."""
    b, heads, s, head = y.shape
    t = ctx.add(Transpose([y], name=f"{ctx.name}/bshd", perm=(0, 2, 1, 3)))
    return ctx.emit("Reshape", [t, _i64(ctx, [b, s, heads * head])], _OPSET)


def _padding_bias(ctx: NodeContext, m: Tensor, b: int, keys: int, dtype: str) -> Tensor:
    """The scores' bias ``[b, 1, 1, keys]`` of a key padding mask ``m``, ``[b]`` lengths (keys at or past
    the length padded) or ``[b, keys]`` 0/1: 0 for a kept key, the node's ``mask_filter_value``
    (-10000, as onnxruntime) for a padded one."""
    if m.shape == (b,):
        keep = ctx.emit("Less", [_i64(ctx, np.arange(keys)),
                                 ctx.emit("Unsqueeze", [ctx.cast(m, "int64"), _i64(ctx, [1])], _OPSET)], _OPSET)
    elif m.shape == (b, keys):
        keep = ctx.emit("Greater", [m, ctx.constant(np.zeros((), numpy_type(m.dtype)))], _OPSET)
    else:
        raise ctx.unsupported(f"a key mask of shape {list(m.shape)} ([batch] lengths and [batch, keys] 0/1 are)")
    keep = ctx.emit("Unsqueeze", [keep, _i64(ctx, [1, 2])], _OPSET)
    dt = numpy_type(dtype)
    filt = np.array(float(ctx.attr("mask_filter_value", -10000.0)), dt)
    return ctx.emit("Where", [keep, ctx.constant(np.zeros((), dt)), ctx.constant(filt)], _OPSET)


def _hide_later(ctx: NodeContext, bias: Tensor | None, s: int, keys: int, dtype: str) -> Tensor:
    """``bias`` (or none) with the keys after each query's position (the last ``s`` of ``keys``) at -inf."""
    dt = numpy_type(dtype)
    later = np.triu(np.ones((1, 1, s, keys), bool), 1 + keys - s)
    if bias is None:
        return ctx.constant(np.where(later, -np.inf, 0).astype(dt))
    return ctx.emit("Where", [ctx.constant(later), ctx.constant(np.array(-np.inf, dt)), bias], _OPSET)


# activations --------------------------------------------------------------------------------------

@onnx_op("Gelu", since=1, domain=_MS)
def gelu(ctx):
    """``0.5 x (1 + erf(x / sqrt 2))``."""
    return [ctx.emit("Gelu", [_float_input(ctx, 0)], _OPSET)]


@onnx_op("BiasGelu", since=1, domain=_MS)
def bias_gelu(ctx):
    """``Gelu(A + B)``, B a bias broadcast along the last dim."""
    return [ctx.emit("Gelu", [_add(ctx, _float_input(ctx, 0), _float_input(ctx, 1))], _OPSET)]


@onnx_op("FastGelu", since=1, domain=_MS)
def fast_gelu(ctx):
    """GELU's tanh approximation of ``X (+ bias)``."""
    x = _add(ctx, _float_input(ctx, 0), _optional(ctx, 1))
    return [ctx.emit("Gelu", [x], _OPSET, approximate="tanh")]


@onnx_op("QuickGelu", since=1, domain=_MS)
def quick_gelu(ctx):
    """``x * sigmoid(alpha x)`` (alpha 1.702 by default; 1: SiLU)."""
    from .handlers_elementwise import swish

    return [swish(ctx, _float_input(ctx, 0), float(ctx.attr("alpha", 1.702)), ctx.name)]


# normalizations -----------------------------------------------------------------------------------

def _skip_sum(ctx: NodeContext, bias_index: int) -> Tensor:
    x, skip = _float_input(ctx, 0), _float_input(ctx, 1)
    if skip.shape != x.shape and skip.shape != x.shape[-2:] and skip.shape != (1,) + x.shape[1:]:
        raise ctx.shape_error(f"skip of shape {skip.shape} does not fit the input's {x.shape}")
    return _add(ctx, ctx.emit("Add", [x, skip], _OPSET), _optional(ctx, bias_index))


@onnx_op("SkipLayerNormalization", since=1, domain=_MS)
def skip_layer_normalization(ctx):
    """``LayerNorm(input + skip (+ bias))`` over the last dim, and the sum itself (output 3)."""
    _only_outputs(ctx, (0, 3))
    s = _skip_sum(ctx, 4)
    ins = [s, _float_input(ctx, 2)] + ([ctx.input(3)] if ctx.has_input(3) else [])
    y = ctx.emit("LayerNormalization", ins, _OPSET, axis=-1, epsilon=float(ctx.attr("epsilon", 1e-12)))
    return [y, None, None, s]


@onnx_op("SkipSimplifiedLayerNormalization", since=1, domain=_MS)
def skip_simplified_layer_normalization(ctx):
    """``RMSNorm(input + skip (+ bias))`` over the last dim, and the sum itself (output 3)."""
    _only_outputs(ctx, (0, 3))
    s = _skip_sum(ctx, 3)
    y = ctx.emit("RMSNormalization", [s, _float_input(ctx, 2)], _OPSET, axis=-1,
                 epsilon=float(ctx.attr("epsilon", 1e-12)))
    return [y, None, None, s]


@onnx_op("SimplifiedLayerNormalization", since=1)
def simplified_layer_normalization(ctx):
    """onnxruntime's RMSNorm (registered in the default domain; ONNX's own is RMSNormalization, 23)."""
    _only_outputs(ctx, (0,))
    stash = int(ctx.attr("stash_type", 1))
    if stash != 1:
        raise ctx.unsupported(f"stash_type {stash} (float32, 1, is)")
    return [ctx.emit("RMSNormalization", [_float_input(ctx, 0), _float_input(ctx, 1)], _OPSET,
                     axis=int(ctx.attr("axis", -1)), epsilon=float(ctx.attr("epsilon", 1e-5)))]


# products ------------------------------------------------------------------------------------------

@onnx_op("FusedMatMul", since=1, domain=_MS)
def fused_matmul(ctx):
    """``alpha * op(A) @ op(B)``, ``op`` swapping the last two dims where ``transA``/``transB``."""
    a, b = _float_input(ctx, 0), _float_input(ctx, 1)
    if ctx.flag("transBatchA", 0) or ctx.flag("transBatchB", 0):
        raise ctx.unsupported("transBatchA/transBatchB")
    ops = []
    for t, key, what in ((a, "transA", "A"), (b, "transB", "B")):
        if ctx.attr(key, 0):
            if t.ndim < 2:
                raise ctx.shape_error(f"{key} on a {t.ndim}-D input")
            perm = tuple(range(t.ndim - 2)) + (t.ndim - 1, t.ndim - 2)
            t = ctx.add(Transpose([t], name=f"{ctx.name}/{what}T", perm=perm))
        ops.append(t)
    y = ctx.emit("MatMul", ops, _OPSET)
    alpha = float(ctx.attr("alpha", 1.0))
    return [y if alpha == 1.0 else ctx.emit("Mul", [y, ctx.constant(np.array(alpha, numpy_type(a.dtype)))], _OPSET)]


def _block_zero_points(ctx, i: int, rows: int, blocks: int, bits: int) -> np.ndarray | None:
    """Input ``i``'s zero points as float32 ``[rows, blocks]`` (None when absent): ``bits``-bit codes
    packed like the weight, each row's blocks padded to whole bytes, or one value per block."""
    if not ctx.has_input(i):
        return None
    zp = ctx.const(i)
    if zp.dtype == np.uint8:
        per_row = -(-blocks * bits // 8)
        if zp.size != rows * per_row:
            raise ctx.invalid(f"packed zero points must be {rows} x {per_row} bytes, got {zp.size}")
        return unpack_bits(zp.reshape(rows, per_row), bits, blocks).astype(np.float32)
    if zp.size != rows * blocks:
        raise ctx.invalid(f"zero points must be packed uint8 or one value per block, got {zp.dtype} of "
                          f"{zp.size} values")
    return zp.astype(np.float32).reshape(rows, blocks)


@onnx_op("MatMulNBits", since=1, domain=_MS)
def matmul_nbits(ctx):
    """``A @ W (+ bias)`` with ``W [K, N]`` stored as ``bits``-bit integers in blocks of ``block_size``
    along K, one scale (and zero point) per block and column. A float32 ``A`` becomes the library's
    :class:`~shardflow.compiler.ops.linalg.MatMulNBits` (the weight stays packed); a float16/bfloat16
    ``A`` or a ``g_idx`` that reorders the blocks (act-order) gets the weight dequantized here."""
    a = _float_input(ctx, 0)
    k, n = int(ctx.attr("K")), int(ctx.attr("N"))
    bits, block = int(ctx.attr("bits", 4)), int(ctx.attr("block_size"))
    if bits not in (2, 4, 8):
        raise ctx.unsupported(f"bits={bits} (2, 4 and 8 are)")
    if block < 16 or block & (block - 1):
        raise ctx.invalid(f"block_size must be a power of 2 of at least 16, got {block}")
    if a.shape[-1] != k:
        raise ctx.shape_error(f"A's last dim is {a.shape[-1]}, K is {k}")
    blocks = -(-k // block)
    packed = ctx.const(1)
    if packed.dtype != np.uint8 or packed.size != n * blocks * block * bits // 8:
        raise ctx.invalid(f"B must be uint8 [N={n}, {blocks} blocks, {block * bits // 8} bytes], got "
                          f"{packed.dtype} of shape {list(packed.shape)}")
    packed = packed.reshape(n, blocks, block * bits // 8)
    scales = ctx.const(2).astype(np.float32)
    if scales.size != n * blocks:
        raise ctx.invalid(f"scales must hold N x blocks = {n * blocks} values, got {scales.size}")
    scales = scales.reshape(n, blocks)
    zp = _block_zero_points(ctx, 3, n, blocks, bits)
    group = np.arange(k) // block
    if ctx.has_input(4):
        g_idx = ctx.const(4).astype(np.int64).reshape(-1)
        if g_idx.size != k or g_idx.min() < 0 or g_idx.max() >= blocks:
            raise ctx.invalid(f"g_idx must give a block in [0, {blocks}) for each of the K = {k} rows")
        group = g_idx
    attrs = {"bits": bits, "block_size": block}
    if a.dtype == "float32" and np.array_equal(group, np.arange(k) // block):
        ins = [a, ctx.constant(np.ascontiguousarray(packed)), ctx.constant(scales)]
        ins += [ctx.constant(zp)] if zp is not None else []
        y = ctx.add(MatMulNBits(ins, name=ctx.name, **attrs))
        log.info("node %s: %d-bit weight [%d, %d] kept packed", ctx.name, bits, k, n)
        return [_add(ctx, y, _optional(ctx, 5))]
    q = unpack_bits(packed, bits, block).reshape(n, blocks * block)[:, :k].astype(np.float32)
    z = np.float32(1 << (bits - 1)) if zp is None else zp[:, group]
    w = (q - z) * scales[:, group]  # [N, K]
    weight = ctx.constant(np.ascontiguousarray(w.T).astype(numpy_type(a.dtype)))
    log.info("node %s: %d-bit weight [%d, %d] dequantized at import (%s)", ctx.name, bits, k, n,
             "activations in " + a.dtype if a.dtype != "float32" else "g_idx reorders the blocks")
    return [_add(ctx, ctx.emit("MatMul", [a, weight], _OPSET), _optional(ctx, 5))]


def _four_bit_table(ctx, four: str, rows: int, k: int, blocks: int) -> tuple[Tensor, np.ndarray]:
    """An int4/uint4 ``GatherBlockQuantized`` table (one code an element) as the library op takes it:
    codes packed two a byte, low nibble first, and float32 zero points (int4's codes and zero points
    moved up by 8, so that the differences stay; uint4's default zero point 0 made explicit)."""
    if k % 2:
        raise ctx.unsupported(f"a 4-bit table of an odd row length ({k})")
    zp = ctx.const(3) if ctx.has_input(3) else None
    if zp is not None and (zp.shape != (rows, blocks) or ctx.four_bit(3) != four):
        raise ctx.invalid(f"zero points must be {four} [{rows}, {blocks}] like the table, got "
                          f"{ctx.four_bit(3) or zp.dtype} {list(zp.shape)}")
    codes, zp = four_bit_codes(ctx.const(0), zp, four, (rows, blocks))
    return ctx.constant(pack_bits(codes, 4)), zp


@onnx_op("GatherBlockQuantized", since=1, domain=_MS)
def gather_block_quantized(ctx):
    """Rows of a table of ``bits``-bit codes (a ``uint8`` table packs 2, 4 or 8 bits a code, as
    MatMulNBits does; an initializer of ONNX's int4/uint4 holds one code an element, as
    ``MatMulNBitsQuantizer`` writes a quantized ``Gather``), rows gathered along axis 0 and blocks
    along the last, dequantized with a scale and zero point per block: the library's
    :class:`~shardflow.compiler.ops.linalg.GatherBlockQuantized`, the table kept packed (a 4-bit
    initializer repacked two codes a byte here)."""
    data, indices, scales = ctx.input(0), ctx.input(1), ctx.input(2)
    bits, block = int(ctx.attr("bits", 4)), int(ctx.attr("block_size", 128))
    four = ctx.four_bit(0)
    if four and bits != 4:
        raise ctx.invalid(f"a {four} table takes bits=4, got bits={bits}")
    rank = data.ndim
    gather_axis, quantize_axis = int(ctx.attr("gather_axis", 0)), int(ctx.attr("quantize_axis", 1))
    gather_axis += rank if gather_axis < 0 else 0
    quantize_axis += rank if quantize_axis < 0 else 0
    if data.dtype != "uint8" and not four:
        raise ctx.unsupported(f"data of type {data.dtype} (uint8, and int4/uint4 initializers, are)")
    if bits not in (2, 4, 8):
        raise ctx.unsupported(f"bits={bits} (2, 4 and 8 are)")
    if block < 16 or block & (block - 1):
        raise ctx.invalid(f"block_size must be a power of 2 of at least 16, got {block}")
    if rank != 2 or gather_axis != 0 or quantize_axis != 1:
        raise ctx.unsupported(f"data of rank {rank} gathered along axis {gather_axis} and quantized along axis "
                              f"{quantize_axis} (a table [rows, packed codes] gathered along 0, quantized along 1 is)")
    if indices.dtype not in ("int32", "int64"):
        raise ctx.invalid(f"indices must be int32 or int64, got {indices.dtype}")
    if scales.dtype not in ("float32", "float16"):
        raise ctx.unsupported(f"scales of type {scales.dtype} (float32 and float16 are)")
    rows, k = data.shape[0], data.shape[1] * (1 if four else 8 // bits)
    blocks = -(-k // block)
    if tuple(scales.shape) != (rows, blocks):
        raise ctx.shape_error(f"scales must be [{rows}, {blocks}] (a scale per block of {block} of the "
                              f"{k} values of a row), got {list(scales.shape)}")
    if four:
        data, zp = _four_bit_table(ctx, four, rows, k, blocks)
    else:
        zp = _block_zero_points(ctx, 3, rows, blocks, bits)
    ins = [data, indices, scales] + ([ctx.constant(zp)] if zp is not None else [])
    return [ctx.add(GatherBlockQuantized(ins, name=ctx.name, bits=bits, block_size=block))]


_MOE_ACTIVATIONS = ("relu", "gelu", "silu", "identity", "swiglu")


@onnx_op("MoE", since=1, domain=_MS)
def mixture_of_experts(ctx):
    """A mixture of experts as onnxruntime's CPU kernel computes it: ``softmax(router)`` over the
    experts, the ``k`` largest (renormalized to sum 1 with ``normalize_routing_weights``) weigh their
    experts' ``fc2(act(fc1(x)))`` (biases optional), the others weigh 0. Each expert's weights are
    ``[out, in]`` in memory whatever the declared shape (the legacy ``[E, in, out]`` shape is read
    that way too, as onnxruntime does). Activations: relu, gelu (tanh form), silu, identity, and
    swiglu with interleaved ``[gate, linear]`` columns (``swiglu_fusion`` 1): ``min(gate, limit) *
    sigmoid(alpha * min(gate, limit)) * (clip(linear, -limit, limit) + beta)``.

    With few tokens (``tokens * k <= 2 num_experts``: decoding), or at any count when the import is
    told so (``routed_experts``: the cpu target, whose grouped template is faster at every size
    measured), only each token's k experts are computed (:class:`~shardflow.compiler.ops.linalg.ExpertMatMul`,
    which reads the chosen experts' weights alone; the planner splits their rows; see
    :func:`moe_routed`). Otherwise densely: every expert on every token (a GEMM on the experts'
    stacked rows, every weight read once), then the weighted sum over experts, so the planner can
    split the experts over devices (a partial sum) like any contraction, at ``num_experts / k``
    times the routed products. The k experts are found without a sort (an expert is chosen when
    fewer than k come before it), so every target compiles it; equal probabilities go to the higher
    expert index, as onnxruntime's sort has them."""
    x, router = _float_input(ctx, 0), _float_input(ctx, 1)
    act = str(ctx.attr("activation_type", "relu")).lower()
    if act not in _MOE_ACTIVATIONS:
        raise ctx.unsupported(f"activation_type {act!r} ({', '.join(_MOE_ACTIVATIONS)} are)")
    if ctx.flag("use_sparse_mixer", 0):
        raise ctx.unsupported("use_sparse_mixer")
    if ctx.has_input(6) or ctx.has_input(7):
        raise ctx.unsupported("fc3 (a third expert weight)")
    if act == "swiglu" and int(ctx.attr("swiglu_fusion", 0)) != 1:
        raise ctx.unsupported(f"swiglu_fusion={ctx.attr('swiglu_fusion', 0)} (1, the interleaved columns, is)")
    if x.dtype != "float32" or router.dtype != "float32":
        raise ctx.unsupported(f"input of type {x.dtype} (float32 is)")
    if x.ndim not in (2, 3) or router.ndim != 2:
        raise ctx.shape_error(f"input [tokens, hidden] or [batch, seq, hidden] and router [tokens, experts], got "
                              f"{list(x.shape)} and {list(router.shape)}")
    hidden, (tokens, experts) = x.shape[-1], router.shape
    w1, w2 = ctx.input(2), ctx.input(4)
    inter = w2.size // (experts * hidden) if w2.ndim == 3 and experts and hidden else 0
    out1 = 2 * inter if act == "swiglu" else inter
    if tokens != x.size // max(hidden, 1) or w1.size != experts * out1 * hidden or w2.size != experts * hidden * inter \
            or w1.ndim != 3 or w2.ndim != 3 or not inter:
        raise ctx.shape_error(f"router {list(router.shape)}, fc1 {list(w1.shape)} and fc2 {list(w2.shape)} do not fit "
                              f"{tokens} tokens of {hidden} and {experts} experts")
    k = int(ctx.attr("k", 1))
    if not 1 <= k <= experts:
        raise ctx.invalid(f"k={k} must be between 1 and the {experts} experts")
    flat = ctx.emit("Reshape", [x, _i64(ctx, [tokens, hidden])], _OPSET)
    probs = ctx.emit("Softmax", [router], _OPSET, axis=-1)
    # expert e is chosen when fewer than k experts come before it: a larger probability, or an equal
    # one and a higher index (onnxruntime's order); element-wise, no sort (any target)
    p_e = ctx.emit("Unsqueeze", [probs, _i64(ctx, [2])], _OPSET)
    p_j = ctx.emit("Unsqueeze", [probs, _i64(ctx, [1])], _OPSET)
    later = ctx.constant(np.arange(experts)[None, :] > np.arange(experts)[:, None])  # [e, j]: j > e
    ahead = ctx.emit("Or", [ctx.emit("Greater", [p_j, p_e], _OPSET),
                            ctx.emit("And", [ctx.emit("Equal", [p_j, p_e], _OPSET), later], _OPSET)], _OPSET)
    before = ctx.emit("ReduceSum", [ctx.cast(ahead, "float32"), _i64(ctx, [2])], _OPSET, keepdims=0)
    chosen = ctx.cast(ctx.emit("Less", [before, ctx.constant(np.array(k, np.float32))], _OPSET), "float32")
    gate = ctx.emit("Mul", [probs, chosen], _OPSET)
    if ctx.flag("normalize_routing_weights", 0):
        gate = ctx.emit("Div", [gate, ctx.emit("ReduceSum", [gate, _i64(ctx, [-1])], _OPSET, keepdims=1)], _OPSET)
    w1 = ctx.emit("Reshape", [w1, _i64(ctx, [experts, out1, hidden])], _OPSET)
    w2 = ctx.emit("Reshape", [w2, _i64(ctx, [experts, hidden, inter])], _OPSET)
    b1 = ctx.emit("Reshape", [ctx.input(3), _i64(ctx, [experts, out1])], _OPSET) if ctx.has_input(3) else None
    b2 = ctx.emit("Reshape", [ctx.input(5), _i64(ctx, [experts, hidden])], _OPSET) if ctx.has_input(5) else None
    if moe_routed(tokens, k, experts, ctx.routed_experts):
        # each token's k experts by their rank (slot j holds the expert with j experts before it), and
        # only their weights read (ExpertMatMul)
        slot = ctx.cast(ctx.emit("Equal", [ctx.emit("Unsqueeze", [before, _i64(ctx, [1])], _OPSET),
                                           ctx.constant(np.arange(k, dtype=np.float32)[None, :, None])], _OPSET),
                        "float32")                                                          # [t, j, e] one-hot
        idx = ctx.cast(ctx.emit("Einsum", [slot, ctx.constant(np.arange(experts, dtype=np.float32))], _OPSET,
                                equation="tje,e->tj"), "int64")
        gate = ctx.emit("Einsum", [slot, gate], _OPSET, equation="tje,te->tj")

        def product(a, w, b, what):  # [tokens, (k,) in] by each slot's expert -> [tokens, k, out]
            ins = [a, w, idx] + ([b] if b is not None else [])
            return ctx.add(ExpertMatMul(ins, name=f"{ctx.name}/{what}"))
        h = product(flat, w1, b1, "fc1")
        y = product(_moe_activation(ctx, h, act), w2, b2, "fc2")
        out = ctx.emit("Einsum", [gate, y], _OPSET, equation="tj,tjh->th")
    else:  # (fc1 of every expert as one product with the experts' rows stacked: a GEMM, weights read once)
        stacked = ctx.emit("Reshape", [w1, _i64(ctx, [experts * out1, hidden])], _OPSET)
        h = ctx.emit("Reshape", [ctx.emit("Gemm", [flat, stacked], _OPSET, transB=1),
                                 _i64(ctx, [tokens, experts, out1])], _OPSET)
        h = _add(ctx, h, b1)
        y = _add(ctx, ctx.emit("Einsum", [_moe_activation(ctx, h, act), w2], _OPSET, equation="tei,ehi->teh"), b2)
        out = ctx.emit("Einsum", [gate, y], _OPSET, equation="te,teh->th")
    return [ctx.emit("Reshape", [out, _i64(ctx, list(x.shape))], _OPSET)]


def moe_routed(tokens: int, k: int, experts: int, always: bool = False) -> bool:
    """Whether an ``MoE`` of ``tokens`` tokens computes only each token's ``k`` experts (ExpertMatMul:
    ``tokens * k`` slots, each chosen expert's weight read once on the cpu target, whose template
    groups the slots by expert) rather than every expert on every token (a GEMM on all the experts'
    weights, ``experts / k`` times the products): ``always`` (the import's ``routed_experts``, which
    ``compile`` sets for the cpu target: ahead at every size benchmarks/cpu_moe.py measured,
    ``results/cpu-moe-2core-xeon-2026-11-28-s37.txt``), else while the slots are at most twice the
    experts (decoding, memory-bound on any target). Past that the dense form stays elsewhere: on a
    GPU it is one tensor-core GEMM where ExpertMatMul is the generic kernel, one weight read per
    slot (not measured: no GPU was lent in session 37)."""
    return always or tokens * k <= 2 * experts


def _moe_activation(ctx, h: Tensor, act: str) -> Tensor:
    """An expert's activation on its first product ``h [tokens, experts, out]`` (see MoE)."""
    if act == "relu":
        return ctx.emit("Relu", [h], _OPSET)
    if act == "gelu":
        return ctx.emit("Gelu", [h], _OPSET, approximate="tanh")
    if act == "silu":
        return ctx.emit("Mul", [h, ctx.emit("Sigmoid", [h], _OPSET)], _OPSET)
    if act == "identity":
        return h
    width = h.shape[-1]
    pick = lambda start: ctx.emit("Slice", [h, _i64(ctx, [start]), _i64(ctx, [width]), _i64(ctx, [-1]),  # noqa: E731
                                            _i64(ctx, [2])], _OPSET)
    gate, linear = pick(0), pick(1)
    limit = ctx.attr("swiglu_limit", None)
    if limit is not None:
        lim = float(limit)
        gate = ctx.emit("Min", [gate, ctx.constant(np.array(lim, np.float32))], _OPSET)
        linear = ctx.emit("Clip", [linear, ctx.constant(np.array(-lim, np.float32)),
                                   ctx.constant(np.array(lim, np.float32))], _OPSET)
    alpha, beta = float(ctx.attr("activation_alpha", 1.0)), float(ctx.attr("activation_beta", 0.0))
    swish = ctx.emit("Mul", [gate, ctx.emit("Sigmoid", [ctx.emit("Mul", [gate, ctx.constant(
        np.array(alpha, np.float32))], _OPSET)], _OPSET)], _OPSET)
    return ctx.emit("Mul", [swish, ctx.emit("Add", [linear, ctx.constant(np.array(beta, np.float32))], _OPSET)],
                    _OPSET)


# attention -----------------------------------------------------------------------------------------

@onnx_op("Attention", since=1, domain=_MS)
def contrib_attention(ctx):
    """BERT-style multi-head self-attention with its input projection: ``input @ weights + bias`` split
    into Q, K, V, ``softmax(Q K^T * scale + mask) V`` per head, padded keys given ``mask_filter_value``
    (-10000) and, ``unidirectional``, later tokens -inf, as onnxruntime's CPU kernel does. ``mask_index``: none,
    ``[batch]`` key lengths, or a ``[batch, keys]`` 0/1 padding mask. No past state, attention bias
    or rotary embedding."""
    _only_outputs(ctx, (0,))
    x, w = _float_input(ctx, 0), _float_input(ctx, 1)
    for i, what in ((4, "past"), (5, "attention_bias"), (6, "past_sequence_length")):
        if ctx.has_input(i):
            raise ctx.unsupported(f"input {what}")
    if ctx.flag("do_rotary", 0):
        raise ctx.unsupported("do_rotary")
    if x.ndim != 3 or w.ndim != 2 or w.shape[0] != x.shape[2]:
        raise ctx.shape_error(f"input [batch, seq, in] {list(x.shape)} and weights [in, 3 hidden] "
                              f"{list(w.shape)} do not fit")
    heads = int(ctx.attr("num_heads"))
    sizes = [int(s) for s in ctx.attr("qkv_hidden_sizes", [])] or [w.shape[1] // 3] * 3
    if len(sizes) != 3 or sum(sizes) != w.shape[1] or sizes[0] != sizes[1] or any(s % heads for s in sizes):
        raise ctx.shape_error(f"qkv_hidden_sizes {sizes} must be Q = K sizes, divisible by num_heads = {heads}, "
                              f"summing to the weights' {w.shape[1]} columns")
    b, s, _ = x.shape
    qkv = _add(ctx, ctx.emit("MatMul", [x, w], _OPSET), _optional(ctx, 2))
    starts = np.cumsum([0] + sizes)
    q, k, v = (_slice_last(ctx, qkv, starts[i], starts[i + 1]) for i in range(3))
    scale = float(ctx.attr("scale", 0.0)) or 1.0 / math.sqrt(sizes[0] // heads)
    bias = _padding_bias(ctx, ctx.input(3), b, s, x.dtype) if ctx.has_input(3) else None
    if ctx.flag("unidirectional", 0):  # (a padded earlier key stays at the filter value)
        bias = _hide_later(ctx, bias, s, s, x.dtype)
    ins = [q, k, v] + ([bias] if bias is not None else [])
    return [ctx.emit("Attention", ins, _OPSET, q_num_heads=heads, kv_num_heads=heads, scale=scale)]


def _gqa_ends(ctx, b: int, total: int | None = None) -> Tensor | None:
    """Each sequence's end, ``seqlens_k + 1``, as ``[b, 1, 1, 1]`` (``None`` without ``seqlens_k``). With
    ``total`` (the total sequence length T), ``seqlens_k`` outside ``[0, T)`` is an error, as onnxruntime
    refuses it, where the masks built from it would give plausible values (:class:`ValuesInRange`: the
    evaluator raises, a compiled program checks it at run time)."""
    if not ctx.has_input(5):
        return None
    lens = ctx.cast(ctx.input(5), "int64")
    if total is not None:
        lens = ctx.add(ValuesInRange([lens], name=f"{ctx.name}/seqlens_k_in_range", lo=0, hi=total - 1,
                                     what="seqlens_k"))
    return ctx.emit("Reshape", [ctx.emit("Add", [lens, _i64(ctx, 1)], _OPSET), _i64(ctx, [b, 1, 1, 1])], _OPSET)


@onnx_op("GroupQueryAttention", since=1, domain=_MS)
def group_query_attention(ctx):
    """Grouped-query attention as onnxruntime-genai's LLMs write it: Q, K, V (or one packed QKV), the
    past key and value ``[batch, kv_heads, P, head]``, each sequence's length ``seqlens_k + 1`` and the
    ``total_sequence_length`` T (known from shapes), rotary embeddings from ``cos_cache``/``sin_cache``
    (``do_rotary``), ``local_window_size``, ``softcap``, attention sinks (``head_sink``, or 0 for every
    head with ``smooth_softmax``) and a windowed cache (``sliding_window_cache``: see
    :func:`_windowed_group_query_attention`); as onnxruntime's CPU kernel computes them.

    The prompt (P = 0): positions ``0..S-1``, each query attending to the keys at or before it and
    before its sequence's length; the present key and value are the new ones. A later step (P > 0):
    each sequence's past length is ``p = seqlens_k + 1 - S``; its new tokens take positions
    ``p..p+S-1`` (rotary and causal), the present (``max(P, T)`` long: a cache of fixed size when P
    = T) holds the past before ``p``, the new keys and values after it, zeros past ``p + S``."""
    _only_outputs(ctx, (0, 1, 2))
    q = _float_input(ctx, 0)
    heads, kv_heads = int(ctx.attr("num_heads")), int(ctx.attr("kv_num_heads"))
    if q.ndim != 3:
        raise ctx.shape_error(f"query must be [batch, seq, hidden], got {list(q.shape)}")
    b, s, hidden = q.shape
    if ctx.has_input(1) != ctx.has_input(2):
        raise ctx.invalid("key and value must be given together")
    if ctx.has_input(1):
        k, v = _float_input(ctx, 1), _float_input(ctx, 2)
        head = hidden // heads
    else:  # packed [Q | K | V] along the hidden dim
        head = hidden // (heads + 2 * kv_heads)
        if head * (heads + 2 * kv_heads) != hidden:
            raise ctx.shape_error(f"packed QKV width {hidden} is not (num_heads + 2 kv_num_heads) x head")
        bounds = np.cumsum([0, heads * head, kv_heads * head, kv_heads * head])
        q, k, v = (_slice_last(ctx, q, bounds[i], bounds[i + 1]) for i in range(3))
    if k.shape != (b, s, kv_heads * head) or v.shape != k.shape:
        raise ctx.shape_error(f"key and value must be [{b}, {s}, {kv_heads * head}], got {list(k.shape)} and "
                              f"{list(v.shape)}")
    for i, what in ((9, "position_ids"), (10, "attention_bias"), (12, "k_scale (a quantized KV cache)"),
                    (13, "v_scale (a quantized KV cache)"), (14, "q_norm_weight"), (15, "k_norm_weight")):
        if ctx.has_input(i):
            raise ctx.unsupported(f"input {what}")
    if ctx.attr("qk_output", 0):
        raise ctx.unsupported("qk_output")
    if int(ctx.attr("kv_cache_bit_width", 0)) or {ctx.attr("k_quant_type", "NONE"), ctx.attr("v_quant_type", "NONE")} \
            != {"NONE"}:
        raise ctx.unsupported("a quantized KV cache (kv_cache_bit_width, k_quant_type, v_quant_type)")
    if int(ctx.attr("causal", 1)) != 1:
        raise ctx.unsupported(f"causal={ctx.attr('causal')} (attention without the causal mask)")
    sink = _attention_sink(ctx, heads)
    past_k, past_v = _optional(ctx, 3), _optional(ctx, 4)
    if (past_k is None) != (past_v is None):
        raise ctx.invalid("past_key and past_value must be given together")
    n_past = past_k.shape[2] if past_k is not None else 0
    if past_k is not None and (past_k.shape != (b, kv_heads, n_past, head) or past_v.shape != past_k.shape):
        raise ctx.shape_error(f"past key and value must be [{b}, {kv_heads}, P, {head}], got {list(past_k.shape)} "
                              f"and {list(past_v.shape)}")
    if n_past and not ctx.has_input(5):
        raise ctx.invalid("a past needs seqlens_k")
    window = int(ctx.attr("local_window_size", -1))
    scale = float(ctx.attr("scale", 0.0)) or 1.0 / math.sqrt(head)
    softcap = float(ctx.attr("softcap", 0.0))
    if int(ctx.attr("sliding_window_cache", 0)) == 1:
        return _windowed_group_query_attention(ctx, q, k, v, past_k, past_v, _gqa_ends(ctx, b), heads, kv_heads,
                                               head, window, scale, softcap, sink)
    total = int(np.asarray(ctx.const(6)).reshape(-1)[0]) if ctx.has_input(6) and (n_past or ctx.is_const(6)) else s
    if not n_past and total != s:
        raise ctx.invalid(f"total_sequence_length {total} differs from the prompt's {s} with no past")
    ends = _gqa_ends(ctx, b, total)
    length = max(n_past, total) if n_past else s  # of the present key and value
    p4 = ctx.emit("Sub", [ends, _i64(ctx, s)], _OPSET) if n_past else None
    q, k = _gqa_rotary(ctx, q, k, p4 if n_past else None, heads, kv_heads)
    k4, v4 = (_heads_first(ctx, t, kv_heads, head, what) for t, what in ((k, "key"), (v, "value")))
    if n_past:  # the present: past before p, the new tokens at p..p+S-1, zeros after
        j = _i64(ctx, np.arange(length)[None, None, :, None])                 # [1, 1, L, 1]
        rel = ctx.emit("Sub", [j, p4], _OPSET)                                # j - p
        is_new = ctx.emit("And", [ctx.emit("GreaterOrEqual", [rel, _i64(ctx, 0)], _OPSET),
                                  ctx.emit("Less", [rel, _i64(ctx, s)], _OPSET)], _OPSET)
        is_past = ctx.emit("Less", [j, p4], _OPSET)
        # new key j - p at row j: one new token is the same row everywhere (broadcast, no index)
        idx = ctx.emit("Expand", [ctx.emit("Clip", [rel, _i64(ctx, 0), _i64(ctx, s - 1)], _OPSET),
                                  _i64(ctx, [b, kv_heads, length, head])], _OPSET) if s > 1 else None
        presents = []
        for new, past in ((k4, past_k), (v4, past_v)):
            if length > n_past:
                past = ctx.emit("Pad", [past, _i64(ctx, [0, 0, 0, 0, 0, 0, length - n_past, 0])], _OPSET)
            moved = ctx.emit("GatherElements", [new, idx], _OPSET, axis=2) if s > 1 else new
            zero = ctx.constant(np.zeros((), numpy_type(new.dtype)))
            presents.append(ctx.emit("Where", [is_past, past, ctx.emit("Where", [is_new, moved, zero], _OPSET)],
                                     _OPSET))
        k_att, v_att = presents
    else:
        presents = [k4, v4]
        k_att, v_att = k4, v4
    # which keys each query sees: at or before its position, before its sequence's end, in the window
    qpos = np.arange(s)[:, None]
    keys = np.arange(length)[None, :]
    if n_past:
        at = ctx.emit("Add", [p4, _i64(ctx, qpos[None, None])], _OPSET)      # [b, 1, S, 1] positions
        kj = _i64(ctx, keys[None, None])
        keep = ctx.emit("LessOrEqual", [kj, at], _OPSET)
        if window > 0:
            keep = ctx.emit("And", [keep, ctx.emit("Greater", [kj, ctx.emit("Sub", [at, _i64(ctx, window)], _OPSET)],
                                                   _OPSET)], _OPSET)
    else:
        allowed = keys <= qpos
        if window > 0:
            allowed &= keys > qpos - window
        keep = ctx.constant(allowed[None, None])  # [1, 1, S, S]
    if ends is not None:  # keys at or past the sequence's end are hidden
        keep = ctx.emit("And", [keep, ctx.emit("Less", [_i64(ctx, np.arange(length)), ends], _OPSET)], _OPSET)
    y4 = _gqa_attend(ctx, _heads_first(ctx, q, heads, head, "query"), k_att, v_att, keep, scale, softcap, sink,
                     ends)
    return [_heads_last(ctx, y4), *presents]


def _attention_sink(ctx: NodeContext, heads: int) -> Tensor | None:
    """GroupQueryAttention's extra softmax logit per head: ``head_sink`` ``[num_heads]`` (gpt-oss's
    attention sinks), else 0 for every head with ``smooth_softmax`` = 1 (onnxruntime enables it at 1
    only), else None."""
    if ctx.has_input(11):
        sink = _float_input(ctx, 11)
        if sink.shape != (heads,):
            raise ctx.shape_error(f"head_sink must be [{heads}] (one value per query head), got {list(sink.shape)}")
        return sink
    if int(ctx.attr("smooth_softmax", -1)) == 1:
        return ctx.constant(np.zeros(heads, numpy_type(ctx.input(0).dtype)))
    return None


def _gqa_rotary(ctx: NodeContext, q: Tensor, k: Tensor, p4: Tensor | None, heads: int,
                kv_heads: int) -> tuple[Tensor, Tensor]:
    """Q and K rotated (``do_rotary``) at positions ``p..p+S-1`` of each sequence (``p4``
    ``[b, 1, 1, 1]``; ``0..S-1`` when None)."""
    if not ctx.flag("do_rotary", 0):
        return q, k
    b, s = q.shape[:2]
    pos = (ctx.emit("Add", [ctx.emit("Reshape", [p4, _i64(ctx, [b, 1])], _OPSET), _i64(ctx, np.arange(s)[None])],
                    _OPSET) if p4 is not None else _i64(ctx, np.broadcast_to(np.arange(s), (b, s))))
    cos, sin = _float_input(ctx, 7), _float_input(ctx, 8)
    rot = dict(interleaved=int(ctx.flag("rotary_interleaved", 0)), rotary_embedding_dim=2 * cos.shape[-1])
    return (ctx.emit("RotaryEmbedding", [q, cos, sin, pos], _OPSET, num_heads=heads, **rot),
            ctx.emit("RotaryEmbedding", [k, cos, sin, pos], _OPSET, num_heads=kv_heads, **rot))


def _gqa_attend(ctx: NodeContext, q4: Tensor, k4: Tensor, v4: Tensor, keep: Tensor, scale: float, softcap: float,
                sink: Tensor | None, ends: Tensor | None = None) -> Tensor:
    """The library's Attention of ``q4`` ``[b, heads, S, D]`` over ``k4``/``v4`` ``[b, kv_heads, L, D]``,
    the keys each query sees given by the bool ``keep`` (broadcast to ``[b, heads, S, L]``), with the
    head's attention sink. ``ends`` (``[b, 1, 1, 1]``, keys at or past it hidden by ``keep`` already)
    also goes in as ``nonpad_kv_seqlen``: the kernels then skip those keys instead of masking them (a
    decoding step over a cache of fixed size reads only the rows in use)."""
    nonpad = [ctx.emit("Reshape", [ends, _i64(ctx, [q4.shape[0]])], _OPSET)] if ends is not None else []
    ins = [q4, k4, v4, keep] + nonpad + ([sink] if sink is not None else [])
    return ctx.add(Attention(ins, name=ctx.name, q_heads=q4.shape[1], kv_heads=k4.shape[1],
                             scale_sqrt=math.sqrt(scale), scale=scale, softcap=softcap, has_mask=True,
                             has_nonpad=bool(nonpad), has_sink=sink is not None))


def _windowed_group_query_attention(ctx: NodeContext, q: Tensor, k: Tensor, v: Tensor, past_k: Tensor | None,
                                    past_v: Tensor | None, ends: Tensor | None, heads: int, kv_heads: int, head: int,
                                    window: int, scale: float, softcap: float, sink: Tensor | None) -> list[Tensor]:
    """GroupQueryAttention with ``sliding_window_cache`` = 1 (onnxruntime-genai's local layers, as
    gpt-oss's): the past and the present are a buffer of C >= ``local_window_size`` rows holding only
    the latest positions, as onnxruntime 1.32's CPU kernel keeps it. With a sequence's past P
    (``seqlens_k + 1 - S``), the buffer's first ``end(P)`` rows hold positions ``P - end(P)..P-1`` in
    order, where ``end(x) = x`` up to C and, past C, ``x`` less as many blocks of ``gap = C - W + 1``
    rows as bring it to C or under (the kernel compacts a block at once, so ``end`` is a function of
    the absolute length and the op stays stateless). The new keys (rotated at positions ``P..P+S-1``)
    are attended together with the resident ones, each query seeing the keys of the last W positions
    up to its own; the present holds positions ``P+S-end(P+S)..P+S-1`` in its first ``end(P+S)``
    rows and zeros after them (onnxruntime leaves those rows as they were: no step reads them).
    ``ends``: each sequence's ``seqlens_k + 1`` as ``[b, 1, 1, 1]``."""
    b, s = q.shape[:2]
    if window <= 0 or past_k is None or ends is None:
        raise ctx.invalid("sliding_window_cache=1 needs local_window_size > 0, a past key and value and seqlens_k")
    cap = past_k.shape[2]
    if cap < window:
        raise ctx.invalid(f"sliding_window_cache: the KV cache's capacity {cap} (the past's dim 2) is less than "
                          f"local_window_size {window}")
    gap = cap - window + 1

    def i64(value):
        return _i64(ctx, value)

    def op(kind, *ins):
        return ctx.emit(kind, list(ins), _OPSET)

    def cache_end(x):  # rows in use after x positions ([b, 1, 1, 1])
        blocks = op("Div", op("Add", op("Sub", x, i64(cap)), i64(gap - 1)), i64(gap))
        return op("Where", op("LessOrEqual", x, i64(cap)), x, op("Sub", x, op("Mul", blocks, i64(gap))))

    p4 = op("Max", op("Sub", ends, i64(s)), i64(0))  # each sequence's past P
    q, k = _gqa_rotary(ctx, q, k, p4, heads, kv_heads)
    k4, v4 = (_heads_first(ctx, t, kv_heads, head, what) for t, what in ((k, "key"), (v, "value")))
    before, after = cache_end(p4), cache_end(op("Add", p4, i64(s)))
    # the keys: the buffer's C rows (row r at position P - end(P) + r, in use below end(P)), then the new
    keys_k, keys_v = (ctx.emit("Concat", [past, new], _OPSET, axis=2) for past, new in ((past_k, k4), (past_v, v4)))
    rows = i64(np.arange(cap)[None, None, None, :])
    pos = ctx.emit("Concat", [op("Add", op("Sub", p4, before), rows),
                              op("Add", p4, i64(np.arange(s)[None, None, None, :]))], _OPSET, axis=3)
    used = ctx.emit("Concat", [op("Less", rows, before),
                               ctx.constant(np.ones((b, 1, 1, s), bool))], _OPSET, axis=3)  # [b, 1, 1, C + S]
    at = op("Add", p4, i64(np.arange(s)[None, None, :, None]))                                 # [b, 1, S, 1]
    keep = op("And", op("And", used, op("LessOrEqual", pos, at)), op("Greater", pos, op("Sub", at, i64(window))))
    y4 = _gqa_attend(ctx, _heads_first(ctx, q, heads, head, "query"), keys_k, keys_v, keep, scale, softcap, sink)
    # the present's row r: buffer row r + end(P) - kept below kept = end(P + S) - S, else new key r - kept
    r = i64(np.arange(cap)[None, None, :, None])
    kept = op("Sub", after, i64(s))
    src = op("Where", op("Less", r, kept), op("Add", r, op("Sub", before, kept)), op("Add", op("Sub", r, kept),
                                                                                   i64(cap)))
    idx = ctx.emit("Expand", [op("Clip", src, i64(0), i64(cap + s - 1)), i64([b, kv_heads, cap, head])], _OPSET)
    zero = ctx.constant(np.zeros((), numpy_type(k4.dtype)))
    filled = op("Less", r, after)
    presents = [op("Where", filled, ctx.emit("GatherElements", [t, idx], _OPSET, axis=2), zero)
                for t in (keys_k, keys_v)]
    return [_heads_last(ctx, y4), *presents]


@onnx_op("RotaryEmbedding", since=1, domain=_MS)
def contrib_rotary_embedding(ctx):
    """onnxruntime's rotary embedding: ONNX's (opset 23) with its inputs in another order
    (input, position_ids, cos_cache, sin_cache) and ``position_ids`` also a single offset: positions
    ``offset..offset+S-1`` for every sequence."""
    x, pos = _float_input(ctx, 0), ctx.input(1)
    cos, sin = _float_input(ctx, 2), _float_input(ctx, 3)
    if ctx.flag("is_packed_batching", 0):
        raise ctx.unsupported("is_packed_batching")
    if float(ctx.attr("scale", 1.0)) != 1.0:
        raise ctx.unsupported("a scale other than 1")
    b, s = x.shape[0], x.shape[-2] if x.ndim == 4 else x.shape[1]
    if pos.size == 1:  # an offset
        pos = ctx.emit("Add", [ctx.emit("Reshape", [ctx.cast(pos, "int64"), _i64(ctx, [1, 1])], _OPSET),
                               _i64(ctx, np.broadcast_to(np.arange(s), (b, s)))], _OPSET)
    elif pos.shape != (b, s):
        raise ctx.shape_error(f"position_ids must be [{b}, {s}] or one offset, got {list(pos.shape)}")
    attrs = {"interleaved": int(ctx.flag("interleaved", 0))}
    if ctx.attr("rotary_embedding_dim", 0):
        attrs["rotary_embedding_dim"] = int(ctx.attr("rotary_embedding_dim"))
    if x.ndim == 3:
        heads = int(ctx.attr("num_heads", 0))
        if not heads:  # (onnxruntime's default: the head size is the cache's width times 2)
            heads = x.shape[2] // (2 * cos.shape[-1])
        attrs["num_heads"] = heads
    return [ctx.emit("RotaryEmbedding", [x, cos, sin, ctx.cast(pos, "int64")], _OPSET, **attrs)]


@onnx_op("MultiHeadAttention", since=1, domain=_MS)
def multi_head_attention(ctx):
    """Multi-head attention on projected Q, K, V: ``query`` ``[b, s, hidden]``, ``key``/``value``
    ``[b, l, hidden]`` or ``[b, heads, l, head]`` (cross attention), an optional ``bias`` for the three,
    ``key_padding_mask`` (``[b]`` lengths or ``[b, l]`` 0/1: padded keys get ``mask_filter_value``),
    ``attention_bias`` added to the scores, ``unidirectional`` (later keys -inf). Packed QKV/KV, a past,
    and cache indirection are refused."""
    _only_outputs(ctx, (0,))
    q = _float_input(ctx, 0)
    for i, what in ((6, "past_key"), (7, "past_value"), (8, "past_sequence_length"), (9, "cache_indirection")):
        if ctx.has_input(i):
            raise ctx.unsupported(f"input {what}")
    if q.ndim != 3 or not ctx.has_input(1) or not ctx.has_input(2) or ctx.input(1).ndim == 5:
        raise ctx.unsupported("packed QKV or KV (query [b, s, hidden] with separate key and value are)")
    k, v = _float_input(ctx, 1), _float_input(ctx, 2)
    heads = int(ctx.attr("num_heads"))
    b, s, hidden = q.shape
    if ctx.has_input(3):  # [q_hidden + k_hidden + v_hidden]
        bias = ctx.input(3)
        vh = v.shape[2] if v.ndim == 3 else v.shape[1] * v.shape[3]
        kh = k.shape[2] if k.ndim == 3 else k.shape[1] * k.shape[3]
        cuts = np.cumsum([0, hidden, kh, vh])
        if bias.shape != (cuts[-1],):
            raise ctx.shape_error(f"bias must be [{cuts[-1]}], got {list(bias.shape)}")
        parts = [_slice_last(ctx, bias, cuts[i], cuts[i + 1]) for i in range(3)]
        q = ctx.emit("Add", [q, parts[0]], _OPSET)
        if k.ndim == 4 or v.ndim == 4:
            raise ctx.unsupported("a bias with 4-D key/value")
        k, v = ctx.emit("Add", [k, parts[1]], _OPSET), ctx.emit("Add", [v, parts[2]], _OPSET)
    head = hidden // heads
    q4 = _heads_first(ctx, q, heads, head, "query")
    k4 = k if k.ndim == 4 else _heads_first(ctx, k, heads, k.shape[2] // heads, "key")
    v4 = v if v.ndim == 4 else _heads_first(ctx, v, heads, v.shape[2] // heads, "value")
    length = k4.shape[2]
    bias_in = _padding_bias(ctx, ctx.input(4), b, length, q.dtype) if ctx.has_input(4) else None
    if ctx.has_input(5):
        ab = _float_input(ctx, 5)
        bias_in = ab if bias_in is None else ctx.emit("Add", [bias_in, ab], _OPSET)
    if ctx.flag("unidirectional", 0):
        bias_in = _hide_later(ctx, bias_in, s, length, q.dtype)
    ins = [q4, k4, v4] + ([bias_in] if bias_in is not None else [])
    scale = float(ctx.attr("scale", 0.0)) or 1.0 / math.sqrt(head)
    return [_heads_last(ctx, ctx.emit("Attention", ins, _OPSET, scale=scale))]


@onnx_op("EmbedLayerNormalization", since=1, domain=_MS)
def embed_layer_normalization(ctx):
    """BERT's embeddings: word (by ``input_ids``) + position (by ``position_ids``, default ``0..S-1``)
    + segment (by ``segment_ids``) embeddings, LayerNorm'd; output 1 ``mask_index`` the number of
    ones of each row of ``mask`` (int32, zeros without a mask), output 2 the sum before the norm."""
    ids = ctx.input(0)
    if ids.ndim != 2 or ids.dtype not in ("int32", "int64"):
        raise ctx.invalid(f"input_ids must be [batch, seq] int32, got {ids.dtype} {list(ids.shape)}")
    b, s = ids.shape
    words, positions = _float_input(ctx, 2), _float_input(ctx, 3)
    x = ctx.emit("Gather", [words, ids], _OPSET)
    pos = ctx.input(9) if ctx.has_input(9) else ctx.constant(np.arange(s, dtype=np.int64)[None])
    x = ctx.emit("Add", [x, ctx.emit("Gather", [positions, pos], _OPSET)], _OPSET)
    if ctx.has_input(1) and ctx.has_input(4):
        x = ctx.emit("Add", [x, ctx.emit("Gather", [_float_input(ctx, 4), ctx.input(1)], _OPSET)], _OPSET)
    y = ctx.emit("LayerNormalization", [x, _float_input(ctx, 5), _float_input(ctx, 6)], _OPSET, axis=-1,
                 epsilon=float(ctx.attr("epsilon", 1e-12)))
    if ctx.has_input(7):
        mask_index = ctx.emit("ReduceSum", [ctx.cast(ctx.input(7), "int32"), ctx.constant(np.array([1]))], _OPSET,
                              keepdims=0)
    else:
        mask_index = ctx.constant(np.zeros(b, np.int32))
    return [y, mask_index, x]
