"""Build the onnxruntime-genai test models: a 2-layer Llama (hidden 64, 4 heads, 2 KV heads, vocabulary 256,
random weights after ``torch.manual_seed(0)``) exported by onnxruntime-genai's model builder, as its users
get their LLMs: ``GroupQueryAttention`` with packed QKV and rotary embeddings, ``SkipSimplifiedLayerNormalization``,
a KV cache as inputs and outputs; in float32 (``llama_genai_fp32.onnx``) and 4-bit (``llama_genai_int4.onnx``:
``MatMulNBits``, block 32, accuracy level 4); and 4-bit with the embedding tied to the ``lm_head``
(``llama_genai_int4_tied.onnx``: the builder's ``shared_embeddings`` option gathers the embedding rows from the
``lm_head``'s 4-bit weight with ``GatherBlockQuantized``); and a 2-layer gpt-oss in float32
(``gptoss_genai_fp32.onnx``: hidden 64, 4 heads, 2 KV heads, head 16, 4 experts of which 2 per token, a
sliding window of 8 on layer 0 with its windowed KV cache, attention sinks drawn from a normal law, the
builder's ``MoE`` with SwiGLU). The weights are embedded in the .onnx files.

    pip install --target /tmp/genai-site --no-deps onnxruntime-genai   # not a test dependency
    PYTHONPATH=/tmp/genai-site python tests/models/export_genai.py

Needs torch, transformers and tokenizers (the test extra); built with onnxruntime-genai 0.18.0.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"

HERE = os.path.dirname(os.path.abspath(__file__))


def save_tokenizer(folder: str) -> None:
    """A word-level tokenizer of 256 tokens in ``folder`` (the builder saves one with the model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(folder)


def build_source(folder: str, tied: bool = False) -> None:
    """A random-weight Llama and the tokenizer in ``folder``; with ``tied``, one weight for the
    embedding and the ``lm_head``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tied)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    save_tokenizer(folder)


def build_gptoss_source(folder: str) -> None:
    """A random-weight 2-layer gpt-oss (layer 0 sliding-window attention, layer 1 full; non-zero
    attention sinks) and the tokenizer, in ``folder``."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=128,
                       layer_types=["sliding_attention", "full_attention"])
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # (initialized to zeros)
            layer.self_attn.sinks.normal_()
    model.save_pretrained(folder)
    save_tokenizer(folder)


def export(src: str, out: str, precision: str, extra: list[str], name: str) -> None:
    """Run the builder on the model in ``src`` (into ``out``) and write its model, weights embedded,
    as ``tests/models/<name>.onnx``."""
    import onnx

    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", src, "-o", out, "-p", precision,
                    "-e", "cpu", *extra], check=True)
    model = onnx.load(os.path.join(out, "model.onnx"), load_external_data=True)
    path = os.path.join(HERE, f"{name}.onnx")
    onnx.save_model(model, path + ".tmp", save_as_external_data=False)
    os.replace(path + ".tmp", path)
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for tied in (False, True):
            build_source(os.path.join(tmp, f"llama{'_tied' * tied}"), tied)
        build_gptoss_source(os.path.join(tmp, "gptoss"))
        # (name, precision, source, builder's extra options)
        for name, precision, src, extra in (("llama_genai_fp32", "fp32", "llama", []),
                                            ("llama_genai_int4", "int4", "llama", []),
                                            ("llama_genai_int4_tied", "int4", "llama_tied",
                                             ["--extra_options", "shared_embeddings=true",
                                              "op_types_to_quantize=MatMul/Gather"]),
                                            ("gptoss_genai_fp32", "fp32", "gptoss", [])):
            export(os.path.join(tmp, src), os.path.join(tmp, name), precision, extra, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
