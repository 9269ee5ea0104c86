"""``connect``: the communication that turns one shard spec of a tensor into another.

A :class:`Resharding` is a sequence of :class:`CommStep` s, each changing the placement of one
mesh axis, following DTensor's transition table:

==============  ===================  ========================================
from → to       step                 note
==============  ===================  ========================================
S(a) → R        ``all_gather``
P → R           ``all_reduce``
P → S(b)        ``reduce_scatter``
R → S(b)        ``local_slice``      free: each rank keeps its chunk
S(a) → S(b)     ``all_to_all``       never all-gather then slice
R → P(op)       ``local_partial``    free: ``sum`` keeps the value on the group's
                                     first rank (zeros elsewhere); max, min, avg
                                     keep it everywhere
S(a) → P        via ``R``            all-gather, then local partial
P(x) → P(y)     via ``R``            all-reduce with x, then local partial y
==============  ===================  ========================================

**Order.** A step on mesh axis ``i`` is legal only when it keeps the nested-split order of the
placement module (a dim is split by the lowest mesh axis first): un-sharding dim ``a`` (gather
or all-to-all) needs ``i`` to be the *last* axis splitting ``a``, and sharding dim ``b``
(slice, reduce-scatter, all-to-all) needs no later axis to split ``b`` already. So inner
axes are un-sharded before outer ones, and outer axes shard before inner ones. Among the legal
orders, :func:`connect` picks the cheapest: a shortest-path search over the intermediate specs
in which every mesh axis holds ``R``, a ``Shard`` of any of the tensor's dims, or its source or
destination placement (at most ``(rank + 3)^ndim`` specs; one search from a source serves every
destination), with each step priced by the cost model on the tensor as it is at that step.
A detour through another dim can pay: ``S(0)P(sum) → S(1)R`` on ``[2, 2]`` reduce-scatters
axis 1 to a dim axis 0 does not split, then moves the splits with all-to-alls, for less than
reducing first.
This does reductions before gathers whenever that moves fewer bytes (``P(sum)S(0) → RR``
all-reduces the shard, then gathers), and prefers fewer steps among equal costs. Specs mixing
different ``Partial`` reductions are never formed.

**Bytes.** ``CommStep.bytes`` is the ``B`` of the cost formulas in
:mod:`~shardflow.compiler.parallel.cost`, computed from the *padded* shard shape (the largest
shard; collectives pad uneven chunks to it): the per-rank buffer for all-reduce, the gathered
buffer for all-gather, the unscattered input for reduce-scatter, and the group's total for
all-to-all. Local steps move nothing and cost 0.
"""
from __future__ import annotations

import heapq
import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError, ShapeError, ShardflowError
from ..ir.graph import Operator, Tensor
from .comm_ops import AllGather, AllReduce, AllToAll, LocalPartial, LocalSlice, ReduceScatter
from .cost import CostModel, itemsize
from .mesh import DeviceMesh
from .placement import Partial, Placement, Replicate, Shard, TensorShardSpec, padded_chunk

__all__ = ["CommStep", "Resharding", "ReshardingError", "connect", "lower_resharding", "STEP_KINDS"]

STEP_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "local_slice", "local_partial")


class ReshardingError(ShardflowError):
    """The requested resharding is not supported (a spec mixing partial reductions)."""


@dataclass(frozen=True)
class CommStep:
    """One transition of one mesh axis.

    Attributes
    ----------
    kind
        One of :data:`STEP_KINDS`.
    mesh_axis
        The mesh axis whose placement changes.
    src, dst
        The tensor's spec before and after the step.
    tensor_dim
        The dim gathered (all-gather, all-to-all's source dim) or split (reduce-scatter, local
        slice); ``None`` for all-reduce and local partial.
    dst_dim
        For all-to-all, the dim that becomes split.
    reduce_op
        The reduction of all-reduce and reduce-scatter, or the ``Partial`` op a local partial makes.
    bytes
        ``B`` of the cost formula (see the module docstring); 0 for local steps.
    cost
        Modeled time in seconds.
    """

    kind: str
    mesh_axis: int
    src: TensorShardSpec
    dst: TensorShardSpec
    tensor_dim: int | None = None
    dst_dim: int | None = None
    reduce_op: str | None = None
    bytes: int = 0
    cost: float = 0.0

    def __str__(self) -> str:
        what = [f"axis {self.mesh_axis}"]
        if self.tensor_dim is not None:
            what.append(f"dim {self.tensor_dim}" + (f"->{self.dst_dim}" if self.dst_dim is not None else ""))
        if self.reduce_op is not None:
            what.append(self.reduce_op)
        if self.bytes:
            what.append(f"{self.bytes} B, {self.cost * 1e6:.3g} us")
        return f"{self.kind}({', '.join(what)}): {self.src} -> {self.dst}"


