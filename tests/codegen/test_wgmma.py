"""The Hopper wgmma GEMM template (compiler/codegen/cuda_wgmma.py).

Without a GPU: which products take it (dense float16/bfloat16 operands on sm_90), that every tile
configuration and operand layout compiles for sm_90a with no local memory, and the operand
analysis. ``pytest -m gpu``: every configuration × dtype × operand layout against numpy, at sizes
that are not multiples of the tiles, batched and with a fused epilogue.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess

import numpy as np
import pytest

from shardflow.compiler.codegen.cuda import KernelLaunch, build_cuda_library, compile_arch, generate_cuda_source
from shardflow.compiler.codegen.cuda_wgmma import (_KMAJOR_B_FALLBACK, CLUSTER_SIZE, WGMMA_CONFIGS, choose_wgmma_config,
                                                   split_count, stream_k_blocks, tile_rows)
from shardflow.compiler.codegen.fusion import fuse
from shardflow.compiler.codegen.lower import CodegenError
from shardflow.compiler.ir import Tensor
from shardflow.compiler.ops.elementwise import Binary, CastOp, Unary
from shardflow.compiler.ops.linalg import Einsum, Gemm, MatMul
from shardflow.compiler.ops.transform import Transpose
from shardflow.runtime.tma import kernel_args

needs_nvcc = pytest.mark.skipif(not __import__("shutil").which("nvcc"), reason="nvcc not installed")
#: the tiles that have run on a GPU; the ping-pong and stream-K ones have their own GPU tests
#: (test_pingpong_*, test_stream_k_*), which benchmarks/gpu/device_session.sh runs apart, under
#: their own time limit, until they have (a wrong hand-over or flag would hang, not fail)
PINGPONG = [c for c, v in WGMMA_CONFIGS.items() if v[3] == "pp"]
STREAM_K = [c for c, v in WGMMA_CONFIGS.items() if v[3] == "sk"]
CLUSTER = [c for c, v in WGMMA_CONFIGS.items() if v[3].startswith("ck")]  # (not run on a GPU yet either)
MULTICAST = [c for c, v in WGMMA_CONFIGS.items() if v[3] == "mc"]  # (nor these)
KMAJOR_B = [c for c, v in WGMMA_CONFIGS.items() if v[1] % 64]  # column counts for a B stored [N, K] only
MEASURED = [c for c in WGMMA_CONFIGS if c not in PINGPONG + STREAM_K + CLUSTER + MULTICAST + KMAJOR_B]
LAYOUTS = list(itertools.product((False, True), (False, True)))  # (trans_a, trans_b)


def _gemm(M, N, K, dt, ta=False, tb=False, name="g"):
    a = Tensor(f"{name}_a", (K, M) if ta else (M, K), dt)
    b = Tensor(f"{name}_b", (N, K) if tb else (K, N), dt)
    return Gemm([a, b], name=name, trans_a=ta, trans_b=tb)


def test_dense_half_operands_take_wgmma_on_hopper_only():
    mm = MatMul([Tensor("a", (256, 512), "float16"), Tensor("b", (512, 384), "float16")], name="mm")
    src = generate_cuda_source([mm], arch="sm_90")
    launch = src.launches["mm"]
    assert launch.kind == "gemm-wgmma-f16" and launch.shared_mem > 48 * 1024
    assert "wgmma.mma_async.sync.aligned.m64n" in src.text and compile_arch("sm_90", src) == "sm_90a"
    old = generate_cuda_source([mm], arch="sm_80")
    assert old.launches["mm"].kind == "gemm-f16" and compile_arch("sm_80", old) == "sm_80"
    # a row length that breaks 16-byte alignment, float32, and a cast operand keep the wmma template
    odd = MatMul([Tensor("a2", (64, 100), "float16"), Tensor("b2", (100, 36), "float16")], name="odd")
    f32 = MatMul([Tensor("a3", (64, 64), "float32"), Tensor("b3", (64, 64), "float32")], name="f32")
    kinds = {k: v.kind for k, v in generate_cuda_source([odd, f32], arch="sm_90").launches.items()}
    assert kinds == {"odd": "gemm-f16", "f32": "gemm-f32"}


def test_configs_follow_the_grid_and_can_be_forced():
    assert choose_wgmma_config(8192, 4096, 1) == "tma128x256"
    # the ping-pong and stream-K tiles are chosen only by name until a GPU run has measured them
    assert not any(choose_wgmma_config(m, n, 1, K=k).startswith(("pp", "sk", "ck", "mc")) for m in (128, 1024, 8192)
                   for n in (768, 3072) for k in (768, 3072))
    assert choose_wgmma_config(8192, 4096, 2) == "128x256"  # batched: no TMA tile
    assert choose_wgmma_config(128, 768, 1) == "64x64"
    # nor the tiles for a K-major B (not measured yet)
    assert not any(WGMMA_CONFIGS[choose_wgmma_config(m, n, 1, K=k)][1] % 64 for m in (128, 1024, 8192)
                   for n in (768, 2304, 3072) for k in (768, 3072))
    g = _gemm(512, 512, 256, "float16")  # (4 K tiles: one for each block of a 4-block split-K cluster)
    for name in WGMMA_CONFIGS:
        # (B is [K, N] here: a tile for a K-major B takes its 64-multiple neighbour)
        wg, bn, _, mode = WGMMA_CONFIGS[_KMAJOR_B_FALLBACK.get(name, name)]
        launch = generate_cuda_source([g], arch="sm_90", gemm_configs={"g": name}).launches["g"]
        assert launch.block == (128 * (wg + (mode != "cp")), 1, 1)
        tiles = -(-512 // tile_rows(name)) * -(-512 // bn)  # pp: a 64-row tile per warpgroup
        units = -(-tiles * 4 // 8) if mode == "sk" else tiles  # stream-K: a block per 8 K tiles (of 4 per tile)
        cluster = CLUSTER_SIZE.get(mode, 1)
        units *= cluster if mode.startswith("ck") else 1  # cluster split-K: a block per part of a tile's K tiles
        top = 128 if cluster == 4 else 132  # (clusters of four: at most 128 blocks)
        assert launch.grid[0] == (tiles if mode == "cp" else min(units, top))  # tma, pp, sk, ck, mc: persistent
        assert bool(launch.tensor_maps) == (mode != "cp")
        assert launch.cluster == cluster and launch.grid[0] % cluster == 0
    with pytest.raises(CodegenError, match="wgmma GEMM config 'huge'"):
        generate_cuda_source([g], arch="sm_90", gemm_configs={"g": "huge"})


def test_kernels_are_sized_for_the_target_multiprocessors():
    """``sms`` (``optimization_config["sm_count"]``): the default tile is the chooser's for that
    count, persistent grids and K splits fit it, more than 132 is 132 on sm_90 (no Hopper GPU has
    more: the stream-K workspace's slots), and the portable template's tile follows it too."""
    from shardflow.compiler.codegen.cuda_templates import choose_gemm_config

    assert choose_wgmma_config(1024, 768, 1, K=768) != choose_wgmma_config(1024, 768, 1, sms=78, K=768)
    for M, N, K in ((1024, 768, 768), (1024, 2304, 768), (128, 768, 3072), (128, 4096, 11008), (1024, 4096, 4096)):
        g = _gemm(M, N, K, "float16", name="g")
        for sms in (114, 78, 20):
            tile = choose_wgmma_config(M, N, 1, sms=sms, K=K)
            src = generate_cuda_source([g], arch="sm_90", sms=sms)
            assert src.text == generate_cuda_source([g], arch="sm_90", gemm_configs={"g": tile}, sms=sms).text
            launch = src.launches["g"]
            if WGMMA_CONFIGS[tile][3] == "tma":
                tiles = -(-M // tile_rows(tile)) * -(-N // WGMMA_CONFIGS[tile][1])
                assert launch.persistent and launch.grid[0] == min(tiles * split_count(tiles, K, sms), sms)
        assert generate_cuda_source([g], arch="sm_90", sms=500).text == generate_cuda_source([g], arch="sm_90").text
    assert [choose_gemm_config(1280, 1280, 1, sms=s) for s in (108, 80)] == ["64x64", "128x128"]
    g = MatMul([Tensor("a", (1280, 64), "float16"), Tensor("b", (64, 1280), "float16")], name="mm")
    assert generate_cuda_source([g], arch="sm_80", sms=80).launches["mm"].grid[:2] == (10, 10)  # 128x128 tiles
    for bad in (0, 1.5, True):
        with pytest.raises(CodegenError, match="multiprocessor count"):
            generate_cuda_source([g], arch="sm_80", sms=bad)


def test_batched_and_broadcast_operands_are_direct():
    mm = MatMul([Tensor("a", (3, 100, 64), "bfloat16"), Tensor("b", (64, 72), "bfloat16")], name="bmm")
    launch = generate_cuda_source([mm], arch="sm_90").launches["bmm"]
    assert launch.kind == "gemm-wgmma-bf16"  # M = 300 folds the batch into rows
    mm2 = MatMul([Tensor("a", (3, 40, 64), "float16"), Tensor("b", (3, 64, 24), "float16")], name="bmm2")
    src = generate_cuda_source([mm2], arch="sm_90")
    assert src.launches["bmm2"].kind == "gemm-wgmma-f16" and src.launches["bmm2"].grid[2] == 3
    # a broadcast batch on B's side folds into N, whose rows are then not evenly strided: the
    # leading row and column axes move into the batch instead (RFC 0005 decision 55)
    mm3 = MatMul([Tensor("a", (2, 1, 40, 64), "float16"), Tensor("b", (3, 64, 24), "float16")], name="bc")
    launch = generate_cuda_source([mm3], arch="sm_90").launches["bc"]
    assert launch.kind == "gemm-wgmma-f16" and launch.grid[2] == 3  # (A's rows (2, 40) stay rows)
    # unless a side would keep fewer than 16 rows: then the portable template
    mm4 = MatMul([Tensor("a", (2, 1, 40, 64), "float16"), Tensor("b", (3, 64, 8), "float16")], name="bc8")
    assert generate_cuda_source([mm4], arch="sm_90").launches["bc8"].kind == "gemm-f16"
    # a float32 product the wgmma template does not take (not opted in) keeps its plan: batch 1
    from shardflow.compiler.ops.conv import Conv

    conv = Conv([Tensor("x", (2, 32, 8, 8), "float32"), Tensor("w", (48, 32, 1, 1), "float32")], name="conv")
    launch = generate_cuda_source([conv], arch="sm_90").launches["conv"]
    assert launch.kind == "gemm-f32" and launch.grid[2] == 1
    # a half conv's pixels are the columns: four consecutive ones stored at once, the weight A
    half = Conv([Tensor("x", (2, 32, 8, 8), "float16"), Tensor("w", (48, 32, 1, 1), "float16")], name="conv")
    src = generate_cuda_source([half], arch="sm_90")
    assert src.launches["conv"].grid[2] == 2 and "reinterpret_cast<SfVec4<__half>*>(out0" in src.text


def test_split_k_only_for_few_tiles_and_long_k():
    assert split_count(12, 3072) == 6  # 48 K tiles: 6 splits of 8
    assert split_count(32, 11008) == 4 and split_count(2, 11008) == 16  # 172 K tiles: 4 x 43; 16 x 11 (last 7)
    assert split_count(64, 4096) == 2
    assert split_count(72, 8192) == 1 and split_count(12, 768) == 1  # enough tiles; short K
    for tiles in range(1, 70):
        for K in (512, 768, 1000, 3072, 4096, 11008):
            s, kt = split_count(tiles, K), -(-K // 64)
            per = -(-kt // s)
            assert (s - 1) * per < kt and (s == 1 or tiles * s <= 132 and per >= 8)


def test_tma_tiles_describe_their_tensor_maps_and_batched_products_fall_back():
    # A [K=200][M=72] (MN-major: 64 x 64 boxes), B [N=136][K=200] (K-major: one 64 x 128 box)
    g = _gemm(72, 136, 200, "bfloat16", ta=True, tb=True)
    launch = generate_cuda_source([g], arch="sm_90", gemm_configs={"g": "tma128x128"}).launches["g"]
    a, b = launch.tensor_maps
    assert a == {"arg": 0, "offset": 0, "dtype": "bfloat16", "dims": [72, 200], "strides": [144], "box": [64, 64],
                 "swizzle": 128}
    assert b == {"arg": 1, "offset": 0, "dtype": "bfloat16", "dims": [200, 136], "strides": [400], "box": [64, 128],
                 "swizzle": 128}
    assert launch.persistent and KernelLaunch.from_dict(launch.to_dict()) == launch  # program.json keeps them
    # a batched product has no single 2-D map per operand: the same tile through cp.async
    mm = MatMul([Tensor("a", (3, 40, 64), "float16"), Tensor("b", (3, 64, 24), "float16")], name="bmm")
    launch = generate_cuda_source([mm], arch="sm_90", gemm_configs={"bmm": "tma128x256"}).launches["bmm"]
    assert launch.tensor_maps == () and launch.block == (256, 1, 1) and launch.grid[2] == 3


@needs_nvcc
def test_gemm_tiles_force_the_tile_of_matching_kernels(tmp_path, caplog):
    """optimization_config["gemm_tiles"]: a pattern naming an op fused into a GEMM kernel (GPT-2's
    c_fc projection, whose kernel is named after its epilogue's cast) sets that kernel's tile;
    the others keep theirs; a pattern naming no GEMM is logged."""
    import json
    import logging
    from pathlib import Path

    from shardflow.compiler import compile

    model = Path(__file__).parent.parent / "models" / "gpt2_ts17.onnx"
    blocks = {}
    for name, tiles in (("default", None), ("forced", {"*c_fc*": "128x256", "*no_such_op*": "64x64"})):
        opt = {"target": "cuda", "precision": "float16", **({"gemm_tiles": tiles} if tiles else {})}
        with caplog.at_level(logging.WARNING, logger="shardflow.compiler.codegen.cuda"):
            compile(model, distributed_config={"mesh_shape": [1]}, optimization_config=opt, out_dir=tmp_path / name)
        program = json.loads((tmp_path / name / "rank0" / "program.json").read_text())
        blocks[name] = {s["node"]: s["launch"]["block"][0] for s in program["steps"]
                        if s["kind"] == "kernel" and s["launch"]["kind"].startswith("gemm-wgmma")}
    fc = [n for n in blocks["default"] if n.endswith("mlp/c_proj/Gemm.in0.float16")]  # c_fc + GELU + cast
    assert len(fc) == 2 and all(blocks["default"][n] == 128 and blocks["forced"][n] == 256 for n in fc)
    assert all(blocks["forced"][n] == b for n, b in blocks["default"].items() if n not in fc)
    assert "'*no_such_op*' names no GEMM kernel" in caplog.text


@needs_nvcc
def test_gemm_tiles_for_a_k_major_b_store_the_matched_weights_n_by_k(tmp_path):
    """A ``gemm_tiles`` pattern forcing a tile for a K-major B (96 columns) on GPT-2's c_proj
    projections stores their float16 weights ``[N, K]`` (read through a Transpose) and their
    kernels take that tile; the other GEMMs keep their weights ``[K, N]`` and their tiles. A
    pattern forcing a 64-multiple tile changes no weight."""
    import json
    from pathlib import Path

    from shardflow.compiler import compile, load_onnx
    from shardflow.compiler.codegen.cuda_wgmma import _smem_bytes
    from shardflow.compiler.driver import _k_major_tiles
    from shardflow.compiler.passes.precision import HalfPrecisionContractions

    model = Path(__file__).parent.parent / "models" / "gpt2_ts17.onnx"
    kmajor, plain = {"*/c_proj/Gemm": "tma64x96"}, {"*/c_proj/Gemm": "tma64x128"}
    assert _k_major_tiles(plain) is None
    graph = HalfPrecisionContractions("float16", k_major_weights=True,
                                      k_major_ops=_k_major_tiles(kmajor)).run(load_onnx(str(model)))
    flips = [op for op in graph.nodes if op.op_type == "Transpose" and op.name.endswith(".w1.T")]
    # two c_proj per layer (the attention's output projection, the MLP's down projection), [K, N]
    # weights stored [N, K]; (the test model's vocabulary is a multiple of 8: no flip for alignment)
    assert len(flips) == 2 * sum(op.name.endswith("/attn/c_proj/Gemm") for op in graph.nodes) >= 2
    assert all(op.name.split("/")[-2:-1] == ["c_proj"] for op in flips)
    assert all(op.outputs[0].shape[::-1] == op.inputs[0].shape for op in flips)
    smem = {}
    for name, tiles in (("default", None), ("kmajor", kmajor), ("plain", plain)):
        opt = {"target": "cuda", "precision": "float16", **({"gemm_tiles": tiles} if tiles else {})}
        compile(model, distributed_config={"mesh_shape": [1]}, optimization_config=opt, out_dir=tmp_path / name)
        program = json.loads((tmp_path / name / "rank0" / "program.json").read_text())
        smem[name] = {s["node"]: s["launch"]["shared_mem"] for s in program["steps"]
                      if s["kind"] == "kernel" and s["launch"]["kind"].startswith("gemm-wgmma")}
    # the c_proj kernels (named after their residual Add) take the 96-column tile: B is K-major
    want = _smem_bytes(1, 96, WGMMA_CONFIGS["tma64x96"][2], "tma")[2]
    changed = {n for n in smem["default"] if smem["kmajor"][n] != smem["default"][n]}
    assert len(changed) == len(flips) and all(smem["kmajor"][n] == want for n in changed)
    assert want not in smem["plain"].values() and want not in smem["default"].values()


def _every_config_and_every_layout_of_its_kind():
    """``(tile, layout)`` pairs in which every tile appears, and every layout with every kind of
    tile (the cp.async, TMA, ping-pong, stream-K, cluster split-K and multicast ones): each kind's
    tiles take the layouts in turn, one more time round where it has fewer tiles than layouts."""
    kinds: dict[str, list[str]] = {}
    for cfg, v in WGMMA_CONFIGS.items():
        kinds.setdefault(v[3][:2], []).append(cfg)
    return [(cfgs[j % len(cfgs)], LAYOUTS[j % len(LAYOUTS)])
            for cfgs in kinds.values() for j in range(max(len(cfgs), len(LAYOUTS)))]


@needs_nvcc
@pytest.mark.parametrize("dt, every", [("float16", False), pytest.param("float16", True, marks=pytest.mark.slow),
                                       pytest.param("bfloat16", True, marks=pytest.mark.slow)])
def test_every_config_and_layout_compiles_without_local_memory(tmp_path, dt, every):
    """Every tile with a layout and every layout with every kind of tile (``every``: every tile
    with every layout, -m slow; bfloat16's kernels differ from float16's by the instruction's
    type only: -m slow)."""
    pairs = itertools.product(WGMMA_CONFIGS, LAYOUTS) if every else _every_config_and_every_layout_of_its_kind()
    ops = [(_gemm(200, 136, 200, dt, ta, tb, name=f"g{i}"), cfg) for i, (cfg, (ta, tb)) in enumerate(pairs)]
    _compiles_without_local_memory(tmp_path, ops)


@needs_nvcc
@pytest.mark.parametrize("precision", ["tf32", "float32"])
def test_every_float32_config_compiles_without_local_memory(tmp_path, precision):
    """Float32 operands, both K-major (the layout the TF32 wgmma reads; a K that leaves a partial K
    tile of 32 floats), on every tile: one TF32 product (``precision="tf32"``), or 3xTF32 with the
    operands split in shared memory (float32, on a forced tile)."""
    ops = [(_gemm(200, 136, 100, "float32", tb=True, name=f"g{i}"), cfg) for i, cfg in enumerate(WGMMA_CONFIGS)]
    _compiles_without_local_memory(tmp_path, ops, precision=precision,
                                   kind="gemm-wgmma-tf32" if precision == "tf32" else "gemm-wgmma-f32")


def _compiles_without_local_memory(tmp_path, ops, precision="float32", kind="gemm-wgmma"):
    """Each (op, tile) of ``ops`` compiles for sm_90a on the wgmma template (launch kind starting
    with ``kind``), ptxas serializes no wgmma, and no kernel has a stack frame."""
    # two halves, compiled side by side (two nvcc processes: the suite runs on two cores)
    procs, symbols = [], set()
    for h, half in enumerate((ops[::2], ops[1::2])):
        src = generate_cuda_source([o for o, _ in half], precision=precision, arch="sm_90",
                                   gemm_configs={o.name: c for o, c in half})
        assert all(launch.kind.startswith(kind) for launch in src.launches.values())
        symbols |= {launch.symbol for launch in src.launches.values()}  # (a tile that falls back shares a kernel)
        cu = tmp_path / f"k{h}.cu"
        cu.write_text(src.text)
        procs.append(subprocess.Popen(["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
                                       "-Xptxas", "-v", "-o", str(tmp_path / f"k{h}.cubin"), str(cu)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    frames, kernel = {}, None
    for proc in procs:
        _, report = proc.communicate()
        assert proc.returncode == 0, report[-3000:]
        assert "serialized" not in report  # ptxas warns when it has to serialize wgmma
        for ln in report.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", ln)
            kernel = m.group(1) if m else kernel
            m = re.search(r"(\d+) bytes stack frame", ln)
            if m:
                frames[kernel] = int(m.group(1))
    assert len(frames) == len(symbols) > len(ops) // 2
    assert all(f == 0 for f in frames.values()), frames  # no local memory


def _residual_epilogue(N, res_t=False, M=200, K=328, dt="float16", heads=None):
    """``x @ w + bias + res`` (``res`` read transposed with ``res_t``), fused: the product in
    float16, the additions in ``dt`` (the product cast first when that is float32). ``w`` is
    stored ``[N, K]`` when N is odd (a ``[K, N]`` one needs 16-byte aligned rows for the wgmma
    kernel); with ``heads`` the row is two axes (``heads``, ``N // heads``): an einsum
    ``mk,knd->mnd``. Returns the ops and their inputs' shapes."""
    row = (heads, N // heads) if heads else (N,)
    x, bias = Tensor("x", (M, K), "float16"), Tensor("bias", row, dt)
    w = Tensor("w", (N, K) if N % 2 else (K,) + row, "float16")
    res = Tensor("res", row[::-1] + (M,) if res_t else (M,) + row, dt)
    ops = [Einsum([x, w], name="mm", equation="mk,knd->mnd") if heads else Gemm([x, w], name="mm", trans_b=bool(N % 2))]
    if dt != "float16":
        ops.append(CastOp([ops[-1].outputs[0]], name="cast", to=dt))
    ops.append(Binary([ops[-1].outputs[0], bias], name="add", fn="add"))
    if res_t:
        ops.append(Transpose([res], name="tr", perm=list(range(res.ndim))[::-1]))
    out = Binary([ops[-2 if res_t else -1].outputs[0], ops[-1].outputs[0] if res_t else res], name="out", fn="add")
    return fuse(ops + [out], keep=[out.outputs[0].name]), {"x": (M, K), "w": w.shape, "bias": row, "res": res.shape}


@needs_nvcc
@pytest.mark.parametrize("dt", ["float16", pytest.param("float32", marks=pytest.mark.slow)])
def test_residual_epilogues_of_whole_tiles_compile_without_local_memory(tmp_path, dt):
    """RFC 0005 decision 28: a product whose tiles lie inside it runs its epilogue untested, and
    one reading a residual along the rows unrolls its loop by four (the reads issued together;
    not on the stream-K tiles). Every tile whose columns divide the product, float16 residuals
    (float32 ones: -m slow), compiles with no local memory."""
    from shardflow.compiler.codegen.cuda_wgmma import _ROW_READ_UNROLL

    tiles = []
    for i, (cfg, (_, _, _, mode)) in enumerate(WGMMA_CONFIGS.items()):
        ops, _ = _residual_epilogue(768, M=768, K=256, dt=dt)
        src = generate_cuda_source(ops, arch="sm_90", gemm_configs={"out": cfg}).text
        unrolled = f"#pragma unroll {_ROW_READ_UNROLL}\n" in src
        assert "inside the product" in src and "sf_m < 768" not in src, cfg
        assert unrolled == (mode != "sk"), cfg
        ops[-1].name = f"out{i}"  # (compiled together, a kernel a tile)
        tiles.append((ops[-1], cfg))
    _compiles_without_local_memory(tmp_path, tiles)


@needs_nvcc
def test_kernels_for_programmatic_dependent_launch_compile(tmp_path):
    """RFC 0005 decisions 29 and 48: with ``pdl`` the cp.async kernel opens with the grid
    dependency wait and trigger, or, when B is a weight, first issues its copies of B's first
    stages; a persistent one (TMA, ping-pong, stream-K, whose stream-K workspace comes before the
    signature, cluster split-K, multicast) sets up its barriers first and, in the TMA and
    ping-pong modes, issues its first stages' copies of a weight B before it waits. Without
    ``pdl`` no wait is written; all compile under nvcc for sm_90a with no
    local memory and no variable left unread."""
    from shardflow.compiler.codegen.cuda import PDL_ENTER, PDL_HELPER

    tiles = ["128x128", "tma64x128", "pp64x128", "sk64x128", "ck128x128", "mc64x128"]
    ops = []
    for i, t in enumerate(tiles):
        g = _gemm(256, 256, 256, "float16", name=f"g{i}")
        w = Tensor(f"w{i}", (256, 256), "float16", value=np.ones((256, 256), np.float16))
        ops += [g, Gemm([g.inputs[0], w], name=f"w{i}")]
    configs = {op.name: t for op, t in zip(ops, [t for t in tiles for _ in range(2)])}
    src = generate_cuda_source(ops, arch="sm_90", gemm_configs=configs, pdl=True)
    plain_src = generate_cuda_source(ops, arch="sm_90", gemm_configs=configs)
    plain = plain_src.text
    assert "griddepcontrol" not in plain and PDL_ENTER not in plain

    def body_of(text, symbol):  # (from the kernel's name in its signature to its closing brace)
        return text[text.index(f" {symbol}(") + 1:].split("\n}\n", 1)[0]
    # (a weight B and an activation B give the same kernel where nothing is loaded early)
    bodies = {op.name: body_of(src.text, src.launches[op.name].symbol) for op in ops}
    for name, body in bodies.items():
        early = name.startswith("w") and configs[name].startswith(("tma", "pp", "128x128"))
        assert body.count(PDL_ENTER) == 1, name
        if configs[name] == "128x128":  # every thread copies B's first stages (uncommitted), then waits
            before = body[:body.index(PDL_ENTER)].split("{\n", 1)[1]
            assert body.split("{\n", 1)[1].startswith(f"  {PDL_ENTER}\n") != early, name
            assert ("in1 + " in before) == early and "in0" not in before and "commit" not in before, name
            continue
        set_up = body.index("sf_mbar_init(")
        assert set_up < body.index(PDL_ENTER) and ("int sf_pre = 0;" in body) == early, name
        before = body[:body.index(PDL_ENTER)]
        assert ("&sf_tmB, " in before) == early and "&sf_tmA, " not in before, name  # (the copies)
    lines = lambda t: sorted(x.strip() for x in t.splitlines() if x.strip())  # noqa: E731
    for name, body in bodies.items():  # an activation B: the same statements, the wait moved
        if name.startswith("g"):
            symbol = plain_src.launches[name].symbol  # (another symbol: the text is another)
            assert lines(body.replace(PDL_ENTER, "").replace(src.launches[name].symbol, symbol)) == \
                lines(body_of(plain, symbol)), name
    assert src.text.count(PDL_HELPER) == 1
    cu = tmp_path / "k.cu"
    cu.write_text(src.text)
    proc = subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
                           "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), str(cu)], capture_output=True, text=True)
    assert proc.returncode == 0 and "#177-D" not in proc.stderr, proc.stderr[-3000:]  # (nothing left unread)
    frames = re.findall(r"(\d+) bytes stack frame", proc.stderr)
    assert frames and set(frames) == {"0"}, proc.stderr


@pytest.mark.parametrize("cfg", ["128x128", "tma64x128", "pp64x128"])
def test_epilogue_takes_four_columns_per_thread(tmp_path, cfg):
    """RFC 0005 decision 22: when the row length is a multiple of 4, each thread's epilogue
    handles four consecutive outputs; reads that step by one element along the row (bias,
    residual) are one vector load, and so is the store. A residual read across rows stays per
    element; an odd row length keeps one output per thread. All compile with no local memory."""
    cases = {"vec": _residual_epilogue(136), "odd": _residual_epilogue(137), "res_t": _residual_epilogue(136, True)}
    srcs = {}
    for name, (ops, _) in cases.items():
        assert len(ops) == 1
        src = generate_cuda_source(ops, arch="sm_90", gemm_configs={"out": cfg})
        assert src.launches["out"].kind == "gemm-wgmma-f16"
        srcs[name] = src.text
        body = src.text[src.text.index('extern "C" __global__'):]
        loads = body.count("reinterpret_cast<const SfVec4<__half>*>")
        if name == "odd":
            assert "SfVec4" not in body and "const float sf_acc = " in body
        else:
            assert "const float sf_acc[4] = {sf_a4.x, sf_a4.y, sf_a4.z, sf_a4.w};" in body
            assert "*reinterpret_cast<SfVec4<__half>*>(out0 + " in body  # one store of four
            assert loads == (2 if name == "vec" else 1), (name, loads)  # bias and residual / bias only
    if __import__("shutil").which("nvcc") is None:
        return
    for name, text in srcs.items():
        cu = tmp_path / f"{name}.cu"
        cu.write_text(text)
        proc = subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
                               "-Xptxas", "-v", "-o", str(tmp_path / f"{name}.cubin"), str(cu)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert re.search(r"\b0 bytes stack frame", proc.stderr) and "serialized" not in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

def _gpu():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # noqa: BLE001
        pass
    pytest.skip("no CUDA device (or cupy is not installed)")


def _bits(x: np.ndarray, dt: str) -> np.ndarray:
    if dt == "float16":
        return x.astype(np.float16)
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _value(bits: np.ndarray, dt: str) -> np.ndarray:
    if dt == "float16":
        return bits.astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _launch(cupy, module, launch, args):
    fn = module.get_function(launch.symbol)
    if launch.shared_mem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = launch.shared_mem
    fn(launch.grid, launch.block, kernel_args(launch.tensor_maps, args), shared_mem=launch.shared_mem)
    cupy.cuda.runtime.deviceSynchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_every_config_and_layout_matches_numpy(tmp_path, dt):
    _configs_match_numpy(tmp_path, dt, MEASURED)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_k_major_b_tiles_match_numpy(tmp_path, dt):
    """The tiles of 96 and 160 columns, every layout (with B [K, N] they take the 64-multiple tile
    beside them), and GPT-2's projections at M = 1024 with B stored [N, K] (128 and 120 tiles)."""
    _configs_match_numpy(tmp_path, dt, KMAJOR_B)
    if dt == "float16":
        cupy = _gpu()
        rng = np.random.default_rng(3)
        for cfg, (M, N, K) in (("tma64x96", (1024, 768, 768)), ("tma64x96", (1024, 768, 3072)),
                               ("tma128x160", (1024, 2304, 768))):
            op = _gemm(M, N, K, dt, tb=True, name="p")
            path = str(tmp_path / f"{cfg}-{N}-{K}.cubin")
            launch = build_cuda_library([op], path, arch="sm_90", cache_dir=str(tmp_path / "c"),
                                        gemm_configs={"p": cfg})["p"]
            assert launch.grid[0] == -(-M // tile_rows(cfg)) * -(-N // WGMMA_CONFIGS[cfg][1])
            a = (rng.standard_normal((M, K)) / 4).astype(np.float16)
            b = (rng.standard_normal((N, K)) / 4).astype(np.float16)
            c = cupy.zeros((M, N), cupy.float16)
            _launch(cupy, cupy.RawModule(path=path), launch, [cupy.asarray(a), cupy.asarray(b), c])
            want = a.astype(np.float32) @ b.astype(np.float32).T
            err = float(np.max(np.abs(c.get().astype(np.float32) - want))) / float(np.max(np.abs(want)))
            assert err < 4e-3, (cfg, M, N, K, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_pingpong_tiles_match_numpy(tmp_path, dt):
    """The ping-pong tiles, every layout, then a product with several tiles per block (its two
    consumer warpgroups take turns, an odd count on some blocks) and a fused epilogue."""
    _configs_match_numpy(tmp_path, dt, PINGPONG)
    if dt == "float16":
        rng = np.random.default_rng(2)
        x = rng.standard_normal((4200, 328)).astype(np.float16)
        w = (rng.standard_normal((328, 1160)) / 8).astype(np.float16)
        for cfg in PINGPONG:
            (tmp_path / cfg).mkdir()
            bias = rng.standard_normal((1160,)).astype(np.float16)
            launch = _bias_tanh_matches_numpy(tmp_path / cfg, x, w, bias, cfg)
            assert launch.tensor_maps and launch.grid[0] == 132


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_stream_k_tiles_match_numpy(tmp_path, dt):
    """The stream-K tiles (RFC 0005 decision 24), every layout (few tiles: every block a range of
    K tiles); then GPT-2's attention output projection at M = 1024 (N = K = 768: 96 tiles of 64 x
    128 on 132 blocks, 24 of 128 x 256 on 36, every tile in pieces) and a product of several waves
    with a fused epilogue, each launched twice (the flags are reset for the next launch)."""
    _configs_match_numpy(tmp_path, dt, STREAM_K)
    if dt == "float16":
        for cfg, M, N, K, launch in _bias_tanh_on_shapes(tmp_path, STREAM_K, ((1024, 768, 768), (4100, 1160, 328)), 6):
            tiles = -(-M // tile_rows(cfg)) * -(-N // WGMMA_CONFIGS[cfg][1])
            assert launch.tensor_maps and launch.grid[0] == stream_k_blocks(tiles, -(-K // 64)) > 1


@pytest.mark.gpu
def test_stream_k_gives_the_same_bits_on_a_grid(tmp_path):
    """A stream-K product (GPT-2's c_proj shape at M = 1024) gives the same bits launch after launch
    on one grid, whichever block finishes first; on a smaller grid (other ranges) numpy's values
    within the float16 rounding."""
    _, outs, want = _product_on_grids(tmp_path, "sk64x128", 1024, 768, 3072, (132, 132, 97, 132, 97), seed=7)
    for same in outs.values():
        for o in same[1:]:
            np.testing.assert_array_equal(o, same[0])
        got = same[0].view(np.float16).astype(np.float32)
        np.testing.assert_allclose(got, want, atol=4e-3 * np.abs(want).max(), rtol=4e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_cluster_split_k_tiles_match_numpy(tmp_path, dt):
    """The cluster split-K tiles (RFC 0005 decision 31), every layout; then GPT-2's attention output
    and second MLP projections at M = 1024 (48 or 96 tiles, two blocks each) and a product of several
    waves with a fused epilogue, each launched twice."""
    _configs_match_numpy(tmp_path, dt, CLUSTER)
    if dt == "float16":
        shapes = ((1024, 768, 768), (1024, 768, 3072), (4100, 1160, 328))
        for cfg, M, N, K, launch in _bias_tanh_on_shapes(tmp_path, CLUSTER, shapes, 8):
            tiles, c = -(-M // tile_rows(cfg)) * -(-N // WGMMA_CONFIGS[cfg][1]), CLUSTER_SIZE[WGMMA_CONFIGS[cfg][3]]
            assert launch.cluster == c and launch.grid[0] == min(c * tiles, 132 if c == 2 else 128)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_multicast_tiles_match_numpy(tmp_path, dt):
    """The B-multicast tiles (RFC 0005 decision 32), every layout; then GPT-2's qkv and fc2
    projections at M = 1024 and a product of several waves with a fused epilogue, each launched
    twice."""
    _configs_match_numpy(tmp_path, dt, MULTICAST)
    if dt == "float16":
        shapes = ((1024, 2304, 768), (1024, 768, 3072), (4096, 1160, 328))
        for cfg, M, N, K, launch in _bias_tanh_on_shapes(tmp_path, MULTICAST, shapes, 10):
            tiles = -(-M // tile_rows(cfg)) * -(-N // WGMMA_CONFIGS[cfg][1])
            assert launch.cluster == 2 and launch.grid[0] == min(tiles, 132)


@pytest.mark.gpu
def test_cluster_split_k_gives_the_same_bits_on_any_grid(tmp_path):
    """Each tile of a cluster split-K product is the sum of the same two halves whichever cluster
    computes it: the same bits launch after launch and on grids of 96, 40 and 2 blocks (clusters
    looping over several tiles)."""
    _, outs, want = _product_on_grids(tmp_path, "ck64x128", 1024, 768, 3072, (None, None, 40, 2), seed=9)
    first = next(iter(outs.values()))[0]
    for same in outs.values():
        for o in same:
            np.testing.assert_array_equal(o, first)
    got = first.view(np.float16).astype(np.float32)
    np.testing.assert_allclose(got, want, atol=4e-3 * np.abs(want).max(), rtol=4e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32", "float32"])
def test_tf32_tiles_match_numpy(tmp_path, precision):
    """Float32 products on the Hopper template, every tile but the cluster ones (float32 operands,
    both K-major: ``A [M, K]``, ``B [N, K]``), at sizes that leave partial tiles and a partial K
    tile of 32 floats: ``precision="tf32"`` within TF32's error of numpy's float64 product, float32
    (3xTF32, on forced tiles) within float32's."""
    _tf32_configs_match_numpy(tmp_path, [c for c in WGMMA_CONFIGS if c not in CLUSTER + MULTICAST], precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32", "float32"])
def test_tf32_cluster_split_k_and_multicast_tiles_match_numpy(tmp_path, precision):
    """The same for the cluster split-K and B-multicast tiles (run apart, like theirs in half types)."""
    _tf32_configs_match_numpy(tmp_path, CLUSTER + MULTICAST, precision)


def _tf32_configs_match_numpy(tmp_path, configs, precision):
    cupy = _gpu()
    rng = np.random.default_rng(0)
    cases = []
    for i, cfg in enumerate(configs):
        M, N, K = (200, 136, 100) if i % 2 else (72, 264, 520)
        cases.append((_gemm(M, N, K, "float32", tb=True, name=f"g{i}"), cfg, M, N, K))
    path = str(tmp_path / "k.cubin")
    launches = build_cuda_library([c[0] for c in cases], path, arch="sm_90", cache_dir=str(tmp_path / "c"),
                                  precision=precision, gemm_configs={c[0].name: c[1] for c in cases})
    module = cupy.RawModule(path=path)
    bad = []
    for op, cfg, M, N, K in cases:
        launch = launches[op.name]
        assert launch.kind == ("gemm-wgmma-tf32" if precision == "tf32" else "gemm-wgmma-f32"), (cfg, launch.kind)
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = rng.standard_normal((N, K)).astype(np.float32)
        want = a.astype(np.float64) @ b.astype(np.float64).T
        out = cupy.full((M, N), np.nan, cupy.float32)  # a missed element shows
        _launch(cupy, module, launch, (cupy.asarray(a), cupy.asarray(b), out))
        err = float(np.max(np.abs(cupy.asnumpy(out) - want))) / float(np.max(np.abs(want)))
        if not err < (2e-3 if precision == "tf32" else 1e-5):  # (TF32: 10 mantissa bits an operand; NaN fails)
            bad.append(f"{cfg} M={M} N={N} K={K}: err {err:.3g}")
    assert not bad, "\n".join(bad)


def _product_on_grids(tmp_path, cfg, M, N, K, grids, seed):
    """A float16 product ``[M, K] @ [K, N]`` (random operands of ``seed``) on tile ``cfg``,
    launched on each of ``grids`` (block counts; None: the launch's own) in turn; returns the
    launch, the outputs by grid and numpy's product."""
    cupy = _gpu()
    rng = np.random.default_rng(seed)
    op = _gemm(M, N, K, "float16", False, False, name="p")
    path = str(tmp_path / "k.cubin")
    launch = build_cuda_library([op], path, arch="sm_90", cache_dir=str(tmp_path / "c"), gemm_configs={"p": cfg})["p"]
    module = cupy.RawModule(path=path)
    a = _bits(rng.standard_normal((M, K)) / 8, "float16")
    b = _bits(rng.standard_normal((K, N)) / 8, "float16")
    want = _value(a, "float16").astype(np.float64) @ _value(b, "float16").astype(np.float64)
    outs = {}
    for grid in grids:
        out = cupy.full((M, N), 0xFFFF, cupy.uint16)
        _launch(cupy, module, dataclasses.replace(launch, grid=(grid or launch.grid[0], 1, 1)),
                (cupy.asarray(a), cupy.asarray(b), out))
        outs.setdefault(grid, []).append(cupy.asnumpy(out))
    return launch, outs, want


def _configs_match_numpy(tmp_path, dt, configs):
    cupy = _gpu()
    rng = np.random.default_rng(0)
    cases = []
    for i, (cfg, (ta, tb)) in enumerate(itertools.product(configs, LAYOUTS)):
        M, N, K = (200, 136, 200) if i % 2 else (72, 264, 520)
        cases.append((_gemm(M, N, K, dt, ta, tb, name=f"g{i}"), cfg, M, N, K, ta, tb))
    path = str(tmp_path / "k.cubin")
    launches = build_cuda_library([c[0] for c in cases], path, arch="sm_90", cache_dir=str(tmp_path / "c"),
                                  gemm_configs={c[0].name: c[1] for c in cases})
    module = cupy.RawModule(path=path)
    bad = []
    for op, cfg, M, N, K, ta, tb in cases:
        launch = launches[op.name]
        assert launch.kind == f"gemm-wgmma-{'f16' if dt == 'float16' else 'bf16'}", (cfg, launch.kind)
        a = _bits(rng.standard_normal((K, M) if ta else (M, K)), dt)
        b = _bits(rng.standard_normal((N, K) if tb else (K, N)), dt)
        want = (_value(a, dt).T if ta else _value(a, dt)).astype(np.float64) @ \
            (_value(b, dt).T if tb else _value(b, dt)).astype(np.float64)
        out = cupy.full((M, N), 0xFFFF, cupy.uint16)  # NaN in both half types: a missed element shows
        _launch(cupy, module, launch, (cupy.asarray(a), cupy.asarray(b), out))
        got = _value(cupy.asnumpy(out).view(np.float16) if dt == "float16" else cupy.asnumpy(out), dt)
        err = float(np.max(np.abs(got - want))) / float(np.max(np.abs(want)))
        if not err < (4e-3 if dt == "float16" else 2e-2):  # NaN (an element not written) fails too
            bad.append(f"{cfg} trans_a={ta} trans_b={tb} M={M} N={N} K={K}: err {err:.3g}")
    assert not bad, "\n".join(bad)


def _bias_tanh_matches_numpy(tmp_path, x, w, bias, config=None):
    """x @ w + bias, then tanh, fused into one wgmma kernel (``config``: its tile) and run; returns
    the launch after checking the result against numpy."""
    cupy = _gpu()
    tx, tw, tb = (Tensor(n, a.shape, "float16") for n, a in (("x", x), ("w", w), ("bias", bias)))
    mm = MatMul([tx, tw], name="mm")
    add = Binary([mm.outputs[0], tb], name="add", fn="add")
    act = Unary([add.outputs[0]], name="act", fn="tanh")
    ops = fuse([mm, add, act], keep=[act.outputs[0].name])
    path = str(tmp_path / "k.cubin")
    launches = build_cuda_library(ops, path, arch="sm_90", cache_dir=str(tmp_path / "c"),
                                  gemm_configs={"act": config} if config else None)
    launch = launches["act"]
    assert launch.kind == "gemm-wgmma-f16"
    module = cupy.RawModule(path=path)
    want = np.tanh(x.astype(np.float64) @ w.astype(np.float64) + bias)
    for _ in range(2):  # twice: a split-K kernel must leave its tile counters ready for the next launch
        out = cupy.full(x.shape[:-1] + w.shape[-1:], 0xFFFF, cupy.uint16).view(cupy.float16)
        arrays = {"x": cupy.asarray(x), "w": cupy.asarray(w), "bias": cupy.asarray(bias), act.outputs[0].name: out}
        _launch(cupy, module, launch, tuple(arrays[n] for n in launch.args))
        got = cupy.asnumpy(out).astype(np.float32)
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, want, atol=4e-3, rtol=4e-3)
    return launch


def _bias_tanh_on_shapes(tmp_path, configs, shapes, seed):
    """:func:`_bias_tanh_matches_numpy` of random operands (``seed``) of each ``(M, N, K)`` of
    ``shapes`` on each tile of ``configs``; yields ``(config, M, N, K, launch)``."""
    rng = np.random.default_rng(seed)
    for M, N, K in shapes:
        x = rng.standard_normal((M, K)).astype(np.float16)
        w = (rng.standard_normal((K, N)) / 8).astype(np.float16)
        bias = rng.standard_normal((N,)).astype(np.float16)
        for cfg in configs:
            (tmp_path / f"{cfg}-{M}-{K}").mkdir()
            yield cfg, M, N, K, _bias_tanh_matches_numpy(tmp_path / f"{cfg}-{M}-{K}", x, w, bias, cfg)


@pytest.mark.gpu
def test_batched_product_with_fused_epilogue(tmp_path):
    """A batched float16 MatMul + bias + tanh epilogue fused into the wgmma kernel."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 100, 64)).astype(np.float16)
    w = rng.standard_normal((64, 72)).astype(np.float16)
    _bias_tanh_matches_numpy(tmp_path, x, w, rng.standard_normal((72,)).astype(np.float16))


#: the tile of :func:`_batched_products`' unbatched conv (at its size the default is a cp.async tile)
BATCHED_TILES = {"one": "tma64x128"}


def _batched_products(dt: str):
    """RFC 0005 decision 55's products (``dt`` operands): a 1x1 conv over 3 images (40 channels,
    4x10 pixels, 72 outputs) with bias, residual and SiLU fused (group ``out``), the same conv on
    one image (``one``: unbatched, on a TMA tile, :data:`BATCHED_TILES`), and a product whose
    batch broadcasts on B's side (``bc``); returns the ops (fused), the operands' bits by name and
    numpy's outputs by group name."""
    from shardflow.compiler.ops.conv import Conv

    rng = np.random.default_rng(3)
    bits = {k: _bits(rng.standard_normal(s) / (4 if k == "w" else 1), dt) for k, s in (
        ("x", (3, 40, 4, 10)), ("w", (72, 40, 1, 1)), ("bias", (72,)), ("res", (3, 72, 4, 10)),
        ("a", (2, 1, 40, 64)), ("b", (3, 64, 24)))}
    bits["x1"] = bits["x"][:1].copy()
    t = {k: Tensor(k, v.shape, dt) for k, v in bits.items()}
    conv = Conv([t["x"], t["w"], t["bias"]], name="conv")
    add = Binary([conv.outputs[0], t["res"]], name="add", fn="add")
    sig = Unary([add.outputs[0]], name="sig", fn="sigmoid")
    chain = [conv, add, sig, Binary([add.outputs[0], sig.outputs[0]], name="out", fn="mul")]
    v = {k: _value(b, dt).astype(np.float64) for k, b in bits.items()}
    y0 = np.einsum("nchw,oc->nohw", v["x"], v["w"][:, :, 0, 0]) + v["bias"][:, None, None]
    y = y0 + v["res"]
    ops = fuse(chain) + [Conv([t["x1"], t["w"], t["bias"]], name="one"), MatMul([t["a"], t["b"]], name="bc")]
    return ops, bits, {"out": y / (1 + np.exp(-y)), "one": y0[:1], "bc": v["a"] @ v["b"]}


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_batched_one_by_one_convs_and_broadcast_products(tmp_path, dt):
    """:func:`_batched_products` on the GPU: the wgmma kernels against numpy."""
    launches = _half_products_on_the_gpu(tmp_path, dt, *_batched_products(dt), gemm_configs=BATCHED_TILES)
    for name, launch in launches.items():
        assert launch.grid[2] == (1 if name == "one" else 3) and bool(launch.tensor_maps) == (name == "one"), name


def _half_products_on_the_gpu(tmp_path, dt, ops, bits, wants, gemm_configs=None) -> dict:
    """Build ``ops`` (``dt`` products) for sm_90, run the kernel of each op named in ``wants`` on
    the operands ``bits`` and check it against ``wants``' value (on the wgmma template); returns
    those launches by name."""
    cupy = _gpu()
    path = str(tmp_path / "k.cubin")
    launches = build_cuda_library(ops, path, arch="sm_90", cache_dir=str(tmp_path / "c"), gemm_configs=gemm_configs)
    module = cupy.RawModule(path=path)
    for name, want in wants.items():
        launch = launches[name]
        assert launch.kind == f"gemm-wgmma-{'f16' if dt == 'float16' else 'bf16'}", name
        out = cupy.full(want.shape, 0xFFFF, cupy.uint16)  # NaN in both half types: a missed element shows
        _launch(cupy, module, launch, tuple(cupy.asarray(bits[n]) for n in launch.args[:launch.num_inputs]) + (out,))
        got = _value(cupy.asnumpy(out).view(np.float16) if dt == "float16" else cupy.asnumpy(out), dt)
        err = float(np.max(np.abs(got - want))) / float(np.max(np.abs(want)))
        assert err < (4e-3 if dt == "float16" else 2e-2), (name, err)
    return {name: launches[name] for name in wants}


#: RFC 0005 decision 57's convs over channels-last images: name -> (image [N, C, *spatial], output
#: channels, kernel, strides, dilations, pads (begins, then ends)); sizes not multiples of the tiles
CHANNELS_LAST = {
    "c3": ((2, 24, 7, 9), 40, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),  # (+ bias, residual, SiLU)
    "s2": ((1, 16, 9, 11), 24, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1)),
    "p1": ((3, 8, 9, 9), 16, (1, 1), (2, 2), (1, 1), (0, 0, 0, 0)),
    "d2": ((1, 8, 6, 8), 20, (3, 3), (1, 1), (2, 2), (2, 2, 2, 2)),
    "k5": ((1, 16, 8, 7), 32, (5, 5), (1, 2), (1, 1), (2, 1, 1, 3)),
    "c1d": ((2, 16, 30), 24, (3,), (2,), (1,), (1, 1)),
    "deep": ((1, 256, 4, 4), 64, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),  # one tile, K split in 4 (decision 59)
    "c3d": ((1, 8, 4, 5, 6), 16, (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 0, 1, 1, 1, 1)),  # (uneven pads)
}


def _channels_last_convs(dt: str):
    """:data:`CHANNELS_LAST`'s convs (``dt`` operands) as the cuda target's graph has them after
    ``ChannelsLastConvs``: the image ``[N, *spatial, C]`` and the weight ``[OC, *kernel, C]`` read
    through Transposes back to NCHW, fused into the conv's kernel (``c3`` with a bias, a residual
    and SiLU too); returns the ops, the operands' bits by name and numpy's outputs by op name."""
    from shardflow.compiler.ops.conv import Conv

    rng = np.random.default_rng(5)
    ops, bits, wants = [], {}, {}
    for name, (shape, oc, kern, strides, dil, pads) in CHANNELS_LAST.items():
        nd = len(shape)
        x = rng.standard_normal(shape)
        w = rng.standard_normal((oc, shape[1], *kern)) / 4
        bits[f"{name}_x"] = _bits(np.moveaxis(x, 1, -1).copy(), dt)
        bits[f"{name}_w"] = _bits(np.moveaxis(w, 1, -1).copy(), dt)
        bits[f"{name}_b"] = _bits(rng.standard_normal(oc), dt)
        t = {k: Tensor(f"{name}_{k}", bits[f"{name}_{k}"].shape, dt) for k in "xwb"}
        back = (0, nd - 1, *range(1, nd - 1))
        tx, tw = (Transpose([t[k]], name=f"{name}_{k}_nchw", perm=back) for k in "xw")
        conv = Conv([tx.outputs[0], tw.outputs[0], t["b"]], name=name, strides=strides, dilations=dil, pads=pads)
        v = {k: _value(bits[f"{name}_{k}"], dt).astype(np.float64) for k in "xwb"}
        y = conv.numpy(np.moveaxis(v["x"], -1, 1), np.moveaxis(v["w"], -1, 1), v["b"])[0]
        chain = [tx, tw, conv]
        if name == "c3":
            bits["c3_res"] = _bits(rng.standard_normal(y.shape), dt)
            add = Binary([conv.outputs[0], Tensor("c3_res", y.shape, dt)], name="c3_add", fn="add")
            sig = Unary([add.outputs[0]], name="c3_sig", fn="sigmoid")
            chain += [add, sig, Binary([add.outputs[0], sig.outputs[0]], name="c3_out", fn="mul")]
            y = y + _value(bits["c3_res"], dt)
            y, name = y / (1 + np.exp(-y)), "c3_out"
        ops += fuse(chain)
        wants[name] = y
    return ops, bits, wants


def test_products_without_tensor_maps_choose_among_the_cp_tiles():
    """A gathered operand has no tensor map: its product's tile is chosen among the ``cp.async``
    tiles it will run on (not a TMA tile's fallback); a dense product still takes a TMA tile."""
    for M, N, K in ((320, 8192, 2880), (1280, 128, 11520), (512, 392, 4608)):
        assert WGMMA_CONFIGS[choose_wgmma_config(M, N, 1, K=K, tma=False)][3] == "cp", (M, N, K)
    assert WGMMA_CONFIGS[choose_wgmma_config(1024, 3072, 1, K=768)][3] == "tma"
    ops, _, _ = _channels_last_convs("float16")
    src = generate_cuda_source(ops, arch="sm_90")
    assert not any(launch.tensor_maps or launch.persistent for launch in src.launches.values())


@needs_nvcc
def test_channels_last_convs_compile_without_local_memory(tmp_path):
    """:func:`_channels_last_convs`' gathered kernels on every ``cp.async`` tile, and on TMA tiles
    (which fall back to those: a gathered operand has no tensor map), compile for sm_90a with no
    local memory."""
    ops, _, _ = _channels_last_convs("float16")
    tiles = ["128x256", "128x128", "64x128", "64x64", "tma128x128", "tma64x128", "128x128", "64x128"]
    _compiles_without_local_memory(tmp_path, list(zip(ops, tiles, strict=True)))


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_channels_last_convs(tmp_path, dt):
    """:func:`_channels_last_convs` on the GPU: the gathered wgmma kernels against numpy."""
    launches = _half_products_on_the_gpu(tmp_path, dt, *_channels_last_convs(dt))
    assert not any(launch.tensor_maps for launch in launches.values())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [c for c in MEASURED if WGMMA_CONFIGS[c][3] != "cp"])
def test_persistent_tma_gemm_with_fused_epilogue(tmp_path, cfg):
    """More tiles than blocks (each persistent block loops over several), rows and columns past the
    last tile, K not a multiple of 64, and a bias + tanh epilogue fused into the TMA kernel."""
    rng = np.random.default_rng(2)
    M, N, K = 4200, 1160, 328
    x = rng.standard_normal((M, K)).astype(np.float16)
    w = (rng.standard_normal((K, N)) / 8).astype(np.float16)
    launch = _bias_tanh_matches_numpy(tmp_path, x, w, rng.standard_normal((N,)).astype(np.float16), cfg)
    assert launch.tensor_maps and launch.grid[0] == 132


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ["tma64x128", "tma128x128"])
def test_split_k_tma_gemm(tmp_path, cfg):
    """A short, deep product (M = 128, K = 3000): few tiles, so K is split over several blocks
    whose partial sums the last one adds up before the fused epilogue."""
    rng = np.random.default_rng(3)
    M, N, K = 128, 776, 3000
    x = (rng.standard_normal((M, K)) / 8).astype(np.float16)
    w = (rng.standard_normal((K, N)) / 8).astype(np.float16)
    launch = _bias_tanh_matches_numpy(tmp_path, x, w, rng.standard_normal((N,)).astype(np.float16), cfg)
    wg, bn = WGMMA_CONFIGS[cfg][:2]
    tiles = -(-M // (64 * wg)) * -(-N // bn)
    assert launch.grid[0] == tiles * split_count(tiles, K) and split_count(tiles, K) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("split_min_kt", [4, 16])
def test_split_k_reductions_give_the_same_bits(tmp_path, monkeypatch, split_min_kt):
    """A split-K product launched with a block per unit (the splits of a tile wait for each other
    and sum a share of its chunks each) and with fewer blocks (the last split of a tile sums it
    all): both sum in split order, so the outputs are bitwise equal, and equal numpy's within the
    float16 rounding; three launches each (the counters are reset for the next)."""
    from shardflow.compiler.codegen import cuda_wgmma
    monkeypatch.setattr(cuda_wgmma, "SPLIT_MIN_KT", split_min_kt)
    M, N, K = 128, 776, 3000
    launch, by_grid, want = _product_on_grids(tmp_path, "tma64x128", M, N, K, (None, None, 5, None), seed=4)
    tiles = 2 * -(-N // 128)
    units = tiles * split_count(tiles, K)
    assert split_count(tiles, K) > 1 and launch.grid[0] == units
    outs = by_grid[None] + by_grid[5]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    got = outs[0].view(np.float16).astype(np.float32)
    np.testing.assert_allclose(got, want, atol=4e-3 * np.abs(want).max(), rtol=4e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ["128x128", "tma64x128", "tma128x256",  # (run apart: -k "pingpong or stream_k")
                                 pytest.param("pp64x128", id="pingpong-pp64x128"),
                                 pytest.param("sk64x128", id="stream_k-sk64x128")])
def test_residual_epilogues_match_numpy(tmp_path, cfg):
    """GEMM + bias + residual (RFC 0005 decision 22): four columns per thread with vector reads and
    stores (N = 136), one column per thread (N = 137), and a residual read across rows; rows and
    columns past the last tile."""
    cupy = _gpu()
    rng = np.random.default_rng(5)
    for name, (N, res_t) in {"vec": (136, False), "odd": (137, False), "res_t": (136, True)}.items():
        ops, shapes = _residual_epilogue(N, res_t, M=1100)
        path = str(tmp_path / f"{name}.cubin")
        launch = build_cuda_library(ops, path, arch="sm_90", cache_dir=str(tmp_path / "c"),
                                    gemm_configs={"out": cfg})["out"]
        arrays = {k: (rng.standard_normal(v) / (8 if k == "w" else 1)).astype(np.float16) for k, v in shapes.items()}
        res = arrays["res"].T if res_t else arrays["res"]
        w = arrays["w"].T if N % 2 else arrays["w"]
        want = arrays["x"].astype(np.float64) @ w.astype(np.float64) + arrays["bias"] + res
        out = cupy.full((1100, N), 0xFFFF, cupy.uint16).view(cupy.float16)
        dev = {k: cupy.asarray(v) for k, v in arrays.items()}
        dev[ops[0].outputs[0].name] = out
        _launch(cupy, cupy.RawModule(path=path), launch, tuple(dev[n] for n in launch.args))
        got = cupy.asnumpy(out).astype(np.float32)
        assert not np.isnan(got).any(), name
        np.testing.assert_allclose(got, want, atol=1e-2, rtol=4e-3, err_msg=f"{cfg} {name}")
