"""CumProd, the window functions, the losses (NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss),
AffineGrid, Col2Im, MaxUnpool, Det, TfIdfVectorizer, the training optimizers, Pow of integers and the optional-tensor
ops imported from small ONNX models and run with FlowGraph.run against onnxruntime (or the ONNX
reference); the errors for what is refused; and composed ops compiled for the cpu target."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import (ModelFormatError, ShapeError, ShardflowError, UnsupportedOperatorError, compile,
                                load_onnx)
from shardflow.runtime import load

ort = pytest.importorskip("onnxruntime")
from onnx_oracles import check_against_ort  # noqa: E402

_ONNX = {np.dtype(k): v for k, v in {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
                                     "float64": TensorProto.DOUBLE, "int32": TensorProto.INT32,
                                     "int64": TensorProto.INT64}.items()}
RNG = np.random.default_rng(0)


def node_model(op, feeds, consts=None, opset=17, outputs=("y",), **attrs):
    """One ``op`` node reading the feeds then the constants (``None`` leaves an input out); the
    outputs' types come from shape inference."""
    consts = consts or {}
    names = list(feeds) + [k if v is not None else "" for k, v in consts.items()]
    node = helper.make_node(op, names, list(outputs), name="node", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(k, _ONNX[v.dtype], v.shape)
                                        for k, v in feeds.items()], [],
                          [numpy_helper.from_array(v, k) for k, v in consts.items() if v is not None])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10 if opset >= 21 else 8
    inferred = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(m, strict_mode=True).graph.value_info}
    m.graph.output.extend(inferred[o] if o in inferred and inferred[o].type.tensor_type.HasField("shape")
                          else helper.make_tensor_value_info(o, TensorProto.FLOAT, ["n"]) for o in outputs)
    return m


def check(model, feeds, rtol=1e-5, atol=1e-6):
    """Shardflow's results equal onnxruntime's (dtype, shape, values)."""
    return check_against_ort(model, feeds, rtol, atol, equal_nan=True)


# CumProd ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("dtype,axis", [("float32", -1), ("float64", 0), ("int32", 1), ("int64", 2)])
def test_cumprod(exclusive, reverse, dtype, axis):
    if dtype.startswith("float"):
        x = (RNG.uniform(0.5, 1.5, (3, 4, 5)) * RNG.choice([-1, 1], (3, 4, 5))).astype(dtype)
    else:
        x = RNG.integers(-3, 4, (3, 4, 5)).astype(dtype)
    check(node_model("CumProd", {"x": x}, {"axis": np.array(axis, np.int32)}, opset=26, exclusive=exclusive,
                     reverse=reverse), {"x": x})


def test_cumprod_needs_a_constant_axis_in_range():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(UnsupportedOperatorError, match="node .*CumProd.*input 1 .*known at compile time"):
        load_onnx(node_model("CumProd", {"x": x, "axis": np.array(0, np.int64)}, opset=26))
    with pytest.raises(ModelFormatError, match="axis 2 is out of range"):
        load_onnx(node_model("CumProd", {"x": x}, {"axis": np.array(2, np.int64)}, opset=26))


# Windows ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
@pytest.mark.parametrize("out", [TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT32])
@pytest.mark.parametrize("size", [1, 5, 8, 11])
def test_window(op, periodic, out, size):
    model = node_model(op, {}, {"size": np.array(size, np.int64)}, periodic=periodic, output_datatype=out)
    if size == 1 and not periodic and out == TensorProto.INT32:
        with pytest.raises(ModelFormatError, match="node node .*size 1 is NaN"):
            load_onnx(model)
        return
    got = check(model, {}, atol=1e-6)
    if size == 1 and not periodic:
        assert np.isnan(got["y"]).all()  # 0/0 by the schema's definition, as onnxruntime
    assert load_onnx(model).nodes == []  # a constant


def test_window_values_against_numpy():
    n = np.arange(16)
    np.testing.assert_allclose(load_onnx(node_model("HannWindow", {}, {"size": np.array(16, np.int32)},
                                                    periodic=0)).run({})["y"],
                               np.hanning(16), atol=1e-6)
    np.testing.assert_allclose(load_onnx(node_model("BlackmanWindow", {}, {"size": np.array(16, np.int64)},
                                                    periodic=1, output_datatype=TensorProto.DOUBLE)).run({})["y"],
                               0.42 - 0.5 * np.cos(2 * np.pi * n / 16) + 0.08 * np.cos(4 * np.pi * n / 16),
                               atol=1e-12)


