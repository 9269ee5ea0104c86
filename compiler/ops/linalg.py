"""Linear algebra: MatMul (numpy semantics), Gemm, Einsum, the integer/quantized matmuls and
scaled dot-product attention.

The matmul-like definitions are one reduction over the contracted index (``K`` of a matmul, the
summed labels of an einsum) with the batch dims read under numpy broadcasting, so the planner sees
the batch and ``M``/``N`` axes as spatial and ``K`` as the reduction (a ``Partial`` when split).
Attention nests its reductions (scores inside the softmax inside the weighted sum of values): its
batch, head and query axes are spatial and the key axis stays whole.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..ir.expr import (BinOp, Cast, Const, Expr, UnaryOp, as_expr, dtype_kind, eq, if_then_else, logical_and, maximum,
                       minimum,
                       numpy_type, sum_type)
from ..ir.graph import Operator
from ..ir.spill import zeros as spill_zeros
from ..ir.task import TensorInput, compute, extern, reduce
from .elementwise import broadcast_shape

__all__ = ["MatMul", "Gemm", "PackedMatMul", "pack_panels", "PANEL", "Einsum", "MatMulInteger", "QLinearMatMul",
           "PackedMatMulInteger", "pack_int8_panels", "INT8_PANEL", "INT8_KSTEP", "PackedMatMulBf16",
           "pack_bf16_panels", "BF16_PANEL", "BF16_KSTEP", "MatMulNBits", "pack_bits", "unpack_bits",
           "GatherBlockQuantized", "GatherColumns", "unpack_panels", "ExpertMatMul", "Attention", "parse_einsum", "Det"]


def _batch_read(x: TensorInput, batch_shape: tuple[int, ...], batch_axes, tail) -> Expr:
    """Read ``x`` whose leading dims broadcast against ``batch_shape`` and whose last dims are ``tail``."""
    nb = x.ndim - len(tail)
    off = len(batch_shape) - nb
    idx = [as_expr(0) if ext == 1 and batch_shape[off + d] != 1 else batch_axes[off + d]
           for d, ext in enumerate(x.shape[:nb])]
    return x[tuple(idx) + tuple(tail)]


def _matmul_shapes(name: str, a_shape, b_shape) -> tuple[tuple[int, ...], int]:
    """Output shape and contracted extent of ``matmul(a, b)`` under ONNX/numpy rules."""
    if not a_shape or not b_shape:
        raise ShapeError(f"{name}: MatMul operands must have rank >= 1, got shapes {a_shape} and {b_shape}")
    k_a = a_shape[-1]
    k_b = b_shape[0] if len(b_shape) == 1 else b_shape[-2]
    if k_a != k_b:
        raise ShapeError(f"{name}: MatMul contracts dim {k_a} of {a_shape} with dim {k_b} of {b_shape}")
    batch = broadcast_shape([a_shape[:-2], b_shape[:-2]], name)
    out = batch + (a_shape[-2:-1] if len(a_shape) >= 2 else ()) + (b_shape[-1:] if len(b_shape) >= 2 else ())
    return out, k_a


def _gemm_numpy(a: np.ndarray, b: np.ndarray, c: tuple, attrs: dict) -> np.ndarray:
    """``alpha * a @ b + beta * c[0]`` (``c`` empty: no bias) in ``a``'s dtype, as Gemm computes it."""
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    y = np.matmul(a, b)
    if alpha != 1:
        y = np.asarray(alpha, a.dtype) * y
    if c and beta != 0:
        y = y + (c[0] if beta == 1 else np.asarray(beta, a.dtype) * c[0])
    return np.asarray(y, a.dtype)


class MatMul(Operator):
    """``y = a @ b`` with numpy semantics: 1-D operands and broadcast batch dims."""

    def compute(self, a, b):
        out, k = _matmul_shapes(self.name, a.shape, b.shape)
        nbatch = len(out) - (a.ndim >= 2) - (b.ndim >= 2)
        batch = out[:nbatch]

        def f(*i):
            bi = i[:nbatch]
            m = i[nbatch:nbatch + 1] if a.ndim >= 2 else ()
            n = i[len(i) - 1:] if b.ndim >= 2 else ()
            return reduce((k,), lambda kk: _batch_read(a, batch, bi, m + (kk,))
                          * _batch_read(b, batch, bi, (kk,) + n), "sum")
        return compute("y", out, f, dtype=a.dtype)

    def numpy(self, a, b):
        return [np.asarray(np.matmul(a, b))]


class Gemm(Operator):
    """``y = alpha * op(a) @ op(b) + beta * c``; ``op`` transposes when ``trans_a``/``trans_b``.

    ``c`` is optional and broadcasts to ``(M, N)``; ``alpha``/``beta`` equal to 1 add no multiply.
    """

    def compute(self, a, b, *c):
        ta, tb = self.attrs.get("trans_a", False), self.attrs.get("trans_b", False)
        alpha, beta = self.attrs.get("alpha", 1.0), self.attrs.get("beta", 1.0)
        if a.ndim != 2 or b.ndim != 2:
            raise ShapeError(f"{self.name}: Gemm takes 2-D operands, got shapes {a.shape} and {b.shape}")
        (k, m), (n_k, n) = (a.shape if ta else a.shape[::-1]), (b.shape[::-1] if tb else b.shape)
        if k != n_k:
            raise ShapeError(f"{self.name}: Gemm contracts dim {k} of A{a.shape} with dim {n_k} of B{b.shape} "
                             f"(trans_a={int(ta)}, trans_b={int(tb)})")
        shape = (m, n)
        if c and broadcast_shape([c[0].shape, shape], self.name) != shape:
            raise ShapeError(f"{self.name}: C of shape {c[0].shape} does not broadcast to the output {shape}")
        dt = a.dtype
        num = (lambda v: Const(float(v), dt)) if dtype_kind(dt) == "f" else (lambda v: Const(int(v), dt))

        def f(i, j):
            acc = reduce((k,), lambda kk: (a[kk, i] if ta else a[i, kk]) * (b[j, kk] if tb else b[kk, j]), "sum")
            if alpha != 1:
                acc = num(alpha) * acc
            if c and beta != 0:
                off = 2 - c[0].ndim
                ax = (i, j)[off:]
                bias = c[0][tuple(as_expr(0) if e == 1 and shape[off + d] != 1 else ax[d]
                                  for d, e in enumerate(c[0].shape))]
                acc = acc + (bias if beta == 1 else num(beta) * bias)
            return acc
        return compute("y", shape, f, dtype=dt)

    def numpy(self, a, b, *c):
        a = a.T if self.attrs.get("trans_a", False) else a
        b = b.T if self.attrs.get("trans_b", False) else b
        return [_gemm_numpy(a, b, c, self.attrs)]


#: Columns per panel of a weight packed for the cpu GEMM (:class:`PackedMatMul`): the width of the
#: AVX2 micro-kernel (16 floats); the SSE one (8) reads half a panel, the AVX-512 one (32) two
#: adjacent panels. 16 rather than 32: on Zen 3 (AVX2) the GPT-2/Llama projections at 1x128 tokens
#: took 5-14% less time (``benchmarks/cpu_gemm.py``).
PANEL = 16


def pack_panels(b: np.ndarray) -> np.ndarray:
    """A matrix ``b[K, N]`` as :class:`PackedMatMul` reads it: ``[ceil(N / PANEL), K, PANEL]``,
    ``b[k, j]`` at ``[j // PANEL, k, j % PANEL]``, zero in the columns past ``N``."""
    k, n = b.shape
    full, tail = divmod(n, PANEL)
    out = spill_zeros((full + (tail > 0), k, PANEL), b.dtype)  # (written once, in place: no padded copy)
    s0, s1 = b.strides  # the panels as a view of b, whatever its strides (b.T of a weight stored [N, K])
    out[:full] = np.lib.stride_tricks.as_strided(b, (full, k, PANEL), (PANEL * s1, s0, s1), writeable=False)
    if tail:
        out[full, :, :tail] = b[:, full * PANEL:]
    return out


def unpack_panels(bp: np.ndarray, n: int, k: int) -> np.ndarray:
    """The matrix ``B[K, N]`` transposed, ``[N, K]``, from its panels: float32 (or float16) ``[ceil(N / 16), K,
    16]`` (:func:`pack_panels`) or bfloat16 ``[ceil(N / 16), Kp / 2, 16, 2]`` (:func:`pack_bf16_panels`). Row
    ``j`` is column ``j`` of ``B``: the row a table tied to that product holds (:class:`GatherColumns`)."""
    if bp.ndim == 3:
        return bp.transpose(0, 2, 1).reshape(-1, bp.shape[1])[:n, :k]
    return bp.transpose(0, 2, 1, 3).reshape(bp.shape[0] * bp.shape[2], -1)[:n, :k]


