"""Channels-last convolutions for the cuda target on Hopper (compiler/passes/channels_last.py, RFC
0005 decision 57): which convs the pass rewrites, that the rewritten graph computes what the
model does, and the program's kernels (the image's cast and channels-last copy one kernel, the
convs on the wgmma template) run on the host emulation against the reference evaluator."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import load_onnx
from shardflow.compiler.codegen.cuda import generate_cuda_source, kernel_groups
from shardflow.compiler.driver import OptimizationConfig, _is_view, rank_passes
from shardflow.compiler.passes.channels_last import channels_last_copy, channels_last_output


def _model(dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    """``x [2, 16, 10, 12]`` read by a padded 3x3 conv and a strided one (one copy for both; the
    strided one's ReLU read by a 3x3 conv alone: the strided conv stores it channels-last, its ReLU
    then runs on channels-last values, decision 61), a
    ReLU, then a 1x1 conv (read as it is: decision 55) and a grouped 3x3 conv (left alone: 4 channels a group); ``y``
    of 12 channels (not a multiple of 8: its copy has 4 channels of zeros more); ``z``'s patch
    embedding (8x8 windows at stride 8: gathered from the NCHW image as it is)."""
    rng = np.random.default_rng(0)
    npt = helper.tensor_dtype_to_np_dtype(dtype)

    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / 4).astype(npt), name)

    inits = [w("w1", 32, 16, 3, 3), w("b1", 32), w("w2", 24, 16, 3, 3), w("w3", 16, 32, 1, 1),
             w("w4", 32, 4, 3, 3), w("w5", 16, 12, 3, 3), w("w6", 16, 3, 8, 8), w("w7", 16, 24, 3, 3)]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r"]),
             helper.make_node("Conv", ["r", "w3"], ["c3"]),
             helper.make_node("Conv", ["r", "w4"], ["c4"], pads=[1, 1, 1, 1], group=8),
             helper.make_node("Conv", ["y", "w5"], ["c5"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["z", "w6"], ["c6"], strides=[8, 8]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w7"], ["c7"], pads=[1, 1, 1, 1])]
    io = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "convs", [io("x", dtype, [2, 16, 10, 12]), io("y", dtype, [1, 12, 8, 8]),
                                               io("z", dtype, [2, 3, 32, 32])],
                              [io("c7", dtype, [2, 16, 5, 6]), io("c3", dtype, [2, 16, 10, 12]),
                               io("c4", dtype, [2, 32, 10, 12]), io("c5", dtype, [1, 16, 8, 8]),
                               io("c6", dtype, [2, 16, 4, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _onnx(nodes, name: str, inputs: list, outputs: list, inits) -> onnx.ModelProto:
    """An opset-17 model of ``nodes``; ``inputs``/``outputs`` as ``(name, dtype, shape)``."""
    io = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, name, [io(*i) for i in inputs], [io(*o) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _evaluate(rg, feeds):
    env = dict(feeds)
    for op in rg.nodes:
        env.update(zip((t.name for t in op.outputs), op.run(*[env[t.name] if t.name in env else t.value
                                                              for t in op.inputs])))
    return env


def _programs(model: onnx.ModelProto) -> dict:
    """``model``'s rank program for the cuda target with float16 products, by arch (sm_80: no
    channels-last pass, the reference; sm_90)."""
    return {arch: rank_passes(load_onnx(model), OptimizationConfig.from_dict(
        {"target": "cuda", "precision": "float16", "arch": arch})) for arch in ("sm_80", "sm_90")}


def _kernels(rg):
    """``rg``'s kernels as the cuda target builds them for sm_90 with float16 products: the source,
    the groups that have a kernel (views left out) and the program's constants by name."""
    consts = {t.name: t.value for op in rg.nodes for t in op.inputs if t.value is not None}
    groups = kernel_groups(list(rg.nodes), "sm_90", keep=[t.name for t in rg.outputs],
                           views=[op.name for op in rg.nodes if _is_view(op)])
    src = generate_cuda_source(groups, arch="sm_90", precision="float16")
    return src, [g for g in groups if g.name in src.launches], consts


