"""Normalizations: layer, RMS, batch (inference), instance, group, Lp, mean-variance, LRN.

Statistics are computed in a *stash* dtype (``stash``, float32 by default for the ONNX ops that
have ``stash_type``) and the normalized value is cast back to the input dtype before the affine
scale and bias, as the ONNX function bodies do. Variances are two-pass (``mean((x - mean)^2)``)
except in :class:`MeanVarianceNorm`, whose ONNX definition is ``E[x^2] - E[x]^2``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..errors import ShapeError
from ..ir.expr import Cast, Const, Expr, UnaryOp, eq, if_then_else, logical_and
from ..ir.graph import Operator
from ..ir.task import TensorInput, compute, reduce
from .elementwise import broadcast_read, broadcast_shape
from .reduce import with_axes

__all__ = ["LayerNorm", "RMSNorm", "BatchNorm", "InstanceNorm", "GroupNorm", "LpNorm", "MeanVarianceNorm", "LRN"]


def _cast(e: Expr, src: str, dst: str) -> Expr:
    return e if src == dst else Cast(e, dst)


def _moments(read: Callable[[Sequence[Expr]], Expr], ext: Sequence[int]) -> tuple[Expr, Expr]:
    """Mean and two-pass variance of ``read(k)`` over ``k`` in ``ext``."""
    mean = reduce(ext, lambda *k: read(k), "mean")

    def sq_dev(*k):
        d = read(k) - mean
        return d * d

    return mean, reduce(ext, sq_dev, "mean")


def _np_moments(x: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    mean = np.mean(x, axis=axes, keepdims=True)
    d = x - mean
    return mean, np.mean(d * d, axis=axes, keepdims=True)


def _check_broadcast(name: str, what: str, t: TensorInput, shape: tuple[int, ...]) -> None:
    if broadcast_shape([shape, t.shape], name) != shape:
        raise ShapeError(f"{name}: {what} of shape {t.shape} does not broadcast to the input shape {shape}")


class LayerNorm(Operator):
    """``(x - mean) / sqrt(var + epsilon) * scale + bias`` with statistics over the axes from
    ``axis`` on, computed in ``stash``. With ``stats`` the mean and ``1/sqrt(var + epsilon)``
    (shape ``x.shape[:axis] + (1,)*...``, dtype ``stash``) are two more outputs."""

    def compute(self, x: TensorInput, scale: TensorInput, bias: TensorInput | None = None):
        axis, eps, st = self.attrs["axis"], self.attrs["epsilon"], self.attrs["stash"]
        xdt, ext = x.dtype, x.shape[axis:]
        for what, t in (("scale", scale), ("bias", bias)):
            if t is not None:
                _check_broadcast(self.name, what, t, x.shape)
        xs = lambda idx: _cast(x[tuple(idx)], xdt, st)  # noqa: E731

        def moments(i):
            return _moments(lambda k: xs(tuple(i[:axis]) + tuple(k)), ext)

        def y(*i):
            mean, var = moments(i)
            v = _cast((xs(i) - mean) * UnaryOp("rsqrt", var + Const(eps, st)), st, xdt)
            v = v * broadcast_read(scale, x.shape, i)
            return v + broadcast_read(bias, x.shape, i) if bias is not None else v

        outs = [compute("y", x.shape, y, dtype=xdt)]
        if self.attrs.get("stats", False):
            sshape = x.shape[:axis] + (1,) * len(ext)
            outs.append(compute("mean", sshape, lambda *i: moments(i)[0], dtype=st))
            outs.append(compute("inv_std_dev", sshape,
                                lambda *i: UnaryOp("rsqrt", moments(i)[1] + Const(eps, st)), dtype=st))
        return outs

    def numpy(self, x, scale, bias=None):
        axis, st = self.attrs["axis"], np.dtype(self.attrs["stash"])
        with np.errstate(all="ignore"):
            xs = x.astype(st, copy=False)
            mean, var = _np_moments(xs, tuple(range(axis, x.ndim)))
            inv = 1 / np.sqrt(var + st.type(self.attrs["epsilon"]))
            y = ((xs - mean) * inv).astype(x.dtype) * scale
            if bias is not None:
                y = y + bias
        if self.attrs.get("stats", False):
            return [y, mean, inv]
        return [y]


class RMSNorm(Operator):
    """``x / sqrt(mean(x^2) + epsilon) * scale`` over the axes from ``axis`` on, computed in
    ``stash``."""

    def compute(self, x: TensorInput, scale: TensorInput):
        axis, eps, st = self.attrs["axis"], self.attrs["epsilon"], self.attrs["stash"]
        xdt, ext = x.dtype, x.shape[axis:]
        _check_broadcast(self.name, "scale", scale, x.shape)
        xs = lambda idx: _cast(x[tuple(idx)], xdt, st)  # noqa: E731

        def y(*i):
            def sq(*k):
                v = xs(tuple(i[:axis]) + k)
                return v * v
            ms = reduce(ext, sq, "mean")
            return _cast(xs(i) * UnaryOp("rsqrt", ms + Const(eps, st)), st, xdt) * broadcast_read(scale, x.shape, i)

        return compute("y", x.shape, y, dtype=xdt)

    def numpy(self, x, scale):
        axis, st = self.attrs["axis"], np.dtype(self.attrs["stash"])
        with np.errstate(all="ignore"):
            xs = x.astype(st, copy=False)
            ms = np.mean(xs * xs, axis=tuple(range(axis, x.ndim)), keepdims=True)
            y = (xs / np.sqrt(ms + st.type(self.attrs["epsilon"]))).astype(x.dtype) * scale
        return [y]


class BatchNorm(Operator):
    """Inference batch normalization: ``(x - mean) * (scale / sqrt(var + epsilon)) + bias``.

    The parameters are indexed by the input dims from 1 on (shape ``(C,)``, or ``x.shape[1:]`` for
    the per-activation form of old opsets) and the arithmetic is done in their promoted dtype.
    """

    injective = True

    def compute(self, x: TensorInput, scale: TensorInput, bias: TensorInput, mean: TensorInput, var: TensorInput):
        eps = self.attrs["epsilon"]
        params = (scale, bias, mean, var)
        for what, t in zip(("scale", "bias", "mean", "var"), params):
            if t.ndim < 1 or t.shape != x.shape[1:1 + t.ndim]:
                raise ShapeError(f"{self.name}: {what} of shape {t.shape} does not match the channel dims of the "
                                 f"input shape {x.shape}")
        cdt = str(np.result_type(*(t.dtype for t in (x,) + params)))

        def y(*i):
            s, b, m, v = (_cast(t[tuple(i[1:1 + t.ndim])], t.dtype, cdt) for t in params)
            # (x - mean) times a per-channel factor: a kernel computes the factor once per channel
            r = (_cast(x[i], x.dtype, cdt) - m) * (s / UnaryOp("sqrt", v + Const(eps, cdt))) + b
            return _cast(r, cdt, x.dtype)

        return compute("y", x.shape, y, dtype=x.dtype)

    def numpy(self, x, scale, bias, mean, var):
        def p(t):
            return t.reshape(t.shape + (1,) * (x.ndim - 1 - t.ndim))

        cdt = np.result_type(x, scale, bias, mean, var)
        with np.errstate(all="ignore"):
            y = (x.astype(cdt) - p(mean)) * (p(scale) / np.sqrt(p(var) + cdt.type(self.attrs["epsilon"]))) + p(bias)
        return [y.astype(x.dtype, copy=False)]


class InstanceNorm(Operator):
    """``scale[c] * (x - mean) / sqrt(var + epsilon) + bias[c]`` with statistics over the spatial
    dims (2 on) of each instance and channel."""

    def compute(self, x: TensorInput, scale: TensorInput, bias: TensorInput):
        eps = self.attrs["epsilon"]
        if x.ndim < 3 or scale.shape != (x.shape[1],) or bias.shape != (x.shape[1],):
            raise ShapeError(f"{self.name}: needs an input (N, C, D1, ...) and scale, bias of shape (C,); got "
                             f"{x.shape}, {scale.shape}, {bias.shape}")
        ext = x.shape[2:]

        def y(*i):
            mean, var = _moments(lambda k: x[tuple(i[:2]) + tuple(k)], ext)
            return scale[i[1]] * (x[i] - mean) / UnaryOp("sqrt", var + Const(eps, x.dtype)) + bias[i[1]]

        return compute("y", x.shape, y, dtype=x.dtype)

    def numpy(self, x, scale, bias):
        ones = (1,) * (x.ndim - 2)
        with np.errstate(all="ignore"):
            mean, var = _np_moments(x, tuple(range(2, x.ndim)))
            y = scale.reshape(-1, *ones) * (x - mean) / np.sqrt(var + x.dtype.type(self.attrs["epsilon"])) \
                + bias.reshape(-1, *ones)
        return [y.astype(x.dtype, copy=False)]


class GroupNorm(Operator):
    """Normalize each of ``groups`` groups of consecutive channels (with the spatial dims) of
    every instance, computed in ``stash``; then ``* scale + bias``, indexed per channel
    (``per_channel``, opset 21) or per group (opset 18)."""

    def compute(self, x: TensorInput, scale: TensorInput, bias: TensorInput):
        groups, eps, st, per_ch = (self.attrs["groups"], self.attrs["epsilon"], self.attrs["stash"],
                                   bool(self.attrs["per_channel"]))
        if x.ndim < 2 or groups < 1 or x.shape[1] % groups:
            raise ShapeError(f"{self.name}: {x.shape[1] if x.ndim > 1 else 'no'} channels cannot be split into "
                             f"{groups} groups")
        c, xdt = x.shape[1], x.dtype
        cpg = c // groups
        want = (c,) if per_ch else (groups,)
        if scale.shape != want or bias.shape != want:
            raise ShapeError(f"{self.name}: scale and bias must have shape {want}, got {scale.shape}, {bias.shape}")
        ext = (cpg,) + x.shape[2:]
        xs = lambda idx: _cast(x[tuple(idx)], xdt, st)  # noqa: E731

        def y(*i):
            first = i[1] if cpg == 1 else (i[1] // cpg) * cpg
            mean, var = _moments(lambda k: xs((i[0], first + k[0]) + tuple(k[1:])), ext)
            v = _cast((xs(i) - mean) * UnaryOp("rsqrt", var + Const(eps, st)), st, xdt)
            p = i[1] if per_ch or cpg == 1 else i[1] // cpg
            return v * scale[p] + bias[p]

        return compute("y", x.shape, y, dtype=xdt)

    def numpy(self, x, scale, bias):
        groups, st = self.attrs["groups"], np.dtype(self.attrs["stash"])
        n, c = x.shape[:2]
        g = x.astype(st, copy=False).reshape((n, groups, x.size // max(n * groups, 1)))
        with np.errstate(all="ignore"):
            mean, var = _np_moments(g, (2,))
            v = ((g - mean) / np.sqrt(var + st.type(self.attrs["epsilon"]))).reshape(x.shape).astype(x.dtype)
            if not self.attrs["per_channel"]:
                scale, bias = np.repeat(scale, c // groups), np.repeat(bias, c // groups)
            ones = (1,) * (x.ndim - 2)
            y = v * scale.reshape(-1, *ones) + bias.reshape(-1, *ones)
        return [y.astype(x.dtype, copy=False)]


class LpNorm(Operator):
    """``x / ||x||_p`` along ``axis`` (``p`` is 1 or 2); 0 where the norm is 0."""

    def compute(self, x: TensorInput):
        axis, p, dt = self.attrs["axis"], self.attrs["p"], x.dtype
        n = x.shape[axis]

        def y(*i):
            def term(k):
                v = x[with_axes(i, (axis,), (k,))]
                return v * v if p == 2 else UnaryOp("abs", v)
            s = reduce((n,), term, "sum")
            norm = UnaryOp("sqrt", s) if p == 2 else s
            return if_then_else(eq(norm, Const(0, dt)), Const(0, dt), x[i] / norm)

        return compute("y", x.shape, y, dtype=dt)

    def numpy(self, x):
        axis, p = self.attrs["axis"], self.attrs["p"]
        with np.errstate(all="ignore"):
            if p == 2:
                norm = np.sqrt(np.sum(x * x, axis=axis, keepdims=True))
            else:
                norm = np.sum(np.abs(x), axis=axis, keepdims=True)
            y = np.where(norm == 0, np.zeros((), x.dtype), x / norm)
        return [y.astype(x.dtype, copy=False)]


class MeanVarianceNorm(Operator):
    """``(x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9)`` with expectations over ``axes``."""

    EPSILON = 1e-9

    def compute(self, x: TensorInput):
        axes, dt = tuple(self.attrs["axes"]), x.dtype
        ext = tuple(x.shape[a] for a in axes)

        def y(*i):
            at = lambda k: x[with_axes(i, axes, k)]  # noqa: E731
            mean = reduce(ext, lambda *k: at(k), "mean")

            def sq(*k):
                v = at(k)
                return v * v
            var = reduce(ext, sq, "mean") - mean * mean
            return (x[i] - mean) / (UnaryOp("sqrt", var) + Const(self.EPSILON, dt))

        return compute("y", x.shape, y, dtype=dt)

    def numpy(self, x):
        axes = tuple(self.attrs["axes"])
        with np.errstate(all="ignore"):
            mean = np.mean(x, axis=axes, keepdims=True)
            var = np.mean(x * x, axis=axes, keepdims=True) - mean * mean
            y = (x - mean) / (np.sqrt(var) + x.dtype.type(self.EPSILON))
        return [y.astype(x.dtype, copy=False)]


class LRN(Operator):
    """Local response normalization across channels (dim 1):
    ``x / (bias + alpha/size * sum of x^2 over the window)^beta``; the window of channel ``c``
    is ``[c - floor((size-1)/2), c + ceil((size-1)/2)]`` clipped to the channels."""

    def compute(self, x: TensorInput):
        size, dt = self.attrs["size"], x.dtype
        c, lo = x.shape[1], (self.attrs["size"] - 1) // 2
        alpha, beta, bias = (Const(v, dt) for v in (self.attrs["alpha"] / size, self.attrs["beta"], self.attrs["bias"]))

        def y(*i):
            def body(k):
                j = i[1] - lo + k if lo else i[1] + k
                v = x[with_axes(i, (1,), (j,))]
                return if_then_else(logical_and(j >= 0, j < c), v * v, Const(0, dt))
            ss = reduce((size,), body, "sum")
            return x[i] / (bias + alpha * ss) ** beta

        return compute("y", x.shape, y, dtype=dt)

    def numpy(self, x):
        size = self.attrs["size"]
        c, lo = x.shape[1], (size - 1) // 2
        sq = x * x
        ss = np.zeros_like(x)
        for k in range(size):
            off = k - lo  # window element c + off
            if abs(off) >= c:
                continue
            dst = [slice(None)] * x.ndim
            src = [slice(None)] * x.ndim
            dst[1] = slice(max(0, -off), c - max(0, off))
            src[1] = slice(max(0, off), c + min(0, off))
            ss[tuple(dst)] += sq[tuple(src)]
        t = x.dtype.type
        with np.errstate(all="ignore"):
            y = x / (t(self.attrs["bias"]) + t(self.attrs["alpha"] / size) * ss) ** t(self.attrs["beta"])
        return [y.astype(x.dtype, copy=False)]


def examples(rng: np.random.Generator):
    """Small instances of every op in this module: ``(op class, input arrays, attrs)``."""
    x = rng.standard_normal((2, 4, 3)).astype(np.float32)
    x16 = rng.standard_normal((2, 5)).astype(np.float16)
    w, b = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((3,)).astype(np.float32)
    c = rng.standard_normal((4,)).astype(np.float32)
    var = (np.abs(c) + 0.5).astype(np.float32)
    g = rng.standard_normal((2,)).astype(np.float32)
    return [
        (LayerNorm, [x, w, w], {"axis": 1, "epsilon": 1e-5, "stash": "float32", "stats": True}),
        (LayerNorm, [x, b], {"axis": 2, "epsilon": 1e-3, "stash": "float32"}),
        (LayerNorm, [x16, x16[0]], {"axis": 1, "epsilon": 1e-5, "stash": "float32", "stats": True}),
        (RMSNorm, [x, b], {"axis": 2, "epsilon": 1e-5, "stash": "float32"}),
        (RMSNorm, [x, w], {"axis": 1, "epsilon": 1e-2, "stash": "float64"}),
        (BatchNorm, [x, c, c, c, var], {"epsilon": 1e-5}),
        (BatchNorm, [x, w, w, w, np.abs(w)], {"epsilon": 1e-3}),
        (BatchNorm, [x.astype(np.float16), c, c, c.astype(np.float64), var], {"epsilon": 1e-5}),
        (InstanceNorm, [x, c, c], {"epsilon": 1e-5}),
        (GroupNorm, [x, c, c], {"groups": 2, "epsilon": 1e-5, "stash": "float32", "per_channel": True}),
        (GroupNorm, [x, g, g], {"groups": 2, "epsilon": 1e-5, "stash": "float32", "per_channel": False}),
        (GroupNorm, [x, c, c], {"groups": 4, "epsilon": 1e-5, "stash": "float64", "per_channel": False}),
        (LpNorm, [x], {"axis": 1, "p": 2}), (LpNorm, [x], {"axis": 2, "p": 1}),
        (LpNorm, [np.zeros((2, 3), np.float32)], {"axis": 1, "p": 2}),
        (MeanVarianceNorm, [x], {"axes": (0, 2)}), (MeanVarianceNorm, [x], {"axes": (2,)}),
        (LRN, [x], {"size": 3, "alpha": 1e-2, "beta": 0.75, "bias": 1.0}),
        (LRN, [x], {"size": 2, "alpha": 0.5, "beta": 0.5, "bias": 2.0}),
        (LRN, [x], {"size": 1, "alpha": 0.5, "beta": 0.5, "bias": 2.0}),
    ]
