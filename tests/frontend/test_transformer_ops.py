"""Swish, RotaryEmbedding, TensorScatter, SwiGLU, CausalConvWithState and LinearAttention: imported
models against onnxruntime (or the ONNX reference evaluator where onnxruntime lacks the op), errors by
type and message, a RotaryEmbedding model sharded over two ranks, and models compiled for the cpu target."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from shardflow.compiler import ModelFormatError, ShapeError, UnsupportedOperatorError, compile, load_onnx
from shardflow.compiler.frontend import handlers_transformer
from shardflow.compiler.parallel import partition, search, simulate
from shardflow.runtime import load

ort = pytest.importorskip("onnxruntime")

_ONNX_TYPES = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.float16): onnx.TensorProto.FLOAT16,
               np.dtype(np.int64): onnx.TensorProto.INT64}


def make_model(op: str, opset: int, inputs: dict, outputs: int = 1, initializers: dict | None = None,
               **attrs) -> onnx.ModelProto:
    """A one-node model; ``inputs`` maps names to example arrays (``None`` leaves an optional input out).
    The outputs' types are those ONNX shape inference gives (scalars of the first input's type where it
    fails: models meant to be refused)."""
    initializers = initializers or {}
    outs = [f"y{i}" for i in range(outputs)]
    node = helper.make_node(op, [n if v is not None else "" for n, v in inputs.items()], outs, name="node0", **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, _ONNX_TYPES[v.dtype], v.shape) for n, v in inputs.items()
         if v is not None and n not in initializers], [],
        [numpy_helper.from_array(v, n) for n, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    inferred = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(model).graph.value_info}
    first = _ONNX_TYPES[next(iter(inputs.values())).dtype]
    model.graph.output.extend(inferred.get(n) or helper.make_tensor_value_info(n, first, []) for n in outs)
    return model


def feeds_of(model: onnx.ModelProto, inputs: dict) -> dict:
    return {vi.name: inputs[vi.name] for vi in model.graph.input}


def run_ort(model: onnx.ModelProto, feeds: dict) -> list:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_reference(model: onnx.ModelProto, feeds: dict) -> list:
    return ReferenceEvaluator(model).run(None, feeds)


def check(model: onnx.ModelProto, inputs: dict, reference=run_ort, tol: float = 1e-5) -> list:
    """Import ``model``, run it with numpy, compare every output with ``reference``; return ours."""
    feeds = feeds_of(model, inputs)
    want = reference(model, feeds)
    got = load_onnx(model).run(feeds)
    names = [o.name for o in model.graph.output]
    for name, w in zip(names, want):
        assert got[name].shape == w.shape and got[name].dtype == w.dtype, name
        np.testing.assert_allclose(got[name], w, rtol=tol, atol=tol, err_msg=name)
    return [got[n] for n in names]


def rand(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# Swish / SwiGLU -----------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_swish(alpha):
    x = rand(np.random.default_rng(0), 3, 7) * 4
    (y,) = check(make_model("Swish", 24, {"x": x}, alpha=alpha), {"x": x})
    np.testing.assert_allclose(y, x / (1 + np.exp(-alpha * x)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alpha,dtype", [(1.0, np.float32), (1.702, np.float32), (1.0, np.float16)])
def test_swiglu(alpha, dtype):
    # onnxruntime has no Swish-24 kernel for SwiGLU's function body: the ONNX reference evaluator
    rng = np.random.default_rng(1)
    a, b = rand(rng, 2, 3, 8, dtype=dtype), rand(rng, 2, 3, 8, dtype=dtype)
    check(make_model("SwiGLU", 28, {"a": a, "b": b}, alpha=alpha), {"a": a, "b": b}, run_reference,
          tol=1e-5 if dtype == np.float32 else 2e-3)


def test_swiglu_refuses_broadcasting():
    rng = np.random.default_rng(1)
    a, b = rand(rng, 2, 8), rand(rng, 1, 8)
    with pytest.raises(ShapeError, match=r"node0 \(SwiGLU\).*same shape"):
        load_onnx(make_model("SwiGLU", 28, {"a": a, "b": b}))


# RotaryEmbedding ----------------------------------------------------------------------------------

def rotary_inputs(rng, ndim: int, rot: int, with_pos: bool, batch=2, heads=3, seq=5, head=8, max_pos=11):
    x = rand(rng, batch, heads, seq, head) if ndim == 4 else rand(rng, batch, seq, heads * head)
    half = (rot or head) // 2
    angles = rng.uniform(0, 2 * np.pi, (max_pos, half) if with_pos else (batch, seq, half))
    inputs = {"x": x, "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
    if with_pos:
        inputs["pos"] = rng.integers(0, max_pos, (batch, seq)).astype(np.int64)
    return inputs


@pytest.mark.parametrize("ndim", [3, 4])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rot", [0, 4])
@pytest.mark.parametrize("with_pos", [True, False])
def test_rotary_embedding(ndim, interleaved, rot, with_pos):
    inputs = rotary_inputs(np.random.default_rng(2), ndim, rot, with_pos)
    attrs = {"interleaved": interleaved, "rotary_embedding_dim": rot}
    if ndim == 3:
        attrs["num_heads"] = 3
    (y,) = check(make_model("RotaryEmbedding", 23, inputs, **attrs), inputs)
    x = inputs["x"]
    if rot:  # the features past the rotary dim pass through unchanged
        tail = (slice(None),) * (ndim - 1)
        if ndim == 3:
            y, x = y.reshape(2, 5, 3, 8), x.reshape(2, 5, 3, 8)
            tail = (slice(None),) * 3
        np.testing.assert_array_equal(y[tail + (slice(rot, None),)], x[tail + (slice(rot, None),)])


def test_rotary_embedding_constant_position_ids_and_fp16():
    rng = np.random.default_rng(3)
    inputs = rotary_inputs(rng, 4, 0, True)
    inputs = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in inputs.items()}
    model = make_model("RotaryEmbedding", 23, inputs, initializers={"pos": inputs["pos"]}, interleaved=1)
    check(model, inputs, tol=2e-3)


@pytest.mark.parametrize("attrs,change,error,match", [
    ({"rotary_embedding_dim": 5}, {}, ModelFormatError, r"node0 \(RotaryEmbedding\).*dim=5 must be even"),
    ({"rotary_embedding_dim": 16}, {}, ModelFormatError, "at most the head size 8"),
    ({}, {"x": (2, 5, 24)}, ModelFormatError, "3-D input needs a positive num_heads"),
    ({"num_heads": 5}, {"x": (2, 5, 24)}, ShapeError, "not divisible by num_heads=5"),
    ({}, {"cos": (11, 3), "sin": (11, 3)}, ShapeError, r"expected \(2, 5, 4\)"),
    ({}, {"x": (10, 8)}, ShapeError, "must be 3-D or 4-D"),
])
def test_rotary_embedding_errors(attrs, change, error, match):
    inputs = rotary_inputs(np.random.default_rng(4), 4, 0, True)
    inputs.update({k: np.zeros(s, np.float32) for k, s in change.items()})
    with pytest.raises(error, match=match):
        load_onnx(make_model("RotaryEmbedding", 23, inputs, **attrs))


# TensorScatter ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["linear", "circular"])
@pytest.mark.parametrize("indices", [None, [3, 0], [6, 1]])
def test_tensor_scatter(mode, indices):
    if mode == "linear" and indices == [6, 1]:
        indices = [5, 1]  # 5 + 3 = the cache length: the last linear write position
    rng = np.random.default_rng(5)
    inputs = {"past": rand(rng, 2, 2, 8, 4), "update": rand(rng, 2, 2, 3, 4),
              "w": None if indices is None else np.array(indices, np.int64)}
    (y,) = check(make_model("TensorScatter", 24, inputs, mode=mode), {k: v for k, v in inputs.items() if v is not None})
    if indices == [6, 1]:  # batch 0 wraps around: positions 6, 7, 0
        np.testing.assert_array_equal(y[0][:, [6, 7, 0]], inputs["update"][0])
        np.testing.assert_array_equal(y[0][:, 1:6], inputs["past"][0][:, 1:6])


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_axis_1_and_full_update(mode):
    rng = np.random.default_rng(6)
    inputs = {"past": rand(rng, 3, 6, 5), "update": rand(rng, 3, 2, 5), "w": np.array([0, 4, 2], np.int64)}
    check(make_model("TensorScatter", 24, inputs, mode=mode, axis=1), inputs)
    inputs = {"past": rand(rng, 2, 4, 3), "update": rand(rng, 2, 4, 3), "w": np.array([1, 0], np.int64)}
    check(make_model("TensorScatter", 24, inputs, mode="circular", axis=-2), inputs)


def test_tensor_scatter_errors():
    rng = np.random.default_rng(7)
    past, upd = rand(rng, 2, 8, 4), rand(rng, 2, 3, 4)
    model = make_model("TensorScatter", 24, {"past": past, "update": upd, "w": np.array([6, 0], np.int64)},
                       initializers={"w": np.array([6, 0], np.int64)})
    with pytest.raises(ShapeError, match=r"node0 \(TensorScatter\).*leave the cache of length 8"):
        load_onnx(model)
    with pytest.raises(ModelFormatError, match="axis must not be 0"):
        load_onnx(make_model("TensorScatter", 24, {"past": past, "update": upd}, axis=0))
    with pytest.raises(ShapeError, match="does not fit past_cache"):
        load_onnx(make_model("TensorScatter", 24, {"past": past, "update": rand(rng, 2, 3, 5)}))


# CausalConvWithState ------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("with_bias,with_past,length", [(False, False, 6), (True, True, 6), (True, False, 1),
                                                         (False, True, 1)])
def test_causal_conv_with_state(activation, with_bias, with_past, length):
    rng = np.random.default_rng(8)
    inputs = {"x": rand(rng, 2, 3, length), "w": rand(rng, 3, 1, 4), "bias": rand(rng, 3) if with_bias else None,
              "past": rand(rng, 2, 3, 3) if with_past else None}
    y, state = check(make_model("CausalConvWithState", 27, inputs, 2, activation=activation),
                     {k: v for k, v in inputs.items() if v is not None})
    assert y.shape == (2, 3, length) and state.shape == (2, 3, 3)


# LinearAttention ----------------------------------------------------------------------------------

@pytest.mark.parametrize("rule,hq,hkv,decay_per_key,with_past,t", [
    ("linear", 2, 2, False, False, 4), ("gated", 2, 2, True, True, 3), ("gated", 2, 1, False, False, 3),
    ("delta", 2, 2, False, True, 3), ("gated_delta", 4, 2, False, True, 3), ("gated_delta", 2, 2, True, False, 1)])
def test_linear_attention(rule, hq, hkv, decay_per_key, with_past, t):
    rng = np.random.default_rng(9)
    b, dk, dv = 2, 3, 4
    key = rand(rng, b, t, hkv, dk)
    key /= np.linalg.norm(key, axis=-1, keepdims=True)
    inputs = {"q": rand(rng, b, t, hq * dk), "k": key.reshape(b, t, hkv * dk), "v": rand(rng, b, t, hkv * dv),
              "past": rand(rng, b, hkv, dk, dv) if with_past else None,
              "decay": -rng.uniform(0.01, 0.5, (b, t, hkv * dk if decay_per_key else hkv)).astype(np.float32)
              if rule.startswith("gated") else None,
              "beta": rng.uniform(0.1, 0.9, (b, t, hkv)).astype(np.float32) if "delta" in rule else None}
    model = make_model("LinearAttention", 27, inputs, 2, q_num_heads=hq, kv_num_heads=hkv, update_rule=rule)
    check(model, {k: v for k, v in inputs.items() if v is not None}, tol=1e-4)


def test_linear_attention_errors(monkeypatch):
    rng = np.random.default_rng(10)
    qkv = {"q": rand(rng, 1, 3, 4), "k": rand(rng, 1, 3, 4), "v": rand(rng, 1, 3, 4)}
    with pytest.raises(ModelFormatError, match=r"node0 \(LinearAttention\).*'gated' requires the decay input"):
        load_onnx(make_model("LinearAttention", 27, qkv, 2, q_num_heads=1, kv_num_heads=1, update_rule="gated"))
    with pytest.raises(ModelFormatError, match="positive multiple of kv_num_heads=2"):
        load_onnx(make_model("LinearAttention", 27, qkv, 2, q_num_heads=1, kv_num_heads=2, update_rule="linear"))
    monkeypatch.setattr(handlers_transformer, "MAX_UNROLLED_STEPS", 2)
    with pytest.raises(UnsupportedOperatorError, match="a sequence of 3 tokens .* at most 2 steps"):
        load_onnx(make_model("LinearAttention", 27, qkv, 2, q_num_heads=1, kv_num_heads=1, update_rule="linear"))


# a rotary block, sharded and compiled ------------------------------------------------------------

def rotary_block() -> tuple[onnx.ModelProto, dict]:
    """``RotaryEmbedding(x @ w)`` with 2 heads of 8 features, partial interleaved rotation."""
    rng = np.random.default_rng(11)
    angles = rng.uniform(0, 2 * np.pi, (16, 3))
    inits = {"w": rand(rng, 16, 16) / 4, "cos": np.cos(angles).astype(np.float32),
             "sin": np.sin(angles).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("RotaryEmbedding", ["h", "cos", "sin", "pos"], ["y"], num_heads=2, interleaved=1,
                              rotary_embedding_dim=6)]
    graph = helper.make_graph(
        nodes, "rope",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 6, 16]),
         helper.make_tensor_value_info("pos", onnx.TensorProto.INT64, [4, 6])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 6, 16])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    inputs = {"x": rand(rng, 4, 6, 16), "pos": rng.integers(0, 16, (4, 6)).astype(np.int64)}
    return model, inputs


def test_rotary_block_sharded_over_two_ranks():
    model, inputs = rotary_block()
    (want,) = run_ort(model, inputs)
    graph = load_onnx(model)
    # replicated, the block needs 6,400 B a rank: the budget makes the search split the rotation
    plan = search(graph, {"mesh_shape": [2], "memory_budget_bytes": 4000})
    assert str(plan.tensor_specs["y"]).startswith("S(")
    got = simulate(partition(graph, plan), inputs)
    np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-5)


def scatter_and_conv_models() -> dict:
    rng = np.random.default_rng(12)
    scatter = {"past": rand(rng, 2, 2, 8, 4), "update": rand(rng, 2, 2, 3, 4), "w": np.array([6, 1], np.int64)}
    conv = {"x": rand(rng, 2, 3, 6), "w": rand(rng, 3, 1, 4), "bias": rand(rng, 3), "past": rand(rng, 2, 3, 3)}
    return {"tensor_scatter": (make_model("TensorScatter", 24, scatter, mode="circular"), scatter),
            "causal_conv": (make_model("CausalConvWithState", 27, conv, 2, activation="silu"), conv)}


@pytest.mark.parametrize("name", ["rotary_block", "tensor_scatter", "causal_conv"])
def test_compiled_for_cpu(tmp_path, name):
    model, inputs = rotary_block() if name == "rotary_block" else scatter_and_conv_models()[name]
    want = run_ort(model, inputs)
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / name)
    got = load(res.out_dir).run(inputs)
    for out, w in zip(model.graph.output, want):
        np.testing.assert_allclose(got[out.name], w, rtol=1e-5, atol=1e-5, err_msg=out.name)


# FlexAttention (ai.onnx.preview) --------------------------------------------------------------------

def _flex_model(q_shape, kv_heads, dtype=TensorProto.FLOAT, **attrs):
    """FlexAttention with a causal score_mod (the ONNX reference's evaluator lets a modifier read no
    enclosing name, so the mask is a Constant inside it) and a prob_mod that squares the
    probabilities."""
    b, h, length, e = q_shape
    mask = np.triu(np.full((length, length), -1e9, np.float32), 1)
    score_mod = helper.make_graph([helper.make_node("Constant", [], ["mask"], value=numpy_helper.from_array(mask)),
                                   helper.make_node("Add", ["s", "mask"], ["s_out"])], "score_mod",
                                  [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)],
                                  [helper.make_tensor_value_info("s_out", TensorProto.FLOAT, None)])
    prob_mod = helper.make_graph([helper.make_node("Mul", ["p", "p"], ["p_out"])], "prob_mod",
                                 [helper.make_tensor_value_info("p", TensorProto.FLOAT, None)],
                                 [helper.make_tensor_value_info("p_out", TensorProto.FLOAT, None)])
    node = helper.make_node("FlexAttention", ["q", "k", "v"], ["y"], name="flex", domain="ai.onnx.preview",
                            score_mod=score_mod, prob_mod=prob_mod, **attrs)
    kv = [b, kv_heads, length, e]
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, dtype, s)
                                        for n, s in (("q", list(q_shape)), ("k", kv), ("v", kv))],
                          [helper.make_tensor_value_info("y", dtype, list(q_shape))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("ai.onnx.preview", 1)])


@pytest.mark.parametrize("kv_heads,dtype,attrs", [(4, np.float32, {}), (2, np.float32, {"scale": 0.3}),
                                                  (1, np.float16, {})])
def test_flex_attention_matches_the_reference(kv_heads, dtype, attrs):
    m = _flex_model((2, 4, 6, 8), kv_heads, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), **attrs)
    rng = np.random.default_rng(7)
    feeds = {"q": rng.standard_normal((2, 4, 6, 8)).astype(dtype),
             "k": rng.standard_normal((2, kv_heads, 6, 8)).astype(dtype),
             "v": rng.standard_normal((2, kv_heads, 6, 8)).astype(dtype)}
    want = ReferenceEvaluator(m).run(None, feeds)[0]
    graph = load_onnx(m)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(graph.run(feeds)["y"], want, rtol=tol, atol=tol)
    if dtype == np.float32:
        got = simulate(partition(graph, search(graph, {"mesh_shape": [2]})), feeds)
        np.testing.assert_allclose(got["y"], want, rtol=tol, atol=tol)
