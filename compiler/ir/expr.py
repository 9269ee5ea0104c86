"""Scalar expressions of compute definitions.

A compute definition describes one output element as an expression over *axis variables*
(:class:`Var`), constants and elements of input tensors (:class:`TensorElement`). Reductions
(:class:`Reduce`) introduce their own variables. Expressions are immutable trees built with
ordinary Python operators::

    i, k = Var("i", 4), Var("k", 8, "reduce")
    e = A[i, k] * 2.0 + 1.0

``==`` keeps Python's identity meaning (expressions are hashable); use :func:`eq` and
:func:`ne` for element comparisons.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import numpy as np

__all__ = [
    "Expr", "Var", "Const", "BinOp", "UnaryOp", "Cast", "IfThenElse", "TensorElement", "Reduce",
    "as_expr", "eq", "ne", "logical_and", "logical_or", "logical_not", "maximum", "minimum",
    "if_then_else", "cast", "UNARY_FUNCS", "BINARY_FUNCS", "REDUCE_OPS", "walk", "dtype_kind",
    "numpy_type", "ML_FLOATS", "affine_form", "affine_expr",
]


class Expr:
    """Base class of scalar expressions."""

    __slots__ = ()

    # arithmetic -----------------------------------------------------------------
    def __add__(self, o): return BinOp("add", self, as_expr(o))
    def __radd__(self, o): return BinOp("add", as_expr(o), self)
    def __sub__(self, o): return BinOp("sub", self, as_expr(o))
    def __rsub__(self, o): return BinOp("sub", as_expr(o), self)
    def __mul__(self, o): return BinOp("mul", self, as_expr(o))
    def __rmul__(self, o): return BinOp("mul", as_expr(o), self)
    def __truediv__(self, o): return BinOp("div", self, as_expr(o))
    def __rtruediv__(self, o): return BinOp("div", as_expr(o), self)
    def __floordiv__(self, o): return BinOp("floordiv", self, as_expr(o))
    def __rfloordiv__(self, o): return BinOp("floordiv", as_expr(o), self)
    def __mod__(self, o): return BinOp("mod", self, as_expr(o))
    def __rmod__(self, o): return BinOp("mod", as_expr(o), self)
    def __pow__(self, o): return BinOp("pow", self, as_expr(o))
    def __rpow__(self, o): return BinOp("pow", as_expr(o), self)
    def __neg__(self): return UnaryOp("neg", self)
    def __lt__(self, o): return BinOp("lt", self, as_expr(o))
    def __le__(self, o): return BinOp("le", self, as_expr(o))
    def __gt__(self, o): return BinOp("gt", self, as_expr(o))
    def __ge__(self, o): return BinOp("ge", self, as_expr(o))
    def __and__(self, o): return BinOp("and", self, as_expr(o))
    def __or__(self, o): return BinOp("or", self, as_expr(o))
    def __invert__(self): return UnaryOp("not", self)

    def __bool__(self):
        raise TypeError("an Expr has no truth value; use if_then_else/logical_and instead of Python if/and")

    def children(self) -> tuple["Expr", ...]:
        return ()

    def __repr__(self) -> str:
        return format_expr(self)


class Var(Expr):
    """An axis variable ranging over ``[0, extent)``; ``kind`` is ``"spatial"`` or ``"reduce"``."""

    __slots__ = ("name", "extent", "kind")
    _ids = itertools.count()

    def __init__(self, name: str, extent: int, kind: str = "spatial"):
        self.name = name
        self.extent = int(extent)
        self.kind = kind


class Const(Expr):
    """A scalar constant. ``dtype=None`` means weakly typed (adopts the other operand's dtype)."""

    __slots__ = ("value", "dtype")

    def __init__(self, value: Any, dtype: str | None = None):
        if isinstance(value, (np.generic,)):
            value = value.item()
        self.value = value
        self.dtype = dtype


class BinOp(Expr):
    __slots__ = ("op", "a", "b")

    def __init__(self, op: str, a: Expr, b: Expr):
        if op not in BINARY_FUNCS:
            raise ValueError(f"unknown binary op {op!r}")
        self.op, self.a, self.b = op, a, b

    def children(self):
        return (self.a, self.b)


class UnaryOp(Expr):
    __slots__ = ("op", "a")

    def __init__(self, op: str, a: Expr):
        if op not in UNARY_FUNCS:
            raise ValueError(f"unknown unary op {op!r}")
        self.op, self.a = op, a

    def children(self):
        return (self.a,)


class Cast(Expr):
    __slots__ = ("a", "dtype")

    def __init__(self, a: Expr, dtype: str):
        self.a, self.dtype = a, str(np.dtype(dtype)) if dtype not in ML_FLOATS else dtype

    def children(self):
        return (self.a,)


class IfThenElse(Expr):
    """``then`` where ``cond`` holds, else ``other``. Only the taken branch's tensor reads matter:
    an index read in the other branch may be out of bounds."""

    __slots__ = ("cond", "then", "other")

    def __init__(self, cond: Expr, then: Expr, other: Expr):
        self.cond, self.then, self.other = cond, then, other

    def children(self):
        return (self.cond, self.then, self.other)


class TensorElement(Expr):
    """``tensor[indices]``: one element of a task input (or of another grid compute)."""

    __slots__ = ("tensor", "indices")

    def __init__(self, tensor, indices: tuple[Expr, ...]):
        self.tensor, self.indices = tensor, indices

    def children(self):
        return self.indices


class Reduce(Expr):
    """``op`` over the ``vars`` (kind ``"reduce"``) of ``body``.

    ``op`` is one of ``sum``, ``prod``, ``max``, ``min``, ``mean``, ``argmax``, ``argmin``
    (the arg variants take exactly one variable and yield its int64 index of the first extremum).
    """

    __slots__ = ("vars", "body", "op")

    def __init__(self, vars: tuple[Var, ...], body: Expr, op: str):
        if op not in REDUCE_OPS:
            raise ValueError(f"unknown reduction {op!r}; expected one of {sorted(REDUCE_OPS)}")
        if op in ("argmax", "argmin") and len(vars) != 1:
            raise ValueError(f"{op} reduces exactly one variable")
        self.vars, self.body, self.op = tuple(vars), body, op

    def children(self):
        return (self.body,)


def as_expr(x: Any) -> Expr:
    """Wrap Python/numpy scalars as :class:`Const`; pass expressions through."""
    if isinstance(x, Expr):
        return x
    if isinstance(x, (bool, int, float, np.generic)):
        return Const(x)
    raise TypeError(f"cannot use {type(x).__name__} as an expression")


def eq(a, b) -> Expr: return BinOp("eq", as_expr(a), as_expr(b))
def ne(a, b) -> Expr: return BinOp("ne", as_expr(a), as_expr(b))
def logical_and(a, b) -> Expr: return BinOp("and", as_expr(a), as_expr(b))
def logical_or(a, b) -> Expr: return BinOp("or", as_expr(a), as_expr(b))
def logical_not(a) -> Expr: return UnaryOp("not", as_expr(a))
def maximum(a, b) -> Expr: return BinOp("max", as_expr(a), as_expr(b))
def minimum(a, b) -> Expr: return BinOp("min", as_expr(a), as_expr(b))
def cast(a, dtype: str) -> Expr: return Cast(as_expr(a), dtype)


def if_then_else(cond, then, other) -> Expr:
    """Select ``then`` where ``cond`` holds, else ``other``."""
    return IfThenElse(as_expr(cond), as_expr(then), as_expr(other))


def _round_half_even(x):
    return np.round(x)


def _erf(x):
    x = np.asarray(x)
    try:
        from scipy.special import erf  # type: ignore
        return erf(x).astype(x.dtype, copy=False)
    except ImportError:  # pragma: no cover - scipy is usually present
        import math
        return np.vectorize(math.erf, otypes=[x.dtype])(x)


def _trunc_div(a, b):
    """C-style integer division (rounds toward zero); true division for floats."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        q = np.floor_divide(a, b)
        adjust = (np.remainder(a, b) != 0) & ((a < 0) ^ (b < 0))
        return q + adjust.astype(q.dtype)
    return np.true_divide(a, b)


def _power(a, b):
    """``a ** b``; for integers (numpy refuses negative exponents) a negative exponent gives the real
    power truncated toward zero: 1 for ``a == 1``, -1 or 1 by parity for ``a == -1``, else 0 (also for
    ``a == 0``, whose real power has no integer value), as the generated kernels compute it."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind not in "iu" or b.dtype.kind not in "iu" or not np.any(b < 0):
        return np.power(a, b)
    neg = b < 0
    pos = np.power(a, np.where(neg, 0, b))
    ones = np.ones_like(pos)
    small = np.where(a == 1, ones, np.where(a == -1, np.where(b % 2 == 0, ones, -ones), np.zeros_like(pos)))
    return np.where(neg, small, pos)


# Numpy implementations used by the reference evaluator (and the list of valid op names).
UNARY_FUNCS: dict[str, Callable] = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x), "sin": np.sin, "cos": np.cos, "tan": np.tan,
    "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh,
    "tanh": np.tanh, "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh, "erf": _erf,
    "floor": np.floor, "ceil": np.ceil, "round": _round_half_even, "sign": np.sign,
    "not": np.logical_not, "bitnot": np.invert, "isnan": np.isnan, "isinf": np.isinf,
    "isposinf": np.isposinf, "isneginf": np.isneginf, "reciprocal": np.reciprocal,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "log1p": np.log1p, "expm1": np.expm1,
}