def _conv_kinds(src, groups) -> dict:
    """The kernel kind of each conv (by its output's name)."""
    kinds = {}
    for g in groups:
        conv = [m for m in getattr(g, "members", [g]) if m.op_type == "Conv"]
        if conv:
            kinds[conv[0].outputs[0].name] = src.launches[g.name].kind
    return kinds


@pytest.mark.parametrize("model_dtype", ["float32", "float16"])
def test_convs_read_a_channels_last_copy_on_hopper(tmp_path, model_dtype):
    """The two convs of ``x`` read one channels-last copy of its half values (the cast to half
    fuses into the copy's kernel, whose output is written), their weights stored ``[OC, KH, KW,
    C]``, and they take the wgmma template; so does the conv of ``y``, its copy and weight padded
    to 16 channels with zeros (the pad in the copy's kernel), the patch embedding, with no copy, and
    c7, whose image the strided conv's kernel stores channels-last (its ReLU and cast fused before
    ReLU, in channels-last order: no copy); the 1x1 and grouped convs are as before.
    ``channels_last: False`` (or sm_80) leaves them alone. The graph computes what it computed
    without the pass (sm_80); every kernel runs on
    the host emulation against the evaluator. A float16 model's convs read its half image directly."""
    from cuda_host import build
    from test_cuda_host import _check_kernels

    half = model_dtype == "float16"
    graph = load_onnx(_model(TensorProto.FLOAT16 if half else TensorProto.FLOAT))
    rng = np.random.default_rng(1)
    feeds = {t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in graph.inputs}
    progs = _programs(_model(TensorProto.FLOAT16 if half else TensorProto.FLOAT))
    rg = progs["sm_90"]
    copies = [op for op in rg.nodes if channels_last_copy(op)]
    assert [(op.inputs[0].shape, op.outputs[0].shape) for op in copies] == [
        ((2, 16, 10, 12), (2, 10, 12, 16)), ((1, 16, 8, 8), (1, 8, 8, 16))]
    assert not any(channels_last_copy(op) for op in progs["sm_80"].nodes)
    off = OptimizationConfig.from_dict({"target": "cuda", "precision": "float16", "channels_last": False})
    assert not any(channels_last_copy(op) for op in rank_passes(load_onnx(_model(TensorProto.FLOAT16 if half else
                                                                               TensorProto.FLOAT)), off).nodes)
    weights = sorted(t.shape for op in rg.nodes for t in op.inputs if t.is_constant and t.name.endswith(".ohwi"))
    assert weights == [(16, 3, 3, 16), (16, 3, 3, 24), (24, 3, 3, 16), (32, 3, 3, 16)]
    env = _evaluate(rg, feeds)
    ref = _evaluate(progs["sm_80"], feeds)
    for t in rg.outputs:  # (the padded channels' zeros may change the order of c5's float32 sums)
        np.testing.assert_allclose(env[t.name], ref[t.name], rtol=1e-5, atol=1e-5 * float(np.abs(ref[t.name]).max()))

    src, groups, consts = _kernels(rg)
    members = {g.name: [m.op_type for m in getattr(g, "members", [g])] for g in groups}
    cast = [] if half else ["Cast"]
    copying = [members[g.name] for g in groups if any(channels_last_copy(m) for m in getattr(g, "members", [g]))]
    assert sorted(copying) == sorted([cast + ["Transpose"], cast + ["Pad", "Transpose"]])
    # (c2's ReLU, read by c7 alone: c2's kernel stores its output channels-last, then the ReLU)
    stored = [members[g.name] for g in groups if any(channels_last_output(m) for m in getattr(g, "members", [g]))]
    assert [m[m.index("Conv"):] for m in stored] == [["Conv", "Transpose", "Activation"] + cast]
    kinds = _conv_kinds(src, groups)
    assert kinds == {"c1": "gemm-wgmma-f16", "c2": "gemm-wgmma-f16", "c3": "gemm-wgmma-f16", "c4": "gemv",
                     "c5": "gemm-wgmma-f16", "c6": "gemm-wgmma-f16", "c7": "gemm-wgmma-f16"}
    _check_kernels("convs", build(src.text, str(tmp_path)), src, groups, env, consts)


