"""Tensor parallelism on cpu ranks: one rank with T threads against N ranks with T/N threads each,
for plans made with the cpu device profile (the compile default for the cpu target), with the
H100 profile, and the Megatron baseline.

The model is BERT-base (1x128 tokens, random weights; needs torch + transformers) or any ONNX file
with an inputs .npz. Each variant is compiled (``shardflow compile``) and run with ``shardflow run
--repeat R --warmup 3`` (mpiexec when installed); the figure is rank 0's median time per run. The
ranks share this machine's cores, so on a 2-core machine N = 2 ranks of 1 thread compete with one
rank of 2 threads: what it shows is the plan and the communication overhead, not a speed-up.
First it times MPI all-reduces of 4 KB to 12 MB between the ranks (mpi4py, median of 30), the
figures to set ``axis_bandwidth_GBps`` and ``axis_latency_us`` from (the defaults, 100 GB/s and
5 us, are NVLink-like).

    python benchmarks/cpu_ranks.py [--nproc 2] [--threads 2] [--repeat 10] [--model M.onnx --inputs IN.npz]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))
from cpu_latency import _cpu_model  # noqa: E402


def _sh(*args, env=None) -> str:
    res = subprocess.run([sys.executable, "-m", "shardflow.compiler.cli", *map(str, args)], capture_output=True,
                         text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"shardflow {' '.join(map(str, args[:2]))} failed:\n{res.stderr[-3000:]}")
    return res.stdout + res.stderr


_ALLREDUCE = r'''
import time, numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
for n in (1024, 98304, 786432, 3145728):
    a = np.ones(n, np.float32); b = np.empty_like(a)
    for _ in range(5): c.Allreduce(a, b)
    ts = []
    for _ in range(30):
        c.Barrier(); t = time.perf_counter(); c.Allreduce(a, b); ts.append(time.perf_counter() - t)
    if c.rank == 0: print(f"all-reduce {4 * n / 1e6:8.3f} MB  {np.median(ts) * 1e6:9.1f} us", flush=True)
'''


def _allreduce_times(nproc: int) -> None:
    import shutil

    if shutil.which("mpiexec") is None:
        print("(no mpiexec: all-reduce times skipped)")
        return
    res = subprocess.run(["mpiexec", "-n", str(nproc), sys.executable, "-c", _ALLREDUCE], capture_output=True,
                         text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    print(res.stdout.rstrip() or f"(mpiexec failed: {res.stderr[-500:]})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads in all (split over ranks)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--model", default=None, help="an ONNX model (default: export BERT-base)")
    ap.add_argument("--inputs", default=None, help="its inputs (.npz keyed by input name)")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="shardflow-ranks-")
    model, inputs = args.model, args.inputs
    if model is None:
        from cpu_latency import export_text_model

        model, inputs = os.path.join(work, "bert.onnx"), os.path.join(work, "bert_in.npz")
        np.savez(inputs, **export_text_model("bert", model))
    variants = [("1 rank", 1, []), (f"{args.nproc} ranks, cpu plan", args.nproc, []),
                (f"{args.nproc} ranks, h100 plan", args.nproc, ["--device", "h100"]),
                (f"{args.nproc} ranks, megatron", args.nproc, ["--algo", "megatron"])]
    print(f"cpu: {_cpu_model()}, {os.cpu_count()} logical cores; {args.threads} threads in all; "
          f"model {os.path.basename(model)}")
    _allreduce_times(args.nproc)
    for name, n, flags in variants:
        out = os.path.join(work, re.sub(r"\W+", "_", name))
        _sh("compile", model, "-o", out, "--mesh", n, "-q", *flags)
        plan = open(os.path.join(out, "plan.txt")).read().splitlines()
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, args.threads // n)))
        log = _sh("run", out, "--nproc", n, "--inputs", inputs, "--repeat", args.repeat, "--warmup", 3, env=env)
        med = re.search(r"median ([0-9.]+) ms", log)
        print(f"{name:<26} {float(med.group(1)):9.2f} ms   {plan[3][2:]:<40} {plan[1][2:]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
