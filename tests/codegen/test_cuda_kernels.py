"""CUDA code generation: every op example lowers and compiles for sm_90; on a GPU every kernel
agrees with the op's numpy implementation.

* Without a GPU (CI): the kernels of every op example of every ops module, plus the larger cases
  below (tensor-core GEMMs at odd sizes, long-row reductions), are generated into ONE translation
  unit and compiled with ``nvcc -arch=sm_90`` (skipped when nvcc is absent).
* ``pytest -m gpu`` (needs cupy and a CUDA device): each kernel runs on the example arrays and is
  compared with ``op.run``: exact for integers and booleans, ``rtol 1e-5`` for float32 outside
  GEMMs, ``rtol 1e-4`` (plus ``1e-5`` of the output's scale) for the default 3xTF32 float32
  GEMMs, ``rtol 1e-2`` (relative to the output's scale) for TF32 (``precision="tf32"``) and fp16.
"""
from __future__ import annotations

import importlib
import pkgutil
import time

import numpy as np
import pytest

import shardflow.compiler.ops as ops_pkg
from shardflow.compiler.codegen import cuda as cg
from shardflow.compiler.codegen.cuda import (CudaCodegenError, KernelLaunch, build_cuda_library,
                                             generate_cuda_source, lowerable)
from shardflow.compiler.codegen.lower import CodegenError
from shardflow.compiler.codegen.toolchain import CompileError
from shardflow.compiler.ir import Tensor, const_tensor
from shardflow.compiler.ops.conv import Conv
from shardflow.compiler.ops.elementwise import Binary, Unary
from shardflow.compiler.ops.linalg import Attention, Einsum, Gemm, MatMul, MatMulNBits
from shardflow.compiler.ops.norm import LayerNorm, RMSNorm
from shardflow.compiler.ops.reduce import ArgReduce, Reduce, Softmax, TopK
from shardflow.runtime.tma import kernel_args


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------

