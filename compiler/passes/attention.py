"""Attention fusion: a ``softmax(Q Kᵀ · scale + bias) V`` written as separate ops becomes one
:class:`~shardflow.compiler.ops.linalg.Attention` op.

Exporters (``torch.onnx.export`` of GPT-2, BERT, T5...) write attention as two batched MatMuls
around a scale, an additive mask and a Softmax, with the heads split and merged by reshapes and
transposes. The cuda driver runs this pass on each rank's graph (after the plan is applied, so
the search and the partitioner see the separate ops), whose products
:class:`~.precision.HalfPrecisionContractions` rounded to float16/bfloat16. It matches::

    s = MatMul(Cast(Qh, f32), Cast(KTh, f32))        Qh [B, H, S, D], KTh [B, H, D, L] half
    s = Mul(s, c) | Div(s, c)                         c a constant scalar (optional)
    s = Add(s, bias) | Add(bias, s)                   bias broadcast to [B, H, S, L] (none, one or
                                                      more, added in turn: T5's position bias and mask)
    p = Softmax(s, axis=-1)
    y = MatMul(Cast(Cast(p, half), f32), Cast(Vh, f32))

(every intermediate read only by the next op, the result not a graph output) and replaces it with
``Attention(Q, K, V, *biases, extra_biases=len(biases), acc_dtype="float32", probs_dtype=half,
scale=c)``, which computes exactly these values (float32 scores of the half operands, float32
softmax, probabilities rounded to the half type).

A model that is float16 or bfloat16 itself writes the same pattern without the casts, every
tensor half (its scale and biases too). It becomes the same op on the half Q, K, V (biases read
in float32, exactly) with its output rounded to the half type once: the fused kernel's values,
which differ from the op-by-op definition (scores, scaled scores, biased scores, probabilities
each rounded to the half type) by those roundings, as a fused element-wise kernel's do. Its
softmax may be computed in float32, ``Cast(Softmax(Cast(s, float32)), half)``, or its
probabilities cast to float32 and back, ``Cast(Cast(Softmax(s), float32), half)`` (transformers'
Llama, Mistral and Qwen in half precision ask for a float32 softmax, which the TorchScript
exporter writes the second way): the op's own softmax is float32 anyway.

Where the heads come from ``Transpose(Reshape(x, [B, S, H, D]))`` of a ``[B, S, H*D]`` tensor
and the result goes back through ``Transpose`` (and element-wise casts) to ``Reshape(..,
[B, S, H*Dv])``, the op reads and writes the ``[B, S, H*D]`` forms directly (its 3-D form), so
no transpose is left; where only the output is merged that way (Llama's Q comes out of the
rotary embedding in heads), the op writes the 3-D form from 4-D operands (``y_3d``).

torch's export of ``scaled_dot_product_attention`` (transformers' default attention) scales Q
and Kᵀ by the scale's square root each before the product (Q's scaling stays its producer; Kᵀ's
is redone on K's rows, with any cast, past a 4-D transpose or the dynamo exporter's ``Reshape(
Transpose(Reshape(k, [B*H, L, D])))``) and makes the probabilities of a row that sees no key 0,
``Where(IsNaN(p), 0, p)``: with one bias, that bias becomes the op's mask, whose rule for such a
row is the same (rfcs/0005 decision 43). A float16 model exported that way by TorchScript widens
its half scores (``Cast(s, float32)``) before the mask and multiplies the float32 probabilities
by V widened: the same op on the half Q, K, V, its probabilities rounded to the half type as a
fused kernel's are (decision 44). Attention on ``[B*H, ..]`` tensors (BLOOM's ALiBi ``baddbmm``)
is first written on its ``[B, H, ..]`` views (:class:`AttentionOnHeads`, decision 45), which
also writes scores filled with ``finfo.min`` where a mask hides them (DeBERTa) or kept where it
shows them (GPT-Neo) as an added bias (decisions 47, 49), drops a clamp of the scores at
``finfo.min`` and computes a softmax of a ``[B*H, S, L]`` view on the ``[B, H, S, L]`` scores
(XGLM, decision 49). K and V
of one head that the products broadcast over the query heads (multi-query attention) are read
with ``kv_heads = 1``. Scores soft-capped after the scale, ``tanh(s / c) * c`` (Gemma 2), give
the op's ``softcap``.

A constant mask that hides every key past a diagonal (GPT-2's and Llama's causal masks,
``finfo.min`` above it) becomes ``is_causal`` (and is dropped when it is 0 elsewhere): same
values, and the kernel skips the hidden blocks of keys. The cuda target computes the op with one
fused kernel (:mod:`shardflow.compiler.codegen.cuda_attention`) that never writes the score
matrix.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from ..codegen.cuda_attention import takes_heads
from ..errors import ShardflowError
from ..ir.expr import dtype_kind
from ..ir.graph import FlowGraph, Operator, Tensor, const_tensor
from .base import GraphPass, splice

__all__ = ["AttentionOnHeads", "FuseAttention", "HalfAttentionInFloat32"]

log = logging.getLogger(__name__)

_HALF = ("float16", "bfloat16")
#: additive biases matched between the scores and the softmax (T5: a position bias, then the mask)
_MAX_BIASES = 3


def _is(op: Operator | None, op_type: str, **attrs) -> bool:
    return op is not None and op.op_type == op_type and all(op.attrs.get(k) == v for k, v in attrs.items())


#: an additive mask entry at or below this hides its key exactly: with scores and the row's
#: largest logit below 1e29 in magnitude, ``exp(logit - max)`` underflows to 0 as for ``-inf``
_HIDDEN = -1e30


def _causal(mask: np.ndarray, s_len: int, l_len: int, hidden: float = _HIDDEN) -> tuple[int | None, bool]:
    """``(offset, keep)`` when the constant additive ``mask`` (broadcast to ``[.., S, L]``) is
    causal: every key ``j > i + offset`` is hidden (``<= hidden``, by default ``_HIDDEN``, or
    ``-inf``) and every query row keeps a key above ``hidden`` among the others, so masking them
    with ``-inf`` instead (``is_causal``) gives the same probabilities, bit for bit (with a float16
    model's ``hidden``, its type's lowest value: wherever a row's scores lie within 65400 of each
    other, ``exp`` of a hidden one minus the row's maximum underflows to 0 in float32).
    ``keep``: whether the mask is still needed for the other keys (False when they are all 0).
    ``(None, True)`` otherwise. The offsets tried are 0 and ``L - S`` (the queries are the last
    ``S`` positions, as with a KV cache), the smaller first (it hides more)."""
    if mask.ndim < 2 or mask.shape[-2] != s_len or mask.dtype.kind != "f" or np.isnan(mask).any():
        return None, True
    i = np.arange(s_len).reshape(-1, 1)
    j = np.arange(l_len).reshape(1, -1)
    for off in sorted({0, l_len - s_len}):
        if off < 0:
            continue
        seen = np.broadcast_to(j <= i + off, mask.shape)
        if not (mask[~seen] <= hidden).all():
            continue
        shown = np.where(seen, mask, -np.inf)
        if not ((shown > hidden).any(axis=-1).all() and (mask[seen] < np.inf).all()):
            continue
        return off, bool(mask[seen].any())
    return None, True


class _Walk:
    """What the attention passes read of a graph: each tensor's producer and readers."""

    def _index(self, graph: FlowGraph) -> None:
        self._producer = {id(t): op for op in graph.nodes for t in op.outputs}
        self._consumers = graph.consumers()
        self._outputs = {id(t) for t in graph.outputs}

    def _folded(self, t: Tensor) -> np.ndarray | None:
        """``t``'s value where it is a constant, or a ``Where`` of constants (a fill of the scores
        written as a bias by :meth:`AttentionOnHeads._fills_as_biases`); else None."""
        if t.is_constant:
            return np.asarray(t.value)
        p = self._prod(t)
        if _is(p, "Where") and all(u.is_constant for u in p.inputs):
            return np.where(*(np.asarray(u.value) for u in p.inputs))
        return None

    def _only(self, t: Tensor) -> Operator | None:
        """The single op reading ``t`` (None when several do, or ``t`` is a graph output)."""
        rs = self._consumers.get(id(t), [])
        if len(rs) != 1 or id(t) in self._outputs or sum(1 for u in rs[0].inputs if u is t) != 1:
            return None
        return rs[0]

    def _prod(self, t: Tensor) -> Operator | None:
        return self._producer.get(id(t))

    def _scores_side(self, t: Tensor, depth: int = _MAX_BIASES) -> bool:
        """Whether ``t`` may be the scores side of an addition: a product, a scaling, or an
        addition one of whose sides is (the other side is then a bias), or one of these widened."""
        p = self._prod(t)
        if _is(p, "Cast", to="float32") and p.inputs[0].dtype in _HALF:
            p = self._prod(p.inputs[0])
        if _is(p, "MatMul") or _is(p, "Binary", fn="mul") or _is(p, "Binary", fn="div"):
            return True
        return depth > 1 and _is(p, "Binary", fn="add") and any(self._scores_side(u, depth - 1) for u in p.inputs)

    def _toward_product(self, p: Operator | None, depth: int = 2 * _MAX_BIASES) -> Tensor | None:
        """The input of ``p`` on the way to the scores' product: the side of an addition that
        reaches a ``MatMul`` (:meth:`_reaches_product`), the scaled input of a scaling by a scalar
        constant (a ``mul`` on either side, a ``div`` by it); None for anything else."""
        if not _is(p, "Binary"):
            return None
        a, b = p.inputs
        if p.attrs["fn"] == "add":
            return a if self._reaches_product(a, depth - 1) else b if self._reaches_product(b, depth - 1) else None
        if p.attrs["fn"] == "mul" and self._scalar(a) is not None:
            return b
        return a if p.attrs["fn"] in ("mul", "div") and self._scalar(b) is not None else None

    def _reaches_product(self, t: Tensor, depth: int = 2 * _MAX_BIASES) -> bool:
        """Whether ``t`` is a ``MatMul``'s output, or one scaled by a scalar constant or with
        something added, down to such an output (:meth:`_toward_product`): the scores' side of an
        addition whose other side is a bias that may be a scaling too (WavLM's and
        ``torch.nn.MultiheadAttention``'s ``baddbmm``: ``s * alpha + mask * beta``)."""
        p = self._prod(t)
        if _is(p, "MatMul"):
            return True
        u = self._toward_product(p, depth) if depth > 1 else None  # (an addition's side already reaches it)
        return u is not None and (p.attrs["fn"] == "add" or self._reaches_product(u, depth - 1))

    def _scalar(self, t: Tensor) -> float | None:
        if t.is_constant and t.size == 1 and dtype_kind(t.dtype) == "f":
            return float(np.asarray(t.value).reshape(()))
        return None


class AttentionOnHeads(_Walk, GraphPass):
    """Attention computed on ``[B*H, ..]`` tensors written on their ``[B, H, ..]`` views, a masked
    fill of the scores written as an added bias and a clamp of them dropped, a scale per head
    moved onto the queries, which
    :class:`FuseAttention` matches (it runs this pass first; the cuda driver also runs it before the
    precision pass, whose casts would stand between the views and the products)."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        self._index(graph)
        graph = self._fills_as_biases(graph)
        self._index(graph)
        graph = self._split_biases(graph)
        self._index(graph)
        graph = self._softmax_on_heads(graph)
        self._index(graph)
        graph = self._head_scales_on_queries(graph)
        self._index(graph)
        graph = self._time_major_heads(graph)
        self._index(graph)
        return self._lift_heads(graph)

    def _hiding(self, t: Tensor) -> bool:
        """Whether ``t`` is a float32 scalar constant that hides a key (``-inf`` or at most ``_HIDDEN``)."""
        v = self._scalar(t)
        return v is not None and v <= _HIDDEN and t.dtype == "float32"

    def _beside_hiding(self, op: Operator, x: Tensor, y: Tensor) -> tuple[Tensor, bool] | None:
        """``(value, hiding_first)`` when one of ``x``, ``y`` is hiding and the other a float32
        value of ``op``'s output shape (``hiding_first``: ``x`` is the hiding one)."""
        for h, v, first in ((x, y, True), (y, x, False)):
            if self._hiding(h) and v.dtype == "float32" and tuple(v.shape) == tuple(op.outputs[0].shape):
                return v, first
        return None

    def _fill_of(self, w: Operator | None) -> tuple[Tensor, bool] | None:
        """``(x, hidden_if_true)`` when ``w`` is ``Where(c, h, x)`` or ``Where(c, x, h)`` (``h``
        hiding, ``x`` float32 of the output's shape): scores filled where a mask hides them."""
        return self._beside_hiding(w, *w.inputs[1:]) if _is(w, "Where") else None

    def _half_causal_fill(self, w: Operator | None) -> tuple[Tensor, bool] | None:
        """``(x, hidden_if_true)`` when ``w`` is a float16 model's causal fill, ``Where(c, h, x)`` or
        ``Where(c, x, h)``: ``x`` float16 scores of the output's shape, ``h`` float16's lowest value
        (transformers' ``finfo.min``: GPT-2's ``torch.where(causal_mask, w, mask_value)`` before
        its masks moved to ``masking_utils``), ``c`` a constant whose hidden keys are causal, every
        row keeping its diagonal (:func:`_causal`). Written as an added bias, ``x + Where(c, h, 0)``
        in float16, a hidden score is ``x - 65504`` (or ``-inf``) instead of ``-65504``: ``exp`` of it
        minus the row's maximum is 0 either way where a row's scores lie within 65400 of each other,
        and no row is all hidden (the softmax reads the fill itself: no padding mask added after
        it); the fused op then masks them as ``is_causal``."""
        if not _is(w, "Where") or not w.inputs[0].is_constant:
            return None
        lowest = float(np.finfo(np.float16).min)
        for h, x, first in ((w.inputs[1], w.inputs[2], True), (w.inputs[2], w.inputs[1], False)):
            v = self._scalar(h)
            if v is None or v > lowest or h.dtype != "float16" or x.dtype != "float16" \
                    or tuple(x.shape) != tuple(w.outputs[0].shape) or x.ndim < 2:
                continue
            cond = np.asarray(w.inputs[0].value, bool)
            hidden = cond if first else ~cond
            if _causal(np.where(hidden, -np.inf, 0).astype(np.float32), x.shape[-2], x.shape[-1])[0] is not None:
                return x, first
        return None

    def _clamp_of(self, m: Operator | None) -> Tensor | None:
        """``y`` when ``m`` is ``Max(y, h)`` or ``Max(h, y)`` (``h`` hiding, ``y`` float32 of the
        output's shape): XGLM's and BART's ``max(scores, finfo.min)``."""
        found = self._beside_hiding(m, *m.inputs) if _is(m, "Binary", fn="max") else None
        return found[0] if found else None

    def _scores_like(self, t: Tensor, depth: int = 2 * _MAX_BIASES) -> bool:
        """:meth:`_scores_side`, a ``[B, H, S, L]`` view of such ``[B*H, S, L]`` scores (before
        :meth:`_lift_heads`), or such scores with biases added, filled (:meth:`_fill_of`) or
        clamped (:meth:`_clamp_of`)."""
        if self._scores_side(t):
            return True
        p = self._prod(t)
        if _is(p, "Reshape") and t.ndim == 4 and p.inputs[0].ndim == 3:
            return self._scores_side(p.inputs[0])
        if depth <= 1:
            return False
        if _is(p, "Binary", fn="add"):
            return any(self._scores_like(u, depth - 1) for u in p.inputs)
        fill = self._fill_of(p) or self._half_causal_fill(p)
        inner = fill[0] if fill else self._clamp_of(p)
        return inner is not None and self._scores_like(inner, depth - 1)

    def _fills_as_biases(self, graph: FlowGraph) -> FlowGraph:
        """``graph`` with the float32 scores a softmax over the keys reads (through additions, and a
        view of them) filled where a mask hides them, ``Where(c, h, s)`` (DeBERTa's ``masked_fill``
        with ``finfo.min``) or ``Where(c, s, h)`` (GPT-Neo's causal ``where``), written as an added
        bias, ``s + Where(c, h, 0)`` or ``s + Where(c, 0, h)``, and clamped from below by a hiding
        value, ``Max(s, h)`` (XGLM's), written as ``s``: the same values where ``h`` is ``-inf`` or a
        finite constant at most ``-1e30`` and the scores finite and below ``2**75`` in magnitude
        (``s + h`` rounds to ``h``, which the clamp leaves as it is; a NaN or infinite score where
        the mask hides it is no longer replaced), a row every key of which is hidden uniform over
        them as before."""
        from ..ops.elementwise import Binary, Where

        insert: dict[int, list[Operator]] = {}
        replace: dict[int, Tensor] = {}
        for sm in graph.nodes:
            if not _is(sm, "Softmax") or tuple(sm.attrs.get("axes", ())) != (sm.inputs[0].ndim - 1,):
                continue
            t, nxt = sm.inputs[0], sm
            if _is(self._prod(t), "Reshape") and self._only(t) is sm:  # (XGLM: [B, H, S, L] -> [B*H, S, L])
                t, nxt = self._prod(t).inputs[0], self._prod(t)
            for step in range(2 * _MAX_BIASES):
                p = self._prod(t)
                if p is None or self._only(t) is not nxt:
                    break
                # (a float16 causal fill only where the softmax reads it: another bias added after
                # it could hide every key of a row, where the fill's exact value matters)
                fill = self._fill_of(p) or (self._half_causal_fill(p) if step == 0 else None)
                clamp = self._clamp_of(p)
                if fill is not None and self._scores_like(fill[0]):
                    x, first = fill
                    zero = const_tensor(np.zeros((), np.dtype(x.dtype)), f"{p.name}.zero")
                    cond, h = p.inputs[0], p.inputs[1 if first else 2]
                    bias = Where([cond, h, zero] if first else [cond, zero, h], name=f"{p.name}.bias")
                    add = Binary([x, bias.outputs[0]], name=f"{p.name}.add", fn="add")
                    insert[id(p)] = [bias, add]
                    replace[id(p.outputs[0])] = add.outputs[0]
                    t = x
                elif clamp is not None and self._scores_like(clamp):
                    replace[id(p.outputs[0])] = t = clamp
                elif _is(p, "Binary", fn="add"):
                    t = next((u for u in p.inputs if self._scores_like(u)), None)
                    if t is None:
                        break
                else:
                    break
                nxt = p
        if insert or replace:
            log.info("attention: %d masked fills and %d clamps of the scores written as added biases and dropped",
                     len(insert), len(replace) - len(insert))
        return splice(graph, insert, replace)

    def _split_biases(self, graph: FlowGraph) -> FlowGraph:
        """``graph`` with biases added to another view of the scores, ``Reshape(Reshape(s, X) + c1 +
        .. + cn, shape(s))`` read by a softmax over the last axis (ViTDet's and SAM's decomposed
        relative positions: ``[N, S, L]`` scores viewed ``[N, qh, qw, kh, kw]``, a term per query row
        and key column added, viewed back), where ``X`` splits the queries or the keys (a view of the
        batch alone is the heads' view, which the later steps take: XGLM's mask), written as
        ``s + Reshape(Expand(c1 + .. + cn, X), shape(s))``: one bias of the scores' shape, which the
        attention passes then take as any other. The same elements added (a reshape moves none), the
        biases summed before the scores instead of after them (each sum rounded in another order)."""
        from ..ops.elementwise import Binary
        from ..ops.transform import Expand, Reshape

        insert: dict[int, list[Operator]] = {}
        replace: dict[int, Tensor] = {}
        for sm in graph.nodes:
            back = self._prod(sm.inputs[0]) if _is(sm, "Softmax") else None
            if not _is(back, "Reshape") or tuple(sm.attrs.get("axes", ())) != (sm.inputs[0].ndim - 1,) \
                    or self._only(sm.inputs[0]) is not sm or sm.inputs[0].dtype != "float32":
                continue
            s_shape = tuple(sm.inputs[0].shape)

            def scores_view(x: Tensor) -> bool:  # a view of [N, S, L] scores
                p = self._prod(x)
                return _is(p, "Reshape") and tuple(p.inputs[0].shape) == s_shape and self._reaches_product(p.inputs[0])

            t, nxt, biases = back.inputs[0], back, []
            while _is(self._prod(t), "Binary", fn="add") and self._only(t) is nxt and len(biases) < _MAX_BIASES:
                nxt = self._prod(t)
                a, b = nxt.inputs
                t, c = (b, a) if scores_view(b) or _is(self._prod(b), "Binary", fn="add") and not scores_view(a) \
                    else (a, b)
                if c.dtype != "float32" or tuple(nxt.outputs[0].shape) != tuple(t.shape):
                    biases = []  # (the scores' view has the sum's shape: the biases broadcast into it)
                    break
                biases.append(c)
            up = self._prod(t)
            if not biases or not scores_view(t) or self._only(t) is not nxt or tuple(t.shape[-2:]) == s_shape[-2:]:
                continue  # (a view that splits the batch alone, [B*H, S, L] as [B, H, S, L]: the heads' view)
            shape, new_ops = tuple(t.shape), []
            bias = biases.pop()  # (the first added)
            for c in reversed(biases):
                new_ops.append(Binary([bias, c], name=f"{sm.name}.biases{len(new_ops)}", fn="add"))
                bias = new_ops[-1].outputs[0]
            if tuple(bias.shape) != shape:
                new_ops.append(Expand([bias], name=f"{sm.name}.biases.full", shape=shape))
                bias = new_ops[-1].outputs[0]
            new_ops.append(Reshape([bias], name=f"{sm.name}.biases.view", shape=s_shape))
            new_ops.append(Binary([up.inputs[0], new_ops[-1].outputs[0]], name=f"{sm.name}.biased", fn="add"))
            insert[id(back)] = new_ops
            replace[id(back.outputs[0])] = new_ops[-1].outputs[0]
        if insert:
            log.info("attention: the biases on a split view of the scores written as one bias, %d times", len(insert))
        return splice(graph, insert, replace)

    def _softmax_on_heads(self, graph: FlowGraph) -> FlowGraph:
        """``graph`` with a softmax over the last axis of a ``[B*H, S, L]`` view of ``[B, H, S, L]``
        scores (XGLM's) computed on the scores and viewed after: the same values."""
        from ..ops.reduce import Softmax
        from ..ops.transform import Reshape

        insert: dict[int, list[Operator]] = {}
        replace: dict[int, Tensor] = {}
        for sm in graph.nodes:
            up = self._prod(sm.inputs[0]) if _is(sm, "Softmax") and sm.inputs[0].ndim == 3 else None
            if not _is(up, "Reshape") or tuple(sm.attrs.get("axes", ())) != (2,) or sm.attrs.get("log") \
                    or self._only(sm.inputs[0]) is not sm or id(sm.outputs[0]) in self._outputs:
                continue
            x4 = up.inputs[0]
            if x4.ndim != 4 or x4.shape[0] * x4.shape[1] != sm.inputs[0].shape[0] \
                    or tuple(x4.shape[2:]) != tuple(sm.inputs[0].shape[1:]) or not self._scores_like(x4):
                continue
            sm4 = Softmax([x4], name=f"{sm.name}.heads", axes=(3,))
            view = Reshape([sm4.outputs[0]], name=f"{sm.name}.view", shape=tuple(sm.outputs[0].shape))
            insert[id(sm)] = [sm4, view]
            replace[id(sm.outputs[0])] = view.outputs[0]
            for r in self._consumers.get(id(sm.outputs[0]), []):  # (a view back to [B, H, S, L]: the scores')
                if _is(r, "Reshape") and tuple(r.outputs[0].shape) == tuple(x4.shape) \
                        and id(r.outputs[0]) not in self._outputs:
                    replace[id(r.outputs[0])] = sm4.outputs[0]
        if insert:
            log.info("attention: %d softmaxes of [B*H, ..] views computed on [B, H, ..] scores", len(insert))
        return splice(graph, insert, replace)

    def _head_scales_on_queries(self, graph: FlowGraph) -> FlowGraph:
        """``graph`` with float32 scores ``MatMul(q, kᵀ) * c`` (``q`` ``[B, H, S, D]``, ``c`` a
        constant of one value per head, ``[H, 1, 1]`` or ``[1, H, 1, 1]``: Swin V2's learned
        temperature of its cosine attention), read on their way to a softmax over the keys by
        additions alone, written as ``MatMul(q * c, kᵀ)``: a scale per head is then Q's (the
        fused op takes one scalar scale). The same products rounded in another order: each score
        differs by float32's rounding of a product (FlashAttention also scales Q first)."""
        from ..ops.elementwise import Binary
        from ..ops.linalg import MatMul

        insert: dict[int, list[Operator]] = {}
        replace: dict[int, Tensor] = {}
        for sm in graph.nodes:
            if not _is(sm, "Softmax") or sm.inputs[0].ndim != 4 or tuple(sm.attrs.get("axes", ())) != (3,):
                continue
            t, nxt = sm.inputs[0], sm
            for _ in range(_MAX_BIASES + 1):
                p = self._prod(t)
                if p is None or self._only(t) is not nxt or not _is(p, "Binary"):
                    break
                if p.attrs["fn"] == "add":
                    t, nxt = next((u for u in p.inputs if self._scores_side(u)), None), p
                    if t is None:
                        break
                    continue
                if p.attrs["fn"] != "mul":
                    break
                for x, c in (p.inputs, p.inputs[::-1]):
                    mm = self._prod(x)
                    if not (_is(mm, "MatMul") and self._only(x) is p and c.is_constant and c.dtype == "float32"
                            and x.dtype == "float32" and mm.inputs[0].ndim == 4 and 1 < c.size == x.shape[1]
                            and c.ndim <= 4 and tuple(c.shape)[-2:] == (1, 1) and c.shape[-3] == x.shape[1]
                            and tuple(x.shape) == tuple(p.outputs[0].shape)):
                        continue
                    q = Binary([mm.inputs[0], c], name=f"{p.name}.q", fn="mul")
                    scores = MatMul([q.outputs[0], mm.inputs[1]], name=f"{p.name}.scores")
                    insert[id(p)] = [q, scores]
                    replace[id(p.outputs[0])] = scores.outputs[0]
                    break
                break
        if insert:
            log.info("attention: %d scales per head moved onto the queries", len(insert))
        return splice(graph, insert, replace)

    def _heads_of(self, q3: Tensor) -> tuple[int, int] | None:
        """``(B, H)`` when ``q3`` (``[B*H, S, D]``) is ``Transpose(Reshape(x [S, B, H*D] -> [S, B*H,
        D]), (1, 0, 2))``, perhaps scaled by a scalar: the time-major heads of torch's
        ``multi_head_attention_forward`` (``nn.MultiheadAttention``'s, WavLM's)."""
        p = self._prod(q3)
        if _is(p, "Binary") and p.attrs["fn"] in ("mul", "div") and self._scalar(p.inputs[1]) is not None:
            p = self._prod(p.inputs[0])
        rs = self._prod(p.inputs[0]) if _is(p, "Transpose", perm=(1, 0, 2)) else None
        if not _is(rs, "Reshape") or rs.inputs[0].ndim != 3:
            return None
        (s_len, b_, e), (s2, bh, d) = rs.inputs[0].shape, rs.outputs[0].shape
        if s2 != s_len or b_ <= 0 or bh % b_ or e != (bh // b_) * d:
            return None
        return b_, bh // b_

    def _time_major_heads(self, graph: FlowGraph) -> FlowGraph:
        """``graph`` with a softmax over the keys of 3-D scores ``[B*H, S, L]`` (additions and
        scalings by scalars over ``MatMul(q, kᵀ)``, each read by the next alone) whose ``q`` has
        time-major heads (:meth:`_heads_of`) computed on their ``[B, H, S, L]`` view and viewed
        back, and the product of those probabilities with V (``[B*H, L, Dv]``) computed on the
        views too (``MatMul(p [B, H, S, L], v viewed [B, H, L, Dv])`` viewed back as ``[B*H, S,
        Dv]``): :meth:`_lift_heads` then writes the scores on the heads. Where ``q`` has no such heads
        and the probabilities are read by that product alone, the ``N = B*H`` attentions (ViTDet's
        ``qkv.reshape(3, B*H, S, D)``) are lifted as one batch of ``N`` heads, ``[1, N, ..]``. The same
        values (views)."""
        from ..ops.linalg import MatMul
        from ..ops.reduce import Softmax
        from ..ops.transform import Reshape

        insert: dict[int, list[Operator]] = {}
        replace: dict[int, Tensor] = {}
        for sm in graph.nodes:
            if not _is(sm, "Softmax") or sm.inputs[0].ndim != 3 or tuple(sm.attrs.get("axes", ())) != (2,) \
                    or sm.attrs.get("log") or id(sm.outputs[0]) in self._outputs:
                continue
            bh, s_len, l_len = sm.inputs[0].shape
            t, nxt = sm.inputs[0], sm
            for _ in range(2 * _MAX_BIASES):
                p = self._prod(t)
                u = self._toward_product(p, 2 * _MAX_BIASES + 1) if self._only(t) is nxt else None
                if u is None:
                    break
                t, nxt = u, p
            mm = self._prod(t)
            if not _is(mm, "MatMul") or self._only(t) is not nxt or mm.inputs[0].ndim != 3:
                continue
            pv = self._only(sm.outputs[0])
            v3 = pv.inputs[1] if _is(pv, "MatMul") and pv.inputs[0] is sm.outputs[0] else None
            by_v = v3 is not None and v3.ndim == 3 and tuple(v3.shape[:2]) == (bh, l_len)  # P·V on the heads
            heads = self._heads_of(mm.inputs[0])
            if heads is None and by_v and tuple(mm.inputs[0].shape[:2]) == (bh, s_len) and mm.inputs[1].shape[0] == bh:
                heads = (1, bh)  # (N attentions of their own: one batch of N heads)
            if heads is None:
                continue
            b_, h_ = heads
            s4 = Reshape([sm.inputs[0]], name=f"{sm.name}.scores.heads", shape=(b_, h_, s_len, l_len))
            sm4 = Softmax([s4.outputs[0]], name=f"{sm.name}.heads", axes=(3,))
            new_ops = [s4, sm4]
            p3 = Reshape([sm4.outputs[0]], name=f"{sm.name}.view", shape=(bh, s_len, l_len))
            new_ops.append(p3)
            if by_v and id(pv.outputs[0]) not in self._outputs:
                dv = v3.shape[2]
                v4 = Reshape([v3], name=f"{pv.name}.v.heads", shape=(b_, h_, l_len, dv))
                pv4 = MatMul([sm4.outputs[0], v4.outputs[0]], name=f"{pv.name}.heads")
                back = Reshape([pv4.outputs[0]], name=f"{pv.name}.view", shape=(bh, s_len, dv))
                insert[id(pv)] = [v4, pv4, back]
                replace[id(pv.outputs[0])] = back.outputs[0]
            insert[id(sm)] = new_ops
            replace[id(sm.outputs[0])] = p3.outputs[0]
        if insert:
            log.info("attention: %d softmaxes of time-major heads computed on their [B, H, ..] views",
                     sum(1 for ops in insert.values() if any(_is(o, "Softmax") for o in ops)))
        return splice(graph, insert, replace)

    def _lift_heads(self, graph: FlowGraph) -> FlowGraph:
        """``graph`` with attention computed on ``[B*H, ..]`` tensors (BLOOM's ``baddbmm`` of the
        ALiBi bias, then a view to ``[B, H, S, L]`` for the mask and the softmax, and back for the
        product with V) written on the ``[B, H, ..]`` views instead, which :class:`FuseAttention` takes: a
        ``Reshape([B*H, S, L] -> [B, H, S, L])`` of a chain of additions (biases ``[B*H | 1, S | 1,
        L]``, viewed as ``[B, H, S | 1, L]``) and scalings over ``MatMul(q, kᵀ)`` (``[B*H, S, D]``,
        ``[B*H, D, L]``, viewed as ``[B, H, ..]``), every step read by the next alone, read on its
        way to a Softmax over the last axis by additions alone; and ``Reshape(MatMul(Reshape(p [B,
        H, S, L] -> [B*H, S, L]), v) -> [B, H, S, Dv])`` as ``MatMul(p, v viewed [B, H, L, Dv])``.
        The same products and sums of the same values (a view is free)."""
        from ..ops.elementwise import Binary
        from ..ops.linalg import MatMul
        from ..ops.transform import Reshape

        insert: dict[int, list[Operator]] = {}
        replace: dict[int, Tensor] = {}

        def view(t: Tensor, shape: tuple, name: str, new_ops: list) -> Tensor:
            src = self._prod(t)  # (a view of a view: the first one's input where it has the shape)
            if _is(src, "Reshape") and tuple(src.inputs[0].shape) == shape:
                return src.inputs[0]
            new_ops.append(Reshape([t], name=name, shape=shape))
            return new_ops[-1].outputs[0]

        for sm in graph.nodes:
            if not _is(sm, "Softmax") or tuple(sm.attrs.get("axes", ())) != (3,) or sm.inputs[0].ndim != 4:
                continue
            b_, h_, s_len, l_len = sm.inputs[0].shape
            t, nxt = sm.inputs[0], sm
            while _is(self._prod(t), "Binary", fn="add") and self._only(t) is nxt:  # the 4-D biases
                nxt = self._prod(t)
                t = next((u for u in nxt.inputs if _is(self._prod(u), "Reshape") or _is(self._prod(u), "Binary")),
                         nxt.inputs[0])
            up = self._prod(t)
            if not (_is(up, "Reshape") and self._only(t) is nxt and tuple(up.inputs[0].shape) == (b_ * h_, s_len, l_len)
                    and h_ > 1):
                continue
            chain, t = [], up.inputs[0]  # the 3-D steps, from the last to the product
            while self._only(t) is (chain[-1] if chain else up):
                p = self._prod(t)
                if _is(p, "MatMul"):
                    break
                if _is(p, "Binary", fn="add"):
                    a, b = p.inputs
                    t3, bias = (a, b) if self._reaches_product(a) else (b, a)
                    if bias.ndim != 3 or bias.shape[0] not in (1, b_ * h_) or bias.shape[1] not in (1, s_len):
                        break
                elif _is(p, "Binary") and p.attrs["fn"] in ("mul", "div") and self._scalar(p.inputs[1]) is not None:
                    t3 = p.inputs[0]
                else:
                    break
                chain.append(p)
                t = t3
            mm = self._prod(t)
            if not _is(mm, "MatMul") or self._only(t) is not (chain[-1] if chain else up):
                continue
            q3, kt3 = mm.inputs
            d = q3.shape[-1]
            if tuple(q3.shape) != (b_ * h_, s_len, d) or tuple(kt3.shape) != (b_ * h_, d, l_len):
                continue
            new_ops: list[Operator] = []
            sc = self._prod(kt3)  # Kᵀ scaled by a scalar (DeBERTa's): the scaling on the view
            scaled = _is(sc, "Binary") and sc.attrs["fn"] in ("mul", "div") and sc.inputs[0] is not sc.inputs[1] \
                and self._scalar(sc.inputs[1]) is not None and self._only(kt3) is mm
            kt4 = view(sc.inputs[0] if scaled else kt3, (b_, h_, d, l_len), f"{mm.name}.kt.heads", new_ops)
            if scaled:
                new_ops.append(Binary([kt4, sc.inputs[1]], name=f"{sc.name}.heads", fn=sc.attrs["fn"]))
                kt4 = new_ops[-1].outputs[0]
            y = MatMul([view(q3, (b_, h_, s_len, d), f"{mm.name}.q.heads", new_ops), kt4], name=f"{mm.name}.heads")
            new_ops.append(y)
            cur = y.outputs[0]
            for step in reversed(chain):  # (in the graph's order)
                if step.attrs["fn"] == "add":
                    bias = step.inputs[1] if step.inputs[0] is t else step.inputs[0]
                    if bias.shape[0] == b_ * h_:
                        bias = view(bias, (b_, h_) + tuple(bias.shape[1:]), f"{step.name}.bias.heads", new_ops)
                    ins = [cur, bias] if step.inputs[0] is t else [bias, cur]
                else:
                    ins = [cur, step.inputs[1]]
                new_ops.append(type(step)(ins, name=f"{step.name}.heads", **step.attrs))
                t, cur = step.outputs[0], new_ops[-1].outputs[0]
            insert[id(up)] = new_ops
            replace[id(up.outputs[0])] = new_ops[-1].outputs[0]
        for mm in graph.nodes:  # the product with V, back from [B*H, S, L]
            down = self._prod(mm.inputs[0]) if _is(mm, "MatMul") and mm.inputs[0].ndim == 3 else None
            out = self._only(mm.outputs[0])
            if not (_is(down, "Reshape") and down.inputs[0].ndim == 4 and _is(out, "Reshape")
                    and self._only(mm.inputs[0]) is mm) or id(out.outputs[0]) in replace \
                    or id(out.outputs[0]) in self._outputs:
                continue  # (or the scores' product, lifted above; the graph's outputs keep their names)
            b_, h_, s_len, l_len = down.inputs[0].shape
            v3 = mm.inputs[1]
            if tuple(v3.shape[:2]) != (b_ * h_, l_len) or tuple(out.outputs[0].shape) != (b_, h_, s_len, v3.shape[2]):
                continue
            new_ops = []
            v4 = view(v3, (b_, h_, l_len, v3.shape[2]), f"{mm.name}.v.heads", new_ops)
            new_ops.append(MatMul([down.inputs[0], v4], name=f"{mm.name}.heads"))
            insert.setdefault(id(out), []).extend(new_ops)
            replace[id(out.outputs[0])] = new_ops[-1].outputs[0]
        if insert:
            log.info("attention: %d products on [B*H, ..] tensors written on their [B, H, ..] views", len(insert))
        return splice(graph, insert, replace)


class FuseAttention(_Walk, GraphPass):
    """Replace attention written as MatMul/Softmax/MatMul on half operands by one ``Attention``.

    ``float32=True``: the same pattern on float32 operands without the casts,
    ``softmax(Q Kᵀ · scale + bias) V``, becomes ``Attention(..., acc_dtype="float32")`` (the
    scores scaled after the sum, as the MatMul and Mul compute them; any bias added after the
    scale, a row whose every logit is -inf NaN as the Softmax gives it) where the target's
    kernel computes it: ``target="cpu"`` (at every precision: at float16/bfloat16 the probabilities
    the precision pass rounds, ``RoundHalf(Softmax(s))`` after :class:`~.precision.HalfModelInFloat32`,
    become the op's ``probs_dtype``; Q, K and V stay the rounded tensors they were), where the cpu template does
    (:func:`~shardflow.compiler.codegen.templates_cpu.template_kind`: two biases at most, GPT-2's
    and BERT's masks, T5's position bias and mask, BLOOM's ALiBi and mask); ``target="cuda"``
    (float32 and tf32 on sm_80 and newer), where the fused kernel takes the head sizes
    (:func:`~shardflow.compiler.codegen.cuda_attention.takes_heads`; TF32 or 3xTF32 products, as
    the separate MatMuls have). The op never writes the ``[B, H, S, L]`` scores and reads and
    writes the heads in the ``[B, S, H*D]`` forms.
    """

    def __init__(self, float32: bool = False, target: str = "cpu"):
        if target not in ("cpu", "cuda"):
            raise ValueError(f"FuseAttention: target {target!r} is not 'cpu' or 'cuda'")
        self.float32, self.target = float32, target

    def run(self, graph: FlowGraph) -> FlowGraph:
        graph = AttentionOnHeads().run(graph)
        self._index(graph)
        self._bounds: dict[tuple, Tensor] = {}  # (position, +1, batch) -> a key bound made once for every layer
        replace: dict[int, Tensor] = {}  # old tensor -> new one
        insert: dict[int, list[Operator]] = {}  # id(op) -> new ops to place right after it
        for op in list(graph.nodes):
            if not _is(op, "MatMul"):
                continue
            found = self._match(op)
            if found is None:
                continue
            new_ops, old, new = found
            insert[id(op)] = new_ops
            replace[id(old)] = new
        if insert:
            log.info("attention: %d softmax(QK^T)V patterns fused into Attention ops", len(insert))
        return splice(graph, insert, replace)

    # ---------------------------------------------------------------------------------------
    def _half_of(self, t: Tensor) -> Tensor | None:
        """``h`` when ``t = Cast(h, float32)`` with ``h`` float16/bfloat16, or ``t`` itself when it is
        half (a half model's own operands); float32 mode: ``t`` itself when it is float32. ``h =
        Cast(Cast(x, float32), half)`` of ``x`` of that half type (a half operand the model widened,
        rounded by the precision pass) is ``x``: the same values."""
        if self.float32:
            return t if t.dtype == "float32" else None
        p = self._prod(t)
        if _is(p, "Cast", to="float32") and p.inputs[0].dtype in _HALF:
            h = p.inputs[0]
            down = self._prod(h)
            up = self._prod(down.inputs[0]) if _is(down, "Cast", to=h.dtype) else None
            return up.inputs[0] if _is(up, "Cast", to="float32") and up.inputs[0].dtype == h.dtype else h
        return t if t.dtype in _HALF else None

    def _heads_3d(self, t: Tensor, perm: tuple) -> Tensor | None:
        """``x`` when ``t = Transpose(Reshape(x, [B, S, H, D]), perm)`` with ``x`` of shape
        ``[B, S, H*D]``."""
        tr = self._prod(t)
        if not _is(tr, "Transpose", perm=perm):
            return None
        rs = self._prod(tr.inputs[0])
        if not _is(rs, "Reshape"):
            return None
        x = rs.inputs[0]
        r4 = rs.outputs[0].shape
        if len(r4) != 4 or len(x.shape) != 3 or tuple(x.shape) != (r4[0], r4[1], r4[2] * r4[3]):
            return None
        return x

    def _match(self, mm2: Operator):
        from ..ops.elementwise import CastOp
        from ..ops.linalg import Attention
        from ..ops.transform import Reshape

        if len(mm2.outputs[0].shape) != 4:
            return None
        vh = self._half_of(mm2.inputs[1])
        if vh is None:
            return None
        native = not self.float32 and vh is mm2.inputs[1]  # a half model's own attention
        up32 = None  # a half model's Cast(scores, float32) before a float32 Softmax
        # a half model's scores (product, scaling) widened to float32 before the biases, and
        # (wide_probs) its float32 probabilities times V widened: the TorchScript export of
        # scaled_dot_product_attention on a float16 model (rfcs/0005 decision 44)
        wide_scores = wide_probs = False
        # a half model's scores computed in float32 from Q and K widened (GPT-Neo's and GPT-J's
        # query.to(float32), key.to(float32)), a float32 Softmax and its probabilities cast back
        wide_qk = False
        # float32 mode: probabilities rounded to a half type's values (RoundHalf: precision float16 or bfloat16
        # on the cpu target, after HalfModelInFloat32), which the op rounds as its probs_dtype
        rounded_probs = None
        if self.float32 or native:  # the probabilities straight from the Softmax
            down, sm = mm2, self._prod(mm2.inputs[0])
            if self.float32 and _is(sm, "RoundHalf") and sm.attrs.get("to") in _HALF \
                    and self._only(sm.outputs[0]) is mm2:
                rounded_probs, down, sm = sm.attrs["to"], sm, self._prod(sm.inputs[0])
            # a half model's probabilities through float32 and back (transformers' Llama, Mistral:
            # softmax(dtype=float32).to(half), which the exporter writes as a float32 Softmax of the
            # scores cast, or as the half Softmax's output cast to float32 and back)
            while native and _is(sm, "Cast") and sm.attrs.get("to") in ("float32", vh.dtype) \
                    and self._only(sm.outputs[0]) is down:
                down, sm = sm, self._prod(sm.inputs[0])
            down, sm, nan_zero = self._past_nan_guard(down, sm)
            if native and _is(sm, "Softmax") and sm.outputs[0].dtype == "float32":
                up32 = self._prod(sm.inputs[0])
                if not _is(up32, "Cast", to="float32") or up32.inputs[0].dtype != vh.dtype \
                        or self._only(up32.outputs[0]) is not sm:
                    up32, wide_qk = None, True  # (checked at the scores' product below)
        else:  # the probabilities rounded to the half type: Cast(Cast(p, half), float32)
            up = self._prod(mm2.inputs[0])
            if _is(up, "Cast", to="float32"):
                if self._only(up.outputs[0]) is not mm2:
                    return None
                down = self._prod(up.inputs[0])
                if not _is(down, "Cast") or down.attrs.get("to") != vh.dtype \
                        or self._only(down.outputs[0]) is not up:
                    return None
                down, sm, nan_zero = self._past_nan_guard(down, self._prod(down.inputs[0]))
            else:  # or float32, with V widened: the scores must be a half product widened (below)
                down, sm, nan_zero = self._past_nan_guard(mm2, up)
                wide_probs = True
        if not _is(sm, "Softmax") or sm.attrs.get("log") or tuple(sm.attrs.get("axes", ())) != (3,) \
                or not (nan_zero or self._only(sm.outputs[0]) is down):  # (the guard checked its readers)
            return None
        s, nxt = sm.inputs[0], sm
        if up32 is not None:
            s, nxt = up32.inputs[0], up32
        biases: list[Tensor] = []  # the additive biases, from the last added to the first
        scale = 1.0
        p = self._prod(s)
        while _is(p, "Binary", fn="add") and self._only(s) is nxt and len(biases) < _MAX_BIASES:
            a, b = p.inputs
            if self._scores_side(a):
                s = a
                biases.append(b)
            elif self._scores_side(b):
                s = b
                biases.append(a)
            else:
                return None
            nxt = p
            p = self._prod(s)

        def widen():  # past Cast(x, float32) of a half x (the model's scores, widened), once
            nonlocal wide_scores, nxt, s, p
            if not (native or self.float32 or wide_scores) and _is(p, "Cast", to="float32") \
                    and p.inputs[0].dtype == vh.dtype and self._only(s) is nxt:
                wide_scores, nxt, s = True, p, p.inputs[0]
                p = self._prod(s)

        widen()
        softcap = self._softcap(p) if self._only(s) is nxt else None
        if softcap is not None:  # tanh(s / cap) * cap (Gemma 2's logit soft-capping), after the scale
            cap_div, cap = softcap
            nxt, s = cap_div, cap_div.inputs[0]
            p = self._prod(s)
        widen()
        if (_is(p, "Binary", fn="mul") or _is(p, "Binary", fn="div")) and self._only(s) is nxt:
            a, b = p.inputs
            c = self._scalar(b)
            if c is None and p.attrs["fn"] == "mul":
                c, a = self._scalar(a), b
            if c is None or c == 0 or not math.isfinite(c):
                return None
            scale = c if p.attrs["fn"] == "mul" else 1.0 / c
            nxt, s = p, a
            p = self._prod(s)
        widen()
        mm1 = p
        if not _is(mm1, "MatMul") or self._only(s) is not nxt or wide_probs and not wide_scores:
            return None
        qh, kth = self._half_of(mm1.inputs[0]), self._half_of(mm1.inputs[1])
        direct = qh is mm1.inputs[0] and kth is mm1.inputs[1]  # (no cast between them and the product)
        if qh is None or kth is None or not (qh.dtype == kth.dtype == vh.dtype) or (
                not self.float32 and ((native and not wide_qk) or wide_scores) != direct):
            return None
        shapes = [tuple(t.shape) for t in (qh, kth, vh)]
        if any(len(sh) != 4 for sh in shapes):
            return None
        (b_, h_, s_len, d), (_, _, dk, l_len), (_, _, lv, dv) = shapes
        # (one K/V head that the products broadcast over the query heads: multi-query attention,
        # Falcon's; any other batch broadcasting is left to the two products)
        mqa = h_ > 1 and shapes[1][:2] == shapes[2][:2] == (b_, 1)
        if dk != d or lv != l_len or not mqa and (shapes[1][:2] != (b_, h_) or shapes[2][:2] != (b_, h_)):
            return None
        if (not self.float32 or self.target == "cuda") and not takes_heads(d, dv, float32=self.float32):
            return None  # the generic lowering of the op would be slower than the separate ops
        biases.reverse()  # in the order they are added
        if nan_zero and len(biases) > 1:
            return None  # (the op's empty-row rule is the mask's: one bias)
        given = list(biases)  # (as the graph has them: a half model's are widened below)
        for bias in biases:
            bs = tuple(bias.shape)
            want = (b_, h_, s_len, l_len)
            if (len(bs) > 4 or not bs or bs[-1] != l_len
                    or bias.dtype != ("float32" if not native or wide_qk else vh.dtype)
                    or any(e not in (1, w) for e, w in zip(bs, want[4 - len(bs):]))):
                return None
        # the operands: 3-D [B, S, H*D] forms where the heads were split by a reshape + transpose
        q3, k3, v3 = self._heads_3d(qh, (0, 2, 1, 3)), self._heads_3d(kth, (0, 2, 3, 1)), \
            self._heads_3d(vh, (0, 2, 1, 3))
        out_chain = self._output_chain(mm2.outputs[0], (b_, s_len, h_ * dv))
        three_d = out_chain is not None  # the output in the [B, S, H*Dv] form (Q too where it can)
        old = out_chain[1].outputs[0] if three_d else mm2.outputs[0]
        if id(old) in self._outputs:  # (the graph's outputs keep their tensors and names)
            return None
        new_ops: list[Operator] = []
        k_steps: list[Operator] = []  # element-wise steps between K's rows and Kᵀ, redone on the rows
        if k3 is None:
            k3, k_steps = self._key_rows(kth, f"{mm2.name}.k", new_ops)
            if k3 is None:
                return None  # (Kᵀ not 4-D, or its casts and scalings read by others)
        if native and not wide_qk:  # the half biases read in float32 (exactly)
            widened = []
            for bias in biases:
                if bias.is_constant:
                    widened.append(const_tensor(np.asarray(bias.value).astype(np.float32), f"{bias.name}.float32"))
                else:
                    new_ops.append(CastOp([bias], name=f"{mm2.name}.bias{len(widened)}.float32", to="float32"))
                    widened.append(new_ops[-1].outputs[0])
            biases = widened
        causal = {}
        value = self._folded(given[0]) if len(biases) == 1 else None
        if value is not None:
            # (a float16 model's mask hides with its type's lowest value, transformers' finfo.min)
            hidden = float(np.finfo(np.float16).min) if native and not wide_qk and vh.dtype == "float16" else _HIDDEN
            off, keep = _causal(value.astype(np.float32), s_len, l_len, hidden)
            if off is not None:
                causal = {"is_causal": True, "past_len": off}
                biases = biases if keep else []
        q_in = q3 if three_d and q3 is not None else qh
        k_in, v_in, kv_heads = k3, v3 if v3 is not None else vh, 1 if mqa else h_
        gk, gv = self._ungrouped(k_in), self._ungrouped(v_in)
        if gk is not None and gv is not None and gk[1] == gv[1]:  # grouped heads: K and V before the repeat
            kv_heads = gk[1]
            k_in, v_in = (self._cast_to(g[0], t.dtype, f"{mm2.name}.{w}", new_ops) for g, t, w in
                          ((gk, k_in, "k"), (gv, v_in, "v")))
            v_in = self._heads_3d(v_in, (0, 2, 1, 3)) or v_in
        for step in k_steps:  # (a scaling by a scalar and a cast commute with transposes and repeats)
            new_ops.append(type(step)([k_in] + step.inputs[1:], name=f"{step.name}.rows", **step.attrs))
            k_in = new_ops[-1].outputs[0]
        # a bias that hides every key past a runtime position (a static KV cache's mask): that
        # position bounds the keys the kernel visits (nonpad_bound: no part in the values)
        bound = None
        if not self.float32 or self.target == "cuda":
            bound = next((b for b in (self._key_bound(x, l_len, b_, s_len, f"{mm2.name}.keys", new_ops)
                                      for x in given) if b is not None), None)
        # (the biases as extra_biases, not as the op's mask: the mask's rule gives 0 for a row whose
        # every key is -inf, the Softmax of the matched ops gives NaN; under a NaN guard, which
        # gives 0 there, the one bias is the mask)
        mask = biases[:1] if nan_zero else []
        biases = biases[len(mask):]
        ins = [q_in, k_in, v_in] + mask + ([bound] if bound is not None else []) + biases
        att = Attention(ins, name=f"{mm2.name}.attention", q_heads=h_, kv_heads=kv_heads, scale=scale,
                        scale_sqrt=math.sqrt(abs(scale)), acc_dtype="float32",
                        **({"probs_dtype": rounded_probs} if rounded_probs else {} if self.float32
                           else {"probs_dtype": vh.dtype}),
                        **({"has_mask": True} if mask else {}),
                        **({"has_nonpad": True, "nonpad_bound": True} if bound is not None else {}),
                        extra_biases=len(biases), **causal, **({"y_3d": True} if three_d and q_in.ndim == 4 else {}),
                        **({"softcap": softcap[1]} if softcap is not None else {}))
        if self.float32 and self.target == "cpu":
            from ..codegen.templates_cpu import template_kind

            if template_kind(att) != "Attention":
                return None  # the generic nest would be slower than the separate ops
        new_ops.append(att)
        y = att.outputs[0]
        for c in out_chain[0] if three_d else ():  # element-wise casts after the transpose, on the 3-D result
            new_ops.append(type(c)([y], name=f"{c.name}.3d", **c.attrs))
            y = new_ops[-1].outputs[0]
        if y.dtype != old.dtype:  # (a half model's attention: its output rounded once)
            new_ops.append(CastOp([y], name=f"{mm2.name}.attention.{old.dtype}", to=old.dtype))
            y = new_ops[-1].outputs[0]
        if three_d and old.ndim == 2:  # the rows [B*S, H*Dv]: a view of the 3-D result
            new_ops.append(Reshape([y], name=f"{out_chain[1].name}.rows", shape=tuple(old.shape)))
            y = new_ops[-1].outputs[0]
        return new_ops, old, y

    def _softcap(self, mul: Operator | None) -> tuple[Operator, float] | None:
        """``(div, c)`` when ``mul`` is ``Mul(Tanh(Div(x, c)), c)`` (either operand order of the
        ``Mul``) with ``c > 0`` a constant scalar and each step read by the next alone: the
        scores' soft-capping the Attention op computes as its ``softcap`` (the same operations)."""
        if not _is(mul, "Binary", fn="mul"):
            return None
        t, c = mul.inputs
        if self._scalar(c) is None:
            c, t = t, c
        cap, th = self._scalar(c), self._prod(t)
        if cap is None or not cap > 0 or not math.isfinite(cap) or not _is(th, "Unary", fn="tanh") \
                or self._only(t) is not mul:
            return None
        div = self._prod(th.inputs[0])
        if not _is(div, "Binary", fn="div") or self._scalar(div.inputs[1]) != cap or self._only(th.inputs[0]) is not th:
            return None
        return div, cap

    def _past_nan_guard(self, reader: Operator, p: Operator | None) -> tuple[Operator, Operator | None, bool]:
        """``(where, softmax, True)`` when ``p`` is ``Where(IsNaN(x), 0, x)`` of a Softmax's output
        ``x`` read by those two ops alone, and ``p`` by ``reader`` alone: torch's export of
        ``scaled_dot_product_attention``, which makes the probabilities of a row whose every key
        is masked (``-inf`` everywhere: NaN) 0, the Attention op's rule for its mask. Else
        ``(reader, p, False)``."""
        if not (_is(p, "Where") and self._only(p.outputs[0]) is reader):
            return reader, p, False
        cond, zero, x = p.inputs
        isnan, sm = self._prod(cond), self._prod(x)
        readers = {id(op) for op in self._consumers.get(id(x), [])}
        if not (_is(isnan, "Unary", fn="isnan") and isnan.inputs[0] is x and self._only(cond) is p
                and _is(sm, "Softmax") and readers == {id(isnan), id(p)} and id(x) not in self._outputs
                and zero.is_constant and zero.size == 1 and float(np.asarray(zero.value).reshape(())) == 0.0):
            return reader, p, False
        return p, sm, True

    def _key_rows(self, kth: Tensor, name: str, new_ops: list) -> tuple[Tensor | None, list[Operator]]:
        """``(k, steps)``: K's rows ``k`` (``[B, H, L, D]``, or the ``[B, L, H*D]`` form) of
        ``kth = steps(Kᵀ)``, ``steps`` the scalings by a constant scalar and casts (each read by
        the next alone) between ``Kᵀ`` and ``kth``, in order; ``(None, [])`` when ``kth`` is not so
        made. ``Kᵀ`` is ``Transpose(k, (0, 1, 3, 2))``, ``Transpose(Reshape(k3), (0, 2, 3, 1))``
        (:meth:`_heads_3d`), or torch's dynamo export of it, ``Reshape(Transpose(Reshape(x, [B*H, L,
        D]), (0, 2, 1)), [B, H, D, L])`` (``x`` ``[B, H, L, D]``, or repeated heads ``[B, Hk, rep, L,
        D]``, then reshaped here by a new op), or any other ``Transpose(x)`` (K's rows then a new
        transpose of ``x``: LeViT's ``x`` is a split of ``[B, L, H, D]``); any other 4-D ``Kᵀ`` by a
        transposed copy, ``Transpose(Kᵀ, (0, 1, 3, 2))``. torch's export of
        ``scaled_dot_product_attention`` scales Q and Kᵀ by the square root of the scale each."""
        from ..ops.transform import Reshape, Transpose

        steps: list[Operator] = []
        t = kth
        while True:
            if steps and self._only(t) is not steps[0]:  # (each tensor between the steps read by the next alone)
                return None, []
            p = self._prod(t)
            if not (_is(p, "Cast") and p.attrs.get("to") in ("float32", *_HALF)
                    or _is(p, "Binary") and p.attrs["fn"] in ("mul", "div") and self._scalar(p.inputs[1]) is not None):
                break
            steps.insert(0, p)
            t = p.inputs[0]
        if t.ndim != 4:
            return None, []
        b_, h_, d, l_len = t.shape
        tk = self._prod(t)
        if _is(tk, "Transpose", perm=(0, 1, 3, 2)):
            return tk.inputs[0], steps
        k3 = self._heads_3d(t, (0, 2, 3, 1))
        if k3 is not None:
            return k3, steps
        if _is(tk, "Transpose") and tk.inputs[0].ndim == 4:  # Kᵀ = x permuted (LeViT's, of a split [B, L, H, D])
            p = tuple(tk.attrs["perm"])
            new_ops.append(Transpose([tk.inputs[0]], name=f"{name}.rows", perm=(p[0], p[1], p[3], p[2])))
            return new_ops[-1].outputs[0], steps
        tr = self._prod(tk.inputs[0]) if _is(tk, "Reshape") else None
        perm = tuple(tr.attrs["perm"]) if _is(tr, "Transpose") and tr.inputs[0].ndim == 3 else None
        if perm is None or tuple(tr.inputs[0].shape[i] for i in (perm[0], perm[2], perm[1])) != (b_ * h_, l_len, d):
            # Kᵀ stored as such (a channels-first K, SqueezeBERT's [B, H*D, L] viewed [B, H, D, L]): its
            # rows a transposed copy (L*D elements, against the S*L scores the separate ops write)
            new_ops.append(Transpose([t], name=f"{name}.rows", perm=(0, 1, 3, 2)))
            return new_ops[-1].outputs[0], steps
        rows = tr.inputs[0]
        if perm != (0, 2, 1):  # (time-major [L, B*H, D] keys, torch's multi_head_attention_forward: (1, 2, 0))
            new_ops.append(Transpose([rows], name=f"{name}.rows", perm=(perm[0], perm[2], perm[1])))
            rows = new_ops[-1].outputs[0]
        merge = self._prod(rows)
        x = merge.inputs[0] if _is(merge, "Reshape") else None
        if x is not None and tuple(x.shape) == (b_, h_, l_len, d):
            return x, steps
        if x is not None and x.ndim == 5 and x.shape[0] == b_ and x.shape[1] * x.shape[2] == h_ \
                and tuple(x.shape[3:]) == (l_len, d):
            rows = x
        new_ops.append(Reshape([rows], name=f"{name}.heads", shape=(b_, h_, l_len, d)))
        self._producer[id(new_ops[-1].outputs[0])] = new_ops[-1]  # (for _ungrouped)
        return new_ops[-1].outputs[0], steps

    def _ungrouped(self, t: Tensor) -> tuple[Tensor, int] | None:
        """``(x, Hk)`` when ``t`` is ``x`` ``[B, Hk, L, D]`` with each head repeated ``rep`` times
        (``[B, Hk * rep, L, D]``, head ``h`` from ``x``'s ``h // rep``: the exporters' ``repeat_kv``
        of grouped-query attention, ``Reshape(Expand(Reshape(x, [B, Hk, 1, L, D]), [B, Hk, rep, L,
        D]), [B, Hk * rep, L, D])``); the Attention op reads ``x`` with ``kv_heads = Hk``."""
        merge = self._prod(t)
        if t.ndim != 4 or not _is(merge, "Reshape"):
            return None
        expand = self._past_casts(merge.inputs[0])
        if not _is(expand, "Expand"):
            return None
        e = tuple(expand.outputs[0].shape)
        if len(e) != 5 or tuple(t.shape) != (e[0], e[1] * e[2], e[3], e[4]):
            return None
        split = self._past_casts(expand.inputs[0])
        if not _is(split, "Reshape") or tuple(split.outputs[0].shape) != (e[0], e[1], 1, e[3], e[4]) \
                or tuple(split.inputs[0].shape) != (e[0], e[1], e[3], e[4]):
            return None
        return split.inputs[0], e[1]

    #: a comparison ``J fn p`` read as ``p fn' J`` (its operands swapped)
    _SWAPPED = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt"}

    def _key_bound(self, bias: Tensor, l_len: int, batch: int, s_len: int, name: str,
                   new_ops: list) -> Tensor | None:
        """An ``int64 [batch]`` tensor ``n`` (made by new ops appended to ``new_ops``) when ``bias``
        hides every key ``j >= n``: ``bias`` is (casts of) ``Where(c, x, h)`` with ``c`` = ``j <= p``
        (``n = p + 1``) or ``j < p`` (``n = p``), or ``Where(c, h, x)`` with ``c`` = ``j > p`` or
        ``j >= p`` (either side of the comparison), where ``j`` is a constant holding ``0 .. L-1``
        along the keys, ``p`` an integer tensor of one element (a decoding step's position, or one
        per sequence, ``[B, 1, 1, 1]`` against 4-D scores, or one per query row, ``[.., S, 1]``: a
        prompt's rows over a static cache, bounded by their largest) and ``h`` ``-inf`` (the test may be one
        of the conditions an ``And`` combines, for ``j <= p``, or an ``Or``, for ``j > p``: a
        padding mask beside it); or ``h`` a finite constant that hides a key (at most ``_HIDDEN``,
        or its type's lowest value, transformers' masks: ``exp`` of it minus a row's maximum is 0
        for scores of a half model's range) with ``x`` a constant above -1e4, so that a row that
        sees a key below ``n`` gets nothing from the keys past it; a row that sees none weighs the
        hidden keys as the separate ops do, so the kernel must visit every key for it: alone, the
        test shows no key exactly when ``n <= 0``, which the kernel reads as every key; beside
        other conditions or with a position per row, a sequence with a row that sees no key gets
        ``n = 0`` (:meth:`_unless_blind`, from the mask's condition). None otherwise."""
        from ..ops.elementwise import Binary, CastOp
        from ..ops.reduce import Reduce
        from ..ops.transform import Expand, Reshape

        w = self._prod(bias)
        while _is(w, "Cast") and dtype_kind(w.outputs[0].dtype) == "f":
            w = self._prod(w.inputs[0])
        select = self._mask_select(w)
        if select is None or not select[3].shape or select[3].shape[-1] != l_len:
            return None
        cond, if_true, if_false, mask = select
        for leaf, combined in self._condition_leaves(cond):
            cmp = self._prod(leaf)
            if not _is(cmp, "Binary") or cmp.attrs.get("fn") not in self._SWAPPED:
                continue
            (a, b), fn = cmp.inputs, cmp.attrs["fn"]
            if not self._is_key_index(a, l_len):
                a, b, fn = b, a, self._SWAPPED[fn]
            per_sequence = (b.ndim == 4 and tuple(b.shape) == (batch, 1, 1, 1) and batch > 1
                            and mask.ndim == 4)  # (a position per sequence, on the scores' batch axis)
            per_row = (s_len > 1 and b.size == s_len and b.ndim >= 2 and b.shape[-2:] == (s_len, 1))  # (a query's)
            # (j <= p shows a key only with the other conditions of an And; j > p hides it whatever an Or adds)
            if self._is_key_index(a, l_len) and (b.size == 1 or per_sequence or per_row) \
                    and dtype_kind(b.dtype) in ("i", "u") and combined <= ({"and"} if fn in ("le", "lt") else {"or"}):
                break
        else:
            return None
        hidden = if_false if fn in ("le", "lt") else if_true  # (the side of the keys past p)
        if not (hidden.is_constant and hidden.size == 1 and dtype_kind(hidden.dtype) == "f"):
            return None
        h = float(np.asarray(hidden.value, np.float64).reshape(()))
        # (under a finite hidden value, other conditions or a row's own position may hide every key
        # below the bound from a row, which then weighs every key: the bound is dropped for its batch)
        blind = h != -np.inf and bool(combined or per_row)
        key = (id(b), fn in ("le", "gt"), batch) + ((id(cond),) if blind else ())
        if h != -np.inf:
            shown = if_true if fn in ("le", "lt") else if_false
            lowest = float(np.finfo(np.dtype(hidden.value.dtype)).min) if hidden.value.dtype.kind == "f" else None
            if not (h <= _HIDDEN or h == lowest) or not (shown.is_constant and shown.size == 1) \
                    or not float(np.asarray(shown.value, np.float64).reshape(())) > -1e4:
                return None
        if key in self._bounds:  # (the layers' masks share one: its ops made at the first layer, before the others)
            return self._bounds[key]
        if per_row:  # (the rows' largest position bounds them all)
            new_ops.append(Reduce([b], name=f"{name}.last", kind="max", axes=tuple(range(b.ndim)), keepdims=True))
            b = new_ops[-1].outputs[0]
        n = b if b.ndim == 1 else None
        if n is None:
            new_ops.append(Reshape([b], name=f"{name}.flat", shape=(b.size,)))
            n = new_ops[-1].outputs[0]
        if n.dtype != "int64":
            new_ops.append(CastOp([n], name=f"{name}.int64", to="int64"))
            n = new_ops[-1].outputs[0]
        if fn in ("le", "gt"):  # keys j <= p: p + 1 of them
            new_ops.append(Binary([n, const_tensor(np.array([1], np.int64), f"{name}.one")], name=f"{name}.next",
                                  fn="add"))
            n = new_ops[-1].outputs[0]
        if n.shape != (batch,):
            new_ops.append(Expand([n], name=name if not blind else f"{name}.each", shape=(batch,)))
            n = new_ops[-1].outputs[0]
        if blind:
            n = self._unless_blind(cond, fn in ("le", "lt"), n, batch, name, new_ops)
        self._bounds[key] = n
        return n

    def _mask_select(self, w: Operator | None) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """``(c, t, f, y)`` when ``w`` computes a mask ``y = c ? t : f``: ``Where(c, t, f)``, or with
        a finite constant ``h`` (either operand) ``Mul(Cast(c), h)`` (``h`` where the boolean ``c``
        holds, 0 elsewhere) or ``Mul(1 - Cast(c), h)`` (0 where it holds): a mask written as a
        product, ``(j > pos) * finfo.min``."""
        if _is(w, "Where"):
            return w.inputs[0], w.inputs[1], w.inputs[2], w.outputs[0]
        if not (_is(w, "Binary") and w.attrs.get("fn") == "mul"):
            return None
        for h, other in (w.inputs, w.inputs[::-1]):
            if not (h.is_constant and h.size == 1 and dtype_kind(h.dtype) == "f"
                    and np.isfinite(np.asarray(h.value, np.float64)).all()):
                continue
            p = self._prod(other)
            flip = _is(p, "Binary") and p.attrs.get("fn") == "sub" and p.inputs[0].is_constant \
                and p.inputs[0].size == 1 and float(np.asarray(p.inputs[0].value).reshape(())) == 1
            cast = self._prod(p.inputs[1]) if flip else p  # (1 - Cast(c): hidden where c fails)
            if _is(cast, "Cast") and cast.inputs[0].dtype == "bool":
                zero = const_tensor(np.zeros((), np.asarray(h.value).dtype), f"{w.name}.zero")
                return (cast.inputs[0], zero, h, w.outputs[0]) if flip else (cast.inputs[0], h, zero, w.outputs[0])
        return None

    @staticmethod
    def _unless_blind(cond: Tensor, shows: bool, n: Tensor, batch: int, name: str, new_ops: list) -> Tensor:
        """``n`` where every query row of a sequence sees a key, 0 (every key: the kernel's
        reading of a bound <= 0) for a sequence with a row that sees none: ``cond`` is the mask's
        condition, true where a key is shown (``shows``) or hidden, broadcast against the scores
        (its first axis the batch when it has 4 and ``batch`` of them)."""
        from ..ops.elementwise import CastOp, Where
        from ..ops.reduce import Reduce
        from ..ops.transform import Expand, Reshape

        new_ops.append(CastOp([cond], name=f"{name}.shown", to="int32"))
        t = new_ops[-1].outputs[0]
        # a row sees a key: its maximum of "shown" is 1 (or its minimum of "hidden" 0)
        new_ops.append(Reduce([t], name=f"{name}.rows", kind="max" if shows else "min", axes=(t.ndim - 1,),
                              keepdims=True))
        t = new_ops[-1].outputs[0]
        per_batch = t.ndim == 4 and t.shape[0] == batch and batch > 1
        axes = tuple(range(1 if per_batch else 0, t.ndim))
        new_ops.append(Reduce([t], name=f"{name}.seen", kind="min" if shows else "max", axes=axes, keepdims=False))
        t = new_ops[-1].outputs[0]
        if t.shape != (batch,):
            new_ops.append(Reshape([t], name=f"{name}.seen.flat", shape=(t.size,)))
            new_ops.append(Expand([new_ops[-1].outputs[0]], name=f"{name}.seen.each", shape=(batch,)))
            t = new_ops[-1].outputs[0]
        new_ops.append(CastOp([t], name=f"{name}.seen.test", to="bool"))
        zero = const_tensor(np.zeros(1, np.int64), f"{name}.all")
        new_ops.append(Where([new_ops[-1].outputs[0], n, zero] if shows else [new_ops[-1].outputs[0], zero, n],
                             name=name))
        return new_ops[-1].outputs[0]

    def _condition_leaves(self, t: Tensor, combined: frozenset = frozenset()):
        """The conditions an ``And``/``Or`` tree of ``t`` combines, each with the combinators on
        its way (a mask's position test beside a padding mask)."""
        p = self._prod(t)
        if _is(p, "Binary") and p.attrs.get("fn") in ("and", "or"):
            for u in p.inputs:
                yield from self._condition_leaves(u, combined | {p.attrs["fn"]})
        else:
            yield t, combined

    @staticmethod
    def _is_key_index(t: Tensor, l_len: int) -> bool:
        """Whether ``t`` is a constant holding ``0 .. l_len-1`` along its last axis (and nothing else)."""
        return (t.is_constant and t.size == l_len and t.shape and t.shape[-1] == l_len
                and np.array_equal(np.asarray(t.value).reshape(-1), np.arange(l_len)))

    def _past_casts(self, t: Tensor) -> Operator | None:
        """The producer of ``t`` past any element-wise casts (a precision pass's, between the steps
        of a repeat: casting commutes with repeating)."""
        p = self._prod(t)
        while _is(p, "Cast"):
            p = self._prod(p.inputs[0])
        return p

    @staticmethod
    def _cast_to(x: Tensor, dtype: str, name: str, new_ops: list) -> Tensor:
        """``x``, cast to ``dtype`` by a new op (appended to ``new_ops``) if it is not of it."""
        if x.dtype == dtype:
            return x
        from ..ops.elementwise import CastOp

        new_ops.append(CastOp([x], name=f"{name}.{dtype}", to=dtype))
        return new_ops[-1].outputs[0]

    def _output_chain(self, t: Tensor, shape3: tuple):
        """``(casts, reshape)`` when ``t`` is read by ``Transpose(0, 2, 1, 3)`` alone, then by
        element-wise casts (and roundings to a half type's values, ``RoundHalf``: the precision
        pass's before the output projection on the cpu target), then by a ``Reshape`` to
        ``shape3`` ``[B, S, H*Dv]`` or to its rows ``[B*S, H*Dv]`` (torch's dynamo exporter, before
        a 2-D ``Gemm``), each the only reader."""
        tr = self._only(t)
        if not _is(tr, "Transpose", perm=(0, 2, 1, 3)):
            return None
        casts = []
        cur = self._only(tr.outputs[0])
        while _is(cur, "Cast") or _is(cur, "RoundHalf"):
            casts.append(cur)
            cur = self._only(cur.outputs[0])
        b_, s_len, width = shape3
        if not _is(cur, "Reshape") or tuple(cur.outputs[0].shape) not in (tuple(shape3), (b_ * s_len, width)):
            return None
        return casts, cur


class HalfAttentionInFloat32(GraphPass):
    """An ``Attention`` that is float16/bfloat16 in the model computes in float32 and rounds its
    output once (the cuda driver, on each rank's graph, at every precision).

    ONNX defines a half ``Attention`` in its own type: the scaled Q and K, the scores, the softmax
    and the weighted sum are each rounded to float16 (``softmax_precision`` may widen the softmax
    alone). GPU attention kernels (FlashAttention, cuDNN, onnxruntime's CUDA kernels) accumulate
    in float32 instead, and so does ours (:mod:`~shardflow.compiler.codegen.cuda_attention`), which
    reads half Q, K, V and computes the mixed-precision form of the op. This pass writes the op in
    that form, ``Cast(Attention(Q, K, V, mask, acc_dtype="float32", probs_dtype=half), half)``,
    which the cuda target compiles into one fused kernel writing the half output: its values are
    closer to the exact result than the half definition's, and differ from them by the half
    type's roundings (the tolerance of rfcs/0004: ``5e-3`` of the output's scale for float16,
    ``2e-2`` for bfloat16; a test against onnxruntime's float16 kernel). A half additive mask is
    read in float32 (a constant one converted here, exactly; another through a ``Cast``).

    Left as they are: ops with ``qk_matmul_output`` (``qk_mode``), a softmax in float64, or Q, K, V
    of different types."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.elementwise import CastOp
        from .precision import mixed_attention_attrs

        changed = 0
        nodes: list[Operator] = []
        for op in graph.nodes:
            a = op.attrs
            half = op.inputs[0].dtype if op.op_type == "Attention" else None
            if (half not in _HALF or any(t.dtype != half for t in op.inputs[:3]) or len(op.outputs) != 1
                    or op.outputs[0].dtype != half or a.get("acc_dtype") or a.get("qk_mode") is not None
                    or a.get("extra_biases") or a.get("softmax_dtype") not in (None, "float32")):
                nodes.append(op)
                continue
            inputs = list(op.inputs)
            if a.get("has_mask") and inputs[3].dtype in _HALF:
                m = inputs[3]
                if m.is_constant:
                    inputs[3] = const_tensor(np.asarray(m.value).astype(np.float32), f"{m.name}.float32")
                else:
                    nodes.append(CastOp([m], name=f"{op.name}.mask.float32", to="float32"))
                    inputs[3] = nodes[-1].outputs[0]
            attrs = {**mixed_attention_attrs(a, half), "softmax_dtype": None}  # (a float32 softmax: the same)
            mixed = type(op)(inputs, name=f"{op.name}.float32", **attrs)
            out = op.outputs[0]
            if mixed.outputs[0].shape != out.shape:
                raise ShardflowError(f"node {op.name}: its float32 form has the output shape "
                                     f"{mixed.outputs[0].shape}, not {out.shape}; this is a bug")
            cast = CastOp([mixed.outputs[0]], name=op.name, to=half)
            out.producer, cast.outputs = cast, [out]  # the graph's readers and outputs keep the tensor
            nodes += [mixed, cast]
            changed += 1
        if changed:
            log.info("attention: %d half-precision Attention ops computed in float32", changed)
            graph.nodes = nodes
        return graph
