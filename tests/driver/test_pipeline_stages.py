"""Pipeline stages (``distributed_config["pipeline_stages"]``): the cut (parallel/pipeline.py), the
compile of one out_dir per stage (compiler/stages.py) and the ranks that run them
(runtime/pipeline.py), against onnxruntime and numpy."""
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from shardflow.compiler import compile, load_onnx
from shardflow.compiler.errors import ConfigError, ShardflowError
from shardflow.compiler.parallel import search
from shardflow.compiler.driver import planning_config
from shardflow.compiler.parallel.pipeline import _crossing_bytes, microbatch_graph, op_times, split_stages
from shardflow.runtime import load
from shardflow.runtime.comm import InProcessWorld

sys.path.insert(0, str(Path(__file__).parent.parent))
from random_models import GENERATORS  # noqa: E402
from threads import run_threads  # noqa: E402

MODELS = Path(__file__).parent.parent / "models"
CPU = {"target": "cpu"}


def _residual_mlp(layers=4, width=32, rows=8, seed=0, dims=None, softmax=False):
    """``x`` through ``layers`` blocks ``h = h + relu(h @ W1) @ W2``; one output (``dims``: ``x``'s and the
    output's, names for dynamic ones, default ``[rows, width]``; ``softmax``: a last-axis softmax at the end)."""
    rng = np.random.default_rng(seed)
    nodes, inits, h = [], [], "x"
    for i in range(layers):
        for j, shape in enumerate(((width, 2 * width), (2 * width, width))):
            inits.append(numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32),
                                                 f"w{i}_{j}"))
        nodes += [oh.make_node("MatMul", [h, f"w{i}_0"], [f"a{i}"], name=f"up{i}"),
                  oh.make_node("Relu", [f"a{i}"], [f"r{i}"], name=f"relu{i}"),
                  oh.make_node("MatMul", [f"r{i}", f"w{i}_1"], [f"d{i}"], name=f"down{i}"),
                  oh.make_node("Add", [h, f"d{i}"], [f"h{i}"], name=f"res{i}")]
        h = f"h{i}"
    if softmax:
        nodes.append(oh.make_node("Softmax", [h], ["y"], name="softmax", axis=-1))
        h = "y"
    dims = dims or [rows, width]
    graph = oh.make_graph(nodes, "mlp", [oh.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                          [oh.make_tensor_value_info(h, TensorProto.FLOAT, dims)], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def _feeds(model):
    base = model.rsplit("_", 1)[0]
    return dict(np.load(MODELS / f"{base}_inputs.npz"))


def _gathered(out_dir, feeds, world):
    """The outputs of one run of the pipeline in ``out_dir`` on ``world`` in-process ranks, gathered on rank 0."""
    def rank(comm):
        prog = load(out_dir, comm.rank, comm)
        return prog.gather_outputs(prog.run(feeds))

    return run_threads(InProcessWorld(world).communicators(), rank, timeout=120)[0]


def _reference(model_path, feeds):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {i.name: feeds[i.name]
                                                                       for i in sess.get_inputs()})))


# ------------------------------------------------------------------------------------------- the cut
def test_the_cut_falls_between_layers_and_balances_the_time():
    g = load_onnx(_residual_mlp(layers=4))
    pipe = split_stages(g, 2)
    names = [[op.name for op in st_nodes] for st_nodes in
             ([op for op in g.nodes][:pipe.stages[0].ops], [op for op in g.nodes][pipe.stages[0].ops:])]
    assert names[0][-1] == "res1" and names[1][0] == "up2"  # after the second block: only h1 crosses
    assert pipe.stages[0].sends == [("h1", [1])] and pipe.stages[1].receives == [("h1", 0)]
    assert pipe.stages[0].time_s == pytest.approx(pipe.stages[1].time_s, rel=1e-6)
    assert [t[:3] for t in pipe.transfers] == [("h1", 0, 1), ("h3", 1, 0)]
    assert [t[3] for t in pipe.transfers] == ["cut", "output"]


def test_the_cut_takes_the_fewest_crossing_bytes_within_the_tolerance():
    g = load_onnx(_residual_mlp(layers=4))
    crossing = _crossing_bytes(g)
    times = op_times(g)
    pipe = split_stages(g, 2, tolerance=0.5)
    cut = pipe.stages[0].ops
    share = sum(times) / 2
    window = [i for i in range(1, len(times)) if abs(sum(times[:i]) - share) <= 0.5 * share]
    assert crossing[cut] == min(crossing[i] for i in window) == 8 * 32 * 4  # (a block boundary: h alone)


def test_stage_graphs_chained_compute_the_model():
    for model, stages in (("gpt2_ts17", 2), ("llama_dynamo18", 3), ("bert_dynamo18", 4)):
        g = load_onnx(str(MODELS / f"{model}.onnx"))
        feeds = {t.name: v for t, v in ((t, _feeds(model)[t.name]) for t in g.inputs)}
        ref = g.run(feeds)
        pipe = split_stages(g, stages)
        env = dict(feeds)
        for st in pipe.stages:
            assert [n for n, _ in st.receives] == [t.name for t in st.graph.inputs][len(st.graph_inputs):]
            env.update(st.graph.run({t.name: env[t.name] for t in st.graph.inputs}))
        for k, v in ref.items():
            np.testing.assert_array_equal(env[k], v, err_msg=f"{model} {k}")
        # every rank's transfers in the one global order: cuts by sending stage first
        cuts = [t for t in pipe.transfers if t[3] == "cut"]
        assert [t[1] for t in cuts] == sorted(t[1] for t in cuts)
        assert all(a < b for _, a, b, _ in cuts)


def test_cut_errors():
    g = load_onnx(_residual_mlp(layers=1))
    with pytest.raises(ShardflowError, match="fewer than the 5 pipeline stages"):
        split_stages(g, 5)
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    graph = oh.make_graph([oh.make_node("Relu", ["x"], ["y"]), oh.make_node("Neg", ["y"], ["z"])], "g", [x],
                          [oh.make_tensor_value_info("z", TensorProto.FLOAT, [2]), x])
    with pytest.raises(ShardflowError, match="graph output 'x' is a graph input"):
        split_stages(load_onnx(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])), 2)


