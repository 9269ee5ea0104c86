"""Plan search: Alpa-style intra-operator ILP, and baselines on the same cost model.

Formulation (see ``rfcs/0001-automatic-parallelization.md``). Ops are first grouped: a cheap op
(element-wise, reshape, transpose, cast: ``Operator.injective``) follows the group of its first
activation input, taking for each of the leader's strategies the candidate that accepts the
leader's output as is (or, failing that, the cheapest with resharding). Groups are then aliased:
groups whose structure and neighbourhood are identical (repeated layers) share one decision. For
alias class ``a`` with strategies ``i`` the ILP has binaries ``s[a,i]`` with ``Σ_i s[a,i] = 1``; for
every pair of classes joined by edges, continuous ``e[a,b,i,j] ≥ 0`` with ``Σ_j e = s[a,i]`` and
``Σ_i e = s[b,j]`` (so ``e`` is the product of the two one-hots). The objective is

    Σ_a Σ_i (compute + in-group resharding + graph-input/-output resharding)[a,i] · s[a,i]
  + Σ_(a,b) Σ_ij (edge resharding)[a,b,i,j] · e[a,b,i,j]

and, with ``memory_budget_bytes``, for every step ``t`` of the topological order:
``Σ parameters(s) + Σ_{tensors live at t} bytes(s) ≤ budget`` (identical rows deduplicated).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError, ShardflowError
from ..ir.expr import BinOp, Reduce, TensorElement, UnaryOp, walk
from ..ir.graph import FlowGraph, Operator, Tensor
from ..ir.task import GridCompute
from .config import DistributedConfig
from .connect import connect, step_graph
from .cost import DEVICE_MEMORY_FRACTION, H100, CostModel, itemsize
from .mesh import DeviceMesh
from .pins import resolve_pins, unavailable
from .placement import Partial, Replicate, Shard, TensorShardSpec
from ..passes.simplify import attr_key
from .rules import OFFSET_ROWS, PARTIAL_SUMS, OpShardSpec, op_strategies, replicated_strategy

__all__ = ["search", "Problem", "op_flops", "op_input_reads", "local_bytes"]

if TYPE_CHECKING:
    from .plan import ShardingPlan

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# costs of single ops

def op_flops(op: Operator) -> float:
    """Arithmetic operations of ``op``: its expression nodes once per output element, and each
    reduction's body once per reduced element and per distinct value of the output indices the
    reduction depends on (a LayerNorm's row mean once per row, not once per element of the row, as
    the kernels compute it; a MatMul's sum once per output element)."""
    total = 0.0
    for out in op.task.outputs:
        size = float(np.prod(out.shape, dtype=np.float64)) if out.shape else 1.0
        if not isinstance(out, GridCompute):
            total += size * max(1.0, math.log2(max(2.0, size)))
            continue
        extent = {id(v): float(v.extent) for v in out.axes}
        per = 1.0
        for n in walk(out.value):
            if isinstance(n, Reduce):
                ext = float(np.prod([v.extent for v in n.vars], dtype=np.float64))
                body_ops = sum(1 for m in walk(n.body) if isinstance(m, (BinOp, UnaryOp)))
                deps = {id(m) for m in walk(n) if id(m) in extent}
                times = float(np.prod([extent[d] for d in deps], dtype=np.float64))
                total += times * ext * max(1, body_ops + 1)
            elif isinstance(n, (BinOp, UnaryOp)):
                per += 1
        total += size * per
    return total


def op_input_reads(op: Operator) -> list[float | None]:
    """Elements of each input that ``op``'s compute definition reads, per input (``None`` where
    the definition does not say: extern computes). An access counts once per output element and
    per element of the reductions around it, so a gather of a few rows of a table reads those
    rows, a slice its part, an element-wise op its whole input; a matmul's count exceeds its
    operands' sizes (each is read whole). The cost model takes the smaller of this and the size."""
    task = op.task
    if task.is_extern or len(task.inputs) != len(op.inputs):
        return [None] * len(op.inputs)
    position = {id(t): i for i, t in enumerate(task.inputs)}
    reads = [0.0] * len(task.inputs)
    seen: set[int] = set()

    def visit(e, times: float) -> None:
        if id(e) in seen:
            return
        seen.add(id(e))
        if isinstance(e, Reduce):
            times *= float(np.prod([v.extent for v in e.vars], dtype=np.float64))
        elif isinstance(e, TensorElement):
            if id(e.tensor) in position:
                reads[position[id(e.tensor)]] += times
            elif isinstance(e.tensor, GridCompute):  # another compute of the same definition
                visit(e.tensor.value, times)
        for c in e.children():
            visit(c, times)

    for out in task.outputs:
        visit(out.value, float(np.prod(out.shape, dtype=np.float64)) if out.shape else 1.0)
    return reads


def local_numel(shape: tuple[int, ...], spec: TensorShardSpec, mesh_shape: tuple[int, ...]) -> int:
    """Elements of the largest local shard of a tensor of ``shape`` under ``spec``."""
    dims = list(shape)
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard) and mesh_shape[m] > 1:
            dims[p.dim] = -(-dims[p.dim] // mesh_shape[m])
    return int(np.prod(dims, dtype=np.int64)) if dims else 1


def local_bytes(t: Tensor, spec: TensorShardSpec, mesh_shape: tuple[int, ...]) -> int:
    return local_numel(t.shape, spec, mesh_shape) * itemsize(t.dtype)


# ----------------------------------------------------------------------------------------------
# the problem: groups, their strategies and costs


@dataclass
class Group:
    """A leader op and the cheap ops that follow it; ``choices[i]`` is the per-member strategy
    when the leader takes its strategy ``i``."""

    index: int
    leader: Operator
    members: list[Operator]
    choices: list[dict[int, OpShardSpec]] = field(default_factory=list)
    node_cost: list[float] = field(default_factory=list)
    alias: int = -1


class Problem:
    """Strategies, costs and edges of a graph on a mesh; shared by the ILP and the baselines."""

    def __init__(self, graph: FlowGraph, cfg: DistributedConfig):
        self.graph = graph
        self.cfg = cfg
        self.mesh = DeviceMesh(cfg.mesh_shape, cfg.mesh_axis_names, cfg.rank_map)
        self.mesh_shape = tuple(cfg.mesh_shape)
        self.cost_model = CostModel(self.mesh, axis_bandwidth_GBps=cfg.axis_bandwidth_GBps,
                                    axis_latency_us=cfg.axis_latency_us, device=cfg.device or H100)
        nd = len(self.mesh_shape)
        self.replicated = TensorShardSpec((Replicate(),) * nd)
        self.input_specs = {t.name: self._parse_placement(cfg.input_placements, t.name, t)
                            for t in graph.inputs}
        self.output_specs = [self._parse_placement(cfg.output_placements, n, t)
                             for n, t in zip(graph.output_names, graph.outputs)]
        self._connect_cache: dict = {}
        # float32 weights the ranks store in half (graph.meta["weights_precision"]: driver.planned_graph)
        self.half_weights = graph.meta.get("weights_precision") in ("float16", "bfloat16")
        self.strategies: dict[int, list[OpShardSpec]] = {}
        same_op: dict[tuple, list[OpShardSpec]] = {}  # repeated layers have identical ops
        partial_sums = cfg.partial_sums is True or (cfg.partial_sums == "auto" and not (
            cfg.memory_budget_bytes is not None and sum(n > 1 for n in self.mesh_shape) > 1))
        # op_placements: the pinned ops keep the strategies their pin admits (a list of their own)
        self.pins = resolve_pins(graph, cfg.op_placements, self.mesh_shape, require_match=not cfg.pins_may_miss)
        for op in graph.nodes:
            key = (type(op), attr_key(op.attrs), tuple((t.shape, t.dtype) for t in op.inputs))
            if key not in same_op:
                specs = op_strategies(op, self.mesh_shape) or [replicated_strategy(op, nd)]
                if not partial_sums:
                    specs = [s for s in specs if PARTIAL_SUMS not in s.assignment]
                reads = op_input_reads(op)
                same_op[key] = [self._with_cost(op, s, reads) for s in specs]
            self.strategies[id(op)] = same_op[key]
            pin = self.pins.get(op.name)
            if pin is not None:
                self.strategies[id(op)] = [s for s in same_op[key] if pin.admits(s)]
                if not self.strategies[id(op)]:
                    # (one the rules give that the search left out: partial sums, off under a budget on 2+ axes)
                    hidden = not partial_sums and any(pin.admits(s) for s in op_strategies(op, self.mesh_shape))
                    raise unavailable(pin, op, same_op[key], "partial_sums" if hidden else None)
        self.producer_of = {id(t): op for op in graph.nodes for t in op.outputs}
        #: input position of each weight product's constant weight (:func:`_is_weight_matmul`), else None
        self.weight_input = {id(op): _is_weight_matmul(op) for op in graph.nodes}
        self._followers: dict[tuple, tuple[OpShardSpec, float]] = {}  # (_follow_leader)
        self._build_groups()

    def _parse_placement(self, table: dict, name: str, t: Tensor) -> TensorShardSpec:
        if name not in table:
            return self.replicated
        try:
            spec = TensorShardSpec.parse(table[name])
        except Exception as exc:
            raise ConfigError(f"placement for {name!r}: cannot parse {table[name]!r} ({exc})") from None
        if len(spec.placements) != len(self.mesh_shape):
            raise ConfigError(f"placement for {name!r} = {table[name]!r}: need one placement per mesh axis "
                              f"({len(self.mesh_shape)})")
        for p in spec.placements:
            if isinstance(p, Shard) and not 0 <= p.dim < t.ndim:
                raise ConfigError(f"placement for {name!r} = {table[name]!r}: {t.name} has rank {t.ndim}")
        return spec

    # costs --------------------------------------------------------------------------
    def _with_cost(self, op: Operator, s: OpShardSpec, reads: list | None = None) -> OpShardSpec:
        flops = op_flops(op) / s.parallelism
        # an input moves its local bytes, or fewer when the op reads only part of it (a gather's rows)
        nbytes = 0.0
        for t, sp, r in zip(op.inputs, s.input_specs, op_input_reads(op) if reads is None else reads):
            b = local_bytes(t, sp, self.mesh_shape)
            nbytes += b if r is None else min(b, r / s.parallelism * itemsize(t.dtype))
        nbytes += sum(local_bytes(t, sp, self.mesh_shape) for t, sp in zip(op.outputs, s.output_specs))
        cost = self.cost_model.compute_time(flops, nbytes)
        return OpShardSpec(s.input_specs, s.output_specs, s.reductions, s.assignment, s.parallelism, cost)

    def reshard_cost(self, t: Tensor, src: TensorShardSpec, dst: TensorShardSpec) -> float:
        if src == dst:
            return 0.0
        key = (t.shape, t.dtype, src, dst)
        if key not in self._connect_cache:
            self._connect_cache[key] = connect(src, dst, t.shape, t.dtype, self.mesh, self.cost_model).cost
        return self._connect_cache[key]

    def step_graph(self, t: Tensor, specs: list[TensorShardSpec]):
        """:func:`~.connect.step_graph` of ``t`` with the partial placements ``specs`` hold."""
        partials = [{sp.placements[a] for sp in specs if isinstance(sp.placements[a], Partial)}
                    for a in range(len(self.mesh_shape))]
        return step_graph(t.shape, t.dtype, partials, self.mesh, self.cost_model)

    def source_spec(self, t: Tensor, assign: dict[int, OpShardSpec]) -> TensorShardSpec | None:
        """The spec ``t`` is produced in under ``assign``; None for constants (sliced for free)."""
        if t.is_constant:
            return None
        p = self.producer_of.get(id(t))
        if p is None:
            return self.input_specs[t.name]
        return assign[id(p)].output_specs[p.outputs.index(t)]

    def edge_cost(self, t: Tensor, dst: TensorShardSpec, assign) -> float:
        src = self.source_spec(t, assign)
        return 0.0 if src is None else self.reshard_cost(t, src, dst)

    def total_cost(self, assign: dict[int, OpShardSpec]) -> tuple[float, float, float]:
        """(total, compute, communication) modeled seconds of a full assignment."""
        comp = sum(assign[id(op)].compute_cost for op in self.graph.nodes)
        comm = 0.0
        for op in self.graph.nodes:
            for t, sp in zip(op.inputs, assign[id(op)].input_specs):
                comm += self.edge_cost(t, sp, assign)
        for t, sp in zip(self.graph.outputs, self.output_specs):
            comm += self.edge_cost(t, sp, assign)
        return comp + comm, comp, comm

    def param_bytes(self, t: Tensor, spec: TensorShardSpec) -> int:
        """A constant's bytes on a rank under ``spec``, as the ranks store it: a float32 weight in
        half when the compile's precision is (``half_weights``)."""
        b = local_bytes(t, spec, self.mesh_shape)
        return b // 2 if self.half_weights and t.dtype == "float32" else b

    def memory(self, assign: dict[int, OpShardSpec]) -> tuple[int, int]:
        """(parameter bytes, peak live activation bytes) per rank under ``assign``."""
        params = 0
        seen: set[tuple[int, TensorShardSpec]] = set()
        for op in self.graph.nodes:
            for t, sp in zip(op.inputs, assign[id(op)].input_specs):
                if t.is_constant and (id(t), sp) not in seen:
                    seen.add((id(t), sp))
                    params += self.param_bytes(t, sp)
        # each activation's bytes once: an unrolled loop keeps hundreds live at every step
        size: dict[int, int] = {}
        for t in {id(t): t for live in self.live_sets() for t in live}.values():
            sp = self.source_spec(t, assign)
            size[id(t)] = local_bytes(t, sp if sp is not None else self.replicated, self.mesh_shape)
        peak = max((sum(size[id(t)] for t in live) for live in self.live_sets()), default=0)
        return params, peak

    def live_sets(self) -> list[list[Tensor]]:
        """Activations live at each step of the topological order (inputs included)."""
        if hasattr(self, "_live"):
            return self._live
        last: dict[int, int] = {}
        order = self.graph.nodes
        for k, op in enumerate(order):
            for t in op.inputs:
                if not t.is_constant:
                    last[id(t)] = k
        end = len(order)
        for t in self.graph.outputs:
            last[id(t)] = end
        born = {id(t): -1 for t in self.graph.inputs}
        tensors = {id(t): t for t in self.graph.inputs}
        for k, op in enumerate(order):
            for t in op.outputs:
                born[id(t)] = k
                tensors[id(t)] = t
        starts = defaultdict(list)
        for tid, b in born.items():
            starts[max(b, 0)].append(tid)
        live: dict[int, Tensor] = {}
        res = []
        for k in range(len(order)):
            for tid in starts.get(k, ()):
                if last.get(tid, -2) >= k:
                    live[tid] = tensors[tid]
            res.append(list(live.values()))
            for tid in [tid for tid in live if last.get(tid, -1) <= k]:
                del live[tid]
        self._live = res
        return res

    # grouping -------------------------------------------------------------------------
    def _build_groups(self) -> None:
        self.groups: list[Group] = []
        self.group_of: dict[int, Group] = {}
        for op in self.graph.nodes:
            acts = [t for t in op.inputs if not t.is_constant]
            p = self.producer_of.get(id(acts[0])) if len(acts) == 1 else None
            if op.injective and p is not None:  # a cheap op with one activation operand follows it
                g = self.group_of[id(p)]
                g.members.append(op)
                self.group_of[id(op)] = g
            else:
                g = Group(len(self.groups), op, [op])
                self.groups.append(g)
                self.group_of[id(op)] = g
        for g in self.groups:
            self._group_choices(g)

    def _group_choices(self, g: Group) -> None:
        """Per leader strategy, the members' strategies that follow it. Where members could carry
        the leader's partial sums on (:data:`~.rules.PARTIAL_SUMS`), there are two choices: carried
        as far as the members' own costs prefer, and resolved at the first member (what a
        consumer outside the group may want); the ILP picks."""
        seen = set()
        for lead in self.strategies[id(g.leader)]:
            for carry in (True, False):
                assign, cost = self._follow_leader(g, lead, carry)
                key = tuple(id(s) for s in assign.values())
                if key not in seen:
                    seen.add(key)
                    g.choices.append(assign)
                    g.node_cost.append(cost)

    def _follow_leader(self, g: Group, lead: OpShardSpec, carry_partial_sums: bool):
        assign = {id(g.leader): lead}
        cost = lead.compute_cost
        for op in g.members[1:]:
            # A member reads one activation, from the member before it (_build_groups): its choice
            # depends on that tensor's spec and its own strategies only, so it is computed once
            # for each (strategies, spec handed over), which identical layers share. (Ops share a
            # strategies list only with the same inputs' shapes and dtypes: __init__'s same_op.)
            lead_t = next(t for t in op.inputs if not t.is_constant)
            p = self.producer_of[id(lead_t)]
            have = assign[id(p)].output_specs[p.outputs.index(lead_t)]
            k = op.inputs.index(lead_t)
            key = (id(self.strategies[id(op)]), carry_partial_sums, k, have)
            hit = self._followers.get(key)
            if hit is None:
                hit = self._followers[key] = self._follower(op, lead_t, k, have, carry_partial_sums)
            assign[id(op)] = hit[0]
            cost += hit[1]
        return assign, cost

    def _follower(self, op: Operator, lead_t: Tensor, k: int, have: TensorShardSpec, carry_partial_sums: bool):
        """The strategy of group member ``op`` whose input ``k`` (``lead_t``) arrives as ``have``, and
        its cost (compute and the resharding of ``lead_t``)."""
        # Follow: keep the spec the group hands over when some candidate accepts it as is ...
        # ... and do not split work along mesh axes where the handed-over tensor is whole.
        whole = [m for m, pl in enumerate(have.placements) if isinstance(pl, Replicate)]
        options = self.strategies[id(op)]
        if not carry_partial_sums:
            options = [c for c in options if PARTIAL_SUMS not in c.assignment] or options
        allowed = [c for c in options if all(c.assignment[m] is None for m in whole)]
        cands = [c for c in allowed if c.input_specs[k] == have] or allowed or options
        best, best_cost = None, math.inf
        for cand in cands:
            c = cand.compute_cost + self.reshard_cost(lead_t, have, cand.input_specs[k])
            if c < best_cost - 1e-15:
                best, best_cost = cand, c
        return best, best_cost

    def pins_hold(self, assign: dict[int, OpShardSpec]) -> bool:
        """Whether ``assign`` runs every pinned op (``op_placements``) as its pin says."""
        return all(self.pins[op.name].admits(assign[id(op)]) for op in self.graph.nodes if op.name in self.pins)

    def external_inputs(self, g: Group):
        """(tensor, member op, input index) reads of ``g`` from outside it."""
        members = {id(m) for m in g.members}
        for op in g.members:
            for k, t in enumerate(op.inputs):
                p = self.producer_of.get(id(t))
                if p is None or id(p) not in members:
                    yield t, op, k


# ----------------------------------------------------------------------------------------------
# layer aliasing

def _alias_classes(problem: Problem, rounds: int = 3) -> None:
    """Weisfeiler-Lehman colouring of the group graph: groups with equal colours after ``rounds``
    refinements (same ops, shapes, attributes and neighbourhoods) share one decision."""
    groups = problem.groups
    preds: dict[int, list[int]] = defaultdict(list)
    succs: dict[int, list[int]] = defaultdict(list)
    for g in groups:
        for t, _, _ in problem.external_inputs(g):
            p = problem.producer_of.get(id(t))
            if p is not None:
                pg = problem.group_of[id(p)].index
                preds[g.index].append(pg)
                succs[pg].append(g.index)
    colour = {}
    for g in groups:
        # (a pinned op's pin too: a layer pinned is not aliased with one that is not)
        sig = "|".join(f"{m.op_type}{sorted((k, repr(v)) for k, v in m.attrs.items())}"
                       f"{[t.shape for t in m.inputs]}{[t.dtype for t in m.inputs]}"
                       f"{problem.pins[m.name].text if m.name in problem.pins else ''}" for m in g.members)
        sig += repr([round(c, 15) for c in g.node_cost]) + str(len(g.choices))
        colour[g.index] = hashlib.sha1(sig.encode()).hexdigest()
    for _ in range(rounds):
        colour = {
            i: hashlib.sha1((colour[i] + "<" + ",".join(sorted(colour[p] for p in preds[i]))
                             + ">" + ",".join(sorted(colour[s] for s in succs[i]))).encode()).hexdigest()
            for i in colour}
    ids: dict[str, int] = {}
    for g in groups:
        g.alias = ids.setdefault(colour[g.index], len(ids))


# ----------------------------------------------------------------------------------------------
# the ILP

@dataclass
class EdgeBlock:
    """Resharding cost between two alias classes through one edge role, by *spec*: strategies
    producing (needing) the same spec share a row (column), which keeps the ILP small."""

    src: int                    # producer's alias class
    dst: int                    # consumer's alias class
    rows: list[int]             # producer strategy -> distinct produced spec
    cols: list[int]             # consumer strategy -> distinct needed spec
    cost: np.ndarray            # [produced spec, needed spec], times the edge's multiplicity
    tensor: Tensor              # (one of) the tensor(s) the edge carries
    have: list                  # the distinct produced specs
    needed: list                # the distinct needed specs
    count: int = 0              # the edge's multiplicity (aliased groups repeat it)


def _distinct(specs: list) -> tuple[list[int], list]:
    index: dict = {}
    return [index.setdefault(sp, len(index)) for sp in specs], list(index)


def _ilp_terms(problem: Problem):
    """Per alias class: strategy count and unary costs; edge blocks between classes."""
    groups = problem.groups
    reps: dict[int, Group] = {}
    for g in groups:
        reps.setdefault(g.alias, g)
    nstrat = {a: len(g.choices) for a, g in reps.items()}

    lin: dict[int, np.ndarray] = {a: np.zeros(n) for a, n in nstrat.items()}
    blocks: dict[tuple, EdgeBlock] = {}
    for g in groups:
        lin[g.alias] += np.asarray(g.node_cost)
    # edges between groups; graph inputs and outputs as unary terms
    for g in groups:
        for t, op, k in problem.external_inputs(g):
            if t.is_constant:
                continue
            p = problem.producer_of.get(id(t))
            need = [ch[id(op)].input_specs[k] for ch in g.choices]
            if p is None:
                src = problem.input_specs[t.name]
                lin[g.alias] += np.array([problem.reshard_cost(t, src, d) for d in need])
                continue
            pg = problem.group_of[id(p)]
            # Aliased groups repeat the same edge role: one block, weighted by its multiplicity.
            key = (pg.alias, g.alias, _index(pg.members, p), p.outputs.index(t), _index(g.members, op), k)
            blk = blocks.get(key)
            if blk is None:
                rows, have = _distinct([ch[id(p)].output_specs[p.outputs.index(t)] for ch in pg.choices])
                cols, needed = _distinct(need)
                cost = np.array([[problem.reshard_cost(t, sp, d) for d in needed] for sp in have])
                blk = blocks[key] = EdgeBlock(pg.alias, g.alias, rows, cols, cost, t, have, needed)
            blk.count += 1
    for t, dst in zip(problem.graph.outputs, problem.output_specs):
        p = problem.producer_of.get(id(t))
        if p is None:
            continue
        pg = problem.group_of[id(p)]
        lin[pg.alias] += np.array([problem.reshard_cost(t, ch[id(p)].output_specs[p.outputs.index(t)], dst)
                                   for ch in pg.choices])
    edges = []
    for blk in blocks.values():
        blk.cost = blk.cost * blk.count
        if blk.src == blk.dst:  # both ends take the same strategy
            lin[blk.src] += np.array([blk.cost[blk.rows[i], blk.cols[i]] for i in range(nstrat[blk.src])])
        elif blk.cost.any():
            edges.append(blk)
    return nstrat, lin, edges


def _index(items: list, x) -> int:
    return next(k for k, y in enumerate(items) if y is x)


def objective_of(problem: Problem, picks: list[int]) -> float:
    """The ILP objective (seconds) of a choice per group (all groups of a class choose alike)."""
    nstrat, lin, edges = _ilp_terms(problem)
    by_alias = {g.alias: i for g, i in zip(problem.groups, picks)}
    total = sum(float(lin[a][i]) for a, i in by_alias.items())
    total += sum(float(e.cost[e.rows[by_alias[e.src]], e.cols[by_alias[e.dst]]]) for e in edges)
    return total


def _solve_ilp(problem: Problem) -> list[int]:
    import pulp

    cfg = problem.cfg
    groups = problem.groups
    if cfg.alias_layers:
        _alias_classes(problem)
    else:
        for g in groups:
            g.alias = g.index
    nstrat, lin, edges = _ilp_terms(problem)

    prob = pulp.LpProblem("shardflow_plan", pulp.LpMinimize)
    s = {a: [pulp.LpVariable(f"s_{a}_{i}", cat="Binary") for i in range(n)] for a, n in sorted(nstrat.items())}
    for a, vs in s.items():
        prob += pulp.lpSum(vs) == 1, f"one_{a}"
    objective = [(v, float(c) * _SCALE) for a in s for c, v in zip(lin[a], s[a]) if c]
    # Edge blocks, in one of two exact formulations with the same LP bound (rfcs/0001 "Every placement
    # an axis can take; the ILP's edges as flows"): a variable per pair of (produced, needed) specs, or a
    # flow over connect's graph of the tensor's specs, a variable per step; flows where they need fewer
    # than 1 / FLOWS_WHEN of the pairs' variables (3-D meshes), since HiGHS proves budgeted MIPs of
    # 2-D meshes faster on pairs.
    graphs = [problem.step_graph(blk.tensor, blk.have + blk.needed) for blk in edges]
    flows = FLOWS_WHEN * sum(len(steps) for _, steps in graphs) < sum(blk.cost.size for blk in edges)
    for n, (blk, graph) in enumerate(zip(edges, graphs)):
        objective += (_flow_terms(prob, n, blk, s, graph) if flows else _pair_terms(prob, n, blk, s))
    prob += _affine(objective)
    t0 = time.perf_counter()
    # Memory rows are added lazily: solve, add the rows the solution violates, solve again. Most
    # steps never bind, and every row left out makes the MIP much cheaper to solve. time_limit_s
    # bounds all the solves together: each gets what the earlier ones left.
    rows = _memory_rows(problem) if cfg.memory_budget_bytes is not None else []
    budget = float(cfg.memory_budget_bytes or 0)
    added: set[int] = set()
    while True:
        with _quiet_stdout():
            status = prob.solve(_solver(cfg, max(1.0, cfg.time_limit_s - (time.perf_counter() - t0))))
        if pulp.LpStatus[status] != "Optimal" or not rows:
            break
        pick = {a: int(np.argmax([v.value() or 0.0 for v in vs])) for a, vs in s.items()}
        load = [sum(c for (a, i), c in row.items() if pick[a] == i) + fixed for row, fixed in rows]
        violated = [k for k in np.argsort(load)[::-1] if load[k] > budget * (1 + 1e-9) and k not in added]
        if not violated:
            break
        if time.perf_counter() - t0 >= cfg.time_limit_s:
            raise ShardflowError(
                f"the ILP ran out of time_limit_s={cfg.time_limit_s:g} before finding a plan within "
                f"memory_budget_bytes={cfg.memory_budget_bytes:,} on mesh {list(cfg.mesh_shape)} (the plan found "
                f"needs {max(load):,.0f} bytes at its peak; the memory rows are added as solutions break them, "
                f"{len(added)} so far); raise time_limit_s, set mip_rel_gap, or raise the budget")
        for k in violated[:4]:  # the worst few at a time
            row, fixed = rows[k]
            added.add(int(k))
            prob += _affine([(s[a][i], float(c) / _MB) for (a, i), c in sorted(row.items()) if c]) \
                <= (budget - fixed) / _MB, f"mem_{k}"
    log.info("ILP (%s): %d classes, %d edge blocks (%s), %d of %d memory rows, status %s, %.2f s", cfg.solver,
             len(s), len(edges), "flows" if flows else "pairs", len(added), len(rows), pulp.LpStatus[status],
             time.perf_counter() - t0)
    if pulp.LpStatus[status] == "Optimal" and prob.sol_status != pulp.LpSolutionOptimal:
        log.warning("the ILP solver stopped at a limit (time_limit_s=%s, max_nodes=%s) before proving optimality: "
                    "the plan is the best found so far%s; raise the limits or mip_rel_gap", cfg.time_limit_s,
                    cfg.max_nodes, " (the same on every machine, unless time_limit_s came first)" if cfg.max_nodes
                    else " and may differ between runs (max_nodes instead bounds the search by work, the same on "
                    "every machine)")
    if pulp.LpStatus[status] != "Optimal":
        if cfg.memory_budget_bytes is not None and pulp.LpStatus[status] == "Infeasible":
            need = _min_memory(problem)
            raise ShardflowError(
                f"no plan fits memory_budget_bytes={cfg.memory_budget_bytes:,} on mesh {list(cfg.mesh_shape)}: "
                f"the least any plan {'running the ops op_placements pins as given ' if problem.pins else ''}needs "
                f"is about {need:,} bytes per rank{_of_instances(cfg)}; raise the budget or use a larger mesh"
                + (f" (or pin fewer ops: {len(problem.pins)} pinned)" if problem.pins else ""))
        raise ShardflowError(f"the ILP solver ended with status {pulp.LpStatus[status]} before finding a plan "
                             f"(time_limit_s={cfg.time_limit_s}, max_nodes={cfg.max_nodes}); raise time_limit_s or "
                             "max_nodes, or set mip_rel_gap")
    choice = {}
    for a, vs in s.items():
        vals = [v.value() or 0.0 for v in vs]
        choice[a] = int(np.argmax(vals))
    return [choice[g.alias] for g in groups]


_MB = 1e6  # memory rows in MB keep the constraint matrix well scaled
# Costs in microseconds keep the coefficients well conditioned. (Expressions are built from (variable,
# coefficient) pairs, each variable once: PuLP's operators make an expression per term, seconds of the
# search on a 3-D mesh.)
_SCALE = 1e6
#: edges as flows where those need fewer than 1 / FLOWS_WHEN of the pairs' variables (_solve_ilp)
FLOWS_WHEN = 2


def _pair_terms(prob, n: int, blk: EdgeBlock, s: dict) -> list:
    """Edge block ``n`` as ``e[u, v] = [producer makes spec u] * [consumer needs spec v]``, linearized
    exactly by its row sums (the producer's one-hot, summed per spec) and column sums; its objective
    terms."""
    import pulp

    a, b, m = blk.src, blk.dst, blk.cost
    e = [[pulp.LpVariable(f"e{n}_{u}_{v}", lowBound=0) for v in range(m.shape[1])] for u in range(m.shape[0])]
    for u in range(m.shape[0]):
        prob += _affine([(x, 1.0) for x in e[u]]
                        + [(s[a][i], -1.0) for i, r in enumerate(blk.rows) if r == u]) == 0, f"r{n}_{u}"
    for v in range(m.shape[1]):
        prob += _affine([(e[u][v], 1.0) for u in range(m.shape[0])]
                        + [(s[b][j], -1.0) for j, c in enumerate(blk.cols) if c == v]) == 0, f"c{n}_{v}"
    return [(e[u][v], float(m[u, v]) * _SCALE) for u in range(m.shape[0]) for v in range(m.shape[1]) if m[u, v]]


def _flow_terms(prob, n: int, blk: EdgeBlock, s: dict, graph) -> list:
    """Edge block ``n`` as a unit of flow over ``graph`` (:func:`~.connect.step_graph` of its tensor) from
    the spec the producer makes to the spec the consumer needs, each step priced: at 0/1 choices its
    cheapest is connect's shortest path, the block's cost; its LP bound is the pairs' (a transport
    whose costs are a graph's shortest paths is a min-cost flow over the graph). Its objective terms."""
    import pulp

    nodes, steps = graph
    at = {sp: k for k, sp in enumerate(nodes)}
    f = [pulp.LpVariable(f"f{n}_{k}", lowBound=0) for k in range(len(steps))]
    balance: dict[int, list] = defaultdict(list)  # in - out + made - needed = 0 at every spec
    for k, (u, v, _) in enumerate(steps):
        balance[u].append((f[k], -1.0))
        balance[v].append((f[k], 1.0))
    for i, r in enumerate(blk.rows):
        balance[at[blk.have[r]]].append((s[blk.src][i], 1.0))
    for j, c in enumerate(blk.cols):
        balance[at[blk.needed[c]]].append((s[blk.dst][j], -1.0))
    for u, terms in sorted(balance.items()):
        prob += _affine(terms) == 0, f"b{n}_{u}"
    return [(f[k], c * blk.count * _SCALE) for k, (_, _, c) in enumerate(steps) if c]


def _affine(pairs: list):
    """A PuLP expression of ``(variable, coefficient)`` pairs, each variable once."""
    import pulp

    return pulp.LpAffineExpression(pairs)


def _memory_rows(problem: Problem) -> list[tuple[dict[tuple[int, int], float], float]]:
    """One row per step: coefficients of ``s[alias, i]`` (parameters + live activations) and the
    bytes that no choice changes (whole graph inputs); the activations and inputs counted once per
    instance of the program the rank holds (``program_instances``: a pipeline stage with states)."""
    mesh_shape = problem.mesh_shape
    k = problem.cfg.program_instances
    base: dict[tuple[int, int], float] = defaultdict(float)
    for g in problem.groups:
        seen = set()
        for i, ch in enumerate(g.choices):
            for op in g.members:
                for t, sp in zip(op.inputs, ch[id(op)].input_specs):
                    if t.is_constant and (id(t), i, sp) not in seen:
                        seen.add((id(t), i, sp))
                        base[(g.alias, i)] += problem.param_bytes(t, sp)
    rows, keys = [], set()
    for live in problem.live_sets():
        row = dict(base)
        fixed = 0.0
        for t in live:
            p = problem.producer_of.get(id(t))
            if p is None:
                fixed += k * local_bytes(t, problem.input_specs[t.name], mesh_shape)
                continue
            g = problem.group_of[id(p)]
            for i, ch in enumerate(g.choices):
                row[(g.alias, i)] = row.get((g.alias, i), 0.0) + k * local_bytes(
                    t, ch[id(p)].output_specs[p.outputs.index(t)], mesh_shape)
        key = (tuple(sorted((k, round(v)) for k, v in row.items())), round(fixed))
        if key not in keys:
            keys.add(key)
            rows.append((row, fixed))
    return rows


def _min_memory(problem: Problem) -> int:
    """The smallest per-rank memory any plan in the search space needs (an ILP on memory alone)."""
    import pulp

    rows = _memory_rows(problem)
    classes = sorted({g.alias for g in problem.groups})
    n = {g.alias: len(g.choices) for g in problem.groups}
    prob = pulp.LpProblem("min_memory", pulp.LpMinimize)
    s = {a: [pulp.LpVariable(f"s_{a}_{i}", cat="Binary") for i in range(n[a])] for a in classes}
    peak = pulp.LpVariable("peak", lowBound=0)
    for a in classes:
        prob += pulp.lpSum(s[a]) == 1
    for row, fixed in rows:
        prob += pulp.lpSum(c * s[a][i] for (a, i), c in row.items() if c) + fixed <= peak
    prob += peak
    with _quiet_stdout():
        prob.solve(_solver(problem.cfg))
    return int(math.ceil(peak.value() or 0))


@contextlib.contextmanager
def _quiet_stdout():
    """The process's standard output (file descriptor 1) sent to a temporary file while the block
    runs, and what was written there logged at debug level: HiGHS prints its banner from C++ when
    highspy makes a solver, before PuLP can turn its output off, which put two lines of licence
    text into ``shardflow plan``'s stdout (and library code does not print)."""
    import ctypes
    import os
    import sys
    import tempfile

    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # (no file descriptor 1: nothing to keep quiet)
        yield
        return
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        libc = None
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield
        finally:
            if libc is not None:
                libc.fflush(None)  # (C's buffered output, into the file before it is put back)
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace").strip()
            if text:
                log.debug("solver output: %s", text)


def _solver(cfg: DistributedConfig, time_limit_s: float | None = None):
    import pulp

    limit = cfg.time_limit_s if time_limit_s is None else time_limit_s
    if cfg.solver == "highs":
        return pulp.HiGHS(msg=False, timeLimit=limit, gapRel=cfg.mip_rel_gap, threads=1)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=limit, gapRel=cfg.mip_rel_gap, threads=1,
                             maxNodes=cfg.max_nodes)


