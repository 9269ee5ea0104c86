"""The GPU benchmark scripts (benchmarks/gpu/) cannot rot: their GEMM dry run generates and compiles
real kernels with nvcc, and the pieces that need no GPU (case list, headline figures, tables,
result file naming) give the values they must. Skipped where nvcc is absent."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import tempfile

import numpy as np
import pytest

from shardflow.compiler.codegen import cuda as cg

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "gpu")
needs_nvcc = pytest.mark.skipif(cg._find_nvcc() is None, reason="nvcc is not installed")


def _load(name):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(f"sf_gpu_bench_{name}", os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_cases_cover_the_issue_shapes():
    gemm = _load("gemm")
    cases = gemm.make_cases()
    assert len(cases) == 3 * 8 * 2
    assert {(c.N, c.K) for c in cases} == {(2304, 768), (768, 768), (3072, 768), (768, 3072), (12288, 4096),
                                           (4096, 4096), (11008, 4096), (4096, 11008)}
    assert {c.M for c in cases} == {128, 1024, 8192} and {c.dtype for c in cases} == {"float16", "bfloat16"}
    assert len({c.id for c in cases}) == len(cases)
    assert [c.id for c in gemm.make_cases([128], ["gpt2.fc2"], ["bfloat16"])] == ["gpt2_fc2_M128_bfloat16"]
    with pytest.raises(SystemExit, match="gpt3"):
        gemm.make_cases([128], ["gpt3"])


def test_headline_figures():
    gemm = _load("gemm")
    recs = [{"id": "a", "dtype": "float16", "ratio": 0.5, "ok": True},
            {"id": "b", "dtype": "bfloat16", "ratio": 2.0, "ok": False}]
    s = gemm.summarize(recs)
    assert s["gemm_vs_cublas_min"] == 0.5 and s["gemm_vs_cublas_min_case"] == "a"
    assert s["gemm_vs_cublas_geomean"] == pytest.approx(1.0)
    assert s["all_correct"] is False and s["gemm_vs_cublas_min_bfloat16"] == 2.0
    models = _load("models")
    rec = {"ours_ms": 3.0, "ours_view_ms": 2.5, "torch_eager_ms": 6.0,
           "torch_compile": {"default": {"ms": 4.0}, "reduce-overhead": {"ms": 2.0}, "max-autotune": {"error": "x"}},
           "interleaved": {"default": {"torch_ms": 3.0, "ratio": 0.9},
                           "reduce-overhead": {"torch_ms": 2.5, "ratio": 1.1}}}
    _load("common").torch_ratios(rec)
    assert rec["torch_compile_mode"] == "reduce-overhead" and rec["vs_torch_compile"] == 1.5
    assert rec["vs_torch_eager"] == 0.5 and rec["vs_torch_compile_static"] == 1.25
    assert rec["interleaved_mode"] == "reduce-overhead" and rec["vs_torch_compile_interleaved"] == 1.1
    res = {"batches": {"1x128": {"vs_torch_compile": 0.8, "vs_torch_eager": 0.3, "vs_torch_compile_static": 0.7,
                                 "vs_torch_compile_interleaved": 0.75},
                       "8x128": {"vs_torch_compile": 1.2, "vs_torch_eager": 0.2, "vs_torch_compile_static": 0.9,
                                 "vs_torch_compile_interleaved": 0.95}}}
    assert models.headline(res, "gpt2_small") == {"gpt2_small_vs_torch_compile": 1.2, "gpt2_small_vs_torch_eager": 0.3,
                                                  "gpt2_small_vs_torch_compile_static_outputs": 0.9,
                                                  "gpt2_small_vs_torch_compile_interleaved": 0.95}
    res["batches"]["8x128"].pop("vs_torch_compile")  # a batch without a figure: no headline
    assert models.headline(res, "gpt2_small")["gpt2_small_vs_torch_compile"] is None


def test_interleaved_timing_alternates_the_contenders():
    """``time_interleaved``: each round runs every contender's untimed call and its timed calls in
    turn, the order rotating; each gets ``rounds * per_round`` timed calls."""
    common = _load("common")
    seen = []
    calls = {k: (lambda k=k: seen.append(k)) for k in ("ours", "torch")}
    syncs = []
    t = common.time_interleaved(calls, lambda: syncs.append(1), rounds=3, per_round=2)
    assert seen == ["ours"] * 3 + ["torch"] * 3 + ["torch"] * 3 + ["ours"] * 3 + ["ours"] * 3 + ["torch"] * 3
    assert len(syncs) == len(seen) and {k: v["calls"] for k, v in t.items()} == {"ours": 6, "torch": 6}
    assert all(v["min_ms"] <= v["ms"] for v in t.values())


def test_result_file_name():
    common = _load("common")
    assert common.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert common.slug("NVIDIA H200") == "nvidia-h200"


@needs_nvcc
def test_gemm_dry_run_builds_real_kernels(tmp_path):
    """Two small cases through the script's own build path: a real cubin per case, each holding
    the symbol its launch names, with the tensor-core kind of its dtype."""
    gemm = _load("gemm")
    out = tmp_path / "gemm.json"
    section = gemm.main(["--dry-run", "--m", "128", "--shapes", "gpt2.attn_out",
                         "--dtypes", "float16,bfloat16,tf32,float32",
                         "--jobs", "1", "--cache-dir", str(tmp_path / "cache"), "--json", str(out)])
    kernels = section["kernels"]
    assert [k["id"] for k in kernels] == ["gpt2_attn_out_M128_float16", "gpt2_attn_out_M128_bfloat16",
                                          "gpt2_attn_out_M128_tf32_nk", "gpt2_attn_out_M128_float32_nk"]
    # (float32 operands: B stored [N, K], on the wgmma template, opt-in in the compiler)
    assert [k["kind"] for k in kernels] == ["gemm-wgmma-f16", "gemm-wgmma-bf16", "gemm-wgmma-tf32", "gemm-wgmma-f32"]
    for k in kernels:
        assert k["grid"][0] * k["grid"][1] * k["grid"][2] > 0 and k["block"][0] in (128, 256, 384)
    cubins = list((tmp_path / "cache").rglob("*.cubin"))
    assert len(cubins) == 4
    for k in kernels:
        assert any(k["symbol"].encode() in c.read_bytes() and c.read_bytes()[:4] == b"\x7fELF" for c in cubins)
    assert json.loads(out.read_text())["kernels"] == kernels
    assert "gemm-wgmma-bf16" in section["table"]


@needs_nvcc
def test_gemm_dry_run_for_programmatic_dependent_launch(tmp_path):
    """``--pdl``: ours built for programmatic dependent launch with B a weight, so the persistent
    kernel (GPT-2's attn_out at M = 1024) loads B's first stages before its wait."""
    from shardflow.compiler.codegen.cuda import generate_cuda_source

    gemm = _load("gemm")
    section = gemm.main(["--dry-run", "--m", "1024", "--shapes", "gpt2.attn_out", "--dtypes", "float16", "--pdl",
                         "--jobs", "1", "--cache-dir", str(tmp_path / "cache")])
    assert section["pdl"] is True and section["kernels"][0]["persistent"]
    (case,) = gemm.make_cases([1024], ["gpt2.attn_out"], ["float16"])
    for weight in (True, False):
        src = generate_cuda_source([gemm.case_op(case, weight_b=weight)], arch="sm_90", pdl=True).text
        assert ("int sf_pre = 0;" in src) is weight


@needs_nvcc
def test_gemm_dry_run_with_measured_tiles(tmp_path, monkeypatch):
    """``--search-space 2``: each case built as the compiler's tuner builds it, one at a time (each
    times its candidates on the GPU); here a fake GPU, whose timer favours the 64x64 tile, the
    default choice of no case (128 threads, 2 x 12 blocks)."""
    from shardflow.compiler.codegen import tune

    gemm = _load("gemm")
    monkeypatch.setattr(tune, "gpu_name", lambda: "Fake GPU")
    monkeypatch.setattr(tune, "measure_on_gpu",
                        lambda cubin, launch, op: 1.0 if (launch.block[0], launch.grid[0]) == (128, 24) else 2.0)
    monkeypatch.setattr(tune, "output_on_gpu", lambda cubin, launch, op: np.zeros(op.outputs[0].shape, np.float32))
    section = gemm.main(["--dry-run", "--m", "128", "--shapes", "gpt2.attn_out", "--dtypes", "float16",
                         "--search-space", "2", "--jobs", "4", "--cache-dir", str(tmp_path / "cache")])
    (kernel,) = section["kernels"]
    assert section["search_space"] == 2 and kernel["block"][0] == 128 and kernel["grid"][0] == 2 * 12  # 64x64
    tuned = list((tmp_path / "cache" / "tune").rglob("*.json"))
    assert len(tuned) == 1 and json.loads(tuned[0].read_text())["config"] == "64x64"


@needs_nvcc
def test_attention_dry_run_builds_every_type(capsys):
    """attention.py's cases through its own build path: the fused kernel of each type (float32
    operands on the TF32 kernels: one product, or 3xTF32)."""
    attention = _load("attention")
    attention.main(["--dry-run", "--shapes", "gpt2", "--sizes", "1x1x4096", "--jobs", "2"])
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("gpt2_")]
    # a decoding step over 4096 keys: 12 heads' keys split over 11 blocks each (split-KV; float32
    # operands: 32 keys a step, the same 11)
    assert [(r[0], r[1], r[2]) for r in rows] == [("gpt2_1x1x4096_float16", "attention-f16", "11x12x1"),
                                                  ("gpt2_1x1x4096_bfloat16", "attention-bf16", "11x12x1"),
                                                  ("gpt2_1x1x4096_tf32", "attention-tf32", "11x12x1"),
                                                  ("gpt2_1x1x4096_float32", "attention-f32", "11x12x1")]
    # Llama 3 8B's: the 4 query heads of each of 8 KV heads in one block's rows, 16 splits each
    attention.main(["--dry-run", "--shapes", "llama3_8b", "--sizes", "1x1x4096", "--dtypes", "float16"])
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("llama3_8b_")]
    assert [(r[0], r[1], r[2]) for r in rows] == [("llama3_8b_1x1x4096_float16", "attention-f16", "16x8x1")]
    # Stable Diffusion 1.5's head size 40 (padded to 48 in shared memory on half operands)
    attention.main(["--dry-run", "--shapes", "sd15", "--sizes", "1x1024", "--dtypes", "float16"])
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("sd15_")]
    assert [(r[0], r[1], r[2]) for r in rows] == [("sd15_1x1024_float16", "attention-f16", "16x8x1")]
    with pytest.raises(SystemExit, match="gpt3"):
        attention.make_cases(["gpt3"])


@needs_nvcc
def test_conv_dry_run_builds_our_conv_kernels():
    """conv.py's cases through its own build path: on sm_90 a 1x1 conv over the batch of two
    latents takes the wgmma template, the images as the product's batch (rfcs/0005 decision 55); a
    3x3 conv too, gathering its windows from the image's channels-last copy (decision 57), whose
    kernel and the NCHW conv's of before (the portable template) are built beside it; a grouped 3x3
    conv likewise, a product per group (decision 62: its 32 groups the grid's third dimension); a
    2x2 transposed conv at stride 2 one product on wgmma too (decision 65)."""
    conv = _load("conv")
    section = conv.main(["--dry-run", "--shapes", "proj64,conv8,rnx14,samup64", "--dtypes", "float16", "--jobs", "2"])
    assert section["kinds"] == {"proj64_float16": "gemm-wgmma-f16", "conv8_float16": "gemm-wgmma-f16",
                                "rnx14_float16": "gemm-wgmma-f16", "samup64_float16": "gemm-wgmma-f16"}
    assert [c.name for c in conv.make_cases("up", ["float16"])] == ["samup64", "samup128", "unetup32"]
    with tempfile.TemporaryDirectory() as work:
        for shape, groups in (("conv8", 1), ("rnx14", 32)):
            built = conv._build_one(conv.make_cases("3x3", ["bfloat16"], [shape])[0], work, "sm_90")
            _, launch, _, launches, (_, nchw) = built
            assert (launch.kind, launches["copy"].kind, nchw.kind) == ("gemm-wgmma-bf16", "transpose", "gemm-bf16")
            assert list(launch.args[:launch.num_inputs]) == ["copy:0", "w_last", "b"]
            assert list(launches["copy"].args) == ["x", "copy:0"]
            assert launch.grid[2] == nchw.grid[2] == groups
    assert len(conv.make_cases()) == 2 * len(conv.SHAPES) and len(conv.make_cases("1x1", ["bfloat16"])) == 5
    with pytest.raises(SystemExit, match="proj99"):
        conv.make_cases(shapes=["proj99"])


@needs_nvcc
@pytest.mark.parametrize("model_dtype", ["float32", "float16"])
def test_cnn_dry_run_puts_every_conv_on_wgmma(tmp_path, model_dtype):
    """cnn.py's ResNet (two stages, 64x64 images, batch 2) exports and compiles for sm_90 with
    float16 products (or exported in float16): every conv on the wgmma template (rfcs/0005
    decisions 55-57: the stem's 3 channels padded to 8 in its channels-last copy), none on the
    portable one, and no transposed copy (decision 61: the block outputs stay channels-last); with
    ``channels_last=False`` (timed beside it on a GPU) the 3x3 convs and the stem take the portable
    template."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cnn = _load("cnn")
    res = cnn.main(["--dry-run", "--tiny", "--batches", "2", "--work-dir", str(tmp_path), "--model-dtype", model_dtype])
    rec = res["batches"]["2"]
    assert "compile_error" not in rec and "nchw_compile_error" not in rec and "error" not in res, rec
    assert res["model_dtype"] == model_dtype
    kinds = rec["kinds"]
    assert kinds.get("gemm-wgmma-f16", 0) >= 7 and "gemm-f16" not in kinds and "transpose" not in kinds, kinds
    # (beside it, the program with channels_last=False: its 3x3 convs and stem on the portable template)
    assert rec["nchw_kinds"].get("gemm-f16") == 3 and "transpose" not in rec["nchw_kinds"], rec["nchw_kinds"]


@needs_nvcc
def test_cnn_dry_run_puts_regnets_grouped_convs_on_wgmma(tmp_path):
    """``--model regnet`` (two stages, groups of 16 channels, squeeze-and-excite): its grouped
    convs a product per group on the wgmma template like the others (rfcs/0005 decision 62), none
    on the portable one; with ``channels_last=False`` the grouped and stem convs take it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cnn = _load("cnn")
    res = cnn.main(["--dry-run", "--tiny", "--model", "regnet", "--batches", "2", "--work-dir", str(tmp_path)])
    rec = res["batches"]["2"]
    assert res["model"] == "regnet" and "compile_error" not in rec and "error" not in res, rec
    assert rec["kinds"].get("gemm-wgmma-f16", 0) >= 9 and "gemm-f16" not in rec["kinds"], rec["kinds"]
    assert rec["nchw_kinds"].get("gemm-f16", 0) >= 3, rec["nchw_kinds"]


@needs_nvcc
def test_decode_dry_run_keeps_the_cache_on_the_device(tmp_path):
    """decode.py's step (a 2-layer grouped-heads model exported in float16 by torch) compiles for
    sm_90 with its four caches written in place, one fused attention per layer (its softmax in
    float32 as transformers writes it in half precision; the 2 query heads of each KV head in one
    block's rows) and the products on the GEMV template."""
    pytest.importorskip("torch")
    decode = _load("decode")
    section = decode.main(["--dry-run", "--tiny", "--max-len", "256", "--batches", "2", "--work-dir", str(tmp_path)])
    rec = section["batches"]["2"]
    assert "compile_error" not in rec, rec
    kinds = rec["kernel_kinds"]
    assert kinds.get("attention-f16") == 2 and kinds.get("gemv", 0) >= 8 and "row" in kinds, kinds
    assert rec["state_in_place"] == 4


def test_decode_self_test_on_the_cpu(tmp_path):
    """decode.py end to end on the cpu target (its self-test): our steps from an empty cache equal
    the float32 module's within float16's tolerance, the timed figures and ratios present."""
    pytest.importorskip("torch")
    decode = _load("decode")
    section = decode.main(["--target", "cpu", "--tiny", "--max-len", "64", "--batches", "1,3", "--repeat", "2",
                           "--warmup", "1", "--compile-modes", "", "--work-dir", str(tmp_path),
                           "--json", str(tmp_path / "d.json")])
    for b in ("1", "3"):
        rec = section["batches"][b]
        assert rec["finite"] and rec["rel_diff"] < 5e-3, rec
        assert rec["ours_ms"] > 0 and rec["vs_torch_eager"] > 0 and set(rec["ours_ms_by_pos"]) == {"8", "63"}
    assert json.loads((tmp_path / "d.json").read_text())["batches"]["3"]["state_in_place"] == 4


def test_models_self_test_of_the_synthetic_llama_on_the_cpu(tmp_path):
    """models.py with ``--models llama7b`` (the synthetic Llama written by tests/models/synth_llama.py,
    here its tiny preset) end to end on the cpu target: torch's module holds the same weights (our
    logits equal its float32 ones within float16's tolerance); a second run reuses the export."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    models = _load("models")
    argv = ["--target", "cpu", "--tiny", "--models", "llama7b", "--batches", "1", "--model-dtype", "float16",
            "--compile-modes", "", "--repeat", "2", "--warmup", "1", "--interleave", "0",
            "--export-dir", str(tmp_path / "e"), "--work-dir", str(tmp_path / "w")]
    os.makedirs(tmp_path / "e")
    os.makedirs(tmp_path / "w")
    for reused in (False, True):
        res = models.main(argv)["models"]["llama7b"]
        rec = res["batches"]["1x128"]
        assert res["reused_export"] == reused
        assert rec["rel_diff"] < 5e-3 and rec["ours_ms"] > 0 and rec["vs_torch_eager"] > 0, rec
        assert sorted(os.listdir(tmp_path / "e")) == ["llama7b.json", "llama7b.onnx", "llama7b.onnx.data"]
        assert res["n_params"] == 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 160 + 2 * 64) + 2 * 128 * 64 + 64


def test_tile_table_is_the_fit_of_the_committed_sweeps(capsys):
    """cuda_wgmma's tile efficiencies are what fit_tiles.py fits to the H100 sweeps in
    benchmarks/results (so the table and its stated origin cannot drift apart)."""
    from shardflow.compiler.codegen import cuda_wgmma as W

    res = os.path.join(BENCH, "..", "results")
    fit = _load("fit_tiles").main(["--sweep", os.path.join(res, "h100-2026-11-22-wgmma-tiles.txt"),
                                   os.path.join(res, "h100-2026-11-22-tma-tiles.txt"), "--spread-sweep",
                                   os.path.join(res, "h100-2026-11-23-tma-spread-split-tiles.txt")])
    assert fit["cp_factor"] == W._CP_FACTOR and fit["split"] == W._SPLIT_EFFICIENCY
    assert {k: v for k, v in fit.items() if k.startswith("tma")} == \
        {k: v for k, v in W._TILE_EFFICIENCY.items() if k.startswith("tma")}
    assert "shipped table: geomean 0.831" in capsys.readouterr().out


def test_the_fit_takes_ping_pong_tiles_from_a_sweep(tmp_path):
    """A sweep with a ping-pong tile's section (here: the tma128x256 figures, relabelled and made
    10% better) gives that tile an efficiency of its own, which then wins shapes."""
    res = os.path.join(BENCH, "..", "results")
    lines, section = [], None
    with open(os.path.join(res, "h100-2026-11-22-tma-tiles.txt")) as f:
        for ln in f:
            if ln.startswith("== "):
                section = ln.split()[1]
            elif section == "tma128x256" and re.match(r"\s+\S+_M\d+_float16\s+ours ", ln):  # a case line
                head, ratio = ln.rsplit(" ratio ", 1)
                value, rest = ratio.split(maxsplit=1)
                lines.append(f"{head} ratio {float(value) * 1.1:.3f} {rest}")
    assert lines
    sweep = tmp_path / "pp.txt"
    sweep.write_text("== pp64x256\n" + "".join(lines))
    fit = _load("fit_tiles").main(["--sweep", os.path.join(res, "h100-2026-11-22-wgmma-tiles.txt"),
                                   os.path.join(res, "h100-2026-11-22-tma-tiles.txt"), str(sweep)])
    assert fit["pp64x256"] > 0 and "pp64x256" not in fit["split"]


def test_fill_account_of_the_committed_sweep(capsys):
    """fill_account.py on session 33's H200 sweep: GPT-2's fc2 at M = 1024 on 64 x 128 tiles is 96
    blocks of 48 K steps of 24 KB (14.7 us at 80 GB/s; measured 14.5 us), and a cluster split-K
    tile's blocks take 1/C of the K steps each (the account it was built on)."""
    fa = _load("fill_account")
    sweep = os.path.join(BENCH, "..", "results", "h200-2026-11-28-95d3e9b-tile-sweep.txt")
    rows = fa.main([sweep, "--cases", "gpt2_fc2_M1024", "--tiles", "tma64x128"])
    assert rows == [["gpt2_fc2_M1024_float16", "tma64x128", 96, 14.5, 14.7, 0.99, 10.8]]
    assert "gpt2_fc2_M1024_float16" in capsys.readouterr().out
    assert fa.fill_us("tma64x128", 1024, 768, 3072, 80.0) == (48 * 24576 / 80e3, 96)
    assert fa.fill_us("ck128x128", 1024, 768, 3072, 80.0) == (24 * 32768 / 80e3, 96)
    assert fa.fill_us("ck4_64x128", 128, 768, 768, 80.0) == (3 * 24576 / 80e3, 48)
