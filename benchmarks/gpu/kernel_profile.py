"""Per-kernel times of one compiled cuda rank program: where a model's latency goes.

    python benchmarks/gpu/kernel_profile.py OUT_DIR [--rank 0] [--reps 10] [--top 25] [--json FILE]
    python benchmarks/gpu/kernel_profile.py --model gpt2_small --batch 8 [--precision float16] [--work DIR]

The first form profiles an artifact folder written by ``shardflow.compile(target="cuda")``; the
second exports the model (``export_models.py``, as ``models.py`` does) and compiles it first.

Method: the program runs once (inputs zero), then every kernel step on its own, in program order:
``--reps`` launches of it captured in a CUDA graph (with the engine's own capture), the graph
replayed between two CUDA events on the engine's stream (inputs are the program's own buffers, so
the kernels see the shapes and data layout of a real run); the figure (``ms``) is the median per
launch of three replays. Launched from Python instead (``eager_ms``, also recorded; the method of
the profiles before session 78), a kernel of a few microseconds is timed at the rate Python
launches it: the H200 profile of 2026-11-28 summed GPT-2's kernels to 1.27 ms against a replay of
1.01. In a graph, back-to-back launches of one kernel keep its operands warm in L2 and leave only
the graph's gap between kernels, so the sum is close to a lower bound of the graph replay time
(printed beside it). Collectives are not timed. Prints the ``--top`` kernels and the totals per
kernel kind.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_shardflow, table  # noqa: E402


def profile(out_dir: str, rank: int = 0, reps: int = 10) -> dict:
    """Time every kernel step of ``out_dir``'s rank program; returns per-step records and totals."""
    import numpy as np

    from shardflow.runtime import load

    from shardflow.runtime.artifact import buffer_dtype

    with open(os.path.join(out_dir, f"rank{rank}", "program.json")) as f:
        program = json.load(f)
    bufs = program["buffers"]
    feeds = {name: np.zeros(tuple(bufs[i]["shape"]), buffer_dtype(bufs[i]["dtype"])) for name, i in program["inputs"]}
    prog = load(out_dir, rank=rank)
    prog.run(feeds)
    prog.run(feeds)  # second run: the engine captures its graph
    return time_steps(prog._engine, program, reps)


def time_steps(engine, program: dict, reps: int = 10) -> dict:
    """:func:`profile`'s timings on a loaded program's cuda engine (runtime/cuda_exec.py), after a
    run: every kernel step's ``ms`` (from a CUDA graph) and ``eager_ms`` (launched from Python), the
    sums, the whole program's graph replay (``graph_ms``) and the totals per kernel kind."""
    import cupy as cp

    steps = [s for s in program["steps"][program.get("load_steps", 0):] if s["kind"] == "kernel"]  # not at load
    launches = [f for seg, _ in engine.segments for f in seg]
    assert len(launches) == len(steps), (len(launches), len(steps))
    start, end = cp.cuda.Event(), cp.cuda.Event()

    def per_launch(run) -> float:  # median milliseconds of three runs of `reps` launches, per launch
        times = []
        for _ in range(3):
            start.record(engine.stream)
            run()
            end.record(engine.stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / reps)
        return statistics.median(times)

    def launched(f):
        def run():
            for _ in range(reps):
                f()
        return run

    records = []
    with engine.stream:
        for s, f in zip(steps, launches):
            if f is None:
                continue
            f()
            eager = per_launch(launched(f))
            graph = engine._capture(launched(f))
            graph.launch(engine.stream)
            records.append({"node": s["node"], "kind": s["launch"]["kind"], "grid": s["launch"]["grid"],
                            "block": s["launch"]["block"], "ms": per_launch(lambda: graph.launch(engine.stream)),
                            "eager_ms": eager})
    # the whole program as the runtime replays it
    t = []
    for _ in range(10):
        start.record(engine.stream)
        if engine.capturable:
            engine._graph("all")[0][0].launch(engine.stream)
        else:
            engine._eager(engine.segments)
        end.record(engine.stream)
        end.synchronize()
        t.append(cp.cuda.get_elapsed_time(start, end))
    by_kind: dict = {}
    for r in records:
        k = by_kind.setdefault(r["kind"], {"kernels": 0, "ms": 0.0})
        k["kernels"] += 1
        k["ms"] += r["ms"]
    return {"steps": records, "sum_ms": sum(r["ms"] for r in records),
            "eager_sum_ms": sum(r["eager_ms"] for r in records), "graph_ms": statistics.median(t), "by_kind": by_kind}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--model", help="export and compile this models.py model instead (gpt2_small, llama)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--precision", default="float16")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--work", help="keep the export and the artifacts here")
    ap.add_argument("--gemm-tiles", default="", help="with --model: optimization_config['gemm_tiles'] as JSON")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    ensure_shardflow()
    out_dir = args.out_dir
    if out_dir is None:
        if not args.model:
            ap.error("give an artifact folder or --model")
        import models

        work = args.work or tempfile.mkdtemp(prefix="sf-profile-")
        _, info = models.prepare(args.model, work, work, False, print)
        tiles = json.loads(args.gemm_tiles) if args.gemm_tiles else None
        out_dir = os.path.join(work, f"{args.model}_{args.batch}x128_{args.precision}" + ("_tiles" if tiles else ""))
        models.compile_ours(info["path"], args.batch, out_dir, target="cuda", arch=args.arch,
                            precision=args.precision, search_space=None, gemm_tiles=tiles)
    res = profile(out_dir, args.rank, args.reps)
    top = sorted(res["steps"], key=lambda r: -r["ms"])[:args.top]
    print(table(["ms", "eager ms", "kind", "grid", "block", "node"],
                [[f"{r['ms']:.4f}", f"{r['eager_ms']:.4f}", r["kind"], "x".join(map(str, r["grid"])), r["block"][0],
                  r["node"][-70:]] for r in top], align=">>><><"))
    print(table(["kind", "kernels", "ms"], [[k, v["kernels"], f"{v['ms']:.3f}"]
                                            for k, v in sorted(res["by_kind"].items(), key=lambda kv: -kv[1]["ms"])],
                align="<>>"))
    print(f"sum of kernels {res['sum_ms']:.3f} ms (launched from Python: {res['eager_sum_ms']:.3f}); "
          f"whole program (graph replay) {res['graph_ms']:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
