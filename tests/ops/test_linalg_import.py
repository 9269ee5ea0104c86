"""Linear algebra, convolution, pooling and resize imported from small ONNX models, checked against
onnxruntime (and, for Resize, against the ONNX backend test data with constant scales/sizes)."""
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import ShapeError, UnsupportedOperatorError, load_onnx

ort = pytest.importorskip("onnxruntime")

OPSET = 19


def _model(op_type, inputs, attrs=None, n_outputs=1, initializers=None, opset=OPSET):
    """A one-node model; ``inputs`` maps name -> array (graph inputs unless in ``initializers``)."""
    initializers = initializers or {}
    node = helper.make_node(op_type, list(inputs), [f"y{i}" for i in range(n_outputs)], **(attrs or {}))
    g_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                for n, a in inputs.items() if n and n not in initializers]  # "" = an absent optional input
    dtype = helper.np_dtype_to_tensor_dtype(next(iter(inputs.values())).dtype)
    outs = [helper.make_tensor_value_info(f"y{i}", dtype if i == 0 else TensorProto.INT64, None)
            for i in range(n_outputs)]
    inits = [numpy_helper.from_array(a, n) for n, a in initializers.items()]
    graph = helper.make_graph([node], "g", g_inputs, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(model)  # fills in the output shapes


def _check(op_type, inputs, attrs=None, n_outputs=1, initializers=(), opset=OPSET):
    inits = {n: inputs[n] for n in initializers}
    model = _model(op_type, inputs, attrs, n_outputs, inits, opset)
    feeds = {n: a for n, a in inputs.items() if n not in inits}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    got = load_onnx(model, input_shapes={n: a.shape for n, a in feeds.items()}).run(feeds)
    for i, w in enumerate(want):
        g = got[f"y{i}"]
        assert g.shape == w.shape and g.dtype == w.dtype
        if w.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
        else:
            np.testing.assert_array_equal(g, w)


def _f(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("a_shape,b_shape", [
    ((2, 1, 3, 4), (5, 4, 6)), ((3, 4), (2, 4, 5)), ((4,), (2, 4, 3)), ((2, 3, 4), (4,)), ((4,), (4,)),
    ((1, 3, 4), (2, 4, 2)),
])
def test_matmul_broadcasting(a_shape, b_shape):
    rng = np.random.default_rng(0)
    _check("MatMul", {"a": _f(rng, *a_shape), "b": _f(rng, *b_shape)})


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("c_shape", [None, (5,), (3, 1), (3, 5), (1,)])
def test_gemm(trans_a, trans_b, c_shape):
    rng = np.random.default_rng(1)
    inputs = {"a": _f(rng, *((4, 3) if trans_a else (3, 4))), "b": _f(rng, *((5, 4) if trans_b else (4, 5)))}
    if c_shape is not None:
        inputs["c"] = _f(rng, *c_shape)
    _check("Gemm", inputs, {"transA": trans_a, "transB": trans_b, "alpha": 0.7, "beta": 1.3}, initializers=("b",))


def test_gemm_checks_the_contracted_dim():
    rng = np.random.default_rng(2)
    model = _model("Gemm", {"a": _f(rng, 3, 4), "b": _f(rng, 5, 4)}, {})
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y0", TensorProto.FLOAT, [3, 5]))
    with pytest.raises(ShapeError, match="contracts dim 4"):
        load_onnx(model)


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 3, 7, 7), (4, 3, 3, 3), {}),
    ((2, 4, 8, 7), (6, 2, 3, 3), {"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 1], "dilations": [1, 2]}),
    ((1, 4, 6, 6), (4, 1, 3, 3), {"group": 4, "pads": [1, 1, 1, 1]}),
    ((1, 2, 9, 8), (4, 2, 3, 2), {"strides": [2, 3], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 9, 8), (4, 2, 4, 2), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 9, 8), (4, 2, 3, 3), {"auto_pad": "VALID", "dilations": [2, 2]}),
    ((2, 3, 11), (2, 3, 3), {"strides": [2], "pads": [2, 1], "dilations": [2]}),
    ((1, 2, 4, 5, 4), (3, 2, 2, 3, 2), {"pads": [1, 0, 0, 0, 1, 1], "strides": [1, 2, 1]}),
])
@pytest.mark.parametrize("bias", [False, True])
def test_conv(x_shape, w_shape, attrs, bias):
    rng = np.random.default_rng(3)
    inputs = {"x": _f(rng, *x_shape), "w": _f(rng, *w_shape)}
    if bias:
        inputs["b"] = _f(rng, w_shape[0])
    _check("Conv", inputs, attrs, initializers=("w",))


