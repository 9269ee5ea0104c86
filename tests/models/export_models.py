"""Export the small ONNX test models used by Shardflow's tests.

Regenerate everything (ONNX files, ``<name>_inputs.npz`` and ``MANIFEST.json``) with::

    python tests/models/export_models.py

Optional: ``python tests/models/export_models.py --out DIR --only gpt2 bert``.

Every model is built from a transformers config (or plain ``torch.nn``) with random weights after
``torch.manual_seed(0)``; nothing is downloaded (``HF_HUB_OFFLINE=1``). Each model is exported with
the TorchScript exporter (``dynamo=False``, opset 17 -> ``<name>_ts17.onnx``) and with the dynamo
exporter (``dynamo=True``, opset 18 -> ``<name>_dynamo18.onnx``), except where ``EXPORTS`` says
otherwise (``llama_sdpa``: dynamo at opset 23 only, ``llama_sdpa_dynamo23.onnx``). Shapes are static (batch 2,
sequence 8 for text models). Each wrapper returns a single tensor (last_hidden_state or logits).
Weights are stored inside the .onnx file (no external data). Every file is checked with
``onnx.checker`` and run with onnxruntime (CPU), and compared with the torch module on the
saved inputs and on a second input set (seed 1, all-ones mask) so a mask baked into the graph
would be caught. A failing exporter is recorded in ``MANIFEST.json`` (``"status": "failed"`` with
the error) instead of aborting; the exit status is 1 if any export failed.
Set ``SHARDFLOW_EXPORT_VERBOSE=1`` to see exporter warnings and tracebacks.

No reference outputs are stored: tests compare against onnxruntime at test time, feeding
``<name>_inputs.npz`` (keys are the ONNX input names; deterministic, numpy seed 0).

Importable helpers: ``export_gpt2(path, n_layer, n_embd, n_head, vocab_size, seq_len, batch,
dynamo=False, opset=17)`` for benchmarks (e.g. GPT-2 small: 12, 768, 12, 50257), ``op_summary(path)``.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import collections
import contextlib
import glob
import io
import json
import logging
import sys
import tempfile
import traceback
import warnings

import numpy as np
import onnx
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))

BATCH = 2
SEQ = 8
VOCAB = 128
IMAGE = 32

TS_OPSET = 17
DYNAMO_OPSET = 18


# --------------------------------------------------------------------------------------------
# Wrappers: every wrapper's forward returns one tensor.
# --------------------------------------------------------------------------------------------


class _HiddenState(nn.Module):
    """Return ``last_hidden_state`` of a transformers base model (text)."""

    def __init__(self, model, use_mask=True):
        super().__init__()
        self.model = model
        self.use_mask = use_mask

    def forward(self, input_ids, attention_mask=None):
        if self.use_mask:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
        else:
            out = self.model(input_ids=input_ids, return_dict=True)
        return out.last_hidden_state


class _Logits(nn.Module):
    """Return ``logits`` of a transformers LM-head model."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).logits