def _extra_cases(rng):
    """Sizes the module examples do not reach: tensor-core GEMMs with sizes that are not multiples
    of the 64x64x32 tile, batched/broadcast/transposed variants, convolution as implicit GEMM,
    and reductions over rows long enough for the warp and block strategies."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    h = lambda *s: rng.standard_normal(s).astype(np.float16)  # noqa: E731
    u8 = lambda *s: rng.integers(0, 256, s).astype(np.uint8)  # noqa: E731
    q = lambda n, b, levels: rng.integers(0, levels, (n, b)).astype(np.float32)  # noqa: E731  (zero points)
    long_rows = f(5, 3001)
    long_rows[1, 17] = np.nan
    ties16 = rng.integers(-2, 3, (6, 37)).astype(np.float16)
    ties16[1, [3, 9]] = np.nan
    return [
        ("gemm", MatMul, [f(37, 53), f(53, 29)], {}),
        ("gemm", MatMul, [f(130, 70), f(70, 67)], {}),
        ("gemm", MatMul, [f(3, 33, 40), f(3, 40, 47)], {}),
        ("gemm", MatMul, [f(2, 1, 20, 24), f(3, 24, 18)], {}),
        ("gemm", Gemm, [f(45, 50), f(70, 45), f(70)], {"trans_a": True, "trans_b": True, "alpha": 0.5,
                                                       "beta": 2.0}),
        ("gemm", Gemm, [f(17, 9), f(9, 100), f(17, 1)], {"alpha": 1.0, "beta": 1.0}),
        ("gemm", Einsum, [f(2, 19, 31), f(2, 31, 23)], {"equation": "bij,bjk->bik"}),
        ("gemm", Einsum, [f(21, 33), f(33), f(33, 18)], {"equation": "ij,j,jk->ik"}),
        ("gemm", Conv, [f(2, 8, 11, 13), f(24, 8, 3, 3), f(24)], {"pads": (1, 1, 1, 1)}),
        ("gemm", Conv, [f(1, 5, 12, 9), f(20, 5, 3, 2)], {"strides": (2, 1), "pads": (1, 0, 1, 1),
                                                          "dilations": (1, 2)}),
        ("gemm", MatMul, [f(3, 515, 40), f(3, 40, 1411)], {}),  # 128x128 tiles
        ("gemm16", MatMul, [h(40, 64), h(64, 36)], {}),
        ("gemm16", MatMul, [h(2, 1000, 24), h(2, 24, 1100)], {}),  # 128x128 tiles
        ("gemm16", MatMul, [h(2, 17, 33), h(2, 33, 45)], {}),
        ("row", Softmax, [f(64, 100)], {"axes": (1,)}),
        ("row", Softmax, [f(4, 3000)], {"axes": (1,)}),
        ("row", Softmax, [f(3, 70, 5)], {"axes": (1,), "log": True}),
        ("row", LayerNorm, [f(8, 777), f(777), f(777)], {"axis": 1, "epsilon": 1e-5, "stash": "float32"}),
        ("row", RMSNorm, [f(3, 5, 600), f(600)], {"axis": 2, "epsilon": 1e-6, "stash": "float32"}),
        ("row", Reduce, [f(3, 5000)], {"kind": "sum", "axes": (1,), "keepdims": False}),
        ("row", Reduce, [f(50, 70)], {"kind": "mean", "axes": (0, 1), "keepdims": False}),
        ("row", Reduce, [f(6, 40, 7)], {"kind": "max", "axes": (1,), "keepdims": True}),
        ("row", Reduce, [f(4100, 40)], {"kind": "sum", "axes": (1,), "keepdims": True}),  # warp per row
        ("elementwise", Reduce, [f(40, 4100)], {"kind": "sum", "axes": (0,), "keepdims": False}),  # column sums
        ("row", ArgReduce, [long_rows], {"kind": "argmax", "axis": 1, "keepdims": False}),
        ("row", ArgReduce, [long_rows], {"kind": "argmin", "axis": 1, "keepdims": True}),
        # (V 12 wide: not the fused kernel, whose head sizes are multiples of 8)
        ("row", Attention, [f(1, 2, 17, 16), f(1, 2, 19, 16), f(1, 2, 19, 12)], {"scale_sqrt": 0.5}),
        ("elementwise", Binary, [f(1000, 37), f(37)], {"fn": "add"}),
        ("elementwise", Unary, [h(33, 65)], {"fn": "tanh"}),
        # fewer than 16 rows (cuda_gemv.py): B read along N (a [K, N] weight) or along K, odd sizes
        ("gemv", MatMul, [f(1, 300), f(300, 70)], {}),
        ("gemv", MatMul, [f(5, 3, 64), f(64, 45)], {}),  # 15 rows
        ("gemv", Gemm, [f(4, 100), f(50, 100), f(50)], {"trans_b": True, "alpha": 0.5, "beta": 2.0}),
        ("gemv", MatMul, [f(3, 1, 40), f(3, 40, 33)], {}),  # batched
        ("gemv", Einsum, [f(2, 4, 1, 16), f(2, 4, 37, 16)], {"equation": "bhqd,bhkd->bhqk"}),  # a decoding step's scores
        ("gemv", Einsum, [f(40, 33), f(33)], {"equation": "ij,j->i"}),  # a vector read by every output
        ("gemv", MatMul, [h(2, 64), h(64, 40)], {}),
        ("gemv", MatMulNBits, [f(3, 100), u8(37, 4, 16), f(37, 4), q(37, 4, 16)], {"bits": 4, "block_size": 32}),
        ("gemv", MatMulNBits, [f(1, 2, 130), u8(20, 3, 32), f(20, 3)], {"bits": 4, "block_size": 64}),
        ("gemv", MatMulNBits, [f(7, 48), u8(33, 3, 4), f(33, 3), q(33, 3, 4)], {"bits": 2, "block_size": 16}),
        ("gemv", MatMulNBits, [f(2, 40), u8(17, 2, 32), f(17, 2), q(17, 2, 256)], {"bits": 8, "block_size": 32}),
        # (K a multiple of 8 and at least 256: a lane takes runs of 8 consecutive elements of K)
        ("gemv", MatMulNBits, [f(2, 512), u8(24, 16, 16), f(24, 16), q(24, 16, 16)], {"bits": 4, "block_size": 32}),
        # (4-bit codes, K a multiple of 8: read a word at a time; the default zero point; K past the last whole block)
        ("gemv", MatMulNBits, [f(3, 256), u8(40, 8, 16), f(40, 8)], {"bits": 4, "block_size": 32}),
        ("gemv", MatMulNBits, [f(1, 72), u8(20, 3, 16), f(20, 3), q(20, 3, 16)], {"bits": 4, "block_size": 32}),
        ("gemv", MatMulNBits, [f(2, 64), u8(18, 2, 16), f(18, 2), f(18, 2) + 7], {"bits": 4, "block_size": 32}),  # (float zp)
        ("gemv", MatMulNBits, [f(3, 256), u8(20, 8, 32), f(20, 8)], {"bits": 8, "block_size": 32}),
        ("gemv", MatMulNBits, [f(2, 512), u8(17, 16, 8), f(17, 16), f(17, 16) + 1], {"bits": 2, "block_size": 32}),
        ("gemv", Gemm, [f(3, 264), f(20, 264)], {"trans_b": True}),
        # TopK (cuda_topk.py): ties and NaNs in halves, a middle axis, k = n, int64 values with ties, a row
        # longer than the shared-memory copy (read k times), an empty shard
        ("topk", TopK, [ties16], {"k": 5, "axis": 1, "largest": True}),
        ("topk", TopK, [ties16], {"k": 6, "axis": 1, "largest": False}),
        ("topk", TopK, [f(3, 40, 5)], {"k": 40, "axis": 1, "largest": True}),
        ("topk", TopK, [rng.integers(-3, 4, (7, 300)).astype(np.int64)], {"k": 9, "axis": 1, "largest": False}),
        ("topk", TopK, [f(2, 5000)], {"k": 7, "axis": 1, "largest": True}),
        ("topk", TopK, [f(0, 9)], {"k": 3, "axis": 1, "largest": True}),
        # unsigned keys past the signed range (-3 wrapped: read as signed they would sort first or last),
        # small integers widened to int
        ("topk", TopK, [rng.integers(-3, 4, (5, 70)).astype(np.uint64)], {"k": 6, "axis": 1, "largest": True}),
        ("topk", TopK, [rng.integers(-3, 4, (70, 5)).astype(np.uint32)], {"k": 4, "axis": 0, "largest": False}),
        ("topk", TopK, [rng.integers(-3, 4, (4, 50)).astype(np.uint8)], {"k": 5, "axis": 1, "largest": False}),
        ("topk", TopK, [rng.integers(-3, 4, (4, 50)).astype(np.int8)], {"k": 5, "axis": 1, "largest": True}),
        ("topk", TopK, [rng.integers(-3, 4, (4, 50)).astype(np.int16)], {"k": 5, "axis": 1, "largest": False}),
        ("topk", TopK, [rng.integers(-3, 4, (4, 50)).astype(np.uint16)], {"k": 5, "axis": 1, "largest": True}),
    ]


def _cases():
    """``(case id, op, arrays, expected kind or None)`` for every example and extra case."""
    res = []
    rng = np.random.default_rng(0)
    for m in pkgutil.iter_modules(ops_pkg.__path__):
        mod = importlib.import_module(f"{ops_pkg.__name__}.{m.name}")
        if not hasattr(mod, "examples"):
            continue
        for k, (cls, arrays, attrs) in enumerate(mod.examples(rng)):
            name = f"{m.name}.{cls.op_type}.{k}"
            op = cls([const_tensor(a) for a in arrays], name=name, **attrs)
            res.append((name, op, arrays, None))
    for k, (kind, cls, arrays, attrs) in enumerate(_extra_cases(np.random.default_rng(1))):
        name = f"extra.{cls.op_type}.{k}"
        op = cls([const_tensor(a) for a in arrays], name=name, **attrs)
        res.append((name, op, arrays, kind))
    return res


CASES = _cases()
LOWERED = [c for c in CASES if lowerable(c[1])]
_KIND = {"gemm": "gemm-f32", "gemm16": "gemm-f16"}


# ----------------------------------------------------------------------------------------------
# generation (no compiler needed)
# ----------------------------------------------------------------------------------------------

def test_every_example_lowers_and_kinds_are_as_planned():
    src = generate_cuda_source([c[1] for c in CASES])
    assert set(src.launches) == {c[0] for c in LOWERED}
    assert all(c[1].task.is_extern for c in CASES if c[0] not in src.launches)  # (TopK has a kernel)
    for name, op, arrays, kind in LOWERED:
        launch = src.launches[name]
        assert launch.args == tuple(t.name for t in op.inputs) + tuple(t.name for t in op.outputs)
        assert launch.num_inputs == len(op.inputs)
        if kind is not None:
            assert launch.kind.split("+")[0] == _KIND.get(kind, kind), (name, launch.kind)
        if launch.kind.startswith("gemm") or launch.kind.startswith("attention"):
            assert launch.block in ((128, 1, 1), (256, 1, 1))
        else:
            assert launch.block == (256, 1, 1)
        assert f'extern "C" __global__ void __launch_bounds__({launch.block[0]}) {launch.symbol}(' in src.text


def test_both_gemm_tiles_are_exercised():
    src = generate_cuda_source([c[1] for c in LOWERED if c[3] in ("gemm", "gemm16")])
    blocks = {(l.kind, l.block[0]) for l in src.launches.values()}
    assert blocks == {("gemm-f32", 128), ("gemm-f32", 256), ("gemm-f16", 128), ("gemm-f16", 256)}
    tf32 = generate_cuda_source([c[1] for c in LOWERED if c[3] == "gemm"], precision="tf32")
    assert {l.kind for l in tf32.launches.values()} == {"gemm-tf32"}
    assert "__float_to_tf32(sf_x - sf_h)" in src.text and "__float_to_tf32(sf_x - sf_h)" not in tf32.text
    with pytest.raises(CudaCodegenError, match="precision 'fp8'"):
        generate_cuda_source([c[1] for c in LOWERED if c[3] == "gemm"], precision="fp8")


def test_identical_ops_share_one_kernel():
    f = lambda *s: const_tensor(np.zeros(s, np.float32))  # noqa: E731
    ops = [MatMul([f(40, 32), f(32, 48)], name="layer0"), MatMul([f(40, 32), f(32, 48)], name="layer1"),
           MatMul([f(40, 32), f(32, 49)], name="other"), Unary([f(3)], name="neg0", fn="neg"),
           Unary([f(3)], name="neg1", fn="neg")]
    src = generate_cuda_source(ops)
    sym = {n: l.symbol for n, l in src.launches.items()}
    assert sym["layer0"] == sym["layer1"] != sym["other"]
    assert sym["neg0"] == sym["neg1"]
    assert src.text.count("__global__") == 3
    assert src.launches["layer1"].args == tuple(t.name for t in ops[1].inputs + ops[1].outputs)


def test_index_arithmetic_on_non_negative_values_is_unsigned():
    """A low-bit code's byte and bit position (``(k % 32) / 2``, ``(k % 2) * 4``) are divisions of
    values known to be non-negative: plain unsigned division and shifts, not numpy's floor-division
    helpers; a division of a tensor's (possibly negative) values keeps them."""
    i32 = Tensor("i", (40,), "int32")
    bq = Tensor("bq", (33, 4, 16), "uint8")
    src = generate_cuda_source([MatMulNBits([Tensor("a", (2, 128), "float32"), bq, Tensor("s", (33, 4), "float32")],
                                            name="nb", bits=4, block_size=32),
                                Binary([i32, const_tensor(np.array(3, np.int32))], name="fd", fn="floordiv")])
    nb, fd = src.text.split("// node nb")[1].split("// node fd")
    assert "(unsigned)" in nb and not any(h in nb for h in ("sf_floordiv", "sf_mod", "sf_shr"))
    assert "sf_floordiv<int>" in fd


