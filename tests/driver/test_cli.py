"""The `shardflow` command line: help, plan, inspect, compile errors."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import callback_kernels as CK
import handmade
from shardflow.compiler import cli, driver

MODELS = Path(__file__).parent.parent / "models"
SHARDFLOW = [sys.executable, "-m", "shardflow.compiler.cli"]


def sh(*args, timeout=120):
    return subprocess.run(SHARDFLOW + [str(a) for a in args], capture_output=True, text=True, timeout=timeout)


def test_help_documents_every_flag():
    top = sh("--help")
    assert top.returncode == 0
    for cmd in ("compile", "run", "plan", "inspect"):
        assert cmd in top.stdout
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for cmd, p in sub.choices.items():
        out = sh(cmd, "--help")
        assert out.returncode == 0, out.stderr
        for action in p._actions:
            for flag in action.option_strings:
                assert flag in out.stdout, (cmd, flag)
            assert action.help, (cmd, action.option_strings or action.dest)


def test_parse_helpers():
    assert cli.parse_mesh("2x2") == [2, 2] and cli.parse_mesh("4") == [4]
    assert cli.parse_shapes(["input_ids=2x24", "s="]) == {"input_ids": [2, 24], "s": []}
    # a sequence input's items (handlers_sequence): scalars and an empty sequence too
    assert cli.parse_shapes(["q=[2x3,4x3]", "r=[,1]", "e=[]"]) == {"q": [[2, 3], [4, 3]], "r": [[], [1]], "e": []}
    with pytest.raises(cli._CLIError, match=r"e.g. s=\[2x3,4x3\]"):
        cli.parse_shapes(["q=[2x3;4x3]"])
    for bad in ("2x", "0", "a"):
        with pytest.raises(cli._CLIError):
            cli.parse_mesh(bad)
    with pytest.raises(cli._CLIError, match="NAME=DIMS"):
        cli.parse_shapes(["2x24"])
    assert cli.parse_dims(["batch_size=1", "a=b=128"]) == {"batch_size": 1, "a=b": 128}
    for bad, what in (("batch", "NAME=SIZE"), ("batch=x", "an integer"), ("batch=-1", "non-negative")):
        with pytest.raises(cli._CLIError, match=what):
            cli.parse_dims([bad])


def test_dims_size_every_input_by_name(tmp_path):
    """`--dim NAME=SIZE` sizes an onnxruntime-genai LLM's inputs by their dims' names (no --shape), in
    `plan` and `compile`; a name the model lacks is an error that lists the names it has."""
    dims = ["--dim", "batch_size=1", "--dim", "sequence_length=4", "--dim", "total_sequence_length=4",
            "--dim", "past_sequence_length=0", "--dim", "kv_cache_dim=16"]
    out = sh("plan", MODELS / "llama_genai_fp32.onnx", "--mesh", "2", *dims)
    assert out.returncode == 0, out.stderr
    out = sh("plan", MODELS / "llama_genai_fp32.onnx", "--dim", "batch=1")
    assert out.returncode == 1 and "dim_sizes names ['batch'], which no input" in out.stderr, out.stderr
    out = sh("compile", MODELS / "llama_genai_fp32.onnx", "-o", tmp_path / "out", "-q", *dims, timeout=600)
    assert out.returncode == 0, out.stderr
    manifest = json.loads((tmp_path / "out" / "rank0" / "manifest.json").read_text())
    assert {i["name"]: i["shape"] for i in manifest["inputs"]}["past_key_values.1.value"] == [1, 2, 0, 16]


def test_values_bind_inputs_at_compile_time(tmp_path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    model = helper.make_model(helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="sum", keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6]),
         helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])]), opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, tmp_path / "m.onnx")
    np.save(tmp_path / "axes.npy", np.array([1]))
    out = sh("plan", tmp_path / "m.onnx", "--mesh", "2")
    assert out.returncode == 1 and "input 1 ('axes') must be known" in out.stderr and "--value" in out.stderr
    out = sh("plan", tmp_path / "m.onnx", "--mesh", "2", "--value", f"axes={tmp_path / 'axes.npy'}")
    assert out.returncode == 0, out.stderr
    assert cli.parse_values([f"axes={tmp_path / 'axes.npy'}"])["axes"].tolist() == [1]
    a = tmp_path / "axes.npy"
    seq = cli.parse_values([f"s=[{a},{a}]", "e=[]"])  # (a sequence input's items)
    assert [x.tolist() for x in seq["s"]] == [[1], [1]] and seq["e"] == []
    np.savez(tmp_path / "two.npz", a=np.ones(1), b=np.ones(2))
    for bad, why in (("axes", "use NAME=FILE.npy"), (f"axes={tmp_path / 'missing.npy'}", "cannot read"),
                     (f"s=[{a},]", "an empty file name"), (f"s={tmp_path / 'two.npz'}", "several arrays")):
        with pytest.raises(cli._CLIError, match=f"--value .*{why}"):
            cli.parse_values([bad])


def test_plan_prints_plan_txt(tmp_path):
    out = sh("plan", MODELS / "mlp_ts17.onnx", "--mesh", "2", "--algo", "megatron", "-o", tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# Shardflow plan (megatron) on mesh [2]")
    assert out.stdout == (tmp_path / "plan.txt").read_text()
    assert json.loads((tmp_path / "plan.json").read_text())["algo"] == "megatron"
    # `shardflow plan` plans for its target's device, as `compile` does: cpu (the default) -> the cpu profile
    assert "(device cpu: 2 TFLOP/s, 200 GB/s)" in out.stdout.splitlines()[1]
    out = sh("plan", MODELS / "mlp_ts17.onnx", "--mesh", "2", "--target", "cuda")
    assert out.returncode == 0 and "(device h100-sxm:" in out.stdout.splitlines()[1], out.stderr
    out = sh("plan", MODELS / "mlp_ts17.onnx", "--mesh", "2", "--target", "cuda", "--device", "cpu")
    assert out.returncode == 0 and "(device cpu: 2 TFLOP/s, 200 GB/s)" in out.stdout.splitlines()[1], out.stderr


def test_a_plan_that_splits_nothing_says_why():
    """The ILP's optimum for the small GPT-2 on two ranks runs every op whole (a collective's latency
    outweighs the work it would split): plan.txt says so and names the two ways to split anyway; a
    plan that splits work has no such line."""
    note = "# every op runs whole on every rank: under the cost model"
    out = sh("plan", MODELS / "gpt2_ts17.onnx", "--mesh", "2")
    assert out.returncode == 0 and out.stdout.splitlines()[3] == "# collectives: none", out.stderr
    assert out.stdout.splitlines()[4].startswith("# links: x 100 GB/s, 5 us a step (the defaults;")
    assert out.stdout.splitlines()[5].startswith(note)
    assert "memory_budget_bytes" in out.stdout.splitlines()[5] and "megatron" in out.stdout.splitlines()[5]
    out = sh("plan", MODELS / "gpt2_ts17.onnx", "--mesh", "2", "--algo", "megatron")
    assert out.returncode == 0 and note not in out.stdout


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`shardflow plan M.onnx | head`: the pipe's reader gone, the command stops without a traceback."""
    r, w = os.pipe()
    os.close(r)  # (the reader has already stopped: the first write fails)
    try:
        proc = subprocess.run(SHARDFLOW + ["plan", str(MODELS / "mlp_ts17.onnx"), "--mesh", "2"], stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr and "Exception" not in proc.stderr, proc.stderr


def test_plan_txt_names_the_links_it_was_priced_on(tmp_path):
    """Given links are printed per axis, without the remark the defaults get."""
    (tmp_path / "d.json").write_text(json.dumps({"axis_bandwidth_GBps": [400, 25], "axis_latency_us": [1, 8]}))
    out = sh("plan", MODELS / "mlp_ts17.onnx", "--mesh", "2x2", "--distributed-config", tmp_path / "d.json")
    assert out.returncode == 0, out.stderr
    assert "# links: x 400 GB/s, 1 us a step, y 25 GB/s, 8 us a step\n" in out.stdout


def test_plan_explains_the_ops_asked_for():
    """`shardflow plan --explain NODE` prints, after the plan, what each mesh axis does to NODE
    (the vocab-parallel lookup: its rows; a row-parallel product: its reduction) and the resharding
    of its inputs; a name not in the plan is an error naming similar ones, and nothing is printed."""
    out = sh("plan", MODELS / "gpt2_ts17.onnx", "--mesh", "2", "--algo", "megatron",
             "--explain", "/model/transformer/wte/Gather", "--explain", "/model/transformer/h.0/attn/c_proj/Gemm")
    assert out.returncode == 0, out.stderr
    plan_text, lookup, product = out.stdout.rsplit("\n\n", 2)
    assert plan_text.startswith("# Shardflow plan (megatron)")
    assert lookup.splitlines()[:2] == ["/model/transformer/wte/Gather (Gather): (S(0), R) -> (P(sum))",
                                       "  mesh axis x (size 2): splits an input into row ranges read through data "
                                       "indices (partial output)"]
    assert product.startswith("/model/transformer/h.0/attn/c_proj/Gemm (Gemm): (S(1), S(0), P(sum)) -> (P(sum))")
    assert "splits loop variable k" in product
    out = sh("plan", MODELS / "gpt2_ts17.onnx", "--mesh", "2", "--explain", "wte/Gather")
    assert out.returncode != 0 and out.stdout == ""
    assert "no op named 'wte/Gather' in the plan; similar: ['/model/transformer/wte/Gather']" in out.stderr


def test_a_saved_plan_names_the_ops_compile_plans(tmp_path):
    """`shardflow plan` runs compile's passes before the plan (driver.plan_passes): GPT-2's fused
    QKV product in its parts on two ranks, so the plan it saves loads in compile (preload_plan)."""
    out = sh("plan", MODELS / "gpt2_ts17.onnx", "--mesh", "2", "--algo", "megatron", "-o", tmp_path / "p")
    assert out.returncode == 0, out.stderr
    assert "c_attn/Gemm#part2" in out.stdout and "all_to_all" not in out.stdout
    res = driver.compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [2],
                                                                        "preload_plan": str(tmp_path / "p")},
                         optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    steps = json.loads((res.out_dir / "rank0" / "program.json").read_text())["steps"]
    kinds = [st["node"].rsplit("/", 1)[-1] for st in steps if st["kind"] == "collective"]
    # two per layer and the vocab-parallel embedding's (its rows' offset comes back with the saved plan)
    assert sum(k.startswith("all_reduce") for k in kinds) == 5 and not any("all_to_all" in k for k in kinds), kinds


