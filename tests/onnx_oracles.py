"""Reference results for small ONNX models: onnxruntime (CPU) and the ONNX reference evaluator,
and a check of ``load_onnx(model).run`` against onnxruntime (shared by the frontend tests)."""
import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

from shardflow.compiler import load_onnx


def run_ort(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    """The first output of ``model`` on ``feeds`` in onnxruntime (CPU)."""
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def run_reference(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    """The first output of ``model`` on ``feeds`` in onnx's ReferenceEvaluator."""
    return ReferenceEvaluator(model).run(None, feeds)[0]


def check_against_ort(model: onnx.ModelProto, feeds: dict, rtol=1e-5, atol=1e-6, equal_nan=False) -> dict:
    """Every output of ``load_onnx(model).run(feeds)`` equals onnxruntime's: dtype, shape, values
    (floats within ``rtol``/``atol``, others exactly). Returns Shardflow's outputs."""
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    want = dict(zip(names, sess.run(None, feeds)))
    got = load_onnx(model).run(feeds)
    for n in names:
        assert got[n].dtype == want[n].dtype, n
        assert got[n].shape == want[n].shape, n
        if want[n].dtype.kind == "f":
            np.testing.assert_allclose(got[n], want[n], rtol=rtol, atol=atol, equal_nan=equal_nan, err_msg=n)
        else:
            np.testing.assert_array_equal(got[n], want[n], err_msg=n)
    return got
