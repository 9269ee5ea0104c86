"""A Llama-style decoder taking one token per sequence over a static KV cache, for ``decode.py``.

The module (``DecodeLM``; random weights after ``torch.manual_seed(0)``) is RMSNorm, rotary
embeddings, grouped-query attention (``heads`` query heads over ``kv_heads`` KV heads, repeated
as transformers' ``repeat_kv`` does), a SwiGLU MLP and an untied LM head. Its cache is static, as
a serving stack keeps it: one ``[batch, kv_heads, max_len, head]`` buffer per layer for keys and
one for values, and a step writes the new token's key and value at row ``pos`` and attends over
the rows ``<= pos`` (an additive mask over all ``max_len`` rows, as transformers' static cache
does).

Two forms of one step, the same arithmetic:

* :meth:`DecodeLM.forward` (what is exported to ONNX): ``(input_ids [B, 1] int64, pos [1]
  int64, past_key_0, past_value_0, ...)`` to ``(logits [B, 1, vocab], present_key_0,
  present_value_0, ...)``, each present ``Where(j != pos, past, new row)``: the form
  ``compile(state={present: past})`` writes over its past in place, storing only the new row
  (rfcs/0003, "Only the rows that change").
* :meth:`DecodeLM.step` (what torch runs): the same with the cache updated in place
  (``index_copy_``) in buffers of the module and ``scaled_dot_product_attention`` with
  ``enable_gqa``, the fast path a torch user writes (and ``torch.compile`` captures).

Exported with the TorchScript exporter (opset 17, ``dynamo=False``).
"""
from __future__ import annotations

import math
import time

#: the default size: Llama 3.2 1B's attention and MLP shapes at half its depth (width 2048, 32
#: heads of 64 over 8 KV heads, SwiGLU 8192) with a 32000-token vocabulary: about 0.6B parameters
CONFIG = dict(vocab=32000, hidden=2048, layers=8, heads=32, kv_heads=8, mlp=8192)
#: a 2-layer narrow one for the script's tests
TINY = dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128)