def test_a_saved_plan_of_a_quantized_model_loads_in_compile(tmp_path):
    """A QDQ product (DequantizeLinear'd int8 operands into a MatMul) imports as the integer product on
    the cpu target (the default) and as the float MatMul on cuda: `shardflow plan` imports the model as
    its --target does (driver.planned_graph), so its saved plan loads in compile, whose import is the
    same; before, it planned the float MatMul and compile refused the plan as another graph's."""
    import onnx
    from random_models import GENERATORS

    model, feeds, desc = GENERATORS["index_program"](0)
    assert "qmm" in desc
    onnx.save(model, tmp_path / "m.onnx")
    out = sh("plan", tmp_path / "m.onnx", "--mesh", "2", "-o", tmp_path / "p")
    assert out.returncode == 0, out.stderr
    assert "_int8" in out.stdout and "MatMul(" not in out.stdout
    res = driver.compile(tmp_path / "m.onnx", optimization_config={"target": "cpu"}, out_dir=tmp_path / "o",
                         distributed_config={"mesh_shape": [2], "preload_plan": str(tmp_path / "p")})
    assert (res.out_dir / "rank1" / "program.json").exists()
    out = sh("plan", tmp_path / "m.onnx", "--mesh", "2", "--target", "cuda")
    assert out.returncode == 0, out.stderr
    assert "MatMul(" in out.stdout and "_int8" not in out.stdout


