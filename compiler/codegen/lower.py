"""Lowering of compute definitions to loop nests (target independent).

A :class:`~shardflow.compiler.ir.task.GridCompute` says what one output element is; this module
decides *how* to compute all of them: which loops, which order, where reductions run and which
scalars are kept in locals. The result is a small statement tree (:class:`Loop`, :class:`FlatLoop`,
:class:`Let`, :class:`Accumulate`, :class:`If`, :class:`Store`...) whose scalar expressions are the
IR's own :class:`~shardflow.compiler.ir.expr.Expr` nodes, made *pure*: no :class:`Reduce` left (each
became a loop and a :class:`Local`), no select whose untaken side could read out of bounds (those
became :class:`If` statements), tensor reads bound to :class:`Buffer` objects with every index proven
in bounds or clamped. Emitters (``cpp.py``) print that tree; they make no decisions of their own.

Decisions, in order (see ``rfcs/0002-codegen.md``):

* **Loops.** One loop per output axis, outermost first, so the innermost loop walks the contiguous
  last dim and stores contiguously (auto-vectorization). The outer axes are flattened into one loop
  (:class:`FlatLoop`) that the emitter may parallelize. A last axis read only modulo one period
  (Tile's ``x[..., a % n]``, a heads merge's ``x[..., a // d, a % d]``) is split into two loops, the
  inner one over the period (:func:`_split_periodic_axis`): contiguous reads, no division per element.
* **Reductions.** A reduction whose free variables are all output axes is computed once per value
  of those axes: *hoisted* to the loop level of its innermost axis when no earlier axis is missing
  (softmax over the last axis: a max loop and a sum loop per row, then the elementwise loop), else
  *materialized* into a temporary over its free variables by its own loop nest (softmax over a
  middle axis). A reduction nested in another one's body that misses some enclosing loop variable is
  materialized too (the scores of an attention). Materialized temporaries are shared by reductions
  that are equal up to renaming of their variables.
* **Reduction loops.** A reduction's innermost variables that index consecutive dims of every read merge
  into one loop; reductions over an axis before the innermost output axis, when the reads are contiguous
  along that axis, accumulate a row of it per step (:meth:`_NestLowerer._interchanged`).
* **Shared expressions.** An expression object used more than once is computed once per scope and
  kept in a local.
* **Selects.** ``IfThenElse`` becomes a ternary when both sides are safe to evaluate (every read
  provably in bounds, no reduction), else a real branch. Inside a branch the condition refines the
  known ranges of index expressions (``i < 3`` makes ``i`` at most 2), which proves most guarded
  reads (padding, concatenation) in bounds. A read that still cannot be proven (indices taken from
  data, as in Gather) is clamped into the tensor, as the reference evaluator does.
* **Types.** Every node's value type follows numpy, as the reference evaluator computes it
  (:func:`value_dtype`), including numpy's accumulator types for ``sum``/``prod``/``mean``.
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..errors import ShardflowError
from ..ir.expr import (BINARY_FUNCS, ML_FLOATS, UNARY_FUNCS, BinOp, Cast, Const, Expr, IfThenElse, Reduce,
                       TensorElement, UnaryOp, Var, affine_form, dtype_kind, walk, rebuild)
from ..ir.task import ExternCompute, GridCompute, Task, TensorInput

__all__ = ["CodegenError", "Buffer", "Local", "Kernel", "Loop", "FlatLoop", "Block", "Let", "Declare", "Assign",
           "Accumulate", "Store", "If", "Comment", "LocalArray", "lower_task", "lowerable", "why_not_lowerable", "value_dtype",
           "SUPPORTED_DTYPES", "FLOAT_FUNCS", "kept_select"]

log = logging.getLogger(__name__)


def kept_select(value: Expr, axes: Sequence, is_kept: Callable[[object], bool]) -> tuple[Expr, Expr] | None:
    """``(c, e)`` when ``value`` is ``c ? x[i] : e`` with ``x`` a tensor ``is_kept`` accepts (the input
    the output is written over) read at the output's own index ``i`` (``axes``): where ``c`` holds
    the element is already there (a KV cache's present over its past). Both code generators store
    only where ``c`` fails (their ``in_place``)."""
    if not isinstance(value, IfThenElse):
        return None
    x = value.then
    if (isinstance(x, TensorElement) and is_kept(x.tensor) and len(x.indices) == len(axes)
            and all(i is a for i, a in zip(x.indices, axes))):
        return value.cond, value.other
    return None


class CodegenError(ShardflowError):
    """An op cannot be turned into a kernel (unsupported construct, dtype or size)."""


#: Tensor dtypes the emitters store and load.
SUPPORTED_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                    "float16", "float32", "float64", *ML_FLOATS)  # (bfloat16 and float8: codegen/float8.py)

#: Unary functions that numpy computes in floating point (integer inputs give floats).
FLOAT_FUNCS = frozenset({"exp", "log", "sqrt", "rsqrt", "sin", "cos", "tan", "asin", "acos", "atan", "sinh",
                         "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "log1p", "expm1"})
_BOOL_BINARY = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "xor"})
_BOOL_UNARY = frozenset({"not", "isnan", "isinf", "isposinf", "isneginf"})
_CMP = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})
#: Functions worth caching a row of values for (see ``_NestLowerer._row_caches``).
_COSTLY = frozenset({"exp", "log", "tanh", "erf", "sigmoid", "sin", "cos", "log1p", "expm1"})


def _worth_caching(body: Expr) -> bool:
    """Whether a row cache of ``body``'s values beats recomputing it: a costly function, a
    division or rounding, or more than a few operations."""
    ops = 0
    for x in walk(body):
        if (isinstance(x, UnaryOp) and (x.op in _COSTLY or x.op == "round")
                or isinstance(x, BinOp) and x.op in ("div", "pow")):
            return True
        ops += isinstance(x, (BinOp, UnaryOp, Cast, IfThenElse))
    return ops > 6


#: Largest temporary (bytes) a materialized reduction may use; larger ones are recomputed inline.
MAX_TEMP_BYTES = 1 << 28
#: Estimated scalar operations below which a loop nest runs on one thread.
PARALLEL_MIN_WORK = 1 << 15
#: Values of the inner loops below which an output axis before them stays a loop of its own rather than
#: being flattened with the outer ones, as long as :data:`FLAT_MIN` rows are left to the flattened loop.
INNER_MIN = 64
FLAT_MIN = 64


# ---------------------------------------------------------------------------------------------
# lowered IR
# ---------------------------------------------------------------------------------------------

class Buffer:
    """A kernel argument or temporary: contiguous row-major ``shape`` of ``dtype``.

    ``role`` is ``"input"``, ``"output"`` or ``"temp"``; ``index`` is the position in the kernel's
    input or output array (or among the temporaries).
    """

    __slots__ = ("name", "shape", "dtype", "role", "index")

    def __init__(self, name: str, shape: Sequence[int], dtype: str, role: str, index: int):
        self.name, self.shape, self.dtype, self.role, self.index = name, tuple(int(d) for d in shape), dtype, role, index

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))

    @property
    def strides(self) -> tuple[int, ...]:
        st, acc = [], 1
        for d in reversed(self.shape):
            st.append(acc)
            acc *= d
        return tuple(reversed(st))

    def __repr__(self):
        return f"{self.name}{list(self.shape)}:{self.dtype}"


class Local(Expr):
    """A scalar computed earlier in the current scope (a C local variable)."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype: str):
        self.name, self.dtype = name, dtype


@dataclass
class Loop:
    """``for var in range(extent)``; ``reduction`` = ``(acc, op)`` when the body only accumulates
    into ``acc`` (the emitter may vectorize it as a reduction); ``simd`` when its iterations are
    independent and the emitter should vectorize it (``omp simd``)."""
    var: Var
    extent: int
    body: list
    parallel: bool = False
    reduction: tuple | None = None
    simd: bool = False


def short_stores(loop: Loop) -> bool:
    """Whether ``loop`` is a short loop (fewer than :data:`INNER_MIN` iterations) of lets and stores alone,
    which the emitter marks ``omp simd``: in the threads' outlined function GCC no longer sees the arguments'
    ``__restrict__`` and vectorizes such a loop behind a check that they do not overlap, made on every entry
    (a blocked layout's 16 lanes ran 3x slower than the same values as long rows). Its iterations are
    independent: a nest reads what it writes at most at the same index (an output written over its input in
    place, ``reads_only_at_own_index``)."""
    return loop.extent < INNER_MIN and loop.reduction is None and not loop.parallel \
        and all(isinstance(x, (Let, Store)) for x in loop.body)


@dataclass
class FlatLoop:
    """One loop over the product of ``vars``' extents (row-major), each var recomputed from the
    flat counter; ``parallel`` asks the emitter to split it across threads."""
    vars: list
    body: list
    parallel: bool = False


@dataclass
class Block:
    """A nested scope."""
    body: list
    comment: str = ""


@dataclass
class Let:
    """Declare ``local`` initialised to ``value``."""
    local: Local
    value: Expr


@dataclass
class Declare:
    """Declare ``local`` without a value (assigned in the branches of an :class:`If`)."""
    local: Local


@dataclass
class Assign:
    local: Local
    value: Expr


@dataclass
class Accumulate:
    """``acc = acc <op> value`` for ``sum``/``prod``/``max``/``min`` (``mean`` accumulates a sum);
    for ``argmax``/``argmin`` ``acc`` is the best value and ``index`` (a :class:`Local`) its
    position, updated to ``index_value`` on a strictly better value (first index wins ties; NaN wins
    over numbers, the first NaN over later ones)."""
    acc: Local
    op: str
    value: Expr
    index: Local | None = None
    index_value: Expr | None = None


@dataclass
class Store:
    buffer: Buffer
    indices: tuple
    value: Expr


@dataclass
class If:
    cond: Expr
    then: list
    other: list


@dataclass
class Comment:
    text: str


@dataclass
class LocalArray:
    """Declare a small array local to the current scope (``buffer.role == "local"``)."""
    buffer: Buffer


@dataclass
class Kernel:
    """One op's kernel: argument buffers, temporaries and the statement tree."""
    op_name: str
    op_type: str
    inputs: list
    outputs: list
    temps: list = field(default_factory=list)
    body: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# dtypes with numpy semantics
# ---------------------------------------------------------------------------------------------

def _norm_dtype(dt: str | None) -> str | None:
    if dt is None:
        return None
    return "float32" if dt in ML_FLOATS else str(np.dtype(dt))


def _kind(dt: str) -> str:
    return dtype_kind(dt)


def _float_result(dt: str) -> str:
    """numpy's float type for a float-only ufunc applied to ``dt``."""
    if _kind(dt) == "f":
        return dt
    if dt in ("bool", "int8", "uint8"):
        return "float16"
    if dt in ("int16", "uint16"):
        return "float32"
    return "float64"


def _weak_kind(c: Const) -> str:
    v = c.value
    if isinstance(v, bool):
        return "b"
    if isinstance(v, int):
        return "i"
    return "f"


def promote(a: Expr, b: Expr, memo: dict) -> str:
    """numpy's result dtype of a binary op on ``a`` and ``b`` (Python scalars are weak, NEP 50)."""
    da, db = value_dtype(a, memo), value_dtype(b, memo)
    if da is None and db is None:
        ka, kb = _weak_kind(a), _weak_kind(b)
        if "f" in (ka, kb):
            return "float64"
        if ka == kb == "b":
            return "bool"
        return "int64"
    if da is None or db is None:
        strong = da or db
        weak = a if da is None else b
        wk = _weak_kind(weak)
        if wk == "f" and _kind(strong) in "iub":
            return "float64"
        if wk == "i" and _kind(strong) == "b":
            return "int64"
        return strong
    return str(np.result_type(da, db))


def value_dtype(e: Expr, memo: dict | None = None) -> str | None:
    """The numpy dtype of ``e``'s value as the reference evaluator computes it (``None`` for a
    weakly typed constant). ``memo`` caches results by node id across calls."""
    if memo is None:
        memo = {}
    k = id(e)
    if k in memo:
        return memo[k][1]
    if isinstance(e, Var):
        r = "int64"
    elif isinstance(e, Const):
        r = _norm_dtype(e.dtype)
    elif isinstance(e, Local):
        r = e.dtype
    elif isinstance(e, TensorElement):
        r = _norm_dtype(e.tensor.dtype)
    elif isinstance(e, Cast):
        r = _norm_dtype(e.dtype)
    elif isinstance(e, BinOp):
        if e.op in _BOOL_BINARY:
            r = "bool"
        else:
            r = promote(e.a, e.b, memo)
            if e.op == "div" and _kind(r) in "iub":
                r = "float64"
    elif isinstance(e, UnaryOp):
        d = value_dtype(e.a, memo)
        if e.op in _BOOL_UNARY:
            r = "bool"
        elif d is None:
            r = "float64" if (e.op in FLOAT_FUNCS or _weak_kind(e.a) == "f") else "int64"
        elif e.op in FLOAT_FUNCS:
            r = _float_result(d)
        else:
            r = d
    elif isinstance(e, IfThenElse):
        r = promote(e.then, e.other, memo)
    elif isinstance(e, Reduce):
        d = value_dtype(e.body, memo) or ("float64" if _weak_kind(e.body) == "f" else "int64")
        if e.op in ("argmax", "argmin"):
            r = "int64"
        elif e.op in ("sum", "prod"):
            if d == "bool" or (_kind(d) == "i" and np.dtype(d).itemsize < 8):
                r = "int64"
            elif _kind(d) == "u" and np.dtype(d).itemsize < 8:
                r = "uint64"
            else:
                r = d
        elif e.op == "mean":
            r = "float64" if _kind(d) in "iub" else d
        else:
            r = d
    else:
        raise CodegenError(f"cannot lower expression node {type(e).__name__}")
    memo[k] = (e, r)  # keep e alive: ids must not be reused while the memo lives
    return r


def accumulator_dtype(r: Reduce, memo: dict) -> str:
    """The dtype a reduction accumulates in (its value dtype; float16 is accumulated in float32 by
    the emitter's compute type)."""
    return value_dtype(r, memo) if r.op not in ("argmax", "argmin") else (value_dtype(r.body, memo) or "float64")


# ---------------------------------------------------------------------------------------------
# structure helpers
# ---------------------------------------------------------------------------------------------



def transform(e: Expr, fn, memo: dict | None = None) -> Expr:
    """Bottom-up rewrite: ``fn(node, rebuilt_node)`` returns a replacement or ``None`` to keep the
    rebuilt node. Shared sub-trees stay shared (memo by id)."""
    if memo is None:
        memo = {}
    def go(x: Expr) -> Expr:
        k = id(x)
        if k in memo:
            return memo[k][1]
        kids = x.children()
        new_kids = [go(c) for c in kids]
        y = x if all(a is b for a, b in zip(kids, new_kids)) else rebuild(x, new_kids)
        z = fn(x, y)
        if z is None:
            z = y
        memo[k] = (x, z)
        return z

    return go(e)


def hashcons(root: Expr) -> Expr:
    """``root`` with structurally equal sub-trees made one object (reductions compared with their
    bound variables renamed by position), so that the lowering computes each value once.

    Inlining a producer into each of its reads copies its tree per read: a QuantizeLinear's NaN
    test and its select both read the rounded value, and down a quantized model's chain of such
    steps the copies doubled per step, reductions among them (a softmax's max recomputed per
    element of the row)."""
    canon: dict = {}
    interner = _Interner()

    def fn(old: Expr, new: Expr):
        if isinstance(new, Reduce):
            k = ("R", new.op, tuple(v.extent for v in new.vars), interner.key(new.body, new.vars))
        elif isinstance(new, Const):
            k = ("C", repr(new.value), type(new.value).__name__, new.dtype)
        elif isinstance(new, TensorElement):
            k = ("T", id(new.tensor)) + tuple(id(c) for c in new.indices)
        elif isinstance(new, BinOp):
            k = ("B", new.op, id(new.a), id(new.b))
        elif isinstance(new, UnaryOp):
            k = ("U", new.op, id(new.a))
        elif isinstance(new, Cast):
            k = ("K", new.dtype, id(new.a))
        elif isinstance(new, IfThenElse):
            k = ("S", id(new.cond), id(new.then), id(new.other))
        else:  # variables keep their identity
            return None
        return canon.setdefault(k, new)

    return transform(root, fn)


def substitute(e: Expr, mapping: dict, memo: dict | None = None) -> Expr:
    """``e`` with each :class:`Var` in ``mapping`` (by identity) replaced; ``memo`` as
    :func:`transform`'s (shared by calls that must map a common sub-tree to one object)."""
    by_id = {id(v): x for v, x in mapping.items()}
    return transform(e, lambda old, new: by_id.get(id(old)) if isinstance(old, Var) else None, memo)


def free_vars(e: Expr, memo: dict) -> frozenset:
    """Variables ``e`` depends on that it does not bind itself (memoized by id)."""
    k = id(e)
    if k in memo:
        return memo[k][1]
    if isinstance(e, Var):
        r = frozenset((e,))
    elif isinstance(e, Reduce):
        r = free_vars(e.body, memo) - frozenset(e.vars)
    else:
        r = frozenset().union(*(free_vars(c, memo) for c in e.children())) if e.children() else frozenset()
    memo[k] = (e, r)
    return r


def _refcounts(root: Expr) -> dict[int, int]:
    """How many parents each node has in the DAG below ``root``."""
    counts: dict[int, int] = {}
    seen: set[int] = set()
    stack = [root]
    counts[id(root)] = 1
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        for c in x.children():
            counts[id(c)] = counts.get(id(c), 0) + 1
            stack.append(c)
    return counts


class _Interner:
    """Structural keys: equal sub-trees get equal small ints (bound variables renamed)."""

    def __init__(self):
        self.table: dict = {}

    def intern(self, t) -> int:
        v = self.table.get(t)
        if v is None:
            v = self.table[t] = len(self.table)
        return v

    def key(self, e: Expr, free_order: Sequence[Var] = (), memo: dict | None = None,
            opaque: frozenset = frozenset()) -> int:
        """Key of ``e`` with ``free_order[p]`` renamed to position ``p`` and bound (reduction)
        variables numbered in traversal order; other variables, and the nodes whose ids are in
        ``opaque``, keep their identity."""
        memo = {} if memo is None else memo
        pos = {id(v): p for p, v in enumerate(free_order)}
        bound: dict[int, int] = {}

        def go(x: Expr) -> int:
            k = id(x)
            if k in memo:
                return memo[k][1]
            if k in opaque:
                t = ("O", k)
            elif isinstance(x, Var):
                if id(x) in pos:
                    t = ("F", pos[id(x)])
                elif id(x) in bound:
                    t = ("B", bound[id(x)], x.extent)
                else:
                    t = ("V", id(x))
            elif isinstance(x, Const):
                t = ("C", repr(x.value), type(x.value).__name__, x.dtype)
            elif isinstance(x, Local):
                t = ("L", x.name)
            elif isinstance(x, TensorElement):
                t = ("T", id(x.tensor)) + tuple(go(i) for i in x.indices)
            elif isinstance(x, Reduce):
                for v in x.vars:
                    bound.setdefault(id(v), len(bound))
                t = ("R", x.op, tuple(go(v) for v in x.vars), go(x.body))
            elif isinstance(x, BinOp):
                t = ("B2", x.op, go(x.a), go(x.b))
            elif isinstance(x, UnaryOp):
                t = ("U", x.op, go(x.a))
            elif isinstance(x, Cast):
                t = ("K", x.dtype, go(x.a))
            elif isinstance(x, IfThenElse):
                t = ("S", go(x.cond), go(x.then), go(x.other))
            else:
                t = ("?", id(x))
            r = self.intern(t)
            memo[k] = (x, r)
            return r

        return go(e)


# ---------------------------------------------------------------------------------------------
# intervals (index range analysis)
# ---------------------------------------------------------------------------------------------

_INF = math.inf
_UNKNOWN = (-_INF, _INF)


def _iv_add(a, b):
    return (a[0] + b[0], a[1] + b[1])


def _iv_neg(a):
    return (-a[1], -a[0])


def _mul(x, y):
    if x == 0 or y == 0:
        return 0
    return x * y


def _iv_mul(a, b):
    ps = [_mul(x, y) for x in a for y in b]
    return (min(ps), max(ps))


def _iv_meet(a, b):
    return (max(a[0], b[0]), min(a[1], b[1]))


def _dtype_range(dt: str | None):
    if dt is None:
        return _UNKNOWN
    if dt == "bool":
        return (0, 1)
    if _kind(dt) in "iu":
        info = np.iinfo(dt)
        return (int(info.min), int(info.max))
    return _UNKNOWN


class _Ranges:
    """Interval analysis of pure index expressions under refinements from branch conditions."""

    def __init__(self, interner: _Interner, dtypes: dict):
        self.interner = interner
        self.keymemo: dict = {}
        self.dtypes = dtypes
        self.local_iv: dict[str, tuple] = {}
        self.stack: list[dict[int, tuple]] = [{}]

    def key(self, e: Expr) -> int:
        return self.interner.key(e, (), self.keymemo)

    @property
    def refined(self) -> dict[int, tuple]:
        return self.stack[-1]

    def interval(self, e: Expr, memo: dict | None = None) -> tuple:
        memo = {} if memo is None else memo
        k = id(e)
        if k in memo:
            return memo[k]
        r = self._interval(e, memo)
        ref = self.refined.get(self.key(e))
        if ref is not None:
            r = _iv_meet(r, ref)
        memo[k] = r
        return r

    def _interval(self, e: Expr, memo) -> tuple:
        if isinstance(e, Var):
            return (0, max(e.extent - 1, 0))
        if isinstance(e, Const):
            v = e.value
            if isinstance(v, (bool, int)):
                return (int(v), int(v))
            if isinstance(v, float) and math.isfinite(v):
                return (v, v)
            return _UNKNOWN
        if isinstance(e, Local):
            return self.local_iv.get(e.name, _dtype_range(e.dtype))
        if isinstance(e, TensorElement):
            return _dtype_range(_norm_dtype(e.tensor.dtype))
        if isinstance(e, BinOp):
            a, b = self.interval(e.a, memo), self.interval(e.b, memo)
            op = e.op
            if op == "add":
                return _iv_add(a, b)
            if op == "sub":
                return _iv_add(a, _iv_neg(b))
            if op == "mul":
                return _iv_mul(a, b)
            if op == "max":
                return (max(a[0], b[0]), max(a[1], b[1]))
            if op == "min":
                return (min(a[0], b[0]), min(a[1], b[1]))
            if op in ("floordiv", "truncdiv") and b[0] == b[1] and isinstance(b[0], int) and b[0] > 0:
                if op == "truncdiv" and a[0] < 0:
                    return _UNKNOWN
                c = b[0]
                lo = a[0] // c if a[0] != -_INF else -_INF
                hi = a[1] // c if a[1] != _INF else _INF
                return (lo, hi)
            if op == "mod" and b[0] == b[1] and isinstance(b[0], int) and b[0] > 0:
                if a[0] >= 0 and a[1] < b[0]:
                    return a
                return (0, b[0] - 1)
            if op in _BOOL_BINARY:
                return (0, 1)
            return _UNKNOWN
        if isinstance(e, UnaryOp):
            if e.op == "neg":
                return _iv_neg(self.interval(e.a, memo))
            if e.op in _BOOL_UNARY:
                return (0, 1)
            return _UNKNOWN
        if isinstance(e, Cast):
            dt = _norm_dtype(e.dtype)
            a = self.interval(e.a, memo)
            if dt == "bool":
                return (0, 1)
            if _kind(dt) in "iu":
                rng = _dtype_range(dt)
                lo = math.trunc(a[0]) if math.isfinite(a[0]) else a[0]
                hi = math.trunc(a[1]) if math.isfinite(a[1]) else a[1]
                if lo >= rng[0] and hi <= rng[1]:
                    return (lo, hi)
                return rng
            return a
        if isinstance(e, IfThenElse):
            a, b = self.interval(e.then, memo), self.interval(e.other, memo)
            return (min(a[0], b[0]), max(a[1], b[1]))
        return _UNKNOWN

    # refinements --------------------------------------------------------------------------
    def push(self, cond: Expr | None, positive: bool):
        new = dict(self.refined)
        if cond is not None:
            self._refine(cond, positive, new)
        self.stack.append(new)

    def pop(self):
        self.stack.pop()

    def _refine(self, c: Expr, positive: bool, out: dict):
        if isinstance(c, UnaryOp) and c.op == "not":
            self._refine(c.a, not positive, out)
            return
        if isinstance(c, BinOp):
            if (c.op == "and" and positive) or (c.op == "or" and not positive):
                self._refine(c.a, positive, out)
                self._refine(c.b, positive, out)
                return
            if c.op in _CMP:
                self._refine_cmp(c, positive, out)

    def _refine_cmp(self, c: BinOp, positive: bool, out: dict):
        op = c.op
        if not positive:
            op = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": None, "ne": "eq"}[op]
            if op is None:
                return
        elif op == "ne":
            return
        a, b = c.a, c.b
        ib = self.interval(b)
        ia = self.interval(a)
        if not (ib[0] == ib[1] and isinstance(ib[0], int)):
            if ia[0] == ia[1] and isinstance(ia[0], int):
                a, b, ia, ib = b, a, ib, ia
                op = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}[op]
            else:
                return
        dt = value_dtype(a, self.dtypes)
        if dt is None or _kind(dt) not in "iub":
            return
        k = ib[0]
        bound = {"lt": (-_INF, k - 1), "le": (-_INF, k), "gt": (k + 1, _INF), "ge": (k, _INF), "eq": (k, k)}[op]
        self._meet_key(a, bound, out)
        aff = affine_form(a)
        if aff is not None:
            coefs, const = aff
            if len(coefs) == 1:
                (v, s), = coefs.items()
                if s in (1, -1):
                    vb = (bound[0] - const, bound[1] - const) if s == 1 else (const - bound[1], const - bound[0])
                    self._meet_key(v, vb, out)

    def _meet_key(self, e: Expr, bound: tuple, out: dict):
        key = self.key(e)
        out[key] = _iv_meet(out.get(key, _UNKNOWN), bound)

    def decide(self, c: Expr) -> bool | None:
        """The value of the integer condition ``c`` where the intervals (under the current
        refinements) prove it, else None. A concatenation read at a constant index, or inside a
        branch that already fixed the index's range, is then lowered as the one part it reads."""
        if isinstance(c, Const) and isinstance(c.value, (bool, int)):
            return bool(c.value)
        if isinstance(c, UnaryOp) and c.op == "not":
            d = self.decide(c.a)
            return None if d is None else not d
        if not isinstance(c, BinOp):
            return None
        if c.op in ("and", "or"):
            da, db = self.decide(c.a), self.decide(c.b)
            short = c.op == "or"  # (the value that settles it)
            if short in (da, db):
                return short
            return None if da is None or db is None else not short
        if c.op not in _CMP:
            return None
        for side in (c.a, c.b):
            dt = value_dtype(side, self.dtypes)
            kind = _weak_kind(side) if dt is None and isinstance(side, Const) else _kind(dt) if dt else "f"
            if kind not in "iub":
                return None
        (alo, ahi), (blo, bhi) = self.interval(c.a), self.interval(c.b)
        op = c.op
        if op in ("gt", "ge"):
            (alo, ahi), (blo, bhi), op = (blo, bhi), (alo, ahi), {"gt": "lt", "ge": "le"}[op]
        if op == "lt":
            return True if ahi < blo else False if alo >= bhi else None
        if op == "le":
            return True if ahi <= blo else False if alo > bhi else None
        equal = True if alo == ahi == blo == bhi else False if ahi < blo or bhi < alo else None
        return equal if op == "eq" or equal is None else not equal

    def in_bounds(self, idx: Expr, extent: int) -> bool:
        lo, hi = self.interval(idx)
        return lo >= 0 and hi <= extent - 1


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------

