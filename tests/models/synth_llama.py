"""A Llama-shaped ONNX decoder with random weights, written without torch and without holding the weights.

Builds the graph a TorchScript export of transformers' ``LlamaForCausalLM`` (eager attention, no
cache) has, with onnx's helpers: token embedding (Gather), per layer RMSNorm (computed in float32
as transformers does: Cast, Pow, ReduceMean, Add, Sqrt, Div, Cast, Mul), the query/key/value
projections as MatMuls on weights stored ``[in, out]``, rotary embedding (rotate_half with Slice,
Neg, Concat; cos/sin tables of ``max_positions`` rows, the first ``seq`` taken), grouped key/value
heads repeated by Unsqueeze/Expand/Reshape, scaled scores plus a causal mask (ConstantOfShape,
Trilu), Softmax in float32, the output projection, residual adds, the SwiGLU MLP (``gate *
Sigmoid(gate) * up``, down projection), the final norm and the language-model head. ``input_ids``
``[batch, seq]`` in (dynamic dims unless given as numbers), ``logits`` out.

Every weight goes to one external data file (``<name>.onnx.data``) as it is made, so a
Llama-7B-sized model (6.7 G parameters, 13.5 GB at float16) is written in about a minute with
about one weight's worth of memory: the model to try a compile of that size on without downloading
one (``benchmarks/compile_memory.py``, ``benchmarks/compile_time.py --model``). Values: every
weight is a window, at a random offset, of one pool of 4 M draws from N(0, 0.02) (drawing 6.7 G
normals one by one took minutes); the norms' scales are 1.

    python tests/models/synth_llama.py OUT.onnx --preset llama-7b --dtype float16 [--batch 1 --seq 128]
    python tests/models/synth_llama.py OUT.onnx --layers 2 --hidden 256 --intermediate 688 --heads 4 \
        --kv-heads 2 --vocab 1000

Needs only numpy and onnx. ``tests/frontend/test_synth_llama.py`` checks small ones against
transformers' ``LlamaForCausalLM`` holding the same weights, and runs them with onnxruntime.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

PRESETS = {
    # name: layers, hidden, intermediate, heads, kv heads, vocab
    "llama-7b": dict(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32000),
    "llama-13b": dict(layers=40, hidden=5120, intermediate=13824, heads=40, kv_heads=40, vocab=32000),
    "llama3-8b": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256),
    "tiny": dict(layers=2, hidden=64, intermediate=160, heads=4, kv_heads=2, vocab=128),
}

_ONNX_TYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
POOL = 1 << 22  # normal draws every weight is cut from


class _Writer:
    """Nodes, initializers and the external data file of one model under construction."""

    def __init__(self, data_path: str, dtype: str, seed: int):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.dtype = dtype
        self.rng = np.random.default_rng(seed)
        # weights are windows of one pool of normal draws, taken at random offsets: drawing
        # 6.7 G normals one by one takes minutes, copying them seconds
        self.pool = (self.rng.standard_normal(POOL, dtype=np.float32) * np.float32(0.02)).astype(dtype)
        self.data_path = data_path
        self.file = open(data_path, "wb")
        self.offset = 0
        self.count = 0
        self.params = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def node(self, op: str, inputs: list[str], hint: str, **attrs) -> str:
        out = self.name(hint)
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"/{out}/{op}", **attrs))
        return out

    def const(self, value: np.ndarray, hint: str) -> str:
        """A small constant stored inside the .onnx file."""
        name = self.name(hint)
        self.inits.append(onnx.numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def weight(self, shape: tuple[int, ...], hint: str, fill: float | None = None) -> str:
        """A weight of the model's dtype, N(0, 0.02) values (or all ``fill``), into the data file."""
        name = hint
        size = int(np.prod(shape))
        if fill is None:
            value = np.empty(size, self.dtype)
            start, done = int(self.rng.integers(self.pool.size)), 0
            while done < size:
                n = min(size - done, self.pool.size - start)
                value[done:done + n] = self.pool[start:start + n]
                done, start = done + n, 0
        else:
            value = np.full(size, fill, self.dtype)
        t = TensorProto()
        t.name, t.data_type = name, _ONNX_TYPE[self.dtype]
        t.dims.extend(shape)
        t.data_location = TensorProto.EXTERNAL
        for key, val in (("location", os.path.basename(self.data_path)), ("offset", str(self.offset)),
                         ("length", str(value.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, val
        self.file.write(value.data)  # (no copy of the bytes)
        self.offset += value.nbytes
        pad = -self.offset % 64  # keep every tensor aligned for mapping
        self.file.write(b"\0" * pad)
        self.offset += pad
        self.inits.append(t)
        self.params += size
        return name


def _rms_norm(w: _Writer, x: str, hidden: int, prefix: str, eps: float) -> str:
    cast = w.dtype != "float32"
    h = w.node("Cast", [x], "norm_f32", to=TensorProto.FLOAT) if cast else x
    sq = w.node("Pow", [h, w.const(np.array(2.0, np.float32), "two")], "pow")
    mean = w.node("ReduceMean", [sq], "mean", axes=[-1], keepdims=1)
    var = w.node("Add", [mean, w.const(np.array(eps, np.float32), "eps")], "add_eps")
    y = w.node("Div", [h, w.node("Sqrt", [var], "sqrt")], "normed")
    if cast:
        y = w.node("Cast", [y], "norm_back", to=_ONNX_TYPE[w.dtype])
    return w.node("Mul", [w.weight((hidden,), f"{prefix}.weight", fill=1.0), y], "scaled")


def _rotary(positions: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(positions, dtype=np.float64), inv)
    emb = np.concatenate([angles, angles], axis=-1)
    return np.cos(emb), np.sin(emb)


def _rotate(w: _Writer, x: str, cos: str, sin: str, half: int) -> str:
    first = w.node("Slice", [x, w.const(np.array([0]), "s0"), w.const(np.array([half]), "s1"),
                             w.const(np.array([-1]), "ax")], "x1")
    second = w.node("Slice", [x, w.const(np.array([half]), "s0"), w.const(np.array([2 ** 62]), "s1"),
                              w.const(np.array([-1]), "ax")], "x2")
    rotated = w.node("Concat", [w.node("Neg", [second], "neg"), first], "rot", axis=-1)
    return w.node("Add", [w.node("Mul", [x, cos], "xcos"), w.node("Mul", [rotated, sin], "xsin")], "roped")


def _heads(w: _Writer, x: str, heads: int, head_dim: int) -> str:
    """[B, S, H*d] -> [B, H, S, d]."""
    shaped = w.node("Reshape", [x, w.const(np.array([0, 0, heads, head_dim]), "shape")], "split_heads")
    return w.node("Transpose", [shaped], "heads", perm=[0, 2, 1, 3])


def _layer(w: _Writer, x: str, i: int, cfg: dict, cos: str, sin: str, mask: str) -> str:
    d, h, hkv = cfg["hidden"], cfg["heads"], cfg["kv_heads"]
    hd = d // h
    p = f"model.layers.{i}"
    n = _rms_norm(w, x, d, f"{p}.input_layernorm", cfg["eps"])
    q = _heads(w, w.node("MatMul", [n, w.weight((d, h * hd), f"{p}.self_attn.q_proj.weight")], "q"), h, hd)
    k = _heads(w, w.node("MatMul", [n, w.weight((d, hkv * hd), f"{p}.self_attn.k_proj.weight")], "k"), hkv, hd)
    v = _heads(w, w.node("MatMul", [n, w.weight((d, hkv * hd), f"{p}.self_attn.v_proj.weight")], "v"), hkv, hd)
    q, k = _rotate(w, q, cos, sin, hd // 2), _rotate(w, k, cos, sin, hd // 2)
    if hkv != h:  # repeat_kv: [B, Hkv, S, d] -> [B, Hkv, g, S, d] -> [B, H, S, d]
        expand = w.const(np.array([1, 1, h // hkv, 1, 1]), "kv_expand")
        flat = w.const(np.array([0, h, -1, hd]), "kv_flat")
        k, v = (w.node("Reshape", [w.node("Expand", [w.node("Unsqueeze", [t, w.const(np.array([2]), "ax2")], "kv1"),
                                                      expand], "kv_rep"), flat], "kv_heads") for t in (k, v))
    kt = w.node("Transpose", [k], "kt", perm=[0, 1, 3, 2])
    scale = w.const(np.array(1.0 / np.sqrt(hd), w.dtype), "scale")
    scores = w.node("Add", [w.node("Mul", [w.node("MatMul", [q, kt], "qk"), scale], "scaled_qk"), mask], "masked")
    if w.dtype != "float32":
        scores = w.node("Cast", [scores], "scores_f32", to=TensorProto.FLOAT)
    probs = w.node("Softmax", [scores], "probs", axis=-1)
    if w.dtype != "float32":
        probs = w.node("Cast", [probs], "probs_back", to=_ONNX_TYPE[w.dtype])
    ctx = w.node("Transpose", [w.node("MatMul", [probs, v], "ctx")], "ctx_t", perm=[0, 2, 1, 3])
    ctx = w.node("Reshape", [ctx, w.const(np.array([0, 0, d]), "shape")], "merge_heads")
    x = w.node("Add", [x, w.node("MatMul", [ctx, w.weight((d, d), f"{p}.self_attn.o_proj.weight")], "o")], "res1")
    n = _rms_norm(w, x, d, f"{p}.post_attention_layernorm", cfg["eps"])
    f = cfg["intermediate"]
    gate = w.node("MatMul", [n, w.weight((d, f), f"{p}.mlp.gate_proj.weight")], "gate")
    up = w.node("MatMul", [n, w.weight((d, f), f"{p}.mlp.up_proj.weight")], "up")
    act = w.node("Mul", [w.node("Mul", [gate, w.node("Sigmoid", [gate], "sig")], "silu"), up], "act")
    down = w.node("MatMul", [act, w.weight((f, d), f"{p}.mlp.down_proj.weight")], "down")
    return w.node("Add", [x, down], "res2")


def build(path: str, *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int,
          batch: int | str = "batch", seq: int | str = "seq", max_positions: int = 2048, dtype: str = "float16",
          seed: int = 0, eps: float = 1e-5, theta: float = 10000.0, log=None) -> int:
    """Write the model to ``path`` (and its weights to ``path + '.data'``); return its parameter count.

    ``batch`` and ``seq`` are the input's declared dims (a name: dynamic); the graph itself works
    for any batch and any sequence up to ``max_positions`` (the rotary tables' rows). Both files are
    written under temporary names and renamed when complete."""
    if dtype not in _ONNX_TYPE:
        raise ValueError(f"dtype must be one of {sorted(_ONNX_TYPE)}, not {dtype!r}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})")
    cfg = dict(layers=layers, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
               vocab=vocab, eps=eps)
    data_final = path + ".data"
    tmp_data = data_final + ".partial"
    w = _Writer(tmp_data, dtype, seed)
    t0 = time.perf_counter()
    try:
        # the rotary tables' first `seq` rows, and a [seq, seq] causal mask (dtype's min above the diagonal)
        n = w.node("Shape", ["input_ids"], "seq_len", start=1, end=2)
        zero, rows = w.const(np.array([0]), "zero"), w.const(np.array([0]), "axis0")
        cos_v, sin_v = _rotary(max_positions, hidden // heads, theta)
        cos, sin = (w.node("Slice", [w.const(t.astype(dtype), name), zero, n, rows], name + "_rows")
                    for t, name in ((cos_v, "cos"), (sin_v, "sin")))
        square = w.node("Concat", [n, n], "mask_shape", axis=0)
        fill = helper.make_tensor("fill", _ONNX_TYPE[dtype], [1], [float(np.finfo(dtype).min)])
        mask = w.node("Trilu", [w.node("ConstantOfShape", [square], "mask_fill", value=fill),
                                w.const(np.array(1), "one")], "causal_mask", upper=1)
        x = w.node("Gather", [w.weight((vocab, hidden), "model.embed_tokens.weight"), "input_ids"], "embed")
        for i in range(layers):
            x = _layer(w, x, i, cfg, cos, sin, mask)
            if log:
                log(f"layer {i + 1}/{layers}: {w.params / 1e9:.2f} G parameters, {time.perf_counter() - t0:.0f} s")
        x = _rms_norm(w, x, hidden, "model.norm", eps)
        logits = w.node("MatMul", [x, w.weight((hidden, vocab), "lm_head.weight")], "logits_mm")
        w.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="/logits/Identity"))
    finally:
        w.file.close()
    graph = helper.make_graph(
        w.nodes, "synth_llama",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])],
        [helper.make_tensor_value_info("logits", _ONNX_TYPE[dtype], [batch, seq, vocab])],
        initializer=w.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="synth_llama")
    for t in model.graph.initializer:  # point at the final data file name
        for e in t.external_data:
            if e.key == "location":
                e.value = os.path.basename(data_final)
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(model.SerializeToString())
    os.replace(tmp_data, data_final)
    onnx.checker.check_model(tmp)  # a path: its external data is checked against the file
    os.replace(tmp, path)
    return w.params


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the .onnx file to write (its weights go to OUT.data)")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a model size; the flags below override it")
    for key in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    ap.add_argument("--batch", default="batch", help="the input's batch dim: a number, or a name (dynamic; default)")
    ap.add_argument("--seq", default="seq", help="the input's sequence dim, likewise")
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--dtype", default="float16", choices=sorted(_ONNX_TYPE))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = dict(PRESETS[args.preset]) if args.preset else {}
    for key in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    missing = [k for k in ("layers", "hidden", "intermediate", "heads", "vocab") if k not in cfg]
    if missing:
        ap.error(f"give --preset or every size: missing {', '.join('--' + k for k in missing)}")
    cfg.setdefault("kv_heads", cfg["heads"])
    t0 = time.perf_counter()
    dims = {k: int(v) if v.isdigit() else v for k, v in (("batch", args.batch), ("seq", args.seq))}
    n = build(args.out, max_positions=args.max_positions, dtype=args.dtype, seed=args.seed, **dims,
              log=lambda m: print(m, file=sys.stderr), **cfg)
    print(f"wrote {args.out} (+ .data): {n / 1e9:.3f} G parameters, {args.dtype}, "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
