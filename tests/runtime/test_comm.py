"""Communicators against the compiler's collective oracle (compiler/parallel/simulate.py).

In-process (threads) for every group size, dtype, reduction and uneven chunking; real processes
for the MPI (mpiexec) and TCP backends, including the per-mesh-axis sub-communicators.
"""
import importlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardflow.compiler.parallel.mesh import DeviceMesh
from shardflow.compiler.parallel.placement import chunk_bounds as ref_chunk_bounds
from shardflow.compiler.parallel.placement import padded_chunk as ref_padded_chunk
from shardflow.runtime.comm import CommError, InProcessWorld, RankFailedError, SelfCommunicator
from shardflow.runtime.comm.base import chunk_bounds, padded_chunk
from threads import run_threads

sim = importlib.import_module("shardflow.compiler.parallel.simulate")
HERE = Path(__file__).parent
REPO = HERE.parent.parent


def chunk_shape(shape, dim, size, n, j):
    lo, hi = chunk_bounds(size, n, j)
    s = list(shape)
    s[dim] = hi - lo
    return s


def test_chunking_matches_the_compiler():
    for size in range(0, 13):
        for n in range(1, 6):
            assert padded_chunk(size, n) == ref_padded_chunk(size, n)
            for j in range(n):
                assert chunk_bounds(size, n, j) == ref_chunk_bounds(size, n, j)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32", "bool", "float16"])
@pytest.mark.parametrize("shape", [(3, 5), ()])
def test_all_reduce_is_bit_identical_to_the_oracle(n, dtype, shape):
    rng = np.random.default_rng(n)
    xs = [np.asarray(rng.standard_normal(shape) * 7).astype(dtype) for _ in range(n)]
    comms = InProcessWorld(n).communicators()
    for op in ("sum", "max", "min", "avg"):
        got = run_threads(comms, lambda c: c.all_reduce(xs[c.rank], op))
        for g, r in zip(got, sim.all_reduce(xs, op)):
            assert g.dtype == r.dtype and g.shape == r.shape
            assert np.array_equal(g, r), (dtype, op)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("size,dim", [(7, 1), (3, 0), (1, 2), (0, 1), (8, 1), (2, 0)])
def test_all_gather_and_reduce_scatter_with_uneven_chunks(n, size, dim):
    rng = np.random.default_rng(size)
    base = [2, 4, 3]
    xs = [rng.standard_normal(chunk_shape(base, dim, size, n, j)).astype(np.float32) for j in range(n)]
    comms = InProcessWorld(n).communicators()
    got = run_threads(comms, lambda c: c.all_gather(xs[c.rank], dim, size))
    for g, r in zip(got, sim.all_gather(xs, dim, size)):
        assert g.shape == r.shape and np.array_equal(g, r)
    full = list(base)
    full[dim] = size
    ys = [rng.standard_normal(full).astype(np.float32) for _ in range(n)]
    for op in ("sum", "max", "avg"):
        got = run_threads(comms, lambda c: c.reduce_scatter(ys[c.rank], dim, op))
        for g, r in zip(got, sim.reduce_scatter(ys, dim, op)):
            assert g.shape == r.shape and np.array_equal(g, r)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("src_size,dst_size,src,dst", [(7, 5, 0, 1), (4, 9, 1, 2), (5, 2, 2, 0), (1, 3, 0, 2)])
def test_all_to_all_matches_the_oracle(n, src_size, dst_size, src, dst):
    rng = np.random.default_rng(src_size * 10 + dst_size)
    xs = []
    for j in range(n):
        shape = [2, 3, 4]
        lo, hi = chunk_bounds(src_size, n, j)
        shape[src], shape[dst] = hi - lo, dst_size
        xs.append(rng.standard_normal(shape).astype(np.float32))
    comms = InProcessWorld(n).communicators()
    got = run_threads(comms, lambda c: c.all_to_all(xs[c.rank], src, dst, src_size))
    for g, r in zip(got, sim.all_to_all(xs, src, dst, src_size)):
        assert g.shape == r.shape and np.array_equal(g, r)


def test_sub_communicators_follow_the_mesh_groups():
    mesh = DeviceMesh((2, 2))
    comms = InProcessWorld(4).communicators()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((3, 2)).astype(np.float32) for _ in range(4)]
    for axes in ([0], [1], [0, 1]):
        groups = mesh.groups(axes)

        def work(c):
            sub = c.split(groups)
            group = mesh.group_of(c.rank, axes)
            assert sub.size == len(group) and sub.global_ranks == tuple(group)
            assert sub.rank == group.index(c.rank)
            return sub.all_reduce(xs[c.rank], "sum")

        got = run_threads(comms, work)
        for group in groups:
            ref = sim.all_reduce([xs[r] for r in group], "sum")
            for r, want in zip(group, ref):
                assert np.array_equal(got[r], want)


