"""3-D max and average pools on the cpu target as two 2-D ones (compiler/passes/pools.py), against onnxruntime."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper

from shardflow.compiler import compile
from shardflow.runtime import load

#: (kernel, strides, pads, dilations, ceil_mode, input [N, C, D, H, W])
CASES = {"2x2x2": ((2, 2, 2), (2, 2, 2), (0,) * 6, (1, 1, 1), 0, (1, 3, 8, 10, 12)),
         "uneven": ((3, 2, 3), (2, 1, 2), (1, 0, 1, 1, 1, 0), (1, 2, 1), 0, (2, 2, 7, 9, 11)),
         "ceil": ((3, 3, 2), (2, 2, 3), (1, 1, 0, 0, 1, 0), (1, 1, 1), 1, (1, 4, 9, 8, 10))}


@pytest.mark.parametrize("case", list(CASES))
def test_a_3d_max_pool_is_two_2d_pools_with_the_same_values(tmp_path, case):
    """A 3-D MaxPool, the graph's output (its name kept) or then a Relu, compiles to the 2-D pools over height
    and width, then depth, whose values equal onnxruntime's bit for bit; with a NaN in the input both
    programs give the same values (NaN where a window holds it, as numpy's max: onnxruntime's MaxPool skips
    NaNs, rfcs/0006)."""
    ort = pytest.importorskip("onnxruntime")
    kern, strides, pads, dil, ceil, shape = CASES[case]
    attrs = dict(kernel_shape=list(kern), strides=list(strides), pads=list(pads), dilations=list(dil), ceil_mode=ceil)
    f = helper.make_tensor_value_info
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    nan = x.copy()
    nan[0, 0, 1, 2, 3] = np.nan
    got = {}
    for last in (True, False):
        nodes = [helper.make_node("MaxPool", ["x"], ["p" if last else "q"], name="pool", **attrs)]
        nodes += [] if last else [helper.make_node("Relu", ["q"], ["p"])]
        model = helper.make_model(helper.make_graph(nodes, "pool3d", [f("x", TensorProto.FLOAT, list(shape))],
                                                    [f("p", TensorProto.FLOAT, list("ncdhw"))]),
                                  opset_imports=[helper.make_opsetid("", 17)])
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
        out = tmp_path / f"o{last}"
        compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=out)
        program = load(out, rank=0)
        np.testing.assert_array_equal(program.run({"x": x})["p"], want[0])
        got[last] = program.run({"x": nan})["p"]
        steps = {st["node"] for st in json.loads((out / "rank0" / "program.json").read_text())["steps"]
                 if st["kind"] == "kernel"}
        assert {"pool.hw", "pool.d"} <= steps and "pool" not in steps, steps
    assert np.isnan(got[True]).any()
    np.testing.assert_array_equal(np.maximum(got[True], 0), got[False])


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_a_3d_average_pool_is_two_2d_pools(tmp_path, case, include_pad):
    """A 3-D AveragePool (then a Relu) compiles to the 2-D pools over height and width, then depth, and
    matches onnxruntime within a few units in the last place (the mean over depth of the planes' means: its
    sums rounded in another order), with and without the padding counted, at the windows cut by the input's
    end in ceil mode too."""
    ort = pytest.importorskip("onnxruntime")
    kern, strides, pads, _, ceil, shape = CASES[case]  # (no dilations: AveragePool takes them from opset 19)
    attrs = dict(kernel_shape=list(kern), strides=list(strides), pads=list(pads), ceil_mode=ceil,
                 count_include_pad=include_pad)
    f = helper.make_tensor_value_info
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    nodes = [helper.make_node("AveragePool", ["x"], ["q"], name="pool", **attrs),
             helper.make_node("Relu", ["q"], ["p"])]
    model = helper.make_model(helper.make_graph(nodes, "avgpool3d", [f("x", TensorProto.FLOAT, list(shape))],
                                                [f("p", TensorProto.FLOAT, list("ncdhw"))]),
                              opset_imports=[helper.make_opsetid("", 17)])
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path)
    np.testing.assert_allclose(load(tmp_path, rank=0).run({"x": x})["p"], want, rtol=1e-6, atol=1e-6)
    steps = {st["node"] for st in json.loads((tmp_path / "rank0" / "program.json").read_text())["steps"]
             if st["kind"] == "kernel"}
    assert {"pool.hw", "pool.d"} <= steps, steps