def why_not_lowerable(op) -> str | None:
    """The reason ``op`` gets no generated kernel, or ``None`` when it can be lowered."""
    if getattr(op, "collective", ""):
        return f"collective {op.collective} (run by the runtime's communicator)"
    task: Task = op.task
    if task.is_extern:
        reasons = sorted({o.reason for o in task.outputs if isinstance(o, ExternCompute)})
        return f"extern output ({'; '.join(reasons)})"
    for t in list(task.inputs) + list(task.outputs):
        dt = getattr(t, "dtype", None)
        if dt not in SUPPORTED_DTYPES:
            return f"dtype {dt} of {t.name} is not supported by the cpu code generator"
    pending, seen = list(task.outputs), set()
    while pending:  # the outputs' expressions and those of the grid computes they read (a fused group's members)
        o = pending.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        for n in walk(o.value):
            if isinstance(n, TensorElement) and isinstance(n.tensor, GridCompute):
                pending.append(n.tensor)
            if isinstance(n, (Var, Const)):
                continue
            if isinstance(n, BinOp) and n.op not in BINARY_FUNCS:
                return f"binary op {n.op}"
            if isinstance(n, UnaryOp) and n.op not in UNARY_FUNCS:
                return f"unary op {n.op}"
            if isinstance(n, Cast) and n.dtype not in SUPPORTED_DTYPES:
                return f"a cast to {n.dtype}, a dtype the code generators do not store"
            if isinstance(n, TensorElement):
                if not isinstance(n.tensor, (TensorInput, GridCompute)):
                    return f"read of {type(n.tensor).__name__}"
                if n.tensor.dtype not in SUPPORTED_DTYPES:
                    return f"dtype {n.tensor.dtype} of {n.tensor.name}"
            elif not isinstance(n, (BinOp, UnaryOp, Cast, IfThenElse, Reduce)):
                return f"expression node {type(n).__name__}"
    return None


