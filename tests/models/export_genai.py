"""Build the onnxruntime-genai test models: a 2-layer Llama (hidden 64, 4 heads, 2 KV heads, vocabulary 256,
random weights after ``torch.manual_seed(0)``) exported by onnxruntime-genai's model builder, as its users
get their LLMs: ``GroupQueryAttention`` with packed QKV and rotary embeddings, ``SkipSimplifiedLayerNormalization``,
a KV cache as inputs and outputs; in float32 (``llama_genai_fp32.onnx``) and 4-bit (``llama_genai_int4.onnx``:
``MatMulNBits``, block 32, accuracy level 4); and 4-bit with the embedding tied to the ``lm_head``
(``llama_genai_int4_tied.onnx``: the builder's ``shared_embeddings`` option gathers the embedding rows from the
``lm_head``'s 4-bit weight with ``GatherBlockQuantized``). The weights are embedded in the .onnx files.

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


def build_source(folder: str, tied: bool = False) -> None:
    """A random-weight Llama and a word-level tokenizer (the builder saves one) in ``folder``; with
    ``tied``, one weight for the embedding and the ``lm_head``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tied)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(folder)


def main() -> int:
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        for tied in (False, True):
            build_source(os.path.join(tmp, f"llama{'_tied' * tied}"), tied)
        # (name, precision, source, builder's extra options)
        for name, precision, src, extra in (("fp32", "fp32", "llama", []), ("int4", "int4", "llama", []),
                                            ("int4_tied", "int4", "llama_tied",
                                             ["--extra_options", "shared_embeddings=true",
                                              "op_types_to_quantize=MatMul/Gather"])):
            out = os.path.join(tmp, name)
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", os.path.join(tmp, src),
                            "-o", out, "-p", precision, "-e", "cpu", *extra], check=True)
            model = onnx.load(os.path.join(out, "model.onnx"), load_external_data=True)
            path = os.path.join(HERE, f"llama_genai_{name}.onnx")
            onnx.save_model(model, path + ".tmp", save_as_external_data=False)
            os.replace(path + ".tmp", path)
            print(f"wrote {path} ({os.path.getsize(path)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