def _blocks(dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    """A ResNet-like chain on ``x [2, 16, 8, 8]``: a 1x1 conv, ReLU, a padded 3x3 conv, ReLU, a 1x1
    conv, the residual add of ``x`` and a ReLU (``o1``), then a per-channel scale, its concatenation
    with ``o1`` and a strided 3x3 conv (``o``, a graph output), a global pool of ``o1`` (``gp``),
    and a 3x3 conv of ``o1``'s 2x2 max pool whose output is reshaped (``flat``)."""
    rng = np.random.default_rng(0)
    npt = helper.tensor_dtype_to_np_dtype(dtype)

    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / 4).astype(npt), name)

    inits = [w("w1", 32, 16, 1, 1), w("b1", 32), w("w2", 32, 32, 3, 3), w("w3", 16, 32, 1, 1), w("w4", 32, 32, 3, 3),
             w("s", 1, 16, 1, 1), w("w5", 16, 16, 3, 3), numpy_helper.from_array(np.array([2, -1], np.int64), "shp")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3"], ["c3"]),
             helper.make_node("Add", ["c3", "x"], ["a"]),
             helper.make_node("Relu", ["a"], ["o1"]),
             helper.make_node("Mul", ["o1", "s"], ["o2"]),
             helper.make_node("Concat", ["o2", "o1"], ["q"], axis=1),
             helper.make_node("Conv", ["q", "w4"], ["c4"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c4"], ["o"]),
             helper.make_node("GlobalAveragePool", ["o1"], ["gp"]),
             helper.make_node("MaxPool", ["o1"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "w5"], ["c5"], pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["c5", "shp"], ["flat"])]
    io = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "blocks", [io("x", dtype, [2, 16, 8, 8])],
                              [io("o", dtype, [2, 32, 4, 4]), io("gp", dtype, [2, 16, 1, 1]),
                               io("flat", dtype, [2, 256])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("model_dtype", ["float32", "float16"])
def test_activations_stay_channels_last_between_convs(tmp_path, model_dtype):
    """Decision 61: c1, c2 and c3 store their outputs channels-last and the ReLUs, the residual add
    (``x`` read through a transpose), the scale (its constant transposed) and the concatenation
    (along the last axis) follow, so no image is copied: the strided conv gathers ``q``, c2 too, c3 reads
    ``r2`` as a matrix, the global pool reads ``o1`` through a transpose, the max pool reads it
    and writes ``p`` channels-last in its kernel, which c5 gathers. ``o`` (a graph output) and
    ``c5`` (reshaped) stay NCHW. Every conv takes wgmma; the graph computes what
    the sm_80 program computes, and every kernel runs on the host emulation against the evaluator.
    A float32 model's image casts to half stay kernels of their own where the float32 values have
    other readers (``o1``: the max pool's kernel casts ``p``), now channels-last too."""
    from cuda_host import build
    from test_cuda_host import _check_kernels

    half = model_dtype == "float16"
    dtype = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    progs = _programs(_blocks(dtype))
    rg = progs["sm_90"]
    assert not any(channels_last_copy(op) for op in rg.nodes)
    stored = sorted(op.inputs[0].name for op in rg.nodes if channels_last_output(op))
    assert stored == ["c1", "c2", "c3", "p"]
    rng = np.random.default_rng(1)
    feeds = {t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in rg.inputs}
    env, ref = _evaluate(rg, feeds), _evaluate(progs["sm_80"], feeds)
    for t in rg.outputs:
        np.testing.assert_allclose(env[t.name], ref[t.name], rtol=1e-5, atol=1e-5 * float(np.abs(ref[t.name]).max()))

    src, groups, consts = _kernels(rg)
    members = {g.name: [m.op_type for m in getattr(g, "members", [g])] for g in groups}
    kinds = _conv_kinds(src, groups)
    assert kinds == dict.fromkeys(["c1", "c2", "c3", "c4", "c5"], "gemm-wgmma-f16")
    rest = sorted(members[g.name] for g in groups if "Conv" not in members[g.name])
    cast = [] if half else ["Cast"]
    # (the scale and concatenation, read by the strided conv alone; the max pool; the global pool;
    # x's half values)
    assert rest == sorted([["Binary", "Concat"] + cast, ["Transpose", "Pool", "Transpose"] + cast,
                           ["Transpose", "GlobalPool"]] + ([] if half else [["Cast"]])), rest
    assert all(src.launches[g.name].kind != "transpose" for g in groups)
    out_shapes = {g.outputs[0].name: g.outputs[0].shape for g in groups}
    assert out_shapes["Relu(o1).nhwc:0"] == (2, 8, 8, 16) and out_shapes["o"] == (2, 32, 4, 4)
    _check_kernels("blocks", build(src.text, str(tmp_path)), src, groups, env, consts)


@pytest.mark.parametrize("model_dtype", ["float32", "float16"])
def test_an_unfolded_batch_norm_follows_channels_last(tmp_path, model_dtype):
    """Decision 61: a BatchNorm that no conv took (here: after a concatenation of a conv's output
    and the image, as in a DenseNet) becomes ``(x - mean) * factor + bias`` on the channels-last
    values, its factor computed at compile time as the op computes it (in float32, or in float16
    for a float16 export: session 52), so the 3x3 conv after it gathers what the concatenation's
    kernel wrote (no copy, no transposing kernel); the values are the sm_80 program's, and every
    kernel runs on the host emulation."""
    from cuda_host import build
    from test_cuda_host import _check_kernels

    rng = np.random.default_rng(0)
    half = model_dtype == "float16"
    dtype = TensorProto.FLOAT16 if half else TensorProto.FLOAT

    def w(name, *shape, lo=None):
        v = rng.standard_normal(shape).astype(model_dtype) / 4
        return numpy_helper.from_array(np.abs(v) + lo if lo is not None else v, name)

    inits = [w("w1", 16, 16, 1, 1), w("w2", 16, 32, 3, 3), w("s", 32, lo=0.5), w("b", 32), w("m", 32),
             w("v", 32, lo=0.1)]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"]),
             helper.make_node("Concat", ["c1", "x"], ["q"], axis=1),
             helper.make_node("BatchNormalization", ["q", "s", "b", "m", "v"], ["n"], epsilon=1e-3),
             helper.make_node("Relu", ["n"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1])]
    io = helper.make_tensor_value_info
    model = helper.make_model(helper.make_graph(nodes, "dense", [io("x", dtype, [2, 16, 8, 8])],
                                                [io("y", dtype, [2, 16, 8, 8])], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    progs = _programs(model)
    rg = progs["sm_90"]
    assert not any(channels_last_copy(op) or op.op_type == "BatchNorm" for op in rg.nodes)
    assert [op.inputs[0].name for op in rg.nodes if channels_last_output(op)] == ["c1"]
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 16, 8, 8)).astype(model_dtype)}
    env, ref = _evaluate(rg, feeds), _evaluate(progs["sm_80"], feeds)
    if half:  # (the BatchNorm's values exactly; the convs' sums in another order)
        np.testing.assert_array_equal(env["Relu(r).nhwc:0"], np.transpose(ref["r"], (0, 2, 3, 1)))
    tol = 1e-3 if half else 1e-6
    np.testing.assert_allclose(env["y"].astype(np.float32), ref["y"].astype(np.float32), rtol=tol,
                               atol=tol * float(np.abs(ref["y"]).max()))

    src, groups, consts = _kernels(rg)
    kinds = sorted((src.launches[g.name].kind, tuple(m.op_type for m in getattr(g, "members", [g]))) for g in groups)
    if half:
        assert kinds == [("elementwise", ("Transpose", "Concat", "Binary", "Binary", "Binary", "Activation")),
                         ("gemm-wgmma-f16", ("Conv", "Transpose")),
                         ("gemm-wgmma-f16", ("Transpose", "Transpose", "Conv"))], kinds
    else:
        assert kinds == [("elementwise", ("Cast",)),  # (x's half values for c1)
                         ("elementwise", ("Transpose", "Concat", "Binary", "Binary", "Binary", "Activation", "Cast")),
                         ("gemm-wgmma-f16", ("Cast", "Cast", "Conv", "Transpose")),
                         ("gemm-wgmma-f16", ("Transpose", "Cast", "Transpose", "Cast", "Conv"))], kinds
    _check_kernels("dense", build(src.text, str(tmp_path)), src, groups, env, consts)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_a_resize_between_convs_reads_and_writes_channels_last(tmp_path, mode):
    """Decision 61: a 2x upsampling between two convs (a feature pyramid's, a UNet decoder's) runs
    between a transpose back and one forward, in one kernel that reads the first conv's
    channels-last output and writes the second conv's channels-last image: no copy, no transposing
    kernel; values as the sm_80 program's, every kernel on the host emulation."""
    from cuda_host import build
    from test_cuda_host import _check_kernels

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) / 4).astype(np.float16), n)
             for n, s in (("w1", (32, 16, 1, 1)), ("w2", (16, 32, 3, 3)))]
    inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"]),
             helper.make_node("Relu", ["c1"], ["r"]),
             helper.make_node("Resize", ["r", "", "scales"], ["u"], mode=mode),
             helper.make_node("Conv", ["u", "w2"], ["y"], pads=[1, 1, 1, 1])]
    io = helper.make_tensor_value_info
    model = helper.make_model(helper.make_graph(nodes, "up", [io("x", TensorProto.FLOAT16, [2, 16, 8, 6])],
                                                [io("y", TensorProto.FLOAT16, [2, 16, 16, 12])], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    progs = _programs(model)
    rg = progs["sm_90"]
    assert not any(channels_last_copy(op) for op in rg.nodes)
    assert sorted(op.inputs[0].name for op in rg.nodes if channels_last_output(op)) == ["c1", "u"]
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 16, 8, 6)).astype(np.float16)}
    env, ref = _evaluate(rg, feeds), _evaluate(progs["sm_80"], feeds)
    np.testing.assert_allclose(env["y"].astype(np.float32), ref["y"].astype(np.float32), rtol=1e-3, atol=1e-3)

    src, groups, consts = _kernels(rg)
    kinds = sorted((src.launches[g.name].kind, tuple(m.op_type for m in getattr(g, "members", [g]))) for g in groups)
    assert kinds == [("elementwise", ("Transpose", "Resize", "Transpose")),
                     ("gemm-wgmma-f16", ("Conv", "Transpose", "Activation")),
                     ("gemm-wgmma-f16", ("Transpose", "Transpose", "Conv"))], kinds
    _check_kernels("up", build(src.text, str(tmp_path)), src, groups, env, consts)


