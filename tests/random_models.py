"""Random ONNX models for differential tests (a test tool, not part of shardflow).

Each generator takes a seed and returns ``(model, feeds, description)``: a small opset-17 model
built with ``onnx.helper`` and inputs for it. The same seed gives the same model. The models mix
the forms that the compiler's passes and templates special-case, at sizes that are not multiples
of the tiles:

* :func:`conv_net`: 1-4 layers of convs (every kernel size, stride, dilation, asymmetric padding,
  groups up to depthwise), transposed convs (overlapping or not, output padding, groups), max
  pools, then now and then a concatenation with a 1x1 branch, a 2x resize, a BatchNorm, SiLU, a
  squeeze-and-excite gate, a residual add and a ReLU; float32 or float16.
* :func:`matmul_chain`: 1-3 products (``MatMul``, ``Gemm`` with ``transB`` and ``alpha``, a weight
  stored ``[N, K]`` and transposed in the graph), biases, ReLU/Erf/SiLU, a residual add, a
  LayerNorm; batch dims or none; float32 or float16.
* :func:`attention_block`: self-attention as transformers' eager forms write it: projections, heads
  split by reshapes and transposes (grouped KV heads repeated as ``repeat_kv`` does), the scale on
  the scores, on Q or on both, a causal mask added or filled with the type's lowest value, a
  padding mask added or filled from a boolean input, a float32 softmax in float16 models, and an
  output projection.

Session 53 ran several hundred of each against onnxruntime and the host emulation of the cuda
kernels (tests/codegen/test_random_models.py keeps a few seeds of each; ``-m slow``).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Builder:
    """Nodes, initializers and fresh names for one model."""

    def __init__(self, rng: np.random.Generator, npt):
        self.rng, self.npt = rng, npt
        self.nodes: list = []
        self.inits: list = []
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, value, prefix: str = "c") -> str:
        n = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(value), n))
        return n

    def weight(self, shape, scale: float) -> str:
        return self.const((self.rng.standard_normal(shape) * scale).astype(self.npt), "w")

    def node(self, op: str, inputs: list[str], prefix: str = "t", **attrs) -> str:
        out = self.name(prefix)
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def model(self, inputs: list, outputs: list) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "random", inputs, outputs, self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m


def _io(name: str, npt, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(npt)), list(shape))


def conv_net(seed: int) -> tuple[onnx.ModelProto, dict, str]:
    """A random conv net on ``x [N, C, H, W]`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    npt = np.float16 if rng.random() < 0.5 else np.float32
    b = _Builder(rng, npt)
    shapes = {"x": (int(rng.choice([1, 2, 3])), int(rng.choice([3, 4, 8, 16, 24, 32, 64])),
                    int(rng.integers(4, 24)), int(rng.integers(4, 24)))}
    cur, desc = "x", []
    for _ in range(int(rng.integers(1, 5))):
        n, c, h, w = shapes[cur]
        kind = rng.choice(["conv", "conv", "conv", "transposed", "pool"])
        if kind == "pool":
            k, s = int(rng.choice([2, 3])), int(rng.choice([1, 2]))
            if min(h, w) < k:
                continue
            out = b.node("MaxPool", [cur], kernel_shape=[k, k], strides=[s, s])
            shapes[out] = (n, c, (h - k) // s + 1, (w - k) // s + 1)
            desc.append(f"pool{k}s{s}")
        elif kind == "conv":
            kh, kw = ([int(v) for v in rng.choice([1, 2, 3, 5], 2)] if rng.random() < 0.3
                      else [int(rng.choice([1, 3, 5]))] * 2)
            st = [int(v) for v in rng.choice([1, 2, 3], 2)] if rng.random() < 0.2 else [int(rng.choice([1, 1, 2]))] * 2
            dil = [int(rng.choice([1, 1, 2]))] * 2
            pads = [int(rng.integers(0, k)) if k > 1 else 0 for k in (kh, kw)]
            pads = pads * 2 if rng.random() < 0.8 else pads + [int(rng.integers(0, kh)), int(rng.integers(0, kw))]
            oh = (h + pads[0] + pads[2] - dil[0] * (kh - 1) - 1) // st[0] + 1
            ow = (w + pads[1] + pads[3] - dil[1] * (kw - 1) - 1) // st[1] + 1
            if min(oh, ow) < 1:
                continue
            g = int(rng.choice([g for g in (1, 1, 1, 2, 4, c) if c % g == 0]))
            oc = c if g == c and rng.random() < 0.5 else int(rng.choice([8, 16, 24, 32, 48, 64]))
            oc = g * max(1, oc // g)
            ins = [cur, b.weight((oc, c // g, kh, kw), (c // g * kh * kw) ** -0.5)]
            ins += [b.weight((oc,), 0.5)] if rng.random() < 0.5 else []
            out = b.node("Conv", ins, kernel_shape=[kh, kw], strides=st, dilations=dil, pads=pads, group=g)
            shapes[out] = (n, oc, oh, ow)
            desc.append(f"conv{kh}x{kw}s{st}d{dil}p{pads}g{g}->{oc}")
        else:
            k, s = int(rng.choice([2, 3, 4])), int(rng.choice([1, 2, 2]))
            p = int(rng.integers(0, k)) if rng.random() < 0.4 else 0
            op = int(rng.integers(0, s)) if rng.random() < 0.3 else 0
            g = int(rng.choice([g for g in (1, 1, 2) if c % g == 0]))
            oc = g * max(1, int(rng.choice([8, 16, 32])) // g)
            oh, ow = ((v - 1) * s - 2 * p + k + op for v in (h, w))
            if min(oh, ow) < 1:
                continue
            ins = [cur, b.weight((c, oc // g, k, k), c ** -0.5)]
            ins += [b.weight((oc,), 0.5)] if rng.random() < 0.5 else []
            out = b.node("ConvTranspose", ins, kernel_shape=[k, k], strides=[s, s], pads=[p] * 4,
                         output_padding=[op, op], group=g)
            shapes[out] = (n, oc, oh, ow)
            desc.append(f"convT{k}s{s}p{p}op{op}g{g}->{oc}")
        cur = out
        n, c, h, w = shapes[cur]
        extra = rng.random()
        if extra < 0.08:
            branch = b.node("Conv", [cur, b.weight((8, c, 1, 1), c ** -0.5)])
            out = b.node("Concat", [cur, branch], axis=1)
            shapes[branch], shapes[out] = (n, 8, h, w), (n, c + 8, h, w)
            desc.append("concat")
        elif extra < 0.14:
            out = b.node("Resize", [cur, "", b.const(np.array([1, 1, 2, 2], np.float32))],
                         mode=str(rng.choice(["nearest", "linear"])))
            shapes[out] = (n, c, 2 * h, 2 * w)
            desc.append("resize")
        elif extra < 0.22:
            stats = [rng.standard_normal(c) * 0.5 + 1, rng.standard_normal(c) * 0.2, rng.standard_normal(c) * 0.2,
                     rng.random(c) + 0.5]
            out = b.node("BatchNormalization", [cur] + [b.const(v.astype(npt)) for v in stats])
            shapes[out] = shapes[cur]
            desc.append("bn")
        elif extra < 0.28:
            out = b.node("Mul", [cur, b.node("Sigmoid", [cur])])
            shapes[out] = shapes[cur]
            desc.append("silu")
        elif extra < 0.33:
            gate = b.node("Sigmoid", [b.node("GlobalAveragePool", [cur])])
            out = b.node("Mul", [cur, gate])
            shapes[out] = shapes[cur]
            desc.append("se")
        else:
            out = cur
        cur = out
        same = [t for t in shapes if t != cur and shapes[t] == shapes[cur]]
        if same and rng.random() < 0.5:
            out = b.node("Add", [cur, str(rng.choice(same))])
            shapes[out] = shapes[cur]
            cur = out
            desc.append("add")
        if rng.random() < 0.6:
            out = b.node("Relu", [cur])
            shapes[out] = shapes[cur]
            cur = out
            desc.append("relu")
    if cur == "x":  # (every layer skipped: one 1x1 conv)
        n, c, h, w = shapes["x"]
        cur = b.node("Conv", ["x", b.weight((8, c, 1, 1), c ** -0.5)])
        shapes[cur] = (n, 8, h, w)
        desc.append("conv1x1")
    model = b.model([_io("x", npt, shapes["x"])], [_io(cur, npt, shapes[cur])])
    feeds = {"x": np.random.default_rng(seed + 1).standard_normal(shapes["x"]).astype(npt)}
    return model, feeds, f"{np.dtype(npt).name} {shapes['x']} " + " ".join(desc)


def matmul_chain(seed: int) -> tuple[onnx.ModelProto, dict, str]:
    """A random chain of products on ``x [*batch, M, K]`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    npt = np.float16 if rng.random() < 0.4 else np.float32
    b = _Builder(rng, npt)
    first = [int(v) for v in rng.choice([1, 2, 3], int(rng.integers(0, 3)))]
    first += [int(rng.choice([3, 16, 17, 40, 64, 96, 130, 200, 256])),
              int(rng.choice([8, 16, 24, 40, 64, 72, 128, 200, 264]))]
    cur, shape, desc = "x", list(first), []
    for _ in range(int(rng.integers(1, 4))):
        k, n = shape[-1], int(rng.choice([8, 16, 24, 48, 64, 72, 96, 136, 192, 256, 264]))
        kind = rng.choice(["matmul", "matmul", "gemm", "transposed"] if len(shape) == 2 else ["matmul", "transposed"])
        if kind == "gemm":
            tb = int(rng.integers(0, 2))
            ins = [cur, b.weight((n, k) if tb else (k, n), k ** -0.5)]
            ins += [b.weight((n,), 0.5)] if rng.random() < 0.6 else []
            cur = b.node("Gemm", ins, transB=tb, alpha=float(rng.choice([1.0, 0.5])))
            desc.append(f"gemm{k}x{n}t{tb}")
        elif kind == "transposed":  # (a weight stored [N, K], transposed in the graph)
            cur = b.node("MatMul", [cur, b.node("Transpose", [b.weight((n, k), k ** -0.5)], perm=[1, 0])])
            desc.append(f"mmT{k}x{n}")
        else:
            cur = b.node("MatMul", [cur, b.weight((k, n), k ** -0.5)])
            desc.append(f"mm{k}x{n}")
            if rng.random() < 0.5:
                cur = b.node("Add", [cur, b.weight((n,), 0.5)])
                desc.append("bias")
        shape[-1] = n
        r = rng.random()
        if r < 0.2:
            cur = b.node("Relu", [cur])
            desc.append("relu")
        elif r < 0.35:
            cur = b.node("Erf", [cur])
            desc.append("erf")
        elif r < 0.5:
            cur = b.node("Mul", [cur, b.node("Sigmoid", [cur])])
            desc.append("silu")
        if shape == first and rng.random() < 0.6:
            cur = b.node("Add", [cur, "x"])
            desc.append("residual")
        if rng.random() < 0.2:
            cur = b.node("LayerNormalization", [cur, b.weight((n,), 0.5), b.weight((n,), 0.5)], axis=-1)
            desc.append("ln")
    model = b.model([_io("x", npt, first)], [_io(cur, npt, shape)])
    feeds = {"x": np.random.default_rng(seed + 1).standard_normal(first).astype(npt)}
    return model, feeds, f"{np.dtype(npt).name} {first} " + " ".join(desc)


