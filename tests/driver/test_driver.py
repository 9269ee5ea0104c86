"""compile(): config validation, the out_dir format, buffer plans, atomic writes, and the programs'
results (run in-process with the callback stand-in for the kernel codegen, against onnxruntime)."""
import json
from pathlib import Path

import numpy as np
import pytest

import callback_kernels as CK
from threads import run_ranks, run_threads
from shardflow.compiler import ConfigError, ShardflowError, compile, driver
from shardflow.compiler.driver import OptimizationConfig, plan_buffers
from shardflow.runtime import load
from shardflow.runtime.artifact import sha256_file
from shardflow.runtime.comm import InProcessWorld

MODELS = Path(__file__).parent.parent / "models"


def inputs_of(model: str) -> dict:
    base = model.rsplit("_", 1)[0]
    return dict(np.load(MODELS / f"{base}_inputs.npz"))


def reference(model: str, inputs: dict) -> dict:
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(MODELS / f"{model}.onnx"), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, inputs)))


@pytest.fixture
def callback_codegen(monkeypatch):
    """Compile with the callback stand-in for the cpu codegen."""
    CK.BUILT.clear()
    monkeypatch.setattr(driver, "_cpu_builder", lambda: CK.build_callback_library)
    return CK


def run_in_threads(out_dir, world, inputs):
    def work(c):
        prog = load(out_dir, c.rank, c)
        CK.attach(prog, CK.BUILT[c.rank])
        return prog.run(inputs)
    return run_threads(InProcessWorld(world).communicators(), work, timeout=120)


# ---------------------------------------------------------------------------------------
# optimization_config
# ---------------------------------------------------------------------------------------
def test_optimization_config_defaults_and_validation():
    c = OptimizationConfig.from_dict(None)
    assert (c.target, c.arch, c.precision, c.fuse, c.cuda_graph, c.search_space, c.comm_backend) == \
        ("cpu", None, "float32", True, True, 1, "auto")
    assert OptimizationConfig.from_dict({"target": "cuda"}).arch == "sm_90" and not c.pdl
    assert OptimizationConfig.from_dict({"target": "cuda", "arch": "sm_90a", "pdl": True}).pdl
    assert OptimizationConfig.from_dict({"target": "cuda", "arch": "sm_80", "comm_backend": "nccl"}).arch == "sm_80"
    assert c.gemm_tiles == {} and OptimizationConfig.from_dict(
        {"target": "cuda", "gemm_tiles": {"*lm_head*": "pp64x256"}}).gemm_tiles == {"*lm_head*": "pp64x256"}
    bad = [({"targt": "cpu"}, "unknown key 'targt'; did you mean 'target'"),
           ({"target": "tpu"}, "choose one of"),
           ({"target": 1}, "need one of"),
           ({"arch": "sm_90"}, "only applies to target 'cuda'"),
           ({"target": "cuda", "arch": "hopper"}, "use a CUDA GPU architecture"),
           ({"target": "cuda", "arch": "sm_75"}, r"sm_80 \(Ampere\) and newer"),
           ({"target": "cuda", "arch": "compute_90"}, "not PTX"),
           ({"sm_count": 132}, "only applies to target 'cuda'"),
           ({"target": "cuda", "sm_count": 0}, "between 1 and 1024"),
           ({"target": "cuda", "sm_count": 114.0}, "need the target GPU's multiprocessor count"),
           ({"target": "cuda", "sm_count": True}, "need the target GPU's multiprocessor count"),
           ({"fuse": "yes"}, "need true or false"),
           ({"cuda_graph": 1}, "need true or false"),
           ({"pdl": True}, "needs target 'cuda' and an arch of sm_90"),
           ({"target": "cuda", "arch": "sm_80", "pdl": True}, "arch 'sm_80'"),
           ({"target": "cuda", "pdl": "on"}, "need true or false"),
           ({"search_space": 3}, "choose 0, 1 or 2"),
           ({"search_space": True}, "need 0, 1 or 2"),
           ({"precision": "int8"}, "choose one of"),
           ({"comm_backend": "gloo"}, "choose one of"),
           ({"comm_backend": "nccl"}, "needs target 'cuda'"),
           ({"precision": "tf32"}, "only applies to target 'cuda'"),
           ({"precision": "fp8"}, "choose one of"),
           ({"gemm_tiles": {"*": "64x64"}}, "only applies to target 'cuda'"),
           ({"target": "cuda", "gemm_tiles": {"*": "huge"}}, r"\['gemm_tiles'\]\['\*'\] = 'huge': choose one of"),
           ({"target": "cuda", "gemm_tiles": {3: "64x64"}}, "as strings"),
           ({"target": "cuda", "gemm_tiles": ["64x64"]}, "need a dict"),
           ([1, 2], "must be a dict")]
    for cfg, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            OptimizationConfig.from_dict(cfg)


def test_the_multiprocessor_count_compiled_for(monkeypatch):
    """``sm_count`` given; else the visible GPU's when it is of the target architecture (the one
    the program will run on); else an H100 SXM's 132."""
    from shardflow.compiler import driver
    from shardflow.compiler.codegen import tune

    def count(gpu, **cfg):
        monkeypatch.setattr(tune, "visible_gpu", lambda: gpu)
        return driver.target_sm_count(OptimizationConfig.from_dict({"target": "cuda", **cfg}))
    pcie = {"name": "NVIDIA H100 PCIe", "sm": 90, "sms": 114}
    assert count(None) == 132 and count(None, sm_count=78) == 78
    assert count(pcie) == 114 and count(pcie, arch="sm_90a") == 114 and count(pcie, sm_count=132) == 132
    assert count(pcie, arch="sm_80") == 132  # (compiling for another GPU than this machine's)
    assert count({"name": "NVIDIA A100", "sm": 80, "sms": 108}, arch="sm_80") == 108


def test_bad_distributed_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'mesh'"):
        compile(MODELS / "mlp_ts17.onnx", distributed_config={"mesh": [2]}, out_dir=tmp_path / "o")


