"""A small pass framework: a pass maps a FlowGraph to a FlowGraph; a pipeline runs passes in order.

Instruments are callables ``(pass_name, graph)`` invoked after every pass, e.g. to dump the graph::

    PassPipeline(default_passes(), instruments=[DumpGraph("dumps/")]).run(graph)
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Iterable, Sequence

from ..ir.graph import FlowGraph, Operator, Tensor

__all__ = ["GraphPass", "PassPipeline", "DumpGraph", "Instrument", "per_channel", "splice", "take_over"]

log = logging.getLogger(__name__)

Instrument = Callable[[str, FlowGraph], None]


class GraphPass:
    """Base class: override :meth:`run`. Passes may rewrite the graph in place and return it."""

    name: str = ""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if not cls.__dict__.get("name"):
            cls.name = cls.__name__

    def run(self, graph: FlowGraph) -> FlowGraph:
        raise NotImplementedError

    def __call__(self, graph: FlowGraph) -> FlowGraph:
        return self.run(graph)


def per_channel(t: Tensor, y: Tensor) -> bool:
    """Whether ``t`` is a constant that an element-wise op broadcasts against ``y [N, C, ...]`` as one value per
    channel (or one value): no more dims than ``y``, none but the channel dim above 1."""
    if not t.is_constant or t.ndim > y.ndim:
        return False
    full = (1,) * (y.ndim - t.ndim) + tuple(t.shape)
    return all(d == 1 for k, d in enumerate(full) if k != 1) and full[1] in (1, y.shape[1])


def splice(graph: FlowGraph, after: dict[int, list[Operator]], replace: dict[int, Tensor]) -> FlowGraph:
    """``graph`` with the new ops ``after[id(op)]`` placed right after ``op``, every later read
    (and graph output) of a tensor in ``replace`` (by id) redirected to its replacement (a new op's
    read too, where the replacement is made before it), and the ops left without readers removed:
    how a rewriting pass puts its result in."""
    from .simplify import EliminateDeadCode

    if not after and not replace:
        return graph
    nodes: list[Operator] = []
    placed: set[int] = set()
    for op in graph.nodes:
        op.inputs = [replace.get(id(t), t) for t in op.inputs]
        nodes.append(op)
        placed.add(id(op))
        for new in after.get(id(op), []):
            # a new op reads the replacement of a tensor where that is already made (two fills
            # rewritten in a chain: the later one's new op reads the earlier one's result), not
            # where the replacement is its own output or a later new op's (a cast of ``t`` placed
            # after ``t``'s producer and replacing ``t`` still reads ``t``)
            new.inputs = [r if (r := replace.get(id(t))) is not None
                          and (r.producer is None or id(r.producer) in placed) else t for t in new.inputs]
            nodes.append(new)
            placed.add(id(new))
    graph.nodes = nodes
    graph.outputs = [replace.get(id(t), t) for t in graph.outputs]
    return EliminateDeadCode().run(graph)


def splice_rewrites(graph: FlowGraph, rewrites: dict[int, list[Operator]], what: str) -> FlowGraph:
    """``graph`` with each op ``rewrites`` names (by id; one output) replaced by the ops it maps to, placed
    right after it, whose last one computes the same tensor (shape and type): every read of the old
    output reads the new one (:func:`splice`), and a graph output keeps its tensor and name, the last
    new op taking it over (:func:`take_over`; ``what``: the rewrite, for its error)."""
    outputs = {id(t) for t in graph.outputs}
    replace: dict[int, Tensor] = {}
    taken: set[int] = set()
    ops = {id(op): op for op in graph.nodes}
    for key, new in rewrites.items():
        old = ops[key]
        if id(old.outputs[0]) in outputs:
            take_over(old, new[-1], what)
            taken.add(key)
        else:
            replace[id(old.outputs[0])] = new[-1].outputs[0]
    graph = splice(graph, rewrites, replace)
    graph.nodes = [op for op in graph.nodes if id(op) not in taken]
    return graph


def take_over(old: Operator, new: Operator, what: str) -> Operator:
    """``new`` (an op rebuilt from ``old``, ``what`` it is) made the producer of ``old``'s output
    tensors, so that their readers are unchanged; the outputs' shapes and types must agree."""
    from ..errors import ShardflowError

    if [(t.shape, t.dtype) for t in new.outputs] != [(t.shape, t.dtype) for t in old.outputs]:
        raise ShardflowError(f"node {old.name}: the {what} changes the outputs {[t.shape for t in old.outputs]}; "
                             "this is a bug")
    for t in old.outputs:
        t.producer = new
    new.outputs = list(old.outputs)
    return new


class PassPipeline:
    """Run ``passes`` in order; repeat the whole sequence until the node count stops changing
    (at most ``max_rounds`` times) when ``fixpoint`` is set."""

    def __init__(self, passes: Sequence[GraphPass | Callable[[FlowGraph], FlowGraph]],
                 instruments: Iterable[Instrument] = (), fixpoint: bool = True, max_rounds: int = 4):
        self.passes = list(passes)
        self.instruments = list(instruments)
        self.fixpoint = fixpoint
        self.max_rounds = max_rounds

    def run(self, graph: FlowGraph) -> FlowGraph:
        for rnd in range(self.max_rounds if self.fixpoint else 1):
            before = len(graph.nodes)
            for p in self.passes:
                name = getattr(p, "name", None) or getattr(p, "__name__", type(p).__name__)
                t0 = time.perf_counter()
                graph = p(graph)
                log.debug("pass %s: %d nodes (%.1f ms)", name, len(graph.nodes), 1e3 * (time.perf_counter() - t0))
                for inst in self.instruments:
                    inst(f"{rnd}-{name}", graph)
            if len(graph.nodes) == before and rnd > 0:
                break
        return graph


class DumpGraph:
    """Instrument writing the graph's text form to ``directory/NN-<pass>.txt`` after each pass."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        self.count = 0

    def __call__(self, pass_name: str, graph: FlowGraph) -> None:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"{self.count:02d}-{pass_name}.txt")
        with open(path, "w") as f:
            f.write(str(graph) + "\n")
        self.count += 1