def lowerable(op) -> bool:
    """Whether the code generators can turn ``op`` into a kernel.

    Collectives (``op.collective`` set; the runtime runs them with its communicator) and ops with an
    extern output (TopK: sorting) are not lowerable, nor ops with dtypes outside
    :data:`SUPPORTED_DTYPES`.
    """
    return why_not_lowerable(op) is None


# ---------------------------------------------------------------------------------------------
# lowering
# ---------------------------------------------------------------------------------------------

@dataclass
class _Ctx:
    """Where an expression is evaluated: the loop variables enclosing it (outer first) and
    whether a reduction found there may be hoisted in the current nest."""
    scope: tuple
    hoist: bool


class _NestLowerer:
    """Lowers one output (or one materialized temporary) to a loop nest."""

    def __init__(self, kl: "KernelLowerer", axes: Sequence[Var], value: Expr, target: Buffer):
        self.kl, self.axes, self.value, self.target = kl, tuple(axes), value, target
        self.pos = {id(a): d for d, a in enumerate(self.axes)}
        self.fv_memo: dict = {}
        self.pre: list = []
        self.hoisted: dict[int, list[Expr]] = {}
        self.rewrite_memo: dict = {}
        self.row_prefix: dict[int, tuple] = {}  # id(row cache) -> its outer indices, for the target's own row

    # --- reduction placement ---------------------------------------------------------------
    def _ordered(self, F: frozenset, scope: Sequence[Var]) -> list[Var]:
        order = [v for v in scope if v in F]
        rest = [v for v in F if v not in order]
        if rest:  # not expected: a free variable outside the scope
            raise CodegenError(f"variables {[v.name for v in rest]} are used outside their loops")
        return order

    def _rewrite(self, e: Expr, ctx: _Ctx) -> Expr:
        k = (id(e), ctx.hoist)
        if k in self.rewrite_memo:
            return self.rewrite_memo[k][1]
        if isinstance(e, Reduce):
            r = self._place_reduce(e, ctx)
        elif isinstance(e, (Var, Const, Local)):
            r = e
        else:
            kids = e.children()
            new = [self._rewrite(c, ctx) for c in kids]
            r = e if all(a is b for a, b in zip(kids, new)) else rebuild(e, new)
            if r is not e and _nonpositive_exp(e, self.kl.dtypes):  # (its maximum placed in a temporary)
                r = ExpOfNonPositive("exp", new[0])
        self.rewrite_memo[k] = (e, r)
        return r

    def _place_reduce(self, R: Reduce, ctx: _Ctx) -> Expr:
        kl = self.kl
        F = free_vars(R, self.fv_memo)
        scope = list(ctx.scope)
        order = self._ordered(F, scope)
        ckey = kl.interner.key(R, order)
        hit = kl.temp_cache.get(ckey)
        if hit is not None:
            return TensorElement(hit, tuple(order))
        size_bytes = math.prod(v.extent for v in order) * 8
        main_only = all(id(v) in self.pos for v in F)
        if main_only and ctx.hoist:
            L = 1 + max((self.pos[id(v)] for v in F), default=-1)
            red = math.prod(a.extent for a in self.axes[:L] if a not in F)
            if red > 1 and size_bytes <= MAX_TEMP_BYTES:
                return self._materialize(R, order, ckey)
            body = self._rewrite(R.body, _Ctx(tuple(self.axes[:L]) + tuple(R.vars), True))
            new = R if body is R.body else Reduce(R.vars, body, R.op)
            self.hoisted.setdefault(L, []).append(new)
            return new
        missing = [v for v in scope if v not in F]
        red = math.prod(v.extent for v in missing)
        if red > 1 and size_bytes <= MAX_TEMP_BYTES:
            return self._materialize(R, order, ckey)
        body = self._rewrite(R.body, _Ctx(tuple(scope) + tuple(R.vars), ctx.hoist))
        return R if body is R.body else Reduce(R.vars, body, R.op)

    def _materialize(self, R: Reduce, order: list[Var], ckey: int) -> Expr:
        kl = self.kl
        # children first, in the temporary's own context: its free vars, then its reduce vars
        body = self._rewrite(R.body, _Ctx(tuple(order) + tuple(R.vars), False))
        R2 = R if body is R.body else Reduce(R.vars, body, R.op)
        n = next(kl.counter)
        new_axes = [Var(f"m{n}_{d}", v.extent) for d, v in enumerate(order)]
        value = substitute(R2, dict(zip(order, new_axes)))
        dt = value_dtype(R2, kl.dtypes) or "float64"
        temp = Buffer(f"tmp{len(kl.temps)}", [v.extent for v in order], dt, "temp", len(kl.temps))
        kl.temps.append(temp)
        sub = _NestLowerer(kl, new_axes, value, temp)
        self.pre.append(Comment(f"{temp.name}{list(temp.shape)} = {R.op} over {[v.extent for v in R.vars]} values"))
        self.pre.extend(sub.lower())
        kl.temp_cache[ckey] = temp
        return TensorElement(temp, tuple(order))

    # --- loops ------------------------------------------------------------------------------
    def lower(self) -> list:
        axes, n = self.axes, len(self.axes)
        if any(a.extent == 0 for a in axes):
            return []
        value = self._rewrite(self.value, _Ctx(axes, True))
        inner = self._interchanged(value)
        if inner is not None:
            return list(self.pre) + inner
        value, rows = self._row_caches(value)
        em = _Emitter(self.kl, value)
        em.row_cache = {id(r): (buf, self.row_prefix.get(id(buf), ())) for r, buf in rows}
        out: list = list(self.pre)
        body: list = []
        em.block = body
        self._emit_hoisted(em, 0, rows)
        if n == 0:
            v = em.emit(value)
            body.append(Store(self.target, (), v))
            out.append(Block(body))
            return out
        levels = [L for L in self.hoisted if L >= 1]
        c = 1 if n == 1 else max(1, min([n - 1] + levels))
        # a short innermost axis (the blocked layout's 16 lanes) keeps the axes before it as loops while the
        # flattened ones still give the threads many rows: one division per row, not one per 16 values
        while c > 1 and math.prod(a.extent for a in axes[c:]) < INNER_MIN \
                and math.prod(a.extent for a in axes[:c - 1]) >= FLAT_MIN:
            c -= 1
        flat_count = math.prod(a.extent for a in axes[:c])
        work = self._work_estimate(value)
        flat = FlatLoop(list(axes[:c]), [], parallel=work >= PARALLEL_MIN_WORK and flat_count >= 2)
        body.append(flat)
        em.push_scope(flat.body)
        for L in range(1, c + 1):
            self._emit_hoisted(em, L, rows)
        if c < n:
            self._hoist_invariants(em, value, c)
        # y[i] = c ? y[i] : e over y's own bytes: store e where c does not hold, nothing else; the
        # test placed around the loops whose variables c does not use (a cache row at a time)
        guard = self._in_place_guard(value)
        if guard is not None:
            cond, value = guard
            fv = free_vars(cond, self.fv_memo)
            used = [d for d, a in enumerate(axes) if a in fv]
            guard_level = max(c, used[-1] + 1 if used else 0)
        scopes = 1
        inner = None
        for d in range(c, n + 1):
            if guard is not None and d == guard_level:
                branch: list = []
                em.block.append(If(UnaryOp("not", em.emit(cond)), branch, []))
                em.push_scope(branch)
                scopes += 1
            if d == n:
                break
            loop = Loop(axes[d], axes[d].extent, [])
            em.block.append(loop)
            em.push_scope(loop.body)
            scopes += 1
            inner = loop
            self._emit_hoisted(em, d + 1, rows)
            if d + 1 < n:
                self._hoist_invariants(em, value, d + 1)
        em.block.append(Store(self.target, tuple(axes), em.emit(value)))
        if inner is not None and inner.var is axes[-1] and em.block is inner.body and guard is None \
                and short_stores(inner):
            inner.simd = True
        for _ in range(scopes):
            em.pop_scope()
        if (not flat.parallel and n >= 2 and c == n - 1 and flat_count < 4 and axes[-1].extent >= 256
                and work >= PARALLEL_MIN_WORK):
            inner = flat.body[-1] if flat.body and isinstance(flat.body[-1], Loop) else None
            if inner is not None and inner.var is axes[-1]:
                inner.parallel = True
        out.append(Block(body))
        return out

    def _interchanged(self, value: Expr) -> list | None:
        """The nest with each reduction over the innermost output axis's row, when the reductions read
        the input along that axis and across their own variables (ReduceMax over the middle axis of
        ``[64, 4096, 16]``, Softmax's statistics over a middle axis): per row of the outer axes an
        array of accumulators, one per element of the innermost axis, and loops over the reduction's
        variables outside a loop over that axis, which reads and accumulates contiguous values (a
        vectorized loop) where the plain nest summed one output at a time through values one row
        apart. Reductions whose body reads another's result take its array. None when the nest is
        not of that form: reductions at the innermost level only (others outside the innermost
        axis's loop), sum/mean/prod/max/min, a read whose last index is the innermost axis and none
        whose last index moves with a reduction variable, rows of at most 8192 accumulators. Fewer
        than 4 output rows (column sums) split their columns into chunks (:func:`_column_chunk`),
        one thread per chunk, each reading a contiguous piece of every input row (the plain nest's
        threads each read single columns): column sums of ``[2048, 4096]`` 1.1 -> 0.61 ms on 2
        cores (onnxruntime 0.87)."""
        axes, n = self.axes, len(self.axes)
        rs = self.hoisted.get(n, [])
        if n == 0 or not rs or any(0 < L < n - 1 for L in self.hoisted) or self._in_place_guard(value) is not None:
            return None
        a = axes[-1]
        if not 8 <= a.extent <= 8192 or any(r.op not in ("sum", "mean", "prod", "max", "min") for r in rs):
            return None
        earlier = {id(r) for L, hs in self.hoisted.items() if L < n for r in hs}
        for i, r in enumerate(rs):
            reads, reduces = _reads_and_reductions(r.body)
            if any(id(x) not in earlier and not any(x is e for e in rs[:i]) for x in reduces):
                return None
            own = set(r.vars)
            lasts = [te.indices[-1] for te in reads if te.indices]
            if not any(ix is a for ix in lasts) or any(own & free_vars(ix, self.fv_memo) for ix in lasts):
                return None
        kl = self.kl
        work = self._work_estimate(value)
        outer, target = list(axes[:-1]), self.target
        chunk = _column_chunk(a.extent) if work >= PARALLEL_MIN_WORK and math.prod(
            x.extent for x in outer) < 4 else None
        if chunk is not None:  # few output rows: their columns split into chunks, one thread each
            q, a = Var(f"{a.name}_q", a.extent // chunk), Var(f"{a.name}_r", chunk)
            whole = {axes[-1]: BinOp("add", BinOp("mul", q, Const(chunk, "int64")), a)}
            memo: dict = {}  # (one memo: value's reductions stay the objects rs holds)
            rs = [substitute(r, whole, memo) for r in rs]
            value = substitute(value, whole, memo)
            outer.append(q)
            target = Buffer(target.name, [x.extent for x in outer] + [chunk], target.dtype, target.role,
                            target.index)
        em = _Emitter(kl, value)
        body: list = []
        em.block = body
        self._emit_hoisted(em, 0, [])
        if outer:  # (one output row unsplit: no outer loop, one thread; the plain nest's threads read columns)
            flat = FlatLoop(outer, [], parallel=work >= PARALLEL_MIN_WORK and math.prod(x.extent for x in outer) >= 2)
            body.append(flat)
            em.push_scope(flat.body)
            for L in range(1, n):
                self._emit_hoisted(em, L, [])
        self._hoist_invariants(em, value, n - 1, inner=frozenset((a,)))
        repl: dict[int, Expr] = {}
        for r in rs:
            dt = accumulator_dtype(r, kl.dtypes)
            row = Buffer(f"row{next(kl.counter)}", (a.extent,), dt, "local", 0)
            em.block.append(LocalArray(row))
            em.block.append(Loop(a, a.extent, [Store(row, (a,), _ReduceInit("sum" if r.op == "mean" else r.op, dt))]))
            loops = [Loop(v, v.extent, []) for v in r.vars] + [Loop(a, a.extent, [], simd=True)]
            for lo, li in zip(loops, loops[1:]):
                lo.body.append(li)
            em.block.append(loops[0])
            for lp in loops:
                em.push_scope(lp.body)
            val = em.emit(transform(r.body, lambda old, new: repl.get(id(old))))
            if em.dtype(val) != dt:
                val = Cast(val, dt)
            comb = {"sum": "add", "mean": "add", "prod": "mul", "max": "max", "min": "min"}[r.op]
            em.block.append(Store(row, (a,), BinOp(comb, TensorElement(row, (a,)), val)))
            for _ in loops:
                em.pop_scope()
            read: Expr = TensorElement(row, (a,))
            if r.op == "mean":
                count = math.prod(v.extent for v in r.vars)
                read = BinOp("div", read, Const(float(count), dt if _kind(dt) == "f" else "float64"))
            repl[id(r)] = read
        last = Loop(a, a.extent, [])
        em.block.append(last)
        em.push_scope(last.body)
        final = transform(value, lambda old, new: repl.get(id(old)))
        em.block.append(Store(target, tuple(outer) + (a,), em.emit(final)))
        for _ in range(2 if outer else 1):
            em.pop_scope()
        return [Block(body)]

    def _in_place_guard(self, value: Expr) -> tuple[Expr, Expr] | None:
        """``(c, e)`` when this nest writes the kernel's output over its input ``in_place`` (the
        program aliases them) and ``value`` is ``c ? x[i] : e`` with ``x`` that input read at the
        output's own index ``i``: where ``c`` holds the element is already there (a KV cache's
        present over its past: the past rows are neither read nor written)."""
        x = self.kl.in_place
        if x is None or self.target is not self.kl.outputs[0]:
            return None
        return kept_select(value, self.axes, lambda t: self.kl.bound.get(id(t)) is x)

    def _hoist_invariants(self, em: "_Emitter", value: Expr, level: int, inner: frozenset | None = None):
        """Compute the operations of ``value`` that depend on ``axes[:level]`` only (a row's
        ``rsqrt(variance + eps)``, quantized) once, into locals of the current scope, instead of per
        element of the loops inside: the C compiler hoisted them itself, but a select on such a
        value (a QDQ chain's clamps) then became a loop-invariant mask that GCC 12 did not
        vectorize (a QDQ Llama's RMSNorm kernels 2.5 ms instead of 0.2). Not inside selects or
        reductions, nor the operands of boolean and/or (short-circuited in C), which the loop
        might not have evaluated. ``inner``: the variables of the loops inside (``axes[level:]``
        unless given)."""
        inner = frozenset(self.axes[level:]) if inner is None else inner
        seen: set[int] = set()

        def visit(e: Expr):
            if id(e) in seen or not isinstance(e, (BinOp, UnaryOp, Cast)):
                return
            seen.add(id(e))
            if free_vars(e, self.fv_memo) & inner:
                if not (isinstance(e, BinOp) and em.dtype(e) == "bool" and e.op in ("and", "or", "max", "min")):
                    for ch in e.children():
                        visit(ch)
                return
            em.hoist(e)

        visit(value)

    def _emit_hoisted(self, em: "_Emitter", level: int, rows: list):
        hoisted = self.hoisted.get(level, [])
        for r, buf in rows:
            if any(h is r for h in hoisted) and buf.role == "local":
                em.block.append(LocalArray(buf))
        for r in hoisted:
            em.emit(r)

    def _row_caches(self, value: Expr) -> tuple[Expr, list]:
        """Keep a per-row reduction's element values when the output needs them again.

        Softmax sums ``exp(x[.., k] - max)`` over the last axis and then divides
        ``exp(x[.., i] - max)`` by the sum: the same values with ``k`` renamed to the innermost
        output axis. The sum's loop stores them in a row array (a local of the row's iteration,
        so threads never share it) and the output loop reads them back instead of recomputing the
        exponentials (or a LayerNorm's output its input's quantize chain). Only for bodies worth
        more than a load (:func:`_worth_caching`) and row arrays of at most 64 KiB.

        Where the nest's own output row can hold them (the values' type, and no input written over
        in place), the sum's loop stores them there and the output loop finishes them in place:
        Softmax's values written once and read back from the cache lines they were written to,
        instead of copied from a row array (float32 ``[12, 512, 512]``, 2 threads: 0.79 -> 0.63 ms,
        rfcs/0002 "Softmax over its output row").
        """
        axes, n = self.axes, len(self.axes)
        cands = self.hoisted.get(n - 1, []) if n >= 1 else []
        if not cands:
            return value, []
        last = axes[-1]
        kl = self.kl
        opaque = frozenset(id(r) for rs in self.hoisted.values() for r in rs)
        vmemo: dict = {}
        vkeys = {}
        for node in walk(value):
            if isinstance(node, (Var, Const, Local, Reduce)) or id(node) in opaque:
                continue
            if last not in free_vars(node, self.fv_memo):
                continue
            vkeys.setdefault(kl.interner.key(node, axes, vmemo, opaque), node)
        rows, repl = [], {}
        for r in cands:
            if len(r.vars) != 1 or r.vars[0].extent != last.extent or r.op not in ("sum", "mean", "prod", "max", "min"):
                continue
            if not _worth_caching(r.body):
                continue
            kb = kl.interner.key(r.body, tuple(axes[:n - 1]) + (r.vars[0],), None, opaque - {id(r)})
            node = vkeys.get(kb)
            dt = value_dtype(r.body, kl.dtypes)
            if node is None or dt is None or id(node) in repl:
                continue
            if not rows and kl.in_place is None and self.target.dtype == dt and self.target.role == "output":
                buf = self.target  # (its row at the outer axes: self.row_prefix; any length)
                self.row_prefix[id(buf)] = tuple(axes[:n - 1])
            elif last.extent * 8 > (1 << 16):
                continue
            else:
                buf = Buffer(f"row{next(kl.counter)}", (last.extent,), dt, "local", 0)
            rows.append((r, buf))
            repl[id(node)] = TensorElement(buf, self.row_prefix.get(id(buf), ()) + (last,))
        if repl:
            value = transform(value, lambda old, new: repl.get(id(old)))
        return self._reduction_row_caches(value, cands, rows)

    def _reduction_row_caches(self, value: Expr, cands: list, rows: list) -> tuple[Expr, list]:
        """Keep a per-row reduction's element values when a later reduction of the row needs them.

        Softmax's exponent pass recomputes the max pass's element values (``exp(v[k] - max)``);
        that is one load when ``v`` is an input, but a quantized model's score is a chain of
        quantize/dequantize steps (three divisions, roundings and clamps per element). The first
        reduction's loop then stores its values in a row array and the later one reads them.
        Only for bodies worth more than a load and rows of at most 64 KiB."""
        axes, n = self.axes, len(self.axes)
        kl = self.kl
        opaque = frozenset(id(r) for rs in self.hoisted.values() for r in rs)
        cached = {id(r): b for r, b in rows}  # (a row the output reads serves later reductions too)
        new_red: dict[int, Reduce] = {}
        for i, ra in enumerate(cands):
            if len(ra.vars) != 1 or not _worth_caching(ra.body):
                continue
            dt = value_dtype(ra.body, kl.dtypes)
            if dt is None or ra.vars[0].extent * 8 > (1 << 16):
                continue
            ka = kl.interner.key(ra.body, tuple(axes[:n - 1]) + (ra.vars[0],), None, opaque)
            buf = cached.get(id(ra))
            for j in range(i + 1, len(cands)):
                rb = new_red.get(id(cands[j]), cands[j])
                if len(rb.vars) != 1 or rb.vars[0].extent != ra.vars[0].extent:
                    continue
                memo: dict = {}
                order = tuple(axes[:n - 1]) + (rb.vars[0],)
                hits = {id(x) for x in walk(rb.body)
                        if not isinstance(x, (Var, Const, Local)) and id(x) not in opaque
                        and kl.interner.key(x, order, memo, opaque) == ka}
                if not hits:
                    continue
                if buf is None:
                    buf = Buffer(f"row{next(kl.counter)}", (ra.vars[0].extent,), dt, "local", 0)
                    rows.append((ra, buf))
                    cached[id(ra)] = buf
                read = TensorElement(buf, self.row_prefix.get(id(buf), ()) + (rb.vars[0],))
                body = transform(rb.body, lambda old, new, hits=hits, read=read: read if id(old) in hits else None)
                new_red[id(cands[j])] = Reduce(rb.vars, body, rb.op)
        if not new_red:
            return value, rows
        for L, rs in self.hoisted.items():
            self.hoisted[L] = [new_red.get(id(r), r) for r in rs]
        rows = [(new_red.get(id(r), r), b) for r, b in rows]
        return transform(value, lambda old, new: new_red.get(id(old))), rows

    def _work_estimate(self, value: Expr) -> int:
        """Rough scalar-operation count of the nest: elements × (1 + reduction trip counts)."""
        elems = math.prod(a.extent for a in self.axes)
        inner = 1
        for nd in walk(value):
            if isinstance(nd, Reduce):
                inner += math.prod(v.extent for v in nd.vars)
        return elems * inner


class _Emitter:
    """Turns a rewritten value into statements and a pure expression (see module docstring)."""

    def __init__(self, kl: "KernelLowerer", root: Expr):
        self.kl = kl
        self.refs = _refcounts(root)
        self.scopes: list[dict] = [{}]
        self.blocks: list[list] = []
        self.block: list = []
        self.ranges = _Ranges(kl.interner, kl.dtypes)
        self.row_cache: dict[int, tuple[Buffer, tuple]] = {}  # id(Reduce) -> (row, the row's outer indices)

    # scopes ---------------------------------------------------------------------------------
    def push_scope(self, block: list):
        self.blocks.append(self.block)
        self.block = block
        self.scopes.append({})

    def pop_scope(self):
        self.scopes.pop()
        self.block = self.blocks.pop()

    def lookup(self, e: Expr):
        k = id(e)
        for s in reversed(self.scopes):
            if k in s:
                return s[k][1]
        return None

    def remember(self, e: Expr, r: Expr):
        self.scopes[-1][id(e)] = (e, r)

    def hoist(self, e: Expr):
        """Emit ``e`` into a local of the current scope (reads in inner scopes find it)."""
        r = self.emit(e)
        if not isinstance(r, (Var, Const, Local)):
            self.remember(e, self.new_local(self.dtype(e) or "float64", r))

    def new_local(self, dtype: str, value: Expr | None = None) -> Local:
        loc = Local(f"t{next(self.kl.local_counter)}", dtype)
        if value is not None:
            self.block.append(Let(loc, value))
            if dtype is not None and _kind(dtype) in "iub":
                self.ranges.local_iv[loc.name] = self.ranges.interval(value)
        else:
            self.block.append(Declare(loc))
        return loc

    # expressions ----------------------------------------------------------------------------
    def dtype(self, e: Expr) -> str | None:
        return value_dtype(e, self.kl.dtypes)

    def emit(self, e: Expr) -> Expr:
        hit = self.lookup(e)
        if hit is not None:
            return hit
        if isinstance(e, (Var, Const, Local)):
            return e
        if isinstance(e, TensorElement):
            r = self._read(e)
        elif isinstance(e, Cast) and (r := self._skip_lossless_cast(e)) is not None:
            pass
        elif isinstance(e, (BinOp, UnaryOp, Cast)):
            kids = [self.emit(c) for c in e.children()]
            r = rebuild(e, kids) if any(a is not b for a, b in zip(e.children(), kids)) else e
            if isinstance(e, ExpOfNonPositive) or _nonpositive_exp(e, self.kl.dtypes):
                r = ExpOfNonPositive("exp", kids[0])
        elif isinstance(e, IfThenElse):
            r = self._select(e)
        elif isinstance(e, Reduce):
            r = self._reduce(e)
        else:
            raise CodegenError(f"cannot lower expression node {type(e).__name__}")
        if self.refs.get(id(e), 0) > 1 and not isinstance(r, (Var, Const, Local)):
            r = self.new_local(self.dtype(e) or "float64", r)
        self.remember(e, r)
        return r

    def _skip_lossless_cast(self, e: Cast) -> Expr | None:
        """``e`` = ``cast(cast(x, narrow), to)`` of an integer ``x`` the interval analysis proves
        inside ``narrow``'s range (the inner cast changes no value) as ``cast(x, to)``, else None.

        QuantizeLinear followed by DequantizeLinear reads ``float(uint8(clamp(...)))``: the
        clamp bounds the value, and without the byte conversion the C compiler keeps the whole
        chain in 32-bit lanes (a QDQ model's softmax kernel: 2.8x faster)."""
        inner = e.a
        if not isinstance(inner, Cast):
            return None
        src, mid = self.dtype(inner.a), _norm_dtype(inner.dtype)
        if src is None or _kind(src) not in "iu" or _kind(mid) not in "iu":
            return None
        x = self.emit(inner.a)
        lo, hi = self.ranges.interval(x)
        rlo, rhi = _dtype_range(mid)
        if not (rlo <= lo and hi <= rhi):
            return None
        return x if _norm_dtype(e.dtype) == src else Cast(x, e.dtype)

    def _read(self, e: TensorElement) -> Expr:
        buf = self.kl.buffer_for(e.tensor)
        if buf.size == 0:
            return Const(0, buf.dtype if buf.dtype not in ML_FLOATS else "float32")
        idx = []
        for ix, ext in zip(e.indices, buf.shape):
            p = self.emit(ix)
            dt = self.dtype(p)
            if dt is None or _kind(dt) not in "iu":
                p = Cast(p, "int64")
            if not self.ranges.in_bounds(p, ext):
                p = BinOp("min", BinOp("max", p, Const(0, "int64")), Const(ext - 1, "int64"))
            idx.append(p)
        return TensorElement(buf, tuple(idx))

    def _speculation_safe(self, e: Expr, budget: list) -> bool:
        """Can ``e`` be evaluated although its value may be discarded: no reduction to compute,
        every read provably in bounds under the current refinements, and not too big."""
        if self.lookup(e) is not None or isinstance(e, (Var, Const, Local)):
            return True
        budget[0] -= 1
        if budget[0] < 0 or isinstance(e, Reduce):
            return False
        if isinstance(e, TensorElement):
            if not all(self._speculation_safe(i, budget) for i in e.indices):
                return False
            buf = self.kl.buffer_for(e.tensor)
            if buf.size == 0:
                return True
            for ix, ext in zip(e.indices, buf.shape):
                if not self._index_provable(ix, ext):
                    return False
            return True
        return all(self._speculation_safe(c, budget) for c in e.children())

    def _index_provable(self, ix: Expr, ext: int) -> bool:
        """Bounds of an un-emitted index expression (sub-trees already computed count as locals)."""
        def pure(x: Expr) -> Expr:
            hit = self.lookup(x)
            if hit is not None:
                return hit
            if isinstance(x, (Var, Const, Local)):
                return x
            kids = x.children()
            return rebuild(x, [pure(c) for c in kids]) if kids else x
        try:
            return self.ranges.in_bounds(pure(ix), ext)
        except CodegenError:
            return False

    def _select(self, e: IfThenElse) -> Expr:
        known = self.ranges.decide(e.cond)
        if known is not None:
            return self.emit(e.then if known else e.other)
        c = self.emit(e.cond)
        if self._speculation_safe(e.then, [64]) and self._speculation_safe(e.other, [64]):
            # both sides are computed unconditionally; sides that read memory go to locals first so
            # that the C compiler sees plain loads and a select (vectorizable without masked loads)
            sides = []
            for side in (e.then, e.other):
                p = self.emit(side)
                if not isinstance(p, (Var, Const, Local)) and any(isinstance(n, TensorElement) for n in walk(p)):
                    p = self.new_local(self.dtype(side) or "float64", p)
                sides.append(p)
            return IfThenElse(c, sides[0], sides[1])
        loc = self.new_local(self.dtype(e) or "float64")
        then_b: list = []
        other_b: list = []
        for positive, blk, side in ((True, then_b, e.then), (False, other_b, e.other)):
            self.push_scope(blk)
            self.ranges.push(c, positive)
            v = self.emit(side)
            blk.append(Assign(loc, v))
            self.ranges.pop()
            self.pop_scope()
        self.block.append(If(c, then_b, other_b))
        return loc

    def _reduce(self, R: Reduce) -> Expr:
        dts = self.kl.dtypes
        acc_dt = accumulator_dtype(R, dts)
        if R.op in ("argmax", "argmin"):
            best = self.new_local(acc_dt, _ReduceInit(R.op, acc_dt))
            idx = self.new_local("int64", Const(0, "int64"))
            self.ranges.local_iv[idx.name] = (0, max(R.vars[0].extent - 1, 0))
            acc, result = best, idx
        else:
            acc = self.new_local(acc_dt, _ReduceInit(R.op, acc_dt))
            result = acc
            idx = None
        outer_block = self.block
        loops: list[Loop] = []
        for v in R.vars:
            lp = Loop(v, v.extent, [])
            self.push_scope(lp.body)
            loops.append(lp)
        val = self.emit(R.body)
        row, prefix = self.row_cache.get(id(R), (None, ()))
        if row is not None:
            if not isinstance(val, (Var, Const, Local)):
                val = self.new_local(self.dtype(R.body) or "float64", val)
            self.block.append(Store(row, prefix + (R.vars[0],), val))
        self.block.append(Accumulate(acc, R.op, val, idx, R.vars[0] if idx is not None else None))
        for _ in R.vars:
            self.pop_scope()
        loops = _merged_reduction_loops(loops)
        # nest the loops
        for outer, inner in zip(loops, loops[1:]):
            outer.body.append(inner)
        if loops:
            if R.op in ("sum", "mean", "prod", "max", "min") or len(loops) == 1:
                loops[-1].reduction = (acc, R.op)
            outer_block.append(loops[0])
        else:  # a reduction over no variables is its body
            pass
        if R.op == "mean":
            count = math.prod(v.extent for v in R.vars)
            self.block.append(Assign(acc, BinOp("div", acc, Const(float(count), acc_dt if _kind(acc_dt) == "f"
                                                                   else "float64"))))
        return result


def _reads_and_reductions(e: Expr) -> tuple[list, list]:
    """The tensor reads of ``e`` and the reductions in it, not looking inside those reductions."""
    reads, reduces, seen, stack = [], [], set(), [e]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, Reduce):
            reduces.append(x)
            continue
        if isinstance(x, TensorElement):
            reads.append(x)
        stack.extend(x.children())
    return reads, reduces