def build(max_len: int, *, tiny: bool = False, **overrides):
    """``DecodeLM`` of :data:`CONFIG` (or :data:`TINY`) with ``overrides``, float32, on the CPU."""
    import torch

    class RMSNorm(torch.nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(n))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight

    class Layer(torch.nn.Module):
        def __init__(self, c):
            super().__init__()
            h, d = c["hidden"], c["hidden"] // c["heads"]
            self.heads, self.kv_heads, self.d = c["heads"], c["kv_heads"], d
            self.ln1, self.ln2 = RMSNorm(h), RMSNorm(h)
            self.q = torch.nn.Linear(h, c["heads"] * d, bias=False)
            self.k = torch.nn.Linear(h, c["kv_heads"] * d, bias=False)
            self.v = torch.nn.Linear(h, c["kv_heads"] * d, bias=False)
            self.o = torch.nn.Linear(c["heads"] * d, h, bias=False)
            self.gate = torch.nn.Linear(h, c["mlp"], bias=False)
            self.up = torch.nn.Linear(h, c["mlp"], bias=False)
            self.down = torch.nn.Linear(c["mlp"], h, bias=False)

        def qkv(self, x, cos, sin):
            b = x.shape[0]
            h = self.ln1(x)
            q = self.q(h).view(b, 1, self.heads, self.d).transpose(1, 2)
            k = self.k(h).view(b, 1, self.kv_heads, self.d).transpose(1, 2)
            v = self.v(h).view(b, 1, self.kv_heads, self.d).transpose(1, 2)
            return _rope(q, cos, sin), _rope(k, cos, sin), v

        def rest(self, x, o):
            b = x.shape[0]
            x = x + self.o(o.transpose(1, 2).reshape(b, 1, self.heads * self.d))
            h = self.ln2(x)
            return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))

    def _rope(x, cos, sin):  # rotate-half rotary embedding at the step's position
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def repeat_kv(x, rep: int):  # transformers' form: [B, Hk, L, D] -> [B, Hk * rep, L, D]
        b, hk, n, d = x.shape
        return x[:, :, None, :, :].expand(b, hk, rep, n, d).reshape(b, hk * rep, n, d)

    class DecodeLM(torch.nn.Module):
        def __init__(self, c, max_len):
            super().__init__()
            self.c, self.max_len = c, max_len
            d = c["hidden"] // c["heads"]
            self.embed = torch.nn.Embedding(c["vocab"], c["hidden"])
            self.layers = torch.nn.ModuleList(Layer(c) for _ in range(c["layers"]))
            self.norm = RMSNorm(c["hidden"])
            self.lm_head = torch.nn.Linear(c["hidden"], c["vocab"], bias=False)
            inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
            ang = torch.arange(max_len).float()[:, None] * inv[None, :]
            ang = torch.cat((ang, ang), dim=-1)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)

        def _angles(self, pos):
            return self.cos[pos].to(self.embed.weight.dtype), self.sin[pos].to(self.embed.weight.dtype)

        def forward(self, input_ids, pos, *pasts):
            """The exported step: logits and the presents (new row at ``pos``)."""
            x = self.embed(input_ids)
            cos, sin = self._angles(pos)
            j = torch.arange(self.max_len, device=input_ids.device)
            other = (j != pos)[:, None]  # [L, 1]: the rows that keep their past
            bias = torch.where(j <= pos, 0.0, float("-inf")).to(x.dtype)  # the rows a query sees
            rep = self.c["heads"] // self.c["kv_heads"]
            presents = []
            for n, layer in enumerate(self.layers):
                q, k, v = layer.qkv(x, cos, sin)
                kc = torch.where(other, pasts[2 * n], k)
                vc = torch.where(other, pasts[2 * n + 1], v)
                presents += [kc, vc]
                s = torch.matmul(q, repeat_kv(kc, rep).transpose(2, 3)) / math.sqrt(layer.d) + bias
                o = torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), repeat_kv(vc, rep))
                x = layer.rest(x, o)
            return (self.lm_head(self.norm(x)), *presents)

        def reset_cache(self, batch: int) -> None:
            """Static cache buffers (zeros) for :meth:`step`, in the module's type and device
            (buffers: ``torch.compile``'s CUDA graphs keep their addresses and their updates)."""
            w = self.embed.weight
            shape = (batch, self.c["kv_heads"], self.max_len, self.c["hidden"] // self.c["heads"])
            for n in range(2 * self.c["layers"]):
                self.register_buffer(f"cache_{n}", torch.zeros(shape, dtype=w.dtype, device=w.device),
                                     persistent=False)

        def step(self, input_ids, pos):
            """torch's step: the cache updated in place, SDPA over the rows ``<= pos``."""
            x = self.embed(input_ids)
            cos, sin = self._angles(pos)
            seen = (torch.arange(self.max_len, device=input_ids.device) <= pos)[None, None, None, :]
            for n, layer in enumerate(self.layers):
                q, k, v = layer.qkv(x, cos, sin)
                kc, vc = getattr(self, f"cache_{2 * n}"), getattr(self, f"cache_{2 * n + 1}")
                kc.index_copy_(2, pos, k)
                vc.index_copy_(2, pos, v)
                o = torch.nn.functional.scaled_dot_product_attention(q, kc, vc, attn_mask=seen, enable_gqa=True)
                x = layer.rest(x, o)
            return self.lm_head(self.norm(x))

    c = dict(TINY if tiny else CONFIG)
    c.update(overrides)
    torch.manual_seed(0)
    model = DecodeLM(c, max_len).eval()
    with torch.no_grad():  # (weights of a realistic scale: unit-variance activations through the layers)
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5 if p is not model.embed.weight else 1.0)
    return model


def io_names(layers: int) -> tuple[list[str], list[str]]:
    """The exported inputs and outputs."""
    caches = [f"{kv}_{n}" for n in range(layers) for kv in ("key", "value")]
    return ["input_ids", "pos"] + [f"past_{c}" for c in caches], ["logits"] + [f"present_{c}" for c in caches]


def export(model, path: str, batch: int, dtype: str = "float16") -> dict:
    """Export ``model`` cast to ``dtype`` (a copy; the module stays float32) to ``path`` as one file,
    traced at ``batch`` sequences with the batch dimension dynamic; its state pairs (``present_*``
    -> ``past_*``), export time and parameter count."""
    import copy
    import io

    import onnx
    import torch

    m = copy.deepcopy(model).to({"float16": torch.float16, "bfloat16": torch.bfloat16,
                                 "float32": torch.float32}[dtype])
    c = m.c
    ins, outs = io_names(c["layers"])
    shape = (batch, c["kv_heads"], m.max_len, c["hidden"] // c["heads"])
    args = (torch.zeros(batch, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
            *(torch.zeros(shape, dtype=m.embed.weight.dtype) for _ in range(2 * c["layers"])))
    t0 = time.perf_counter()
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(m, args, buf, input_names=ins, output_names=outs, opset_version=17, dynamo=False,
                          do_constant_folding=True,
                          dynamic_axes={n: {0: "batch"} for n in ins + outs if n != "pos"})
    onnx.save(onnx.load_from_string(buf.getvalue()), path)
    return {"state": {o: i for o, i in zip(outs[1:], ins[2:])}, "export_s": time.perf_counter() - t0,
            "n_params": sum(p.numel() for p in model.parameters())}
