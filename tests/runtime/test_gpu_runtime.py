"""The cuda runtime on a GPU: cross-compiled models run eagerly and as CUDA graphs, with numpy or
cupy inputs, with NCCL at world size 1, and at 2-4 ranks sharing one GPU (MPI and TCP host
staging), against onnxruntime. Skipped without cupy and a CUDA device."""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
MODELS = Path(__file__).parent.parent / "models"


def _cupy():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # noqa: BLE001
        return None


def _compile(tmp_path, model, mesh, algo, **opt):
    from shardflow.compiler import compile
    from shardflow.compiler.codegen.toolchain import ToolchainError

    try:
        res = compile(MODELS / f"{model}.onnx", distributed_config={"mesh_shape": mesh, "algo": algo},
                      optimization_config={"target": "cuda", "arch": "sm_90", **opt}, out_dir=tmp_path / "o")
    except ToolchainError as exc:  # no nvcc/NVRTC here (any other failure is a failure)
        pytest.skip(f"cannot cross-compile for cuda here: {exc}")
    inputs = dict(np.load(MODELS / f"{model.rsplit('_', 1)[0]}_inputs.npz"))
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(MODELS / f"{model}.onnx"), providers=["CPUExecutionProvider"])
    ref = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, inputs)))
    return res.out_dir, inputs, ref


def _close(got, ref, rel_scale=0.0):
    """rtol/atol 1e-3 (float32); with ``rel_scale`` the absolute tolerance is that fraction of the
    output's largest magnitude (lower precisions)."""
    for k, v in ref.items():
        g = got[k].get() if type(got[k]).__module__.startswith("cupy") else got[k]
        atol = max(1e-3, rel_scale * float(np.abs(v).max()))
        np.testing.assert_allclose(g, v, rtol=max(1e-3, rel_scale), atol=atol, err_msg=k)


@pytest.mark.parametrize("model", ["mlp_ts17", "gpt2_ts17", "bert_dynamo18", "llama_ts17", "vit_dynamo18",
                                   "resnet_ts17", "t5_encoder_ts17", "gpt2_dynamo18", "resnet_dynamo18"])
def test_one_rank_eager_graph_cupy_and_nccl(tmp_path, model):
    cp = _cupy()
    if cp is None:
        pytest.skip("needs cupy and a CUDA device")
    from shardflow.runtime import load
    from shardflow.runtime.comm import SelfCommunicator
    from shardflow.runtime.comm.nccl import NCCLCommunicator, nccl_available

    out, inputs, ref = _compile(tmp_path, model, [1], "replicate")
    prog = load(out)
    _close(prog.run(inputs), ref)        # eager warm-up
    _close(prog.run(inputs), ref)        # captured CUDA graph
    assert prog._engine.graphs is not None and prog._engine.capturable
    got = prog.run({k: cp.asarray(v) for k, v in inputs.items()})
    assert all(type(v).__module__.startswith("cupy") for v in got.values())
    _close(got, ref)
    # fresh device outputs (the last kernels may write them straight into new arrays): each run
    # gives arrays of its own, which later runs on other inputs, copying or not, leave alone
    kept = {k: v.copy() for k, v in got.items()}
    other = {k: cp.asarray(np.roll(v, 1) if v.dtype.kind in "iub" else v * 0.5) for k, v in inputs.items()}
    again = prog.run(other)
    assert all(again[k].data.ptr != got[k].data.ptr for k in got)
    _close(prog.run({k: cp.asarray(v) for k, v in inputs.items()}), ref)
    prog.run(other, copy_outputs=False)
    assert all(bool((got[k] == kept[k]).all()) for k in got)
    if nccl_available():
        _close(load(out, 0, NCCLCommunicator(SelfCommunicator())).run(inputs), ref)


def test_profile_and_trace_on_the_gpu(tmp_path):
    """RankProgram.profile and trace of a cuda program: each step launched from Python between CUDA events on
    the rank's stream (CudaEngine.timed_run), the device's times; the traced run's outputs onnxruntime's,
    and a graph-replayed run after them too."""
    cp = _cupy()
    if cp is None:
        pytest.skip("needs cupy and a CUDA device")
    import json

    from shardflow.runtime import load

    out, inputs, ref = _compile(tmp_path, "gpt2_ts17", [1], "replicate")
    prog = load(out)
    steps = json.loads((out / "rank0" / "program.json").read_text())
    steps = steps["steps"][steps.get("load_steps", 0):]
    records = prog.profile(inputs, repeat=3)
    assert [r["node"] for r in records] == [s["node"] for s in steps]
    assert all(r["ms"] >= 0 for r in records) and sum(r["ms"] for r in records) > 0
    events = prog.trace(inputs, runs=2)
    assert [(e["run"], e["node"]) for e in events] == [(r, s["node"]) for r in range(2) for s in steps]
    _close(prog.traced_run(inputs, []), ref)
    _close(prog.run(inputs), ref)
    _close(prog.run(inputs), ref)