def test_a_saved_plan_with_padded_heads_loads_in_compile(tmp_path):
    """GPT-2's 4 heads on 3 ranks (Megatron): `shardflow plan` pads them to 6 as compile does
    (passes/heads.py), plan.json records it, and compile with the saved plan (algo left at its
    default) pads the graph alike: the same plan, its collectives listed in plan.txt as the
    saved one lists them, two all-reduces a layer and the embedding's on the ranks."""
    out = sh("plan", MODELS / "gpt2_ts17.onnx", "--mesh", "3", "--algo", "megatron", "-o", tmp_path / "p")
    assert out.returncode == 0, out.stderr
    assert "4 -> 6 (8 products)" in out.stdout and "# megatron:" not in out.stdout
    assert json.loads((tmp_path / "p" / "plan.json").read_text())["pad_heads"] == 3
    res = driver.compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [3],
                                                                        "preload_plan": str(tmp_path / "p")},
                         optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    saved = (tmp_path / "p" / "plan.txt").read_text().splitlines()
    compiled = (res.out_dir / "plan.txt").read_text().splitlines()
    assert [ln for ln in compiled if ln.startswith("# collectives")] == \
        [ln for ln in saved if ln.startswith("# collectives")] == ["# collectives: all_gather×1, all_reduce×5"]
    steps = json.loads((res.out_dir / "rank2" / "program.json").read_text())["steps"]
    kinds = [st["node"].rsplit("/", 1)[-1] for st in steps if st["kind"] == "collective"]
    assert sum(k.startswith("all_reduce") for k in kinds) == 5, kinds


