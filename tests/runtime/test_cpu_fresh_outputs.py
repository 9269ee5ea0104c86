"""Outputs a cpu program writes straight into fresh arrays (``program.json``'s ``fresh_outputs``,
``driver._fresh_outputs``; ``RankProgram.run`` with ``copy_outputs=True``): which outputs qualify,
that each run's arrays are the caller's own (no later run, profile or view run touches them), and
that every output still equals onnxruntime's."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from model_refs import MODELS
from onnx import TensorProto, helper, numpy_helper
from threads import run_threads

from shardflow.compiler import compile
from shardflow.runtime import executor, load
from shardflow.runtime.artifact import ArtifactError
from shardflow.runtime import InputShapeError
from shardflow.runtime.comm import InProcessWorld

ort = pytest.importorskip("onnxruntime")


def _model() -> onnx.ModelProto:
    """``y = x @ W`` (also read by the Relu), ``r`` a reshape of ``Relu(y)`` (a view), ``z`` the
    concatenation in place of two products (its parts written by their kernels), ``xo`` the input
    passed through, ``y2`` a second name of ``y``'s bytes, ``c`` a constant."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "W")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "W2")
    w3 = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "W3")
    c = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "C")
    shape = numpy_helper.from_array(np.array([8, 64], np.int64), "shape")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["y"]),
        helper.make_node("Relu", ["y"], ["ry"]),
        helper.make_node("Reshape", ["ry", "shape"], ["r"]),
        helper.make_node("MatMul", ["x", "W2"], ["b"]),
        helper.make_node("MatMul", ["x", "W3"], ["a"]),
        helper.make_node("Concat", ["a", "b"], ["z"], axis=0),
        helper.make_node("Identity", ["x"], ["xo"]),
        helper.make_node("Identity", ["y"], ["y2"]),
        helper.make_node("Identity", ["C"], ["c"]),
    ]
    shapes = {"y": [16, 32], "r": [8, 64], "z": [32, 32], "xo": [16, 16], "y2": [16, 32], "c": [2, 3]}
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()]
    g = helper.make_graph(nodes, "fresh", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 16])], outs,
                          [w, w2, w3, c, shape])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("fresh")
    model = _model()
    out = d / "o"
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=out)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return out, lambda feeds: dict(zip(names, sess.run(None, feeds)))


def _check(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_the_outputs_written_on_every_run_alone_are_fresh(built):
    out, _ = built
    program = json.loads((out / "rank0" / "program.json").read_text())
    fresh = {e["output"]: e for e in program["fresh_outputs"]}
    # not: the input passed through, the constant, y and y2 (one block under two names)
    assert sorted(fresh) == ["r", "z"]
    # z's block holds its two parts, each written by its own kernel, and z itself
    assert len(fresh["z"]["buffers"]) == 3 and fresh["z"]["bytes"] == 32 * 32 * 4
    assert load(out)._fresh == []  # (outputs under 16 KiB are copied out instead: cheaper)


def test_each_run_returns_arrays_of_its_own(built, monkeypatch):
    out, ref = built
    monkeypatch.setattr(executor, "_FRESH_LEAST", 0)  # (these outputs are small: written fresh all the same)
    prog = load(out)
    assert sorted(name for name, _, _ in prog._fresh) == ["r", "z"]
    x1, x2 = (np.random.default_rng(s).standard_normal((16, 16)).astype(np.float32) for s in (1, 2))
    first = prog.run({"x": x1})
    kept = {k: v.copy() for k, v in first.items()}
    _check(first, ref({"x": x1}))
    assert first["r"].flags.writeable and first["r"].flags.c_contiguous and first["r"].shape == (8, 64)
    second = prog.run({"x": x2})
    _check(second, ref({"x": x2}))
    for k in first:
        assert not np.shares_memory(first[k], second[k]), k
    # neither a view run, nor profile, nor a run that fails writes the first arrays
    views = prog.run({"x": x2}, copy_outputs=False)
    _check(views, ref({"x": x2}))
    prog.profile({"x": x2}, repeat=1)
    with pytest.raises(InputShapeError):
        prog.run({"x": x1[:, :3]})
    steps = prog._run_steps

    def failing():
        steps()
        raise RuntimeError("a kernel failed")

    prog._run_steps = failing
    with pytest.raises(RuntimeError, match="a kernel failed"):
        prog.run({"x": x1})
    prog._run_steps = steps
    # the failed run gave the arena back to the kernels: a view run writes the arena again
    _check(prog.run({"x": x1}, copy_outputs=False), ref({"x": x1}))
    for k in first:
        np.testing.assert_array_equal(first[k], kept[k], err_msg=k)
    first["z"][...] = 0  # the caller's to write
    _check(prog.run({"x": x1}), ref({"x": x1}))


def test_a_collectives_output_is_copied(tmp_path):
    """The test MLP on two ranks (Megatron): its output comes out of an all-reduce's staging, so it
    is not fresh, and both ranks still return onnxruntime's values, run after run."""
    model = MODELS / "mlp_ts17.onnx"
    out = tmp_path / "o2"
    compile(model, distributed_config={"mesh_shape": [2], "algo": "megatron"}, optimization_config={"target": "cpu"},
            out_dir=out)
    for r in range(2):
        program = json.loads((out / f"rank{r}" / "program.json").read_text())
        made = {b for s in program["steps"] if s["kind"] == "collective" for b in s["outputs"]}
        assert [b in made for _, b in program["outputs"]] == [True]
        assert "fresh_outputs" not in program
    feeds = dict(np.load(MODELS / "mlp_inputs.npz"))
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))

    def twice(c):
        prog = load(out, c.rank, c)
        return prog.run(feeds), prog.run(feeds)

    for first, second in run_threads(InProcessWorld(2).communicators(), twice):
        _check(first, want)
        _check(second, want)
        assert not np.shares_memory(first["output"], second["output"])


def test_a_malformed_entry_is_refused(built, tmp_path):
    out, _ = built
    copy = tmp_path / "bad"
    shutil.copytree(out, copy)
    path = copy / "rank0" / "program.json"
    program = json.loads(path.read_text())
    program["fresh_outputs"][0]["buffers"].append(0)  # the input's buffer: not inside the output's block
    path.write_text(json.dumps(program))
    with pytest.raises(ArtifactError, match="fresh output .* lists buffer 0"):
        load(copy, verify=False)
