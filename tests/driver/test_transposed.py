"""Depthwise transposed convs on the cpu target as a depthwise conv per output phase (compiler/passes/transposed.py),
against onnxruntime."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import compile
from shardflow.runtime import load

#: name: (ConvTranspose attributes, input [N, C, H, W], kernel, bias, rewritten)
CASES = {
    "bilinear-k4s2p1": (dict(strides=[2, 2], pads=[1, 1, 1, 1]), (1, 5, 6, 7), (4, 4), True, True),
    "k2s2-tiles": (dict(strides=[2, 2]), (2, 3, 4, 5), (2, 2), False, False),
    "k4s2-two-images": (dict(strides=[2, 2], pads=[1, 1, 1, 1]), (2, 3, 4, 5), (4, 4), False, True),
    "k3s2p1-output-padding": (dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]), (1, 4, 5, 6), (3, 3),
                              True, True),
    "k5s2p2-uneven": (dict(strides=[2, 3], pads=[2, 1, 1, 2], output_padding=[0, 2]), (1, 3, 5, 4), (5, 4), True,
                      True),
    "k6s3p2": (dict(strides=[3, 3], pads=[2, 2, 1, 1]), (1, 2, 4, 4), (6, 6), True, True),
    "dilated": (dict(strides=[2, 2], dilations=[2, 2], pads=[1, 1, 1, 1]), (1, 3, 5, 5), (3, 3), True, False),
}


@pytest.mark.parametrize("last", [False, True], ids=["then-relu", "graph-output"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_depthwise_transposed_conv_is_a_conv_per_output_phase(tmp_path, case, last):
    """A depthwise ConvTranspose (one channel a group; then a Relu, or the graph's output) compiles to a
    depthwise conv per output phase (strides 2 and 3, kernels of 3 to 6 taps, odd kernels whose phases
    have different taps, uneven pads, output padding, a bias or none, two images) and matches onnxruntime
    within an ulp or two (the taps summed in another order); a dilated one, and a 2x2 stride-2 one whose
    windows tile the output, keep their op."""
    ort = pytest.importorskip("onnxruntime")
    attrs, shape, kern, has_bias, rewritten = CASES[case]
    rng = np.random.default_rng(6)
    c = shape[1]
    inits = [numpy_helper.from_array(rng.standard_normal((c, 1, *kern)).astype(np.float32), "w")]
    inputs = ["x", "w"]
    if has_bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b"))
        inputs.append("b")
    f = helper.make_tensor_value_info
    nodes = [helper.make_node("ConvTranspose", inputs, ["y" if last else "q"], name="up", group=c, **attrs)]
    nodes += [] if last else [helper.make_node("Relu", ["q"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "dwt", [f("x", TensorProto.FLOAT, list(shape))],
                                                [f("y", TensorProto.FLOAT, list("nchw"))], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal(shape).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path)
    got = load(tmp_path, rank=0).run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    steps = {st["node"] for st in json.loads((tmp_path / "rank0" / "program.json").read_text())["steps"]
             if st["kind"] == "kernel"}
    assert ("up.p00" in steps and "up" not in steps) == rewritten, sorted(steps)


def test_a_depthwise_transposed_conv_on_two_ranks(tmp_path):
    """A conv, then a depthwise ConvTranspose (a CenterNet-style 4x4 stride-2 upsampling) and a Relu, on two
    cpu ranks: the plan splits the transposed conv's channels (its compute reads channel ``oci`` directly, as
    a depthwise Conv's does; the local op's group is its share), each rank's share is a conv per output
    phase, and every rank's output equals onnxruntime's."""
    ort = pytest.importorskip("onnxruntime")
    from threads import run_ranks


    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 3, 3, 3)).astype(np.float32), "wc"),
             numpy_helper.from_array(rng.standard_normal((16, 1, 4, 4)).astype(np.float32), "wt"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "bt")]
    f = helper.make_tensor_value_info
    nodes = [helper.make_node("Conv", ["x", "wc"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("ConvTranspose", ["c", "wt", "bt"], ["u"], name="up", group=16, strides=[2, 2],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["u"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "up2", [f("x", TensorProto.FLOAT, [1, 3, 48, 40])],
                                                [f("y", TensorProto.FLOAT, [1, 16, 96, 80])], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, 3, 48, 40)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    # (links fast enough that the plan splits the work: each rank's transposed conv a share of the channels)
    compile(model, distributed_config={"mesh_shape": [2], "axis_bandwidth_GBps": [10000], "axis_latency_us": [0.01]},
            optimization_config={"target": "cpu"}, out_dir=tmp_path)
    got = [o["y"] for o in run_ranks(tmp_path, {"x": x})]
    for y in got:
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    up, = [line for line in (tmp_path / "plan.txt").read_text().splitlines() if line.startswith("up ")]
    assert "S(1), S(0), S(0) -> S(1)" in up, up  # (its channels split, each rank's share rewritten)
    for rank in (0, 1):
        steps = {st["node"] for st in json.loads((tmp_path / f"rank{rank}" / "program.json").read_text())["steps"]}
        assert {"up.p00", "up.p11"} <= steps, sorted(steps)
