"""Resizes of volumes on the cpu target as two resizes (compiler/passes/resizes.py), against onnxruntime."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import compile
from shardflow.runtime import load

#: name: (Resize attributes, scales [N, C, D, H, W], input shape, opset)
CASES = {
    "trilinear-x2": (dict(mode="linear"), (1, 1, 2, 2, 2), (1, 3, 4, 5, 6), 17),
    "align-corners": (dict(mode="linear", coordinate_transformation_mode="align_corners"), (1, 1, 2, 1.5, 3),
                      (2, 2, 4, 6, 3), 17),
    "pytorch-half-pixel-down": (dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
                                (1, 1, 0.5, 2, 0.5), (1, 2, 8, 3, 10), 17),
    "nearest-depth-only": (dict(mode="nearest", nearest_mode="round_prefer_ceil",
                                coordinate_transformation_mode="asymmetric"), (1, 1, 3, 1, 1), (1, 4, 3, 5, 7), 17),
    "cubic": (dict(mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1), (1, 1, 2, 2, 2), (1, 2, 5, 4, 6), 17),
    "antialias-down": (dict(mode="linear", antialias=1), (1, 1, 0.5, 0.5, 0.5), (1, 2, 10, 8, 12), 18),
}


@pytest.mark.parametrize("last", [False, True], ids=["then-relu", "graph-output"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_volume_resize_is_two_resizes(tmp_path, case, last):
    """A Resize of depth, height and width (then a Relu, or the graph's output, which keeps its name)
    compiles to a resize of height and width, then one of depth, and matches onnxruntime: nearest exactly,
    the interpolations within a few units in the last place (rounded to float32 between the steps); cubic
    against onnx's reference evaluator."""
    ort = pytest.importorskip("onnxruntime")
    attrs, scales, shape, opset = CASES[case]
    f = helper.make_tensor_value_info
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    nodes = [helper.make_node("Resize", ["x", "", "s"], ["y" if last else "q"], name="up", **attrs)]
    nodes += [] if last else [helper.make_node("Relu", ["q"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "resize3d", [f("x", TensorProto.FLOAT, list(shape))],
                                                [f("y", TensorProto.FLOAT, list("ncdhw"))],
                                                [numpy_helper.from_array(np.array(scales, np.float32), "s")]),
                              opset_imports=[helper.make_opsetid("", opset)])
    if attrs["mode"] == "cubic":  # (onnxruntime's cubic takes the last two dims only: onnx's reference evaluator)
        from onnx.reference import ReferenceEvaluator
        want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    else:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        want = sess.run(None, {"x": x})[0]
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path)
    got = load(tmp_path, rank=0).run({"x": x})["y"]
    if attrs["mode"] == "nearest":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    steps = {st["node"]: st for st in json.loads((tmp_path / "rank0" / "program.json").read_text())["steps"]
             if st["kind"] == "kernel"}
    assert {"up.hw", "up.d"} <= set(steps), sorted(steps)
