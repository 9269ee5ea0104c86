"""The cuda engine's run loop (runtime/cuda_exec.py) without a GPU: cupy replaced by a numpy stand-in
whose kernels are Python functions and whose CUDA graphs record launches and replay them.

What this checks is the engine's own bookkeeping: eager first run, then captured graphs; the
graph of every step, and the one without the trailing kernels that write fresh output arrays
(``copy_outputs=True`` with device inputs); that those arrays are new on every run, untouched by
later runs, and hold the same values as the arena's. The real thing runs in
tests/runtime/test_gpu_runtime.py (``pytest -m gpu``).
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
from fake_cupy import _Array, _fake_cupy


def _program():
    """x (input) + w (weights) -> h; y = 2 h (output, written by the last kernel); all float32."""
    def buf(name, shape, storage, offset):
        return {"name": name, "shape": list(shape), "dtype": "float32", "storage": storage, "offset": offset}
    buffers = [buf("x", (4,), "arena", 0), buf("w", (4,), "weights", 0), buf("h", (4,), "arena", 16),
               buf("y", (4,), "arena", 32)]
    launch = {"grid": [1, 1, 1], "block": [32, 1, 1]}
    steps = [{"kind": "kernel", "node": "add", "symbol": "add", "inputs": [0, 1], "outputs": [2], "launch": launch},
             {"kind": "kernel", "node": "twice", "symbol": "twice", "inputs": [2], "outputs": [3], "launch": launch}]
    return {"buffers": buffers, "steps": steps, "inputs": [["x", 0]], "outputs": [["y", 3]], "arena_bytes": 48}


def add(x, w, h):
    np.add(x, w, out=h)


def twice(h, y):
    np.multiply(h, 2, out=y)


@pytest.fixture
def engine(monkeypatch):
    log: list = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy({"add": add, "twice": twice}, log))
    from shardflow.runtime.cuda_exec import CudaEngine

    prog = types.SimpleNamespace(program=_program(), weights=np.arange(4, dtype=np.float32).view(np.uint8),
                                 buffers=[None] * 4, directory=Path("."), rank=0, groups={})
    return CudaEngine(prog), log


def test_runs_eagerly_then_from_graphs(engine):
    eng, log = engine
    x = np.ones(4, np.float32)
    want = 2 * (x + np.arange(4))
    for _ in range(3):  # eager, then the graph of every step, captured once and replayed
        np.testing.assert_array_equal(eng.run({"x": x})["y"], want)
    assert set(eng.graphs) == {"all"} and len(eng.graphs["all"][0][0].calls) == 2
    assert log == ["add", "twice"] * 3


def test_fresh_outputs_are_written_by_the_last_kernel(engine):
    eng, log = engine
    assert len(eng.tail) == 1 and eng.fresh_buffers == {3}
    x = np.ones(4, np.float32).view(_Array)
    arena_y = eng.outputs[0][2]
    runs = []
    for k in range(4):  # eager, then the graph without the last kernel, which runs on its own
        runs.append(eng.run({"x": x * (k + 1)}))
        y = runs[-1]["y"]
        assert type(y) is _Array and y.data.ptr != arena_y.data.ptr
        np.testing.assert_array_equal(y, 2 * ((k + 1) + np.arange(4)))
    assert len({r["y"].data.ptr for r in runs}) == 4  # a new array each run
    assert set(eng.graphs) == {"body"} and len(eng.graphs["body"][0][0].calls) == 1
    assert log == ["add", "twice"] * 4
    # the arena's own output buffer, when asked for (and the earlier fresh arrays left alone)
    view = eng.run({"x": x * 9}, copy_outputs=False)["y"]
    assert view.data.ptr == arena_y.data.ptr
    np.testing.assert_array_equal(view, 2 * (9 + np.arange(4)))
    np.testing.assert_array_equal(runs[0]["y"], 2 * (1 + np.arange(4)))
    assert set(eng.graphs) == {"body", "all"}


def scale(w, c):
    np.multiply(w, 3, out=c)


def test_load_steps_run_once_before_the_graphs(monkeypatch):
    """A program whose first step (``load_steps`` = 1) computes c = 3 w from the weights alone: the
    engine launches it once when it loads, never in a run or a captured graph, and the runs read c."""
    log: list = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy({"scale": scale, "add": add, "twice": twice}, log))
    from shardflow.runtime.cuda_exec import CudaEngine

    p = _program()
    p["buffers"].append({"name": "c", "shape": [4], "dtype": "float32", "storage": "arena", "offset": 48})
    p["arena_bytes"] = 64
    launch = p["steps"][0]["launch"]
    p["steps"][0]["inputs"] = [0, 4]  # add(x, c)
    p["steps"].insert(0, {"kind": "kernel", "node": "scale", "symbol": "scale", "inputs": [1], "outputs": [4],
                          "launch": launch})
    p["load_steps"] = 1
    prog = types.SimpleNamespace(program=p, weights=np.arange(4, dtype=np.float32).view(np.uint8),
                                 buffers=[None] * 5, directory=Path("."), rank=0, groups={})
    eng = CudaEngine(prog)
    assert log == ["scale"]
    for k in range(3):  # eager, then the graph of the two other steps
        np.testing.assert_array_equal(eng.run({"x": np.full(4, k, np.float32)})["y"], 2 * (k + 3 * np.arange(4)))
    assert len(eng.graphs["all"][0][0].calls) == 2
    assert log == ["scale"] + ["add", "twice"] * 3


def test_state_copied_after_the_steps_and_inside_the_graph(monkeypatch):
    """A state (``compile(state=...)``): x (input) + w -> h is the next run's x, y = 2 h the output
    (d: an input no kernel reads, given as a device array to make the runs return device arrays).
    x's view is zeroed at load; a run given x sets it, a run without it reads the previous h, which
    the engine copies into x after the steps: eagerly at first, then inside the captured graph (the
    graph of every step, or the one without the trailing kernel that writes a fresh y)."""
    log: list = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy({"add": add, "twice": twice}, log))
    from shardflow.runtime.cuda_exec import CudaEngine

    p = _program()
    p["buffers"].append({"name": "d", "shape": [4], "dtype": "float32", "storage": "arena", "offset": 48})
    p["inputs"].append(["d", 4])
    p["arena_bytes"] = 64
    p["state"] = [{"input": "x", "input_buffer": 0, "output": "h", "output_buffer": 2, "in_place": False}]
    prog = types.SimpleNamespace(program=p, weights=np.arange(4, dtype=np.float32).view(np.uint8),
                                 buffers=[None] * 5, directory=Path("."), rank=0, groups={})
    eng = CudaEngine(prog)
    w = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(eng.read_state()["x"], 0)
    x = np.full(4, 5, np.float32)
    d = np.zeros(4, np.float32)
    for k in range(6):  # runs 0-2 with numpy inputs (graph "all"), 3-5 with a device one (graph "body", y fresh)
        feeds = {"d": d} if k < 3 else {"d": d.view(_Array)}
        if k in (0, 4):
            feeds["x"] = x
        y = eng.run(feeds)["y"]
        assert (type(y) is _Array) == (k >= 3)
        x = x + w
        np.testing.assert_array_equal(y, 2 * x)
        np.testing.assert_array_equal(eng.read_state()["x"], x)
    assert set(eng.graphs) == {"all", "body"}
    assert len(eng.graphs["all"][0][0].calls) == 3 and len(eng.graphs["body"][0][0].calls) == 2  # (kernels + copy)
    eng.reset_state()
    np.testing.assert_array_equal(eng.read_state()["x"], 0)


@pytest.mark.parametrize("cluster,want", [(1, 131), (2, 130)])
def test_a_persistent_grid_lowered_to_the_device_stays_whole_clusters(monkeypatch, caplog, cluster, want):
    """A persistent kernel sized for 132 multiprocessors on a device with 131: the engine lowers its
    grid to one block per multiprocessor, and to whole clusters for a kernel with cluster dimensions
    (``launch["cluster"]``: the driver refuses a grid that is not a multiple of them); it says the
    program was compiled for another GPU (the manifest's ``sm_count``)."""
    log: list = []
    cp = _fake_cupy({"add": add, "twice": twice}, log)
    cp.cuda.Device = lambda: types.SimpleNamespace(id=0, attributes={"MultiProcessorCount": 131})
    monkeypatch.setitem(sys.modules, "cupy", cp)
    from shardflow.runtime.cuda_exec import CudaEngine

    p = _program()
    p["steps"][0]["launch"] = {"grid": [132, 1, 1], "block": [32, 1, 1], "persistent": True, "cluster": cluster}
    prog = types.SimpleNamespace(program=p, weights=np.arange(4, dtype=np.float32).view(np.uint8),
                                 buffers=[None] * 4, directory=Path("."), rank=0, groups={}, manifest={"sm_count": 132})
    eng = CudaEngine(prog)
    assert "sized for 132 multiprocessors and this GPU has 131" in caplog.text and "'sm_count'] = 131" in caplog.text
    (launches, _), = eng.segments
    assert launches[0].args[0] == (want, 1, 1) and launches[1].args[0] == (1, 1, 1)
    np.testing.assert_array_equal(eng.run({"x": np.ones(4, np.float32)})["y"], 2 * (1 + np.arange(4)))


def copy_bytes(x, y):
    np.copyto(y, x)


def test_a_float8_input_reaches_the_device_as_its_bytes(monkeypatch):
    """A float8 input (ml_dtypes' array on the host, bytes in the arena: cupy has no float8) is
    copied as its bytes, not converted to their integer values; the output comes back as bytes."""
    import ml_dtypes

    log: list = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy({"copy": copy_bytes}, log))
    from shardflow.runtime.cuda_exec import CudaEngine

    buffers = [{"name": n, "shape": [4], "dtype": "float8_e4m3fn", "storage": "arena", "offset": o}
               for n, o in (("x", 0), ("y", 64))]
    steps = [{"kind": "kernel", "node": "copy", "symbol": "copy", "inputs": [0], "outputs": [1],
              "launch": {"grid": [1, 1, 1], "block": [32, 1, 1]}}]
    p = {"buffers": buffers, "steps": steps, "inputs": [["x", 0]], "outputs": [["y", 1]], "arena_bytes": 128}
    prog = types.SimpleNamespace(program=p, weights=np.zeros(0, np.uint8), buffers=[None] * 2,
                                 directory=Path("."), rank=0, groups={})
    x = np.array([1.5, -448.0, 0.25, 3.0], ml_dtypes.float8_e4m3fn)
    y = CudaEngine(prog).run({"x": x})["y"]
    assert y.dtype == np.uint8 and y.tobytes() == x.tobytes()


