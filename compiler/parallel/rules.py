"""Sharding rules generated from compute definitions.

A *strategy* assigns each mesh axis either nothing (the op's work is replicated along it) or one
loop variable of the compute definition: an output axis (the output is split along it) or a
variable of the top-level reduction (every rank reduces a slice: the output is ``Partial``).
:func:`op_strategies` enumerates every assignment and keeps exactly those the index analysis
proves valid:

* every read of an input indexes the dim(s) tied to a sharded variable *only* through that
  variable — ``x[.., v, ..]`` (same extent), ``x[.., v*c + w, ..]`` with ``w`` ranging over
  ``[0, c)`` (a merged dim, even split), or ``x[.., v // c, ..]`` (even split into whole ``c``
  blocks); a read where the variable does not appear leaves that dim whole;
* all reads of one input agree on which dims each mesh axis splits;
* a sharded variable appears nowhere else (selects, values, ``%``...): such positions would need
  the rank's global offset, halos or data-dependent exchange, none of which a local op provides;
  except the output axes of a :attr:`~shardflow.compiler.ir.graph.Operator.positional` op (a random
  draw), which partition gives the offset of its part;
* a reduction variable may be sharded only when the output is ``c * reduce(...) + rest`` (linear),
  giving ``Partial(op)``; the terms in ``rest`` then read their inputs as ``Partial`` too.

A mesh axis may also split no loop variable but carry partial sums through the op
(:data:`PARTIAL_SUMS`): when the output is a homogeneous linear function of some float inputs
(``a + b``, ``a - b``, ``a * w``, ``a / w``, ``-a``, casts between floats, reshapes,
transposes, slices, gathers of ``a``, selects between ``a`` and zero, with ``w`` not among
them; ops with reductions are left out), running the op on each rank's partial sums of those
inputs gives partial sums of the output. Those inputs are then ``Partial(sum)`` along the axis,
the others ``Replicate``, and the output ``Partial(sum)``. This lets a plan add the partial sums
of two row-parallel products before one all-reduce (a parallel attention + MLP block), or carry
a bias or residual add (its replicated operand made partial by a local zeroing) to a later
reduce-scatter.

A mesh axis may also split an input dim that the op reads only through indices taken from data
(:data:`OFFSET_ROWS`): an embedding table split by rows, with no loop variable to tie the split
to. The op must declare it can run on a range of rows (:meth:`Operator.offset_split_dims`: it
reads zero for an index outside its rows, so each index has its value on exactly one rank and
zeros on the others); every rank then holds a partial sum of the output (Megatron-LM's
vocab-parallel embedding).

Nothing else here is written per op: the same analysis covers matmul, convolution, gathers,
reshapes and normalizations. Extern outputs (sorting) contribute their declared ``axis_map``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from ..ir.expr import (BinOp, Cast, Const, Expr, IfThenElse, Reduce, TensorElement, UnaryOp, Var, affine_form,
                       infer_dtype, rebuild, walk)
from ..ir.graph import Operator
from ..ir.task import ExternCompute, GridCompute
from .placement import Partial, Placement, Replicate, Shard, TensorShardSpec

__all__ = ["OpShardSpec", "op_strategies", "replicated_strategy", "PARTIAL_SUMS", "OFFSET_ROWS"]

_PARTIAL_OPS = {"sum": "sum", "max": "max", "min": "min", "mean": "avg"}

#: the assignment of a mesh axis along which an op runs on partial sums (see the module's docstring)
PARTIAL_SUMS = "partial sums"
#: the assignment of a mesh axis that splits an input dim read through indices from data into row
#: ranges, the output Partial(sum) along it (see the module's docstring)
OFFSET_ROWS = "offset rows"


@dataclass(frozen=True)
class OpShardSpec:
    """One way to run an op on the mesh.

    Attributes
    ----------
    input_specs, output_specs
        The spec each input must have and each output gets.
    reductions
        Per output, the ``(mesh_axis, op)`` pairs along which it is ``Partial`` (to be resolved by
        an all-reduce or a reduce-scatter downstream).
    assignment
        Per mesh axis, the name of the loop variable it splits (``None``: replicated work).
    parallelism
        How many ways the op's work is split (product of the sizes of the assigned mesh axes).
    """

    input_specs: tuple[TensorShardSpec, ...]
    output_specs: tuple[TensorShardSpec, ...]
    reductions: tuple[tuple[tuple[int, str], ...], ...]
    assignment: tuple[str | None, ...]
    parallelism: int = 1
    compute_cost: float = field(default=0.0, compare=False)

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.input_specs))
        outs = ", ".join(map(str, self.output_specs))
        return f"({ins}) -> ({outs})"


# ----------------------------------------------------------------------------------------------
# access analysis

_FULL = "full"  # a read that needs the whole dim on every rank of the mesh axis


def _direct_vars(e: Expr) -> set[Var]:
    """Variables of ``e`` outside nested tensor reads (those index *other* tensors)."""
    res: set[Var] = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, Var):
            res.add(x)
        elif not isinstance(x, TensorElement):
            stack.extend(x.children())
    return res


def _classify_index(idx: Expr, dim_extent: int, sharded: dict[Var, int],
                    blocks: bool = False) -> tuple[str, Var | None]:
    """How one index position reads its dim when the variables in ``sharded`` (var -> number of
    shards) are split: ``("shard", v)``, ``(_FULL, None)``, or ``("invalid", None)``. ``blocks``: the op
    splits by whole blocks (``Operator.splits_by_blocks``), so a read of ``v // c`` is classified by
    the block number."""
    direct = _direct_vars(idx) & sharded.keys()
    if not direct:
        return _FULL, None
    if len(direct) > 1:
        return "invalid", None
    (v,) = direct
    n = sharded[v]
    form = affine_form(idx)
    if form is not None:
        coefs, const = form
        if const != 0 or coefs.get(v) is None:
            return "invalid", None
        c = coefs[v]
        others = {w: k for w, k in coefs.items() if w is not v}
        if c == 1 and not others and dim_extent == v.extent:
            return "shard", v
        # v * c + r, r of other variables within [0, c): each of v's blocks reads its block of
        # the dim ([H, d] viewed as H * d; BLOOM's head-major [H, 3, d] too)
        if c > 1 and others and dim_extent == v.extent * c and v.extent % n == 0 \
                and all(k > 0 and w not in sharded for w, k in others.items()) \
                and sum(k * (w.extent - 1) for w, k in others.items()) < c:
            return "shard", v
        return "invalid", None
    over = _over_blocks(idx, v) if blocks else None
    if over is not None and v.extent % (n * over[2]) == 0:
        # v read only as v // c, each shard of v whole blocks of c: the index's form in the block number (a
        # grouped conv's input channel (oc // ocg) * icg + ic: each shard of the outputs reads its groups')
        rest = {w: k for w, k in sharded.items() if w is not v}
        if _classify_index(over[0], dim_extent, {**rest, over[1]: n})[0] == "shard":
            return "shard", v
    if isinstance(idx, BinOp) and idx.a is v and isinstance(idx.b, Const) and isinstance(idx.b.value, int):
        c = idx.b.value
        if c > 0 and v.extent % (n * c) == 0:
            if idx.op == "floordiv" and dim_extent == v.extent // c:
                return "shard", v
            if idx.op == "mod" and dim_extent == c:
                return _FULL, None
    if _only_residues(idx, v, n):
        return _FULL, None
    return "invalid", None


def _over_blocks(idx: Expr, v: Var) -> tuple[Expr, Var, int] | None:
    """``(idx', q, c)``: ``idx`` with each ``v // c`` outside nested reads (one constant ``c`` > 1 dividing
    ``v``'s extent) replaced by a variable ``q`` of extent ``v.extent // c``, when ``v`` is read in no other
    way there; else None."""
    def block(e: Expr) -> bool:
        return isinstance(e, BinOp) and e.op == "floordiv" and e.a is v and isinstance(e.b, Const) \
            and isinstance(e.b.value, (int, np.integer))

    cs = {int(e.b.value) for e in walk(idx) if block(e)}
    if len(cs) != 1:
        return None
    c = cs.pop()
    if c <= 1 or v.extent % c:
        return None
    q = Var(f"{v.name}_block", v.extent // c)

    def go(e: Expr) -> Expr:
        if block(e) and int(e.b.value) == c:
            return q
        kids = e.children()
        return e if isinstance(e, TensorElement) or not kids else rebuild(e, [go(k) for k in kids])
    out = go(idx)
    return None if v in _direct_vars(out) else (out, q, c)


def _only_residues(idx: Expr, v: Var, n: int) -> bool:
    """``v`` appears in ``idx`` only as ``v % c`` or ``(v // b) % c`` with every shard of ``v`` (``n``
    of them) a multiple of ``c`` (``b * c``) long: each shard reads the positions the whole extent
    reads (a byte within a block of packed 4-bit values, ``(k % block) // 2``; a dim in the middle
    of several merged, ``[Hkv, G, d]`` viewed as ``Hkv * G * d`` and read at ``(o // d) % G``)."""
    def positive(e: Expr) -> bool:
        return isinstance(e, Const) and isinstance(e.value, int) and e.value > 0

    def go(e: Expr) -> bool:
        if e is v:
            return False
        if isinstance(e, BinOp) and e.op == "mod" and positive(e.b):
            if e.a is v:
                return v.extent % (n * e.b.value) == 0
            if isinstance(e.a, BinOp) and e.a.op == "floordiv" and e.a.a is v and positive(e.a.b):
                return v.extent % (n * e.a.b.value * e.b.value) == 0
        if isinstance(e, TensorElement):
            return True
        return all(go(c) for c in e.children())
    return go(idx)


def _reads(e: Expr) -> list[TensorElement]:
    return [n for n in walk(e) if isinstance(n, TensorElement)]


def _linear_read(term: Expr) -> bool:
    """``term`` is one tensor read scaled by constants (linear in that input)."""
    if isinstance(term, TensorElement):
        return True
    if isinstance(term, Cast):
        return _linear_read(term.a)
    if isinstance(term, BinOp) and term.op == "mul":
        return ((isinstance(term.a, Const) and _linear_read(term.b))
                or (isinstance(term.b, Const) and _linear_read(term.a)))
    if isinstance(term, UnaryOp) and term.op == "neg":
        return _linear_read(term.a)
    return False


def _linear_reduce(value: Expr) -> tuple[Reduce, list[Expr], bool] | None:
    """If ``value`` is ``c * reduce(...) + sum(c_i * read_i)``: the reduce, the ``read`` terms,
    and whether the value is the bare reduction (no scaling, no terms)."""
    if isinstance(value, Reduce):
        return value, [], True
    if isinstance(value, Cast):
        return _linear_reduce(value.a)
    if isinstance(value, BinOp):
        if value.op == "mul":
            for r, k in ((value.a, value.b), (value.b, value.a)):
                if isinstance(k, Const):
                    found = _linear_reduce(r)
                    if found and not found[1]:
                        return found[0], [], False
            return None
        if value.op in ("add", "sub"):
            for r, other in ((value.a, value.b), (value.b, value.a)):
                found = _linear_reduce(r)
                if found is not None and _linear_read(other):
                    return found[0], found[1] + [other], False
    return None


_ZERO, _INDEPENDENT, _LINEAR = "zero", "independent", "linear"


def _degree(value: Expr, linear_in: set[int]) -> str | None:
    """How ``value`` depends on the reads of the task inputs whose ids are in ``linear_in``:
    ``_ZERO`` (the constant 0), ``_INDEPENDENT`` (it does not read them), ``_LINEAR`` (a
    homogeneous linear function of them, with coefficients that do not read them), or ``None``."""
    memo: dict[int, str | None] = {}

    def join_sum(a, b):  # a + b, and the branches of a select
        if a is None or b is None:
            return None
        if a == _ZERO:
            return b
        if b == _ZERO or a == b:
            return a
        return None  # linear + independent: affine

    def go(e: Expr) -> str | None:
        k = id(e)
        if k not in memo:
            memo[k] = visit(e)
        return memo[k]

    def visit(e: Expr) -> str | None:
        if isinstance(e, Const):
            return _ZERO if e.value == 0 else _INDEPENDENT
        if isinstance(e, Var):
            return _INDEPENDENT
        if isinstance(e, TensorElement):
            if any(go(i) not in (_ZERO, _INDEPENDENT) for i in e.indices):
                return None  # a partial sum used as an index
            return _LINEAR if id(e.tensor) in linear_in else _INDEPENDENT
        if isinstance(e, Cast):
            d = go(e.a)
            if d == _LINEAR and (_np_kind(e.dtype) != "f" or _np_kind(infer_dtype(e.a)) != "f"):
                return None  # rounding a partial sum to an integer is not the sum's rounding
            return d
        if isinstance(e, UnaryOp):
            d = go(e.a)
            if e.op == "neg" or d is None:
                return d
            return _INDEPENDENT if d != _LINEAR else None
        if isinstance(e, BinOp):
            a, b = go(e.a), go(e.b)
            if a is None or b is None:
                return None
            if e.op in ("add", "sub"):
                return join_sum(a, b)
            if e.op == "mul":
                if _LINEAR in (a, b):
                    return None if a == b else _LINEAR  # (0 * x: linear too)
                return _ZERO if _ZERO in (a, b) else _INDEPENDENT
            if e.op == "div" and b != _LINEAR:
                return a if a != _ZERO else _ZERO
            return None if _LINEAR in (a, b) else _INDEPENDENT
        if isinstance(e, IfThenElse):
            if go(e.cond) not in (_ZERO, _INDEPENDENT):
                return None
            return join_sum(go(e.then), go(e.other))
        return None  # (reductions: their outputs get no partial-sums strategies, see _partial_input_sets)

    return go(value)


def _np_kind(dtype: str | None) -> str:
    """numpy's kind letter of ``dtype`` (``"f"`` for bfloat16), ``""`` when unknown."""
    if dtype is None:
        return ""
    return "f" if dtype == "bfloat16" else np.dtype(dtype).kind


def _partial_input_sets(out: GridCompute, task_inputs, max_inputs: int = 4) -> list[tuple[int, ...]]:
    """The sets of input positions in which the output is a homogeneous linear function (all
    float, the output too): the inputs an op may take as partial sums."""
    n = len(task_inputs)
    if n > max_inputs or _np_kind(out.dtype) != "f" or out.reduces():
        return []  # (a product or a reduction of partial sums is valid too, but dearer than reducing first)
    floats = [k for k, t in enumerate(task_inputs) if _np_kind(t.dtype) == "f"]
    res = []
    for size in range(1, len(floats) + 1):
        for ks in itertools.combinations(floats, size):
            if _degree(out.value, {id(task_inputs[k]) for k in ks}) == _LINEAR:
                res.append(ks)
    return res


def _with_partial_sums(spec: OpShardSpec, axes: tuple[int, ...], inputs: tuple[int, ...]) -> OpShardSpec:
    """``spec`` with ``inputs`` and the output ``Partial(sum)`` along the mesh ``axes`` (which it
    does not split)."""
    def put(ts: TensorShardSpec) -> TensorShardSpec:
        return TensorShardSpec(tuple(Partial("sum") if m in axes else p for m, p in enumerate(ts.placements)))
    ins = tuple(put(ts) if k in inputs else ts for k, ts in enumerate(spec.input_specs))
    return OpShardSpec(ins, (put(spec.output_specs[0]),), (spec.reductions[0] + tuple((m, "sum") for m in axes),),
                       tuple(PARTIAL_SUMS if m in axes else v for m, v in enumerate(spec.assignment)),
                       spec.parallelism)


class _OutputAnalysis:
    """Candidate strategies of one grid-compute output."""

    def __init__(self, out: GridCompute, input_ids: dict[int, int], positional: bool = False,
                 blocks: bool = False):
        self.out = out
        self.blocks = blocks
        self.input_ids = input_ids
        self.lin = _linear_reduce(out.value)
        red = self.lin[0] if self.lin else None
        self.partial_op = _PARTIAL_OPS.get(red.op) if red is not None else None
        if self.partial_op not in (None, "sum") and not self.lin[2]:
            self.partial_op = None  # max/min/avg commute only with the bare reduction
        self.loop_vars: list[Var] = list(out.axes)
        if red is not None and self.partial_op is not None:
            self.loop_vars += list(red.vars)
        self.reduce_vars = set(red.vars) if red is not None else set()
        self.reads = _reads(out.value)
        self.rest_reads = {id(t) for term in (self.lin[1] if self.lin else []) for t in _reads(term)}
        # Variables used outside tensor indices (values, selects) cannot be split locally, except as
        # residues v % c when each shard is a multiple of c long (they are then the same locally)
        self.residues: dict[Var, set[int]] = {}
        self.pinned = self._pinned_vars()
        #: output axes that may split without an input dim split with them: a positional op's
        #: (Operator.positional: its output axes in values are positions it offsets itself, and its
        #: extents and origin are attributes that partition rewrites)
        self.untied: set[Var] = set(out.axes) if positional else set()
        self.pinned -= self.untied

    def _pinned_vars(self) -> set[Var]:
        pinned: set[Var] = set()
        seen: set[tuple[int, bool]] = set()

        def visit(e: Expr, in_index: bool) -> None:
            if (id(e), in_index) in seen:
                return
            seen.add((id(e), in_index))
            if not in_index and isinstance(e, BinOp) and e.op == "mod" and isinstance(e.a, Var) \
                    and isinstance(e.b, Const) and isinstance(e.b.value, int) and e.b.value > 0:
                self.residues.setdefault(e.a, set()).add(e.b.value)
            elif isinstance(e, Var):
                if not in_index:
                    pinned.add(e)
            elif isinstance(e, TensorElement):
                for idx in e.indices:
                    visit(idx, True)
            else:
                for ch in e.children():
                    visit(ch, in_index)

        visit(self.out.value, False)
        return pinned

    def evaluate(self, assign: tuple[Var | None, ...], mesh_shape: tuple[int, ...], ninputs: int):
        """Input placements (per input: per mesh axis a Placement or None = unconstrained) and
        the output spec, or None when the assignment is invalid."""
        sharded: dict[Var, int] = {}
        for m, v in enumerate(assign):
            if v is not None:
                if v in self.pinned:
                    return None
                sharded[v] = sharded.get(v, 1) * mesh_shape[m]
        if any(v.extent % (n * c) for v, n in sharded.items() for c in self.residues.get(v, ())):
            return None
        if self.partial_op == "avg" and any(v.extent % n for v, n in sharded.items() if v in self.reduce_vars):
            return None  # a mean of uneven shards' means is not the mean
        for v, n in sharded.items():
            if -(-v.extent // n) * (n - 1) >= v.extent:
                return None  # some rank would get an empty shard (torch.chunk bounds): no work to split
        in_place: list[list[Placement | None] | None] = [None] * ninputs
        for r in self.reads:
            pos = self.input_ids.get(id(r.tensor))
            if pos is None:  # reading another output of the same task: not supported for splitting
                if sharded:
                    return None
                continue
            dims_by_var: dict[Var, int] = {}
            for d, idx in enumerate(r.indices):
                kind, v = _classify_index(idx, r.tensor.shape[d], sharded, self.blocks)
                if kind == "invalid":
                    return None
                if kind == "shard":
                    if v in dims_by_var:
                        return None  # one variable indexing two dims (a diagonal)
                    dims_by_var[v] = d
            places: list[Placement | None] = []
            for m, v in enumerate(assign):
                if v is None:
                    places.append(None)
                elif v in dims_by_var:
                    places.append(Shard(dims_by_var[v]))
                elif v in self.reduce_vars and id(r) in self.rest_reads:
                    places.append(Partial(self.partial_op))
                else:
                    places.append(Replicate())
            if in_place[pos] is None:
                in_place[pos] = places
            elif in_place[pos] != places:
                return None
        if sharded and any(p is None for p in in_place):
            return None  # an input no read touches (an empty concat operand): its shard is undefined
        # A split output axis must be tied to a split input dim: the local op derives its
        # output extent from its inputs (an axis no read ties down cannot shrink locally).
        tied = {v for places in in_place if places is not None
                for v, p in zip(assign, places) if isinstance(p, Shard)}
        if any(v not in tied and v not in self.untied for v in sharded):
            return None
        out_places: list[Placement] = []
        reductions = []
        for m, v in enumerate(assign):
            if v is None:
                out_places.append(Replicate())
            elif v in self.reduce_vars:
                out_places.append(Partial(self.partial_op))
                reductions.append((m, self.partial_op))
            else:
                out_places.append(Shard(self.out.axes.index(v)))
        return in_place, TensorShardSpec(tuple(out_places)), tuple(reductions)


def op_strategies(op: Operator, mesh_shape: tuple[int, ...]) -> list[OpShardSpec]:
    """Every valid strategy of ``op`` on a mesh of ``mesh_shape`` (replicated first).

    Mesh axes of size 1 only take the replicated choice.
    """
    mesh_shape = tuple(mesh_shape)
    task = op.task
    ninputs = len(op.inputs)
    input_ids = {id(p): k for k, p in enumerate(task.inputs)}
    if task.is_extern or len(task.outputs) != 1:
        return _multi_output_strategies(op, mesh_shape)
    ana = _OutputAnalysis(task.outputs[0], input_ids, op.positional, op.splits_by_blocks)
    choices = [[None] + (ana.loop_vars if size > 1 else []) for size in mesh_shape]
    res: list[OpShardSpec] = []
    seen = set()
    for assign in itertools.product(*choices):
        r = ana.evaluate(assign, mesh_shape, ninputs)
        if r is None:
            continue
        in_place, out_spec, reductions = r
        in_specs = tuple(_finish(p, len(mesh_shape)) for p in in_place)
        spec = OpShardSpec(in_specs, (out_spec,), (reductions,),
                           tuple(v.name if v is not None else None for v in assign),
                           _parallelism(assign, mesh_shape))
        key = (spec.input_specs, spec.output_specs)
        if key in seen:
            continue
        seen.add(key)
        res.append(spec)
    sets = _partial_input_sets(task.outputs[0], task.inputs)
    for spec in list(res) if sets else []:
        if any(op != "sum" for _, op in spec.reductions[0]):
            continue  # P(sum) beside P(max)/P(avg) has no defined value
        free = [m for m, v in enumerate(spec.assignment) if v is None and mesh_shape[m] > 1]
        for r in range(1, len(free) + 1):
            for axes in itertools.combinations(free, r):
                for ks in sets:
                    new = _with_partial_sums(spec, axes, ks)
                    key = (new.input_specs, new.output_specs)
                    if key not in seen:
                        seen.add(key)
                        res.append(new)
    return res + _offset_row_strategies(op, res, mesh_shape)


def _offset_row_strategies(op: Operator, specs: list[OpShardSpec], mesh_shape: tuple[int, ...]) -> list[OpShardSpec]:
    """``specs`` (those without partial sums) with one more mesh axis splitting the inputs of
    :meth:`Operator.offset_split_dims` into row ranges, the output ``Partial(sum)`` along it."""
    split = op.offset_split_dims()
    if not split or _np_kind(op.task.outputs[0].dtype) != "f":
        return []
    rows = {op.inputs[pos].shape[dim] for pos, dim in split}
    if len(rows) != 1:
        return []  # (the inputs split together have as many rows)
    (rows,) = rows
    res = []
    for spec in specs:
        if PARTIAL_SUMS in spec.assignment or any(op != "sum" for _, op in spec.reductions[0]) \
                or any(Shard(dim) in spec.input_specs[pos].placements for pos, dim in split):
            continue
        for m, v in enumerate(spec.assignment):
            n = mesh_shape[m]
            if v is not None or n == 1 or -(-rows // n) * (n - 1) >= rows:
                continue  # (a rank without rows)
            ins = list(spec.input_specs)
            for pos, dim in split:
                ins[pos] = TensorShardSpec(tuple(Shard(dim) if k == m else p
                                                 for k, p in enumerate(ins[pos].placements)))
            outs = TensorShardSpec(tuple(Partial("sum") if k == m else p
                                         for k, p in enumerate(spec.output_specs[0].placements)))
            res.append(OpShardSpec(tuple(ins), (outs,), (spec.reductions[0] + ((m, "sum"),),),
                                   tuple(OFFSET_ROWS if k == m else a for k, a in enumerate(spec.assignment)),
                                   spec.parallelism))
    return res


def _finish(places: list[Placement | None] | None, ndim: int) -> TensorShardSpec:
    if places is None:
        return TensorShardSpec((Replicate(),) * ndim)
    return TensorShardSpec(tuple(p if p is not None else Replicate() for p in places))


def _parallelism(assign, mesh_shape) -> int:
    n = 1
    for v, size in zip(assign, mesh_shape):
        if v is not None:
            n *= size
    return n


def _multi_output_strategies(op: Operator, mesh_shape: tuple[int, ...]) -> list[OpShardSpec]:
    """Ops with several outputs or extern outputs: split only along output axes that every
    output shares as an independent copy of the same input dim (batch-like axes)."""
    task = op.task
    ninputs = len(op.inputs)
    input_ids = {id(p): k for k, p in enumerate(task.inputs)}
    # For each output: map (input pos, input dim) -> output axis, for axes that are plain copies.
    per_output: list[dict[tuple[int, int], int]] = []
    for out in task.outputs:
        if isinstance(out, ExternCompute):
            per_output.append({(m[0], m[1]): d for d, m in enumerate(out.axis_map) if m is not None})
            continue
        ana = _OutputAnalysis(out, input_ids)
        mapping = {}
        for d, v in enumerate(out.axes):
            r = ana.evaluate(tuple([v]), (2,), ninputs)
            if r is None:
                continue
            in_place, _, _ = r
            srcs = [(k, p[0].dim) for k, p in enumerate(in_place) if p is not None and isinstance(p[0], Shard)]
            if len(srcs) == 1:
                mapping[srcs[0]] = d
        per_output.append(mapping)
    common = set(per_output[0]) if per_output else set()
    for mp in per_output[1:]:
        common &= set(mp)
    keys = sorted(common)
    choices = [[None] + (keys if size > 1 else []) for size in mesh_shape]
    res = []
    for assign in itertools.product(*choices):
        used = [k for k in assign if k is not None]
        if len(set(used)) != len(used):
            continue
        ins: list[list[Placement]] = [[Replicate()] * len(mesh_shape) for _ in range(ninputs)]
        outs: list[list[Placement]] = [[Replicate()] * len(mesh_shape) for _ in task.outputs]
        for m, key in enumerate(assign):
            if key is None:
                continue
            pos, dim = key
            ins[pos][m] = Shard(dim)
            for o, mp in enumerate(per_output):
                outs[o][m] = Shard(mp[key])
        res.append(OpShardSpec(tuple(TensorShardSpec(tuple(p)) for p in ins),
                               tuple(TensorShardSpec(tuple(p)) for p in outs),
                               tuple(() for _ in task.outputs),
                               tuple(None if k is None else f"in{k[0]}.d{k[1]}" for k in assign),
                               _parallelism(assign, mesh_shape)))
    return res


def replicated_strategy(op: Operator, mesh_ndim: int) -> OpShardSpec:
    """The strategy that runs ``op`` whole on every rank."""
    r = TensorShardSpec((Replicate(),) * mesh_ndim)
    return OpShardSpec(tuple(r for _ in op.inputs), tuple(r for _ in op.outputs),
                       tuple(() for _ in op.outputs), (None,) * mesh_ndim, 1)
