"""Run every rank's graph in one process, with in-memory collectives.

:func:`simulate` executes the per-rank graphs that partition produces in lockstep: each rank
runs its local ops until it reaches its next collective; when every rank has reached one, the
operands of each process group are combined exactly as the real collective would (padding
uneven chunks to :func:`~shardflow.compiler.parallel.placement.padded_chunk`, exchanging equal
blocks, trimming) and every rank continues. Ranks whose collective sequences differ raise
:class:`~shardflow.compiler.errors.GraphError` instead of hanging.

The kernels (:func:`all_reduce`, :func:`all_gather`, :func:`reduce_scatter`,
:func:`all_to_all`) take the operands of one group, in group order, and return each member's
result; tests reuse them as a reference for the runtime's communicators.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from ..errors import DtypeError, GraphError, ShapeError
from ..ir.expr import numpy_type
from ..ir.graph import RNG_STEP, FlowGraph, Operator
from .comm_ops import Collective
from .mesh import DeviceMesh
from .placement import chunk_bounds, padded_chunk

__all__ = ["simulate", "simulate_ranks", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "reduce_arrays"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# collective kernels: operands of one group (in group order) -> each member's result
# ---------------------------------------------------------------------------------------
def reduce_arrays(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    """Element-wise ``op`` (sum, max, min, avg) of same-shaped arrays, in their dtype.

    ``avg`` of integers rounds toward zero (as NCCL's ``ncclAvg``).
    """
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ShapeError(f"reduction operands have different shapes {sorted(shapes)}")
    dtype = arrays[0].dtype
    if op == "max":
        return np.maximum.reduce(list(arrays)).astype(dtype, copy=False)
    if op == "min":
        return np.minimum.reduce(list(arrays)).astype(dtype, copy=False)
    acc = arrays[0].astype(dtype, copy=True)
    for a in arrays[1:]:
        acc = acc + a
    acc = acc.astype(dtype, copy=False)
    if op == "sum":
        return acc
    if op == "avg":
        if dtype.kind in "iu":
            return np.trunc(acc / len(arrays)).astype(dtype)
        return (acc / len(arrays)).astype(dtype)
    raise ValueError(f"unknown reduction {op!r}")


def _pad(a: np.ndarray, dim: int, size: int) -> np.ndarray:
    if a.shape[dim] == size:
        return a
    width = [(0, 0)] * a.ndim
    width[dim] = (0, size - a.shape[dim])
    return np.pad(a, width)


def _take(a: np.ndarray, dim: int, lo: int, hi: int) -> np.ndarray:
    return a[(slice(None),) * dim + (slice(lo, hi),)]


def all_reduce(arrays: Sequence[np.ndarray], op: str = "sum") -> list[np.ndarray]:
    """Every member gets the ``op`` of all operands."""
    r = reduce_arrays(arrays, op)
    return [r.copy() for _ in arrays]


def all_gather(arrays: Sequence[np.ndarray], dim: int, global_size: int) -> list[np.ndarray]:
    """Member ``j`` holds chunk ``j`` of a dim of ``global_size``; every member gets the whole dim."""
    n = len(arrays)
    c = padded_chunk(global_size, n)
    for j, a in enumerate(arrays):
        lo, hi = chunk_bounds(global_size, n, j)
        if a.shape[dim] != hi - lo:
            raise ShapeError(f"all-gather: member {j} holds {a.shape[dim]} entries of dim {dim}, but chunk {j} of "
                             f"{global_size} over {n} ranks has {hi - lo}")
    full = np.concatenate([_pad(a, dim, c) for a in arrays], axis=dim)
    return [_take(full, dim, 0, global_size).copy() for _ in arrays]


def reduce_scatter(arrays: Sequence[np.ndarray], dim: int, op: str = "sum") -> list[np.ndarray]:
    """Reduce the operands with ``op``; member ``j`` gets chunk ``j`` of ``dim``."""
    n = len(arrays)
    size = arrays[0].shape[dim]
    c = padded_chunk(size, n)
    padded = _pad(reduce_arrays(arrays, op), dim, n * c)
    res = []
    for j in range(n):
        lo, hi = chunk_bounds(size, n, j)
        res.append(_take(padded, dim, j * c, j * c + hi - lo).copy())
    return res


def all_to_all(arrays: Sequence[np.ndarray], src_dim: int, dst_dim: int, src_size: int) -> list[np.ndarray]:
    """Member ``j`` holds chunk ``j`` of ``src_dim`` (a dim of ``src_size``) and all of
    ``dst_dim``; it sends block ``k`` of ``dst_dim`` to member ``k`` and ends with all of
    ``src_dim`` and chunk ``j`` of ``dst_dim``."""
    n = len(arrays)
    dst_size = arrays[0].shape[dst_dim]
    cs, cd = padded_chunk(src_size, n), padded_chunk(dst_size, n)
    blocks = []  # blocks[j][k]: what member j sends to member k, padded to (cs, cd)
    for j, a in enumerate(arrays):
        lo, hi = chunk_bounds(src_size, n, j)
        if a.shape[src_dim] != hi - lo or a.shape[dst_dim] != dst_size:
            raise ShapeError(f"all-to-all: member {j} has shape {a.shape}; expected chunk {j} of {src_size} "
                             f"({hi - lo}) along dim {src_dim} and {dst_size} along dim {dst_dim}")
        p = _pad(_pad(a, src_dim, cs), dst_dim, n * cd)
        blocks.append([_take(p, dst_dim, k * cd, (k + 1) * cd) for k in range(n)])
    res = []
    for k in range(n):
        lo, hi = chunk_bounds(dst_size, n, k)
        got = np.concatenate([blocks[j][k] for j in range(n)], axis=src_dim)
        res.append(_take(_take(got, src_dim, 0, src_size), dst_dim, 0, hi - lo).copy())
    return res


def run_collective(kind: str, arrays: Sequence[np.ndarray], attrs: dict) -> list[np.ndarray]:
    """Run collective ``kind`` with a collective op's attributes on one group's operands."""
    if kind == "all_reduce":
        return all_reduce(arrays, attrs.get("op", "sum"))
    if kind == "all_gather":
        return all_gather(arrays, attrs["dim"], attrs["global_size"])
    if kind == "reduce_scatter":
        return reduce_scatter(arrays, attrs["dim"], attrs.get("op", "sum"))
    if kind == "all_to_all":
        return all_to_all(arrays, attrs["src_dim"], attrs["dst_dim"], attrs["src_size"])
    raise ValueError(f"unknown collective {kind!r}")


# ---------------------------------------------------------------------------------------
# lockstep execution
# ---------------------------------------------------------------------------------------
# attributes that legitimately differ between ranks (or between groups) of one collective call
_PER_RANK_ATTRS = {"global_size", "src_size", "group_index"}


def _signature(op: Operator) -> tuple:
    """What every rank's op of one collective call must agree on."""
    return op.op_type, tuple(sorted((k, v) for k, v in op.attrs.items() if k not in _PER_RANK_ATTRS))


def _describe(op: Operator) -> str:
    kind, attrs = _signature(op)
    return f"{kind}({', '.join(f'{k}={v}' for k, v in attrs)}) [node {op.name}]"


def _bind(graph: FlowGraph, inputs: dict[str, np.ndarray], rank: int) -> dict[int, np.ndarray]:
    env = {}
    if RNG_STEP not in inputs and any(t.name == RNG_STEP for t in graph.inputs):
        inputs = {**inputs, RNG_STEP: np.array(0, np.int64)}  # (the random ops' first run, as FlowGraph.run)
    for t in graph.inputs:
        if t.name not in inputs:
            raise ShapeError(f"rank {rank}: missing input {t.name!r}; the inputs given are {sorted(inputs)}")
        a = np.asarray(inputs[t.name])
        if a.dtype != numpy_type(t.dtype):
            raise DtypeError(f"rank {rank}: input {t.name!r} has dtype {a.dtype}, the graph expects {t.dtype}")
        if a.shape != t.shape:
            raise ShapeError(f"rank {rank}: input {t.name!r} has shape {a.shape}, the graph expects {t.shape}")
        env[id(t)] = a
    return env


def simulate_ranks(rank_graphs: Sequence[FlowGraph], inputs: dict[str, np.ndarray],
                   mesh: DeviceMesh, values: list | None = None) -> list[dict[str, np.ndarray]]:
    """Run every rank's graph in lockstep; return each rank's outputs (see :func:`simulate`).
    ``values``: a list that receives, per rank, the value of every tensor its ops wrote and of its
    inputs, by tensor name (what a test checks each rank's kernels against)."""
    n = len(rank_graphs)
    if n != mesh.size or sorted(mesh.rank_map) != list(range(n)):
        raise GraphError(f"simulate: got {n} rank graphs for a mesh of {mesh.size} ranks {sorted(mesh.rank_map)}; "
                         "pass one graph per global rank 0..size-1")
    envs = [_bind(g, inputs, r) for r, g in enumerate(rank_graphs)]
    nodes = [g.nodes for g in rank_graphs]
    pcs = [0] * n
    step = 0
    while True:
        for r in range(n):  # run local ops up to the next collective
            env, ns = envs[r], nodes[r]
            while pcs[r] < len(ns) and not isinstance(ns[pcs[r]], Collective):
                op = ns[pcs[r]]
                args = [env[id(t)] if id(t) in env else t.value for t in op.inputs]
                for t, v in zip(op.outputs, op.run(*args)):
                    env[id(t)] = v
                pcs[r] += 1
        waiting = [r for r in range(n) if pcs[r] < len(nodes[r])]
        if not waiting:
            break
        ops: list[Collective] = [nodes[r][pcs[r]] if pcs[r] < len(nodes[r]) else None for r in range(n)]
        if len(waiting) < n:
            done = [r for r in range(n) if ops[r] is None]
            raise GraphError(f"collective #{step}: rank(s) {done} finished while rank {waiting[0]} waits at "
                             f"{_describe(ops[waiting[0]])}; every rank must issue the same collectives")
        for r in range(1, n):
            if _signature(ops[r]) != _signature(ops[0]):
                raise GraphError(f"collective #{step} differs between ranks: rank 0 is at {_describe(ops[0])}, "
                                 f"rank {r} at {_describe(ops[r])}; every rank must issue the same collectives "
                                 "in the same order")
        _run_collective_step(ops, envs, mesh, step)
        for r in range(n):
            pcs[r] += 1
        step += 1
    log.debug("simulated %d ranks through %d collectives", n, step)
    if values is not None:
        values.extend({t.name: env[id(t)] for t in [*g.inputs, *(u for op in g.nodes for u in op.outputs)]
                       if id(t) in env} for g, env in zip(rank_graphs, envs))
    return [{name: (env[id(t)] if id(t) in env else t.value) for name, t in zip(g.output_names, g.outputs)}
            for g, env in zip(rank_graphs, envs)]


def _run_collective_step(ops: list[Collective], envs: list[dict], mesh: DeviceMesh, step: int) -> None:
    axes = ops[0].axes
    for group in mesh.groups(axes):
        members = [ops[r] for r in group]
        where = f"collective #{step} {_describe(members[0])} on ranks {list(group)}"
        if members[0].attrs["group_size"] != len(group):
            raise GraphError(f"{where}: group_size is {members[0].attrs['group_size']} but the group along mesh "
                             f"axes {axes} has {len(group)} ranks")
        for k in ("global_size", "src_size"):
            vals = {op.attrs[k] for op in members if k in op.attrs}
            if len(vals) > 1:
                raise GraphError(f"{where}: the ranks disagree on {k} ({sorted(vals)})")
        for j, op in enumerate(members):
            if op.attrs.get("group_index", j) != j:
                raise GraphError(f"{where}: rank {group[j]} has group_index {op.attrs['group_index']}, but it is "
                                 f"member {j} of its group")
        arrays = [envs[r][id(op.inputs[0])] if id(op.inputs[0]) in envs[r] else op.inputs[0].value
                  for r, op in zip(group, members)]
        if len({a.dtype for a in arrays}) > 1:
            raise GraphError(f"{where}: operands have different dtypes {sorted({str(a.dtype) for a in arrays})}")
        try:
            results = run_collective(members[0].collective, arrays, members[0].attrs)
        except ShapeError as exc:
            raise ShapeError(f"{where}: {exc}") from None
        for r, op, res in zip(group, members, results):
            t = op.outputs[0]
            if res.shape != t.shape:
                raise ShapeError(f"{where}: rank {r} gets shape {res.shape} but {op.name} declares {t.shape}")
            envs[r][id(t)] = res


def simulate(rank_graphs: Sequence[FlowGraph], inputs: dict[str, np.ndarray],
             mesh: DeviceMesh | None = None) -> dict[str, np.ndarray]:
    """Run the per-rank graphs together in this process and return rank 0's outputs.

    Parameters
    ----------
    rank_graphs
        ``rank_graphs[r]`` is global rank ``r``'s graph (one per rank of ``mesh``).
    inputs
        Arrays by input name, shared by all ranks; each rank's graph takes the inputs it
        declares. The rank graphs partition produces declare the *full* graph inputs and take
        their shards with :class:`~shardflow.compiler.parallel.comm_ops.LocalSlice`; a test may
        instead give each rank its own input names. A graph with random ops takes their step
        (``shardflow_rng_step``) as :meth:`FlowGraph.run` does: 0, the first run, when left out.
    mesh
        The device mesh the collectives' ``mesh_axis`` refer to; by default the one
        :func:`~shardflow.compiler.parallel.partition.partition` recorded in the graphs' ``meta``.

    Returns
    -------
    dict
        Rank 0's outputs keyed by output name (:func:`simulate_ranks` returns every rank's).

    Raises
    ------
    GraphError
        When the ranks' collective sequences differ (kind, mesh axis, dims, reduction, group
        size), or a group disagrees on sizes.
    """
    if mesh is None:
        mesh = rank_graphs[0].meta.get("mesh") if rank_graphs else None
        if mesh is None:
            raise GraphError("simulate: the rank graphs carry no mesh (they were not made by partition); pass mesh=")
    return simulate_ranks(rank_graphs, inputs, mesh)[0]
