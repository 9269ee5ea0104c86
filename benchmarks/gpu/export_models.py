"""Build the two end-to-end benchmark models and export them to ONNX.

Models (random weights after ``torch.manual_seed(0)``; nothing is downloaded, ``HF_HUB_OFFLINE=1``):

* ``gpt2_small``: ``transformers.GPT2LMHeadModel(GPT2Config())`` -- the GPT-2 small defaults
  (12 layers, width 768, 12 heads, vocabulary 50257, 1024 positions; 124M parameters).
* ``llama``: a Llama-style ``LlamaForCausalLM`` small enough to export and compile in seconds: width 1024,
  8 layers, 16 heads (no grouped KV: 16 KV heads), SwiGLU intermediate 2816, vocabulary 32000,
  RMSNorm eps 1e-6, untied LM head (about 168M parameters).
* ``llama7b`` (not in the default set): Llama-2-7B's shapes (32 layers, width 4096, 32 heads,
  SwiGLU 11008, vocabulary 32000; 6.74 G parameters). Too large to export from torch on a machine
  of this kind in reasonable time, so the ONNX file is written by ``tests/models/synth_llama.py``
  (numpy and onnx; weights in external data, dynamic batch and sequence, RMSNorm eps 1e-5) and the
  torch module is ``LlamaForCausalLM`` holding the same weights read back from that file (the
  synthetic graph is transformers' Llama: ``tests/frontend/test_synth_llama.py``). Written in the
  model dtype: ``--model-dtype float16`` gives the 13.5 GB a float16 checkpoint has.

Both take one input, ``input_ids`` (int64 ``[batch, 128]``, no attention mask: causal attention
only; the export passes an all-ones mask, see ``Logits``) and return ``logits`` (float32
``[batch, 128, vocab]``). They are exported with the TorchScript exporter (``dynamo=False``,
opset 17) with a dynamic batch dimension, so one file serves both 1x128 and 8x128
(``compile(..., input_shapes={"input_ids": [B, 128]})`` binds it).
Attention is exported with transformers' ``"eager"`` implementation (plain MatMul/Softmax, which
the importer reads); the torch baselines in ``models.py`` run the same weights with the
``"sdpa"`` implementation, the default a torch user gets.

The weights do not need to travel: the GPU image has transformers, so ``models.py`` calls
:func:`export` on the device itself and times torch on the very module it exported. Running
this file by hand (``python benchmarks/gpu/export_models.py --out DIR``) writes, per model,
``<name>.onnx`` and ``<name>.json`` (config and I/O); ``models.py --export-dir DIR`` reuses
them only together with ``<name>.state.pt`` (the state dict, written with ``--state``), because
torch needs the same weights. At 0.5-0.7 GB per model these files are far too large to carry to
the device machine; export there instead.
"""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import contextlib
import io
import json
import logging
import tempfile
import time
import warnings

SEQ = 128
MODELS = ("gpt2_small", "llama")
SYNTH = {"llama7b": "llama-7b"}  # written by tests/models/synth_llama.py: name -> its preset

LLAMA_CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
                    rms_norm_eps=1e-6, tie_word_embeddings=False)


def _logits_wrapper(model):
    import torch

    class Logits(torch.nn.Module):
        """``input_ids -> logits`` of a transformers causal LM (no cache).

        With ``ones_mask`` (set for the ONNX export) an all-ones attention mask is passed: without
        a mask, recent transformers look for packed sequences in the position ids with
        ``aten::diff``, which the TorchScript exporter cannot export. An all-ones mask computes
        the same function; the torch timings run with ``ones_mask = False`` (no mask: the path a
        torch user gets for unpadded input).
        """

        def __init__(self, m):
            super().__init__()
            self.model = m
            self.ones_mask = False

        def forward(self, input_ids):
            mask = torch.ones_like(input_ids) if self.ones_mask else None
            return self.model(input_ids=input_ids, attention_mask=mask, use_cache=False, return_dict=True).logits

    return Logits(model).eval()