def test_scalar_weights_are_written_as_literals():
    """A one-element constant input (GPT-2's GELU: ``Pow(x, w)`` with ``w = 3`` a weight, and its
    scale factors) is not read by the kernel: its value is a literal, and the cube is a product
    (not ``pow``'s general path behind a test per element). A scalar read from an activation
    keeps its read."""
    from shardflow.compiler.codegen.fusion import fuse
    from shardflow.compiler.ir.graph import FlowGraph

    x, y = Tensor("x", (64, 96), "float32"), Tensor("y", (1,), "float32")
    cube = Binary([x, const_tensor(np.array([3.0], np.float32))], name="cube", fn="pow")
    scaled = Binary([cube.outputs[0], const_tensor(np.float32(0.044715))], name="scaled", fn="mul")
    out = Binary([scaled.outputs[0], y], name="out", fn="add")
    g = FlowGraph([x, y], out.outputs)
    (group,) = fuse(list(g.nodes), keep=g.output_names)
    src = generate_cuda_source([group]).text
    body = src[src.index('extern "C" __global__'):]
    assert "sf_fpow(" not in body and "pow(" not in body
    assert "0.044714998453855515f" in body
    assert body.count("in2[") == 0 and body.count("in1[") == 0  # the two weights: inputs 1 and 2
    assert "in3[" in body  # the activation y


