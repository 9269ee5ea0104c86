"""float8 types (E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ): imported, computed by the evaluator (widened to float32,
each float8 output rounded once; ``Cast``'s ``saturate``), weights dequantized at import compiled like
float ones; a float8 activation refused by the code generators with the node named. The conformance
cases (casts, QuantizeLinear/DequantizeLinear to and from float8) run in test_conformance.py."""
import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import DtypeError, compile, load_onnx
from shardflow.runtime import load

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


def test_float8_activations_run_in_the_evaluator_and_are_refused_by_the_code_generators(tmp_path):
    """Quantize to E4M3FN and back (300 / 0.5 = 600 saturates to 448): the evaluator against
    onnxruntime; compiling names the node whose output is float8."""
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
    with pytest.raises(DtypeError, match=r"node QuantizeLinear\(q\) .*float8_e4m3fn.*does not store"):
        compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                out_dir=tmp_path / "out")
