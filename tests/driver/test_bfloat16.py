"""bfloat16 models (an LLM exported in bfloat16): imported, run by the numpy evaluator, compiled for
the cpu target (computed in float32 and rounded where kernels store, as float16 models; the products
and convs on the bfloat16 GEMM), split over ranks (partial sums reduced in float32) and compiled for
cuda, against onnxruntime on the float32 model with the same rounded weights (onnxruntime has no
bfloat16 products on the CPU).

Every op computes in float32 and rounds each bfloat16 output once; a compiled kernel rounds at its
stores only (intermediates of a fused kernel stay float32). So results differ from the float32
reference by the bfloat16 roundings along the network: the model checks allow 2**-5 of the
output's largest magnitude (measured: 0.3-1.5%), the single-op checks one rounding."""
import json
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from model_refs import half_model
from onnx import TensorProto, helper, numpy_helper

from shardflow.compiler import DtypeError, compile, load_onnx
from shardflow.compiler.parallel import partition, search, simulate
from shardflow.compiler.passes.precision import ReduceBfloat16InFloat32, WidenHalfProducts
from shardflow.runtime import load

BF16 = ml_dtypes.bfloat16
CPU = {"target": "cpu"}
ONE = {"mesh_shape": [1]}


def _close(got: np.ndarray, want: np.ndarray, rel: float = 2.0 ** -5) -> None:
    got, want = np.asarray(got).astype(np.float32), np.asarray(want).astype(np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * float(np.abs(want).max()))