@dataclass(frozen=True)
class Resharding:
    """The steps turning ``src`` into ``dst`` for a tensor of ``shape`` and ``dtype``, and their
    total modeled ``cost`` in seconds (``steps`` is empty and ``cost`` 0 when ``src == dst``)."""

    src: TensorShardSpec
    dst: TensorShardSpec
    shape: tuple[int, ...]
    dtype: str
    steps: tuple[CommStep, ...]
    cost: float

    @property
    def bytes(self) -> int:
        """Total ``B`` over the steps."""
        return sum(s.bytes for s in self.steps)

    def __str__(self) -> str:
        head = f"{self.src} -> {self.dst} for {self.dtype}{list(self.shape)}: {self.cost * 1e6:.3g} us"
        return "\n".join([head] + [f"  {s}" for s in self.steps])


_CACHE: "weakref.WeakKeyDictionary[CostModel, dict]" = weakref.WeakKeyDictionary()


def connect(src: TensorShardSpec | str, dst: TensorShardSpec | str, shape: Sequence[int], dtype: str,
            mesh: DeviceMesh, cost_model: CostModel) -> Resharding:
    """The cheapest sequence of steps turning ``src`` into ``dst`` (see the module docstring).

    Parameters
    ----------
    src, dst
        Shard specs (or their text, ``"S(0)R"``), one placement per mesh axis.
    shape, dtype
        The tensor's global shape and dtype.
    mesh
        The device mesh.
    cost_model
        Prices the steps; results are cached per cost model.

    Raises
    ------
    ReshardingError
        For a spec mixing ``Partial`` reductions. (``P(x) → P(y)`` on one axis with ``x != y``
        reduces to ``R`` first, then makes the new partial value locally.)
    ShapeError
        When a spec does not fit the mesh or the tensor's rank.
    """
    src = TensorShardSpec.parse(src) if isinstance(src, str) else src
    dst = TensorShardSpec.parse(dst) if isinstance(dst, str) else dst
    shape = tuple(int(d) for d in shape)
    dtype = str(dtype)
    key = (src, dst, shape, dtype, mesh)
    cache = _CACHE.setdefault(cost_model, {})
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = _connect(src, dst, shape, dtype, mesh, cost_model, cache)
    return hit


def _connect(src, dst, shape, dtype, mesh, cost_model, cache: dict) -> Resharding:
    if cost_model.mesh is not mesh and cost_model.mesh != mesh:
        raise ConfigError(f"connect: the cost model is for {cost_model.mesh}, not {mesh}")
    for spec in (src, dst):
        if len(spec) != mesh.ndim:
            raise ShapeError(f"shard spec {spec} has {len(spec)} placements but the mesh has {mesh.ndim} axes")
        spec.check_ndim(len(shape))
        if len(spec.partial_ops) > 1:
            raise ReshardingError(f"shard spec {spec} mixes partial reductions {list(spec.partial_ops)}; their "
                                  "combined value depends on the reduction order")
    if src == dst:
        return Resharding(src, dst, shape, dtype, (), 0.0)
    isz = itemsize(dtype)
    # the partial sums of bfloat16 travel in float32 (passes/precision.py ReduceBfloat16InFloat32)
    rsz = 4 if str(dtype) == "bfloat16" else isz
    # One search from src reaches every spec (its tree is kept for the other destinations); a
    # destination's partial placements are states of their own (a detour through a partial never
    # pays, so the other destinations' paths are those of the search without them).
    extra = tuple(q if isinstance(q, Partial) else None for q in dst)
    tree_key = ("tree", src, shape, isz, rsz, extra)
    prev = cache.get(tree_key)
    if prev is None:
        prev = cache[tree_key] = _shortest_paths(src, extra, shape, isz, rsz, mesh, cost_model, cache)
    start, goal = tuple(p._key() for p in src), tuple(p._key() for p in dst)
    if goal not in prev:
        raise ReshardingError(f"no legal sequence of steps turns {src} into {dst}")  # unreachable by construction
    path = []
    at = goal
    while at != start:
        at, step = prev[at]
        path.append(step)
    path.reverse()
    return Resharding(src, dst, shape, dtype, tuple(path), sum(s.cost for s in path))


def _axis_placements(ndim: int, others) -> list[Placement]:
    """``R``, ``S(d)`` for every dim of a tensor of rank ``ndim`` and the placements ``others``, in one
    order (placements' keys: searches on a shape share their moves)."""
    return sorted({Replicate(), *(Shard(d) for d in range(ndim)), *others}, key=lambda x: x._key())