def test_out_buffer_receives_the_result():
    comms = InProcessWorld(2).communicators()
    arena = np.zeros(64, np.float32)
    outs = [arena[0:6].reshape(2, 3), arena[32:38].reshape(2, 3)]
    xs = [np.full((2, 3), 1.5, np.float32), np.full((2, 3), 2.0, np.float32)]
    got = run_threads(comms, lambda c: c.all_reduce(xs[c.rank], "sum", out=outs[c.rank]))
    assert got[0] is outs[0] and np.all(arena[0:6] == 3.5) and np.all(arena[32:38] == 3.5)


def test_bad_arguments_raise_comm_errors():
    c = SelfCommunicator()
    with pytest.raises(CommError, match="unknown reduction 'prod'"):
        c.all_reduce(np.ones(3), "prod")
    with pytest.raises(CommError, match="chunk 0 of 5 over 1 ranks has 5"):
        c.all_gather(np.ones((2, 3)), 0, 5)
    with pytest.raises(CommError, match="out of range"):
        c.reduce_scatter(np.ones((2, 3)), 2)
    comms = InProcessWorld(2).communicators()
    with pytest.raises(CommError, match="do not partition"):
        comms[0].split([[0], [0, 1]])


def test_tcp_spin_setting_is_read_when_connecting(monkeypatch):
    """SHARDFLOW_TCP_SPIN_US is read when a communicator connects, not at import; a bad value is a
    CommError naming the variable, raised before any socket is opened."""
    from shardflow.runtime.comm.tcp import SPIN_US, TCPCommunicator, TCPStore

    class NoStore(TCPStore):
        def __init__(self):
            self.host, self.timeout_s = "127.0.0.1", 1.0

        def set(self, key, value):
            raise AssertionError("a socket was used before the setting was checked")

    monkeypatch.delenv("SHARDFLOW_TCP_SPIN_US", raising=False)
    assert TCPCommunicator(0, 1, {}, None).spin_us == SPIN_US
    monkeypatch.setenv("SHARDFLOW_TCP_SPIN_US", "0")
    assert TCPCommunicator(0, 1, {}, None).spin_us == 0.0
    for bad in ("fast", "-5", "nan"):
        monkeypatch.setenv("SHARDFLOW_TCP_SPIN_US", bad)
        with pytest.raises(CommError, match="SHARDFLOW_TCP_SPIN_US"):
            TCPCommunicator.connect(0, 2, NoStore())
    monkeypatch.delenv("SHARDFLOW_TCP_SPIN_US")
    monkeypatch.setenv("SHARDFLOW_COMM_TIMEOUT", "10s")
    with pytest.raises(CommError, match="SHARDFLOW_COMM_TIMEOUT='10s' is not a number of seconds"):
        TCPCommunicator.connect(0, 2, NoStore())


def test_number_settings_from_the_environment(monkeypatch):
    """Every numeric SHARDFLOW_* setting is parsed by one function: unset or empty gives the
    default, a number >= 0 is taken, anything else is the caller's error type naming the variable."""
    from shardflow.runtime.comm.watchdog import Watchdog
    from shardflow.runtime.errors import ShardflowError, number_from_env

    monkeypatch.delenv("SF_TEST_NUMBER", raising=False)
    assert number_from_env("SF_TEST_NUMBER", 2.5, "seconds") == 2.5
    monkeypatch.setenv("SF_TEST_NUMBER", " ")
    assert number_from_env("SF_TEST_NUMBER", 2.5, "seconds") == 2.5
    monkeypatch.setenv("SF_TEST_NUMBER", "0.25")
    assert number_from_env("SF_TEST_NUMBER", 2.5, "seconds") == 0.25
    for bad in ("abc", "-1", "nan", "1e"):
        monkeypatch.setenv("SF_TEST_NUMBER", bad)
        with pytest.raises(ShardflowError, match=f"SF_TEST_NUMBER='{bad}' is not a number of seconds >= 0"):
            number_from_env("SF_TEST_NUMBER", 2.5, "seconds")
        with pytest.raises(CommError):
            number_from_env("SF_TEST_NUMBER", 2.5, "seconds", CommError)
    comm = InProcessWorld(1).communicators()[0]
    monkeypatch.setenv("SHARDFLOW_HEARTBEAT_TIMEOUT", "7")
    assert Watchdog(comm).timeout_s == 7.0
    monkeypatch.setenv("SHARDFLOW_HEARTBEAT_TIMEOUT", "seven")
    with pytest.raises(CommError, match="SHARDFLOW_HEARTBEAT_TIMEOUT"):
        Watchdog(comm)