class PackedMatMul(Operator):
    """``y = alpha * a @ B + beta * c`` with the constant ``B[K, N]`` stored in panels
    (:func:`pack_panels`): the form the cpu target gives a MatMul or Gemm whose weight is a
    constant (``passes/prepack.py``), so its GEMM reads the weight as packed at compile time
    instead of packing it on every call.

    Inputs ``a[..., K]``, ``bp[ceil(N / PANEL), K, PANEL]``, optionally ``c`` (broadcasts to the
    output ``[..., N]``). Attributes ``n`` (``N``), ``alpha``, ``beta`` (as in Gemm). The panels
    may be float16 for a float32 ``a``: a weight of float16 values (a float16 model's, or one
    rounded by ``optimization_config["precision"] = "float16"``), read as float32 exactly.
    """

    def compute(self, a, bp, *c):
        n = int(self.attrs["n"])
        alpha, beta = self.attrs.get("alpha", 1.0), self.attrs.get("beta", 1.0)
        if a.ndim < 1 or bp.ndim != 3 or bp.shape[2] != PANEL or bp.shape[1] != a.shape[-1] \
                or bp.shape[0] != -(-n // PANEL) \
                or (bp.dtype != a.dtype and (a.dtype, bp.dtype) != ("float32", "float16")):
            raise ShapeError(f"{self.name}: PackedMatMul takes a[..., K] and panels [ceil(N/{PANEL}), K, {PANEL}] "
                             f"with N = {n} of a's type (or float16 for a float32 a), got {a.dtype} {a.shape} and "
                             f"{bp.dtype} {bp.shape}")
        shape = tuple(a.shape[:-1]) + (n,)
        if c and broadcast_shape([c[0].shape, shape], self.name) != shape:
            raise ShapeError(f"{self.name}: C of shape {c[0].shape} does not broadcast to the output {shape}")
        k, dt = a.shape[-1], a.dtype
        weight = (lambda v: v) if bp.dtype == dt else (lambda v: Cast(v, dt))  # noqa: E731

        def f(*i):
            rows, j = i[:-1], i[-1]
            acc = reduce((k,), lambda kk: a[tuple(rows) + (kk,)] * weight(bp[j // PANEL, kk, j % PANEL]), "sum")
            if alpha != 1:
                acc = Const(float(alpha), dt) * acc
            if c and beta != 0:
                off = len(shape) - c[0].ndim
                bias = c[0][tuple(as_expr(0) if e == 1 and shape[off + d] != 1 else i[off + d]
                                  for d, e in enumerate(c[0].shape))]
                acc = acc + (bias if beta == 1 else Const(float(beta), dt) * bias)
            return acc
        return compute("y", shape, f, dtype=dt)

    def local_attrs(self, inputs, output_shapes):
        # a shard of the output's columns reads whole panels (the rules split ``j // PANEL`` only
        # when the shards' bounds are multiples of PANEL): ``n`` becomes the shard's width
        return dict(self.attrs, n=int(output_shapes[0][-1]))

    def numpy(self, a, bp, *c):
        b = unpack_panels(bp, int(self.attrs["n"]), bp.shape[1]).T.astype(a.dtype)
        return [_gemm_numpy(a, b, c, self.attrs)]


#: Columns per panel of a bfloat16 weight packed for the cpu bfloat16 GEMM (:class:`PackedMatMulBf16`):
#: one AMX tile's (16 float32 sums a row) and one AVX-512 register's.
BF16_PANEL = 16
#: The packed weight's ``K`` is padded with zeros to a multiple of this: the depth of one AMX tile
#: (32 bfloat16 values, 16 pairs of rows).
BF16_KSTEP = 32


def pack_bf16_panels(b: np.ndarray) -> np.ndarray:
    """A constant matrix ``b[K, N]`` whose values are bfloat16 (a bfloat16 array, or float32 holding
    bfloat16 values exactly) as :class:`PackedMatMulBf16` reads it: bfloat16 ``[ceil(N / 16), Kp / 2,
    16, 2]`` (``Kp``: ``K`` rounded up to :data:`BF16_KSTEP`), ``b[k, j]`` at ``[j // 16, k // 2, j % 16,
    k % 2]``, zero past ``K`` and ``N``: the pairs along ``k`` that AMX and AVX-512's bfloat16 dot
    products add into one float32 sum."""
    bf16 = numpy_type("bfloat16")
    k, n = b.shape
    kp, npanel = -(-k // BF16_KSTEP) * BF16_KSTEP, -(-n // BF16_PANEL)
    out = spill_zeros((npanel, kp // 2, BF16_PANEL, 2), bf16)
    step = max(1, (1 << 22) // max(1, kp * BF16_PANEL))  # panels per chunk: about 8 MB of bfloat16
    for p0 in range(0, npanel, step):
        p1 = min(npanel, p0 + step)
        c0, c1 = p0 * BF16_PANEL, min(n, p1 * BF16_PANEL)
        padded = np.zeros((kp, (p1 - p0) * BF16_PANEL), bf16)
        padded[:k, :c1 - c0] = np.asarray(b[:, c0:c1]).astype(bf16)
        out[p0:p1] = padded.reshape(kp // 2, 2, p1 - p0, BF16_PANEL).transpose(2, 0, 3, 1)
    return out


class PackedMatMulBf16(Operator):
    """``y = alpha * a @ B + beta * c`` for a bfloat16 ``a`` and a constant bfloat16 ``B[K, N]`` packed by
    :func:`pack_bf16_panels`, in float32 (each product of two bfloat16 values is exact in float32; the
    sums are float32): the form the cpu target gives a float32 MatMul or Gemm whose operands are
    bfloat16 values widened (``passes/prepack.py``), so that its GEMM multiplies them as bfloat16 (AMX
    tiles, AVX-512 BF16, or widened again on a CPU with neither).

    Inputs ``a[..., K]`` (bfloat16), ``bp`` (bfloat16 ``[ceil(N / 16), Kp / 2, 16, 2]``), optionally
    ``c`` (float32, broadcasts to the output ``[..., N]``). Attributes ``n`` (``N``), ``alpha``,
    ``beta`` (as in Gemm), ``to``: the output's type, ``"float32"`` (the default) or ``"bfloat16"`` (rounded
    to nearest even as it is stored: a bfloat16 model's rounding of the product, ``passes/prepack.py``).
    """

    def compute(self, a, bp, *c):
        n = int(self.attrs["n"])
        alpha, beta = self.attrs.get("alpha", 1.0), self.attrs.get("beta", 1.0)
        k = a.shape[-1] if a.ndim else 0
        if a.ndim < 1 or a.dtype != "bfloat16" or bp.dtype != "bfloat16" or bp.ndim != 4 \
                or tuple(bp.shape[2:]) != (BF16_PANEL, 2) or bp.shape[0] != -(-n // BF16_PANEL) \
                or bp.shape[1] != -(-k // BF16_KSTEP) * BF16_KSTEP // 2:
            raise ShapeError(f"{self.name}: PackedMatMulBf16 takes a[..., K] (bfloat16) and panels "
                             f"[ceil(N/{BF16_PANEL}), Kp/2, {BF16_PANEL}, 2] (bfloat16, Kp = K rounded up to "
                             f"{BF16_KSTEP}) with N = {n}, got {a.dtype} {a.shape} and {bp.dtype} {bp.shape}")
        shape = tuple(a.shape[:-1]) + (n,)
        if c and (c[0].dtype != "float32" or broadcast_shape([c[0].shape, shape], self.name) != shape):
            raise ShapeError(f"{self.name}: C ({c[0].dtype} {c[0].shape}) must be float32 and broadcast to the "
                             f"output {shape}")

        def f(*i):
            rows, j = i[:-1], i[-1]
            acc = reduce((k,), lambda kk: Cast(a[tuple(rows) + (kk,)], "float32")
                         * Cast(bp[j // BF16_PANEL, kk // 2, j % BF16_PANEL, kk % 2], "float32"), "sum")
            if alpha != 1:
                acc = Const(float(alpha), "float32") * acc
            if c and beta != 0:
                off = len(shape) - c[0].ndim
                bias = c[0][tuple(as_expr(0) if e == 1 and shape[off + d] != 1 else i[off + d]
                                  for d, e in enumerate(c[0].shape))]
                acc = acc + (bias if beta == 1 else Const(float(beta), "float32") * bias)
            return acc if to == "float32" else Cast(acc, to)
        to = self.attrs.get("to", "float32")
        return compute("y", shape, f, dtype=to)

    def numpy(self, a, bp, *c):
        b = unpack_panels(bp, int(self.attrs["n"]), a.shape[-1]).T.astype(np.float32)
        y = _gemm_numpy(a.astype(np.float32), b, c, self.attrs)
        return [y.astype(numpy_type(self.attrs.get("to", "float32")))]


class GatherColumns(Operator):
    """Rows of a table ``T[V, D]`` looked up as the columns of a product's weight ``B = Tᵀ`` (an output
    layer tied to the token table): ``y[i..., d] = B[d, j]`` with ``j = indices[i...]`` (negative ones
    counted from the end), ``B`` stored plain ``[D, V]``, in float32 (or float16) panels ``[ceil(V / 16), D, 16]``
    (:func:`pack_panels`: ``B[d, j]`` at ``[j // 16, d, j % 16]``) or in bfloat16 ones ``[ceil(V / 16), Dp /
    2, 16, 2]`` (:func:`pack_bf16_panels`: at ``[j // 16, d // 2, j % 16, d % 2]``). The cpu target's
    ``Gather`` of such a table, so that a rank stores the table once, as the product's weight
    (``passes/precision.py``, :class:`~shardflow.compiler.passes.precision.TablesInTiedWeights`).

    Inputs ``b`` and ``indices`` (int32/int64). Attributes ``n`` (``V``), ``d`` (``D``); with ``start`` and
    ``extent`` (as :class:`~shardflow.compiler.ops.transform.Gather`'s), ``b`` holds the rows ``start`` on
    of a table of ``extent`` rows, and an index outside them reads zero (a vocab-parallel rank). The output
    has ``b``'s type.
    """

    def compute(self, b, indices):
        from .transform import _wrap_index

        n, d = int(self.attrs["n"]), int(self.attrs["d"])
        start, extent = self.attrs.get("start", 0), self.attrs.get("extent")
        if b.ndim == 4:  # bfloat16 panels (a shard of d reads those of the pairs)
            fits = b.dtype == "bfloat16" and tuple(b.shape[2:]) == (BF16_PANEL, 2) and 2 * b.shape[1] >= d \
                and b.shape[0] == -(-n // BF16_PANEL)
        elif b.ndim == 3:  # float32 (or float16) panels
            fits = b.dtype in ("float32", "float16") and tuple(b.shape[1:]) == (d, PANEL) \
                and b.shape[0] == -(-n // PANEL)
        else:
            fits = tuple(b.shape) == (d, n)
        if not fits or indices.dtype not in ("int32", "int64"):
            raise ShapeError(f"{self.name}: GatherColumns takes B [D, V], float32/float16 panels [ceil(V/{PANEL}), "
                             f"D, {PANEL}] or bfloat16 panels [ceil(V/{BF16_PANEL}), >= D/2, {BF16_PANEL}, 2] with "
                             f"V = {n}, D = {d}, and int32/int64 indices, got {b.dtype} {b.shape} and {indices.dtype} "
                             f"{indices.shape}")
        q = indices.ndim

        def f(*i):
            e = i[q]
            j = _wrap_index(indices[i[:q]], n if extent is None else int(extent))
            if extent is not None:
                j = j - start
            v = (b[j // BF16_PANEL, e // 2, j % BF16_PANEL, e % 2] if b.ndim == 4 else
                 b[j // PANEL, e, j % PANEL] if b.ndim == 3 else b[e, j])
            if extent is None:
                return v
            zero = Const(np.zeros((), numpy_type(b.dtype)).item(), b.dtype)
            return if_then_else(logical_and(j >= 0, j < n), v, zero)
        return compute("y", tuple(indices.shape) + (d,), f, dtype=b.dtype)

    def local_attrs(self, inputs, output_shapes):
        # a shard of the rows' values (of ``d``) reads those of ``b``
        return dict(self.attrs, d=int(output_shapes[0][-1]))

    def numpy(self, b, indices):
        from .transform import _np_wrap

        n, d, extent = int(self.attrs["n"]), int(self.attrs["d"]), self.attrs.get("extent")
        table = b.T if b.ndim == 2 else unpack_panels(b, n, d)
        if extent is None:
            return [table[_np_wrap(indices, n, self.name)]]
        j = _np_wrap(indices, int(extent), self.name) - int(self.attrs.get("start", 0))
        inside = (j >= 0) & (j < n)
        return [np.where(inside[..., None], table[np.where(inside, j, 0)], np.zeros((), table.dtype))]


def parse_einsum(equation: str, shapes: list[tuple[int, ...]], where: str = "Einsum"):
    """Parse an einsum equation against operand shapes.

    Returns ``(operand_labels, output_labels, extents, normalized)``: one label list per operand
    (ellipsis dims replaced by private labels), the output labels, each label's extent, and the
    equation with an explicit output (``...`` kept) for ``np.einsum``. Implicit mode follows numpy:
    the ellipsis dims, then the labels used once in alphabetical order. Extent-1 dims broadcast.
    """
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise ShapeError(f"{where}: equation {equation!r} has {len(terms)} operands, {len(shapes)} given")
    letters = [c for c in eq if c.isalpha()]
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in letters]
    for t in terms + ([rhs] if arrow else []):
        body = t.replace("...", "")
        if not all(c.isalpha() for c in body) or t.count("...") > 1:
            raise ShapeError(f"{where}: malformed einsum term {t!r} in {equation!r}")
    n_ell = 0
    for t, s in zip(terms, shapes):
        named = len(t.replace("...", ""))
        if "..." in t:
            if len(s) < named:
                raise ShapeError(f"{where}: term {t!r} needs rank >= {named}, operand has shape {s}")
            n_ell = max(n_ell, len(s) - named)
        elif len(s) != named:
            raise ShapeError(f"{where}: term {t!r} has {named} labels but the operand has shape {s}")
    if n_ell > len(spare):
        raise ShapeError(f"{where}: too many dims under the ellipsis in {equation!r}")
    ell = spare[:n_ell]
    op_labels: list[list[str]] = []
    extents: dict[str, int] = {}
    for t, s in zip(terms, shapes):
        pre, dots, post = t.partition("...")
        labels = list(pre) + (ell[n_ell - (len(s) - len(pre) - len(post)):] if dots else []) + list(post)
        own: dict[str, int] = {}
        for lab, ext in zip(labels, s):
            if own.setdefault(lab, ext) != ext:  # (a diagonal: no broadcast within one operand)
                raise ShapeError(f"{where}: label {lab!r} repeats in term {t!r} of {equation!r} over dims of "
                                 f"extents {own[lab]} and {ext}")
            have = extents.setdefault(lab, ext)
            if have != ext and 1 not in (have, ext):
                raise ShapeError(f"{where}: label {lab!r} of {equation!r} has extents {have} and {ext}")
            if have == 1:
                extents[lab] = ext
        op_labels.append(labels)
    if arrow:
        pre, dots, post = rhs.partition("...")
        out = list(pre) + (ell if dots else []) + list(post)
        if len(set(out)) != len(out) or any(lab not in extents for lab in out):
            raise ShapeError(f"{where}: output term {rhs!r} of {equation!r} repeats a label or uses an unknown one")
        if ell and not dots:
            raise ShapeError(f"{where}: output term {rhs!r} of {equation!r} drops the broadcast (ellipsis) dims")
        norm = eq
    else:
        counts: dict[str, int] = {}
        for c in lhs:
            if c.isalpha():
                counts[c] = counts.get(c, 0) + 1
        once = sorted(c for c, n in counts.items() if n == 1)
        out = ell + once
        norm = f"{lhs}->{'...' if ell else ''}{''.join(once)}"
    return op_labels, out, extents, norm


class Einsum(Operator):
    """``np.einsum(equation, *operands)``: one product of operand reads summed over the labels
    missing from the output (attribute ``equation``)."""

    def compute(self, *xs):
        labels, out, ext, _ = parse_einsum(self.attrs["equation"], [x.shape for x in xs], self.name)
        summed = [lab for lab in ext if lab not in out]

        def read(x, labs, env):
            return x[tuple(as_expr(0) if e == 1 and ext[lab] != 1 else env[lab] for lab, e in zip(labs, x.shape))]

        def f(*i):
            env = dict(zip(out, i))

            def body(*k):
                env.update(zip(summed, k))
                prod = read(xs[0], labels[0], env)
                for x, labs in zip(xs[1:], labels[1:]):
                    prod = prod * read(x, labs, env)
                return prod
            if not summed:
                return body()
            return reduce(tuple(ext[s] for s in summed), body, "sum")
        return compute("y", tuple(ext[lab] for lab in out), f, dtype=xs[0].dtype)

    def numpy(self, *xs):
        _, _, _, norm = parse_einsum(self.attrs["equation"], [x.shape for x in xs], self.name)
        dt = xs[0].dtype  # (half operands: products and sums in float32, rounded once)
        wide = [x.astype(sum_type(dt), copy=False) for x in xs]
        return [np.asarray(np.einsum(norm, *wide, optimize=len(xs) > 1)).astype(dt, copy=False)]


def _qparam_read(p: TensorInput | None, axis_var) -> Expr | None:
    """Read a quantization parameter that is per-tensor (one element) or per-row/column (``axis_var``)."""
    if p is None:
        return None
    if p.ndim == 0:
        return p[()]
    return p[(as_expr(0) if p.shape[0] == 1 else axis_var,)]


def _int_matmul_body(a, b, azp, bzp, batch, bi, m, n):
    """``sum_k (a - azp) * (b - bzp)`` in int32 for the output position (``bi``, ``m``, ``n``)."""
    def body(kk):
        av = Cast(_batch_read(a, batch, bi, m + (kk,)), "int32")
        bv = Cast(_batch_read(b, batch, bi, (kk,) + n), "int32")
        za, zb = _qparam_read(azp, m[0] if m else 0), _qparam_read(bzp, n[0] if n else 0)
        if za is not None:
            av = av - Cast(za, "int32")
        if zb is not None:
            bv = bv - Cast(zb, "int32")
        return av * bv
    return body


def _check_qparam(name: str, p: TensorInput | None, what: str, length: int) -> None:
    if p is not None and not (p.ndim == 0 or (p.ndim == 1 and p.shape[0] in (1, length))):
        raise ShapeError(f"{name}: {what} must be a scalar or have {length} elements (one per "
                         f"{'row' if what.startswith('a') else 'column'}), got shape {p.shape}")


def _qparam_np(p: np.ndarray | None, row: bool, ndim: int):
    if p is None:
        return None
    p = p.reshape(-1)
    if p.size == 1:
        return p.reshape(())
    return p.reshape((-1, 1) if row and ndim >= 2 else (-1,))


class MatMulInteger(Operator):
    """``y = (a - a_zero_point) @ (b - b_zero_point)`` accumulated in int32.

    Inputs ``a, b[, a_zero_point, b_zero_point]``; zero points are per-tensor, per-row of ``a`` or
    per-column of ``b``. Attribute ``has_azp`` says whether the third input is ``a_zero_point``.
    """

    def compute(self, a, b, *zps):
        azp, bzp = self._zps(zps)
        out, k = _matmul_shapes(self.name, a.shape, b.shape)
        _check_qparam(self.name, azp, "a_zero_point", a.shape[-2] if a.ndim >= 2 else 1)
        _check_qparam(self.name, bzp, "b_zero_point", b.shape[-1] if b.ndim >= 2 else 1)
        nbatch = len(out) - (a.ndim >= 2) - (b.ndim >= 2)

        def f(*i):
            bi, m = i[:nbatch], (i[nbatch:nbatch + 1] if a.ndim >= 2 else ())
            n = i[len(i) - 1:] if b.ndim >= 2 else ()
            return reduce((k,), _int_matmul_body(a, b, azp, bzp, out[:nbatch], bi, m, n), "sum")
        return compute("y", out, f, dtype="int32")

    def _zps(self, zps):
        zps = list(zps)
        azp = zps.pop(0) if self.attrs.get("has_azp", False) else None
        return azp, (zps[0] if zps else None)

    def numpy(self, a, b, *zps):
        azp, bzp = self._zps(zps)
        av, bv = a.astype(np.int32), b.astype(np.int32)
        if azp is not None:
            av = av - _qparam_np(azp, True, a.ndim).astype(np.int32)
        if bzp is not None:
            bv = bv - _qparam_np(bzp, False, b.ndim).astype(np.int32)
        return [np.asarray(np.matmul(av, bv), np.int32)]


#: Columns per panel of an int8 weight packed for the cpu integer GEMM (:class:`PackedMatMulInteger`):
#: one AVX-512 register of int32 sums; the contracted dim goes in groups of four (VNNI's
#: ``vpdpbusd`` multiplies four unsigned by four signed bytes and adds them to one int32 lane).
INT8_PANEL = 16
#: The packed int8 weight's contracted dim is padded with zeros to a multiple of this: 16 groups of
#: four, the rows of one AMX tile (``tdpbusd`` takes 16 x 64 bytes of a panel at a time).
INT8_KSTEP = 64


def _int8_groups(k: int) -> int:
    """Groups of four along ``K`` in a weight panel packed by :func:`pack_int8_panels`."""
    return -(-k // INT8_KSTEP) * (INT8_KSTEP // 4)


def pack_int8_panels(b: np.ndarray, b_zero_point: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A constant int8 or uint8 matrix ``b[K, N]`` (and its zero point: none, one, or one per column)
    as :class:`PackedMatMulInteger` reads it: ``(bp, bc)``.

    ``bp`` (int8) ``[ceil(N / 16), Kp / 4, 16, 4]`` (``Kp``: ``K`` rounded up to :data:`INT8_KSTEP`)
    holds ``b' = b`` (int8) or ``b - 128`` (uint8, so that every weight is a signed byte) with
    ``b'[k, j]`` at ``[j // 16, k // 4, j % 16, k % 4]``, zero past ``K`` and ``N``. ``bc`` (int32)
    ``[2, 16 * ceil(N / 16)]``: row 0 the zero point in the same terms (``bzp - 128`` or ``bzp``, so
    ``b - bzp = b' - bc[0]``), row 1 the sums of ``b'`` over ``k`` (the kernel's correction for ``a``'s
    zero point)."""
    k, n = b.shape
    shift = 128 if b.dtype == np.uint8 else 0
    npanel, ngroup = -(-n // INT8_PANEL), _int8_groups(k)
    bp = spill_zeros((npanel, ngroup, INT8_PANEL, 4), np.int8)
    bc = np.zeros((2, npanel * INT8_PANEL), np.int32)
    zp = np.zeros(n, np.int32) if b_zero_point is None else np.broadcast_to(
        np.asarray(b_zero_point).reshape(-1).astype(np.int32), (n,))
    bc[0, :n] = zp - shift
    # by chunks of panels of about 4 MB of int16 values (not the whole matrix in int32 twice)
    step = max(1, (1 << 21) // max(1, ngroup * 4 * INT8_PANEL))
    for p0 in range(0, npanel, step):
        p1 = min(npanel, p0 + step)
        c0, c1 = p0 * INT8_PANEL, min(n, p1 * INT8_PANEL)
        bs = b[:, c0:c1].astype(np.int16) - shift
        bc[1, c0:c1] = bs.sum(axis=0, dtype=np.int32)
        padded = np.zeros((ngroup * 4, (p1 - p0) * INT8_PANEL), np.int8)
        padded[:k, :c1 - c0] = bs
        bp[p0:p1] = padded.reshape(ngroup, 4, p1 - p0, INT8_PANEL).transpose(2, 0, 3, 1)
    return bp, bc


class PackedMatMulInteger(Operator):
    """:class:`MatMulInteger` with a constant 2-D weight packed by :func:`pack_int8_panels`: the form
    the cpu target gives it (``passes/prepack.py``), so that its integer GEMM reads the weight in
    the layout of its kernels (and its column sums) instead of converting it on every call.

    Inputs ``a[..., K]`` (int8 or uint8), ``bp``, ``bc`` and optionally ``a_zero_point`` (``a``'s
    dtype; a scalar or one per row of ``a``). Attribute ``n`` (``N``). With ``a' = a`` (uint8) or
    ``a + 128`` (int8, as a byte: ``a ^ 0x80``) and ``z = a_zero_point`` in the same terms, the
    definition is the kernel's identity, ``sum_k a' b' - bc[0, n] sum_k a' - z bc[1, n] + K z bc[0, n]``
    (``= sum_k (a - a_zero_point)(b - b_zero_point)``), in int32 with wrap-around like MatMulInteger.
    """

    def compute(self, a, bp, bc, *azp):
        n = int(self.attrs["n"])
        if a.ndim < 1 or a.dtype not in ("int8", "uint8") or bp.ndim != 4 or tuple(bp.shape[2:]) != (INT8_PANEL, 4) \
                or bp.shape[1] != _int8_groups(a.shape[-1]) or bp.shape[0] != -(-n // INT8_PANEL) \
                or tuple(bc.shape) != (2, bp.shape[0] * INT8_PANEL):
            raise ShapeError(f"{self.name}: PackedMatMulInteger takes a[..., K] (int8/uint8), panels "
                             f"[ceil(N/{INT8_PANEL}), ceil(K/{INT8_KSTEP})*{INT8_KSTEP // 4}, {INT8_PANEL}, 4] and "
                             f"column terms [2, {INT8_PANEL} * ceil(N/{INT8_PANEL})] with N = {n}, got shapes {a.shape}, {bp.shape} "
                             f"and {bc.shape}")
        z = azp[0] if azp else None
        _check_qparam(self.name, z, "a_zero_point", a.shape[-2] if a.ndim >= 2 else 1)
        shape = tuple(a.shape[:-1]) + (n,)
        k = a.shape[-1]
        shift = Const(128 if a.dtype == "int8" else 0, "int32")

        def f(*i):
            rows, j = i[:-1], i[-1]

            def a_(kk):
                return Cast(a[tuple(rows) + (kk,)], "int32") + shift
            dot = reduce((k,), lambda kk: a_(kk) * Cast(bp[j // INT8_PANEL, kk // 4, j % INT8_PANEL, kk % 4], "int32"),
                         "sum")
            acc = dot - bc[0, j] * reduce((k,), a_, "sum")
            if z is None and a.dtype == "uint8":
                return acc
            zv = shift if z is None else Cast(_qparam_read(z, rows[-1] if a.ndim >= 2 else 0), "int32") + shift
            return acc - zv * bc[1, j] + Const(k, "int32") * zv * bc[0, j]
        return compute("y", shape, f, dtype="int32")

    def numpy(self, a, bp, bc, *azp):
        n, k = int(self.attrs["n"]), a.shape[-1]
        shift = 128 if a.dtype == np.int8 else 0
        b = bp.transpose(1, 3, 0, 2).reshape(bp.shape[1] * 4, -1)[:k, :n].astype(np.int64)
        av = a.astype(np.int64) + shift
        z = (_qparam_np(azp[0], True, a.ndim).astype(np.int64) + shift) if azp else np.int64(shift)
        y = np.matmul(av, b) - bc[0, :n] * av.sum(axis=-1, keepdims=True) - z * bc[1, :n] + k * z * bc[0, :n]
        return [np.asarray(y).astype(np.int32)]


def unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first ``count`` ``bits``-bit unsigned values packed least significant first along the last
    axis of the uint8 array ``packed`` (onnxruntime's ``MatMulNBits`` layout)."""
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    vals = (packed[..., :, None] >> shifts) & np.uint8((1 << bits) - 1)
    return vals.reshape(packed.shape[:-1] + (-1,))[..., :count]


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """:func:`unpack_bits`' inverse: ``bits``-bit unsigned ``values`` packed least significant first
    along the last axis into uint8 (that axis padded with zeros to whole bytes)."""
    per = 8 // bits
    v = np.asarray(values).astype(np.uint8)
    v = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, -v.shape[-1] % per)]).reshape(v.shape[:-1] + (-1, per))
    out = np.zeros(v.shape[:-1], np.uint8)
    for j in range(per):
        out |= (v[..., j] << np.uint8(j * bits)).astype(np.uint8)
    return out


class MatMulNBits(Operator):
    """``y = a @ W`` with the weight ``W[K, N]`` kept as ``bits``-bit unsigned integers (2, 4 or 8) in
    blocks of ``block_size`` along ``K``, one scale and zero point per block and column: onnxruntime's
    ``MatMulNBits`` (``com.microsoft``), stored as its quantizer wrote it, so that a 4-bit weight
    takes an eighth of the float32 bytes in the plan, the weights file and memory.

    Inputs ``a[..., K]`` (float32), ``bq[N, blocks, block_size * bits / 8]`` (uint8, value ``k`` of a
    column's block in bits ``(k % (8 / bits)) * bits`` of its byte ``k / (8 / bits)``), ``scales[N,
    blocks]`` (float32) and optionally ``zero_points[N, blocks]`` (float32; default ``2^(bits - 1)``),
    ``blocks = ceil(K / block_size)``. ``W[k, n] = (q[n, k] - zero_point[n, b]) * scale[n, b]`` with
    ``b = k / block_size``. Attributes ``bits``, ``block_size``, and optionally ``operand_dtype``
    (``"float16"``/``"bfloat16"``: ``a`` and ``W`` rounded to that type before their products, which
    are exact in float32 and summed in float32, as a tensor-core GEMM on half operands computes;
    ``passes/lowbit.py`` sets it for the cuda target under a half ``precision``).

    The planner splits ``N`` (whole columns) and ``K`` where each shard holds whole blocks (a
    ``Partial`` sum). Both targets compute on the codes, never storing the weight dequantized: the
    cpu target with ``cpu_library/lowbit.h``, the cuda target with the kernels of its compute
    definition (the GEMV template up to 15 rows, a tensor-core GEMM dequantizing in its operand
    loads beyond).
    """

    def compute(self, a, bq, scales, *zp):
        bits, bs = int(self.attrs["bits"]), int(self.attrs["block_size"])
        if bits not in (2, 4, 8) or bs < 1 or bs * bits % 8:
            raise ShapeError(f"{self.name}: MatMulNBits takes bits 2, 4 or 8 and a block of whole bytes, got bits "
                             f"{bits}, block_size {bs}")
        k = a.shape[-1] if a.ndim else 0
        blocks = -(-k // bs)
        if a.ndim < 1 or a.dtype != "float32" or bq.dtype != "uint8" or bq.ndim != 3 \
                or tuple(bq.shape[1:]) != (blocks, bs * bits // 8) or scales.dtype != "float32" \
                or tuple(scales.shape) != (bq.shape[0], blocks) \
                or (zp and (zp[0].dtype != "float32" or tuple(zp[0].shape) != tuple(scales.shape))):
            raise ShapeError(f"{self.name}: MatMulNBits takes a[..., K] (float32), bq[N, ceil(K / {bs}), "
                             f"{bs * bits // 8}] (uint8), scales and zero points [N, ceil(K / {bs})] (float32), got "
                             f"{[(t.dtype, tuple(t.shape)) for t in (a, bq, scales, *zp)]}")
        half = self.attrs.get("operand_dtype")
        if half not in (None, "float16", "bfloat16"):
            raise ShapeError(f"{self.name}: MatMulNBits' operand_dtype is 'float16' or 'bfloat16', not {half!r}")
        n, per = int(bq.shape[0]), 8 // bits
        shape = tuple(a.shape[:-1]) + (n,)
        mask = Const((1 << bits) - 1, "int32")
        default_zp = Const(float(1 << (bits - 1)), "float32")

        def f(*i):
            rows, j = tuple(i[:-1]), i[-1]

            def term(kk):
                blk = kk // bs
                byte = Cast(bq[j, blk, (kk % bs) // per if per > 1 else kk % bs], "int32")
                q = byte if per == 1 else BinOp("bitand", BinOp("shr", byte, Cast((kk % per) * bits, "int32")), mask)
                w = (Cast(q, "float32") - (zp[0][j, blk] if zp else default_zp)) * scales[j, blk]
                x = a[rows + (kk,)]
                if half:
                    x, w = Cast(Cast(x, half), "float32"), Cast(Cast(w, half), "float32")
                return x * w
            return reduce((k,), term, "sum")
        return compute("y", shape, f, dtype="float32")

    def dequantized(self, bq: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, k: int) -> np.ndarray:
        """``W[K, N]`` (float32) from the stored weight."""
        bits, bs = int(self.attrs["bits"]), int(self.attrs["block_size"])
        q = unpack_bits(bq, bits, bs).reshape(bq.shape[0], -1)[:, :k].astype(np.float32)
        g = np.arange(k) // bs
        z = np.float32(1 << (bits - 1)) if zp is None else zp[:, g]
        return np.ascontiguousarray(((q - z) * scales[:, g]).T)

    def numpy(self, a, bq, scales, *zp):
        w = self.dequantized(bq, scales, zp[0] if zp else None, a.shape[-1])
        half = self.attrs.get("operand_dtype")
        if half:
            a, w = (x.astype(numpy_type(half)).astype(np.float32) for x in (a, w))
        return [np.asarray(np.matmul(a, w), np.float32)]


class GatherBlockQuantized(Operator):
    """Rows of a table kept as ``bits``-bit unsigned integers, dequantized as they are gathered:
    onnxruntime's ``GatherBlockQuantized`` (``com.microsoft``) on ``uint8`` data, the quantized
    embedding of an LLM whose embedding and ``lm_head`` share one 4-bit weight.

    Inputs ``data[V, K * bits / 8]`` (uint8, value ``k`` of a row in bits ``(k % (8 / bits)) *
    bits`` of its byte ``k / (8 / bits)``), ``indices[...]`` (int32/int64, negative ones counted
    from the end), ``scales[V, blocks]`` (float32 or float16) and optionally ``zero_points[V,
    blocks]`` (float32; default ``2^(bits - 1)``), ``blocks = ceil(K / block_size)``.
    ``y[i..., k] = (q[r, k] - zero_point[r, b]) * scale[r, b]`` with ``r = indices[i...]`` and ``b =
    k / block_size``, in the scales' type; an index outside ``[-V, V)`` gives a row of zeros (as
    onnxruntime's kernel does). Attributes ``bits``, ``block_size``; with ``start`` and ``extent``
    (:meth:`offset_attrs`), ``data``, ``scales`` and ``zero_points`` hold the rows ``start`` on of a
    table of ``extent`` rows, and an index outside them reads zeros too (a vocab-parallel rank).
    """

    def compute(self, data, indices, scales, *zp):
        bits, bs = int(self.attrs["bits"]), int(self.attrs["block_size"])
        if bits not in (2, 4, 8) or bs < 1:
            raise ShapeError(f"{self.name}: GatherBlockQuantized takes bits 2, 4 or 8 and a positive block size, "
                             f"got bits {bits}, block_size {bs}")
        per = 8 // bits
        v, k = (int(data.shape[0]), int(data.shape[1]) * per) if data.ndim == 2 else (0, 0)
        blocks = -(-k // bs)
        if data.ndim != 2 or data.dtype != "uint8" or indices.dtype not in ("int32", "int64") \
                or scales.dtype not in ("float32", "float16") or tuple(scales.shape) != (v, blocks) \
                or (zp and (zp[0].dtype != "float32" or tuple(zp[0].shape) != (v, blocks))):
            raise ShapeError(f"{self.name}: GatherBlockQuantized takes data[V, K * {bits} / 8] (uint8), indices "
                             f"(int32/int64), scales[V, ceil(K / {bs})] (float32/float16) and zero points like the "
                             f"scales (float32), got "
                             f"{[(t.dtype, tuple(t.shape)) for t in (data, indices, scales, *zp)]}")
        mask = Const((1 << bits) - 1, "int32")
        default_zp = Const(float(1 << (bits - 1)), "float32")
        q_dims = indices.ndim
        start, extent = int(self.attrs.get("start", 0)), self.attrs.get("extent")
        whole = v if extent is None else int(extent)

        def f(*i):
            raw = Cast(indices[i[:q_dims]], "int64")
            inside = logical_and(raw >= -whole, raw < whole)
            r = if_then_else(raw < 0, raw + whole, raw)
            if extent is not None:  # (this rank's rows only)
                r = r - start
                inside = logical_and(inside, logical_and(r >= 0, r < v))
            r = if_then_else(inside, r, Const(0, "int64"))  # (a read in bounds; the value is 0 below)
            kk = i[q_dims]
            blk = kk // bs
            byte = Cast(data[r, kk // per if per > 1 else kk], "int32")
            q = byte if per == 1 else BinOp("bitand", BinOp("shr", byte, Cast((kk % per) * bits, "int32")), mask)
            w = (Cast(q, "float32") - (zp[0][r, blk] if zp else default_zp)) * Cast(scales[r, blk], "float32")
            return Cast(if_then_else(inside, w, Const(0.0, "float32")), scales.dtype)
        return compute("y", tuple(indices.shape) + (k,), f, dtype=scales.dtype)

    def numpy(self, data, indices, scales, *zp):
        bits, bs = int(self.attrs["bits"]), int(self.attrs["block_size"])
        v, extent = data.shape[0], self.attrs.get("extent")
        whole = v if extent is None else int(extent)
        idx = np.asarray(indices).astype(np.int64)
        inside = (idx >= -whole) & (idx < whole)
        rows = np.where(idx < 0, idx + whole, idx) - int(self.attrs.get("start", 0))
        inside &= (rows >= 0) & (rows < v)
        rows = np.where(inside, rows, 0)
        q = unpack_bits(data[rows], bits, data.shape[1] * 8 // bits).astype(np.float32)
        g = np.arange(q.shape[-1]) // bs
        z = np.float32(1 << (bits - 1)) if not zp else zp[0][rows][..., g]
        w = (q - z) * scales[rows][..., g].astype(np.float32)
        return [np.where(inside[..., None], w, np.float32(0)).astype(scales.dtype)]

    def offset_split_dims(self):
        if "extent" in self.attrs:
            return ()
        return tuple((k, 0) for k in range(len(self.inputs)) if k != 1)  # (the codes, scales, zero points)

    def offset_attrs(self, start):
        if not self.offset_split_dims():
            return super().offset_attrs(start)
        return {"start": int(start), "extent": int(self.inputs[0].shape[0])}


class ExpertMatMul(Operator):
    """The product of each token with the weights of the experts it was routed to (a mixture of
    experts computed on the chosen experts only): inputs ``x`` ``[T, K]`` (every slot of a token
    reads its row) or ``[T, J, K]`` (one row per slot), ``w[E, N, K]`` (each expert's weight, its
    rows the outputs), ``experts[T, J]`` (int32/int64: slot ``j`` of token ``t`` uses expert
    ``experts[t, j]``) and optionally ``bias[E, N]``::

        y[t, j, n] = sum_k x[t, (j,) k] * w[experts[t, j], n, k]  (+ bias[experts[t, j], n])

    ``y`` is ``[T, J, N]``; an expert index outside ``[0, E)`` gives a row of zeros. Only the chosen
    experts' weights are read (``T * J`` of the ``E``), where a dense product over every expert would
    read them all. The experts' axis is indexed by data, so the planner does not split it; it splits
    the tokens, the slots, ``N`` (each rank the rows of every expert it holds) and ``K`` (a partial sum)."""

    def compute(self, x, w, experts, *bias):
        t_len, j_len = experts.shape if experts.ndim == 2 else (0, 0)
        e_len, n_len, k_len = w.shape if w.ndim == 3 else (0, 0, 0)
        if (experts.ndim != 2 or experts.dtype not in ("int32", "int64") or w.ndim != 3
                or x.shape not in ((t_len, k_len), (t_len, j_len, k_len)) or dtype_kind(x.dtype) != "f"
                or w.dtype != x.dtype
                or (bias and (tuple(bias[0].shape) != (e_len, n_len) or bias[0].dtype != x.dtype))):
            raise ShapeError(f"{self.name}: ExpertMatMul takes x[T, K] or [T, J, K], w[E, N, K] of x's float type, "
                             f"experts[T, J] (int32/int64) and bias[E, N], got "
                             f"{[(t.dtype, tuple(t.shape)) for t in (x, w, experts, *bias)]}")

        def f(t, j, n):
            raw = Cast(experts[t, j], "int64")
            inside = logical_and(raw >= 0, raw < e_len)
            e = if_then_else(inside, raw, Const(0, "int64"))  # (a read in bounds; the value is 0 below)
            acc = reduce((k_len,), lambda k: (x[t, k] if x.ndim == 2 else x[t, j, k]) * w[e, n, k], "sum")
            if bias:
                acc = acc + bias[0][e, n]
            return if_then_else(inside, acc, Const(0.0, x.dtype))
        return compute("y", (t_len, j_len, n_len), f, dtype=x.dtype)

    def numpy(self, x, w, experts, *bias):
        idx = np.asarray(experts).astype(np.int64)
        xs = np.broadcast_to(x[:, None, :], idx.shape + x.shape[-1:]) if x.ndim == 2 else x
        y = np.zeros(idx.shape + (w.shape[1],), x.dtype)
        for e in np.unique(idx[(idx >= 0) & (idx < w.shape[0])]):  # each chosen expert's slots at once
            at = idx == e
            y[at] = xs[at] @ w[e].T + (bias[0][e] if bias else 0)
        return [y]


class QLinearMatMul(Operator):
    """Quantized matmul: ``y = saturate(round(((a - azp) @ (b - bzp)) * (a_scale * b_scale / y_scale)) + yzp)``.

    Inputs ``a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point`` as in
    ONNX. The int32 accumulator is scaled in float64 (the multiplier is formed in the scales'
    dtype) and rounded half to even.
    """

    def compute(self, a, a_s, azp, b, b_s, bzp, y_s, yzp):
        out, k = _matmul_shapes(self.name, a.shape, b.shape)
        rows, cols = (a.shape[-2] if a.ndim >= 2 else 1), (b.shape[-1] if b.ndim >= 2 else 1)
        for p, what, n in ((a_s, "a_scale", rows), (azp, "a_zero_point", rows), (b_s, "b_scale", cols),
                           (bzp, "b_zero_point", cols), (y_s, "y_scale", 1), (yzp, "y_zero_point", 1)):
            _check_qparam(self.name, p, what, n)
        nbatch = len(out) - (a.ndim >= 2) - (b.ndim >= 2)
        info = np.iinfo(yzp.dtype)

        def f(*i):
            bi, m = i[:nbatch], (i[nbatch:nbatch + 1] if a.ndim >= 2 else ())
            n = i[len(i) - 1:] if b.ndim >= 2 else ()
            acc = reduce((k,), _int_matmul_body(a, b, azp, bzp, out[:nbatch], bi, m, n), "sum")
            mult = _qparam_read(a_s, m[0] if m else 0) * _qparam_read(b_s, n[0] if n else 0) / _qparam_read(y_s, 0)
            v = Cast(acc, "float64") * Cast(mult, "float64") + Cast(_qparam_read(yzp, 0), "float64")
            v = minimum(maximum(UnaryOp("round", v), Const(float(info.min), "float64")),
                        Const(float(info.max), "float64"))
            return Cast(v, yzp.dtype)
        return compute("y", out, f, dtype=yzp.dtype)

    def numpy(self, a, a_s, azp, b, b_s, bzp, y_s, yzp):
        av = a.astype(np.int32) - _qparam_np(azp, True, a.ndim).astype(np.int32)
        bv = b.astype(np.int32) - _qparam_np(bzp, False, b.ndim).astype(np.int32)
        acc = np.matmul(av, bv).astype(np.float64)
        mult = _qparam_np(a_s, True, a.ndim) * _qparam_np(b_s, False, b.ndim) / y_s.reshape(())
        v = acc * mult.astype(np.float64) + yzp.reshape(()).astype(np.float64)
        info = np.iinfo(yzp.dtype)
        return [np.clip(np.rint(v), info.min, info.max).astype(yzp.dtype)]


class Attention(Operator):
    """Scaled dot-product attention (ONNX ``Attention``, opsets 23-25) as one definition.

    Inputs ``q, k, v[, mask][, nonpad_kv_seqlen][, sink]`` (attributes ``has_mask``/``has_nonpad``/
    ``has_sink`` say which optional ones follow). ``q`` is ``[B, Hq, S, D]`` or ``[B, S, Hq*D]``
    (``q_heads``); ``k``/``v`` are ``[B, Hkv, L, D]`` or ``[B, L, Hkv*D]`` (``kv_heads``), already holding any past cache; query head
    ``h`` reads key/value head ``h // (Hq / Hkv)``. Per output element::

        s_j = softcap(sum_d (q*c)[d] * (k*c)[j, d]) + bias_j      (c = ``scale_sqrt``)
        y   = sum_j softmax_j(s) * v[j]                            (0 where every bias_j is -inf)

    ``bias_j`` is the float mask (or 0/-inf of a bool mask; -inf past the mask's last dim), plus
    -inf where ``is_causal`` (``j <= i + offset``), the window (``left_window``/``right_window``,
    -1 = unbounded) or ``nonpad_kv_seqlen`` (``j < nonpad[b]``) exclude ``j``. A ``sink`` ``[Hq]``
    (not ONNX's: onnxruntime's ``head_sink``, gpt-oss's attention sinks) is one more logit per
    head that takes part in the softmax's maximum and sum but weighs no value:
    ``softmax_j(s) = exp(s_j - m) / (sum_k exp(s_k - m) + exp(sink[h] - m))`` with
    ``m = max(max_k s_k, sink[h])``, so the probabilities sum to less than 1. The offset is
    ``past_len``, or ``nonpad[b] - S`` with ``nonpad_kv_seqlen`` and no past. ``softmax_dtype``
    computes the softmax in another dtype. ``qk_mode`` (0-3) adds the ``qk_matmul_output``
    output: the (softcapped) scores, the scores plus bias, or the probabilities.

    Mixed precision (set by :class:`~shardflow.compiler.passes.attention.FuseAttention`, not by
    ONNX): with ``acc_dtype`` (``"float32"``) ``q``, ``k``, ``v`` may be float16/bfloat16; every
    value is computed in ``acc_dtype`` and the score is ``sum_d q[d] * k[j, d] * scale`` (``scale``,
    applied after the sum as a product followed by ``Mul`` computes it). With ``probs_dtype`` the
    probabilities are rounded to that type before they weigh ``v`` (what a tensor-core product
    of half-precision probabilities computes). The output is ``acc_dtype``. ``extra_biases`` (n,
    also set by the pass only) says that n more float inputs follow, additive biases broadcast
    like the mask and added after it one by one (T5 adds its position bias, then the mask:
    ``(s + b1) + b2`` is not ``s + (b1 + b2)`` in floating point). ``y_3d`` (the pass too): the
    output is ``[B, S, Hq*Dv]`` even when ``q`` is 4-D (Llama's Q comes out of the rotary
    embedding in heads, its output goes to the projection merged). ``nonpad_bound`` (the pass
    too): the ``nonpad_kv_seqlen`` input is a bound the extra biases already keep every key at or
    past hidden behind (a static KV cache's mask, ``j <= pos``): it takes no part in the values
    (no diagonal, no empty-row rule); a kernel need not visit the keys past it.
    """

    def _extras(self, extra) -> tuple:
        """``(mask, nonpad, sink, extra_biases)`` of the inputs after ``q, k, v`` (each None when
        absent; ``nonpad`` None too when it is only a bound, ``nonpad_bound``)."""
        a, extra = self.attrs, list(extra)
        mask = extra.pop(0) if a.get("has_mask") else None
        nonpad = extra.pop(0) if a.get("has_nonpad") else None
        sink = extra.pop(0) if a.get("has_sink") else None
        return mask, None if a.get("nonpad_bound") else nonpad, sink, extra[:a.get("extra_biases", 0)]

    def _geometry(self, q, k, v):
        qh, kvh = self.attrs.get("q_heads"), self.attrs.get("kv_heads")

        def split(t, heads, what):
            if t.ndim == 4:
                return t.shape
            if t.ndim != 3 or not heads or t.shape[2] % heads:
                raise ShapeError(f"{self.name}: {what} of shape {t.shape} must be 4-D, or 3-D with a hidden size "
                                 f"divisible by its head count ({heads})")
            return (t.shape[0], heads, t.shape[1], t.shape[2] // heads)
        g = [split(q, qh, "Q"), split(k, kvh, "K"), split(v, kvh, "V")]
        (b, hq, s, d), (bk, hk, lk, dk), (bv, hv, lv, dv) = g
        if not (b == bk == bv) or d != dk or hk != hv or lk != lv or hq % hk:
            raise ShapeError(f"{self.name}: Q/K/V shapes {q.shape}, {k.shape}, {v.shape} are inconsistent "
                             f"(per-head Q{g[0]}, K{g[1]}, V{g[2]}; Q heads must be a multiple of K/V heads)")
        return b, hq, hk, s, lk, d, dv

    @staticmethod
    def _read(t, b, h, j, e, head):
        """Element ``[b, h, j, e]`` of a 4-D tensor or of the 3-D ``[B, L, H*E]`` form."""
        return t[b, h, j, e] if t.ndim == 4 else t[b, j, h * head + e]

    def compute(self, q, k, v, *extra):
        a = self.attrs
        b_, hq, hk, s_len, l_len, d_len, dv = self._geometry(q, k, v)
        rep, acc = hq // hk, a.get("acc_dtype")
        dt = acc or q.dtype
        mask, nonpad, sink, adds = self._extras(extra)  # (a bound the biases imply takes no part in the values)

        def read(t, bi, h, j, e, head):
            x = self._read(t, bi, h, j, e, head)
            return Cast(x, acc) if acc and t.dtype != acc else x
        bias_shape = (b_, hq, s_len, l_len)
        for m in ([mask] if mask is not None else []) + adds:
            if m.ndim > 4 or m.shape[-1] > l_len or broadcast_shape([m.shape[:-1], bias_shape[:-1]],
                                                                   self.name) != bias_shape[:-1]:
                raise ShapeError(f"{self.name}: attn_mask of shape {m.shape} does not broadcast to {bias_shape}")
        if any(m.shape[-1] != l_len or m.dtype != dt for m in adds):
            raise ShapeError(f"{self.name}: the extra biases {[m.shape for m in adds]} must be {dt} with {l_len} keys")
        if nonpad is not None and nonpad.shape != (b_,):
            raise ShapeError(f"{self.name}: nonpad_kv_seqlen has shape {nonpad.shape}, expected ({b_},)")
        if sink is not None and (sink.shape != (hq,) or dtype_kind(sink.dtype) != "f"):
            raise ShapeError(f"{self.name}: the sink must be a float [{hq}] (one logit per query head), got "
                             f"{sink.dtype} {sink.shape}")
        c = Const(a.get("scale_sqrt", 1.0), dt)
        cap, left, right = a.get("softcap", 0.0), a.get("left_window", -1), a.get("right_window", -1)
        neg_inf = Const(-np.inf, dt)

        def kv_head(h):
            return h if rep == 1 else h // rep

        def score(bi, h, i, j):
            if acc:
                dot = reduce((d_len,), lambda e: read(q, bi, h, i, e, d_len) * read(k, bi, kv_head(h), j, e, d_len),
                             "sum") * Const(a["scale"], dt)
            else:
                dot = reduce((d_len,), lambda e: (read(q, bi, h, i, e, d_len) * c)
                             * (read(k, bi, kv_head(h), j, e, d_len) * c), "sum")
            if cap > 0:
                dot = UnaryOp("tanh", dot / Const(cap, dt)) * Const(cap, dt)
            return dot

        def offset(bi):
            if nonpad is not None and not a.get("past_len"):
                return Cast(nonpad[bi], "int64") - s_len
            return as_expr(a.get("past_len", 0))

        def at(m, bi, h, i, j):
            """Element ``(b, h, i, j)`` of ``m`` broadcast to the scores."""
            off = 4 - m.ndim
            pos = (bi, h, i, j)[off:]
            return m[tuple(as_expr(0) if e == 1 and bias_shape[off + n] != 1 else pos[n]
                           for n, e in enumerate(m.shape))]

        def bias(bi, h, i, j):
            """The additive mask at ``(b, h, i, j)``, or None without masking."""
            allowed = []
            val = None
            if mask is not None:
                if mask.shape[-1] < l_len:
                    allowed.append(j < mask.shape[-1])
                if mask.dtype == "bool":
                    allowed.append(at(mask, bi, h, i, j))
                else:
                    val = at(mask, bi, h, i, j)
            if a.get("is_causal"):
                allowed.append(j <= i + offset(bi))
            if left >= 0:
                allowed.append(i + offset(bi) - j <= left)
            if right >= 0:
                allowed.append(j - (i + offset(bi)) <= right)
            if nonpad is not None:
                allowed.append(j < Cast(nonpad[bi], "int64"))
            if not allowed:
                return val
            ok = allowed[0]
            for cond in allowed[1:]:
                ok = logical_and(ok, cond)
            return if_then_else(ok, Const(0, dt) if val is None else val, neg_inf)

        sdt = a.get("softmax_dtype") or dt
        has_bias = (mask is not None or nonpad is not None or bool(a.get("is_causal")) or left >= 0 or right >= 0)

        def logits(bi, h, i, j):
            sc = score(bi, h, i, j)
            bs = bias(bi, h, i, j)
            x = sc if bs is None else sc + bs
            for m in adds:
                x = x + at(m, bi, h, i, j)
            return x

        def probs(bi, h, i):
            """``p(j)``: the guarded softmax over j (in ``softmax_dtype``)."""
            lg = (lambda j: logits(bi, h, i, j)) if sdt == dt else (lambda j: Cast(logits(bi, h, i, j), sdt))
            m = reduce((l_len,), lg, "max")
            sk = None
            if sink is not None:  # one more logit in the maximum and the sum
                sk = sink[h] if sink.dtype == sdt else Cast(sink[h], sdt)
                m = maximum(m, sk)
            den = reduce((l_len,), lambda j: UnaryOp("exp", lg(j) - m), "sum")
            if sk is not None:
                den = den + UnaryOp("exp", sk - m)
            masked = None
            if has_bias:
                masked = eq(reduce((l_len,), lambda j: bias(bi, h, i, j), "max"), neg_inf)

            def p(j):
                v_ = UnaryOp("exp", lg(j) - m) / den
                if masked is not None:
                    v_ = if_then_else(masked, Const(0, sdt), v_)
                v_ = v_ if sdt == dt else Cast(v_, dt)
                if a.get("probs_dtype"):
                    v_ = Cast(Cast(v_, a["probs_dtype"]), dt)
                return v_
            return p

        def y4(bi, h, i, e):
            p = probs(bi, h, i)
            return reduce((l_len,), lambda j: p(j) * read(v, bi, kv_head(h), j, e, dv), "sum")

        if q.ndim == 4 and not a.get("y_3d"):
            y = compute("y", (b_, hq, s_len, dv), y4, dtype=dt)
        else:
            y = compute("y", (b_, s_len, hq * dv), lambda bi, i, ce: y4(bi, ce // dv, i, ce % dv), dtype=dt)
        mode = a.get("qk_mode")
        if mode is None:
            return y

        def qk(bi, h, i, j):
            if mode == 3:
                return probs(bi, h, i)(j)
            if mode == 2:
                return logits(bi, h, i, j)
            return score(bi, h, i, j)
        return [y, compute("qk", bias_shape, qk, dtype=dt)]

    def numpy(self, q, k, v, *extra):
        a = self.attrs
        b_, hq, hk, s_len, l_len, d_len, dv = self._geometry(q, k, v)
        if a.get("acc_dtype"):
            q, k, v = (np.asarray(t).astype(a["acc_dtype"]) for t in (q, k, v))
        dt = q.dtype
        mask, nonpad, sink, adds = self._extras(extra)

        def to4(t, h):
            return t if t.ndim == 4 else t.reshape(t.shape[0], t.shape[1], h, -1).transpose(0, 2, 1, 3)
        q4, k4, v4 = to4(q, hq), to4(k, hk), to4(v, hk)
        if hq != hk:
            k4, v4 = np.repeat(k4, hq // hk, axis=1), np.repeat(v4, hq // hk, axis=1)
        c = dt.type(a.get("scale_sqrt", 1.0))
        with np.errstate(all="ignore"):
            if a.get("acc_dtype"):
                score = np.matmul(q4, np.swapaxes(k4, 2, 3)) * dt.type(a["scale"])
            else:
                score = np.matmul(q4 * c, np.swapaxes(k4 * c, 2, 3))
            cap = a.get("softcap", 0.0)
            if cap > 0:
                score = np.tanh(score / dt.type(cap)) * dt.type(cap)
            allowed = np.ones((1, 1, 1, l_len), bool)
            val = np.zeros((), dt)
            if mask is not None:
                m = mask
                if m.shape[-1] < l_len:
                    pad = [(0, 0)] * (m.ndim - 1) + [(0, l_len - m.shape[-1])]
                    allowed = allowed & np.pad(np.ones(m.shape, bool), pad)
                    m = np.pad(m, pad)
                if m.dtype == bool:
                    allowed = allowed & m
                else:
                    val = m
            i_idx = np.arange(s_len).reshape(-1, 1)
            j_idx = np.arange(l_len).reshape(1, -1)
            off = np.asarray(a.get("past_len", 0)).reshape(1, 1, 1, 1)
            if nonpad is not None and not a.get("past_len"):
                off = (nonpad.astype(np.int64) - s_len).reshape(-1, 1, 1, 1)
            diff = i_idx + off - j_idx
            if a.get("is_causal"):
                allowed = allowed & (diff >= 0)
            if a.get("left_window", -1) >= 0:
                allowed = allowed & (diff <= a["left_window"])
            if a.get("right_window", -1) >= 0:
                allowed = allowed & (-diff <= a["right_window"])
            if nonpad is not None:
                allowed = allowed & (j_idx < nonpad.reshape(-1, 1, 1, 1))
            bias = np.where(allowed, val, dt.type(-np.inf)).astype(dt)
            logits = score + bias
            for m in adds:
                logits = logits + m
            sdt = numpy_type(a.get("softmax_dtype") or str(dt))
            lg = logits.astype(sdt)
            mx = lg.max(axis=-1, keepdims=True)
            den = 0
            if sink is not None:
                sk = np.asarray(sink).astype(sdt).reshape(1, hq, 1, 1)
                mx = np.maximum(mx, sk)
                den = np.exp(sk - mx)
            e = np.exp(lg - mx)
            p = e / (e.sum(axis=-1, keepdims=True) + den)
            masked = np.isneginf(np.broadcast_to(bias, logits.shape).max(axis=-1, keepdims=True))
            p = np.where(masked, sdt.type(0), p).astype(dt)
            if a.get("probs_dtype"):
                p = p.astype(numpy_type(a["probs_dtype"])).astype(dt)
            y = np.matmul(p, v4)
        if q.ndim == 3 or a.get("y_3d"):
            y = y.transpose(0, 2, 1, 3).reshape(b_, s_len, hq * dv)
        mode = a.get("qk_mode")
        if mode is None:
            return [y]
        return [y, {3: p, 2: logits}.get(mode, score).astype(dt)]


class Det(Operator):
    """The determinants of the square matrices ``x[..., M, M]``: shape ``x.shape[:-2]``. No index
    expression factorizes a matrix, so the output is an extern (sharded along the batch axes only);
    the cpu target computes it with a template (LU with partial pivoting)."""

    def compute(self, x: TensorInput):
        if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
            raise ShapeError(f"{self.name}: Det takes square matrices [..., M, M], got shape {x.shape}")
        return extern("y", x.shape[:-2], x.dtype, tuple((0, d) for d in range(x.ndim - 2)),
                      "a determinant (an LU factorization)")

    def numpy(self, x):
        with np.errstate(all="ignore"):
            return [np.asarray(np.linalg.det(x.astype(np.float64)), dtype=x.dtype).reshape(x.shape[:-2])]


def examples(rng: np.random.Generator):
    """Small instances of every op in this module: ``(op class, input arrays, attrs)``."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    u8 = lambda *s: rng.integers(0, 256, s).astype(np.uint8)  # noqa: E731
    i8 = lambda *s: rng.integers(-128, 128, s).astype(np.int8)  # noqa: E731
    bf = lambda *s: f(*s).astype(numpy_type("bfloat16"))  # noqa: E731
    res = [
        (MatMul, [f(3, 4), f(4, 5)], {}),
        (MatMul, [f(2, 1, 3, 4), f(3, 4, 2)], {}),
        (MatMul, [f(4), f(2, 4, 3)], {}),
        (MatMul, [f(2, 3, 4), f(4)], {}),
        (MatMul, [f(4), f(4)], {}),
        (MatMul, [rng.integers(-3, 4, (2, 3)).astype(np.int64), rng.integers(-3, 4, (3, 2)).astype(np.int64)], {}),
        (Gemm, [f(3, 4), f(4, 5)], {}),
        (Gemm, [f(4, 3), f(5, 4), f(5)], {"trans_a": True, "trans_b": True, "alpha": 0.5, "beta": 2.0}),
        (Gemm, [f(3, 4), f(4, 5), f(3, 1)], {"alpha": 1.0, "beta": 1.0}),
        (Gemm, [f(3, 4), f(5, 4), f(1)], {"trans_b": True, "beta": 0.0}),
        (PackedMatMul, [f(3, 4), pack_panels(f(4, 5))], {"n": 5}),
        (PackedMatMul, [f(2, 3, 4), pack_panels(f(4, 40))], {"n": 40}),
        (PackedMatMul, [f(4), pack_panels(f(4, 33))], {"n": 33}),
        (PackedMatMul, [f(3, 4), pack_panels(f(4, 5)), f(5)], {"n": 5, "alpha": 0.5, "beta": 2.0}),
        (PackedMatMul, [f(3, 4), pack_panels(f(4, 64)), f(3, 1)], {"n": 64}),
        (Einsum, [f(2, 3, 4), f(2, 4, 5)], {"equation": "bij,bjk->bik"}),
        (Einsum, [f(3, 3)], {"equation": "ii"}),
        (Einsum, [f(2, 3, 3)], {"equation": "...ii->...i"}),
        (Einsum, [f(3, 4)], {"equation": "ij->ji"}),
        (Einsum, [f(3), f(3)], {"equation": "i,i"}),
        (Einsum, [f(2, 1, 3, 4), f(5, 4, 2)], {"equation": "...ij,...jk"}),
        (Einsum, [f(3, 4), f(4), f(4, 2)], {"equation": "ij,j,jk->ik"}),
        (Einsum, [f(1, 3), f(2, 3)], {"equation": "ij,ij->ij"}),
        (Gemm, [rng.integers(-3, 4, (2, 3)).astype(np.int32), rng.integers(-3, 4, (3, 2)).astype(np.int32),
                rng.integers(-3, 4, (2,)).astype(np.int32)], {"alpha": 2.0, "beta": 3.0}),
        (MatMulInteger, [u8(3, 4), u8(4, 2), np.array(7, np.uint8), np.array([1, 2], np.uint8)], {"has_azp": True}),
        (MatMulInteger, [u8(2, 3, 4), u8(4, 2)], {}),
        (MatMulInteger, [u8(3, 4), u8(4, 2), np.array([5], np.uint8)], {"has_azp": False}),
        (PackedMatMulInteger, [u8(3, 5), *pack_int8_panels(u8(5, 17), np.array(3, np.uint8)), np.array(7, np.uint8)],
         {"n": 17}),
        (PackedMatMulInteger, [i8(2, 3, 9), *pack_int8_panels(i8(9, 4))], {"n": 4}),
        (PackedMatMulBf16, [bf(3, 5), pack_bf16_panels(bf(5, 17))], {"n": 17}),
        (PackedMatMulBf16, [bf(2, 3, 40), pack_bf16_panels(bf(40, 4)), f(4)], {"n": 4, "alpha": 0.5, "beta": 2.0}),
        (PackedMatMulInteger, [i8(9), *pack_int8_panels(u8(9, 33), u8(33)), np.array([-5], np.int8)], {"n": 33}),
        (PackedMatMulInteger, [u8(3, 8), *pack_int8_panels(i8(8, 16), np.array(0, np.int8)), u8(3)], {"n": 16}),
        (MatMulNBits, [f(3, 40), u8(5, 3, 8), f(5, 3), rng.integers(0, 16, (5, 3)).astype(np.float32)],
         {"bits": 4, "block_size": 16}),
        (MatMulNBits, [f(2, 2, 32), u8(4, 2, 4), f(4, 2)], {"bits": 2, "block_size": 16}),
        (GatherBlockQuantized, [u8(6, 20), np.array([[0, 5, -1], [7, 2, -7]], np.int64), f(6, 2),
                                rng.integers(0, 16, (6, 2)).astype(np.float32)], {"bits": 4, "block_size": 32}),
        (GatherBlockQuantized, [u8(5, 8), np.array([4, 0, 4], np.int32), f(5, 2).astype(np.float16)],
         {"bits": 2, "block_size": 16}),
        (GatherBlockQuantized, [u8(3, 17), np.array(2, np.int64), f(3, 2)], {"bits": 8, "block_size": 16}),
        (ExpertMatMul, [f(3, 5), f(4, 6, 5), np.array([[2, 0], [3, 3], [1, 2]], np.int64), f(4, 6)], {}),
        (ExpertMatMul, [f(2, 3, 7), f(5, 4, 7), np.array([[4, 0, 9], [-1, 2, 1]], np.int32)], {}),
        (MatMulNBits, [f(33), u8(3, 3, 16), f(3, 3), rng.integers(0, 256, (3, 3)).astype(np.float32)],
         {"bits": 8, "block_size": 16}),
        (QLinearMatMul, [u8(2, 3, 4), np.array(0.05, np.float32), np.array(3, np.uint8), u8(4, 5),
                         np.array([0.02], np.float32), np.array([7], np.uint8), np.array(0.3, np.float32),
                         np.array(10, np.uint8)], {}),
        (QLinearMatMul, [rng.integers(-128, 128, (3, 4)).astype(np.int8), np.array([0.05, 0.1, 0.2], np.float32),
                         np.array([1, 0, -2], np.int8), rng.integers(-128, 128, (4, 2)).astype(np.int8),
                         np.array(0.02, np.float32), np.array(0, np.int8), np.array(0.01, np.float32),
                         np.array(-3, np.int8)], {}),
    ]
    q4, k4, v4 = f(2, 4, 3, 4), f(2, 2, 5, 4), f(2, 2, 5, 3)
    res += [
        (Attention, [q4, k4, v4], {"scale_sqrt": 0.7}),
        (Attention, [q4, k4, v4, f(3, 5)], {"scale_sqrt": 0.7, "has_mask": True, "is_causal": True, "past_len": 2,
                                            "qk_mode": 2}),
        (Attention, [q4, k4, v4, rng.random((2, 1, 3, 4)) > 0.3, np.array([5, 2], np.int64)],
         {"scale_sqrt": 0.7, "has_mask": True, "has_nonpad": True, "softcap": 2.0, "qk_mode": 3}),
        (Attention, [f(2, 3, 8), f(2, 5, 4), f(2, 5, 6)], {"scale_sqrt": 0.7, "q_heads": 2, "kv_heads": 1,
                                                          "is_causal": True, "left_window": 1, "right_window": 0,
                                                          "qk_mode": 0}),
        # attention sinks (gpt-oss): with a bool mask and a window (the probabilities out), and alone
        (Attention, [q4, k4, v4, rng.random((2, 1, 3, 5)) > 0.3, f(4)],
         {"scale_sqrt": 0.7, "has_mask": True, "has_sink": True, "is_causal": True, "past_len": 2, "left_window": 2,
          "qk_mode": 3}),
        (Attention, [f(2, 3, 8), f(2, 5, 4), f(2, 5, 4), f(2) * 3], {"scale_sqrt": 0.7, "q_heads": 2, "kv_heads": 1,
                                                                   "has_sink": True}),
        (Attention, [q4, k4, v4, (rng.random((1, 5)) > 0.5).reshape(5)],
         {"scale_sqrt": 0.7, "has_mask": True, "softmax_dtype": "float64", "qk_mode": 1}),
        # a key bound (FuseAttention's, from a static cache's mask): no part in the values, causal
        # without moving the diagonal, a row the extra bias hides wholly NaN as without it
        (Attention, [q4, k4, v4, np.array([3, 0], np.int64),
                     np.where(np.arange(5) < [[[[3]]], [[[0]]]], 0.0, -np.inf).astype(np.float32)],
         {"scale_sqrt": 0.7, "has_nonpad": True, "nonpad_bound": True, "extra_biases": 1, "is_causal": True,
          "past_len": 2}),
        # the mixed-precision form: half Q/K/V (3-D here), float32 mask/output
        (Attention, [f(2, 3, 32).astype(np.float16), f(2, 5, 32).astype(np.float16), f(2, 5, 32).astype(np.float16),
                     np.where(rng.random((2, 1, 3, 5)) > 0.3, 0, -3.4e38).astype(np.float32)],
         {"scale_sqrt": 0.5, "scale": 0.25, "q_heads": 2, "kv_heads": 2, "has_mask": True, "acc_dtype": "float32",
          "probs_dtype": "float16"}),
        # T5's as FuseAttention makes it: unscaled, a position bias [1, H, S, L] then a mask
        # [B, 1, 1, L] added after it, both as extra biases (no mask rule)
        (Attention, [f(2, 2, 3, 16).astype(np.float16), f(2, 2, 5, 16).astype(np.float16),
                     f(2, 2, 5, 16).astype(np.float16), f(1, 2, 3, 5),
                     np.where(rng.random((2, 1, 1, 5)) > 0.3, 0, -3.4e38).astype(np.float32)],
         {"scale": 1.0, "extra_biases": 2, "acc_dtype": "float32", "probs_dtype": "float16"}),
    ]
    res += [(Det, [f(3, 3)], {}), (Det, [f(2, 4, 4)], {}), (Det, [np.ones((2, 2, 2), np.float32)], {})]
    # rows 3..6 of a 9-row quantized table (a rank of a vocab-parallel embedding): 8, 1 and -7 read zeros
    res.append((GatherBlockQuantized, [u8(4, 20), np.array([[3, 8, -3], [1, 6, -7]], np.int64), f(4, 2),
                                       rng.integers(0, 16, (4, 2)).astype(np.float32)],
                {"bits": 4, "block_size": 32, "start": 3, "extent": 9}))
    # a tied table's rows read as its product's weight's columns: from float32 panels (37 rows, a partial last
    # panel, negative indices), from bfloat16 panels of a width padded to 32, from a plain float16 weight, and
    # a rank's rows 16..35 of 50 (49 and -5 read zeros)
    res += [(GatherColumns, [pack_panels(f(6, 37)), np.array([[0, 36, -1], [17, 5, -37]], np.int64)],
             {"n": 37, "d": 6}),
            (GatherColumns, [pack_bf16_panels(bf(40, 20)), np.array([19, 0, -20, 3], np.int32)], {"n": 20, "d": 40}),
            (GatherColumns, [f(5, 9).astype(np.float16), np.array([[8, -9], [2, 2]], np.int64)], {"n": 9, "d": 5}),
            (GatherColumns, [pack_panels(f(4, 20)), np.array([[16, 35, 20], [49, -5, -34]], np.int64)],
             {"n": 20, "d": 4, "start": 16, "extent": 50})]
    # float16 panels of a float32 product (37 columns: a partial last panel), with Gemm's scales and bias
    res += [(PackedMatMul, [f(3, 5), pack_panels(f(5, 37).astype(np.float16))], {"n": 37}),
            (PackedMatMul, [f(2, 3, 20), pack_panels(f(20, 16).astype(np.float16)), f(16)],
             {"n": 16, "alpha": 0.5, "beta": 2.0})]
    # a bfloat16 product rounded to bfloat16 as it stores (a bfloat16 model's), with a bias; 17 columns
    res += [(PackedMatMulBf16, [bf(2, 3, 40), pack_bf16_panels(bf(40, 17)), f(17)], {"n": 17, "to": "bfloat16"})]
    # float32 operands with their probabilities rounded to a half type (FuseAttention at precision bfloat16 or
    # float16 on the cpu target): 3-D heads, causal past 3 keys, a mask as the extra bias; 4-D grouped heads
    # with two extra biases
    res += [(Attention, [f(2, 6, 32), f(2, 9, 32), f(2, 9, 32),
                         np.where(rng.random((2, 1, 6, 9)) > 0.2, 0, -3.4e38).astype(np.float32)],
             {"scale": 0.25, "q_heads": 2, "kv_heads": 2, "extra_biases": 1, "is_causal": True, "past_len": 3,
              "acc_dtype": "float32", "probs_dtype": "bfloat16"}),
            (Attention, [q4, k4, v4, f(1, 4, 3, 5), np.where(rng.random((2, 1, 1, 5)) > 0.3, 0, -3.4e38).astype(
                np.float32)], {"scale": 0.5, "extra_biases": 2, "acc_dtype": "float32", "probs_dtype": "float16"})]
    return res
