"""Grouped convs and transposed convs split by whole groups across ranks (compiler/parallel/rules.py reads a
grouped op's input channel ``(oc // ocg) * icg + ic`` in its group number), against onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from threads import run_ranks

from shardflow.compiler import compile
from shardflow.compiler.ir import Tensor
from shardflow.compiler.ops.conv import Conv, ConvTranspose
from shardflow.compiler.parallel.rules import op_strategies


def test_grouped_ops_offer_a_split_by_whole_groups():
    """Four groups split on 2 ranks (2 groups each) and on 4, not on 8 (a shard would cut a group); a conv
    and a transposed conv alike (the transposed one's weight read at oc % ocg: every position on every rank)."""
    x = Tensor("x", (1, 16, 6, 6), "float32")
    conv = Conv([x, Tensor("w", (16, 4, 3, 3), "float32")], group=4, pads=(1, 1, 1, 1))
    convt = ConvTranspose([x, Tensor("wt", (16, 4, 4, 4), "float32")], group=4, strides=(2, 2), pads=(1, 1, 1, 1),
                          output_shape=(12, 12))
    for op in (conv, convt):
        for ranks, split in ((2, True), (4, True), (8, False)):
            specs = [str(s) for s in op_strategies(op, (ranks,))]
            assert ("(S(1), S(0)) -> (S(1))" in specs) == split, (op.op_type, ranks, specs)


def test_grouped_convs_on_two_ranks(tmp_path):
    """A conv, a grouped conv (4 groups of 4 channels) and a grouped transposed conv (4 groups, 4x4 stride 2),
    then a Relu, on two cpu ranks with fast links: the plan splits both grouped ops by their groups, and every
    rank's output equals onnxruntime's."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(8)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.3, n)
             for n, s in (("w0", (16, 3, 3, 3)), ("w1", (16, 4, 3, 3)), ("b1", (16,)), ("w2", (16, 4, 4, 4)))]
    f = helper.make_tensor_value_info
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["a", "w1", "b1"], ["b"], name="grouped", group=4, pads=[1, 1, 1, 1]),
             helper.make_node("ConvTranspose", ["b", "w2"], ["c"], name="up", group=4, strides=[2, 2],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "grouped", [f("x", TensorProto.FLOAT, [1, 3, 40, 32])],
                                                [f("y", TensorProto.FLOAT, [1, 16, 80, 64])], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, 3, 40, 32)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    compile(model, distributed_config={"mesh_shape": [2], "axis_bandwidth_GBps": [10000], "axis_latency_us": [0.01]},
            optimization_config={"target": "cpu"}, out_dir=tmp_path)
    plan = {line.split()[0]: line for line in (tmp_path / "plan.txt").read_text().splitlines()
            if line and not line.startswith("#")}
    assert "S(1), S(0), S(0) -> S(1)" in plan["grouped"] and "S(1), S(0) -> S(1)" in plan["up"], plan
    got = [o["y"] for o in run_ranks(tmp_path, {"x": x})]
    for y in got:
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
