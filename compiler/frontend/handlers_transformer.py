"""Handlers for the transformer-era ONNX ops: RotaryEmbedding (23), TensorScatter (24), SwiGLU (28),
CausalConvWithState (27) and LinearAttention (27).

None of them has an operator of its own: each is composed from library ops (Gather, Slice,
Reshape, Concat, element-wise arithmetic, ScatterElements, Conv, MatMul), following the ONNX
specification and its reference implementation (``onnx/reference/ops``). The recurrence of
LinearAttention is unrolled over the (static) sequence length, at most :data:`MAX_UNROLLED_STEPS`
steps.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from ..ir.graph import Tensor
from ..ops.conv import Conv
from ..ops.elementwise import Binary, CastOp, Identity, Unary
from ..ops.linalg import MatMul
from ..ops.transform import Concat, Expand, Gather, ScatterElements
from .handlers_elementwise import swish
from .handlers_transform import _axis, _reshape, _slice
from .registry import FLOATS, NodeContext, onnx_op

__all__ = ["MAX_UNROLLED_STEPS"]

log = logging.getLogger(__name__)

#: Longest sequence whose LinearAttention recurrence is unrolled at import. A step is about a dozen
#: ops: 1024 steps make a graph of some 13,000 ops, which imports in seconds; longer sequences would
#: make import and the sharding search slow, so they are refused.
MAX_UNROLLED_STEPS = 1024


def _float_input(ctx: NodeContext, i: int, dtype: str | None = None) -> Tensor:
    """Input ``i``, checked to be floating point (and of ``dtype`` when given)."""
    t = ctx.input(i)
    if t.dtype not in FLOATS:
        raise ctx.unsupported(f"dtype {t.dtype} of input {i}")
    if dtype is not None and t.dtype != dtype:
        raise ctx.invalid(f"input {i} has dtype {t.dtype}, but input 0 has {dtype}")
    return t


def _mul(ctx: NodeContext, a: Tensor, b: Tensor, name: str) -> Tensor:
    return ctx.add(Binary([a, b], name=f"{ctx.name}/{name}", fn="mul"))


# rotary embedding ---------------------------------------------------------------------------------

@onnx_op("RotaryEmbedding", since=23)
def rotary_embedding(ctx):
    """``RotaryEmbedding``: rotate the first ``rotary_embedding_dim`` features of each head by the
    cached angles of the token's position, in halves or interleaved pairs (ONNX opset 23)."""
    x = _float_input(ctx, 0)
    cos, sin = _float_input(ctx, 1, x.dtype), _float_input(ctx, 2, x.dtype)
    interleaved = ctx.flag("interleaved", 0)
    if x.ndim == 4:                                   # [batch, heads, seq, head]
        b, _, s, head = x.shape
        x4 = x
    elif x.ndim == 3:                                 # [batch, seq, heads * head]
        heads = int(ctx.attr("num_heads", 0))
        b, s, hidden = x.shape
        if heads <= 0:
            raise ctx.invalid("a 3-D input needs a positive num_heads attribute")
        if hidden % heads:
            raise ctx.shape_error(f"hidden size {hidden} is not divisible by num_heads={heads}")
        head = hidden // heads
        x4 = _reshape(ctx, x, (b, s, heads, head), f"{ctx.name}/heads")
    else:
        raise ctx.shape_error(f"input must be 3-D or 4-D, got shape {x.shape}")
    rot = int(ctx.attr("rotary_embedding_dim", 0)) or head
    if not 0 < rot <= head or rot % 2:
        raise ctx.invalid(f"rotary_embedding_dim={rot} must be even and at most the head size {head}")
    half = rot // 2

    if ctx.has_input(3):
        pos = ctx.input(3)
        if pos.dtype != "int64" or pos.ndim != 2:
            raise ctx.invalid(f"position_ids must be a 2-D int64 tensor, got {pos.dtype} of shape {pos.shape}")
        if cos.ndim != 2 or sin.ndim != 2:
            raise ctx.shape_error(f"with position_ids the caches must be 2-D, got shapes {cos.shape} and {sin.shape}")
        cos = ctx.add(Gather([cos, pos], name=f"{ctx.name}/cos_at", axis=0))
        sin = ctx.add(Gather([sin, pos], name=f"{ctx.name}/sin_at", axis=0))
    elif cos.ndim != 3 or sin.ndim != 3:
        raise ctx.shape_error(f"without position_ids the caches must be 3-D [batch, seq, rotary_dim/2], got shapes "
                              f"{cos.shape} and {sin.shape}")
    cb, cs, ch = cos.shape
    if cos.shape != sin.shape or ch != half or cb not in (1, b) or cs not in (1, s):
        raise ctx.shape_error(f"the cos/sin caches (after position_ids) have shapes {cos.shape} and {sin.shape}; "
                              f"expected ({b}, {s}, {half}) (rotary_embedding_dim / 2 = {half})")
    # [batch, seq, half] -> broadcastable against x4's [b, h, s, half] or [b, s, h, half]
    cache_shape = (cb, 1, cs, half) if x.ndim == 4 else (cb, cs, 1, half)
    cos = _reshape(ctx, cos, cache_shape, f"{ctx.name}/cos")
    sin = _reshape(ctx, sin, cache_shape, f"{ctx.name}/sin")

    if interleaved:
        x1 = _slice(ctx, x4, {3: (0, rot, 2)}, f"{ctx.name}/x1")
        x2 = _slice(ctx, x4, {3: (1, rot, 2)}, f"{ctx.name}/x2")
    else:
        x1 = _slice(ctx, x4, {3: (0, half, 1)}, f"{ctx.name}/x1")
        x2 = _slice(ctx, x4, {3: (half, rot, 1)}, f"{ctx.name}/x2")
    real = ctx.add(Binary([_mul(ctx, cos, x1, "cos_x1"), _mul(ctx, sin, x2, "sin_x2")], name=f"{ctx.name}/real",
                          fn="sub"))
    imag = ctx.add(Binary([_mul(ctx, sin, x1, "sin_x1"), _mul(ctx, cos, x2, "cos_x2")], name=f"{ctx.name}/imag",
                          fn="add"))
    if interleaved:                                   # pairs (real, imag) side by side
        pair = x4.shape[:3] + (half, 1)
        real = _reshape(ctx, real, pair, f"{ctx.name}/real_pair")
        imag = _reshape(ctx, imag, pair, f"{ctx.name}/imag_pair")
        both = ctx.add(Concat([real, imag], name=f"{ctx.name}/pairs", axis=4))
        parts = [_reshape(ctx, both, x4.shape[:3] + (rot,), f"{ctx.name}/rotated")]
    else:
        parts = [real, imag]
    if rot < head:
        parts.append(_slice(ctx, x4, {3: (rot, head, 1)}, f"{ctx.name}/pass"))
    last = x.ndim == 4
    y = ctx.add(Concat(parts, name=ctx.name if last else f"{ctx.name}/y4", axis=3))
    return [y if last else _reshape(ctx, y, x.shape)]


