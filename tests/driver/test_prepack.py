"""Weights packed at compile time for the cpu GEMM (compiler/passes/prepack.py): which
contractions the pass rewrites, that the rewritten graph computes the same values, and that
compiled ranks (one, and two with sharded weights) match onnxruntime while their programs read
the packed weights."""
import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from threads import run_threads

from shardflow.compiler import compile
from shardflow.compiler.ir import Tensor, const_tensor
from shardflow.compiler.ir.graph import FlowGraph
from shardflow.compiler.ops.conv import Conv
from shardflow.compiler.ops.elementwise import Binary, CastOp
from shardflow.compiler.ops.linalg import (BF16_PANEL, INT8_PANEL, PANEL, Gemm, MatMul, MatMulInteger, pack_bf16_panels,
                                           pack_panels)
from shardflow.compiler.passes.prepack import PrepackWeights
from shardflow.runtime import load
from shardflow.runtime.comm import InProcessWorld

MODELS = Path(__file__).resolve().parents[1] / "models"


def test_pack_panels_layout():
    b = np.arange(3 * 40, dtype=np.float32).reshape(3, 40)
    p = pack_panels(b)
    npanel = -(-40 // PANEL)
    assert 40 % PANEL and p.shape == (npanel, 3, PANEL) and p.flags.c_contiguous
    for k in range(3):
        for j in range(40):
            assert p[j // PANEL, k, j % PANEL] == b[k, j]
    assert not p[-1, :, 40 % PANEL:].any()  # the columns past N are zero


def _graph(rng):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    x = Tensor("x", (2, 5, 40), "float32")
    x2 = Tensor("x2", (5, 40), "float32")
    i = Tensor("i", (5, 4), "int64")
    shared, also_added, out_w = const_tensor(f(40, 40)), const_tensor(f(40, 40)), const_tensor(f(40, 3))
    mixed = const_tensor(f(40, 40))
    ops = [
        MatMul([x, const_tensor(f(40, 70))], name="mm3d"),                     # batch folded into M, N tail
        Gemm([x2, const_tensor(f(33, 40)), const_tensor(f(33))], name="gemm_tb", trans_b=True, alpha=0.5,
             beta=2.0),                                                         # B transposed at packing
        MatMul([x2, shared], name="shared_a"),                                  # two readers, one packed copy
        MatMul([x2, shared], name="shared_b"),
        MatMul([x2, also_added], name="kept_mm"),                               # its weight is also added:
        Binary([also_added, also_added], name="kept_add", fn="add"),            # stays as it is
        Gemm([const_tensor(f(40, 5)), const_tensor(f(40, 7))], name="gemm_ta", trans_a=True),  # A transposed
        MatMul([x2, out_w], name="out_weight"),                                 # weight is a graph output
        Gemm([x2, mixed], name="mixed_t", trans_b=True),                        # read transposed and not:
        MatMul([x2, mixed], name="mixed_n"),                                    # two layouts, not packed
        MatMul([i, const_tensor(rng.integers(-3, 4, (4, 6)))], name="int_mm"),
    ]
    outs = [o.outputs[0] for o in ops] + [out_w]
    return FlowGraph([x, x2, i], outs)


def test_the_pass_rewrites_float32_contractions_with_constant_weights_and_keeps_the_values():
    rng = np.random.default_rng(0)
    g = _graph(rng)
    feeds = {"x": rng.standard_normal((2, 5, 40)).astype(np.float32),
             "x2": rng.standard_normal((5, 40)).astype(np.float32), "i": rng.integers(-3, 4, (5, 4))}
    want = g.run(feeds)
    g = PrepackWeights().run(g)
    g.validate()
    kinds = {op.name: op.op_type for op in g.nodes}
    assert kinds == {"mm3d": "PackedMatMul", "gemm_tb": "PackedMatMul", "shared_a": "PackedMatMul",
                     "shared_b": "PackedMatMul", "kept_mm": "MatMul", "kept_add": "Binary", "gemm_ta": "Gemm",
                     "out_weight": "MatMul", "mixed_t": "Gemm", "mixed_n": "MatMul", "int_mm": "MatMul"}
    by = {op.name: op for op in g.nodes}
    assert by["shared_a"].inputs[1] is by["shared_b"].inputs[1]
    assert by["mm3d"].inputs[1].shape == (-(-70 // PANEL), 40, PANEL)
    assert by["gemm_tb"].inputs[1].shape == (-(-33 // PANEL), 40, PANEL)
    got = g.run(feeds)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)


def test_pack_bf16_panels_layout():
    bf16 = np.dtype("bfloat16")
    b = np.random.default_rng(3).standard_normal((45, 37)).astype(bf16)
    p = pack_bf16_panels(b)
    assert p.shape == (3, 32, BF16_PANEL, 2) and p.dtype == bf16  # K padded to 64, N to 48
    for k in range(45):
        for j in range(37):
            assert p[j // 16, k // 2, j % 16, k % 2] == b[k, j]
    assert not p[:, 45 // 2 + 1:].astype(np.float32).any() and not p[-1, :, 37 % 16:].astype(np.float32).any()
    assert p[:, 22, :, 1].astype(np.float32).sum() == 0  # k = 45, past K
    np.testing.assert_array_equal(pack_bf16_panels(b.astype(np.float32)), p)  # float32 holding bfloat16 values


def _bf16_graph(rng):
    """Products of bfloat16 values widened (as precision bfloat16 and a bfloat16 model's widened products
    read them), and ones that must stay float32."""
    bf16 = np.dtype("bfloat16")
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    x, x2, x3 = Tensor("x", (2, 5, 40), "float32"), Tensor("x2", (5, 40), "float32"), Tensor("x3", (5, 40), "float32")
    down = CastOp([x], name="down", to="bfloat16")
    up = CastOp([down.outputs[0]], name="up", to="float32")
    down2 = CastOp([x2], name="down2", to="bfloat16")
    up2 = CastOp([down2.outputs[0]], name="up2", to="float32")
    w_cast = CastOp([const_tensor(f(40, 70).astype(bf16))], name="w_cast", to="float32")  # a bfloat16 constant
    exact = const_tensor(f(33, 40).astype(bf16).astype(np.float32))  # float32 holding bfloat16 values
    products = [
        MatMul([up.outputs[0], w_cast.outputs[0]], name="precision_mm"),
        Gemm([up2.outputs[0], exact, const_tensor(f(33))], name="model_gemm", trans_b=True, alpha=0.5, beta=2.0),
        MatMul([up2.outputs[0], const_tensor(f(40, 6))], name="float32_weight"),  # not bfloat16 values
        MatMul([x3, const_tensor(f(40, 6).astype(bf16).astype(np.float32))], name="float32_input"),  # A is float32
    ]
    return FlowGraph([x, x2, x3], [p.outputs[0] for p in products])


def test_products_of_bfloat16_values_are_packed_for_the_bfloat16_gemm_with_the_same_values():
    """A float32 MatMul/Gemm reading bfloat16 values widened by a Cast and a constant B holding bfloat16 values
    (a Cast of a bfloat16 constant, or float32 values that are bfloat16's) becomes a PackedMatMulBf16 reading
    the bfloat16 tensor and B in bfloat16 panels; the widened copies go; the others keep the float32 GEMM."""
    rng = np.random.default_rng(4)
    g = _bf16_graph(rng)
    feeds = {"x": rng.standard_normal((2, 5, 40)).astype(np.float32),
             "x2": rng.standard_normal((5, 40)).astype(np.float32),
             "x3": rng.standard_normal((5, 40)).astype(np.float32)}
    want = g.run(feeds)
    g = PrepackWeights().run(g)
    g.validate()
    by = {op.name: op for op in g.nodes}
    assert {n: by[n].op_type for n in ("precision_mm", "model_gemm", "float32_weight", "float32_input")} == {
        "precision_mm": "PackedMatMulBf16", "model_gemm": "PackedMatMulBf16", "float32_weight": "PackedMatMul",
        "float32_input": "PackedMatMul"}
    assert "w_cast" not in by and "up" not in by  # nothing reads the widened values any more
    assert by["precision_mm"].inputs[0].dtype == "bfloat16" and by["precision_mm"].inputs[1].shape == (5, 32, 16, 2)
    assert by["model_gemm"].inputs[1].shape == (3, 32, 16, 2) and by["model_gemm"].attrs["n"] == 33
    got = g.run(feeds)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)


def _half_builds(path, feeds, tmp_path, precision: str = "bfloat16") -> dict:
    """``{prepack: (program.json, outputs)}`` of ``path`` compiled for a cpu rank at ``precision`` (bfloat16 or
    float16) with the ``prepack`` pass on and off, run on ``feeds``."""
    res = {}
    for prepack in (True, False):
        out = tmp_path / f"out{precision}{prepack}"
        compile(path, distributed_config={"mesh_shape": [1]},
                optimization_config={"target": "cpu", "precision": precision, "prepack": prepack}, out_dir=out)
        res[prepack] = (json.loads((out / "rank0" / "program.json").read_text()), load(out).run(feeds))
    return res


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs a C++ compiler")
def test_precision_bfloat16_runs_the_bfloat16_gemm_and_matches_onnxruntime(tmp_path):
    """With precision bfloat16 the cpu target's products of constant weights are PackedMatMulBf16 kernels (the
    weights stored once, as bfloat16 panels), within bfloat16's tolerance of onnxruntime's float32 result and
    equal to the float32 GEMM on the same rounded operands (``prepack`` off: the widened values)."""
    path, x, want = _mlp_with_reference(tmp_path, 5)
    got = {}
    for prepack, (program, outputs) in _half_builds(path, {"x": x}, tmp_path).items():
        kinds = [s["op_type"] for s in program["steps"] if s["kind"] == "kernel"]
        if prepack:
            assert kinds.count("PackedMatMulBf16") == 3 and "MatMul" not in kinds and "Gemm" not in kinds, kinds
            stored = {b["dtype"] for b in program["buffers"] if b["storage"] == "weights" and len(b["shape"]) > 1}
            assert stored == {"bfloat16"}, stored
        got[prepack] = outputs["y"]
    np.testing.assert_allclose(got[True], want, rtol=3e-2, atol=3e-2 * float(np.abs(want).max()))
    np.testing.assert_allclose(got[True], got[False], rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs a C++ compiler")
def test_precision_float16_reads_the_weights_as_float16_panels(tmp_path):
    """With precision float16 the cpu target's products of constant weights are PackedMatMul kernels reading the
    weights as float16 panels (stored once, half the bytes of float32 ones, widened as the GEMM reads them;
    before: each product's float16 weight widened into a float32 copy on every call, then packed), equal to the
    float32 GEMM on the same rounded operands (``prepack`` off) and within float16's tolerance of onnxruntime's
    float32 result."""
    path, x, want = _mlp_with_reference(tmp_path, 6)
    got = {}
    for prepack, (program, outputs) in _half_builds(path, {"x": x}, tmp_path, "float16").items():
        kinds = [s["op_type"] for s in program["steps"] if s["kind"] == "kernel"]
        weights = {b["dtype"] for b in program["buffers"] if b["storage"] == "weights" and len(b["shape"]) > 1}
        if prepack:
            assert kinds.count("PackedMatMul") == 3 and "MatMul" not in kinds and "Gemm" not in kinds, kinds
            assert weights == {"float16"}, weights  # (the Casts left: the activations rounded to float16)
        got[prepack] = outputs["y"]
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got[True], want, rtol=0, atol=5e-3 * scale)
    np.testing.assert_allclose(got[True], got[False], rtol=0, atol=1e-5 * scale)


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs a C++ compiler")
def test_precision_bfloat16_runs_the_convs_on_the_bfloat16_gemm(tmp_path):
    """With precision bfloat16 the cpu target's convs of 32 or more products per output are PackedConvBf16
    kernels (the bfloat16 image and weight rows on the bfloat16 GEMM), within bfloat16's tolerance of
    onnxruntime's float32 result and of the float32 convs on the same rounded operands (``prepack`` off)."""
    import onnxruntime as ort

    path = str(MODELS / "resnet_ts17.onnx")
    feeds = dict(np.load(MODELS / "resnet_inputs.npz"))
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = {}
    for prepack, (program, outputs) in _half_builds(path, feeds, tmp_path).items():
        kinds = [s["op_type"] for s in program["steps"] if s["kind"] == "kernel"]
        # (five of its six convs: the 1x1 of 16 products per output stays float32)
        assert kinds.count("PackedConvBf16") == (5 if prepack else 0), kinds
        got[prepack] = list(outputs.values())[0]
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got[True], want, rtol=0, atol=2e-2 * scale)
    np.testing.assert_allclose(got[True], got[False], rtol=0, atol=1e-4 * scale)


def test_int8_weights_are_packed_for_the_integer_gemm_with_the_same_values():
    """MatMulInteger with a constant int8/uint8 weight (and a constant or no zero point) becomes a
    PackedMatMulInteger reading the weight as the integer GEMM's panels; two readers share one copy; a
    weight something else reads, or whose zero point is computed, stays as it is. Same int32 values."""
    rng = np.random.default_rng(3)
    i8 = lambda *s: const_tensor(rng.integers(-128, 128, s).astype(np.int8))  # noqa: E731
    u8 = lambda *s: const_tensor(rng.integers(0, 256, s).astype(np.uint8))  # noqa: E731
    xu = Tensor("xu", (2, 5, 40), "uint8")
    xs = Tensor("xs", (5, 40), "int8")
    azp = Tensor("azp", (), "int8")
    bzp_in = Tensor("bzp", (), "int8")
    shared, cast_too, computed = i8(40, 24), i8(40, 8), i8(40, 8)
    ops = [
        MatMulInteger([xu, i8(40, 70), u8(), i8()], name="zp_both", has_azp=True),
        MatMulInteger([xs, u8(40, 33), azp, u8(33)], name="per_column", has_azp=True),
        MatMulInteger([xs, shared], name="shared_a"),
        MatMulInteger([xs, shared, azp], name="shared_b", has_azp=True),
        MatMulInteger([xs, cast_too], name="kept_mm"),
        CastOp([cast_too], name="kept_cast", to="int32"),
        MatMulInteger([xs, computed, bzp_in], name="computed_zp"),
    ]
    g = FlowGraph([xu, xs, azp, bzp_in], [o.outputs[0] for o in ops])
    feeds = {"xu": rng.integers(0, 256, (2, 5, 40)).astype(np.uint8),
             "xs": rng.integers(-128, 128, (5, 40)).astype(np.int8), "azp": np.array(-7, np.int8),
             "bzp": np.array(3, np.int8)}
    want = g.run(feeds)
    g = PrepackWeights().run(g)
    g.validate()
    kinds = {op.name: op.op_type for op in g.nodes}
    assert kinds == {"zp_both": "PackedMatMulInteger", "per_column": "PackedMatMulInteger",
                     "shared_a": "PackedMatMulInteger", "shared_b": "PackedMatMulInteger", "kept_mm": "MatMulInteger",
                     "kept_cast": "Cast", "computed_zp": "MatMulInteger"}
    by = {op.name: op for op in g.nodes}
    assert by["shared_a"].inputs[1] is by["shared_b"].inputs[1]
    assert by["zp_both"].inputs[1].shape == (-(-70 // INT8_PANEL), 16, INT8_PANEL, 4)  # (K = 40 padded to 64)
    got = g.run(feeds)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def _onnx_model(rng, path):
    """x[4, 48] -> MatMul(W1[48, 100]) -> Gemm(W2ᵀ[64, 100], b2, alpha, beta) -> MatMul(W3[64, 30])."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inits = [numpy_helper.from_array(f(48, 100), "w1"), numpy_helper.from_array(f(64, 100), "w2"),
             numpy_helper.from_array(f(64), "b2"), numpy_helper.from_array(f(64, 30), "w3")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="fc1"),
             helper.make_node("Gemm", ["h1", "w2", "b2"], ["h2"], name="fc2", transB=1, alpha=0.7, beta=1.5),
             helper.make_node("MatMul", ["h2", "w3"], ["y"], name="fc3")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 48])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 30])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path.write_bytes(model.SerializeToString())
    return model


def _mlp_with_reference(tmp_path, seed):
    """:func:`_onnx_model` written under ``tmp_path``, an input ``x`` and onnxruntime's output on it."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(seed)
    path = tmp_path / "mlp.onnx"
    _onnx_model(rng, path)
    x = rng.standard_normal((4, 48)).astype(np.float32)
    return path, x, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _compiled_ranks(path, out, mesh, algo, x, **options):
    """Compile ``path`` for cpu ranks on ``mesh`` into ``out`` (more ``optimization_config`` in ``options``);
    each rank's program.json and the output ``y`` every rank computes from ``x`` (in-process ranks)."""
    compile(path, distributed_config={"mesh_shape": mesh, "algo": algo},
            optimization_config={"target": "cpu", **options}, out_dir=out)
    world = int(np.prod(mesh))
    programs = [json.loads((out / f"rank{r}" / "program.json").read_text()) for r in range(world)]

    def work(c):
        return load(out, c.rank, c).run({"x": x})["y"]
    return programs, run_threads(InProcessWorld(world).communicators(), work, timeout=120)


@pytest.mark.parametrize("mesh,algo", [([1], "ilp"), ([2], "megatron")])
def test_compiled_ranks_read_packed_weights_and_match_onnxruntime(tmp_path, mesh, algo):
    path, x, want = _mlp_with_reference(tmp_path, 1)
    programs, got = _compiled_ranks(path, tmp_path / "out", mesh, algo, x)
    for program in programs:
        kinds = [s["op_type"] for s in program["steps"] if s["kind"] == "kernel"]
        assert kinds.count("PackedMatMul") == 3 and "MatMul" not in kinds and "Gemm" not in kinds
        packed = [b for b in program["buffers"] if b["name"].endswith((".panels", ".panels.T"))]
        assert len(packed) == 3 and all(b["storage"] == "weights" and b["shape"][-1] == PANEL for b in packed)
    for g in got:
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("algo,shared", [("replicate", True), ("data", True), ("megatron", False)])
def test_ranks_holding_a_weight_whole_share_its_pack_and_their_weights_file(tmp_path, monkeypatch, algo, shared):
    """The ranks of one compile that hold a weight whole (replicated) share one packed copy, made once
    (passes/prepack.py PackCache), and a rank whose weights are the same arrays as an earlier rank's
    gets a hard link to that rank's weights.bin; a Megatron plan's shards are packed and written per
    rank. Every rank still matches onnxruntime."""
    import shardflow.compiler.ops.linalg as linalg

    calls = []
    real = linalg.pack_panels
    monkeypatch.setattr(linalg, "pack_panels", lambda b: calls.append(b.shape) or real(b))
    path, x, want = _mlp_with_reference(tmp_path, 3)
    _, got = _compiled_ranks(path, tmp_path / "out", [2], algo, x)
    assert len(calls) == (3 if shared else 6), calls
    files = [(tmp_path / "out" / f"rank{r}" / "weights.bin").stat() for r in range(2)]
    assert (files[0].st_ino == files[1].st_ino) == shared and files[0].st_nlink == (2 if shared else 1)
    for g in got:
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)


def test_prepack_false_keeps_the_contractions(tmp_path):
    rng = np.random.default_rng(2)
    path = tmp_path / "mlp.onnx"
    _onnx_model(rng, path)
    out = tmp_path / "out"
    compile(path, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu", "prepack": False},
            out_dir=out)
    program = json.loads((out / "rank0" / "program.json").read_text())
    assert [s["op_type"] for s in program["steps"] if s["kind"] == "kernel"] == ["MatMul", "Gemm", "MatMul"]


def test_prepack_must_be_a_bool():
    from shardflow.compiler import ConfigError
    from shardflow.compiler.driver import OptimizationConfig

    assert OptimizationConfig.from_dict(None).prepack is True
    with pytest.raises(ConfigError, match=r"optimization_config\['prepack'\] = 'yes': need true or false"):
        OptimizationConfig.from_dict({"prepack": "yes"})


def test_the_pass_packs_convs_on_small_images_only():
    """1x1 convs of one group on float32 with a constant weight, whose output images have at most
    CONV_MAX_PIXELS pixels, become PackedConvs computing the same values; convs sharing a weight share
    one packed copy when all of them are packed, and keep the weight when one of them is not."""
    from shardflow.compiler.ops.conv import Conv
    from shardflow.compiler.passes.prepack import CONV_MAX_PIXELS

    rng = np.random.default_rng(3)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    weights = [f(20, 8, 1, 1), f(20), f(12, 8, 1, 1), f(12, 8, 1, 1), f(8, 2, 1, 1), f(8, 8, 1, 1), f(6, 8, 3, 3),
               f(4, 8, 1, 1)]

    def build():  # the pass rewrites the graph it is given
        small, large = Tensor("small", (2, 8, 9, 9), "float32"), Tensor("large", (1, 8, 17, 17), "float32")
        w = [const_tensor(v) for v in weights]
        ops = [
            Conv([small, w[0], w[1]], name="c1x1", pads=(1, 1, 1, 1)),                  # 11 x 11 pixels
            Conv([small, w[2]], name="c1x1_s2", strides=(2, 2)),
            Conv([large, w[3]], name="c_large"),                                        # 289 pixels
            Conv([small, w[6]], name="c3x3", pads=(1, 1, 1, 1)),                        # not 1x1
            Conv([small, w[4]], name="c_grouped", group=4),
            Conv([small, w[5]], name="c_shared_a"),                                     # one weight, two
            Conv([small, w[5]], name="c_shared_b"),                                     # packed readers
            Conv([small, w[7]], name="c_mixed_a"),                                      # one packed reader,
            Conv([large, w[7]], name="c_mixed_b"),                                      # one not: kept
            Conv([small, Tensor("w_in", (4, 8, 1, 1), "float32")], name="c_weight_input"),
        ]
        return FlowGraph([small, large, ops[-1].inputs[1]], [o.outputs[0] for o in ops])

    assert 11 * 11 <= CONV_MAX_PIXELS < 17 * 17
    feeds = {"small": f(2, 8, 9, 9), "large": f(1, 8, 17, 17), "w_in": f(4, 8, 1, 1)}
    want = build().run(feeds)
    packed = PrepackWeights().run(build())
    packed.validate()
    assert {op.name: op.op_type for op in packed.nodes} == {
        "c1x1": "PackedConv", "c1x1_s2": "PackedConv", "c_large": "Conv", "c3x3": "Conv", "c_grouped": "Conv",
        "c_shared_a": "PackedConv", "c_shared_b": "PackedConv", "c_mixed_a": "Conv", "c_mixed_b": "Conv",
        "c_weight_input": "Conv"}
    by = {op.name: op for op in packed.nodes}
    assert by["c_shared_a"].inputs[1] is by["c_shared_b"].inputs[1]
    assert by["c1x1"].inputs[1].shape == (-(-20 // PANEL), 8, PANEL)
    got = packed.run(feeds)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    assert {op.op_type for op in PrepackWeights(conv_max_pixels=0).run(build()).nodes} == {"Conv"}


def test_the_pass_packs_strided_convs_of_long_products_only():
    """2-D convs of horizontal stride 2 with a window wider than 1x1 and at least STRIDED_MIN_K products
    per output become PackedConvs computing the same values; shorter products, stride 1 (on images
    larger than SMALL_MAX_PIXELS) or 3, and ``windows=False`` keep the Conv."""
    from shardflow.compiler.ops.conv import Conv
    from shardflow.compiler.passes.prepack import STRIDED_MIN_K

    rng = np.random.default_rng(5)
    f = lambda *s: rng.standard_normal(s).astype(np.float32) / 10  # noqa: E731
    weights = [f(20, 128, 3, 3), f(20), f(20, 8, 3, 3), f(20, 128, 3, 3), f(20, 128, 3, 3), f(24, 128, 3, 3)]

    def build():
        x, xs = Tensor("x", (2, 128, 9, 11), "float32"), Tensor("xs", (1, 8, 9, 11), "float32")
        w = [const_tensor(v) for v in weights]
        ops = [
            Conv([x, w[0], w[1]], name="s2", strides=(2, 2), pads=(1, 1, 1, 1)),         # K = 1152
            Conv([xs, w[2]], name="s2_short", strides=(2, 2)),                         # K = 72
            Conv([x, w[3]], name="s1", pads=(1, 1, 1, 1)),                             # stride 1 (few pixels:
            Conv([x, w[4]], name="s3", strides=(3, 3)),                                # not Winograd's either)
            Conv([x, w[5]], name="s12", strides=(1, 2), dilations=(2, 1), pads=(0, 1, 2, 0)),
        ]
        return FlowGraph([x, xs], [o.outputs[0] for o in ops])

    assert 8 * 9 < STRIDED_MIN_K <= 32 * 9
    feeds = {"x": f(2, 128, 9, 11), "xs": f(1, 8, 9, 11)}
    want = build().run(feeds)
    packed = PrepackWeights(winograd=False).run(build())
    packed.validate()
    assert {op.name: op.op_type for op in packed.nodes} == {
        "s2": "PackedConv", "s2_short": "Conv", "s1": "Conv", "s3": "Conv", "s12": "PackedConv"}
    got = packed.run(feeds)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-4, err_msg=k)
    kept = PrepackWeights(winograd=False, windows=False).run(build())
    assert {op.name: op.op_type for op in kept.nodes}["s2"] == "Conv"


def test_3x3_convs_on_small_images_are_packed_convs_before_winograd():
    """A 3x3 stride-1 conv of at least SMALL_MIN_K products per output on an image of at most
    SMALL_MAX_PIXELS output pixels becomes a PackedConv even where Winograd's rule would take it (a
    7x7 image of 128 channels); at 9x9, or 5x5 windows, or short products it does not."""
    from shardflow.compiler.ops.conv import Conv
    from shardflow.compiler.passes.prepack import SMALL_MAX_PIXELS, SMALL_MIN_K, winograd_tile

    rng = np.random.default_rng(7)
    f = lambda *s: rng.standard_normal(s).astype(np.float32) / 10  # noqa: E731
    weights = [f(64, 128, 3, 3), f(64, 128, 3, 3), f(64, 128, 5, 5), f(64, 64, 3, 3)]

    def build():
        x7, x9 = Tensor("x7", (1, 128, 7, 7), "float32"), Tensor("x9", (1, 128, 9, 9), "float32")
        x7s = Tensor("x7s", (1, 64, 7, 7), "float32")
        w = [const_tensor(v) for v in weights]
        ops = [Conv([x7, w[0]], name="small", pads=(1, 1, 1, 1)),
               Conv([x9, w[1]], name="larger", pads=(1, 1, 1, 1)),
               Conv([x7, w[2]], name="w5x5", pads=(2, 2, 2, 2)),
               Conv([x7s, w[3]], name="short", pads=(1, 1, 1, 1))]
        return FlowGraph([x7, x9, x7s], [o.outputs[0] for o in ops])

    assert 49 <= SMALL_MAX_PIXELS < 81 and 64 * 9 < SMALL_MIN_K <= 128 * 9
    assert winograd_tile(128, 64, 7, 7) and winograd_tile(128, 64, 9, 9) and winograd_tile(64, 64, 7, 7)
    feeds = {"x7": f(1, 128, 7, 7), "x9": f(1, 128, 9, 9), "x7s": f(1, 64, 7, 7)}
    want = build().run(feeds)
    packed = PrepackWeights().run(build())
    assert {op.name: op.op_type for op in packed.nodes} == {
        "small": "PackedConv", "larger": "WinogradConv", "w5x5": "Conv", "short": "WinogradConv"}
    got = packed.run(feeds)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-4, err_msg=k)
    assert {op.name: op.op_type for op in PrepackWeights(windows=False).run(build()).nodes}["small"] == "WinogradConv"


@pytest.mark.parametrize("mesh,algo", [([1], "ilp"), ([2], "megatron")])
def test_compiled_ranks_run_strided_packed_convs_and_match_onnxruntime(tmp_path, mesh, algo):
    """Two 3x3 stride-2 convs of 128 channels, one + bias + a residual + Relu (the kernel's finish), one
    * 0.5 then Sigmoid (an epilogue), their sum the output, compiled for one and two cpu ranks: both are
    PackedConvs, read from the channel-blocked image on an AVX-512 host (rows of 14 + 3 pixels; 40 output
    channels: a block of 32 and one of 8), and the output is onnxruntime's."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(6)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inits = [numpy_helper.from_array(f(40, 128, 3, 3) / 30, "w1"), numpy_helper.from_array(f(40), "b1"),
             numpy_helper.from_array(f(2, 40, 6, 17), "r"), numpy_helper.from_array(f(40, 128, 3, 3) / 30, "w2"),
             numpy_helper.from_array(np.float32(0.5), "half")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv1"),
             helper.make_node("Add", ["c1", "r"], ["a1"]),
             helper.make_node("Relu", ["a1"], ["r1"]),
             helper.make_node("Conv", ["x", "w2"], ["c2"], pads=[1, 1, 1, 0], strides=[2, 2],
                              name="conv2"),
             helper.make_node("Mul", ["c2", "half"], ["m2"]),
             helper.make_node("Sigmoid", ["m2"], ["s2"]),
             helper.make_node("Add", ["r1", "s2"], ["y"])]
    graph = helper.make_graph(nodes, "strided", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 128, 11, 34])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 40, 6, 17])], inits)
    path = tmp_path / "strided.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    x = f(2, 128, 11, 34)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    programs, got = _compiled_ranks(path, tmp_path / "out", mesh, algo, x)
    for program in programs:
        kinds = [s["op_type"] for s in program["steps"] if s["kind"] == "kernel"]
        # conv2's product by 0.5 is folded into its weight (passes/fold.py)
        assert {"w1.panels", "conv2.folded_w.panels"} <= {b["name"] for b in program["buffers"]} and "Conv" not in kinds
    for g in got:
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh,algo", [([1], "ilp"), ([2], "megatron")])
def test_compiled_ranks_run_strided_1d_packed_convs_and_match_onnxruntime(tmp_path, mesh, algo):
    """A speech model's feature extractor: a Conv1d of one channel to 64 (kernel 10, stride 5: the GEMM, not
    the depthwise kernel), Relu, then two Conv1d 64 -> 64 of kernel 5 and 3 at stride 2 (320 and 192 products
    per output: the first a PackedConv, the second below STRIDED_MIN_K, the conv template), + bias and Relu;
    compiled for one and two cpu ranks, against onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(8)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inits = [numpy_helper.from_array(f(64, 1, 10) / 3, "w0"), numpy_helper.from_array(f(64, 64, 5) / 18, "w1"),
             numpy_helper.from_array(f(64), "b1"), numpy_helper.from_array(f(64, 64, 3) / 14, "w2")]
    n = helper.make_node
    nodes = [n("Conv", ["x", "w0"], ["c0"], strides=[5], name="conv0"), n("Relu", ["c0"], ["r0"]),
             n("Conv", ["r0", "w1", "b1"], ["c1"], strides=[2], pads=[2, 2], name="conv1"), n("Relu", ["c1"], ["r1"]),
             n("Conv", ["r1", "w2"], ["y"], strides=[2], name="conv2")]
    graph = helper.make_graph(nodes, "speech", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 1000])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64, 49])], inits)
    path = tmp_path / "speech.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    x = f(2, 1, 1000)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    programs, got = _compiled_ranks(path, tmp_path / "out", mesh, algo, x)
    for program in programs:  # (each conv's Relu fused into its kernel)
        names = {b["name"] for b in program["buffers"]}
        assert "w1.panels" in names and {"w0", "w2"} <= names and "w1" not in names
    for g in got:
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("mesh,algo", [([1], "ilp"), ([2], "megatron")])
def test_compiled_ranks_run_packed_convs_and_match_onnxruntime(tmp_path, mesh, algo):
    """A small conv net (3x3 + bias + Relu, a strided 1x1, a 1x1 with a residual add, a 1x1 head)
    compiled for one and two cpu ranks: its 1x1 convs are PackedConvs (epilogues fused), and the
    output is onnxruntime's."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(4)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inits = [numpy_helper.from_array(f(32, 16, 3, 3) / 12, "w1"), numpy_helper.from_array(f(32), "b1"),
             numpy_helper.from_array(f(32, 32, 1, 1) / 6, "w2"), numpy_helper.from_array(f(32, 32, 1, 1) / 6, "w3"),
             numpy_helper.from_array(f(10, 32, 1, 1) / 6, "w4")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], strides=[2, 2], name="conv2"),
             helper.make_node("Conv", ["c2", "w3"], ["c3"], name="conv3"),
             helper.make_node("Add", ["c3", "c2"], ["a3"]),
             helper.make_node("Conv", ["a3", "w4"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "convnet",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 10, 6, 6])], inits)
    path = tmp_path / "convnet.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    x = f(2, 16, 12, 12)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    programs, got = _compiled_ranks(path, tmp_path / "out", mesh, algo, x)
    for program in programs:
        names = {b["name"] for b in program["buffers"]}
        assert {"w2.panels", "w3.panels", "w4.panels"} <= names and not names & {"w2", "w3", "w4"}
    for g in got:
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [2, 4])
def test_winograd_transforms_are_a_correlation(m):
    """The (B^T, G, A^T) of ops.conv.WINOGRAD (what the kernel's transforms hard-code) give m outputs of a
    3-tap correlation, and WinogradConv.weight inverts winograd_weights."""
    from shardflow.compiler.ops.conv import WINOGRAD, WinogradConv, winograd_weights

    bt, g, at = WINOGRAD[m]
    rng = np.random.default_rng(m)
    d, taps = rng.standard_normal(m + 2), rng.standard_normal(3)
    np.testing.assert_allclose(at @ ((g @ taps) * (bt @ d)), [d[i:i + 3] @ taps for i in range(m)], atol=1e-12)
    w = rng.standard_normal((20, 5, 3, 3)).astype(np.float32)
    op = WinogradConv([Tensor("x", (1, 5, 8, 8), "float32"), const_tensor(winograd_weights(w, m))], oc=20, m=m)
    np.testing.assert_allclose(op.weight(op.inputs[1].value), w, rtol=1e-5, atol=1e-6)


def test_winograd_tile_rule():
    from shardflow.compiler.passes.prepack import winograd_tile

    assert winograd_tile(64, 64, 28, 28) == 4       # 49 tiles of 4x4
    assert winograd_tile(64, 64, 14, 14) == 2       # 16 of 4x4, 49 of 2x2
    assert winograd_tile(512, 512, 7, 7) == 2       # 16 of 2x2
    assert winograd_tile(64, 64, 6, 6) == 0         # 9 of 2x2
    assert winograd_tile(64, 64, 14, 14, images=3) == 4
    assert winograd_tile(32, 64, 56, 56) == 0 and winograd_tile(64, 48, 56, 56) == 0  # few channels
    # against the direct conv on blocked tensors: tiles x C x OC of at least 250,000 (F(4x4)), 2,000,000 (F(2x2))
    assert winograd_tile(64, 64, 28, 28, blocked=True) == 0        # 49 x 64 x 64 = 200,704
    assert winograd_tile(64, 96, 28, 28, blocked=True) == 4        # 301,056
    assert winograd_tile(64, 64, 56, 56, blocked=True) == 4
    assert winograd_tile(192, 192, 14, 14, blocked=True) == 0      # 49 tiles of 2x2: 1,806,336
    assert winograd_tile(192, 256, 14, 14, blocked=True) == 2      # 2,408,448
    assert winograd_tile(96, 96, 14, 14, images=8, blocked=True) == 4


def test_the_pass_makes_winograd_convs_of_the_3x3_convs_it_picks():
    """3x3 convs of stride 1, dilation 1, one group and a constant weight, that winograd_tile picks,
    become WinogradConvs whose values are the conv's to rounding (two of one tile sharing a weight share
    its transform; two of different tiles keep it); winograd=False keeps them."""
    from shardflow.compiler.ops.conv import Conv, WinogradConv

    rng = np.random.default_rng(5)
    f = lambda *s: (rng.standard_normal(s) / 24).astype(np.float32)  # noqa: E731
    weights = [f(64, 64, 3, 3), f(64), f(64, 64, 3, 3), f(64, 64, 3, 3), f(64, 64, 3, 3), f(64, 32, 3, 3),
               f(32, 64, 3, 3), f(64, 64, 3, 3), f(64, 64, 3, 3)]

    def build():
        x28, x12 = Tensor("x28", (1, 64, 28, 28), "float32"), Tensor("x12", (1, 64, 12, 12), "float32")
        w = [const_tensor(v) for v in weights]
        ops = [
            Conv([x28, w[0], w[1]], name="f4", pads=(1, 1, 1, 1)),                      # 49 tiles of 4x4
            Conv([x12, w[2]], name="f2", pads=(1, 1, 1, 1)),                            # 9 of 4x4, 36 of 2x2
            Conv([x28, w[3]], name="strided", strides=(2, 2), pads=(1, 1, 1, 1)),
            Conv([x28, w[4]], name="dilated", dilations=(2, 2), pads=(2, 2, 2, 2)),
            Conv([x12, w[5]], name="grouped", group=2, pads=(1, 1, 1, 1)),
            Conv([x12, w[6]], name="few_out", pads=(1, 1, 1, 1)),
            Conv([x12, w[7]], name="shared_a"),                                         # one weight, two
            Conv([x12, w[7]], name="shared_b"),                                         # F(2x2) readers
            Conv([x12, w[8]], name="mixed_a"),                                          # F(2x2) and F(4x4)
            Conv([x28, w[8]], name="mixed_b", pads=(1, 1, 1, 1)),                       # readers: kept
        ]
        return FlowGraph([x28, x12], [o.outputs[0] for o in ops])

    feeds = {"x28": rng.standard_normal((1, 64, 28, 28)).astype(np.float32),
             "x12": rng.standard_normal((1, 64, 12, 12)).astype(np.float32)}
    want = build().run(feeds)
    g = PrepackWeights().run(build())
    g.validate()
    kinds = {op.name: (op.op_type, op.attrs.get("m")) for op in g.nodes}
    assert kinds == {"f4": ("WinogradConv", 4), "f2": ("WinogradConv", 2), "strided": ("PackedConv", None),
                     "dilated": ("Conv", None), "grouped": ("Conv", None), "few_out": ("Conv", None),
                     "shared_a": ("WinogradConv", 2), "shared_b": ("WinogradConv", 2), "mixed_a": ("Conv", None),
                     "mixed_b": ("Conv", None)}
    by = {op.name: op for op in g.nodes}
    assert by["shared_a"].inputs[1] is by["shared_b"].inputs[1]
    assert isinstance(by["f4"], WinogradConv) and by["f4"].inputs[1].shape == (36, 64 // PANEL, 64, PANEL)
    got = g.run(feeds)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5 * float(np.abs(v).max()), err_msg=k)
    assert "WinogradConv" not in {op.op_type for op in PrepackWeights(winograd=False).run(build()).nodes}


def test_ops_without_inputs_pass_through():
    """A weight made at run time (ConstantOfShape above the fold limit, as in onnx's light AlexNet)
    comes from an op with no inputs; the pass skipped such ops only after reading their first input
    (an IndexError). The conv that reads it is left as it is (its weight is no constant)."""
    from shardflow.compiler.ops.conv import Conv
    from shardflow.compiler.ops.transform import Full

    x = Tensor("x", (1, 64, 12, 12), "float32")
    full = Full([], name="w", shape=(64, 64, 3, 3), value=0.01, dtype="float32")
    conv = Conv([x, full.outputs[0]], name="conv", pads=(1, 1, 1, 1))
    g = PrepackWeights().run(FlowGraph([x], [conv.outputs[0]]))
    assert [op.op_type for op in g.nodes] == ["Full", "Conv"]


def _winograd_net(rng, path):
    """x [2, 128, 20, 20] -> 3x3 conv + bias -> Relu -> 2x2 max pool -> 3x3 conv -> + the pool -> y."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inits = [numpy_helper.from_array(f(128, 128, 3, 3) / 34, "w1"), numpy_helper.from_array(f(128), "b1"),
             numpy_helper.from_array(f(128, 128, 3, 3) / 34, "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Add", ["c2", "p1"], ["y"])]
    graph = helper.make_graph(nodes, "winograd",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 128, 20, 20])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 128, 10, 10])], inits)
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())


