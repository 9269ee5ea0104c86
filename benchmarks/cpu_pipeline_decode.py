"""Measured: decoding steps of an onnxruntime-genai Llama on pipeline stages of cpu ranks, its KV cache kept
as state in each stage, with and without microbatches (each microbatch its own rows of the cache), against
one rank and onnxruntime, in one run.

    pip install --target /tmp/genai-site --no-deps onnxruntime-genai   # the model builder
    PYTHONPATH=/tmp/genai-site OPENBLAS_NUM_THREADS=1 python benchmarks/cpu_pipeline_decode.py [--layers 8]
        [--hidden 512] [--heads 8] [--kv-heads 4] [--batch 4] [--cache 1024] [--ranks 2] [--repeat 20]
        [--microbatches 1 2 4]

The model is ``cpu_decode_state.py``'s (a random-weight Llama exported by the builder, float32). Each
configuration is compiled with ``compile(state=...)`` (the presents kept as the pasts) and run with
``shardflow run --nproc N --repeat R`` (the ranks on this machine, each bound to its share of the cores);
printed: the median step (rank 0's, barrier to barrier: the whole step through every stage), and the
largest difference of the logits from onnxruntime's for the same step (the cache zero, ``cache / 2``
positions valid, one new token a sequence). onnxruntime runs in this process on every core.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "models"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args(argv)
    import onnxruntime as ort
    from cpu_decode_state import build
    from cpu_pipeline import _run

    from shardflow.compiler import compile

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = build(tmp, args)
        state = {f"present.{n}.{kv}": f"past_key_values.{n}.{kv}"
                 for n in range(args.layers) for kv in ("key", "value")}
        hd = args.hidden // args.heads
        past = {name: np.zeros((args.batch, args.kv_heads, args.cache, hd), np.float32) for name in state.values()}
        mask = np.zeros((args.batch, args.cache), np.int64)
        mask[:, :args.cache // 2 + 1] = 1
        feeds = {"input_ids": np.arange(args.batch, dtype=np.int64)[:, None] + 7, "attention_mask": mask}
        np.savez(tmp / "in.npz", **feeds)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        ref = sess.run(["logits"], {**feeds, **past})[0]
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            sess.run(["logits"], {**feeds, **past})
            times.append(time.perf_counter() - t0)
        shapes = {k: v.shape for k, v in {**feeds, **past}.items()}
        print(f"# genai Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} "
              "key/value), "
              f"batch {args.batch}, cache {args.cache} ({args.cache // 2 + 1} valid); {os.cpu_count()} cores; "
              f"`shardflow run --repeat {args.repeat}` medians (rank 0, barrier to barrier), measured")
        print(f"{'config':<26} {'ranks':>5} {'ms/step':>9} {'vs 1 rank':>9} {'max |diff|':>11}")
        configs = [("1 rank", {"mesh_shape": [1]}, 1)]
        configs += [(f"{args.ranks} stages, {m} microbatch{'es' if m > 1 else ''}",
                     {"mesh_shape": [args.ranks], "pipeline_stages": args.ranks, "pipeline_microbatches": m},
                     args.ranks) for m in args.microbatches if args.batch % m == 0]
        base = None
        for name, dcfg, n in configs:
            out = str(tmp / name.replace(" ", "_").replace(",", ""))
            compile(str(path), distributed_config=dcfg, optimization_config={"target": "cpu"}, out_dir=out,
                    input_shapes=shapes, state=state)
            ms, _ = _run(out, n, str(tmp / "in.npz"), str(tmp / "out.npz"), args.repeat)
            diff = float(np.abs(np.load(tmp / "out.npz")["logits"] - ref).max())
            base = base or ms
            print(f"{name:<26} {n:>5} {ms:>9.2f} {ms / base:>9.2f} {diff:>11.1e}", flush=True)
        print(f"{'onnxruntime':<26} {1:>5} {np.median(times) * 1e3:>9.2f} {np.median(times) * 1e3 / base:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