# KV-cache update ----------------------------------------------------------------------------------

@onnx_op("TensorScatter", since=24)
def tensor_scatter(ctx):
    """``TensorScatter``: write ``update`` into ``past_cache`` along ``axis`` from each batch's
    ``write_indices`` (0 when absent), wrapping around in ``circular`` mode (ONNX opset 24).

    Without ``write_indices`` the result is a concatenation; with them, a ScatterElements at
    update-shaped indices. ``linear`` mode requires ``0 <= write_indices`` and ``write_indices +
    sequence_length <= max_sequence_length``: constant indices are checked at import; indices known
    only at run time are not (the numpy execution raises on positions past the end, as the ONNX
    reference does, and compiled kernels skip them).
    """
    past, upd = ctx.input(0), ctx.input(1)
    if upd.dtype != past.dtype:
        raise ctx.invalid(f"update has dtype {upd.dtype}, but past_cache has {past.dtype}")
    mode = ctx.attr("mode", "linear")
    if mode not in ("linear", "circular"):
        raise ctx.invalid(f"mode must be 'linear' or 'circular', got {mode!r}")
    if past.ndim < 2:
        raise ctx.shape_error(f"past_cache must have a batch dim and a sequence dim, got shape {past.shape}")
    axis = _axis(ctx, int(ctx.attr("axis", -2)), past.ndim)
    if axis == 0:
        raise ctx.invalid("axis must not be 0 (the batch dim)")
    if upd.ndim != past.ndim or upd.shape[axis] > past.shape[axis] or any(
            u != p for d, (u, p) in enumerate(zip(upd.shape, past.shape)) if d != axis):
        raise ctx.shape_error(f"update of shape {upd.shape} does not fit past_cache of shape {past.shape} "
                              f"(they may differ only in dim {axis}, where the update must not be longer)")
    cap, seq = past.shape[axis], upd.shape[axis]
    if seq == 0:
        return [ctx.add(Identity([past], name=ctx.name))]
    if not ctx.has_input(2):
        if seq == cap:
            return [ctx.add(Identity([upd], name=ctx.name))]
        rest = _slice(ctx, past, {axis: (seq, cap, 1)}, f"{ctx.name}/rest")
        return [ctx.add(Concat([upd, rest], name=ctx.name, axis=axis))]
    w = ctx.input(2)
    if w.dtype != "int64" or w.shape != past.shape[:1]:
        raise ctx.invalid(f"write_indices must be int64 of shape ({past.shape[0]},), got {w.dtype} of shape {w.shape}")
    if mode == "linear" and w.value is not None:
        wv = np.asarray(w.value)
        if wv.size and (wv.min() < 0 or wv.max() + seq > cap):
            raise ctx.shape_error(f"write_indices {wv.tolist()[:8]} plus the update length {seq} leave the cache "
                                  f"of length {cap} (linear mode; use mode='circular' to wrap around)")
    ones = (1,) * (past.ndim - 1)
    start = _reshape(ctx, w, past.shape[:1] + ones, f"{ctx.name}/start")
    steps = np.arange(seq, dtype=np.int64).reshape(ones[:axis - 1] + (seq,) + ones[axis:])
    idx = ctx.add(Binary([start, ctx.constant(steps)], name=f"{ctx.name}/positions", fn="add"))
    if mode == "circular":
        idx = ctx.add(Binary([idx, ctx.constant(np.int64(cap))], name=f"{ctx.name}/wrapped", fn="mod"))
    idx = ctx.add(Expand([idx], name=f"{ctx.name}/indices", shape=upd.shape))
    return [ctx.add(ScatterElements([past, idx, upd], name=ctx.name, axis=axis, reduction="none"))]