class _Unmergeable(Exception):
    pass


def _merged_reduction_loops(loops: list[Loop]) -> list[Loop]:
    """A reduction's innermost loops as one loop where they walk adjacent axes of every tensor the body reads.

    ``ReduceMean(x, axes=[2, 3])`` over a ``[N, C, 56, 56]`` image reads ``x[n, c, k0, k1]`` only: ``k0``
    and ``k1`` make one index ``k`` of 3136 values over ``x`` seen as ``[N, C, 3136]``. One loop is
    vectorized as one reduction, where the nest of two combined the vector lanes after each row of 56
    (that ReduceMean's whole run 0.102 -> 0.031 ms; rfcs/0002 "Lowering"). Two variables merge only when
    each occurrence of them in the body is a read indexed by them alone, at consecutive dimensions, the second of the
    variable's own extent; any other use (an index computed from them, a condition) keeps the nest.
    The values are summed in another order (as the vectorized loop already did)."""
    while len(loops) >= 2:
        a, b = loops[-2].var, loops[-1].var
        k = Var(f"{a.name}_{b.name}", a.extent * b.extent, "reduce")
        try:
            body = _merge_statements(loops[-1].body, a, b, k, {})
        except _Unmergeable:
            break
        loops = loops[:-2] + [Loop(k, k.extent, body)]
    return loops


