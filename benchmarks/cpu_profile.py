"""Per-kernel times of a cpu rank program beside onnxruntime's per-node times: where a model's
latency goes, and against which of onnxruntime's op kinds.

    python benchmarks/cpu_profile.py MODEL.onnx [--inputs IN.npz] [--threads 2] [--reps 20] [--top 20]
    python benchmarks/cpu_profile.py --sized bert|llama|gpt2|resnet [...]

The model is compiled for one rank (target cpu) and run once; then every kernel step is called
on its own, in program order, ``--reps`` times back to back on the program's own buffers, and the
figure is the median per call (operands warm in cache, as after the step before them; the sum
is printed beside the whole run's median). onnxruntime runs the same inputs with its profiler
on (``SessionOptions.enable_profiling``) and the same thread count; its per-node durations are
summed per op type (medians over ``--reps`` runs). Our kernels are fused groups named after
their last op, so compare the totals, and the op kinds loosely (onnxruntime fuses too:
``FusedMatMul``, ``SkipLayerNormalization``...). Inputs: ``--inputs``, else zeros for floats
and ones for integers (token ids 1, masks all ones).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))
from cpu_latency import _cpu_model, _medians_ms, in_child  # noqa: E402


def profile_ours(path: str, feeds: dict, reps: int, work: str) -> dict:
    """Compile ``path`` for one cpu rank; per kernel step its median time per call (ms)."""
    from shardflow.compiler import compile
    from shardflow.runtime import load

    out = os.path.join(work, "prog")
    compile(path, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=out)
    prog = load(out, rank=0)
    run_ms, = _medians_ms([lambda: prog.run(feeds, copy_outputs=False)], reps)
    kernel_steps = [s for s in prog.program["steps"][prog.load_steps:] if s["kind"] == "kernel"]  # run ones
    calls = [c for calls, _ in prog._segments for c in calls]  # (fn, ins, outs, ...) per kernel step
    assert len(calls) == len(kernel_steps)
    steps = []
    for s, (fn, a, b, _, _) in zip(kernel_steps, calls):
        fn(a, b)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(a, b)
            times.append(time.perf_counter() - t0)
        steps.append({"node": s["node"], "op_type": s.get("op_type", "?"), "ms": 1e3 * statistics.median(times)})
    return {"run_ms": run_ms, "steps": steps}


def profile_onnxruntime(path: str, feeds: dict, threads: int, reps: int, work: str) -> dict:
    """onnxruntime's median run (ms, profiler off) and its per-op-type node time per run (ms)."""
    import onnxruntime as ort

    def session(profiling: bool):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        if profiling:
            opts.enable_profiling = True
            opts.profile_file_prefix = os.path.join(work, "ort")
        return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    plain = session(False)
    run_ms, = _medians_ms([lambda: plain.run(None, feeds)], reps)
    prof = session(True)
    for _ in range(3 + reps):
        prof.run(None, feeds)
    with open(prof.end_profiling()) as f:
        events = json.load(f)
    per_run: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * (3 + reps))
    run = -1
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            run += 1
        elif e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and 0 <= run < 3 + reps:
            per_run[e["args"].get("op_name", "?")][run] += e["dur"] / 1e3
    by_type = {k: statistics.median(v[3:]) for k, v in per_run.items()}
    return {"run_ms": run_ms, "by_type": by_type}


def default_feeds(path: str) -> dict:
    import onnx

    model = onnx.load(path, load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for i in model.graph.input:
        if i.name in inits:
            continue
        t = i.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        feeds[i.name] = (np.zeros if dtype.kind == "f" else np.ones)(shape, dtype)
    return feeds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="an ONNX model with static shapes")
    ap.add_argument("--sized", choices=("bert", "llama", "gpt2", "resnet"),
                    help="export a full-sized model first (as cpu_latency.py --sized does; needs torch + transformers)")
    ap.add_argument("--inputs", help="an .npz of the model's inputs")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    if (args.model is None) == (args.sized is None):
        ap.error("give a model file or --sized, not both")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    with tempfile.TemporaryDirectory() as work:
        path = args.model
        feeds = dict(np.load(args.inputs)) if args.inputs else None
        if args.sized:
            path = os.path.join(work, f"{args.sized}.onnx")
            # (exported in a child process: torch stays out of the timing process; cpu_latency.in_child)
            if args.sized == "resnet":
                feeds = in_child("export_resnet50", path)
            elif args.sized == "gpt2":
                in_child("export_models:export_gpt2", path, n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                         seq_len=128, batch=1)
            else:
                feeds = in_child("export_text_model", args.sized, path)
        feeds = feeds if feeds is not None else default_feeds(path)
        ours = profile_ours(path, feeds, args.reps, work)
        ort = profile_onnxruntime(path, feeds, args.threads, args.reps, work)
    print(f"cpu: {_cpu_model()}, {os.cpu_count()} logical cores; threads: {args.threads}; model: "
          f"{args.sized or os.path.basename(path)}")
    total = sum(s["ms"] for s in ours["steps"])
    print(f"shardflow: run {ours['run_ms']:.3f} ms, sum of {len(ours['steps'])} kernels alone {total:.3f} ms; "
          f"onnxruntime: run {ort['run_ms']:.3f} ms, sum of node times {sum(ort['by_type'].values()):.3f} ms")
    print(f"\ntop {args.top} kernels (shardflow)")
    for s in sorted(ours["steps"], key=lambda s: -s["ms"])[:args.top]:
        print(f"  {s['ms']:9.3f} ms  {100 * s['ms'] / total:5.1f}%  {s['op_type']:<22} {s['node']}")
    mine: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.Counter()
    for s in ours["steps"]:
        mine[s["op_type"]] += s["ms"]
        count[s["op_type"]] += 1
    print("\nper op type: shardflow (kernels named by their last op)          onnxruntime (nodes)")
    left = sorted(mine.items(), key=lambda kv: -kv[1])
    right = sorted(ort["by_type"].items(), key=lambda kv: -kv[1])
    for k in range(max(len(left), len(right))):
        a = f"{left[k][0]:<22} {left[k][1]:9.3f} ms ({count[left[k][0]]:3d})" if k < len(left) else ""
        b = f"{right[k][0]:<26} {right[k][1]:9.3f} ms" if k < len(right) else ""
        print(f"  {a:<48}  {b}")


if __name__ == "__main__":
    main()
