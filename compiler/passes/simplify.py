"""Simplification passes: constant folding, no-op removal, common-subexpression elimination,
zero padding folded into convolutions and dead-code elimination."""
from __future__ import annotations

import hashlib
import logging

import numpy as np

from ..ir.graph import FlowGraph, Operator, Tensor, const_tensor, topological_sort
from .base import GraphPass, splice

__all__ = ["FoldConstants", "RemoveNoOps", "EliminateCommonSubexpressions", "FoldPadIntoConv",
           "EliminateDeadCode", "default_passes"]

log = logging.getLogger(__name__)

#: Folded results larger than this (elements) stay ops: materializing them would bloat weights.
FOLD_LIMIT = 1 << 22


class FoldConstants(GraphPass):
    """Replace every op whose inputs are all constants, or whose results were already known at
    import (``Shape`` of a static tensor), by constants holding its results."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        kept: list[Operator] = []
        replace: dict[int, Tensor] = {}
        for op in graph.nodes:
            op.inputs = [replace.get(id(t), t) for t in op.inputs]
            if op.data_dependent_values or sum(t.size for t in op.outputs) > FOLD_LIMIT:
                kept.append(op)
                continue
            values = [t.value for t in op.outputs]
            known = all(v is not None for v in values)  # e.g. Shape of a non-constant tensor
            if known or all(t.is_constant for t in op.inputs):
                if not known:
                    values = op.run(*[t.value for t in op.inputs])
                for t, v in zip(op.outputs, values):
                    replace[id(t)] = const_tensor(v, t.name)
                continue
            kept.append(op)
        graph.outputs = [replace.get(id(t), t) for t in graph.outputs]
        graph.nodes = kept
        return graph


class RemoveNoOps(GraphPass):
    """Bypass ops that return one of their inputs unchanged (identity, same-shape reshape, ...)."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        replace: dict[int, Tensor] = {}
        kept = []
        for op in graph.nodes:
            op.inputs = [replace.get(id(t), t) for t in op.inputs]
            k = op.passthrough_input()
            if k is not None:
                src, out = op.inputs[k], op.outputs[0]
                if src.shape == out.shape and src.dtype == out.dtype:
                    replace[id(out)] = src
                    continue
            kept.append(op)
        graph.outputs = [replace.get(id(t), t) for t in graph.outputs]
        graph.nodes = kept
        return graph


def attr_key(v):
    if isinstance(v, np.ndarray):
        return ("nd", v.dtype.str, v.shape, hashlib.sha1(np.ascontiguousarray(v).tobytes()).hexdigest())
    if isinstance(v, (list, tuple)):
        return tuple(attr_key(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, attr_key(x)) for k, x in v.items()))
    if isinstance(v, float) and v != v:
        return ("nan",)
    return v


class EliminateCommonSubexpressions(GraphPass):
    """Merge ops of the same type and attributes on the same inputs, and equal small constants."""

    const_limit = 1 << 16

    def run(self, graph: FlowGraph) -> FlowGraph:
        replace: dict[int, Tensor] = {}
        consts: dict[tuple, Tensor] = {}
        seen: dict[tuple, Operator] = {}
        kept = []

        def canon(t: Tensor) -> Tensor:
            t = replace.get(id(t), t)
            if t.is_constant and t.size <= self.const_limit:
                key = (t.dtype, t.shape, np.ascontiguousarray(t.value).tobytes())
                return consts.setdefault(key, t)
            return t

        for op in graph.nodes:
            op.inputs = [canon(t) for t in op.inputs]
            if op.data_dependent_values:
                kept.append(op)
                continue
            key = (type(op), tuple(id(t) for t in op.inputs), attr_key(op.attrs))
            prev = seen.get(key)
            if prev is not None:
                for a, b in zip(op.outputs, prev.outputs):
                    replace[id(a)] = b
                continue
            seen[key] = op
            kept.append(op)
        graph.outputs = [replace.get(id(t), t) for t in graph.outputs]
        graph.nodes = kept
        return graph


class FoldPadIntoConv(GraphPass):
    """A zero ``Pad`` of a conv's input's spatial dims (TensorFlow-style "same" padding, as
    transformers' MobileNet writes it) becomes the conv's own ``pads`` when the conv is the pad's
    only reader: the padded copy is never made (onnxruntime folds it too). Only constant-mode pads
    of 0 (the attribute, no fill input) with no cropping and none on the batch or channel dims."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.conv import Conv

        consumers = graph.consumers()
        outputs = {id(t) for t in graph.outputs}
        producer = {id(t): op for op in graph.nodes for t in op.outputs}
        after: dict[int, list[Operator]] = {}
        replace: dict[int, Tensor] = {}
        for op in graph.nodes:
            pad = producer.get(id(op.inputs[0])) if type(op) is Conv and op.inputs else None
            if pad is None or pad.op_type != "Pad" or len(pad.inputs) != 1 or id(pad.outputs[0]) in outputs \
                    or len(consumers.get(id(pad.outputs[0]), [])) != 1:
                continue
            begin, end = tuple(pad.attrs["begin"]), tuple(pad.attrs["end"])
            if pad.attrs.get("mode", "constant") != "constant" or float(pad.attrs.get("value", 0)) != 0.0 \
                    or min(begin + end) < 0 or any(begin[:2]) or any(end[:2]):
                continue
            n_sp = op.inputs[0].ndim - 2
            pads = tuple(op.attrs.get("pads") or (0,) * (2 * n_sp))
            new_pads = tuple(int(p) + int(b) for p, b in zip(pads[:n_sp], begin[2:])) + \
                tuple(int(p) + int(e) for p, e in zip(pads[n_sp:], end[2:]))
            new = Conv([pad.inputs[0]] + list(op.inputs[1:]), name=op.name, **dict(op.attrs, pads=new_pads))
            after[id(op)] = [new]
            replace[id(op.outputs[0])] = new.outputs[0]
        if after:
            log.debug("folded %d zero pads into their convs", len(after))
        return splice(graph, after, replace)


class EliminateDeadCode(GraphPass):
    """Drop ops whose results do not reach a graph output."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        live = {id(op) for op in topological_sort(graph.outputs)}
        graph.nodes = [op for op in graph.nodes if id(op) in live]
        return graph


def default_passes() -> list[GraphPass]:
    """The simplification pipeline ``load_onnx`` runs."""
    return [FoldConstants(), RemoveNoOps(), EliminateCommonSubexpressions(), FoldPadIntoConv(), EliminateDeadCode()]
