"""Convolutions that the cuda target computes as products once their output axes are split
(``codegen/cuda.py`` ``_split_divided_axes``): transposed convolutions of non-overlapping windows
(rfcs/0005 decision 65: the op's compute reads input ``o // s`` at tap ``o % s``; the product's
rows are the input pixels, its columns the output channels and taps) or of overlapping ones whose
kernel is a multiple of the stride (decision 69: a product per phase), and grouped convs whose
output a channel shuffle's reshape splits (decision 66). Before, generic or GEMV kernels.
Checked against onnxruntime and, kernel by kernel, on the host emulation. (Grouped convs in
channels-last regions: test_channels_last.py.) Also: a half model's sums in the generic kernels add
exact products (rfcs/0004, session 53)."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import load_onnx
from shardflow.compiler.codegen.cuda import generate_cuda_source, kernel_groups
from shardflow.compiler.driver import OptimizationConfig, _is_view, rank_passes


def _model(dtype, c: int, oc: int, group: int, k: int, hw: tuple[int, int], window: int | None = None):
    """``x [2, c, *hw]`` -> ConvTranspose (``k``x``k`` taps, stride ``k``, ``group`` groups, a bias)
    -> ReLU; with ``window`` the kernel is ``window``x``window`` instead, padded by one (windows that
    overlap: the general form)."""
    rng = np.random.default_rng(0)
    npt = helper.tensor_dtype_to_np_dtype(dtype)
    kk = window or k
    inits = [numpy_helper.from_array((rng.standard_normal((c, oc // group, kk, kk)) / 4).astype(npt), "w"),
             numpy_helper.from_array(rng.standard_normal(oc).astype(npt), "b")]
    attrs = {"strides": [k, k], "group": group} | ({"pads": [1, 1, 1, 1]} if window else {})
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["c"], **attrs), helper.make_node("Relu", ["c"], ["y"])]
    out = [(n - 1) * k + kk - (2 if window else 0) for n in hw]
    io = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "up", [io("x", dtype, [2, c, *hw])], [io("y", dtype, [2, oc, *out])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _program(model, feeds: dict, arch: str):
    """``model``'s program for ``arch`` with float16 products: its graph evaluated on ``feeds``
    (checked against onnxruntime within float16's tolerance), the source, the groups that have a
    kernel and the constants by name."""
    ort = pytest.importorskip("onnxruntime")
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    rg = rank_passes(load_onnx(model), OptimizationConfig.from_dict({"target": "cuda", "precision": "float16",
                                                                      "arch": arch}))
    env = dict(feeds)
    for op in rg.nodes:
        env.update(zip((t.name for t in op.outputs), op.run(*[env[t.name] if t.name in env else t.value
                                                              for t in op.inputs])))
    np.testing.assert_allclose(env["y"].astype(np.float32), want.astype(np.float32), rtol=5e-3,
                               atol=5e-3 * float(np.abs(want).max()))
    consts = {t.name: t.value for op in rg.nodes for t in op.inputs if t.value is not None}
    groups = kernel_groups(list(rg.nodes), arch, keep=["y"], views=[op.name for op in rg.nodes if _is_view(op)])
    src = generate_cuda_source(groups, arch=arch, precision="float16")
    return env, src, [g for g in groups if g.name in src.launches], consts


CASES = {  # name: (c, oc, group, k, hw, window)
    "sam": (32, 16, 1, 2, (6, 8), None),  # SAM's mask decoder, a UNet's up-convolution: 2x2, stride 2
    "grouped": (32, 32, 2, 2, (6, 8), None),
    "odd": (16, 24, 1, 3, (5, 3), None),  # (3x3 at stride 3, pixels not a multiple of 8)
    "overlapping": (16, 16, 1, 2, (5, 4), 4),  # (4x4 at stride 2, padded: DCGAN's, pix2pix's; decision 69)
    "general": (16, 16, 1, 2, (5, 4), 3),  # (3x3 at stride 2: the kernel no multiple of the stride)
}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("model_dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_transposed_convs_are_products(tmp_path, case, model_dtype, arch):
    """The program (float16 products) against onnxruntime within float16's tolerance; the
    transposed conv's kernel a tensor-core GEMM (on sm_90 the wgmma template where its pixels make
    runs of 8 and the windows do not overlap; overlapping windows whose kernel is a multiple of the
    stride a product per phase, decision 69), a kernel no multiple of the stride still a generic
    one; every kernel on the host emulation
    against the evaluator."""
    from cuda_host import build
    from test_cuda_host import _check_kernels

    dtype = TensorProto.FLOAT16 if model_dtype == "float16" else TensorProto.FLOAT
    c, oc, group, k, hw, window = CASES[case]
    model = _model(dtype, c, oc, group, k, hw, window)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, c, *hw)).astype(model_dtype)}
    env, src, groups, consts = _program(model, feeds, arch)
    kind = next(src.launches[g.name].kind for g in groups
                if any(m.op_type == "ConvTranspose" for m in getattr(g, "members", [g])))
    if window == 3:  # (the general form: every tap of the window, most guarded off)
        assert not kind.startswith("gemm"), kind
    elif arch == "sm_90" and hw[0] * hw[1] % 8 == 0 and not window:
        assert kind == "gemm-wgmma-f16", kind
    else:  # (the overlapping windows' phases read the image at non-affine offsets: the portable template)
        assert kind == "gemm-f16", kind
    _check_kernels(case, build(src.text, str(tmp_path)), src, groups, env, consts)


def test_divisions_the_ranges_decide_are_simplified():
    """``X // c`` and ``X % c`` of an affine ``X`` whose remainder terms stay in ``[0, c)``."""
    from shardflow.compiler.codegen.cuda import _simplified_divisions
    from shardflow.compiler.ir.expr import Var, format_expr

    g, o, c = Var("g", 4), Var("o", 16), Var("c", 8)
    e = ((g * 16 + o) // 16) * 8 + c + (g * 16 + o) % 16
    assert format_expr(_simplified_divisions(e)) == format_expr(g * 8 + c + o)
    shifted = (g * 16 + o + 3) // 16  # (o + 3 reaches 18: not decided)
    assert _simplified_divisions(shifted) is shifted
    assert format_expr(_simplified_divisions((g * 32 + c + 35) // 16)) == format_expr(g * 2 + 2)  # (c + 3 < 16)


def _shuffle_model(dtype):
    """``x [2, 64, 8, 8]`` -> 1x1 conv of 4 groups (16 channels a group) -> ReLU -> channel shuffle
    (reshape to ``[2, 4, 16, 8, 8]``, swap the two, reshape back) -> 1x1 conv of 4 groups -> ``y``,
    as ShuffleNet's units."""
    rng = np.random.default_rng(0)
    npt = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [numpy_helper.from_array((rng.standard_normal((64, 16, 1, 1)) / 4).astype(npt), n) for n in ("w1", "w2")]
    inits += [numpy_helper.from_array(np.array(s, np.int64), n) for n, s in (("s5", [2, 4, 16, 8, 8]),
                                                                            ("s4", [2, 64, 8, 8]))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], group=4), helper.make_node("Relu", ["c1"], ["r"]),
             helper.make_node("Reshape", ["r", "s5"], ["r5"]),
             helper.make_node("Transpose", ["r5"], ["t5"], perm=[0, 2, 1, 3, 4]),
             helper.make_node("Reshape", ["t5", "s4"], ["q"]), helper.make_node("Conv", ["q", "w2"], ["y"], group=4)]
    io = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "shuffle", [io("x", dtype, [2, 64, 8, 8])], [io("y", dtype, [2, 64, 8, 8])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("model_dtype", ["float32", "float16"])
def test_a_channel_shuffle_keeps_the_grouped_convs_products(tmp_path, model_dtype, arch):
    """Decision 66: with the shuffle's first reshape fused as the first conv's epilogue, the conv's
    output axes are already ``(g, o)`` and it reads input channel ``((g * 16 + o) // 16) * 16 +
    c``; simplified, the group is the product's batch axis. Both grouped convs are tensor-core
    GEMMs; the program against onnxruntime; every kernel on the host emulation."""
    from cuda_host import build
    from test_cuda_host import _check_kernels

    dtype = TensorProto.FLOAT16 if model_dtype == "float16" else TensorProto.FLOAT
    model = _shuffle_model(dtype)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 64, 8, 8)).astype(model_dtype)}
    env, src, groups, consts = _program(model, feeds, arch)
    convs = {m.outputs[0].name: src.launches[g.name].kind for g in groups for m in getattr(g, "members", [g])
             if m.op_type == "Conv"}
    assert sorted(convs) == ["c1", "y"] and all(k.startswith("gemm-") and k.endswith("f16") for k in convs.values()), \
        convs
    _check_kernels("shuffle", build(src.text, str(tmp_path)), src, groups, env, consts)