def _model(nodes, inputs, outputs, inits=(), opset=18):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                          [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


MODELS = ["gpt2_ts17", "llama_ts17", "bert_ts17", "llama_sdpa_dynamo23", "vit_ts17", "resnet_ts17"]


@pytest.mark.parametrize("model", MODELS)
def test_model_in_bfloat16_by_the_evaluator(model):
    m, feeds, ref = half_model(model)
    g = load_onnx(m)
    assert any(t.dtype == "bfloat16" for op in g.nodes for t in op.inputs if t.is_constant)
    got = g.run(feeds)
    for k, v in ref.items():
        assert got[k].dtype == BF16
        _close(got[k], v)


@pytest.mark.parametrize("model", ["gpt2_ts17", "llama_ts17", "llama_sdpa_dynamo23", "resnet_ts17"])
def test_model_in_bfloat16_compiled_for_cpu(tmp_path, model):
    m, feeds, ref = half_model(model)
    res = compile(m, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out")
    got = load(res.out_dir).run(feeds)
    for k, v in ref.items():
        assert got[k].dtype == BF16
        _close(got[k], v)


@pytest.mark.parametrize("model", ["gpt2_ts17", "resnet_ts17"])
def test_float16_model_compiled_for_cpu(tmp_path, model):
    """A model that is float16 itself is computed in float32 (HalfModelInFloat32: its products 70x faster
    than the generic kernel on a 2-layer GPT-2), within 2**-7 of the largest output (measured 4e-4 to 8e-4);
    its products' weights stay float16, as float16 panels (before: float32 ones, twice the bytes); GPT-2's
    attention is fused as a float32 model's is."""
    m, feeds, ref = half_model(model, "float16")
    g = WidenHalfProducts().run(load_onnx(m))
    assert not any(t.dtype == "float16" for op in g.nodes if op.op_type in ("MatMul", "Gemm", "Conv")
                   for t in op.inputs)
    res = compile(m, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out")
    program = json.loads((res.out_dir / "rank0" / "program.json").read_text())
    panels = {b["dtype"] for b in program["buffers"] if b["storage"] == "weights" and b["name"].endswith(".panels16")}
    float32_panels = [b for b in program["buffers"] if b["storage"] == "weights" and b["name"].endswith(".panels")]
    if model == "gpt2_ts17":  # (the ResNet's convs read float32 weights)
        assert panels == {"float16"} and not float32_panels, program["buffers"]
        # its two layers' attention fused (HalfModelInFloat32 leaves the scores and probabilities unrounded)
        assert sum(s.get("op_type") == "Attention" for s in program["steps"]) == 2, program["steps"]
        assert not any(s.get("op_type") == "Softmax" for s in program["steps"])
    got = load(res.out_dir).run(feeds)
    for k, v in ref.items():
        assert got[k].dtype == np.float16
        _close(got[k], v, rel=2.0 ** -7)


def _float16_cnn():
    """x (float16) -> Conv -> + x -> Relu -> MaxPool -> Reshape -> MatMul -> y; out = tanh(y) * 0.5 + y; and
    emb = table[ids] + y (a Gather of a float16 table)."""
    rng = np.random.default_rng(5)
    h = lambda *shape: rng.standard_normal(shape).astype(np.float16)  # noqa: E731
    inits = [numpy_helper.from_array(a, n) for n, a in [
        ("w", h(8, 8, 3, 3) * np.float16(0.3)), ("b", h(8)), ("w2", h(72, 5)), ("half", np.array(0.5, np.float16)),
        ("table", h(100, 5)), ("shape", np.array([1, 72], np.int64))]]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Reshape", ["p", "shape"], ["f"]), helper.make_node("MatMul", ["f", "w2"], ["y"]),
             helper.make_node("Tanh", ["y"], ["t"]), helper.make_node("Mul", ["t", "half"], ["u"]),
             helper.make_node("Add", ["u", "y"], ["out"]), helper.make_node("Gather", ["table", "ids"], ["e"]),
             helper.make_node("Add", ["e", "y"], ["emb"])]
    m = _model(nodes, [("x", TensorProto.FLOAT16, [1, 8, 6, 6]), ("ids", TensorProto.INT64, [3])],
               [("out", TensorProto.FLOAT16, [1, 5]), ("emb", TensorProto.FLOAT16, [3, 5])], inits)
    return m, {"x": h(1, 8, 6, 6), "ids": np.array([3, 97, 3], np.int64)}


def test_a_float16_model_is_computed_in_float32_on_the_cpu():
    """HalfModelInFloat32 (the cpu target's): every op of a float16 model computes on float32 values, each
    output rounded to float16 (a RoundHalf) where an element-wise chain ends, none after ops that only move
    or select values (max pool, reshape, a Relu of rounded values); the Gather of a float16 table stays
    half (its rows widened after); the graph's outputs are cast back to float16. The values are those of
    the float16 graph (onnxruntime's) up to where the roundings fall."""
    import onnxruntime as ort

    from shardflow.compiler.passes.precision import HalfModelInFloat32

    m, feeds = _float16_cnn()
    g = load_onnx(m)
    want = g.run(feeds)
    g = HalfModelInFloat32().run(g)
    g.validate()
    half = [op.op_type for op in g.nodes if any(t.dtype == "float16" for t in list(op.inputs) + op.outputs)]
    assert sorted(half) == ["Cast", "Cast", "Cast", "Cast", "Gather"], half  # x and the rows widened; 2 outputs
    rounded = sorted(op.inputs[0].producer.op_type for op in g.nodes if op.op_type == "RoundHalf")
    # conv; the Relu of the unrounded x + conv (read by the pool); the product; the two outputs' adds
    assert rounded == ["Activation", "Binary", "Binary", "Conv", "MatMul"], rounded
    got = g.run(feeds)
    ref = dict(zip(["out", "emb"], ort.InferenceSession(m.SerializeToString()).run(None, feeds)))
    for k in ("out", "emb"):
        assert got[k].dtype == np.float16
        _close(got[k], want[k], rel=2.0 ** -9)
        _close(got[k], ref[k], rel=2.0 ** -9)


def test_a_comparison_of_float16_values_feeds_the_float32_select():
    """An op computed in float32 whose other output is not float16 (a comparison's bools) is read by the
    ops computed after it in float32 (before, the select's float32 copy read the old comparison, which
    stayed in the graph beside its copy: two nodes of one name, refused by the compile; ONNX's
    ``test_attention_local_window_ext_cache_float16_mask_expanded`` on the cpu target)."""
    from shardflow.compiler.passes.precision import HalfModelInFloat32

    zero = numpy_helper.from_array(np.array(0.0, np.float16), "zero")
    nodes = [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Greater", ["t", "zero"], ["b"]),
             helper.make_node("Where", ["b", "t", "x"], ["w"]), helper.make_node("Mul", ["w", "x"], ["y"])]
    m = _model(nodes, [("x", TensorProto.FLOAT16, [4, 6])], [("y", TensorProto.FLOAT16, [4, 6])], [zero])
    feeds = {"x": np.random.default_rng(2).standard_normal((4, 6)).astype(np.float16)}
    g = load_onnx(m)
    want = g.run(feeds)["y"]
    g = HalfModelInFloat32().run(g)
    g.validate()
    assert len({op.name for op in g.nodes}) == len(g.nodes), [op.name for op in g.nodes]
    assert not any(t.dtype == "float16" for op in g.nodes if op.op_type != "Cast" for t in op.inputs + op.outputs)
    _close(g.run(feeds)["y"], want, rel=2.0 ** -10)


def test_a_float16_cnn_compiled_for_cpu_takes_the_float32_templates(tmp_path):
    """Compiled for the cpu target, the float16 CNN's conv takes the float32 conv template with the residual,
    the Relu and the roundings applied as the kernels store (SfClamp's half), its pool the pool template;
    no activation is stored in float16 but the graph's inputs and outputs (before: the generic kernels on
    half storage, a native float16 ResNet-50 at 1.8x its float32 time; now 1.0x). Values as onnxruntime's."""
    import onnxruntime as ort

    m, feeds = _float16_cnn()
    res = compile(m, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out")
    program = json.loads((res.out_dir / "rank0" / "program.json").read_text())
    halves = sorted(b["name"] for b in program["buffers"] if b["dtype"] == "float16" and b["storage"] != "weights")
    assert halves == ["emb.float16:0", "out.float16:0", "x"], halves
    # x widened; the conv with its residual, Relu and roundings; the pool; the product and its rounding; the
    # chain of out and its cast; the gather, its widening, the add and the cast of emb
    kinds = [s.get("op_type") for s in program["steps"]]
    assert kinds == ["Cast", "RoundHalf", "Pool", "PackedMatMul", "RoundHalf", "Cast", "Cast"], kinds
    got = load(res.out_dir).run(feeds)
    ref = dict(zip(["out", "emb"], ort.InferenceSession(m.SerializeToString()).run(None, feeds)))
    for k in ("out", "emb"):
        assert got[k].dtype == np.float16
        _close(got[k], ref[k], rel=2.0 ** -9)


def _as_bfloat16(m, feeds):
    """The float16 model ``m`` (and its ``feeds``) with every float16 type and value in bfloat16 (rounded)."""
    low = type(m)()
    low.CopyFrom(m)
    for t in low.graph.initializer:
        if t.data_type == TensorProto.FLOAT16:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32).astype(BF16), t.name))
    for vi in list(low.graph.input) + list(low.graph.output):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT16:
            vi.type.tensor_type.elem_type = TensorProto.BFLOAT16
    return low, {k: v.astype(np.float32).astype(BF16) if v.dtype == np.float16 else v for k, v in feeds.items()}