# ---------------------------------------------------------------------------------------
# buffer plan
# ---------------------------------------------------------------------------------------
def test_plan_buffers_never_overlaps_live_blocks():
    rng = np.random.default_rng(0)
    for _ in range(30):
        blocks = []
        for _ in range(int(rng.integers(1, 40))):
            a = int(rng.integers(-1, 20))
            blocks.append((int(rng.integers(0, 5000)), a, a + int(rng.integers(0, 8))))
        offs, total = plan_buffers(blocks)
        for i, (si, ai, bi) in enumerate(blocks):
            assert offs[i] % 64 == 0 and offs[i] + si <= total
            for j, (sj, aj, bj) in enumerate(blocks[:i]):
                if si and sj and not (bi < aj or bj < ai):  # live at the same time
                    assert offs[i] + si <= offs[j] or offs[j] + sj <= offs[i], (blocks[i], blocks[j])
    # a chain reuses memory: a -> b -> c needs two slots, not three
    offs, total = plan_buffers([(640, 0, 1), (640, 1, 2), (640, 2, 3)])
    assert total == 1280 and offs[0] == offs[2]


# ---------------------------------------------------------------------------------------
# out_dir format and atomicity
# ---------------------------------------------------------------------------------------
def test_out_dir_layout_and_manifest(tmp_path, callback_codegen):
    out = tmp_path / "mlp"
    res = compile(MODELS / "mlp_ts17.onnx", distributed_config={"mesh_shape": [2, 2], "algo": "megatron"},
                  optimization_config={"target": "cpu"}, out_dir=out)
    assert res.world_size == 4 and res.out_dir == out.resolve() and res.plan.mesh.shape == (2, 2)
    assert set(res.timings) == {"import", "search", "partition", "codegen", "write", "total"}
    assert sorted(p.name for p in out.iterdir()) == ["mesh.json", "plan.json", "plan.txt", "rank0", "rank1", "rank2",
                                                     "rank3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp"]  # no temporary left
    # compile plans for the target's device (search alone would plan for an H100)
    assert json.loads((out / "plan.json").read_text())["device"]["name"] == "cpu" and res.plan.device.name == "cpu"
    mesh = json.loads((out / "mesh.json").read_text())
    assert mesh["world_size"] == 4 and mesh["groups"]["0"] == [[0, 2], [1, 3]] and mesh["groups"]["1"] == [[0, 1],
                                                                                                           [2, 3]]
    for r in range(4):
        d = out / f"rank{r}"
        m = json.loads((d / "manifest.json").read_text())
        assert m["artifact_format"] == 1 and m["rank"] == r and m["world_size"] == 4 and m["target"] == "cpu"
        assert m["mesh"]["coord"] == [r // 2, r % 2] and m["mesh"]["shape"] == [2, 2]
        assert m["inputs"] == [{"name": "x", "shape": [2, 32], "dtype": "float32", "placement": "RR"}]
        assert m["outputs"][0]["name"] == "output" and m["outputs"][0]["global_shape"] == [2, 16]
        assert m["outputs"][0]["bounds"] == [[0, 2], [0, 16]]
        assert sorted(m["files"]) == ["kernels.so", "program.json", "weights.bin"]
        for name, info in m["files"].items():
            assert info["sha256"] == sha256_file(d / name)
        prog = json.loads((d / "program.json").read_text())
        kinds = [s["kind"] for s in prog["steps"]]
        # (the second axis splits the products, the first is data parallel: the batch split, its
        # output gathered along it at the end)
        assert kinds.count("collective") == 3 and m["collectives"] == 3
        assert sorted((s["collective"], s["group"]) for s in prog["steps"] if s["kind"] == "collective") == [
            ("all_gather", "0"), ("all_reduce", "1"), ("all_reduce", "1")]
        assert prog["weights_bytes"] == (d / "weights.bin").stat().st_size
    outs = run_in_threads(out, 4, inputs_of("mlp_ts17"))
    ref = reference("mlp_ts17", inputs_of("mlp_ts17"))
    for o in outs:
        np.testing.assert_allclose(o["output"], ref["output"], rtol=1e-3, atol=1e-3)


def test_input_values_become_constants_of_the_program(tmp_path, callback_codegen):
    from onnx import TensorProto, helper

    model = helper.make_model(helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
         helper.make_node("MatMul", ["r", "x"], ["y"], name="matmul")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])]), opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ShardflowError, match="input_values"):
        compile(model, distributed_config={"mesh_shape": [2]}, out_dir=tmp_path / "m")
    res = compile(model, distributed_config={"mesh_shape": [2]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "m", input_values={"shape": np.array([4, 4])})
    m = json.loads((res.out_dir / "rank0" / "manifest.json").read_text())
    assert [i["name"] for i in m["inputs"]] == ["x"]
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    for o in run_in_threads(res.out_dir, 2, {"x": x}):
        np.testing.assert_allclose(o["y"], x @ x, rtol=1e-5, atol=1e-5)


def test_native_runner_and_python_loop_agree(tmp_path, callback_codegen):
    res = compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [1]}, out_dir=tmp_path / "g")
    prog = load(res.out_dir)
    CK.attach(prog, CK.BUILT[0])
    assert prog._native is not None
    inputs = inputs_of("gpt2_ts17")
    native = prog.run(inputs)
    prog._native = None
    looped = prog.run(inputs)
    np.testing.assert_array_equal(native["logits"], looped["logits"])


