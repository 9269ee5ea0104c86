"""Compile time of ``shardflow.compiler.compile``, cold (empty kernel cache) and cached, per stage.

By default compiles GPT-2 small (124M, exported on the fly; needs torch + transformers) to 4 CPU
ranks (Megatron plan); ``--model`` compiles a given ONNX file instead. Prints the per-stage
timings of both compiles (import, search, partition, codegen, write, total).

    python benchmarks/compile_time.py [--model M.onnx] [--mesh 4] [--algo megatron] [--target cpu]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="an ONNX file (default: export GPT-2 small)")
    ap.add_argument("--mesh", default="4", help="mesh shape, e.g. 4 or 2x2")
    ap.add_argument("--algo", default="megatron")
    ap.add_argument("--target", default="cpu")
    args = ap.parse_args(argv)
    mesh = [int(x) for x in args.mesh.split("x")]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SHARDFLOW_CACHE_DIR"] = os.path.join(tmp, "kernel-cache")  # start cold
        from shardflow.compiler import compile

        model = args.model
        if model is None:
            from export_models import export_gpt2

            model = os.path.join(tmp, "gpt2_small.onnx")
            t0 = time.perf_counter()
            export_gpt2(model, n_layer=12, n_embd=768, n_head=12, vocab_size=50257, seq_len=128, batch=1)
            print(f"exported GPT-2 small in {time.perf_counter() - t0:.1f} s")
        for label in ("cold", "cached"):
            res = compile(model, distributed_config={"mesh_shape": mesh, "algo": args.algo},
                          optimization_config={"target": args.target}, out_dir=os.path.join(tmp, f"out-{label}"))
            stages = ", ".join(f"{k} {v:.2f} s" for k, v in res.timings.items())
            print(f"{label:<6} compile to {res.world_size} ranks ({args.target}): {stages}", flush=True)


if __name__ == "__main__":
    main()
