"""``distributed_config["op_placements"]`` (parallel/pins.py): ops pinned to the specs the user gives, the
ILP planning the rest around them; against the unpinned plan, numpy (the sharded simulation) and
onnxruntime (compiled ranks), and every error."""
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from models import mlp
from random_models import GENERATORS, reference

from shardflow.compiler import ConfigError, ShardflowError, compile, load_onnx
from shardflow.compiler.parallel import ShardingPlan, partition, search, simulate
from shardflow.compiler.parallel.config import DistributedConfig
from shardflow.compiler.parallel.pins import matching_ops, parse_pin
from shardflow.compiler.parallel.search import Problem

sys.path.insert(0, str(Path(__file__).parent.parent))
from threads import run_ranks  # noqa: E402

MODELS = Path(__file__).parent.parent / "models"
# Megatron's MLP: the up-projection split by columns, the down-projection by rows (a partial sum)
COLUMN, ROW = "R, S(1) -> S(1)", "S(1), S(0) -> P(sum)"


@pytest.fixture(scope="module")
def graph():
    return load_onnx(mlp(4))  # matmul0..3 (+ bias, relu): 64 -> 256 -> 64 -> 256 -> 64, batch 8


def _x():
    return np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)


def _check_values(graph, plan):
    want = graph.run({"x": _x()})["y"]
    got = simulate(partition(graph, plan), {"x": _x()})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pins_give_the_pinned_specs_and_the_cheapest_plan_around_them(graph):
    """At these sizes the unpinned plan keeps every op whole (a collective costs more than the work it
    splits); pinned Megatron-style, the first pair runs as given and its partial sum is resolved once
    (an all-reduce, or a reduce-scatter whose batch rows the rest then runs split, gathered at the end),
    the other weights whole."""
    cfg = {"mesh_shape": [4], "device": "cpu"}
    free = search(graph, cfg)
    assert not free.collectives and all(sp.parallelism == 1 for sp in free.op_specs.values())
    plan = search(graph, {**cfg, "op_placements": {"matmul0": COLUMN, "matmul1": ROW}})
    assert str(plan.op_specs["matmul0"]) == "(R, S(1)) -> (S(1))"
    assert str(plan.op_specs["matmul1"]) == "(S(1), S(0)) -> (P(sum))"
    # between them the split columns stay split (no resharding); after, one resolution of the sum
    assert str(plan.op_specs["relu0"]) == "(S(1)) -> (S(1))"
    kinds = Counter(c.kind for c in plan.collectives)
    assert kinds in (Counter(all_reduce=1), Counter(reduce_scatter=1, all_gather=1)), kinds
    for name in ("matmul2", "matmul3"):
        assert str(plan.op_specs[name].input_specs[1]) == "R"
    assert plan.cost > free.cost  # (the pins cost: the search would not have split)
    assert plan.pinned == {"matmul0": COLUMN, "matmul1": ROW}
    assert any("op_placements: 2 op(s) pinned" in n for n in plan.notes)
    assert "pinned by op_placements" in plan.explain("matmul0")
    assert "pinned" not in plan.explain("matmul2")
    _check_values(graph, plan)


def test_a_pattern_pins_every_op_it_matches(graph):
    plan = search(graph, {"mesh_shape": [2], "device": "cpu",
                          "op_placements": {"matmul[02]": COLUMN, "matmul[13]": ROW}})
    for i in range(4):
        assert str(plan.op_specs[f"matmul{i}"]) == ("(R, S(1)) -> (S(1))" if i % 2 == 0 else "(S(1), S(0)) -> (P(sum))")
    assert sorted(plan.pinned) == [f"matmul{i}" for i in range(4)]
    _check_values(graph, plan)


def test_only_the_outputs_or_a_wildcard(graph):
    """``"S(1)"`` pins the output alone; ``*`` leaves a place free: the search picks the rest."""
    plan = search(graph, {"mesh_shape": [2], "device": "cpu", "op_placements": {"matmul0": "S(1)",
                                                                                 "matmul1": "*, S(0) -> *"}})
    assert str(plan.op_specs["matmul0"].output_specs[0]) == "S(1)"
    assert str(plan.op_specs["matmul1"].input_specs[1]) == "S(0)"
    _check_values(graph, plan)


def test_a_pinned_layer_is_not_aliased_with_the_unpinned_ones(graph):
    """Layers 0 and 2 are alike (the search shares one decision among them); pinning layer 0 leaves layer 2
    as the unpinned plan runs it."""
    cfg = {"mesh_shape": [2], "device": "cpu"}
    free = search(graph, cfg)
    plan = search(graph, {**cfg, "op_placements": {"matmul0": COLUMN}})
    assert str(plan.op_specs["matmul0"]) == "(R, S(1)) -> (S(1))"
    assert plan.op_specs["matmul2"] == free.op_specs["matmul2"] and plan.op_specs["matmul2"].parallelism == 1


