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
* :func:`tensor_program`: 2-8 random steps on ``x`` of rank 1-4: unary and broadcast binary
  elementwise ops (with earlier tensors or constants), transposes, reshapes, slices (negative
  steps), concatenations, splits, gathers, expands, reductions over random axes (kept or not),
  softmax/log-softmax, LayerNorm on any axis, an RMSNorm as Llama writes it, pads (constant,
  reflect, edge), tiles, selects, running sums, TopK values, GatherElements, Trilu,
  Depth/SpaceToDepth, InstanceNorm, small products and einsums.
* :func:`int_program`: the same on int32/int64 values: truncating ``Div``, ``Mod`` of both signs
  conventions, comparisons and logic into selects, ``ArgMax``/``TopK`` ties, halves rounded by
  ``Floor``/``Ceil``/``Round``/``Cast``, exact sums; every result exact.
* :func:`spatial_net`: 1-4 window ops on ``x [N, C, *spatial]`` of 1-3 spatial dims (opset 21):
  convs with ``auto_pad``, transposed convs with ``output_shape``, ceil-mode and dilated pools,
  Lp pools, global pools, every ``Resize`` mode and coordinate transformation, group and instance
  norms; steps where onnxruntime and onnx's reference evaluator disagree are left out.
* :func:`recurrent_net`: one ``RNN``, ``GRU`` or ``LSTM`` of a random direction, hidden size,
  activations, ``clip``, biases, initial states, ``sequence_lens``, peepholes, ``input_forget``
  or ``linear_before_reset``; its sequence output or a final state.
* :func:`index_program`: 2-8 steps of indexing and quantization on ``x`` (opset 18):
  ``ScatterElements`` and ``ScatterND`` with every reduction (repeated places where they reduce),
  ``GatherND`` with batch dims, ``OneHot`` of constants or of an ``ArgMax``, ``Range`` (integer and
  float), ``Compress``, ``ReverseSequence``, per-tensor and per-axis quantize-dequantize pairs,
  requantizations around a transpose, and the QDQ ``MatMul``/``Gemm`` forms the cpu target runs on
  its integer GEMM; power-of-two scales, so that quantizing is exact where the values are.
* :func:`control_program`: 2-8 ``If`` (on a static dim or a constant), ``Loop`` (a trip count, or
  a condition on the iteration number; an ``If`` on it inside) and ``Scan`` (any axis and
  direction in and out) nodes with elementwise bodies, and reductions between them.
* :func:`attention_op`: one opset-23 ``Attention`` on projections of ``x``: 3-D (heads as
  attributes) or 4-D inputs, grouped KV heads, ``RotaryEmbedding`` (interleaved or not, partial)
  on q and k, a past key/value cache, a boolean or additive mask (2-D or 4-D) or ``is_causal``,
  ``scale`` and ``softcap``; float32 or float16.

:func:`reference` runs a model in onnxruntime with its graph optimizations off: the operators'
semantics, which its optimizations depart from on quantized models (rfcs/0006).

Session 53 ran several hundred of each against onnxruntime and the host emulation of the cuda
kernels (tests/codegen/test_random_models.py keeps a few seeds of each; ``-m slow``); session 54 added
the tensor and integer programs, the spatial nets and the recurrent nets and ran hundreds of each the
same way; session 55 the index and control programs.
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

    def model(self, inputs: list, outputs: list, opset: int = 17) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "random", inputs, outputs, self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = 8 if opset <= 17 else 10
        onnx.checker.check_model(m)
        return m