def build(name: str, attn: str = "eager", tiny: bool = False):
    """The wrapped model ``name`` (random weights after ``torch.manual_seed(0)``) and its config dict.

    Parameters
    ----------
    name
        ``"gpt2_small"`` or ``"llama"``.
    attn
        transformers attention implementation, ``"eager"`` (for export) or ``"sdpa"``.
    tiny
        A 2-layer, narrow version of the same architecture (for tests and quick dry runs).
    """
    import torch

    torch.manual_seed(0)
    if name == "gpt2_small":
        from transformers import GPT2Config, GPT2LMHeadModel

        kw = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, bos_token_id=0, eos_token_id=0) if tiny else {}
        cfg = GPT2Config(use_cache=False, attn_implementation=attn, **kw)
        model = GPT2LMHeadModel(cfg)
    elif name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        kw = dict(LLAMA_CONFIG)
        if tiny:
            kw.update(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4)
        cfg = LlamaConfig(use_cache=False, attn_implementation=attn, **kw)
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    model.eval()
    desc = {k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool)) or v is None}
    return _logits_wrapper(model), desc


def set_attention(wrapper, attn: str) -> str:
    """Switch a built wrapper's attention implementation in place; returns the one in effect."""
    m = wrapper.model
    if hasattr(m, "set_attn_implementation"):
        try:
            m.set_attn_implementation(attn)
        except Exception as exc:  # noqa: BLE001 - older/newer transformers refuse some
            logging.getLogger(__name__).warning("cannot switch attention to %s: %s", attn, exc)
    else:
        m.config._attn_implementation = attn
    return getattr(m.config, "_attn_implementation", attn)


@contextlib.contextmanager
def _quiet():
    buf = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            yield


def export(name: str, path: str, tiny: bool = False, dtype: str = "float32"):
    """Build ``name`` and export it to ``path`` (single file, dynamic batch); ``dtype``
    ``"bfloat16"``/``"float16"`` exports the module cast to that type (weights and activations; the
    returned wrapper is float32 again, with those rounded weights).

    Returns
    -------
    (wrapper, info)
        The exported torch module (CPU, eager attention) and a JSON-ready description
        (config, parameter count, export seconds, file size).
    """
    import onnx
    import torch

    if name in SYNTH:
        return _export_synth(name, path, tiny, dtype)
    t0 = time.perf_counter()
    wrapper, cfg = build(name, "eager", tiny=tiny)
    vocab = cfg["vocab_size"]
    ids = torch.randint(0, vocab, (2, SEQ), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    wrapper.ones_mask = True
    wrapper.to({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype])
    with tempfile.TemporaryDirectory(prefix=".export-", dir=d) as tmp:
        raw = os.path.join(tmp, "raw.onnx")
        with torch.no_grad(), _quiet():
            torch.onnx.export(wrapper, (ids,), raw, input_names=["input_ids"], output_names=["logits"],
                              opset_version=17, dynamo=False, do_constant_folding=True,
                              dynamic_axes={"input_ids": {0: "batch"}, "logits": {0: "batch"}})
        model = onnx.load(raw, load_external_data=True)  # pull any external data into one file
        final = os.path.join(tmp, "final.onnx")
        onnx.save_model(model, final, save_as_external_data=False)
        del model
        os.replace(final, path)
    wrapper.ones_mask = False
    wrapper.float()
    info = {"name": name, "dtype": dtype, "path": os.path.abspath(path), "config": cfg, "seq_len": SEQ,
            "n_params": int(sum(p.numel() for p in wrapper.parameters())),
            "size_bytes": os.path.getsize(path), "export_s": round(time.perf_counter() - t0, 2),
            "inputs": {"input_ids": ["batch", SEQ]}, "outputs": {"logits": ["batch", SEQ, vocab]},
            "tiny": tiny}
    return wrapper, info


def _synth_llama():
    """``tests/models/synth_llama.py`` (loaded by its path; that folder is not put on sys.path)."""
    from common import load_by_path

    return load_by_path("sf_synth_llama", "tests/models/synth_llama.py")


def synth_preset(name: str, tiny: bool) -> dict:
    """The sizes of synthetic model ``name`` (``tiny``: the 2-layer preset)."""
    return dict(_synth_llama().PRESETS["tiny" if tiny else SYNTH[name]])


def synth_module(path: str, preset: dict, attn: str = "eager"):
    """``LlamaForCausalLM`` (wrapped like :func:`build`'s, float32, CPU) holding the weights of the
    synthetic model at ``path`` (written by ``synth_llama.build`` with ``preset``'s sizes)."""
    import numpy as np
    import onnx
    import torch
    from onnx import numpy_helper
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=preset["vocab"], hidden_size=preset["hidden"],
                      intermediate_size=preset["intermediate"], num_hidden_layers=preset["layers"],
                      num_attention_heads=preset["heads"], num_key_value_heads=preset["kv_heads"],
                      max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      use_cache=False, attn_implementation=attn)
    skip = contextlib.nullcontext()  # (drawing 6.7 G random initial values would take minutes)
    for where in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            skip = getattr(__import__(where, fromlist=["no_init_weights"]), "no_init_weights")()
            break
        except (ImportError, AttributeError):
            pass
    with skip:
        model = LlamaForCausalLM(cfg)
    proto = onnx.load(path, load_external_data=False)
    base = os.path.dirname(os.path.abspath(path))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for t in proto.graph.initializer:
            if t.name in params:
                if t.data_location == onnx.TensorProto.EXTERNAL:  # mapped, not read through protobuf
                    ext = {e.key: e.value for e in t.external_data}
                    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
                    a = np.memmap(os.path.join(base, ext["location"]), dtype=dtype, mode="r",
                                  offset=int(ext.get("offset", 0)), shape=tuple(t.dims))
                else:
                    a = numpy_helper.to_array(t)
                a = torch.from_numpy(np.array(a))  # (copy_ converts to float32 as it transposes)
                params.pop(t.name).copy_(a.T if t.name.endswith("proj.weight") or t.name == "lm_head.weight" else a)
    if params:
        raise ValueError(f"{path}: no weights for {sorted(params)[:4]}")
    model.eval()
    desc = {k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool)) or v is None}
    return _logits_wrapper(model), desc