class _PixelHidden(nn.Module):
    """Return ``last_hidden_state`` of a vision model fed ``pixel_values``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values, return_dict=True).last_hidden_state


class MLP(nn.Module):
    """4 Linear layers, hidden 64: Linear-GELU-Linear-ReLU-Linear-GELU-Linear."""

    def __init__(self, d_in=32, hidden=64, d_out=16):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, d_out),
        )

    def forward(self, x):
        return self.net(x)


# --------------------------------------------------------------------------------------------
# Model builders: each returns (module, [(input_name, shape, numpy dtype, kind)], [output_name]).
# kind: "ids" (int64 in [0, VOCAB)), "mask" (int64 ones with some zero padding), "float" (N(0,1)).
# --------------------------------------------------------------------------------------------


def _text_inputs(with_mask=True):
    specs = [("input_ids", (BATCH, SEQ), "int64", "ids")]
    if with_mask:
        specs.append(("attention_mask", (BATCH, SEQ), "int64", "mask"))
    return specs


def build_gpt2(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=None, lm_head=True, n_inner=None):
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    cfg = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions or 64,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_inner=n_inner,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    model = GPT2LMHeadModel(cfg) if lm_head else GPT2Model(cfg)
    model.eval()
    wrapper = _Logits(model) if lm_head else _HiddenState(model)
    return wrapper, ["logits" if lm_head else "last_hidden_state"]


def build_bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    model = BertModel(cfg, add_pooling_layer=False).eval()
    return _HiddenState(model), _text_inputs(), ["last_hidden_state"]


def build_llama(attn_implementation="eager"):
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    model = LlamaModel(cfg).eval()
    return _HiddenState(model), _text_inputs(), ["last_hidden_state"]


def build_neox(width=64, intermediate=128, heads=4, positions=64, vocab_size=VOCAB):
    """GPT-NeoX (Pythia), 2 layers: attention and MLP in parallel from the same input, both added
    to the residual (``use_parallel_residual``), the block shape of GPT-J, GPT-NeoX and PaLM. The
    defaults are the test model's; ``benchmarks/plan_partial_sums.py`` builds a wider one."""
    from transformers import GPTNeoXConfig, GPTNeoXModel

    cfg = GPTNeoXConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=heads,
        max_position_embeddings=positions,
        use_parallel_residual=True,
        use_cache=False,
        attn_implementation="eager",
    )
    model = GPTNeoXModel(cfg).eval()
    return _HiddenState(model), _text_inputs(), ["last_hidden_state"]


def build_vit():
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(
        image_size=IMAGE,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    model = ViTModel(cfg, add_pooling_layer=False).eval()
    specs = [("pixel_values", (BATCH, 3, IMAGE, IMAGE), "float32", "float")]
    return _PixelHidden(model), specs, ["last_hidden_state"]


def build_t5_encoder():
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=0.0,
        use_cache=False,
        is_encoder_decoder=False,
        attn_implementation="eager",
    )
    model = T5EncoderModel(cfg).eval()
    return _HiddenState(model), _text_inputs(), ["last_hidden_state"]


def build_resnet():
    from transformers import ResNetConfig, ResNetModel

    cfg = ResNetConfig(
        num_channels=3,
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="basic",
        hidden_act="relu",
        downsample_in_first_stage=False,
    )
    model = ResNetModel(cfg).eval()
    specs = [("pixel_values", (BATCH, 3, IMAGE, IMAGE), "float32", "float")]
    return _PixelHidden(model), specs, ["last_hidden_state"]


def build_mlp():
    model = MLP().eval()
    specs = [("x", (BATCH, 32), "float32", "float")]
    return model, specs, ["output"]


def build_llama_sdpa():
    """Llama with torch's scaled_dot_product_attention, which the dynamo exporter at opset 23 writes as
    ONNX ``Attention`` ops (grouped K/V heads, the padding mask as a bool mask)."""
    return build_llama(attn_implementation="sdpa")


def _build_gpt2_default():
    wrapper, outs = build_gpt2(n_inner=128)
    return wrapper, _text_inputs(), outs


#: (exporter, dynamo, opset) of each model's exports, unless EXPORTS says otherwise.
DEFAULT_EXPORTS = (("torchscript", False, TS_OPSET), ("dynamo", True, DYNAMO_OPSET))
EXPORTS = {"llama_sdpa": (("dynamo", True, 23),)}  # the model is there for opset 23's Attention op

MODELS = {
    "gpt2": _build_gpt2_default,
    "bert": build_bert,
    "llama": build_llama,
    "llama_sdpa": build_llama_sdpa,
    "neox": build_neox,
    "vit": build_vit,
    "t5_encoder": build_t5_encoder,
    "resnet": build_resnet,
    "mlp": build_mlp,
}


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def make_inputs(specs, seed=0, vocab_size=VOCAB, pad=True):
    """Deterministic numpy inputs for ``specs`` (list of (name, shape, dtype, kind)).

    With ``pad`` the attention mask zeroes the last two positions of the last sequence; without it
    the mask is all ones (used to check that the exporter did not bake the mask into the graph).
    """
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, shape, dtype, kind in specs:
        if kind == "ids":
            arr = rng.integers(0, vocab_size, size=shape, dtype=np.int64)
        elif kind == "mask":
            arr = np.ones(shape, dtype=np.int64)
            # pad the tail of the last sequence so masking is actually exercised
            if pad and shape[0] > 1 and shape[-1] > 2:
                arr[-1, -2:] = 0
        else:
            arr = rng.standard_normal(size=shape).astype(dtype)
        feeds[name] = arr.astype(dtype)
    return feeds


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def _uses_external_data(model: onnx.ModelProto) -> bool:
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            return True
    return False