def test_the_watchdogs_abort_names_the_failed_rank():
    """Rank 0's watchdog sees rank 2's connection close before it finished: it stops, and so do the
    others, each told which rank failed (they record it for the launcher, which names the rank
    that failed first from those records under mpiexec; before, the relayed abort named none)."""
    import threading

    from shardflow.runtime.comm.watchdog import Watchdog

    failures = {}
    seen = threading.Event()

    def on_failure(rank):
        def f(message, failed):
            failures[rank] = (failed, message)
            if len(failures) == 2:
                seen.set()
        return f

    comms = InProcessWorld(3).communicators()
    dogs = run_threads(comms, lambda c: Watchdog(c, heartbeat_s=0.05, timeout_s=30, on_failure=on_failure(c.rank)))
    try:
        dogs[2]._stop.set()  # (rank 2 goes away without a word, as a killed process does)
        dogs[2]._sock.close()
        assert seen.wait(10), failures
        assert failures[0][0] == failures[1][0] == 2 and 2 not in failures, failures
        assert "rank 2 died" in failures[1][1] and failures[1][1].endswith("rank 1 stops"), failures
    finally:
        for d in dogs:
            d.stop()


def test_a_watchdog_closed_before_its_thread_runs_stops_quietly():
    """A rank's watchdog whose connection is closed before its thread first runs (stopped at
    once, as the test above stops rank 2's) returns without an exception in the thread; one whose
    connection is lost while it is watching reports the failure."""
    import socket

    from shardflow.runtime.comm.watchdog import Watchdog

    failures = []
    dog = Watchdog(InProcessWorld(1).communicators()[0], on_failure=lambda m, r: failures.append((m, r)))
    dog.rank, dog.global_ranks, dog._sock = 1, [0, 1], socket.socket()
    dog._sock.close()
    dog._stop.set()
    dog._client()  # (raised OSError: Bad file descriptor)
    assert failures == []
    dog._stop.clear()
    dog._client()
    assert len(failures) == 1 and "lost the watchdog connection to rank 0" in failures[0][0] and failures[0][1] == 0


def test_a_missing_peer_raises_rank_failed_naming_it():
    world = InProcessWorld(2, timeout_s=0.3)
    c0, _ = world.communicators()
    with pytest.raises(RankFailedError, match="no message from rank 1") as info:
        c0.all_reduce(np.ones(3, np.float32))
    assert info.value.rank == 1


def test_bytes_helpers():
    comms = InProcessWorld(3).communicators()
    got = run_threads(comms, lambda c: (c.broadcast_bytes(b"abc" if c.rank == 0 else None),
                                        c.allgather_bytes(bytes([c.rank]) * c.rank)))
    for b, g in got:
        assert b == b"abc" and g == [b"", b"\x01", b"\x02\x02"]


# ---------------------------------------------------------------------------------------
# real processes
# ---------------------------------------------------------------------------------------
def _has_mpi() -> bool:
    return shutil.which("mpiexec") is not None and importlib.util.find_spec("mpi4py") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not _has_mpi(), reason="needs mpiexec and mpi4py")
@pytest.mark.parametrize("n,mesh", [(2, "2"), (4, "2x2"), (3, "3")])
def test_mpi_collectives_across_processes(n, mesh):
    proc = subprocess.run([shutil.which("mpiexec"), "-n", str(n), sys.executable, str(HERE / "comm_check.py"), "mpi",
                           mesh], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == n


@pytest.mark.parametrize("n,mesh,spin_us", [(2, "2", "100"), (4, "2x2", "100"), (2, "2", "0")])
def test_tcp_collectives_across_processes(n, mesh, spin_us):
    """With and without polling the sockets before waiting in select (SHARDFLOW_TCP_SPIN_US)."""
    port = _free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   SHARDFLOW_TCP_SPIN_US=spin_us)
        for k in [k for k in env if k.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_"))]:
            env.pop(k)
        procs.append(subprocess.Popen([sys.executable, str(HERE / "comm_check.py"), "tcp", mesh], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
