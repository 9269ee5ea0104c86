"""What fusing torch's ``scaled_dot_product_attention`` export gains on the cpu target (rfcs/0005
decision 43), beside onnxruntime.

Exports a transformers Qwen2 (random weights, ``attn_implementation="sdpa"``, transformers' default;
grouped KV heads) with the TorchScript exporter, compiles it for one cpu rank twice: with the
attention left as separate ops (the matching of decision 43 turned off: what the pass did before
it) and fused (the code as it is), and times both paired with ``cpu_compare_builds.py``
(alternating rounds; this VM's speed drifts), then onnxruntime on the same file.

    python benchmarks/cpu_sdpa_fusion.py [--seq 512] [--layers 4] [--hidden 512] [--rounds 11]

Needs torch and transformers (the test extras). Prints the compare script's report and
onnxruntime's median.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def export(path: str, seq: int, layers: int, hidden: int) -> dict:
    import torch
    import transformers as T

    sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))
    import export_models as em

    cfg = T.Qwen2Config(vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                        num_key_value_heads=max(1, hidden // 256), intermediate_size=4 * hidden,
                        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = T.Qwen2Model(cfg).eval()
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 1000, (1, seq)), "attention_mask": np.ones((1, seq), np.int64)}
    em.export_module(em._HiddenState(model), feeds, list(feeds), ["y"], path)
    return feeds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args(argv)
    from shardflow.compiler.passes.attention import FuseAttention

    path = os.path.join(tempfile.mkdtemp(prefix="sf-sdpa-"), "qwen2_sdpa.onnx")
    feeds = export(path, args.seq, args.layers, args.hidden)
    guard, rows = FuseAttention._past_nan_guard, FuseAttention._key_rows

    def before_guard(self, reader, p):  # decision 43 off: no NaN guard taken
        return reader, p, False

    def before_rows(self, kth, name, new_ops):  # and K^T only as a plain transpose of K
        tk = self._prod(kth)
        return (tk.inputs[0], []) if tk is not None and tk.op_type == "Transpose" \
            and tk.attrs.get("perm") == (0, 1, 3, 2) else (None, [])

    @contextlib.contextmanager
    def before():
        FuseAttention._past_nan_guard, FuseAttention._key_rows = before_guard, before_rows
        try:
            yield
        finally:
            FuseAttention._past_nan_guard, FuseAttention._key_rows = guard, rows
    sys.path.insert(0, HERE)
    import cpu_compare_builds

    cpu_compare_builds.before_and_after(
        path, feeds, before(), f"# Qwen2 (sdpa export), hidden {args.hidden}, {args.layers} layers, batch 1 x "
        f"{args.seq} tokens; old = attention as separate ops, new = fused", args.rounds, only="attention")

if __name__ == "__main__":
    main()