def _half_sums():
    """float16 models whose sums take the generic kernels: a transposed conv whose kernel is no
    multiple of its stride (3x3 at stride 2) and a grouped conv with a bias, of few outputs (a warp
    each)."""
    rng = np.random.default_rng(0)
    io = helper.make_tensor_value_info
    f16 = TensorProto.FLOAT16
    models = {}
    w = numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) / 4).astype(np.float16), "w")
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], pads=[1, 1, 1, 1])]
    models["transposed"] = (helper.make_graph(nodes, "t", [io("x", f16, [2, 16, 5, 4])], [io("y", f16, [2, 16, 9, 7])],
                                              [w]), (2, 16, 5, 4))
    w = numpy_helper.from_array((rng.standard_normal((24, 8, 3, 2)) / 4).astype(np.float16), "w")
    b = numpy_helper.from_array(rng.standard_normal(24).astype(np.float16), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[2, 1, 1, 0], strides=[2, 3], group=2)]
    models["grouped"] = (helper.make_graph(nodes, "g", [io("x", f16, [1, 16, 5, 6])], [io("y", f16, [1, 24, 3, 2])],
                                           [w, b]), (1, 16, 5, 6))
    return {k: (helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), shape)
            for k, (g, shape) in models.items()}


@pytest.mark.parametrize("case", ["transposed", "grouped"])
def test_half_sums_add_exact_products(tmp_path, case):
    """A float16 sum of products accumulates in float32 the exact products of its half operands
    (``_Emitter._exact_product``): the generic kernel's output is the float64 sum rounded to float16
    (then the bias added), within one float16 step (the sum is rounded once; before, each product was rounded to
    float16 first, off by hundreds of steps where the sum cancels). The reference evaluator too (ConvTranspose's numpy
    summed the overlapping taps in float16, off by up to 6 steps)."""
    from cuda_host import build, run

    model, shape = _half_sums()[case]
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float16)
    env, src, groups, consts = _program(model, {"x": x}, "sm_90")
    (g,) = groups
    launch = src.launches[g.name]
    assert launch.kind == "row", launch.kind  # (a warp an output)
    op = getattr(g, "members", [g])[0]
    weights = [consts[t.name] for t in op.inputs[1:]]
    truth = op.numpy(x.astype(np.float64), weights[0].astype(np.float64))[0]  # (the sum, no bias)
    got = run(build(src.text, str(tmp_path)), launch, [x, *weights], [(truth.shape, np.float16)])[0]
    if len(weights) > 1:  # (the sum rounded, then the bias added in float16: the op's compute)
        truth = (truth.astype(np.float16) + weights[1].reshape(-1, 1, 1)).astype(np.float64)
    step = np.spacing(np.abs(truth).astype(np.float16)).astype(np.float64)  # (float16's step at each value)
    for name, y in (("kernel", got), ("evaluator", env["y"])):
        assert y.dtype == np.float16
        err = np.abs(y.astype(np.float64) - truth) / step
        assert err.max() <= 1.0, (name, float(err.max()))