BINARY_FUNCS: dict[str, Callable] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
    "floordiv": np.floor_divide, "mod": np.mod, "fmod": np.fmod, "pow": _power,
    "max": np.maximum, "min": np.minimum, "and": np.logical_and, "or": np.logical_or,
    "xor": np.logical_xor, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal, "bitand": np.bitwise_and,
    "bitor": np.bitwise_or, "bitxor": np.bitwise_xor, "shl": np.left_shift,
    "shr": np.right_shift, "truncdiv": _trunc_div,
}

REDUCE_OPS = {"sum", "prod", "max", "min", "mean", "argmax", "argmin"}

_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%",
            "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "&&",
            "or": "||"}


def walk(expr: Expr):
    """Yield every node of ``expr`` once (pre-order, shared sub-trees visited once)."""
    seen: set[int] = set()
    stack = [expr]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend(reversed(e.children()))


def format_expr(e: Expr) -> str:
    """Readable one-line form of an expression."""
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, BinOp):
        if e.op in _SYMBOLS:
            return f"({format_expr(e.a)} {_SYMBOLS[e.op]} {format_expr(e.b)})"
        return f"{e.op}({format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, UnaryOp):
        return f"{e.op}({format_expr(e.a)})"
    if isinstance(e, Cast):
        return f"cast<{e.dtype}>({format_expr(e.a)})"
    if isinstance(e, IfThenElse):
        return f"select({format_expr(e.cond)}, {format_expr(e.then)}, {format_expr(e.other)})"
    if isinstance(e, TensorElement):
        return f"{e.tensor.name}[{', '.join(format_expr(i) for i in e.indices)}]"
    if isinstance(e, Reduce):
        vs = ", ".join(f"{v.name}<{v.extent}" for v in e.vars)
        return f"{e.op}[{vs}]({format_expr(e.body)})"
    return object.__repr__(e)


