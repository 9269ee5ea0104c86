"""RankProgram.profile and the report of `shardflow run --profile`."""
import json

import numpy as np
import onnxruntime
import pytest

from models import mlp
from shardflow.compiler import compile
from shardflow.runtime import load
from shardflow.runtime.profile import chrome_trace, format_profile, format_trace_summary, memory_record


def _mlp_program(tmp_path):
    """A 2-layer MLP compiled for one cpu rank, loaded; an input and onnxruntime's output for it."""
    compile(mlp(layers=2, batch=8, hidden=16), distributed_config={"mesh_shape": [1]},
            optimization_config={"target": "cpu"}, out_dir=tmp_path / "out")
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    ref = onnxruntime.InferenceSession(mlp(layers=2, batch=8, hidden=16).SerializeToString()).run(None, {"x": x})[0]
    return load(tmp_path / "out", 0), x, ref


def test_profile_times_every_step_and_leaves_the_program_usable(tmp_path):
    prog, x, ref = _mlp_program(tmp_path)
    steps = prog.profile({"x": x}, repeat=3)
    program = json.loads((tmp_path / "out" / "rank0" / "program.json").read_text())["steps"]
    assert [(s["kind"], s["node"], s["index"]) for s in steps] == [(p["kind"], p["node"], k)
                                                                 for k, p in enumerate(program)]
    assert all(s["kind"] == "kernel" and s["ms"] > 0 for s in steps)
    (got,) = prog.run({"x": x}).values()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="repeat"):
        prog.profile({"x": x}, repeat=0)


def test_trace_records_each_step_of_each_run_in_order(tmp_path):
    """RankProgram.trace: an event per step and run, in program order, each inside the run and after the
    one before; the traced runs compute what run() does (its outputs, then a plain run's)."""
    prog, x, ref = _mlp_program(tmp_path)
    events = prog.trace({"x": x}, runs=3)
    program = json.loads((tmp_path / "out" / "rank0" / "program.json").read_text())["steps"]
    assert [(e["run"], e["kind"], e["node"]) for e in events] == [(r, p["kind"], p["node"]) for r in range(3)
                                                                  for p in program]
    assert all(e["end_ns"] >= e["start_ns"] for e in events)
    assert all(b["start_ns"] >= a["end_ns"] for a, b in zip(events, events[1:]))
    got = prog.traced_run({"x": x}, [], run=9)
    np.testing.assert_allclose(next(iter(got.values())), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(next(iter(prog.run({"x": x}).values())), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="runs"):
        prog.trace({"x": x}, runs=0)


def test_chrome_trace_and_its_summary():
    """Two ranks' events as a Chrome trace (a named process per rank, complete events in microseconds) and
    the summary's span, kernels, waiting (collectives, sends and receives) and the rest."""
    ranks = [[{"kind": "kernel", "node": "a", "what": "MatMul", "run": 0, "start_ns": 1000, "end_ns": 3000},
              {"kind": "collective", "node": "a", "what": "all_reduce", "run": 0, "start_ns": 4000, "end_ns": 9000}],
             [{"kind": "receive", "node": "h", "what": "receive stage 0", "run": 0, "microbatch": 1,
               "start_ns": 0, "end_ns": 2000},
              {"kind": "kernel", "node": "b", "what": "Relu", "run": 0, "microbatch": 1, "start_ns": 2400,
               "end_ns": 3000}]]
    trace = chrome_trace(ranks, ["rank 0", "rank 1 (stage 1's rank 0)"], {"runs": 1})
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert [(e["pid"], e["args"]["name"]) for e in meta] == [(0, "rank 0"), (1, "rank 1 (stage 1's rank 0)")]
    done = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"], e["cat"], e["ts"], e["dur"]) for e in done] == [
        (0, "a", "kernel", 1.0, 2.0), (0, "a", "collective", 4.0, 5.0), (1, "h", "receive", 0.0, 2.0),
        (1, "b", "kernel", 2.4, 0.6)]
    assert done[2]["args"] == {"what": "receive stage 0", "run": 0, "microbatch": 1}
    assert trace["otherData"] == {"runs": 1} and json.loads(json.dumps(trace)) == trace
    lines = format_trace_summary(ranks).splitlines()
    assert lines[1].split() == ["0", "0.008", "0.002", "0.005", "0.001", "62.5"]
    assert lines[2].split() == ["1", "0.003", "0.001", "0.002", "0.000", "66.7"]


