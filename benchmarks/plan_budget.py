"""Planning time under a memory budget: HiGHS against CBC on the same problems.

A budget makes the plan search a hard MIP (rfcs/0001 "What is left": the LP bound is weak), most
of all on meshes of two or three axes. For each case it runs ``search`` with ``solver: "highs"``
and ``"cbc"`` one after the other and prints the wall-clock time and the plan's modeled cost (the
same cost when both prove the optimum). Cases: the committed test exports (GPT-2, Llama, BERT:
tiny widths) and, with ``--gpt2``, GPT-2 at its real width (12 layers of 768, vocabulary 50257,
128 tokens; exported with random weights, needs torch and transformers from the ``test`` extra)
and a narrower 4-layer one (256 wide, batch 4).

    python benchmarks/plan_budget.py [--gpt2] [--time-limit 120]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "tests", "models")
sys.path.insert(0, MODELS)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpt2", action="store_true", help="also GPT-2 at real width and a 256-wide one (exported)")
    ap.add_argument("--time-limit", type=float, default=120.0, help="time_limit_s of each search")
    args = ap.parse_args(argv)
    from shardflow.compiler import ShardflowError, load_onnx
    from shardflow.compiler.parallel import search

    cases = [("gpt2_ts17", [2, 2], 0.75), ("llama_ts17", [2, 2], 0.75), ("bert_ts17", [2, 2], 0.75),
             ("gpt2_ts17", [2, 4], 0.75), ("gpt2_ts17", [2, 2, 2], 0.75)]
    paths = {n: os.path.join(MODELS, n + ".onnx") for n, _, _ in cases}
    with tempfile.TemporaryDirectory() as tmp:
        if args.gpt2:
            from export_models import export_gpt2
            paths["gpt2-768x12"] = os.path.join(tmp, "gpt2_768.onnx")
            export_gpt2(paths["gpt2-768x12"], n_layer=12, n_embd=768, n_head=12, vocab_size=50257, seq_len=128, batch=1)
            paths["gpt2-256x4-b4"] = os.path.join(tmp, "gpt2_256.onnx")
            export_gpt2(paths["gpt2-256x4-b4"], n_layer=4, n_embd=256, n_head=8, vocab_size=8192, seq_len=128, batch=4)
            cases += [("gpt2-256x4-b4", [2, 2], 0.4), ("gpt2-768x12", [2, 2], 0.4), ("gpt2-768x12", [2, 2, 2], 0.3),
                      ("gpt2-768x12", [2, 2, 2], 0.75)]
        print(f"budget: a fraction of the replicated plan's bytes per rank; time_limit_s {args.time_limit:g}")
        print(f"{'model':<16} {'mesh':<7} {'budget':>6} {'highs s':>8} {'cost us':>10} {'cbc s':>8} {'cost us':>10}")
        graphs = {}
        for name, mesh, frac in cases:
            graph = graphs.get(name) or graphs.setdefault(name, load_onnx(paths[name]))
            rep = search(graph, {"mesh_shape": mesh, "algo": "replicate"})
            row = []
            for solver in ("highs", "cbc"):
                cfg = {"mesh_shape": mesh, "memory_budget_bytes": int(frac * rep.memory_bytes), "solver": solver,
                       "time_limit_s": args.time_limit}
                t0 = time.perf_counter()
                try:
                    cost = f"{search(graph, cfg).cost * 1e6:10.3f}"
                except ShardflowError as exc:
                    cost = f"{type(exc).__name__:>10}"
                row.append(f"{time.perf_counter() - t0:8.2f} {cost}")
            print(f"{name:<16} {'x'.join(map(str, mesh)):<7} {frac:6.2f} {' '.join(row)}", flush=True)


if __name__ == "__main__":
    main()