# gated activations and convolutions ---------------------------------------------------------------

@onnx_op("SwiGLU", since=28)
def swiglu(ctx):
    """``SwiGLU``: ``Swish_alpha(A) * B`` for equal-shaped ``A`` and ``B`` (ONNX opset 28)."""
    a = _float_input(ctx, 0)
    b = _float_input(ctx, 1, a.dtype)
    if a.shape != b.shape:
        raise ctx.shape_error(f"A {a.shape} and B {b.shape} must have the same shape (no broadcasting)")
    gate = swish(ctx, a, float(ctx.attr("alpha", 1.0)), f"{ctx.name}/swish")
    return [ctx.add(Binary([gate, b], name=ctx.name, fn="mul"))]


def _silu(ctx: NodeContext, x: Tensor, name: str) -> Tensor:
    """``x * sigmoid(x)`` computed in at least float32, as the ONNX reference does."""
    if x.dtype != "float16":
        return swish(ctx, x, 1.0, name)
    wide = ctx.add(CastOp([x], name=f"{name}/f32", to="float32"))
    return ctx.add(CastOp([swish(ctx, wide, 1.0, f"{name}/silu")], name=name, to=x.dtype))


@onnx_op("CausalConvWithState", since=27)
def causal_conv_with_state(ctx):
    """``CausalConvWithState``: a depthwise causal 1-D convolution over ``past_state ++ input``,
    with an optional fused SiLU, returning the last ``k - 1`` positions as the new state (ONNX
    opset 27)."""
    x = _float_input(ctx, 0)
    w = _float_input(ctx, 1, x.dtype)
    act = ctx.attr("activation", "none")
    if act not in ("none", "silu", "swish"):
        raise ctx.invalid(f"activation must be 'none', 'silu' or 'swish', got {act!r}")
    if x.ndim != 3:
        raise ctx.shape_error(f"input must be [batch, channels, length], got shape {x.shape}")
    b, c, _ = x.shape
    if w.ndim != 3 or w.shape[:2] != (c, 1) or w.shape[2] < 1:
        raise ctx.shape_error(f"weight must be [{c}, 1, k] with k >= 1, got shape {w.shape}")
    k = w.shape[2]
    ins = [w]
    if ctx.has_input(2):
        bias = _float_input(ctx, 2, x.dtype)
        if bias.shape != (c,):
            raise ctx.shape_error(f"bias must have shape ({c},), got {bias.shape}")
        ins.append(bias)
    if ctx.has_input(3):
        past = _float_input(ctx, 3, x.dtype)
        if past.shape != (b, c, k - 1):
            raise ctx.shape_error(f"past_state must have shape ({b}, {c}, {k - 1}), got {past.shape}")
    else:
        past = ctx.constant(np.zeros((b, c, k - 1), x.dtype))
    padded = ctx.add(Concat([past, x], name=f"{ctx.name}/padded", axis=2)) if k > 1 else x
    conv_name = ctx.name if act == "none" else f"{ctx.name}/conv"
    y = ctx.add(Conv([padded] + ins, name=conv_name, group=c, strides=(1,), dilations=(1,), pads=(0, 0)))
    if act != "none":
        y = _silu(ctx, y, ctx.name)
    n = padded.shape[2]
    state = _slice(ctx, padded, {2: (n - (k - 1), n, 1)}, f"{ctx.name}/present_state")
    return [y, state]


