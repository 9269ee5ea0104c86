"""Decoding steps of an onnxruntime-genai Llama on the cpu with its KV cache kept as state
(``compile(state=...)``: the presents written over the pasts, no cache in or out) against the same
program fed its cache every step (the past copied in, the presents copied out and passed back) and
onnxruntime running that loop. Prints milliseconds per step (median of ``--steps`` steps, after
two) and checks that the three give the same logits.

    pip install --target /tmp/genai-site --no-deps onnxruntime-genai   # the model builder
    PYTHONPATH=/tmp/genai-site python benchmarks/cpu_decode_state.py [--layers 8] [--hidden 512]
        [--heads 8] [--kv-heads 4] [--batch 4] [--cache 2048] [--steps 20] [--threads 2]

The model: a random-weight Llama of that size (vocabulary 1024, MLP 3x hidden) exported in float32 by
the builder (needs torch, transformers, tokenizers). The cache (``--cache`` positions, zeros past
each sequence's end) starts half full; each step adds one token per sequence.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))


def build(folder: Path, args) -> Path:
    """The builder's float32 model of a random Llama of ``args``' size, in ``folder``."""
    import torch
    from export_genai import save_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(4096, args.cache))
    src = folder / "src"
    LlamaForCausalLM(cfg).save_pretrained(src)
    save_tokenizer(str(src))
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o",
                    str(folder / "model"), "-p", "fp32", "-e", "cpu"], check=True, capture_output=True)
    return folder / "model" / "model.onnx"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--cache", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import onnx
    import onnxruntime as ort

    from shardflow.compiler import compile
    from shardflow.runtime import load

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = build(tmp, args)
        model = onnx.load(str(path))
        pasts = [i.name for i in model.graph.input if i.name.startswith("past_key_values.")]
        state = {n.replace("past_key_values", "present"): n for n in pasts}
        head = args.hidden // args.heads
        b, cache = args.batch, args.cache
        shapes = {"input_ids": (b, 1), "attention_mask": (b, cache), **{n: (b, args.kv_heads, cache, head)
                                                                       for n in pasts}}
        progs = {}
        for kind, st in (("fed", None), ("state", state)):
            t = time.perf_counter()
            res = compile(str(path), distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                          out_dir=tmp / kind, input_shapes=shapes, state=st)
            progs[kind] = load(res.out_dir)
            print(f"compiled {kind}: {time.perf_counter() - t:.1f} s")
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]

        rng = np.random.default_rng(0)
        start = cache // 2
        first = {n: np.zeros(shapes[n], np.float32) for n in pasts}
        for n in pasts:
            first[n][:, :, :start] = rng.standard_normal((b, args.kv_heads, start, head)).astype(np.float32) * 0.5
        total = args.steps + 2

        def loop(run, keeps_state: bool) -> tuple[list[float], list[np.ndarray]]:
            mask = np.zeros((b, cache), np.int64)
            mask[:, :start] = 1
            ids = np.arange(b, dtype=np.int64)[:, None] + 7
            past, times, logits = dict(first), [], []
            for k in range(total):
                mask[:, start + k] = 1
                feeds = {"input_ids": ids, "attention_mask": mask}
                t = time.perf_counter()
                out = run({**feeds, **past} if past else feeds)
                times.append(time.perf_counter() - t)
                past = {} if keeps_state else {n: out[o] for o, n in state.items()}
                logits.append(out["logits"])
                ids = out["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
            return times[2:], logits

        runs = {"shardflow, cache kept (state)": loop(progs["state"].run, True),
                "shardflow, cache fed each step": loop(progs["fed"].run, False),
                "onnxruntime, cache fed each step": loop(lambda f: dict(zip(names, sess.run(None, f))), False)}
        ref = runs["onnxruntime, cache fed each step"][1]
        cache_mb = sum(int(np.prod(s)) * 4 for n, s in shapes.items() if n in pasts) / 2**20
        print(f"Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} KV), batch {b}, "
              f"cache {cache} positions ({cache_mb:.0f} MiB), {args.threads} threads; ms per decoding step "
              f"(median of {args.steps})")
        for name, (times, logits) in runs.items():
            err = max(float(np.abs(a - r).max()) for a, r in zip(logits, ref))
            print(f"  {name:34s} {1e3 * statistics.median(times):8.2f}   (max |logits - onnxruntime's| {err:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