def reference(model: onnx.ModelProto, feeds: dict) -> dict:
    """The outputs of ``model`` by onnxruntime (CPU) with its graph optimizations off: what the
    operators define. Its optimizations depart from that on quantized models (rfcs/0006): they drop a
    ``DequantizeLinear``-``QuantizeLinear`` pair of different scales, rounding included, and round a
    ``Gemm`` of dequantized inputs differently, which a later quantization can turn into a step."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


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


def _broadcast_shape(rng, shape):
    """A random shape that broadcasts to ``shape`` (dims dropped from the front or set to 1)."""
    keep = int(rng.integers(0, len(shape) + 1))
    return [d if rng.random() < 0.6 else 1 for d in shape[len(shape) - keep:]]


class _Program(_Builder):
    """A :class:`_Builder` for the random programs: ``x`` of a random rank-1..4 shape (at most 4096
    elements), the shape of every tensor and a description of each step."""

    def __init__(self, rng: np.random.Generator, npt):
        super().__init__(rng, npt)
        shape = [int(v) for v in rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 33], int(rng.integers(1, 5)))]
        while int(np.prod(shape)) > 4096:
            shape[int(np.argmax(shape))] //= 2
        self.shapes: dict[str, list[int]] = {"x": shape}
        self.desc: list[str] = []

    def put(self, t: str, shape, what: str) -> str:
        self.shapes[t] = [int(v) for v in shape]
        self.desc.append(what)
        return t

    def steps(self, kinds: list[str]):
        """2-8 kinds of step drawn from ``kinds``."""
        for _ in range(int(self.rng.integers(2, 9))):
            yield str(self.rng.choice(kinds))

    def ints(self, v) -> str:
        return self.const(np.array(v, np.int64))

    def reduce(self, cur: str, ops: list[str]) -> str:
        """One of ``ops`` (``ReduceSum``, ``ReduceMax``, ...) over random axes of ``cur``, kept or not."""
        s, rng = self.shapes[cur], self.rng
        op, r = str(rng.choice(ops)), len(s)
        axes = sorted(int(v) for v in rng.choice(r, int(rng.integers(1, r + 1)), replace=False))
        keep = int(rng.random() < 0.5)
        new = [d if i not in axes else 1 for i, d in enumerate(s) if keep or i not in axes]
        if not new:
            keep, new = 1, [1] * r
        named = [v - r if rng.random() < 0.3 else v for v in axes]
        if op == "ReduceSum":  # (axes an input since opset 13; the others' an attribute until 18)
            out = self.node(op, [cur, self.ints(named)], keepdims=keep)
        else:
            out = self.node(op, [cur], axes=named, keepdims=keep)
        return self.put(out, new, f"{op[6:].lower()}{axes}k{keep}")

    def finish(self, cur: str, x: np.ndarray, opset: int = 17) -> tuple[onnx.ModelProto, dict, str]:
        """The model from ``x`` to ``cur``, its feeds and description."""
        model = self.model([_io("x", self.npt, x.shape)], [_io(cur, self.npt, self.shapes[cur])], opset)
        return model, {"x": x}, f"{np.dtype(self.npt).name} {list(x.shape)} " + " ".join(self.desc)


def tensor_program(seed: int) -> tuple[onnx.ModelProto, dict, str]:
    """A random program of elementwise, layout and reduction ops on ``x`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    npt = np.float16 if rng.random() < 0.4 else np.float32
    b = _Program(rng, npt)
    shapes, desc, put, ints = b.shapes, b.desc, b.put, b.ints

    cur = "x"
    for kind in b.steps(["unary", "unary", "binary", "binary", "pair", "transpose", "reshape", "slice", "concat",
                         "split", "gather", "expand", "reduce", "reduce", "softmax", "layernorm", "rmsnorm", "pad",
                         "tile", "where", "cast", "cumsum", "matmul", "gather_elements", "trilu", "space",
                         "instancenorm", "topk", "einsum"]):
        s = shapes[cur]
        if not s:
            break
        r = len(s)
        if kind == "unary":
            op = str(rng.choice(["Relu", "Sigmoid", "Tanh", "Abs", "Neg", "Erf", "Softplus", "LeakyRelu", "Elu",
                                 "HardSigmoid", "Sin", "Cos", "Sqrt", "Log", "Exp", "Reciprocal", "Clip", "Selu"]))
            src = cur
            if op in ("Sqrt", "Log", "Reciprocal"):  # (on |t| + 1)
                src = b.node("Add", [b.node("Abs", [cur]), b.const(np.array(1, npt))])
            elif op == "Exp":
                src = b.node("Tanh", [cur])
            if op == "Clip":
                lo, hi = sorted(rng.standard_normal(2))
                cur = b.node(op, [src, b.const(np.array(lo, npt)), b.const(np.array(hi, npt))])
            else:
                cur = b.node(op, [src])
            put(cur, s, op.lower())
        elif kind in ("binary", "pair"):
            op = str(rng.choice(["Add", "Sub", "Mul", "Div", "Max", "Min", "Pow"]))
            if op == "Pow":  # (|t| to a constant power)
                cur = b.node("Pow", [b.node("Abs", [cur]), b.const(np.array(rng.choice([2.0, 0.5, 3.0]), npt))])
                put(cur, s, "pow")
                continue
            other = None
            if kind == "pair":  # (an earlier tensor that broadcasts with this one)
                fits = [t for t, u in shapes.items() if t != cur and len(u) <= r and
                        all(a in (c, 1) for a, c in zip(u[::-1], s[::-1]))]
                other = str(rng.choice(fits)) if fits else None
            if other is None:
                other = b.weight(_broadcast_shape(rng, s), 1.0)
            if op == "Div":
                other = b.node("Add", [b.node("Abs", [other]), b.const(np.array(1, npt))])
            swap = rng.random() < 0.3 and op != "Div"  # (other broadcasts to s: the result is s)
            cur = b.node(op, [other, cur] if swap else [cur, other])
            put(cur, s, op.lower() + ("*" if kind == "pair" else ""))
        elif kind == "transpose" and r > 1:
            perm = [int(v) for v in rng.permutation(r)]
            cur = put(b.node("Transpose", [cur], perm=perm), [s[p] for p in perm], f"T{perm}")
        elif kind == "reshape" and r >= 1:
            if r > 1 and rng.random() < 0.5:  # merge two neighbours
                a = int(rng.integers(0, r - 1))
                new = s[:a] + [s[a] * s[a + 1]] + s[a + 2:]
            else:  # split a dim (or add a 1)
                a = int(rng.integers(0, r))
                f = [v for v in (2, 3, 4, 1) if s[a] % v == 0 and (v > 1 or r < 5)]
                f = int(rng.choice(f))
                new = s[:a] + [f, s[a] // f] + s[a + 1:]
            spec = list(new)
            if rng.random() < 0.3:
                spec[int(rng.integers(0, len(new)))] = -1
            cur = put(b.node("Reshape", [cur, ints(spec)]), new, f"reshape{new}")
        elif kind == "slice":
            a = int(rng.integers(0, r))
            n = s[a]
            step = int(rng.choice([1, 1, 2, -1, -2]))
            if step > 0:
                lo = int(rng.integers(0, n))
                hi = int(rng.integers(lo + 1, n + 1))
                idx = list(range(lo, hi, step))
                start, end = lo - (n if rng.random() < 0.3 else 0), hi if hi < n or rng.random() < 0.5 else 2 ** 62
            else:
                hi = int(rng.integers(0, n))
                lo = int(rng.integers(-1, hi))
                idx = list(range(hi, lo, step))
                start, end = hi, (lo if lo >= 0 else -n - 1)
            new = s[:a] + [len(idx)] + s[a + 1:]
            cur = put(b.node("Slice", [cur, ints([start]), ints([end]), ints([a - r if rng.random() < 0.3 else a]),
                                       ints([step])]), new, f"slice{a}:{start}:{end}:{step}")
        elif kind == "concat":
            a = int(rng.integers(0, r))
            extra = list(s)
            extra[a] = int(rng.choice([1, 2, 3]))
            parts = [cur, b.weight(extra, 1.0)]
            if rng.random() < 0.4:
                parts.append(cur)
            rng.shuffle(parts)
            new = list(s)
            new[a] = sum(extra[a] if p not in shapes else s[a] for p in parts)
            cur = put(b.node("Concat", parts, axis=a - r if rng.random() < 0.3 else a), new, f"concat{a}")
        elif kind == "split" and max(s) > 1:
            a = int(rng.choice([i for i, d in enumerate(s) if d > 1]))
            k = int(rng.integers(1, s[a]))
            outs = [b.name("sp"), b.name("sp")]
            b.nodes.append(helper.make_node("Split", [cur, ints([k, s[a] - k])], outs, axis=a))
            shapes[outs[0]] = s[:a] + [k] + s[a + 1:]
            shapes[outs[1]] = s[:a] + [s[a] - k] + s[a + 1:]
            cur = outs[int(rng.integers(0, 2))]
            desc.append(f"split{a}:{k}")
            if k == s[a] - k and rng.random() < 0.5:
                cur = put(b.node("Mul", outs), shapes[cur], "mul-halves")
        elif kind == "gather":
            a = int(rng.integers(0, r))
            n = s[a]
            if rng.random() < 0.3:
                idx = np.array(int(rng.integers(-n, n)), np.int64)
            else:
                idx = rng.integers(-n, n, int(rng.integers(1, 5))).astype(np.int64)
            new = s[:a] + list(idx.shape) + s[a + 1:]
            if not new:
                continue
            cur = put(b.node("Gather", [cur, b.const(idx)], axis=a), new, f"gather{a}{idx.tolist()}")
        elif kind == "expand" and r < 5:
            a = int(rng.integers(0, r + 1))
            u = b.node("Unsqueeze", [cur, ints([a])])
            new = s[:a] + [int(rng.choice([2, 3]))] + s[a:]
            cur = put(b.node("Expand", [u, ints(new)]), new, f"expand{a}")
        elif kind == "reduce":
            cur = b.reduce(cur, ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceL2", "ReduceLogSumExp",
                                 "ReduceSumSquare", "ReduceL1"])
        elif kind == "softmax":
            a = int(rng.integers(0, r))
            op = str(rng.choice(["Softmax", "LogSoftmax"]))
            cur = put(b.node(op, [cur], axis=a - r if rng.random() < 0.5 else a), s, f"{op.lower()}{a}")
        elif kind == "layernorm":
            a = int(rng.integers(0, r))
            ins = [cur, b.weight(s[a:], 0.5)] + ([b.weight(s[a:], 0.5)] if rng.random() < 0.5 else [])
            cur = put(b.node("LayerNormalization", ins, axis=a, epsilon=1e-5), s, f"ln{a}")
        elif kind == "rmsnorm":  # (as Llama writes it)
            ms = b.node("ReduceMean", [b.node("Pow", [cur, b.const(np.array(2, npt))])], axes=[-1], keepdims=1)
            inv = b.node("Reciprocal", [b.node("Sqrt", [b.node("Add", [ms, b.const(np.array(1e-5, npt))])])])
            cur = put(b.node("Mul", [b.node("Mul", [cur, inv]), b.weight(s[-1:], 0.5)]), s, "rms")
        elif kind == "pad":
            pads = [int(v) for v in rng.integers(0, 3, 2 * r)]
            mode = str(rng.choice(["constant", "reflect", "edge"]))
            if mode == "reflect":
                pads = [min(p, s[i % r] - 1) for i, p in enumerate(pads)]
            new = [d + pads[i] + pads[i + r] for i, d in enumerate(s)]
            ins = [cur, ints(pads)] + ([b.const(np.array(rng.standard_normal(), npt))] if mode == "constant" else [])
            cur = put(b.node("Pad", ins, mode=mode), new, f"pad{pads}{mode}")
        elif kind == "tile" and np.prod(s) <= 1024:
            reps = [int(rng.choice([1, 1, 2, 3])) for _ in s]
            cur = put(b.node("Tile", [cur, ints(reps)]), [d * k for d, k in zip(s, reps)], f"tile{reps}")
        elif kind == "where":
            cond = b.const(rng.random(_broadcast_shape(rng, s)) < 0.5)
            other = b.weight(_broadcast_shape(rng, s), 1.0)
            cur = put(b.node("Where", [cond, cur, other] if rng.random() < 0.5 else [cond, other, cur]), s, "where")
        elif kind == "cast" and npt == np.float16:  # (to float32 and back: a float32 model's trip through
            # float16 would round values that the compared programs compute a rounding error apart)
            wide = b.node("Cast", [cur], to=TensorProto.FLOAT)
            cur = put(b.node("Cast", [b.node("Tanh", [wide])], to=TensorProto.FLOAT16), s, "cast-tanh")
        elif kind == "cumsum":
            a = int(rng.integers(0, r))
            cur = put(b.node("CumSum", [cur, ints(a)], exclusive=int(rng.random() < 0.3),
                             reverse=int(rng.random() < 0.3)), s, f"cumsum{a}")
        elif kind == "matmul":
            n = int(rng.choice([1, 3, 8, 16]))
            cur = put(b.node("MatMul", [cur, b.weight((s[-1], n), s[-1] ** -0.5)]), s[:-1] + [n], f"mm{n}")
        elif kind == "gather_elements":
            a = int(rng.integers(0, r))
            new = [int(rng.integers(1, d + 1)) for d in s]
            idx = rng.integers(-s[a], s[a], new).astype(np.int64)
            cur = put(b.node("GatherElements", [cur, b.const(idx)], axis=a), new, f"gather_elements{a}")
        elif kind == "trilu" and r >= 2:
            k = int(rng.integers(-2, 3))
            up = int(rng.random() < 0.5)
            cur = put(b.node("Trilu", [cur, ints(k)], upper=up), s, f"trilu{k}u{up}")
        elif kind == "space" and r == 4:
            if s[2] % 2 == 0 and s[3] % 2 == 0 and rng.random() < 0.5:
                cur = put(b.node("SpaceToDepth", [cur], blocksize=2), [s[0], 4 * s[1], s[2] // 2, s[3] // 2], "s2d")
            elif s[1] % 4 == 0:
                mode = str(rng.choice(["DCR", "CRD"]))
                cur = put(b.node("DepthToSpace", [cur], blocksize=2, mode=mode),
                          [s[0], s[1] // 4, 2 * s[2], 2 * s[3]], f"d2s{mode}")
        elif kind == "instancenorm" and r >= 3:
            cur = put(b.node("InstanceNormalization", [cur, b.weight(s[1:2], 0.5), b.weight(s[1:2], 0.5)]), s, "in")
        elif kind == "topk":
            a = int(rng.integers(0, r))
            k = int(rng.integers(1, s[a] + 1))
            outs = [b.name("tk"), b.name("ti")]
            b.nodes.append(helper.make_node("TopK", [cur, ints([k])], outs, axis=a, largest=int(rng.random() < 0.5)))
            cur = put(outs[0], s[:a] + [k] + s[a + 1:], f"topk{a}:{k}")
        elif kind == "einsum" and r <= 4:
            letters = "abcd"[:r]
            n = int(rng.choice([2, 5, 8]))
            keep = [c for c in letters if rng.random() < 0.7] or [letters[0]]
            contracted = letters[-1]
            out_letters = "".join(c for c in keep if c != contracted) + "z"
            eq = f"{letters},{contracted}z->{out_letters}"
            cur = put(b.node("Einsum", [cur, b.weight((s[-1], n), s[-1] ** -0.5)], equation=eq),
                      [s[letters.index(c)] for c in out_letters[:-1]] + [n], f"einsum({eq})")
        while int(np.prod(shapes[cur])) > 16384:  # (keep it small: a sum over a leading dim)
            cur = put(b.node("ReduceMean", [cur], axes=[0], keepdims=0), shapes[cur][1:], "shrink")
    if cur == "x":
        cur = put(b.node("Relu", ["x"]), shapes["x"], "relu")
    return b.finish(cur, np.random.default_rng(seed + 1).standard_normal(shapes["x"]).astype(npt))


def int_program(seed: int) -> tuple[onnx.ModelProto, dict, str]:
    """A random program of integer ops on ``x`` (int32 or int64, values in [-20, 20]); every result is
    exact, so the compared programs must agree bit for bit (see the module docstring)."""
    rng = np.random.default_rng(seed)
    npt = np.int32 if rng.random() < 0.5 else np.int64
    b = _Program(rng, npt)
    shapes, put, ints = b.shapes, b.put, b.ints
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(npt))

    def small(s, lo=-9, hi=10, nonzero=False):
        v = rng.integers(lo, hi, _broadcast_shape(rng, s)).astype(npt)
        if nonzero:
            v[v == 0] = 3
        return b.const(v)

    cur = "x"
    for kind in b.steps(["arith", "arith", "div", "mod", "unary", "minmax", "compare", "logic", "clip", "reduce",
                         "argreduce", "cumsum", "transpose", "slice", "concat", "gather", "expand", "pad", "topk",
                         "round", "where"]):
        s = shapes[cur]
        if not s:
            break
        r = len(s)
        if kind in ("reduce", "cumsum"):  # (sums that cannot overflow int32)
            cur = b.node("Clip", [cur, b.const(np.array(-300, npt)), b.const(np.array(300, npt))])
            shapes[cur] = s
        if kind == "arith":
            op = str(rng.choice(["Add", "Sub", "Mul"]))
            cur = put(b.node(op, [cur, small(s, -3, 4)] if rng.random() < 0.7 else [small(s, -3, 4), cur]), s,
                      op.lower())
        elif kind == "div":  # (truncates toward zero, either sign)
            cur = put(b.node("Div", [cur, small(s, -5, 6, nonzero=True)]), s, "div")
        elif kind == "mod":
            fmod = int(rng.random() < 0.5)
            cur = put(b.node("Mod", [cur, small(s, -5, 6, nonzero=True)], fmod=fmod), s, f"mod{fmod}")
        elif kind == "unary":
            op = str(rng.choice(["Abs", "Neg", "Sign"]))
            cur = put(b.node(op, [cur]), s, op.lower())
        elif kind == "minmax":
            op = str(rng.choice(["Max", "Min"]))
            cur = put(b.node(op, [cur, small(s)]), s, op.lower())
        elif kind in ("compare", "logic", "where"):
            def cond():
                op = str(rng.choice(["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"]))
                return b.node(op, [cur, small(s, -4, 5)]), op
            c, op = cond()
            if kind == "logic":
                c2, _ = cond()
                how = str(rng.choice(["And", "Or", "Xor"]))
                c = b.node(how, [c, c2])
                if rng.random() < 0.3:
                    c = b.node("Not", [c])
                op += how
            if kind == "where":
                cur = put(b.node("Where", [c, cur, small(s)]), s, f"where{op}")
            else:
                cur = put(b.node("Cast", [c], to=elem), s, op.lower())
        elif kind == "clip":
            lo, hi = sorted(int(v) for v in rng.integers(-15, 16, 2))
            bounds = [b.const(np.array(lo, npt)), b.const(np.array(hi, npt))]
            cur = put(b.node("Clip", [cur] + bounds), s, f"clip{lo}:{hi}")
        elif kind == "reduce":
            cur = b.reduce(cur, ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceL1", "ReduceSumSquare"])
        elif kind == "argreduce":  # (ties: the first index, or the last with select_last_index)
            a = int(rng.integers(0, r))
            keep, last = int(rng.random() < 0.5), int(rng.random() < 0.5)
            new = [d if i != a else 1 for i, d in enumerate(s) if keep or i != a]
            if not new:
                continue
            op = str(rng.choice(["ArgMax", "ArgMin"]))
            t = b.node(op, [b.node("Clip", [cur, b.const(np.array(-2, npt)), b.const(np.array(2, npt))])],
                       axis=a, keepdims=keep, select_last_index=last)
            cur = put(b.node("Cast", [t], to=elem) if npt != np.int64 else t, new, f"{op.lower()}{a}k{keep}l{last}")
        elif kind == "cumsum":
            a = int(rng.integers(0, r))
            cur = put(b.node("CumSum", [cur, ints(a)], exclusive=int(rng.random() < 0.3),
                             reverse=int(rng.random() < 0.3)), s, f"cumsum{a}")
        elif kind == "transpose" and r > 1:
            perm = [int(v) for v in rng.permutation(r)]
            cur = put(b.node("Transpose", [cur], perm=perm), [s[p] for p in perm], f"T{perm}")
        elif kind == "slice":
            a = int(rng.integers(0, r))
            n = s[a]
            step = int(rng.choice([1, 2, -1, -3]))
            if step > 0:
                lo = int(rng.integers(0, n))
                idx = range(lo, n, step)
                start, end = lo, 2 ** 62
            else:
                hi = int(rng.integers(0, n))
                idx = range(hi, -1, step)
                start, end = hi, -2 ** 62
            cur = put(b.node("Slice", [cur, ints([start]), ints([end]), ints([a]), ints([step])]),
                      s[:a] + [len(idx)] + s[a + 1:], f"slice{a}:{start}::{step}")
        elif kind == "concat":
            a = int(rng.integers(0, r))
            extra = list(s)
            extra[a] = int(rng.choice([1, 2]))
            parts = [cur, b.const(rng.integers(-9, 10, extra).astype(npt))]
            rng.shuffle(parts)
            cur = put(b.node("Concat", parts, axis=a), s[:a] + [s[a] + extra[a]] + s[a + 1:], f"concat{a}")
        elif kind == "gather":
            a = int(rng.integers(0, r))
            idx = rng.integers(-s[a], s[a], int(rng.integers(1, 4))).astype(np.int64)
            cur = put(b.node("Gather", [cur, b.const(idx)], axis=a), s[:a] + [len(idx)] + s[a + 1:], f"gather{a}")
        elif kind == "expand" and r < 5:
            a = int(rng.integers(0, r + 1))
            new = s[:a] + [int(rng.choice([2, 3]))] + s[a:]
            cur = put(b.node("Expand", [b.node("Unsqueeze", [cur, ints([a])]), ints(new)]), new, f"expand{a}")
        elif kind == "pad":
            pads = [int(v) for v in rng.integers(0, 3, 2 * r)]
            mode = str(rng.choice(["constant", "edge"]))
            ins = [cur, ints(pads)] + ([b.const(np.array(int(rng.integers(-5, 6)), npt))] if mode == "constant" else [])
            cur = put(b.node("Pad", ins, mode=mode), [d + pads[i] + pads[i + r] for i, d in enumerate(s)],
                      f"pad{mode}")
        elif kind == "topk":  # (ties keep the lower index first: the indices are compared too)
            a = int(rng.integers(0, r))
            k = int(rng.integers(1, s[a] + 1))
            outs = [b.name("tk"), b.name("ti")]
            b.nodes.append(helper.make_node("TopK", [cur, ints([k])], outs, axis=a, largest=int(rng.random() < 0.5)))
            shapes[outs[0]] = shapes[outs[1]] = s[:a] + [k] + s[a + 1:]
            idx = outs[1] if npt == np.int64 else b.node("Cast", [outs[1]], to=elem)
            cur = put(b.node("Add", [outs[0], b.node("Mul", [idx, b.const(np.array(100, npt))])]), shapes[outs[0]],
                      f"topk{a}:{k}")
        elif kind == "round":  # (halves through float32: Floor, Ceil, Round to even, Cast truncating)
            f = b.node("Mul", [b.node("Cast", [cur], to=TensorProto.FLOAT), b.const(np.array(0.5, np.float32))])
            op = str(rng.choice(["Floor", "Ceil", "Round", "Cast"]))
            if op != "Cast":
                f = b.node(op, [f])
            cur = put(b.node("Cast", [f], to=elem), s, f"half-{op.lower()}")
        while int(np.prod(shapes[cur])) > 16384:
            cur = put(b.node("ReduceMax", [cur], axes=[0], keepdims=0), shapes[cur][1:], "shrink")
        if np.prod(shapes[cur]) and rng.random() < 0.3:  # (keep values small)
            cur = put(b.node("Clip", [cur, b.const(np.array(-50, npt)), b.const(np.array(50, npt))]), shapes[cur],
                      "clip")
    if cur == "x":
        cur = put(b.node("Neg", ["x"]), shapes["x"], "neg")
    return b.finish(cur, np.random.default_rng(seed + 1).integers(-20, 21, shapes["x"]).astype(npt))


def _distinct_along(rng, shape, axis: int, n: int) -> np.ndarray:
    """int64 indices of ``shape`` into a dim of ``n``, distinct along ``axis`` (``shape[axis] <= n``),
    a third of them written negative: a ScatterElements without a reduction writes each place once."""
    moved = list(shape[:axis]) + list(shape[axis + 1:])
    rows = [rng.permutation(n)[:shape[axis]] for _ in range(int(np.prod(moved, dtype=np.int64)))]
    idx = np.moveaxis(np.array(rows, np.int64).reshape(moved + [shape[axis]]), -1, axis)
    return np.where(rng.random(idx.shape) < 0.3, idx - n, idx)


def index_program(seed: int) -> tuple[onnx.ModelProto, dict, str]:
    """A random program of indexing and quantization steps on ``x`` (opset 18; see the module
    docstring); float32 or float16 (the quantization steps in float32 only)."""
    rng = np.random.default_rng(seed)
    npt = np.float16 if rng.random() < 0.3 else np.float32
    b = _Program(rng, npt)
    shapes, put, ints = b.shapes, b.put, b.ints

    def quantize(s, axis=None):
        """Quantize-dequantize parameters of a tensor of shape ``s``: a power-of-two scale (per tensor
        or along ``axis``), so that ``x / scale`` is exact and a rounding tie as rare as in the data,
        and an 8-bit zero point."""
        n = [] if axis is None else [s[axis]]
        scale = b.const((2.0 ** -rng.integers(3, 7, n)).astype(np.float32))
        signed = rng.random() < 0.5
        zp = rng.integers(-20, 21, n) if signed else rng.integers(108, 149, n)
        zero = b.const(zp.astype(np.int8 if signed else np.uint8))
        attrs = {} if axis is None else {"axis": axis - len(s) if rng.random() < 0.3 else axis}
        return [scale, zero], attrs

    def reduction():  # (onnxruntime reduces float32 scatters only)
        return str(rng.choice(["none", "none", "add", "mul", "max", "min"] if npt == np.float32 else ["none"]))

    cur = "x"
    for kind in b.steps(["scatter_elements", "scatter_nd", "gather_nd", "onehot", "range", "compress", "reverse",
                         "qdq", "qdq", "requant", "qmatmul", "qmatmul", "unary"]):
        s = shapes[cur]
        if not s:
            break
        r = len(s)
        a = int(rng.integers(0, r))
        if kind == "scatter_elements":
            red = reduction()
            ishape = [int(rng.integers(1, d + 1)) for d in s]
            if red == "none":
                idx = _distinct_along(rng, ishape, a, s[a])
            else:  # (repeated places: the reduction combines them)
                idx = rng.integers(-s[a], s[a], ishape).astype(np.int64)
            upd = b.const((1 + 0.5 * rng.standard_normal(ishape)).astype(npt), "w")
            cur = put(b.node("ScatterElements", [cur, b.const(idx), upd], axis=a, reduction=red), s,
                      f"scatter_elements{a}{red}{ishape}")
        elif kind == "scatter_nd":
            red = reduction()
            q = int(rng.integers(1, r + 1))
            places = int(np.prod(s[:q]))
            m = int(rng.integers(1, min(places, 6) + 1))
            flat = rng.choice(places, m, replace=False) if red == "none" else rng.integers(0, places, m)
            idx = np.stack(np.unravel_index(flat, s[:q]), -1).astype(np.int64)
            idx = np.where(rng.random(idx.shape) < 0.3, idx - np.array(s[:q]), idx)
            upd = b.const((1 + 0.5 * rng.standard_normal([m] + s[q:])).astype(npt), "w")
            cur = put(b.node("ScatterND", [cur, b.const(idx), upd], reduction=red), s, f"scatter_nd{q}x{m}{red}")
        elif kind == "gather_nd":
            bd = int(rng.integers(0, 2)) if r > 1 else 0
            q = int(rng.integers(1, r - bd + 1))
            m = int(rng.integers(1, 5))
            idx = np.stack([rng.integers(-d, d, s[:bd] + [m]) for d in s[bd:bd + q]], -1).astype(np.int64)
            new = s[:bd] + [m] + s[bd + q:]
            cur = put(b.node("GatherND", [cur, b.const(idx)], batch_dims=bd), new, f"gather_nd{bd}:{q}x{m}")
        elif kind == "onehot" and r > 1:  # (of ArgMax along a or of constants: shaped as ``cur``, multiplied in)
            rest = s[:a] + s[a + 1:]
            if rng.random() < 0.5:
                idx = b.node("ArgMax", [cur], axis=a, keepdims=0)
            else:
                idx = b.const(rng.integers(-s[a], s[a], rest).astype(np.int64))
            vals = b.const(np.array(sorted(rng.standard_normal(2)), npt))
            hot = b.node("OneHot", [idx, ints(s[a]), vals], axis=a - r if rng.random() < 0.3 else a)
            cur = put(b.node(str(rng.choice(["Mul", "Add"])), [cur, hot]), s, f"onehot{a}")
        elif kind == "range":  # (along the last dim, integer or float steps)
            n, step = s[-1], float(rng.choice([1, -1, 0.5, -2]))
            lo = float(rng.integers(-3, 4))
            if step == int(step) and rng.random() < 0.5:
                rg = b.node("Cast", [b.node("Range", [ints(int(lo)), ints(int(lo + n * step)), ints(int(step))])],
                            to=helper.np_dtype_to_tensor_dtype(np.dtype(npt)))
            else:  # (onnxruntime has no float16 Range)
                rg = b.node("Range", [b.const(np.array(v, np.float32)) for v in (lo, lo + n * step - step / 2, step)])
                if npt != np.float32:
                    rg = b.node("Cast", [rg], to=TensorProto.FLOAT16)
            cur = put(b.node("Add", [cur, rg]), s, f"range{lo}:{step}")
        elif kind == "compress":
            keep = rng.random(s[a]) < 0.6
            keep[int(rng.integers(0, s[a]))] = True
            cur = put(b.node("Compress", [cur, b.const(keep)], axis=a), s[:a] + [int(keep.sum())] + s[a + 1:],
                      f"compress{a}")
        elif kind == "reverse" and r >= 2:
            ta = int(rng.integers(0, 2))
            lens = rng.integers(1, s[ta] + 1, s[1 - ta]).astype(np.int64)
            cur = put(b.node("ReverseSequence", [cur, b.const(lens)], time_axis=ta, batch_axis=1 - ta), s,
                      f"reverse{ta}{lens.tolist()}")
        elif kind == "qdq" and npt == np.float32:
            params, attrs = quantize(s, a if rng.random() < 0.5 else None)
            q = b.node("QuantizeLinear", [cur] + params, **attrs)
            cur = put(b.node("DequantizeLinear", [q] + params, **attrs), s, f"qdq{attrs}")
        elif kind == "requant" and npt == np.float32 and r > 1:  # (a move between quantizations of one scale)
            params, _ = quantize(s)
            d = b.node("DequantizeLinear", [b.node("QuantizeLinear", [cur] + params)] + params)
            perm = [int(v) for v in rng.permutation(r)]
            moved = b.node("Transpose", [d], perm=perm)
            cur = put(b.node("DequantizeLinear", [b.node("QuantizeLinear", [moved] + params)] + params),
                      [s[p] for p in perm], f"requant-T{perm}")
        elif kind == "qmatmul" and npt == np.float32:  # (the QDQ MatMul/Gemm that becomes MatMulInteger)
            k, n = s[-1], int(rng.choice([1, 3, 8, 16]))
            params, _ = quantize(s)
            dx = b.node("DequantizeLinear", [b.node("QuantizeLinear", [cur] + params)] + params)
            gemm = r == 2 and rng.random() < 0.5
            trans = int(gemm and rng.random() < 0.5)
            wshape = [n, k] if trans else [k, n]
            per_col = rng.random() < 0.5
            wscale = 2.0 ** -rng.integers(4, 8, [n] if per_col else [])
            signed = rng.random() < 0.7
            wq = rng.integers(-127, 128, wshape) if signed else rng.integers(0, 256, wshape)
            wz = (rng.integers(-3, 4, wscale.shape) if signed else rng.integers(120, 137, wscale.shape))
            wt = np.int8 if signed else np.uint8
            dw = b.node("DequantizeLinear", [b.const(wq.astype(wt)), b.const(wscale.astype(np.float32)),
                                             b.const(wz.astype(wt))], **({"axis": 1 - trans} if per_col else {}))
            if gemm:
                ins = [dx, dw] + ([b.weight([n], 0.5)] if rng.random() < 0.5 else [])
                out = b.node("Gemm", ins, transB=trans, alpha=float(rng.choice([1.0, 0.5])))
            else:
                out = b.node("MatMul", [dx, dw])
            cur = put(out, s[:-1] + [n], f"q{'gemm' if gemm else 'mm'}{n}t{trans}c{int(per_col)}")
        elif kind == "unary":
            cur = put(b.node(str(rng.choice(["Tanh", "Relu", "Sin"])), [cur]), s, "unary")
        while int(np.prod(shapes[cur])) > 16384:
            cur = put(b.node("ReduceMean", [cur, ints([0])], keepdims=0), shapes[cur][1:], "shrink")
    if cur == "x":
        cur = put(b.node("Relu", ["x"]), shapes["x"], "relu")
    return b.finish(cur, np.random.default_rng(seed + 1).standard_normal(shapes["x"]).astype(npt), opset=18)


def control_program(seed: int) -> tuple[onnx.ModelProto, dict, str]:
    """A random program of ``If``, ``Loop`` and ``Scan`` nodes on ``x`` (see the module docstring),
    with conditions and trip counts that static shapes and iteration numbers decide."""
    rng = np.random.default_rng(seed)
    npt = np.float16 if rng.random() < 0.3 else np.float32
    b = _Program(rng, npt)
    shapes, put, ints = b.shapes, b.put, b.ints
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(npt))

    def value(name, dtype=elem, shape=None):
        return helper.make_tensor_value_info(name, dtype, shape)

    def emit(nodes, op, inputs, **attrs):
        out = b.name("u")
        nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def scalar(v):
        return b.const(np.array(v, npt))

    def block(src, s):
        """Nodes (a body's, returned) of a random elementwise step on ``src`` of shape ``s``, its output."""
        nodes, out = [], b.name("u")
        op = str(rng.choice(["Tanh", "Neg", "Add", "Mul", "Sigmoid", "Transpose"]))
        if op in ("Add", "Mul"):
            nodes.append(helper.make_node(op, [src, b.weight(_broadcast_shape(rng, s), 0.5)], [out]))
        elif op == "Transpose" and len(s) > 1 and len(set(s)) == 1:  # (a square shape keeps its shape)
            nodes.append(helper.make_node(op, [src], [out], perm=[int(v) for v in rng.permutation(len(s))]))
        else:
            nodes.append(helper.make_node("Tanh" if op == "Transpose" else op, [src], [out]))
        return nodes, out

    cur = "x"
    for kind in b.steps(["if", "if", "loop", "loop", "scan", "scan", "reduce"]):
        s = shapes[cur]
        if not s:
            break
        r = len(s)
        if kind == "if":  # (on a dim of cur, or a constant; each branch a step, a different one)
            a = int(rng.integers(0, r))
            if rng.random() < 0.7:
                dim = b.node("Gather", [b.node("Shape", [cur]), ints(a)])
                cond = b.node(str(rng.choice(["Greater", "Less", "Equal"])), [dim, ints(int(rng.integers(1, 6)))])
            else:
                cond = b.const(np.array(rng.random() < 0.5))
            branches = {}
            for branch in ("then_branch", "else_branch"):
                nodes, out = block(cur, s)
                branches[branch] = helper.make_graph(nodes, b.name(branch), [], [value(out)])
            cur = put(b.node("If", [cond], **branches), s, "if")
        elif kind == "loop":  # (a trip count, or a condition on the iteration number; an If on it inside)
            trips = int(rng.integers(1, 5))
            i, c_in, v_in = b.name("i"), b.name("cond"), b.name("v")
            nodes, out = block(v_in, s)
            half = emit(nodes, "Mul", [out, scalar(0.5)])
            step = emit(nodes, "Add", [half, emit(nodes, "Cast", [i], to=elem)])
            if rng.random() < 0.4:  # (the first iteration takes the other branch)
                branches = {}
                for branch, op in (("then_branch", "Neg"), ("else_branch", "Identity")):
                    inner: list = []
                    branches[branch] = helper.make_graph(inner, b.name(branch), [], [value(emit(inner, op, [step]))])
                step = emit(nodes, "If", [emit(nodes, "Equal", [i, ints(0)])], **branches)
            counted = rng.random() < 0.6
            if counted:
                c_out = emit(nodes, "Identity", [c_in])
            else:  # (runs while i + 1 < trips)
                c_out = emit(nodes, "Less", [emit(nodes, "Add", [i, ints(1)]), ints(trips)])
            y = emit(nodes, "Sin", [step])
            body = helper.make_graph(nodes, b.name("body"),
                                     [value(i, TensorProto.INT64, []), value(c_in, TensorProto.BOOL, []), value(v_in)],
                                     [value(c_out, TensorProto.BOOL, []), value(step), value(y)])
            final, ys = b.name("lf"), b.name("ly")
            ins = [ints(trips) if counted else "", b.const(np.array(True)), cur]
            b.nodes.append(helper.make_node("Loop", ins, [final, ys], body=body))
            shapes[ys] = [trips] + s
            cur = final if rng.random() < 0.5 else ys
            put(cur, shapes[ys] if cur == ys else s, f"loop{trips}{'' if counted else 'c'}->{cur[:2]}")
        elif kind == "scan":  # (a running state along axis a; outputs stacked along any axis, either way)
            a = int(rng.integers(0, r))
            rest = s[:a] + s[a + 1:]
            st_in, x_t = b.name("st"), b.name("xt")
            nodes, out = block(x_t, rest)
            st_out = emit(nodes, "Add", [emit(nodes, "Mul", [st_in, scalar(0.5)]), out])
            y = emit(nodes, "Tanh", [st_out])
            body = helper.make_graph(nodes, b.name("body"), [value(st_in, shape=rest), value(x_t, shape=rest)],
                                     [value(st_out, shape=rest), value(y, shape=rest)])
            oa = int(rng.integers(0, len(rest) + 1))
            attrs = {"num_scan_inputs": 1, "scan_input_axes": [a], "scan_output_axes": [oa],
                     "scan_input_directions": [int(rng.random() < 0.5)],
                     "scan_output_directions": [int(rng.random() < 0.5)]}
            final, ys = b.name("sf"), b.name("sy")
            b.nodes.append(helper.make_node("Scan", [b.weight(rest, 0.5), cur], [final, ys], body=body, **attrs))
            shapes[ys] = rest[:oa] + [s[a]] + rest[oa:]
            if not rest or rng.random() < 0.5:
                cur = ys
            else:
                cur = final
            put(cur, shapes[cur] if cur == ys else rest, f"scan{a}->{oa}{attrs['scan_input_directions']}"
                f"{attrs['scan_output_directions']}{cur[:2]}")
        elif kind == "reduce":
            cur = b.reduce(cur, ["ReduceSum", "ReduceMax"])
        while int(np.prod(shapes[cur])) > 16384:
            cur = put(b.node("ReduceMean", [cur], axes=[0], keepdims=0), shapes[cur][1:], "shrink")
    if cur == "x":
        cur = put(b.node("Relu", ["x"]), shapes["x"], "relu")
    return b.finish(cur, np.random.default_rng(seed + 1).standard_normal(shapes["x"]).astype(npt))


def attention_op(seed: int) -> tuple[onnx.ModelProto, dict, str]:
    """A random opset-23 ``Attention`` on projections of ``x [B, S, E]`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    npt = np.float16 if rng.random() < 0.3 else np.float32
    b = _Builder(rng, npt)
    bs, s, past = int(rng.choice([1, 2])), int(rng.choice([1, 3, 5, 8])), int(rng.choice([0, 0, 2, 4]))
    heads, d = int(rng.choice([1, 2, 4])), int(rng.choice([4, 8]))
    kv = int(rng.choice([g for g in (1, 2, heads) if heads % g == 0]))
    e, total = heads * d, past + s
    four_d = rng.random() < 0.5
    attrs, desc = {}, []

    def project(n):
        return b.node("MatMul", ["x", b.weight((e, n * d), e ** -0.5)])

    def heads_of(t, n):  # [B, S, n*D] -> [B, n, S, D]
        return b.node("Transpose", [b.node("Reshape", [t, b.const(np.array([bs, s, n, d], np.int64))])],
                      perm=[0, 2, 1, 3])

    q, k, v = project(heads), project(kv), project(kv)
    if four_d:
        q, k, v = heads_of(q, heads), heads_of(k, kv), heads_of(v, kv)
    else:
        attrs.update(q_num_heads=heads, kv_num_heads=kv)
    if rng.random() < 0.5:  # rotary embeddings on q and k, at positions past..past+S-1
        interleaved = int(rng.random() < 0.5)
        rot = int(rng.choice([d, d // 2])) if d >= 8 else d
        angles = np.outer(np.arange(total + 2), 10000.0 ** (-np.arange(rot // 2) / (rot // 2)))
        cos, sin = b.const(np.cos(angles).astype(npt)), b.const(np.sin(angles).astype(npt))
        pos = b.const(np.tile(np.arange(past, total, dtype=np.int64), (bs, 1)))
        extra = {"rotary_embedding_dim": rot, "interleaved": interleaved}
        q = b.node("RotaryEmbedding", [q, cos, sin, pos], **extra, **({} if four_d else {"num_heads": heads}))
        k = b.node("RotaryEmbedding", [k, cos, sin, pos], **extra, **({} if four_d else {"num_heads": kv}))
        desc.append(f"rope{rot}i{interleaved}")
    mask = ""
    kind = str(rng.choice(["none", "bool", "add", "causal"]))
    if kind == "causal":
        attrs["is_causal"] = 1
    elif kind != "none":
        shape = [s, total] if rng.random() < 0.5 else [bs, 1, s, total]
        keep = rng.random(shape) < 0.7
        keep[..., -1] = True  # (no row masked whole)
        if kind == "bool":
            mask = b.const(keep)
        else:
            mask = b.const(np.where(keep, rng.standard_normal(shape) * 0.5, -10000.0).astype(npt))
    ins = [q, k, v, mask]
    if past:
        ins += [b.weight((bs, kv, past, d), 1.0), b.weight((bs, kv, past, d), 1.0)]
    if rng.random() < 0.4:
        attrs["scale"] = float(rng.choice([0.1, 0.5]))
    if rng.random() < 0.3:
        attrs["softcap"] = float(rng.choice([2.0, 5.0]))
    while ins[-1] == "":
        ins.pop()
    y = b.name("y")
    outs = [y] + ([b.name("pk"), b.name("pv")] if past else [])
    b.nodes.append(helper.make_node("Attention", ins, outs, **attrs))
    if four_d:
        y = b.node("Reshape", [b.node("Transpose", [y], perm=[0, 2, 1, 3]), b.const(np.array([bs, s, e], np.int64))])
    out = b.node("MatMul", [y, b.weight((e, e), e ** -0.5)])
    model = b.model([_io("x", npt, [bs, s, e])], [_io(out, npt, [bs, s, e])], opset=23)
    x = np.random.default_rng(seed + 1).standard_normal((bs, s, e)).astype(npt)
    layout = "4d" if four_d else "3d"
    return model, {"x": x}, (f"{np.dtype(npt).name} B{bs} S{s} past{past} H{heads}/{kv} D{d} {layout} "
                             f"mask={kind} {attrs} " + " ".join(desc))


def _partial_value(b: _Builder, x: np.ndarray, t: str):
    """``(model, value)``: the model built so far with output ``t``, and ``t``'s value by
    onnxruntime from ``x`` (None where it refuses the model or the value is empty or not finite)."""
    import onnxruntime as ort

    g = helper.make_graph(b.nodes, "partial", [_io("x", b.npt, x.shape)],
                          [helper.make_tensor_value_info(t, helper.np_dtype_to_tensor_dtype(np.dtype(b.npt)), None)],
                          b.inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        y = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    except Exception:
        return m, None
    return m, (y if y.size and np.isfinite(y.astype(np.float32)).all() else None)


def _reference_shape(b: _Builder, x: np.ndarray, t: str):
    """The shape of ``t`` that onnxruntime computes from ``x`` in the model built so far, or None
    (the generator drops the step) where onnxruntime refuses the model or disagrees with onnx's
    reference evaluator. onnxruntime, not onnx's shape inference: they differ on ceil-mode pools
    whose last window would start in the padding. Checked against the reference evaluator because
    onnxruntime 1.2x departs from the operator specs in places (this compiler follows the specs):
    linear, cubic and ``pytorch_half_pixel`` resizes to or from one element, ``tf_crop_and_resize``
    of a dim of one element, a transposed conv whose ``SAME`` padding would be negative."""
    from onnx.reference import ReferenceEvaluator

    m, y = _partial_value(b, x, t)
    if y is None:
        return None
    try:
        with np.errstate(all="ignore"):
            ref = ReferenceEvaluator(m).run(None, {"x": x})[0]
    except Exception:  # (an op it does not implement at this opset: onnxruntime's word stands)
        return list(y.shape)
    scale = float(np.abs(y.astype(np.float32)).max())
    same = ref.shape == y.shape and np.allclose(ref.astype(np.float32), y.astype(np.float32), rtol=1e-2,
                                                atol=1e-2 * max(scale, 1.0))
    return list(y.shape) if same else None


def spatial_net(seed: int) -> tuple[onnx.ModelProto, dict, str]:
    """A random chain of window ops on ``x [N, C, *spatial]`` of 1-3 spatial dims (opset 21): convs
    with ``auto_pad``, transposed convs with ``output_shape``, max/average/Lp pools with
    ``ceil_mode``, ``count_include_pad`` and dilations, global pools, resizes of every mode and
    coordinate transformation (scales or sizes), instance/group norms, depth-to-space."""
    rng = np.random.default_rng(seed)
    npt = np.float16 if rng.random() < 0.3 else np.float32
    b = _Builder(rng, npt)
    nd = int(rng.choice([1, 2, 2, 3]))
    x_shape = [int(rng.choice([1, 2])), int(rng.choice([1, 2, 3, 4, 8]))]
    x_shape += [int(rng.integers(1, {1: 40, 2: 16, 3: 8}[nd])) for _ in range(nd)]
    shape, cur, desc = list(x_shape), "x", []
    x = np.random.default_rng(seed + 1).standard_normal(x_shape).astype(npt)

    def window(kmax=4):
        k = [int(v) for v in rng.integers(1, kmax + 1, nd)]
        attrs = {"kernel_shape": k}
        if rng.random() < 0.5:
            attrs["strides"] = [int(v) for v in rng.integers(1, 4, nd)]
        ap = str(rng.choice(["NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
        if ap != "NOTSET":
            attrs["auto_pad"] = ap
        elif rng.random() < 0.6:
            attrs["pads"] = [int(rng.integers(0, kk)) if kk > 1 else 0 for kk in k] + \
                            [int(rng.integers(0, kk)) if kk > 1 else 0 for kk in k]
        if ap.startswith("SAME") and "strides" in attrs:  # (onnxruntime's pools refuse a stride past the kernel)
            attrs["strides"] = [min(st, kk) for st, kk in zip(attrs["strides"], k)]
        return attrs

    def fits(attrs):  # the (dilated) window within the padded input, where it is not padded to fit
        if attrs.get("auto_pad", "NOTSET").startswith("SAME"):
            return True
        pads = attrs.get("pads", [0] * (2 * nd))
        dil = attrs.get("dilations", [1] * nd)
        return all(d + pads[i] + pads[i + nd] >= (attrs["kernel_shape"][i] - 1) * dil[i] + 1
                   for i, d in enumerate(shape[2:]))

    steps = int(rng.integers(1, 5))
    for _ in range(4 * steps):  # (a step that does not fit the shape is drawn again)
        if len(desc) == steps:
            break
        c = shape[1]
        kind = str(rng.choice(["conv", "conv", "convT", "maxpool", "avgpool", "lppool", "global", "resize",
                               "resize", "norm", "d2s"]))
        if kind == "conv":
            attrs = window(5)
            if rng.random() < 0.3 and attrs.get("auto_pad", "NOTSET") in ("NOTSET", "VALID"):
                attrs["dilations"] = [int(v) for v in rng.integers(1, 3, nd)]
            if not fits(attrs):
                continue
            g = int(rng.choice([gg for gg in (1, 1, 2, c) if c % gg == 0]))
            oc = g * int(rng.choice([1, 2, 3]))
            fan_in = c // g * int(np.prod(attrs["kernel_shape"]))
            ins = [cur, b.weight([oc, c // g] + attrs["kernel_shape"], fan_in ** -0.5)]
            ins += [b.weight([oc], 0.5)] if rng.random() < 0.5 else []
            out = b.node("Conv", ins, group=g, **attrs)
            what = f"conv{attrs}g{g}->{oc}"
        elif kind == "convT":
            k = [int(v) for v in rng.integers(1, 4, nd)]
            s = [int(v) for v in rng.integers(1, 3, nd)]
            attrs = {"kernel_shape": k, "strides": s}
            g = int(rng.choice([gg for gg in (1, 1, 2) if c % gg == 0]))
            oc = g * int(rng.choice([1, 2]))
            r = rng.random()
            if r < 0.3:  # (output_shape: the pads follow from it, SAME_UPPER's way by default)
                attrs["output_shape"] = [(d - 1) * st + kk + int(rng.integers(0, st)) - int(rng.integers(0, kk))
                                         for d, st, kk in zip(shape[2:], s, k)]
            elif r < 0.5:  # (a kernel narrower than the stride would pad by a negative amount: onnxruntime
                # then departs from the spec, and onnx's reference evaluator cannot always tell, after a GroupNorm)
                attrs["auto_pad"] = str(rng.choice(["SAME_UPPER", "SAME_LOWER"]))
                attrs["kernel_shape"] = k = [max(kk, st) for kk, st in zip(k, s)]
            else:
                attrs["pads"] = [int(rng.integers(0, kk)) for kk in k] * 2
                attrs["output_padding"] = [int(rng.integers(0, st)) for st in s]
            ins = [cur, b.weight([c, oc // g] + k, c ** -0.5)]
            ins += [b.weight([oc], 0.5)] if rng.random() < 0.5 else []
            out = b.node("ConvTranspose", ins, group=g, **attrs)
            what = f"convT{attrs}g{g}->{oc}"
        elif kind in ("maxpool", "avgpool", "lppool"):
            attrs = window(3)
            if kind != "lppool" and rng.random() < 0.4 and "auto_pad" not in attrs:  # (with auto_pad onnx's
                attrs["ceil_mode"] = 1  # shape inference and onnxruntime disagree)
            if kind == "maxpool" and rng.random() < 0.3 and "auto_pad" not in attrs:
                attrs["dilations"] = [int(v) for v in rng.integers(1, 3, nd)]
            if kind == "avgpool":
                attrs["count_include_pad"] = int(rng.random() < 0.5)
            if kind == "lppool":
                attrs["p"] = int(rng.choice([1, 2, 3]))
            if not fits(attrs):
                continue
            out = b.node({"maxpool": "MaxPool", "avgpool": "AveragePool", "lppool": "LpPool"}[kind], [cur], **attrs)
            what = f"{kind}{attrs}"
        elif kind == "global":
            op = str(rng.choice(["GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"]))
            out = b.node(op, [cur])
            what = op
        elif kind == "resize":
            mode = str(rng.choice(["nearest", "linear", "cubic"][:{1: 1, 2: 3, 3: 2}[nd]]))  # (onnxruntime's)
            ctm = str(rng.choice(["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel",
                                  "tf_crop_and_resize", "half_pixel_symmetric"] if mode != "nearest" else
                                 ["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"]))
            attrs = {"mode": mode, "coordinate_transformation_mode": ctm}
            if mode == "nearest":
                attrs["nearest_mode"] = str(rng.choice(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]))
            if mode == "cubic":
                attrs["cubic_coeff_a"] = float(rng.choice([-0.75, -0.5]))
                attrs["exclude_outside"] = int(rng.random() < 0.3)
            roi = ""
            if ctm == "tf_crop_and_resize":
                lo = rng.uniform(0, 0.4, nd)
                roi = b.const(np.concatenate([[0, 0], lo, [1, 1], lo + rng.uniform(0.3, 0.6, nd)]).astype(np.float32))
                attrs["extrapolation_value"] = float(rng.standard_normal())
            if rng.random() < 0.5:
                sc = [float(rng.choice([0.5, 0.75, 1.5, 2.0, 3.0])) for _ in range(nd)]
                out = b.node("Resize", [cur, roi, b.const(np.array([1, 1] + sc, np.float32))], **attrs)
            else:
                sz = [max(1, int(d * rng.uniform(0.4, 2.5))) for d in shape[2:]]
                if ctm == "tf_crop_and_resize":  # (onnxruntime ignores the roi of a dim that keeps its size)
                    sz = [v + 1 if v == d else v for v, d in zip(sz, shape[2:])]
                out = b.node("Resize", [cur, roi, "", b.const(np.array(shape[:2] + sz, np.int64))], **attrs)
            what = f"resize{attrs}"
        elif kind == "norm":
            instance = rng.random() < 0.5
            g = c if instance else int(rng.choice([gg for gg in (1, 2, c) if c % gg == 0]))
            v = x if cur == "x" else _partial_value(b, x, cur)[1]
            if v is None:
                continue
            spread = v.astype(np.float32).reshape(v.shape[0], g, -1).std(-1)
            if spread.min() < 1e-3 * max(float(np.abs(v.astype(np.float32)).max()), 1e-3):
                continue  # (an instance or group of near-equal values: normalizing it amplifies rounding)
            if instance:
                out = b.node("InstanceNormalization", [cur, b.weight([c], 0.5), b.weight([c], 0.5)], epsilon=1e-5)
                what = "instancenorm"
            else:
                out = b.node("GroupNormalization", [cur, b.weight([c], 0.5), b.weight([c], 0.5)], num_groups=g,
                             epsilon=1e-5)
                what = f"groupnorm{g}"
        else:
            if nd != 2 or c % 4:
                continue
            out = b.node("DepthToSpace", [cur], blocksize=2, mode=str(rng.choice(["DCR", "CRD"])))
            what = "d2s"
        new = _reference_shape(b, x, out)
        if new is None or int(np.prod(new)) > 200000:
            b.nodes.pop()
            continue
        cur, shape = out, new
        desc.append(what)
    if cur == "x":
        cur = b.node("Relu", ["x"])
    model = b.model([_io("x", npt, x_shape)], [_io(cur, npt, shape)], opset=21)
    return model, {"x": x}, f"{np.dtype(npt).name} {x_shape} " + " ".join(desc)


def recurrent_net(seed: int) -> tuple[onnx.ModelProto, dict, str]:
    """One random ``RNN``, ``GRU`` or ``LSTM`` on ``x [S, B, I]`` (opset 14): a direction, hidden size,
    activations, ``clip``, biases, initial states, per-batch ``sequence_lens``, LSTM peepholes and
    ``input_forget``, GRU's ``linear_before_reset``; the output is ``Y`` or a final state."""
    rng = np.random.default_rng(seed)
    npt = np.float32
    b = _Builder(rng, npt)
    op = str(rng.choice(["RNN", "GRU", "LSTM"]))
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    seq, batch, inp, hid = (int(rng.integers(1, 7)), int(rng.integers(1, 4)), int(rng.choice([1, 3, 8])),
                            int(rng.choice([1, 2, 5, 8])))
    direction = str(rng.choice(["forward", "reverse", "bidirectional"]))
    nd = 2 if direction == "bidirectional" else 1
    attrs = {"hidden_size": hid, "direction": direction}  # (layout 0: onnxruntime has no batch-first ones)
    acts = {"RNN": ["Tanh", "Relu", "Sigmoid"], "GRU": ["Sigmoid", "Tanh", "Relu"],
            "LSTM": ["Sigmoid", "Tanh", "Relu"]}[op]
    per_dir = {"RNN": 1, "GRU": 2, "LSTM": 3}[op]
    if rng.random() < 0.3:
        chosen = [str(rng.choice(acts)) for _ in range(per_dir)]
        attrs["activations"] = chosen * nd
    if rng.random() < 0.3:
        attrs["clip"] = float(rng.choice([0.5, 2.0]))
    if op == "GRU" and rng.random() < 0.5:
        attrs["linear_before_reset"] = 1
    if op == "LSTM" and rng.random() < 0.3:
        attrs["input_forget"] = 1
    x_shape = [seq, batch, inp]
    ins = ["x", b.weight((nd, gates * hid, inp), 0.5), b.weight((nd, gates * hid, hid), 0.5)]
    ins.append(b.weight((nd, 2 * gates * hid), 0.3) if rng.random() < 0.7 else "")
    lens = rng.integers(1, seq + 1, batch).astype(np.int32) if rng.random() < 0.4 else None
    ins.append(b.const(lens) if lens is not None else "")
    state = [nd, batch, hid]
    ins.append(b.weight(state, 0.5) if rng.random() < 0.5 else "")
    if op == "LSTM":
        ins.append(b.weight(state, 0.5) if rng.random() < 0.5 else "")
        ins.append(b.weight((nd, 3 * hid), 0.3) if rng.random() < 0.3 else "")
    while ins and ins[-1] == "":
        ins.pop()
    n_out = 3 if op == "LSTM" else 2
    outs = [b.name("y") for _ in range(n_out)]
    b.nodes.append(helper.make_node(op, ins, outs, **attrs))
    pick = int(rng.integers(0, n_out))
    y_shape = [seq, nd, batch, hid] if pick == 0 else state
    out = b.node("Identity", [outs[pick]])
    model = b.model([_io("x", npt, x_shape)], [_io(out, npt, y_shape)], opset=14)
    x = np.random.default_rng(seed + 1).standard_normal(x_shape).astype(npt)
    desc = f"{op} {attrs} x{x_shape} lens={None if lens is None else lens.tolist()} out{pick} inputs={ins[1:]}"
    return model, {"x": x}, desc


GENERATORS = {"conv_net": conv_net, "matmul_chain": matmul_chain, "attention_block": attention_block,
              "tensor_program": tensor_program, "int_program": int_program,
              "spatial_net": spatial_net, "recurrent_net": recurrent_net, "index_program": index_program,
              "control_program": control_program, "attention_op": attention_op}
