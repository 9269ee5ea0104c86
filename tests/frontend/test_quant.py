"""QuantizeLinear / DequantizeLinear (handlers_quant) against onnxruntime and the ONNX reference."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from shardflow.compiler import DtypeError, ShapeError, load_onnx
from shardflow.compiler.parallel import partition, search, simulate

NP2ONNX = {np.dtype(k): v for k, v in [("float32", TensorProto.FLOAT), ("float16", TensorProto.FLOAT16),
                                       ("int8", TensorProto.INT8), ("uint8", TensorProto.UINT8),
                                       ("int16", TensorProto.INT16), ("uint16", TensorProto.UINT16),
                                       ("int32", TensorProto.INT32)]}


def one_node(op, x, scale, zp, out_dtype, opset, **attrs):
    """A model of one ``op`` node; ``x`` is the graph input, scale and zero point are initializers."""
    inits = [numpy_helper.from_array(scale, "scale")] + ([numpy_helper.from_array(zp, "zp")] if zp is not None
                                                         else [])
    node = helper.make_node(op, ["x", "scale"] + (["zp"] if zp is not None else []), ["y"], name="q", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", NP2ONNX[x.dtype], list(x.shape))],
                          [helper.make_tensor_value_info("y", NP2ONNX[np.dtype(out_dtype)], list(x.shape))], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(m)
    return m


def reference(m, feeds, use_ort):
    if use_ort:
        ort = pytest.importorskip("onnxruntime")
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    return ReferenceEvaluator(m).run(None, feeds)[0]


MODELS = Path(__file__).resolve().parents[1] / "models"
RNG = np.random.default_rng(0)
X = (RNG.standard_normal((3, 4, 6)) * 40).astype(np.float32)
X[0, 0, :4] = [0.5, 1.5, 2.5, -2.5]  # ties round to even
Q_CASES = [
    # id, scale, zero point, attrs, opset, use onnxruntime
    ("tensor-uint8-default", np.float32(0.7), None, {}, 13, True),
    ("tensor-int8", np.float32(1.0), np.int8(-3), {}, 13, True),
    ("axis1-uint8", np.array([0.5, 1, 2, 4], np.float32), np.array([0, 10, 128, 255], np.uint8), {"axis": 1}, 13,
     True),
    ("axis-neg-int16", np.linspace(0.01, 0.1, 6).astype(np.float32), np.arange(6).astype(np.int16) * 100,
     {"axis": -1}, 21, True),
    ("blocked-int8", np.abs(RNG.standard_normal((3, 2, 6))).astype(np.float32) + 0.1,
     RNG.integers(-5, 5, (3, 2, 6)).astype(np.int8), {"axis": 1, "block_size": 3}, 21, True),
    ("blocked-ragged-uint16", np.abs(RNG.standard_normal((3, 4, 2))).astype(np.float32) + 0.01, None,
     {"axis": 2, "block_size": 4, "output_dtype": TensorProto.UINT16}, 21, False),
    ("f16-scale-precision", np.float16(0.3), np.uint8(7), {"precision": TensorProto.FLOAT16}, 23, False),
]


@pytest.mark.parametrize("case", Q_CASES, ids=[c[0] for c in Q_CASES])
def test_quantize_linear(case):
    _, scale, zp, attrs, opset, use_ort = case
    out = zp.dtype if zp is not None else np.dtype({TensorProto.UINT16: "uint16"}.get(attrs.get("output_dtype"),
                                                                                        "uint8"))
    m = one_node("QuantizeLinear", X, np.asarray(scale), None if zp is None else np.asarray(zp), out, opset, **attrs)
    got = load_onnx(m).run({"x": X})["y"]
    want = reference(m, {"x": X}, use_ort)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


D_CASES = [
    ("tensor-uint8", np.uint8, np.float32(0.25), np.uint8(128), {}, 13, True),
    ("axis0-int8", np.int8, np.array([0.5, 2, 3], np.float32), np.array([-1, 0, 5], np.int8), {"axis": 0}, 13, True),
    ("int32-no-zero-point", np.int32, np.float32(1e-3), None, {}, 13, True),
    ("blocked-int16-f16", np.int16, (np.abs(RNG.standard_normal((3, 4, 3))) + 0.1).astype(np.float16),
     RNG.integers(-9, 9, (3, 4, 3)).astype(np.int16), {"axis": 2, "block_size": 2}, 21, True),
    ("output-dtype-uint16", np.uint16, np.float16(0.5), np.uint16(300), {"output_dtype": TensorProto.FLOAT}, 23,
     False),
]


@pytest.mark.parametrize("case", D_CASES, ids=[c[0] for c in D_CASES])
def test_dequantize_linear(case):
    _, dtype, scale, zp, attrs, opset, use_ort = case
    info = np.iinfo(dtype)
    x = RNG.integers(max(info.min, -30000), min(info.max, 30000), (3, 4, 6)).astype(dtype)
    out = {TensorProto.FLOAT: np.float32}.get(attrs.get("output_dtype"), np.asarray(scale).dtype)
    m = one_node("DequantizeLinear", x, np.asarray(scale), None if zp is None else np.asarray(zp), out, opset,
                 **attrs)
    got = load_onnx(m).run({"x": x})["y"]
    want = reference(m, {"x": x}, use_ort)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_bad_scales_name_the_node():
    x = np.zeros((2, 4), np.uint8)
    m = one_node("DequantizeLinear", x, np.ones(3, np.float32), None, np.float32, 13, axis=1)
    with pytest.raises(ShapeError, match=r"node q \(DequantizeLinear\): the scale of shape \[3\] is neither"):
        load_onnx(m)
    m = one_node("DequantizeLinear", x, np.ones((2, 3), np.float32), None, np.float32, 21, axis=1, block_size=2)
    with pytest.raises(ShapeError, match=r"does not block the input \[2, 4\] by 2 along axis 1 \(expected \[2, 2\]"):
        load_onnx(m)
    m = one_node("QuantizeLinear", x.astype(np.float32), np.float32(1), None, np.uint8, 21,
                 output_dtype=TensorProto.FLOAT4E2M1)
    with pytest.raises(DtypeError, match=r"node q attribute 'output_dtype'.*FLOAT4E2M1"):
        load_onnx(m)


def test_weight_only_int8_matmul_folds_and_shards():
    """An int8 weight with per-column scales dequantized before a MatMul: folded to a float32
    weight at import, then sharded over two ranks."""
    w = RNG.integers(-127, 127, (16, 8)).astype(np.int8)
    scale = (np.abs(RNG.standard_normal(8)) / 50).astype(np.float32)
    nodes = [helper.make_node("DequantizeLinear", ["w", "scale"], ["wf"], axis=1),
             helper.make_node("MatMul", ["x", "wf"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(scale, "scale")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    x = RNG.standard_normal((4, 16)).astype(np.float32)
    graph = load_onnx(m)
    assert [op.op_type for op in graph.nodes] == ["MatMul"]
    want = x @ (w.astype(np.float32) * scale)  # onnxruntime quantizes x on this pattern (its QDQ fusion)
    np.testing.assert_allclose(graph.run({"x": x})["y"], want, rtol=1e-5, atol=1e-5)
    got = simulate(partition(graph, search(graph, {"mesh_shape": [2]})), {"x": x})
    np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-5)


def _qconv_model(kind):
    """One ConvInteger (uint8 x and w, zero points) or QLinearConv (uint8 x, int8 w with per-channel
    scales and zero points, int32 bias, uint8 y) over a 1x3x7x6 image, 4 output channels, 3x3,
    padding 1, stride 2 along H."""
    rng = np.random.default_rng(3)
    attrs = {"pads": [1, 1, 1, 1], "strides": [2, 1], "kernel_shape": [3, 3]}
    if kind == "ConvInteger":
        inits = [numpy_helper.from_array(rng.integers(0, 256, (4, 3, 3, 3)).astype(np.uint8), "w"),
                 numpy_helper.from_array(np.array(128, np.uint8), "xzp"),
                 numpy_helper.from_array(np.array(120, np.uint8), "wzp")]
        node = helper.make_node("ConvInteger", ["x", "w", "xzp", "wzp"], ["y"], name="qc", **attrs)
        out = TensorProto.INT32
    else:
        inits = [numpy_helper.from_array(np.array(0.02, np.float32), "xs"),
                 numpy_helper.from_array(np.array(130, np.uint8), "xzp"),
                 # 7-bit weights: with full-range ones onnxruntime's uint8 x int8 convolution on an
                 # AVX2 machine was off by up to 26 (likely saturating int16 pair sums; the ONNX
                 # reference and Shardflow agreed): quantizers offer reduce_range for that
                 numpy_helper.from_array(rng.integers(-64, 64, (4, 3, 3, 3)).astype(np.int8), "w"),
                 numpy_helper.from_array(np.array([0.01, 0.02, 0.005, 0.03], np.float32), "ws"),
                 numpy_helper.from_array(np.zeros(4, np.int8), "wzp"),
                 numpy_helper.from_array(np.array(0.5, np.float32), "ys"),
                 numpy_helper.from_array(np.array(100, np.uint8), "yzp"),
                 numpy_helper.from_array(rng.integers(-3000, 3000, (4,)).astype(np.int32), "b")]
        node = helper.make_node("QLinearConv", ["x", "xs", "xzp", "w", "ws", "wzp", "ys", "yzp", "b"], ["y"],
                                name="qc", **attrs)
        out = TensorProto.UINT8
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 3, 7, 6])],
                          [helper.make_tensor_value_info("y", out, [1, 4, 4, 6])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("kind", ["ConvInteger", "QLinearConv"])
def test_quantized_conv_matches_onnxruntime_compiled_and_sharded(kind, tmp_path):
    """The integer convolutions import as an int32 Conv (plus the requantizing chain): the
    reference evaluation, a compiled cpu rank and a 2-rank split equal onnxruntime's output (the cpu
    target's integer conv: tests/driver/test_prepack.py)."""
    from shardflow.compiler import compile
    from shardflow.runtime import load

    m = _qconv_model(kind)
    x = np.random.default_rng(4).integers(0, 256, (1, 3, 7, 6)).astype(np.uint8)
    want = reference(m, {"x": x}, use_ort=True)
    np.testing.assert_array_equal(reference(m, {"x": x}, use_ort=False), want)
    g = load_onnx(m)
    np.testing.assert_array_equal(g.run({"x": x})["y"], want)
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    compile(str(path), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "out")
    np.testing.assert_array_equal(load(tmp_path / "out", rank=0).run({"x": x})["y"], want)
    plan = search(g, {"mesh_shape": [2], "algo": "megatron"})
    np.testing.assert_array_equal(simulate(partition(g, plan), {"x": x}, plan.mesh)["y"], want)