def test_report_sums_each_rank_and_names_the_slowest_rank_of_each_step():
    def step(kind, what, node, ms):
        return {"kind": kind, "what": what, "node": node, "ms": ms}
    ranks = [[step("kernel", "MatMul", "a", 2.0), step("collective", "all_reduce", "ar", 0.5),
              step("kernel", "Add", "b", 0.1)],
             [step("kernel", "MatMul", "a", 1.0), step("collective", "all_reduce", "ar", 1.5),
              step("kernel", "Add", "b", 0.3)]]
    text = format_profile(ranks, repeat=4, top=2)
    lines = text.splitlines()
    assert "median of 4 run(s)" in lines[0]
    assert lines[2].split()[:4] == ["0", "2.10", "0.50", "2.60"] and "all_reduce 1 (0.50)" in lines[2]
    assert lines[3].split()[:4] == ["1", "1.30", "1.50", "2.80"]
    assert "the 2 slowest steps" in lines[4]
    first, second = lines[6].split(), lines[7].split()
    assert first[:5] == ["2.000", "0", "0", "kernel", "MatMul"]  # step a: rank 0 is slower
    assert second[:5] == ["1.500", "1", "1", "collective", "all_reduce"]


def test_report_puts_the_plans_modeled_times_beside_the_measured_ones():
    ranks = [[{"kind": "kernel", "what": "MatMul", "node": "a", "ms": 2.0}]]
    plan = {"compute_cost_s": 0.0015, "comm_cost_s": 0.00025, "device": {"name": "cpu"}}
    text = format_profile(ranks, repeat=1, plan=plan)
    assert "modeled by the plan (device cpu): compute 1.50 ms, communication 0.25 ms per rank" in text
    assert "modeled" not in format_profile(ranks, repeat=1)


def test_report_puts_each_ranks_memory_beside_the_plans_model():
    ranks = [[{"kind": "kernel", "what": "MatMul", "node": "a", "ms": 2.0}]] * 2
    memory = [{"arena": 3 * 2**20, "weights": 2**21, "scratch": 2**19}, {"arena": 2**20, "weights": 0, "scratch": None}]
    plan = {"params_bytes": 2**21, "peak_activation_bytes": 2**20}
    lines = format_profile(ranks, repeat=1, plan=plan, memory=memory).splitlines()
    at = next(k for k, line in enumerate(lines) if line.startswith("memory per rank"))
    assert lines[at + 2].split() == ["0", "3.00", "2.00", "0.50", "5.50"]
    assert lines[at + 3].split() == ["1", "1.00", "0.00", "-", "1.00"]
    assert lines[at + 4] == "modeled by the plan: parameters 2.00 MiB + peak activations 1.00 MiB per rank"
    assert "memory per rank" not in format_profile(ranks, repeat=1)
    # (a pipeline stage keeping states with 2 microbatches: its plan counts an instance a microbatch)
    text = format_profile(ranks, repeat=1, plan={**plan, "instances": 2}, memory=memory)
    assert "modeled by the plan: parameters 2.00 MiB + 2 instances x peak activations 1.00 MiB per rank" in text


def test_the_cpu_kernels_scratch_is_counted(tmp_path):
    """A conv's kernels take scratch buffers (its padded image, packing) that the arena does not hold:
    ``scratch_bytes`` counts them after a run; they are kept, so a second run of the same program adds
    nothing."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((32, 16, 3, 3)).astype(np.float32), "w")
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 40, 40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 40, 40])], [w]),
        opset_imports=[helper.make_opsetid("", 17)])
    compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    prog = load(tmp_path / "o", 0)
    assert prog.scratch_bytes == 0
    x = np.random.default_rng(1).standard_normal((1, 16, 40, 40)).astype(np.float32)
    prog.run({"x": x})
    held = prog.scratch_bytes
    assert held > 0 and held % 4096 == 0  # (whole pages per buffer)
    prog.run({"x": x})
    assert prog.scratch_bytes == held
    assert memory_record(prog) == {"arena": prog.arena.nbytes, "weights": prog.weights.nbytes, "scratch": held}