def _export_synth(name: str, path: str, tiny: bool, dtype: str):
    if dtype not in ("float32", "float16"):
        raise ValueError(f"{name} is written in float32 or float16, not {dtype}")
    preset = synth_preset(name, tiny)
    t0 = time.perf_counter()
    n = _synth_llama().build(path, dtype=dtype, **preset)
    wrapper, cfg = synth_module(path, preset)
    size = os.path.getsize(path) + os.path.getsize(path + ".data")
    info = {"name": name, "dtype": dtype, "path": os.path.abspath(path), "config": cfg, "seq_len": SEQ,
            "n_params": n, "size_bytes": size, "export_s": round(time.perf_counter() - t0, 2),
            "inputs": {"input_ids": ["batch", "seq"]}, "outputs": {"logits": ["batch", "seq", preset["vocab"]]},
            "tiny": tiny, "synthetic": "tests/models/synth_llama.py"}
    return wrapper, info


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for <name>.onnx and <name>.json")
    ap.add_argument("--only", nargs="*", choices=MODELS, default=list(MODELS))
    ap.add_argument("--tiny", action="store_true", help="2-layer narrow versions (tests)")
    ap.add_argument("--state", action="store_true", help="also save <name>.state.pt (the torch weights)")
    args = ap.parse_args(argv)
    import torch

    for name in args.only:
        path = os.path.join(args.out, f"{name}.onnx")
        wrapper, info = export(name, path, tiny=args.tiny)
        if args.state:
            torch.save(wrapper.state_dict(), os.path.join(args.out, f"{name}.state.pt"))
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(info, f, indent=1)
        print(f"{name}: {info['n_params'] / 1e6:.1f}M parameters, {info['size_bytes'] / 1e6:.1f} MB, "
              f"exported in {info['export_s']} s -> {path}", flush=True)


if __name__ == "__main__":
    main()
