"""``search_space=2``: measured wgmma tiles (compiler/codegen/tune.py).

The measuring function is replaced by a fake here (CI has no GPU): which tile wins, that the
choice reaches the kernel, that it is cached per kernel source and device, that a tile whose
values differ from the default tile's is not used, and that without a GPU the default choice is
kept. The real measurement (``measure_on_gpu``) needs cupy and a device.
"""
from __future__ import annotations

import glob
import json
import logging
import itertools
import shutil
import threading

import numpy as np
import pytest

from shardflow.compiler.codegen import cuda, tune
from shardflow.compiler.codegen.cuda import build_cuda_library
from shardflow.compiler.codegen.toolchain import CompileError
from shardflow.compiler.codegen.cuda_wgmma import choose_wgmma_config
from shardflow.compiler.ir import Tensor
from shardflow.compiler.ops.linalg import Gemm, MatMul

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


def _ops():  # two identical layers and one other shape
    mk = lambda n, m, k, nn: MatMul([Tensor(f"{n}a", (m, k), "float16"), Tensor(f"{n}b", (k, nn), "float16")],  # noqa: E731
                                    name=n)
    return [mk("l0", 1024, 256, 768), mk("l1", 1024, 256, 768), mk("head", 128, 256, 512)]


@needs_nvcc
def test_measured_tiles_are_used_and_cached(tmp_path, monkeypatch):
    calls = []

    def fake(cubin, launch, op):
        calls.append((op.name, launch.block[0], launch.grid[0]))
        assert cubin  # compiled for real
        return {128: 2.0, 256: 3.0, 384: 4.0}[launch.block[0]] / launch.grid[0]  # prefers many small blocks

    monkeypatch.setattr(tune, "gpu_name", lambda: "Fake GPU")
    monkeypatch.setattr(tune, "measure_on_gpu", fake)
    monkeypatch.setattr(tune, "output_on_gpu", lambda cubin, launch, op: np.zeros(op.outputs[0].shape, np.float32))
    compiled = []  # every nvcc run: the candidates' too go through the kernel cache
    real_nvcc = cuda._compile_nvcc
    monkeypatch.setattr(cuda, "_compile_nvcc",
                        lambda nvcc, src, arch: compiled.append(src) or real_nvcc(nvcc, src, arch))
    cache = str(tmp_path / "cache")
    launches = build_cuda_library(_ops(), str(tmp_path / "k.cubin"), arch="sm_90", cache_dir=cache, search_space=2)
    assert choose_wgmma_config(1024, 768, 1) != "64x64"  # the measurement, not the default, decided
    assert launches["l0"].block == (128, 1, 1) and launches["l0"].grid[0] == 16 * 12  # 64x64 tiles
    # l1 has l0's kernel: measured once; 15 tiles (4 cp.async, 4 TMA, 3 ping-pong, 4 stream-K) per distinct kernel
    n = len(tune.CANDIDATES)
    assert n == 15 and len(calls) == 2 * n and {c[0] for c in calls} == {"l0", "head"}
    records = {r["op"]: r for r in (json.load(open(p)) for p in glob.glob(f"{cache}/tune/*/*.json"))}
    assert records["l0"]["config"] == "64x64" and records["l0"]["device"] == "Fake GPU"
    assert all(set(r["ms"]) == set(tune.CANDIDATES) and r["rejected"] == [] for r in records.values())
    # per distinct kernel its tiles (the default tile among them), and the program
    assert len(compiled) == 2 * n + 1
    # a second build reads the choices back: nothing is measured
    monkeypatch.setattr(tune, "measure_on_gpu", lambda *a: pytest.fail("measured again"))
    again = build_cuda_library(_ops(), str(tmp_path / "k2.cubin"), arch="sm_90", cache_dir=cache, search_space=2)
    assert again == launches
    # another GPU measures for itself
    monkeypatch.setattr(tune, "gpu_name", lambda: "Other GPU")
    monkeypatch.setattr(tune, "measure_on_gpu", fake)
    calls.clear()
    compiled.clear()
    build_cuda_library(_ops(), str(tmp_path / "k3.cubin"), arch="sm_90", cache_dir=cache, search_space=2)
    assert len(calls) == 2 * n and compiled == []  # measured again, from the cached cubins


def test_which_tiles_are_candidates(tmp_path, monkeypatch):
    """The tiles fed by TMA (plain, ping-pong, stream-K) are measured only for a product whose
    operands TMA loads (not a batched one: they would fall back to the cp.async tiles measured
    already), and the ping-pong and stream-K ones only on half operands, the only ones a GPU has
    run them on (not a float32 product's TF32 steps)."""
    monkeypatch.setattr(tune, "gpu_name", lambda: "Fake GPU")
    kinds = {}

    def measure(cubin, launch, op):
        kinds.setdefault(op.name, set()).add(launch.kind)
        return 1.0
    batched = MatMul([Tensor("xa", (4, 256, 64), "float16"), Tensor("xb", (4, 64, 256), "float16")], name="batched")
    # (float32 operands on the wgmma template: B K-major, a Linear's weight stored [N, K])
    tf32 = Gemm([Tensor("ya", (512, 256), "float32"), Tensor("yb", (384, 256), "float32")], name="tf32", trans_b=True)
    cp_tma = ["128x256", "128x128", "64x128", "64x64", "tma128x256", "tma128x192", "tma128x128", "tma64x128"]
    for ops, precision, want in (([_ops()[0]], "float16", list(tune.CANDIDATES)),
                                 ([batched], "float16", cp_tma[:4]),
                                 ([tf32], "tf32", cp_tma)):
        cache = str(tmp_path / ops[0].name)
        tune.tune_gemms(ops, arch="sm_90", precision=precision, cache_dir=cache, wgmma_fp32=True,
                        compile_source=lambda src: src.text.encode(), measure=measure,
                        output=lambda cubin, launch, op: np.zeros(op.outputs[0].shape, np.float32))
        (record,) = [json.load(open(p)) for p in glob.glob(f"{cache}/tune/*/*.json")]
        assert sorted(record["ms"]) == sorted(want), ops[0].name
    assert kinds == {"l0": {"gemm-wgmma-f16"}, "batched": {"gemm-wgmma-f16"}, "tf32": {"gemm-wgmma-tf32"}}