def test_conv_rejects_mismatched_channels():
    rng = np.random.default_rng(4)
    model = _model("Conv", {"x": _f(rng, 1, 3, 5, 5), "w": _f(rng, 2, 2, 3, 3)}, {})
    with pytest.raises(ShapeError, match="channels"):
        load_onnx(model)


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 2, 3, 3), (2, 3, 3, 3), {}),
    ((1, 2, 3, 4), (2, 2, 3, 3), {"strides": [3, 2], "pads": [1, 2, 1, 2]}),
    ((1, 2, 3, 4), (2, 2, 3, 3), {"strides": [3, 2], "output_padding": [1, 1]}),
    ((1, 4, 3, 3), (4, 1, 3, 2), {"group": 2, "strides": [2, 2], "dilations": [2, 1]}),
    ((2, 2, 5), (2, 3, 4), {"strides": [2], "pads": [1, 2]}),
    ((1, 2, 3, 3), (2, 2, 3, 3), {"strides": [2, 2], "output_shape": [7, 7]}),
    ((1, 2, 3, 3), (2, 2, 3, 3), {"strides": [2, 2], "output_shape": [5, 6]}),
    ((1, 2, 3, 3), (2, 2, 3, 3), {"strides": [2, 2], "output_shape": [6, 6], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 3, 3), (2, 2, 3, 3), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
])
def test_conv_transpose(x_shape, w_shape, attrs):
    rng = np.random.default_rng(5)
    _check("ConvTranspose", {"x": _f(rng, *x_shape), "w": _f(rng, *w_shape), "b": _f(rng, w_shape[1] * attrs.get(
        "group", 1))}, attrs, initializers=("w",))


@pytest.mark.parametrize("attrs", [{"strides": [3, 1], "output_padding": [1, 1]},
                                   {"strides": [2, 2], "output_padding": [0, 2]},
                                   {"strides": [2, 2], "dilations": [1, 3], "output_padding": [1, 3]}])
def test_conv_transpose_output_padding_past_its_stride_is_refused(attrs):
    """``output_padding`` must be less than its axis's stride or dilation (the spec's bound; onnxruntime
    refuses the run): a ModelFormatError naming the node, where the import computed a larger output."""
    from shardflow.compiler import ModelFormatError

    rng = np.random.default_rng(1)
    model = _model("ConvTranspose", {"x": _f(rng, 1, 2, 3, 4), "w": _f(rng, 2, 2, 3, 3)}, attrs,
                   initializers={"w": _f(rng, 2, 2, 3, 3)})
    with pytest.raises(ModelFormatError, match=r"output_padding .* must be at least 0 and less than the stride or "
                                               r"the dilation of its axis"):
        load_onnx(model)


POOL_CASES = [
    ((1, 2, 7, 7), {"kernel_shape": [3, 3]}),
    ((1, 2, 7, 8), {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1]}),
    ((1, 2, 6, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 2, 7, 7), {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}),
    ((1, 2, 8, 8), {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 8, 8), {"kernel_shape": [2, 2], "strides": [3, 3], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 9, 9), {"kernel_shape": [2, 3], "dilations": [2, 2], "strides": [2, 1], "ceil_mode": 1}),
    ((2, 3, 10), {"kernel_shape": [3], "strides": [3], "pads": [1, 1], "ceil_mode": 1}),
    ((1, 1, 5, 6, 5), {"kernel_shape": [2, 2, 3], "strides": [2, 2, 2], "pads": [0, 1, 1, 1, 0, 1]}),
]


@pytest.mark.parametrize("x_shape,attrs", POOL_CASES)
@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool(x_shape, attrs, count_include_pad):
    rng = np.random.default_rng(6)
    _check("AveragePool", {"x": _f(rng, *x_shape)}, {**attrs, "count_include_pad": count_include_pad})


@pytest.mark.parametrize("x_shape,attrs", POOL_CASES)
def test_max_pool(x_shape, attrs):
    rng = np.random.default_rng(7)
    _check("MaxPool", {"x": _f(rng, *x_shape)}, attrs)


