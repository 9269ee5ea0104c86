"""Reductions, arg-reductions, the softmax family, cumulative sums and products, and top-k.

A plain reduction (sum, mean, max, min, prod, sum of squares, L1) has its ``reduce`` node as the
whole output value, so the planner can recognise a partial result when a reduced axis is split.
Composite ones (L2, log-sum, log-sum-exp, softmax) wrap or nest reductions; their reduced axes
stay whole on one rank.
"""
from __future__ import annotations

import math
from typing import ClassVar, Sequence

import numpy as np

from ..errors import ShapeError
from ..ir.expr import Cast, Const, Expr, UnaryOp, dtype_kind, eq, if_then_else, sum_type
from ..ir.graph import Operator
from ..ir.task import TensorInput, compute, extern, reduce

__all__ = ["Reduce", "ArgReduce", "Softmax", "Hardmax", "CumSum", "CumProd", "TopK", "REDUCE_KINDS", "with_axes",
           "reduced_shape"]

#: Reduction kinds of :class:`Reduce`.
REDUCE_KINDS = ("sum", "mean", "max", "min", "prod", "sum_square", "l1", "l2", "log_sum", "log_sum_exp")


def with_axes(index: Sequence[Expr], axes: Sequence[int], values: Sequence[Expr]) -> tuple[Expr, ...]:
    """``index`` with the entries at ``axes`` replaced by ``values`` (in order)."""
    res = list(index)
    for a, v in zip(axes, values):
        res[a] = v
    return tuple(res)


def reduced_shape(shape: Sequence[int], axes: Sequence[int], keepdims: bool) -> tuple[int, ...]:
    """The shape left after reducing ``axes`` of ``shape`` (kept as 1s with ``keepdims``)."""
    if keepdims:
        return tuple(1 if d in axes else n for d, n in enumerate(shape))
    return tuple(n for d, n in enumerate(shape) if d not in axes)


def _input_index(rank: int, axes: Sequence[int], keepdims: bool, out: Sequence[Expr],
                 k: Sequence[Expr]) -> tuple[Expr, ...]:
    """Index of the input element read at output position ``out`` and reduction position ``k``."""
    idx, kit, pos = [], iter(k), 0
    for d in range(rank):
        if d in axes:
            idx.append(next(kit))
            pos += keepdims
        else:
            idx.append(out[pos])
            pos += 1
    return tuple(idx)


def _is_int(dtype: str) -> bool:
    return dtype_kind(dtype) in "iub"


def _float_fn(fn: str, e: Expr, dtype: str) -> Expr:
    """``fn(e)``; integer values go through float64 and are truncated back (ONNX reference)."""
    if _is_int(dtype):
        return Cast(UnaryOp(fn, Cast(e, "float64")), dtype)
    return UnaryOp(fn, e)


def _empty_value(kind: str, dtype: str):
    """The value of a reduction over an empty set (ONNX reference / onnxruntime)."""
    k = dtype_kind(dtype)
    if kind in ("max", "min"):
        if k == "b":
            return kind == "min"
        if k in "iu":
            info = np.iinfo(dtype)
            return int(info.min if kind == "max" else info.max)
        return -math.inf if kind == "max" else math.inf
    if kind == "prod":
        return 1
    if kind in ("log_sum", "log_sum_exp"):
        return -math.inf
    if kind == "mean":
        return 0 if k in "iu" else math.nan
    return 0


