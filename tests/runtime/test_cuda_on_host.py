"""Whole cuda programs without a GPU: compiled by ``compile`` for the cuda target (sm_90), loaded by
``load`` and run by the runtime's cuda engine, their kernels on the host emulation of CUDA
(``tests/host_cupy.py``: the compile keeps each library's CUDA source instead of running nvcc, and
cupy's numpy stand-in runs that source compiled with g++ against ``tests/cuda_host.py``). Against
onnxruntime: the test models at float32, float16, bfloat16 and TF32, eagerly and from the engine's
captured graphs; a decoding step keeping its KV cache on the device; two Megatron ranks exchanging
through an in-process communicator. What the kernels compute is tested kernel by kernel in
tests/codegen/test_cuda_host.py and on a GPU by ``pytest -m gpu``; this is the program around them:
buffers, offsets, load steps, state, graphs and collectives (shape variants:
tests/driver/test_variants.py), as they run where no GPU was lent."""
from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
from host_cupy import use_host_cuda
from model_refs import MODELS
from test_state import _cache_state, _llama_steps
from threads import run_threads

from shardflow.compiler import compile
from shardflow.runtime import load
from shardflow.runtime.comm import CommError, InProcessCommunicator, InProcessWorld

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")


@pytest.fixture
def host(monkeypatch, tmp_path_factory):
    """The launched kernels' symbols, in order (the emulation set up for the test)."""
    log: list = []
    use_host_cuda(monkeypatch, str(tmp_path_factory.getbasetemp() / "cuda-host-kernels"), log)
    return log


def _close(got, want, tol, what=""):
    scale = max(float(np.abs(want).max()), 1.0)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * scale, err_msg=what)


def _session(path):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return lambda feeds: dict(zip(names, sess.run(None, feeds)))


@pytest.mark.parametrize("model,precision,tol", [("gpt2_ts17", "float32", 1e-5), ("llama_ts17", "float16", 2e-2),
                                                 ("bert_ts17", "bfloat16", 5e-2), ("t5_encoder_ts17", "tf32", 2e-2)])
def test_a_test_model_runs_through_the_cuda_engine(tmp_path, host, model, precision, tol):
    """The run eager, then from the captured graph of every step (the same kernels launched again,
    once each), the outputs onnxruntime's within the precision's tolerance."""
    path = MODELS / f"{model}.onnx"
    feeds = dict(np.load(MODELS / f"{model.rsplit('_', 1)[0]}_inputs.npz"))
    res = compile(str(path), distributed_config={"mesh_shape": [1]}, out_dir=tmp_path / "out",
                  optimization_config={"target": "cuda", "precision": precision},
                  input_shapes={k: v.shape for k, v in feeds.items()})
    prog = load(res.out_dir)
    want = _session(path)(feeds)
    runs = []
    for k in range(3):
        got = prog.run(feeds)
        runs.append(list(host))
        assert set(got) == set(prog.output_names) and prog.output_names
        for name in prog.output_names:
            _close(got[name], want[name], tol, f"{model} {precision} run {k} {name}")
    per_run = len(runs[0])
    assert per_run >= 10 and runs[2] == runs[0] * 3  # (every step once a run, eager or from the graph)
    assert prog._engine.graphs