# ----------------------------------------------------------------------------------------------
# baselines

def _follow(problem: Problem, pick) -> dict[int, OpShardSpec]:
    """Assign ops in order: ``pick(op, candidates, assign)`` may choose; otherwise the candidate
    whose inputs arrive without resharding (most parallel first), else replicated. Baselines
    resolve partial sums where they arise (no :data:`~.rules.PARTIAL_SUMS` strategies)."""
    assign: dict[int, OpShardSpec] = {}
    for op in problem.graph.nodes:
        cands = ([c for c in problem.strategies[id(op)] if PARTIAL_SUMS not in c.assignment]
                 or problem.strategies[id(op)])  # (a pinned op may keep partial-sum strategies alone)
        chosen = pick(op, cands, assign)
        assign[id(op)] = chosen if chosen is not None else _cheapest(problem, op, cands, assign)
    return assign


def _cheapest(problem: Problem, op: Operator, cands: list[OpShardSpec], assign) -> OpShardSpec:
    """The candidate with the least resharding + compute given the inputs' specs so far (most
    parallel on ties)."""
    def key(c):
        comm = sum(problem.edge_cost(t, sp, assign) for t, sp in zip(op.inputs, c.input_specs))
        return comm + c.compute_cost, -c.parallelism
    return min(cands, key=key)


