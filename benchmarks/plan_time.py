"""Planning time and modeled plan cost for GPT-2 at depths 12/24/48 on meshes [8] and [2, 4].

For each depth it exports a narrow GPT-2 (random weights, TorchScript exporter; needs torch and
transformers from the ``test`` extra), imports it, and runs ``search`` with the ILP and with the
baselines on the same cost model, printing side by side: wall-clock planning time, modeled cost
(µs), collectives and per-rank memory.

    python benchmarks/plan_time.py [--depths 12 24 48] [--embd 64] [--seq 128] [--meshes '8;2x4'] [--compile-graph]

The graph as imported keeps GPT-2's fused ``c_attn`` (which breaks the Megatron baseline's pairs, so
its fix-up loop runs a round per product); ``--compile-graph`` plans what ``compile`` plans.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[12, 24, 48])
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--meshes", default="8;2x4", help="';'-separated meshes, e.g. '8;2x4'")
    ap.add_argument("--compile-graph", action="store_true",
                    help="plan the graph compile plans (its fused projections split first: SplitProjections), "
                         "not the graph as imported")
    args = ap.parse_args(argv)
    from export_models import export_gpt2

    from shardflow.compiler import load_onnx
    from shardflow.compiler.cli import parse_mesh
    from shardflow.compiler.parallel import search

    meshes = [parse_mesh(m) for m in args.meshes.split(";")]
    print(f"{'model':<14} {'mesh':<7} {'algo':<10} {'plan s':>8} {'cost us':>12} {'collectives':>12} {'memory MB':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for depth in args.depths:
            path = os.path.join(tmp, f"gpt2_{depth}.onnx")
            export_gpt2(path, n_layer=depth, n_embd=args.embd, n_head=4, vocab_size=256, seq_len=args.seq, batch=1)
            graph = load_onnx(path)
            if args.compile_graph:
                from shardflow.compiler.passes.projections import SplitProjections

                graph = SplitProjections().run(graph)
            for mesh in meshes:
                for algo in ("ilp", "megatron", "data", "replicate"):
                    t0 = time.perf_counter()
                    plan = search(graph, {"mesh_shape": mesh, "algo": algo})
                    dt = time.perf_counter() - t0
                    print(f"gpt2-{depth:<9} {'x'.join(map(str, mesh)):<7} {algo:<10} {dt:8.2f} {plan.cost * 1e6:12.1f} "
                          f"{len(plan.collectives):12d} {plan.memory_bytes / 1e6:10.2f}", flush=True)


if __name__ == "__main__":
    main()