def test_a_pinned_op_that_follows_its_group(graph):
    """``relu0`` follows ``bias0``'s group in the search (a cheap op): pinned to split the batch, it runs so
    and its input is resharded to it."""
    plan = search(graph, {"mesh_shape": [2], "device": "cpu", "op_placements": {"relu0": "S(0) -> S(0)"}})
    assert str(plan.op_specs["relu0"]) == "(S(0)) -> (S(0))"
    _check_values(graph, plan)


def test_a_pin_on_partial_sums(graph):
    """The bias add pinned to work on partial sums (its bias made partial by a local zeroing): the product
    before it is row-parallel, the sum resolved after it."""
    plan = search(graph, {"mesh_shape": [2], "device": "cpu", "op_placements": {"bias1": "P(sum), P(sum) -> P(sum)"}})
    assert str(plan.op_specs["bias1"]) == "(P(sum), P(sum)) -> (P(sum))"
    assert str(plan.op_specs["matmul1"].output_specs[0]) == "P(sum)"
    _check_values(graph, plan)


def test_pins_on_a_two_axis_mesh(graph):
    pins = {"matmul0": "RR, RS(1) -> RS(1)", "matmul1": "S(0)S(1), RS(0) -> S(0)P(sum)"}
    plan = search(graph, {"mesh_shape": [2, 2], "device": "cpu", "op_placements": pins})
    assert str(plan.op_specs["matmul1"]) == "(S(0)S(1), RS(0)) -> (S(0)P(sum))"
    _check_values(graph, plan)


def test_a_pinned_plan_saved_and_loaded(graph, tmp_path):
    plan = search(graph, {"mesh_shape": [2], "device": "cpu", "op_placements": {"matmul0": COLUMN}})
    plan.save(tmp_path)
    assert json.loads((tmp_path / "plan.json").read_text())["pinned"] == {"matmul0": COLUMN}
    assert ShardingPlan.load(tmp_path, graph=graph).pinned == {"matmul0": COLUMN}
    unpinned = search(graph, {"mesh_shape": [2], "device": "cpu"})
    unpinned.save(tmp_path / "free")
    assert "pinned" not in json.loads((tmp_path / "free" / "plan.json").read_text())


def test_the_grammar():
    pin = parse_pin("op", " R , S(1)->S(1) ")
    assert [str(s) for s in pin.inputs] == ["R", "S(1)"] and [str(s) for s in pin.outputs] == ["S(1)"]
    pin = parse_pin("op", "*, P -> P(max)")
    assert pin.inputs[0] is None and str(pin.inputs[1]) == "P(sum)" and str(pin.outputs[0]) == "P(max)"
    assert parse_pin("op", "S(0)R").inputs is None and parse_pin("op", " -> R").inputs == ()
    assert matching_ops(["a[1]", "a1", "b"], "a[1]") == ["a[1]"]  # (a name is itself before a pattern)
    assert matching_ops(["a1", "a2", "b"], "a?") == ["a1", "a2"]


@pytest.mark.parametrize("pins, extra, match", [
    ({"matmul9": COLUMN}, {}, r"'matmul9' names no op of the graph; did you mean \['matmul"),
    ({"matmul0": "R, S(1) -> S(1) -> R"}, {}, "one '->' at most"),
    ({"matmul0": "R, -> S(1)"}, {}, "an empty spec"),
    ({"matmul0": "Q(1)"}, {}, "op_placements'\\]\\['matmul0'\\] = 'Q\\(1\\)'"),
    ({"matmul0": "R -> S(1)"}, {}, "the op has 2 inputs \\(x, w0\\), the pin gives 1"),
    ({"matmul0": "RR, RS(1) -> RS(1)"}, {}, r"has 2 placement\(s\); the mesh it is planned on, \[2\], has 1"),
    ({"matmul0": "R, S(2) -> S(1)"}, {}, "splits dim 2 of 'w0', which has 2 dims"),
    ({"matmul0": "S(1), R -> R"}, {}, r"cannot run so on this mesh \(its sharding rules allow: .*R, S\(1\) -> S\(1\)"),
    ({"matmul*": "S(1)", "matmul0": "S(0)"}, {}, "pinned by 'matmul\\*' to 'S\\(1\\)' and by 'matmul0'"),
    ({"bias1": "P(sum), P(sum) -> P(sum)"}, {"partial_sums": False}, "runs so on partial sums, which this search "
                                                                      "leaves out .*: set partial_sums true"),
    ({"matmul0": COLUMN}, {"algo": "megatron"}, "algo 'megatron' is a fixed recipe"),
    ({"matmul0": COLUMN}, {"preload_plan": "plan.json"}, "preload_plan skips"),
    ({"matmul0": COLUMN}, {"pipeline_stages": "auto"}, "pipeline_stages 'auto'"),
    ({"matmul0": 3}, {}, "must map op names \\(or patterns of them\\) to spec strings"),
])
def test_errors(graph, pins, extra, match):
    cfg = {"mesh_shape": [2], "device": "cpu", "op_placements": pins, **extra}
    with pytest.raises(ConfigError, match=match):
        search(graph, cfg)