class Reduce(Operator):
    """Reduce ``axes`` (sorted, non-negative) of ``x`` with ``kind`` (one of :data:`REDUCE_KINDS`).

    ``keepdims`` keeps the reduced axes as 1s. Empty ``axes`` reduce nothing but still apply the
    kind's element function (``l2`` gives ``|x|``), as ONNX's ``noop_with_empty_axes`` does.
    """

    def compute(self, x: TensorInput):
        kind, axes, keepdims = self.attrs["kind"], tuple(self.attrs["axes"]), bool(self.attrs["keepdims"])
        dt = x.dtype
        shape = reduced_shape(x.shape, axes, keepdims)
        ext = tuple(x.shape[a] for a in axes)
        if 0 in ext:
            value = Const(_empty_value(kind, dt), dt)
            return compute("y", shape, lambda *i: value, dtype=dt)

        def f(*i):
            def red(elem, op):
                if not axes:
                    return elem(x[_input_index(x.ndim, axes, keepdims, i, ())])
                return reduce(ext, lambda *k: elem(x[_input_index(x.ndim, axes, keepdims, i, k)]), op)

            ident = lambda v: v  # noqa: E731
            if kind in ("sum", "mean", "max", "min", "prod"):
                return red(ident, kind)
            if kind == "sum_square":
                return red(lambda v: v * v, "sum")
            if kind == "l1":
                return red(lambda v: UnaryOp("abs", v), "sum")
            if kind == "l2":
                return _float_fn("sqrt", red(lambda v: v * v, "sum"), dt)
            if kind == "log_sum":
                return UnaryOp("log", red(ident, "sum"))
            # log_sum_exp, shifted by the maximum; an infinite maximum is not subtracted
            m = red(ident, "max")
            shift = if_then_else(UnaryOp("isinf", m), Const(0, dt), m)
            return shift + UnaryOp("log", red(lambda v: UnaryOp("exp", v - shift), "sum"))

        return compute("y", shape, f, dtype=dt)

    def numpy(self, x):
        kind, axes = self.attrs["kind"], tuple(self.attrs["axes"])
        shape = self.outputs[0].shape
        if any(x.shape[a] == 0 for a in axes):
            return [np.full(shape, _empty_value(kind, x.dtype.name), x.dtype)]
        kw = {"axis": axes, "keepdims": True}
        # half values summed (and multiplied) in float32, rounded once (numpy's own float16
        # reduction along a leading axis rounds every partial sum)
        wide = sum_type(x.dtype) != x.dtype
        if wide:
            kw["dtype"] = sum_type(x.dtype)
        with np.errstate(all="ignore"):
            if kind in ("max", "min"):
                r = getattr(np, kind)(x, axis=axes, keepdims=True)
            elif kind in ("sum", "mean", "prod"):
                r = getattr(np, kind)(x, **kw)
            elif kind == "sum_square":  # (the products of half values exact in float32)
                r = np.sum(np.square(x, dtype=np.float32) if wide else x * x, **kw)
            elif kind == "l1":
                r = np.sum(np.abs(x), **kw)
            elif kind == "l2":
                s = np.sum(np.square(x, dtype=np.float32) if wide else x * x, **kw)
                r = np.sqrt(s.astype(np.float64) if _is_int(x.dtype.name) else s.astype(x.dtype))
            elif kind == "log_sum":
                r = np.log(np.sum(x, **kw).astype(x.dtype))
            else:
                m = np.max(x, axis=axes, keepdims=True)
                shift = np.where(np.isinf(m), np.zeros((), x.dtype), m)
                r = shift + np.log(np.sum(np.exp(x - shift), **kw).astype(x.dtype))
        return [np.asarray(r).astype(x.dtype, copy=False).reshape(shape)]


class ArgReduce(Operator):
    """Index (int64) of the first maximum (``kind="argmax"``) or minimum (``"argmin"``) along
    ``axis``; the last one with ``select_last``."""

    def compute(self, x: TensorInput):
        kind, axis, keepdims = self.attrs["kind"], self.attrs["axis"], bool(self.attrs["keepdims"])
        last = bool(self.attrs.get("select_last", False))
        n = x.shape[axis]
        if n == 0:
            raise ShapeError(f"{self.name}: {kind} over axis {axis} of extent 0")
        shape = reduced_shape(x.shape, (axis,), keepdims)

        def f(*i):
            if last:
                r = reduce((n,), lambda k: x[_input_index(x.ndim, (axis,), keepdims, i, (n - 1 - k,))], kind)
                return Const(n - 1) - r
            return reduce((n,), lambda k: x[_input_index(x.ndim, (axis,), keepdims, i, (k,))], kind)

        return compute("y", shape, f, dtype="int64")

    def numpy(self, x):
        kind, axis = self.attrs["kind"], self.attrs["axis"]
        fn = np.argmax if kind == "argmax" else np.argmin
        if self.attrs.get("select_last", False):
            r = x.shape[axis] - 1 - fn(np.flip(x, axis), axis=axis, keepdims=True)
        else:
            r = fn(x, axis=axis, keepdims=True)
        return [r.astype(np.int64).reshape(self.outputs[0].shape)]


class Softmax(Operator):
    """``exp(x - max) / sum(exp(x - max))`` over ``axes`` jointly; ``log`` gives log-softmax.

    ``axes`` is one axis (opset 13+) or the trailing axes from ``axis`` on (the 2-D coercion of
    earlier opsets).
    """

    def compute(self, x: TensorInput):
        axes, log = tuple(self.attrs["axes"]), bool(self.attrs.get("log", False))
        ext = tuple(x.shape[a] for a in axes)

        def f(*i):
            at = lambda k: x[with_axes(i, axes, k)]  # noqa: E731
            m = reduce(ext, lambda *k: at(k), "max")
            s = reduce(ext, lambda *k: UnaryOp("exp", at(k) - m), "sum")
            if log:
                return x[i] - m - UnaryOp("log", s)
            # times 1 / sum (one division per row, not per element; within an ulp of the quotient)
            return UnaryOp("exp", x[i] - m) * (Const(1.0, x.dtype) / s)

        return compute("y", x.shape, f, dtype=x.dtype)

    def numpy(self, x):
        axes = tuple(self.attrs["axes"])
        if x.size == 0:
            return [x.copy()]
        with np.errstate(all="ignore"):
            d = x - np.max(x, axis=axes, keepdims=True)
            e = np.exp(d)
            s = np.sum(e, axis=axes, keepdims=True)
            y = d - np.log(s) if self.attrs.get("log", False) else e / s
        return [y.astype(x.dtype, copy=False)]


