"""``optimization_config["precision"]``: float16 contractions (compiler/passes/precision.py) on
the cpu target against onnxruntime, the graph it produces, and the cuda kernels it selects.

Tolerances (documented in rfcs/0004-precision-and-fusion.md): operands of contractions are
rounded to float16 (relative error 2**-11 each) or bfloat16 (2**-8) and accumulated in float32, so
outputs stay within ``5e-3 * max|reference|`` (float16; measured worst 7e-4, ResNet and T5) or
``2e-2 * max|reference|`` (bfloat16; measured worst 5.9e-3, ResNet) of the float32 model.
On the cpu target both run (bfloat16 stored as 16-bit patterns since session 34); without a GPU the
bfloat16 cuda kernels are checked by cross-compiling.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from model_refs import onnxruntime_reference

from shardflow.compiler import compile, load_onnx
from shardflow.compiler.ir import Tensor, const_tensor
from shardflow.compiler.ir.graph import FlowGraph
from shardflow.compiler.ops.elementwise import Binary
from shardflow.compiler.ops.linalg import MatMul
from shardflow.compiler.passes.precision import HalfPrecisionContractions
from shardflow.runtime import load

MODELS = Path(__file__).parent.parent / "models"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_pass_rounds_operands_and_keeps_biases_and_outputs_float32(dtype):
    rng = np.random.default_rng(0)
    x = Tensor("x", (5, 7), "float32")
    w = rng.standard_normal((7, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    mm = MatMul([x, const_tensor(w)])
    add = Binary([mm.outputs[0], const_tensor(b)], fn="add")
    g = FlowGraph([x], add.outputs)
    xv = rng.standard_normal((5, 7)).astype(np.float32)
    g = HalfPrecisionContractions(dtype).run(g)
    g.validate()
    halves = [t for t in g.constants() if t.dtype == dtype]
    assert [t.shape for t in halves] == [(7, 3)]  # the weight, stored in the half type; the bias stays
    got = g.run({"x": xv})[g.output_names[0]]
    rnd = lambda a: a.astype(dtype).astype(np.float32)  # noqa: E731 - ml_dtypes (with onnx) names bfloat16
    want = rnd(xv) @ rnd(w) + b
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_attention_operands_are_rounded_where_the_projection_writes_them():
    """One QKV projection sliced, reshaped and transposed into Q, K^T and V for two batched
    products: the rounding moves up to the projection's output (one Cast, shared), the movement
    ops run on half values; the 2-D output projection's transposed input keeps its own rounding
    after the transpose (a transposed 2-D operand would not be a dense strided read)."""
    from shardflow.compiler.ops.transform import Reshape, Slice, Transpose

    rng = np.random.default_rng(1)
    b, s, h, d = 2, 4, 2, 8
    x = Tensor("x", (b, s, h * d), "float32")
    qkv = MatMul([x, const_tensor(rng.standard_normal((h * d, 3 * h * d)).astype(np.float32))], name="qkv")
    heads = []
    for i in range(3):
        sl = Slice([qkv.outputs[0]], name=f"slice{i}", starts=(0, 0, i * h * d), steps=(1, 1, 1),
                   sizes=(b, s, h * d))
        r = Reshape([sl.outputs[0]], name=f"split{i}", shape=(b, s, h, d))
        heads.append(Transpose([r.outputs[0]], name=f"heads{i}", perm=(0, 2, 3, 1) if i == 1 else (0, 2, 1, 3)))
    scores = MatMul([heads[0].outputs[0], heads[1].outputs[0]], name="scores")
    ctx = MatMul([scores.outputs[0], heads[2].outputs[0]], name="ctx")
    back = Transpose([ctx.outputs[0]], name="back", perm=(0, 2, 1, 3))
    flat = Reshape([back.outputs[0]], name="flat", shape=(b * s, h * d))
    out = MatMul([flat.outputs[0], const_tensor(rng.standard_normal((h * d, 5)).astype(np.float32))], name="out")
    g = FlowGraph([x], out.outputs)
    xv = rng.standard_normal(x.shape).astype(np.float32)
    want = g.run({"x": xv})[g.output_names[0]]
    g = HalfPrecisionContractions("float16").run(g)
    g.validate()
    by_name = {op.name: op for op in g.nodes}
    casts = [op for op in g.nodes if op.op_type == "Cast" and op.outputs[0].dtype == "float16"]
    assert sorted(c.inputs[0].name for c in casts) == sorted(["x", qkv.outputs[0].name, scores.outputs[0].name,
                                                              back.outputs[0].name])
    assert all(by_name[f"heads{i}"].outputs[0].dtype == "float16" for i in range(3))
    assert by_name["back"].outputs[0].dtype == "float32"  # rounded after the transpose, as before
    got = g.run({"x": xv})[g.output_names[0]]
    np.testing.assert_allclose(got, want, rtol=5e-3, atol=5e-3 * float(np.abs(want).max()))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
@pytest.mark.parametrize("model", ["gpt2_ts17", "resnet_ts17"])
def test_half_precision_model_on_cpu_matches_onnxruntime(tmp_path, model):
    feeds, ref = onnxruntime_reference(model)
    sizes = {}
    for prec in ("float32", "float16", "bfloat16"):
        out = tmp_path / prec
        compile(MODELS / f"{model}.onnx", distributed_config={"mesh_shape": [1]},
                optimization_config={"precision": prec}, out_dir=out)
        got = load(out).run(feeds)
        for k, v in ref.items():
            scale = float(np.abs(v).max())
            tol = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}[prec]
            np.testing.assert_allclose(got[k], v, rtol=tol, atol=tol * scale, err_msg=f"{prec} {k}")
        program = json.loads((out / "rank0" / "program.json").read_text())
        sizes[prec] = program["weights_bytes"]
        dtypes = {b["dtype"] for b in program["buffers"] if b["storage"] == "weights"}
        assert dtypes & {"float16", "bfloat16"} == ({prec} - {"float32"})
    # (bfloat16 conv weights are stored as the bfloat16 GEMM's rows, padded to whole AMX tiles: a little more
    # than float16's on this small model's 16-channel convs)
    assert max(sizes["float16"], sizes["bfloat16"]) < 0.75 * sizes["float32"]
    assert sizes["float16"] <= sizes["bfloat16"] <= 1.1 * sizes["float16"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
@pytest.mark.parametrize("prec", ["bfloat16", "float16"])
def test_half_precision_attention_on_cpu_is_one_fused_kernel(tmp_path, prec):
    """At precision float16/bfloat16 the cpu target fuses GPT-2's attention as at float32 (one Attention kernel
    per layer, no Softmax, no [B, H, S, L] scores): the probabilities the precision pass rounds are rounded by
    the kernel (``probs_dtype``), so the program's output is the unfused program's (``fuse`` off: the separate
    MatMul, Softmax and rounding kernels), here bit for bit, and within the precision's tolerance of
    onnxruntime."""
    feeds, ref = onnxruntime_reference("gpt2_ts17")
    got, kinds = {}, {}
    for fuse in (True, False):
        out = tmp_path / f"fuse{fuse}"
        compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [1]},
                optimization_config={"target": "cpu", "precision": prec, "fuse": fuse}, out_dir=out)
        program = json.loads((out / "rank0" / "program.json").read_text())
        kinds[fuse] = [s["op_type"] for s in program["steps"] if s["kind"] == "kernel"]
        got[fuse] = load(out).run(feeds)
    assert kinds[True].count("Attention") == 2 and "Softmax" not in kinds[True], kinds[True]
    assert kinds[False].count("Softmax") == 2 and "Attention" not in kinds[False], kinds[False]
    tol = {"float16": 5e-3, "bfloat16": 2e-2}[prec]
    for k, v in ref.items():
        scale = float(np.abs(v).max())
        np.testing.assert_allclose(got[True][k], got[False][k], rtol=0, atol=1e-6 * scale, err_msg=k)
        np.testing.assert_allclose(got[True][k], v, rtol=tol, atol=tol * scale, err_msg=k)


def test_float16_cuda_kernels_use_the_half_tensor_cores(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    out = tmp_path / "o"
    compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [1]},
            optimization_config={"precision": "float16", "target": "cuda", "sm_count": 2}, out_dir=out)
    program = json.loads((out / "rank0" / "program.json").read_text())
    launches = [s["launch"] for s in program["steps"] if s["kind"] == "kernel"]
    kinds = [launch["kind"] for launch in launches]
    # every projection (weight operand) is a float16 tensor-core GEMM; on sm_90 the Hopper wgmma
    # template, reading float16 activations that the producing kernels wrote (casts materialized)
    assert kinds.count("gemm-wgmma-f16") >= 8 and kinds.count("gemm-f32") <= 1, kinds
    # sized for the GPU named (a tiny one: the QKV products' three tiles go to a persistent grid of
    # two blocks, where 132 multiprocessors give them a block each)
    assert json.loads((out / "rank0" / "manifest.json").read_text())["sm_count"] == 2
    grids = [launch["grid"][0] for launch in launches if launch.get("persistent")]
    assert grids and max(grids) == 2, grids


@pytest.mark.parametrize("model", ["gpt2_ts17", "resnet_ts17"])
def test_bfloat16_graph_on_two_ranks_matches_onnxruntime(model):
    from shardflow.compiler.parallel import partition, search
    from shardflow.compiler.parallel.config import DistributedConfig
    from shardflow.compiler.parallel.simulate import simulate

    feeds, ref = onnxruntime_reference(model)
    g = load_onnx(MODELS / f"{model}.onnx")  # as the driver does: the plan on the float32 graph,
    plan = search(g, DistributedConfig.from_dict({"mesh_shape": [2], "algo": "megatron"}))
    ranks = [HalfPrecisionContractions("bfloat16").run(rg) for rg in partition(g, plan)]  # then each rank
    assert all(any(t.dtype == "bfloat16" for t in rg.constants()) for rg in ranks)
    got = simulate(ranks, feeds)
    for k, v in ref.items():
        scale = float(np.abs(v).max())
        np.testing.assert_allclose(got[k], v, rtol=2e-2, atol=2e-2 * scale, err_msg=k)
        assert np.abs(got[k] - v).max() > 1e-5 * scale  # the rounding is really there


def test_bfloat16_cross_compiles_to_bf16_tensor_cores(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    out = tmp_path / "o"
    compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [2], "algo": "megatron"},
            optimization_config={"precision": "bfloat16", "target": "cuda"}, out_dir=out)
    for r in range(2):
        program = json.loads((out / f"rank{r}" / "program.json").read_text())
        kinds = [s["launch"]["kind"] for s in program["steps"] if s["kind"] == "kernel"]
        # (the megatron plan of this small model splits the batch: the products after the QKV
        # projection have 8 rows per rank, below the tensor-core templates' 16)
        assert kinds.count("gemm-wgmma-bf16") >= 1 and kinds.count("attention-bf16") == 2, kinds
        assert "bfloat16" in {b["dtype"] for b in program["buffers"] if b["storage"] == "weights"}


def test_unaligned_weights_are_stored_k_major_for_cuda():
    """A MatMul weight [K, N] with N not a multiple of 8 (GPT-2's 50257-word head) is stored [N, K]
    behind a Transpose for cuda, so that the wgmma GEMM can copy it 16 bytes at a time; the values
    are the same, and the reshape feeding the product is rounded before the reshape."""
    from shardflow.compiler.codegen.cuda import generate_cuda_source
    from shardflow.compiler.codegen.fusion import fuse
    from shardflow.compiler.ops.transform import Reshape

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 50)).astype(np.float32)
    x = Tensor("x", (2, 16, 64), "float32")
    flat = Reshape([x], shape=(32, 64))
    mm = MatMul([flat.outputs[0], const_tensor(w, "w")])
    g = HalfPrecisionContractions("float16", k_major_weights=True).run(FlowGraph([x], mm.outputs))
    g.validate()
    assert [t.shape for t in g.constants() if t.dtype == "float16"] == [(50, 64)]
    types = [op.op_type for op in g.nodes]
    assert types.index("Cast") < types.index("Reshape")  # x rounded, then reshaped (a view)
    xv = rng.standard_normal((2, 16, 64)).astype(np.float32)
    got = g.run({"x": xv})[g.output_names[0]]
    rnd = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    np.testing.assert_allclose(got, rnd(xv).reshape(32, 64) @ rnd(w), rtol=1e-5, atol=1e-5)
    compute = [op for op in g.nodes if op.op_type != "Reshape"]
    kinds = [l.kind for l in generate_cuda_source(fuse(compute), arch="sm_90").launches.values()]
    assert "gemm-wgmma-f16" in kinds, kinds
    mm2 = MatMul([flat.outputs[0], const_tensor(w, "w")])
    plain = HalfPrecisionContractions("float16").run(FlowGraph([x], mm2.outputs))
    assert [t.shape for t in plain.constants() if t.dtype == "float16"] == [(64, 50)]


@pytest.mark.parametrize("case", ["half", "half-k-major", "half-model", "tf32"])
def test_a_weight_read_by_several_products_is_stored_once_and_cast_by_each(case):
    """A weight several contractions read (ALBERT's shared layers; equal constants merged) is stored
    once in its new form (half values, ``[N, K]``, TF32-rounded), and for cuda each product reads
    it through a Cast or Transpose of its own, which fuses into its GEMM: both take the wgmma
    template on sm_90, and no kernel writes the weight's float32 (or ``[K, N]``) values at run
    time, as a shared Cast did (its GEMMs then took the float32 template). Values against numpy.
    For the cpu target, which runs such casts as kernels, the readers share one."""
    from shardflow.compiler.codegen.cuda import generate_cuda_source, kernel_groups
    from shardflow.compiler.passes.precision import Float32WeightsKMajor, HalfWeightsKMajor, round_tf32

    rng = np.random.default_rng(1)
    n = 56 if case == "half-k-major" else 64  # (56 columns: 112-byte rows, stored [N, K])
    dt = "float16" if case == "half-model" else "float32"
    w = rng.standard_normal((64, n)).astype(dt)
    x, z = Tensor("x", (32, 64), dt), Tensor("z", (48, 64), dt)
    weight = const_tensor(w, "w")
    y1, y2 = MatMul([x, weight], name="p1"), MatMul([z, weight], name="p2")
    g = FlowGraph([x, z], y1.outputs + y2.outputs)
    if case.startswith("half") and dt == "float32":
        g = HalfPrecisionContractions("float16", k_major_weights=True, cast_per_reader=True,
                                      k_major_ops=(lambda op: True) if case == "half-k-major" else None).run(g)
    elif case == "half-model":
        g = HalfWeightsKMajor(lambda op: True).run(g)
    else:
        g = Float32WeightsKMajor(tf32=True).run(g)
    g.validate()
    stored = [t for t in g.constants() if t.size == w.size]
    assert len(stored) == 1 and stored[0].shape == ((64, n) if case == "half" else (n, 64)), stored
    feeds = {"x": rng.standard_normal((32, 64)).astype(dt), "z": rng.standard_normal((48, 64)).astype(dt)}
    got = g.run(feeds)
    rnd = (lambda a: a.astype(np.float16).astype(np.float32)) if case.startswith("half") else round_tf32
    for name, a in zip(g.output_names, (feeds["x"], feeds["z"])):
        np.testing.assert_allclose(got[name].astype(np.float32), rnd(a) @ rnd(w) if case != "tf32" else a @ rnd(w),
                                   rtol=2e-3, atol=2e-3)
    launches = generate_cuda_source(kernel_groups(g.nodes, "sm_90", keep=g.output_names), arch="sm_90",
                                    precision="tf32" if case == "tf32" else "float16",
                                    wgmma_fp32=case == "tf32").launches.values()
    products = [launch for launch in launches if launch.kind.startswith("gemm")]
    assert [launch.kind for launch in products] == ["gemm-wgmma-" + ("tf32" if case == "tf32" else "f16")] * 2
    assert all(stored[0].name in launch.args for launch in products)  # (each reads the stored weight)
    if case == "half":  # for the cpu target, which runs the casts as kernels: one for both readers
        w2 = const_tensor(w, "w")
        g2 = FlowGraph([x, z], MatMul([x, w2]).outputs + MatMul([z, w2]).outputs)
        g2 = HalfPrecisionContractions("float16").run(g2)
        casts = [op.inputs[0].name for op in g2.nodes if op.op_type == "Cast" and op.inputs[0].is_constant]
        assert casts == ["w.float16"]


def test_round_tf32_keeps_ten_mantissa_bits_to_nearest():
    from shardflow.compiler.passes.precision import round_tf32

    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -10)  # TF32's spacing at 1
    x = np.array([one, one + ulp / 4, one + ulp / 2, one + 3 * ulp / 4, -(one + ulp / 2), np.inf, -np.inf, 0.0,
                  np.float32(np.finfo(np.float32).tiny)], np.float32)
    got = round_tf32(x)
    np.testing.assert_array_equal(got[:5], [one, one, one + ulp, one + ulp, -(one + ulp)])  # ties away from 0
    assert np.isposinf(got[5]) and np.isneginf(got[6]) and got[7] == 0 and got[8] == x[8]
    assert np.isnan(round_tf32(np.array([np.nan], np.float32)))[0]
    r = round_tf32(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    assert not (r.view(np.uint32) & 0x1FFF).any()


def test_tf32_on_hopper_stores_weights_k_major_and_rounded(tmp_path):
    """``precision="tf32"`` with ``wgmma_fp32`` for sm_90: each MatMul/Gemm weight is stored
    ``[N, K]`` (a Gemm's ``trans_b`` one as it is) with its values rounded to TF32, and every
    projection of GPT-2's test model runs on the TF32 wgmma template; without the option (not
    measured on a GPU yet) the weights stay as they are and the portable TF32 template, which
    rounds the operands itself, runs them; sm_80 refuses the option."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    from shardflow.compiler.errors import ConfigError
    from shardflow.compiler.ops.linalg import Gemm
    from shardflow.compiler.passes.precision import Float32WeightsKMajor, round_tf32

    rng = np.random.default_rng(0)
    w, v = rng.standard_normal((64, 48)).astype(np.float32), rng.standard_normal((40, 48)).astype(np.float32)
    x = Tensor("x", (32, 64), "float32")
    mm = MatMul([x, const_tensor(w, "w")], name="mm")
    gm = Gemm([mm.outputs[0], const_tensor(v, "v")], name="gm", trans_b=True)
    y = Tensor("y", (32, 38), "float32")
    odd = MatMul([y, const_tensor(rng.standard_normal((38, 8)).astype(np.float32), "odd")], name="odd")
    g = Float32WeightsKMajor(tf32=True).run(FlowGraph([x, y], gm.outputs + odd.outputs))
    g.validate()
    consts = {t.name: t for t in g.constants()}
    np.testing.assert_array_equal(consts["w.tf32.T"].value, round_tf32(w.T))
    np.testing.assert_array_equal(consts["v.tf32"].value, round_tf32(v))
    assert "odd" in consts  # K = 38: not 16-byte aligned, left as it is
    kinds = {}
    for wgmma in (True, False):
        out = tmp_path / str(wgmma)
        compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [1]},
                optimization_config={"precision": "tf32", "target": "cuda", "arch": "sm_90", "wgmma_fp32": wgmma},
                out_dir=out)
        program = json.loads((out / "rank0" / "program.json").read_text())
        kinds[wgmma] = [s["launch"]["kind"] for s in program["steps"] if s["kind"] == "kernel"]
    assert kinds[True].count("gemm-wgmma-tf32") >= 8 and "gemm-tf32" not in kinds[True], kinds
    assert kinds[False].count("gemm-tf32") >= 8 and "gemm-wgmma-tf32" not in kinds[False], kinds
    with pytest.raises(ConfigError, match="wgmma_fp32"):
        compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [1]}, out_dir=tmp_path / "x",
                optimization_config={"precision": "tf32", "target": "cuda", "arch": "sm_80", "wgmma_fp32": True})


