"""State kept by a program between runs (``compile(state=...)``): a KV cache of fixed size whose
present becomes the next past on the program's own memory, written in place when its kernel allows
(the present's past rows are the past's), copied after the run otherwise. Every run is compared with
onnxruntime running the same loop with the cache passed in and out, or with numpy."""
from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from model_refs import MODELS, gptoss_step_feeds
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import ConfigError, compile
from shardflow.runtime import load

ort = pytest.importorskip("onnxruntime")

CPU = {"target": "cpu"}
ONE = {"mesh_shape": [1]}


def _session(model):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model if isinstance(model, str) else model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return lambda feeds: dict(zip(names, sess.run(None, feeds)))


def _close(got, want, tol=1e-4, what=""):
    scale = max(float(np.abs(want).max()), 1.0)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=what)


def _cache_state(layers: int) -> dict[str, str]:
    return {f"present.{n}.{kv}": f"past_key_values.{n}.{kv}" for n in range(layers) for kv in ("key", "value")}


def _program_state(out_dir) -> list[dict]:
    return json.loads((out_dir / "rank0" / "program.json").read_text())["state"]


def _llama_steps(n: int):
    """``n`` greedy decoding steps of the genai Llama (two sequences, a cache of 16), onnxruntime fed
    its own presents: per step, what a program keeping the cache takes (the zero cache with the first
    step only) and onnxruntime's outputs."""
    ref = _session(str(MODELS / "llama_genai_fp32.onnx"))
    state = _cache_state(2)
    past = {k: np.zeros((2, 2, 16, 16), np.float32) for k in state.values()}
    mask = np.zeros((2, 16), np.int64)
    ids = np.array([[3], [250]], np.int64)
    for step in range(n):
        mask[:, step] = 1
        feeds = {"input_ids": ids, "attention_mask": mask.copy()}
        want = ref({**feeds, **past})
        yield ({**feeds, **past} if step == 0 else feeds), want
        past = {name: want[out] for out, name in state.items()}
        ids = want["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)


def test_llama_kv_cache_stays_in_the_program(tmp_path):
    """onnxruntime-genai's Llama, a decoding program of fixed shapes (cache of 16): its four presents
    kept as state, each written in place (the kernel that writes a present reads the past at the same
    element only). Five greedy steps of two sequences, the first given the (zero) past, the others
    only the token and the mask: logits and the kept cache against onnxruntime fed its own presents."""
    path = str(MODELS / "llama_genai_fp32.onnx")
    state = _cache_state(2)
    shapes = {"input_ids": (2, 1), "attention_mask": (2, 16), **{k: (2, 2, 16, 16) for k in state.values()}}
    res = compile(path, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out",
                  input_shapes=shapes, state=state)
    assert [e["in_place"] for e in _program_state(res.out_dir)] == [True] * 4
    prog = load(res.out_dir)
    assert prog.output_names == ["logits"] and prog.state_names == {v: k for k, v in state.items()}
    for step, (given, want) in enumerate(_llama_steps(5)):
        got = prog.run(given)
        assert set(got) == {"logits"}
        _close(got["logits"], want["logits"], what=f"step {step}")
        kept = prog.read_state()
        for out, name in state.items():
            _close(kept[name], want[out], what=f"step {step} {name}")
    prog.reset_state()
    assert all(not v.any() for v in prog.read_state().values())


def test_gptoss_windowed_cache_copied_full_cache_in_place(tmp_path):
    """gpt-oss's decoding step: layer 0's windowed cache (its present gathered from the buffer and
    the new token: not at the past's own index, so copied after the run), layer 1's full cache (in
    place). Three steps from ``gptoss_step_feeds``' past, then the same on two ranks in one process
    (the ILP under a memory budget), every rank keeping the whole state."""
    from threads import run_threads

    from shardflow.runtime.comm import InProcessWorld

    path = str(MODELS / "gptoss_genai_fp32.onnx")
    first = gptoss_step_feeds()
    state = _cache_state(2)
    shapes = {k: v.shape for k, v in first.items()}
    ref = _session(path)

    def steps(run, read_state):
        """Three steps: each rank's logits and kept state against onnxruntime's."""
        feeds, past = dict(first), {k: first[k] for k in state.values()}
        for step in range(3):
            want = ref({**feeds, **past})
            outs = run(feeds if step == 0 else {k: feeds[k] for k in ("input_ids", "attention_mask")})
            for got, kept in zip(outs, read_state()):
                _close(got["logits"], want["logits"], what=f"step {step}")
                for out, name in state.items():
                    _close(kept[name], want[out], what=f"step {step} {name}")
            past = {name: want[out] for out, name in state.items()}
            feeds["input_ids"] = want["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
            feeds["attention_mask"] = feeds["attention_mask"].copy()
            feeds["attention_mask"][:, 21 + step] = 1

    res = compile(path, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "one",
                  input_shapes=shapes, state=state)
    assert {e["output"]: e["in_place"] for e in _program_state(res.out_dir)} == {
        "present.0.key": False, "present.0.value": False, "present.1.key": True, "present.1.value": True}
    prog = load(res.out_dir)
    steps(lambda f: [prog.run(f)], lambda: [prog.read_state()])

    res = compile(path, distributed_config={"mesh_shape": [2], "memory_budget_bytes": 420_000},
                  optimization_config=CPU, out_dir=tmp_path / "two", input_shapes=shapes, state=state)
    world = InProcessWorld(2).communicators()
    progs = [load(res.out_dir, c.rank, c) for c in world]
    steps(lambda f: run_threads(world, lambda c: progs[c.rank].run(f), timeout=300),
          lambda: [p.read_state() for p in progs])


def _accumulator(second_reader: bool) -> onnx.ModelProto:
    """``s' = 0.5 s + x`` (the state), ``y = s' W``; with ``second_reader`` also ``z = s W``: the
    old state read after ``s'`` is written."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32), "w")
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    nodes = [helper.make_node("Mul", ["s", "half"], ["hs"]), helper.make_node("Add", ["hs", "x"], ["s_next"]),
             helper.make_node("MatMul", ["s_next", "w"], ["y"])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3]),
            helper.make_tensor_value_info("s_next", TensorProto.FLOAT, [4, 8])]
    if second_reader:
        nodes.append(helper.make_node("MatMul", ["s", "w"], ["z"]))
        outs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 3]))
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 8]) for n in ("s", "x")]
    return helper.make_model(helper.make_graph(nodes, "acc", ins, outs, [w, half]),
                             opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("second_reader", [False, True])
def test_state_in_place_only_when_nothing_reads_the_old_value_later(tmp_path, second_reader):
    """The element-wise update of an accumulator is written over its input; when another op reads
    the old state too, the new one is copied after the run. Four runs against numpy; the state set
    by passing it, and left out."""
    m = _accumulator(second_reader)
    res = compile(m, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out",
                  state={"s_next": "s"})
    assert [e["in_place"] for e in _program_state(res.out_dir)] == [not second_reader]
    prog = load(res.out_dir)
    w = numpy_helper.to_array(m.graph.initializer[0])
    rng = np.random.default_rng(1)
    s = np.zeros((4, 8), np.float32)
    for k in range(4):
        x = rng.standard_normal((4, 8)).astype(np.float32)
        feeds = {"x": x}
        if k == 2:  # set the state
            s = rng.standard_normal((4, 8)).astype(np.float32)
            feeds["s"] = s
        got = prog.run(feeds)
        assert set(got) == ({"y", "z"} if second_reader else {"y"})
        if second_reader:
            _close(got["z"], s @ w, tol=1e-5)
        s = np.float32(0.5) * s + x
        _close(got["y"], s @ w, tol=1e-5)
        np.testing.assert_allclose(prog.read_state()["s"], s, rtol=1e-6)


def test_state_errors_name_the_key(tmp_path):
    m = _accumulator(False)

    def compile_with(state, **kw):
        return compile(m, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out", state=state,
                       **kw)

    with pytest.raises(ConfigError, match="'s_nxt' is not an output.*did you mean 's_next'"):
        compile_with({"s_nxt": "s"})
    with pytest.raises(ConfigError, match="'t' \\(for output 's_next'\\) is not an input"):
        compile_with({"s_next": "t"})
    with pytest.raises(ConfigError, match="output 'y' is float32\\[4, 3\\] but input 's' is float32\\[4, 8\\]"):
        compile_with({"y": "s"})
    with pytest.raises(ConfigError, match="input 's' is given by two outputs"):
        compile_with({"s_next": "s", "y": "s"})
    with pytest.raises(ConfigError, match="input 's' of output 's_next' is fixed by input_values"):
        compile_with({"s_next": "s"}, input_values={"s": np.zeros((4, 8), np.float32)})
    with pytest.raises(ConfigError, match="state must be a dict"):
        compile_with(["s_next"])
    assert not (tmp_path / "out").exists()


def test_a_grown_cache_is_refused_with_the_fix():
    """onnxruntime's own loop (past 8, present 9) cannot be state: the error says what can."""
    state = _cache_state(2)
    shapes = {"input_ids": (2, 1), "attention_mask": (2, 9), **{k: (2, 2, 8, 16) for k in state.values()}}
    with pytest.raises(ConfigError, match="present.0.key' is float32\\[2, 2, 9, 16\\].*KV cache of fixed size"):
        compile(str(MODELS / "llama_genai_fp32.onnx"), distributed_config=ONE, optimization_config=CPU,
                out_dir="unused", input_shapes=shapes, state=state)


UPDATES = {  # the state's update from s [8, 8] and x [8, 8], written in place or not, and numpy's
    "elementwise": (True, lambda s, x: np.tanh(s) * np.float32(0.5) + x),
    "transposed": (False, lambda s, x: s.T + x),
    "rolled": (False, lambda s, x: np.concatenate([s[1:], x[:1]])),
    "row sums": (False, lambda s, x: s * np.float32(0.5) + s.sum(1, keepdims=True) * np.float32(0.1) + x),
}


def _update_model(kind: str) -> onnx.ModelProto:
    c = {k: numpy_helper.from_array(np.array(v, np.float32), k) for k, v in (("half", 0.5), ("tenth", 0.1))}
    c["one"] = numpy_helper.from_array(np.array([1], np.int64), "one")
    c["end"] = numpy_helper.from_array(np.array([8], np.int64), "end")
    c["zero"] = numpy_helper.from_array(np.array([0], np.int64), "zero")
    node = helper.make_node
    nodes = {
        "elementwise": [node("Tanh", ["s"], ["t"]), node("Mul", ["t", "half"], ["u"]), node("Add", ["u", "x"], ["n"])],
        "transposed": [node("Transpose", ["s"], ["t"], perm=[1, 0]), node("Add", ["t", "x"], ["n"])],
        "rolled": [node("Slice", ["s", "one", "end", "zero"], ["t"]), node("Slice", ["x", "zero", "one", "zero"], ["u"]),
                   node("Concat", ["t", "u"], ["n"], axis=0)],
        "row sums": [node("ReduceSum", ["s", "one"], ["r"], keepdims=1), node("Mul", ["r", "tenth"], ["t"]),
                     node("Mul", ["s", "half"], ["u"]), node("Add", ["u", "t"], ["v"]), node("Add", ["v", "x"], ["n"])],
    }[kind]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [8, 8]) for n in ("s", "x")]
    outs = [helper.make_tensor_value_info("n", TensorProto.FLOAT, [8, 8])]
    return helper.make_model(helper.make_graph(nodes, "upd", ins, outs, list(c.values())),
                             opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("kind", list(UPDATES))
def test_state_written_in_place_only_from_its_own_element(tmp_path, kind):
    """A state whose update reads each old element for its own new one is written in place; a
    transposed, shifted (a rolling buffer, as a convolution's state) or row-reduced one is copied
    after the run. Three runs from a state set once, against numpy."""
    in_place, update = UPDATES[kind]
    res = compile(_update_model(kind), distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out",
                  state={"n": "s"})
    assert [e["in_place"] for e in _program_state(res.out_dir)] == [in_place]
    prog = load(res.out_dir)
    assert prog.output_names == []
    rng = np.random.default_rng(2)
    s = rng.standard_normal((8, 8)).astype(np.float32)
    for k in range(3):
        x = rng.standard_normal((8, 8)).astype(np.float32)
        assert prog.run({"x": x, "s": s} if k == 0 else {"x": x}) == {}
        s = update(s, x)
        np.testing.assert_allclose(prog.read_state()["s"], s, rtol=1e-5, atol=1e-5, err_msg=f"run {k}")


def _llama_on_two_ranks(tmp_path, name, config, state=None):
    from shardflow.runtime.comm import InProcessWorld

    state = _cache_state(2) if state is None else state
    shapes = {"input_ids": (2, 1), "attention_mask": (2, 16), **{k: (2, 2, 16, 16) for k in _cache_state(2).values()}}
    res = compile(str(MODELS / "llama_genai_fp32.onnx"), distributed_config={"mesh_shape": [2], **config},
                  optimization_config=CPU, out_dir=tmp_path / name, input_shapes=shapes, state=state or None)
    world = InProcessWorld(2).communicators()
    return res, world, [load(res.out_dir, c.rank, c) for c in world]


@pytest.mark.parametrize("how", ["megatron", "heads"])
def test_state_split_over_two_ranks_stays_split(tmp_path, how):
    """On two ranks each keeps its part of the cache in the spec its present is written in: the
    Megatron baseline's (chosen from the plan's writer of each present: the heads, since the model's
    fused QKV product is split into its parts before the plan, passes/projections.py; the batch
    before) or the heads, given as both placements. Four steps, the first given the whole (zero) cache, against onnxruntime: logits,
    and each rank's kept part against the same part of onnxruntime's presents (the manifest's
    bounds); no collective gathers the presents (the Megatron program without state does)."""
    from threads import run_threads

    state = _cache_state(2)
    config = ({"algo": "megatron"} if how == "megatron" else
              {"input_placements": {k: "S(1)" for k in state.values()}, "output_placements": {k: "S(1)" for k in state}})
    res, world, progs = _llama_on_two_ranks(tmp_path, "state", config)
    manifests = [json.loads((res.out_dir / f"rank{r}" / "manifest.json").read_text()) for r in range(2)]
    parts = [{e["name"]: tuple(slice(a, b) for a, b in e["bounds"]) for e in m["inputs"] if "bounds" in e}
             for m in manifests]
    split = {e["name"]: e["placement"] for e in manifests[0]["inputs"] if e["name"] in state.values()}
    assert set(split.values()) == {"S(1)"}

    def gathers_presents(out_dir) -> bool:
        program = json.loads((out_dir / "rank0" / "program.json").read_text())
        presents = {i for n, i in program["outputs"] if n.startswith("present.")}
        presents |= {e["output_buffer"] for e in program.get("state", ())}
        return any(st["kind"] == "collective" and presents & set(st["outputs"]) for st in program["steps"])

    assert not gathers_presents(res.out_dir)
    if how == "megatron":  # the same plan without state returns the presents whole: gathered
        assert gathers_presents(_llama_on_two_ranks(tmp_path, "plain", config, state={})[0].out_dir)
    for step, (given, want) in enumerate(_llama_steps(4)):
        outs = run_threads(world, lambda c: progs[c.rank].run(given), timeout=300)
        for r, (got, prog) in enumerate(zip(outs, progs)):
            _close(got["logits"], want["logits"], what=f"step {step} rank {r}")
            kept = prog.read_state()
            for out, name in state.items():
                assert kept[name].shape == want[out][parts[r][name]].shape != want[out].shape
                _close(kept[name], want[out][parts[r][name]], what=f"step {step} rank {r} {name}")
    from shardflow.runtime import InputShapeError

    with pytest.raises(InputShapeError, match="compiled for \\(2, 2, 16, 16\\) \\(or its part"):
        progs[0].run({**given, "past_key_values.0.key": np.zeros((2, 2, 8, 16), np.float32)})


def test_state_placements_must_agree(tmp_path):
    with pytest.raises(ConfigError, match="the input's placement S\\(1\\) and the output's R differ"):
        _llama_on_two_ranks(tmp_path, "bad", {"input_placements": {"past_key_values.0.key": "S(1)"}})


@pytest.mark.parametrize("kind", ["elementwise", "transposed"])
def test_profile_advances_the_state_as_runs_do(tmp_path, kind):
    """``profile`` runs the program step by step: its runs carry the state over as ``run``'s do,
    in place or copied (one warm-up and two timed runs: three updates)."""
    _, update = UPDATES[kind]
    res = compile(_update_model(kind), distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out",
                  state={"n": "s"})
    prog = load(res.out_dir)
    rng = np.random.default_rng(3)
    s, x = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2))
    prog.run({"x": x, "s": s})
    steps = prog.profile({"x": x}, repeat=2, warmup=1)
    assert [st["kind"] for st in steps] == ["kernel"] * len(steps) and steps
    for _ in range(4):
        s = update(s, x)
    np.testing.assert_allclose(prog.read_state()["s"], s, rtol=1e-5, atol=1e-5)


