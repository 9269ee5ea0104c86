"""Time to import and simplify GPT-2 graphs with ``load_onnx``.

Exports (on the fly, random weights; needs torch and transformers from the ``test`` extra) GPT-2
small (124M parameters) and a 48-layer narrow GPT-2 with the TorchScript exporter, then prints
the median import+simplify time over ``--repeat`` runs, the node counts before and after
simplification, and onnxruntime's session-creation time for the same file side by side.

    python benchmarks/import_time.py [--repeat 3] [--skip-small]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))


def _median_time(fn, repeat):
    times, res = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), res


def bench(name, path, repeat):
    import onnx
    import onnxruntime as ort

    from shardflow.compiler import load_onnx

    onnx_nodes = len(onnx.load(path, load_external_data=False).graph.node)
    t_load, g = _median_time(lambda: load_onnx(path), repeat)
    t_raw, raw = _median_time(lambda: load_onnx(path, simplify=False), 1)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    t_ort, _ = _median_time(lambda: ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]), 1)
    print(f"{name:<22} onnx nodes {onnx_nodes:>6}  unsimplified {len(raw.nodes):>6}  simplified {len(g.nodes):>6}  "
          f"load_onnx {t_load:6.2f} s (import only {t_raw:6.2f} s)  onnxruntime session {t_ort:6.2f} s")
    return t_load


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-small", action="store_true", help="skip GPT-2 small (124M)")
    args = ap.parse_args(argv)
    from export_models import export_gpt2

    configs = [("gpt2-48layer-narrow", dict(n_layer=48, n_embd=64, n_head=4, vocab_size=256))]
    if not args.skip_small:
        configs.insert(0, ("gpt2-small-124M", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)))
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in configs:
            path = os.path.join(tmp, f"{name}.onnx")
            export_gpt2(path, seq_len=128, batch=1, **cfg)
            bench(name, path, args.repeat)


if __name__ == "__main__":
    main()