def test_source_is_deterministic():
    ops = [c[1] for c in CASES[:40]] + [c[1] for c in CASES if c[0].startswith("extra.")]
    assert generate_cuda_source(ops).text == generate_cuda_source(ops).text


def test_softmax_hoists_its_reductions():
    """Softmax over 3000 columns: one block per row computes max and sum once (no O(n^2) loop)."""
    op = next(c[1] for c in CASES if c[0].startswith("extra.Softmax") and c[1].inputs[0].shape == (4, 3000))
    src = generate_cuda_source([op])
    body = src.text[src.text.index(src.launches[op.name].symbol):]
    assert body.count("__shfl_xor_sync") == 2  # one block reduction for the max, one for the sum
    assert "< 3000; ++" not in body  # no serial loop over the row inside the element loop
    assert src.launches[op.name].grid == (4, 1, 1)


def test_attention_hoists_softmax_statistics_per_query_row():
    op = next(c[1] for c in CASES if c[0].startswith("extra.Attention"))
    src = generate_cuda_source([op])
    launch = src.launches[op.name]
    assert launch.kind == "row"
    body = src.text[src.text.index(launch.symbol):]
    assert "row" in body and body.count("__shfl_xor_sync") == 2  # max and sum over the keys, once per row


def test_half_results_are_stored_from_the_float_they_round():
    """A float16/bfloat16 op's value is a float rounded to that type (``sf_rh``/``sf_rb``); its store
    rounds the float itself (the same value) instead of converting the rounded one back and again:
    LayerNorm in half, an addition of halves, a GELU epilogue's last product."""
    import re

    for dt, fn, conv in (("float16", "sf_rh", "__float2half_rn"), ("bfloat16", "sf_rb", "__float2bfloat16_rn")):
        x, g, b = Tensor("x", (8, 64), dt), Tensor("g", (64,), dt), Tensor("b", (64,), dt)
        srcs = [cg.generate_cuda_source([LayerNorm([x, g, b], name="ln", axis=1, epsilon=1e-5, stash="float32")]).text,
                cg.generate_cuda_source([Binary([x, x], name="add", fn="add")]).text]
        for text in srcs:
            defs = dict(re.findall(r"const float (v\d+) = ([^;]*);", text))
            stored = re.findall(rf"{conv}\((v\d+)\)", text)
            assert stored and all(not defs.get(v, "").startswith(fn + "(") for v in stored), text[-800:]
    assert cg._rounded_arg("sf_rh(a) * sf_rh(b)", "sf_rh") is None and cg._rounded_arg("sf_rh((a * b))", "sf_rh")