def test_a_budget_the_pins_cannot_meet(graph):
    """Pinned whole, the weights break a budget the search alone would meet: the error says the pins are why."""
    budget = int(search(graph, {"mesh_shape": [4], "algo": "replicate"}).params_bytes * 0.6)
    assert search(graph, {"mesh_shape": [4], "memory_budget_bytes": budget}).memory_bytes <= budget
    with pytest.raises(ShardflowError, match=r"the least any plan running the ops op_placements pins as given needs .*"
                                             r"\(or pin fewer ops: 4 pinned\)"):
        search(graph, {"mesh_shape": [4], "memory_budget_bytes": budget, "op_placements": {"matmul*": "R, R -> R"}})


def _gpt2():
    return MODELS / "gpt2_ts17.onnx", dict(np.load(MODELS / "gpt2_inputs.npz"))


def _ort(path, feeds):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {i.name: feeds[i.name]
                                                                       for i in sess.get_inputs()})))


# GPT-2's MLPs Megatron-style, everything else left to the search
GPT2_PINS = {"/model/transformer/h.*/mlp/c_fc/Gemm": "R, S(1), S(0) -> S(1)",
             "/model/transformer/h.*/mlp/c_proj/Gemm": "S(1), S(0), * -> P(sum)"}


def test_a_pinned_gpt2_compiled_runs_equal_to_onnxruntime(tmp_path):
    path, feeds = _gpt2()
    res = compile(str(path), distributed_config={"mesh_shape": [2], "op_placements": GPT2_PINS},
                  optimization_config={"target": "cpu"}, out_dir=tmp_path / "out")
    for name, sp in res.plan.op_specs.items():
        if name.endswith("mlp/c_fc/Gemm"):
            assert str(sp) == "(R, S(1), S(0)) -> (S(1))"
    assert len(res.plan.pinned) == 4 and "op_placements: 4 op(s) pinned" in (tmp_path / "out" / "plan.txt").read_text()
    ref = _ort(path, feeds)
    for outs in run_ranks(tmp_path / "out", feeds):
        for k in ref:
            np.testing.assert_allclose(outs[k], ref[k], rtol=1e-4, atol=1e-5)


def test_pins_on_pipeline_stages(tmp_path):
    """With stages a pin's specs are on a stage's mesh ([2, 2] in 2 stages: [2]); a pattern may name ops of
    one stage, but must name some stage's."""
    from shardflow.compiler.stages import plan_stages

    path, feeds = _gpt2()
    cfg = {"mesh_shape": [2, 2], "pipeline_stages": 2, "op_placements": {"/model/transformer/h.1/mlp/c_fc/Gemm":
                                                                         "R, S(1), S(0) -> S(1)"}}
    pipe, plans = plan_stages(str(path), distributed_config=cfg, optimization_config={"target": "cpu"})
    held = [p for p in plans if "/model/transformer/h.1/mlp/c_fc/Gemm" in p.op_specs]
    assert len(held) == 1 and list(held[0].pinned) == ["/model/transformer/h.1/mlp/c_fc/Gemm"]
    assert str(held[0].op_specs["/model/transformer/h.1/mlp/c_fc/Gemm"]) == "(R, S(1), S(0)) -> (S(1))"
    with pytest.raises(ConfigError, match="names no op of any pipeline stage"):
        plan_stages(str(path), distributed_config={**cfg, "op_placements": {"nothing*": "S(0)"}},
                    optimization_config={"target": "cpu"})
    with pytest.raises(ConfigError, match=r"the mesh it is planned on, \[2\]"):
        plan_stages(str(path), distributed_config={**cfg, "op_placements": {"/model/transformer/h.1/mlp/c_fc/Gemm":
                                                                             "RR, RS(1), RS(0) -> RS(1)"}},
                    optimization_config={"target": "cpu"})