# linear attention ---------------------------------------------------------------------------------

_UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")


def _as_f32(ctx: NodeContext, t: Tensor, what: str) -> Tensor:
    return t if t.dtype == "float32" else ctx.add(CastOp([t], name=f"{ctx.name}/{what}_f32", to="float32"))


def _linear_attention_operands(ctx: NodeContext):
    """Check LinearAttention's inputs and attributes against the spec; return the pieces."""
    q = _float_input(ctx, 0)
    k, v = _float_input(ctx, 1, q.dtype), _float_input(ctx, 2, q.dtype)
    rule = ctx.attr("update_rule", "gated_delta")
    if rule not in _UPDATE_RULES:
        raise ctx.invalid(f"update_rule must be one of {', '.join(_UPDATE_RULES)}, got {rule!r}")
    hq, hkv = int(ctx.attr("q_num_heads")), int(ctx.attr("kv_num_heads"))
    if hq <= 0 or hkv <= 0 or hq % hkv:
        raise ctx.invalid(f"q_num_heads={hq} must be a positive multiple of kv_num_heads={hkv}")
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    for i, what, needed in ((4, "decay", gated), (5, "beta", delta)):
        if ctx.has_input(i) != needed:
            raise ctx.invalid(f"update_rule {rule!r} {'requires' if needed else 'forbids'} the {what} input")
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ctx.shape_error(f"query, key and value must be 3-D [B, T, H*D], got {q.shape}, {k.shape}, {v.shape}")
    b, t, qd = q.shape
    if qd % hq or v.shape[2] % hkv:
        raise ctx.shape_error(f"query width {qd} / value width {v.shape[2]} are not divisible by the head counts "
                              f"{hq} / {hkv}")
    dk, dv = qd // hq, v.shape[2] // hkv
    if k.shape != (b, t, hkv * dk) or v.shape[:2] != (b, t):
        raise ctx.shape_error(f"key {k.shape} / value {v.shape} do not match query {q.shape} with {hkv} kv heads")
    decay = beta = past = None
    if gated:
        decay = _float_input(ctx, 4, q.dtype)
        if decay.ndim != 3 or decay.shape[:2] != (b, t) or decay.shape[2] not in (hkv, hkv * dk):
            raise ctx.shape_error(f"decay must be [{b}, {t}, {hkv}] or [{b}, {t}, {hkv * dk}], got {decay.shape}")
    if delta:
        beta = _float_input(ctx, 5, q.dtype)
        if beta.ndim != 3 or beta.shape[:2] != (b, t) or beta.shape[2] not in (hkv, 1):
            raise ctx.shape_error(f"beta must be [{b}, {t}, {hkv}] or [{b}, {t}, 1], got {beta.shape}")
    if ctx.has_input(3):
        past = _float_input(ctx, 3)
        if past.shape != (b, hkv, dk, dv):
            raise ctx.shape_error(f"past_state must have shape ({b}, {hkv}, {dk}, {dv}), got {past.shape}")
    if t < 1:
        raise ctx.unsupported("an empty sequence (T = 0)")
    if t > MAX_UNROLLED_STEPS:
        raise ctx.unsupported(f"a sequence of {t} tokens (the recurrence is unrolled at import, at most "
                              f"{MAX_UNROLLED_STEPS} steps; split the sequence into chunks and carry the state)")
    scale = float(ctx.attr("scale", 0.0)) or 1.0 / math.sqrt(dk)
    return q, k, v, past, decay, beta, (b, t, hq, hkv, dk, dv), scale