def attention_block(seed: int) -> tuple[onnx.ModelProto, dict, str]:
    """A random self-attention block on ``x [B, S, E]`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    half = rng.random() < 0.4
    npt = np.float16 if half else np.float32
    b = _Builder(rng, npt)
    bs, s = int(rng.choice([1, 2, 3])), int(rng.choice([1, 5, 16, 33, 64, 100, 130]))
    heads, d = int(rng.choice([1, 2, 4, 6])), int(rng.choice([8, 16, 24, 32, 40, 64, 72, 80, 128]))
    e = heads * d
    kv = int(rng.choice([g for g in (1, 2, heads) if heads % g == 0])) if rng.random() < 0.4 else heads
    causal, padding = bool(rng.random() < 0.5), str(rng.choice(["none", "add", "none", "fill"]))
    scale_at = str(rng.choice(["divide", "multiply", "query", "both"]))
    float32_softmax = half and rng.random() < 0.5
    low = np.finfo(npt).min
    q = b.node("Add", [b.node("MatMul", ["x", b.weight((e, e), e ** -0.5)]), b.weight((e,), 0.1)])
    k = b.node("MatMul", ["x", b.weight((e, kv * d), e ** -0.5)])
    v = b.node("MatMul", ["x", b.weight((e, kv * d), e ** -0.5)])

    def heads_of(t, n, perm):  # [B, S, n*D] -> [B, n, S, D] (perm [0, 2, 1, 3]) or its Kᵀ form
        return b.node("Transpose", [b.node("Reshape", [t, b.const(np.array([bs, s, n, d], np.int64))])], perm=perm)

    def repeated(t):  # repeat_kv: [B, KV, S, D] -> [B, KV, H/KV, S, D] -> [B, H, S, D]
        if kv == heads:
            return t
        u = b.node("Unsqueeze", [t, b.const(np.array([2], np.int64))])
        u = b.node("Expand", [u, b.const(np.array([bs, kv, heads // kv, s, d], np.int64))])
        return b.node("Reshape", [u, b.const(np.array([bs, heads, s, d], np.int64))])

    qh = heads_of(q, heads, [0, 2, 1, 3])
    kt = b.node("Transpose", [repeated(heads_of(k, kv, [0, 2, 1, 3]))], perm=[0, 1, 3, 2])
    vh = repeated(heads_of(v, kv, [0, 2, 1, 3]))
    scale = d ** -0.5
    if scale_at == "query":
        qh = b.node("Mul", [qh, b.const(np.array(scale, npt))])
    elif scale_at == "both":
        root = b.const(np.array(scale ** 0.5, npt))
        qh, kt = b.node("Mul", [qh, root]), b.node("Mul", [kt, root])
    scores = b.node("MatMul", [qh, kt])
    if scale_at == "divide":
        scores = b.node("Div", [scores, b.const(np.array(1 / scale, npt))])
    elif scale_at == "multiply":
        scores = b.node("Mul", [scores, b.const(np.array(scale, npt))])
    if causal:
        seen = np.tril(np.ones((s, s), bool))
        scores = b.node("Where", [b.const(seen), scores, b.const(np.array(low, npt))])
    inputs, feeds = [_io("x", npt, [bs, s, e])], {}
    frng = np.random.default_rng(seed + 1)
    keep = np.ones((bs, 1, 1, s), bool)
    for i in range(bs):
        keep[i, ..., int(frng.integers(1, s + 1)):] = False  # (every row keeps key 0)
    if padding == "add":
        scores = b.node("Add", [scores, b.const(np.where(keep, 0, low).astype(npt))])
    elif padding == "fill":
        inputs.append(_io("keep", np.bool_, [bs, 1, 1, s]))
        feeds["keep"] = keep
        scores = b.node("Where", ["keep", scores, b.const(np.array(low, npt))])
    if float32_softmax:  # (Llama's softmax(dtype=float32).to(half))
        p = b.node("Cast", [b.node("Softmax", [b.node("Cast", [scores], to=TensorProto.FLOAT)], axis=-1)],
                   to=TensorProto.FLOAT16)
    else:
        p = b.node("Softmax", [scores], axis=-1)
    o = b.node("Transpose", [b.node("MatMul", [p, vh])], perm=[0, 2, 1, 3])
    o = b.node("Reshape", [o, b.const(np.array([bs, s, e], np.int64))])
    y = b.node("MatMul", [o, b.weight((e, e), e ** -0.5)])
    model = b.model(inputs, [_io(y, npt, [bs, s, e])])
    feeds["x"] = frng.standard_normal((bs, s, e)).astype(npt)
    return model, feeds, (f"{np.dtype(npt).name} B{bs} S{s} H{heads}/{kv} D{d} causal={causal} padding={padding} "
                          f"scale={scale_at} float32_softmax={float32_softmax}")


GENERATORS = {"conv_net": conv_net, "matmul_chain": matmul_chain, "attention_block": attention_block}
