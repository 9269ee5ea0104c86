"""Element-wise operators: unary math, binary arithmetic with numpy broadcasting, casts, select.

The compute definitions index each input with the output axes aligned to the right (numpy
broadcasting); a broadcast dim (extent 1) is read at index 0.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import ShapeError
from ..ir.expr import (BINARY_FUNCS, UNARY_FUNCS, BinOp, Cast, Const, Expr, IfThenElse, UnaryOp, as_expr,
                       if_then_else, maximum, minimum, numpy_type)
from ..ir.graph import Operator
from ..ir.task import TensorInput, compute, extern

__all__ = ["broadcast_shape", "broadcast_read", "Unary", "Binary", "CastOp", "RoundHalf", "Where", "Activation",
           "Clip", "Identity", "ACTIVATIONS"]


def broadcast_shape(shapes: Sequence[Sequence[int]], where: str = "") -> tuple[int, ...]:
    """Numpy broadcast of ``shapes``; raises :class:`ShapeError` naming ``where`` when incompatible."""
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError:
        raise ShapeError(f"{where}: shapes {[tuple(s) for s in shapes]} do not broadcast") from None


def broadcast_read(x: TensorInput, out_shape: Sequence[int], axes: Sequence[Expr]) -> Expr:
    """Read ``x`` at the output position ``axes`` under numpy broadcasting."""
    off = len(out_shape) - x.ndim
    idx = []
    for d, ext in enumerate(x.shape):
        idx.append(as_expr(0) if ext == 1 and out_shape[off + d] != 1 else axes[off + d])
    return x[tuple(idx)]


class Unary(Operator):
    """``y = fn(x)`` for a function named in :data:`UNARY_FUNCS` (attribute ``fn``)."""

    injective = True

    def compute(self, x):
        fn = self.attrs["fn"]
        return compute("y", x.shape, lambda *i: UnaryOp(fn, x[i]), dtype=self._dtype(x.dtype))

    def _dtype(self, dt):
        return "bool" if self.attrs["fn"] in ("not", "isnan", "isinf", "isposinf", "isneginf") else dt

    def numpy(self, x):
        with np.errstate(all="ignore"):
            return [np.asarray(UNARY_FUNCS[self.attrs["fn"]](x))]


class Binary(Operator):
    """``z = fn(a, b)`` with numpy broadcasting for a function named in :data:`BINARY_FUNCS`."""

    injective = True

    def compute(self, a, b):
        fn = self.attrs["fn"]
        shape = broadcast_shape([a.shape, b.shape], self.name)
        dt = "bool" if fn in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "xor") else a.dtype
        return compute("z", shape, lambda *i: BinOp(fn, broadcast_read(a, shape, i), broadcast_read(b, shape, i)),
                       dtype=dt)

    def numpy(self, a, b):
        with np.errstate(all="ignore"):
            return [np.asarray(BINARY_FUNCS[self.attrs["fn"]](a, b))]


class CastOp(Operator):
    """``y = cast<to>(x)``. To a float8 type, ``saturate`` (ONNX's default) clamps values beyond its
    largest finite one (infinities included) to it; otherwise they become NaN (or inf, E5M2)."""

    op_type = "Cast"
    injective = True

    def compute(self, x):
        to = self.attrs["to"]
        if not (to.startswith("float8") and self.attrs.get("saturate", True)):
            return compute("y", x.shape, lambda *i: Cast(x[i], to), dtype=to)
        import ml_dtypes

        big = float(ml_dtypes.finfo(numpy_type(to)).max)
        wide = x.dtype if x.dtype in ("float16", "float32", "float64") else "float32"

        def clamped(*i):  # (a NaN fails both tests and stays NaN)
            v = x[i] if x.dtype == wide else Cast(x[i], wide)
            hi, lo = Const(big, wide), Const(-big, wide)
            return Cast(IfThenElse(v > hi, hi, IfThenElse(v < lo, lo, v)), to)
        return compute("y", x.shape, clamped, dtype=to)

    def numpy(self, x):
        to = numpy_type(self.attrs["to"])
        with np.errstate(all="ignore"):
            if self.attrs["to"].startswith("float8"):
                import ml_dtypes

                x = x.astype(np.float32) if x.dtype.kind != "f" else x
                if self.attrs.get("saturate", True):
                    big = float(ml_dtypes.finfo(to).max)
                    x = np.clip(x, -big, big)
            return [x.astype(to)]

    def passthrough_input(self):
        return 0 if self.inputs[0].dtype == self.attrs["to"] else None


class RoundHalf(Operator):
    """``y = float32(half(x))``: float32 ``x`` rounded to the half type ``to`` (``"float16"`` or
    ``"bfloat16"``, round to nearest even), kept in float32. A float16 model computed in float32 on the cpu
    target (``passes/precision.HalfModelInFloat32``) rounds its ops' outputs with it: one element-wise
    float32 op, which joins its producer's kernel (a conv's epilogue, where the conv kernels apply it as
    they store) where a pair of casts, with a half tensor between them, did not."""

    op_type = "RoundHalf"
    injective = True

    def compute(self, x):
        to = self.attrs["to"]
        return compute("y", x.shape, lambda *i: Cast(Cast(x[i], to), x.dtype), dtype=x.dtype)

    def numpy(self, x):
        with np.errstate(over="ignore"):
            return [x.astype(numpy_type(self.attrs["to"])).astype(x.dtype)]


class BitCast(Operator):
    """``y`` = the bytes of ``x`` read as type ``to`` (of the same width; little endian, as ONNX says
    and as every target here stores them). No index expression reinterprets bits, so the output is
    an extern (each element of ``y`` is the element of ``x`` at the same index: sharded alike); the
    driver runs it as a view of ``x``'s bytes, with no kernel."""

    def compute(self, x: TensorInput):
        return extern("y", x.shape, self.attrs["to"], tuple((0, d) for d in range(len(x.shape))),
                      "a reinterpretation of the bytes")

    #: the input's bytes as they are stored (a bfloat16 or float8 input is not widened first)
    widens_ml_floats = False

    def numpy(self, x):
        return [np.ascontiguousarray(x).view(numpy_type(self.attrs["to"])).reshape(x.shape)]