def test_a_bfloat16_cnn_compiled_for_cpu_is_computed_in_float32_with_bfloat16_products(tmp_path):
    """A bfloat16 model on the cpu target is computed in float32 as a float16 one is (HalfModelInFloat32: the
    pool template, roundings where the kernels store), its conv and product on the bfloat16 GEMM: they read
    a bfloat16 copy of their operand (PrepackWeights casts the float32 tensor of bfloat16 values, exactly:
    the conv's input is the graph's input; the product's the pooled values, rounded where the Relu's kernel
    stores them); the conv stores its output rounded to bfloat16, which the residual Add reads widened.
    Before: the max pool in a scalar nest on bfloat16 storage (ResNet-50's: 6.4 ms of 27). Values as the
    evaluator's on the bfloat16 graph."""
    m, feeds = _as_bfloat16(*_float16_cnn())
    want = load_onnx(m).run(feeds)
    res = compile(m, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out")
    program = json.loads((res.out_dir / "rank0" / "program.json").read_text())
    kinds = [s.get("op_type") for s in program["steps"]]
    # the conv on x, its output rounded to bfloat16 as it stores; the residual (x and the conv's output widened
    # in the kernel), Relu and rounding; the pool; the product's operand cast; the product, rounded to bfloat16
    # as it stores; its widening (two readers); out's chain and cast; the gather, the add and the cast of emb
    assert kinds == ["PackedConvBf16", "RoundHalf", "Pool", "Cast", "PackedMatMulBf16", "Cast", "Cast", "Cast"], \
        kinds
    buffers = program["buffers"]
    conv, mm = program["steps"][0], program["steps"][4]
    assert buffers[conv["inputs"][0]]["name"] == "x"  # (the graph's input as it is: no copy)
    assert buffers[mm["inputs"][0]]["dtype"] == "bfloat16" and buffers[mm["inputs"][1]]["dtype"] == "bfloat16"
    halves = sorted(b["name"] for b in buffers if b["dtype"] == "bfloat16" and b["storage"] != "weights")
    assert len(halves) == 6, halves  # x, the conv's output, the product's operand and output, the two outputs
    assert buffers[conv["outputs"][0]]["dtype"] == "bfloat16"
    got = load(res.out_dir).run(feeds)
    for k in ("out", "emb"):
        assert got[k].dtype == BF16
        _close(got[k], want[k], rel=2.0 ** -6)


def test_a_bfloat16_products_operand_is_stored_once_for_every_reader(tmp_path):
    """``t = tanh(x)`` of a bfloat16 model feeds a product and an element-wise op: computed in float32, its
    rounding becomes the cast to bfloat16 that the product reads (PrepackWeights), and the element-wise op
    reads that copy widened, so the tanh's kernel writes the bfloat16 copy alone (no float32 tensor of its
    values); the product writes the output ``y`` itself, rounded as it stores. The evaluator's values exactly
    (its products sum the same float32 products of bfloat16 values)."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((64, 48)).astype(np.float32).astype(BF16), "w")
    two = numpy_helper.from_array(np.array(2.0, BF16), "two")
    nodes = [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("MatMul", ["t", "w"], ["y"]),
             helper.make_node("Mul", ["t", "two"], ["z"])]
    m = _model(nodes, [("x", TensorProto.BFLOAT16, [32, 64])],
               [("y", TensorProto.BFLOAT16, [32, 48]), ("z", TensorProto.BFLOAT16, [32, 64])], [w, two])
    feeds = {"x": rng.standard_normal((32, 64)).astype(np.float32).astype(BF16)}
    res = compile(m, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out")
    program = json.loads((res.out_dir / "rank0" / "program.json").read_text())
    # (the product writes y itself, rounded to bfloat16 as it stores)
    assert [s.get("op_type") for s in program["steps"]] == ["Cast", "PackedMatMulBf16", "Cast"]
    buffers = program["buffers"]
    tanh, mm, z = program["steps"]
    assert [buffers[k]["dtype"] for k in tanh["outputs"]] == ["bfloat16"]
    assert [["y", k] for k in mm["outputs"]] == program["outputs"][:1]
    assert buffers[mm["outputs"][0]]["dtype"] == "bfloat16"
    assert mm["inputs"][0] == tanh["outputs"][0] and z["inputs"][0] == tanh["outputs"][0]
    got, want = load(res.out_dir).run(feeds), load_onnx(m).run(feeds)
    for k in ("y", "z"):
        np.testing.assert_array_equal(got[k].astype(np.float32), want[k].astype(np.float32))


@pytest.mark.parametrize("how", ["model", "precision", "clip"])
def test_a_bfloat16_conv_stores_its_relus_bfloat16_values(tmp_path, how):
    """``conv -> Relu -> conv`` of a bfloat16 model (or of a float32 one at precision ``bfloat16``; or with a Clip to
    [0, 6], MobileNet's): the first conv applies the clamp and the rounding to bfloat16 as it stores
    (PackedConvBf16's ``lo``, ``hi`` and ``to``), and the second reads that bfloat16 tensor: no Relu or cast
    kernel between them (a bfloat16 ResNet-50 ran 32 such kernels). The evaluator's values (its sums in another
    order: one bfloat16 rounding apart at most)."""
    rng = np.random.default_rng(4)
    nt = np.float32 if how == "precision" else BF16
    code = TensorProto.FLOAT if how == "precision" else TensorProto.BFLOAT16
    arr = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32).astype(BF16).astype(nt)  # noqa: E731
    w1, b1, w2 = (numpy_helper.from_array(arr(*shape), n) for n, shape in (("w1", (16, 8, 3, 3)), ("b1", (16,)),
                                                                          ("w2", (4, 16, 3, 3))))
    bounds = [numpy_helper.from_array(np.array(v, nt), n) for n, v in (("lo", 0.0), ("hi", 6.0))]
    clamp = helper.make_node("Clip", ["c1", "lo", "hi"], ["r"]) if how == "clip" else \
        helper.make_node("Relu", ["c1"], ["r"])
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]), clamp,
             helper.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1])]
    m = _model(nodes, [("x", code, [1, 8, 9, 7])], [("y", code, [1, 4, 9, 7])], [w1, b1, w2] + bounds)
    feeds = {"x": arr(1, 8, 9, 7) * nt(8)}  # (13% of the first conv's sums past 6, half below 0)
    oc = dict(CPU, precision="bfloat16") if how == "precision" else CPU
    res = compile(m, distributed_config=ONE, optimization_config=oc, out_dir=tmp_path / "out")
    program = json.loads((res.out_dir / "rank0" / "program.json").read_text())
    steps = [s for s in program["steps"] if s.get("op_type") != "Cast"]  # (the casts of x and y)
    assert [s.get("op_type") for s in steps] == ["PackedConvBf16", "PackedConvBf16"], program["steps"]
    first, second = steps
    assert first["outputs"] == second["inputs"][:1]
    assert program["buffers"][first["outputs"][0]]["dtype"] == "bfloat16"
    got = load(res.out_dir).run(feeds)["y"].astype(np.float32)
    g = load_onnx(m)
    if how == "precision":  # (the reference: the model's operands rounded, as the precision asks)
        from shardflow.compiler.passes.precision import HalfPrecisionContractions
        g = HalfPrecisionContractions("bfloat16").run(g)
    want = g.run(feeds)["y"].astype(np.float32)
    _close(got, want, rel=2.0 ** -7)


def test_a_bfloat16_depthwise_conv_keeps_the_float32_depthwise_kernels(tmp_path):
    """A bfloat16 model's depthwise 7x7 conv (ConvNeXt's: 49 products per output, one output channel per group)
    is not run on the bfloat16 GEMM (a GEMM of one row per group: ConvNeXt-tiny's 18 such convs took 45 ms
    of 67 there) but by the float32 conv template's depthwise kernels; a shallow conv reading its output (fewer
    than BF16_CONV_DEEP_K products per output) stays on the float32 kernels too (its image comes from a
    float32 kernel: no copy to bfloat16 for it; MobileNetV2's 1x1s); a deep one after it takes the bfloat16
    GEMM, through a copy."""
    rng = np.random.default_rng(6)
    arr = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32).astype(BF16)  # noqa: E731
    inits = [numpy_helper.from_array(a, n) for n, a in (("wd", arr(32, 1, 7, 7)), ("bd", arr(32)),
                                                        ("wg", arr(32, 16, 3, 3)), ("wk", arr(16, 32, 5, 5)))]
    nodes = [helper.make_node("Conv", ["x", "wd", "bd"], ["d"], group=32, pads=[3, 3, 3, 3]),
             helper.make_node("Conv", ["d", "wg"], ["g"], group=2, pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["g", "wk"], ["y"], pads=[2, 2, 2, 2])]
    m = _model(nodes, [("x", TensorProto.BFLOAT16, [1, 32, 10, 9])], [("y", TensorProto.BFLOAT16, [1, 16, 10, 9])],
               inits)
    feeds = {"x": arr(1, 32, 10, 9)}
    res = compile(m, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out")
    program = json.loads((res.out_dir / "rank0" / "program.json").read_text())
    # x widened; the depthwise conv rounding as it stores; the grouped conv (K = 144), both on the float32
    # template; the copy of its output in bfloat16 (the rounding); the 5x5 conv (K = 800) on the bfloat16 GEMM,
    # writing y
    kinds = [s.get("op_type") for s in program["steps"]]
    assert kinds == ["Cast", "RoundHalf", "Conv", "Cast", "PackedConvBf16"], kinds
    _close(load(res.out_dir).run(feeds)["y"].astype(np.float32), load_onnx(m).run(feeds)["y"].astype(np.float32),
           rel=2.0 ** -7)


def test_bfloat16_products_take_the_float32_templates():
    """On the cpu target each bfloat16 MatMul/Gemm/Conv becomes the same op on widened operands
    (weights stored float32 once) and one rounding of its output; nothing else changes."""
    m, feeds, _ = half_model("gpt2_ts17")
    g = load_onnx(m)
    want = g.run(feeds)
    n_products = sum(op.op_type in ("MatMul", "Gemm") for op in g.nodes)
    g = WidenHalfProducts().run(g)
    products = [op for op in g.nodes if op.op_type in ("MatMul", "Gemm")]
    assert len(products) == n_products > 8
    for op in products:
        assert all(t.dtype == "float32" for t in list(op.inputs) + list(op.outputs)), op
        assert all(t.is_constant or t.producer.op_type == "Cast" for t in op.inputs if t.dtype == "float32"), op
    got = g.run(feeds)
    for k in want:  # the same roundings: equal up to the float32 sums' order
        _close(got[k], want[k], rel=2.0 ** -7)


def test_attention_of_a_bfloat16_model_is_fused_for_cuda():
    """FuseAttention (the cuda driver's) matches a bfloat16 model's own MatMul/Softmax/MatMul (no
    casts, bfloat16 scale and mask) and writes one Attention on the bfloat16 Q, K, V whose output is
    rounded once; the values stay those of the separate ops up to their bfloat16 roundings."""
    from shardflow.compiler.passes.attention import FuseAttention

    m, feeds, ref = half_model("gpt2_ts17")
    g = load_onnx(m)
    want = g.run(feeds)
    fused = FuseAttention().run(g)
    atts = [op for op in fused.nodes if op.op_type == "Attention"]
    assert len(atts) == 2 and not any(op.op_type == "Softmax" for op in fused.nodes)
    for op in atts:
        assert [t.dtype for t in op.inputs[:3]] == ["bfloat16"] * 3 and op.attrs["probs_dtype"] == "bfloat16"
        assert op.attrs["extra_biases"] == 1 and op.inputs[3].dtype == "float32"  # the mask, widened
    got = fused.run(feeds)
    for k, v in ref.items():
        assert got[k].dtype == BF16
        _close(got[k], want[k], rel=2.0 ** -6)
        _close(got[k], v)


def _mlp(d=64, h=256, seed=0):
    """x [4, d] -> MatMul -> Relu -> MatMul -> y, bfloat16: megatron splits the hidden dim, so the
    second product's partial sums are all-reduced."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((d, h)) / np.sqrt(d)).astype(BF16)
    w2 = (rng.standard_normal((h, d)) / np.sqrt(h)).astype(BF16)
    m = _model([helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
                helper.make_node("MatMul", ["r", "w2"], ["y"])],
               [("x", TensorProto.BFLOAT16, [4, d])], [("y", TensorProto.BFLOAT16, [4, d])],
               [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    x = rng.standard_normal((4, d)).astype(BF16)
    return m, x, w1, w2


def test_partial_sums_of_bfloat16_are_reduced_in_float32():
    m, x, _, _ = _mlp()
    g = load_onnx(m)
    plan = search(g, {"mesh_shape": [2], "algo": "megatron"})
    ranks = [ReduceBfloat16InFloat32().run(rg) for rg in partition(g, plan)]
    for rg in ranks:
        reductions = [op for op in rg.nodes if getattr(op, "collective", "") in ("all_reduce", "reduce_scatter")]
        assert reductions and all(op.inputs[0].dtype == "float32" for op in reductions)
    got = simulate(ranks, {"x": x})["y"]
    assert got.dtype == BF16
    _close(got, g.run({"x": x})["y"], rel=2.0 ** -7)


def test_bfloat16_reductions_are_priced_in_float32():
    """``connect`` prices a bfloat16 all-reduce / reduce-scatter at the float32 bytes it moves and a
    bfloat16 all-gather at its own two bytes an element."""
    from shardflow.compiler.parallel import CostModel, DeviceMesh, connect

    mesh = DeviceMesh([2])
    cm = CostModel(mesh)
    for src, dst, ratio in (("P(sum)", "S(0)", 1.0), ("S(0)", "R", 0.5)):
        bf = connect(src, dst, (64, 64), "bfloat16", mesh, cm)
        f32 = connect(src, dst, (64, 64), "float32", mesh, cm)
        assert [st.bytes for st in bf.steps] == [int(st.bytes * ratio) for st in f32.steps], (src, dst)
        assert bf.steps[0].bytes > 0
    # So a bfloat16 partial sum is made whole by a reduce-scatter in float32 and an all-gather of the
    # bfloat16 halves, for less than an all-reduce moving float32 both ways (the float32 one all-reduces).
    bf, f32 = (connect("P(sum)", "R", (64, 64), dt, mesh, cm) for dt in ("bfloat16", "float32"))
    assert [(st.kind, st.bytes) for st in bf.steps] == [("reduce_scatter", 64 * 64 * 4), ("all_gather", 64 * 64 * 2)]
    assert [(st.kind, st.bytes) for st in f32.steps] == [("all_reduce", 64 * 64 * 4)]
    assert bf.cost < f32.cost


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not installed")
def test_bfloat16_mlp_on_two_ranks_equals_one_device(tmp_path):
    """Compiled for cpu on a [2] mesh (megatron: an all-reduce of the bfloat16 partial sums, carried in
    float32) and run by ``shardflow run`` on two processes, the npz files holding bfloat16 as numpy's
    void ``V2``; against the same model compiled for one device."""
    from test_multirank_models import clean_env

    m, x, _, _ = _mlp(seed=1)
    one = compile(m, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "one")
    want = load(one.out_dir).run({"x": x})["y"]
    two = compile(m, distributed_config={"mesh_shape": [2], "algo": "megatron"}, optimization_config=CPU,
                  out_dir=tmp_path / "two")
    np.savez(tmp_path / "in.npz", x=x)
    proc = subprocess.run([sys.executable, "-m", "shardflow.compiler.cli", "run", str(two.out_dir), "--nproc", "2",
                           "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "out.npz")],
                          capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")["y"]
    assert got.dtype == np.dtype("V2")
    _close(got.view(BF16), want, rel=2.0 ** -7)


_SPECIALS = np.array([1.0, 1.00390625, 1.005859375, 1.0078125 + 2.0 ** -9, -2.0 ** -133, 3.4e38, 3.39e38, -0.0,
                      np.inf, -np.inf, np.nan, 1e-40, 65504.0, -1.5e-3, 2.0 ** -126], np.float32)


def test_cpu_rounding_to_bfloat16_is_ml_dtypes(tmp_path):
    """The cpu kernels' float32 -> bfloat16 (round to nearest even; ties, overflow to inf, subnormals,
    NaN, signed zero) and back, bit for bit, on ``Cast`` and on an op's store."""
    x = np.concatenate([_SPECIALS, np.random.default_rng(0).standard_normal(49).astype(np.float32) * 1e3])
    bf, f32 = TensorProto.BFLOAT16, TensorProto.FLOAT
    m = _model([helper.make_node("Cast", ["x"], ["c"], to=bf), helper.make_node("Mul", ["x", "two"], ["d"]),
                helper.make_node("Cast", ["d"], ["y"], to=bf), helper.make_node("Cast", ["c"], ["back"], to=f32)],
               [("x", f32, [64])], [("c", bf, [64]), ("y", bf, [64]), ("back", f32, [64])],
               [numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    res = compile(m, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out")
    got = load(res.out_dir).run({"x": x})
    with np.errstate(over="ignore"):
        twice = (x * np.float32(2)).astype(BF16)
    for k, want in (("c", x.astype(BF16)), ("y", twice),
                    ("back", x.astype(BF16).astype(np.float32))):
        assert got[k].dtype == want.dtype
        assert got[k].view(np.uint16 if k != "back" else np.uint32).tolist() == \
            want.view(np.uint16 if k != "back" else np.uint32).tolist(), k


def test_bfloat16_sums_accumulate_in_float32(tmp_path):
    """4096 ones: a bfloat16 accumulator stops at 256 (256 + 1 rounds to 256); the evaluator and
    the cpu kernel sum in float32 and round once."""
    m = _model([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)],
               [("x", TensorProto.BFLOAT16, [4096])], [("y", TensorProto.BFLOAT16, [])])
    x = np.ones(4096, BF16)
    assert float(load_onnx(m).run({"x": x})["y"]) == 4096.0
    res = compile(m, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out")
    assert float(load(res.out_dir).run({"x": x})["y"]) == 4096.0


def test_bfloat16_inputs_bound_at_import_and_checked():
    m = _model([helper.make_node("Add", ["x", "b"], ["y"])],
               [("x", TensorProto.BFLOAT16, [3]), ("b", TensorProto.BFLOAT16, [3])], [("y", TensorProto.BFLOAT16, [3])])
    b = np.array([0.5, 1.5, -2.0], BF16)
    g = load_onnx(m, input_values={"b": b})
    assert [t.name for t in g.inputs] == ["x"]
    assert g.run({"x": np.ones(3, BF16)})["y"].astype(np.float32).tolist() == [1.5, 2.5, -1.0]
    with pytest.raises(DtypeError, match="bfloat16"):
        load_onnx(m).run({"x": np.ones(3, np.float32), "b": b})


def test_four_bit_floats_are_refused_with_a_typed_error():
    """bfloat16 (and float8, test_float8.py) are supported element types; 4-bit floats still raise a
    clear DtypeError naming the attribute and the supported types."""
    m = _model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT4E2M1)],
               [("x", TensorProto.FLOAT, [2])], [("y", TensorProto.FLOAT4E2M1, [2])], opset=23)
    with pytest.raises(DtypeError, match="FLOAT4E2M1.*bfloat16"):
        load_onnx(m)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_model_in_bfloat16_compiled_for_cuda(tmp_path):
    m, _, _ = half_model("llama_ts17")
    res = compile(m, distributed_config=ONE, optimization_config={"target": "cuda", "arch": "sm_90"},
                  out_dir=tmp_path / "out")
    assert res.ranks[0]["kernels"] > 10
    assert (tmp_path / "out" / "rank0" / "kernels.cubin").stat().st_size > 0


@pytest.mark.parametrize("dynamo", [False, True], ids=["ts17", "dynamo18"])
def test_llama_exported_in_bfloat16_by_torch(tmp_path, dynamo):
    """The user's path: ``model.to(torch.bfloat16)``, ``torch.onnx.export`` (its RMSNorm casts to
    float32 and back, rotary tables, causal masks in bfloat16), imported and compiled for cpu, against
    torch's own bfloat16 forward of the module."""
    import os

    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
    import export_models as em

    torch.manual_seed(0)
    module = em.build_llama()[0].to(torch.bfloat16).eval()
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, em.VOCAB, (2, 8)), "attention_mask": np.ones((2, 8), np.int64)}
    feeds["attention_mask"][1, 6:] = 0  # a padded row
    path = em.export_module(module, feeds, list(feeds), ["y"], str(tmp_path / "llama.onnx"), dynamo=dynamo)
    with torch.no_grad():
        want = module(*(torch.from_numpy(v) for v in feeds.values())).float().numpy()
    got = load_onnx(path).run(feeds)["y"]
    assert got.dtype == BF16
    _close(got, want, rel=2.0 ** -6)
    res = compile(path, distributed_config=ONE, optimization_config=CPU, out_dir=tmp_path / "out")
    _close(load(res.out_dir).run(feeds)["y"], want, rel=2.0 ** -6)
