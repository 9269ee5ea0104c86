"""The cuda target's kernels run on the host against numpy, in CI (tests/cuda_host.py's shim).

``pytest -m gpu`` runs every generated kernel on a GPU (test_cuda_kernels.py and the others), but
most sessions and CI have none. Here the kernels are compiled with g++ against an emulation of
the CUDA they use (threads as coroutines, barriers, warp shuffles, shared memory, ``ldmatrix`` and
``mma.sync``, the wmma API, and the Hopper GEMMs' ``cp.async``, TMA, mbarriers and ``wgmma``,
asynchronous as on the GPU) and compared with numpy and the reference evaluator under the GPU tests' tolerances:
every kernel of every op example (element-wise, row, wmma GEMMs), the fused chains, the fused
attention cases, every wgmma tile (ping-pong ones under random interleavings), split-K, GEMM
epilogues, and every kernel of the float16 programs of the test models.
"""
from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
from cuda_host import build, build_all, run
from test_cuda_kernels import LOWERED, _check

from shardflow.compiler.codegen.cuda import CudaCodegenError, generate_cuda_source
from shardflow.compiler.ir import Tensor
from shardflow.compiler.ops.norm import LayerNorm
from shardflow.compiler.ops.reduce import Softmax

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")

#: the kernel kinds of the op examples (the default architecture: no wgmma)
HOST_KINDS = ("elementwise", "row", "empty", "gemm-f32", "gemm-f16", "attention-f16", "gemv", "topk")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    ops = [c[1] for c in LOWERED]
    kinds = generate_cuda_source(ops).launches
    cases = [c for c in LOWERED if kinds[c[0]].kind.split("+")[0] in HOST_KINDS]
    src = generate_cuda_source([c[1] for c in cases])
    return {"kernels": build(src.text, str(tmp_path_factory.mktemp("host"))), "launches": src.launches,
            "cases": {c[0]: c for c in cases}}


def _host_cases():
    kinds = generate_cuda_source([c[1] for c in LOWERED]).launches
    return [c[0] for c in LOWERED if kinds[c[0]].kind.split("+")[0] in HOST_KINDS]


HOST_CASES = _host_cases()


def test_every_kernel_is_covered():
    kinds = {k: v.kind.split("+")[0] for k, v in generate_cuda_source([c[1] for c in LOWERED]).launches.items()}
    assert len(HOST_CASES) == len(LOWERED) > 250
    assert {kinds[n] for n in HOST_CASES} == set(HOST_KINDS)


@pytest.mark.parametrize("name", HOST_CASES)
def test_kernel_on_the_host_matches_numpy(host, name):
    _, op, arrays, _ = host["cases"][name]
    launch = host["launches"][name]
    with np.errstate(all="ignore"):
        want = op.run(*arrays)
    got = run(host["kernels"], launch, arrays, [(t.shape, t.dtype) for t in op.outputs])
    for g, w in zip(got, want):
        _check(name, launch.kind, g, w)


def test_the_emulation_sees_a_missing_barrier(tmp_path):
    """The emulation is no rubber stamp: without the barrier between the warps' partial sums and
    their reading, the block reduction of the softmax's sum reads the maxima the warps left there
    and gives another result; a warp whose lanes wait at a warp and a block barrier is reported
    as a deadlock, not a hang."""
    x = np.random.default_rng(0).standard_normal((4, 3000)).astype(np.float32)
    op = Softmax([Tensor("x", x.shape, "float32")], name="sm", axes=(1,))
    src = generate_cuda_source([op])
    launch = src.launches["sm"]
    parts = src.text.split("__syncthreads();")
    assert launch.grid == (4, 1, 1) and len(parts) == 5  # before and after each of two reductions' writes
    want = op.run(x)[0]
    good = run(build(src.text, str(tmp_path)), launch, [x], [(want.shape, want.dtype)])[0]
    _check("sm", launch.kind, good, want)
    broken = "__syncthreads();".join(parts[:4]) + parts[4]  # the sum's partials read unguarded
    bad = run(build(broken, str(tmp_path)), launch, [x], [(want.shape, want.dtype)])[0]
    assert not np.allclose(bad, want, equal_nan=True)
    i = src.text.index('extern "C"')
    split = "if ((threadIdx.x & 31) < 16) __syncwarp(); else __syncthreads();"  # half a warp at each
    body = src.text[i:].replace("__syncthreads();", split, 1)
    with pytest.raises(RuntimeError, match="deadlock"):
        run(build(src.text[:i] + body, str(tmp_path)), launch, [x], [(want.shape, want.dtype)])


def test_a_kept_select_stores_only_where_its_condition_fails(tmp_path):
    """An output the program writes over its input as ``c ? x : e`` (a KV cache's present over its
    past, ``compile(state=...)``): with ``in_place`` the kernel stores ``e`` where ``c`` fails and
    nothing else (a separate, poisoned output keeps its poison there), and on the input's own
    buffer the result is the select's. Without ``in_place`` it writes every element."""
    from shardflow.compiler.ops.elementwise import Binary, Where

    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 16, 8)).astype(np.float32)
    keep = np.ones((2, 1, 16, 1), bool)
    keep[0, :, 5], keep[1, :, 9] = False, False  # each sequence's new row
    new = rng.standard_normal((2, 3, 1, 8)).astype(np.float32)
    ins = [Tensor("keep", keep.shape, "bool"), Tensor("past", x.shape, "float32"), Tensor("new", new.shape, "float32")]
    scaled = Binary([ins[2], Tensor("two", (), "float32")], name="scaled", fn="mul")
    op = Where([ins[0], ins[1], scaled.outputs[0]], name="present")
    from shardflow.compiler.codegen.fusion import fuse

    (group,) = fuse([scaled, op], keep=["present:0"])
    arrays = [keep, x, new, np.float32(2.0)]
    arrays = [dict(zip([t.name for t in ins] + ["two"], arrays))[t.name] for t in group.inputs]
    past = [t.name for t in group.inputs].index("past")
    want = np.where(keep, x, new * 2)
    src = generate_cuda_source([group], in_place={group.name: past})
    assert src.text.split("// node ")[1].count("if (!") == 1
    kernels = build(src.text, str(tmp_path))
    launch = src.launches[group.name]
    (alone,) = run(kernels, launch, arrays, [(x.shape, x.dtype)])
    poison = np.full(1, 0x5A5A5A5A, np.uint32).view(np.float32)[0]
    np.testing.assert_array_equal(alone, np.where(keep, poison, new * 2))
    (aliased,) = run(kernels, launch, arrays, [(x.shape, x.dtype)], alias={0: past})
    np.testing.assert_array_equal(aliased, want)
    plain = generate_cuda_source([group])
    assert "if (!" not in plain.text.split("// node ")[1]
    (every,) = run(build(plain.text, str(tmp_path)), plain.launches[group.name], arrays, [(x.shape, x.dtype)])
    np.testing.assert_array_equal(every, want)


@pytest.mark.parametrize("keep_shape,blocks", [((1, 1, 40, 1), None), ((2, 1, 40, 1), None), ((2, 1, 40, 1), 7)])
def test_a_kept_select_walks_the_rows_of_its_condition(tmp_path, monkeypatch, keep_shape, blocks):
    """A kept select whose condition reads some axes only (a cache row: ``[1, 1, L, 1]``, or a
    sequence's row ``[B, 1, L, 1]``) over rows of at least 256 elements: the kernel walks the
    condition's rows and stores the rows where it fails with a block's threads (a decoding step's
    present tests L rows, not every element); poison kept where it holds, the select on the
    input's own buffer; a block per row, or fewer blocks each walking several rows."""
    from shardflow.compiler.codegen import cuda as cg
    from shardflow.compiler.codegen.fusion import fuse
    from shardflow.compiler.ops.elementwise import Binary, Where

    if blocks:
        monkeypatch.setattr(cg, "_KEPT_ROW_BLOCKS", blocks)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 40, 64)).astype(np.float32)
    keep = np.ones(keep_shape, bool)
    keep[0, :, 7] = False
    keep[-1, :, 31] = False
    new = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    ins = [Tensor("keep", keep.shape, "bool"), Tensor("past", x.shape, "float32"), Tensor("new", new.shape, "float32")]
    scaled = Binary([ins[2], Tensor("two", (), "float32")], name="scaled", fn="mul")
    (group,) = fuse([scaled, Where([ins[0], ins[1], scaled.outputs[0]], name="present")], keep=["present:0"])
    arrays = dict(zip([t.name for t in ins] + ["two"], [keep, x, new, np.float32(2.0)]))
    arrays = [arrays[t.name] for t in group.inputs]
    past = [t.name for t in group.inputs].index("past")
    src = generate_cuda_source([group], in_place={group.name: past})
    launch = src.launches[group.name]
    rows = 40 * keep_shape[0]
    assert "// the condition's rows" in src.text and launch.grid[0] == (blocks or rows) and launch.block[0] == 256
    kernels = build(src.text, str(tmp_path))
    (alone,) = run(kernels, launch, arrays, [(x.shape, x.dtype)])
    poison = np.full(1, 0x5A5A5A5A, np.uint32).view(np.float32)[0]
    np.testing.assert_array_equal(alone, np.where(keep, poison, new * 2))
    (aliased,) = run(kernels, launch, arrays, [(x.shape, x.dtype)], alias={0: past})
    np.testing.assert_array_equal(aliased, np.where(keep, x, new * 2))


def test_four_bit_codes_with_an_unaligned_activation(tmp_path):
    """The GEMV on 4-bit codes reads a run of 8 activations as two 16-byte loads where the
    activation's address allows (the others: the op-example cases) and element by element where it
    does not (here, 4 bytes past an aligned address); both against numpy, several rows."""
    from shardflow.compiler.ir import const_tensor
    from shardflow.compiler.ops.linalg import MatMulNBits

    rng = np.random.default_rng(6)
    a = rng.standard_normal((3, 256)).astype(np.float32)
    bq = rng.integers(0, 256, (40, 8, 16)).astype(np.uint8)
    scales = rng.random((40, 8)).astype(np.float32)
    op = MatMulNBits([Tensor("a", a.shape, "float32"), const_tensor(bq, "bq"), const_tensor(scales, "s")], name="nb",
                     bits=4, block_size=32)
    src = generate_cuda_source([op])
    assert "const float4 sf_a0" in src.text and src.launches["nb"].kind == "gemv"
    kernels = build(src.text, str(tmp_path))
    want = op.run(a, bq, scales)[0]
    for shift in (None, {0: 4}):
        (got,) = run(kernels, src.launches["nb"], [a, bq, scales], [(want.shape, want.dtype)], shift=shift)
        _check("nb", "gemv", got, want)