@onnx_op("LinearAttention", since=27)
def linear_attention(ctx):
    """``LinearAttention``: the linear / gated / delta / gated-delta recurrence over a state
    ``[B, H_kv, d_k, d_v]``, with grouped query heads (ONNX opset 27).

    The recurrence is unrolled over the sequence at import, in float32 as the reference computes
    it. All per-step tensors keep the layout ``[B, 1, H_kv, rows, cols]`` so that the steps need
    only slices, broadcasting element-wise ops and batched matrix products.
    """
    q, k, v, past, decay, beta, (b, t, hq, hkv, dk, dv), scale = _linear_attention_operands(ctx)
    g = hq // hkv
    n = ctx.name
    log.debug("%s: unrolling the %s recurrence over %d steps", n, ctx.attr("update_rule", "gated_delta"), t)

    def steps(x: Tensor, what: str, shape) -> list[Tensor]:
        """``x`` (float32, reshaped to ``[B, T, *shape]``) sliced into its ``T`` steps."""
        x = _reshape(ctx, _as_f32(ctx, x, what), (b, t) + tuple(shape), f"{n}/{what}_steps")
        return [_slice(ctx, x, {1: (i, i + 1, 1)}, f"{n}/{what}{i}") for i in range(t)]

    qs = steps(q, "q", (hkv, g, dk))
    k_cols = steps(k, "k_col", (hkv, dk, 1))
    vs = steps(v, "v", (hkv, 1, dv))
    k_rows = steps(k, "k_row", (hkv, 1, dk)) if beta is not None else None
    betas = steps(beta, "beta", (beta.shape[2], 1, 1)) if beta is not None else None
    if decay is not None:
        per_key = decay.shape[2] // hkv
        factor = ctx.add(Unary([_as_f32(ctx, decay, "decay")], name=f"{n}/decay_factor", fn="exp"))
        decays = steps(factor, "decay", (hkv, per_key, 1))
    if past is not None:
        state = _reshape(ctx, _as_f32(ctx, past, "past"), (b, 1, hkv, dk, dv), f"{n}/state_in")
    else:
        state = ctx.constant(np.zeros((b, 1, hkv, dk, dv), np.float32))
    outs = []
    for i in range(t):
        if decay is not None:
            state = _mul(ctx, state, decays[i], f"decayed{i}")
        v_i = vs[i]
        if beta is not None:
            seen = ctx.add(MatMul([k_rows[i], state], name=f"{n}/retrieved{i}"))
            v_i = _mul(ctx, betas[i], ctx.add(Binary([v_i, seen], name=f"{n}/error{i}", fn="sub")), f"delta{i}")
        state = ctx.add(Binary([state, _mul(ctx, k_cols[i], v_i, f"outer{i}")], name=f"{n}/state{i}", fn="add"))
        outs.append(ctx.add(MatMul([qs[i], state], name=f"{n}/read{i}")))
    o = outs[0] if t == 1 else ctx.add(Concat(outs, name=f"{n}/reads", axis=1))
    o = _mul(ctx, o, ctx.constant(np.float32(scale)), "scaled")
    o = _reshape(ctx, o, (b, t, hq * dv), f"{n}/output_f32")
    out = ctx.add(CastOp([o], name=n, to=q.dtype))
    present = _reshape(ctx, state, (b, hkv, dk, dv), f"{n}/present_f32")
    present_dtype = past.dtype if past is not None else q.dtype
    return [out, ctx.add(CastOp([present], name=f"{n}/present_state", to=present_dtype))]


