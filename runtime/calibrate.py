"""What each rank of ``shardflow calibrate`` measures: its compute and memory throughput while
every rank works at once, and the collectives' times along every mesh axis.

The compiler side (:mod:`shardflow.compiler.calibrate`) compiles the two probe programs, starts
the ranks (``python -m shardflow.runtime.calibrate``) and fits the cost model's figures to what
they report; this module only measures (the runtime never imports the compiler).

Every figure is the median over ``trials`` of the slowest rank's time: each trial starts at a
barrier, runs the operation ``reps`` times back to back, and ends at a barrier, so a figure is
what a program whose ranks wait for each other sees.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import struct
import sys
import time
from typing import Callable, Sequence

import numpy as np

from .artifact import write_json
from .errors import ShardflowError

__all__ = ["COLLECTIVE_KINDS", "BUFFER_BYTES", "axis_groups", "time_collectives", "time_program", "rank_memory",
           "run_rank", "main"]

log = logging.getLogger("shardflow.runtime.calibrate")

#: The collectives timed, by the cost model's names.
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
#: Bytes of each rank's buffer for the collective timings (float32).
BUFFER_BYTES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)
#: Work per trial the repetition count aims at (bytes moved per rank).
_TRIAL_BYTES = 16 << 20


def axis_groups(mesh_shape: Sequence[int], axis: int) -> list[list[int]]:
    """The rank groups along ``axis`` of a row-major mesh (rank = position in row-major order)."""
    ranks = np.arange(int(np.prod(mesh_shape))).reshape(tuple(mesh_shape))
    return np.moveaxis(ranks, axis, -1).reshape(-1, mesh_shape[axis]).tolist()


def _slowest(comm, seconds: float) -> float:
    return max(struct.unpack("d", b)[0] for b in comm.allgather_bytes(struct.pack("d", seconds)))


def _timed(comm, fn: Callable[[], object], reps: int, trials: int) -> float:
    """Median over trials of the slowest rank's seconds per call of ``fn``."""
    fn()  # warm up (first-touch, connection set-up)
    per_trial = []
    for _ in range(trials):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        comm.barrier()
        per_trial.append(_slowest(comm, (time.perf_counter() - t0) / reps))
    return float(np.median(per_trial))