class Where(Operator):
    """``y = cond ? a : b`` with broadcasting."""

    injective = True

    def compute(self, c, a, b):
        shape = broadcast_shape([c.shape, a.shape, b.shape], self.name)
        return compute("y", shape, lambda *i: IfThenElse(broadcast_read(c, shape, i), broadcast_read(a, shape, i),
                                                         broadcast_read(b, shape, i)), dtype=a.dtype)

    def numpy(self, c, a, b):
        return [np.where(c, a, b)]


def _c(v, dt):
    return Const(v, dt)


# kind -> (compute-definition builder, numpy implementation). Both get the attributes dict.
# Written so that floats keep the input dtype (constants carry the input's dtype).
_ACTIVATIONS = {
    "relu": (lambda x, a, dt: maximum(x, _c(0, dt)), lambda x, a: np.maximum(x, 0).astype(x.dtype)),
    "leaky_relu": (lambda x, a, dt: if_then_else(x >= _c(0, dt), x, x * _c(a["alpha"], dt)),
                   lambda x, a: np.where(x >= 0, x, x * x.dtype.type(a["alpha"]))),
    "elu": (lambda x, a, dt: if_then_else(x >= _c(0, dt), x, _c(a["alpha"], dt) * (UnaryOp("exp", x) - _c(1, dt))),
            lambda x, a: np.where(x >= 0, x, x.dtype.type(a["alpha"]) * (np.exp(x) - 1)).astype(x.dtype)),
    "selu": (lambda x, a, dt: _c(a["gamma"], dt) * if_then_else(
        x > _c(0, dt), x, _c(a["alpha"], dt) * (UnaryOp("exp", x) - _c(1, dt))),
        lambda x, a: (x.dtype.type(a["gamma"]) * np.where(x > 0, x, x.dtype.type(a["alpha"]) * (np.exp(x) - 1)))
        .astype(x.dtype)),
    "celu": (lambda x, a, dt: maximum(x, _c(0, dt)) + minimum(
        _c(0, dt), _c(a["alpha"], dt) * (UnaryOp("exp", x / _c(a["alpha"], dt)) - _c(1, dt))),
        lambda x, a: (np.maximum(x, 0) + np.minimum(0, a["alpha"] * (np.exp(x / a["alpha"]) - 1))).astype(x.dtype)),
    "sigmoid": (lambda x, a, dt: _c(1, dt) / (_c(1, dt) + UnaryOp("exp", -x)),
                lambda x, a: (1 / (1 + np.exp(-x))).astype(x.dtype)),
    "hard_sigmoid": (lambda x, a, dt: maximum(_c(0, dt), minimum(_c(1, dt), _c(a["alpha"], dt) * x + _c(a["beta"], dt))),
                     lambda x, a: np.clip(x * x.dtype.type(a["alpha"]) + x.dtype.type(a["beta"]), 0, 1).astype(x.dtype)),
    "hard_swish": (lambda x, a, dt: x * maximum(_c(0, dt), minimum(_c(1, dt), x * _c(1 / 6, dt) + _c(0.5, dt))),
                   lambda x, a: (x * np.clip(x / 6 + 0.5, 0, 1)).astype(x.dtype)),
    "softplus": (lambda x, a, dt: UnaryOp("log", UnaryOp("exp", x) + _c(1, dt)),
                 lambda x, a: np.log(np.exp(x) + 1).astype(x.dtype)),
    "softsign": (lambda x, a, dt: x / (_c(1, dt) + UnaryOp("abs", x)),
                 lambda x, a: (x / (1 + np.abs(x))).astype(x.dtype)),
    "mish": (lambda x, a, dt: x * UnaryOp("tanh", UnaryOp("log", UnaryOp("exp", x) + _c(1, dt))),
             lambda x, a: (x * np.tanh(np.log1p(np.exp(x)))).astype(x.dtype)),
    "thresholded_relu": (lambda x, a, dt: if_then_else(x > _c(a["alpha"], dt), x, _c(0, dt)),
                         lambda x, a: np.where(x > a["alpha"], x, 0).astype(x.dtype)),
    "gelu": (lambda x, a, dt: _c(0.5, dt) * x * (_c(1, dt) + UnaryOp("erf", x * _c(0.7071067811865476, dt))),
             lambda x, a: (0.5 * x * (1 + UNARY_FUNCS["erf"](x * x.dtype.type(0.7071067811865476)))).astype(x.dtype)),
    "gelu_tanh": (lambda x, a, dt: _c(0.5, dt) * x * (_c(1, dt) + UnaryOp(
        "tanh", _c(0.7978845608028654, dt) * (x + _c(0.044715, dt) * x * x * x))),
        lambda x, a: (0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))).astype(x.dtype)),
    "shrink": (lambda x, a, dt: if_then_else(x < _c(-a["lambd"], dt), x + _c(a["bias"], dt),
                                             if_then_else(x > _c(a["lambd"], dt), x - _c(a["bias"], dt), _c(0, dt))),
               lambda x, a: np.where(x < -a["lambd"], x + a["bias"],
                                     np.where(x > a["lambd"], x - a["bias"], 0)).astype(x.dtype)),
}


