"""Attention on queries grouped by key/value head, rewritten on the query heads (for :mod:`.heads`).

torch's export of a decoding step with grouped key/value heads (``Hkv`` of them, each read by
``G = H / Hkv`` query heads; transformers' ``StaticCache`` under the TorchScript exporter, one
new token) does not repeat the keys and values for the queries: it views the queries
``[.., H, S, d]`` as ``[.., Hkv, G * S, d]`` (each key/value head's ``G`` query heads as rows of
one matrix), computes the attention per key/value head, and views the result back as
``[.., H, S, dv]``. Every op between the two views holds ``Hkv`` heads, so the Megatron
baseline's replication of key/value heads fewer than the ranks (:class:`.heads.PadHeads`: each
rank the one its queries read) found no ``repeat_kv`` to end at: it padded the key/value heads
and kept the query projection whole.

:func:`ungroup_queries` writes such an attention on the query heads, as transformers' eager
attention does: the queries stay ``[.., H, S, d]``, each product's other operand
``[.., Hkv, a, b]`` (the keys, the values) is repeated to ``[.., H, a, b]`` by a ``repeat_kv``
(``[.., Hkv, 1, a, b]`` expanded to ``[.., Hkv, G, a, b]``, reshaped; query head ``h`` reads
key/value head ``h // G``, as the grouped rows did), every op between is rebuilt on ``[.., H, S,
..]`` and the view back is dropped. The values are the same: row ``g * S + s`` of group ``k`` is
query head ``k * G + g``'s row ``s`` (the views are row-major). Matched between the views:
element-wise ops whose other operands broadcast over the heads and rows (the mask ``[B, 1, 1,
L]``, the scale), a softmax over the last axis, and products whose first operand is grouped.
Anything else between them, or a grouped tensor read past the view back, leaves the attention
as it is. Only done where the ranks do not divide the key/value heads (on a single device, or
where they divide, the grouped form reads each key/value head once and stays).
"""
from __future__ import annotations

import logging

from ..ir.graph import FlowGraph, Operator, Tensor
from .base import splice
from .heads import _ELEMENTWISE as _HEADS_ELEMENTWISE

__all__ = ["ungroup_queries"]

log = logging.getLogger(__name__)

_ELEMENTWISE = _HEADS_ELEMENTWISE | {"Where"}


def ungroup_queries(graph: FlowGraph, ranks: int) -> int:
    """Rewrite in ``graph`` each attention on grouped queries (see the module's docstring) whose
    key/value heads ``ranks`` does not divide; the number rewritten."""
    consumers = graph.consumers()
    after: dict[int, list[Operator]] = {}
    replace: dict[int, Tensor] = {}
    done = 0
    for op in graph.nodes:
        found = _grouped_view(op)
        if found is None or found[0] % ranks == 0:
            continue
        hkv, g = found
        region = _region(op, consumers)
        if region is None:
            continue
        inside, end = region
        new_ops, last = _rebuild(op, [n for n in graph.nodes if id(n) in inside], end, g)
        if last is None:
            continue
        if last.shape != end.outputs[0].shape:  # (the same elements in the same order: a view)
            from ..ops.transform import Reshape

            new_ops.append(Reshape([last], name=end.name, shape=end.outputs[0].shape))
            last = new_ops[-1].outputs[0]
        last.name = end.outputs[0].name
        after[id(end)] = new_ops
        replace[id(end.outputs[0])] = last
        done += 1
        log.info("heads: attention on %d query heads grouped by %d key/value heads (%s) written on the "
                 "query heads, its keys and values repeated", hkv * g, hkv, op.name)
    splice(graph, after, replace)
    return done


