"""Graph passes and the pass pipeline."""
from .base import DumpGraph, GraphPass, Instrument, PassPipeline
from .simplify import (EliminateCommonSubexpressions, EliminateDeadCode, FoldConstants, FoldPadIntoConv,
                       RemoveNoOps, default_passes)

__all__ = ["GraphPass", "PassPipeline", "DumpGraph", "Instrument", "FoldConstants", "RemoveNoOps",
           "EliminateCommonSubexpressions", "FoldPadIntoConv", "EliminateDeadCode", "default_passes", "simplify"]


def simplify(graph, instruments=()):
    """Run the default simplification pipeline on ``graph`` (in place) and return it."""
    graph = PassPipeline(default_passes(), instruments=instruments).run(graph)
    graph.validate()
    return graph