def step_graph(shape: Sequence[int], dtype: str, partials: Sequence[Sequence[Partial]], mesh: DeviceMesh,
               cost_model: CostModel) -> tuple[list[TensorShardSpec], list[tuple[int, int, float]]]:
    """The specs of a tensor of ``shape`` and ``dtype`` on ``mesh`` (every axis ``R``, a ``Shard`` of
    any dim, or a partial ``partials`` lists for it; none mixing partial reductions) and the legal
    steps between them, ``(from, to, seconds)`` by the specs' indices: the graph whose shortest
    paths :func:`connect` takes (the planner's edges are flows over it). Cached per cost model."""
    shape = tuple(int(d) for d in shape)
    isz = itemsize(dtype)
    rsz = 4 if str(dtype) == "bfloat16" else isz
    per_axis = [_axis_placements(len(shape), partials[a]) for a in range(mesh.ndim)]
    cache = _CACHE.setdefault(cost_model, {})
    key = ("graph", shape, isz, rsz, tuple(tuple(p._key() for p in c) for c in per_axis), mesh)
    hit = cache.get(key)
    if hit is None:
        nodes = [TensorShardSpec(c) for c in itertools.product(*per_axis)]
        nodes = [n for n in nodes if len(n.partial_ops) <= 1]
        at = {n: k for k, n in enumerate(nodes)}
        arcs = []
        for k, n in enumerate(nodes):
            for axis, cands in enumerate(per_axis):
                for q in cands:
                    if q != n.placements[axis]:
                        step = _step(n, axis, q, shape, isz, mesh, cost_model, rsz)
                        if step is not None:
                            arcs.append((k, at[step.dst], step.cost))
        hit = cache[key] = (nodes, arcs)
    return hit


def _shortest_paths(src: TensorShardSpec, extra: tuple, shape: tuple[int, ...], isz: int, rsz: int,
                    mesh: DeviceMesh, cost_model: CostModel, cache: dict) -> dict:
    """Dijkstra from ``src`` over the specs whose every axis holds ``R``, a ``Shard`` of any dim, its
    placement in ``src`` or the partial ``extra`` names for it (a destination's; a partial that neither
    end holds is never on a cheapest path: entered only from ``R`` and left by a reduction, it costs
    what staying ``R`` does not): for every spec reached (as a tuple of its placements' keys, hashed
    and compared in C), its predecessor and the step from it. Priorities are integer femtoseconds
    (exact sums), then the step count."""
    candidates = [_axis_placements(len(shape), [p] + ([q] if q is not None else []))
                  for p, q in zip(src.placements, extra)]
    keys = [tuple(p._key() for p in c) for c in candidates]
    by_key = [dict(zip(k, c)) for k, c in zip(keys, candidates)]
    # a spec's legal steps (femtoseconds, the spec reached, the step), listed once for every search on
    # this shape with these candidates, each step made once for every search on this shape
    moves_of = cache.setdefault(("moves", shape, isz, rsz, tuple(keys)), {})
    steps = cache.setdefault(("steps", shape, isz, rsz), {})

    def moves(cur: tuple) -> list:
        res = []
        spec = None
        for axis in reversed(range(mesh.ndim)):
            for q in keys[axis]:
                if q == cur[axis]:
                    continue
                hit = steps.get((cur, axis, q))
                if hit is None:
                    if spec is None:
                        spec = TensorShardSpec(tuple(by_key[a][k] for a, k in enumerate(cur)))
                    step = _step(spec, axis, by_key[axis][q], shape, isz, mesh, cost_model, rsz)
                    hit = steps[(cur, axis, q)] = () if step is None else (  # (): not a legal step
                        round(step.cost * 1e15), cur[:axis] + (q,) + cur[axis + 1:], step)
                if hit:
                    res.append(hit)
        return res

    start = tuple(p._key() for p in src)
    best = {start: (0, 0)}
    prev: dict[tuple, tuple[tuple, CommStep]] = {}
    heap = [(0, 0, 0, start)]
    tie = 1
    while heap:
        cost, nsteps, _, cur = heapq.heappop(heap)
        if (cost, nsteps) > best[cur]:
            continue
        out = moves_of.get(cur)
        if out is None:
            out = moves_of[cur] = moves(cur)
        for fs, nxt, step in out:
            cand = (cost + fs, nsteps + 1)
            old = best.get(nxt)
            if old is None or cand < old:
                best[nxt] = cand
                prev[nxt] = (cur, step)
                heapq.heappush(heap, (*cand, tie, nxt))
                tie += 1
    return prev


