"""Measured: pipeline stages and microbatches on this machine's cpu ranks, against one rank, a plan over
the ranks, and onnxruntime, in one run.

Exports a GPT-2 (random weights; torch and transformers from the ``test`` extra), compiles it for the cpu
target in each configuration below, runs each with ``shardflow run --nproc N --repeat R`` (the ranks on
this machine, each bound to its share of the cores, as ``shardflow run`` starts them) and prints the
median time of a run (rank 0's), the largest difference of the logits from onnxruntime's, and
onnxruntime's own time in this process (its intra-op threads: every core).

    OPENBLAS_NUM_THREADS=1 python benchmarks/cpu_pipeline.py [--layers 4] [--embd 512] [--heads 8] [--vocab 8192]
        [--batch 8] [--seq 64] [--ranks 2] [--repeat 20] [--microbatches 1 2 4 8] [--balance modeled measured]
        [--only-stages] [--trace]

Configurations: ``1 rank`` (mesh [1], every core), ``ilp [N]`` and ``megatron [N]`` (one plan over N
ranks), ``stages N/m`` (``pipeline_stages = N`` on mesh [N], ``pipeline_microbatches = m``; ``measured``:
``pipeline_balance = "measured"``), each stage's op count after it. ``--trace``: each configuration also
run with ``shardflow run --trace`` (3 runs), and each rank's share of the traced span spent waiting on the
others (collectives, a pipeline's receives and sends) printed after it: a pipeline's bubble.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))
SHARDFLOW = [sys.executable, "-m", "shardflow.compiler.cli"]


def _run(out: str, nproc: int, inputs: str, outputs: str, repeat: int, throughput: bool = False
         ) -> tuple[float, float | None]:
    """``shardflow run`` of ``out`` on ``nproc`` ranks: (a single run's median ms, and with ``throughput``
    the ms a run took back to back, else None)."""
    proc = subprocess.run(SHARDFLOW + ["run", out, "--nproc", str(nproc), "--inputs", inputs, "--outputs", outputs,
                                       "--repeat", str(repeat), "--warmup", "2"]
                          + (["--throughput"] if throughput else []), capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    text = proc.stderr + proc.stdout
    pace = re.search(r"back to back: ([0-9.]+) ms a run", text) if throughput else None
    return float(re.search(r"median ([0-9.]+) ms", text).group(1)), float(pace.group(1)) if pace else None


def _waiting(out: str, nproc: int, inputs: str, trace: str) -> list[str]:
    """``shardflow run --trace`` of ``out`` (3 runs): each rank's waiting share of its span, as its summary
    prints it."""
    proc = subprocess.run(SHARDFLOW + ["run", out, "--nproc", str(nproc), "--inputs", inputs, "--repeat", "3",
                                       "--trace", trace], capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    rows = re.findall(r"^(?:\[rank 0\] )?\s*(\d+)\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+-?[0-9.]+\s+([0-9.]+)\s*$",
                      proc.stderr + proc.stdout, flags=re.M)
    return [w for _, w in rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--balance", nargs="+", choices=("modeled", "measured"), default=["modeled"],
                    help="what the stages' cut balances (distributed_config pipeline_balance): each is a row")
    ap.add_argument("--only-stages", action="store_true", help="leave out the configurations without stages")
    ap.add_argument("--trace", action="store_true", help="also trace each configuration: each rank's waiting share")
    args = ap.parse_args(argv)
    import onnxruntime as ort
    from export_models import export_gpt2

    from shardflow.compiler import compile

    n = args.ranks
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "gpt2.onnx")
        export_gpt2(path, n_layer=args.layers, n_embd=args.embd, n_head=args.heads, vocab_size=args.vocab,
                    seq_len=args.seq, batch=args.batch)
        rng = np.random.default_rng(0)
        feeds = {"input_ids": rng.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int64),
                 "attention_mask": np.ones((args.batch, args.seq), np.int64)}
        inputs = os.path.join(tmp, "in.npz")
        np.savez(inputs, **feeds)
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        ref = sess.run(None, feeds)[0]
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - t0)
        print(f"# GPT-2 {args.layers} layers, {args.embd} wide, {args.heads} heads, vocab {args.vocab}, "
              f"{args.batch}x{args.seq} tokens; {os.cpu_count()} cores; `shardflow run --repeat {args.repeat}` "
              "medians (rank 0), measured")
        print(f"{'config':<32} {'ranks':>5} {'ms':>9} {'vs first':>9} {'max |diff|':>11}")
        print(f"{'onnxruntime':<32} {'-':>5} {float(np.median(times)) * 1e3:9.2f} {'':>9} {'':>11}", flush=True)
        configs = [] if args.only_stages else [
            ("1 rank", {"mesh_shape": [1]}, 1), (f"ilp [{n}]", {"mesh_shape": [n]}, n),
            (f"megatron [{n}]", {"mesh_shape": [n], "algo": "megatron"}, n)]
        configs += [(f"stages {n}/{m}" + (f" {b}" if b != "modeled" else ""),
                     {"mesh_shape": [n], "pipeline_stages": n, "pipeline_microbatches": m, "pipeline_balance": b}, n)
                    for m in args.microbatches for b in args.balance]
        base = None
        for name, cfg, nproc in configs:
            out = os.path.join(tmp, re.sub(r"\W", "_", name))
            res = compile(path, distributed_config=cfg, optimization_config={"target": "cpu"}, out_dir=out)
            if hasattr(res, "pipeline"):  # (the cut: ops a stage)
                name += " " + "/".join(str(st["ops"]) for st in res.pipeline["stages"])
            got = os.path.join(tmp, "out.npz")
            ms, _ = _run(out, nproc, inputs, got, args.repeat)
            base = base or ms
            diff = float(np.abs(np.load(got)["logits"] - ref).max())
            waits = ""
            if args.trace:
                waits = "  waiting % a rank: " + ", ".join(_waiting(out, nproc, inputs, os.path.join(tmp, "t.json")))
            print(f"{name:<32} {nproc:5d} {ms:9.2f} {ms / base:9.2f} {diff:11.1e}{waits}", flush=True)


if __name__ == "__main__":
    main()