def _merge_statements(body: list, a: Var, b: Var, k: Var, memo: dict) -> list:
    out = []
    for s in body:
        if isinstance(s, Let):
            out.append(Let(s.local, _merge_expr(s.value, a, b, k, memo)))
        elif isinstance(s, Assign):
            out.append(Assign(s.local, _merge_expr(s.value, a, b, k, memo)))
        elif isinstance(s, Declare):
            out.append(s)
        elif isinstance(s, Accumulate) and s.index is None:
            out.append(Accumulate(s.acc, s.op, _merge_expr(s.value, a, b, k, memo)))
        elif isinstance(s, If):
            out.append(If(_merge_expr(s.cond, a, b, k, memo), _merge_statements(s.then, a, b, k, memo),
                          _merge_statements(s.other, a, b, k, memo)))
        else:  # (a nested loop, a store, an arg-reduction's index)
            raise _Unmergeable
    return out


def _merge_expr(e: Expr, a: Var, b: Var, k: Var, memo: dict) -> Expr:
    hit = memo.get(id(e))
    if hit is not None:
        return hit[1]
    if e is a or e is b:
        raise _Unmergeable
    r = e
    if isinstance(e, TensorElement) and isinstance(e.tensor, Buffer):
        ix, shape = e.indices, e.tensor.shape
        d = next((d for d in range(len(ix) - 1) if ix[d] is a and ix[d + 1] is b), None)
        if d is not None and shape[d + 1] == b.extent:
            buf = e.tensor
            merged = Buffer(buf.name, shape[:d] + (shape[d] * shape[d + 1],) + shape[d + 2:], buf.dtype, buf.role,
                            buf.index)
            rest = [_merge_expr(x, a, b, k, memo) for x in ix[:d] + ix[d + 2:]]
            r = TensorElement(merged, tuple(rest[:d]) + (k,) + tuple(rest[d:]))
    if r is e:
        kids = e.children()
        new = [_merge_expr(c, a, b, k, memo) for c in kids]
        r = rebuild(e, new) if any(x is not y for x, y in zip(kids, new)) else e
    memo[id(e)] = (e, r)
    return r


