"""Pipeline stages against a plan over the whole mesh, on a mesh whose first axis is a slow link.

Exports a GPT-2 (random weights, TorchScript exporter; torch and transformers from the ``test`` extra),
then on ``mesh_shape = [P, W]`` with the first axis's links slow (between machines) and the second's
fast (within one) prints, side by side, for:

* ``ilp``: one plan over the whole mesh (``search``), as ``compile`` plans without stages;
* ``megatron``: the Megatron baseline over the whole mesh (data parallel over the first axis);
* ``stages/m``: ``pipeline_stages = P`` with ``pipeline_microbatches = m``, the cut and each stage
  planned over ``[W]`` (``plan_stages``, what ``compile`` plans with stages); a run: every stage
  once for the first microbatch, then the slowest stage's microbatch time for each other one;

the modeled time of one run (for the stages: their plans' costs one after another plus the
transfers; all figures from the cost model, none measured), the bytes the collectives spanning
the slow axis move (for the stages: the most a stage sends), the most memory a rank holds
(parameters as stored plus peak activations, as the plans count them), and the planning time
(measured, this machine).

    python benchmarks/plan_pipeline.py [--layers 12] [--embd 768] [--heads 12] [--vocab 50257] [--batch 8]
        [--seq 128] [--mesh 2x4] [--slow 25,10] [--fast 450,3] [--device h100] [--budget-mb MB]
        [--microbatches 1 4]

``--slow BW,LAT`` and ``--fast BW,LAT``: GB/s and µs of the two axes' links (defaults: 200 Gb/s
InfiniBand between machines, NVLink within one).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))


def _slow_axis_bytes(plan, axis: int = 0) -> float:
    """Bytes of the tensors ``plan``'s collectives spanning mesh ``axis`` move, in one run."""
    def flat(axes):
        return {a for x in axes for a in (x if isinstance(x, tuple) else (x,))}
    return float(sum(c.bytes for c in plan.collectives if axis in flat(c.mesh_axes)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument("--slow", default="25,10", help="GB/s,µs of the first axis's links")
    ap.add_argument("--fast", default="450,3", help="GB/s,µs of the second axis's links")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 4],
                    help="pipeline_microbatches to plan the stages with (a row each)")
    ap.add_argument("--budget-mb", type=float, default=None, help="memory_budget_bytes per rank, MB (1e6 bytes)")
    args = ap.parse_args(argv)
    from export_models import export_gpt2

    from shardflow.compiler.cli import parse_mesh
    from shardflow.compiler.driver import planned_graph
    from shardflow.compiler.errors import ShardflowError
    from shardflow.compiler.parallel import search
    from shardflow.compiler.parallel.cost import total_bytes
    from shardflow.compiler.stages import plan_stages

    mesh = parse_mesh(args.mesh)
    if len(mesh) != 2:
        raise SystemExit("--mesh: two axes, e.g. 2x4")
    (sbw, slat), (fbw, flat) = ([float(x) for x in v.split(",")] for v in (args.slow, args.fast))
    base = {"mesh_shape": mesh, "axis_bandwidth_GBps": [sbw, fbw], "axis_latency_us": [slat, flat],
            "device": args.device}
    if args.budget_mb:
        base["memory_budget_bytes"] = int(args.budget_mb * 1e6)
    print(f"# GPT-2 {args.layers} layers, {args.embd} wide, {args.heads} heads, vocab {args.vocab}, {args.batch}x"
          f"{args.seq} tokens; mesh {mesh}: axis 0 {sbw:g} GB/s {slat:g} us, axis 1 {fbw:g} GB/s {flat:g} us; "
          f"device {args.device}; budget {args.budget_mb or 'none'} MB; modeled figures (cost model), planning "
          "time measured")
    print(f"{'plan':<10} {'modeled ms':>11} {'axis-0 MB/rank':>15} {'memory MB/rank':>15} {'plan s':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "gpt2.onnx")
        export_gpt2(path, n_layer=args.layers, n_embd=args.embd, n_head=args.heads, vocab_size=args.vocab,
                    seq_len=args.seq, batch=args.batch)
        for algo in ("ilp", "megatron"):
            cfg = dict(base, algo=algo)
            t0 = time.perf_counter()
            graph = planned_graph(path, distributed_config=cfg, optimization_config={"target": "cuda"})
            try:
                plan = search(graph, cfg)
            except ShardflowError as exc:
                print(f"{algo:<10} no plan: {exc}")
                continue
            dt = time.perf_counter() - t0
            print(f"{algo:<10} {plan.cost * 1e3:11.3f} {_slow_axis_bytes(plan) / 1e6:15.2f} "
                  f"{plan.memory_bytes / 1e6:15.1f} {dt:8.2f}", flush=True)
        for micro in args.microbatches:
            cfg = dict(base, pipeline_stages=mesh[0], pipeline_microbatches=micro)
            name = f"stages/{micro}"
            t0 = time.perf_counter()
            try:
                pipe, plans = plan_stages(path, distributed_config=cfg, optimization_config={"target": "cuda"})
            except ShardflowError as exc:
                print(f"{name:<10} no plan: {exc}")
                continue
            dt = time.perf_counter() - t0
            # a microbatch's time in each stage (its plan and its sends); fill, then the slowest stage per microbatch
            per = [p.cost + pipe.transfer_seconds(sbw, slat, ("cut",), s) for s, p in enumerate(plans)]
            total = sum(per) + (micro - 1) * max(per)
            out = pipe.transfer_seconds(sbw, slat, ("output",)) * micro
            sent = micro * max(sum(total_bytes(*pipe.tensors[n]) for n, a, _, k in pipe.transfers
                                   if a == st.index and k == "cut") for st in pipe.stages)
            print(f"{name:<10} {total * 1e3:11.3f} {sent / 1e6:15.2f} {max(p.memory_bytes for p in plans) / 1e6:15.1f} "
                  f"{dt:8.2f}")
            print(f"#   {name}: a microbatch {' / '.join(f'{x * 1e3:.3f}' for x in per)} ms in the stages (plan and "
                  f"sends); the outputs gathered on rank 0, once, not per run: {out * 1e3:.3f} ms; "
                  f"{[st.ops for st in pipe.stages]} ops, {len([t for t in pipe.transfers if t[3] == 'cut'])} cut "
                  "transfers", flush=True)

if __name__ == "__main__":
    main()