def _grouped(dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    """A ResNeXt-like block on ``x [2, 32, 8, 8]``: a 1x1 conv and ReLU, a padded 3x3 conv of 4
    groups (16 channels a group) with a bias, ReLU, a 1x1 conv, the residual add of ``x`` and a
    ReLU, then a strided 3x3 conv of 2 groups (16 channels in, 32 out a group) and a ReLU (``o``, a
    graph output)."""
    rng = np.random.default_rng(0)
    npt = helper.tensor_dtype_to_np_dtype(dtype)

    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / 4).astype(npt), name)

    inits = [w("w1", 64, 32, 1, 1), w("w2", 64, 16, 3, 3), w("b2", 64), w("w3", 32, 64, 1, 1), w("w4", 64, 16, 3, 3)]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], group=4),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3"], ["c3"]),
             helper.make_node("Add", ["c3", "x"], ["a"]),
             helper.make_node("Relu", ["a"], ["o1"]),
             helper.make_node("Conv", ["o1", "w4"], ["c4"], pads=[1, 1, 1, 1], strides=[2, 2], group=2),
             helper.make_node("Relu", ["c4"], ["o"])]
    return _onnx(nodes, "grouped", [("x", dtype, [2, 32, 8, 8])], [("o", dtype, [2, 64, 4, 4])], inits)


