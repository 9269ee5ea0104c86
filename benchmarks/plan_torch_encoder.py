"""Plans of a ``torch.nn.TransformerEncoder`` (torch's own multi-head attention: a packed
in-projection, heads merged with the batch): the Megatron baseline and the ILP on 2, 4 and 8
ranks, their modeled cost, parameters and peak activations a rank, collectives and the products
the baseline keeps whole, for both torch exporters.

The model has ViT-B/16's widths (2 layers of ``nn.TransformerEncoderLayer(768, 12 heads, 3072,
batch_first, GELU, norm_first)``, weights N(0, 0.02), input ``[8, 197, 768]``); it is exported
with torch's fast path off (``torch.backends.mha.set_fastpath_enabled(False)``: the TorchScript
exporter has no symbolic for the fused encoder layer). Needs torch from the ``test`` extra. The
figures are the planner's cost model (``--device``, default links), not measured times.

    python benchmarks/plan_torch_encoder.py [--layers 2] [--batch 8] [--meshes 2,4,8] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))


def export(out: str, layers: int, batch: int) -> dict[str, str]:
    """The encoder exported by both exporters into ``out`` (kept if there already): name -> path."""
    paths = {ex: os.path.join(out, f"encoder{layers}_b{batch}_{ex}.onnx") for ex in ("ts17", "dynamo18")}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    import torch
    from export_models import export_module

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    torch.backends.mha.set_fastpath_enabled(False)
    layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True, dropout=0.0, activation="gelu",
                                             norm_first=True)
    encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()
    for p in encoder.parameters():  # (the layers are copies of one another until trained)
        torch.nn.init.normal_(p, std=0.02)
    x = np.random.default_rng(0).standard_normal((batch, 197, 768)).astype(np.float32)
    for ex, path in paths.items():
        dynamo = ex == "dynamo18"
        export_module(encoder, {"x": x}, ["x"], ["y"], path, dynamo=dynamo, opset=18 if dynamo else 17)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--meshes", default="2,4,8", help="comma-separated rank counts")
    ap.add_argument("--device", default="h100", help="the cost model's device profile")
    ap.add_argument("--out", default=None, help="where the exports are kept (default: a temporary folder)")
    args = ap.parse_args()

    from shardflow.compiler import load_onnx
    from shardflow.compiler.driver import plan_passes
    from shardflow.compiler.parallel import search

    with tempfile.TemporaryDirectory() as tmp:
        paths = export(args.out or tmp, args.layers, args.batch)
        print(f"{'export':9s} {'mesh':5s} {'algo':9s} {'params a rank':>14s} {'peak act.':>10s} "
              f"{'modeled us (compute + comm)':>29s}  collectives / kept whole")
        for ex, path in paths.items():
            for n in (int(v) for v in args.meshes.split(",")):
                for algo in ("megatron", "ilp"):
                    graph = plan_passes(load_onnx(path), [n], **({"pad_heads": n} if algo == "megatron" else {}))
                    plan = search(graph, {"mesh_shape": [n], "algo": algo, "device": args.device})
                    text = plan.to_text().splitlines()
                    kept = [line.split(":", 1)[1].split(" weight")[0].strip() for line in text
                            if line.startswith("# megatron:")]
                    collectives = next(line for line in text if line.startswith("# collectives:")).split(":", 1)[1]
                    print(f"{ex:9s} [{n}]   {algo:9s} {plan.params_bytes / 1e6:11.1f} MB "
                          f"{plan.peak_activation_bytes / 1e6:7.1f} MB {plan.cost * 1e6:10.1f} "
                          f"({plan.compute_cost * 1e6:7.1f} + {plan.comm_cost * 1e6:7.1f})  "
                          f"{collectives.strip()} / {kept[0] if kept else 0} products", flush=True)


if __name__ == "__main__":
    main()
