"""Small ONNX models built with onnx.helper for planner tests."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def mlp(layers: int = 4, batch: int = 8, hidden: int = 64, expand: int = 4, seed: int = 0,
        gemm: bool = False) -> onnx.ModelProto:
    """``layers`` Linear layers alternating hidden -> expand*hidden -> hidden, ReLU between
    layers (MatMul + Add bias, or Gemm with bias when ``gemm``)."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    cur = "x"
    for i in range(layers):
        din, dout = (hidden, hidden * expand) if i % 2 == 0 else (hidden * expand, hidden)
        w = (rng.standard_normal((din, dout)) / np.sqrt(din)).astype(np.float32)
        b = (rng.standard_normal((dout,)) * 0.1).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        if gemm:
            nodes.append(helper.make_node("Gemm", [cur, f"w{i}", f"b{i}"], [f"h{i}"], name=f"fc{i}"))
        else:
            nodes.append(helper.make_node("MatMul", [cur, f"w{i}"], [f"m{i}"], name=f"matmul{i}"))
            nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [f"h{i}"], name=f"bias{i}"))
        cur = f"h{i}"
        if i < layers - 1:
            nodes.append(helper.make_node("Relu", [cur], [f"r{i}"], name=f"relu{i}"))
            cur = f"r{i}"
    nodes.append(helper.make_node("Identity", [cur], ["y"], name="out"))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def parallel_block(batch: int = 8, hidden: int = 64, expand: int = 4, seed: int = 0) -> onnx.ModelProto:
    """``y = x + mlp_a(x) + mlp_b(x)``: two MLP branches (MatMul, Relu, MatMul + Add bias) read the
    same ``x`` and are summed with it, as in the parallel attention + MLP blocks of GPT-J,
    GPT-NeoX and PaLM. Split Megatron-style, each branch ends in a partial sum; the sum of both
    needs one all-reduce, not two."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    for br in "ab":
        w1 = (rng.standard_normal((hidden, hidden * expand)) / np.sqrt(hidden)).astype(np.float32)
        w2 = (rng.standard_normal((hidden * expand, hidden)) / np.sqrt(hidden * expand)).astype(np.float32)
        b2 = (rng.standard_normal((hidden,)) * 0.1).astype(np.float32)
        inits += [numpy_helper.from_array(w1, f"{br}_w1"), numpy_helper.from_array(w2, f"{br}_w2"),
                  numpy_helper.from_array(b2, f"{br}_b2")]
        nodes += [helper.make_node("MatMul", ["x", f"{br}_w1"], [f"{br}_h"], name=f"{br}_up"),
                  helper.make_node("Relu", [f"{br}_h"], [f"{br}_r"], name=f"{br}_relu"),
                  helper.make_node("MatMul", [f"{br}_r", f"{br}_w2"], [f"{br}_m"], name=f"{br}_down"),
                  helper.make_node("Add", [f"{br}_m", f"{br}_b2"], [f"{br}_out"], name=f"{br}_bias")]
    nodes += [helper.make_node("Add", ["x", "a_out"], ["xa"], name="residual_a"),
              helper.make_node("Add", ["xa", "b_out"], ["y"], name="residual_b")]
    graph = helper.make_graph(nodes, "parallel_block",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