def _is_weight_matmul(op: Operator) -> int | None:
    """Input position of the constant weight of a matmul-like op (a 2-D constant read by the
    top-level reduction), or None. Scalar inputs computed at run time (a MatMulInteger's zero point
    of its activation, from DynamicQuantizeLinear) do not count as a second activation."""
    if len(op.task.outputs) != 1 or not isinstance(op.task.outputs[0], GridCompute):
        return None
    if not any(isinstance(n, Reduce) and n.op == "sum" for n in walk(op.task.outputs[0].value)):
        return None
    consts = [k for k, t in enumerate(op.inputs) if t.is_constant and t.ndim == 2]
    acts = [k for k, t in enumerate(op.inputs) if not t.is_constant and t.ndim > 0]
    return consts[0] if len(consts) >= 1 and len(acts) == 1 else None


def _megatron(problem: Problem, kept_whole: list[str] | None = None, greedy: list | None = None
              ) -> dict[int, OpShardSpec]:
    """Column-parallel then row-parallel weight matmuls over the last mesh axis; attention follows
    the column-parallel projections head-wise; an embedding table larger than its output is split
    by rows (vocab-parallel); everything else follows or stays replicated. The other mesh axes, if
    any, are data parallel (Megatron-LM's DP x TP): weights whole along them, activations split by
    their first dim (the batch) where they can be and kept so, without collectives between them.

    A column-parallel product whose split output is resharded before a row-parallel product reads
    it (attention whose heads do not divide over the axis: GPT-2 XL's 25 on 2 ranks, or a Llama's 2
    key/value heads on 4) is not split: the ops are assigned again with it replicated, until no
    such product is left. Each round keeps whole only the products resharded nearest to them (a
    key projection's, at its own reshape), since the others may have broken because of those (the
    query projection's heads, when the keys were split wrongly): queries stay split by heads
    with the keys and values whole. ``kept_whole`` gets the names of the products so kept whole;
    ``greedy`` the first, greedy assignment when it differs from the result (the ILP's safety net
    weighs it too: under a memory budget such a plan may be the cheapest that fits, as for an
    unrolled LSTM, whose steps read the whole state)."""
    axis = len(problem.mesh_shape) - 1
    data_axes = range(axis)
    graph_inputs = {id(t) for t in problem.graph.inputs}
    banned: set[int] = set()  # weight products kept whole

    def only_axis(c: OpShardSpec) -> bool:
        return all(v is None for m, v in enumerate(c.assignment) if m != axis)

    def data_parallel(op: Operator, c: OpShardSpec, assign) -> bool:
        # along the data axes: constants whole, activations as they arrive, nothing partial; a
        # graph input whole along them may be sliced by its first dim, the batch (free)
        for m in data_axes:
            for t, sp in zip(op.inputs, c.input_specs):
                p = sp.placements[m]
                if t.is_constant:
                    if not isinstance(p, Replicate):
                        return False
                    continue
                was = problem.source_spec(t, assign).placements[m]
                if p != was and not (isinstance(was, Replicate) and p == Shard(0) and id(t) in graph_inputs):
                    return False
            if any(not isinstance(o.placements[m], (Replicate, Shard)) for o in c.output_specs):
                return False
        return True

    def best(op, matches, assign):
        return _cheapest(problem, op, matches, assign) if matches else None

    def pick(op, cands, assign):
        w = problem.weight_input[id(op)]
        if w is None:
            return _vocab_parallel(op, cands, assign)
        if id(op) in banned:
            return None
        act = next(k for k, t in enumerate(op.inputs) if not t.is_constant)
        src = problem.source_spec(op.inputs[act], assign)
        incoming_sharded = src is not None and not isinstance(src.placements[axis], Replicate)
        row, column = [], []
        for c in cands:
            if c.assignment[axis] is None or not data_parallel(op, c, assign):
                continue
            wp = c.input_specs[w].placements[axis]
            ap = c.input_specs[act].placements[axis]
            if incoming_sharded and isinstance(ap, Shard) and ap == src.placements[axis] and isinstance(wp, Shard):
                row.append(c)  # row-parallel: consume the sharded activation, produce a partial sum
            if not incoming_sharded and isinstance(wp, Shard) and isinstance(ap, Replicate) \
                    and isinstance(c.output_specs[0].placements[axis], Shard):
                column.append(c)  # column-parallel
        return best(op, row or column, assign)

    def _vocab_parallel(op, cands, assign):
        # A constant table split by rows (Megatron-LM's vocab-parallel embedding) when it is larger
        # than the rows it gathers (the all-reduce of the output moves fewer bytes than it saves)
        # and it is looked up by the model's input, its tokens: a table looked up at positions the
        # model computes (a rotary cache's cos and sin) stays whole, as in Megatron-LM.
        tables = _constant_tables(op)
        if not (tables and sum(t.nbytes for t in tables) > op.outputs[0].nbytes
                and _looked_up_by_inputs(op, graph_inputs)):
            return None
        return best(op, [c for c in cands if c.assignment[axis] == OFFSET_ROWS and data_parallel(op, c, assign)],
                    assign)

    def restricted(op, cands, assign):
        chosen = pick(op, cands, assign)
        if chosen is not None:
            return chosen
        # (no candidate keeps the data axes' split: replicated along them, gathered)
        ok = [c for c in cands if data_parallel(op, c, assign)] or [c for c in cands if only_axis(c)] or cands
        # (row ranges of a constant table only where pick chose them: a vocab-parallel embedding)
        if _constant_tables(op):
            ok = [c for c in ok if c.assignment[axis] != OFFSET_ROWS] or ok
        # Work whose activations are whole along the axis stays whole (only weights start a split).
        acts = [problem.source_spec(t, assign) for t in op.inputs if not t.is_constant]
        if acts and all(sp is not None and isinstance(sp.placements[axis], Replicate) for sp in acts):
            ok = [c for c in ok if c.assignment[axis] is None] or ok
        # A partial sum (after a row-parallel matmul) is all-reduced to a whole tensor.
        partial_in = [k for k, t in enumerate(op.inputs)
                      if (sp := problem.source_spec(t, assign)) is not None and sp.partial_axes]
        if partial_in:
            ok = [c for c in ok if all(isinstance(c.input_specs[k].placements[axis], Replicate)
                                       for k in partial_in)] or ok
        return _cheapest(problem, op, ok, assign)

    first = None
    while True:
        assign = _follow(problem, restricted)
        first = first or assign
        unmatched = {k: d for k, d in _unmatched_column_splits(problem, assign, axis).items() if k not in banned}
        if not unmatched:
            if kept_whole is not None:  # (a banned product may still be row-parallel)
                kept_whole.extend(op.name for op in problem.graph.nodes
                                  if id(op) in banned and assign[id(op)].assignment[axis] is None)
            if greedy is not None and first is not assign:
                greedy.append(first)
            return assign
        nearest = min(unmatched.values())
        banned |= {k for k, d in unmatched.items() if d == nearest}


