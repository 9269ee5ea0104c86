"""Run every collective on a real multi-process communicator and compare with the oracle.

Started by tests/runtime/test_comm.py under ``mpiexec -n N`` (backend mpi) or as N processes
with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (backend tcp). Exits 0 when every check passes.
"""
import importlib
import itertools
import sys

import numpy as np

from shardflow.runtime.comm import create_world
from shardflow.runtime.comm.prepared import prepare
from shardflow.runtime.launch import detect_environment

S = importlib.import_module("shardflow.compiler.parallel.simulate")
from shardflow.compiler.parallel.mesh import DeviceMesh  # noqa: E402
from shardflow.compiler.parallel.placement import chunk_bounds  # noqa: E402


def operands(seed, n, make):
    rng = np.random.default_rng(seed)
    return [make(rng, j) for j in range(n)]


def check(comm, members, tag, seed):
    """``comm`` is a group whose member j is global rank members[j]; all ranks draw the same operands."""
    n, me = comm.size, comm.rank
    bad = []

    def same(got, ref, what):
        if got.shape != ref.shape or got.dtype != ref.dtype:
            bad.append(f"{tag} {what}: got {got.shape} {got.dtype}, want {ref.shape} {ref.dtype}")
        elif ref.dtype.kind == "f" and comm.backend == "mpi":
            if not np.allclose(got, ref, rtol=1e-6, atol=1e-6):
                bad.append(f"{tag} {what}: values differ (max {np.abs(got - ref).max()})")
        elif not np.array_equal(got, ref):
            bad.append(f"{tag} {what}: values differ")

    for dt, shape in [(dt, (3, 5)) for dt in ("float32", "float64", "int64", "int32", "bool", "float16")] + \
            [("float32", ())]:  # a scalar (a full reduction's partial sums)
        xs = operands(seed, n, lambda rng, j: np.asarray(rng.standard_normal(shape) * 7).astype(dt))
        for op in ("sum", "max", "min", "avg"):
            out = np.empty_like(xs[me])
            comm.all_reduce(xs[me], op, out=out)
            same(out, S.all_reduce(xs, op)[me], f"all_reduce {dt}{list(shape)} {op}")
    for size, dim in ((7, 1), (3, 0), (1, 2), (0, 1), (8, 1)):
        def piece(rng, j, size=size, dim=dim):
            lo, hi = chunk_bounds(size, n, j)
            shape = [2, 4, 3]
            shape[dim] = hi - lo
            return rng.standard_normal(shape).astype(np.float32)
        xs = operands(seed + size, n, piece)
        same(comm.all_gather(xs[me], dim, size), S.all_gather(xs, dim, size)[me], f"all_gather size {size} dim {dim}")
        ys = operands(seed + size, n, lambda rng, j, size=size, dim=dim: rng.standard_normal(
            [2, 4, 3][:dim] + [size] + [2, 4, 3][dim + 1:]).astype(np.float32))
        for op in ("sum", "max", "avg"):
            same(comm.reduce_scatter(ys[me], dim, op), S.reduce_scatter(ys, dim, op)[me],
                 f"reduce_scatter size {size} dim {dim} {op}")
    for src_size, dst_size, src, dst in ((7, 5, 0, 1), (4, 9, 1, 2), (5, 2, 2, 0), (1, 3, 0, 2)):
        def piece(rng, j, src_size=src_size, dst_size=dst_size, src=src, dst=dst):
            lo, hi = chunk_bounds(src_size, n, j)
            shape = [2, 3, 4]
            shape[src], shape[dst] = hi - lo, dst_size
            return rng.standard_normal(shape).astype(np.float32)
        xs = operands(seed + 100 * src_size + dst_size, n, piece)
        same(comm.all_to_all(xs[me], src, dst, src_size), S.all_to_all(xs, src, dst, src_size)[me],
             f"all_to_all {src_size}->{dst_size} dims {src}->{dst}")
    check_prepared(comm, seed, same)
    return bad


