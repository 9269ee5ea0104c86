"""What the cpu attention template's second bias gains (rfcs/0005 decision 46): BLOOM (ALiBi, then
the causal mask) and MPNet (a relative position bias, then the padding mask), beside onnxruntime.

Exports the model (transformers, random weights, TorchScript exporter), compiles it for one cpu
rank twice: with the template refusing a second bias as it did before (the attention left as
separate ops) and as it is (one fused Attention a layer), and times both paired with
``cpu_compare_builds.py`` (alternating rounds; this VM's speed drifts), then onnxruntime on the
same file.

    python benchmarks/cpu_two_bias_attention.py [--model bloom|mpnet] [--seq 512] [--layers 4]
                                                [--hidden 512] [--rounds 11]

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


def export(path: str, model: str, seq: int, layers: int, hidden: int) -> dict:
    import torch
    import transformers as T

    sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))
    import export_models as em

    heads = hidden // 64
    if model == "mpnet":
        net = T.MPNetModel(T.MPNetConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers,
                                         num_attention_heads=heads, intermediate_size=4 * hidden,
                                         max_position_embeddings=seq + 2))
        wrap = em._HiddenState
    else:
        net = T.BloomForCausalLM(T.BloomConfig(vocab_size=1000, hidden_size=hidden, n_layer=layers, n_head=heads))
        wrap = em._Logits
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    mask = np.ones((1, seq), np.int64)
    mask[0, seq - seq // 8:] = 0  # a padded tail: the mask is not all zeros
    feeds = {"input_ids": rng.integers(0, 1000, (1, seq)), "attention_mask": mask}
    em.export_module(wrap(net.eval()), feeds, list(feeds), ["y"], path)
    return feeds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["bloom", "mpnet"], default="bloom")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args(argv)
    from shardflow.compiler.codegen import templates_cpu

    path = os.path.join(tempfile.mkdtemp(prefix="sf-two-bias-"), f"{args.model}.onnx")
    feeds = export(path, args.model, args.seq, args.layers, args.hidden)
    template = templates_cpu._TEMPLATES["Attention"]

    def one_bias(op):  # the template before decision 46: one extra bias at most
        return None if op.attrs.get("extra_biases", 0) > 1 else template(op)

    @contextlib.contextmanager
    def before():
        templates_cpu._TEMPLATES["Attention"] = one_bias
        try:
            yield
        finally:
            templates_cpu._TEMPLATES["Attention"] = template
    sys.path.insert(0, HERE)
    import cpu_compare_builds

    cpu_compare_builds.before_and_after(
        path, feeds, before(), f"# {args.model} (TorchScript export), hidden {args.hidden}, {args.layers} layers, "
        f"batch 1 x {args.seq} tokens; old = attention as separate ops, new = fused with its two biases",
        args.rounds, only=".attention")

if __name__ == "__main__":
    main()
