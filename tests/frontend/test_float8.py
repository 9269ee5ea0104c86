"""float8 types (E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ): imported, computed by the evaluator (widened to float32,
each float8 output rounded once; ``Cast``'s ``saturate``), weights dequantized at import compiled like
float ones; float8 activations stored as bytes by both targets' kernels (codegen/float8.py). The
conformance cases (casts, QuantizeLinear/DequantizeLinear to and from float8) run in test_conformance.py,
and on the cuda target in tests/codegen/test_cuda_conformance.py."""
import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import compile, load_onnx
from shardflow.runtime import load

from float8_models import float8_model, same_values

ort = pytest.importorskip("onnxruntime")
F = TensorProto.FLOAT


def _model(nodes, inits, out_shape):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [3, 8])],
                          [helper.make_tensor_value_info("y", F, out_shape)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("kind", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_weights_are_dequantized_at_import_and_compile(tmp_path, kind):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 4)) * 10).astype(getattr(ml_dtypes, kind))
    m = _model([helper.make_node("DequantizeLinear", ["w", "s"], ["wf"]), helper.make_node("MatMul", ["x", "wf"], ["y"])],
               [numpy_helper.from_array(np.array(0.1, np.float32), "s"), numpy_helper.from_array(w, "w")], [3, 4])
    x = rng.standard_normal((3, 8)).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
    g = load_onnx(m)
    assert not any(op.op_type == "Cast" for op in g.nodes)  # (folded into a float32 weight)
    res = compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "out")
    np.testing.assert_allclose(load(res.out_dir).run({"x": x})["y"], want, rtol=1e-6, atol=1e-6)


def test_float8_activations_run_in_the_evaluator(tmp_path):
    """Quantize to E4M3FN and back (300 / 0.5 = 600 saturates to 448): the evaluator against
    onnxruntime (the compiled programs: test_float8_activations_compile_and_run)."""
    zp = helper.make_tensor("zp", TensorProto.FLOAT8E4M3FN, [], [0.0])
    m = _model([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"]),
                helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"])],
               [numpy_helper.from_array(np.array(0.5, np.float32), "s"), zp], [3, 8])
    x = (np.random.default_rng(1).standard_normal((3, 8)) * 100).astype(np.float32)
    x[0, :3] = [300.0, -1000.0, np.inf]
    want = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
    got = load_onnx(m).run({"x": x})["y"]
    np.testing.assert_array_equal(got, want)
    assert got[0, :3].tolist() == [224.0, -224.0, 224.0]


@pytest.mark.parametrize("kind,saturate", [("float8_e4m3fn", 1), ("float8_e4m3fnuz", 1), ("float8_e5m2", 1),
                                           ("float8_e5m2fnuz", 1), ("float8_e4m3fn", 0), ("float8_e5m2", 0)])
def test_float8_activations_compile_and_run(tmp_path, kind, saturate):
    """Float8 activations (a quantization, a cast with and without saturation, float8 outputs)
    compiled for the cpu target and run: the same values as the evaluator, which gives the onnx
    package's reference evaluator's, and onnxruntime's with saturation (without, its
    QuantizeLinear saturates E4M3FN's 480 to 448 where the reference's cast gives NaN). (The cuda
    target's kernels: test_cuda_host.py's float8 test.)"""
    from onnx.reference import ReferenceEvaluator

    m, feeds = float8_model(kind, saturate)
    want = load_onnx(m).run(feeds)
    res = compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "out")
    got = load(res.out_dir).run(feeds)
    for name in ("q", "c", "y"):
        assert got[name].dtype == want[name].dtype, name
        same_values(got[name], want[name], name)
    refs = [ReferenceEvaluator(m).run(None, feeds)]
    if saturate:
        try:
            refs.append(ort.InferenceSession(m.SerializeToString()).run(None, feeds))
        except Exception:  # noqa: BLE001 - this onnxruntime has no kernel of the type
            pass
    for ref in refs:
        for name, r in zip(("q", "c", "y"), ref):  # (onnxruntime hands float8 outputs out as their bytes)
            same_values(want[name], r.view(want[name].dtype) if r.dtype == np.uint8 else r, name)