def test_candidates_compile_at_once_and_a_compile_error_is_raised(tmp_path, monkeypatch):
    """The candidates of all GEMMs are compiled concurrently (each compile waits here until
    another one runs beside it: compiled one by one, the barrier would time out); a candidate's
    compile error stops the tuning with that error."""
    monkeypatch.setattr(tune, "gpu_name", lambda: "Fake GPU")
    monkeypatch.setattr(tune.os, "cpu_count", lambda: 2)
    both = threading.Barrier(2, timeout=30)

    def compile_source(src):
        both.wait()
        return src.text.encode()
    chosen = tune.tune_gemms(_ops(), arch="sm_90", precision="float16", cache_dir=str(tmp_path / "a"),
                             compile_source=compile_source, measure=lambda cubin, launch, op: 1.0 / launch.grid[0],
                             output=lambda cubin, launch, op: np.zeros(op.outputs[0].shape, np.float32))
    assert set(chosen) == {"l0", "l1", "head"} and chosen["l0"] == chosen["l1"]

    count = itertools.count()

    def failing(src):  # the third compile fails
        if next(count) == 2:
            raise CompileError("nvcc failed on the kernels of l0", ["l0"])
        return b"cubin"
    with pytest.raises(CompileError, match="l0"):
        tune.tune_gemms(_ops(), arch="sm_90", precision="float16", cache_dir=str(tmp_path / "b"),
                        compile_source=failing, measure=lambda *a: 1.0, output=lambda *a: np.zeros(1))


def test_a_tile_with_other_values_is_not_used_however_fast(tmp_path, monkeypatch, caplog):
    """The fastest tile gives other values than the default tile on the same operands (a NaN
    where the default has a number, or an element off by more than 1% of the largest): it is
    not chosen, and the log and the cache record say so."""
    monkeypatch.setattr(tune, "gpu_name", lambda: "Fake GPU")
    monkeypatch.setattr(tune, "measure_on_gpu", lambda cubin, launch, op: 1.0 / launch.grid[0])  # the most blocks
    fastest = "64x64"  # (16 x 12 blocks: the most of any tile at 1024 x 768)

    def output(cubin, launch, op):
        out = np.ones(op.outputs[0].shape, np.float32)
        if launch.grid[0] == 16 * 12:  # the fastest tile's kernel
            out[3, 5] = bad
        return out
    monkeypatch.setattr(tune, "output_on_gpu", output)
    for bad in (np.nan, 1.02):
        cache = str(tmp_path / f"cache{bad}")
        with caplog.at_level(logging.WARNING, logger="shardflow.compiler.codegen.tune"):
            chosen = tune.tune_gemms(_ops()[:1], arch="sm_90", precision="float16", cache_dir=cache,
                                     compile_source=lambda src: b"cubin")
        assert chosen["l0"] != fastest and fastest in caplog.text and "not used" in caplog.text
        (record,) = [json.load(open(p)) for p in glob.glob(f"{cache}/tune/*/*.json")]
        assert record["rejected"] == [fastest] and fastest not in record["ms"]
    # within 1%: the same values (another summation order)
    bad = 1.005
    chosen = tune.tune_gemms(_ops()[:1], arch="sm_90", precision="float16", cache_dir=str(tmp_path / "ok"),
                             compile_source=lambda src: b"cubin")
    assert chosen["l0"] == fastest


def test_without_a_gpu_level_2_keeps_the_default(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tune, "gpu_name", lambda: None)
    ops = _ops()
    with caplog.at_level(logging.INFO, logger="shardflow.compiler.codegen.tune"):
        chosen = tune.tune_gemms(ops, arch="sm_90", precision="float32", cache_dir=str(tmp_path),
                                 compile_source=lambda s: pytest.fail("compiled"))
    assert chosen == {} and "no CUDA device" in caplog.text
    # cpu-only GEMMs (other architectures: no wgmma) are not tuned either
    monkeypatch.setattr(tune, "gpu_name", lambda: "Fake GPU")
    assert tune.tune_gemms(ops, arch="sm_80", precision="float32", cache_dir=str(tmp_path),
                           compile_source=lambda s: pytest.fail("compiled")) == {}


@pytest.mark.gpu
def test_measures_on_the_gpu(tmp_path):
    if tune.gpu_name() is None:
        pytest.skip("no CUDA device (or cupy is not installed)")
    cache = str(tmp_path / "cache")
    launches = build_cuda_library(_ops(), str(tmp_path / "k.cubin"), arch="sm_90", cache_dir=cache, search_space=2)
    records = [json.load(open(p)) for p in glob.glob(f"{cache}/tune/*/*.json")]
    assert len(records) == 2 and all(r["config"] in tune.CANDIDATES for r in records)
    assert all(0 < t < 10 for r in records for t in r["ms"].values()), records
    assert all(r["ms"][r["config"]] == min(r["ms"].values()) for r in records)
    assert launches["l0"].kind == "gemm-wgmma-f16"
    print({r["op"]: r["ms"] for r in records})