class Activation(Unary):
    """A named element-wise activation (attribute ``kind``, plus its parameters: ``alpha``...)."""

    def compute(self, x):
        build = _ACTIVATIONS[self.attrs["kind"]][0]
        return compute("y", x.shape, lambda *i: build(x[i], self.attrs, x.dtype), dtype=x.dtype)

    def numpy(self, x):
        with np.errstate(all="ignore"):
            return [np.asarray(_ACTIVATIONS[self.attrs["kind"]][1](x, self.attrs))]


ACTIVATIONS = tuple(_ACTIVATIONS)


class Clip(Operator):
    """``y = min(max(x, lo), hi)`` with constant bounds (``None`` = unbounded)."""

    injective = True

    def compute(self, x):
        lo, hi, dt = self.attrs.get("lo"), self.attrs.get("hi"), x.dtype

        def f(*i):
            v = x[i]
            if lo is not None:
                v = maximum(v, Const(lo, dt))
            if hi is not None:
                v = minimum(v, Const(hi, dt))
            return v
        return compute("y", x.shape, f, dtype=dt)

    def numpy(self, x):
        lo, hi = self.attrs.get("lo"), self.attrs.get("hi")
        y = x
        if lo is not None:
            y = np.maximum(y, np.asarray(lo, x.dtype))
        if hi is not None:
            y = np.minimum(y, np.asarray(hi, x.dtype))
        return [np.asarray(y, x.dtype)]