def _constant_tables(op: Operator) -> list[Tensor]:
    """The inputs ``op`` can take row ranges of (:meth:`~..ir.graph.Operator.offset_split_dims`)
    when they are all constants (a lookup table and its scales); else none."""
    tables = [op.inputs[pos] for pos, _ in op.offset_split_dims()]
    return tables if all(t.is_constant for t in tables) else []


#: ops that pass their one activation input's values on (views, casts)
_VALUE_VIEWS = frozenset({"Reshape", "Transpose", "Cast", "Identity", "Unsqueeze", "Squeeze", "Flatten"})


def _looked_up_by_inputs(op: Operator, graph_inputs: set[int]) -> bool:
    """Whether every activation ``op`` reads (a lookup's indices) is a graph input, maybe viewed or
    cast: the model's tokens, not positions it computes."""
    acts = [t for t in op.inputs if not t.is_constant]
    for t in acts:
        while t.producer is not None and t.producer.op_type in _VALUE_VIEWS:
            ins = [u for u in t.producer.inputs if not u.is_constant]
            if len(ins) != 1:
                break
            t = ins[0]
        if id(t) not in graph_inputs:
            return False
    return bool(acts)


def _unmatched_column_splits(problem: Problem, assign: dict[int, OpShardSpec], axis: int) -> dict[int, int]:
    """The column-parallel weight products (weight and output split over ``axis``, activation
    whole) of ``assign`` whose split output, followed through the ops that keep it split, is
    resharded before a row-parallel product reads it (Megatron's pairing broken, with collectives
    inside the block), each with the number of ops from it to the nearest resharding."""
    consumers: dict[int, list[tuple[Operator, int]]] = {}
    for op in problem.graph.nodes:
        for k, t in enumerate(op.inputs):
            consumers.setdefault(id(t), []).append((op, k))

    def split(sp: TensorShardSpec) -> bool:
        return isinstance(sp.placements[axis], Shard)

    def row_parallel(op: Operator, k: int) -> bool:
        w = problem.weight_input[id(op)]
        return w is not None and w != k and split(assign[id(op)].input_specs[w])

    bad: dict[int, int] = {}
    for op in problem.graph.nodes:
        w = problem.weight_input[id(op)]
        c = assign[id(op)]
        if w is None or not (split(c.input_specs[w]) and split(c.output_specs[0])):
            continue
        if any(split(sp) for t, sp in zip(op.inputs, c.input_specs) if not t.is_constant):
            continue  # (row-parallel, or an activation split already)
        level, depth, seen = [op.outputs[0]], 1, set()  # (breadth first: the nearest resharding's depth)
        while level and id(op) not in bad:
            following = []
            for t in level:
                if id(t) in seen:
                    continue
                seen.add(id(t))
                src = problem.source_spec(t, assign)
                for reader, k in consumers.get(id(t), ()):
                    if assign[id(reader)].input_specs[k].placements[axis] != src.placements[axis]:
                        bad[id(op)] = depth
                        break
                    if not row_parallel(reader, k):  # (else the pair closes with its partial sum)
                        following.extend(u for u, sp in zip(reader.outputs, assign[id(reader)].output_specs)
                                         if split(sp))
            level, depth = following, depth + 1
    return bad