class ExpOfNonPositive(UnaryOp):
    """``exp(a)`` of an ``a`` that is at most 0 or NaN: ``x - max(x)`` (a softmax's shift), proven by
    :func:`_below_its_max`; printed ``sf_exp_nonpos`` (helpers.h: one scaling, the same bits as ``sf_exp``
    there). A rewrite that rebuilds the node makes a plain ``exp`` of it."""

    __slots__ = ()


def _same_up_to_vars(a: Expr, b: Expr, sub: dict) -> bool:
    """``a`` is ``b`` with ``b``'s variables in ``sub`` (id -> Var) replaced by variables of the same extent
    (bound consistently in ``sub``'s values, filled as met)."""
    if isinstance(b, Var):
        if id(b) in sub:
            if sub[id(b)] is None:
                if not isinstance(a, Var) or a.extent != b.extent:
                    return False
                sub[id(b)] = a
            return sub[id(b)] is a
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, Const):
        return a.value == b.value and a.dtype == b.dtype and type(a.value) is type(b.value)
    if isinstance(a, (BinOp, UnaryOp)) and a.op != b.op:
        return False
    if isinstance(a, Cast) and a.dtype != b.dtype:
        return False
    if isinstance(a, TensorElement) and a.tensor is not b.tensor:
        return False
    if isinstance(a, Reduce) or not isinstance(a, (BinOp, UnaryOp, Cast, IfThenElse, TensorElement)):
        return False
    ka, kb = a.children(), b.children()
    return len(ka) == len(kb) and all(_same_up_to_vars(x, y, sub) for x, y in zip(ka, kb))


