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


def torch_multihead_attention(scaled_after_projection: bool = False, keys_transposed_twice: bool = False
                              ) -> onnx.ModelProto:
    """A block on ``torch.nn.MultiheadAttention`` (4 heads of 4, time-major ``x [6, 2, 16]``) as
    torch's ``multi_head_attention_forward`` exports it: one packed in-projection whose output is
    viewed as ``[L, B, 3, E]``, unsqueezed, transposed, squeezed to ``[3, L, B, E]`` and selected
    into Q, K and V; each viewed as ``[L, B * H, d]`` (heads merged with the batch) and transposed
    to ``[B * H, L, d]`` (the queries then scaled); the key padding mask ``[B, L]`` expanded to
    ``[B, H, 1, L]``, merged to ``[B * H, 1, L]`` and added to the causal mask; the heads merged
    back by a transpose to ``[L, B * H, d]`` and a view ``[L * B, E]`` for the out-projection.
    With ``scaled_after_projection`` the queries are scaled before their view instead (OPT's and
    Whisper's ``q_proj(x) * scaling``); with ``keys_transposed_twice`` the keys are transposed to
    ``[B * H, L, d]`` and then to ``[B * H, d, L]`` (``nn.TransformerEncoderLayer``'s export, through
    ``scaled_dot_product_attention``). The ONNX model."""
    rng = np.random.default_rng(3)
    L, B, E, H = 6, 2, 16, 4
    d = E // H
    consts = {"w_in": rng.standard_normal((E, 3 * E)) / 4, "b_in": rng.standard_normal(3 * E) / 4,
              "w_out": rng.standard_normal((E, E)) / 4, "b_out": rng.standard_normal(E) / 4,
              "causal": np.triu(np.full((L, L), -np.inf), 1)[None], "scale": np.array(d ** -0.5)}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in consts.items()]
    shapes = {"packed": [L, B, 3, E], "zero": [0], "three": [3], "heads_time": [L, B * H, d], "mask4": [B, 1, 1, L],
              "mask_rep": [1, H, 1, 1], "mask3": [B * H, 1, L], "flat": [L * B, E], "out": [L, B, E]}
    inits += [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in shapes.items()]
    inits += [numpy_helper.from_array(np.array(i, np.int64), f"i{i}") for i in range(3)]

    def node(op, ins, out, **kw):
        return helper.make_node(op, ins, [out], **kw)

    nodes = [node("MatMul", ["x", "w_in"], "p0"), node("Add", ["p0", "b_in"], "p1"),
             node("Reshape", ["p1", "packed"], "p2"), node("Unsqueeze", ["p2", "zero"], "p3"),
             node("Transpose", ["p3"], "p4", perm=[3, 1, 2, 0, 4]), node("Squeeze", ["p4", "three"], "p5")]
    for i, t in enumerate("qkv"):
        nodes.append(node("Gather", ["p5", f"i{i}"], f"{t}0", axis=0))
    if scaled_after_projection:
        nodes += [node("Mul", ["q0", "scale"], "q0s"), node("Reshape", ["q0s", "heads_time"], "q1"),
                  node("Transpose", ["q1"], "q", perm=[1, 0, 2])]
    else:
        nodes += [node("Reshape", ["q0", "heads_time"], "q1"), node("Transpose", ["q1"], "q2", perm=[1, 0, 2]),
                  node("Mul", ["q2", "scale"], "q")]
    if keys_transposed_twice:
        nodes += [node("Reshape", ["k0", "heads_time"], "k1"), node("Transpose", ["k1"], "k2", perm=[1, 0, 2]),
                  node("Transpose", ["k2"], "kt", perm=[0, 2, 1])]
    else:
        nodes += [node("Reshape", ["k0", "heads_time"], "k1"), node("Transpose", ["k1"], "kt", perm=[1, 2, 0])]
    nodes += [node("Reshape", ["v0", "heads_time"], "v1"), node("Transpose", ["v1"], "v", perm=[1, 0, 2]),
              node("Reshape", ["mask", "mask4"], "m1"), node("Expand", ["m1", "mask_rep"], "m2"),
              node("Reshape", ["m2", "mask3"], "m3"), node("Add", ["causal", "m3"], "m"),
              node("MatMul", ["q", "kt"], "s0"), node("Add", ["s0", "m"], "s"), node("Softmax", ["s"], "a", axis=-1),
              node("MatMul", ["a", "v"], "o0"), node("Transpose", ["o0"], "o1", perm=[1, 0, 2]),
              node("Reshape", ["o1", "flat"], "o2"), node("Gemm", ["o2", "w_out", "b_out"], "o3"),
              node("Reshape", ["o3", "out"], "y")]
    g = helper.make_graph(nodes, "torch_mha", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [L, B, E]),
                                               helper.make_tensor_value_info("mask", TensorProto.FLOAT, [B, L])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [L, B, E])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