# flex attention (ai.onnx.preview) -------------------------------------------------------------------

_SOFTMAX_PRECISIONS = {1: "float32", 10: "float16", 11: "float64"}


def _repeat_heads(ctx: NodeContext, t: Tensor, group: int) -> Tensor:
    """``[B, H, S, E]`` -> ``[B, H * group, S, E]``, each head repeated ``group`` times in place
    (grouped-query attention: query head ``h`` reads key/value head ``h // group``)."""
    if group == 1:
        return t
    b, h, s, e = t.shape
    wide = ctx.emit("Unsqueeze", [t, ctx.constant(np.array([2], np.int64))], 13)
    wide = ctx.emit("Expand", [wide, ctx.constant(np.array([b, h, group, s, e], np.int64))], 13)
    return ctx.emit("Reshape", [wide, ctx.constant(np.array([b, h * group, s, e], np.int64))], 13)


def _modifier(ctx: NodeContext, name: str, t: Tensor) -> Tensor:
    """``t`` through the subgraph attribute ``name`` (one rank-4 tensor in, one of the same shape
    and type out), or ``t`` when the node has none."""
    if not ctx.has_attr(name):
        return t
    outs = ctx.subgraph(ctx.graph_attr(name), [t], name)
    if len(outs) != 1 or outs[0].shape != t.shape or outs[0].dtype != t.dtype:
        raise ctx.invalid(f"{name} must give one tensor of shape {list(t.shape)} and type {t.dtype}")
    return outs[0]


@onnx_op("FlexAttention", since=1, domain="ai.onnx.preview")
def flex_attention(ctx):
    """``FlexAttention`` (preview): ``softmax(score_mod(Q K^T * scale)) -> prob_mod -> @ V``, the
    modifier subgraphs imported inline on the score and probability tensors; grouped key/value
    heads are repeated. Arithmetic as the ONNX reference: the scale split as ``sqrt(scale)`` on Q
    and K, the product in the input type, softmax and the second product in ``softmax_precision``
    (float32 for half inputs)."""
    q = _float_input(ctx, 0)
    k, v = _float_input(ctx, 1, q.dtype), _float_input(ctx, 2, q.dtype)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ctx.shape_error(f"Q, K and V must be rank 4, got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    (b, hq, _, e), (_, hkv, s, _) = q.shape, k.shape
    if k.shape[0] != b or v.shape[:3] != (b, hkv, s) or k.shape[3] != e or hkv < 1 or hq % hkv:
        raise ctx.shape_error(f"Q {list(q.shape)}, K {list(k.shape)} and V {list(v.shape)} do not fit: batch and "
                              "head size shared, K and V of one shape up to V's head size, and Q's heads a multiple "
                              "of K's")
    precision = int(ctx.attr("softmax_precision", 0))
    if precision and precision not in _SOFTMAX_PRECISIONS:
        raise ctx.unsupported(f"softmax_precision {precision}")
    compute = _SOFTMAX_PRECISIONS.get(precision) or ("float32" if q.dtype == "float16" else q.dtype)
    scale = float(ctx.attr("scale", 1.0 / math.sqrt(e)))
    root = ctx.constant(np.asarray(np.sqrt(np.float32(scale)), q.dtype))
    k, v = _repeat_heads(ctx, k, hq // hkv), _repeat_heads(ctx, v, hq // hkv)
    kt = ctx.emit("Transpose", [ctx.emit("Mul", [k, root], 13)], 13, perm=[0, 1, 3, 2])
    scores = ctx.emit("MatMul", [ctx.emit("Mul", [q, root], 13), kt], 13)
    scores = _modifier(ctx, "score_mod", ctx.cast(scores, compute))
    probs = _modifier(ctx, "prob_mod", ctx.emit("Softmax", [scores], 13, axis=-1))
    return [ctx.cast(ctx.emit("MatMul", [probs, ctx.cast(v, compute)], 13), v.dtype)]