def test_launch_round_trips_through_json():
    import json
    src = generate_cuda_source([c[1] for c in LOWERED[:5]])
    for launch in src.launches.values():
        assert KernelLaunch.from_dict(json.loads(json.dumps(launch.to_dict()))) == launch


def test_unsupported_dtype_is_a_clear_error():
    op = Unary([const_tensor(np.zeros((2, 2), np.complex64))], name="cplx", fn="neg")
    with pytest.raises(CudaCodegenError, match="cplx") as info:
        generate_cuda_source([op])
    assert isinstance(info.value, CodegenError)


def test_duplicate_op_names_are_refused():
    x = const_tensor(np.zeros((2, 2), np.float32))
    ops = [Unary([x], name="same", fn="neg"), Unary([x], name="same", fn="abs")]
    with pytest.raises(CudaCodegenError, match="same"):
        generate_cuda_source(ops)


def test_collectives_are_excluded():
    from shardflow.compiler.parallel.comm_ops import AllReduce
    x = const_tensor(np.zeros((4,), np.float32))
    ar = AllReduce([x], name="ar", mesh_axis=0, group_size=2, group_index=0, op="sum")
    neg = Unary([x], name="neg", fn="neg")
    src = generate_cuda_source([ar, neg])
    assert set(src.launches) == {"neg"}


def test_bad_arch_is_refused(tmp_path):
    x = const_tensor(np.zeros((4,), np.float32))
    with pytest.raises(CudaCodegenError, match="arch"):
        build_cuda_library([Unary([x], name="neg", fn="neg")], str(tmp_path / "k.cubin"), arch="gfx90a",
                           cache_dir=str(tmp_path / "cache"))


# ----------------------------------------------------------------------------------------------
# compilation with nvcc (no GPU needed)
# ----------------------------------------------------------------------------------------------

needs_nvcc = pytest.mark.skipif(cg._find_nvcc() is None, reason="nvcc is not installed")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """All cases compiled once into one cubin (a fresh cache, so nvcc really runs)."""
    if cg._find_nvcc() is None and not _have_cupy():
        pytest.skip("no CUDA compiler (nvcc or cupy's NVRTC)")
    d = tmp_path_factory.mktemp("cuda")
    path = str(d / "kernels.cubin")
    t0 = time.perf_counter()
    launches = build_cuda_library([c[1] for c in CASES], path, arch="sm_90", cache_dir=str(d / "cache"))
    return {"path": path, "launches": launches, "seconds": time.perf_counter() - t0, "cache": str(d / "cache")}


@needs_nvcc
def test_every_kernel_compiles_for_sm90(library):
    data = open(library["path"], "rb").read()
    assert data[:4] == b"\x7fELF"  # a cubin is an ELF image
    assert set(library["launches"]) == {c[0] for c in LOWERED}
    for launch in library["launches"].values():
        assert launch.symbol.encode() in data


