"""Index values checked at run time: the graph inputs read as indices, and the indices computed inside
the graph that cannot be proven to lie in their axes.

An index outside its axis is an error in the evaluator (a ``ShapeError`` naming the op) and in
onnxruntime, but the compiled kernels clamp it into the tensor, silently (rfcs/0002, "Lowering"): a
plausible wrong answer. Two checks close that gap, both on the whole (planned, not yet partitioned)
graph:

* **Inputs.** :func:`input_index_ranges` finds, for each integer graph input, the ops that read its
  values as indices (:meth:`~shardflow.compiler.ir.graph.Operator.index_ranges`: Gather,
  GatherElements, GatherND, the scatters, ReverseSequence's lengths), followed through the ops that
  keep values (reshapes, expands, transposes, slices, identities, widening integer casts); ``compile``
  writes them into each rank's manifest (``index_checks`` of its ``inputs`` entry) and the runtime
  checks the input against them before every run (a minimum and a maximum, on the host or device).
* **Computed indices.** :func:`value_ranges` bounds every integer tensor by interval arithmetic
  (constants exactly; inputs by the checks above; ArgMax/TopK indices by their axis; sums, products,
  clips, selects, concatenations...; a :class:`ValuesInRange` by its range, which its own check
  enforces; anything else by its type's range). Where an op's index input is
  not proven inside its range, :func:`add_index_checks` adds an :class:`IndexCheck` op (how many of
  its values lie outside: an int64 scalar) as an extra graph output named ``__index_check_<k>``; the
  plan treats it as any other output (whole on every rank: a split index tensor gathered, or its
  ranks' counts summed), ``compile`` lists
  them in each manifest's ``index_checks``, and the runtime raises ``IndexRangeError`` naming the ops
  after a run in which one is not zero (the outputs of that run are not returned). A positions tensor
  computed from an attention mask (a rotary embedding's cos/sin rows past the cache) is the common
  case; ArgMax/TopK outputs, clipped values and constants need no check.
"""
from __future__ import annotations

import math

import numpy as np

from ..ir.expr import numpy_type
from ..ir.graph import FlowGraph, Tensor
from ..ops.elementwise import Binary, CastOp, Clip, Identity, Where
from ..ops.reduce import ArgReduce, CumSum, Reduce, TopK
from ..ops.transform import (Concat, Expand, Gather, GatherElements, GatherND, IndexCheck, Range, Reshape, Slice,
                             Tile, Transpose, ValuesInRange)

__all__ = ["input_index_ranges", "value_ranges", "add_index_checks", "index_check_outputs", "CHECK_PREFIX"]

#: the names of the check outputs :func:`add_index_checks` adds: ``__index_check_0``, ...
CHECK_PREFIX = "__index_check_"

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
    integer graph input's values as indices take, one per such op (see the module's docstring). A
    GatherND's or ScatterND's indices whose columns address axes of different extents are left to
    :func:`add_index_checks` (one range per column)."""
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
                        if not isinstance(lo, tuple):
                            res.setdefault(t.name, []).append((int(lo), int(hi), op.name))
                    elif pos == 0 and _keeps_values(op, cur.dtype):
                        stack.extend(op.outputs)
    return res


Range_ = tuple[int, int]

#: integer constants of up to this many values are bounded by their values (larger ones, packed low-bit
#: weights, by their type: the compile does not read them through for this)
_SCANNED = 1 << 20


def _type_range(dtype: str) -> Range_ | None:
    dt = numpy_type(dtype)
    if dt.kind == "b":
        return 0, 1
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return int(info.min), int(info.max)
    return None


def _fit(r: Range_ | None, dtype: str) -> Range_ | None:
    """``r`` where the integer type ``dtype`` holds it, else the type's range (the values wrapped)."""
    whole = _type_range(dtype)
    if r is None or whole is None or r[0] < whole[0] or r[1] > whole[1]:
        return whole
    return r


def _binary(fn: str, a: Range_, b: Range_) -> Range_ | None:
    if fn == "add":
        return a[0] + b[0], a[1] + b[1]
    if fn == "sub":
        return a[0] - b[1], a[1] - b[0]
    if fn == "max":
        return max(a[0], b[0]), max(a[1], b[1])
    if fn == "min":
        return min(a[0], b[0]), min(a[1], b[1])
    if fn == "mul":
        ends = [x * y for x in a for y in b]
        return min(ends), max(ends)
    return None


def _union(rs) -> Range_ | None:
    rs = list(rs)
    if not rs or any(r is None for r in rs):
        return None
    return min(r[0] for r in rs), max(r[1] for r in rs)