def test_interrupted_compile_leaves_no_out_dir(tmp_path, monkeypatch):
    calls = []

    def builder(ops, path, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C while building rank 1
        return CK.build_callback_library(ops, path)

    monkeypatch.setattr(driver, "_cpu_builder", lambda: builder)
    out = tmp_path / "o"
    with pytest.raises(KeyboardInterrupt):
        compile(MODELS / "mlp_ts17.onnx", distributed_config={"mesh_shape": [2]}, out_dir=out)
    assert list(tmp_path.iterdir()) == []
    # an existing out_dir survives an interrupted recompile untouched
    out.mkdir()
    (out / "keep").write_text("x")
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        compile(MODELS / "mlp_ts17.onnx", distributed_config={"mesh_shape": [2]}, out_dir=out)
    assert [p.name for p in tmp_path.iterdir()] == ["o"] and (out / "keep").read_text() == "x"


def test_codegen_errors_leave_no_out_dir(tmp_path, monkeypatch):
    def builder(ops, path, **kw):
        raise ShardflowError("kernel generation failed for node X")

    monkeypatch.setattr(driver, "_cpu_builder", lambda: builder)
    with pytest.raises(ShardflowError, match="node X"):
        compile(MODELS / "mlp_ts17.onnx", distributed_config={"mesh_shape": [2]}, out_dir=tmp_path / "o")
    assert list(tmp_path.iterdir()) == []


def test_views_alias_and_the_arena_reuses_memory(tmp_path, callback_codegen):
    res = compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [1]}, out_dir=tmp_path / "g")
    prog = json.loads((tmp_path / "g" / "rank0" / "program.json").read_text())
    ops = CK.BUILT[0]
    assert not any(op.op_type == "Reshape" for op in ops)  # reshapes alias their input: no kernel
    activations = sum(int(np.prod(b["shape"])) * np.dtype(b["dtype"]).itemsize
                      for b in prog["buffers"] if b["storage"] == "arena")
    assert prog["arena_bytes"] < activations / 3, (prog["arena_bytes"], activations)
    outs = run_in_threads(res.out_dir, 1, inputs_of("gpt2_ts17"))
    ref = reference("gpt2_ts17", inputs_of("gpt2_ts17"))
    np.testing.assert_allclose(outs[0]["logits"], ref["logits"], rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------
# every test model on meshes [2], [4], [2, 2] (in-process ranks, callback kernels)
# ---------------------------------------------------------------------------------------
DEFAULT = ["gpt2_ts17", "bert_dynamo18", "llama_ts17", "vit_dynamo18", "resnet_ts17", "t5_encoder_ts17", "mlp_ts17"]
OTHER = ["gpt2_dynamo18", "bert_ts17", "llama_dynamo18", "vit_ts17", "resnet_dynamo18", "t5_encoder_dynamo18",
         "mlp_dynamo18"]


def _cases():
    for models, marks in ((DEFAULT, ()), (OTHER, (pytest.mark.slow,))):
        for m in models:
            for mesh, algo in (([2], "megatron"), ([4], "data"), ([2, 2], "data")):
                yield pytest.param(m, mesh, algo, marks=marks, id=f"{m}-{'x'.join(map(str, mesh))}-{algo}")


@pytest.mark.parametrize("model,mesh,algo", list(_cases()))
def test_programs_match_onnxruntime(tmp_path, callback_codegen, model, mesh, algo):
    res = compile(MODELS / f"{model}.onnx", distributed_config={"mesh_shape": mesh, "algo": algo},
                  out_dir=tmp_path / "o")
    inputs = inputs_of(model)
    ref = reference(model, inputs)
    outs = run_in_threads(res.out_dir, res.world_size, inputs)
    for r, o in enumerate(outs):
        for k, v in ref.items():
            np.testing.assert_allclose(o[k], v, rtol=1e-3, atol=1e-3, err_msg=f"rank {r} output {k}")


# ---------------------------------------------------------------------------------------
# concatenations in place
# ---------------------------------------------------------------------------------------
def _one_rank_program(tmp_path, name, nodes, inits, outs, x_shape=(1, 4, 8, 8)):
    """program.json of the model of ``nodes`` (input ``x`` of ``x_shape``, float32 ``outs``: name -> shape)
    compiled for one cpu rank into ``tmp_path / name``."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, v) for n, v in outs.items()],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, tmp_path / f"{name}.onnx")
    compile(tmp_path / f"{name}.onnx", distributed_config={"mesh_shape": [1]},
            optimization_config={"target": "cpu"}, out_dir=tmp_path / name)
    return json.loads((tmp_path / name / "rank0" / "program.json").read_text())


def _matches_onnxruntime(tmp_path, name, outs, rng, x_shape=(1, 4, 8, 8)):
    """The program of :func:`_one_rank_program` returns onnxruntime's ``outs`` on a random ``x``."""
    ort = pytest.importorskip("onnxruntime")
    x = rng.standard_normal(x_shape).astype(np.float32)
    got = load(tmp_path / name, rank=0).run({"x": x})
    want = ort.InferenceSession(str(tmp_path / f"{name}.onnx"),
                                providers=["CPUExecutionProvider"]).run(list(outs), {"x": x})
    for k, w in zip(outs, want):
        np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-4, err_msg=k)


def test_concatenations_in_place(tmp_path):
    """Channel concatenations whose inputs each come from one kernel are written in place by those
    kernels (no Concat step; each input's buffer a run of the output's), chained ones too (a DenseNet
    block: a conv reads the first concatenation, a prefix of the second, and writes the second's next
    channels); the others keep their Concat kernel: a graph input, one tensor twice, a graph output,
    another axis than the outermost non-unit one, inputs not 64-byte aligned in the output, a tensor
    already in another concatenation. The
    results equal onnxruntime's."""
    pytest.importorskip("onnxruntime")
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def conv(name, x, cin, cout):
        w = numpy_helper.from_array(rng.standard_normal((cout, cin, 3, 3)).astype(np.float32), f"{name}_w")
        inits.append(w)
        nodes.append(helper.make_node("Conv", [x, w.name], [name], pads=[1, 1, 1, 1]))
        return name

    def concat(name, xs, axis=1):
        nodes.append(helper.make_node("Concat", xs, [name], axis=axis))
        return name

    conv("a", "x", 4, 4)
    conv("b0", "x", 4, 4)
    nodes.append(helper.make_node("Relu", ["b0"], ["b"]))
    concat("c1", ["a", "b"])                 # in place
    conv("d", "c1", 8, 4)                    # reads c1 (a prefix of c2), writes c2's last channels
    concat("c2", ["c1", "d"])                # in place: c1 and its inputs are runs of c2
    conv("e", "c2", 12, 4)
    concat("k_input", ["x", "e"])            # a graph input: kept
    conv("f", "c2", 12, 4)
    concat("k_twice", ["f", "f"])            # one tensor twice: kept
    conv("g", "c2", 12, 4)
    concat("k_output", ["g", "f"])           # g is a graph output: kept
    concat("k_axis", ["e", "f"], axis=2)     # rows of 4 channels: not one run each, kept
    concat("k_again", ["e", "b"])            # b is in c1 already: kept
    for name in ("h", "h2"):  # [1, 1, 3, 3]
        inits.append(numpy_helper.from_array(rng.standard_normal((1, 4, 3, 3)).astype(np.float32), f"{name}_w"))
        nodes.append(helper.make_node("Conv", ["x", f"{name}_w"], [name], strides=[2, 2]))
    concat("k_align", ["h", "h2"])           # 9 floats each: the second would start unaligned, kept
    outs = {"c2": [1, 12, 8, 8], "k_input": [1, 8, 8, 8], "k_twice": [1, 8, 8, 8], "k_output": [1, 8, 8, 8],
            "g": [1, 4, 8, 8], "k_axis": [1, 4, 16, 8], "k_again": [1, 8, 8, 8], "k_align": [1, 2, 3, 3]}
    prog = _one_rank_program(tmp_path, "concats", nodes, inits, outs)
    kept = sorted(s["node"] for s in prog["steps"] if s["op_type"] == "Concat")
    assert kept == [f"Concat({n})" for n in ("k_again", "k_align", "k_axis", "k_input", "k_output", "k_twice")], kept
    at = {b["name"]: b["offset"] for b in prog["buffers"] if b["storage"] == "arena"}
    run = 4 * 64 * 4  # bytes of 4 channels of 8x8
    assert at["a"] == at["c1"] == at["c2"] and at["b"] == at["c2"] + run and at["d"] == at["c2"] + 2 * run
    _matches_onnxruntime(tmp_path, "concats", outs, rng)