@needs_nvcc
def test_second_build_hits_the_cache(library, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the compiler ran although the kernels are cached")

    monkeypatch.setattr(cg, "_compile_nvcc", boom)
    out = str(tmp_path / "again.cubin")
    launches = build_cuda_library([c[1] for c in CASES], out, arch="sm_90", cache_dir=library["cache"])
    assert launches == library["launches"]
    assert open(out, "rb").read() == open(library["path"], "rb").read()


@needs_nvcc
def test_compiler_errors_name_the_op(tmp_path, monkeypatch):
    x = const_tensor(np.zeros((4,), np.float32))
    ops = [Unary([x], name="fine", fn="neg"), Unary([x], name="broken", fn="abs")]
    real = cg._lower_op

    def bad(op, symbol, *args):
        src, launch, wrapper = real(op, symbol, *args)
        if op.name == "broken":
            src = src.replace("{", "{ this is not C++;", 1)
        return src, launch, wrapper

    monkeypatch.setattr(cg, "_lower_op", bad)
    with pytest.raises(CompileError, match="broken") as info:
        build_cuda_library(ops, str(tmp_path / "k.cubin"), arch="sm_90", cache_dir=str(tmp_path / "c"))
    assert info.value.ops == ["broken"]
    assert isinstance(info.value, CodegenError)
    assert not (tmp_path / "k.cubin").exists()


def _rank_units(pdl=False):
    """Two ranks' units for sm_90 that share a kernel, differ in others, and each need the same
    helpers: float16 and bfloat16 products on the wgmma template (instruction wrappers), float32
    ones on it (the 3xTF32 split) and fused attentions."""
    def mm(name, M, N, K, dt):  # (float32 ones take the template with both operands K-major)
        if dt == "float32":
            return Gemm([Tensor(f"{name}_a", (M, K), dt), Tensor(f"{name}_b", (N, K), dt)], name=name, trans_b=True)
        return MatMul([Tensor(f"{name}_a", (M, K), dt), Tensor(f"{name}_b", (K, N), dt)], name=name)

    # (the examples on half operands, which the fused kernel takes; picked by attributes, not by their
    # place in the list of examples, which moves when an op module gains one)
    att = [c[1] for c in LOWERED if c[0].startswith("linalg.Attention.") and c[1].attrs.get("probs_dtype") == "float16"
           and c[1].inputs[0].dtype == "float16"]
    assert len(att) == 2, [op.name for op in att]
    a = [mm("qkv", 256, 384, 512, "float16"), att[0], mm("f32", 128, 64, 64, "float32")]
    b = [mm("qkv", 256, 384, 512, "float16"), mm("bf", 128, 128, 64, "bfloat16"), att[1],
         mm("f32", 128, 128, 64, "float32")]
    return [cg.generate_cuda_source(ops, arch="sm_90", wgmma_fp32=True, pdl=pdl) for ops in (a, b)]


def test_ranks_units_merge_into_one_with_each_kernel_and_helper_once():
    """The driver compiles the ranks' units as one (compile_cuda_sources): a kernel of several
    ranks is written once (its symbol is a digest of its text), every helper once, before the
    first kernel that needs it; an op of one name with different kernels keeps both."""
    a, b = _rank_units()
    assert a.launches["qkv"].symbol == b.launches["qkv"].symbol  # the same code, the same symbol
    assert a.launches["f32"].symbol != b.launches["f32"].symbol  # (the same name, other shapes)
    m = cg.CudaSource.merge([a, b])
    symbols = {k.symbol for k in m.kernels}
    assert symbols == {launch.symbol for s in (a, b) for launch in s.launches.values()} and len(symbols) == 6
    for sym in symbols:
        assert m.text.count(f" {sym}(") == 1, sym
    for key in ("split", "attention"):
        assert any(key in k.needs for k in a.kernels) and any(key in k.needs for k in b.kernels), key
        assert m.text.count(cg._helper_text(key)) == 1, key
    wrappers = {k.wrapper for k in m.kernels if k.wrapper is not None}
    assert len(wrappers) >= 2  # (the float16 product's and the bfloat16 one's)
    common = cg.wgmma_helpers(set(), common=True)
    assert m.text.count(common) == 1 and m.text.index(common) < m.text.index(cg.wgmma_helpers(wrappers, False)[:200])
    for w in wrappers:
        assert m.text.count(cg.wgmma_helpers({w}, common=False)) == 1
    # each op's lines: the kernel of its first unit, the other's under the op and its symbol
    first, last = m.lines["f32"]
    assert a.launches["f32"].symbol in "".join(m.text.splitlines(True)[first - 1:last])
    assert f"f32 ({b.launches['f32'].symbol})" in m.lines
    assert cg.CudaSource.merge([a]) is a
    pdl, _ = _rank_units(pdl=True)
    with pytest.raises(ValueError, match="different headers"):
        cg.CudaSource.merge([a, pdl])
    with pytest.raises(ValueError, match="different architectures"):
        cg.compile_cuda_sources([a, cg.generate_cuda_source([c[1] for c in LOWERED[:2]], arch="sm_80")], "never")


@needs_nvcc
def test_merged_units_compile_once_into_a_cubin_with_every_symbol(tmp_path, monkeypatch):
    a, b = _rank_units()
    runs = []
    real = cg._compile_nvcc
    monkeypatch.setattr(cg, "_compile_nvcc", lambda *args: runs.append(args) or real(*args))
    path = tmp_path / "k.cubin"
    assert not cg.compile_cuda_sources([a, b], str(path), cache_dir=str(tmp_path / "c"))
    assert len(runs) == 1 and runs[0][2] == "sm_90a"
    data = path.read_bytes()
    for s in (a, b):
        for launch in s.launches.values():
            assert launch.symbol.encode() in data


# ----------------------------------------------------------------------------------------------
# GPU: run every kernel and compare with numpy
# ----------------------------------------------------------------------------------------------

def _have_cupy() -> bool:
    import importlib.util
    return importlib.util.find_spec("cupy") is not None


def _have_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.fixture(scope="module")
def gpu_module(library):
    if not _have_gpu():
        pytest.skip("no CUDA device (or cupy is not installed)")
    import cupy
    return cupy.RawModule(path=library["path"])


def _run(module, launch: KernelLaunch, op, arrays):
    import cupy
    from shardflow.runtime.artifact import buffer_dtype

    ins = [cupy.asarray(np.ascontiguousarray(a)) for a in arrays]
    outs = [cupy.empty(t.shape, buffer_dtype(t.dtype, device=True)) for t in op.outputs]  # (float8: bytes)
    for o in outs:  # poison the outputs so that an element the kernel misses cannot pass
        if o.size:
            o.reshape(-1).view(cupy.uint8).fill(0x5A)
    fn = module.get_function(launch.symbol)
    if launch.shared_mem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = launch.shared_mem
    fn(launch.grid, launch.block, kernel_args(launch.tensor_maps, ins + outs), shared_mem=launch.shared_mem)
    cupy.cuda.runtime.deviceSynchronize()
    return [cupy.asnumpy(o).view(buffer_dtype(t.dtype)) for o, t in zip(outs, op.outputs)]


def _check(name, kind, got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    if want.dtype.name == "bfloat16":  # (ml_dtypes', kind "V"): the kernel and the evaluator may
        # round differently once (a fused kernel keeps its intermediates in float32)
        w = want.astype(np.float32)
        scale = float(np.max(np.abs(w[np.isfinite(w)]), initial=1.0))
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2.0 ** -7,
                                   atol=2.0 ** -8 * scale, equal_nan=True, err_msg=name)
        return
    if want.dtype.kind != "f":
        np.testing.assert_array_equal(got, want, err_msg=name)
        return
    finite = np.isfinite(want)
    scale = float(np.max(np.abs(want[finite]))) if finite.any() else 1.0
    if kind in ("gemm-f32", "gemm-wgmma-f32", "attention-f32"):  # 3xTF32: fp32-level (sums in another order)
        rtol, atol = 1e-4, 1e-5 * max(scale, 1.0)
    elif kind.startswith("gemm") or kind.startswith("attention"):  # (attention: probabilities rounded once more)
        rtol, atol = 1e-2, 1e-2 * max(scale, 1.0)
    elif want.dtype == np.float16:
        rtol, atol = 2e-3, 1e-3
    else:
        rtol, atol = 1e-5, 1e-6 * max(scale, 1.0)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol,
                               equal_nan=True, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("case", LOWERED, ids=[c[0] for c in LOWERED])
def test_kernel_matches_numpy(gpu_module, library, case):
    name, op, arrays, _ = case
    launch = library["launches"][name]
    with np.errstate(all="ignore"):
        want = op.run(*arrays)
    got = _run(gpu_module, launch, op, arrays)
    for g, w in zip(got, want):
        _check(name, launch.kind, g, w)


@pytest.mark.gpu
def test_tf32_precision_gemms(tmp_path):
    """``precision="tf32"``: one TF32 product per step, within TF32's tolerance; the default 3xTF32
    kernels of the same cases are at least 10x closer to the float64 product."""
    if not _have_gpu():
        pytest.skip("no CUDA device (or cupy is not installed)")
    import cupy
    picked = [c for c in LOWERED if c[3] == "gemm"]
    errs = {}
    for prec in ("tf32", "float32"):
        path = str(tmp_path / f"{prec}.cubin")
        launches = build_cuda_library([c[1] for c in picked], path, arch="sm_90", cache_dir=str(tmp_path / "c"),
                                      precision=prec)
        module = cupy.RawModule(path=path)
        worst = 0.0
        for name, op, arrays, _ in picked:
            want = op.run(*[a.astype(np.float64) for a in arrays])[0]
            got = _run(module, launches[name], op, arrays)[0]
            _check(name, launches[name].kind, got.astype(np.float32), want.astype(np.float32))
            worst = max(worst, float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0)))
        errs[prec] = worst
    assert errs["float32"] * 10 < errs["tf32"], errs