def _nonpositive_exp(e: Expr, dtypes: dict) -> bool:
    """``e`` is a float32 ``exp`` of a value :func:`_below_its_max`."""
    return (isinstance(e, UnaryOp) and e.op == "exp" and not isinstance(e, ExpOfNonPositive)
            and value_dtype(e, dtypes) == "float32" and _below_its_max(e.a))


def _below_its_max(e: Expr) -> bool:
    """``e`` is ``v - max over K of body`` where ``v`` is ``body`` at variables ranging over ``K``'s extents,
    so one of the values the maximum is taken over: ``e <= 0``, or NaN (a NaN value, an infinite one)."""
    if not (isinstance(e, BinOp) and e.op == "sub" and isinstance(e.b, Reduce) and e.b.op == "max"):
        return False
    return _same_up_to_vars(e.a, e.b.body, {id(v): None for v in e.b.vars})


class _ReduceInit(Expr):
    """The identity of a reduction (printed by the emitter for the accumulator's type)."""

    __slots__ = ("op", "dtype")

    def __init__(self, op: str, dtype: str):
        self.op, self.dtype = op, dtype


def reduce_init(e: Expr) -> tuple[str, str] | None:
    """``(op, dtype)`` when ``e`` is a reduction's initial value."""
    return (e.op, e.dtype) if isinstance(e, _ReduceInit) else None