class Identity(Operator):
    """``y = x``."""

    injective = True

    def compute(self, x):
        return compute("y", x.shape, lambda *i: x[i], dtype=x.dtype)

    def numpy(self, x):
        return [x]

    def passthrough_input(self):
        return 0


def examples(rng: np.random.Generator):
    """Small instances of every op in this module: ``(op class, input arrays, attrs)``."""
    x = rng.standard_normal((3, 4)).astype(np.float32)
    y = rng.standard_normal((4,)).astype(np.float32)
    i = rng.integers(-5, 6, (3, 4)).astype(np.int64)
    j = rng.integers(1, 4, (1, 4)).astype(np.int64)
    res = [(Unary, [np.abs(x) + 0.5], {"fn": fn}) for fn in UNARY_FUNCS if fn not in ("not", "bitnot")]
    res += [(Unary, [x > 0], {"fn": "not"}), (Unary, [i], {"fn": "bitnot"})]
    for fn in BINARY_FUNCS:
        if fn in ("and", "or", "xor"):
            res.append((Binary, [x > 0, y > 0], {"fn": fn}))
        elif fn in ("bitand", "bitor", "bitxor", "shl", "shr", "truncdiv", "floordiv", "mod", "fmod"):
            res.append((Binary, [i, j], {"fn": fn}))
        else:
            res.append((Binary, [np.abs(x) + 0.1, y], {"fn": fn}))
    # integer powers, negative exponents too (the real power truncated: 0 unless the base is 1 or -1)
    base = np.array([[-3, -2, -1, 0, 1, 2, 3, 5]] * 2, np.int64)
    res.append((Binary, [base, np.array([[-3, -2, -1, 0, 1, 2, 3, -1], [-1, -1, -2, -2, -3, 0, 5, 2]], np.int64)],
                {"fn": "pow"}))
    res += [(CastOp, [x * 10], {"to": "int32"}), (CastOp, [i], {"to": "float16"}),
            (CastOp, [x * 600], {"to": "float8_e4m3fn"}),  # (saturated: |x| * 600 > 448 for some)
            (CastOp, [x * 6e4], {"to": "float8_e5m2", "saturate": False}),  # (past 61440: infinities)
            (Where, [x > 0, x, y], {}), (Clip, [x], {"lo": -0.5, "hi": 0.5}), (Clip, [x], {"lo": None, "hi": 0.1}),
            (Identity, [x], {}), (BitCast, [x], {"to": "int32"}), (BitCast, [x > 0], {"to": "uint8"})]
    params = {"alpha": 0.3, "beta": 0.4, "gamma": 1.2, "lambd": 0.5, "bias": 0.1}
    res += [(Activation, [x], {"kind": k, **params}) for k in _ACTIVATIONS]
    # (half ties, subnormals, overflow to inf, NaN)
    edge = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2.0 ** -20, 65520.0, -1e6, np.nan, 0.1, -0.0], np.float32)
    res += [(RoundHalf, [np.concatenate([x.ravel(), edge])], {"to": to}) for to in ("float16", "bfloat16")]
    return res