@pytest.mark.parametrize("model_dtype", ["float32", "float16"])
def test_grouped_convs_on_the_tensor_cores(tmp_path, model_dtype):
    """Decision 62: a grouped conv's output channel, split into group (a batch axis of the product)
    and channel in the group (its columns), makes it a GEMM per group. On sm_90 both grouped convs
    take wgmma, gathering their channels-last images (16-channel runs of their own group) and
    storing channels-last like the 1x1 convs between them: no copy, no transposing kernel; their
    weights are stored ``[OC, KH, KW, C/group]``. On sm_80 they take the portable tensor-core
    template on NCHW values (before: a GEMV kernel). Both programs compute what the graph
    computes without the passes, and every kernel of both runs on the host emulation against the
    evaluator."""
    from cuda_host import build
    from test_cuda_host import _check_kernels

    half = model_dtype == "float16"
    dtype = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    progs = _programs(_grouped(dtype))
    rg = progs["sm_90"]
    assert not any(channels_last_copy(op) for op in rg.nodes)
    assert sorted(op.inputs[0].name for op in rg.nodes if channels_last_output(op)) == ["c1", "c2", "c3"]
    weights = sorted(t.shape for op in rg.nodes for t in op.inputs if t.is_constant and t.name.endswith(".ohwi"))
    assert weights == [(64, 3, 3, 16), (64, 3, 3, 16)]
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 32, 8, 8)).astype(model_dtype)}
    env, ref = _evaluate(rg, feeds), _evaluate(progs["sm_80"], feeds)
    np.testing.assert_allclose(env["o"].astype(np.float32), ref["o"].astype(np.float32), rtol=1e-5,
                               atol=(2e-3 if half else 1e-5) * float(np.abs(ref["o"]).max()))

    src, groups, consts = _kernels(rg)
    assert _conv_kinds(src, groups) == dict.fromkeys(["c1", "c2", "c3", "c4"], "gemm-wgmma-f16")
    assert all(src.launches[g.name].kind != "transpose" for g in groups)
    _check_kernels("grouped", build(src.text, str(tmp_path)), src, groups, env, consts)

    (tmp_path / "sm80").mkdir()
    old = progs["sm_80"]
    consts = {t.name: t.value for op in old.nodes for t in op.inputs if t.value is not None}
    groups = kernel_groups(list(old.nodes), "sm_80", keep=["o"], views=[op.name for op in old.nodes if _is_view(op)])
    src = generate_cuda_source(groups, arch="sm_80", precision="float16")
    groups = [g for g in groups if g.name in src.launches]
    kinds = _conv_kinds(src, groups)
    assert kinds["c2"] == kinds["c4"] == "gemm-f16", kinds

    def check(got, want, name):  # (values rounded to half, stored as float32: one rounding may differ)
        w = want.astype(np.float32)
        np.testing.assert_allclose(got.astype(np.float32), w, rtol=2.0 ** -10, atol=2.0 ** -10 * float(np.abs(w).max()),
                                   err_msg=name)
    _check_kernels("grouped", build(src.text, str(tmp_path / "sm80")), src, groups, ref, consts, check=check)


