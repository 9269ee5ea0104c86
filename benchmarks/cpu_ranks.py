"""Tensor parallelism on cpu ranks: one rank with T threads against N ranks with T/N threads each,
for plans made with the cpu device profile (the compile default for the cpu target), with the
H100 profile, and the Megatron baseline.

The model is BERT-base or a 170M Llama (``--export``; 1x128 tokens, random weights; needs torch +
transformers) or any ONNX file with an inputs .npz. Each variant is compiled (``shardflow compile``) and run with ``shardflow run
--repeat R --warmup 3`` (mpiexec when installed), in ``--rounds`` rounds over the variants in turn;
the figure is the median over rounds of rank 0's median time per run. The
ranks share this machine's cores, so on a 2-core machine N = 2 ranks of 1 thread compete with one
rank of 2 threads: what it shows is the plan and the communication overhead, not a speed-up.
First it runs ``shardflow calibrate --mesh N`` (prints what it measured: GEMM and memory throughput
per rank, the collectives' times and the fitted link figures) and adds a variant planned with
those figures (``--distributed-config`` the calibration file).

    python benchmarks/cpu_ranks.py [--nproc 2] [--threads 2] [--repeat 10] [--rounds 3] [--export bert|llama]
    python benchmarks/cpu_ranks.py --model M.onnx --inputs IN.npz
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


def _sh(*args, env=None, stdout_only=False) -> str:
    res = subprocess.run([sys.executable, "-m", "shardflow.compiler.cli", *map(str, args)], capture_output=True,
                         text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"shardflow {' '.join(map(str, args[:2]))} failed:\n{res.stderr[-3000:]}")
    return res.stdout if stdout_only else res.stdout + res.stderr


def _threads_env(threads: int, nproc: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(max(1, threads // nproc)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads in all (split over ranks)")
    ap.add_argument("--repeat", type=int, default=10, help="runs per `shardflow run` (its median is one figure)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds over the variants in turn; the figure is the median over rounds (default 3)")
    ap.add_argument("--model", default=None, help="an ONNX model (default: export --export's model)")
    ap.add_argument("--export", choices=("bert", "llama"), default="bert",
                    help="the model exported when --model is not given: BERT-base or the 170M Llama (default bert)")
    ap.add_argument("--inputs", default=None, help="its inputs (.npz keyed by input name)")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="shardflow-ranks-")
    model, inputs = args.model, args.inputs
    if model is None:
        from cpu_latency import export_text_model

        model, inputs = os.path.join(work, f"{args.export}.onnx"), os.path.join(work, f"{args.export}_in.npz")
        np.savez(inputs, **export_text_model(args.export, model))
    calibration = os.path.join(work, "machine.json")
    print(f"cpu: {_cpu_model()}, {os.cpu_count()} logical cores; {args.threads} threads in all; "
          f"model {os.path.basename(model)}")
    print(_sh("calibrate", "--mesh", args.nproc, "-o", calibration, env=_threads_env(args.threads, args.nproc),
              stdout_only=True).rstrip())
    variants = [("1 rank", 1, []), (f"{args.nproc} ranks, cpu plan", args.nproc, []),
                (f"{args.nproc} ranks, calibrated plan", args.nproc, ["--distributed-config", calibration]),
                (f"{args.nproc} ranks, h100 plan", args.nproc, ["--device", "h100"]),
                (f"{args.nproc} ranks, megatron", args.nproc, ["--algo", "megatron"])]
    plans = {}
    for name, n, flags in variants:
        out = os.path.join(work, re.sub(r"\W+", "_", name))
        _sh("compile", model, "-o", out, "--mesh", n, "-q", *flags)
        plans[name] = open(os.path.join(out, "plan.txt")).read().splitlines()
    # rounds over the variants in turn, so that a slow spell of the machine does not land on one
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for _ in range(args.rounds):
        for name, n, _ in variants:
            out = os.path.join(work, re.sub(r"\W+", "_", name))
            log = _sh("run", out, "--nproc", n, "--inputs", inputs, "--repeat", args.repeat, "--warmup", 3,
                      env=_threads_env(args.threads, n))
            times[name].append(float(re.search(r"median ([0-9.]+) ms", log).group(1)))
    for name, _, _ in variants:
        plan = plans[name]
        rounds = " ".join(f"{t:.1f}" for t in times[name])
        print(f"{name:<26} {np.median(times[name]):9.2f} ms (rounds: {rounds})   {plan[3][2:]:<40} {plan[1][2:]}",
              flush=True)

if __name__ == "__main__":
    sys.exit(main())