def test_layernorm_of_a_long_row(tmp_path):
    """A LayerNorm row longer than a block's threads, half-precision output (the precision pass's
    form), against numpy."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 2304)).astype(np.float32)
    g, b = rng.standard_normal(2304).astype(np.float32), rng.standard_normal(2304).astype(np.float32)
    op = LayerNorm([Tensor(n, a.shape, "float32") for n, a in (("x", x), ("g", g), ("b", b))], name="ln", axis=1,
                   epsilon=1e-5, stash="float32")
    src = generate_cuda_source([op])
    launch = src.launches["ln"]
    want = op.run(x, g, b)
    got = run(build(src.text, str(tmp_path)), launch, [x, g, b], [(t.shape, t.dtype) for t in op.outputs])
    for o, w in zip(got, want):
        _check("ln", launch.kind, o, w)


def test_fused_chains_on_the_host_match_their_members(tmp_path):
    """``cast -> op -> neg`` around every lowerable op example (test_fusion.py's chains): each
    fused kernel (element-wise or row) against its members run one by one."""
    from test_fusion import CHAINS, _reference

    from shardflow.compiler.codegen.fusion import fuse

    src = generate_cuda_source(fuse([op for _, chain, _ in CHAINS for op in chain]))
    kernels = build(src.text, str(tmp_path))
    checked = 0
    for name, chain, arrays in CHAINS:
        launch = src.launches[chain[-1].name]
        tensors = {chain[0].inputs[0].name: arrays[0]}
        tensors.update({t.name: t.value for op in chain for t in op.inputs if t.value is not None})
        out = chain[-1].outputs[0]
        got = run(kernels, launch, [tensors[n] for n in launch.args[:launch.num_inputs]], [(out.shape, out.dtype)])
        with np.errstate(all="ignore"):
            want = _reference(chain, arrays)
        _check(name, launch.kind, got[0], want)
        checked += 1
    assert checked == len(CHAINS) > 200


def test_decomposed_rms_norm_is_one_row_kernel_on_the_host(tmp_path):
    """Llama's RMSNorm as exporters write it (pow, mean, add, sqrt, div, two products) is one row
    kernel since session 6 (RFC 0004): against its members."""
    from test_fusion import _decomposed_rms_norm

    from shardflow.compiler.codegen.fusion import fuse

    x, ops = _decomposed_rms_norm((3, 5, 1000))
    (group,) = fuse(ops)
    src = generate_cuda_source([group])
    launch = src.launches[group.name]
    assert launch.kind == "row"
    xv = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    vals = {id(x): xv}
    for o in ops:
        vals[id(o.outputs[0])] = o.run(*[vals[id(t)] if id(t) in vals else t.value for t in o.inputs])[0]
    tensors = {t.name: (vals[id(t)] if id(t) in vals else t.value) for o in ops for t in o.inputs}
    got = run(build(src.text, str(tmp_path)), launch, [tensors[n] for n in launch.args[:launch.num_inputs]],
              [(x.shape, "float32")])
    _check(group.name, launch.kind, got[0], vals[id(ops[-1].outputs[0])])


def _rank_graph_for_cuda(model: str, k_major_ops=None, feeds: dict | None = None, precision: str = "float16"):
    """A committed test model as the driver hands it to the cuda code generator for sm_90 at
    ``precision`` (float16, float32 or tf32; ``float32-wgmma``: float32 with every weight stored
    ``[N, K]``, as for products forced onto wgmma tiles) on one device: imported, planned, merged
    projections, half operands (the weights of ``k_major_ops`` stored ``[N, K]``) or float32 ones
    for wgmma, fused attention (on half operands, and on float32 ones as for sm_80 and newer); on
    ``feeds`` (default: the model's inputs file)."""
    from model_refs import MODELS

    from shardflow.compiler import load_onnx
    from shardflow.compiler.parallel.partition import partition
    from shardflow.compiler.parallel.search import search
    from shardflow.compiler.passes.attention import FuseAttention
    from shardflow.compiler.passes.lowbit import HalfLowBitOperands
    from shardflow.compiler.passes.precision import Float32WeightsKMajor, HalfPrecisionContractions
    from shardflow.compiler.passes.projections import MergeProjections

    if feeds is None:
        feeds = dict(np.load(MODELS / f"{model.rsplit('_', 1)[0]}_inputs.npz"))
    graph = load_onnx(str(MODELS / f"{model}.onnx"), input_shapes={k: list(v.shape) for k, v in feeds.items()})
    (rg,) = partition(graph, search(graph, {"mesh_shape": [1], "algo": "replicate"}))
    if precision == "float16":
        rg = HalfLowBitOperands(precision).run(rg)
    rg = MergeProjections().run(rg)
    if precision == "float16":
        rg = HalfPrecisionContractions("float16", k_major_weights=True, k_major_ops=k_major_ops,
                                       cast_per_reader=True).run(rg)
    if precision in ("tf32", "float32-wgmma"):  # (float32 on wgmma: every weight, as a "*" tile pattern does)
        rg = Float32WeightsKMajor(precision == "tf32").run(rg)
    return FuseAttention(float32=True, target="cuda").run(FuseAttention().run(rg)), feeds


@pytest.mark.parametrize("model", ["gpt2_ts17", "llama_ts17", "t5_encoder_ts17", "bert_ts17"])
def test_model_kernels_on_the_host_match_the_evaluator(tmp_path, model):
    """Every kernel of a test model's float16 cuda program for sm_90 (LayerNorm, RMSNorm, GELU,
    rotary embeddings, masks, casts, fused attention, wgmma and wmma GEMMs with their fused
    prologues and epilogues) on the activations the reference evaluator computes, against the
    evaluator. Grouped as the sm_90 build groups them (its half casts written for their readers):
    Llama's attention reads its 2 KV heads, cast to float16 before the repeat the export wrote."""
    from shardflow.compiler.codegen.cuda import _half_cast

    env, consts, groups = _graph_values(*_rank_graph_for_cuda(model), materialize=_half_cast)
    src = generate_cuda_source(groups, arch="sm_90", precision="float16")
    host_groups = [g for g in groups if g.name in src.launches and src.launches[g.name].grid[0] > 0]
    assert len(host_groups) >= 15 and {src.launches[g.name].kind for g in host_groups} >= {"row", "elementwise"}
    kinds = [src.launches[g.name].kind for g in host_groups]
    assert kinds.count("attention-f16") == 2 and "gemm-wgmma-f16" in kinds, kinds
    _check_kernels(model, build(src.text, str(tmp_path)), src, host_groups, env, consts)


@pytest.mark.parametrize("model", ["llama_ts17", "gpt2_ts17"])
def test_float16_program_for_sm80_on_the_host(tmp_path, model):
    """A float16 program for sm_80 (no wgmma: portable GEMMs reading through their fused casts),
    grouped as the build groups it there (reshapes as views): the casts the attention's Q, K and
    V come from are written by their producers' kernels (Llama's K and V by kernels of their
    own), so the fused kernel reads half values (Llama's on 2 KV heads); so are the casts a
    producer's kernel would otherwise take with the cast back to float32 after them (GPT-2's
    head read the float32 values of its last LayerNorm's half cast, and ran in float32), so every
    product is a float16 one; every kernel against the evaluator."""
    from shardflow.compiler.codegen.cuda import _attention_operand_casts, _epilogue_operand_casts

    rg, feeds = _rank_graph_for_cuda(model)
    att_casts = _attention_operand_casts(rg.nodes)
    assert len(att_casts) == (6 if model == "llama_ts17" else 2)
    feeds_casts = att_casts | _epilogue_operand_casts(rg.nodes)
    env, consts, groups = _graph_values(rg, feeds, materialize=lambda op: op.name in feeds_casts, views=True)
    src = generate_cuda_source(groups, arch="sm_80", precision="float16")
    host_groups = [g for g in groups if g.name in src.launches and src.launches[g.name].grid[0] > 0]
    kinds = [src.launches[g.name].kind for g in host_groups]
    assert kinds.count("attention-f16") == 2 and kinds.count("gemm-f16") >= 9 and "gemm-f32" not in kinds, kinds
    _check_kernels(model, build(src.text, str(tmp_path)), src, host_groups, env, consts)


@pytest.mark.parametrize("model", ["bert_dynamo18", "t5_encoder_ts17", "vit_dynamo18", "resnet_ts17"])
def test_float16_products_for_sm80_read_half_operands(model):
    """As the sm_80 build groups a float16 program: every product is a float16 one (a producer's
    kernel no longer takes a product's half cast and the precision pass's cast back to float32
    after it, which left the product reading float32 values, in float32: most of these models'
    projections until session 52)."""
    from shardflow.compiler.codegen.cuda import kernel_groups
    from shardflow.compiler.driver import _is_view

    rg, _ = _rank_graph_for_cuda(model)
    groups = kernel_groups(list(rg.nodes), "sm_80", keep=[t.name for t in rg.outputs],
                           views=[op.name for op in rg.nodes if _is_view(op)])
    src = generate_cuda_source(groups, arch="sm_80", precision="float16")
    kinds = [launch.kind for launch in src.launches.values()]
    assert kinds.count("gemm-f16") >= 6 and "gemm-f32" not in kinds, kinds


def test_gptoss_program_on_the_host(tmp_path):
    """gpt-oss's decoding step (onnxruntime-genai's builder: attention sinks, a sliding window's
    buffer, MoE with SwiGLU, routed) as its float16 program for sm_90: every kernel, the two fused
    attentions with their sinks and the routed experts' products on float16 weights among them, on
    the evaluator's values, against the evaluator."""
    from model_refs import gptoss_step_feeds

    from shardflow.compiler.codegen.cuda import _half_cast

    rg, feeds = _rank_graph_for_cuda("gptoss_genai_fp32", feeds=gptoss_step_feeds())
    made = {id(t): op for op in rg.nodes for t in op.outputs}
    experts = [made[id(op.inputs[1])] for op in rg.nodes if op.op_type == "ExpertMatMul"]
    assert len(experts) == 4 and all(c.op_type == "Cast" and c.inputs[0].dtype == "float16" and c.inputs[0].is_constant
                                     for c in experts)  # the routed experts' weights stored in float16
    env, consts, groups = _graph_values(rg, feeds, materialize=_half_cast, views=True)
    src = generate_cuda_source(groups, arch="sm_90", precision="float16")
    kinds = [src.launches[g.name].kind for g in groups if g.name in src.launches]
    assert kinds.count("attention-f16") == 2
    _check_kernels("gptoss", build(src.text, str(tmp_path)), src, [g for g in groups if g.name in src.launches],
                   env, consts)


def test_pdl_program_on_the_host(tmp_path):
    """A program for programmatic dependent launch (RFC 0005 decision 29): every kernel (row,
    element-wise, fused attention, GEMMs) starts with the grid dependency wait and trigger, and
    still matches the evaluator (the emulation runs grids one after another, as the
    wait orders them; the PTX itself is checked by nvcc in test_wgmma.py); and the Llama's
    products on persistent tiles, which wait after their set-up and their weights' first stages."""
    from shardflow.compiler.codegen.cuda import PDL_ENTER

    env, consts, groups = _model_values("gpt2_ts17")
    src = generate_cuda_source(groups, arch="sm_90", precision="float16", pdl=True)
    bodies = src.text.split('extern "C" __global__ ')[1:]
    assert len(bodies) >= 10 and all(b.split("{\n", 1)[1].startswith(f"  {PDL_ENTER}\n") for b in bodies)
    host_groups = [g for g in groups if g.name in src.launches and src.launches[g.name].grid[0] > 0]
    kinds = {src.launches[g.name].kind for g in host_groups}
    assert kinds >= {"row", "attention-f16"} and any(k.startswith("gemm") for k in kinds), kinds
    _check_kernels("gpt2_ts17", build(src.text, str(tmp_path)), src, host_groups, env, consts)
    with pytest.raises(CudaCodegenError, match="sm_90"):
        generate_cuda_source(groups, arch="sm_80", pdl=True)
    # the Llama's wgmma products on persistent tiles (decision 48): each loads its weight's first
    # stages before its wait; its epilogue (SiLU(gate) * up, the casts) reads the activations after it
    env, consts, groups = _model_values("llama_ts17")
    src = generate_cuda_source(groups, arch="sm_90", precision="float16")
    gemms = [g for g in groups if g.name in src.launches and src.launches[g.name].kind.startswith("gemm-wgmma")]
    assert len(gemms) >= 4
    tiles = {g.name: ("tma64x128", "pp64x128")[i % 2] for i, g in enumerate(gemms)}
    src = generate_cuda_source(groups, arch="sm_90", precision="float16", pdl=True, gemm_configs=tiles)
    assert all(src.launches[g.name].persistent for g in gemms)
    assert src.text.count("int sf_pre = 0;") == len({src.launches[g.name].symbol for g in gemms})
    (tmp_path / "tiles").mkdir()
    _check_kernels("llama_ts17", build(src.text, str(tmp_path / "tiles")), src, gemms, env, consts, grid=(3, 1, 1))


@pytest.mark.parametrize("case", ["causal-3d", "nonpad-mask-4d"])
def test_half_onnx_attention_program_on_the_host(tmp_path, case):
    """Every kernel of the cuda program of a float16 model's own ``Attention`` (its projections,
    and the fused attention computing in float32 that reads the float16 mask and writes the
    float16 output: passes/attention.py's HalfAttentionInFloat32), against the evaluator."""
    from test_attention import _float16_attention_model

    from shardflow.compiler import load_onnx
    from shardflow.compiler.passes.attention import HalfAttentionInFloat32

    model, feeds = _float16_attention_model(case)
    env, consts, groups = _graph_values(HalfAttentionInFloat32().run(load_onnx(model)), feeds)
    src = generate_cuda_source(groups, arch="sm_90")
    kinds = [src.launches[g.name].kind for g in groups]
    assert kinds.count("attention-f16") == 1 and len(kinds) == 5, kinds
    _check_kernels(case, build(src.text, str(tmp_path)), src, groups, env, consts)


@pytest.mark.parametrize("case", ["causal-mask-4d", "nonpad-3d"])
def test_float32_onnx_attention_program_on_the_host(tmp_path, case):
    """A float32 model's own ``Attention`` (opset 23/24; its definition scales Q and K before the
    sum, the kernel the sum: a rounding apart) as the fused kernel with 3xTF32 products: the
    program's kernels on the host against onnxruntime's float32 output, to float32 accuracy."""
    from test_attention import ONNX_ATTENTION, _onnx_attention_model, _ort

    from shardflow.compiler import load_onnx
    from shardflow.compiler.codegen.fusion import fuse

    model, feeds = _onnx_attention_model(*ONNX_ATTENTION[case])
    g = load_onnx(model)
    groups = fuse(list(g.nodes), keep=g.output_names)
    src = generate_cuda_source(groups, arch="sm_90")
    assert [src.launches[gr.name].kind for gr in groups].count("attention-f32") == 1
    kernels, env = build(src.text, str(tmp_path)), dict(feeds)
    for gr in groups:  # (the program: each kernel on the outputs of the ones before it)
        launch = src.launches[gr.name]
        ins = [env[n] if n in env else t.value for n, t in zip(launch.args, gr.inputs)]
        outs = run(kernels, launch, ins, [(tuple(t.shape), np.dtype(t.dtype)) for t in gr.outputs])
        env.update({t.name: o for t, o in zip(gr.outputs, outs)})
    want = _ort(model, feeds)["out"]
    np.testing.assert_allclose(env["out"], want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("model", ["gpt2_ts17", "llama_ts17"])
def test_bfloat16_model_program_on_the_host(tmp_path, model):
    """Every kernel of the cuda program of a model that is bfloat16 itself (weights, activations;
    model_refs.half_model), as the driver builds it at the default precision (merged
    projections, bfloat16 wgmma GEMMs with their epilogues, GPT-2's attention as one fused kernel
    reading bfloat16 Q, K, V (Llama's its 2 KV heads before the repeat), row and element-wise
    kernels storing bfloat16), against the evaluator (float32 arithmetic, each op's output rounded
    once)."""
    from model_refs import half_model

    from shardflow.compiler import load_onnx
    from shardflow.compiler.parallel.partition import partition
    from shardflow.compiler.parallel.search import search
    from shardflow.compiler.passes.attention import FuseAttention, HalfAttentionInFloat32
    from shardflow.compiler.passes.projections import MergeProjections

    m, feeds, _ = half_model(model)
    graph = load_onnx(m)
    (rg,) = partition(graph, search(graph, {"mesh_shape": [1], "algo": "replicate"}))
    rg = HalfAttentionInFloat32().run(FuseAttention().run(MergeProjections().run(rg)))
    env, consts, groups = _graph_values(rg, feeds)
    src = generate_cuda_source(groups, arch="sm_90")
    host_groups = [g for g in groups if g.name in src.launches and src.launches[g.name].grid[0] > 0]
    kinds = [src.launches[g.name].kind for g in host_groups]
    assert {"row", "elementwise", "gemm-wgmma-bf16"} <= set(kinds), kinds
    assert kinds.count("attention-bf16") == 2, kinds
    _check_kernels(model, build(src.text, str(tmp_path)), src, host_groups, env, consts)


@pytest.mark.parametrize("half,pos", [("float16", 37), ("bfloat16", 37), ("float16", -1)])
def test_half_decoding_step_program_on_the_host(tmp_path, half, pos):
    """Every kernel of the cuda program of benchmarks/gpu/decode.py's step (a 2-layer Llama with 4
    query heads over 2 KV heads and a static cache of 256 rows, exported by torch in ``half``: its
    softmax asked for in float32, its presents ``Where(j != pos, past, new)``), as the driver
    builds it for sm_90, at a step that sees 38 rows of a random cache (or none: position -1, NaN
    as the separate ops give): the products on the GEMV template, each layer's attention one fused
    kernel (its runtime mask read, the key blocks past the position not visited, the 2 query heads
    of a KV head in one block's rows), against the evaluator."""
    pytest.importorskip("torch")
    import os
    import sys

    from shardflow.compiler import load_onnx
    from shardflow.compiler.codegen.cuda import _product_operand_casts
    from shardflow.compiler.parallel.partition import partition
    from shardflow.compiler.parallel.search import search
    from shardflow.compiler.passes.attention import FuseAttention, HalfAttentionInFloat32
    from shardflow.compiler.passes.projections import MergeProjections

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
    import decode_model as dm

    L, B = 256, 2
    model = dm.build(L, tiny=True)
    dm.export(model, str(tmp_path / "step.onnx"), B, dtype=half)
    ins, _ = dm.io_names(model.c["layers"])
    rng = np.random.default_rng(0)
    dt = np.float16 if half == "float16" else __import__("ml_dtypes").bfloat16
    feeds = {"input_ids": np.array([[3], [200]], np.int64), "pos": np.array([pos], np.int64),
             **{n: (0.5 * rng.standard_normal((B, 2, L, 16))).astype(dt) for n in ins[2:]}}
    graph = load_onnx(str(tmp_path / "step.onnx"), input_shapes={k: list(v.shape) for k, v in feeds.items()})
    (rg,) = partition(graph, search(graph, {"mesh_shape": [1], "algo": "replicate"}))
    rg = HalfAttentionInFloat32().run(FuseAttention().run(MergeProjections().run(rg)))
    fed = _product_operand_casts(rg.nodes)  # (grouped as the sm_90 build groups them)
    env, consts, groups = _graph_values(rg, feeds, materialize=lambda op: op.name in fed, views=True)
    src = generate_cuda_source(groups, arch="sm_90")
    host_groups = [g for g in groups if g.name in src.launches and src.launches[g.name].grid[0] > 0]
    kinds = [src.launches[g.name].kind for g in host_groups]
    t = "f16" if half == "float16" else "bf16"
    assert kinds.count(f"attention-{t}") == 2 and kinds.count("gemv") >= 8, kinds
    assert all(src.launches[g.name].grid[1] == 2 for g in host_groups if src.launches[g.name].kind.startswith("att"))
    assert "const int sf_nkb = (sf_np + 63) / 64;" in src.text  # (the position bounds the key blocks)
    _check_kernels("decode", build(src.text, str(tmp_path)), src, host_groups, env, consts)
    if pos < 0:
        assert np.isnan(env["logits"]).all()


@pytest.mark.parametrize("cmp,hide,pos,pad,rows", [
    ("le", -np.inf, 17, False, 1), ("le", -np.inf, -1, False, 1), ("lt", -np.inf, 0, False, 1),
    ("ge", -65504.0, 9, False, 1), ("ge", -65504.0, 0, False, 1), ("ge", -65504.0, -3, False, 1),
    ("le", -np.inf, (30, -1), False, 1), ("gt", -65504.0, (0, 39), False, 1), ("le", -np.inf, (25, 12), True, 1),
    ("gt", -np.inf, 30, True, 1), ("le", -np.inf, 20, False, 3), ("le", -np.inf, 1, False, 3),
    ("le", -65504.0, (25, 12), True, 1), ("gt", -65504.0, (30, 22), True, 1), ("le", -65504.0, 20, False, 3),
    ("le", -65504.0, 1, False, 3)])
def test_static_cache_attention_kernel_on_the_host(tmp_path, cmp, hide, pos, pad, rows, mul=False):
    """The fused kernel of a static cache's step whose mask bounds the keys (test_attention's
    ``_static_cache_step``; ``nonpad_bound``) against the op's definition: the key blocks past the
    position not visited (one position, one per sequence, one per query row: their largest;
    beside a padding mask); a row that
    sees no key NaN under ``-inf`` and, under float16's lowest value, weighing the hidden keys as
    the definition does (the kernel then visits every key: the bound is 0 for its sequence)."""
    from test_attention import _static_cache_step

    from shardflow.compiler import load_onnx
    from shardflow.compiler.passes.attention import FuseAttention

    each = isinstance(pos, tuple)  # (a position per sequence)
    model, feeds = _static_cache_step(cmp, False, hide, per_sequence=each, pad=pad, rows=rows, mul=mul)
    feeds["pos"] = np.array(pos, np.int64).reshape(2, 1, 1, 1) if each else np.array([pos], np.int64) \
        if rows == 1 else np.arange(pos - rows + 1, pos + 1, dtype=np.int64).reshape(rows, 1)
    g = FuseAttention().run(load_onnx(model))
    assert any(op.attrs.get("nonpad_bound") for op in g.nodes)
    env, consts, groups = _graph_values(g, feeds, views=True)
    src = generate_cuda_source(groups, arch="sm_90")
    att = [gr for gr in groups if gr.name in src.launches and src.launches[gr.name].kind == "attention-f16"]
    assert len(att) == 1
    _check_kernels("static-cache", build(src.text, str(tmp_path)), src, att, env, consts)
    out = env[att[0].outputs[0].name]
    for b, p in enumerate(pos if each else (pos, pos)):  # (padding: the second sequence's first 20 rows)
        for r in range(rows):  # (a prompt's row r at position p - rows + 1 + r)
            seen = p - (rows - 1 - r) + (cmp in ("le", "gt")) - (20 if pad and b == 1 else 0)
            assert np.isnan(out[b, r]).all() == (hide == -np.inf and seen <= 0)


@pytest.mark.parametrize("cmp,pos", [("le", 17), ("le", -1), ("gt", (30, 0)), ("gt", (0, -2))])
def test_product_mask_attention_kernel_on_the_host(tmp_path, cmp, pos):
    """The static cache's mask written as a product (``(1 - Cast(j <= pos)) * lowest``,
    ``Cast(j > pos) * lowest``: FuseAttention's ``_mask_select``) bounds the keys the same way."""
    test_static_cache_attention_kernel_on_the_host(tmp_path, cmp, -65504.0, pos, False, 1, mul=True)


def test_unaligned_weight_of_a_bfloat16_model_on_the_host(tmp_path):
    """A bfloat16 model's own weight [K, N] with N not a multiple of 8 (GPT-2's 50257-word head) is
    stored [N, K] behind a Transpose (passes/precision.py HalfWeightsKMajor), so the product is a
    wgmma GEMM reading it K-major (not the portable kernel); against the evaluator."""
    import ml_dtypes

    from shardflow.compiler.ir import const_tensor
    from shardflow.compiler.ir.graph import FlowGraph
    from shardflow.compiler.ops.linalg import MatMul
    from shardflow.compiler.passes.precision import HalfWeightsKMajor

    rng = np.random.default_rng(3)
    x = Tensor("x", (64, 96), "bfloat16")
    mm = MatMul([x, const_tensor(rng.standard_normal((96, 37)).astype(ml_dtypes.bfloat16), "w")], name="head")
    g = HalfWeightsKMajor().run(FlowGraph([x], mm.outputs))
    assert [op.op_type for op in g.nodes] == ["Transpose", "MatMul"] and g.nodes[0].inputs[0].shape == (37, 96)
    env, consts, groups = _graph_values(g, {"x": rng.standard_normal((64, 96)).astype(ml_dtypes.bfloat16)})
    src = generate_cuda_source(groups, arch="sm_90")
    (group,) = [gr for gr in groups if gr.name in src.launches]
    assert src.launches[group.name].kind == "gemm-wgmma-bf16"
    _check_kernels("k-major bf16", build(src.text, str(tmp_path)), src, [group], env, consts)


@pytest.mark.parametrize("cfg", ["sk64x128", "sk128x256", "pp64x128"])
def test_model_gemms_on_the_unmeasured_tiles_on_the_host(tmp_path, cfg):
    """Every wgmma GEMM of the Llama test model's float16 program (the gate projection, and the up
    projection with SiLU(gate) * up and the cast for the down projection in its epilogue) forced
    onto a stream-K or ping-pong tile, run on 3 resident blocks (more blocks than K tiles: empty
    stream-K ranges), against the evaluator. (Its products are one row tile and one K tile: the
    cluster tiles would build their TMA twins; their fused epilogues are checked below.)"""
    env, consts, groups = _model_values("llama_ts17")
    src = generate_cuda_source(groups, arch="sm_90", precision="float16")
    gemms = [g for g in groups if g.name in src.launches and src.launches[g.name].kind.startswith("gemm-wgmma")]
    assert len(gemms) >= 4
    src = generate_cuda_source(groups, arch="sm_90", precision="float16", gemm_configs={g.name: cfg for g in gemms})
    assert all(src.launches[g.name].persistent for g in gemms)
    _check_kernels("llama_ts17", build(src.text, str(tmp_path)), src, gemms, env, consts, grid=(3, 1, 1))


def test_model_gemms_on_the_tiles_for_a_k_major_b_on_the_host(tmp_path):
    """Every wgmma GEMM of the Llama test model's float16 program with its weight stored [N, K]
    (the precision pass's ``k_major_ops``), on the 96- and 160-column tiles in turn, fused
    epilogues (SiLU(gate) * up, the casts) included, on 3 resident blocks, against the
    evaluator; each kernel built with the tile forced (not its fallback)."""
    from shardflow.compiler.codegen.cuda_wgmma import WGMMA_CONFIGS, _smem_bytes

    env, consts, groups = _graph_values(*_rank_graph_for_cuda("llama_ts17", k_major_ops=lambda op: True))
    src = generate_cuda_source(groups, arch="sm_90", precision="float16")
    gemms = [g for g in groups if g.name in src.launches and src.launches[g.name].kind.startswith("gemm-wgmma")]
    assert len(gemms) >= 4
    tiles = {g.name: ("tma64x96", "tma128x160")[i % 2] for i, g in enumerate(gemms)}
    src = generate_cuda_source(groups, arch="sm_90", precision="float16", gemm_configs=tiles)
    for g in gemms:
        wg, bn, stages, mode = WGMMA_CONFIGS[tiles[g.name]]
        assert src.launches[g.name].shared_mem == _smem_bytes(wg, bn, stages, mode)[2], g.name
    _check_kernels("llama_ts17", build(src.text, str(tmp_path)), src, gemms, env, consts, grid=(3, 1, 1))


@pytest.mark.parametrize("step,precision", [("decode", "float32"), ("decode", "float16"), ("prompt", "float32"),
                                            ("prompt", "float16")])
def test_low_bit_llama_program_on_the_host(tmp_path, step, precision):
    """The 4-bit genai Llama's cuda program for sm_90, its weights kept as codes: a decoding step's
    products (2 rows) are gemv kernels, the prompt's (16 rows) tensor-core GEMMs, both dequantizing
    the codes as they load them (at float16 rounded to half operands, passes/lowbit.py); every
    kernel on the evaluator's values, against the evaluator."""
    from model_refs import genai_llama_feeds

    rg, feeds = _rank_graph_for_cuda("llama_genai_int4", feeds=genai_llama_feeds(step), precision=precision)
    nbits = [op for op in rg.nodes if op.op_type == "MatMulNBits"]
    rounded = precision if precision != "float32" and step == "prompt" else None  # (decoding: float32)
    assert len(nbits) == 11 and all(op.attrs.get("operand_dtype") == rounded for op in nbits)
    env, consts, groups = _graph_values(rg, feeds, views=True)
    src = generate_cuda_source(groups, arch="sm_90", precision=precision)
    kinds = [src.launches[g.name].kind for g in groups if g.name in src.launches]
    gemm = {"float32": "gemm-f32", "float16": "gemm-f16"}[precision]
    assert kinds.count("gemv" if step == "decode" else gemm) == 11, kinds
    # (a decoding step's products read the codes a word at a time; qkv's and gate's kernel is one)
    assert src.text.count("0x4B000000u") == (5 if step == "decode" else 0)
    _check_kernels("llama_genai_int4", build(src.text, str(tmp_path)), src,
                   [g for g in groups if g.name in src.launches], env, consts)


def _model_values(model: str):
    """For a test model's float16 rank graph for cuda: every tensor's value by name (the
    evaluator's, on the model's inputs), the constants by name, and the graph's kernel groups."""
    return _graph_values(*_rank_graph_for_cuda(model))


def _graph_values(rg, feeds, materialize=lambda op: False, views: bool = False):
    """``_model_values`` of graph ``rg`` on inputs ``feeds`` (``materialize``: the fusion's, as the
    cuda build passes it for sm_90; ``views``: reshapes and the like left to run as views, as the
    driver does)."""
    from shardflow.compiler.codegen.fusion import drop_views, fuse
    from shardflow.compiler.driver import _is_view

    env = {t.name: feeds[t.name] for t in rg.inputs}
    for op in rg.nodes:
        with np.errstate(all="ignore"):
            outs = op.run(*[env[t.name] if t.name in env else t.value for t in op.inputs])
        env.update({t.name: v for t, v in zip(op.outputs, outs)})
    consts = {t.name: t.value for op in rg.nodes for t in op.inputs if t.value is not None}
    names = [op.name for op in rg.nodes if views and _is_view(op)]
    groups = fuse([op for op in rg.nodes], keep=[t.name for t in rg.outputs], materialize=materialize, views=names)
    return env, consts, drop_views(groups, names)


def _check_kernels(model, kernels, src, groups, env, consts, grid=None, check=None):
    """Run each group's kernel on the evaluator's values of its inputs and check its outputs
    (persistent kernels on ``grid`` blocks, all resident, when given; ``check(got, want, name)``
    instead of the GPU tests' tolerances)."""
    for g in groups:
        launch = src.launches[g.name]
        names = launch.args
        ins = [env[n] if n in env else consts[n] for n in names[:launch.num_inputs]]
        persistent = grid is not None and launch.persistent
        outs = run(kernels, launch, ins, [(env[n].shape, env[n].dtype) for n in names[launch.num_inputs:]],
                   grid=grid if persistent else None, resident=grid[0] if persistent else 1)
        for n, o in zip(names[launch.num_inputs:], outs):
            if check is None:
                _check(f"{model}: {g.name} -> {n}", launch.kind, o, env[n])
            else:
                check(o, env[n], f"{model}: {g.name} -> {n}")


@pytest.fixture(scope="module")
def attention(tmp_path_factory):
    from test_attention import _ops

    ops = _ops()
    src = generate_cuda_source([op for op, _, _ in ops.values()], arch="sm_90")
    return ops, src.launches, build(src.text, str(tmp_path_factory.mktemp("att")))


def _attention_cases():
    from test_attention import CASES as ATTENTION_CASES
    return list(ATTENTION_CASES)


@pytest.mark.parametrize("name", _attention_cases())
def test_attention_kernel_on_the_host_matches_the_definition(attention, name):
    """The fused attention kernel (``mma.sync``, ``ldmatrix``, online softmax) for every case of
    test_attention.py's GPU test, under its tolerance: the cases that ran on the H100 in session 5
    (gpt2-like, odd sizes, head sizes, grouped heads, masked rows, bfloat16) check the emulation;
    the rest (causal, KV cache, bool and short masks, two biases, merged output, windows, softcap)
    had not run anywhere before."""
    from test_attention import _bits, check_case

    ops, launches, kernels = attention
    op, arrays, half = ops[name]
    launch = launches[name]
    assert launch.kind.startswith("attention")
    want = op.run(*arrays)[0]
    ins = [_bits(a, half) if k < 3 else a for k, a in enumerate(arrays)]
    if half == "bfloat16":
        ins[:3] = [a.view(np.uint16) for a in ins[:3]]
    check_case(name, run(kernels, launch, ins, [(want.shape, np.float32)])[0], want)


@pytest.fixture(scope="module")
def float32_attention(tmp_path_factory):
    """The float32 cases' kernels at each float32 precision, built for the host: by precision,
    ``(ops, launches, kernels)``."""
    from test_attention import _float32_ops

    ops = _float32_ops()
    built = {}
    for precision in ("float32", "tf32"):
        src = generate_cuda_source([op for op, _ in ops.values()], precision=precision, arch="sm_90")
        built[precision] = ops, src.launches, build(src.text, str(tmp_path_factory.mktemp("att32")))
    return built


def _float32_attention_cases():
    """Every float32 case for 3xTF32; for one TF32 product (the same kernel but for the products) a
    few by default, the rest in the slow run."""
    from test_attention import float32_cases

    quick = ("gpt2-like", "causal", "sinks-window", "decode-split", "split-nonpad-sinks")
    return [pytest.param(p, n, id=f"{p}-{n}", marks=() if p == "float32" or n in quick else pytest.mark.slow)
            for p in ("float32", "tf32") for n in float32_cases()]


@pytest.mark.parametrize("precision,name", _float32_attention_cases())
def test_float32_attention_kernel_on_the_host_matches_the_definition(float32_attention, precision, name):
    """The fused attention kernel on float32 operands (``mma.sync.m16n8k8`` on TF32 operands, the
    keys of each 8 taken in the order the scores' fragments hold them) for every case: 3xTF32 to
    float32 accuracy (dropping any of its three products fails), one TF32 product to its own
    (test_attention.FLOAT32_TOL). An operand not converted to TF32 fails the emulated mma."""
    from test_attention import FLOAT32_TOL, check_case

    ops, launches, kernels = float32_attention[precision]
    op, arrays = ops[name]
    want = op.run(*arrays)[0]
    check_case(name, run(kernels, launches[name], arrays, [(want.shape, np.float32)])[0], want,
               FLOAT32_TOL[precision])


@pytest.mark.parametrize("name", ["decode-split", "split-nonpad-sinks",
                                  *(pytest.param(n, marks=pytest.mark.slow)
                                    for n in ("causal-window-split", "head256-decode-split"))])
def test_split_kv_combines_the_same_bits_whichever_split_is_last(attention, name):
    """Split-KV (rfcs/0005 decision 36): with a block of queries' splits running at once, in any
    order (two scheduler seeds), the last to count in combines the splits in their order: the
    output's bits equal those of the splits run one after another; and the count each leaves
    behind is reset (the launches share the kernel's globals)."""
    from test_attention import _bits, check_case

    ops, launches, kernels = attention
    op, arrays, half = ops[name]
    launch = launches[name]
    assert launch.grid[0] > -(-op.inputs[0].shape[-2 if op.inputs[0].ndim == 4 else 1] // 64)  # (split)
    ins = [_bits(a, half) if k < 3 else a for k, a in enumerate(arrays)]
    if half == "bfloat16":
        ins[:3] = [a.view(np.uint16) for a in ins[:3]]
    spec = [(op.outputs[0].shape, np.float32)]
    first = run(kernels, launch, ins, spec)[0]
    check_case(name, first, op.run(*arrays)[0])  # (after the other tests' launches of this kernel)
    for seed in (2, 3):
        again = run(kernels, launch, ins, spec, seed=seed, resident=launch.grid[0] * launch.grid[1])[0]
        np.testing.assert_array_equal(again.view(np.uint32), first.view(np.uint32))


# ----------------------------------------------------------------------------------------------
# Hopper GEMMs: wgmma, TMA, mbarriers, named barriers (the shim's asynchronous model)
# ----------------------------------------------------------------------------------------------

def _wgmma_gemm(tmp_path, cfg, M, N, K, ta=False, tb=False, grid=None, seeds=(1,), dt="float16", launches=1,
                pdl=False):
    """A half GEMM on tile ``cfg`` run on the host (persistent kernels on ``grid`` blocks, all
    resident at once), against numpy, for each scheduling ``seed`` (``launches`` times each, on
    the same kernel, A negated every other time: what a launch leaves behind must not leak into
    the next); returns the launch and the outputs (of the launches on A as given). ``pdl``: B is a
    constant (a weight) and the kernel is for programmatic dependent launch; returns the source too."""
    from test_wgmma import _bits, _gemm, _value

    from shardflow.compiler.ops.linalg import Gemm

    rng = np.random.default_rng(0)
    a = _bits(rng.standard_normal((K, M) if ta else (M, K)), dt)
    b = _bits(rng.standard_normal((N, K) if tb else (K, N)), dt)
    op = _gemm(M, N, K, dt, ta, tb, name="g")
    if pdl:
        op = Gemm([op.inputs[0], Tensor("g_b", b.shape, dt, value=b)], name="g", trans_a=ta, trans_b=tb)
    src = generate_cuda_source([op], arch="sm_90", gemm_configs={"g": cfg}, pdl=pdl)
    launch = src.launches["g"]
    assert launch.kind == f"gemm-wgmma-{'f16' if dt == 'float16' else 'bf16'}"
    kernels = build(src.text, str(tmp_path))
    want = (_value(a, dt).T if ta else _value(a, dt)).astype(np.float64) @ \
        (_value(b, dt).T if tb else _value(b, dt)).astype(np.float64)
    outs = []
    for seed in seeds:
        for j in range(launches):
            sign = -1 if j % 2 else 1  # (flipping the sign bit negates a float16 or bfloat16 value)
            a_j = (a.view(np.uint16) ^ np.uint16(0x8000)).view(a.dtype) if j % 2 else a
            out = run(kernels, launch, [a_j, b], [((M, N), np.uint16)], grid=grid, seed=seed,
                      resident=(grid or launch.grid)[0] if launch.persistent else 1)[0]
            got = _value(out.view(np.float16) if dt == "float16" else out, dt)
            err = float(np.max(np.abs(got - sign * want))) / float(np.max(np.abs(want)))
            # (NaN, an element not written, fails too)
            assert err < (4e-3 if dt == "float16" else 2e-2), (cfg, ta, tb, seed, j, err)
            if sign == 1:
                outs.append(out)
    return (launch, outs, src.text) if pdl else (launch, outs)


def _wgmma_cases():
    from shardflow.compiler.codegen.cuda_wgmma import WGMMA_CONFIGS

    cases = []
    for i, cfg in enumerate(WGMMA_CONFIGS):  # every tile; the four operand layouts spread over them
        ta, tb = [(False, False), (True, True), (False, True), (True, False)][i % 4]
        cases.append(pytest.param(cfg, ta, tb, id=f"{cfg}-{'T' if ta else 'N'}{'T' if tb else 'N'}"))
    return cases


@pytest.mark.parametrize("cfg,ta,tb", _wgmma_cases())
def test_wgmma_gemms_on_the_host_match_numpy(tmp_path, cfg, ta, tb):
    """Every wgmma tile (cp.async, persistent TMA, ping-pong) at sizes that are not multiples of
    the tile, with bulk copies landing late and in any order, cp.async copies and wgmma products
    completing only at their wait_group (so a stage freed too early shows)."""
    from shardflow.compiler.codegen.cuda_wgmma import CLUSTER_SIZE, WGMMA_CONFIGS

    mode = WGMMA_CONFIGS[cfg][3]
    grid = None if mode == "cp" else (4, 1, 1) if mode in CLUSTER_SIZE else (3, 1, 1)  # (whole clusters)
    launch, _ = _wgmma_gemm(tmp_path, cfg, 200, 136, 200, ta, tb, grid=grid)
    assert launch.cluster == CLUSTER_SIZE.get(mode, 1)  # (the tile itself, not a fallback)


@pytest.mark.parametrize("cfg", ["tma64x96", "tma128x160"])
def test_tiles_for_a_k_major_b_on_the_host(tmp_path, cfg):
    """The tiles whose column count is not a multiple of 64 (for a weight stored ``[N, K]``):
    both layouts of A, sizes that are not multiples of the tile, blocks with several tiles and a
    split-K product, each against numpy; with an MN-major B the same forced tile takes the
    64-multiple tile beside it (the kernel's shared memory tells which was built)."""
    from shardflow.compiler.codegen.cuda_wgmma import _KMAJOR_B_FALLBACK, WGMMA_CONFIGS, _smem_bytes
    from test_wgmma import _gemm

    def smem(name):
        wg, bn, stages, mode = WGMMA_CONFIGS[name]
        return _smem_bytes(wg, bn, stages, mode)[2]

    for i, (ta, M, N, K, grid) in enumerate([(False, 200, 136, 200, 3), (True, 136, 350, 328, 2),
                                               (False, 72, 100, 1096, 8)]):
        (tmp_path / str(i)).mkdir()
        launch, _ = _wgmma_gemm(tmp_path / str(i), cfg, M, N, K, ta, True, grid=(grid, 1, 1))
        assert launch.persistent and launch.shared_mem == smem(cfg)
    mn = generate_cuda_source([_gemm(200, 136, 200, "float16", False, False)], arch="sm_90",
                              gemm_configs={"g": cfg}).launches["g"]
    assert mn.shared_mem == smem(_KMAJOR_B_FALLBACK[cfg])


@pytest.mark.parametrize("cfg", ["pp64x128", pytest.param("pp64x256", marks=pytest.mark.slow)])  # (opt-in tiles)
def test_pingpong_hand_over_under_random_interleavings(tmp_path, cfg):
    """Ping-pong (RFC 0005 decision 20) with one block taking 5 tiles (its consumer warpgroups
    alternate, the second has fewer) and 10 K tiles each (more than half the stages: the case
    where a warpgroup could wait on a stage barrier two phases ahead without the hand-over), under
    several random interleavings; bfloat16 too. (Without the hand-over these deadlock here.)"""
    _wgmma_gemm(tmp_path, cfg, 300, 128, 640, grid=(1, 1, 1), seeds=range(2, 6))
    _wgmma_gemm(tmp_path, cfg, 300, 128, 640, grid=(1, 1, 1), seeds=(7,), dt="bfloat16")


@pytest.mark.parametrize("cfg,M,N,K,tb,blocks", [
    ("tma128x128", 200, 136, 200, False, 3),  # fewer K tiles than stages, blocks with several tiles
    ("tma64x128", 136, 264, 1096, True, 2),  # more K tiles than stages, B stored [N, K]
    ("tma64x128", 64, 136, 1152, False, 4),  # split-K: 2 tiles x 2 splits (a unit is a part of a tile's K tiles)
    ("pp64x128", 300, 128, 640, False, 1),  # ping-pong: one block, its warpgroups alternating
    ("128x128", 200, 136, 200, False, None),  # cp.async: fewer K tiles than prologue stages
    ("64x64", 136, 264, 1096, True, None),  # cp.async: more
])
def test_weight_stages_before_the_grid_dependency_wait_on_the_host(tmp_path, cfg, M, N, K, tb, blocks):
    """Programmatic dependent launch (RFC 0005 decision 48): a GEMM whose B is a weight issues its
    copies of B's first stages, then waits for the kernel before; A's copies, the later stages'
    and everything that reads or writes an activation come after the wait. A persistent kernel
    sets up its barriers first and counts those stages' bytes once on them (a stage announced
    twice would never fill); the cp.async kernel's early copies join its first group. Against
    numpy under several interleavings."""
    from shardflow.compiler.codegen.cuda import PDL_ENTER

    launch, _, text = _wgmma_gemm(tmp_path, cfg, M, N, K, False, tb, grid=blocks and (blocks, 1, 1), seeds=(1, 2, 3),
                                  launches=2, pdl=True)
    assert launch.persistent == (blocks is not None)
    assert "_ws[" in text or K != 1152  # (the split-K case's partial sums)
    body = text[text.index('extern "C" __global__'):]
    before, after = body.split(PDL_ENTER)
    before = before.split("{", 1)[1]  # (the signature left out)
    if launch.persistent:
        copies = before.split("__syncthreads();")[1]
        assert "&sf_tmB, " in copies and "&sf_tmA, " not in copies and not re.search(r"\bin\d\b|\bout0\b", before)
        assert "if (sf_g >= sf_pre)" in after
    else:
        assert "in1 + " in before and not re.search(r"\bin0\b|\bout0\b|commit", before)


def test_split_k_on_the_host(tmp_path):
    """A short, deep product split along K; with fewer blocks than units the last split of a tile
    sums every split's partials before the epilogue; twice, so the counters are reset."""
    from shardflow.compiler.codegen.cuda_wgmma import split_count

    launch, _ = _wgmma_gemm(tmp_path, "tma64x128", 128, 776, 3000, grid=(7, 1, 1), seeds=(1, 3))
    assert split_count(2 * 7, 3000) > 1 and launch.grid[0] > 7


def test_split_k_spread_over_a_full_grid_on_the_host(tmp_path):
    """Split-K with a block per unit, all resident (the GPU's case): the splits of a tile wait for
    each other and each sums a share of the tile's chunks; the same bits as the last-split sum on
    a smaller grid, under several interleavings, twice per run (the counters are reset)."""
    launch, spread = _wgmma_gemm(tmp_path, "tma64x128", 64, 136, 1152, seeds=(1, 2, 3), launches=2)
    assert launch.grid[0] == 4  # 2 tiles x 2 splits
    _, last = _wgmma_gemm(tmp_path, "tma64x128", 64, 136, 1152, grid=(3, 1, 1))
    assert all(np.array_equal(o, last[0]) for o in spread)


# (stream-K tiles run only where gemm_tiles names them: four of the seven cases, ~45 s of host
# emulation, run with `pytest -m slow`)
@pytest.mark.parametrize("cfg,M,N,K,blocks", [
    ("sk64x128", 200, 136, 200, 3),  # 8 tiles on 3 blocks: 3 whole, 5 cut into 3 ranges
    pytest.param("sk64x128", 100, 136, 640, 3, marks=pytest.mark.slow),  # 4 tiles on 3 blocks: one wave and
    # the rest, all in ranges
    pytest.param("sk64x128", 64, 248, 640, 3, marks=pytest.mark.slow),  # 2 tiles on 3 blocks: each in 2 pieces
    ("sk64x128", 64, 104, 640, 4),  # 1 tile on 4 blocks: its first piece adds three others
    ("sk64x128", 64, 104, 128, 4),  # 2 K tiles on 4 blocks: empty ranges
    pytest.param("sk64x128", 192, 136, 200, 3, marks=pytest.mark.slow),  # 6 tiles on 3 blocks: whole waves
    pytest.param("sk128x256", 130, 264, 520, 3, marks=pytest.mark.slow),  # 4 tiles of 128 x 256
])
def test_stream_k_on_the_host(tmp_path, cfg, M, N, K, blocks):
    """Stream-K (RFC 0005 decision 24) with its blocks resident together: whole tiles, then ranges
    of K tiles crossing tile boundaries; a tile's first piece waits for the later pieces' partial
    sums (the next blocks') and adds them in block order. The same bits under several random
    interleavings, each launched twice (the flags are reset for the next launch)."""
    _, outs = _wgmma_gemm(tmp_path, cfg, M, N, K, grid=(blocks, 1, 1), seeds=(1, 2, 5), launches=2)
    assert all(np.array_equal(o, outs[0]) for o in outs)
    _wgmma_gemm(tmp_path, cfg, M, N, K, grid=(blocks, 1, 1), seeds=(3,), dt="bfloat16")


@pytest.mark.parametrize("cfg,M,N,K,blocks", [
    ("ck64x128", 200, 136, 200, 2),  # 8 tiles on one cluster, 2 + 2 K tiles
    pytest.param("ck128x128", 200, 136, 328, 4, marks=pytest.mark.slow),  # 4 tiles on two clusters, 3 + 3 K tiles,
    # the last one short
    pytest.param("ck128x256", 130, 264, 520, 2, marks=pytest.mark.slow),  # 4 exchanges of a pair of chunks
    ("ck4_64x128", 200, 136, 768, 4),  # clusters of four: 8 tiles on one, 3 K tiles a block
    pytest.param("ck4_128x128", 136, 136, 200, 8, marks=pytest.mark.slow),  # 2 tiles on two clusters, 1 K tile a block
])
def test_cluster_split_k_on_the_host(tmp_path, cfg, M, N, K, blocks):
    """Cluster split-K (RFC 0005 decision 31): the two (or four) blocks of a cluster take the parts
    of each tile's K tiles and exchange their partial sums through each other's shared memory, a
    cluster looping over several tiles (the exchange barriers' phases carry over). The same bits
    under several random interleavings, each launched twice; bfloat16 too."""
    launch, outs = _wgmma_gemm(tmp_path, cfg, M, N, K, grid=(blocks, 1, 1), seeds=(1, 2, 5), launches=2)
    assert launch.cluster == (4 if cfg.startswith("ck4") else 2)
    assert all(np.array_equal(o, outs[0]) for o in outs)
    _wgmma_gemm(tmp_path, cfg, M, N, K, grid=(blocks, 1, 1), seeds=(3,), dt="bfloat16")


@pytest.mark.parametrize("cfg,M,N,K,tb,blocks", [
    ("mc64x128", 256, 136, 640, False, 2),  # 8 tiles (4 pairs) on one cluster, MN-major B: a panel each
    ("mc64x128", 200, 136, 200, True, 4),  # K-major B: half the rows each; rows past M in the last pair
    pytest.param("mc128x192", 256, 264, 328, True, 2, marks=pytest.mark.slow),  # K-major B: boxes of 96 rows (its
    # 3 MN-major panels: the test above)
    pytest.param("mc128x256", 136, 264, 520, True, 2, marks=pytest.mark.slow),
])
def test_multicast_on_the_host(tmp_path, cfg, M, N, K, tb, blocks):
    """B multicast (RFC 0005 decision 32): the two blocks of a cluster take vertically adjacent
    tiles and each loads half of their common B tile into both blocks' shared memory, a stage
    freed for the producers once both blocks' consumers have read it; copies land at random in
    each block. The same bits under several random interleavings, each launched twice; bfloat16."""
    launch, outs = _wgmma_gemm(tmp_path, cfg, M, N, K, tb=tb, grid=(blocks, 1, 1), seeds=(1, 2, 5), launches=2)
    assert launch.cluster == 2
    assert all(np.array_equal(o, outs[0]) for o in outs)
    _wgmma_gemm(tmp_path, cfg, M, N, K, tb=tb, grid=(blocks, 1, 1), seeds=(3,), dt="bfloat16")


def _float16_product(cfg, M, N, K):
    """The source and launch of an ``[M, K] @ [K, N]`` float16 product on tile ``cfg``, random
    operands (as float16 bits) and their product in float64."""
    from test_wgmma import _bits, _gemm, _value

    src = generate_cuda_source([_gemm(M, N, K, "float16", name="g")], arch="sm_90", gemm_configs={"g": cfg})
    rng = np.random.default_rng(0)
    a, b = _bits(rng.standard_normal((M, K)), "float16"), _bits(rng.standard_normal((K, N)), "float16")
    want = _value(a, "float16").astype(np.float64) @ _value(b, "float16").astype(np.float64)
    return src, src.launches["g"], a, b, want


def test_the_emulation_sees_a_stage_freed_for_one_block_only(tmp_path):
    """Without the consumers' arrivals on the other block's empty barriers (and those barriers
    counting only their own block's), a producer's multicast overwrites a stage the other block
    has not read yet: wrong results."""
    M, N = 256, 136
    src, launch, a, b, want = _float16_product("mc64x128", M, N, 640)
    broken = re.sub(r"\n *sf_mbar_arrive_cluster\(sf_pbars[^;]*;", "", src.text)
    init = "sf_mbar_init(sf_bars + (8 + (sf_s)) * 8, 256);"
    assert broken != src.text and init in broken
    kernels = {t: build(t, str(tmp_path)) for t in (src.text, broken.replace(init, init.replace("256", "128")))}
    errs = []
    for text, k in kernels.items():
        out = run(k, launch, [a, b], [((M, N), np.uint16)], grid=(2, 1, 1), seed=2)[0]
        errs.append(float(np.max(np.abs(out.view(np.float16) - want))) / float(np.max(np.abs(want))))
    assert errs[0] < 4e-3 and not errs[1] < 4e-3, errs


def test_the_emulation_sees_a_broken_cluster_exchange(tmp_path):
    """The cluster machinery is no rubber stamp either: without the wait for the peer's partial sums
    a block reads a staging tile the peer has not filled (wrong values, or a wait that never ends);
    without the wait until the peer has read the previous ones, a block overwrites them; without
    the cluster barrier at the end, a block arrives on the barrier of a peer that has exited (an
    error on a GPU); an odd grid is not whole clusters."""
    M, N = 200, 136
    src, launch, a, b, want = _float16_product("ck64x128", M, N, 200)

    def err(text, seed=1, grid=2):
        out = run(build(text, str(tmp_path)), launch, [a, b], [((M, N), np.uint16)], grid=(grid, 1, 1),
                  resident=grid, seed=seed)[0]
        with np.errstate(all="ignore"):
            return float(np.max(np.abs(out.view(np.float16) - want))) / float(np.max(np.abs(want)))

    text = src.text
    assert err(text) < 4e-3
    for wait in ("sf_ready", "sf_free"):
        broken = re.sub(rf"sf_mbar_wait_cluster\({wait}, [^;]*;", "", text)
        assert broken != text
        try:
            assert not err(broken) < 4e-3  # (NaN or inf: not below either)
        except RuntimeError as exc:
            assert "deadlock" in str(exc)
    end = text.rindex("sf_cluster_sync();")
    with pytest.raises(RuntimeError, match="cluster block that has exited"):
        err(text[:end] + text[end + len("sf_cluster_sync();"):])
    with pytest.raises(ValueError, match="whole clusters of 2"):
        err(text, grid=3)


def test_a_wait_on_blocks_that_never_run_fails_the_launch(tmp_path):
    """Stream-K's first piece of a tile waits for the next blocks' partial sums; where those blocks
    cannot run (here: one block at a time) the generated wait gives up after 2^36 cycles and traps,
    so the launch fails instead of hanging (with the clock standing still, the emulation calls it
    a deadlock)."""
    from test_wgmma import _gemm

    op = _gemm(64, 104, 640, "float16", name="g")
    src = generate_cuda_source([op], arch="sm_90", gemm_configs={"g": "sk64x128"})
    launch = src.launches["g"]
    kernels = build(src.text, str(tmp_path))
    a, b = np.ones((64, 640), np.float16), np.ones((640, 104), np.float16)
    with pytest.raises(RuntimeError, match="__trap"):
        run(kernels, launch, [a, b], [((64, 104), np.uint16)], grid=(4, 1, 1), clock_step=1 << 32)
    with pytest.raises(RuntimeError, match="deadlock"):
        run(kernels, launch, [a, b], [((64, 104), np.uint16)], grid=(4, 1, 1))
    out = run(kernels, launch, [a, b], [((64, 104), np.uint16)], grid=(4, 1, 1), resident=4, clock_step=1 << 20)[0]
    assert (out.view(np.float16) == 640).all()  # all resident: no wait lasts that long


EPILOGUES = {  # name: (N, dtype of the additions, residual read across rows, row as (heads, N // heads))
    "vec": (136, "float16", False, None),  # four columns per thread: vector reads and store
    "vec-f32": (136, "float32", False, None),
    "odd": (137, "float16", False, None),  # one column per thread
    "res_t": (136, "float16", True, None),  # the residual read per element
    "two-axes": (144, "float32", False, 3),  # rows of 3 x 48: the lanes step along the 48
    "short-inner": (136, "float32", False, 4),  # 4 x 34: N a multiple of 4, the last axis not
}


@pytest.mark.parametrize("cfg", ["128x128", "tma64x128", *(pytest.param(c, marks=pytest.mark.slow) for c in (
    "pp64x128", "ck128x128", "mc64x128"))])  # (the slow ones: the tma epilogue in other loops)
def test_residual_epilogues_in_whole_gemm_kernels_on_the_host(tmp_path, cfg):
    """GEMM + bias + residual as whole kernels (RFC 0005 decision 22): four columns per thread
    with vector reads and stores (every vector access aligned), one column per thread, a residual
    read across rows, a row of two axes, float16 and float32 additions."""
    from test_wgmma import _residual_epilogue

    rng = np.random.default_rng(5)
    M = 250 if cfg.startswith("mc") else 300  # (multicast pairs row tiles: 4 of 64 rows, the last short)
    cases = {name: _residual_epilogue(N, res_t, M=M, dt=dt, heads=heads)
             for name, (N, dt, res_t, heads) in EPILOGUES.items()}
    srcs = {name: generate_cuda_source(ops, arch="sm_90", gemm_configs={"out": cfg})
            for name, (ops, _) in cases.items()}
    kernels = dict(zip(srcs, build_all([src.text for src in srcs.values()], str(tmp_path))))
    for name, (N, dt, res_t, heads) in EPILOGUES.items():
        shapes, src = cases[name][1], srcs[name]
        launch = src.launches["out"]
        assert launch.kind == "gemm-wgmma-f16" and ("sf_acc[4]" in src.text) == (name not in ("odd", "short-inner"))
        assert launch.cluster == (2 if cfg.startswith(("ck", "mc")) else 1)  # (not a fallback)
        arrays = {k: (rng.standard_normal(v) / (8 if k == "w" else 1)).astype(np.float16 if k in "xw" else dt)
                  for k, v in shapes.items()}
        w = arrays["w"].T if N % 2 else arrays["w"].reshape(arrays["w"].shape[0], -1)
        res = arrays["res"].T if res_t else arrays["res"]
        want = ((arrays["x"].astype(np.float64) @ w.astype(np.float64)).reshape(res.shape) + arrays["bias"] + res)
        got = run(kernels[name], launch, [arrays[n] for n in launch.args[:launch.num_inputs]],
                  [(res.shape, dt)], grid=(2, 1, 1) if launch.tensor_maps else None)[0]
        np.testing.assert_allclose(got.astype(np.float32), want, atol=1e-2, rtol=4e-3, err_msg=f"{cfg} {name}")


@pytest.mark.parametrize("cfg", ["128x128", "tma64x128", "tma128x128", "pp64x128", "ck128x128",
                                 pytest.param("mc64x128", marks=pytest.mark.slow)])
def test_residual_epilogues_of_whole_tiles_on_the_host(tmp_path, cfg):
    """Products whose tiles all lie inside them (RFC 0005 decision 28): the epilogue tests no
    element, and one that reads a residual along the rows is unrolled whole (its reads issued
    together); a bare product keeps the short unroll. Against numpy, blocks taking
    several tiles; the residual read per element (across rows) too."""
    from shardflow.compiler.codegen.cuda_wgmma import _ROW_READ_UNROLL
    from test_wgmma import _gemm, _residual_epilogue

    rng = np.random.default_rng(7)
    cases = {"vec": _residual_epilogue(256, M=256, K=136), "res_t": _residual_epilogue(256, True, M=256, K=136),
             "vec-f32": _residual_epilogue(256, M=256, K=136, dt="float32")}
    srcs = {name: generate_cuda_source(ops, arch="sm_90", gemm_configs={"out": cfg})
            for name, (ops, _) in cases.items()}
    bare = generate_cuda_source([_gemm(256, 256, 136, "float16", False, False)], arch="sm_90",
                                gemm_configs={"g": cfg}).text
    for text in [s.text for s in srcs.values()] + [bare]:
        assert "inside the product" in text and "sf_m < 256" not in text
    unrolled = f"#pragma unroll {_ROW_READ_UNROLL}\n"
    assert all(unrolled in s.text for s in srcs.values()) and unrolled not in bare
    kernels = dict(zip(srcs, build_all([src.text for src in srcs.values()], str(tmp_path))))
    for name, (ops, shapes) in cases.items():
        launch, dt = srcs[name].launches["out"], "float32" if name == "vec-f32" else "float16"
        assert launch.cluster == (2 if cfg.startswith(("ck", "mc")) else 1)  # (not a fallback)
        arrays = {k: (rng.standard_normal(v) / (8 if k == "w" else 1)).astype(np.float16 if k in "xw" else dt)
                  for k, v in shapes.items()}
        res = arrays["res"].T if name == "res_t" else arrays["res"]
        want = arrays["x"].astype(np.float64) @ arrays["w"].astype(np.float64) + arrays["bias"] + res
        got = run(kernels[name], launch, [arrays[n] for n in launch.args[:launch.num_inputs]], [(res.shape, dt)],
                  grid=(4 if launch.cluster > 1 else 3, 1, 1) if launch.tensor_maps else None, seed=3)[0]
        np.testing.assert_allclose(got.astype(np.float32), want, atol=1e-2, rtol=4e-3, err_msg=f"{cfg} {name}")


def test_epilogue_of_a_transposed_output_on_the_host(tmp_path):
    """An output whose rows are not contiguous: with the batch axis last (``bmk,bkn->mnb``) four
    columns per thread, each stored on its own (decision 22's other store path); a transposed
    output (``mk,kn->nm``) swaps the product's sides instead (decision 55: its columns along the
    output's rows), four consecutive elements stored at once."""
    from shardflow.compiler.ops.linalg import Einsum

    rng = np.random.default_rng(0)
    x, w = Tensor("x", (200, 72), "float16"), Tensor("w", (72, 136), "float16")
    xb, wb = Tensor("xb", (3, 40, 72), "float16"), Tensor("wb", (3, 72, 136), "float16")
    ops = [Einsum([x, w], name="e", equation="mk,kn->nm"), Einsum([xb, wb], name="eb", equation="bmk,bkn->mnb")]
    vals = {t.name: rng.standard_normal(t.shape).astype(np.float16) for t in (x, w, xb, wb)}
    wants = {"e": (vals["x"].astype(np.float64) @ vals["w"].astype(np.float64)).T,
             "eb": np.einsum("bmk,bkn->mnb", vals["xb"].astype(np.float64), vals["wb"].astype(np.float64))}
    kernels = {}
    for op in ops:
        src = generate_cuda_source([op], arch="sm_90")
        assert "sf_acc[4]" in src.text and ("SfVec4<__half> sf_o" in src.text) == (op.name == "e"), op.name
        kernels[op.name] = (src.launches[op.name], build(src.text, str(tmp_path)))
    for name, (launch, lib) in kernels.items():
        got = run(lib, launch, [vals[n] for n in launch.args[:2]], [(wants[name].shape, np.float16)],
                  grid=(3, 1, 1) if launch.persistent else None, resident=3 if launch.persistent else 1)[0]
        np.testing.assert_allclose(got.astype(np.float32), wants[name], atol=4e-3 * np.abs(wants[name]).max(),
                                   rtol=4e-3, err_msg=name)


def _tf32(x: np.ndarray) -> np.ndarray:
    """float32 values with their low 13 mantissa bits cleared: what the tensor cores read of a TF32 operand."""
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.mark.parametrize("cfg,blocks", [("128x128", None), ("64x128", None), ("tma128x256", 3), ("tma64x96", 3),
                                        ("pp64x128", 3), ("sk128x128", 3), ("ck128x128", 4), ("ck4_64x128", 4),
                                        ("mc128x128", 4)])
def test_tf32_wgmma_gemms_on_the_host(tmp_path, cfg, blocks):
    """``precision="tf32"`` products of float32 operands that are both K-major (``A [M, K]``, ``B``
    stored ``[N, K]``) run on the Hopper template, one tile of each mode at sizes that are not
    multiples of the tile (K tiles of 32 floats, a partial last one): numpy's product of the
    operands with their low 13 mantissa bits cleared, to float32 rounding."""
    from shardflow.compiler.codegen.cuda_wgmma import CLUSTER_SIZE, WGMMA_CONFIGS
    from test_wgmma import _gemm

    M, N, K = 200, 136, 100
    op = _gemm(M, N, K, "float32", tb=True, name="g")
    src = generate_cuda_source([op], precision="tf32", arch="sm_90", gemm_configs={"g": cfg})
    launch = src.launches["g"]
    assert launch.kind == "gemm-wgmma-tf32"
    assert launch.cluster == CLUSTER_SIZE.get(WGMMA_CONFIGS[cfg][3], 1)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((N, K)).astype(np.float32)
    want = _tf32(a).astype(np.float64) @ _tf32(b).astype(np.float64).T
    out = run(build(src.text, str(tmp_path)), launch, [a, b], [((M, N), np.float32)],
              grid=(blocks, 1, 1) if blocks else None, seed=3, resident=blocks or 1)[0]
    scale = float(np.max(np.abs(want)))
    assert float(np.max(np.abs(out - want))) < 1e-5 * scale, cfg  # (NaN, an element not written, fails too)
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    assert float(np.max(np.abs(out - exact))) < 2e-3 * scale  # TF32's own error


@pytest.mark.parametrize("model,precision", [("gpt2_ts17", "tf32"), ("bert_ts17", "tf32"), ("llama_ts17", "float32")])
def test_float32_model_program_on_wgmma_on_the_host(tmp_path, model, precision):
    """A test model at ``precision="tf32"`` with ``wgmma_fp32`` for sm_90, as the driver builds it
    (its weights stored ``[N, K]`` and rounded to TF32, reshapes left as views): every GEMM on the
    TF32 wgmma template; or at float32 with every GEMM forced onto a wgmma tile (3xTF32; the
    weights ``[N, K]`` as they are). The attention fused on float32 operands. Every
    kernel against the evaluator (tf32: on the rounded weights; float32: to float32 accuracy)."""
    graph = _rank_graph_for_cuda(model, precision="tf32" if precision == "tf32" else "float32-wgmma")
    env, consts, groups = _graph_values(*graph, views=True)
    forced = {} if precision == "tf32" else {g.name: "tma128x128" for g in groups}
    src = generate_cuda_source(groups, arch="sm_90", precision=precision, gemm_configs=forced,
                               wgmma_fp32=precision == "tf32")
    host_groups = [g for g in groups if g.name in src.launches and src.launches[g.name].grid[0] > 0]
    kinds = [src.launches[g.name].kind for g in host_groups]
    gemms = [k for k in kinds if k.startswith("gemm")]
    assert len(gemms) >= 8 and set(gemms) == {"gemm-wgmma-tf32" if precision == "tf32" else "gemm-wgmma-f32"}, kinds
    assert kinds.count(f"attention-{'tf32' if precision == 'tf32' else 'f32'}") == 2, kinds
    _check_kernels(model, build(src.text, str(tmp_path)), src, host_groups, env, consts, grid=(3, 1, 1))


@pytest.mark.parametrize("model,precision", [("gpt2_ts17", "float32"), ("t5_encoder_ts17", "tf32"),
                                             ("llama_ts17", "float32")])
def test_float32_model_program_on_the_host(tmp_path, model, precision):
    """A float32 test model at the default float32 (3xTF32) or at tf32 for sm_90 without
    ``wgmma_fp32``: its attention fused on float32 operands (T5's with its position bias and
    mask, Llama's on its grouped heads), products on the portable kernel; every kernel against
    the evaluator."""
    env, consts, groups = _graph_values(*_rank_graph_for_cuda(model, precision=precision), views=True)
    src = generate_cuda_source(groups, arch="sm_90", precision=precision)
    host_groups = [g for g in groups if g.name in src.launches and src.launches[g.name].grid[0] > 0]
    kinds = [src.launches[g.name].kind for g in host_groups]
    t = "f32" if precision == "float32" else "tf32"
    assert kinds.count(f"attention-{t}") == 2 and f"gemm-{t}" in kinds, kinds
    _check_kernels(model, build(src.text, str(tmp_path)), src, host_groups, env, consts)


@pytest.mark.parametrize("cfg,blocks", [("128x256", None), ("64x64", None), ("tma128x192", 3), ("tma64x96", 3),
                                        ("pp64x256", 3), ("sk64x128", 3), ("ck128x256", 4), ("ck4_128x128", 4),
                                        ("mc64x128", 4)])
def test_float32_wgmma_gemms_on_the_host(tmp_path, cfg, blocks):
    """A float32 product (the default precision) on a forced wgmma tile: 3xTF32, each operand split
    in shared memory into two TF32 parts, ``hi·hi + hi·lo + lo·hi``: numpy's float64 product to
    float32 accuracy (one TF32 product alone is ~1e-3 off; dropping any of the three products or
    the barrier after the split fails), one tile of each mode, partial tiles and K tile. The tiles
    whose split stages do not fit take a narrower one (128x256: 128x128)."""
    from shardflow.compiler.codegen.cuda_wgmma import CLUSTER_SIZE, WGMMA_CONFIGS
    from test_wgmma import _gemm

    M, N, K = 200, 136, 100
    op = _gemm(M, N, K, "float32", tb=True, name="g")
    src = generate_cuda_source([op], arch="sm_90", gemm_configs={"g": cfg})
    launch = src.launches["g"]
    assert launch.kind == "gemm-wgmma-f32" and "sf_split4" in src.text
    assert launch.cluster == CLUSTER_SIZE.get(WGMMA_CONFIGS[cfg][3], 1)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((N, K)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64).T
    out = run(build(src.text, str(tmp_path)), launch, [a, b], [((M, N), np.float32)],
              grid=(blocks, 1, 1) if blocks else None, seed=3, resident=blocks or 1)[0]
    assert float(np.max(np.abs(out - want))) < 2e-6 * float(np.max(np.abs(want))), cfg  # (NaN fails too)


@pytest.mark.parametrize("tile", [None, "tma128x128"])
def test_3xtf32_products_keep_infinities_and_nans(tmp_path, tile):
    """A float32 product (3xTF32: the portable kernel, and a wgmma tile) whose operands hold
    infinities and NaN: infinite with numpy's sign and NaN where numpy's float64 product is (a
    TF32-exact operand against an infinite one too, whose ``lo = 0`` times ``hi = inf`` was a NaN,
    and ``0·inf``), the finite outputs to float32 accuracy (TF32_HI_FINITE)."""
    from test_wgmma import _gemm

    M, N, K = 200, 136, 100
    op = _gemm(M, N, K, "float32", tb=True, name="g")
    src = generate_cuda_source([op], arch="sm_90", gemm_configs={"g": tile} if tile else None)
    launch = src.launches["g"]
    assert launch.kind == ("gemm-wgmma-f32" if tile else "gemm-f32")
    rng = np.random.default_rng(2)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((N, K)).astype(np.float32)
    a[:, 30] = np.round(a[:, 30] * 4) + 0.5  # TF32-exact, nonzero: its lo is 0
    a[60:64, 30] = 0.0  # 0 * inf: NaN
    a[3, 7], a[10, 20], a[50, 0], a[90, 99] = np.inf, -np.inf, np.nan, 3.4e38  # (the last rounds to inf in TF32)
    b[5, 30], b[9, 7], b[11, 64] = np.inf, -np.inf, np.nan
    with np.errstate(invalid="ignore", over="ignore"):  # (row 90 overflows float32 where |b| > 1: inf)
        want = (a.astype(np.float64)[:, None, :] * b.astype(np.float64)[None, :, :]).sum(-1).astype(np.float32)
    grid = (3, 1, 1) if tile else None
    out = run(build(src.text, str(tmp_path)), launch, [a, b], [((M, N), np.float32)], grid=grid,
              resident=3 if tile else 1)[0]
    assert np.isinf(want).sum() > 300 and np.isnan(want).sum() > 300
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_array_equal(np.where(np.isinf(want), out, 0), np.where(np.isinf(want), want, 0))
    for rows in (np.arange(M) != 90, np.arange(M) == 90):  # (each at its own scale)
        fin = np.isfinite(want) & rows[:, None]
        assert float(np.max(np.abs(out[fin] - want[fin]))) < 2e-6 * float(np.max(np.abs(want[fin])))


@pytest.mark.parametrize("precision", ["float32", "tf32"])
def test_float32_products_stay_on_wmma_unless_asked(precision):
    """Without ``wgmma_fp32`` or a forced tile a float32 product keeps the portable kernel (the
    wgmma ones are not measured on a GPU yet); an operand that is not K-major keeps it in any case."""
    from test_wgmma import _gemm

    ops = [_gemm(200, 136, 100, "float32", tb=True, name="free"),
           _gemm(200, 136, 100, "float32", tb=True, name="forced"), _gemm(200, 136, 100, "float32", name="mn_major")]
    forced = {"forced": "tma128x128", "mn_major": "tma128x128"}
    t = "f32" if precision == "float32" else "tf32"
    for flag, free in ((False, f"gemm-{t}"), (True, f"gemm-wgmma-{t}")):
        src = generate_cuda_source(ops, precision, "sm_90", gemm_configs=forced, wgmma_fp32=flag)
        assert {k: v.kind for k, v in src.launches.items()} == {"free": free, "forced": f"gemm-wgmma-{t}",
                                                                "mn_major": f"gemm-{t}"}


def test_an_mbarrier_used_before_its_init_fails_the_launch(tmp_path):
    """A kernel that waits on an mbarrier it never initialized fails its launch with a message
    (a test failure), instead of killing the test process."""
    M, N = 128, 136
    src, launch, a, b, _ = _float16_product("tma64x128", M, N, 640)
    broken = re.sub(r"\n *sf_mbar_init\(sf_bars \+ \(sf_s\) \* 8, 1\);", "", src.text)
    assert broken != src.text
    with pytest.raises(RuntimeError, match="mbarrier [0-9]+ used before init"):
        run(build(broken, str(tmp_path)), launch, [a, b], [((M, N), np.uint16)], grid=(2, 1, 1), seed=2)


@pytest.mark.parametrize("kind,saturate", [("float8_e4m3fn", 1), ("float8_e4m3fnuz", 0), ("float8_e5m2", 0),
                                           ("float8_e5m2fnuz", 1)])
def test_float8_program_on_the_host(tmp_path, kind, saturate):
    """A program with float8 activations (a quantization and a cast with or without saturation to
    float8 outputs, and their float32 values; tests/float8_models.py) as its cuda kernels for sm_90
    (bytes, codegen/float8.py), on inputs with every special value, ties, subnormals and
    overflows: the values (NaN where NaN, zeros with their sign) the evaluator gives."""
    from float8_models import float8_model, same_values

    from shardflow.compiler import load_onnx

    m, feeds = float8_model(kind, saturate)
    env, consts, groups = _graph_values(load_onnx(m), feeds, views=True)
    src = generate_cuda_source(groups, arch="sm_90")
    assert f"sf_float_to_{kind[7:]}(" in src.text
    host_groups = [g for g in groups if g.name in src.launches]
    _check_kernels(kind, build(src.text, str(tmp_path)), src, host_groups, env, consts, check=same_values)
    assert {n for g in host_groups for n in src.launches[g.name].args} >= {"q", "c", "y"}


def test_transposed_copies_are_tiled_on_the_host(tmp_path):
    """An element-wise kernel that reads a whole tensor transposed (its innermost axis another
    output axis, both at least 16 long) goes through 32 x 32 tiles in shared memory (kind
    ``transpose``), with the rest of its value fused: an NCHW image's channels-last copy with its
    cast to float16 (its ``(h, w)`` one axis of the tile), a 7x7 image's (49 pixels as one axis), a
    Kᵀ copy of bfloat16 values plus a bias read per output element, a 2-D int32 transpose, sizes off
    the tile. Exact against numpy. A short output row keeps the per-element kernel."""
    from test_wgmma import _bits, _value

    from shardflow.compiler.codegen.fusion import fuse
    from shardflow.compiler.ops.elementwise import Binary, CastOp
    from shardflow.compiler.ops.transform import Transpose

    rng = np.random.default_rng(6)
    vals = {"img": rng.standard_normal((2, 40, 3, 18)).astype(np.float32),
            "k": _bits(rng.standard_normal((2, 3, 20, 33)), "bfloat16"),
            "bias": _bits(rng.standard_normal((33, 20)), "bfloat16"),
            "ints": rng.integers(-9, 9, (17, 50)).astype(np.int32), "short": rng.standard_normal((40, 6)),
            "pix": rng.standard_normal((1, 24, 7, 7)).astype(np.float16)}
    types = {"img": "float32", "ints": "int32", "short": "float64", "pix": "float16"}
    t = {k: Tensor(k, v.shape, types.get(k, "bfloat16")) for k, v in vals.items()}
    cast = CastOp([t["img"]], name="half", to="float16")
    copy = Transpose([cast.outputs[0]], name="copy", perm=(0, 2, 3, 1))
    kt = Transpose([t["k"]], name="kt", perm=(0, 1, 3, 2))
    ops = fuse([cast, copy]) + fuse([kt, Binary([kt.outputs[0], t["bias"]], name="kt_bias", fn="add")]) + [
        Transpose([t["ints"]], name="ints_t", perm=(1, 0)), Transpose([t["short"]], name="short_t", perm=(1, 0)),
        Transpose([t["pix"]], name="pix_t", perm=(0, 2, 3, 1))]
    k = _value(vals["k"], "bfloat16")
    wants = {"copy": (vals["img"].astype(np.float16).transpose(0, 2, 3, 1), np.float16),
             "kt_bias": (k.transpose(0, 1, 3, 2) + _value(vals["bias"], "bfloat16"), np.uint16),
             "ints_t": (vals["ints"].T, np.int32), "short_t": (vals["short"].T, np.float64),
             "pix_t": (vals["pix"].transpose(0, 2, 3, 1), np.float16)}
    src = generate_cuda_source(ops, arch="sm_90")
    kernels = build(src.text, str(tmp_path))
    for name, (want, dtype) in wants.items():
        launch = src.launches[name]
        assert launch.kind == ("elementwise" if name == "short_t" else "transpose"), name
        out = run(kernels, launch, [vals[n] for n in launch.args[:launch.num_inputs]], [(want.shape, dtype)])[0]
        if name == "kt_bias":  # (the sum rounded to bfloat16 once, to nearest)
            np.testing.assert_allclose(_value(out, "bfloat16"), want, rtol=2 ** -8, err_msg=name)
            continue
        np.testing.assert_array_equal(out, want.astype(out.dtype), err_msg=name)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_channels_last_convs_take_wgmma_on_the_host(tmp_path, dt):
    """Convs over a channels-last image (RFC 0005 decision 57: 3x3 with padding and a fused bias,
    residual and SiLU, strided, a strided 1x1, dilated, 5x5 with uneven strides and pads, a 1-D
    conv, a 3-D one, a deep one on few pixels whose K is split over 4 blocks: decision 59) take the wgmma
    template with the image as a gathered operand (K ordered taps, then channels; the padding's
    taps copied as zeros), the weight ``[OC, *kernel, C]`` a direct one.
    Against numpy, sizes that are not multiples of the tile."""
    from test_wgmma import _channels_last_convs, _value

    ops, bits, wants = _channels_last_convs(dt)
    src = generate_cuda_source(ops, arch="sm_90")
    kernels = build(src.text, str(tmp_path))
    for name, want in wants.items():
        launch = src.launches[name]
        assert launch.kind == f"gemm-wgmma-{'f16' if dt == 'float16' else 'bf16'}", name
        assert not launch.tensor_maps, name  # (the cp.async tiles: a gathered operand has no tensor map)
        assert launch.grid[1] == (4 if name == "deep" else 1), name  # (split-K: decision 59)
        out = run(kernels, launch, [bits[n] for n in launch.args[:launch.num_inputs]], [(want.shape, np.uint16)])[0]
        got = _value(out.view(np.float16) if dt == "float16" else out, dt)
        err = float(np.max(np.abs(got - want))) / float(np.max(np.abs(want)))
        assert err < (4e-3 if dt == "float16" else 2e-2), (name, err)  # (NaN, an element not written, fails too)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_batched_one_by_one_convs_and_broadcast_products_take_wgmma_on_the_host(tmp_path, dt):
    """A 1x1 convolution over a batch of images reads its pixels ``(n, h, w)`` with no single
    stride; with ``n`` moved into the product's batch (RFC 0005 decision 55) it takes the wgmma
    template, a fused bias, residual and SiLU in its epilogue; a product whose batch broadcasts on
    one side takes it the same way. The convs' pixels are the product's columns (the epilogue
    stores four consecutive ones at once); on one image the conv takes a TMA tile. Against numpy,
    sizes that are not multiples of the tile."""
    from test_wgmma import BATCHED_TILES, _batched_products, _value

    ops, bits, wants = _batched_products(dt)
    src = generate_cuda_source(ops, arch="sm_90", gemm_configs=BATCHED_TILES)
    kernels = build(src.text, str(tmp_path))
    for name, want in wants.items():
        launch = src.launches[name]
        assert launch.kind == f"gemm-wgmma-{'f16' if dt == 'float16' else 'bf16'}", name
        assert launch.grid[2] == (1 if name == "one" else 3) and bool(launch.tensor_maps) == (name == "one"), name
        out = run(kernels, launch, [bits[n] for n in launch.args[:launch.num_inputs]], [(want.shape, np.uint16)],
                  grid=(2, 1, 1) if launch.persistent else None, resident=2 if launch.persistent else 1)[0]
        got = _value(out.view(np.float16) if dt == "float16" else out, dt)
        err = float(np.max(np.abs(got - want))) / float(np.max(np.abs(want)))
        assert err < (4e-3 if dt == "float16" else 2e-2), (name, err)  # (NaN, an element not written, fails too)