def _unflatten(k: Expr, extents: Sequence[int]) -> list[Expr]:
    """Row-major coordinates of the flat index ``k`` over ``extents``."""
    out, stride = [], math.prod(extents)
    for d, e in enumerate(extents):
        stride //= e
        v = k if stride == 1 else k // stride
        out.append(v % e if d > 0 else v)
    return out


class Hardmax(Operator):
    """1 at the first maximum over ``axes`` (jointly, row-major), 0 elsewhere."""

    def compute(self, x: TensorInput):
        axes = tuple(self.attrs["axes"])
        ext = tuple(x.shape[a] for a in axes)
        n = math.prod(ext)
        strides = [math.prod(ext[d + 1:]) for d in range(len(ext))]

        def f(*i):
            am = reduce((n,), lambda k: x[with_axes(i, axes, _unflatten(k, ext))], "argmax")
            pos = i[axes[-1]]
            for a, s in zip(axes[:-1], strides[:-1]):
                pos = pos + i[a] * s
            return Cast(eq(am, pos), x.dtype)

        return compute("y", x.shape, f, dtype=x.dtype)

    def numpy(self, x):
        axes = tuple(self.attrs["axes"])
        if x.size == 0:
            return [x.copy()]
        dest = tuple(range(x.ndim - len(axes), x.ndim))
        xt = np.moveaxis(x, axes, dest)
        flat = xt.reshape(xt.shape[:x.ndim - len(axes)] + (-1,))
        am = np.argmax(flat, axis=-1)[..., None]
        onehot = (np.arange(flat.shape[-1]) == am).astype(x.dtype)
        return [np.moveaxis(onehot.reshape(xt.shape), dest, axes)]


#: The identity and numpy scan of each combination of :class:`_Cumulative`.
_SCANS = {"sum": (0, np.cumsum), "prod": (1, np.cumprod)}


class _Cumulative(Operator):
    """Cumulative ``combine`` (a :data:`~shardflow.compiler.ir.expr.REDUCE_OPS` name with an
    identity: ``"sum"`` or ``"prod"``) along ``axis``; ``exclusive`` leaves out the element
    itself, ``reverse`` runs from the end. Subclasses name the combination and define
    ``compute`` (so that the op library lists them, not this base)."""

    combine: ClassVar[str] = ""

    def _scan(self, x: TensorInput):
        axis, excl, rev = self.attrs["axis"], bool(self.attrs["exclusive"]), bool(self.attrs["reverse"])
        n, dt = x.shape[axis], x.dtype
        identity = Const(_SCANS[self.combine][0], dt)

        def f(*i):
            ia = i[axis]

            def body(k):
                if rev:
                    cond = k > ia if excl else k >= ia
                else:
                    cond = k < ia if excl else k <= ia
                return if_then_else(cond, x[with_axes(i, (axis,), (k,))], identity)

            return reduce((n,), body, self.combine)

        return compute("y", x.shape, f, dtype=dt)

    def numpy(self, x):
        axis, excl, rev = self.attrs["axis"], bool(self.attrs["exclusive"]), bool(self.attrs["reverse"])
        identity, scan = _SCANS[self.combine]
        dt = sum_type(x.dtype)  # (half values combine in float32, each result rounded once)
        if rev:
            x = np.flip(x, axis)
        if excl:  # y[j] combines x[:j]; y[0] is the identity
            y = np.full(x.shape, identity, dt)
            head, tail = [slice(None)] * x.ndim, [slice(None)] * x.ndim
            head[axis], tail[axis] = slice(0, -1), slice(1, None)
            scan(x[tuple(head)], axis=axis, dtype=dt, out=y[tuple(tail)])
        else:
            y = scan(x, axis=axis, dtype=dt)
        if rev:
            y = np.flip(y, axis)
        return [np.ascontiguousarray(y.astype(x.dtype, copy=False))]


class CumSum(_Cumulative):
    """Cumulative sum along ``axis``; ``exclusive`` leaves out the element itself, ``reverse``
    sums from the end."""

    combine = "sum"

    def compute(self, x: TensorInput):
        return self._scan(x)


