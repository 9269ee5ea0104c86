"""Weight bytes and error of half-precision programs: ``precision="float16"`` against float32.

For each committed test model (tests/models), compiles the one-rank cpu program at ``float32``
and at ``float16``, runs both on the model's inputs, and prints each program's ``weights_bytes``
(program.json) and the largest ``|shardflow - onnxruntime| / max |onnxruntime|`` over the outputs
(onnxruntime running the float32 model). ``--gpt2-small`` also exports a GPT-2-small-sized model
(124M parameters, 1x128 tokens; needs torch and transformers) and prints the ``weights_bytes`` of
its float16 cuda program (compiled for sm_90, not run: this needs no GPU).

    python benchmarks/half_weights.py [--gpt2-small]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models")
TEST_MODELS = ["gpt2_ts17", "bert_ts17", "llama_ts17", "t5_encoder_ts17", "vit_ts17"]


def _weights_bytes(out: str) -> int:
    with open(os.path.join(out, "rank0", "program.json")) as f:
        return int(json.load(f)["weights_bytes"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpt2-small", action="store_true", help="also a GPT-2-small-sized cuda program (slow)")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(MODELS, ".."))
    from model_refs import onnxruntime_reference

    from shardflow.compiler import compile
    from shardflow.runtime import load

    for name in TEST_MODELS:
        feeds, ref = onnxruntime_reference(name)
        row = [f"{name:18s}"]
        for precision in ("float32", "float16"):
            with tempfile.TemporaryDirectory() as out:
                compile(os.path.join(MODELS, f"{name}.onnx"), distributed_config={"mesh_shape": [1]},
                        optimization_config={"precision": precision}, out_dir=out)
                got = load(out).run(feeds)
                size = _weights_bytes(out)
            err = max(float(np.abs(got[k] - v).max() / np.abs(v).max()) for k, v in ref.items())
            row.append(f"{precision} {size:>9,d} B  rel err {err:.2e}")
        print("   ".join(row), flush=True)
    if args.gpt2_small:
        sys.path.insert(0, MODELS)
        from export_models import export_gpt2

        with tempfile.TemporaryDirectory() as work:
            path = os.path.join(work, "gpt2_small.onnx")
            export_gpt2(path, n_layer=12, n_embd=768, n_head=12, vocab_size=50257, seq_len=128, batch=1)
            out = os.path.join(work, "out")
            compile(path, distributed_config={"mesh_shape": [1]}, out_dir=out,
                    optimization_config={"target": "cuda", "arch": "sm_90", "precision": "float16"})
            print(f"gpt2_small_124M    cuda float16 weights {_weights_bytes(out):,d} B "
                  f"(model file {os.path.getsize(path):,d} B, float32)")


if __name__ == "__main__":
    main()