@pytest.mark.parametrize("algo, pad_heads, padded", [("megatron", "auto", True), ("megatron", False, False),
                                                     ("ilp", "auto", False), ("ilp", True, True)])
def test_pad_heads_key(tmp_path, algo, pad_heads, padded):
    """`pad_heads`: auto pads for the Megatron baseline only; true and false say so for any algo."""
    from shardflow.compiler.parallel.config import DistributedConfig

    cfg = DistributedConfig.from_dict({"mesh_shape": [3], "algo": algo, "pad_heads": pad_heads})
    assert driver.heads_padding(cfg) == (3 if padded else 1)
    (tmp_path / "d.json").write_text(json.dumps({"pad_heads": pad_heads}))
    out = sh("plan", MODELS / "gpt2_ts17.onnx", "--mesh", "3", "--algo", algo, "--distributed-config",
             tmp_path / "d.json")
    assert out.returncode == 0, out.stderr
    assert ("# heads padded to split over 3 ranks" in out.stdout) == padded


def test_compile_errors_are_reported(tmp_path):
    out = sh("compile", MODELS / "mlp_ts17.onnx", "-o", tmp_path / "o", "--mesh", "2y2")
    assert out.returncode == 2 and "--mesh '2y2'" in out.stderr
    cfg = tmp_path / "opt.json"
    cfg.write_text(json.dumps({"targett": "cpu"}))
    out = sh("compile", MODELS / "mlp_ts17.onnx", "-o", tmp_path / "o", "--optimization-config", cfg)
    assert out.returncode == 1 and "ConfigError" in out.stderr and "did you mean 'target'" in out.stderr
    out = sh("compile", MODELS / "mlp_ts17.onnx", "-o", tmp_path / "o", "--sm-count", "0")
    assert out.returncode == 1 and "optimization_config['sm_count'] = 0" in out.stderr
    out = sh("compile", tmp_path / "missing.onnx", "-o", tmp_path / "o")
    assert out.returncode == 1 and "missing.onnx" in out.stderr
    assert not (tmp_path / "o").exists()