def test_window_size_must_be_known():
    with pytest.raises(UnsupportedOperatorError, match="node node .*input 0 .*known at compile time"):
        load_onnx(node_model("HannWindow", {"size": np.array(4, np.int64)}))
    model = node_model("HammingWindow", {}, {"size": np.array(1, np.int64)})
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(0, np.int64), "size"))
    with pytest.raises(ModelFormatError, match="size must be positive"):
        load_onnx(model)


# Losses -------------------------------------------------------------------------------------------
SHAPES = {"NC": (4, 5), "NCd1d2": (2, 5, 3, 2)}


def _loss_feeds(shape, weight, ignore, dtype="float32", tdtype="int64"):
    x = RNG.standard_normal(shape).astype(dtype)
    t = RNG.integers(0, shape[1], (shape[0],) + shape[2:]).astype(tdtype)
    if ignore is not None:
        t.flat[::3] = ignore
    feeds = {"x": x, "t": t}
    if weight:
        feeds["w"] = RNG.uniform(0.1, 1.0, shape[1]).astype(dtype)
    return feeds


@pytest.mark.parametrize("op,opset", [("NegativeLogLikelihoodLoss", 13), ("NegativeLogLikelihoodLoss", 22),
                                      ("SoftmaxCrossEntropyLoss", 12), ("SoftmaxCrossEntropyLoss", 13)])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weight,ignore", [(False, None), (True, None), (False, 1), (True, -1)])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_loss(op, opset, reduction, weight, ignore, shape):
    feeds = _loss_feeds(SHAPES[shape], weight, ignore)
    kw = {} if ignore is None else {"ignore_index": ignore}
    outputs = ("y", "log_prob") if op == "SoftmaxCrossEntropyLoss" else ("y",)
    check(node_model(op, feeds, opset=opset, outputs=outputs, reduction=reduction, **kw), feeds, rtol=1e-5, atol=1e-5)


def test_loss_int32_targets_float64_and_an_ignore_index_out_of_range():
    feeds = _loss_feeds((3, 4, 5), True, None, dtype="float64", tdtype="int32")
    check(node_model("SoftmaxCrossEntropyLoss", feeds, opset=13, reduction="mean", ignore_index=1 << 40), feeds)
    check(node_model("NegativeLogLikelihoodLoss", feeds, opset=13, reduction="sum", ignore_index=2), feeds)


def test_loss_errors():
    feeds = _loss_feeds((3, 4), False, None)
    with pytest.raises(ModelFormatError, match="node node .*reduction must be"):
        load_onnx(node_model("NegativeLogLikelihoodLoss", feeds, opset=13, reduction="max"))
    bad = {"x": feeds["x"], "t": np.zeros((4,), np.int64)}
    with pytest.raises((ShapeError, ModelFormatError), match="target"):
        load_onnx(node_model("SoftmaxCrossEntropyLoss", bad, opset=13))


