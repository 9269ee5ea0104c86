"""What the run-time index checks cost on the cpu target (``optimization_config["index_checks"]``,
compiler/passes/index_checks.py; rfcs/0002 "Lowering"), beside onnxruntime.

The committed onnxruntime-genai decoding steps (``tests/models/llama_genai_fp32.onnx``: one check, its
``seqlens_k`` in the cache; ``gptoss_genai_fp32.onnx``: two, ``seqlens_k`` and the windowed layer's
rotary rows) and GPT-2 (``gpt2_ts17.onnx``: its token ids checked before the run, no kernel) compiled
for one cpu rank with the checks and without, then timed in alternating rounds (this VM's speed drifts
within minutes: each round times ``--runs`` whole runs of each build, the ratio is taken per round,
then its median), and onnxruntime on the same inputs.

    python benchmarks/cpu_index_checks.py [--rounds 15] [--runs 40]

Prints per model: the number of check kernels, the median run of each build (ms, the median over the
rounds of each round's median), the paired ratio (checks / none) and onnxruntime's median.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "tests", "models")
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _median_run(prog, feeds, runs: int) -> float:
    laps = []
    for _ in range(runs):
        t0 = time.perf_counter()
        prog.run(feeds)
        laps.append(time.perf_counter() - t0)
    return statistics.median(laps)


def bench(name: str, feeds: dict, rounds: int, runs: int) -> None:
    import onnxruntime as ort

    from shardflow.compiler import compile
    from shardflow.runtime import load

    path = os.path.join(MODELS, f"{name}.onnx")
    shapes = {k: v.shape for k, v in feeds.items()}
    work = tempfile.mkdtemp(prefix="sf-index-checks-")
    progs, checks = {}, 0
    for on in (True, False):
        out = os.path.join(work, "on" if on else "off")
        compile(path, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu", "index_checks": on},
                out_dir=out, input_shapes=shapes)
        if on:
            with open(os.path.join(out, "rank0", "manifest.json")) as f:
                checks = len(json.load(f).get("index_checks", ()))
        progs[on] = load(out)
        progs[on].run(feeds)
    times: dict[bool, list[float]] = {True: [], False: []}
    ratios = []
    for _ in range(rounds):
        for on in (True, False):
            times[on].append(_median_run(progs[on], feeds, runs))
        ratios.append(times[True][-1] / times[False][-1])
    so = ort.SessionOptions()
    so.intra_op_num_threads = os.cpu_count() or 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    ort_t = _median_run(type("S", (), {"run": lambda self, f: sess.run(None, f)})(), feeds, rounds * runs)
    print(f"{name}: {checks} check kernel(s); with checks {1e3 * statistics.median(times[True]):.3f} ms, without "
          f"{1e3 * statistics.median(times[False]):.3f} ms, paired ratio {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); onnxruntime {1e3 * ort_t:.3f} ms", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--runs", type=int, default=40)
    args = ap.parse_args(argv)
    from model_refs import genai_llama_feeds, gptoss_step_feeds

    print(f"cpu: {os.cpu_count()} cores; {args.rounds} rounds of {args.runs} runs per build")
    bench("llama_genai_fp32", genai_llama_feeds("decode"), args.rounds, args.runs)
    bench("gptoss_genai_fp32", gptoss_step_feeds(), args.rounds, args.runs)
    bench("gpt2_ts17", dict(np.load(os.path.join(MODELS, "gpt2_inputs.npz"))), args.rounds, args.runs)


if __name__ == "__main__":
    main()