def test_the_command_line(tmp_path):
    path, _ = _gpt2()
    run = subprocess.run([sys.executable, "-m", "shardflow.compiler.cli", "plan", str(path), "--mesh", "2", "--place",
                          "/model/transformer/h.*/mlp/c_fc/Gemm=S(1)", "--explain",
                          "/model/transformer/h.0/mlp/c_fc/Gemm"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "op_placements: 2 op(s) pinned" in run.stdout and "pinned by op_placements to 'S(1)'" in run.stdout
    run = subprocess.run([sys.executable, "-m", "shardflow.compiler.cli", "plan", str(path), "--mesh", "2", "--place",
                          "/model/transformer/h.*/mlp/c_fc/Gemm=S(1)", "--compare"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    table = run.stdout.split("== plans compared on mesh [2]")[1].splitlines()
    assert [line.split("  ")[0] for line in table[2:]] == ["ilp, 2 op(s) pinned", "ilp without op_placements",
                                                           "megatron", "data", "replicate"]
    staged = subprocess.run([sys.executable, "-m", "shardflow.compiler.cli", "plan", str(path), "--mesh", "2",
                             "--stages", "2", "--compare"], capture_output=True, text=True, timeout=300)
    assert staged.returncode != 0 and "--compare` compares plans over the whole mesh" in staged.stderr
    bad = subprocess.run([sys.executable, "-m", "shardflow.compiler.cli", "plan", str(path), "--mesh", "2",
                          "--place", "S(1)"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--place 'S(1)': write OP=SPEC" in bad.stderr


def test_plans_compared():
    """``compare_plans`` (``shardflow plan --compare``): the pinned plan, the ILP without the pins (no
    dearer: the pins only take plans away), and each baseline, none cheaper than the ILP (its optimum
    is over a space holding theirs: the ILP keeps a baseline that beats it); under a budget the
    plans above it refused, each with the reason."""
    from shardflow.compiler.driver import compare_plans

    path, _ = _gpt2()
    rows = compare_plans(str(path), distributed_config={"mesh_shape": [2], "op_placements": GPT2_PINS},
                         optimization_config={"target": "cpu"})
    assert [r[0] for r in rows] == ["ilp, 4 op(s) pinned", "ilp without op_placements", "megatron", "data",
                                    "replicate"]
    assert all(plan is not None and why is None for _, plan, why in rows)
    pinned, free = rows[0][1], rows[1][1]
    assert len(pinned.pinned) == 4 and not free.pinned and free.cost <= pinned.cost
    assert all(free.cost <= p.cost * (1 + 1e-9) for _, p, _ in rows[2:])
    replicated = rows[-1][1].memory_bytes
    rows = compare_plans(str(path), distributed_config={"mesh_shape": [2], "memory_budget_bytes": replicated - 1},
                         optimization_config={"target": "cpu"})
    assert rows[0][1].memory_bytes < replicated
    assert rows[-1][0] == "replicate" and rows[-1][1] is None and "above memory_budget_bytes" in rows[-1][2]
    with pytest.raises(ConfigError, match="with pipeline_stages"):
        compare_plans(str(path), distributed_config={"mesh_shape": [2], "pipeline_stages": 2})


RANDOM_SEEDS = range(*(int(v) for v in os.environ.get("SHARDFLOW_RANDOM_SEEDS", "0:2").split(":")))


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_random_pins_on_random_models(kind, seed):
    """Random models (tests/random_models.py), three random ops each pinned to a random strategy of theirs
    (partial sums and row ranges included), on [2] and [2, 2]: the plan runs them so and, planned around
    them, computes what onnxruntime does (``SHARDFLOW_RANDOM_SEEDS=A:B`` for more seeds)."""
    from test_random_plans import _float32

    model, feeds, desc = GENERATORS[kind](seed)
    if feeds["x"].dtype != np.float32:
        feeds = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()}
        model = _float32(model)
    want = reference(model, feeds)
    g = load_onnx(model)
    rng = np.random.default_rng(seed)
    for mesh in ([2], [2, 2]):
        problem = Problem(g, DistributedConfig.from_dict({"mesh_shape": mesh}))
        pins = {}
        for k in rng.choice(len(g.nodes), size=min(3, len(g.nodes)), replace=False):
            op = g.nodes[int(k)]
            s = problem.strategies[id(op)][int(rng.integers(len(problem.strategies[id(op)])))]
            pins[op.name] = f"{', '.join(map(str, s.input_specs))} -> {', '.join(map(str, s.output_specs))}"
        plan = search(g, {"mesh_shape": mesh, "op_placements": pins})
        for name, text in pins.items():
            sp = plan.op_specs[name]
            assert f"{', '.join(map(str, sp.input_specs))} -> {', '.join(map(str, sp.output_specs))}" == text
        got = simulate(partition(g, plan), feeds, plan.mesh)
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, rtol=1e-3, atol=1e-3 * max(float(np.abs(w).max()), 1.0),
                                       err_msg=f"{desc} {mesh} {pins}: {name}")