@contextlib.contextmanager
def _quiet():
    """Silence exporter chatter (warnings, progress prints) unless SHARDFLOW_EXPORT_VERBOSE is set."""
    if os.environ.get("SHARDFLOW_EXPORT_VERBOSE"):
        yield
        return
    buf = io.StringIO()
    levels = {}
    for name in ("torch.onnx", "onnxscript", "torch._dynamo", "torch.export", "transformers", "root"):
        lg = logging.getLogger(None if name == "root" else name)
        levels[name] = lg.level
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                yield
    finally:
        for name, lvl in levels.items():
            logging.getLogger(None if name == "root" else name).setLevel(lvl)


def export_dynamic_gpt2(path, seed: int = 0, **config) -> None:
    """A randomly initialised ``GPT2LMHeadModel`` (``GPT2Config(**config)``; its defaults: GPT-2 small)
    exported by the TorchScript exporter with the ``batch`` and ``seq`` dims of its inputs and logits
    dynamic (for shape variants: tests/driver/test_variants.py, benchmarks/cpu_variants.py)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(use_cache=False, **config)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    dyn = {0: "batch", 1: "seq"}
    with torch.no_grad(), _quiet():
        torch.onnx.export(_Logits(model), (ids, torch.ones_like(ids)), str(path),
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_axes={"input_ids": dyn, "attention_mask": dyn, "logits": dyn},
                          opset_version=TS_OPSET, dynamo=False)


def export_module(module, feeds, input_names, output_names, path, dynamo=False, opset=None):
    """Export ``module`` to a single self-contained ``path``. Returns the path.

    The export happens in a private temporary folder next to ``path`` and the finished file is
    moved into place with ``os.replace``, so ``path`` is never missing or half-written.
    """
    opset = opset or (DYNAMO_OPSET if dynamo else TS_OPSET)
    module.eval()
    args = tuple(torch.from_numpy(feeds[n]) for n in input_names)
    out_dir = os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export_tmp_", dir=out_dir) as tmp:
        tmp_path = os.path.join(tmp, os.path.basename(path))
        with torch.no_grad(), _quiet():
            if dynamo:
                prog = torch.onnx.export(
                    module,
                    args,
                    input_names=list(input_names),
                    output_names=list(output_names),
                    opset_version=opset,
                    dynamo=True,
                    external_data=False,
                    optimize=True,
                    verify=False,
                )
                prog.save(tmp_path, external_data=False)
            else:
                torch.onnx.export(
                    module,
                    args,
                    tmp_path,
                    input_names=list(input_names),
                    output_names=list(output_names),
                    opset_version=opset,
                    dynamo=False,
                    do_constant_folding=True,
                )
        # One file (pull any external data in), without the per-node debug metadata (stack
        # traces with local paths, fx node text) that the dynamo exporter attaches.
        model = onnx.load(tmp_path, load_external_data=True)
        _strip_debug_metadata(model)
        final_tmp = os.path.join(tmp, "final.onnx")
        onnx.save_model(model, final_tmp, save_as_external_data=False)
        del model
        os.replace(final_tmp, path)
    return path


def _atomic_write(path, write):
    """Call ``write(tmp_path)`` and move the result onto ``path``."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", suffix=os.path.splitext(path)[1], dir=d)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _strip_debug_metadata(model: onnx.ModelProto) -> None:
    def strip_graph(graph):
        graph.doc_string = ""
        for node in graph.node:
            del node.metadata_props[:]
            node.doc_string = ""
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    strip_graph(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        strip_graph(g)
        for vi in list(graph.value_info) + list(graph.input) + list(graph.output):
            del vi.metadata_props[:]
        for init in graph.initializer:
            del init.metadata_props[:]

    strip_graph(model.graph)
    for fn in model.functions:
        for node in fn.node:
            del node.metadata_props[:]
            node.doc_string = ""


def check_model(path, feeds):
    """onnx.checker + one onnxruntime CPU run. Returns the list of output arrays."""
    import onnxruntime as ort

    model = onnx.load(path)
    assert not _uses_external_data(model), f"{path} uses external data"
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    outs = sess.run(None, {n: feeds[n] for n in names})
    for o in outs:
        assert np.all(np.isfinite(o)), f"{path}: non-finite output"
    return outs


def compare_with_torch(module, path, feeds_list, input_names, rtol=1e-3, atol=1e-4):
    """Run ``module`` in torch and ``path`` in onnxruntime on each feed dict; return max abs diff."""
    import onnxruntime as ort

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    onnx_inputs = [i.name for i in sess.get_inputs()]
    worst = 0.0
    for feeds in feeds_list:
        with torch.no_grad():
            ref = module(*[torch.from_numpy(feeds[n]) for n in input_names]).numpy()
        got = sess.run(None, {n: feeds[n] for n in onnx_inputs})[0]
        assert got.shape == ref.shape, f"{path}: shape {got.shape} != torch {ref.shape}"
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol, err_msg=f"{path} vs torch")
        worst = max(worst, float(np.max(np.abs(got - ref))))
    return worst