@pytest.mark.gpu
def test_nvrtc_fallback_builds_runnable_kernels(tmp_path):
    if not _have_gpu():
        pytest.skip("no CUDA device (or cupy is not installed)")
    import cupy
    by_kind = {}
    for c in LOWERED:  # an elementwise op, a TF32 and an fp16 GEMM, a block-per-row softmax
        key = c[3] or ("elementwise" if c[0].startswith("elementwise.Unary") else None)
        if key in ("elementwise", "gemm", "gemm16") or (key == "row" and c[1].op_type == "Softmax"
                                                        and c[1].inputs[0].shape == (4, 3000)):
            by_kind.setdefault(key, c)
    picked = list(by_kind.values())
    assert len(picked) == 4
    path = str(tmp_path / "nvrtc.cubin")
    launches = build_cuda_library([c[1] for c in picked], path, arch="sm_90", cache_dir=str(tmp_path / "c"),
                                  compiler="nvrtc")
    module = cupy.RawModule(path=path)
    for name, op, arrays, _ in picked:
        with np.errstate(all="ignore"):
            want = op.run(*arrays)
        for g, w in zip(_run(module, launches[name], op, arrays), want):
            _check(name, launches[name].kind, g, w)


def _bf16_bits(x) -> np.ndarray:
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _from_bf16_bits(b) -> np.ndarray:
    return (np.asarray(b).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.gpu
def test_bfloat16_kernels(tmp_path):
    """bfloat16 tensors (numpy has none: passed as their 16-bit patterns): a bf16 tensor-core GEMM
    and an elementwise op rounding to bf16."""
    if not _have_gpu():
        pytest.skip("no CUDA device (or cupy is not installed)")
    import cupy
    rng = np.random.default_rng(3)
    a = _from_bf16_bits(_bf16_bits(rng.standard_normal((70, 40))))  # values exact in bf16
    b = _from_bf16_bits(_bf16_bits(rng.standard_normal((40, 90))))
    ta, tb = Tensor("a", a.shape, "bfloat16"), Tensor("b", b.shape, "bfloat16")
    ops = [MatMul([ta, tb], name="mm"), Unary([ta], name="ex", fn="exp")]
    path = str(tmp_path / "bf16.cubin")
    launches = build_cuda_library(ops, path, arch="sm_90", cache_dir=str(tmp_path / "c"))
    assert launches["mm"].kind == "gemm-bf16"
    module = cupy.RawModule(path=path)
    for name, ins, want, rtol in (("mm", [a, b], a.astype(np.float64) @ b, None), ("ex", [a], np.exp(a), 8e-3)):
        launch = launches[name]
        out = cupy.zeros(want.shape, cupy.uint16)
        args = tuple(cupy.asarray(_bf16_bits(x)) for x in ins) + (out,)
        module.get_function(launch.symbol)(launch.grid, launch.block, args)
        got = _from_bf16_bits(cupy.asnumpy(out))
        if rtol is None:  # bf16 output of an fp32-accumulated product
            np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
        else:
            np.testing.assert_allclose(got, want, rtol=rtol)


@needs_nvcc
def test_float8_kernels_compile_for_sm90(tmp_path):
    """The float8 conversions (codegen/float8.py) in real CUDA: the float8 test model of every
    type, fused as the driver fuses it, through nvcc for sm_90 (the host emulation runs the same
    source: test_cuda_host.py's float8 test)."""
    from float8_models import float8_model

    from shardflow.compiler import load_onnx

    ops = []
    for kind in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"):
        g = load_onnx(float8_model(kind, 1)[0])
        for op in g.nodes:
            op.name = f"{kind}/{op.name}"
        ops += list(g.nodes)
    path = str(tmp_path / "k.cubin")
    launches = build_cuda_library(ops, path, arch="sm_90", cache_dir=str(tmp_path / "cache"), fuse=True,
                                  keep=["q", "c", "y"])
    data = open(path, "rb").read()
    symbols = [launch.symbol for launch in launches.values() if launch is not None]
    assert data[:4] == b"\x7fELF" and len(symbols) == 12  # (a quantization, a cast, the float32 sum: per type)
    assert all(sym.encode() in data for sym in symbols)