def test_a_decoding_step_keeps_its_cache_on_the_device(tmp_path, host):
    """onnxruntime-genai's Llama as a decoding program whose four presents are kept as state, written in
    place by their kernels: five greedy steps (the first given the zero past, the others the token and
    the mask only), the logits and the kept cache against onnxruntime fed its own presents; then
    ``reset_state``."""
    steps = list(_llama_steps(5))
    state = _cache_state(2)
    first, _ = steps[0]
    res = compile(str(MODELS / "llama_genai_fp32.onnx"), distributed_config={"mesh_shape": [1]},
                  optimization_config={"target": "cuda"}, out_dir=tmp_path / "out",
                  input_shapes={k: v.shape for k, v in first.items()}, state=state)
    prog = load(res.out_dir)
    for step, (given, want) in enumerate(steps):
        got = prog.run(given)
        _close(got["logits"], want["logits"], 1e-4, f"step {step}")
        kept = prog.read_state()
        for out, name in state.items():
            _close(kept[name], want[out], 1e-4, f"step {step} {name}")
    prog.reset_state()
    assert all(not v.any() for v in prog.read_state().values())
    # (profile and trace: each step timed between CUDA events on the rank's stream; here the stand-in's)
    program = json.loads((res.out_dir / "rank0" / "program.json").read_text())
    steps = program["steps"][program.get("load_steps", 0):]
    assert [(p["kind"], p["node"]) for p in prog.profile(first, repeat=2)] == [(s["kind"], s["node"]) for s in steps]
    events = prog.trace(first, runs=2)
    assert [(e["run"], e["node"]) for e in events] == [(r, s["node"]) for r in range(2) for s in steps]
    assert all(b["start_ns"] >= a["end_ns"] - 1 for a, b in zip(events, events[1:]) if a["run"] == b["run"])
    with pytest.raises(ValueError, match="runs = 0 must be at least 1"):
        prog.trace(first, runs=0)


def test_two_megatron_ranks_on_the_host(tmp_path, host):
    """GPT-2's test export split Megatron-style over two ranks (all-reduces of device arrays staged
    through an in-process communicator, so the engine runs a captured graph per stretch of kernels
    between them): each rank's logits onnxruntime's, eagerly and from the graphs, and without graphs."""
    path = MODELS / "gpt2_ts17.onnx"
    feeds = dict(np.load(MODELS / "gpt2_inputs.npz"))
    want = _session(path)(feeds)["logits"]
    for graphs in (True, False):
        res = compile(str(path), distributed_config={"mesh_shape": [2], "algo": "megatron"},
                      optimization_config={"target": "cuda", "cuda_graph": graphs}, out_dir=tmp_path / str(graphs),
                      input_shapes={k: v.shape for k, v in feeds.items()})
        steps = json.loads((res.out_dir / "rank0" / "program.json").read_text())["steps"]
        assert sum(s["kind"] == "collective" and s["collective"] == "all_reduce" for s in steps) >= 2
        world = InProcessWorld(2).communicators()
        progs = [load(res.out_dir, c.rank, c) for c in world]
        for k in range(3):
            for r, got in enumerate(run_threads(world, lambda c: progs[c.rank].run(feeds)["logits"], timeout=120)):
                _close(got, want, 1e-5, f"rank {r} run {k} graphs {graphs}")
        assert all(bool(p._engine.graphs) == graphs for p in progs)


def test_pipeline_stages_of_cuda_ranks_on_the_host(tmp_path, host):
    """GPT-2's test export cut into 2 pipeline stages of 2 Megatron ranks each (compiler/stages.py): the
    stages' cuda programs on the host emulation, the cut's tensors and the logits through the host
    communicator (runtime/pipeline.py); the last stage's logits onnxruntime's, twice, and gathered on rank 0."""
    path = MODELS / "gpt2_ts17.onnx"
    feeds = dict(np.load(MODELS / "gpt2_inputs.npz"))
    want = _session(path)(feeds)["logits"]
    res = compile(str(path), distributed_config={"mesh_shape": [2, 2], "algo": "megatron", "pipeline_stages": 2},
                  optimization_config={"target": "cuda"}, out_dir=tmp_path / "pp",
                  input_shapes={k: v.shape for k, v in feeds.items()})
    assert res.world_size == 4 and [r.world_size for r in res.stages] == [2, 2]
    world = InProcessWorld(4).communicators()
    progs = run_threads(world, lambda c: load(res.out_dir, c.rank, c), timeout=120)
    for k in range(2):
        outs = run_threads(world, lambda c: progs[c.rank].run(feeds), timeout=120)
        assert [sorted(o) for o in outs] == [[], [], ["logits"], ["logits"]]
        for r in (2, 3):
            _close(np.asarray(outs[r]["logits"]), want, 1e-5, f"rank {r} run {k}")
    full = run_threads(world, lambda c: progs[c.rank].gather_outputs(outs[c.rank]), timeout=120)
    _close(np.asarray(full[0]["logits"]), want, 1e-5, "gathered on rank 0")
    # (a rank_map placing rank 0 in the last stage, 2 microbatches, traced: the logits gathered on rank 0 are
    # its own; every rank's trace has its transfers and its kernels)
    res = compile(str(path), distributed_config={"mesh_shape": [2, 2], "algo": "megatron", "pipeline_stages": 2,
                                                 "pipeline_microbatches": 2, "rank_map": [2, 3, 0, 1]},
                  optimization_config={"target": "cuda"}, out_dir=tmp_path / "pm",
                  input_shapes={k: v.shape for k, v in feeds.items()})
    assert res.pipeline["ranks"] == [[2, 3], [0, 1]]
    progs = run_threads(world, lambda c: load(res.out_dir, c.rank, c), timeout=120)
    full = run_threads(world, lambda c: progs[c.rank].gather_outputs(progs[c.rank].run(feeds)), timeout=120)
    _close(np.asarray(full[0]["logits"]), want, 1e-5, "gathered on rank 0, in the last stage")
    traces = run_threads(world, lambda c: progs[c.rank].trace(feeds), timeout=120)
    assert [{e["kind"] for e in t} for t in traces] == [{"kernel", "collective", "receive"}] * 2 + [
        {"kernel", "collective", "send"}] * 2


