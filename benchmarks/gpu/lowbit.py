"""4-bit weights at decoding sizes: our MatMulNBits kernel on the codes vs cuBLAS on float16 weights.

    python benchmarks/gpu/lowbit.py [--m 1,4,8] [--shapes llama7b.o,...] [--bits 4] [--block 32]
                                    [--dry-run] [--jobs 8] [--json OUT.json]

What is compared
    ``y[M, N] = a[M, K] @ W[K, N]`` with ``W`` stored as onnxruntime's ``MatMulNBits`` stores it:
    ``bits``-bit codes in blocks of ``--block`` along K, a float32 scale and zero point per block and
    column (``bq[N, K / block, block * bits / 8]`` uint8; 0.5 + 8 / 32 = 0.75 byte a weight at 4 bits
    and blocks of 32). ``a`` and ``y`` are float32 (the op's types). At M <= 15 our kernel is the
    gemv template (``compiler/codegen/cuda_gemv.py``: a warp per column walks the column's codes, the
    M rows' sums in registers), beyond it a tensor-core GEMM dequantizing in its operand loads.

    Beside it, in the same run: cuBLAS (``torch.matmul``) on the same weight dequantized to float16,
    ``W16[K, N]``, with ``a`` in float16: the dense half-precision product a model without low-bit
    weights runs (2 bytes a weight). At these sizes both are bound by reading the weight, so the
    4-bit kernel's goal is to be faster than that by up to the ratio of the bytes (2 / 0.75).
    ``ours GB/s`` is the weight's stored bytes (codes, scales, zero points) over our time.

Timing and correctness
    As ``gemm.py``: CUDA graphs of back-to-back launches rotating over enough input sets that each
    launch reads its weight from device memory (three times the L2 cache), median over ``--reps``
    replays. Before timing, ``y`` is poisoned and compared with ``a @ W`` in float32 (TF32 off) on
    the dequantized weight: ``err = max|y - ref| / max|ref|`` must be <= 1e-4 (float32 sums in
    another order).

``--dry-run`` generates and compiles every kernel (nvcc, no GPU needed) and prints its launch.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import zlib
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (build_alone, build_cases, dump_json, fmt, kernel_bench_args, print_built, run_cases,  # noqa: E402
                    table)
from gemm import PROJECTIONS, _cupy_view, _time  # noqa: E402

M_VALUES = (1, 4, 8)
TOLERANCE = 1e-4
MAX_SETS = 64


@dataclass(frozen=True)
class Case:
    model: str
    proj: str
    M: int
    N: int
    K: int
    bits: int = 4
    block: int = 32

    @property
    def id(self) -> str:
        return f"{self.model}_{self.proj.replace('|', '_')}_M{self.M}_q{self.bits}b{self.block}"

    @property
    def blocks(self) -> int:
        return -(-self.K // self.block)

    @property
    def weight_bytes(self) -> int:  # codes, then a float32 scale and zero point per block and column
        return self.N * self.blocks * (self.block * self.bits // 8 + 8)


def make_cases(m_values=M_VALUES, shapes=None, bits: int = 4, block: int = 32) -> list[Case]:
    """``m_values`` x the projections named by ``shapes`` (``gpt2``, ``llama7b`` or ``model.proj``;
    default Llama-7B's)."""
    want = set(shapes or ["llama7b"])
    known = {p[0] for p in PROJECTIONS} | {f"{p[0]}.{p[1]}" for p in PROJECTIONS}
    if want - known:
        raise SystemExit(f"unknown shape(s) {sorted(want - known)}; choose from {sorted(known)}")
    projs = [p for p in PROJECTIONS if p[0] in want or f"{p[0]}.{p[1]}" in want]
    return [Case(m, p, M, n, k, bits, block) for (m, p, n, k) in projs for M in m_values]


def _build_one(case: Case, work: str, arch: str):
    import numpy as np

    from shardflow.compiler.ir import Tensor, const_tensor
    from shardflow.compiler.ops.linalg import MatMulNBits

    # (the zero points a constant of whole numbers, as a model's are: the kernel then subtracts each
    # code's in one step; the values run are run_case's, passed like every other buffer)
    zp = const_tensor(np.zeros((case.N, case.blocks), np.float32), "zp")
    ins = [Tensor("a", (case.M, case.K), "float32"),
           Tensor("bq", (case.N, case.blocks, case.block * case.bits // 8), "uint8"),
           Tensor("scales", (case.N, case.blocks), "float32"), zp]
    op = MatMulNBits(ins, name=case.id, bits=case.bits, block_size=case.block)
    return build_alone(op, work, arch)


def run_case(case: Case, cubin: str, launch, reps: int, l2_bytes: int, torch, cp) -> dict:
    dev = torch.device("cuda")
    per = 8 // case.bits
    set_bytes = case.weight_bytes + 4 * case.M * (case.K + case.N)
    nsets = max(1, min(MAX_SETS, math.ceil(3 * l2_bytes / set_bytes)))
    n = max(20, nsets)
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(case.id.encode()))
    sets = []
    for _ in range(nsets):
        a = torch.randn(case.M, case.K, device=dev, generator=gen)
        bq = torch.randint(0, 256, (case.N, case.blocks, case.block // per), device=dev, generator=gen,
                           dtype=torch.uint8)
        scales = torch.rand(case.N, case.blocks, device=dev, generator=gen) * 0.02
        zp = torch.randint(0, 1 << case.bits, (case.N, case.blocks), device=dev, generator=gen).float()
        y = torch.empty(case.M, case.N, device=dev)
        sets.append((a, bq, scales, zp, y))

    def dequantized(bq, scales, zp):  # W[K, N] float32: code k of a block in bits (k % per) * bits of byte k / per
        shifts = torch.arange(per, device=dev, dtype=torch.uint8) * case.bits
        q = ((bq.unsqueeze(-1) >> shifts) & ((1 << case.bits) - 1)).reshape(case.N, case.blocks * case.block)
        w = (q[:, :case.K].float() - zp.repeat_interleave(case.block, 1)[:, :case.K]) \
            * scales.repeat_interleave(case.block, 1)[:, :case.K]
        return w.t().contiguous()

    halves = [(a.half(), dequantized(bq, s, z).half(), torch.empty(case.M, case.N, device=dev, dtype=torch.float16))
              for a, bq, s, z, _ in sets]
    module = cp.RawModule(path=cubin)
    fn = module.get_function(launch.symbol)
    stream = torch.cuda.Stream()
    cstream = cp.cuda.ExternalStream(stream.cuda_stream)
    views = [[_cupy_view(x, cp) for x in s] for s in sets]
    grid, block = tuple(launch.grid), tuple(launch.block)

    def ours(i):
        fn(grid, block, views[i % nsets], shared_mem=int(launch.shared_mem), stream=cstream)

    def cublas(i):
        a16, w16, y16 = halves[i % nsets]
        torch.matmul(a16, w16, out=y16)

    a, bq, scales, zp, y = sets[0]
    torch.cuda.synchronize()
    y.fill_(float("nan"))
    torch.cuda.synchronize()
    ours(0)
    cstream.synchronize()
    ref = a @ dequantized(bq, scales, zp)
    nan = bool(torch.isnan(y).any().item())
    err = (y - ref).abs().max().item() / ref.abs().max().item()
    rec = asdict(case)
    rec.update(id=case.id, kind=launch.kind, grid=list(grid), block=list(block), weight_bytes=case.weight_bytes,
               input_sets=nsets, err=None if nan else err, ok=(not nan) and err <= TOLERANCE)
    t_ours = _time(ours, stream, reps, torch, True, n)
    t_cublas = _time(cublas, stream, reps, torch, True, n)
    rec.update(ours_ms=t_ours, cublas_fp16_ms=t_cublas, ours_gbs=case.weight_bytes / t_ours / 1e6,
               cublas_fp16_gbs=2 * case.N * case.K / t_cublas / 1e6, speedup_vs_fp16=t_cublas / t_ours)
    return rec


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default=",".join(map(str, M_VALUES)), help="comma-separated M values")
    ap.add_argument("--shapes", default="llama7b", help="comma-separated: gpt2, llama7b or model.proj")
    ap.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    ap.add_argument("--block", type=int, default=32)
    kernel_bench_args(ap, reps=30)
    args = ap.parse_args(argv)
    cases = make_cases([int(x) for x in args.m.split(",") if x], [s for s in args.shapes.split(",") if s],
                       args.bits, args.block)
    section: dict = {"bits": args.bits, "block": args.block, "arch": args.arch, "tolerance": TOLERANCE}
    with tempfile.TemporaryDirectory(prefix="sf-lowbit-") as work:
        built = build_cases(_build_one, cases, work, args.arch, args.jobs)
        if args.dry_run:
            print_built(cases, built)
            return section
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        records, device = run_cases(run_case, cases, built, args.reps, lambda rec: (
            f"  {rec['id']:<34} ours {rec['ours_ms'] * 1e3:8.1f} us {rec['ours_gbs']:7.0f} GB/s  cuBLAS fp16 "
            f"{rec['cublas_fp16_ms'] * 1e3:8.1f} us  x{rec['speedup_vs_fp16']:.2f}  err "
            f"{fmt(rec['err'], '.1e')}{'' if rec['ok'] else '  WRONG'}"))
    section.update(device=device, records=records, all_correct=all(r["ok"] for r in records))
    print(table(["case", "kind", "ours us", "ours GB/s", "cuBLAS fp16 us", "fp16 GB/s", "speedup", "err"],
                [[r["id"], r["kind"], fmt(r["ours_ms"] * 1e3, ".1f"), fmt(r["ours_gbs"], ".0f"),
                  fmt(r["cublas_fp16_ms"] * 1e3, ".1f"), fmt(r["cublas_fp16_gbs"], ".0f"),
                  fmt(r["speedup_vs_fp16"], ".2f"), fmt(r["err"], ".1e") if r["ok"] else "WRONG"] for r in records],
                align="<<>>>>>>"))
    dump_json(args.json, section)
    return section


if __name__ == "__main__":
    main()