@pytest.mark.parametrize("model,precision,tiles", [("gpt2_ts17", "float16", None), ("llama_ts17", "float32", None),
                                                   ("gpt2_ts17", "float16", "tma64x128"),
                                                   ("llama_ts17", "float16", "pp64x128")])
def test_programmatic_dependent_launch(tmp_path, model, precision, tiles):
    """RFC 0005 decisions 29 and 48: a program compiled with ``pdl`` launches every kernel through
    cuLaunchKernelEx with programmatic serialization, eagerly, in CUDA graphs and for fresh device
    outputs, and gives the outputs of the same program without it (bit for bit: the same products,
    each kernel waiting for the one before; ``tiles``: every product on that persistent tile, whose
    weight's first stages load before the wait)."""
    cp = _cupy()
    if cp is None:
        pytest.skip("needs cupy and a CUDA device")
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    from shardflow.runtime import load

    for d in ("plain", "pdl"):
        (tmp_path / d).mkdir()
    forced = {"gemm_tiles": {"*": tiles}} if tiles else {}
    plain, inputs, ref = _compile(tmp_path / "plain", model, [1], "replicate", precision=precision, **forced)
    pdl, _, _ = _compile(tmp_path / "pdl", model, [1], "replicate", precision=precision, pdl=True, **forced)
    want = load(plain).run(inputs)
    prog = load(pdl)
    assert prog._engine.pdl
    for _ in range(3):  # eager, captured, replayed
        got = prog.run(inputs)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    dev = prog.run({k: cp.asarray(v) for k, v in inputs.items()})
    assert all(np.array_equal(dev[k].get(), want[k]) for k in want)
    _close(got, ref, rel_scale=5e-3 if precision != "float32" else 0.0)


def _clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_COMM", "PMIX_", "SLURM_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