def _inverted_residual(dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    """MobileNetV2's block at 14x14 pixels (196: not a multiple of 8, so its 1x1 convs gather a
    channels-last image): ``x [2, 16, 14, 14]`` -> 1x1 conv to 64 -> ReLU6 -> depthwise 3x3 -> ReLU6
    -> 1x1 conv to 16 -> the residual add of ``x`` (``y``)."""
    rng = np.random.default_rng(0)
    npt = helper.tensor_dtype_to_np_dtype(dtype)

    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / 4).astype(npt), name)

    inits = [w("w1", 64, 16, 1, 1), w("wd", 64, 1, 3, 3), w("bd", 64), w("w3", 16, 64, 1, 1),
             numpy_helper.from_array(np.array(0, npt), "lo"), numpy_helper.from_array(np.array(6, npt), "hi")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"]), helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"]),
             helper.make_node("Conv", ["r1", "wd", "bd"], ["d"], pads=[1, 1, 1, 1], group=64),
             helper.make_node("Clip", ["d", "lo", "hi"], ["r2"]), helper.make_node("Conv", ["r2", "w3"], ["c3"]),
             helper.make_node("Add", ["c3", "x"], ["y"])]
    return _onnx(nodes, "mbv2", [("x", dtype, [2, 16, 14, 14])], [("y", dtype, [2, 16, 14, 14])], inits)


