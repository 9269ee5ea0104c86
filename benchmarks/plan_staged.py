"""Plans on meshes with a slow axis: modeled cost, the bytes each mesh axis moves, and planning time.

For changes to connect or the cost model (rfcs/0001 "Staged reductions: tried, not landed"): run it
on two checkouts (a ``PYTHONPATH`` naming the other one's package) to print the plans before and
after. Meshes ``[2, 4]`` and ``[2, 2, 2]``, with every link alike (the
defaults, 100 GB/s and 5 us) and with axis 0 between hosts (25 GB/s, 10 us; the other axes
400 GB/s, 1 us). Models: the committed GPT-2, Llama and BERT test exports, with ``--gpt2``
GPT-2 small's shapes (768 wide, 12 layers, 1x128 tokens; needs torch and transformers), with
``--block`` the planner tests' two parallel MLPs added to their input. Plans:
the ILP without a budget and with a budget of ``--budget`` times the replicated plan's bytes
(``partial_sums: true`` so that the ILP may carry partial sums on both axes), and the Megatron
baseline.

    python benchmarks/plan_staged.py [--gpt2] [--block] [--budget 0.4] [--time-limit 120] [--meshes '2x4;2x2x2']
                                     [--models gpt2_ts17,llama_ts17,bert_ts17]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "tests", "models")
sys.path.insert(0, MODELS)


def _links(kind: str, ndim: int) -> dict:
    if kind == "even":
        return {}
    return {"axis_bandwidth_GBps": [25] + [400] * (ndim - 1), "axis_latency_us": [10] + [1] * (ndim - 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpt2", action="store_true", help="also GPT-2 small's shapes (exported here)")
    ap.add_argument("--block", action="store_true",
                    help="also tests/parallel/models.py's parallel_block (x + mlp_a(x) + mlp_b(x)), 2048x1024")
    ap.add_argument("--budget", type=float, default=0.4)
    ap.add_argument("--time-limit", type=float, default=120)
    ap.add_argument("--meshes", default="2x4;2x2x2", help="';'-separated meshes")
    ap.add_argument("--models", default="gpt2_ts17,llama_ts17,bert_ts17", help="committed test exports, ','-separated")
    args = ap.parse_args(argv)
    from shardflow.compiler import ShardflowError, load_onnx
    from shardflow.compiler.parallel import connect, search

    print(f"connect from {connect.__module__} at {sys.modules[connect.__module__].__file__}")
    names = [n for n in args.models.split(",") if n]
    paths = {n: os.path.join(MODELS, n + ".onnx") for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        if args.gpt2:
            from export_models import export_gpt2
            paths["gpt2-768x12"] = os.path.join(tmp, "gpt2_768.onnx")
            export_gpt2(paths["gpt2-768x12"], n_layer=12, n_embd=768, n_head=12, vocab_size=50257, seq_len=128, batch=1)
            names.append("gpt2-768x12")
        print(f"{'model':<12} {'mesh':<6} {'links':<6} {'plan':<10} {'plan s':>7} {'cost us':>10} "
              f"{'MB per axis':<24} collectives")
        if args.block:
            import onnx
            sys.path.insert(0, os.path.join(HERE, "..", "tests", "parallel"))
            from models import parallel_block
            paths["block"] = os.path.join(tmp, "block.onnx")
            onnx.save(parallel_block(batch=2048, hidden=1024), paths["block"])
            names.append("block")
        for name in names:
            graph = load_onnx(paths[name])
            for mesh in ([int(d) for d in m.split("x")] for m in args.meshes.split(";")):
                for links in ("even", "slow0"):
                    base = {"mesh_shape": mesh, "device": "h100", **_links(links, len(mesh))}
                    rep = search(graph, {**base, "algo": "replicate"})
                    plans = [("ilp", {}), (f"ilp@{args.budget:g}", {
                        "memory_budget_bytes": int(args.budget * rep.memory_bytes), "partial_sums": True,
                        "time_limit_s": args.time_limit}), ("megatron", {"algo": "megatron"})]
                    for label, extra in plans:
                        t0 = time.perf_counter()
                        try:
                            plan = search(graph, {**base, **extra})
                        except ShardflowError as exc:
                            print(f"{name:<12} {'x'.join(map(str, mesh)):<6} {links:<6} {label:<10} "
                                  f"{time.perf_counter() - t0:7.2f} {type(exc).__name__}", flush=True)
                            continue
                        secs = time.perf_counter() - t0
                        per_axis = [0.0] * len(mesh)
                        for c in plan.collectives:
                            for a in c.mesh_axes:
                                per_axis[a] += c.bytes / 1e6
                        kinds = Counter(f"{c.kind}@{','.join(map(str, c.mesh_axes))}" for c in plan.collectives)
                        print(f"{name:<12} {'x'.join(map(str, mesh)):<6} {links:<6} {label:<10} {secs:7.2f} "
                              f"{plan.cost * 1e6:10.2f} {'/'.join(f'{b:.2f}' for b in per_axis):<24} "
                              f"{' '.join(f'{k}:{v}' for k, v in sorted(kinds.items()))}", flush=True)


if __name__ == "__main__":
    main()