def test_inspect_summarizes_and_verifies(tmp_path, monkeypatch, capsys):
    CK.BUILT.clear()
    monkeypatch.setattr(driver, "_cpu_builder", lambda: CK.build_callback_library)
    driver.compile(MODELS / "mlp_ts17.onnx", distributed_config={"mesh_shape": [2, 2], "algo": "megatron"},
                   out_dir=tmp_path / "o")
    out = sh("inspect", tmp_path / "o", "--verify")
    assert out.returncode == 0, out.stderr
    assert "target cpu" in out.stdout and "mesh [2, 2]" in out.stdout and "4 rank(s)" in out.stdout
    assert len(re.findall(r"^rank \d \[\d, \d\]: 16 kernels; collectives all_gather@0×1, all_reduce@1×2.*"
                          r"checksums ok$", out.stdout, re.M)) == 4, out.stdout
    info = json.loads(sh("inspect", tmp_path / "o", "--json").stdout)
    assert info["world_size"] == 4 and info["inputs"][0]["name"] == "x"
    w = tmp_path / "o" / "rank3" / "weights.bin"
    data = bytearray(w.read_bytes())
    data[0] ^= 1
    w.write_bytes(bytes(data))
    out = sh("inspect", tmp_path / "o", "--verify")
    assert out.returncode == 1 and "rank3/weights.bin" in out.stdout


def test_inspect_handmade(tmp_path):
    handmade.make_artifact(tmp_path / "h", (2,))
    out = sh("inspect", tmp_path / "h")
    assert out.returncode == 0, out.stderr
    assert "all_reduce@0×1" in out.stdout and "all_gather@0×1" in out.stdout and "at load" not in out.stdout
    prog = tmp_path / "h" / "rank1" / "program.json"  # a first step run once at load (no --verify here)
    prog.write_text(json.dumps(dict(json.loads(prog.read_text()), load_steps=1)))
    out = sh("inspect", tmp_path / "h")
    assert re.search(r"^rank 1 \[1\]: 3 kernels \(1 run once at load\);", out.stdout, re.M), out.stdout
    assert json.loads(sh("inspect", tmp_path / "h", "--json").stdout)["ranks"][1]["load_steps"] == 1
    assert "linked" not in out.stdout  # (each rank's own weights)
    w0, w1 = tmp_path / "h" / "rank0" / "weights.bin", tmp_path / "h" / "rank1" / "weights.bin"
    w1.unlink()
    os.link(w0, w1)  # (ranks with the same weights, as compile links them)
    out = sh("inspect", tmp_path / "h")
    assert re.search(r"^rank 1 \[1\]: .*weights 192 B \(rank 0's file, linked\)$", out.stdout, re.M), out.stdout
    info = json.loads(sh("inspect", tmp_path / "h", "--json").stdout)
    assert [r["weights_file_of_rank"] for r in info["ranks"]] == [None, 0]


def test_calibration_flag_takes_device_and_links_unless_set(tmp_path):
    cal = {"mesh_shape": [2], "axis_bandwidth_GBps": [3.5], "axis_latency_us": [8.0],
           "device": {"name": "cpu calibrated here", "peak_tflops": 0.09, "mem_bandwidth_GBps": 16.0}}
    f = tmp_path / "machine.json"
    f.write_text(json.dumps(cal))
    model = MODELS / "mlp_ts17.onnx"
    res = sh("plan", model, "--calibration", f)  # the mesh comes from the calibration
    assert res.returncode == 0, res.stderr
    assert "mesh [2]" in res.stdout and "device cpu calibrated here: 0.09 TFLOP/s, 16 GB/s" in res.stdout
    res = sh("plan", model, "--calibration", f, "--device", "h100")
    assert res.returncode == 0 and "device h100-sxm" in res.stdout
    args = cli.build_parser().parse_args(["plan", str(model), "--calibration", str(f)])
    dcfg = cli._distributed_config(args)
    assert dcfg["axis_bandwidth_GBps"] == [3.5] and dcfg["axis_latency_us"] == [8.0]
    bad = sh("plan", model, "--calibration", f, "--mesh", "2x2")
    assert bad.returncode == 2 and "measured the links of mesh [2]" in bad.stderr and "--mesh 2x2" in bad.stderr
    f.write_text(json.dumps({"mesh_shape": [2]}))
    bad = sh("plan", model, "--calibration", f)
    assert bad.returncode == 2 and "lacks" in bad.stderr and "shardflow calibrate" in bad.stderr