class CumProd(_Cumulative):
    """Cumulative product along ``axis``; ``exclusive`` leaves out the element itself (the
    first product is 1), ``reverse`` multiplies from the end."""

    combine = "prod"

    def compute(self, x: TensorInput):
        return self._scan(x)


class TopK(Operator):
    """The ``k`` largest (``largest=True``) or smallest values along ``axis``, sorted, and their
    int64 indices; equal values keep the lower index first."""

    def compute(self, x: TensorInput):
        k, axis = self.attrs["k"], self.attrs["axis"]
        if not 0 <= k <= x.shape[axis]:
            raise ShapeError(f"{self.name}: k={k} is outside [0, {x.shape[axis]}] (the extent of axis {axis})")
        shape = with_axes(x.shape, (axis,), (k,))
        amap = tuple(None if d == axis else (0, d) for d in range(x.ndim))
        why = f"sorting along axis {axis}"
        return [extern("values", shape, x.dtype, amap, why), extern("indices", shape, "int64", amap, why)]

    def numpy(self, x):
        k, axis = self.attrs["k"], self.attrs["axis"]
        if self.attrs.get("largest", True):
            # stable ascending sort of the reversed axis, read backwards: descending, ties by lower index
            order = np.argsort(np.flip(x, axis), axis=axis, kind="stable")
            order = x.shape[axis] - 1 - np.flip(order, axis)
        else:
            order = np.argsort(x, axis=axis, kind="stable")
        idx = np.take(order, np.arange(k), axis=axis)
        return [np.take_along_axis(x, idx, axis=axis), idx.astype(np.int64)]


def examples(rng: np.random.Generator):
    """Small instances of every op in this module: ``(op class, input arrays, attrs)``."""
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    xi = rng.integers(-4, 5, (2, 3, 4)).astype(np.int32)
    xb = rng.integers(0, 2, (3, 4)).astype(bool)
    ties = np.array([[1, 3, 3, 0], [2, 2, 2, 2], [0, 5, 1, 5]], np.float32)
    res = []
    for kind in REDUCE_KINDS:
        src = np.abs(x) + 0.1 if kind in ("log_sum",) else x
        res += [(Reduce, [src], {"kind": kind, "axes": (1,), "keepdims": True}),
                (Reduce, [src], {"kind": kind, "axes": (0, 2), "keepdims": False}),
                (Reduce, [src], {"kind": kind, "axes": (), "keepdims": True}),
                (Reduce, [np.zeros((2, 0, 3), np.float32)], {"kind": kind, "axes": (1,), "keepdims": False})]
    res += [(Reduce, [xi], {"kind": k, "axes": (2,), "keepdims": False}) for k in ("sum", "mean", "max", "l2")]
    res += [(Reduce, [xb], {"kind": k, "axes": (1,), "keepdims": True}) for k in ("max", "min")]
    res += [(Reduce, [np.array([[-np.inf, -np.inf], [np.inf, 1.0]], np.float32)],
             {"kind": "log_sum_exp", "axes": (1,), "keepdims": True})]
    for kind in ("argmax", "argmin"):
        res += [(ArgReduce, [ties], {"kind": kind, "axis": 1, "keepdims": True}),
                (ArgReduce, [ties], {"kind": kind, "axis": 1, "keepdims": False, "select_last": True}),
                (ArgReduce, [x], {"kind": kind, "axis": 0, "keepdims": False})]
    res += [(Softmax, [x], {"axes": (1,)}), (Softmax, [x], {"axes": (1, 2), "log": True}),
            (Softmax, [x * 100], {"axes": (2,), "log": True}),
            (Hardmax, [ties], {"axes": (1,)}), (Hardmax, [x], {"axes": (1, 2)}), (Hardmax, [ties], {"axes": (0,)})]
    res += [(CumSum, [x], {"axis": a, "exclusive": e, "reverse": r})
            for a, e, r in ((1, False, False), (2, True, False), (0, False, True), (2, True, True))]
    res += [(CumSum, [xi], {"axis": 2, "exclusive": True, "reverse": False})]
    xp = (rng.uniform(0.5, 1.5, (2, 3, 4)) * rng.choice([-1, 1], (2, 3, 4))).astype(np.float32)
    res += [(CumProd, [xp], {"axis": a, "exclusive": e, "reverse": r})
            for a, e, r in ((1, False, False), (2, True, False), (0, False, True), (2, True, True))]
    res += [(CumProd, [xi], {"axis": 2, "exclusive": False, "reverse": True}),
            (CumProd, [xi.astype(np.int64)], {"axis": 1, "exclusive": True, "reverse": False})]
    res += [(TopK, [ties], {"k": 3, "axis": 1, "largest": True}), (TopK, [ties], {"k": 2, "axis": 1, "largest": False}),
            (TopK, [x], {"k": 2, "axis": 0, "largest": True})]
    return res