@pytest.mark.parametrize("mesh,algo", [([1], "ilp"), ([2], "ilp"), ([2], "megatron")])
def test_compiled_ranks_run_winograd_convs_and_match_onnxruntime(tmp_path, mesh, algo):
    """Two 3x3 convs of 128 channels compiled for one and two cpu ranks run as WinogradConvs (their
    weights transformed, the Relu fused) and match onnxruntime (``blocked: False``: the rule without the
    blocked direct conv); with the blocked layout only the first (50 tiles of 4x4 over the two images)
    does, the second (10x10: 50 tiles of 2x2, 819,200 < 2,000,000 of work) runs the blocked direct conv;
    ``winograd: False`` runs them directly, and a memory budget keeps their weights as they are."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(6)
    path = tmp_path / "winograd.onnx"
    _winograd_net(rng, path)
    x = rng.standard_normal((2, 128, 20, 20)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    programs, got = _compiled_ranks(path, tmp_path / "out", mesh, algo, x, blocked=False)
    for program in programs:
        names = {b["name"] for b in program["buffers"]}
        assert any(n.startswith("w1.winograd") for n in names) and any(n.startswith("w2.winograd") for n in names)
        assert not names & {"w1", "w2"}
    for g in got:
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))
    if mesh == [1]:
        programs, got = _compiled_ranks(path, tmp_path / "blocked", mesh, algo, x)
        names = {b["name"] for b in programs[0]["buffers"]}
        assert any(n.startswith("w1.winograd") for n in names) and not any(n.startswith("w2.winograd") for n in names)
        np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))
        programs, got = _compiled_ranks(path, tmp_path / "direct", mesh, algo, x, winograd=False)
        assert not any(".winograd" in b["name"] for b in programs[0]["buffers"])
        np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))
        # under a memory budget the plan counted the 3x3 weights: they stay so
        compile(path, distributed_config={"mesh_shape": mesh, "memory_budget_bytes": 1 << 30},
                optimization_config={"target": "cpu"}, out_dir=tmp_path / "budget")
        program = json.loads((tmp_path / "budget" / "rank0" / "program.json").read_text())
        assert {"w1", "w2"} <= {b["name"] for b in program["buffers"]}


def test_winograd_must_be_a_bool():
    from shardflow.compiler import ConfigError
    from shardflow.compiler.driver import OptimizationConfig

    assert OptimizationConfig.from_dict(None).winograd is True
    with pytest.raises(ConfigError, match=r"optimization_config\['winograd'\] = 1: need true or false"):
        OptimizationConfig.from_dict({"winograd": 1})


def _integer_convs_model(rng):
    """Integer convs that the cpu target runs on the integer conv: a uint8 image with a constant zero point
    and an int8 weight with one per channel, a run-time zero point, an int8 image with a uint8 weight and
    no zero points, groups with strides and dilations, a 1-D conv, a QLinearConv (its bias added after);
    and a depthwise one, too thin for the GEMM (INT8_CONV_MIN_K), which stays a Conv."""
    u8 = lambda *s: rng.integers(0, 256, s).astype(np.uint8)  # noqa: E731
    i8 = lambda *s: rng.integers(-128, 128, s).astype(np.int8)  # noqa: E731
    inits = [numpy_helper.from_array(a, n) for n, a in (
        ("w1", i8(20, 8, 3, 3)), ("w1zp", i8(20)), ("x1zp", np.array(131, np.uint8)),
        ("w2", u8(8, 72, 1, 1)), ("w3", i8(12, 22, 2, 3)), ("w3zp", np.array(-4, np.int8)),
        ("w4", u8(16, 24, 3)), ("w4zp", np.array(100, np.uint8)), ("x4zp", np.array(7, np.uint8)),
        ("w5", i8(8, 1, 3, 3)), ("xs", np.array(0.02, np.float32)), ("ws", np.full(20, 0.01, np.float32)),
        ("ys", np.array(3.0, np.float32)), ("yzp", np.array(9, np.uint8)), ("b", rng.integers(-999, 999, 20)
                                                                               .astype(np.int32)))]
    nodes = [helper.make_node("ConvInteger", ["x", "w1", "x1zp", "w1zp"], ["y1"], name="const_zp", pads=[1, 1, 1, 1]),
             helper.make_node("ConvInteger", ["x72", "w2", "xzp"], ["y2"], name="runtime_zp"),
             helper.make_node("ConvInteger", ["xi", "w3", "", "w3zp"], ["y3"], name="grouped", group=2,
                              strides=[2, 1], dilations=[1, 2], pads=[0, 1, 1, 2]),
             helper.make_node("ConvInteger", ["x1", "w4", "x4zp", "w4zp"], ["y4"], name="one_d", strides=[2],
                              pads=[1, 1]),
             helper.make_node("ConvInteger", ["x", "w5", "x1zp"], ["y5"], name="depthwise", group=8, pads=[1, 1, 1, 1]),
             helper.make_node("QLinearConv", ["x", "xs", "x1zp", "w1", "ws", "w1zp", "ys", "yzp", "b"], ["y6"],
                              name="qlinear", pads=[1, 1, 1, 1], strides=[2, 2])]
    graph = helper.make_graph(nodes, "convs", [
        helper.make_tensor_value_info("x", TensorProto.UINT8, [2, 8, 9, 7]),
        helper.make_tensor_value_info("x72", TensorProto.UINT8, [1, 72, 5, 6]),
        helper.make_tensor_value_info("xzp", TensorProto.UINT8, []),
        helper.make_tensor_value_info("xi", TensorProto.INT8, [1, 44, 8, 10]),
        helper.make_tensor_value_info("x1", TensorProto.UINT8, [1, 24, 30])],
        [helper.make_tensor_value_info(n, dt, s) for n, dt, s in (
            ("y1", TensorProto.INT32, [2, 20, 9, 7]), ("y2", TensorProto.INT32, [1, 8, 5, 6]),
            ("y3", TensorProto.INT32, [1, 12, 4, 9]), ("y4", TensorProto.INT32, [1, 16, 15]),
            ("y5", TensorProto.INT32, [2, 8, 9, 7]), ("y6", TensorProto.UINT8, [2, 20, 5, 4]))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    feeds = {"x": u8(2, 8, 9, 7), "x72": u8(1, 72, 5, 6), "xzp": np.array(250, np.uint8), "xi": i8(1, 44, 8, 10),
             "x1": u8(1, 24, 30)}
    return model, feeds


def test_integer_convs_run_on_the_integer_conv_with_the_same_values(tmp_path):
    """ConvInteger and QLinearConv (an int32 Conv of the widened image less its zero point) become a
    PackedConvInteger on the image's bytes: the same values as the ONNX reference, in the graph after the
    pass and compiled for a cpu rank; a depthwise one and int32 Convs of other values stay."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    from shardflow.compiler import load_onnx

    model, feeds = _integer_convs_model(np.random.default_rng(5))
    want = dict(zip(["y1", "y2", "y3", "y4", "y5", "y6"], ReferenceEvaluator(model).run(None, feeds)))
    g = PrepackWeights().run(load_onnx(model))
    assert {op.name: op.op_type for op in g.nodes if op.op_type in ("Conv", "PackedConvInteger")} == {
        "const_zp": "PackedConvInteger", "runtime_zp": "PackedConvInteger", "grouped": "PackedConvInteger",
        "one_d": "PackedConvInteger", "depthwise": "Conv", "qlinear/conv_int32": "PackedConvInteger"}
    got = g.run(feeds)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    # an int32 conv of an int32 input, or with weights spanning more than a byte, stays
    x, xb = Tensor("x", (1, 2, 6, 6), "int32"), Tensor("xb", (1, 2, 6, 6), "uint8")
    for graph_input, inp, w in ((x, x, np.ones((3, 2, 1, 1), np.int32)),
                                (xb, CastOp([xb], to="int32").outputs[0], np.array([0, 300] * 3, np.int32))):
        conv = Conv([inp, const_tensor(w.reshape(3, 2, 1, 1))], name="c")
        kept = PrepackWeights().run(FlowGraph([graph_input], conv.outputs))
        kinds = [op.op_type for op in kept.nodes]
        assert "Conv" in kinds and "PackedConvInteger" not in kinds
    path = tmp_path / "convs.onnx"
    onnx.save(model, path)
    compile(str(path), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
            out_dir=tmp_path / "out")
    program = json.loads((tmp_path / "out" / "rank0" / "program.json").read_text())
    assert [s["op_type"] for s in program["steps"] if s["kind"] == "kernel"].count("PackedConvInteger") == 5
    got = load(tmp_path / "out", rank=0).run(feeds)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def _tied_head_model(path, vocab: int, shared: bool = False):
    """Token ids looked up in a table ``[V, 64]``, a Tanh, and an output layer tied to the table, written to
    ``path``: ids ``[2, 5]`` and a MatMul by the table's transposed copy (GPT-2's head as torch exports it),
    or (``shared``) ids ``[10]`` and a ``Gemm(transB=1)`` of the table itself. Returns the ids (one negative)
    and onnxruntime's logits."""
    import onnxruntime as ort

    table = np.random.default_rng(3).standard_normal((vocab, 64)).astype(np.float32)
    inits = [numpy_helper.from_array(table, "wte")]
    ids = np.array([[0, 17, vocab - 1, 33, -1], [25, 24, 3, 16, 40]], np.int64)
    if shared:
        ids = ids.reshape(-1)
        head = helper.make_node("Gemm", ["t", "wte"], ["logits"], transB=1)
    else:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(table.T), "lm_head"))
        head = helper.make_node("MatMul", ["t", "lm_head"], ["logits"])
    nodes = [helper.make_node("Gather", ["wte", "ids"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]), head]
    g = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ids.shape)],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ids.shape + (vocab,))], inits)
    helper_model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with open(path, "wb") as fh:
        fh.write(helper_model.SerializeToString())
    return ids, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs a C++ compiler")