#: Periods of the innermost axis below which :func:`_split_periodic_axis` leaves it whole (its inner
#: loop would be too short to vectorize).
MIN_SPLIT_PERIOD = 8


#: Columns per chunk of an interchanged reduction's few output rows (:func:`_column_chunk`).
COLUMN_CHUNK = 1024


def _column_chunk(extent: int) -> int | None:
    """The columns one thread accumulates when an interchanged reduction has fewer than 4 output
    rows (column sums of a matrix): the largest divisor of ``extent`` of at most
    :data:`COLUMN_CHUNK` that leaves at least 2 chunks and is a multiple of 16 (whole vectors), or
    ``None`` (then one thread per row)."""
    for c in range(min(COLUMN_CHUNK, extent // 2) // 16 * 16, 15, -16):
        if extent % c == 0:
            return c
    return None


def _split_periodic_axis(axes: Sequence[Var], value: Expr) -> tuple[tuple, Expr] | None:
    """The output's axes with the innermost one, ``a``, split into ``(q, r)``, ``a = q * c + r``, and
    ``value`` rewritten over them, when ``value`` reads ``a`` as ``a % c`` (and possibly ``a // c``
    or ``a`` itself) for one ``c`` that divides ``a``'s extent at least twice: Tile's last axis,
    ``x[..., a % n]``. The innermost loop then runs over ``r`` and reads ``x[..., r]``, a contiguous
    copy the C++ compiler vectorizes, where ``a % c`` per element (an integer division) kept it
    scalar. ``None`` when there is no such ``c`` or it is below :data:`MIN_SPLIT_PERIOD`. The caller
    stores through a view of the output whose last dim is split the same way (same bytes)."""
    if not axes:
        return None
    a = axes[-1]
    periods = set()
    for e in walk(value):
        if isinstance(e, BinOp) and e.op in ("mod", "floordiv") and e.a is a:
            if not (isinstance(e.b, Const) and isinstance(e.b.value, (int, np.integer))):
                return None
            if e.op == "mod":
                periods.add(int(e.b.value))
    if len(periods) != 1:
        return None
    c = periods.pop()
    if c < MIN_SPLIT_PERIOD or a.extent % c or a.extent // c < 2:
        return None
    q, r = Var(f"{a.name}_q", a.extent // c), Var(f"{a.name}_r", c)

    def fn(old, new):
        if isinstance(old, BinOp) and old.a is a and old.op in ("mod", "floordiv") and isinstance(old.b, Const):
            if int(old.b.value) == c:
                return r if old.op == "mod" else q
        return None
    whole = BinOp("add", BinOp("mul", q, Const(c, "int64")), r)
    rest = transform(value, fn)
    rest = substitute(rest, {a: whole})  # (a read as itself, or divided by another constant)
    return tuple(axes[:-1]) + (q, r), hashcons(rest)


class KernelLowerer:
    """Lowers every output of one task into one :class:`Kernel`."""

    def __init__(self, task: Task, op_name: str = "", op_type: str = "", scalars: dict | None = None,
                 in_place: int | None = None):
        self.task = task
        # reads of one-element inputs whose value is known (constants): literals in the code
        self.scalars = {id(task.inputs[k]): Const(v, task.inputs[k].dtype) for k, v in (scalars or {}).items()}
        self.op_name, self.op_type = op_name or task.name, op_type or task.name
        self.inputs = [Buffer(f"in{k}", t.shape, t.dtype, "input", k) for k, t in enumerate(task.inputs)]
        self.outputs = [Buffer(f"out{k}", o.shape, o.dtype, "output", k) for k, o in enumerate(task.outputs)]
        self.bound: dict[int, Buffer] = {id(t): b for t, b in zip(task.inputs, self.inputs)}
        self.in_place = self.inputs[in_place] if in_place is not None else None  # output 0 aliases it
        self.temps: list[Buffer] = []
        self.temp_cache: dict[int, Buffer] = {}
        self.interner = _Interner()
        self.key_memo: dict = {}  # (the interner's, by id: it keeps the keyed expressions alive)
        self.inlined: dict = {}  # (id of a grid compute, keys of its indices) -> its inlined value
        self.dtypes: dict = {}
        self.counter = itertools.count()
        self.local_counter = itertools.count()

    def buffer_for(self, tensor) -> Buffer:
        if isinstance(tensor, Buffer):
            return tensor
        b = self.bound.get(id(tensor))
        if b is None:
            raise CodegenError(f"{self.op_name}: tensor {tensor.name} is read but not bound")
        return b

    def _bind(self, value: Expr) -> Expr:
        """Inline reads of grid computes that are not already computed outputs. A read at the
        same indices (structurally) is inlined once and shared: down an unrolled recurrence, each
        state is read by the next step and by its own output, and inlining a fresh copy per read
        repeated every earlier step once per later one."""
        def fn(old, new):
            if isinstance(new, TensorElement) and isinstance(new.tensor, GridCompute) and id(new.tensor) not in self.bound:
                gc = new.tensor
                key = (id(gc),) + tuple(self.interner.key(i, memo=self.key_memo) for i in new.indices)
                inlined = self.inlined.get(key)
                if inlined is None:
                    inlined = self.inlined[key] = self._bind(substitute(gc.value, dict(zip(gc.axes, new.indices))))
                return inlined
            if isinstance(new, TensorElement) and id(new.tensor) in self.scalars:
                return self.scalars[id(new.tensor)]
            return None
        return transform(value, fn)

    def lower(self) -> Kernel:
        body: list = []
        for gc, buf in zip(self.task.outputs, self.outputs):
            if not isinstance(gc, GridCompute):
                raise CodegenError(f"{self.op_name}: output {gc.name} is extern ({gc.reason})")
            value = hashcons(self._bind(gc.value))
            axes, target = gc.axes, buf
            split = None if self.in_place is not None else _split_periodic_axis(gc.axes, value)
            if split is not None:
                axes, value = split
                target = Buffer(buf.name, [a.extent for a in axes], buf.dtype, buf.role, buf.index)
            nest = _NestLowerer(self, axes, value, target).lower()
            body.append(Comment(f"output {buf.name} = {gc.name}{list(gc.shape)}:{gc.dtype}"))
            body.extend(nest)
            self.bound[id(gc)] = buf
            self.inlined.clear()  # (later outputs read this one from its buffer)
        return Kernel(self.op_name, self.op_type, self.inputs, self.outputs, self.temps, body)


def lower_task(task: Task, op_name: str = "", op_type: str = "", scalars: dict | None = None,
               in_place: int | None = None) -> Kernel:
    """Lower every output of ``task`` to loop nests. ``scalars`` maps the index of a one-element
    input to its value: its reads become that literal (the kernel still takes the input), so that
    the C++ compiler folds it (``x ** 3`` becomes ``x * x * x``, a multiply by 1 disappears).
    ``in_place``: the index of an input whose bytes the program gives output 0 (a state written in
    place); a select that keeps that input's element where its condition holds then stores only
    where it does not.

    Raises
    ------
    CodegenError
        for an extern output or an expression the lowering does not know.
    """
    return KernelLowerer(task, op_name, op_type, scalars, in_place).lower()