def test_a_concatenation_in_place_takes_no_producer_into_its_kernel(tmp_path):
    """A concatenation that can be made in place (64 KiB or more) takes no producer into its kernel: a part
    computed by element-wise ops read only by it (``erf(x / 2)`` here; YOLOv8's last bottleneck's SiLU after
    a Winograd conv) is a kernel of its own writing its run of the concatenation, and the concatenation has no
    step. A smaller one keeps those ops fused into its copy. The results equal onnxruntime's."""
    pytest.importorskip("onnxruntime")
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(9)
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in
             (("s0", [0, 0]), ("s1", [8, 8]), ("ax", [2, 3]))]
    nodes = [helper.make_node("MaxPool", ["x"], ["small"], kernel_shape=[4, 4], strides=[4, 4]),  # [1, 4, 8, 8]
             helper.make_node("Slice", ["x", "s0", "s1", "ax"], ["corner"])]                      # [1, 4, 8, 8]
    for tag, src, part in (("", "x", "x"), ("2", "small", "corner")):
        inits.append(numpy_helper.from_array(rng.standard_normal((12, 4, 3, 3)).astype(np.float32), f"w{tag}"))
        inits.append(numpy_helper.from_array(rng.standard_normal((4, 16, 3, 3)).astype(np.float32), f"v{tag}"))
        inits.append(numpy_helper.from_array(np.array(0.5, np.float32), f"half{tag}"))
        nodes += [helper.make_node("Conv", [src, f"w{tag}"], [f"a{tag}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Mul", [part, f"half{tag}"], [f"h{tag}"]),
                  helper.make_node("Erf", [f"h{tag}"], [f"e{tag}"]),
                  helper.make_node("Concat", [f"a{tag}", f"e{tag}"], [f"cat{tag}"], axis=1),  # 64 KiB; 4 KiB
                  helper.make_node("Conv", [f"cat{tag}", f"v{tag}"], [f"y{tag}"], pads=[1, 1, 1, 1])]
    outs = {"y": [1, 4, 32, 32], "y2": [1, 4, 8, 8]}
    prog = _one_rank_program(tmp_path, "erf_cat", nodes, inits, outs, (1, 4, 32, 32))
    kinds = {st["node"]: st["op_type"] for st in prog["steps"]}
    assert [n for n, k in kinds.items() if k == "Concat"] == ["Concat(cat2)"], kinds
    assert "Erf(e)" in kinds and "Erf(e2)" not in kinds, kinds
    at = {b["name"]: b["offset"] for b in prog["buffers"] if b["storage"] == "arena"}
    assert at["a"] == at["cat"] and at["e"] == at["cat"] + 12 * 1024 * 4, at
    _matches_onnxruntime(tmp_path, "erf_cat", outs, rng, (1, 4, 32, 32))


def test_slices_of_one_run_are_views(tmp_path):
    """A Slice whose values are one contiguous run of its input, starting 64-byte aligned, is a view of it
    (no step; its buffer a run of the input's): a split's parts concatenated again put the split tensor
    itself into the concatenation, written there by its producer (YOLOv8's C2f blocks); a slice of channels
    read by a conv is a view of its input. Kept as copies: a slice of rows (not one run), one starting
    unaligned (36 bytes in), a graph output, a slice of a graph input. The results equal onnxruntime's."""
    pytest.importorskip("onnxruntime")
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(3)
    inits, nodes = [], []

    def conv(name, x, cin, cout, **attrs):
        w = numpy_helper.from_array(rng.standard_normal((cout, cin, 3, 3)).astype(np.float32), f"{name}_w")
        inits.append(w)
        nodes.append(helper.make_node("Conv", [x, w.name], [name + "_c"], **{"pads": [1, 1, 1, 1], **attrs}))
        nodes.append(helper.make_node("Relu", [name + "_c"], [name]))
        return name

    def take(name, x, axis, start, end):
        for k, v in (("s", start), ("e", end), ("a", axis)):
            inits.append(numpy_helper.from_array(np.array([v], np.int64), f"{name}_{k}"))
        nodes.append(helper.make_node("Slice", [x, f"{name}_s", f"{name}_e", f"{name}_a"], [name]))
        return name

    conv("p", "x", 4, 8)
    inits.append(numpy_helper.from_array(np.array([4, 4], np.int64), "halves"))
    nodes.append(helper.make_node("Split", ["p", "halves"], ["s0", "s1"], axis=1))
    conv("q", "s1", 4, 4)
    conv("q0", "s0", 4, 4)  # (read twice, neither part is fused into the concatenation's kernel)
    nodes.append(helper.make_node("Concat", ["s0", "s1", "q"], ["cat"], axis=1))  # p placed into cat
    conv("p2", "x", 4, 8)
    conv("w", take("v", "p2", 1, 2, 6), 4, 4)  # a view of p2's channels 2..5
    take("rows", "p2", 2, 0, 4)                 # rows of every channel: kept
    conv("h", "x", 4, 4, strides=[3, 3])        # [1, 4, 3, 3]: 9 floats a channel
    conv("oddc", take("odd", "h", 1, 1, 3), 2, 4)  # 36 bytes in: kept
    take("o_slice", "p2", 1, 0, 4)              # a graph output: kept
    take("in_slice", "x", 1, 0, 2)              # of a graph input: kept
    conv("z", "in_slice", 2, 4)
    outs = {"cat": [1, 12, 8, 8], "q0": [1, 4, 8, 8], "w": [1, 4, 8, 8], "rows": [1, 8, 4, 8], "oddc": [1, 4, 3, 3],
            "o_slice": [1, 4, 8, 8], "z": [1, 4, 8, 8]}
    prog = _one_rank_program(tmp_path, "slices", nodes, inits, outs)
    kinds = {s["node"]: s["op_type"] for s in prog["steps"]}
    kept = sorted(n for n, k in kinds.items() if k in ("Slice", "Concat"))
    assert kept == [f"Slice({n})" for n in ("in_slice", "o_slice", "odd", "rows")], kinds
    at = {b["name"]: b["offset"] for b in prog["buffers"] if b["storage"] == "arena"}
    channels = 64 * 4  # bytes of one channel of 8x8
    assert at["p"] == at["s0"] == at["cat"] and at["s1"] == at["cat"] + 4 * channels
    assert at["q"] == at["cat"] + 8 * channels and at["v"] == at["p2"] + 2 * channels
    _matches_onnxruntime(tmp_path, "slices", outs, rng)


def test_topk_model_on_one_and_two_cpu_ranks_matches_onnxruntime(tmp_path):
    """TopK (whose definition is an extern: only the cpu template sorts) after a projection, values and
    indices, with ties, on one rank and on two (the plan's choice) against onnxruntime."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(4)
    w = np.round(rng.standard_normal((16, 300)), 1).astype(np.float32)  # rounded: ties among the scores
    nodes = [helper.make_node("MatMul", ["x", "w"], ["s"]), helper.make_node("TopK", ["s", "k"], ["v", "i"], axis=-1)]
    graph = helper.make_graph(nodes, "topk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
                              [helper.make_tensor_value_info("v", TensorProto.FLOAT, [8, 7]),
                               helper.make_tensor_value_info("i", TensorProto.INT64, [8, 7])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([7], np.int64), "k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.round(rng.standard_normal((8, 16)), 0).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    cpu = {"target": "cpu"}
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config=cpu, out_dir=tmp_path / "a")
    got = load(tmp_path / "a").run({"x": x})
    np.testing.assert_allclose(got["v"], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["i"], want[1])
    compile(model, distributed_config={"mesh_shape": [2]}, optimization_config=cpu, out_dir=tmp_path / "b")
    outs = run_ranks(tmp_path / "b", {"x": x})
    for got in outs:
        np.testing.assert_allclose(got["v"], want[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got["i"], want[1])


# ---------------------------------------------------------------------------------------
# steps computed from constants alone run once at load
# ---------------------------------------------------------------------------------------
def _fill_model(path):
    """Fills above the constant-fold limit: a weight computed from one (``Wc``), whose memory the
    tensors made after its last reader would take if it were not kept, and a fill that is the first
    part of a channel concatenation whose other part a conv writes on every run (in place when not
    fused), whose memory the conv after its reader would take."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from shardflow.compiler.passes.simplify import FOLD_LIMIT

    rng = np.random.default_rng(1)
    assert 2048 * 2049 > FOLD_LIMIT and 65 * 256 * 256 > FOLD_LIMIT
    inits = [numpy_helper.from_array(np.array([2048, 2049], np.int64), "wshape"),
             numpy_helper.from_array(rng.standard_normal(2049).astype(np.float32), "col"),
             numpy_helper.from_array(np.array([1, 65, 256, 256], np.int64), "fshape"),
             numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "cw"),
             numpy_helper.from_array(rng.standard_normal((2, 69, 1, 1)).astype(np.float32), "mw"),
             numpy_helper.from_array(rng.standard_normal((2, 2, 1, 1)).astype(np.float32), "mw2")]
    fill = lambda v: helper.make_tensor("v", TensorProto.FLOAT, [1], [v])  # noqa: E731
    nodes = [helper.make_node("ConstantOfShape", ["wshape"], ["W0"], value=fill(0.01)),
             helper.make_node("Mul", ["W0", "col"], ["Wc"]),
             helper.make_node("MatMul", ["x", "Wc"], ["y"]),
             helper.make_node("Add", ["xt", "y"], ["t"]),
             helper.make_node("Relu", ["t"], ["tr"]),
             helper.make_node("ReduceSum", ["tr"], ["s"], keepdims=0),
             helper.make_node("ConstantOfShape", ["fshape"], ["F"], value=fill(0.5)),
             helper.make_node("Conv", ["img", "cw"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["F", "c"], ["cat"], axis=1),
             helper.make_node("Conv", ["cat", "mw"], ["m"]),
             helper.make_node("Conv", ["m", "mw2"], ["m2"])]
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "fills",
        [helper.make_tensor_value_info("x", f32, [1, 2048]), helper.make_tensor_value_info("xt", f32, [2048, 1]),
         helper.make_tensor_value_info("img", f32, [1, 4, 256, 256])],
        [helper.make_tensor_value_info("s", f32, []), helper.make_tensor_value_info("y", f32, [1, 2049]),
         helper.make_tensor_value_info("m2", f32, [1, 2, 256, 256])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)


@pytest.mark.parametrize("cfg,at_load", [({}, {"Wc", "F"}), ({"fuse": False}, {"W0", "Wc", "F"}),
                                         ({"precompute": False}, set())], ids=["default", "unfused", "off"])
def test_steps_from_constants_run_once_at_load(tmp_path, cfg, at_load):
    """Ops constant folding leaves in the graph (results above ``FOLD_LIMIT``) come first in the program
    and run once, at load (``load_steps``): the fill fused into the Mul that makes ``Wc``, and the fill written
    in place into a concatenation whose other part a conv writes on every run (the concatenation, in place,
    takes no producer into its kernel); unfused, also the first fill itself. What they write and a run reads
    keeps its bytes for good: no other buffer shares them, but for the concatenation's parts. Two runs
    on other inputs equal onnxruntime's; ``precompute: False`` runs every step every time."""
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "fills.onnx"
    _fill_model(path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    feeds = [{"x": rng.standard_normal((1, 2048)).astype(np.float32),
              "xt": rng.standard_normal((2048, 1)).astype(np.float32),
              "img": rng.standard_normal((1, 4, 256, 256)).astype(np.float32)} for _ in range(2)]
    compile(path, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu", **cfg},
            out_dir=tmp_path / "o")
    prog = json.loads((tmp_path / "o" / "rank0" / "program.json").read_text())
    n = prog.get("load_steps", 0)
    assert {prog["buffers"][i]["name"] for s in prog["steps"][:n] for i in s["outputs"]} == at_load
    arena = {b["name"]: b for b in prog["buffers"] if b["storage"] == "arena"}
    span = lambda b: (b["offset"], b["offset"] + int(np.prod(b["shape"])) * 4)  # noqa: E731
    cat = span(arena["cat"])
    assert "F" not in at_load or arena["F"]["offset"] == cat[0]  # unfused: the fill is written in place
    for keep in at_load & {"Wc", "F"}:
        lo, hi = span(arena[keep] if keep == "Wc" else arena["cat"])
        for name, b in arena.items():
            a, z = span(b)
            if name != keep and a < hi and lo < z:
                assert keep == "F" and cat[0] <= a and z <= cat[1], (keep, name)
    p = load(tmp_path / "o", rank=0)
    for f in feeds:
        got = p.run(f)
        for name, want in zip(["s", "y", "m2"], sess.run(["s", "y", "m2"], f)):
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-3, err_msg=name)


def test_steps_at_load_on_two_ranks(tmp_path):
    """The fill model on two in-process ranks (Megatron's plan): each rank runs its own load steps (its
    share of the weight made from the fill) once, and two runs equal onnxruntime's on every rank."""
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "fills.onnx"
    _fill_model(path)
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((1, 2048)).astype(np.float32),
             "xt": rng.standard_normal((2048, 1)).astype(np.float32),
             "img": rng.standard_normal((1, 4, 256, 256)).astype(np.float32)}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["s", "y", "m2"], feeds)
    res = compile(path, distributed_config={"mesh_shape": [2], "algo": "megatron"},
                  optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    for r in range(2):
        prog = json.loads((tmp_path / "o" / f"rank{r}" / "program.json").read_text())
        assert prog.get("load_steps", 0) >= 1, r

    def work(c):
        prog = load(res.out_dir, c.rank, c)
        return [prog.run(feeds) for _ in range(2)]
    for r, runs in enumerate(run_threads(InProcessWorld(2).communicators(), work, timeout=300)):
        for got in runs:
            for name, w in zip(["s", "y", "m2"], want):
                np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-3, err_msg=f"rank {r} {name}")