def _collective_call(group, kind: str, nbytes: int):
    """A prepared collective ``kind`` on a per-rank buffer of ``nbytes`` (as a rank program runs
    it: :func:`~shardflow.runtime.comm.prepared.prepare`), and the bytes the cost model's formula
    takes for it (:mod:`shardflow.compiler.parallel.cost`)."""
    from .comm.prepared import prepare

    n = group.size
    elems = max(nbytes // 4, n) // n * n  # divisible by the group
    x = np.ones(elems, np.float32)
    if kind == "all_reduce":
        return prepare(group, kind, x, np.empty_like(x), {"op": "sum"}), elems * 4
    if kind == "all_gather":
        return prepare(group, kind, x, np.empty(elems * n, np.float32), {"dim": 0, "global_size": elems * n}), \
            elems * n * 4
    if kind == "reduce_scatter":
        return prepare(group, kind, x, np.empty(elems // n, np.float32), {"dim": 0, "op": "sum"}), elems * 4
    if kind == "all_to_all":
        # [1, elems] split on dim 0 (one row per member) becomes [n, elems / n] split on dim 1: the
        # group's buffers total n * nbytes
        return prepare(group, kind, x.reshape(1, elems), np.empty((n, elems // n), np.float32),
                       {"src_dim": 0, "dst_dim": 1, "src_size": n}), elems * n * 4
    raise ValueError(f"unknown collective {kind!r}")


def time_collectives(comm, mesh_shape: Sequence[int], *, buffer_bytes: Sequence[int] = BUFFER_BYTES,
                     kinds: Sequence[str] = COLLECTIVE_KINDS, trials: int = 5) -> list[dict]:
    """Time every collective of ``kinds`` on every buffer size along every mesh axis.

    All the groups of an axis run at once (as in a sharded program). Collective: every rank of
    ``comm`` calls it with the same arguments.

    Returns
    -------
    list of dict
        ``{"axis", "group_size", "kind", "buffer_bytes", "nbytes", "seconds"}`` per timing, where
        ``nbytes`` is the byte count the cost model's formula for ``kind`` takes.
    """
    if int(np.prod(mesh_shape)) != comm.size:
        raise ShardflowError(f"mesh {list(mesh_shape)} has {int(np.prod(mesh_shape))} ranks but {comm.size} "
                             "were started")
    records = []
    for axis, n in enumerate(mesh_shape):
        if n == 1:
            continue
        group = comm if n == comm.size else comm.split(axis_groups(mesh_shape, axis))
        for kind in kinds:
            for b in buffer_bytes:
                fn, nbytes = _collective_call(group, kind, b)
                reps = max(2, min(50, _TRIAL_BYTES // max(b, 1)))
                secs = _timed(comm, fn, reps, trials)
                records.append({"axis": axis, "group_size": n, "kind": kind, "buffer_bytes": int(b),
                                "nbytes": int(nbytes), "seconds": secs})
                log.debug("axis %d %s %d B: %.1f us", axis, kind, b, secs * 1e6)
        if group is not comm:
            group.close()
    return records


def rank_memory(comm) -> int | None:
    """The memory one rank may hold: each host's physical memory divided among the ranks on it
    (hosts told apart by name), the least over the hosts; ``None`` where the system does not say."""
    try:
        mine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        mine = None
    hosts: dict[str, list] = {}
    for b in comm.allgather_bytes(json.dumps([socket.gethostname(), mine]).encode()):
        name, total = json.loads(b)
        hosts.setdefault(name, []).append(total)
    if any(t is None for totals in hosts.values() for t in totals):
        return None
    return min(min(totals) // len(totals) for totals in hosts.values())


def time_program(comm, out_dir: str | os.PathLike, *, trials: int = 5, min_trial_s: float = 0.05) -> float:
    """Seconds per run of the one-rank program in ``out_dir`` when every rank runs its own copy
    at once (so that the ranks share the machine as a sharded program's ranks do); its inputs
    are ones."""
    from .executor import load

    prog = load(out_dir, 0)
    try:
        inputs = {name: np.ones(buf.shape, buf.dtype) for name, buf in prog.input_specs}
        prog.run(inputs)
        t0 = time.perf_counter()
        prog.run(inputs)
        once = _slowest(comm, time.perf_counter() - t0)
        reps = max(1, min(100, int(min_trial_s / max(once, 1e-6))))
        return _timed(comm, lambda: prog.run(inputs, copy_outputs=False), reps, trials)
    finally:
        prog.close()


# ---------------------------------------------------------------------------------------
# one rank of `shardflow calibrate`
# ---------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m shardflow.runtime.calibrate",
                                description="One rank of `shardflow calibrate` (started by it).")
    p.add_argument("--mesh", required=True, help="ranks per axis, joined by 'x'")
    p.add_argument("--probe", action="append", default=[], metavar="NAME=OUT_DIR",
                   help="a one-rank program to time (repeat)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--backend", choices=("auto", "mpi", "tcp"), default="auto")
    p.add_argument("--result", required=True, metavar="FILE.json", help="where rank 0 writes the timings")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def run_rank(mesh_shape: Sequence[int], probes: dict[str, str], *, trials: int = 5, backend: str = "auto",
             env=None) -> dict | None:
    """This process's rank of a calibration started by a launcher (``shardflow calibrate``'s own,
    mpiexec, srun, torchrun-style variables): connect, time the one-rank ``probes`` (name ->
    out_dir) and the collectives, and return the timings on rank 0 (``None`` on the others).

    A rank that fails logs why and leaves the process at once (status 1) when other ranks exist,
    so that none waits for it in a collective.
    """
    from .comm import create_world
    from .launch import _bind_to_share, _die, _threads_per_rank, detect_environment

    env = env or detect_environment()
    hard = env.size > 1 or env.launched_by == "mpi"
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = _threads_per_rank(max(env.local_size, 1))
    _bind_to_share(env.local_rank, env.local_size)  # (as `shardflow run` binds the ranks it starts)
    try:
        comm = create_world(backend, launched_by=env.launched_by, rank=env.rank, size=env.size,
                            master_addr=env.master_addr, master_port=env.master_port, local_rank=env.local_rank)
    except ShardflowError as exc:
        _die(f"rank {env.rank}: cannot connect the ranks: {exc}", 1, hard)
        raise
    try:
        programs = {name: time_program(comm, path, trials=trials) for name, path in probes.items()}
        records = time_collectives(comm, mesh_shape, trials=trials)
    except Exception as exc:  # noqa: BLE001 - a rank must never leave the others waiting
        _die(f"rank {env.rank}: {type(exc).__name__}: {exc}", 1, hard)
        raise
    comm.barrier()
    memory = rank_memory(comm)
    result = {"mesh_shape": list(mesh_shape), "backend": comm.backend,
              "threads_per_rank": os.environ["OMP_NUM_THREADS"], "programs_s": programs, "collectives": records,
              "memory_per_rank_bytes": memory}
    comm.close()
    return result if env.rank == 0 else None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one calibration rank started by ``shardflow calibrate``; rank 0 writes
    ``--result``."""
    from .launch import _setup_logging, detect_environment

    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    env = detect_environment()
    _setup_logging(env.rank, args.verbose)
    probes = dict(item.partition("=")[::2] for item in args.probe)
    try:
        result = run_rank([int(d) for d in args.mesh.split("x")], probes, trials=args.trials,
                          backend=args.backend, env=env)
    except ShardflowError:
        return 1
    if result is not None:
        write_json(args.result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