def check_prepared(comm, seed, same):
    """The prepared collectives a rank program runs (into fixed buffers; MPI's straight into the
    output where the chunks are laid end to end), twice per buffer pair, against the oracle;
    ``same`` records the failures."""
    n, me = comm.size, comm.rank
    for dt in ("float32", "float64", "int32", "bool", "float16"):
        for op in ("sum", "max", "avg"):
            rounds = [operands(seed + r, n, lambda rng, j: (rng.standard_normal((3, 5)) * 7).astype(dt))
                      for r in range(2)]
            x, y = np.empty((3, 5), dt), np.empty((3, 5), dt)
            pc = prepare(comm, "all_reduce", x, y, {"op": op})
            for xs in rounds:
                x[...] = xs[me]
                pc()
            same(y, S.all_reduce(rounds[1], op)[me], f"prepared all_reduce {dt} {op}")
    # leading dims of one entry and even sizes: no staging; the others: staged
    for base, size, dim in (([1, 8, 3], 8, 1), ([1, 1, 12], 12, 2), ([2, 8, 3], 8, 1), ([1, 7, 3], 7, 1),
                            ([8, 3], 8, 0)):
        full = list(base)
        full[dim] = size

        def piece(rng, j, size=size, dim=dim, full=full):
            lo, hi = chunk_bounds(size, n, j)
            return rng.standard_normal(full[:dim] + [hi - lo] + full[dim + 1:]).astype(np.float32)
        rounds = [operands(seed + size + r, n, piece) for r in range(2)]
        x, y = np.empty(rounds[0][me].shape, np.float32), np.empty(full, np.float32)
        pc = prepare(comm, "all_gather", x, y, {"dim": dim, "global_size": size})
        for xs in rounds:
            x[...] = xs[me]
            pc()
        same(y, S.all_gather(rounds[1], dim, size)[me], f"prepared all_gather {base} dim {dim}")
        for op in ("sum", "avg"):
            rounds = [operands(seed + size + r, n,
                               lambda rng, j, full=full: rng.standard_normal(full).astype(np.float32))
                      for r in range(2)]
            ref = S.reduce_scatter(rounds[1], dim, op)[me]
            x, y = np.empty(full, np.float32), np.empty(ref.shape, np.float32)
            pc = prepare(comm, "reduce_scatter", x, y, {"dim": dim, "op": op})
            for xs in rounds:
                x[...] = xs[me]
                pc()
            same(y, ref, f"prepared reduce_scatter {base} dim {dim} {op}")
    for src_size, dst_size, src, dst in ((7, 5, 0, 1), (8, 6, 1, 2), (5, 2, 2, 0)):
        def shape(j, of_output, src_size=src_size, dst_size=dst_size, src=src, dst=dst):
            s = [2, 3, 4]
            lo, hi = chunk_bounds(src_size, n, j)
            dlo, dhi = chunk_bounds(dst_size, n, j)
            s[src], s[dst] = (src_size, dhi - dlo) if of_output else (hi - lo, dst_size)
            return s
        rounds = [operands(seed + src_size + r, n,
                           lambda rng, j, shape=shape: rng.standard_normal(shape(j, False)).astype(np.float32))
                  for r in range(2)]
        x, y = np.empty(shape(me, False), np.float32), np.empty(shape(me, True), np.float32)
        pc = prepare(comm, "all_to_all", x, y, {"src_dim": src, "dst_dim": dst, "src_size": src_size})
        for xs in rounds:
            x[...] = xs[me]
            pc()
        same(y, S.all_to_all(rounds[1], src, dst, src_size)[me], f"prepared all_to_all {src}->{dst}")


def main():
    backend = sys.argv[1]
    mesh_shape = tuple(int(d) for d in sys.argv[2].split("x"))
    env = detect_environment()
    world = create_world(backend, launched_by=env.launched_by, rank=env.rank, size=env.size,
                         master_addr=env.master_addr, master_port=env.master_port)
    assert world.backend == backend, (world.backend, backend)
    bad = check(world, list(range(world.size)), "world", 1)
    mesh = DeviceMesh(mesh_shape)
    axis_sets = [(a,) for a in range(mesh.ndim)] + [c for c in itertools.combinations(range(mesh.ndim), 2)]
    for axes in axis_sets:
        groups = mesh.groups(axes)
        sub = world.split(groups)
        group = mesh.group_of(world.rank, axes)
        assert sub.size == len(group) and sub.rank == group.index(world.rank), (axes, sub.rank, sub.size, group)
        assert sub.global_ranks == tuple(group), (sub.global_ranks, group)
        bad += check(sub, group, f"axes {axes}", 10 + sum(axes))
    world.barrier()
    data = world.broadcast_bytes(b"hello" if world.rank == 0 else None)
    assert data == b"hello", data
    got = world.allgather_bytes(bytes([world.rank]) * (world.rank + 1))
    assert got == [bytes([r]) * (r + 1) for r in range(world.size)], got
    world.close()
    if bad:
        print(f"rank {env.rank}: {len(bad)} failures:\n" + "\n".join(bad[:20]), flush=True)
        sys.exit(1)
    print(f"rank {env.rank}: ok", flush=True)


if __name__ == "__main__":
    main()