def test_kernel_profile_times_each_kernel_from_a_graph(monkeypatch):
    """benchmarks/gpu/kernel_profile.py's timings on the engine: each kernel step ``reps`` times
    launched from Python (``eager_ms``), then ``reps`` launches of it captured in a graph and the
    graph replayed three times (``ms``), then the whole program's graph replayed ten times."""
    import importlib.util
    import time

    log: list = []
    cp = _fake_cupy({"add": add, "twice": twice}, log)

    class Event:
        def record(self, stream=None):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

    cp.cuda.Event = Event
    cp.cuda.get_elapsed_time = lambda a, b: 1e3 * (b.t - a.t)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    from shardflow.runtime.cuda_exec import CudaEngine

    p = _program()
    for step in p["steps"]:
        step["launch"] = {**step["launch"], "kind": "elementwise"}
    prog = types.SimpleNamespace(program=p, weights=np.arange(4, dtype=np.float32).view(np.uint8),
                                 buffers=[None] * 4, directory=Path("."), rank=0, groups={})
    eng = CudaEngine(prog)
    for _ in range(2):  # (eager, then the graph: as kernel_profile.profile runs a loaded program)
        eng.run({"x": np.ones(4, np.float32)})
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("sf_kernel_profile", bench / "kernel_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    del log[:]
    res = mod.time_steps(eng, p, reps=4)
    assert [r["node"] for r in res["steps"]] == ["add", "twice"]
    assert all(r["ms"] >= 0 and r["eager_ms"] >= 0 for r in res["steps"])
    assert res["by_kind"] == {"elementwise": {"kernels": 2, "ms": res["sum_ms"]}} and res["graph_ms"] >= 0
    # per kernel: 1 warm-up, 3 x 4 from Python, the graph of 4 launched once to warm up and 3 times timed;
    # then the program's graph 10 times
    per_kernel = 1 + 3 * 4 + 4 + 3 * 4
    assert log == ["add"] * per_kernel + ["twice"] * per_kernel + ["add", "twice"] * 10


def test_a_device_that_cannot_hold_the_program_is_a_memory_limit_error(monkeypatch):
    """cupy's OutOfMemoryError names no program: the engine's error names the rank, the folder, the
    sizes and what to do."""
    cp = _fake_cupy({"add": add, "twice": twice}, [])

    class OutOfMemoryError(Exception):
        pass

    def full(n, dtype):
        raise OutOfMemoryError(f"Out of memory allocating {n:,} bytes")
    cp.cuda.memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError)
    cp.zeros = full
    monkeypatch.setitem(sys.modules, "cupy", cp)
    from shardflow.runtime import MemoryLimitError
    from shardflow.runtime.cuda_exec import CudaEngine

    p = _program()
    p["arena_bytes"] = 3 << 30
    prog = types.SimpleNamespace(program=p, weights=np.arange(4, dtype=np.float32).view(np.uint8),
                                 buffers=[None] * 4, directory=Path("out/rank1"), rank=1, groups={})
    with pytest.raises(MemoryLimitError, match=r"rank 1: the program in 'out/rank1' needs 16 B of weights and "
                                               r"3\.0 GiB of working memory .* on GPU 0, which could not allocate them "
                                               r"\(Out of memory allocating 3,221,225,472 bytes\); run it on a GPU"):
        CudaEngine(prog)