def _step(cur: TensorShardSpec, axis: int, q: Placement, shape: tuple[int, ...], isz: int, mesh: DeviceMesh,
          cm: CostModel, rsz: int | None = None) -> CommStep | None:
    """The step setting ``cur[axis]`` to ``q``, or ``None`` when it is not a legal single step
    (``isz``: bytes an element; ``rsz``: bytes an element of a reduction, default ``isz``)."""
    rsz = isz if rsz is None else rsz
    p = cur[axis]
    new = cur.with_placement(axis, q)
    if len(new.partial_ops) > 1:
        return None
    later = cur.placements[axis + 1:]

    def split_later(d: int) -> bool:
        return any(x.is_shard(d) for x in later)

    n = mesh.shape[axis]
    local = cur.padded_local_shape(shape, mesh.shape)

    def padded_to_group(d: int) -> int:  # elements of the local buffer with dim d padded to n equal chunks
        return math.prod(s for k, s in enumerate(local) if k != d) * n * padded_chunk(local[d], n)

    kind, dim, dst_dim, op, nbytes = None, None, None, None, 0
    if isinstance(p, Shard):
        if split_later(p.dim):
            return None
        if isinstance(q, Replicate):
            kind, dim, nbytes = "all_gather", p.dim, math.prod(local) * n * isz
        elif isinstance(q, Shard) and not split_later(q.dim):
            kind, dim, dst_dim, nbytes = "all_to_all", p.dim, q.dim, n * padded_to_group(q.dim) * isz
    elif isinstance(p, Replicate):
        if isinstance(q, Shard) and not split_later(q.dim):
            kind, dim = "local_slice", q.dim
        elif isinstance(q, Partial):
            kind, op = "local_partial", q.op
    elif isinstance(p, Partial):
        if isinstance(q, Replicate):
            kind, op, nbytes = "all_reduce", p.op, math.prod(local) * rsz
        elif isinstance(q, Shard) and not split_later(q.dim):
            kind, dim, op, nbytes = "reduce_scatter", q.dim, p.op, padded_to_group(q.dim) * rsz
    if kind is None:
        return None
    cost = 0.0 if kind.startswith("local_") else cm.collective(kind, nbytes, axis)
    return CommStep(kind, axis, cur, new, dim, dst_dim, op, nbytes, cost)


def lower_resharding(resharding: Resharding, x: Tensor, mesh: DeviceMesh, rank: int,
                     name: str = "") -> tuple[Tensor, list[Operator]]:
    """Build ``rank``'s ops for ``resharding``, applied to its local tensor ``x``.

    Steps over a mesh axis of size 1 change nothing and emit no op.

    Parameters
    ----------
    resharding
        From :func:`connect`.
    x
        ``rank``'s shard of the tensor under ``resharding.src``.
    mesh, rank
        The mesh and the global rank the ops are for (their attributes are rank-specific).
    name
        Prefix of the ops' names (default: generated).

    Returns
    -------
    tuple
        The rank's shard under ``resharding.dst`` (``x`` itself when there are no ops) and the new
        ops in execution order.
    """
    shape = resharding.shape
    want = resharding.src.local_shape(shape, mesh, rank)
    if x.shape != want:
        raise ShapeError(f"lower_resharding: rank {rank}'s shard of a {list(shape)} tensor under "
                         f"{resharding.src} has shape {want}, got {x.shape} (%{x.name})")
    coord = mesh.coord_of(rank)
    ops: list[Operator] = []
    for k, st in enumerate(resharding.steps):
        n, idx = mesh.shape[st.mesh_axis], coord[st.mesh_axis]
        if n == 1:
            continue
        before = st.src.local_bounds(shape, mesh, rank)
        after = st.dst.local_bounds(shape, mesh, rank)
        kw = {"name": f"{name}.{st.kind}{k}"} if name else {}
        axis = st.mesh_axis
        if st.kind == "all_gather":
            d = st.tensor_dim
            op = AllGather([x], mesh_axis=axis, dim=d, global_size=after[d][1] - after[d][0], group_size=n, **kw)
        elif st.kind == "all_to_all":
            d = st.tensor_dim
            op = AllToAll([x], mesh_axis=axis, src_dim=d, dst_dim=st.dst_dim, src_size=after[d][1] - after[d][0],
                          group_size=n, group_index=idx, **kw)
        elif st.kind == "all_reduce":
            op = AllReduce([x], mesh_axis=axis, op=st.reduce_op, group_size=n, **kw)
        elif st.kind == "reduce_scatter":
            op = ReduceScatter([x], mesh_axis=axis, dim=st.tensor_dim, op=st.reduce_op, group_size=n,
                               group_index=idx, **kw)
        elif st.kind == "local_slice":
            d = st.tensor_dim
            op = LocalSlice([x], dim=d, start=after[d][0] - before[d][0], stop=after[d][1] - before[d][0], **kw)
        else:
            op = LocalPartial([x], keep=st.reduce_op != "sum" or idx == 0, **kw)
        ops.append(op)
        x = op.outputs[0]
    return x, ops