def simplify_index(e: Expr) -> Expr:
    """Fold constant arithmetic in index expressions (``i*1 + 0`` → ``i``)."""
    if isinstance(e, BinOp):
        a, b = simplify_index(e.a), simplify_index(e.b)
        if isinstance(a, Const) and isinstance(b, Const) and e.op in ("add", "sub", "mul"):
            return Const({"add": a.value + b.value, "sub": a.value - b.value, "mul": a.value * b.value}[e.op])
        if e.op == "add":
            if isinstance(b, Const) and b.value == 0:
                return a
            if isinstance(a, Const) and a.value == 0:
                return b
        if e.op == "sub" and isinstance(b, Const) and b.value == 0:
            return a
        if e.op == "mul":
            if isinstance(b, Const) and b.value == 1:
                return a
            if isinstance(a, Const) and a.value == 1:
                return b
            if (isinstance(b, Const) and b.value == 0) or (isinstance(a, Const) and a.value == 0):
                return Const(0)
        if e.op in ("floordiv",) and isinstance(b, Const) and b.value == 1:
            return a
        if a is e.a and b is e.b:
            return e
        return BinOp(e.op, a, b)
    return e


def affine_form(e: Expr) -> tuple[dict[Var, int], int] | None:
    """Decompose an index expression as ``sum(coef[v] * v) + const`` with integer coefficients.

    Returns ``None`` when the expression is not affine in the axis variables (``//``, ``%``,
    tensor reads, selects...).
    """
    if isinstance(e, Var):
        return {e: 1}, 0
    if isinstance(e, Const):
        if isinstance(e.value, (bool, float)) or not isinstance(e.value, int):
            return None
        return {}, int(e.value)
    if isinstance(e, UnaryOp) and e.op == "neg":
        f = affine_form(e.a)
        return None if f is None else ({v: -c for v, c in f[0].items()}, -f[1])
    if isinstance(e, BinOp) and e.op in ("add", "sub", "mul"):
        fa, fb = affine_form(e.a), affine_form(e.b)
        if fa is None or fb is None:
            return None
        (ca, ka), (cb, kb) = fa, fb
        if e.op == "mul":
            if not ca:
                return {v: ka * c for v, c in cb.items() if ka * c}, ka * kb
            if not cb:
                return {v: kb * c for v, c in ca.items() if kb * c}, ka * kb
            return None
        sign = 1 if e.op == "add" else -1
        out = dict(ca)
        for v, c in cb.items():
            out[v] = out.get(v, 0) + sign * c
            if out[v] == 0:
                del out[v]
        return out, ka + sign * kb
    return None