def _data_parallel(problem: Problem) -> dict[int, OpShardSpec]:
    """Weights stay whole on every rank; activations are split wherever that is cheapest (the
    batch dim, in practice), following the ops in order."""

    def pick(op, cands, assign):
        ok = [c for c in cands if all(sp.is_replicated for t, sp in zip(op.inputs, c.input_specs) if t.is_constant)]
        return _cheapest(problem, op, ok, assign) if ok else None

    return _follow(problem, pick)


def _replicate(problem: Problem) -> dict[int, OpShardSpec]:
    nd = len(problem.mesh_shape)
    return {id(op): problem._with_cost(op, replicated_strategy(op, nd)) for op in problem.graph.nodes}


BASELINES = {"megatron": _megatron, "data": _data_parallel, "replicate": _replicate}


def search(graph: FlowGraph, distributed_config) -> "ShardingPlan":
    """Find a sharding plan for ``graph`` on the mesh of ``distributed_config``.

    Parameters
    ----------
    graph
        A simplified FlowGraph (``load_onnx``).
    distributed_config
        A dict of the keys documented in :mod:`shardflow.compiler.parallel.config`.

    Returns
    -------
    ShardingPlan
        The cheapest plan found under the cost model (``algo="ilp"``), or the named baseline.
        Without ``memory_budget_bytes``, on a device whose memory is known (the ``h100``
        profile's 81559 MiB, a ``device`` dict's ``memory_GB``), a plan needing more than
        :data:`~.cost.DEVICE_MEMORY_FRACTION` of it per rank is searched again with that as the
        budget (a warning says so, and a note in the plan).

    Raises
    ------
    ShardflowError
        When no plan fits the budget, or the device's memory as above; for a baseline
        (``algo`` other than ``ilp``) above either.
    ConfigError
        For a bad ``distributed_config``.
    """
    from .plan import ShardingPlan

    cfg = DistributedConfig.from_dict(distributed_config)
    if cfg.pipeline_stages != 1:
        raise ShardflowError(f"pipeline_stages = {cfg.pipeline_stages!r}: search plans one stage's graph on its mesh; "
                             "compile cuts the graph into stages (parallel/pipeline.py) and plans each on "
                             f"{list(cfg.stage_config().mesh_shape)}")
    if cfg.preload_plan:
        return ShardingPlan.load(cfg.preload_plan, graph=graph)
    plan = _search(graph, cfg)
    device = cfg.device or H100
    cap = device_memory_cap(cfg)
    if cfg.memory_budget_bytes is not None or cap is None:
        return plan
    # No budget given: keep the plan within the device's memory (DEVICE_MEMORY_FRACTION of it).
    if plan.memory_bytes <= cap:
        return plan
    need = f"{plan.memory_bytes:,} bytes per rank (parameters and peak activations{_of_instances(cfg)})"
    held = f"{DEVICE_MEMORY_FRACTION:g} of the {device.name}'s {device.memory_bytes:,.0f} bytes"
    if cfg.algo != "ilp":
        raise ShardflowError(f"the {cfg.algo} plan on mesh {list(cfg.mesh_shape)} needs {need}, above {held}: use "
                             "algo='ilp' or a larger mesh (or, for a device with more memory, its memory_GB in "
                             "distributed_config['device'], or memory_budget_bytes)")
    log.warning("the plan on mesh %s needs %s, above %s: searching again with memory_budget_bytes=%s",
                list(cfg.mesh_shape), need, held, f"{cap:,}")
    try:
        capped = _search(graph, dataclasses.replace(cfg, memory_budget_bytes=cap))
    except ShardflowError as exc:
        raise ShardflowError(f"the plan on mesh {list(cfg.mesh_shape)} needs {need}, above {held}, and none was "
                             f"found within that ({exc})") from None
    capped.search_seconds += plan.search_seconds
    capped.notes.append(f"planned under memory_budget_bytes={cap:,} ({held}; none was given): the cheapest plan "
                        f"without it needs {need}")
    return capped