@pytest.mark.parametrize("precision,prepack,shared", [("float32", True, False), ("bfloat16", True, False),
                                                      ("float32", False, False), ("float32", True, True)])
@pytest.mark.parametrize("mesh,algo", [([1], "ilp"), ([2], "megatron")])
def test_a_tied_table_is_read_from_the_output_layers_weight(tmp_path, precision, prepack, shared, mesh, algo):
    """The cpu target's gather from a token table whose transposed copy is an output layer's weight (GPT-2's
    tied head) reads the rows as that weight's columns (GatherColumns): from its float32 or bfloat16 panels,
    or from the weight as it is (``prepack`` off). The table is not stored (before: beside the weight, as
    many bytes again). A ``Gemm(transB=1)`` of the table itself (``shared``) now takes the panels too
    (before: the GEMM packed the table on every call). On two ranks (Megatron: the table split by rows, the
    head by columns) each rank reads its 25 rows from its own part of the weight and the ids of the other
    rank's rows read zeros. The logits match onnxruntime (bfloat16: within its tolerance)."""
    from shardflow.compiler import load_onnx
    from shardflow.compiler.driver import OptimizationConfig, plan_passes, rank_passes
    from shardflow.compiler.parallel import partition, search

    vocab = 50
    path = tmp_path / "tied.onnx"
    ids, want = _tied_head_model(path, vocab, shared)
    rows = vocab // mesh[0]
    # the one weight stored: the panels, or the head [64, rows]
    stored_rows = -(-rows // 16) if prepack else 64
    graph = plan_passes(load_onnx(str(path)), mesh)
    options = {"target": "cpu", "precision": precision, "prepack": prepack}
    for rg in partition(graph, search(graph, {"mesh_shape": mesh, "algo": algo})):
        rg = rank_passes(rg, OptimizationConfig.from_dict(options))
        (head,) = [op for op in rg.nodes if op.op_type in ("MatMul", "Gemm", "PackedMatMul", "PackedMatMulBf16")]
        (lookup,) = [op for op in rg.nodes if op.op_type in ("Gather", "GatherColumns")]
        assert lookup.op_type == "GatherColumns" and lookup.inputs[0] is head.inputs[1], lookup
        assert [t.shape[0] for t in rg.constants()] == [stored_rows], rg.constants()
    out = tmp_path / "out"
    compile(str(path), distributed_config={"mesh_shape": mesh, "algo": algo}, optimization_config=options,
            out_dir=out)
    world = int(np.prod(mesh))
    for r in range(world):
        program = json.loads((out / f"rank{r}" / "program.json").read_text())
        stored = [b["shape"] for b in program["buffers"] if b["storage"] == "weights"]
        assert len(stored) == 1 and stored[0][0] == stored_rows, stored

    def work(c):
        return load(out, c.rank, c).run({"ids": ids})["logits"]
    scale = float(np.abs(want).max())
    for got in run_threads(InProcessWorld(world).communicators(), work, timeout=120):
        np.testing.assert_allclose(got, want, rtol=0, atol=(2e-2 if precision == "bfloat16" else 1e-5) * scale)


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs a C++ compiler")
def test_replicated_ranks_compare_a_tied_table_with_the_panels_once(tmp_path, monkeypatch):
    """On ranks that all hold the tied head whole (a ``replicate`` plan) the panels are made once and the
    test that the table is their columns (a whole pass over both) runs once, not per rank
    (PackCache); every rank reads its rows there and matches onnxruntime, and the ranks' weights are
    one file."""
    import shardflow.compiler.passes.precision as precision

    calls = []
    real = precision._panel_bits
    monkeypatch.setattr(precision, "_panel_bits", lambda bp, table: calls.append(bp.shape) or real(bp, table))
    path = tmp_path / "tied.onnx"
    ids, want = _tied_head_model(path, 50, False)
    out = tmp_path / "out"
    compile(str(path), distributed_config={"mesh_shape": [3], "algo": "replicate"},
            optimization_config={"target": "cpu"}, out_dir=out)
    assert len(calls) == 1, calls
    for r in range(3):
        program = json.loads((out / f"rank{r}" / "program.json").read_text())
        stored = [b["shape"] for b in program["buffers"] if b["storage"] == "weights"]
        assert len(stored) == 1 and stored[0][0] == 4, stored  # (the panels only: the table is not stored)
    assert (out / "rank2" / "weights.bin").stat().st_nlink == 3

    def work(c):
        return load(out, c.rank, c).run({"ids": ids})["logits"]
    for got in run_threads(InProcessWorld(3).communicators(), work, timeout=120):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