def test_a_select_over_its_state_stores_only_what_changes(tmp_path):
    """``s' = Where(keep, s, x)`` kept as state: written over ``s``, its kernel stores only where
    ``keep`` fails and never reads ``s`` (``build_cpu_library``'s ``in_place``); the rows kept stay as
    they were. Four runs with changing rows against numpy."""
    from shardflow.compiler import load_onnx
    from shardflow.compiler.codegen.cpp import kernel_source

    node = helper.make_node("Where", ["keep", "s", "x"], ["n"])
    ins = [helper.make_tensor_value_info("keep", TensorProto.BOOL, [8, 1]),
           helper.make_tensor_value_info("s", TensorProto.FLOAT, [8, 16]),
           helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])]
    m = helper.make_model(helper.make_graph([node], "sel", ins, [helper.make_tensor_value_info("n", TensorProto.FLOAT,
                                                                                                [8, 16])]),
                          opset_imports=[helper.make_opsetid("", 17)])
    where = load_onnx(m).nodes[0]
    guarded, plain = (kernel_source(where, in_place=k)[1] for k in (1, None))
    assert "if ((!(in0[" in guarded and "in1[" not in guarded.split("__restrict__ out0")[1]
    assert "if (" not in plain and "in1[" in plain
    res = compile(m, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out", state={"n": "s"})
    assert [e["in_place"] for e in _program_state(res.out_dir)] == [True]
    prog = load(res.out_dir)
    rng = np.random.default_rng(4)
    s = np.zeros((8, 16), np.float32)
    for _ in range(4):
        keep, x = rng.random((8, 1)) < 0.5, rng.standard_normal((8, 16)).astype(np.float32)
        prog.run({"keep": keep, "x": x})
        s = np.where(keep, s, x)
        np.testing.assert_array_equal(prog.read_state()["s"], s)


def test_cuda_presents_store_only_what_changes(tmp_path, monkeypatch):
    """For the cuda target too, the genai Llama's presents kept over their pasts are generated to store
    only where their select changes the past (``build_cuda_library``'s ``in_place``): four kernels
    each with one guarded store, none reading its past; the program writes them in place. (The
    kernel itself runs on the host emulation in tests/codegen/test_cuda_host.py, the program on a
    GPU in test_gpu_runtime.py.)"""
    import shutil

    from shardflow.compiler.codegen import cuda

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    sources, real = [], cuda.generate_cuda_source
    monkeypatch.setattr(cuda, "generate_cuda_source", lambda *a, **k: sources.append(real(*a, **k)) or sources[-1])
    feeds, _ = next(_llama_steps(1))
    res = compile(str(MODELS / "llama_genai_fp32.onnx"), distributed_config=ONE, out_dir=tmp_path / "out",
                  optimization_config={"target": "cuda", "arch": "sm_90"},
                  input_shapes={k: v.shape for k, v in feeds.items()}, state=_cache_state(2))
    assert [e["in_place"] for e in _program_state(res.out_dir)] == [True] * 4
    (src,) = sources
    guarded = {re.search(r"__launch_bounds__\(\d+\) (\w+)\(", k).group(1) for k in src.text.split("// node ")[1:]
               if re.search(r"if \(!\w+\) \{", k)}  # (a guarded store: if (!c) { ... })
    assert len(guarded) == 2  # (the two layers' presents share their kernels)
    assert sum(launch.symbol in guarded for launch in src.launches.values()) == 4
