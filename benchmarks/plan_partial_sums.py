"""Plans with and without partial sums through linear ops (``distributed_config["partial_sums"]``):
modeled cost, collectives and planning time, side by side, for a sequential-block GPT-2 and a
parallel-block GPT-NeoX of the same size.

Both are exported with random weights (width ``--width``, 2 layers, 1x128 tokens; needs torch and
transformers from the ``test`` extra) and planned by the ILP under a memory budget (0.6 of the
replicated plan's memory on [2], 0.35 on [4] and [2, 2]) with ``partial_sums`` false (the search
space before it existed) and true.

    python benchmarks/plan_partial_sums.py [--width 768] [--meshes '2;4;2x2']
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))


def export_neox(path: str, width: int, seq: int = 128) -> None:
    """The test models' GPT-NeoX (parallel attention + MLP residual, 2 layers) at ``width``,
    ``width // 64`` heads, MLP 4x, vocabulary 256, fed one sequence of ``seq`` tokens."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from export_models import build_neox, export_module, make_inputs

    torch.manual_seed(0)
    module, _, outs = build_neox(width=width, intermediate=4 * width, heads=width // 64, positions=512,
                                 vocab_size=256)
    specs = [("input_ids", (1, seq), "int64", "ids"), ("attention_mask", (1, seq), "int64", "mask")]
    export_module(module, make_inputs(specs, seed=0, vocab_size=256), [s[0] for s in specs], outs, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--meshes", default="2;4;2x2", help="';'-separated meshes")
    args = ap.parse_args(argv)
    from export_models import export_gpt2

    from shardflow.compiler import load_onnx
    from shardflow.compiler.cli import parse_mesh
    from shardflow.compiler.parallel import search

    meshes = [parse_mesh(m) for m in args.meshes.split(";")]
    print(f"{'model':<10} {'mesh':<7} {'partial_sums':<13} {'plan s':>7} {'cost us':>10} {'comm us':>9}  collectives")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"gpt2": os.path.join(tmp, "gpt2.onnx"), "neox": os.path.join(tmp, "neox.onnx")}
        export_gpt2(paths["gpt2"], n_layer=2, n_embd=args.width, n_head=args.width // 64, vocab_size=256,
                    seq_len=128, batch=1)
        export_neox(paths["neox"], args.width)
        for name, path in paths.items():
            graph = load_onnx(path)
            rep = search(graph, {"mesh_shape": [2], "algo": "replicate"})
            full = rep.params_bytes + rep.peak_activation_bytes
            for mesh in meshes:
                budget = int(full * (0.6 if mesh == [2] else 0.35))
                for ps in (False, True):
                    t = time.perf_counter()
                    plan = search(graph, {"mesh_shape": mesh, "memory_budget_bytes": budget, "partial_sums": ps,
                                          "time_limit_s": 300})
                    dt = time.perf_counter() - t
                    kinds = dict(sorted(Counter(c.kind for c in plan.collectives).items()))
                    print(f"{name:<10} {'x'.join(map(str, mesh)):<7} {str(ps).lower():<13} {dt:7.2f} "
                          f"{plan.cost * 1e6:10.3f} {plan.comm_cost * 1e6:9.3f}  {kinds}", flush=True)


if __name__ == "__main__":
    main()