def _grouped_view(op: Operator) -> tuple[int, int] | None:
    """``(Hkv, G)`` when ``op`` is a reshape of queries ``[.., H, S, d]`` into ``[.., Hkv, G * S,
    d]`` (``H = Hkv * G``, ``G > 1``); else None."""
    if op.op_type != "Reshape" or op.inputs[0].ndim < 3 or op.outputs[0].ndim != op.inputs[0].ndim:
        return None
    (*p, h, s, d), (*p2, hkv, rows, d2) = op.inputs[0].shape, op.outputs[0].shape
    if p != p2 or d != d2 or hkv < 1 or h <= hkv or h % hkv or rows != (h // hkv) * s:
        return None
    return int(hkv), int(h // hkv)


def _region(view: Operator, consumers) -> tuple[set[int], Operator] | None:
    """The ops (ids) between ``view`` (:func:`_grouped_view`) and the reshape that reads the
    grouped result (the view back to ``[.., H, S, dv]``, or to ``[.., Hkv, G, S, dv]``), and that
    reshape; None when an op between is not one this rewrite takes, a grouped tensor is a graph
    output or read by a second reshape, or no product is among them."""
    *p, hkv, rows, _ = view.outputs[0].shape
    inside: dict[int, Operator] = {}
    end = None
    todo = [view.outputs[0]]
    grouped = {id(view.outputs[0])}
    while todo:
        readers = consumers.get(id(todo.pop()), [])
        if not readers:
            return None  # (a graph output)
        for r in readers:
            if r.op_type == "Reshape":  # (the view back: to [.., H, S, dv], or [.., Hkv, G, S, dv])
                if end is not None and end is not r:
                    return None
                end = r
                continue
            y = r.outputs[0]
            if len(r.outputs) != 1 or y.shape[:-1] != (*p, hkv, rows):
                return None
            inside[id(r)] = r
            if id(y) not in grouped:
                grouped.add(id(y))
                todo.append(y)
    # (checked once all are known: an op may read two grouped tensors, found in either order)
    if end is None or not all(_takes(r, grouped, hkv) for r in inside.values()) \
            or not any(r.op_type == "MatMul" for r in inside.values()):
        return None
    return set(inside), end


def _takes(op: Operator, grouped: set[int], hkv: int) -> bool:
    """Whether ``op`` (reading grouped tensors, ids ``grouped``) can be rebuilt on query heads: an
    element-wise op whose other operands broadcast over the heads and rows; a softmax over the
    last axis; a product whose first operand is grouped and whose second is a ``[.., Hkv, a, b]``
    tensor that is not."""
    nd = op.outputs[0].ndim
    if op.op_type in _ELEMENTWISE:
        return all(id(t) in grouped or t.ndim < 2 or t.ndim <= nd and t.shape[-2] == 1
                   and (t.ndim < 3 or t.shape[-3] == 1) for t in op.inputs)
    if op.op_type == "Softmax":
        return tuple(op.attrs.get("axes", ())) == (nd - 1,)
    if op.op_type == "MatMul" and len(op.inputs) == 2:
        a, b = op.inputs
        return id(a) in grouped and id(b) not in grouped and b.ndim == nd and b.shape[-3] == hkv
    return False


def _rebuild(view: Operator, ops: list[Operator], end: Operator, g: int):
    """``(new ops, the last one's output)``: ``ops`` on the query heads (the queries before
    ``view``; each product's second operand repeated to ``H`` heads); ``(.., None)`` when an op
    rebuilt does not give the shape expected."""
    from ..ops.transform import Expand, Reshape

    new: dict[int, Tensor] = {id(view.outputs[0]): view.inputs[0]}
    out: list[Operator] = []
    h, s = view.inputs[0].shape[-3:-1]
    for op in ops:
        ins = [new.get(id(t), t) for t in op.inputs]
        if op.op_type == "MatMul":
            b = op.inputs[1]
            *lead, a, c = b.shape
            one = Reshape([b], name=f"{op.name}.repeat_kv_unsqueeze", shape=(*lead, 1, a, c))
            wide = Expand([one.outputs[0]], name=f"{op.name}.repeat_kv_expand", shape=(*lead, g, a, c))
            heads = Reshape([wide.outputs[0]], name=f"{op.name}.repeat_kv", shape=(*lead[:-1], h, a, c))
            out += [one, wide, heads]
            ins[1] = heads.outputs[0]
        rebuilt = type(op)(ins, name=op.name, **op.attrs)
        want = (*op.outputs[0].shape[:-3], h, s, op.outputs[0].shape[-1])
        if rebuilt.outputs[0].shape != want or rebuilt.outputs[0].dtype != op.outputs[0].dtype:
            log.warning("heads: %s on query heads gives %s, not %s; the grouped attention is left as it is "
                        "(please report this)", op.name, rebuilt.outputs[0].shape, want)
            return [], None
        rebuilt.outputs[0].name = op.outputs[0].name
        new[id(op.outputs[0])] = rebuilt.outputs[0]
        out.append(rebuilt)
    return out, new[id(end.inputs[0])]