class _DeviceComm(InProcessCommunicator):
    """A rank of an in-process world that moves device arrays only, as NCCL does (``host_only`` False, a
    host array refused), with a host communicator of the same ranks as its ``bootstrap``; it counts the
    arrays it moved and its ``wait`` calls (shared by the communicators split off it)."""

    host_only = False

    def __init__(self, world, rank, boot, counts):
        super().__init__(world, rank)
        self.bootstrap, self.counts = boot, counts

    def exchange(self, sends, recvs) -> None:
        for a in list(sends.values()) + list(recvs.values()):
            if not type(a).__module__.startswith("cupy"):
                raise CommError(f"a device communicator given a host array ({type(a).__name__})")
        self.counts["moved"] += len(sends)
        super().exchange(sends, recvs)

    def wait(self) -> None:
        self.counts["waits"] += 1


def _device_world(n: int) -> list[_DeviceComm]:
    world, boots = InProcessWorld(n), InProcessWorld(n).communicators()
    return [_DeviceComm(world, r, boots[r], Counter()) for r in range(n)]


def test_cuda_pipeline_stages_send_device_arrays(tmp_path, host):
    """Cuda stages on a device communicator (NCCL's contract, stood in for in-process): the cut's tensors go
    from device to device (a host array given to it is refused), each transfer waited for; host inputs give
    host outputs, device inputs device ones; the last stage's logits onnxruntime's, with 2 microbatches, and
    gathered on rank 0 through the host communicator."""
    path = MODELS / "gpt2_ts17.onnx"
    feeds = dict(np.load(MODELS / "gpt2_inputs.npz"))
    want = _session(path)(feeds)["logits"]
    res = compile(str(path), distributed_config={"mesh_shape": [2, 2], "algo": "megatron", "pipeline_stages": 2,
                                                 "pipeline_microbatches": 2},
                  optimization_config={"target": "cuda"}, out_dir=tmp_path / "pp",
                  input_shapes={k: v.shape for k, v in feeds.items()})
    world = _device_world(4)
    progs = run_threads(world, lambda c: load(res.out_dir, c.rank, c), timeout=120)
    assert all(p._device for p in progs)
    outs = run_threads(world, lambda c: progs[c.rank].run(feeds), timeout=120)
    for r in (2, 3):
        assert isinstance(outs[r]["logits"], np.ndarray) and type(outs[r]["logits"]) is np.ndarray
        _close(outs[r]["logits"], want, 1e-5, f"rank {r}")
    cuts = [e for e in res.pipeline["transfers"] if e["kind"] == "cut"]
    assert cuts and all(c.counts["moved"] >= 2 * len(cuts) for c in world[:2])  # (2 microbatches)
    assert all(c.counts["waits"] >= 2 * len(cuts) for c in world)
    import cupy

    device_feeds = {k: cupy.asarray(v) for k, v in feeds.items()}
    outs = run_threads(world, lambda c: progs[c.rank].run(device_feeds), timeout=120)
    assert type(outs[2]["logits"]).__module__.startswith("cupy")
    _close(np.asarray(outs[3]["logits"]), want, 1e-5, "device inputs")
    full = run_threads(world, lambda c: progs[c.rank].gather_outputs(progs[c.rank].run(feeds)), timeout=120)
    _close(np.asarray(full[0]["logits"]), want, 1e-5, "gathered on rank 0")
    # (traced: the steps timed between events return device copies, which the sends take as they are)
    def stage0(c):  # (its two ranks together: their program's all-reduces; microbatch 0's row)
        p = progs[c.rank]
        return p.program.traced_run({k: device_feeds[k][:1] for k in p._stage_spec["graph_inputs"]}, []) \
            if p.stage == 0 else None
    got = run_threads(world, stage0, timeout=120)[0]
    assert got and all(type(a).__module__.startswith("cupy") for a in got.values())
    traces = run_threads(world, lambda c: progs[c.rank].trace(feeds), timeout=120)
    assert [{e["kind"] for e in t} for t in traces] == [{"kernel", "collective", "send"}] * 2 + [
        {"kernel", "collective", "receive"}] * 2