def _ort_int16_saturates() -> bool:
    """Whether this machine's onnxruntime MatMulInteger (uint8 x int8) departs from the exact int32
    product: its AVX2 kernel without VNNI sums pairs of products in saturating int16."""
    a, b = np.full((1, 2), 255, np.uint8), np.full((2, 1), 127, np.int8)
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "probe",
                              [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 2]),
                               helper.make_tensor_value_info("b", TensorProto.INT8, [2, 1])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])])
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return int(reference(probe, {"a": a, "b": b}, use_ort=True)[0, 0]) != 2 * 255 * 127


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_dynamically_quantized_transformer_matches_onnxruntime(name, tmp_path):
    """onnxruntime's ``quantize_dynamic`` (int8 weights, ``DynamicQuantizeLinear`` + ``MatMulInteger``
    per projection) declares no types for the quantized activations, which the opset-11 function
    body of ``DynamicQuantizeLinear`` needs to be converted to the model's opset 17: the import
    infers them. Evaluated, compiled for one cpu rank (the integer GEMM's template), simulated on two
    ranks and compiled for two, it equals onnxruntime."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from threads import run_ranks

    from shardflow.compiler import compile
    from shardflow.runtime import load

    ort = pytest.importorskip("onnxruntime")
    src = MODELS / f"{name}_ts17.onnx"
    path = tmp_path / "q8.onnx"
    # On x86 without VNNI onnxruntime's u8 x s8 GEMM adds pairs of products in saturating int16
    # (vpmaddubsw): full-range int8 weights make its reference wrong by up to 1e-2 there. The 7-bit
    # weights of ``reduce_range`` (onnxruntime's advice for such machines) keep its sums exact.
    quantize_dynamic(str(src), str(path), weight_type=QuantType.QInt8, reduce_range=_ort_int16_saturates())
    m = onnx.load(path)
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= {n.op_type for n in m.graph.node}
    feeds = {k: v for k, v in np.load(MODELS / f"{name}_inputs.npz").items() if k in {i.name for i in m.graph.input}}
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    want = dict(zip(names, sess.run(None, feeds)))
    g = load_onnx(str(path))
    tol = {n: 1e-5 * float(np.abs(w).max()) for n, w in want.items()}
    got = g.run(feeds)
    for n in names:
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=tol[n], err_msg=n)
    compile(str(path), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "out")
    program = json.loads((tmp_path / "out" / "rank0" / "program.json").read_text())
    kinds = [s["op_type"] for s in program["steps"] if s["kind"] == "kernel"]
    assert "PackedMatMulInteger" in kinds and "MatMulInteger" not in kinds  # the integer GEMM's template
    got = load(tmp_path / "out", rank=0).run(feeds)
    for n in names:
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=tol[n], err_msg=n)
    plan = search(g, {"mesh_shape": [2], "algo": "megatron"})
    # Megatron splits the projections' weights (their activation's zero point, a run-time scalar, does not
    # count as a second activation); the quantization ranges of split activations are all-reduced (min/max)
    split = [not plan.op_specs[n.name].input_specs[1].is_replicated for n in g.nodes if n.op_type == "MatMulInteger"]
    assert any(split) and (name != "bert" or all(split)), split  # GPT-2's later blocks run split by tokens
    got = simulate(partition(g, plan), feeds, plan.mesh)
    for n in names:
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=tol[n], err_msg=n)
    # two compiled cpu ranks (in-process): each packs its shard of the weights; partial int32 sums all-reduced
    compile(str(path), distributed_config={"mesh_shape": [2], "algo": "megatron"},
            optimization_config={"target": "cpu"}, out_dir=tmp_path / "out2")
    for r in range(2):
        program = json.loads((tmp_path / "out2" / f"rank{r}" / "program.json").read_text())
        assert "PackedMatMulInteger" in [s["op_type"] for s in program["steps"] if s["kind"] == "kernel"]
    ranks = run_ranks(tmp_path / "out2", feeds)
    for got in ranks:
        for n in names:
            np.testing.assert_allclose(got[n], want[n], rtol=0, atol=tol[n], err_msg=n)


def _qdq_copy(name, tmp_path, per_channel):
    """The committed ``name`` model in onnxruntime's static QDQ format (uint8 activations calibrated on
    its own inputs, int8 weights, per tensor or per output channel) and those inputs."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    src = MODELS / f"{name}_ts17.onnx"
    inputs = {i.name for i in onnx.load(src).graph.input}
    feeds = {k: v for k, v in np.load(MODELS / f"{name}_inputs.npz").items() if k in inputs}

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.left = [feeds]

        def get_next(self):
            return self.left.pop() if self.left else None

    path = tmp_path / f"{name}_qdq.onnx"
    quantize_static(str(src), str(path), Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return path, feeds


@pytest.mark.parametrize("name,per_channel", [("bert", False), ("gpt2", True), ("llama", True), ("resnet", False),
                                              ("resnet", True)])
def test_qdq_matmuls_run_as_integer_products(name, per_channel, tmp_path):
    """A QDQ model's MatMuls, Gemms and Convs between DequantizeLinear'd int8 values become MatMulInteger
    (ConvInteger: an int32 Conv) times the scales (frontend/qdq.py): the same values as the float ops of
    the dequantized operands and as onnxruntime's unoptimized session (the format's reference semantics;
    its optimized one rounds some activations the other way), evaluated and compiled for a cpu rank, where
    they run the integer GEMM (the integer conv)."""
    ort = pytest.importorskip("onnxruntime")
    from shardflow.compiler import compile
    from shardflow.runtime import load

    path, feeds = _qdq_copy(name, tmp_path, per_channel)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    want = dict(zip(names, sess.run(None, feeds)))
    tol = {n: 1e-5 * float(np.abs(w).max()) for n, w in want.items()}
    plain, fused = load_onnx(str(path)), load_onnx(str(path), int8_qdq=True)

    def integer(g):
        return sum(op.op_type == "MatMulInteger" or (op.op_type == "Conv" and op.outputs[0].dtype == "int32")
                   for op in g.nodes)
    # (the ResNet's 1x1 conv of 16 products per output stays float: INT8_CONV_MIN_K)
    assert not integer(plain) and integer(fused) >= {"bert": 12, "gpt2": 9, "llama": 14, "resnet": 5}[name]
    for got in (plain.run(feeds), fused.run(feeds)):
        for n in names:
            np.testing.assert_allclose(got[n], want[n], rtol=0, atol=tol[n], err_msg=n)
    compile(str(path), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "out")
    program = json.loads((tmp_path / "out" / "rank0" / "program.json").read_text())
    kinds = [s["op_type"] for s in program["steps"] if s["kind"] == "kernel"]
    assert kinds.count("PackedConvInteger") == 5 if name == "resnet" else "PackedMatMulInteger" in kinds
    got = load(tmp_path / "out", rank=0).run(feeds)
    for n in names:
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=tol[n], err_msg=n)