def test_a_weight_filled_from_constants_stays_with_its_reader(tmp_path):
    """A weight too large to fold, filled by a ``ConstantOfShape`` at the top of the graph (onnx's light
    VGG-19 and AlexNet do so): in the stage of the product reading it, computed at load there, rather than
    made in stage 0 and sent across the cut every run (481 MB a run for the light VGG-19 before). Its op
    takes no time in the balance (it runs at load). Against numpy on 2 in-process ranks."""
    from shardflow.compiler.parallel.pipeline import constant_ops, constants_beside_readers

    rows, k, n = 8, 2048, 2049  # (k * n > FOLD_LIMIT: the fill stays an op)
    nodes = [oh.make_node("ConstantOfShape", ["wshape"], ["w"], name="fill",
                          value=numpy_helper.from_array(np.array([0.001], np.float32)))]
    h = "x"
    for i in range(6):
        nodes.append(oh.make_node("Relu" if i % 2 else "Neg", [h], [f"h{i}"], name=f"act{i}"))
        h = f"h{i}"
    nodes.append(oh.make_node("MatMul", [h, "w"], ["y"], name="product"))
    graph = oh.make_graph(nodes, "filled", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])],
                          [numpy_helper.from_array(np.array([k, n], np.int64), "wshape")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    g = load_onnx(model)
    assert [op.name for op in g.nodes][0] == "fill" and len(constant_ops(g.nodes)) == 1
    before = split_stages(g, 2, times=[1.0] * len(g.nodes))
    # (without the reorder: made again in the reader's stage, not sent, nor made where nothing reads it)
    assert "w" not in [t[0] for t in before.transfers] and before.stages[1].remade == ["fill"]
    assert "fill" not in [op.name for op in before.stages[0].graph.nodes]
    g = constants_beside_readers(g)
    assert [op.name for op in g.nodes][-2:] == ["fill", "product"] and op_times(g)[-2] == 0.0
    pipe = split_stages(g, 2)
    assert [t[0] for t in pipe.transfers if t[3] == "cut"] != [] and "w" not in [t[0] for t in pipe.transfers]
    assert [st.remade for st in pipe.stages] == [[], []]
    res = compile(model, distributed_config={"mesh_shape": [2], "pipeline_stages": 2}, optimization_config=CPU,
                  out_dir=tmp_path / "out")
    assert all(e["name"] != "w" for e in res.pipeline["transfers"])
    x = np.random.default_rng(0).standard_normal((rows, k)).astype(np.float32)
    np.testing.assert_allclose(_gathered(tmp_path / "out", {"x": x}, 2)["y"], load_onnx(model).run({"x": x})["y"],
                               rtol=1e-4, atol=1e-5)


def test_an_op_from_constants_read_by_two_stages_is_made_in_each(tmp_path, capsys):
    """A mask computed from constants alone (too large to fold: a ``Trilu`` of a ``ConstantOfShape``) read by
    an op of each stage: the second stage makes it again (at its load, as the first does) instead of
    receiving it every run; what crosses the cut is the activation only, and the cut's choice does not count
    the mask's bytes. Against the unstaged graph on 2 in-process ranks."""
    from shardflow.compiler.parallel.pipeline import constant_ops

    rows, n = 1024, 4097  # (rows * n > FOLD_LIMIT: the mask stays ops)
    nodes = [oh.make_node("ConstantOfShape", ["mshape"], ["ones"], name="fill",
                          value=numpy_helper.from_array(np.array([1.0], np.float32))),
             oh.make_node("Trilu", ["ones"], ["mask"], name="tril", upper=0),
             oh.make_node("Mul", ["x", "mask"], ["h0"], name="first")]
    h = "h0"
    for i in range(1, 7):
        nodes.append(oh.make_node("Relu" if i % 2 else "Neg", [h], [f"h{i}"], name=f"act{i}"))
        h = f"h{i}"
    nodes.append(oh.make_node("Add", [h, "mask"], ["y"], name="last"))
    graph = oh.make_graph(nodes, "masked", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [rows, n])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])],
                          [numpy_helper.from_array(np.array([rows, n], np.int64), "mshape")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    g = load_onnx(model)
    assert len(constant_ops(g.nodes)) == 2
    pipe = split_stages(g, 2)
    assert [st.remade for st in pipe.stages] == [[], ["fill", "tril"]]
    assert [t[0] for t in pipe.transfers if t[3] == "cut"] and "mask" not in [t[0] for t in pipe.transfers]
    res = compile(model, distributed_config={"mesh_shape": [2], "pipeline_stages": 2}, optimization_config=CPU,
                  out_dir=tmp_path / "out")
    assert all(e["name"] != "mask" for e in res.pipeline["transfers"])
    assert res.pipeline["stages"][1]["remade"] == ["fill", "tril"]
    from shardflow.compiler.cli import main

    assert main(["inspect", str(tmp_path / "out")]) == 0
    assert "sends none; makes again from constants: fill, tril" in capsys.readouterr().out
    x = np.random.default_rng(0).standard_normal((rows, n)).astype(np.float32)
    np.testing.assert_allclose(_gathered(tmp_path / "out", {"x": x}, 2)["y"], load_onnx(model).run({"x": x})["y"],
                               rtol=1e-6, atol=1e-6)


def test_a_saved_pipeline_is_compiled_as_planned(tmp_path):
    """preload_plan with stages: the folder `shardflow plan --stages 2 -o DIR` writes (stages.json: the cut,
    each stage's first and last op in a microbatch graph's order; a plan per stage) is what compile builds:
    the cut and every stage's plan as saved (here the Megatron baseline's, compiled under the default
    algo), not searched again; a staged out_dir serves as well (its pipeline.json). GPT-2 on [4] (2 stages
    of 2 ranks) with 2 microbatches, against onnxruntime. Refused: other stages, microbatches or meshes than
    the saved ones, another model's cut, a folder of neither kind, and the keys that would choose the cut."""
    import subprocess

    from test_multirank_models import SHARDFLOW, clean_env

    model = MODELS / "gpt2_ts17.onnx"
    cfg = {"mesh_shape": [4], "pipeline_stages": 2, "pipeline_microbatches": 2}
    proc = subprocess.run(SHARDFLOW + ["plan", str(model), "--mesh", "4", "--stages", "2", "--microbatches", "2",
                                       "--algo", "megatron", "-o", str(tmp_path / "plans")],
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((tmp_path / "plans" / "stages.json").read_text())
    assert saved["microbatches"] == 2 and saved["mesh_shape"] == [4] and len(saved["stages"]) == 2
    graph = load_onnx(str(model))
    from shardflow.compiler.parallel.pipeline import constants_beside_readers, microbatch_graph

    order = [op.name for op in constants_beside_readers(microbatch_graph(graph, 2)).nodes]
    n0 = saved["stages"][0]["ops"]
    assert order[n0 - 1] == saved["stages"][0]["last_op"] and order[n0] == saved["stages"][1]["first_op"]
    res = compile(str(model), distributed_config={**cfg, "preload_plan": str(tmp_path / "plans")},
                  optimization_config=CPU, out_dir=tmp_path / "a")
    assert [st["ops"] for st in res.pipeline["stages"]] == [st["ops"] for st in saved["stages"]]
    assert [p.algo for p in res.plans] == ["megatron", "megatron"]
    for s, plan in enumerate(res.plans):
        want = json.loads((tmp_path / "plans" / f"stage{s}" / "plan.json").read_text())
        assert {o["name"]: o["inputs"] + o["outputs"] for o in want["ops"]} == \
            {n: [str(x) for x in sp.input_specs + sp.output_specs] for n, sp in plan.op_specs.items()}
    feeds = _feeds("gpt2_ts17")
    feeds = {e["name"]: feeds[e["name"]] for e in res.pipeline["inputs"]}
    ref = _reference(model, feeds)
    got = _gathered(tmp_path / "a", feeds, 4)
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5, err_msg=k)
    # a compiled out_dir as the saved pipeline
    again = compile(str(model), distributed_config={**cfg, "preload_plan": str(tmp_path / "a")},
                    optimization_config=CPU, out_dir=tmp_path / "b")
    assert [p.algo for p in again.plans] == ["megatron", "megatron"]
    assert [st["ops"] for st in again.pipeline["stages"]] == [st["ops"] for st in saved["stages"]]

    def refused(match, **over):
        with pytest.raises(ConfigError, match=match):
            compile(str(over.pop("model", model)), distributed_config={**cfg, "preload_plan": str(tmp_path / "plans"),
                                                                       **over},
                    optimization_config=CPU, out_dir=tmp_path / "c")
        assert not (tmp_path / "c").exists()
    refused(r"was planned with pipeline_microbatches 2, the config gives 1", pipeline_microbatches=1)
    refused(r"was planned with mesh_shape \[4\], the config gives \[2\]", mesh_shape=[2])
    refused(r"planned with pipeline_stages 2, the config gives 4", pipeline_stages=4)
    refused(r"does not fit this model's graph .* plan again", model=MODELS / "llama_dynamo18.onnx",
            pipeline_microbatches=2)
    refused(r"give the folder `shardflow plan --stages 2 -o DIR` wrote",
            preload_plan=str(tmp_path / "plans" / "stage0"))
    refused(r"pipeline_microbatches 'auto' would choose", pipeline_microbatches="auto")
    refused(r"pipeline_balance 'measured' would choose", pipeline_balance="measured")


def test_auto_says_whether_the_config_or_the_capacity_refuses_every_option(tmp_path):
    """With microbatches 'auto', a pin written for the whole mesh's two axes is wrong on every option's stage
    mesh (one axis): a ConfigError saying the config is refused by every option, each option's reason
    listed; a budget nothing fits: a ShardflowError (not a ConfigError) saying nothing fits."""
    model = _residual_mlp(layers=4)
    cfg = {"mesh_shape": [2, 2], "pipeline_stages": 2, "pipeline_microbatches": "auto"}
    with pytest.raises(ConfigError, match=r"pipeline_microbatches 'auto' on mesh \[2, 2\]: every option refuses the "
                                          r"config: 2 stages over \[2\], 1 microbatch refused \(pipeline stage 0 of 2: "
                                          r"distributed_config\['op_placements'\]"):
        compile(model, distributed_config={**cfg, "op_placements": {"up1": "RR"}}, optimization_config=CPU,
                out_dir=tmp_path / "a")
    with pytest.raises(ShardflowError, match="nothing fits") as info:
        compile(model, distributed_config={**cfg, "memory_budget_bytes": 1000}, optimization_config=CPU,
                out_dir=tmp_path / "a")
    assert not isinstance(info.value, ConfigError) and not (tmp_path / "a").exists()


# -------------------------------------------------------------------------------------- config
def test_config_errors(tmp_path):
    model = _residual_mlp(layers=2)
    with pytest.raises(ConfigError, match=r"its size must be a multiple of 2 \(got mesh_shape \[3\]\)"):
        compile(model, distributed_config={"mesh_shape": [3], "pipeline_stages": 2}, optimization_config=CPU,
                out_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match=r"'output_placements'\]\['h3'\]: with pipeline_stages a run's outputs are "
                                          r"gathered whole .* \(the states: none\)"):
        compile(model, distributed_config={"mesh_shape": [2], "pipeline_stages": 2,
                                           "output_placements": {"h3": "S(0)"}}, optimization_config=CPU,
                out_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match=r"'input_placements'\] names 'y', which is not an input of the model"):
        compile(model, distributed_config={"mesh_shape": [2], "pipeline_stages": 2, "input_placements": {"y": "S(0)"}},
                optimization_config=CPU, out_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="pipeline_stages"):
        compile(model, distributed_config={"mesh_shape": [2], "pipeline_stages": 0}, optimization_config=CPU,
                out_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="pipeline_microbatches'\\] = 2 needs pipeline_stages > 1"):
        compile(model, distributed_config={"mesh_shape": [2], "pipeline_microbatches": 2}, optimization_config=CPU,
                out_dir=tmp_path / "a")
    with pytest.raises(ShardflowError, match="compile cuts the graph into stages"):
        search(load_onnx(model), {"mesh_shape": [2, 2], "pipeline_stages": 2})
    assert not (tmp_path / "a").exists()


# --------------------------------------------------------------------------------- compile and run
@pytest.mark.parametrize("model,mesh,stages,sub", [("gpt2_ts17", [2], 2, [1]), ("gpt2_ts17", [2, 2], 2, [2]),
                                                    ("llama_dynamo18", [3, 2], 3, [2]), ("gpt2_ts17", [4], 2, [2])])
def test_pipeline_ranks_match_onnxruntime(tmp_path, model, mesh, stages, sub):
    """Stages on the first mesh axis: one per position ([2], [2, 2], [3, 2]) or a share of it ([4] in 2
    stages of [2]); every rank against onnxruntime."""
    feeds = _feeds(model)
    ref = _reference(MODELS / f"{model}.onnx", feeds)
    res = compile(str(MODELS / f"{model}.onnx"), distributed_config={"mesh_shape": mesh, "pipeline_stages": stages},
                  optimization_config=CPU, out_dir=tmp_path / "out")
    width = int(np.prod(sub))
    assert res.world_size == stages * width == int(np.prod(mesh)) and len(res.stages) == stages
    assert [r.world_size for r in res.stages] == [width] * stages
    assert [list(r.plan.mesh.shape) for r in res.stages] == [sub] * stages
    spec = json.loads((tmp_path / "out" / "pipeline.json").read_text())
    assert spec["world_size"] == res.world_size and [st["dir"] for st in spec["stages"]] == \
        [f"stage{s}" for s in range(stages)]
    assert res.rank_dirs == [tmp_path.resolve() / "out" / f"stage{s}" / f"rank{c}" for s in range(stages)
                             for c in range(width)]
    assert "pipeline stages" in res.summary() and len(res.plans) == stages
    with pytest.raises(AttributeError, match="use .plans"):
        res.plan
    feeds = {e["name"]: feeds[e["name"]] for e in spec["inputs"]}

    def rank(comm):
        prog = load(tmp_path / "out", comm.rank, comm)
        mine = prog.run(feeds)
        return mine, prog.gather_outputs(mine)

    last = range((stages - 1) * width, stages * width)
    for r, (mine, full) in enumerate(run_threads(InProcessWorld(res.world_size).communicators(), rank, timeout=120)):
        assert sorted(mine) == (sorted(ref) if r in last else [])  # (the outputs stay where they are made)
        assert sorted(full) == sorted(ref if r == 0 else mine)
        for o in (mine, full):
            for k in o:
                np.testing.assert_allclose(o[k], ref[k], rtol=1e-4, atol=1e-5, err_msg=f"rank {r} {k}")


def test_an_output_read_by_a_later_stage(tmp_path):
    """``h1`` is a graph output and crosses the cut: stage 0 returns it and sends it to stage 1, which
    returns ``h3``; the gather brings ``h3`` to rank 0."""
    model = _residual_mlp(layers=4)
    model.graph.output.insert(0, oh.make_tensor_value_info("h1", TensorProto.FLOAT, [8, 32]))
    x = np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32)
    ref = load_onnx(model).run({"x": x})
    compile(model, distributed_config={"mesh_shape": [2], "pipeline_stages": 2}, optimization_config=CPU,
            out_dir=tmp_path / "out")
    spec = json.loads((tmp_path / "out" / "pipeline.json").read_text())
    assert [(e["name"], e["from"], e["to"], e["kind"]) for e in spec["transfers"]] == [
        ("h1", 0, 1, "cut"), ("h3", 1, 0, "output")]
    def rank(comm):
        prog = load(tmp_path / "out", comm.rank, comm)
        mine = prog.run({"x": x})
        return mine, prog.gather_outputs(mine)

    (a, full), (b, _) = run_threads(InProcessWorld(2).communicators(), rank, timeout=120)
    assert list(a) == ["h1"] and list(b) == ["h3"] and list(full) == ["h1", "h3"]
    for k, v in ref.items():
        np.testing.assert_allclose(full[k], v, rtol=1e-5, atol=1e-5, err_msg=k)


