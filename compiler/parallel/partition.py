"""partition(graph, plan): one FlowGraph per rank with the communication injected.

Every rank graph takes the *full* graph inputs (every rank receives them; the ``sharded_inputs``
of a state excepted, :func:`partition`) and returns the graph
outputs in their planned spec (replicated by default). For each op input the rank graph holds
the tensor in the spec its producer made; when the op needs another spec, the steps of
:func:`connect` become ops: collectives (``AllReduce``, ``AllGather``, ``ReduceScatter``,
``AllToAll``: the same op on every rank of the group) or local ops with explicit, rank-specific
offsets (``LocalSlice``, ``LocalPartial``). Constants are sliced at compile time so each rank
graph holds only its shards of the weights. Ops whose attributes name their output shape
(reshape targets) are rebuilt for the local shapes by :meth:`Operator.localize`, and an op whose
spec splits an input into row ranges (:data:`~.rules.OFFSET_ROWS`, an embedding table) learns
there where its rows start.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from ..errors import ShardflowError
from ..ir.graph import FlowGraph, Operator, Tensor, const_tensor
from ..ir.spill import contiguous
from . import comm_ops
from .connect import connect
from .mesh import DeviceMesh
from .placement import Partial, Shard, TensorShardSpec, chunk_bounds
from .plan import ShardingPlan
from .rules import OFFSET_ROWS

__all__ = ["partition", "partition_ranks"]


def local_shape(shape, spec: TensorShardSpec, mesh: DeviceMesh, rank: int) -> tuple[int, ...]:
    return spec.local_shape(shape, mesh, rank)


def _slice_constant(value: np.ndarray, spec: TensorShardSpec, mesh: DeviceMesh, rank: int) -> np.ndarray:
    bounds = spec.local_bounds(value.shape, mesh, rank)
    coord = mesh.coord_of(rank)
    local = value[tuple(slice(a, b) for a, b in bounds)]
    for m, p in enumerate(spec.placements):
        if isinstance(p, Partial) and p.op == "sum" and coord[m] != 0:
            local = np.zeros_like(local)  # the value lives on the group's first rank only
    return contiguous(local)  # (a column shard copied once, into a spilled array when compiling)


class _RankBuilder:
    def __init__(self, graph: FlowGraph, plan: ShardingPlan, rank: int, sharded_inputs: frozenset = frozenset()):
        self.graph, self.plan, self.rank = graph, plan, rank
        self.sharded_inputs = sharded_inputs
        self.mesh = plan.mesh
        self.coord = self.mesh.coord_of(rank)
        self.nodes: list[Operator] = []
        self.local: dict[tuple[int, TensorShardSpec], Tensor] = {}
        self.specs: dict[int, TensorShardSpec] = {}
        self.replicated = TensorShardSpec.replicated(self.mesh.ndim)
        self.cost_model = plan.cost_model()

    def add(self, op: Operator) -> Tensor:
        self.nodes.append(op)
        return op.outputs[0]

    def get(self, t: Tensor, dst: TensorShardSpec) -> Tensor:
        """``t`` on this rank in spec ``dst``, resharding from the spec it was produced in."""
        key = (id(t), dst)
        if key in self.local:
            return self.local[key]
        if t.is_constant:
            val = _slice_constant(t.value, dst, self.mesh, self.rank)
            name = t.name if dst.is_replicated else f"{t.name}@{dst}"
            res = const_tensor(val, name)
        else:
            src = self.specs[id(t)]
            x = self.local[(id(t), src)]
            steps = connect(src, dst, t.shape, t.dtype, self.mesh, self.cost_model).steps
            for k, st in enumerate(steps):
                x = self.add(self._step_op(st, x, t, f"{t.name}/{st.kind}{k}->{dst}"))
            res = x
        self.local[key] = res
        return res

    def _step_op(self, st, x: Tensor, t: Tensor, name: str) -> Operator:
        m = st.mesh_axis
        n = self.mesh.shape[m]
        j = self.coord[m]  # this rank's index in its group along mesh axis m
        if st.kind == "local_slice":
            start, stop = chunk_bounds(x.shape[st.tensor_dim], n, j)
            return comm_ops.LocalSlice([x], name=name, dim=st.tensor_dim, start=start, stop=stop)
        if st.kind == "local_partial":
            keep = j == 0 or st.reduce_op != "sum"
            return comm_ops.LocalPartial([x], name=name, keep=keep)
        if st.kind == "all_reduce":
            return comm_ops.AllReduce([x], name=name, mesh_axis=m, op=st.reduce_op, group_size=n)
        if st.kind == "reduce_scatter":
            return comm_ops.ReduceScatter([x], name=name, mesh_axis=m, dim=st.tensor_dim, op=st.reduce_op,
                                          group_size=n, group_index=j)
        dst_shape = local_shape(t.shape, st.dst, self.mesh, self.rank)
        if st.kind == "all_gather":
            return comm_ops.AllGather([x], name=name, mesh_axis=m, dim=st.tensor_dim,
                                      global_size=dst_shape[st.tensor_dim], group_size=n)
        if st.kind == "all_to_all":
            return comm_ops.AllToAll([x], name=name, mesh_axis=m, src_dim=st.tensor_dim, dst_dim=st.dst_dim,
                                     src_size=dst_shape[st.tensor_dim], group_size=n, group_index=j)
        raise ShardflowError(f"partition: unknown resharding step {st.kind!r}")

    def _row_offset(self, op: Operator, sp) -> int | None:
        """Where the rows this rank holds start when ``sp`` splits inputs of ``op`` into row ranges
        (:data:`~.rules.OFFSET_ROWS`), else None."""
        if OFFSET_ROWS not in sp.assignment:
            return None
        m = sp.assignment.index(OFFSET_ROWS)
        split = op.offset_split_dims()
        if not split or any(sp.input_specs[pos].placements[m] != Shard(dim) for pos, dim in split):
            raise ShardflowError(f"partition: op {op.name} ({op.op_type}) has no inputs split into row ranges "
                                 f"as its spec {sp} says; re-plan this graph")
        pos, dim = split[0]
        return sp.input_specs[pos].local_bounds(op.inputs[pos].shape, self.mesh, self.rank)[dim][0]

    def build(self) -> FlowGraph:
        g, plan = self.graph, self.plan
        inputs = []
        for t in g.inputs:
            spec = plan.input_specs[t.name] if t.name in self.sharded_inputs else self.replicated
            local_in = Tensor(t.name, local_shape(t.shape, spec, self.mesh, self.rank), t.dtype)
            inputs.append(local_in)
            self.specs[id(t)] = spec
            self.local[(id(t), spec)] = local_in
        for op in g.nodes:
            sp = plan.op_specs.get(op.name)
            if sp is None:
                raise ShardflowError(f"partition: the plan has no spec for op {op.name}; re-plan this graph")
            ins = [self.get(t, s) for t, s in zip(op.inputs, sp.input_specs)]
            out_shapes = [local_shape(t.shape, s, self.mesh, self.rank) for t, s in zip(op.outputs, sp.output_specs)]
            origin = None
            if op.positional:  # (where this rank's part of the output starts in the whole)
                origin = [lo for lo, _ in sp.output_specs[0].local_bounds(op.outputs[0].shape, self.mesh, self.rank)]
            local_op = op.localize(ins, out_shapes, self._row_offset(op, sp), origin)
            self.nodes.append(local_op)
            for t, lt, s in zip(op.outputs, local_op.outputs, sp.output_specs):
                lt.name = t.name
                self.specs[id(t)] = s
                self.local[(id(t), s)] = lt
        outputs = [self.get(t, plan.output_specs.get(name, self.replicated))
                   for name, t in zip(g.output_names, g.outputs)]
        rg = FlowGraph(inputs, outputs, self.nodes, list(g.output_names), name=f"{g.name}.rank{self.rank}")
        rg.validate()
        rg.meta.update(rank=self.rank, mesh=self.mesh)
        return rg


def partition(graph: FlowGraph, plan: ShardingPlan, sharded_inputs=()) -> list[FlowGraph]:
    """Split ``graph`` into one graph per rank of ``plan.mesh`` (indexed by global rank).

    The inputs named in ``sharded_inputs`` are the exception to whole inputs: each rank graph takes
    only its part of them, in the plan's input spec (a state kept by the program between runs, which
    each rank keeps its share of: ``compile(state=...)``)."""
    return list(partition_ranks(graph, plan, sharded_inputs))


def partition_ranks(graph: FlowGraph, plan: ShardingPlan, sharded_inputs=()) -> Iterator[FlowGraph]:
    """:func:`partition`'s rank graphs one at a time, in rank order, each built when it is asked
    for: a caller that is done with a rank before the next (``compile``) holds one rank's weight
    shards at a time. The arguments are checked before the first is built."""
    for name, spec in plan.input_specs.items():
        if spec.partial_axes:
            raise ShardflowError(f"graph input {name!r} cannot be Partial; inputs are delivered whole to every rank")
    names = {t.name for t in graph.inputs}
    unknown = sorted(set(sharded_inputs) - names)
    if unknown:
        raise ShardflowError(f"partition: sharded_inputs {unknown} are not inputs of the graph")
    return (_RankBuilder(graph, plan, r, frozenset(sharded_inputs)).build() for r in range(plan.mesh.size))