# AffineGrid, Col2Im, MaxUnpool --------------------------------------------------------------------
@pytest.mark.parametrize("size,align_corners", [((2, 3, 4, 5), 0), ((2, 3, 4, 5), 1), ((1, 1, 1, 3), 0),
                                                ((2, 1, 3, 2, 4), 0), ((2, 1, 3, 2, 4), 1), ((1, 2, 1, 1, 2), 0)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_affine_grid(size, align_corners, dtype):
    nd = len(size) - 2
    theta = RNG.standard_normal((size[0], nd, nd + 1)).astype(dtype)
    check(node_model("AffineGrid", {"theta": theta}, {"size": np.array(size, np.int64)}, opset=20,
                     align_corners=align_corners), {"theta": theta}, atol=1e-6 if dtype == "float32" else 1e-12)


def test_affine_grid_errors():
    theta = np.zeros((2, 2, 3), np.float32)
    with pytest.raises(UnsupportedOperatorError, match="input 1 .*known at compile time"):
        load_onnx(node_model("AffineGrid", {"theta": theta, "size": np.array([2, 1, 3, 3], np.int64)}, opset=20))
    with pytest.raises(ShapeError, match=r"theta has shape \(2, 2, 3\); expected \(3, 2, 3\)"):
        load_onnx(node_model("AffineGrid", {"theta": theta}, {"size": np.array([3, 1, 3, 3], np.int64)}, opset=20))
    # a single position with align_corners: onnxruntime puts it at 1, the ONNX reference at -1
    with pytest.raises(UnsupportedOperatorError, match="node node .*align_corners=1 with a spatial extent of 1"):
        load_onnx(node_model("AffineGrid", {"theta": theta}, {"size": np.array([2, 1, 1, 3], np.int64)}, opset=20,
                             align_corners=1))


@pytest.mark.parametrize("image,block,attrs", [
    ((5, 6), (2, 3), {}),
    ((7, 6), (3, 2), {"strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2]}),
    ((6, 5), (2, 2), {"strides": [3, 2]}),  # blocks leave the last rows and columns uncovered
    ((3, 4, 5), (1, 2, 2), {"pads": [0, 1, 0, 0, 1, 1]}),
], ids=["plain", "strided-padded-dilated", "uncovered", "3d"])
def test_col2im(image, block, attrs):
    nd = len(image)
    st, dil = attrs.get("strides", [1] * nd), attrs.get("dilations", [1] * nd)
    pads = attrs.get("pads", [0] * 2 * nd)
    blocks = [(image[d] + pads[d] + pads[nd + d] - dil[d] * (block[d] - 1) - 1) // st[d] + 1 for d in range(nd)]
    x = RNG.standard_normal((2, 3 * int(np.prod(block)), int(np.prod(blocks)))).astype(np.float32)
    check(node_model("Col2Im", {"x": x}, {"image_shape": np.array(image, np.int64),
                                          "block_shape": np.array(block, np.int64)}, opset=18, **attrs), {"x": x})


def test_col2im_refuses_a_column_count_that_does_not_fit():
    x = np.zeros((1, 4, 7), np.float32)
    model = node_model("Col2Im", {"x": x}, {"image_shape": np.array([3, 4], np.int64),
                                            "block_shape": np.array([2, 2], np.int64)}, opset=18)
    with pytest.raises(ShapeError, match="node node .*expected dim 1 a multiple of 4 and dim 2 = 2 \\* 3 blocks"):
        load_onnx(model)


def _pool_unpool(x, opset, out_shape=None, **attrs):
    """MaxPool (values and indices) then MaxUnpool with the same attributes."""
    nodes = [helper.make_node("MaxPool", ["x"], ["v", "i"], **attrs),
             helper.make_node("MaxUnpool", ["v", "i"] + (["s"] if out_shape is not None else []), ["y"], name="node",
                              **attrs)]
    inits = [numpy_helper.from_array(np.array(out_shape, np.int64), "s")] if out_shape is not None else []
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [f"d{k}" for k in range(x.ndim)])],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("opset", [11, 18])
@pytest.mark.parametrize("shape,attrs", [((2, 3, 6, 8), {"kernel_shape": [2, 2], "strides": [2, 2]}),
                                         ((1, 2, 7, 5), {"kernel_shape": [3, 2], "strides": [2, 1],
                                                         "pads": [1, 0, 1, 1]}),
                                         ((2, 2, 9), {"kernel_shape": [3], "strides": [3]})])
def test_max_unpool(opset, shape, attrs):
    x = RNG.standard_normal(shape).astype(np.float32)
    got = check(_pool_unpool(x, opset, **attrs), {"x": x})
    assert (got["y"] != 0).sum() > 0


def test_max_unpool_with_output_shape():
    x = RNG.standard_normal((1, 2, 4, 4)).astype(np.float32)
    check(_pool_unpool(x, 11, out_shape=[1, 2, 4, 4], kernel_shape=[2, 2], strides=[2, 2]), {"x": x})
    x = RNG.standard_normal((1, 2, 5, 5)).astype(np.float32)
    with pytest.raises(UnsupportedOperatorError, match="node node .*output_shape \\[1, 2, 5, 5\\] different"):
        load_onnx(_pool_unpool(x, 11, out_shape=[1, 2, 5, 5], kernel_shape=[2, 2], strides=[2, 2]))


# compiled for the cpu target ----------------------------------------------------------------------
def _sce_case():
    feeds = _loss_feeds((4, 6, 3), True, 2)
    return feeds, node_model("SoftmaxCrossEntropyLoss", feeds, opset=13, outputs=("y", "log_prob"),
                             reduction="mean", ignore_index=2)


def _col2im_case():
    feeds = {"x": RNG.standard_normal((2, 2 * 6, 3 * 4)).astype(np.float32)}
    return feeds, node_model("Col2Im", feeds, {"image_shape": np.array([5, 6], np.int64),
                                               "block_shape": np.array([2, 3], np.int64)}, opset=18,
                             strides=[2, 1], pads=[1, 0, 0, 0])


@pytest.mark.parametrize("case", [_sce_case, _col2im_case], ids=["sce", "col2im"])
def test_composed_ops_compiled_for_cpu(tmp_path, case):
    feeds, model = case()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "out")
    got = load(res.out_dir).run(feeds)
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("base", ["int32", "int64"])
@pytest.mark.parametrize("exponent", ["float32", "int64"])
def test_pow_of_integers_against_onnxruntime(tmp_path, base, exponent):
    """An integer base to a float power is the real power truncated (3 ** 0.5 = 1, 4 ** -0.5 = 0, as
    np.power(a, b).astype(a.dtype)): the exponent was truncated to the base's type first (3 ** 0 = 1
    for both, but 8 ** 1.5 = 8). An integer base to a negative integer power is the real power
    truncated too (0 unless the base is 1 or -1), where the evaluator raised numpy's ValueError.
    Both in the graph and compiled for cpu."""
    a = np.array([[2, 3, 4, 8, 1, -1, -2, 5], [7, 9, 16, 3, -3, 1, 2, 10]], base)
    if exponent == "float32":
        b = np.array([[0.5, 1.5, -0.5, 1.5, -2.0, 3.0, 2.0, 0.25], [2.5, 0.5, 0.75, -1.0, 3.0, -0.7, 10.0, 1.2]],
                     exponent)
    else:
        b = np.array([[-1, 2, -2, 1, -3, -3, 3, 0], [1, -1, 0, 3, -2, -1, 4, -1]], exponent)
    feeds = {"a": a, "b": b}
    model = node_model("Pow", feeds, opset=15)
    got = check(model, feeds)
    assert got["y"].tolist() == np.power(a.astype(np.float64), b.astype(np.float64)).astype(base).tolist()
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "out")
    np.testing.assert_array_equal(load(res.out_dir).run(feeds)["y"], got["y"])


@pytest.mark.parametrize("op", ["LayerNormalization", "RMSNormalization", "GroupNormalization"])
def test_a_float64_normalization_is_computed_in_float64(tmp_path, op):
    """A float64 input's statistics are computed in float64 although its stash_type is float32 (the
    default): stash_type widens stage one, never narrows it, as onnxruntime and onnx's reference compute
    (float32 statistics put a 1e-7 relative error in a float64 result); LayerNormalization's Mean and
    InvStdDev outputs are still of type stash_type. Against numpy in float64 within 1e-12, in the graph and
    compiled for cpu; LayerNormalization and RMSNormalization against onnxruntime too."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 6)) * 1.2345678901 + 0.3
    w, b = rng.standard_normal(6), rng.standard_normal(6)
    if op == "GroupNormalization":
        w, b = rng.standard_normal(4), rng.standard_normal(4)
        xs = x.reshape(2, 2, 12)
        mu = xs.mean(-1, keepdims=True)
        want = ((xs - mu) / np.sqrt(((xs - mu) ** 2).mean(-1, keepdims=True) + 1e-5)).reshape(x.shape)
        want = want * w[:, None] + b[:, None]
        model = node_model(op, {"x": x}, {"w": w, "b": b}, opset=21, num_groups=2)
        model.graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE  # (shape inference leaves it out)
    elif op == "RMSNormalization":
        want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w
        model = node_model(op, {"x": x}, {"w": w}, opset=23)
    else:
        mu = x.mean(-1, keepdims=True)
        inv = 1 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
        want = (x - mu) * inv * w + b
        model = node_model(op, {"x": x}, {"w": w, "b": b}, opset=17, outputs=("y", "mean", "inv"))
    got = load_onnx(model).run({"x": x})
    compiled = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                       out_dir=tmp_path / "out")
    ran = load(compiled.out_dir).run({"x": x})
    for have in (got, ran):
        assert have["y"].dtype == np.float64
        np.testing.assert_allclose(have["y"], want, rtol=1e-12, atol=1e-12)
        if op == "LayerNormalization":
            assert have["mean"].dtype == have["inv"].dtype == np.float32
            np.testing.assert_allclose(have["mean"], mu, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(have["inv"], inv, rtol=1e-6)
    if op != "GroupNormalization":
        check(model, {"x": x}, rtol=1e-11, atol=1e-11)


def test_a_float_attribute_left_out_takes_the_float32_default():
    """A float attribute left out is the spec's default as a float32 attribute holds it: a float64
    BatchNormalization in training mode without ``momentum`` updates its running statistics with
    0.8999999762 (float32's 0.9), as onnxruntime and onnx's reference do; 0.9 itself gave running means
    4e-8 away from theirs."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 4, 5))
    consts = {"s": rng.standard_normal(3), "b": rng.standard_normal(3), "mean": rng.standard_normal(3) * 5,
              "var": rng.uniform(1, 5, 3)}
    model = node_model("BatchNormalization", {"x": x}, consts, opset=15, outputs=("y", "running_mean", "running_var"),
                       training_mode=1)
    got = check(model, {"x": x}, rtol=1e-13, atol=1e-13)
    m = float(np.float32(0.9))
    np.testing.assert_allclose(got["running_mean"], consts["mean"] * m + x.mean(axis=(0, 2, 3)) * (1 - m),
                               rtol=1e-14)
    x = rng.standard_normal((3, 4))
    got = check(node_model("LeakyRelu", {"x": x}, opset=16), {"x": x}, rtol=1e-15, atol=0)
    np.testing.assert_array_equal(got["y"], np.where(x < 0, x * float(np.float32(0.01)), x))


def test_a_default_computed_from_the_inputs_keeps_float64():
    """A default the schema computes (Attention's scale, 1/sqrt(head size)) is not a float32 value: a
    float64 Attention without ``scale`` matches onnx's reference within 1e-13 (rounding the scale to
    float32 put it 1.5e-8 away)."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(5)
    feeds = {"q": rng.standard_normal((1, 2, 3, 6)), "k": rng.standard_normal((1, 2, 4, 6)),
             "v": rng.standard_normal((1, 2, 4, 6))}
    model = node_model("Attention", feeds, opset=23, outputs=("y", "present_k", "present_v", "qk"),
                       qk_matmul_output_mode=1)
    for vo in model.graph.output:
        vo.type.tensor_type.elem_type = TensorProto.DOUBLE  # (shape inference leaves some out)
    want = ReferenceEvaluator(model).run(None, feeds)
    got = load_onnx(model).run(feeds)
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(got["qk"], want[-1], rtol=1e-13, atol=1e-13)


def test_group_normalization_is_a_layer_norm_over_groups(tmp_path):
    """GroupNormalization (opset 21) imports as a LayerNorm over [N, G, C/G * spatial] and the
    per-channel affine after it (scale and bias graph inputs here); it computes what the GroupNorm op
    computes, in the graph and compiled for cpu."""
    from shardflow.compiler.ops.norm import GroupNorm

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 5, 7)).astype(np.float32)
    s, b = (rng.standard_normal(6).astype(np.float32) for _ in range(2))
    node = helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=3, epsilon=1e-3)
    vi = helper.make_tensor_value_info
    g = helper.make_graph([node], "gn", [vi("x", TensorProto.FLOAT, x.shape), vi("s", TensorProto.FLOAT, s.shape),
                                         vi("b", TensorProto.FLOAT, b.shape)], [vi("y", TensorProto.FLOAT, x.shape)])
    path = tmp_path / "gn.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)
    graph = load_onnx(str(path))
    assert "LayerNorm" in graph.op_types() and "GroupNorm" not in graph.op_types()
    op = GroupNorm([graph.inputs[0], graph.inputs[1], graph.inputs[2]], name="ref", groups=3, epsilon=1e-3,
                   stash="float32", per_channel=True)
    want = op.run(x, s, b)[0]
    feeds = {"x": x, "s": s, "b": b}
    np.testing.assert_allclose(graph.run(feeds)["y"], want, rtol=1e-5, atol=1e-5)
    compile(str(path), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=str(tmp_path / "o"))
    np.testing.assert_allclose(load(str(tmp_path / "o"), rank=0).run(feeds)["y"], want, rtol=1e-5, atol=1e-5)


def test_an_optional_tensor_input_is_compiled_as_present(tmp_path):
    """A graph input of an optional tensor type is the tensor (the program takes it): OptionalGetElement is
    it, OptionalHasElement is True for it and False for a left-out input; compiled for the cpu target."""
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [2, 3]))
    nodes = [helper.make_node("OptionalGetElement", ["x"], ["e"]), helper.make_node("Relu", ["e"], ["y"]),
             helper.make_node("OptionalHasElement", ["x"], ["has"]),
             helper.make_node("OptionalHasElement", [""], ["none"])]
    g = helper.make_graph(nodes, "g", [helper.make_value_info("x", opt)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
                           helper.make_tensor_value_info("has", TensorProto.BOOL, []),
                           helper.make_tensor_value_info("none", TensorProto.BOOL, [])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    x = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]], np.float32)
    compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "out")
    got = load(tmp_path / "out", 0).run({"x": x})
    np.testing.assert_array_equal(got["y"], np.maximum(x, 0))
    assert got["has"].dtype == np.bool_ and bool(got["has"]) and not bool(got["none"])


# Det ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,dtype", [((3, 3), np.float32), ((2, 4, 5, 5), np.float32), ((1, 1), np.float32),
                                         ((3, 6, 6), np.float64)])
def test_det(tmp_path, shape, dtype):
    x = RNG.standard_normal(shape).astype(dtype)
    if len(shape) > 2:
        x[0, ..., 1, :] = x[0, ..., 0, :] * 2  # singular matrices: 0
    model = node_model("Det", {"x": x}, opset=22)
    if dtype == np.float64:  # (onnxruntime has no float64 Det: the cpu target's LU template against numpy's)
        res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                      out_dir=tmp_path / "det")
        np.testing.assert_allclose(load(res.out_dir).run({"x": x})["y"], np.linalg.det(x), rtol=1e-10, atol=1e-12)
    else:
        check(model, {"x": x}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("x,error,match", [(np.zeros((3, 4), np.float32), ShapeError, "square matrices"),
                                           (np.zeros((3, 3), np.int32), UnsupportedOperatorError, "Det of int32")])
def test_det_refuses_other_shapes_and_types(x, error, match):
    g = helper.make_graph([helper.make_node("Det", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", _ONNX[x.dtype], x.shape)],
                          [helper.make_tensor_value_info("y", _ONNX[x.dtype], [3])])
    with pytest.raises(error, match=match):
        load_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)], ir_version=10))


def test_det_compiled_for_cpu_and_on_two_ranks(tmp_path):
    """A batch of determinants after a MatMul, compiled for the cpu target (the LU template), against
    onnxruntime; and planned over two ranks (the batch split) and simulated."""
    from shardflow.compiler.parallel import partition, search, simulate

    x = RNG.standard_normal((8, 5, 5)).astype(np.float32)
    w = RNG.standard_normal((5, 5)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Det", ["p"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 5, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])],
                          [numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)])
    model.ir_version = 10
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "det")
    np.testing.assert_allclose(load(res.out_dir).run({"x": x})["y"], want, rtol=1e-4, atol=1e-5)
    graph = load_onnx(model)
    plan = search(graph, {"mesh_shape": [2], "memory_budget_bytes": 1500})
    assert str(plan.tensor_specs["y"]).startswith("S(")
    np.testing.assert_allclose(simulate(partition(graph, plan), {"x": x})["y"], want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ShardflowError, match=r"no kernel for node .*\(Det\): extern output"):  # (no cuda kernel)
        compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cuda"},
                out_dir=tmp_path / "det-cuda")


# TfIdfVectorizer ------------------------------------------------------------------------------------

#: a pool of 4 unigrams, 3 bigrams (one repeating a unigram's token) and 2 trigrams
_POOL = dict(pool_int64s=[2, 3, 5, 4, 5, 6, 7, 8, 6, 7, 2, 3, 4, 5, 6, 7], ngram_counts=[0, 4, 10],
             ngram_indexes=[0, 1, 2, 3, 4, 5, 6, 7, 8])


def tfidf_model(x, mode, lo, hi, skip, weights=None, indexes=None, opset=9):
    attrs = dict(_POOL, mode=mode, min_gram_length=lo, max_gram_length=hi, max_skip_count=skip)
    if indexes is not None:
        attrs["ngram_indexes"] = indexes
    if weights is not None:
        attrs["weights"] = weights
    size = max(attrs["ngram_indexes"]) + 1
    node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], name="node", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", _ONNX[x.dtype], x.shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape[:-1]) + [size])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("mode,lo,hi,skip,weighted,shape,dtype", [
    ("TF", 1, 3, 0, False, (2, 12), np.int64), ("TF", 2, 2, 3, False, (3, 10), np.int32),
    ("TF", 1, 2, 5, False, (14,), np.int64), ("IDF", 1, 3, 2, True, (2, 12), np.int64),
    ("IDF", 2, 3, 1, False, (2, 12), np.int32), ("TFIDF", 1, 3, 4, True, (4, 9), np.int64),
    ("TFIDF", 3, 3, 2, False, (2, 7), np.int64)])
def test_tfidf_vectorizer(mode, lo, hi, skip, weighted, shape, dtype):
    x = RNG.integers(2, 9, shape).astype(dtype)
    weights = [0.5, 1.5, 2.0, 0.25, 3.0, 1.0, 0.75, 2.5, 4.0] if weighted else None
    check(tfidf_model(x, mode, lo, hi, skip, weights), {"x": x})


def test_tfidf_vectorizer_n_grams_sharing_an_output_and_compiled(tmp_path):
    """Two pool n-grams counted into one output (ngram_indexes repeats), compiled for the cpu target,
    and a batch split over two ranks, against onnxruntime."""
    from shardflow.compiler.parallel import partition, search, simulate

    x = RNG.integers(2, 9, (8, 16)).astype(np.int64)
    model = tfidf_model(x, "TF", 1, 3, 2, indexes=[0, 1, 2, 3, 4, 0, 5, 6, 1])
    want = check(model, {"x": x})["y"]
    res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                  out_dir=tmp_path / "tfidf")
    np.testing.assert_array_equal(load(res.out_dir).run({"x": x})["y"], want)
    graph = load_onnx(model)
    plan = search(graph, {"mesh_shape": [2], "memory_budget_bytes": 10_000})  # (replicated: over 20 kB)
    assert str(plan.tensor_specs[graph.outputs[0].name]).startswith("S(")
    np.testing.assert_array_equal(simulate(partition(graph, plan), {"x": x})["y"], want)


def test_tfidf_vectorizer_refusals():
    x = np.zeros((2, 5), np.int64)
    m = tfidf_model(x, "TF", 1, 2, 0)
    m.graph.node[0].attribute.append(helper.make_attribute("pool_strings", ["a", "b"]))
    with pytest.raises(UnsupportedOperatorError, match="a pool of strings"):
        load_onnx(m)
    with pytest.raises(ModelFormatError, match="are not whole 2-grams"):
        m = tfidf_model(x, "TF", 1, 2, 0)
        counts = next(a for a in m.graph.node[0].attribute if a.name == "ngram_counts")
        counts.ints[:] = [0, 4, 9]  # 5 values for the bigrams
        load_onnx(m)
    with pytest.raises(ModelFormatError, match="mode must be one of"):
        load_onnx(tfidf_model(x, "BM25", 1, 2, 0))


# Optimizer updates (ai.onnx.preview.training) ---------------------------------------------------------

def optimizer_model(op, groups, shapes, **attrs):
    """One ``op`` node (training domain, no default opset, as the ONNX test cases) on R, T and
    ``groups`` groups of tensors of ``shapes``; outputs the updated tensors, group by group."""
    names = [f"{g}{i}" for g in "xgvh"[:groups] for i in range(len(shapes))]
    outs = [f"{n}_new" for n in names if not n.startswith("g")]
    node = helper.make_node(op, ["r", "t"] + names, outs, domain="ai.onnx.preview.training", **attrs)
    inputs = [helper.make_tensor_value_info("r", TensorProto.FLOAT, []),
              helper.make_tensor_value_info("t", TensorProto.INT64, [])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[int(n[1:])]) for n in names]
    g = helper.make_graph([node], "g", inputs,
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[int(n[1:-4])]) for n in outs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("ai.onnx.preview.training", 1)])
    m.ir_version = 8
    return m, names


@pytest.mark.parametrize("op,groups,attrs", [
    ("Adagrad", 3, {"norm_coefficient": 0.01, "decay_factor": 0.1, "epsilon": 1e-6}),
    ("Momentum", 3, {"alpha": 0.9, "beta": 0.5, "norm_coefficient": 0.02, "mode": "standard"}),
    ("Momentum", 3, {"alpha": 0.8, "beta": 0.7, "norm_coefficient": 0.0, "mode": "nesterov"}),
    ("Adam", 4, {"alpha": 0.85, "beta": 0.95, "epsilon": 1e-7, "norm_coefficient": 0.01,
                 "norm_coefficient_post": 0.02}),
])
@pytest.mark.parametrize("step", [0, 3])
def test_optimizer_updates(tmp_path, op, groups, attrs, step):
    """Two tensors updated at iteration 0 (no bias correction, Momentum's first step) and 3, against
    the ONNX reference; then compiled for the cpu target."""
    from onnx.reference import ReferenceEvaluator

    shapes = [(3, 4), (5,)]
    model, names = optimizer_model(op, groups, shapes, **attrs)
    feeds = {"r": np.array(0.1, np.float32), "t": np.array(step, np.int64)}
    for n in names:
        v = RNG.standard_normal(shapes[int(n[1:])]).astype(np.float32)
        feeds[n] = v if n[0] in "xg" else np.abs(v)  # (states: Adagrad's and Adam's sums of squares)
    want = ReferenceEvaluator(model).run(None, feeds)
    got = load_onnx(model).run(feeds)
    outs = [o.name for o in model.graph.output]
    for name, w in zip(outs, want):
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6)
    if step:
        res = compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                      out_dir=tmp_path / "opt")
        ran = load(res.out_dir).run(feeds)
        for name, w in zip(outs, want):
            np.testing.assert_allclose(ran[name], w, rtol=1e-5, atol=1e-6)


def test_optimizer_refusals():
    model, _ = optimizer_model("Momentum", 3, [(2, 2)], alpha=0.9, beta=0.1, norm_coefficient=0.0, mode="heavy")
    with pytest.raises(ModelFormatError, match="mode must be 'standard' or 'nesterov'"):
        load_onnx(model)
    model, _ = optimizer_model("Adagrad", 3, [(2, 2)])
    model.graph.node[0].input.pop()  # one state short
    with pytest.raises(ModelFormatError, match="groups of tensors of one count"):
        load_onnx(model)


# ai.onnx.ml: Binarizer, ArrayFeatureExtractor ----------------------------------------------------------

def ml_model(op, feeds, consts=None, out_shape=None, out_type=None, **attrs):
    consts = consts or {}
    node = helper.make_node(op, list(feeds) + list(consts), ["y"], domain="ai.onnx.ml", **attrs)
    first = next(iter(feeds.values()))
    g = helper.make_graph([node], "g",
                          [helper.make_tensor_value_info(k, _ONNX[v.dtype], v.shape) for k, v in feeds.items()],
                          [helper.make_tensor_value_info("y", out_type or _ONNX[first.dtype], out_shape)],
                          [numpy_helper.from_array(v, k) for k, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_binarizer(dtype):
    x = (RNG.standard_normal((3, 5)) * 3).astype(dtype)
    model = ml_model("Binarizer", {"x": x}, out_shape=[3, 5], threshold=0.5)
    if dtype == np.float32:
        check(model, {"x": x})
    else:  # (onnxruntime's Binarizer takes float32 only)
        got = load_onnx(model).run({"x": x})["y"]
        assert got.dtype == dtype and np.array_equal(got, (x > 0.5).astype(dtype))


@pytest.mark.parametrize("xshape,idx", [((3, 5), [[4, 0, 2]]), ((5,), [1, 3]), ((2, 3, 4), [[0, 3], [1, 1]])])
def test_array_feature_extractor(xshape, idx):
    x = RNG.standard_normal(xshape).astype(np.float32)
    ind = np.array(idx, np.int64)
    out = [1, ind.size] if len(xshape) == 1 else list(xshape[:-1]) + [ind.size]
    check(ml_model("ArrayFeatureExtractor", {"x": x, "i": ind}, out_shape=out), {"x": x, "i": ind})