def _tanh_matmul(tmp_path):
    """A Tanh and a MatMul by a weight, ``[4, 8] @ [8, 6]``: ``(path, x, w)``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("MatMul", ["t", "w"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])],
                              [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    return tmp_path / "m.onnx", x, w


def _kernel_symbols(out, world):
    """Each rank's kernel symbols (program.json's steps)."""
    return [{s["symbol"] for s in json.loads((out / f"rank{r}" / "program.json").read_text())["steps"]
             if s["kind"] == "kernel"} for r in range(world)]


def test_the_ranks_kernels_are_compiled_once_into_one_library(tmp_path, monkeypatch):
    """A data-parallel plan slices the replicated input at each rank's offset, in a kernel of its own
    per rank (the rest are the same code): the ranks' kernels are compiled together, once, into one
    library that every rank dir holds (it used to be one compile per rank, each compiling the
    shared kernels again), and each rank runs its own symbols from it."""
    import shardflow.compiler.codegen as codegen

    model, x, w = _tanh_matmul(tmp_path)
    builds = []
    real = codegen.build_shared_library
    monkeypatch.setattr(codegen, "build_shared_library", lambda source, path, **kw: builds.append(path) or
                        real(source, path, **kw))
    out = tmp_path / "out"
    compile(model, distributed_config={"mesh_shape": [2], "algo": "data"},
            optimization_config={"target": "cpu"}, out_dir=out)
    assert len(builds) == 1
    symbols = _kernel_symbols(out, 2)
    assert symbols[0] != symbols[1] and symbols[0] & symbols[1]  # a kernel of each rank's own, one shared
    assert (out / "rank0" / "kernels.so").read_bytes() == (out / "rank1" / "kernels.so").read_bytes()
    got = [o["y"] for o in run_ranks(out, {"x": x})]
    for y in got:
        np.testing.assert_allclose(y, np.tanh(x) @ w, rtol=1e-5, atol=1e-5)


def test_the_ranks_cuda_kernels_are_compiled_once_into_one_cubin(tmp_path, monkeypatch):
    """As for the cpu target: the ranks' CUDA units are compiled as one (nvcc once, not once per
    rank whenever a kernel differs), each rank dir holds the cubin, and each rank's program names
    the symbols its own unit generated (the kernel at its offset), all in the cubin."""
    import shardflow.compiler.codegen.cuda as cuda

    if cuda._find_nvcc() is None:
        pytest.skip("nvcc is not installed")
    model, _, _ = _tanh_matmul(tmp_path)
    monkeypatch.setenv("SHARDFLOW_CACHE_DIR", str(tmp_path / "cache"))  # (cold: nvcc runs)
    runs, units = [], []
    real_compile, real_prepare = cuda._compile_nvcc, cuda.prepare_cuda_library
    monkeypatch.setattr(cuda, "_compile_nvcc", lambda *a: runs.append(a) or real_compile(*a))

    def prepare(*a, **kw):
        res = real_prepare(*a, **kw)
        units.append({launch.symbol for launch in res[1].launches.values()})
        return res
    monkeypatch.setattr(cuda, "prepare_cuda_library", prepare)
    out = tmp_path / "out"
    compile(model, distributed_config={"mesh_shape": [2], "algo": "data"},
            optimization_config={"target": "cuda"}, out_dir=out)
    assert len(runs) == 1
    symbols = _kernel_symbols(out, 2)
    assert symbols == units and symbols[0] != symbols[1] and symbols[0] & symbols[1]
    cubin = (out / "rank0" / "kernels.cubin").read_bytes()
    assert cubin[:4] == b"\x7fELF" and (out / "rank1" / "kernels.cubin").read_bytes() == cubin
    assert all(sym.encode() in cubin for sym in symbols[0] | symbols[1])


def test_merged_kernel_sources_keep_each_symbol_once():
    from shardflow.compiler.codegen import CpuSource

    a = CpuSource("head", [("s1", "k1"), ("s2", "k2")], {"a": "s1", "b": "s2"}, {}, {"s1": ["a"], "s2": ["b"]})
    b = CpuSource("head", [("s2", "k2"), ("s3", "k3")], {"b": "s2", "a": "s3"}, {}, {"s2": ["b", "c"], "s3": ["a"]})
    m = CpuSource.merge([a, b])
    assert m.kernels == [("s1", "k1"), ("s2", "k2"), ("s3", "k3")] and m.users["s2"] == ["b", "c"]
    assert "k3" in m.text and m.text.count("k2") == 1
    with pytest.raises(ValueError, match="different headers"):
        CpuSource.merge([a, CpuSource("another head")])


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_a_fused_qkv_product_is_split_by_heads_on_two_ranks(tmp_path, target):
    """GPT-2's QKV product (one Gemm read in three slices) is split into its parts before the plan
    (passes/projections.py), so the Megatron baseline splits Q, K and V by heads: two all-reduces
    per layer, the vocab-parallel embedding's all-reduce and the logits' all-gather, no all-to-all
    (the slices' blocks cut across Q, K and V before). Each rank computes its parts in one product
    again: on cpu a PackedMatMul, on cuda one GEMM kernel with the bias; the embedding's lookup of
    its rows is compiled for both targets."""
    import collections

    from shardflow.compiler.codegen import cuda

    if target == "cuda" and cuda._find_nvcc() is None:
        pytest.skip("nvcc is not installed")
    feeds = dict(np.load(MODELS / "gpt2_inputs.npz"))
    res = compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [2], "algo": "megatron"},
                  optimization_config={"target": target}, out_dir=tmp_path / "o",
                  input_shapes={k: list(v.shape) for k, v in feeds.items()})
    kinds = collections.Counter(c.kind for c in res.plan.collectives)
    assert kinds == {"all_reduce": 5, "all_gather": 1}, kinds
    assert str(res.plan.op_specs["/model/transformer/wte/Gather"]) == "(S(0), R) -> (P(sum))"
    for r in range(2):
        steps = json.loads((res.out_dir / f"rank{r}" / "program.json").read_text())["steps"]
        qkv = [s for s in steps if s["kind"] == "kernel" and "c_attn/Gemm#part0.merged" in s["node"]
               and not (target == "cpu" and s["op_type"] == "Binary")]  # (cpu: the bias apart, as BERT's)
        assert len(qkv) == 2, [s["node"] for s in qkv]  # (one per layer)
        if target == "cpu":
            assert all(s["op_type"] == "PackedMatMul" and s["node"].endswith(".merged") for s in qkv)
        else:  # (the bias Add's kernel: the GEMM with it as its epilogue)
            assert all(s["node"].endswith("merged_bias") and s["launch"]["kind"].startswith("gemm") for s in qkv)


def test_replicated_ranks_share_the_merged_projections_and_one_weights_file(tmp_path, monkeypatch):
    """GPT-2 on two ranks that replicate everything: its QKV parts (column views of the fused weight,
    split before the plan) are merged and packed once for both ranks (passes/prepack.PackCache; before,
    once per rank), so the two ranks' weights are the same arrays and rank 1's weights.bin is a hard
    link to rank 0's. Both ranks compute the one-rank logits."""
    import shardflow.compiler.passes.projections as projections
    from threads import run_ranks

    merged = []
    real = projections.concatenate
    monkeypatch.setattr(projections, "concatenate", lambda arrays, axis=0: merged.append(axis) or real(arrays, axis))
    feeds = dict(np.load(MODELS / "gpt2_inputs.npz"))
    compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "one")
    want = load(tmp_path / "one").run(feeds)
    assert merged == []  # (one rank: nothing split, nothing merged)
    out = tmp_path / "two"
    compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [2], "algo": "replicate"},
            optimization_config={"target": "cpu"}, out_dir=out)
    # the 2 layers' weights and their biases (all zero: one constant since import, merged once), for both ranks
    assert merged == [1, 0, 1], merged
    files = [(out / f"rank{r}" / "weights.bin").stat() for r in range(2)]
    assert files[0].st_ino == files[1].st_ino and files[0].st_nlink == 2
    for got in run_ranks(out, feeds):
        for name, w in want.items():
            np.testing.assert_array_equal(got[name], w, err_msg=name)


