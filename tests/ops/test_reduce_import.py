"""Reductions, softmax family, CumSum, TopK and normalizations imported from small ONNX models and
run with FlowGraph.run, compared with onnxruntime; plus the errors for what is refused."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import (ModelFormatError, ShapeError, UnsupportedOperatorError, load_onnx)
from shardflow.compiler.ir import Reduce as ReduceExpr
from shardflow.compiler.ir import const_tensor
from shardflow.compiler.ops.norm import GroupNorm
from shardflow.compiler.ops.reduce import Reduce

ort = pytest.importorskip("onnxruntime")
from onnx_oracles import check_against_ort  # noqa: E402

_NP2ONNX = {np.dtype(k): v for k, v in {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
                                        "float64": TensorProto.DOUBLE, "int32": TensorProto.INT32,
                                        "int64": TensorProto.INT64}.items()}


def make_model(nodes, feeds: dict, consts: dict, outputs, opset: int) -> onnx.ModelProto:
    """A model whose graph inputs are ``feeds`` and initializers ``consts``; output types inferred."""
    inputs = [helper.make_tensor_value_info(k, _NP2ONNX[v.dtype], v.shape) for k, v in feeds.items()]
    g = helper.make_graph(nodes, "g", inputs, [], [numpy_helper.from_array(v, k) for k, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10 if opset >= 21 else 8
    inferred = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(m).graph.value_info
                if vi.type.tensor_type.HasField("shape")}
    x = next(iter(feeds.values()))  # the type where inference cannot tell (functions, bad nodes)
    m.graph.output.extend(inferred.get(o) or helper.make_tensor_value_info(o, _NP2ONNX[x.dtype], x.shape)
                          for o in outputs)
    return m


def check(model: onnx.ModelProto, feeds: dict, rtol=1e-5, atol=1e-6):
    check_against_ort(model, feeds, rtol, atol)


def node_model(op, feeds, consts=None, opset=18, n_out=1, **attrs):
    """One ``op`` node reading the feeds then the constants (``None`` values leave a gap)."""
    consts = consts or {}
    names = list(feeds) + [k if v is not None else "" for k, v in consts.items()]
    outs = [f"y{k}" for k in range(n_out)]
    node = helper.make_node(op, names, outs, **attrs)
    return make_model([node], feeds, {k: v for k, v in consts.items() if v is not None}, outs, opset)


RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
X3 = RNG.standard_normal((2, 4, 6)).astype(np.float32)
TIES = np.array([[1, 3, 3, 0, 3], [2, 2, 2, 2, 2], [0, 5, 1, 5, -1]], np.float32)


def test_decomposed_rms_norm():
    w = RNG.standard_normal((6,)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]),
             helper.make_node("Add", ["ms", "eps"], ["mse"]),
             helper.make_node("Sqrt", ["mse"], ["rms"]),
             helper.make_node("Div", ["x", "rms"], ["n"]),
             helper.make_node("Mul", ["n", "w"], ["y"])]
    m = make_model(nodes, {"x": X3}, {"axes": np.array([-1], np.int64), "eps": np.array(1e-6, np.float32), "w": w},
                   ["y"], 18)
    check(m, {"x": X3})
    g = load_onnx(m)
    assert g.op_types()["Reduce"] == 1


def test_decomposed_layer_norm_opset13():
    # ReduceMean takes axes as an attribute before opset 18
    w, b = RNG.standard_normal((2, (6))).astype(np.float32)
    nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
             helper.make_node("Sub", ["x", "mean"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"]),
             helper.make_node("Mul", ["n", "w"], ["s"]),
             helper.make_node("Add", ["s", "b"], ["y"])]
    m = make_model(nodes, {"x": X3}, {"two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32),
                                      "w": w, "b": b}, ["y"], 13)
    check(m, {"x": X3})


@pytest.mark.parametrize("axis", [-1, 1, 0])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_layer_normalization_with_stats(axis, dtype):
    x = X.astype(dtype)
    w = RNG.standard_normal(x.shape[axis % 4:]).astype(dtype)
    b = RNG.standard_normal(x.shape[-1:]).astype(dtype)
    m = node_model("LayerNormalization", {"x": x}, {"w": w, "b": b}, opset=17, n_out=3, axis=axis, epsilon=1e-3)
    check(m, {"x": x}, rtol=2e-3 if dtype == "float16" else 1e-5, atol=2e-3 if dtype == "float16" else 1e-5)


def test_layer_normalization_without_bias():
    w = RNG.standard_normal((6,)).astype(np.float32)
    check(node_model("LayerNormalization", {"x": X3}, {"w": w}, opset=17), {"x": X3}, atol=1e-5)


def test_rms_normalization():
    w = RNG.standard_normal((4, 6)).astype(np.float32)
    check(node_model("RMSNormalization", {"x": X3}, {"w": w}, opset=23, axis=1, epsilon=1e-4), {"x": X3}, atol=1e-5)


REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("opset", [11, 13, 18])
def test_reductions_across_opsets(op, opset):
    x = np.abs(X3) + 0.5 if op == "ReduceLogSum" else X3
    feeds = {"x": x}
    if op == "ReduceSum" and opset >= 13 or opset >= 18:
        check(node_model(op, feeds, {"axes": np.array([0, -1], np.int64)}, opset=opset, keepdims=0), feeds)
        check(node_model(op, feeds, {"axes": np.array([1], np.int64)}, opset=opset), feeds)
        check(node_model(op, feeds, {"axes": np.zeros((0,), np.int64)}, opset=opset, noop_with_empty_axes=1), feeds)
        check(node_model(op, feeds, opset=opset, keepdims=0), feeds)  # no axes: all
    else:
        check(node_model(op, feeds, opset=opset, axes=[0, -1], keepdims=0), feeds)
        check(node_model(op, feeds, opset=opset, axes=[1]), feeds)
        check(node_model(op, feeds, opset=opset), feeds)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceMean"])
def test_integer_reductions(op):
    x = RNG.integers(-5, 6, (3, 4)).astype(np.int32)
    check(node_model(op, {"x": x}, {"axes": np.array([1], np.int64)}, keepdims=0), {"x": x})


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceL2", "ReduceProd", "ReduceLogSumExp"])
def test_reduction_over_an_empty_axis(op):
    x = np.zeros((2, 0, 3), np.float32)
    check(node_model(op, {"x": x}, {"axes": np.array([1], np.int64)}), {"x": x})


def test_plain_reduction_is_a_reduce_node():
    x = load_onnx(node_model("ReduceSum", {"x": X3}, {"axes": np.array([2], np.int64)})).nodes[0]
    assert isinstance(x, Reduce) and isinstance(x.task.outputs[0].value, ReduceExpr)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("last", [0, 1])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_arg_reductions(op, last, keepdims):
    x = TIES if op == "ArgMax" else -TIES
    check(node_model(op, {"x": x}, opset=13, axis=-1, keepdims=keepdims, select_last_index=last), {"x": x})
    check(node_model(op, {"x": x}, opset=13, axis=0, keepdims=keepdims, select_last_index=last), {"x": x})


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("opset,axis", [(11, 1), (11, 0), (11, -1), (13, 1), (13, -1)])
def test_softmax_family(op, opset, axis):
    x = np.concatenate([X, X[:, :1]], axis=1) if op == "Hardmax" else X * 5  # ties for hardmax
    check(node_model(op, {"x": x}, opset=opset, axis=axis), {"x": x})


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumsum(exclusive, reverse):
    for x in (X3, RNG.integers(-9, 9, (3, 5)).astype(np.int32)):
        check(node_model("CumSum", {"x": x}, {"axis": np.array(-1, np.int64)}, opset=14, exclusive=exclusive,
                         reverse=reverse), {"x": x})


@pytest.mark.parametrize("largest", [0, 1])
@pytest.mark.parametrize("axis", [1, 0])
def test_topk(largest, axis):
    check(node_model("TopK", {"x": TIES}, {"k": np.array([3], np.int64)}, opset=11, n_out=2, axis=axis,
                     largest=largest), {"x": TIES})


def test_topk_opset1_k_attribute():
    check(node_model("TopK", {"x": TIES}, opset=1, n_out=2, k=2), {"x": TIES})


@pytest.mark.parametrize("opset", [9, 15])
def test_batch_normalization(opset):
    s, b, mu = RNG.standard_normal((3, 3)).astype(np.float32)
    var = (np.abs(RNG.standard_normal(3)) + 0.1).astype(np.float32)
    check(node_model("BatchNormalization", {"x": X}, {"s": s, "b": b, "m": mu, "v": var}, opset=opset,
                     epsilon=1e-3), {"x": X}, atol=1e-5)


def test_instance_normalization():
    s, b = RNG.standard_normal((2, 3)).astype(np.float32)
    check(node_model("InstanceNormalization", {"x": X}, {"s": s, "b": b}, opset=6, epsilon=1e-3), {"x": X}, atol=1e-5)


def test_group_normalization():
    s, b = RNG.standard_normal((2, 4)).astype(np.float32)  # per channel from opset 21
    check(node_model("GroupNormalization", {"x": X3}, {"s": s, "b": b}, opset=21, num_groups=2), {"x": X3},
          atol=1e-5)


def test_group_normalization_opset18_scales_per_group():
    # onnx.checker rejects the deprecated opset-18 op, so build the op directly and compare with
    # the ONNX reference evaluator running the opset-18 function body
    from onnx.reference import ReferenceEvaluator

    s, b = RNG.standard_normal((2, 2)).astype(np.float32)
    m = node_model("GroupNormalization", {"x": X3}, {"s": s, "b": b}, opset=18, num_groups=2, epsilon=1e-3)
    want = ReferenceEvaluator(m).run(None, {"x": X3})[0]
    op = GroupNorm([const_tensor(a) for a in (X3, s, b)], groups=2, epsilon=1e-3, stash="float32", per_channel=False)
    np.testing.assert_allclose(op.run(X3, s, b)[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization(p):
    x = X3.copy()
    x[0, 1] = 0
    check(node_model("LpNormalization", {"x": x}, opset=1, axis=2, p=p), {"x": x})


def test_mean_variance_normalization():
    check(node_model("MeanVarianceNormalization", {"x": X}, opset=13), {"x": X}, atol=1e-5)
    check(node_model("MeanVarianceNormalization", {"x": X}, opset=13, axes=[1, 3]), {"x": X}, atol=1e-5)


@pytest.mark.parametrize("size", [1, 3, 5])  # onnxruntime takes odd sizes only
def test_lrn(size):
    check(node_model("LRN", {"x": X}, opset=13, size=size, alpha=0.1, beta=0.6, bias=1.5), {"x": X})


# refusals -----------------------------------------------------------------------------------------

def test_axes_from_a_graph_input_is_refused():
    m = make_model([helper.make_node("ReduceSum", ["x", "axes"], ["y"])], {"x": X3, "axes": np.array([1])}, {},
                   ["y"], 13)
    with pytest.raises(UnsupportedOperatorError, match="'axes'.*must be known at compile time"):
        load_onnx(m)


def test_batchnorm_training_mode():
    """Opset 14+: batch statistics normalize, the running statistics come back updated (against
    the ONNX reference, onnxruntime's CPU build has no training mode); before opset 14 the
    training outputs differ and are refused."""
    from onnx.reference import ReferenceEvaluator

    s, b, mu = RNG.standard_normal((3, 3)).astype(np.float32)
    var = (np.abs(RNG.standard_normal(3)) + 0.1).astype(np.float32)
    m = node_model("BatchNormalization", {"x": X}, {"s": s, "b": b, "m": mu, "v": var}, opset=15, n_out=3,
                   training_mode=1, momentum=0.8, epsilon=1e-3)
    got = load_onnx(m).run({"x": X})
    for k, want in enumerate(ReferenceEvaluator(m).run(None, {"x": X})):
        np.testing.assert_allclose(got[f"y{k}"], want, rtol=1e-5, atol=1e-5)
    m = node_model("BatchNormalization", {"x": X}, {"s": s, "b": b, "m": mu, "v": var}, opset=9, n_out=5)
    with pytest.raises(UnsupportedOperatorError, match="training mode before opset 14"):
        load_onnx(m)


def test_dropout_in_training_mode_with_ratio_zero_is_the_identity():
    keep = node_model("Dropout", {"x": X}, {"r": np.float32(0), "t": np.array(True)}, opset=13, n_out=2)
    got = load_onnx(keep).run({"x": X})
    np.testing.assert_array_equal(got["y0"], X)
    assert got["y1"].dtype == bool and got["y1"].all()
    # (a ratio above 0 draws masks: tests/ops/test_random.py; a ratio of 1 keeps nothing, to scale by 1/0)
    drop = node_model("Dropout", {"x": X}, {"r": np.float32(1), "t": np.array(True)}, opset=13)
    with pytest.raises(ModelFormatError, match=r"ratio 1.0 is outside \[0, 1\)"):
        load_onnx(drop)


def test_topk_k_too_large():
    with pytest.raises(ShapeError, match="K=9 exceeds"):
        load_onnx(node_model("TopK", {"x": TIES}, {"k": np.array([9], np.int64)}, opset=11, n_out=2))


def test_reduce_axis_out_of_range():
    with pytest.raises(ModelFormatError, match="axes entry 3 is out of range"):
        load_onnx(node_model("ReduceSum", {"x": X3}, {"axes": np.array([3], np.int64)}, opset=13))


def test_argmax_over_empty_axis():
    with pytest.raises(ShapeError, match="extent 0"):
        load_onnx(node_model("ArgMax", {"x": np.zeros((2, 0), np.float32)}, opset=13, axis=1))


def test_group_norm_channels_not_divisible():
    s = np.ones(3, np.float32)
    with pytest.raises(ShapeError, match="cannot be split into 3 groups"):
        load_onnx(node_model("GroupNormalization", {"x": X3}, {"s": s, "b": s}, opset=21, num_groups=3))


@pytest.mark.parametrize("exclusive", [0, 1])
def test_a_half_cumsum_is_rounded_once(exclusive):
    """A float16 running sum adds in float32 and rounds each result once, as the kernels and the
    reductions do (numpy's own float16 cumsum rounds every partial sum: off by several steps here)."""
    x = np.random.default_rng(0).standard_normal((4, 300)).astype(np.float16)
    g = load_onnx(node_model("CumSum", {"x": x}, {"axis": np.array(-1, np.int64)}, opset=14, exclusive=exclusive))
    got = g.run({"x": x})[g.outputs[0].name]
    wide = np.cumsum(x.astype(np.float64), axis=-1)
    if exclusive:
        wide = np.concatenate([np.zeros((4, 1)), wide[:, :-1]], axis=-1)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, wide.astype(np.float32).astype(np.float16))


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1"])
def test_a_half_reduction_along_a_leading_axis_is_rounded_once(op):
    """A float16 reduction along a leading axis adds in float32 and rounds once, as the kernels do
    (numpy's float16 sum along axis 0 adds row by row in float16: several steps off for 300 rows)."""
    x = np.random.default_rng(1).standard_normal((300, 6)).astype(np.float16)
    if op == "ReduceSum":
        g = load_onnx(node_model(op, {"x": x}, {"axes": np.array([0], np.int64)}, opset=13))
    else:
        g = load_onnx(node_model(op, {"x": x}, opset=13, axes=[0]))
    got = g.run({"x": x})[g.outputs[0].name]
    w = x.astype(np.float64)
    want = {"ReduceSum": w.sum(0), "ReduceMean": w.mean(0), "ReduceSumSquare": (w * w).sum(0),
            "ReduceL1": np.abs(w).sum(0)}[op]
    np.testing.assert_array_equal(got.reshape(-1), want.astype(np.float32).astype(np.float16))
