"""Fused attention: our kernel vs torch's scaled_dot_product_attention, per type, causal.

    python benchmarks/gpu/attention.py [--shapes gpt2,llama7b] [--sizes 1x128,8x128,1x1024,1x4096,1x1x4096,8x1x4096]
                                       [--dtypes float16,bfloat16,tf32,float32] [--dry-run] [--json OUT.json]

What is compared
    ``softmax(Q Kᵀ / sqrt(D) + causal mask) V`` on ``[B, H, S, D]`` queries and ``[B, H, L, D]``
    keys and values (GPT-2's heads: H 12, D 64; Llama-7B's: H 32, D 128; Gemma-7B's, H 16, D 256,
    half types only, with ``--shapes gemma7b``; Stable Diffusion 1.5's, H 8, D 40, with ``--shapes sd15``:
    a head size the half kernel pads to 48 in shared memory, rfcs/0005 decision 50; Llama-3-8B's
    grouped heads, ``--shapes llama3_8b``:
    32 query heads over 8 KV heads, D 128, whose decoding steps take the 4 query heads of a KV head
    in one block's rows, rfcs/0005 decision 39), ``--sizes`` ``BxS``
    (``L = S``: a prompt) or ``BxSxL`` (``S`` queries after ``L - S`` cached keys: ``1x1x4096`` is
    a decoding step over a 4096-key cache, where ours splits the keys over several blocks,
    rfcs/0005 decision 36); query ``i`` sees keys ``j <= i + L - S``. Ours is the ``Attention`` op the
    driver fuses, compiled alone (``compiler/codegen/cuda_attention.py``): float16/bfloat16 operands
    with float32 accumulation (``mma.sync.m16n8k16``), or float32 operands on TF32 tensor cores
    (``m16n8k8``): one TF32 product (``tf32``) or 3xTF32 (``float32``, float32 accuracy;
    rfcs/0005 decision 35). Its output is float32 (what the op gives; a model's graph casts or
    fuses it further).

    Beside it, in the same run: ``torch.nn.functional.scaled_dot_product_attention`` with that
    mask (``is_causal=True`` when ``S = L``, none for one query; ``enable_gqa`` for grouped heads) on
    the same operands in the same
    type (its flash kernel for the halves; for
    float32 its memory-efficient or math kernel, TF32 allowed for ``tf32`` and not for
    ``float32``), output in the operands' type.

    ``TFLOP/s`` counts ``4 B H D`` times the keys the rows see (``S^2 / 2`` for a prompt: the two
    products over the keys a causal row sees).

Timing and correctness
    As ``gemm.py``: CUDA graphs of back-to-back launches rotating over enough input sets that each
    launch reads its operands from device memory (three times the L2 cache, at most 16 sets),
    median over ``--reps`` replays. Before timing, our output is poisoned with NaN and compared with
    torch's attention in float64: ``err = max|y - ref| / max|ref|`` must be within the type's
    tolerance (``TOLERANCE``).

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
from common import (build_alone, build_cases, dump_json, ensure_shardflow, first_run_error, fmt,  # noqa: E402
                    kernel_bench_args, our_launcher, print_built, run_cases, table)
from gemm import _time  # noqa: E402

#: (query heads, head size[, KV heads]) of the models' attention
HEADS = {"gpt2": (12, 64), "llama7b": (32, 128), "gemma7b": (16, 256),  # (gemma7b: half types only)
         "llama3_8b": (32, 128, 8), "sd15": (8, 40)}  # (sd15: Stable Diffusion 1.5's first level, padded to 48)
SIZES = ((1, 128, 128), (8, 128, 128), (1, 1024, 1024), (1, 4096, 4096), (1, 1, 4096), (8, 1, 4096))
DTYPES = ("float16", "bfloat16", "tf32", "float32")
#: largest error (of the output's largest value) each type may have against float64
TOLERANCE = {"float16": 1e-2, "bfloat16": 2e-2, "tf32": 5e-3, "float32": 1e-4}
MAX_SETS = 16


@dataclass(frozen=True)
class Case:
    model: str
    B: int
    S: int
    L: int
    dtype: str

    @property
    def H(self) -> int:
        return HEADS[self.model][0]

    @property
    def D(self) -> int:
        return HEADS[self.model][1]

    @property
    def Hk(self) -> int:
        return HEADS[self.model][-1] if len(HEADS[self.model]) > 2 else self.H

    @property
    def id(self) -> str:
        keys = "" if self.L == self.S else f"x{self.L}"
        return f"{self.model}_{self.B}x{self.S}{keys}_{self.dtype}"

    @property
    def flops(self) -> float:  # (query i sees L - S + i + 1 keys)
        return 4.0 * self.B * self.H * self.D * (self.S * (self.L - self.S) + self.S * (self.S + 1) / 2)


def make_cases(shapes=("gpt2", "llama7b"), sizes=SIZES, dtypes=DTYPES) -> list[Case]:
    unknown = (set(shapes) - set(HEADS)) | (set(dtypes) - set(DTYPES))
    if unknown:
        raise SystemExit(f"unknown shape(s) or type(s) {sorted(unknown)}; choose from {sorted(HEADS)}, {DTYPES}")
    ensure_shardflow()
    from shardflow.compiler.codegen.cuda_attention import takes_heads

    return [Case(m, b, s, n, dt) for m in shapes for (b, s, n) in sizes for dt in dtypes
            if takes_heads(HEADS[m][1], HEADS[m][1], float32=dt in ("tf32", "float32"))]


def _build_one(case: Case, work: str, arch: str):
    from shardflow.compiler.ir import Tensor
    from shardflow.compiler.ops.linalg import Attention

    half = case.dtype in ("float16", "bfloat16")
    ins = [Tensor(n, (case.B, case.H, case.S, case.D) if n == "q" else (case.B, case.Hk, case.L, case.D),
                  case.dtype if half else "float32") for n in "qkv"]
    op = Attention(ins, name=case.id, q_heads=case.H, kv_heads=case.Hk, scale=case.D ** -0.5,
                   scale_sqrt=case.D ** -0.25, acc_dtype="float32", is_causal=True, past_len=case.L - case.S,
                   **({"probs_dtype": case.dtype} if half else {}))
    return build_alone(op, work, arch, precision="float32" if half else case.dtype)


def run_case(case: Case, cubin: str, launch, reps: int, l2_bytes: int, torch, cp) -> dict:
    import torch.nn.functional as F

    dev = torch.device("cuda")
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(case.dtype, torch.float32)
    shape, kv_shape = (case.B, case.H, case.S, case.D), (case.B, case.Hk, case.L, case.D)
    esize = torch.tensor([], dtype=tdt).element_size()
    set_bytes = math.prod(shape) * (esize + 4) + 2 * math.prod(kv_shape) * esize
    nsets = max(1, min(MAX_SETS, math.ceil(3 * l2_bytes / set_bytes)))
    n = max(20, nsets)
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(case.id.encode()))
    sets = [[torch.randn(sh, device=dev, generator=gen).to(tdt) for sh in (shape, kv_shape, kv_shape)]
            + [torch.empty(shape, device=dev)] for _ in range(nsets)]
    # the causal mask: query i sees keys j <= i + L - S (torch's is_causal aligns it to the top left)
    causal = {"is_causal": True} if case.S == case.L else {} if case.S == 1 else {
        "attn_mask": torch.ones(case.S, case.L, dtype=torch.bool, device=dev).tril(case.L - case.S)}
    if case.Hk != case.H:
        causal["enable_gqa"] = True
    theirs_out = [torch.empty(shape, device=dev, dtype=tdt) for _ in range(nsets)]
    stream, cstream, ours = our_launcher(cubin, launch, sets, torch, cp)

    def theirs(i):
        q, k, v, _ = sets[i % nsets]
        theirs_out[i % nsets].copy_(F.scaled_dot_product_attention(q, k, v, **causal))

    torch.backends.cuda.matmul.allow_tf32 = case.dtype == "tf32"
    q, k, v, y = sets[0]
    err = first_run_error(ours, cstream, y, lambda: F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                                   **causal), torch)
    rec = asdict(case)
    rec.update(id=case.id, H=case.H, Hk=case.Hk, D=case.D, kind=launch.kind, grid=list(launch.grid),
               block=list(launch.block), shared_mem=int(launch.shared_mem), input_sets=nsets, err=err,
               ok=err is not None and err <= TOLERANCE[case.dtype])
    t_ours = _time(ours, stream, reps, torch, True, n)
    t_theirs = _time(theirs, stream, reps, torch, True, n)
    rec.update(ours_ms=t_ours, torch_sdpa_ms=t_theirs, ours_tflops=case.flops / t_ours / 1e9,
               torch_sdpa_tflops=case.flops / t_theirs / 1e9, ours_vs_torch=t_theirs / t_ours)
    return rec


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="gpt2,llama7b", help=f"comma-separated, of {sorted(HEADS)}")
    ap.add_argument("--sizes", default=",".join(f"{b}x{s}" + (f"x{n}" if n != s else "") for b, s, n in SIZES),
                    help="comma-separated BxS (a prompt) or BxSxL (S queries, L keys)")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {DTYPES}")
    kernel_bench_args(ap)
    args = ap.parse_args(argv)
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",") if s]
    sizes = [sz if len(sz) == 3 else (sz[0], sz[1], sz[1]) for sz in sizes]
    cases = make_cases([s for s in args.shapes.split(",") if s], sizes, [d for d in args.dtypes.split(",") if d])
    section: dict = {"arch": args.arch, "tolerance": TOLERANCE}
    with tempfile.TemporaryDirectory(prefix="sf-attention-") as work:
        built = build_cases(_build_one, cases, work, args.arch, args.jobs)
        if args.dry_run:
            print_built(cases, built)
            return section
        records, device = run_cases(run_case, cases, built, args.reps, lambda rec: (
            f"  {rec['id']:<26} ours {rec['ours_ms'] * 1e3:9.1f} us {rec['ours_tflops']:6.1f} TFLOP/s  torch "
            f"{rec['torch_sdpa_ms'] * 1e3:9.1f} us  x{rec['ours_vs_torch']:.2f}  err "
            f"{fmt(rec['err'], '.1e')}{'' if rec['ok'] else '  WRONG'}"))
    section.update(device=device, records=records, all_correct=all(r["ok"] for r in records))
    print(table(["case", "kind", "ours us", "ours TFLOP/s", "torch us", "torch TFLOP/s", "torch/ours", "err"],
                [[r["id"], r["kind"], fmt(r["ours_ms"] * 1e3, ".1f"), fmt(r["ours_tflops"], ".1f"),
                  fmt(r["torch_sdpa_ms"] * 1e3, ".1f"), fmt(r["torch_sdpa_tflops"], ".1f"),
                  fmt(r["ours_vs_torch"], ".2f"), fmt(r["err"], ".1e") if r["ok"] else "WRONG"] for r in records],
                align="<<>>>>>>"))
    dump_json(args.json, section)
    return section


if __name__ == "__main__":
    main()