def test_compile_holds_one_rank_graph_at_a_time(tmp_path, monkeypatch):
    """Each rank's graph (its weight shards, their packed forms) is built when its turn comes and
    dropped before the next one's: a model's compile on R ranks needs about one rank's share of
    the weights beside the whole model, not all R shares. mesh.json and every manifest still name
    the groups of every rank's collectives. (Ops and tensors refer to each other: the compile runs
    the cycle collector itself after each rank that holds COLLECT_RANK_BYTES of weights or more, here
    every rank: the test turns the automatic one off.)"""
    import gc
    import weakref

    monkeypatch.setattr(driver, "COLLECT_RANK_BYTES", 0)

    seen: list = []
    alive_before: list = []
    passes = driver.rank_passes

    def watch(rg, opt, **kw):
        alive_before.append(sum(r() is not None for r in seen))
        seen.append(weakref.ref(rg))
        out = passes(rg, opt, **kw)
        seen.extend(weakref.ref(t) for op in out.nodes for t in op.inputs if t.is_constant)  # (its weights)
        return out
    monkeypatch.setattr(driver, "rank_passes", watch)
    gc.disable()
    try:
        res = compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [2, 2], "algo": "megatron"},
                      optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    finally:
        gc.enable()
    assert alive_before == [0, 0, 0, 0]
    groups = json.loads((res.out_dir / "mesh.json").read_text())["groups"]
    assert groups == {"0": [[0, 2], [1, 3]], "1": [[0, 1], [2, 3]]}
    for r in range(4):
        assert json.loads((res.out_dir / f"rank{r}" / "manifest.json").read_text())["mesh"]["groups"] == groups


