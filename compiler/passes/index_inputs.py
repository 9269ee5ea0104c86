"""Graph inputs read as indices, and the values each may take.

An index outside its axis is an error in the evaluator (a ``ShapeError`` naming the op) and in
onnxruntime, but the compiled kernels clamp it into the tensor, silently (rfcs/0002, "Lowering"). The
commonest case is a graph input read as an index: token ids past an embedding table's rows, positions
past a position table. :func:`input_index_ranges` finds, for each integer graph input, the ops that
read its values as indices (:meth:`~shardflow.compiler.ir.graph.Operator.index_ranges`: Gather,
GatherElements, ScatterElements, ReverseSequence's lengths), followed through the ops that keep
values (reshapes, expands, transposes, slices, identities, widening integer casts); ``compile``
writes them into each rank's manifest (``index_checks`` of its ``inputs`` entry) and the runtime checks
the input against them before every run. An index computed inside the graph (an offset added to
positions) is not checked.
"""
from __future__ import annotations

import numpy as np

from ..ir.expr import numpy_type
from ..ir.graph import FlowGraph
from ..ops.elementwise import CastOp, Identity
from ..ops.transform import Expand, Reshape, Slice, Transpose

#: ops whose output holds values of their first input only
_KEEP_VALUES = (Reshape, Expand, Transpose, Slice, Identity)


def _keeps_values(op, x_dtype: str) -> bool:
    if isinstance(op, _KEEP_VALUES):
        return True
    if isinstance(op, CastOp):  # a widening integer cast (int32 ids read as int64)
        src, to = numpy_type(x_dtype), numpy_type(op.attrs["to"])
        return src.kind in "iu" and to.kind in "iu" and np.can_cast(src, to, "safe")
    return False


def input_index_ranges(graph: FlowGraph) -> dict[str, list[tuple[int, int, str]]]:
    """``{input name: [(lo, hi, op name), ...]}``: the inclusive ranges of values the ops reading the
    integer graph input's values as indices take, one per such op (see the module's docstring)."""
    readers = graph.consumers()
    res: dict[str, list[tuple[int, int, str]]] = {}
    for t in graph.inputs:
        if numpy_type(t.dtype).kind not in "iu":
            continue
        stack, seen = [t], set()
        while stack:
            cur = stack.pop()
            if id(cur) in seen:
                continue
            seen.add(id(cur))
            for op in readers.get(id(cur), ()):
                ranges = op.index_ranges()
                for pos, x in enumerate(op.inputs):
                    if x is not cur:
                        continue
                    if pos in ranges:
                        lo, hi = ranges[pos]
                        res.setdefault(t.name, []).append((int(lo), int(hi), op.name))
                    elif pos == 0 and _keeps_values(op, cur.dtype):
                        stack.extend(op.outputs)
    return res