def test_float32_products_on_forced_wgmma_tiles(tmp_path):
    """At the default precision (float32: 3xTF32) the GEMMs stay on the portable kernel unless
    ``gemm_tiles`` forces a wgmma tile or ``wgmma_fp32`` is set (the Hopper 3xTF32 kernel is not
    measured on a GPU yet): then the (matched) MatMul/Gemm weights are stored ``[N, K]`` with their
    exact values and those products take it."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    kinds = {}
    for i, opt in enumerate(({}, {"gemm_tiles": {"*": "tma128x128"}}, {"wgmma_fp32": True})):
        out = tmp_path / str(i)
        compile(MODELS / "llama_ts17.onnx", distributed_config={"mesh_shape": [1]},
                optimization_config={"target": "cuda", "arch": "sm_90", **opt}, out_dir=out)
        program = json.loads((out / "rank0" / "program.json").read_text())
        kinds[i] = [s["launch"]["kind"] for s in program["steps"] if s["kind"] == "kernel"]
    assert "gemm-wgmma-f32" not in kinds[0] and kinds[0].count("gemm-f32") >= 8, kinds[0]
    for i in (1, 2):
        assert kinds[i].count("gemm-wgmma-f32") >= 8 and "gemm-f32" not in kinds[i], kinds[i]


def _tied_embedding_model(vocab: int = 50):
    """Token ids ``[2, 5]`` looked up in a table ``[V, 64]``, a Tanh, and an output layer that is the
    table's transposed copy (GPT-2's tied head as torch exports it): the ONNX model and its table."""
    from onnx import TensorProto, helper, numpy_helper

    table = np.random.default_rng(3).standard_normal((vocab, 64)).astype(np.float32)
    inits = [numpy_helper.from_array(table, "wte"), numpy_helper.from_array(np.ascontiguousarray(table.T), "lm_head")]
    nodes = [helper.make_node("Gather", ["wte", "ids"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("MatMul", ["t", "lm_head"], ["logits"])]
    g = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 5, vocab])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), table


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("target, vocab", [("cuda", 50), ("cpu", 50), ("cuda", 48)])
def test_embedding_tables_are_stored_half_and_shared_with_a_tied_output_layer(tmp_path, target, vocab, ranks):
    """At float16 an embedding table (a constant a Gather looks rows up in) is stored in the half
    type, its rows read back as float32 (a Cast after the gather); for cuda the output layer's
    weight, a transposed copy of the table with 50 (unaligned) columns, stored ``[N, K]``, then
    holds the table's bytes, which the program writer stores once
    (``test_constants_with_the_same_bytes_share_them_in_the_weights``; before, the table stayed
    float32 beside the head's half copy, 3x its half bytes). On two ranks (Megatron: the table
    split by rows, the head by columns) each rank's two hold the same rows. The cpu target stores
    the head as it is (``[K, N]``) and the gather reads the table's rows as its columns
    (``TablesInTiedWeights``, ``GatherColumns``): one half constant. With 48 (aligned) columns the head is
    stored ``[K, N]`` for cuda too, and the gather looks its rows up in that weight through a
    transpose (``TablesFromTiedWeights``): the table is not stored at all (before: twice, in
    float32 and in the head's half). Values against numpy with the table rounded."""
    from shardflow.compiler.driver import OptimizationConfig, plan_passes, rank_passes
    from shardflow.compiler.parallel import partition, search, simulate

    model, table = _tied_embedding_model(vocab)
    ids = np.random.default_rng(4).integers(0, vocab, (2, 5)).astype(np.int64)
    graph = plan_passes(load_onnx(model), [ranks])
    plan = search(graph, {"mesh_shape": [ranks], "algo": "megatron"})
    opt = OptimizationConfig.from_dict({"target": target, "precision": "float16", "prepack": False})
    ranks_graphs = [rank_passes(rg, opt) for rg in partition(graph, plan)]
    for rg in ranks_graphs:
        rg.validate()
        halves = [t for t in rg.constants() if t.dtype == "float16"]
        rows = vocab // ranks
        if vocab % 8 == 0:  # (the head stored [K, N], the table read through its transpose)
            assert [t.shape for t in halves] == [(64, rows)], halves
            readers = sorted(op.op_type for op in rg.nodes if halves[0] in op.inputs)
            assert readers == ["Cast", "Transpose"], readers
            assert next(op for op in rg.nodes if op.op_type == "Gather").inputs[0].producer.op_type == "Transpose"
        elif target == "cuda":
            assert [t.shape for t in halves] == [(rows, 64)] * 2, halves
            assert np.array_equal(halves[0].value.view(np.uint16), halves[1].value.view(np.uint16))
            readers = sorted(op.op_type for op in rg.nodes for t in halves if t in op.inputs)
            assert readers == ["Gather", "Transpose"], readers
        else:  # (cpu: the gather reads the head's half weight [K, N] as columns)
            assert [t.shape for t in halves] == [(64, rows)], halves
            readers = sorted(op.op_type for op in rg.nodes if halves[0] in op.inputs)
            assert readers == ["Cast", "GatherColumns"], readers
        assert not any(t.dtype == "float32" and t.size >= rows * 64 for t in rg.constants())
    got = simulate(ranks_graphs, {"ids": ids}, plan.mesh)["logits"]
    rnd = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    want = rnd(np.tanh(rnd(table)[ids])) @ rnd(table).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if target == "cuda" and shutil.which("g++"):  # the kernels up to the first collective, on the host emulation
        _kernels_before_collectives(ranks_graphs[-1], {"ids": ids}, tmp_path)


def _kernels_before_collectives(rg, feeds, tmp_path):
    """Each sm_90 kernel of ``rg`` that runs before its first collective (the gather from the half
    table, on a rank holding a part of its rows too), on the host emulation, against the evaluator."""
    import os
    import sys

    from cuda_host import build

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "codegen"))
    from test_cuda_host import _check_kernels

    from shardflow.compiler.codegen.cuda import generate_cuda_source, kernel_groups
    from shardflow.compiler.driver import _is_view
    from shardflow.compiler.parallel.comm_ops import Collective

    env = dict(feeds)
    for op in rg.nodes:
        if isinstance(op, Collective):
            break
        env.update(zip((t.name for t in op.outputs), op.run(*[env.get(t.name, t.value) for t in op.inputs])))
    before = [op for op in rg.nodes if all(t.name in env for t in op.outputs)]
    after = [op for op in rg.nodes if op not in before]
    keep = [t.name for op in before for t in op.outputs
            if t in rg.outputs or any(t in later.inputs for later in after)]  # (what the collectives read)
    consts = {t.name: t.value for op in before for t in op.inputs if t.value is not None}
    groups = kernel_groups(before, "sm_90", keep=keep, views=[op.name for op in before if _is_view(op)])
    src = generate_cuda_source(groups, arch="sm_90", precision="float16")
    groups = [g for g in groups if g.name in src.launches]
    assert groups and any(op.op_type == "Gather" and op.inputs[0].dtype == "float16" for op in before), before
    _check_kernels("tied", build(src.text, str(tmp_path)), src, groups, env, consts)