def device_memory_cap(cfg: DistributedConfig) -> int | None:
    """The bytes a rank's plan may take of its device's memory without a ``memory_budget_bytes``:
    :data:`~.cost.DEVICE_MEMORY_FRACTION` of it, or ``None`` where the device's memory is not known."""
    device = cfg.device or H100
    return int(DEVICE_MEMORY_FRACTION * device.memory_bytes) if device.memory_bytes else None


def _search(graph: FlowGraph, cfg: DistributedConfig) -> "ShardingPlan":
    """:func:`search` for a validated ``cfg``, with its memory budget as given."""
    from .plan import ShardingPlan

    t0 = time.perf_counter()
    problem = Problem(graph, cfg)
    kept_whole: list[str] = []  # (what the Megatron baseline kept whole, for plan.txt)
    if cfg.algo == "ilp":
        picks = _solve_ilp(problem)
        assign = {}
        for g, i in zip(problem.groups, picks):
            assign.update(g.choices[i])
        algo = "ilp"
        # The grouped/aliased ILP searches a restricted space; never return worse than a baseline.
        best = problem.total_cost(assign)[0]
        greedy: list = []  # (the Megatron baseline's greedy assignment, where its pairs check changed it)
        alts = [(name, _megatron(problem, greedy=greedy) if name == "megatron" else fn(problem))
                for name, fn in BASELINES.items()]
        for name, alt in alts + [("megatron", g) for g in greedy]:
            if not _fits(problem, alt) or not problem.pins_hold(alt):
                continue
            c = problem.total_cost(alt)[0]
            if c < best * (1 - 1e-9):
                log.warning("ILP plan (%.4g s) is costlier than the %s baseline (%.4g s); using the baseline",
                            best, name, c)
                assign, best, algo = alt, c, f"ilp->{name}"
    else:
        assign = _megatron(problem, kept_whole=kept_whole) if cfg.algo == "megatron" else BASELINES[cfg.algo](problem)
        algo = cfg.algo
    plan = ShardingPlan.from_assignment(problem, assign, algo=algo, search_seconds=time.perf_counter() - t0)
    if problem.pins:
        plan.pinned = {name: pin.text for name, pin in problem.pins.items()}
        plan.notes.append(f"op_placements: {len(problem.pins)} op(s) pinned, the rest planned around them: "
                          f"{_first_names(list(problem.pins))}")
    padded = graph.meta.get("padded_heads")
    if padded:
        plan.pad_heads = int(padded["ranks"])
        parts = []
        if padded["groups"]:
            grouped = padded.get("grouped", {})

            def group(h, h2, k):
                if h not in grouped:
                    return f"{h} -> {h2} ({k} products)"
                hkv, g, g2 = grouped[h]
                return f"{h} -> {h2} ({k} products; {hkv} key/value groups of {g} -> {g2}, copies of their first)"

            parts.append("heads padded to split over {} ranks (copies of head 0, their output rows zero): {}".format(
                padded["ranks"], ", ".join(group(*grp) for grp in padded["groups"])))
        if padded.get("replicated"):
            parts.append("key/value heads replicated to one a rank (Megatron-LM's layout for fewer of them than "
                         "ranks): {}".format(", ".join(f"{h} -> {h2} ({k} products)"
                                                       for h, h2, k in padded["replicated"])))
        plan.notes.append("; ".join(parts) + f": {_first_names(padded['products'])}")
    if algo == "megatron" and kept_whole:
        plan.notes.append(
            f"megatron: {len(kept_whole)} weight products kept whole: split by columns, their outputs would be "
            f"resharded before a row-parallel product reads them (attention heads that do not divide over "
            f"{problem.mesh_shape[-1]} ranks, or a single key/value head, which every rank computes whole as "
            f"Megatron-LM does?): {_first_names(kept_whole)}")
    if cfg.memory_budget_bytes is not None and plan.memory_bytes > cfg.memory_budget_bytes and cfg.algo != "ilp":
        raise ShardflowError(f"the {cfg.algo} plan needs {plan.memory_bytes:,} bytes per rank, above "
                             f"memory_budget_bytes={cfg.memory_budget_bytes:,}; use algo='ilp' or raise the budget")
    return plan


def _of_instances(cfg: DistributedConfig) -> str:
    """What a message about a plan's memory adds when a rank holds several instances of the program."""
    if cfg.program_instances == 1:
        return ""
    return (f", activations and states x {cfg.program_instances}: a pipeline stage keeping states holds an "
            "instance of its program per microbatch")


def _first_names(names: list[str]) -> str:
    """The first four ``names`` for a plan.txt note, ``...`` for the rest."""
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _fits(problem: Problem, assign) -> bool:
    budget = problem.cfg.memory_budget_bytes
    if budget is None:
        return True
    params, peak = problem.memory(assign)
    return params + problem.cfg.program_instances * peak <= budget