def op_summary(path):
    """(Counter of op_type over the main graph and all functions, {domain: opset version})."""
    model = onnx.load(path, load_external_data=False)
    counts = collections.Counter()

    def walk(graph):
        for node in graph.node:
            counts[node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"] += 1
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        walk(g)

    walk(model.graph)
    for fn in model.functions:
        walk(fn)
    opsets = {(imp.domain or "ai.onnx"): imp.version for imp in model.opset_import}
    return counts, opsets


def _io_description(path):
    model = onnx.load(path, load_external_data=False)
    init_names = {i.name for i in model.graph.initializer}

    def desc(vi):
        t = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
        return {
            "name": vi.name,
            "shape": shape,
            "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
        }

    inputs = [desc(v) for v in model.graph.input if v.name not in init_names]
    outputs = [desc(v) for v in model.graph.output]
    return inputs, outputs


def export_gpt2(path, n_layer, n_embd, n_head, vocab_size, seq_len, batch, dynamo=False, opset=17):
    """Export a randomly initialised GPT2LMHeadModel (logits output) to a single ONNX file.

    Inputs: ``input_ids`` and ``attention_mask`` (int64, [batch, seq_len]); output ``logits``
    ([batch, seq_len, vocab_size]). Weights are inline (no external data); the protobuf 2 GB limit
    applies, which GPT-2 small (124M params, ~500 MB fp32) is well under. Returns a dict describing
    the export (path, inputs, outputs, size_bytes, n_params).
    """
    if opset is None:
        opset = DYNAMO_OPSET if dynamo else TS_OPSET
    torch.manual_seed(0)
    wrapper, outs = build_gpt2(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab_size,
        n_positions=max(1024, seq_len),
        lm_head=True,
    )
    specs = [
        ("input_ids", (batch, seq_len), "int64", "ids"),
        ("attention_mask", (batch, seq_len), "int64", "mask"),
    ]
    feeds = make_inputs(specs, seed=0, vocab_size=vocab_size)
    export_module(wrapper, feeds, [s[0] for s in specs], outs, path, dynamo=dynamo, opset=opset)
    inputs, outputs = _io_description(path)
    return {
        "path": path,
        "inputs": inputs,
        "outputs": outputs,
        "size_bytes": os.path.getsize(path),
        "n_params": sum(p.numel() for p in wrapper.parameters()),
    }


def export_all(out_dir=HERE, only=None, verbose=True):
    """Export every model in MODELS with both exporters. Returns the manifest dict (also written)."""
    os.makedirs(out_dir, exist_ok=True)
    manifest_path = os.path.join(out_dir, "MANIFEST.json")
    old = {}
    if only and os.path.exists(manifest_path):
        with open(manifest_path) as f:
            old = {(e["model"], e["exporter"]): e for e in json.load(f)["exports"]}
    entries = []
    names = [n for n in MODELS if not only or n in only]
    for name in names:
        torch.manual_seed(0)
        module, specs, outs = MODELS[name]()
        feeds = make_inputs(specs, seed=0)
        alt_feeds = make_inputs(specs, seed=1, pad=False)
        _atomic_write(os.path.join(out_dir, f"{name}_inputs.npz"), lambda p: np.savez(p, **feeds))
        input_names = [s[0] for s in specs]
        for exporter, dynamo, opset in EXPORTS.get(name, DEFAULT_EXPORTS):
            fname = f"{name}_{'dynamo' if dynamo else 'ts'}{opset}.onnx"
            path = os.path.join(out_dir, fname)
            entry = {
                "model": name,
                "exporter": exporter,
                "opset": opset,
                "file": fname,
                "inputs_file": f"{name}_inputs.npz",
            }
            try:
                torch.manual_seed(0)
                export_module(module, feeds, input_names, outs, path, dynamo=dynamo, opset=opset)
                ort_outs = check_model(path, feeds)
                max_diff = compare_with_torch(module, path, [feeds, alt_feeds], input_names)
                inputs, outputs = _io_description(path)
                counts, opsets = op_summary(path)
                entry.update(
                    status="ok",
                    inputs=inputs,
                    outputs=outputs,
                    output_shapes=[list(o.shape) for o in ort_outs],
                    size_bytes=os.path.getsize(path),
                    max_abs_diff_vs_torch=max_diff,
                    opset_imports=opsets,
                    op_types=dict(sorted(counts.items())),
                )
                if verbose:
                    print(
                        f"[ok]     {fname:28s} {os.path.getsize(path) / 1024:8.1f} KiB  "
                        f"opsets={opsets}  ops={len(counts)} types / {sum(counts.values())} nodes  "
                        f"max|ort-torch|={max_diff:.1e}"
                    )
            except Exception as e:  # record and carry on
                if os.path.exists(path):
                    os.remove(path)
                msg = f"{type(e).__name__}: {e}".strip().splitlines()
                entry.update(
                    status="failed",
                    error="\n".join(msg[:8])[:2000],
                    inputs=[
                        {"name": n, "shape": list(s), "dtype": dt} for n, s, dt, _ in specs
                    ],
                    outputs=[{"name": o} for o in outs],
                )
                if verbose:
                    print(f"[FAILED] {fname:28s} {msg[0][:200] if msg else ''}")
                    if os.environ.get("SHARDFLOW_EXPORT_VERBOSE"):
                        traceback.print_exc()
            entries.append(entry)
    if old:
        done = {(e["model"], e["exporter"]) for e in entries}
        entries = [e for k, e in old.items() if k not in done] + entries
        order = list(MODELS)
        entries.sort(key=lambda e: (order.index(e["model"]) if e["model"] in order else 99, e["exporter"] != "torchscript"))
    manifest = {
        "generated_by": "python tests/models/export_models.py",
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "seed": 0,
        "exports": entries,
    }
    def write_manifest(p):
        with open(p, "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")

    _atomic_write(manifest_path, write_manifest)
    if verbose:
        total = sum(os.path.getsize(p) for p in glob.glob(os.path.join(out_dir, "*.onnx")))
        total += sum(os.path.getsize(p) for p in glob.glob(os.path.join(out_dir, "*.npz")))
        n_ok = sum(e["status"] == "ok" for e in entries)
        print(f"{n_ok}/{len(entries)} exports ok; total size of .onnx + .npz: {total / 1024:.1f} KiB")
    return manifest


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=HERE, help="output directory (default: this folder)")
    p.add_argument("--only", nargs="*", choices=list(MODELS), help="export only these models")
    args = p.parse_args(argv)
    manifest = export_all(args.out, args.only)
    return 0 if all(e["status"] == "ok" for e in manifest["exports"]) else 1


if __name__ == "__main__":
    sys.exit(main())