@pytest.mark.parametrize("model_dtype", ["float32", "float16"])
def test_a_depthwise_conv_reads_and_stores_channels_last(tmp_path, model_dtype):
    """Decision 68: the depthwise conv reads the expanding conv's channels-last output and stores
    its own channels-last, which the projecting 1x1 conv reads as a matrix: the image's copy is
    the only one (before, the depthwise conv's output had a copy too: 196 pixels are no runs of
    8); both 1x1 convs on wgmma; the values are the sm_80 program's, and every kernel runs on the
    host emulation."""
    from cuda_host import build
    from test_cuda_host import _check_kernels

    half = model_dtype == "float16"
    progs = _programs(_inverted_residual(TensorProto.FLOAT16 if half else TensorProto.FLOAT))
    rg = progs["sm_90"]
    copied = [op.inputs[0].name for op in rg.nodes if channels_last_copy(op)]
    assert copied == ["x" if half else "Conv(c1).in0.float16:0"]
    assert sorted(op.inputs[0].name for op in rg.nodes if channels_last_output(op)) == ["c1", "d"]
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 16, 14, 14)).astype(model_dtype)}
    env, ref = _evaluate(rg, feeds), _evaluate(progs["sm_80"], feeds)
    tol = 1e-3 if half else 1e-5
    np.testing.assert_allclose(env["y"].astype(np.float32), ref["y"].astype(np.float32), rtol=tol,
                               atol=tol * float(np.abs(ref["y"]).max()))

    src, groups, consts = _kernels(rg)
    kinds = _conv_kinds(src, groups)
    assert kinds["c1"] == kinds["c3"] == "gemm-wgmma-f16" and not kinds["d"].startswith("gemm"), kinds
    assert [src.launches[g.name].kind for g in groups].count("transpose") == 1  # (x's copy)
    _check_kernels("mbv2", build(src.text, str(tmp_path)), src, groups, env, consts)


def _up(dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    """A UNet decoder step: ``x [2, 16, 8, 8]`` -> 1x1 conv -> ReLU -> 2x2 transposed conv at stride 2
    (a bias) -> ReLU, concatenated with ``z [2, 16, 16, 16]``'s 1x1 conv and ReLU (the skip), ->
    padded 3x3 conv (``y``)."""
    rng = np.random.default_rng(0)
    npt = helper.tensor_dtype_to_np_dtype(dtype)

    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / 4).astype(npt), name)

    inits = [w("w1", 32, 16, 1, 1), w("wt", 32, 16, 2, 2), w("bt", 16), w("w3", 16, 16, 1, 1), w("w4", 16, 32, 3, 3)]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("ConvTranspose", ["r1", "wt", "bt"], ["u"], strides=[2, 2]),
             helper.make_node("Relu", ["u"], ["ru"]),
             helper.make_node("Conv", ["z", "w3"], ["s"]), helper.make_node("Relu", ["s"], ["rs"]),
             helper.make_node("Concat", ["ru", "rs"], ["q"], axis=1),
             helper.make_node("Conv", ["q", "w4"], ["y"], pads=[1, 1, 1, 1])]
    return _onnx(nodes, "up", [("x", dtype, [2, 16, 8, 8]), ("z", dtype, [2, 16, 16, 16])],
                 [("y", dtype, [2, 16, 16, 16])], inits)