def test_bad_inputs_are_refused_on_every_rank(tmp_path):
    """Checked against the whole model's inputs before any transfer: every rank refuses, none waits."""
    from shardflow.runtime.executor import InputDtypeError, InputNameError, InputShapeError

    compile(_residual_mlp(layers=2), distributed_config={"mesh_shape": [2], "pipeline_stages": 2},
            optimization_config=CPU, out_dir=tmp_path / "out")
    errors = []

    def rank(comm):
        prog = load(tmp_path / "out", comm.rank, comm)
        assert prog.input_names == ["x"] and prog.model_output_names == ["h1"]
        assert prog.output_names == (["h1"] if comm.rank == 1 else [])
        for bad, kind in (({"x": np.zeros((8, 31), np.float32)}, InputShapeError), ({}, InputNameError),
                          ({"x": np.zeros((8, 32), np.float32), "y": 1}, InputNameError),
                          ({"x": [[0.5] * 32] * 8}, InputDtypeError)):  # (a list: float64)
            with pytest.raises(kind):
                prog.run(bad)
            errors.append(kind)
        return prog.gather_outputs(prog.run({"x": np.ones((8, 32), np.float32)}))

    a, b = run_threads(InProcessWorld(2).communicators(), rank, timeout=120)
    np.testing.assert_array_equal(a["h1"], b["h1"])
    assert len(errors) == 8


def test_world_size_and_layout_errors(tmp_path):
    from shardflow.runtime.artifact import ArtifactError
    from shardflow.runtime.executor import WorldSizeError
    from shardflow.runtime.launch import artifact_world_size, own_rank_dir

    compile(_residual_mlp(layers=2), distributed_config={"mesh_shape": [2, 2], "pipeline_stages": 2},
            optimization_config=CPU, out_dir=tmp_path / "out")
    assert artifact_world_size(tmp_path / "out") == 4
    assert own_rank_dir(tmp_path / "out", 3) == tmp_path / "out" / "stage1" / "rank1"
    with pytest.raises(WorldSizeError, match="compiled for 4 ranks"):
        load(tmp_path / "out", 0, InProcessWorld(2).communicators()[0])
    spec = json.loads((tmp_path / "out" / "pipeline.json").read_text())
    spec["stages"][1]["dir"] = "stage7"
    (tmp_path / "out" / "pipeline.json").write_text(json.dumps(spec))
    with pytest.raises(ArtifactError, match="stage folder 'stage7'"):
        load(tmp_path / "out", 0)


# ------------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("launcher", ["spawn", "mpiexec"])
def test_cli_compile_run_inspect_and_plan(tmp_path, launcher):
    """`shardflow compile --stages`, `shardflow run` on 4 processes (its own spawner, or mpiexec), `inspect`
    and `plan --stages`, against onnxruntime."""
    import subprocess

    from test_multirank_models import HAS_MPI, SHARDFLOW, clean_env

    if launcher == "mpiexec" and not HAS_MPI:
        pytest.skip("needs mpiexec and mpi4py (pip install -e '.[mpi]')")

    model = MODELS / "gpt2_ts17.onnx"
    feeds = _feeds("gpt2_ts17")
    np.savez(tmp_path / "in.npz", **feeds)
    out = tmp_path / "out"

    def cli(*args, err=False):
        proc = subprocess.run(SHARDFLOW + list(args), capture_output=True, text=True, timeout=600, env=clean_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr if err else proc.stdout

    cli("compile", str(model), "-o", str(out), "--mesh", "2x2", "--stages", "2", "-q")
    cli("run", str(out), "--nproc", "4", "--launcher", launcher, "--inputs", str(tmp_path / "in.npz"), "--outputs",
        str(tmp_path / "out.npz"))
    got = np.load(tmp_path / "out.npz")
    for k, v in _reference(model, feeds).items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5, err_msg=k)
    if launcher == "spawn":  # (a report per stage, each beside its own plan)
        text = cli("run", str(out), "--nproc", "4", "--launcher", launcher, "--inputs", str(tmp_path / "in.npz"),
                   "--repeat", "2", "--profile", "--throughput", err=True)
        assert "== stage 0 (ranks 0-1" in text and "== stage 1 (ranks 2-3" in text and text.count("modeled by") >= 2
        assert "back to back:" in text and "runs/s" in text
    text = cli("inspect", str(out))
    assert "2 pipeline stages on mesh [2, 2], 4 rank(s)" in text and "== stage stage1" in text
    info = json.loads(cli("inspect", str(out), "--json", "--verify"))
    assert [st["world_size"] for st in info["stages"]] == [2, 2]
    assert all(r["verified"] is True for st in info["stages"] for r in st["ranks"])
    text = cli("plan", str(model), "--mesh", "2x2", "--stages", "2", "-o", str(tmp_path / "plans"))
    assert text.count("== pipeline stage") == 2 and "# Shardflow plan" in text
    assert (tmp_path / "plans" / "stage1" / "plan.json").is_file()


