"""Prepared collectives (runtime/comm/prepared.py): fixed staging buffers, called repeatedly, give
exactly the oracle's results (compiler/parallel/simulate.py) for every kind, group size, uneven
chunking and reduction; the same code runs on cupy arrays with NCCL inside CUDA graphs."""
import importlib

import numpy as np
import pytest

from shardflow.runtime.comm import CommError, InProcessWorld, SelfCommunicator
from shardflow.runtime.comm.base import chunk_bounds
from shardflow.runtime.comm.prepared import prepare

from test_comm import chunk_shape
from threads import run_threads

sim = importlib.import_module("shardflow.compiler.parallel.simulate")


def _run_prepared(comms, kind, xs, out_shapes, attrs, dtype=np.float32, repeats=2):
    """Prepare once per member, call ``repeats`` times with fresh input values, return the last outputs
    and the inputs of the last call."""
    def work(c):
        x = np.empty(xs[0][c.rank].shape, dtype)
        y = np.full(out_shapes[c.rank], -7, dtype)
        pc = prepare(c, kind, x, y, attrs)
        assert not pc.capturable  # host arrays: never captured
        for r in range(repeats):
            x[...] = xs[r][c.rank]
            pc()
        return y
    return run_threads(comms, work)


def _two_rounds(make):
    return [make(0), make(1)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("float32", "avg"), ("int64", "max"), ("int32", "avg"),
                                      ("bool", "sum"), ("float64", "min")])
def test_all_reduce(n, dtype, op):
    rng = np.random.default_rng(n)
    rounds = _two_rounds(lambda r: [(rng.standard_normal((3, 5)) * 10).astype(dtype) for _ in range(n)])
    got = _run_prepared(InProcessWorld(n).communicators(), "all_reduce", rounds, [(3, 5)] * n, {"op": op}, dtype)
    for g, ref in zip(got, sim.all_reduce(rounds[1], op)):
        assert g.dtype == ref.dtype and np.array_equal(g, ref)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("size,dim", [(7, 1), (3, 0), (1, 2), (0, 1), (8, 1), (2, 0)])
def test_all_gather_and_reduce_scatter_with_uneven_chunks(n, size, dim):
    rng = np.random.default_rng(size + 10 * n)
    base = [2, 4, 3]
    full = list(base)
    full[dim] = size
    comms = InProcessWorld(n).communicators()
    rounds = _two_rounds(lambda r: [rng.standard_normal(chunk_shape(base, dim, size, n, j)).astype(np.float32)
                                    for j in range(n)])
    got = _run_prepared(comms, "all_gather", rounds, [full] * n, {"dim": dim, "global_size": size})
    for g, ref in zip(got, sim.all_gather(rounds[1], dim, size)):
        assert np.array_equal(g, ref)
    for op in ("sum", "max", "avg"):
        rounds = _two_rounds(lambda r: [rng.standard_normal(full).astype(np.float32) for _ in range(n)])
        outs = [chunk_shape(base, dim, size, n, j) for j in range(n)]
        got = _run_prepared(comms, "reduce_scatter", rounds, outs, {"dim": dim, "op": op})
        for g, ref in zip(got, sim.reduce_scatter(rounds[1], dim, op)):
            assert g.shape == ref.shape and np.array_equal(g, ref)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("src_size,dst_size,src,dst", [(7, 5, 0, 1), (4, 9, 1, 2), (5, 2, 2, 0), (1, 3, 0, 2)])
def test_all_to_all(n, src_size, dst_size, src, dst):
    rng = np.random.default_rng(src_size * 10 + dst_size)

    def shape(j, of_output):
        s = [2, 3, 4]
        lo, hi = chunk_bounds(src_size, n, j)
        dlo, dhi = chunk_bounds(dst_size, n, j)
        s[src], s[dst] = (src_size, dhi - dlo) if of_output else (hi - lo, dst_size)
        return s
    rounds = _two_rounds(lambda r: [rng.standard_normal(shape(j, False)).astype(np.float32) for j in range(n)])
    got = _run_prepared(InProcessWorld(n).communicators(), "all_to_all", rounds, [shape(j, True) for j in range(n)],
                        {"src_dim": src, "dst_dim": dst, "src_size": src_size})
    for g, ref in zip(got, sim.all_to_all(rounds[1], src, dst, src_size)):
        assert g.shape == ref.shape and np.array_equal(g, ref)


def test_bad_buffers_are_refused():
    x = np.zeros((4, 3), np.float32)
    with pytest.raises(CommError, match="output shape"):
        prepare(SelfCommunicator(), "all_reduce", x, np.zeros((3, 4), np.float32), {"op": "sum"})
    with pytest.raises(CommError, match="unknown collective"):
        prepare(SelfCommunicator(), "broadcast", x, x, {})
    comms = InProcessWorld(2).communicators()
    with pytest.raises(CommError, match="chunk 0 of 5"):
        prepare(comms[0], "all_gather", x, np.zeros((5, 3), np.float32), {"dim": 0, "global_size": 5})


def test_host_collectives_stage_only_what_their_layout_needs():
    comms = InProcessWorld(2).communicators()
    x, y = np.zeros((1, 4, 3), np.float32), np.zeros((1, 8, 3), np.float32)
    assert prepare(comms[0], "all_gather", x, y, {"dim": 1, "global_size": 8})._keep == ()
    assert prepare(comms[0], "reduce_scatter", y, x, {"dim": 1, "op": "sum"})._keep == ()
    # a dim before the split one with two entries: x is sent as it is, the chunks arrive in a
    # receive buffer and are copied into y; an uneven split also stages x (padded)
    x2, y2 = np.zeros((2, 4, 3), np.float32), np.zeros((2, 8, 3), np.float32)
    send, recv = prepare(comms[0], "all_gather", x2, y2, {"dim": 1, "global_size": 8})._keep
    assert np.shares_memory(send, x2) and not np.shares_memory(recv, y2)
    x3, y3 = np.zeros((1, 4, 3), np.float32), np.zeros((1, 7, 3), np.float32)
    send, recv = prepare(comms[0], "all_gather", x3, y3, {"dim": 1, "global_size": 7})._keep
    assert not np.shares_memory(send, x3) and not np.shares_memory(recv, y3)
    # ... and the unstaged ones give the oracle's result
    rng = np.random.default_rng(3)
    rounds = _two_rounds(lambda r: [rng.standard_normal((1, 4, 3)).astype(np.float32) for _ in range(2)])
    got = _run_prepared(comms, "all_gather", rounds, [(1, 8, 3)] * 2, {"dim": 1, "global_size": 8})
    for g, ref in zip(got, sim.all_gather(rounds[1], 1, 8)):
        assert np.array_equal(g, ref)
