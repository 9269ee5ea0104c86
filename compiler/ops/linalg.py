"""Linear algebra: MatMul (numpy semantics), Gemm, Einsum and the integer/quantized matmuls.

Every definition here is one reduction over the contracted index (``K`` of a matmul, the summed
labels of an einsum) with the batch dims read under numpy broadcasting, so the planner sees the
batch and ``M``/``N`` axes as spatial and ``K`` as the reduction (a ``Partial`` when split).
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..ir.expr import Cast, Const, Expr, UnaryOp, as_expr, maximum, minimum
from ..ir.graph import Operator
from ..ir.task import TensorInput, compute, reduce
from .elementwise import broadcast_shape

__all__ = ["MatMul", "Gemm", "Einsum", "MatMulInteger", "QLinearMatMul", "parse_einsum"]


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

        def f(i, j):
            acc = reduce((k,), lambda kk: (a[kk, i] if ta else a[i, kk]) * (b[j, kk] if tb else b[kk, j]), "sum")
            if alpha != 1:
                acc = Const(alpha, dt) * acc
            if c and beta != 0:
                off = 2 - c[0].ndim
                ax = (i, j)[off:]
                bias = c[0][tuple(as_expr(0) if e == 1 and shape[off + d] != 1 else ax[d]
                                  for d, e in enumerate(c[0].shape))]
                acc = acc + (bias if beta == 1 else Const(beta, dt) * bias)
            return acc
        return compute("y", shape, f, dtype=dt)

    def numpy(self, a, b, *c):
        a = a.T if self.attrs.get("trans_a", False) else a
        b = b.T if self.attrs.get("trans_b", False) else b
        alpha, beta = self.attrs.get("alpha", 1.0), self.attrs.get("beta", 1.0)
        y = np.matmul(a, b)
        if alpha != 1:
            y = np.asarray(alpha, a.dtype) * y
        if c and beta != 0:
            y = y + (c[0] if beta == 1 else np.asarray(beta, a.dtype) * c[0])
        return [np.asarray(y, a.dtype)]


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
        for lab, ext in zip(labels, s):
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
        return [np.asarray(np.einsum(norm, *xs, optimize=len(xs) > 1), xs[0].dtype)]


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


def examples(rng: np.random.Generator):
    """Small instances of every op in this module: ``(op class, input arrays, attrs)``."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    u8 = lambda *s: rng.integers(0, 256, s).astype(np.uint8)  # noqa: E731
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
        (Einsum, [f(2, 3, 4), f(2, 4, 5)], {"equation": "bij,bjk->bik"}),
        (Einsum, [f(3, 3)], {"equation": "ii"}),
        (Einsum, [f(2, 3, 3)], {"equation": "...ii->...i"}),
        (Einsum, [f(3, 4)], {"equation": "ij->ji"}),
        (Einsum, [f(3), f(3)], {"equation": "i,i"}),
        (Einsum, [f(2, 1, 3, 4), f(5, 4, 2)], {"equation": "...ij,...jk"}),
        (Einsum, [f(3, 4), f(4), f(4, 2)], {"equation": "ij,j,jk->ik"}),
        (MatMulInteger, [u8(3, 4), u8(4, 2), np.array(7, np.uint8), np.array([1, 2], np.uint8)], {"has_azp": True}),
        (MatMulInteger, [u8(2, 3, 4), u8(4, 2)], {}),
        (MatMulInteger, [u8(3, 4), u8(4, 2), np.array([5], np.uint8)], {"has_azp": False}),
        (QLinearMatMul, [u8(2, 3, 4), np.array(0.05, np.float32), np.array(3, np.uint8), u8(4, 5),
                         np.array([0.02], np.float32), np.array([7], np.uint8), np.array(0.3, np.float32),
                         np.array(10, np.uint8)], {}),
        (QLinearMatMul, [rng.integers(-128, 128, (3, 4)).astype(np.int8), np.array([0.05, 0.1, 0.2], np.float32),
                         np.array([1, 0, -2], np.int8), rng.integers(-128, 128, (4, 2)).astype(np.int8),
                         np.array(0.02, np.float32), np.array(0, np.int8), np.array(0.01, np.float32),
                         np.array(-3, np.int8)], {}),
    ]
    return res