def _op_range(op, k: int, ins: list[Range_ | None]) -> Range_ | None:
    """The range of ``op``'s output ``k`` from its inputs' (``None``: unknown)."""
    x = ins[0] if ins else None
    if isinstance(op, ValuesInRange):  # (a run whose check fails returns nothing)
        lo, hi = op.index_ranges()[0]
        return (lo, hi) if x is None else (max(x[0], lo), min(x[1], hi))
    if isinstance(op, TopK):
        return (0, op.inputs[0].shape[op.attrs["axis"]] - 1) if k == 1 else x
    if isinstance(op, ArgReduce):
        return 0, op.inputs[0].shape[op.attrs["axis"]] - 1
    if isinstance(op, Range):
        if numpy_type(op.attrs["dtype"]).kind not in "iu" or not op.attrs["size"]:
            return None
        ends = (int(op.attrs["start"]), int(op.attrs["start"]) + (op.attrs["size"] - 1) * int(op.attrs["delta"]))
        return min(ends), max(ends)
    if isinstance(op, _KEEP_VALUES + (Tile, CastOp, Gather, GatherElements, GatherND)):
        return x  # (values of the first input; a cast's fitted to its type by the caller)
    if isinstance(op, Clip) and x is not None:
        lo, hi = op.attrs.get("lo"), op.attrs.get("hi")
        a, b = x
        if lo is not None:
            a, b = max(a, math.ceil(lo)), max(b, math.ceil(lo))
        if hi is not None:
            a, b = min(a, math.floor(hi)), min(b, math.floor(hi))
        return a, b
    if isinstance(op, Binary) and x is not None and ins[1] is not None:
        return _binary(op.attrs["fn"], x, ins[1])
    if isinstance(op, Where):
        return _union(ins[1:])
    if isinstance(op, Concat):
        return _union(ins)
    if isinstance(op, Reduce) and x is not None:
        n = math.prod(op.inputs[0].shape[a] for a in op.attrs["axes"])
        if op.attrs["kind"] in ("max", "min") and n:
            return x
        if op.attrs["kind"] == "sum":
            return min(n * x[0], 0), max(n * x[1], 0)
    if isinstance(op, CumSum) and x is not None:
        n = op.inputs[0].shape[op.attrs["axis"]]
        return min(n * x[0], x[0], 0), max(n * x[1], x[1], 0)
    return None


def value_ranges(graph: FlowGraph, inputs: dict[str, list[tuple[int, int, str]]] | None = None
                 ) -> dict[int, Range_]:
    """``{id(tensor): (lo, hi)}``: inclusive bounds of the values of every integer (or bool) tensor of
    ``graph`` (constants, graph inputs and op outputs). ``inputs``: :func:`input_index_ranges`'s
    result, the ranges the runtime holds each input to (its values lie in all of them)."""
    res: dict[int, Range_] = {}

    def rng(t: Tensor) -> Range_ | None:
        if id(t) in res:
            return res[id(t)]
        if t.is_constant and _type_range(t.dtype) is not None and math.prod(t.shape) <= _SCANNED:
            v = np.asarray(t.value)
            res[id(t)] = (int(v.min()), int(v.max())) if v.size else (0, 0)
            return res[id(t)]
        return _type_range(t.dtype)

    for t in graph.inputs:
        r = _type_range(t.dtype)
        if r is not None:
            for lo, hi, _ in (inputs or {}).get(t.name, ()):
                r = max(r[0], lo), min(r[1], hi)
            res[id(t)] = r
    for op in graph.nodes:
        ins = [rng(t) for t in op.inputs]
        for k, t in enumerate(op.outputs):
            if _type_range(t.dtype) is not None:
                res[id(t)] = _fit(_op_range(op, k, ins), t.dtype)
    return res


def add_index_checks(graph: FlowGraph) -> list[dict]:
    """Add an :class:`IndexCheck` output for every index tensor of ``graph`` not proven to lie in the
    range its readers take (see the module's docstring): one per tensor and range (the cos and sin
    rows of a rotary embedding read by one positions tensor: one check), per column for a GatherND's
    or ScatterND's indices of unequal axes. Rewrites ``graph``; returns :func:`index_check_outputs`."""
    ranges = value_ranges(graph, input_index_ranges(graph))
    checks: dict[tuple, list] = {}  # (id(tensor), lo, hi, column) -> [tensor, reader names]
    for op in list(graph.nodes):
        for pos, (lo, hi) in op.index_ranges().items():
            t = op.inputs[pos]
            have = ranges.get(id(t))
            cols = list(enumerate(zip(lo, hi))) if isinstance(lo, tuple) else [(None, (lo, hi))]
            for col, (a, b) in cols:
                if have is not None and a <= have[0] and have[1] <= b:
                    continue
                checks.setdefault((id(t), int(a), int(b), col), [t, []])[1].append(op.name)
    k = 0
    for (_, lo, hi, col), (t, nodes) in checks.items():
        while f"{CHECK_PREFIX}{k}" in graph.output_names:
            k += 1
        check = IndexCheck([t], name=f"{nodes[0]}/index_check" + ("" if col is None else f"{col}"), lo=lo, hi=hi,
                           nodes=tuple(nodes), **({} if col is None else {"column": col}))
        graph.nodes.append(check)
        graph.outputs.append(check.outputs[0])
        graph.output_names.append(f"{CHECK_PREFIX}{k}")
    return index_check_outputs(graph)


def index_check_outputs(graph: FlowGraph) -> list[dict]:
    """The check outputs of ``graph`` (:func:`add_index_checks`): ``[{"output", "nodes", "lo", "hi",
    "column"}]``, what a rank's manifest lists as its ``index_checks``."""
    res = []
    for name, t in zip(graph.output_names, graph.outputs):
        if name.startswith(CHECK_PREFIX) and isinstance(t.producer, IndexCheck):
            a = t.producer.attrs
            res.append({"output": name, "nodes": list(a["nodes"]), "lo": int(a["lo"]), "hi": int(a["hi"]),
                        "column": a.get("column")})
    return res