def affine_expr(terms, const: int = 0) -> Expr:
    """``sum(coef * e) + const`` over ``terms = [(e, coef), ...]`` without ``* 1`` or ``+ 0`` noise
    (what :func:`affine_form` reads back)."""
    res = None
    for e, c in terms:
        if c == 0:
            continue
        if res is None:
            res = e if c == 1 else -e if c == -1 else e * c
        elif c > 0:
            res = res + (e if c == 1 else e * c)
        else:
            res = res - (e if c == -1 else e * (-c))
    if res is None:
        return Const(const)
    if const > 0:
        return res + const
    if const < 0:
        return res - (-const)
    return res


def rebuild(e: Expr, kids: list[Expr]) -> Expr:
    """``e`` with new children (``kids`` in ``e.children()`` order); leaves are returned as is."""
    if isinstance(e, BinOp):
        return BinOp(e.op, kids[0], kids[1])
    if isinstance(e, UnaryOp):
        return UnaryOp(e.op, kids[0])
    if isinstance(e, Cast):
        return Cast(kids[0], e.dtype)
    if isinstance(e, IfThenElse):
        return IfThenElse(kids[0], kids[1], kids[2])
    if isinstance(e, TensorElement):
        return TensorElement(e.tensor, tuple(kids))
    if isinstance(e, Reduce):
        return Reduce(e.vars, kids[0], e.op)
    return e


def free_vars(e: Expr) -> set[Var]:
    """Axis variables used in ``e`` (reduction variables bound inside ``e`` included)."""
    return {n for n in walk(e) if isinstance(n, Var)}


def format_index_list(indices: Sequence[Expr]) -> str:
    return ", ".join(format_expr(i) for i in indices)


_BOOL_OPS = {"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "xor"}
_BOOL_UNARY = {"not", "isnan", "isinf", "isposinf", "isneginf"}


def infer_dtype(e: Expr) -> str | None:
    """The dtype of an expression's value, or ``None`` for weakly typed constants alone.

    Follows numpy promotion, with weak Python scalars adopting the other operand's dtype.
    """
    memo: dict[int, str | None] = {}

    def go(x: Expr) -> str | None:
        k = id(x)
        if k in memo:
            return memo[k]
        if isinstance(x, TensorElement):
            r = x.tensor.dtype
        elif isinstance(x, Var):
            r = "int64"
        elif isinstance(x, Const):
            r = x.dtype
        elif isinstance(x, Cast):
            r = x.dtype
        elif isinstance(x, BinOp):
            if x.op in _BOOL_OPS:
                r = "bool"
            else:
                r = _promote(go(x.a), go(x.b), x.a, x.b)
                if x.op == "div" and r is not None and dtype_kind(r) in "iub":
                    r = "float64"
        elif isinstance(x, UnaryOp):
            r = "bool" if x.op in _BOOL_UNARY else go(x.a)
        elif isinstance(x, IfThenElse):
            r = _promote(go(x.then), go(x.other), x.then, x.other)
        elif isinstance(x, Reduce):
            r = "int64" if x.op in ("argmax", "argmin") else go(x.body)
        else:
            r = None
        memo[k] = r
        return r

    return go(e)


def _promote(da: str | None, db: str | None, a: Expr, b: Expr) -> str | None:
    if da is None and db is None:
        va = a.value if isinstance(a, Const) else 0
        vb = b.value if isinstance(b, Const) else 0
        if isinstance(va, float) or isinstance(vb, float):
            return "float32"
        return "int64"
    if da is None or db is None:
        strong = da or db
        weak = a if da is None else b
        if isinstance(weak, Const) and isinstance(weak.value, float) and dtype_kind(strong) in "iub":
            return "float64"
        return strong
    if da == "bfloat16" or db == "bfloat16":
        return "bfloat16"
    return str(np.result_type(da, db))


#: The floating-point types numpy has through ml_dtypes (installed with onnx) only.
ML_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")


def dtype_kind(dtype) -> str:
    """numpy's kind letter of ``dtype`` (``"f"``, ``"i"``, ``"u"``, ``"b"``...), ``"f"`` for
    ml_dtypes' floats (:data:`ML_FLOATS`), whose own kind is ``"V"`` or that numpy does not know."""
    return "f" if str(dtype) in ML_FLOATS else np.dtype(dtype).kind


def sum_type(dtype) -> np.dtype:
    """The numpy type a reference (an op's ``numpy``) adds and multiplies values of ``dtype`` in:
    float32 for float16 and bfloat16 (each result rounded once to the half type, as the kernels
    do; numpy's own half sums may round every partial sum), ``dtype`` itself otherwise."""
    return np.dtype(np.float32) if str(dtype) in ("float16", "bfloat16") else np.dtype(dtype)


def numpy_type(name: str) -> np.dtype:
    """The numpy type of a dtype name (:data:`ML_FLOATS`: ml_dtypes')."""
    if name in ML_FLOATS:
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)