@pytest.mark.parametrize("vocab", [48, 50])
def test_a_tied_table_is_read_through_the_output_layers_weight_at_float32(vocab):
    """For cuda at float32 the gather looks its rows up in the output layer's weight (the table's
    transposed copy), transposed: the table itself is not stored; the values are the model's."""
    from shardflow.compiler.driver import OptimizationConfig, rank_passes
    from shardflow.compiler.parallel import partition, search

    model, table = _tied_embedding_model(vocab)
    g = load_onnx(model)
    (rg,) = partition(g, search(g, {"mesh_shape": [1], "algo": "replicate"}))
    rg = rank_passes(rg, OptimizationConfig.from_dict({"target": "cuda", "precision": "float32"}))
    assert [(t.name, t.shape) for t in rg.constants()] == [("lm_head", (64, vocab))]
    ids = np.random.default_rng(5).integers(0, vocab, (2, 5)).astype(np.int64)
    np.testing.assert_allclose(rg.run({"ids": ids})["logits"], np.tanh(table[ids]) @ table.T, rtol=1e-5, atol=1e-5)


def test_the_plan_counts_half_weights_as_the_ranks_store_them():
    """The plan of a float16/bfloat16 compile is searched on the float32 graph (its weights are
    rounded per rank afterwards), and counts its float32 weights at 2 bytes, as the ranks hold
    them (rfcs/0001 "Plans within the device's memory"); activations as the graph has them."""
    from shardflow.compiler.driver import planned_graph
    from shardflow.compiler.parallel import search

    plans = {}
    for prec in ("float32", "float16", "bfloat16"):
        g = planned_graph(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [2]},
                          optimization_config={"precision": prec})
        plans[prec] = search(g, {"mesh_shape": [2], "algo": "replicate"})
    assert plans["float16"].params_bytes == plans["bfloat16"].params_bytes
    # (GPT-2's float32 constants are all but a few small int64 shape constants)
    assert 0.49 < plans["float16"].params_bytes / plans["float32"].params_bytes < 0.51
    assert plans["float16"].peak_activation_bytes == plans["float32"].peak_activation_bytes
