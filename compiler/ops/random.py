"""Random numbers as a pure function of position: ONNX's RandomUniform(Like), RandomNormal(Like) and
Bernoulli (rfcs/0006, "Random numbers").

Element ``f`` (the row-major flat index of the output) of run ``s`` (the program's step, an int64
input the runtime keeps as state: 0 on the first run, then 1, 2, ...) takes the 64 bits of
SplitMix64 at counter ``s * size + f + 1`` from the op's key::

    z = key + c * 0x9E3779B97F4A7C15       (mod 2^64)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    bits = z ^ (z >> 31)

(SplitMix64's ``c``-th output seeded with ``key``; read at a counter rather than stepped, so any
element is computed alone.) Nothing depends on which rank or thread computes an element, or in
which order: a sharded program draws exactly the single-device values, every target the same bits.

From the bits: a uniform in ``[0, 1)`` is the top 24 bits times ``2^-24`` (float32, float16,
bfloat16: computed in float32) or the top 53 times ``2^-53`` (float64); a normal is Box-Muller's
``sqrt(-2 ln u1) cos(2 pi u2)`` of two uniforms from the two halves (24 bits each in float32: its
largest magnitude is 5.77, the 1 - 8e-9 quantile; 32 bits each in float64: 6.66); Bernoulli is
``u < p``; a categorical draw (Multinomial) is the number of classes whose cumulative weight is at
most ``u`` times the row's total.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ShapeError
from ..ir.expr import BinOp, Cast, Const, Expr, UnaryOp, dtype_kind, if_then_else, infer_dtype, numpy_type
from ..ir.graph import Operator
from ..ir.task import compute, reduce

__all__ = ["Random", "RANDOM_KINDS", "splitmix64_key", "random_bits"]

RANDOM_KINDS = ("uniform", "normal", "bernoulli", "categorical")

_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK = (1 << 64) - 1


def splitmix64_key(seed: int) -> int:
    """The key of a seed (any Python int): SplitMix64's first output from it, so nearby seeds give
    unrelated streams."""
    z = (seed + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def random_bits(key: int, counters: np.ndarray) -> np.ndarray:
    """The 64 bits (uint64) at ``counters`` of the stream ``key`` (numpy; the reference)."""
    u = np.uint64
    with np.errstate(over="ignore"):
        z = u(key) + np.asarray(counters, np.uint64) * u(_GOLDEN)
        z = (z ^ (z >> u(30))) * u(_M1)
        z = (z ^ (z >> u(27))) * u(_M2)
    return z ^ (z >> u(31))


def _u64(v) -> Const:
    return Const(int(v), "uint64")


def _shr(z: Expr, n: int) -> Expr:
    return BinOp("shr", z, _u64(n))


def _xorshift(z: Expr, n: int) -> Expr:
    return BinOp("bitxor", z, _shr(z, n))


def _bits_expr(key: int, counter: Expr) -> Expr:
    z = _u64(key) + counter * _u64(_GOLDEN)
    z = _xorshift(z, 30) * _u64(_M1)
    z = _xorshift(z, 27) * _u64(_M2)
    return _xorshift(z, 31)


def _cos_terms(wide: str) -> list[float]:
    """Taylor's coefficients of ``cos(2 pi b)`` in powers of ``b^2``, enough for ``b`` in
    ``[0, 1/4]`` (``2 pi b`` up to ``pi/2``): the first term left out is below 1e-8 (float32) or
    1e-17 (float64)."""
    n = 11 if wide == "float64" else 7
    return [(-1) ** k * (2 * math.pi) ** (2 * k) / math.factorial(2 * k) for k in range(n)]


def _cos_turns(t: Expr, wide: str) -> Expr:
    """``cos(2 pi t)`` for ``t`` in ``[0, 1)``, in element-wise arithmetic the C++ compiler
    vectorizes (a call of ``std::cos`` per element is not): folded exactly to ``b`` in ``[0, 1/4]``
    (``cos(2 pi t) = -cos(2 pi (t - 1/2))``, even, and ``cos(2 pi a) = -cos(2 pi (1/2 - a))``), then
    the polynomial in ``b^2``. :func:`_np_cos_turns` is the same steps in numpy."""
    c = lambda v: Const(v, wide)  # noqa: E731
    a = UnaryOp("abs", t - c(0.5))
    far = a > c(0.25)
    b = if_then_else(far, c(0.5) - a, a)
    b2 = b * b
    terms = _cos_terms(wide)
    poly: Expr = c(terms[-1])
    for k in reversed(terms[:-1]):
        poly = poly * b2 + c(k)
    return if_then_else(far, poly, -poly)


def _np_cos_turns(t: np.ndarray) -> np.ndarray:
    wide = t.dtype.type
    a = np.abs(t - wide(0.5))
    far = a > wide(0.25)
    b = np.where(far, wide(0.5) - a, a)
    b2 = b * b
    terms = _cos_terms("float64" if wide == np.float64 else "float32")
    poly = np.full_like(t, terms[-1])
    for k in reversed(terms[:-1]):
        poly = poly * b2 + wide(k)
    return np.where(far, poly, -poly)


def _widened(v: Expr, wide: str) -> Expr:
    return v if infer_dtype(v) == wide else Cast(v, wide)


class Random(Operator):
    """Random values of ``shape`` in ``dtype`` (module docstring). Inputs: ``step`` (int64, 0-d:
    which run of the program this is); for ``kind = "categorical"`` the cumulative weights
    ``[B, C]`` of each row's classes (output ``[B, S]``: ``S`` draws of a class per row, the number
    of classes whose cumulative weight is at most ``u`` times the row's total); for
    ``"bernoulli"`` the probabilities ``p`` (of the output's shape), or else the attribute ``p``
    (one probability for every element: a training Dropout's mask). Attributes: ``kind``
    (:data:`RANDOM_KINDS`), ``shape``, ``dtype``, ``key`` (:func:`splitmix64_key` of the seed),
    ``a`` and ``b`` (uniform: low and high; normal: mean and scale; unused otherwise); on a rank
    that computes a part of the output (:attr:`positional`), ``origin`` (where the part starts) and
    ``global_shape`` (the whole's shape, whose positions the counters number)."""

    positional = True

    def origin_attrs(self, origin):
        mine = self.attrs.get("origin", (0,) * len(origin))  # (a part of a part: the offsets add up)
        return {"origin": tuple(int(a) + int(o) for a, o in zip(mine, origin)),
                "global_shape": tuple(self.attrs.get("global_shape", self.attrs["shape"]))}

    def _positions(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], list[int], int]:
        """``(origin, strides, size)`` of the counters: the part's origin in the whole, the
        whole's row-major strides and its element count."""
        whole = tuple(int(d) for d in self.attrs.get("global_shape", shape))
        origin = tuple(int(o) for o in self.attrs.get("origin", (0,) * len(shape)))
        if len(whole) != len(shape) or len(origin) != len(shape) or any(
                o < 0 or o + d > w for o, d, w in zip(origin, shape, whole)):
            raise ShapeError(f"{self.name}: a part {list(shape)} at {list(origin)} does not lie in {list(whole)}")
        return origin, [math.prod(whole[d + 1:]) for d in range(len(whole))], math.prod(whole)

    def compute(self, step, *p):
        kind, dt, key = self.attrs["kind"], self.attrs["dtype"], int(self.attrs["key"])
        shape = tuple(int(d) for d in self.attrs["shape"])
        if kind not in RANDOM_KINDS:
            raise ShapeError(f"{self.name}: kind {kind!r} is not one of {RANDOM_KINDS}")
        if step.shape != () or step.dtype != "int64":
            raise ShapeError(f"{self.name}: the step must be a 0-d int64, got {step.dtype}{list(step.shape)}")
        if kind == "categorical":
            if len(p) != 1 or p[0].ndim != 2 or len(shape) != 2 or p[0].shape[0] != shape[0] \
                    or dtype_kind(p[0].dtype) != "f" or dtype_kind(dt) != "i":
                raise ShapeError(f"{self.name}: a categorical draw takes cumulative weights [B, C] (float) and gives "
                                 f"integers [B, S], got {[(t.dtype, t.shape) for t in p]} -> {dt}{list(shape)}")
        elif (kind != "bernoulli" and p) or (p and (p[0].shape != shape or dtype_kind(p[0].dtype) != "f")):
            takes = "a float p of its shape" if kind == "bernoulli" else "no"
            raise ShapeError(f"{self.name}: a {kind} draw takes {takes} input besides the step, "
                             f"got {[(t.dtype, t.shape) for t in p]}")
        origin, strides, size = self._positions(shape)
        wide = "float64" if (p[0].dtype if p else dt) == "float64" else "float32"
        a, b = self.attrs.get("a", 0.0), self.attrs.get("b", 1.0)

        def f(*i):
            flat: Expr = _u64(1 + sum(o * s for o, s in zip(origin, strides)))
            for v, s in zip(i, strides):
                flat = flat + Cast(v, "uint64") * _u64(s)
            z = _bits_expr(key, Cast(step[()], "uint64") * _u64(size) + flat)
            top, scale = (53, 2.0 ** -53) if wide == "float64" else (24, 2.0 ** -24)
            if kind == "normal":
                half, hscale = (32, 2.0 ** -32) if wide == "float64" else (24, 2.0 ** -24)
                u1 = (Cast(_shr(z, 64 - half), wide) + Const(1.0, wide)) * Const(hscale, wide)
                u2 = Cast(BinOp("bitand", z, _u64((1 << half) - 1)), wide) * Const(hscale, wide)
                r = UnaryOp("sqrt", Const(-2.0, wide) * UnaryOp("log", u1))
                v = Const(float(a), wide) + Const(float(b), wide) * (r * _cos_turns(u2, wide))
            else:
                u = Cast(_shr(z, 64 - top), wide) * Const(scale, wide)
                if kind == "categorical":  # the classes whose cumulative weight is at most u * total
                    cdf, c = p[0], p[0].shape[1]
                    t = u * _widened(cdf[i[0], c - 1], wide)
                    count = reduce((c,), lambda j: if_then_else(_widened(cdf[i[0], j], wide) <= t, Const(1, dt),
                                                                Const(0, dt)), "sum")
                    return if_then_else(count < Const(c - 1, dt), count, Const(c - 1, dt))
                if kind == "bernoulli":
                    pv = (Const(float(self.attrs["p"]), wide) if not p else p[0][i] if p[0].dtype == wide
                          else Cast(p[0][i], wide))
                    one, zero = (Const(True, dt), Const(False, dt)) if dt == "bool" else (Const(1, dt), Const(0, dt))
                    return if_then_else(u < pv, one, zero)
                v = Const(float(a), wide) + Const(float(b) - float(a), wide) * u
            return v if dt == wide else Cast(v, dt)
        return compute("y", shape, f, dtype=dt)

    def numpy(self, step, *p):
        kind, dt, key = self.attrs["kind"], self.attrs["dtype"], int(self.attrs["key"])
        shape = tuple(int(d) for d in self.attrs["shape"])
        origin, strides, size = self._positions(shape)
        flat = 1 + sum(o * s for o, s in zip(origin, strides)) + sum(
            np.arange(d, dtype=np.uint64).reshape([-1 if k == j else 1 for k in range(len(shape))]) * np.uint64(s)
            for j, (d, s) in enumerate(zip(shape, strides)))
        with np.errstate(over="ignore"):
            counters = np.uint64(int(np.asarray(step))) * np.uint64(size) + np.broadcast_to(
                np.asarray(flat, np.uint64), shape)
        z = random_bits(key, counters)
        wide = np.float64 if (p[0].dtype if p else numpy_type(dt)) == np.float64 else np.float32
        a, b = self.attrs.get("a", 0.0), self.attrs.get("b", 1.0)
        if kind == "normal":
            half = 32 if wide == np.float64 else 24
            hscale = wide(2.0 ** -half)
            u1 = ((z >> np.uint64(64 - half)).astype(wide) + wide(1)) * hscale
            u2 = (z & np.uint64((1 << half) - 1)).astype(wide) * hscale
            r = np.sqrt(wide(-2) * np.log(u1))
            v = wide(a) + wide(b) * (r * _np_cos_turns(u2))
        else:
            top = 53 if wide == np.float64 else 24
            u = (z >> np.uint64(64 - top)).astype(wide) * wide(2.0 ** -top)
            if kind == "categorical":
                cdf = np.asarray(p[0]).astype(wide)
                t = u * cdf[:, -1:]
                count = (cdf[:, None, :] <= t[:, :, None]).sum(axis=2)
                return [np.minimum(count, cdf.shape[1] - 1).astype(numpy_type(dt))]
            if kind == "bernoulli":
                pv = np.asarray(p[0]).astype(wide) if p else wide(self.attrs["p"])
                return [(u < pv).astype(numpy_type(dt))]
            v = wide(a) + wide(float(b) - float(a)) * u
        return [v.astype(numpy_type(dt))]


def examples(rng: np.random.Generator):
    """Small instances of every op in this module: ``(op class, input arrays, attrs)``."""
    step = np.array(3, np.int64)
    key = splitmix64_key(42)
    p = rng.uniform(0, 1, (4, 5)).astype(np.float32)
    return [
        (Random, [step], {"kind": "uniform", "shape": (3, 7), "dtype": "float32", "key": key, "a": -2.0, "b": 3.0}),
        (Random, [step], {"kind": "uniform", "shape": (2, 3, 5), "dtype": "float64", "key": key, "a": 0.0, "b": 1.0}),
        (Random, [step], {"kind": "normal", "shape": (4, 9), "dtype": "float32", "key": key, "a": 1.0, "b": 2.0}),
        (Random, [step], {"kind": "normal", "shape": (17,), "dtype": "float64", "key": key, "a": 0.0, "b": 1.0}),
        (Random, [step], {"kind": "uniform", "shape": (6,), "dtype": "float16", "key": key, "a": 0.0, "b": 1.0}),
        (Random, [step, p], {"kind": "bernoulli", "shape": (4, 5), "dtype": "float32", "key": key}),
        (Random, [step, p.astype(np.float64)], {"kind": "bernoulli", "shape": (4, 5), "dtype": "int32", "key": key}),
        (Random, [np.array(0, np.int64)], {"kind": "uniform", "shape": (), "dtype": "float32", "key": key}),
        (Random, [step], {"kind": "bernoulli", "shape": (3, 8), "dtype": "bool", "key": key, "p": 0.25}),
        # a rank's part [1:3, 4:9] of a [4, 12] draw
        (Random, [step], {"kind": "uniform", "shape": (2, 5), "dtype": "float32", "key": key, "origin": (1, 4),
                          "global_shape": (4, 12)}),
        (Random, [step, np.cumsum(rng.uniform(0, 1, (3, 6)), axis=1).astype(np.float32)],
         {"kind": "categorical", "shape": (3, 10), "dtype": "int64", "key": key}),
    ]