def test_a_stage_with_states_is_planned_for_every_microbatch_instance(tmp_path):
    """A stage keeping its cache with 2 microbatches holds 2 instances of its program (each a part's
    activations and cache, the weights once), and its plan counts both (``instances``; memory_bytes is
    parameters + 2 x peak). A budget every stage meets unsplit with one instance but not with two: on [2]
    (a rank a stage, nothing to split) refused naming the stage; on [4] (2 ranks a stage) the plans split
    weights to fit both instances, and the program decodes five steps as onnxruntime does."""
    from test_state import _cache_state, _llama_steps

    state = _cache_state(2)
    first, _ = next(_llama_steps(1))
    kw = dict(optimization_config=CPU, input_shapes={k: v.shape for k, v in first.items()}, state=state)
    cfg = {"mesh_shape": [4], "pipeline_stages": 2, "pipeline_microbatches": 2}
    free = compile(str(MODELS / "llama_genai_fp32.onnx"), distributed_config=cfg, out_dir=tmp_path / "a", **kw).plans
    assert all(p.instances == 2 and p.memory_bytes == p.params_bytes + 2 * p.peak_activation_bytes > 0 for p in free)
    assert all(not p.collectives for p in free)  # (whole on both ranks: too small to split unbudgeted)
    tight = max(p.params_bytes + p.peak_activation_bytes * 3 // 2 for p in free)  # (one instance fits unsplit)
    with pytest.raises(ShardflowError, match=r"pipeline stage \d of 2 \(it keeps states\): no plan fits "
                                             r"memory_budget_bytes=[\d,]+ on mesh \[1\]: .* activations and states "
                                             r"x 2: a pipeline stage keeping states holds an instance of its program"):
        compile(str(MODELS / "llama_genai_fp32.onnx"), distributed_config={**cfg, "mesh_shape": [2],
                                                                          "memory_budget_bytes": tight},
                out_dir=tmp_path / "b", **kw)
    assert not (tmp_path / "b").exists()
    res = compile(str(MODELS / "llama_genai_fp32.onnx"), distributed_config={**cfg, "memory_budget_bytes": tight},
                  out_dir=tmp_path / "c", **kw)
    assert all(p.instances == 2 and p.memory_bytes <= tight for p in res.plans)
    assert sum(p.params_bytes for p in res.plans) < sum(p.params_bytes for p in free)  # (split to fit)
    saved = json.loads((tmp_path / "c" / "stage0" / "plan.json").read_text())
    assert saved["instances"] == 2
    assert "2 instances of the program" in (tmp_path / "c" / "stage0" / "plan.txt").read_text()
    _decode_on_stages(tmp_path / "c", res, 2, "ilp")


@pytest.mark.parametrize("extra", [[], ["--stages", "2", "--microbatches", "2"]], ids=["one-stage", "stages"])
def test_plan_with_state_prints_the_plan_compile_makes(tmp_path, capsys, extra):
    """`shardflow plan --state` plans as compile does with its state: the genai Llama's cache kept split by
    key/value heads on 2 Megatron ranks (4 all-gathers of the presents fewer than planned without it), and
    on 2 stages of 2 ranks with 2 microbatches each stage's plan counting its 2 instances; plan.txt as
    compile writes it."""
    from test_state import _cache_state

    from shardflow.compiler.cli import main

    model = str(MODELS / "llama_genai_fp32.onnx")
    state = [f"--state={o}={i}" for o, i in _cache_state(2).items()]
    shapes = ["--shape=input_ids=2x1", "--shape=attention_mask=2x16"] + [
        f"--shape={i}=2x2x16x16" for i in _cache_state(2).values()]
    mesh = ["--mesh", "4" if extra else "2", "--algo", "megatron", *extra]

    def plan_txt(*args) -> list[str]:
        capsys.readouterr()
        assert main(["plan", model, *mesh, *shapes, *args]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if not line.startswith("==")]
    with_state, without = plan_txt(*state), plan_txt()
    assert main(["compile", model, "-o", str(tmp_path / "out"), *mesh, *shapes, *state, "-q"]) == 0
    folders = [tmp_path / "out" / f"stage{k}" for k in range(2)] if extra else [tmp_path / "out"]
    compiled = [line for d in folders for line in (d / "plan.txt").read_text().splitlines()]
    assert with_state == compiled and with_state != without
    if extra:
        assert sum("2 instances of the program" in line for line in with_state) == 2
    else:
        counts = [line for line in with_state + without if line.startswith("# collectives:")]
        assert counts == ["# collectives: all_gather×1, all_reduce×6", "# collectives: all_gather×5, all_reduce×6"]
        # (--compare: every algo's plan with the states kept as compile keeps them; the config's row first)
        from shardflow.compiler.driver import compare_plans

        kw = dict(distributed_config={"mesh_shape": [2], "algo": "megatron"}, optimization_config=CPU,
                  input_shapes={"input_ids": (2, 1), "attention_mask": (2, 16),
                                **{i: (2, 2, 16, 16) for i in _cache_state(2).values()}})
        rows = {label: len(plan.collectives) for label, plan, _ in compare_plans(model, state=_cache_state(2), **kw)}
        assert rows["megatron"] == 7 and {label: len(plan.collectives)
                                          for label, plan, _ in compare_plans(model, **kw)}["megatron"] == 11


def test_cli_runs_and_profiles_a_kv_cache_on_stages_with_microbatches(tmp_path):
    """`shardflow run --profile` of the genai Llama on 2 stages with 2 microbatches and its cache kept: the
    logits of a step (the zero cache) onnxruntime's, and each rank's memory every instance's arena, the
    weights once."""
    import subprocess

    from test_multirank_models import SHARDFLOW, clean_env
    from test_state import _cache_state, _llama_steps

    state = _cache_state(2)
    first, want = next(_llama_steps(1))
    compile(str(MODELS / "llama_genai_fp32.onnx"),
            distributed_config={"mesh_shape": [2], "pipeline_stages": 2, "pipeline_microbatches": 2},
            optimization_config=CPU, out_dir=tmp_path / "out", input_shapes={k: v.shape for k, v in first.items()},
            state=state)
    np.savez(tmp_path / "in.npz", **{k: v for k, v in first.items() if k not in state.values()})
    proc = subprocess.run(SHARDFLOW + ["run", str(tmp_path / "out"), "--nproc", "2", "--launcher", "spawn",
                                       "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "o.npz"),
                                       "--repeat", "2", "--profile-json", str(tmp_path / "p.json")],
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "o.npz")["logits"], want["logits"], rtol=1e-4, atol=1e-4)
    memory = json.loads((tmp_path / "p.json").read_text())["memory"]
    for r in range(2):
        prog = json.loads((tmp_path / "out" / f"stage{r}" / "rank0" / "program.json").read_text())
        assert memory[r]["arena"] == 2 * prog["arena_bytes"] and memory[r]["weights"] == prog["weights_bytes"]


# ------------------------------------------------------------------------------------ microbatches
def _one_node(op, x_shape, z_shape, extra=(), inits=(), **attrs):
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)
    node = oh.make_node(op, ["x", *extra], ["y"], **attrs)
    graph = oh.make_graph([node, oh.make_node("Relu", ["y"], ["z"])], "g", [x],
                          [oh.make_tensor_value_info("z", TensorProto.FLOAT, z_shape)], list(inits))
    return load_onnx(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))