def test_qdq_gemm_terms_and_what_stays_float():
    """A Gemm with transB, alpha, beta and C over a per-row-quantized weight becomes MatMulInteger
    (weight transposed), the scales times alpha, plus beta * C; a MatMul whose activation scale is a
    graph input (not an initializer) stays a float MatMul. Values equal the float graph's."""
    from shardflow.compiler.frontend.qdq import fuse_qdq_matmuls

    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "sx"),
             numpy_helper.from_array(np.array(120, np.uint8), "zx"),
             numpy_helper.from_array(rng.integers(-128, 128, (6, 10)).astype(np.int8), "w"),
             numpy_helper.from_array((rng.random(6) * 0.02 + 0.01).astype(np.float32), "sw"),
             numpy_helper.from_array(rng.integers(-5, 5, 6).astype(np.int8), "zw"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "c"),
             numpy_helper.from_array(rng.integers(-128, 128, (10, 4)).astype(np.int8), "w2"),
             numpy_helper.from_array(np.array(0.03, np.float32), "sw2")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wd"], axis=0),
             helper.make_node("Gemm", ["xd", "wd", "c"], ["y"], name="gemm", transB=1, alpha=0.5, beta=2.0),
             helper.make_node("QuantizeLinear", ["x", "s_in", "zx"], ["xq2"]),
             helper.make_node("DequantizeLinear", ["xq2", "s_in", "zx"], ["xd2"]),
             helper.make_node("DequantizeLinear", ["w2", "sw2"], ["wd2"]),
             helper.make_node("MatMul", ["xd2", "wd2"], ["y2"], name="kept")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 10]),
                                       helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6]),
                           helper.make_tensor_value_info("y2", TensorProto.FLOAT, [3, 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])  # (the reference evaluator's Q/DQ)
    onnx.checker.check_model(m)
    out = fuse_qdq_matmuls(m)
    assert [n.op_type for n in out.graph.node].count("MatMulInteger") == 1 and "Gemm" not in [
        n.op_type for n in out.graph.node] and "kept" in [n.name for n in out.graph.node if n.op_type == "MatMul"]
    feeds = {"x": rng.standard_normal((3, 10)).astype(np.float32) * 3, "s_in": np.array(0.04, np.float32)}
    want = ReferenceEvaluator(m).run(None, feeds)
    for got, w in zip(load_onnx(m, int8_qdq=True).run(feeds).values(), want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
    for got, w in zip(ReferenceEvaluator(out).run(None, feeds), want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["uint8", "int8", "uint16", "int16"])
def test_a_dequantize_quantize_round_trip_with_one_scale_is_exact_in_float32(dtype):
    """The premise of drop_requantizations: round((q - z) * s / s) == q - z in float32 for every
    q and z of the type and normal scales across the exponent range, up to the largest whose
    65535-fold is finite."""
    info = np.iinfo(dtype)
    q = np.arange(info.min, info.max + 1, dtype=np.int64)
    rng = np.random.default_rng(7)
    f32 = np.finfo(np.float32)
    scales = np.concatenate([[f32.tiny, np.float32(f32.max / 65536), 1.0, 0.1, 1 / 3],
                             2.0 ** rng.uniform(-126, 110, 40) * rng.uniform(1, 2, 40)]).astype(np.float32)
    for z in (info.min, 0, info.max, int(rng.integers(info.min, info.max))):
        n = (q - z).astype(np.float32)
        for s in scales:
            with np.errstate(over="raise", under="ignore"):
                back = np.round((n * s) / s)
            assert np.array_equal(back, n), (dtype, z, s)


def _round_trip_model():
    """x -> Q(sa, za) -> DQ -> Reshape -> Transpose -> Q(sa, za) -> DQ -> ``moved``; an embedding
    (uint8 weight) -> DQ(sw, zw) -> Gather(ids) -> Q(sw, zw) -> DQ -> ``embedded``; and the same
    chain from x requantized with another scale (``rescaled``) and with another zero point
    (``shifted``), which must stay."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(np.array(v, dt), n) for n, v, dt in [
        ("sa", 0.037, np.float32), ("za", 121, np.uint8), ("sb", 0.05, np.float32), ("zb", 118, np.uint8),
        ("sw", 0.0123, np.float32), ("zw", 3, np.int8), ("shape", [4, 6, 5], np.int64)]]
    inits.append(numpy_helper.from_array(rng.integers(-128, 128, (50, 7)).astype(np.int8), "w"))
    n = helper.make_node
    nodes = [n("QuantizeLinear", ["x", "sa", "za"], ["xq"]), n("DequantizeLinear", ["xq", "sa", "za"], ["xd"]),
             n("Reshape", ["xd", "shape"], ["xr"]), n("Transpose", ["xr"], ["xt"], perm=[2, 0, 1]),
             n("QuantizeLinear", ["xt", "sa", "za"], ["mq"]), n("DequantizeLinear", ["mq", "sa", "za"], ["moved"]),
             n("QuantizeLinear", ["xt", "sb", "za"], ["rq"]), n("DequantizeLinear", ["rq", "sb", "za"], ["rescaled"]),
             n("QuantizeLinear", ["xt", "sa", "zb"], ["tq"]), n("DequantizeLinear", ["tq", "sa", "zb"], ["shifted"]),
             n("DequantizeLinear", ["w", "sw", "zw"], ["wd"]), n("Gather", ["wd", "ids"], ["g"]),
             n("QuantizeLinear", ["g", "sw", "zw"], ["gq"]), n("DequantizeLinear", ["gq", "sw", "zw"], ["embedded"])]
    f = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "g", [f("x", TensorProto.FLOAT, [120]), f("ids", TensorProto.INT64, [2, 3])],
                          [f(o, TensorProto.FLOAT, [5, 4, 6]) for o in ("moved", "rescaled", "shifted")]
                          + [f("embedded", TensorProto.FLOAT, [2, 3, 7])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(m)
    return m


def test_requantizations_with_one_scale_are_dropped_and_values_stay_exact(tmp_path):
    """QuantizeLinear(move(DequantizeLinear(q))) with the same scale and zero point becomes
    move(q) (Reshape/Transpose and an embedding's Gather copied onto the integers); other scales or
    zero points stay requantizations. Values equal onnxruntime's unoptimized session exactly,
    evaluated and compiled for a cpu rank (ties, saturation and NaN included)."""
    ort = pytest.importorskip("onnxruntime")
    from shardflow.compiler import compile
    from shardflow.compiler.frontend.qdq import drop_requantizations
    from shardflow.runtime import load

    m = _round_trip_model()
    out = drop_requantizations(m)
    kinds = [nd.op_type for nd in out.graph.node]
    assert kinds.count("QuantizeLinear") == 3 and kinds.count("Gather") == 2 and kinds.count("Transpose") == 2
    assert {nd.output[0]: nd.op_type for nd in out.graph.node}["mq"] == "Transpose"
    assert {nd.output[0]: list(nd.input) for nd in out.graph.node}["gq"] == ["w", "ids"]
    assert drop_requantizations(out) is out
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(120) * 3).astype(np.float32)
    x[:6] = [np.nan, np.inf, -np.inf, 0.037 * 2.5, 1e9, -0.037 * 121]
    feeds = {"x": x, "ids": np.array([[0, 49, 7], [7, 3, 12]], np.int64)}
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    for got in (load_onnx(m).run(feeds), load(tmp_path / "o", rank=0).run(feeds)):
        for name, w in want.items():
            np.testing.assert_array_equal(got[name], w, err_msg=name)


def test_a_requantization_in_another_precision_stays():
    """A QuantizeLinear dividing in float16 (``precision``, opset 23) or a DequantizeLinear giving
    float16 (``output_dtype``) is not the float32 round trip drop_requantizations proves exact: kept."""
    from shardflow.compiler.frontend.qdq import drop_requantizations

    inits = [numpy_helper.from_array(np.array(0.037, np.float32), "s"),
             numpy_helper.from_array(np.array(9, np.uint8), "z")]
    f = helper.make_tensor_value_info
    for q_attrs, dq_attrs in (({"precision": TensorProto.FLOAT16}, {}), ({}, {"output_dtype": TensorProto.FLOAT16}),
                              ({}, {})):
        nodes = [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], **dq_attrs),
                 helper.make_node("QuantizeLinear", ["d", "s", "z"], ["y"], **q_attrs)]
        g = helper.make_graph(nodes, "g", [f("q", TensorProto.UINT8, [4])], [f("y", TensorProto.UINT8, [4])], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
        kept = [n.op_type for n in drop_requantizations(m).graph.node] == ["DequantizeLinear", "QuantizeLinear"]
        assert kept == bool(q_attrs or dq_attrs), (q_attrs, dq_attrs)


def test_a_requantization_with_a_scale_near_float32s_max_stays_without_a_warning():
    """A scale whose times 65535 overflows float32 (1e36) is not the round trip drop_requantizations proves
    exact: the pair is kept, and the check raises no numpy overflow warning (it printed one through a
    user's import of a QDQ model)."""
    import warnings

    from shardflow.compiler.frontend.qdq import drop_requantizations

    f = helper.make_tensor_value_info
    for scale, kept in ((1e36, True), (0.037, False)):
        inits = [numpy_helper.from_array(np.array(scale, np.float32), "s"),
                 numpy_helper.from_array(np.array(9, np.uint8), "z")]
        nodes = [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
                 helper.make_node("QuantizeLinear", ["d", "s", "z"], ["y"])]
        g = helper.make_graph(nodes, "g", [f("q", TensorProto.UINT8, [4])], [f("y", TensorProto.UINT8, [4])], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = drop_requantizations(m)
        assert ([n.op_type for n in out.graph.node] == ["DequantizeLinear", "QuantizeLinear"]) == kept, scale


def _padded_depthwise_model(pad_value: float, mode: str = "constant", quantized: bool = True):
    """MobileNetV2's QDQ form of an explicitly padded depthwise conv: x -> Q/DQ(s, z) -> Pad(value, quantized as
    the quantizer writes it: DequantizeLinear(QuantizeLinear(Constant)), or the Constant itself) -> Q/DQ(s, z) ->
    depthwise Conv (float weight, 3x3, no pads of its own) -> y."""
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(np.array(v, dt), n) for n, v, dt in [
        ("s", 0.037, np.float32), ("z", 121, np.uint8), ("pads", [0, 0, 1, 1, 0, 0, 1, 1], np.int64)]]
    inits.append(numpy_helper.from_array(rng.standard_normal((6, 1, 3, 3)).astype(np.float32), "w"))
    n = helper.make_node
    nodes = [n("Constant", [], ["v"], value=numpy_helper.from_array(np.array(pad_value, np.float32))),
             n("QuantizeLinear", ["v", "s", "z"], ["vq"]), n("DequantizeLinear", ["vq", "s", "z"], ["vd"]),
             n("QuantizeLinear", ["x", "s", "z"], ["xq"]), n("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             n("Pad", ["xd", "pads", "vd" if quantized else "v"], ["p"], mode=mode),
             n("QuantizeLinear", ["p", "s", "z"], ["pq"]), n("DequantizeLinear", ["pq", "s", "z"], ["pd"]),
             n("Conv", ["pd", "w"], ["y"], group=6, kernel_shape=[3, 3])]
    f = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "g", [f("x", TensorProto.FLOAT, [1, 6, 7, 5])],
                          [f("y", TensorProto.FLOAT, [1, 6, 7, 5])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("pad_value, mode, quantized, dropped", [
    (0.0, "constant", True, True), (0.05, "constant", True, True), (0.0, "constant", False, True),
    (0.05, "constant", False, False), (0.0, "edge", True, True)])
def test_requantizations_around_pads_on_the_grid_are_dropped(tmp_path, pad_value, mode, quantized, dropped):
    """DequantizeLinear(QuantizeLinear(Pad(DequantizeLinear(q)))) with one scale and zero point is the Pad's own
    output where the pad value is on the quantization's grid (zero; any value quantized with the same scale and
    zero point, as the quantizer writes it; ``edge`` copies values): the pair is dropped (HF MobileNetV2's explicit
    pads, its QDQ model 7.4 -> 4.1 ms here). A float value off the grid (0.05 as it is) keeps it. Values equal
    onnxruntime's unoptimized session, evaluated and compiled for a cpu rank."""
    ort = pytest.importorskip("onnxruntime")
    from shardflow.compiler import compile
    from shardflow.compiler.frontend.qdq import drop_requantizations
    from shardflow.runtime import load

    m = _padded_depthwise_model(pad_value, mode, quantized)
    out = drop_requantizations(m)
    conv = next(nd for nd in out.graph.node if nd.op_type == "Conv")
    reader = {nd.output[0]: nd for nd in out.graph.node}[conv.input[0]]
    assert (reader.op_type == "Identity" and reader.input[0] == "p") == dropped, reader
    x = (np.random.default_rng(8).standard_normal((1, 6, 7, 5)) * 3).astype(np.float32)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    for got in (load_onnx(m).run({"x": x})["y"], load(tmp_path / "o", rank=0).run({"x": x})["y"]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pad_value", [0.0, 0.05, -9.0])
def test_a_pad_before_an_integer_conv_moves_onto_the_integers(tmp_path, pad_value):
    """QuantizeLinear(Pad(DequantizeLinear(q))) of one scale before a conv that becomes integer (a quantized weight
    of 72 products per output) is Pad(q) with the pad value quantized as QuantizeLinear does (0.05 rounds to a
    step, -9.0 saturates to 0): the conv reads the padded integers (ConvInteger on the cpu target). Values equal
    onnxruntime's unoptimized session, evaluated and compiled."""
    ort = pytest.importorskip("onnxruntime")
    from shardflow.compiler import compile
    from shardflow.compiler.frontend.qdq import drop_requantizations
    from shardflow.runtime import load

    rng = np.random.default_rng(9)
    inits = [numpy_helper.from_array(np.array(v, dt), n) for n, v, dt in [
        ("s", 0.037, np.float32), ("z", 121, np.uint8), ("pads", [0, 0, 1, 1, 0, 0, 1, 1], np.int64),
        ("v", pad_value, np.float32), ("ws", 0.02, np.float32), ("wz", 0, np.int8)]]
    inits.append(numpy_helper.from_array(rng.integers(-100, 100, (5, 8, 3, 3)).astype(np.int8), "wq"))
    n = helper.make_node
    nodes = [n("QuantizeLinear", ["x", "s", "z"], ["xq"]), n("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             n("Pad", ["xd", "pads", "v"], ["p"]),
             n("QuantizeLinear", ["p", "s", "z"], ["pq"]), n("DequantizeLinear", ["pq", "s", "z"], ["pd"]),
             n("DequantizeLinear", ["wq", "ws", "wz"], ["w"]), n("Conv", ["pd", "w"], ["y"], kernel_shape=[3, 3])]
    f = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "g", [f("x", TensorProto.FLOAT, [1, 8, 6, 7])],
                          [f("y", TensorProto.FLOAT, [1, 5, 6, 7])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(m)
    out = drop_requantizations(m)
    pad = {nd.output[0]: nd for nd in out.graph.node}["pq"]
    value = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}[pad.input[2]]
    assert pad.op_type == "Pad" and pad.input[0] == "xq" and value.dtype == np.uint8, pad
    assert int(value) == int(np.clip(np.rint(np.float32(pad_value) / np.float32(0.037)) + 121, 0, 255))
    x = (rng.standard_normal((1, 8, 6, 7)) * 3).astype(np.float32)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    compile(m, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=tmp_path / "o")
    program = json.loads((tmp_path / "o" / "rank0" / "program.json").read_text())
    assert "PackedConvInteger" in [s["op_type"] for s in program["steps"] if s["kind"] == "kernel"]
    for got in (load_onnx(m).run({"x": x})["y"], load(tmp_path / "o", rank=0).run({"x": x})["y"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