BACKENDS = ["tcp", pytest.param("mpi", marks=pytest.mark.skipif(
    shutil.which("mpiexec") is None or importlib.util.find_spec("mpi4py") is None, reason="needs mpiexec + mpi4py"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model,mesh,algo", [("gpt2_ts17", [2], "megatron"), ("bert_dynamo18", [2], "megatron"),
                                             ("gpt2_ts17", [2, 2], "data"), ("mlp_ts17", [4], "data")])
def test_ranks_sharing_one_gpu(tmp_path, backend, model, mesh, algo):
    if _cupy() is None:
        pytest.skip("needs cupy and a CUDA device")
    out, inputs, ref = _compile(tmp_path, model, mesh, algo)
    np.savez(tmp_path / "in.npz", **inputs)
    world = int(np.prod(mesh))
    proc = subprocess.run([sys.executable, "-m", "shardflow.runtime.launch", str(out), "--nproc", str(world),
                           "--launcher", "mpiexec" if backend == "mpi" else "spawn", "--backend", backend,
                           "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "out.npz"),
                           "--repeat", "3"], capture_output=True, text=True, timeout=300, env=_clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    _close(dict(np.load(tmp_path / "out.npz")), ref)


@pytest.mark.parametrize("model", ["gpt2_ts17", "resnet_ts17", "llama_ts17"])
@pytest.mark.parametrize("precision,rel", [("float16", 5e-3), ("tf32", 5e-3)])
def test_lower_precisions_on_one_gpu(tmp_path, model, precision, rel):
    """float16 contraction operands (fp32 accumulation) and TF32 GEMMs, within their documented
    tolerances of the float32 model (rfcs/0004-precision-and-fusion.md)."""
    if _cupy() is None:
        pytest.skip("needs cupy and a CUDA device")
    from shardflow.runtime import load

    out, inputs, ref = _compile(tmp_path, model, [1], "replicate", precision=precision)
    prog = load(out)
    _close(prog.run(inputs), ref, rel)
    _close(prog.run(inputs), ref, rel)  # CUDA graph replay


@pytest.mark.parametrize("model", ["gpt2_ts17", "resnet_ts17", "bert_dynamo18"])
def test_float16_for_sm80_on_one_gpu(tmp_path, model):
    """A float16 program compiled for sm_80 (the portable tensor-core GEMMs, which the Hopper GPU
    runs too): every product a float16 one reading half operands (rfcs/0005 decision 63), within
    float16's tolerance of the float32 model, eagerly and from its CUDA graph."""
    if _cupy() is None:
        pytest.skip("needs cupy and a CUDA device")
    import json

    from shardflow.runtime import load

    out, inputs, ref = _compile(tmp_path, model, [1], "replicate", precision="float16", arch="sm_80")
    program = json.loads((out / "rank0" / "program.json").read_text())
    kinds = [s["launch"]["kind"] for s in program["steps"] if s["kind"] == "kernel"]
    assert "gemm-f16" in kinds and "gemm-f32" not in kinds, kinds
    prog = load(out)
    _close(prog.run(inputs), ref, 5e-3)
    _close(prog.run(inputs), ref, 5e-3)  # CUDA graph replay


@pytest.mark.parametrize("model", ["gpt2_ts17", "llama_ts17"])
@pytest.mark.parametrize("opt,kind,rel", [({"gemm_tiles": {"*": "tma128x128"}}, "gemm-wgmma-f32", 0.0),
                                          ({"wgmma_fp32": True}, "gemm-wgmma-f32", 0.0),
                                          ({"precision": "tf32", "wgmma_fp32": True}, "gemm-wgmma-tf32", 5e-3)])
def test_float32_models_on_wgmma_3xtf32_and_tf32(tmp_path, model, opt, kind, rel):
    """Float32 products on the Hopper template (rfcs/0005 decisions 33, 34): the default precision
    with every GEMM on a forced wgmma tile or with ``wgmma_fp32`` (3xTF32: float32's tolerance of
    onnxruntime), and ``tf32`` with ``wgmma_fp32`` (one TF32 product: its tolerance)."""
    if _cupy() is None:
        pytest.skip("needs cupy and a CUDA device")
    import json

    from shardflow.runtime import load

    out, inputs, ref = _compile(tmp_path, model, [1], "replicate", **opt)
    program = json.loads((out / "rank0" / "program.json").read_text())
    assert any(s["launch"]["kind"] == kind for s in program["steps"] if s["kind"] == "kernel")
    prog = load(out)
    _close(prog.run(inputs), ref, rel)
    _close(prog.run(inputs), ref, rel)  # CUDA graph replay


@pytest.mark.parametrize("tile", ["tma128x128", "tma64x128"])
def test_tma_gemms_in_a_compiled_model(tmp_path, monkeypatch, tile):
    """Every float16 GEMM on a persistent TMA tile: the runtime encodes the tensor maps from the
    arena's addresses once, eagerly and inside the CUDA graph."""
    _model_on_tile(tmp_path, monkeypatch, tile)


def test_cluster_split_k_gemms_in_a_compiled_model(tmp_path, monkeypatch):
    """The same on a cluster split-K tile (RFC 0005 decision 31: kernels with cluster dimensions,
    launched by the runtime like any other; the GEMMs whose K is one K tile take the TMA tile)."""
    _model_on_tile(tmp_path, monkeypatch, "ck128x128")


def _model_on_tile(tmp_path, monkeypatch, tile):
    if _cupy() is None:
        pytest.skip("needs cupy and a CUDA device")
    import json

    from shardflow.compiler.codegen import cuda_wgmma
    from shardflow.runtime import load

    monkeypatch.setattr(cuda_wgmma, "choose_wgmma_config", lambda *args, **kwargs: tile)
    out, inputs, ref = _compile(tmp_path, "gpt2_ts17", [1], "replicate", precision="float16")
    steps = json.loads((out / "rank0" / "program.json").read_text())["steps"]
    assert any(s.get("launch", {}).get("tensor_maps") for s in steps)
    assert any(s.get("launch", {}).get("cluster", 1) == 2 for s in steps) == tile.startswith("ck")
    prog = load(out)
    _close(prog.run(inputs), ref, 5e-3)
    _close(prog.run(inputs), ref, 5e-3)  # CUDA graph replay
    cp = _cupy()
    views = prog.run({k: cp.asarray(v) for k, v in inputs.items()}, copy_outputs=False)  # arena views
    _close(views, ref, 5e-3)


@pytest.mark.parametrize("model", ["llama_genai_fp32", "gptoss_genai_fp32"])
def test_kv_cache_state_on_the_gpu(tmp_path, model):
    """A decoding program with its KV cache kept as state on the device (``compile(state=...)``:
    the presents written over the pasts in place, gpt-oss's windowed ones copied in the graph):
    four steps, eager then graph replays, numpy then cupy inputs, each step's logits and the kept
    cache against onnxruntime fed its own presents."""
    cp = _cupy()
    if cp is None:
        pytest.skip("needs cupy and a CUDA device")
    from model_refs import gptoss_step_feeds

    from shardflow.compiler import compile
    from shardflow.runtime import load

    ort = pytest.importorskip("onnxruntime")
    path = str(MODELS / f"{model}.onnx")
    state = {f"present.{n}.{kv}": f"past_key_values.{n}.{kv}" for n in range(2) for kv in ("key", "value")}
    if model == "gptoss_genai_fp32":
        feeds = gptoss_step_feeds()
    else:
        feeds = {"input_ids": np.array([[3], [250]], np.int64), "attention_mask": np.zeros((2, 16), np.int64),
                 **{k: np.zeros((2, 2, 16, 16), np.float32) for k in state.values()}}
        feeds["attention_mask"][:, 0] = 1
    res = compile(path, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cuda", "arch": "sm_90"},
                  out_dir=tmp_path / "o", input_shapes={k: v.shape for k, v in feeds.items()}, state=state)
    prog = load(res.out_dir)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    start = int(feeds["attention_mask"].sum(1).max())
    past = {k: feeds[k] for k in state.values()}
    for step in range(4):
        want = dict(zip(names, sess.run(None, feeds | past)))
        given = {k: feeds[k] for k in ("input_ids", "attention_mask")} | (past if step == 0 else {})
        if step >= 2:
            given = {k: cp.asarray(v) for k, v in given.items()}
        _close(prog.run(given), {"logits": want["logits"]})
        _close(prog.read_state(), {name: want[out] for out, name in state.items()})
        if step == 3:  # (gpt-oss's cache of 24 is full after it: no position left for a next token)
            break
        past = {name: want[out] for out, name in state.items()}
        feeds["input_ids"] = want["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        feeds["attention_mask"] = feeds["attention_mask"].copy()
        feeds["attention_mask"][:, start + step] = 1


@pytest.mark.parametrize("step", ["prompt", "decode"])
@pytest.mark.parametrize("precision,rel", [("float32", 0.0), ("float16", 5e-3)])
def test_low_bit_weights_on_the_gpu(tmp_path, step, precision, rel):
    """The 4-bit genai Llama on the device with its weights kept as codes (the GEMV kernels at a
    decoding step's 2 rows, tensor-core GEMMs dequantizing in their loads at the prompt's 16): logits
    and presents against onnxruntime at accuracy level 0 (float32 activations)."""
    import onnx

    if _cupy() is None:
        pytest.skip("needs cupy and a CUDA device")
    from model_refs import genai_llama_feeds

    from shardflow.compiler import compile
    from shardflow.runtime import load

    ort = pytest.importorskip("onnxruntime")
    m = onnx.load(str(MODELS / "llama_genai_int4.onnx"))
    for n in m.graph.node:
        for a in n.attribute:
            if a.name == "accuracy_level":
                a.i = 0
    feeds = genai_llama_feeds(step, seed=5)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    res = compile(m, distributed_config={"mesh_shape": [1]}, out_dir=tmp_path / "o",
                  optimization_config={"target": "cuda", "arch": "sm_90", "precision": precision},
                  input_shapes={k: v.shape for k, v in feeds.items()})
    prog = load(res.out_dir)
    _close(prog.run(feeds), want, rel)


def _driver_tests_on_a_gpu():
    """cupy; skips without it and a CUDA device; makes tests/driver's modules importable (their models)."""
    cp = _cupy()
    if cp is None:
        pytest.skip("needs cupy and a CUDA device")
    if str(Path(__file__).parent.parent / "driver") not in sys.path:
        sys.path.insert(0, str(Path(__file__).parent.parent / "driver"))
    return cp


def test_index_checks_on_the_gpu(tmp_path):
    """The index checks on a cuda program (tests/driver/test_index_checks.py's positions model): a token
    id past the table refused before the run, positions computed past the table refused after it (the
    check's count read back, eagerly and from the CUDA graph, numpy and cupy inputs), in-range runs
    equal to onnxruntime's."""
    cp = _driver_tests_on_a_gpu()
    from test_index_checks import _feeds, _positions_model

    from shardflow.compiler import compile
    from shardflow.runtime import IndexRangeError, InputIndexError, load

    ort = pytest.importorskip("onnxruntime")
    model = _positions_model()
    res = compile(model, distributed_config={"mesh_shape": [1]},
                  optimization_config={"target": "cuda", "arch": "sm_90"}, out_dir=tmp_path / "o")
    prog = load(res.out_dir)
    good = _feeds()
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, good)[0]
    bad = dict(good, mask=np.ones((2, 6), np.int64) * 2)
    for k in range(3):  # eager, then captured, then replayed
        for feeds in (good, {n: cp.asarray(v) for n, v in good.items()}):
            got = prog.run(feeds)
            assert list(got) == ["y"]
            _close(got, {"y": want})
        with pytest.raises(IndexRangeError, match="wpe/Gather"):
            prog.run(bad if k % 2 else {n: cp.asarray(v) for n, v in bad.items()})
    with pytest.raises(InputIndexError, match="'ids'"):
        prog.run(dict(good, ids=np.full((2, 6), 10, np.int64)))


def test_shape_variants_share_their_weights_on_the_gpu(tmp_path):
    """Two shape variants of the driver tests' position model (their 64 KiB weights alike, a position slice
    not): each variant against onnxruntime, eager then graph, in both loading orders; the second loaded
    reads the first's device arrays (the same device addresses), not a copy of its own."""
    _driver_tests_on_a_gpu()
    from test_variants import _position_model, _x

    from shardflow.compiler import compile_variants
    from shardflow.runtime import load

    ort = pytest.importorskip("onnxruntime")
    m = _position_model()
    compile_variants(m, variants=[{"seq": 4}, {"seq": 8}], dim_sizes={"batch": 2},
                     distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cuda", "arch": "sm_90"},
                     out_dir=tmp_path / "o")
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for order in ((4, 8, 4, 8), (8, 4, 8, 4)):
        prog = load(tmp_path / "o")
        for seq in order:
            x = _x(2, seq, seed=seq)
            _close(prog.run({"x": x}), {"y": sess.run(None, {"x": x})[0]})
        first, second = (prog.program(0), prog.program(1)) if order[0] == 4 else (prog.program(1), prog.program(0))
        assert prog.borrowed_bytes == 2 << 16 and second.borrowed_weights_bytes == 2 << 16
        ptrs = {v.data.ptr for v in first._engine.views if v.nbytes >= 1 << 16}
        assert sum(v.data.ptr in ptrs for v in second._engine.views if v.nbytes >= 1 << 16) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_pipeline_stages_sharing_one_gpu(tmp_path, backend):
    """GPT-2's test export as 2 pipeline stages of 2 Megatron ranks, a run's batch in 2 microbatches,
    every rank on the one GPU: the cut's tensors and the gathered logits through the host communicator
    (runtime/pipeline.py), against onnxruntime."""
    if _cupy() is None:
        pytest.skip("needs cupy and a CUDA device")
    from shardflow.compiler import compile

    model = MODELS / "gpt2_ts17.onnx"
    inputs = dict(np.load(MODELS / "gpt2_inputs.npz"))
    ort = pytest.importorskip("onnxruntime")
    ref = dict(zip(["logits"], ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, inputs)))
    compile(model, distributed_config={"mesh_shape": [2, 2], "algo": "megatron", "pipeline_stages": 2,
                                       "pipeline_microbatches": 2},
            optimization_config={"target": "cuda", "arch": "sm_90"}, out_dir=tmp_path / "o")
    np.savez(tmp_path / "in.npz", **inputs)
    proc = subprocess.run([sys.executable, "-m", "shardflow.runtime.launch", str(tmp_path / "o"), "--nproc", "4",
                           "--launcher", "mpiexec" if backend == "mpi" else "spawn", "--backend", backend,
                           "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "out.npz"),
                           "--repeat", "3"], capture_output=True, text=True, timeout=300, env=_clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    _close(dict(np.load(tmp_path / "out.npz")), ref)