@pytest.mark.parametrize("x_shape,attrs", [c for c in POOL_CASES if len(c[0]) <= 4 and "auto_pad" not in c[1]])
@pytest.mark.parametrize("storage_order", [0, 1])
def test_max_pool_indices(x_shape, attrs, storage_order):
    rng = np.random.default_rng(8)
    _check("MaxPool", {"x": _f(rng, *x_shape)}, {**attrs, "storage_order": storage_order}, n_outputs=2)


@pytest.mark.parametrize("x_shape,attrs", POOL_CASES[:4])
def test_lp_pool(x_shape, attrs):
    rng = np.random.default_rng(9)
    _check("LpPool", {"x": _f(rng, *x_shape)}, {**attrs, "p": 3} if "ceil_mode" not in attrs else {**attrs, "p": 2})


@pytest.mark.parametrize("op_type", ["GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"])
def test_global_pool(op_type):
    rng = np.random.default_rng(10)
    _check(op_type, {"x": _f(rng, 2, 3, 5, 4)})


@pytest.mark.parametrize("equation,shapes", [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]), ("...ii->...i", [(2, 3, 3)]), ("ij->", [(3, 4)]),
    ("i,i", [(5,), (5,)]), ("...ij,...jk", [(2, 1, 3, 4), (1, 5, 4, 2)]), ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
])
def test_einsum(equation, shapes):
    rng = np.random.default_rng(11)
    _check("Einsum", {f"x{i}": _f(rng, *s) for i, s in enumerate(shapes)}, {"equation": equation})