def _big_weights_model(path):
    """x[4, 512] @ w1[512, 2048] (4 MiB) -> Gemm with w2 stored [N, K] (transB) and a bias."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    w1 = rng.standard_normal((512, 2048)).astype(np.float32) / 20
    w2 = rng.standard_normal((384, 2048)).astype(np.float32) / 30
    bias = rng.standard_normal(384).astype(np.float32)
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(bias, "b")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b"], ["y"], transB=1)]
    info = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "big", [info("x", TensorProto.FLOAT, [4, 512])],
                          [info("y", TensorProto.FLOAT, [4, 384])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return lambda x: np.maximum(x @ w1, 0) @ w2.T + bias


@pytest.mark.parametrize("target, mesh", [("cpu", [1]), ("cpu", [2]), ("cuda", [2])])
def test_compile_keeps_the_constants_it_makes_in_files(tmp_path, monkeypatch, target, mesh):
    """The large constants a compile makes (column shards, packed panels, [N, K] and half copies)
    past its budget are maps of unlinked files (ir/spill.py), not the process's memory; the
    artifacts are byte for byte those of a compile that keeps them in memory, and no spill folder
    is left beside out_dir."""
    from shardflow.compiler.ir import spill

    ref = _big_weights_model(tmp_path / "m.onnx")
    made: list = []
    build = driver.build_program

    def watch(rg, kernels, **kw):
        made.extend(t.value for op in rg.nodes for t in op.inputs
                    if t.is_constant and t.value.nbytes >= 1 << 20 and t.name not in ("w1", "w2"))
        return build(rg, kernels, **kw)
    monkeypatch.setattr(driver, "build_program", watch)
    monkeypatch.setenv(spill.BUDGET_ENV, "0")  # (every large one spilled)
    ocfg = {"target": target, **({"arch": "sm_90", "precision": "float16"} if target == "cuda" else {})}
    dcfg = {"mesh_shape": mesh, "algo": "megatron"}
    res = compile(tmp_path / "m.onnx", distributed_config=dcfg, optimization_config=ocfg, out_dir=tmp_path / "o")
    assert made and all(spill.file_backed(v) for v in made), [type(v) for v in made]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "o"]
    monkeypatch.delenv(spill.BUDGET_ENV)  # (the default: half the memory available, nothing spilled here)
    made.clear()
    plain = compile(tmp_path / "m.onnx", distributed_config=dcfg, optimization_config=ocfg, out_dir=tmp_path / "p")
    assert made and not any(spill.file_backed(v) for v in made)
    for r in range(len(res.rank_dirs)):
        assert (res.rank_dirs[r] / "weights.bin").read_bytes() == (plain.rank_dirs[r] / "weights.bin").read_bytes()
    if mesh == [1] and target == "cpu":
        x = np.random.default_rng(6).standard_normal((4, 512)).astype(np.float32)
        np.testing.assert_allclose(load(res.out_dir).run({"x": x})["y"], ref(x), rtol=1e-4, atol=1e-4)


def test_weights_that_cannot_be_written_are_a_clear_error(tmp_path):
    with pytest.raises(ShardflowError, match=r"could not write the weights .*gone/weights.bin \(8 bytes\): .*"
                                             r"choose another out_dir"):
        driver._write_weights(tmp_path / "gone" / "weights.bin", [(0, np.zeros(2, np.float32))], 8)


def test_a_failed_compile_leaves_no_spill_folder(tmp_path, monkeypatch):
    from shardflow.compiler.ir import spill

    _big_weights_model(tmp_path / "m.onnx")
    monkeypatch.setenv(spill.BUDGET_ENV, "0")

    def fail(*a, **kw):
        raise ShardflowError("stop here")
    monkeypatch.setattr(driver, "build_program", fail)  # (after the packed weights were spilled)
    with pytest.raises(ShardflowError, match="stop here"):
        compile(tmp_path / "m.onnx", distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                out_dir=tmp_path / "o")
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def test_constants_with_the_same_bytes_share_them_in_the_weights(tmp_path):
    """Two constants holding the same bytes under different shapes (a tied table and its product's
    weight, as onnxruntime-genai's 4-bit models store them) are written once: both buffers point
    at one offset of weights.bin, and the program computes with both."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    other = rng.standard_normal((32, 64)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w.reshape(32, 64).copy(), "table"),
             numpy_helper.from_array(other, "other")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Gather", ["table", "ids"], ["z"]),
             helper.make_node("Gather", ["other", "ids"], ["u"])]
    info = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "tied", [info("x", TensorProto.FLOAT, [3, 64]), info("ids", TensorProto.INT64, [5])],
                          [info("y", TensorProto.FLOAT, [3, 32]), info("z", TensorProto.FLOAT, [5, 64]),
                           info("u", TensorProto.FLOAT, [5, 64])], inits)
    path = tmp_path / "tied.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    res = compile(path, distributed_config={"mesh_shape": [1]},
                  optimization_config={"target": "cpu", "prepack": False}, out_dir=tmp_path / "o")
    program = json.loads((res.out_dir / "rank0" / "program.json").read_text())
    offsets = sorted(b["offset"] for b in program["buffers"] if b["storage"] == "weights")
    assert len(offsets) == 3 and len(set(offsets)) == 2, offsets  # (w and table: one copy)
    assert program["weights_bytes"] == 2 * w.nbytes
    feeds = {"x": rng.standard_normal((3, 64)).astype(np.float32), "ids": np.array([0, 31, 7, -1, 7])}
    out = load(res.out_dir).run(feeds)
    np.testing.assert_allclose(out["y"], feeds["x"] @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out["z"], w.reshape(32, 64)[[0, 31, 7, 31, 7]])
    np.testing.assert_array_equal(out["u"], other[[0, 31, 7, 31, 7]])


def test_an_out_dir_compiled_again_loads_its_new_kernels(tmp_path):
    """Compiled, loaded, compiled again into the same out_dir with other kernels, loaded again in the same
    process: the dynamic loader would hand back the first kernels.so (same name), missing the new
    symbols; the runtime loads the new file under a name of its own (executor._load_library)."""
    import onnx
    from onnx import TensorProto, helper as oh, numpy_helper

    from shardflow.compiler import compile
    from shardflow.runtime import load

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32), "w")
    graph = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["y"]), oh.make_node("Tanh", ["y"], ["z"])], "g",
                          [oh.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [oh.make_tensor_value_info("z", TensorProto.FLOAT, [4, 16])], [w])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    want = np.tanh(x @ numpy_helper.to_array(w))
    outs = []
    for opt in ({"target": "cpu"}, {"target": "cpu", "fuse": False, "prepack": False}):
        compile(model, distributed_config={"mesh_shape": [1]}, optimization_config=opt, out_dir=tmp_path / "out")
        outs.append(load(tmp_path / "out").run({"x": x})["z"])
    for got in outs:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
