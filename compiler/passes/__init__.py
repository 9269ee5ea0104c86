"""Graph passes and the pass pipeline."""
from .base import DumpGraph, GraphPass, Instrument, PassPipeline
from .simplify import (EliminateCommonSubexpressions, EliminateDeadCode, FoldConstants, RemoveNoOps,
                       default_passes)

__all__ = ["GraphPass", "PassPipeline", "DumpGraph", "Instrument", "FoldConstants", "RemoveNoOps",
           "EliminateCommonSubexpressions", "EliminateDeadCode", "default_passes", "simplify"]


def simplify(graph, instruments=()):
    """Run the default simplification pipeline on ``graph`` (in place) and return it."""
    graph = PassPipeline(default_passes(), instruments=instruments).run(graph)
    graph.validate()
    return graph