def test_a_half_einsum_is_rounded_once():
    """A float16 einsum that sums over an index of one operand only (``a`` here) multiplies and adds
    in float32 and rounds once, as the kernels do (numpy's float16 einsum first sums ``a`` in float16:
    off by several steps)."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((300, 4, 6)).astype(np.float16), rng.standard_normal((6, 3)).astype(np.float16)
    g = load_onnx(_model("Einsum", {"x": x, "w": w}, {"equation": "abd,dz->bz"}, initializers={"w": w}))
    got = g.run({"x": x})["y0"]
    want = np.einsum("abd,dz->bz", x.astype(np.float64), w.astype(np.float64))
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-3, atol=1e-3)


def test_resize_backend_cases_with_constant_scales():
    """Every ONNX backend Resize/Upsample case, with scales/sizes/roi turned into initializers.

    (The conformance runner feeds them as graph inputs, which is correctly refused.)
    """
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = [c for c in load_model_tests(kind="node") if c.name.startswith(("test_resize", "test_upsample"))]
    assert len(cases) >= 40
    failures = []
    for case in cases:
        model = onnx.ModelProto()
        model.CopyFrom(case.model)
        (inputs, outputs), = case.data_sets[:1]
        feeds = {}
        for vi, arr in zip(list(model.graph.input), inputs):
            if vi.name == "X":
                feeds["X"] = arr
            else:
                model.graph.initializer.append(numpy_helper.from_array(arr, vi.name))
        got = load_onnx(model, input_shapes={"X": feeds["X"].shape}).run(feeds)[model.graph.output[0].name]
        want = outputs[0]
        if got.shape != want.shape or got.dtype != want.dtype or not np.allclose(got, want, rtol=1e-5, atol=1e-6):
            failures.append(case.name)
    assert not failures, f"wrong results: {failures}"


def test_resize_with_data_dependent_scales_is_refused():
    rng = np.random.default_rng(12)
    x = _f(rng, 1, 1, 2, 2)
    model = _model("Resize", {"x": x, "": np.zeros(0, np.float32), "s": np.array([1, 1, 2, 2], np.float32)},
                   {"mode": "nearest"})
    with pytest.raises(UnsupportedOperatorError, match="must be known at compile time"):
        load_onnx(model)


@pytest.mark.parametrize("mode,scales", [("nearest", [1, 1, 2, 3]), ("nearest", [1, 1, 1.7, 2.5]),
                                         ("linear", [1, 1, 2, 1.5]), ("nearest", [1, 1, 0.6, 0.7]),
                                         ("linear", [1, 1, 0.6, 0.7])])
def test_resize_opset10_and_upsample9_match_onnxruntime(mode, scales):
    rng = np.random.default_rng(13)
    x = _f(rng, 1, 2, 5, 7)
    s = np.array(scales, np.float32)
    _check("Resize", {"x": x, "s": s}, {"mode": mode}, initializers=("s",), opset=10)
    if min(scales) >= 1:
        _check("Upsample", {"x": x, "s": s}, {"mode": mode}, initializers=("s",), opset=9)


@pytest.mark.parametrize("mesh,algo", [([1], "ilp"), ([2], "data"), ([2], "megatron")])
def test_fpn_top_down_step_compiles_to_the_resize_template(tmp_path, monkeypatch, mesh, algo):
    """A feature pyramid's top-down step (a 1x1 conv's output resized 2x, nearest, plus the lateral
    features, then a Relu) compiled for cpu ranks: the Resize runs its template with the Add and the
    Relu as its epilogue, and every rank's output matches onnxruntime."""
    import json

    from threads import run_threads

    from shardflow.compiler import compile
    from shardflow.compiler.codegen import templates_cpu
    from shardflow.runtime import load
    from shardflow.runtime.comm import InProcessWorld

    fused_with = []
    real = templates_cpu._resize

    def resize(op, fused=None):
        body = real(op, fused)
        if fused is not None and body is not None:
            fused_with.append([m.op_type for m in fused.members])
        return body
    monkeypatch.setattr(templates_cpu, "_resize", resize)
    rng = np.random.default_rng(14)
    inits = [numpy_helper.from_array(_f(rng, 16, 8, 1, 1), "w_top"),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    nodes = [helper.make_node("Conv", ["top", "w_top"], ["t"]),
             helper.make_node("Resize", ["t", "", "scales"], ["up"], mode="nearest",
                              coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             helper.make_node("Add", ["up", "lat"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "fpn", [info("top", TensorProto.FLOAT, [2, 8, 7, 9]),
                                             info("lat", TensorProto.FLOAT, [2, 16, 14, 18])],
                              [info("y", TensorProto.FLOAT, [2, 16, 14, 18])], inits)
    path = tmp_path / "fpn.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), path)
    feeds = {"top": _f(rng, 2, 8, 7, 9), "lat": _f(rng, 2, 16, 14, 18)}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    out = tmp_path / "out"
    compile(path, distributed_config={"mesh_shape": mesh, "algo": algo}, optimization_config={"target": "cpu"},
            out_dir=out)
    world = int(np.prod(mesh))
    kernels = [[s["node"] for s in json.loads((out / f"rank{r}" / "program.json").read_text())["steps"]
                if s["kind"] == "kernel"] for r in range(world)]
    if algo == "data":
        # each rank slices its images of `lat` (a LocalSlice member: the epilogue reads `lat` at the
        # rank's offset): the Resize with the slice, Add and Relu as its epilogue on every rank
        assert fused_with and all(f == ["Resize", "LocalSlice", "Binary", "Activation"] for f in fused_with), \
            fused_with
        assert all(k == ["top/local_slice0->S(0)", "Conv(t)", "Relu(y)"] for k in kernels), kernels
    else:  # the conv, then the Resize with its epilogue
        assert fused_with and all(f == ["Resize", "Binary", "Activation"] for f in fused_with), fused_with
        assert all(k == ["Conv(t)", "Relu(y)"] for k in kernels), kernels

    def work(c):
        return load(out, c.rank, c).run(feeds)["y"]
    for got in run_threads(InProcessWorld(world).communicators(), work, timeout=120):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _shufflenet_units(rng, c=48, groups=4):
    """Two ShuffleNet units with random weights: a stride-2 one (1x1 group conv, BatchNorm, Relu,
    channel shuffle, 3x3 depthwise stride 2, 1x1 group conv, concatenated with the 3x3 average
    pooled input) and a stride-1 one (the same convs, its output added to its input)."""
    nodes, inits = [], []

    def w(name, *shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name))
        return name

    def bn(x, name, ch):
        s, b, m = (w(f"{name}_{k}", ch) for k in "sbm")
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 1.5, ch).astype(np.float32), f"{name}_v"))
        nodes.append(helper.make_node("BatchNormalization", [x, s, b, m, f"{name}_v"], [name], epsilon=1e-5))
        return name

    def unit(x, name, cin, cout, stride, hw):
        mid = cout // 4
        nodes.append(helper.make_node("Conv", [x, w(f"{name}_w1", mid, cin // groups, 1, 1)], [f"{name}_c1"],
                                      group=groups))
        nodes.append(helper.make_node("Relu", [bn(f"{name}_c1", f"{name}_bn1", mid)], [f"{name}_r1"]))
        inits.append(numpy_helper.from_array(np.array([-1, groups, mid // groups, hw, hw], np.int64), f"{name}_s5"))
        inits.append(numpy_helper.from_array(np.array([-1, mid, hw, hw], np.int64), f"{name}_s4"))
        nodes.extend([helper.make_node("Reshape", [f"{name}_r1", f"{name}_s5"], [f"{name}_g"]),
                      helper.make_node("Transpose", [f"{name}_g"], [f"{name}_t"], perm=[0, 2, 1, 3, 4]),
                      helper.make_node("Reshape", [f"{name}_t", f"{name}_s4"], [f"{name}_sh"])])
        nodes.append(helper.make_node("Conv", [f"{name}_sh", w(f"{name}_dw", mid, 1, 3, 3)], [f"{name}_d"],
                                      group=mid, pads=[1, 1, 1, 1], strides=[stride, stride]))
        out = cout - cin if stride == 2 else cout
        w3 = w(f"{name}_w3", out, mid // groups, 1, 1)
        nodes.append(helper.make_node("Conv", [bn(f"{name}_d", f"{name}_bn2", mid), w3], [f"{name}_c3"], group=groups))
        y = bn(f"{name}_c3", f"{name}_bn3", out)
        if stride == 2:
            nodes.append(helper.make_node("AveragePool", [x], [f"{name}_p"], kernel_shape=[3, 3], strides=[2, 2],
                                          pads=[1, 1, 1, 1]))
            nodes.append(helper.make_node("Concat", [f"{name}_p", y], [f"{name}_cat"], axis=1))
        else:
            nodes.append(helper.make_node("Add", [x, y], [f"{name}_cat"]))
        nodes.append(helper.make_node("Relu", [f"{name}_cat"], [f"{name}_y"]))
        return f"{name}_y"

    y = unit(unit("x", "u1", 24, c * 2, 2, 28), "u2", c * 2, c * 2, 1, 14)
    nodes.append(helper.make_node("Identity", [y], ["y"]))
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "shufflenet_units", [info("x", TensorProto.FLOAT, [2, 24, 28, 28])],
                              [info("y", TensorProto.FLOAT, [2, c * 2, 14, 14])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


@pytest.mark.parametrize("mesh,algo", [([1], "ilp"), ([2], "data"), ([2], "megatron")])
def test_shufflenet_units_compiled_for_cpu_ranks_match_onnxruntime(tmp_path, mesh, algo):
    """Two ShuffleNet units (group and depthwise convs in blocks of channels, stride 2, BatchNorms
    and Relus as conv epilogues, the channel shuffle's reshapes as views, a concat and a residual)
    compiled for cpu ranks: every rank's output matches onnxruntime; on one rank each 1x1 conv's
    BatchNorm and Relu are its epilogue (no kernel of their own before the shuffle)."""
    import json

    from threads import run_threads

    from shardflow.compiler import compile
    from shardflow.runtime import load
    from shardflow.runtime.comm import InProcessWorld

    rng = np.random.default_rng(15)
    path = tmp_path / "units.onnx"
    onnx.save(_shufflenet_units(rng), path)
    feeds = {"x": _f(rng, 2, 24, 28, 28)}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    out = tmp_path / "out"
    compile(path, distributed_config={"mesh_shape": mesh, "algo": algo}, optimization_config={"target": "cpu"},
            out_dir=out)
    world = int(np.prod(mesh))
    if world == 1:
        kernels = [s["node"] for s in json.loads((out / "rank0" / "program.json").read_text())["steps"]
                   if s["kind"] == "kernel"]
        assert "Relu(u1_r1)" in kernels and "Relu(u2_r1)" in kernels, kernels  # conv + BN + Relu, one kernel
        assert not any(k.startswith(("Reshape(u1_g)", "Reshape(u2_g)")) for k in kernels), kernels

    def work(c):
        return load(out, c.rank, c).run(feeds)["y"]
    for got in run_threads(InProcessWorld(world).communicators(), work, timeout=120):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