@pytest.mark.parametrize("model", ["gpt2_ts17", "llama_dynamo18", "bert_dynamo18", "resnet_ts17"])
def test_a_microbatch_graph_computes_its_rows_of_the_batch(model):
    g = load_onnx(str(MODELS / f"{model}.onnx"))
    feeds = {t.name: _feeds(model)[t.name] for t in g.inputs}
    ref = g.run(feeds)
    mg = microbatch_graph(g, 2)
    assert [t.shape for t in mg.inputs] == [(t.shape[0] // 2,) + t.shape[1:] for t in g.inputs]
    outs = [mg.run({k: np.split(v, 2)[j] for k, v in feeds.items()}) for j in range(2)]
    for k, v in ref.items():
        np.testing.assert_array_equal(np.concatenate([o[k] for o in outs]), v, err_msg=k)
    assert microbatch_graph(g, 1) is g


def test_microbatches_refuse_what_one_program_cannot_run():
    mean = _one_node("Softmax", [4, 3], [4, 3], axis=0)  # mixes the batch's rows
    with pytest.raises(ShardflowError, match="does not compute the samples of its batch .* apart"):
        microbatch_graph(mean, 2)
    with pytest.raises(ShardflowError, match=r"'x' has shape \[4, 3\], whose dim 0 .* does not divide into 3"):
        microbatch_graph(mean, 3)
    table = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "t")  # a row per sample
    with pytest.raises(ShardflowError, match="microbatch 1's graph differs from microbatch 0's"):
        microbatch_graph(_one_node("Add", [4, 3], [4, 3], extra=["t"], inits=[table]), 2)
    bias = numpy_helper.from_array(np.arange(3, dtype=np.float32), "b")  # the same for every row: fine
    assert microbatch_graph(_one_node("Add", [4, 3], [4, 3], extra=["b"], inits=[bias]), 2).inputs[0].shape == (2, 3)


@pytest.mark.parametrize("mesh,micro", [([2], 2), ([2, 2], 2)])
def test_microbatches_through_the_stages_match_onnxruntime(tmp_path, mesh, micro):
    feeds = _feeds("gpt2_ts17")
    ref = _reference(MODELS / "gpt2_ts17.onnx", feeds)
    res = compile(str(MODELS / "gpt2_ts17.onnx"), optimization_config=CPU, out_dir=tmp_path / "out",
                  distributed_config={"mesh_shape": mesh, "pipeline_stages": 2, "pipeline_microbatches": micro})
    spec = res.pipeline
    assert spec["microbatches"] == micro and "2 microbatches a run" in res.summary()
    assert [e["shape"] for e in spec["inputs"]] == [list(feeds[e["name"]].shape) for e in spec["inputs"]]
    assert all(e["shape"][0] == 1 for e in spec["transfers"] if e["kind"] == "cut")  # (a microbatch's rows)
    feeds = {e["name"]: feeds[e["name"]] for e in spec["inputs"]}

    def rank(comm):
        prog = load(tmp_path / "out", comm.rank, comm)
        runs = [prog.run(feeds) for _ in range(2)]
        return runs, prog.gather_outputs(runs[-1])

    width = res.world_size // 2
    for r, (runs, full) in enumerate(run_threads(InProcessWorld(res.world_size).communicators(), rank, timeout=120)):
        for o in runs + [full]:
            assert sorted(o) == (["logits"] if r >= width or o is full and r == 0 else [])
            for k in o:
                np.testing.assert_allclose(o[k], ref[k], rtol=1e-4, atol=1e-5, err_msg=f"rank {r} {k}")


@pytest.mark.parametrize("mesh, rank_map, ranks", [([4], [3, 1, 0, 2], [[3, 1], [0, 2]]),
                                                   ([2, 2], [1, 3, 0, 2], [[1, 3], [0, 2]])])
def test_rank_map_places_the_stages(tmp_path, mesh, rank_map, ranks):
    """rank_map with stages: stage s holds the mesh positions of its run of the first axis, each on the rank
    rank_map gives it (pipeline.json's ranks); rank 0 may be in the last stage (the outputs then come to it
    from the first rank of the stage making them, or are its own). GPT-2 in 2 stages of 2 ranks with 2
    microbatches on in-process ranks against onnxruntime; a rank_map that is not a permutation is refused."""
    feeds = _feeds("gpt2_ts17")
    ref = _reference(MODELS / "gpt2_ts17.onnx", feeds)
    cfg = {"mesh_shape": mesh, "pipeline_stages": 2, "pipeline_microbatches": 2, "rank_map": rank_map}
    res = compile(str(MODELS / "gpt2_ts17.onnx"), distributed_config=cfg, optimization_config=CPU,
                  out_dir=tmp_path / "out")
    assert res.pipeline["ranks"] == ranks
    # (the logits are made by stage 1, which holds rank 0: nothing to gather across stages)
    assert [e for e in res.pipeline["transfers"] if e["kind"] == "output"] == []
    feeds = {e["name"]: feeds[e["name"]] for e in res.pipeline["inputs"]}

    def rank(comm):
        prog = load(tmp_path / "out", comm.rank, comm)
        full = prog.gather_outputs(prog.run(feeds))
        return prog.stage, full
    got = run_threads(InProcessWorld(4).communicators(), rank, timeout=120)
    assert [s for s, _ in got] == [next(k for k, r in enumerate(ranks) if g in r) for g in range(4)]
    for k, v in ref.items():
        np.testing.assert_allclose(got[0][1][k], v, rtol=1e-4, atol=1e-5, err_msg=k)
    if mesh == [4]:  # (processes: each loads its own stage's folder; rank 0 writes the outputs)
        import subprocess

        from test_multirank_models import SHARDFLOW, clean_env

        np.savez(tmp_path / "in.npz", **feeds)
        proc = subprocess.run(SHARDFLOW + ["run", str(tmp_path / "out"), "--nproc", "4", "--launcher", "spawn",
                                           "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "o.npz")],
                              capture_output=True, text=True, timeout=600, env=clean_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        np.testing.assert_allclose(np.load(tmp_path / "o.npz")["logits"], ref["logits"], rtol=1e-4, atol=1e-5)
        from shardflow.compiler.cli import inspect_out_dir

        assert inspect_out_dir(str(tmp_path / "out"))["stage_ranks"] == ranks
    with pytest.raises(ConfigError, match="rank_map"):
        compile(str(MODELS / "gpt2_ts17.onnx"), distributed_config={**cfg, "rank_map": [0, 0, 1, 2]},
                optimization_config=CPU, out_dir=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_a_trace_of_microbatches_through_the_stages(tmp_path):
    """PipelineProgram.trace on 2 stages of 2 ranks with 2 microbatches (GPT-2, in-process ranks: one
    clock): per rank and microbatch its receives, the stage program's steps and its sends, in that order;
    stage 1 receives microbatch j only after stage 0 started sending it, and runs its steps after that."""
    feeds = _feeds("gpt2_ts17")
    res = compile(str(MODELS / "gpt2_ts17.onnx"), optimization_config=CPU, out_dir=tmp_path / "out",
                  distributed_config={"mesh_shape": [4], "pipeline_stages": 2, "pipeline_microbatches": 2})
    feeds = {e["name"]: feeds[e["name"]] for e in res.pipeline["inputs"]}

    def rank(comm):
        prog = load(tmp_path / "out", comm.rank, comm)
        events = prog.trace(feeds, runs=2)
        prog.close()
        return events
    ranks = run_threads(InProcessWorld(4).communicators(), rank, timeout=240)
    for r, events in enumerate(ranks):
        stage = r // 2
        for run in range(2):
            for j in range(2):
                mine = [e for e in events if e["run"] == run and e["microbatch"] == j]
                kinds = [e["kind"] for e in mine]
                first = "send" if stage == 0 else "receive"
                assert (kinds[0] if stage else kinds[-1]) == first and set(kinds) >= {first, "kernel"}
                assert all(b["start_ns"] >= a["end_ns"] for a, b in zip(mine, mine[1:]))
    for c in range(2):  # (each rank of stage 1 and its peer in stage 0)
        for run in range(2):
            for j in range(2):
                sent = [e for e in ranks[c] if e["kind"] == "send" and (e["run"], e["microbatch"]) == (run, j)]
                got = [e for e in ranks[2 + c] if e["kind"] == "receive" and (e["run"], e["microbatch"]) == (run, j)]
                steps = [e for e in ranks[2 + c] if e["kind"] == "kernel" and (e["run"], e["microbatch"]) == (run, j)]
                assert got[-1]["end_ns"] >= sent[0]["start_ns"] and steps[0]["start_ns"] >= got[-1]["end_ns"]


def test_shape_variants_of_pipeline_stages(tmp_path):
    """compile_variants with pipeline_stages: each variant cut and planned for its own shapes
    (``v{k}/stage{s}``), listed ``staged`` in variants.json, a stage's weights file hard-linked to an
    earlier variant's where alike; load() runs the variant the inputs' shapes choose, a PipelineProgram.
    Two sizes with 2 microbatches on 2 in-process ranks in mixed order against onnxruntime; `shardflow run`
    (its outputs gathered from the last stage, --profile per stage) and `shardflow inspect`."""
    import subprocess

    from test_multirank_models import SHARDFLOW, clean_env
    from test_variants import HIDDEN, _ort, _x, dynamic_model

    from shardflow.compiler import compile_variants
    from shardflow.runtime.pipeline import PipelineProgram

    out = tmp_path / "out"
    res = compile_variants(dynamic_model(), variants=[{"seq": 4}, {"seq": 8, "batch": 4}], dim_sizes={"batch": 2},
                           distributed_config={"mesh_shape": [2], "pipeline_stages": 2, "pipeline_microbatches": 2},
                           optimization_config=CPU, out_dir=out)
    spec = json.loads((out / "variants.json").read_text())
    assert [(v["staged"], v["world_size"], v["inputs"]) for v in spec["variants"]] == [
        (True, 2, {"x": [2, 4, HIDDEN]}), (True, 2, {"x": [4, 8, HIDDEN]})]
    assert [r.out_dir for r in res.results] == [out.resolve() / "v0", out.resolve() / "v1"]
    assert res.results[1].rank_dirs == [out.resolve() / "v1" / f"stage{s}" / "rank0" for s in range(2)]
    assert all(d.is_dir() for r in res.results for d in r.rank_dirs)
    # (the same cut in both: the same weights, whatever the shapes, one file per stage)
    assert [[st["ops"] for st in r.pipeline["stages"]] for r in res.results] == [[2, 3], [2, 3]]
    assert res.shared_weights == 2 and os.path.samefile(out / "v0" / "stage1" / "rank0" / "weights.bin",
                                                        out / "v1" / "stage1" / "rank0" / "weights.bin")
    world = InProcessWorld(2).communicators()
    progs = [load(out, c.rank, c) for c in world]
    for b, seq in ((4, 8), (2, 4), (4, 8)):
        x = _x(b, seq, seed=seq)

        def rank(c):
            prog = progs[c.rank]
            outs = prog.run({"x": x})
            return prog.last.gather_outputs(outs)  # (the variant that ran, a PipelineProgram)
        got = run_threads(world, rank, timeout=120)[0]
        np.testing.assert_allclose(got["y"], _ort(x), rtol=1e-5, atol=1e-6)
    assert progs[0].staged and isinstance(progs[0].last, PipelineProgram) and len(progs[0]._programs) == 2
    run_threads(world, lambda c: progs[c.rank].close(), timeout=60)
    x = _x(4, 8)
    np.savez(tmp_path / "in.npz", x=x)
    proc = subprocess.run(SHARDFLOW + ["run", str(out), "--nproc", "2", "--launcher", "spawn", "--inputs",
                                       str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "o.npz"), "--profile",
                                       "--trace", str(tmp_path / "trace.json")],
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "o.npz")["y"], _ort(x), rtol=1e-5, atol=1e-6)
    assert f"ran {out / 'v1'} on 2 rank(s)" in proc.stderr and "== stage 1 (ranks 1-1" in proc.stderr
    # (--trace: the variant that ran, each stage's rank a process of the timeline, its sends and receives)
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0 (stage 0's rank 0)", 1: "rank 1 (stage 1's rank 0)"}
    kinds = {(e["pid"], e["cat"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert kinds == {(0, "kernel"), (0, "send"), (1, "receive"), (1, "kernel")}
    assert trace["otherData"]["out_dir"].endswith("v1") and "waiting %" in proc.stderr
    text = subprocess.run(SHARDFLOW + ["inspect", str(out)], capture_output=True, text=True, timeout=120,
                          env=clean_env()).stdout
    assert "== shape variant v1 (seq=8, batch=4)" in text and "2 pipeline stages on mesh [2], 2 microbatches" in text
    assert text.count("== stage stage1") == 2


def test_decoding_at_two_batch_sizes_through_staged_variants(tmp_path):
    """The genai Llama's decoding step compiled as two shape variants (batch 2 and 4), each 2 stages of 2
    ranks with 2 microbatches and its KV cache kept: runs alternating between the sizes, each variant
    keeping its own cache (its stages' instances a microbatch's rows of it), the logits onnxruntime's fed
    its own presents, step by step."""
    from test_state import _cache_state, _close, _session

    from shardflow.compiler import compile_variants

    state = _cache_state(2)
    compile_variants(str(MODELS / "llama_genai_fp32.onnx"), variants=[{"batch_size": 2}, {"batch_size": 4}],
                     dim_sizes={"sequence_length": 1, "past_sequence_length": 16, "total_sequence_length": 16,
                                "kv_cache_dim": 16},
                     distributed_config={"mesh_shape": [4], "pipeline_stages": 2, "pipeline_microbatches": 2},
                     optimization_config=CPU, out_dir=tmp_path / "out", state=state)
    ref = _session(str(MODELS / "llama_genai_fp32.onnx"))
    world = InProcessWorld(4).communicators()
    progs = [load(tmp_path / "out", c.rank, c) for c in world]
    rng = np.random.default_rng(0)
    steps = {2: 0, 4: 0}
    past = {b: {n: np.zeros((b, 2, 16, 16), np.float32) for n in state.values()} for b in steps}
    for b in (2, 4, 2, 4, 2):
        mask = np.zeros((b, 16), np.int64)
        mask[:, :steps[b] + 1] = 1
        feeds = {"input_ids": rng.integers(0, 256, (b, 1)).astype(np.int64), "attention_mask": mask}
        want = ref({**feeds, **past[b]})

        def rank(c):
            prog = progs[c.rank]
            outs = prog.run(feeds)
            return prog.last.gather_outputs(outs)
        got = run_threads(world, rank, timeout=240)[0]
        _close(got["logits"], want["logits"], what=f"batch {b} step {steps[b]}")
        past[b] = {name: want[out] for out, name in state.items()}
        steps[b] += 1
    assert all(len(p._programs) == 2 and p.staged for p in progs)


def test_token_ids_past_the_table_are_refused_on_every_rank(tmp_path):
    """The index ranges the stages check (the embedding's rows) are checked on every rank before any
    transfer: a stage that does not read input_ids refuses too, rather than waiting on stage 0."""
    from shardflow.runtime.executor import InputIndexError

    feeds = _feeds("gpt2_ts17")
    compile(str(MODELS / "gpt2_ts17.onnx"), distributed_config={"mesh_shape": [2], "pipeline_stages": 2},
            optimization_config=CPU, out_dir=tmp_path / "out")
    spec = json.loads((tmp_path / "out" / "pipeline.json").read_text())
    assert [e["name"] for e in spec["inputs"] if e.get("index_checks")] == ["input_ids"]
    assert "input_ids" not in spec["stages"][1]["graph_inputs"]
    bad = dict(feeds, input_ids=np.full_like(feeds["input_ids"], 10 ** 6))

    def rank(comm):
        prog = load(tmp_path / "out", comm.rank, comm)
        with pytest.raises(InputIndexError, match="holds the index 1000000"):
            prog.run(bad)
        return sorted(prog.run(feeds))

    assert run_threads(InProcessWorld(2).communicators(), rank, timeout=120) == [[], ["logits"]]


@pytest.mark.parametrize("mesh, micro, algo, placed", [([2], 1, "ilp", False), ([2], 2, "ilp", False),
                                                      ([4], 2, "megatron", False), ([4], 2, "ilp", True)],
                         ids=["2x1", "2x1-microbatches", "2x2-megatron-microbatches", "2x2-placed-microbatches"])
def test_a_kv_cache_stays_in_its_stage(tmp_path, mesh, micro, algo, placed):
    """onnxruntime-genai's Llama decoding step (2 layers, a cache of 16) on 2 stages with its KV cache kept
    as state: no cut between a layer's past and its present, so each stage keeps its layer's cache. Five
    greedy steps of two sequences, the first given the zero past, the others only the token and the mask:
    the last stage's logits and each stage's cache against onnxruntime fed its own presents. With 2
    microbatches (a sequence each) a stage keeps an instance of its program per microbatch, each with its
    sequence's rows of the cache and the weights held once; on 2 Megatron ranks a stage, each rank its
    key/value head of them; so too with the ILP given the cache's placement (``input_placements`` and
    ``output_placements`` ``S(1)`` for each past and present, on a stage's mesh), as without stages."""
    from test_state import _cache_state

    state = _cache_state(2)
    shapes = {"input_ids": (2, 1), "attention_mask": (2, 16), **{k: (2, 2, 16, 16) for k in state.values()}}
    placements = {"input_placements": {n: "S(1)" for n in state.values()},
                  "output_placements": {n: "S(1)" for n in state}} if placed else {}
    res = compile(str(MODELS / "llama_genai_fp32.onnx"),
                  distributed_config={"mesh_shape": mesh, "pipeline_stages": 2, "pipeline_microbatches": micro,
                                      "algo": algo, **placements},
                  optimization_config=CPU, out_dir=tmp_path / "out", input_shapes=shapes, state=state)
    kept = [{e["output"]: e["input"] for e in st["state"]} for st in res.pipeline["stages"]]
    assert kept == [{k: v for k, v in state.items() if ".0." in k}, {k: v for k, v in state.items() if ".1." in k}]
    assert [e["name"] for e in res.pipeline["outputs"]] == ["logits"]
    assert sorted(e["name"] for e in res.pipeline["inputs"] if e.get("state")) == sorted(state.values())
    _decode_on_stages(tmp_path / "out", res, micro, "megatron" if placed else algo)


def _decode_on_stages(out, res, micro, algo):
    """Five greedy steps of the genai Llama compiled into ``out`` (``res``) on pipeline stages with its cache
    kept as ``state``, on threads: the last stage's logits and each stage's cache against onnxruntime fed its
    own presents; each stage's instances (one a microbatch) sharing its weights."""
    from test_state import _close, _llama_steps

    kept = [{e["output"]: e["input"] for e in st["state"]} for st in res.pipeline["stages"]]
    width = res.pipeline["stage_world_size"]
    steps = list(_llama_steps(5))

    def part(r, name, whole):
        """Rank ``r``'s part of a state: each microbatch's rows, cut as the stage's program keeps them."""
        s, c = divmod(r, width)
        entry = next(e for e in json.loads((out / f"stage{s}" / f"rank{c}" / "manifest.json")
                                           .read_text())["inputs"] if e["name"] == name)
        if algo == "megatron":  # (split by key/value heads: one a rank)
            assert entry["bounds"] == [[0, 1], [c, c + 1], [0, 16], [0, 16]] and entry["global_shape"] == [1, 2, 16, 16]
        cut = tuple(slice(lo, hi) for lo, hi in entry.get("bounds", [[0, n] for n in entry["shape"]]))
        return np.concatenate([rows[cut] for rows in np.split(whole, micro)], axis=0)

    def rank(comm):
        prog = load(out, comm.rank, comm)
        s = comm.rank // width
        assert prog.state_names == {v: k for k, v in kept[s].items()}
        assert len(prog._programs) == micro
        # (the microbatches' instances hold the stage's weights once)
        assert len({id(p.weights) for p in prog._programs}) == 1
        assert all(p.borrowed_weights_bytes == prog.program.weights.nbytes > 0 for p in prog._programs[1:])
        seen = []
        for given, _ in steps:
            got = prog.run(given)
            seen.append((got, prog.read_state()))
        prog.reset_state()
        assert all(not v.any() for v in prog.read_state().values())
        prog.close()
        return seen

    last = range(width, 2 * width)
    for r, seen in enumerate(run_threads(InProcessWorld(2 * width).communicators(), rank, timeout=240)):
        for step, ((got, cache), (_, want)) in enumerate(zip(seen, steps)):
            assert sorted(got) == (["logits"] if r in last else [])
            if r in last:
                _close(got["logits"], want["logits"], what=f"step {step}")
            for key, name in kept[r // width].items():
                _close(cache[name], part(r, name, want[key]), what=f"rank {r} step {step} {name}")


def test_no_cut_between_a_states_input_and_its_output():
    """The residual MLP with a second input ``c`` added in block 1 and ``h2`` (block 2's output) kept as
    its next value: the even cut (after ``addc``, block 1's end) would part them, so it moves before
    ``addc``, which joins ``h2``'s stage; a state spanning the whole graph leaves no place for a cut."""
    model = _residual_mlp(layers=4)
    g = model.graph
    g.input.append(oh.make_tensor_value_info("c", TensorProto.FLOAT, [8, 32]))
    at = [i for i, n in enumerate(g.node) if n.name == "res1"][0]
    g.node[at].output[0] = "h1a"
    g.node.insert(at + 1, oh.make_node("Add", ["h1a", "c"], ["h1"], name="addc"))
    g.output.insert(0, oh.make_tensor_value_info("h2", TensorProto.FLOAT, [8, 32]))
    graph = load_onnx(model)
    free = split_stages(graph, 2)
    assert [op.name for op in graph.nodes][free.stages[0].ops - 1] == "addc"  # (after block 1)
    pipe = split_stages(graph, 2, state={"h2": "c"})
    assert [op.name for op in graph.nodes][pipe.stages[0].ops - 1] == "res1"
    assert pipe.stages[0].state == {} and pipe.stages[1].state == {"h2": "c"}
    assert pipe.stages[1].graph_inputs == ["c"] and pipe.stages[0].graph_inputs == ["x"]
    assert [t for t in pipe.transfers if t[3] == "output"] == [("h3", 1, 0, "output")]  # (h2: a state, kept)
    with pytest.raises(ShardflowError, match="no place for pipeline cut 1 of 1"):
        split_stages(graph, 2, state={"h3": "x"})


# --------------------------------------------------------------------------------- random models
RANDOM_SEEDS = range(*(int(v) for v in os.environ.get("SHARDFLOW_RANDOM_SEEDS", "0:3").split(":")))


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_random_models_cut_and_split_into_microbatches(kind, seed):
    """Random models (tests/random_models.py) cut into 2 and 3 stages at a random tolerance: the stage
    graphs chained equal the graph bit for bit (the evaluator); the graph of 2 microbatches, where the
    batch divides and the model computes its samples apart, gives the rows of the whole (to the last
    bits numpy's products round by shape), else a ``ShardflowError`` says why.
    ``SHARDFLOW_RANDOM_SEEDS=A:B`` runs seeds A..B-1 (default 0:3)."""
    model, feeds, desc = GENERATORS[kind](seed)
    g = load_onnx(model)
    feeds = {t.name: feeds[t.name] for t in g.inputs}
    ref = g.run(feeds)
    rng = np.random.default_rng([seed, 105])
    for stages in (2, 3):
        if len(g.nodes) < stages:
            continue
        try:
            pipe = split_stages(g, stages, tolerance=float(rng.uniform(0.0, 0.5)))
        except ShardflowError as exc:  # (an output no op makes)
            assert "made by no op" in str(exc), f"{kind} {seed} ({desc}): {exc}"
            break
        env = dict(feeds)
        for st in pipe.stages:
            env.update(st.graph.run({t.name: env[t.name] for t in st.graph.inputs}))
        for k, v in ref.items():
            np.testing.assert_array_equal(env[k], v, err_msg=f"{kind} {seed} ({desc}) {stages} stages: {k}")
    try:
        mg = microbatch_graph(g, 2)
    except ShardflowError as exc:
        assert "pipeline_microbatches = 2" in str(exc), f"{kind} {seed} ({desc}): {exc}"
        return
    parts = [mg.run({k: np.split(v, 2)[j] for k, v in feeds.items()}) for j in range(2)]
    for k, v in ref.items():  # (numpy's products round by their shapes: a part's may differ in the last bits)
        got = np.concatenate([p[k] for p in parts])
        if v.dtype.kind in "fc":
            np.testing.assert_allclose(got, v, rtol=1e-5, atol=1e-6 * max(float(np.abs(v).max()), 1.0),
                                       err_msg=f"{kind} {seed} ({desc}): {k}")
        else:
            np.testing.assert_array_equal(got, v, err_msg=f"{kind} {seed} ({desc}): {k}")


@pytest.mark.slow
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_random_models_on_pipeline_ranks(tmp_path, kind, seed):
    """Random models compiled for the cpu target on 2 stages of 2 ranks (with 2 microbatches where the model
    allows them), run on in-process ranks, the outputs gathered on rank 0 against onnxruntime (``-m
    slow``; ``SHARDFLOW_RANDOM_SEEDS``)."""
    from random_models import reference

    model, feeds, desc = GENERATORS[kind](seed)
    want = reference(model, feeds)
    cfg = {"mesh_shape": [2, 2], "pipeline_stages": 2, "pipeline_microbatches": 2}
    try:
        microbatch_graph(load_onnx(model), 2)
    except ShardflowError:
        cfg.pop("pipeline_microbatches")
    try:
        res = compile(model, distributed_config=cfg, optimization_config=CPU, out_dir=tmp_path / "out")
    except ShardflowError as exc:  # (an output no op makes; a graph of one op)
        assert "made by no op" in str(exc) or "fewer than the 2 pipeline stages" in str(exc), \
            f"{kind} {seed} ({desc}): {exc}"
        return

    def rank(comm):
        prog = load(tmp_path / "out", comm.rank, comm)
        return prog.gather_outputs(prog.run(dict(feeds)))

    got = run_threads(InProcessWorld(res.world_size).communicators(), rank, timeout=300)[0]
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = np.asarray(got[k])
        assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{kind} {seed} ({desc}) {cfg}: {k}"
        if w.dtype.kind in "fc":
            tol = 3e-2 if any(v.dtype == np.float16 for v in feeds.values()) else 1e-4
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=tol,
                                       atol=tol * max(float(np.abs(w).max()) if w.size else 0.0, 1e-6),
                                       err_msg=f"{kind} {seed} ({desc}) {cfg}: {k}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{kind} {seed} ({desc}) {cfg}: {k}")


def test_auto_weighs_stages_against_one_plan_over_the_mesh(tmp_path):
    """``pipeline_stages: "auto"`` on a [2, 2] mesh whose first axis is slow (1 MB/s): without a budget one
    plan over the whole mesh (it need not cross the slow axis); under a budget that keeps the 8 blocks'
    weights from sitting whole on each half of the mesh, 2 stages (one transfer over the slow axis, where the
    plan over the whole mesh splits weights across it). Each as the note says, run against the evaluator."""
    model = _residual_mlp(layers=8, width=64)
    x = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    want = load_onnx(model).run({"x": x})["h7"]
    base = {"mesh_shape": [2, 2], "pipeline_stages": "auto", "axis_bandwidth_GBps": [0.001, 100]}
    flat = compile(model, distributed_config=base, optimization_config=CPU, out_dir=tmp_path / "flat")
    assert not hasattr(flat, "stages") and "pipeline_stages 'auto': one plan over mesh [2, 2]" in flat.plan.notes[-1]
    assert "pipeline_stages 'auto'" in (tmp_path / "flat" / "plan.txt").read_text()
    for o in run_threads(InProcessWorld(4).communicators(), lambda c: load(tmp_path / "flat", c.rank, c).run({"x": x})):
        np.testing.assert_allclose(o["h7"], want, rtol=1e-4, atol=1e-5)
    staged = compile(model, distributed_config=dict(base, memory_budget_bytes=200_000), optimization_config=CPU,
                     out_dir=tmp_path / "staged")
    assert len(staged.stages) == 2 and staged.pipeline["note"].startswith("pipeline_stages 'auto': 2 stages over [2]")

    def rank(comm):
        prog = load(tmp_path / "staged", comm.rank, comm)
        return prog.gather_outputs(prog.run({"x": x}))

    np.testing.assert_allclose(run_threads(InProcessWorld(4).communicators(), rank)[0]["h7"], want, rtol=1e-4,
                               atol=1e-5)
    # every count of stages dividing the first axis is weighed
    four = compile(model, distributed_config={"mesh_shape": [4], "pipeline_stages": "auto"}, optimization_config=CPU,
                   out_dir=tmp_path / "four")
    note = four.pipeline["note"] if hasattr(four, "pipeline") else four.plan.notes[-1]
    assert "one plan over mesh [4]" in note and "2 stages over [2]" in note and "4 stages over [1]" in note
    with pytest.raises(ConfigError, match="has no first axis to cut along"):
        compile(model, distributed_config={"mesh_shape": [1, 2], "pipeline_stages": "auto"}, optimization_config=CPU,
                out_dir=tmp_path / "x")


def test_auto_weighs_every_count_of_microbatches(tmp_path):
    """``pipeline_microbatches: "auto"``: every count dividing the batch (64 rows: 1, 2, 4, 8, 16, the most
    weighed) cut and planned, the one of least modeled run kept (the modeled runs of ``plan_stages`` at each
    count, computed apart: 2, where the parts' overlap gains more than each part's reading the weights again
    costs), compiled as that count would be and run against the evaluator; a model that mixes its samples
    keeps 1, the others refused by name in the note."""
    from shardflow.compiler.stages import _modeled, plan_stages

    model = _residual_mlp(layers=4, width=64, rows=64)
    base = {"mesh_shape": [2], "pipeline_stages": 2, "axis_latency_us": 0.0}
    modeled = {}
    for m in (1, 2, 4, 8, 16):
        cfg = dict(base, pipeline_microbatches=m)
        pipe, plans = plan_stages(model, distributed_config=cfg, optimization_config=CPU)
        modeled[m] = _modeled(pipe, [p.cost for p in plans], planning_config(cfg, CPU))["total"]
    best = min(modeled, key=modeled.get)
    assert best == 2
    res = compile(model, distributed_config=dict(base, pipeline_microbatches="auto"), optimization_config=CPU,
                  out_dir=tmp_path / "out")
    note = res.pipeline["note"]
    assert res.pipeline["microbatches"] == best and note.startswith(f"pipeline_microbatches 'auto': 2 stages over "
                                                                    f"[1], {best} microbatch")
    for m, t in modeled.items():
        assert f"{m} microbatch{'es' if m > 1 else ''} {t * 1e6:.4g} us" in note
    x = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)
    np.testing.assert_allclose(_gathered(tmp_path / "out", {"x": x}, 2)["h3"], load_onnx(model).run({"x": x})["h3"],
                               rtol=1e-4, atol=1e-5)
    mixed = _one_node("Softmax", [4, 3], [4, 3], axis=0)
    res = compile(mixed, distributed_config={"mesh_shape": [2], "pipeline_stages": 2, "pipeline_microbatches": "auto"},
                  optimization_config=CPU, out_dir=tmp_path / "mixed")
    assert res.pipeline["microbatches"] == 1
    assert "2 microbatches refused (pipeline_microbatches = 2: the model does not compute the samples" in \
        res.pipeline["note"] and "4 microbatches refused" in res.pipeline["note"]
    with pytest.raises(ConfigError, match="pipeline_microbatches'\\] = 'auto' needs pipeline_stages > 1"):
        compile(model, distributed_config={"mesh_shape": [2], "pipeline_microbatches": "auto"},
                optimization_config=CPU, out_dir=tmp_path / "x")
    with pytest.raises(ConfigError, match="plan_stages with pipeline_microbatches 'auto': compile decides"):
        plan_stages(model, distributed_config=dict(base, pipeline_microbatches="auto"), optimization_config=CPU)


def test_cli_microbatches(tmp_path):
    """``--microbatches M|auto`` and ``--balance`` on the command line (distributed_config
    pipeline_microbatches, pipeline_balance)."""
    import subprocess

    import onnx
    from test_multirank_models import SHARDFLOW, clean_env

    onnx.save(_residual_mlp(layers=4, width=64, rows=64), tmp_path / "m.onnx")

    def cli(*args):
        return subprocess.run(SHARDFLOW + list(args), capture_output=True, text=True, timeout=600, env=clean_env())

    proc = cli("compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "out"), "--mesh", "2", "--stages", "2",
               "--microbatches", "auto", "-q")
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = json.loads((tmp_path / "out" / "pipeline.json").read_text())
    assert spec["note"].startswith("pipeline_microbatches 'auto'") and spec["microbatches"] in (1, 2, 4, 8, 16)
    proc = cli("plan", str(tmp_path / "m.onnx"), "--mesh", "2", "--stages", "2", "--microbatches", "4",
               "--balance", "measured")
    assert proc.returncode == 0 and proc.stdout.count("== pipeline stage") == 2, proc.stderr[-3000:]
    # (`plan` with 'auto': every option compile weighs, the kept one marked and planned: the one compile kept)
    proc = cli("plan", str(tmp_path / "m.onnx"), "--mesh", "2", "--stages", "2", "--microbatches", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.split("\n\n")[0].splitlines()
    assert table[0].startswith("== options on mesh [2]") and len(table) == 6 and "refused" not in proc.stdout
    assert [line.split(",")[1].split()[0] for line in table[1:]] == ["1", "2", "4", "8", "16"]
    assert [line for line in table if line.endswith("<- kept")] == \
        [line for line in table if line.startswith(f"2 stages over [1], {spec['microbatches']} microbatch")]
    assert proc.stdout.count("== pipeline stage") == 2
    proc = cli("plan", str(tmp_path / "m.onnx"), "--mesh", "2", "--stages", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.split("\n\n")[0].splitlines()
    assert [line.split(" us")[0].rsplit(None, 1)[0].strip() for line in table[1:]] == [
        "one plan over mesh [2]", "2 stages over [1]"] and sum(line.endswith("<- kept") for line in table) == 1
    proc = cli("plan", str(tmp_path / "m.onnx"), "--mesh", "2", "--stages", "auto", "--compare")
    assert proc.returncode != 0 and "with --stages or --microbatches auto, the options compile weighs" in proc.stderr
    proc = cli("plan", str(tmp_path / "m.onnx"), "--mesh", "2", "--stages", "2", "--microbatches", "x")
    assert proc.returncode != 0 and "'x': give a number of microbatches or 'auto'" in proc.stderr


def test_kernel_times_spread_over_the_ops_they_cover():
    """``spread_kernel_times``: a kernel's time goes to the ops since the kernel before it, by their roofline
    shares; a kernel named after no op of the graph (a split projection's ``#part`` maps to its op; an
    unknown name) counts toward the next one; what follows the last op found goes to the ops after it.
    Then ``measured_op_times`` for real: one time an op, all of them found."""
    from shardflow.compiler.stages import measured_op_times, spread_kernel_times

    g = load_onnx(_residual_mlp(layers=2))  # up0 relu0 down0 res0 up1 relu1 down1 res1
    names = [op.name for op in g.nodes]
    steps = [{"node": n, "ms": ms} for n, ms in
             [("relu0", 6.0), ("down0#part1", 3.0), ("elsewhere", 2.0), ("res0", 1.0), ("up1", 4.0), ("unknown", 5.0)]]
    roof = op_times(g)
    times = spread_kernel_times(g, steps, roof)
    assert sum(times) == pytest.approx(21e-3)

    def share(span, total):
        w = sum(roof[names.index(n)] for n in span)
        return [total * roof[names.index(n)] / w for n in span]

    want = share(["up0", "relu0"], 6e-3) + [3e-3] + [3e-3] + [4e-3] + share(["relu1", "down1", "res1"], 5e-3)
    np.testing.assert_allclose(times, want, rtol=1e-9)
    real = measured_op_times(g, CPU)
    assert len(real) == len(names) and all(t >= 0 for t in real) and sum(real) > 0


@pytest.mark.parametrize("second_faster", [True, False])
def test_the_measured_cut_is_checked_on_the_stage_programs(monkeypatch, second_faster):
    """``_measured_cut``: the cut on the ops' measured times (here the first block ten times the others: the
    cut moves into it) against the roofline cut, each timed as its stage programs (replaced here: the
    measured cut's slowest stage faster, or slower); the faster kept, the note saying so; within the margin
    (a few percent: timings vary that much between runs) the roofline one."""
    from shardflow.compiler import stages as st_mod
    from shardflow.compiler.parallel.config import DistributedConfig

    g = load_onnx(_residual_mlp(layers=4))
    times = [10.0 if i < 4 else 1.0 for i in range(len(g.nodes))]
    calls = []

    def fake(graph, optimization_config, device=None, repeat=5, ranks=1):
        calls.append(len(graph.nodes))
        # the roofline cut's stages first (calls 1-2), then the measured cut's (3-4)
        slow = 5.0 if (len(calls) > 2) == second_faster else 9.0
        return [slow / len(graph.nodes)] * len(graph.nodes)

    monkeypatch.setattr(st_mod, "measured_op_times", fake)
    dcfg = DistributedConfig.from_dict({"mesh_shape": [2], "pipeline_stages": 2, "pipeline_balance": "measured"})
    pipe = st_mod._measured_cut(g, dcfg, CPU, {}, times, 2)
    roofline, measured = split_stages(g, 2), split_stages(g, 2, times=times)
    assert [st.ops for st in roofline.stages] == [8, 8] and measured.stages[0].ops < 8 and len(calls) == 4
    want = measured if second_faster else roofline
    assert [st.ops for st in pipe.stages] == [st.ops for st in want.stages]
    assert f"kept the {'measured' if second_faster else 'roofline'} one (the measured one when 5% faster" in pipe.note
    assert pipe.to_dict()["balance_note"] == pipe.note
    monkeypatch.setattr(st_mod, "measured_op_times", lambda graph, *a, **k: (
        calls.append(1), [(9.6 if len(calls) > 2 else 10.0) / len(graph.nodes)] * len(graph.nodes))[1])
    calls.clear()
    close = st_mod._measured_cut(g, dcfg, CPU, {}, times, 2)  # (the measured cut 4% faster only: not kept)
    assert [st.ops for st in close.stages] == [8, 8] and "kept the roofline one" in close.note
    calls.clear()
    same = st_mod._measured_cut(g, dcfg, CPU, {}, op_times(g), 2)  # (one cut: nothing to time)
    assert not calls and same.note.startswith("the measured times cut where the roofline times do")


def test_measured_balance_compiles_a_pipeline_equal_to_onnxruntime(tmp_path):
    """``pipeline_balance: "measured"``: GPT-2's test export cut on its kernels' times on this machine, run on
    2 in-process ranks against onnxruntime; ``pipeline.json`` says how it was balanced; the cuda target and
    a config without stages refused."""
    model = MODELS / "gpt2_ts17.onnx"
    feeds = _feeds("gpt2_ts17")
    ref = _reference(model, feeds)
    cfg = {"mesh_shape": [2], "pipeline_stages": 2, "pipeline_balance": "measured"}
    res = compile(str(model), distributed_config=cfg, optimization_config=CPU, out_dir=tmp_path / "out")
    assert res.pipeline["balance"] == "measured" and "measure" in res.timings
    from shardflow.compiler.cli import inspect_out_dir

    info = inspect_out_dir(str(tmp_path / "out"), False)
    assert info["balance"] == "measured" and info["notes"] == [res.pipeline["balance_note"]]
    feeds = {e["name"]: feeds[e["name"]] for e in res.pipeline["inputs"]}

    def rank(comm):
        prog = load(tmp_path / "out", comm.rank, comm)
        return prog.gather_outputs(prog.run(feeds))

    got = run_threads(InProcessWorld(2).communicators(), rank, timeout=120)[0]
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5, err_msg=k)
    with pytest.raises(ConfigError, match="the cuda target's are not timed at compile time"):
        compile(str(model), distributed_config=cfg, optimization_config={"target": "cuda"}, out_dir=tmp_path / "c")
    with pytest.raises(ConfigError, match="pipeline_balance'\\] = 'measured' needs pipeline_stages > 1"):
        compile(str(model), distributed_config={"mesh_shape": [2], "pipeline_balance": "measured"},
                optimization_config=CPU, out_dir=tmp_path / "x")
    with pytest.raises(ConfigError, match="'modeled' \\(the cost model's roofline times\\) or 'measured'"):
        compile(str(model), distributed_config={**cfg, "pipeline_balance": "timed"}, optimization_config=CPU,
                out_dir=tmp_path / "x")


def test_measured_balance_of_a_decoding_step_with_its_cache(tmp_path):
    """``pipeline_balance: "measured"`` times the graph on inputs a run accepts: the genai Llama computes its
    cache positions from the mask's sum, which a mask of zeros puts at -1, outside the cache (the timing run
    refused itself, and the compile with it, until session 107: integer inputs are now ones, within their
    checked ranges; ``_timing_inputs``). Its decoding steps then run on 2 stages with 2 microbatches, the
    cache kept, against onnxruntime."""
    from test_state import _cache_state, _close, _llama_steps

    from shardflow.compiler.stages import _timing_inputs

    got = _timing_inputs([{"name": "ids", "shape": [2, 1], "dtype": "int64", "index_checks": [[0, 255, "g"]]},
                          {"name": "mask", "shape": [2], "dtype": "int64"}, {"name": "x", "shape": [1],
                                                                               "dtype": "float32"},
                          {"name": "pos", "shape": [1], "dtype": "int32", "index_checks": [[4, 9, "g"], [2, 7, "h"]]},
                          {"name": "one", "shape": [1], "dtype": "int64", "index_checks": [[0, 0, "g"]]}])
    assert {k: v.tolist() for k, v in got.items()} == {"ids": [[1], [1]], "mask": [1, 1], "x": [0.0], "pos": [4],
                                                        "one": [0]}
    steps = list(_llama_steps(3))
    res = compile(str(MODELS / "llama_genai_fp32.onnx"), optimization_config=CPU, out_dir=tmp_path / "out",
                  distributed_config={"mesh_shape": [2], "pipeline_stages": 2, "pipeline_microbatches": 2,
                                      "pipeline_balance": "measured"},
                  input_shapes={k: v.shape for k, v in steps[0][0].items()}, state=_cache_state(2))
    assert res.pipeline["balance"] == "measured" and res.pipeline["balance_note"]
    world = InProcessWorld(2).communicators()
    progs = [load(tmp_path / "out", c.rank, c) for c in world]
    for step, (given, want) in enumerate(steps):
        got = run_threads(world, lambda c: progs[c.rank].gather_outputs(progs[c.rank].run(given)), timeout=120)[0]
        _close(got["logits"], want["logits"], what=f"step {step}")


def test_microbatches_rebalance_the_cut_on_the_stages_plans(monkeypatch):
    """With microbatches the slowest stage sets the pace: when the stages' plans cost other than their
    roofline sums (here stage 1's plan three times its ops' roofline times), the graph is cut again on
    the times so scaled and the new cut kept if its slowest stage is faster; kept as it was otherwise.
    (Links of no latency: the toy's ops take microseconds, a message's latency would decide.)"""
    from shardflow.compiler import stages as st_mod
    from shardflow.compiler.parallel.config import DistributedConfig

    g = microbatch_graph(load_onnx(_residual_mlp(layers=8, width=64)), 2)
    dcfg = DistributedConfig.from_dict({"mesh_shape": [2], "pipeline_stages": 2, "pipeline_microbatches": 2,
                                        "device": "cpu", "axis_latency_us": 0, "axis_bandwidth_GBps": 1e6})
    first = split_stages(g, 2, dcfg.device)
    times = op_times(g, dcfg.device)
    calls = []

    def fake_costs(pipe):  # stage 1 three times slower per op than the roofline says
        at, res = 0, []
        for s in pipe.stages:
            res.append(sum(times[at:at + s.ops]) * (3.0 if s.index == 1 else 1.0))
            at += s.ops
        return res

    def fake_plans(pipe, cfg, opt):
        calls.append([s.ops for s in pipe.stages])
        return [SimpleNamespace(cost=c) for c in fake_costs(pipe)]

    monkeypatch.setattr(st_mod, "_stage_plans", fake_plans)
    again, plans = st_mod._rebalanced(g, first, dcfg, CPU, {})
    assert calls[0] == [s.ops for s in first.stages] and len(calls) == 2
    assert again.stages[0].ops > first.stages[0].ops  # (ops moved to the cheaper stage)
    assert [p.cost for p in plans] == fake_costs(again)  # (the kept cut's plans, for the caller to reuse)
    assert max(fake_costs(again)) < max(fake_costs(first))
    monkeypatch.setattr(st_mod, "_stage_plans", lambda pipe, cfg, opt: [
        SimpleNamespace(cost=c) for c in ([1.0, 1.0] if pipe is first else [1.0, 2.0])])
    assert st_mod._rebalanced(g, first, dcfg, CPU, {})[0] is first  # (the second cut no faster: the first kept)