@pytest.mark.parametrize("model_dtype", ["float32", "float16"])
def test_a_transposed_conv_reads_and_stores_channels_last(tmp_path, model_dtype):
    """Decision 67: the 2x2 transposed conv (one product, decision 65) reads the 1x1 conv's
    channels-last output as a matrix and stores its own channels-last (its weight stored ``[C, 2,
    2, OC]``, so that the product's columns run like the output's), which the concatenation and
    the 3x3 conv take as they are: no copy, no transposing kernel, every product on wgmma; the
    values are the sm_80 program's, and every kernel runs on the host emulation."""
    from cuda_host import build
    from test_cuda_host import _check_kernels

    half = model_dtype == "float16"
    progs = _programs(_up(TensorProto.FLOAT16 if half else TensorProto.FLOAT))
    rg = progs["sm_90"]
    assert not any(channels_last_copy(op) for op in rg.nodes)
    assert sorted(op.inputs[0].name for op in rg.nodes if channels_last_output(op)) == ["c1", "s", "u"]
    assert [t.shape for op in rg.nodes for t in op.inputs if t.is_constant and t.name.endswith(".iohw")] == \
        [(32, 2, 2, 16)]
    rng = np.random.default_rng(1)
    feeds = {t.name: rng.standard_normal(t.shape).astype(model_dtype) for t in rg.inputs}
    env, ref = _evaluate(rg, feeds), _evaluate(progs["sm_80"], feeds)
    tol = 1e-3 if half else 1e-5
    np.testing.assert_allclose(env["y"].astype(np.float32), ref["y"].astype(np.float32), rtol=tol,
                               atol=tol * float(np.abs(ref["y"]).max()))

    src, groups, consts = _kernels(rg)
    kinds = {m.outputs[0].name: src.launches[g.name].kind for g in groups for m in getattr(g, "members", [g])
             if m.op_type in ("Conv", "ConvTranspose")}
    assert kinds == dict.fromkeys(["c1", "u", "s", "y"], "gemm-wgmma-f16"), kinds
    assert all(src.launches[g.name].kind != "transpose" for g in groups)
    _check_kernels("up", build(src.text, str(tmp_path)), src, groups, env, consts)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", ["blocks", "grouped", "up", "mbv2"])
@pytest.mark.parametrize("model_dtype", ["float32", "float16"])
def test_channels_last_blocks_on_the_gpu(tmp_path, model_dtype, blocks):
    """Decisions 61, 62, 67 and 68 on a GPU: :func:`_blocks` (or :func:`_grouped`, :func:`_up`,
    :func:`_inverted_residual`) compiled for sm_90 with float16 products (a float32 export) or as
    it is (a float16 export), run eagerly and from its CUDA graph, against onnxruntime within
    float16's tolerance (rfcs/0004)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("needs a CUDA device")
    except Exception:  # noqa: BLE001
        pytest.skip("needs cupy and a CUDA device")
    ort = pytest.importorskip("onnxruntime")
    from shardflow.compiler import compile
    from shardflow.runtime import load

    model = {"blocks": _blocks, "grouped": _grouped, "up": _up, "mbv2": _inverted_residual}[blocks](
        TensorProto.FLOAT16 if model_dtype == "float16" else TensorProto.FLOAT)
    path = tmp_path / "blocks.onnx"
    onnx.save(model, path)
    compile(path, distributed_config={"mesh_shape": [1], "algo": "replicate"},
            optimization_config={"target": "cuda", "arch": "sm_90", "precision": "float16"}, out_dir=tmp_path / "o")
    rng = np.random.default_rng(1)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(model_dtype)
             for i in model.graph.input}
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ref = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    prog = load(tmp_path / "o")
    for _ in range(2):  # eager, then the captured graph
        got = prog.run(feeds)
        for k, v in ref.items():
            v = v.astype(np.float32)
            np.testing.assert_allclose(np.asarray(got[k], np.float32), v, rtol=5e-3,
                                       atol=5e-3 * float(np.abs(v).max()), err_msg=k)