def test_a_kv_cache_on_cuda_pipeline_stages_with_microbatches(tmp_path, host):
    """onnxruntime-genai's Llama decoding step on 2 stages of one cuda rank, 2 microbatches (a sequence
    each): each stage keeps an instance of its program per microbatch (``RankProgram.twin``), its own
    arena holding its sequence's rows of the cache on the device, the weights' device arrays the first
    instance's; five greedy steps, the last stage's logits and each stage's cache against onnxruntime."""
    steps = list(_llama_steps(5))
    state = _cache_state(2)
    first, _ = steps[0]
    res = compile(str(MODELS / "llama_genai_fp32.onnx"),
                  distributed_config={"mesh_shape": [2], "pipeline_stages": 2, "pipeline_microbatches": 2},
                  optimization_config={"target": "cuda"}, out_dir=tmp_path / "pp",
                  input_shapes={k: v.shape for k, v in first.items()}, state=state)
    world = InProcessWorld(2).communicators()
    progs = run_threads(world, lambda c: load(res.out_dir, c.rank, c), timeout=120)
    for p in progs:
        a, b = p._programs
        assert a._engine.arena is not b._engine.arena
        assert all(b._engine.regions[k] is v for k, v in a._engine.regions.items())
        assert b.borrowed_weights_bytes == a.weights.nbytes > 0
    for step, (given, want) in enumerate(steps):
        outs = run_threads(world, lambda c: progs[c.rank].run(given), timeout=120)
        _close(np.asarray(outs[1]["logits"]), want["logits"], 1e-4, f"step {step}")
        kept = run_threads(world, lambda c: progs[c.rank].read_state(), timeout=120)
        for r in range(2):
            for out, name in state.items():
                if name in kept[r]:
                    _close(kept[r][name], want[out], 1e-4, f"rank {r} step {step} {name}")
    assert sorted(n for k in kept for n in k) == sorted(state.values())


def test_a_bfloat16_input_given_on_the_device_as_its_bits(tmp_path, host):
    """cupy has no bfloat16: a cuda program takes a bfloat16 input on the device as its bit pattern
    (``uint16``, what a cuda pipeline stage receives a bfloat16 cut tensor into), the same outputs as
    ml_dtypes' bfloat16 on the host; a device array of another dtype is refused, naming the input."""
    import ml_dtypes
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT), helper.make_node("Relu", ["xf"], ["y"])],
        "bf16_in", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
    path = tmp_path / "m.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    prog = load(compile(str(path), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cuda"},
                        out_dir=tmp_path / "out").out_dir)
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(ml_dtypes.bfloat16)
    want = np.maximum(x.astype(np.float32), 0)
    np.testing.assert_array_equal(prog.run({"x": x})["y"], want)
    import cupy

    np.testing.assert_array_equal(np.asarray(prog.run({"x": cupy.asarray(x.view(np.uint16))})["y"]), want)
    from shardflow.runtime.executor import InputDtypeError

    with pytest.raises(InputDtypeError, match="input 'x' has dtype int16"):
        prog.run({"x": cupy.asarray(x.view(np.int16))})
