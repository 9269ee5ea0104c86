"""C++ emitter for ``target="cpu"``: one translation unit, one ``extern "C"`` kernel per op.

Kernel ABI (what the runtime calls)::

    extern "C" void <symbol>(const void* const* inputs, void* const* outputs);

``inputs[k]``/``outputs[k]`` point to contiguous row-major arrays with exactly the static shape and
dtype of the op's k-th input/output (shapes and dtypes are baked into the kernel). Inputs and
outputs must not overlap. Kernels are thread-safe: scratch memory is per calling thread.

Generic kernels are printed from the loop nests of :mod:`.lower`; MatMul, Gemm and Conv use the
blocked GEMM of the prelude (see :mod:`.templates_cpu`). Identical kernels (same text) are emitted
once and shared by every op that needs them.
"""
from __future__ import annotations

import hashlib
import logging
import math
import re
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from ..ir.expr import (ML_FLOATS, BinOp, Cast, Const, Expr, IfThenElse, TensorElement, UnaryOp, Var, dtype_kind,
                       numpy_type, walk)
from .lower import (Accumulate, Assign, Block, Buffer, CodegenError, Comment, Declare, ExpOfNonPositive, FlatLoop,
                    If, Kernel, Let, Local, LocalArray, Loop, Store, lower_task, reduce_init, value_dtype, why_not_lowerable,
                    promote)
from . import float8
from .prelude_cpu import PRELUDE  # noqa: F401 (re-exported: templates_cpu, tests)

__all__ = ["generate_cpu_source", "CpuSource", "kernel_source", "STORAGE_CTYPE", "COMPUTE_CTYPE"]

log = logging.getLogger(__name__)

STORAGE_CTYPE = {"bool": "uint8_t", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
                 "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
                 "float16": "_Float16", "bfloat16": "sf_bf16", "float32": "float", "float64": "double",
                 **{t: "uint8_t" for t in float8.FLOAT8}}
#: Arithmetic happens in these types: float16 and bfloat16 values are computed in float32 (rounded at
#: stores and at explicit casts only; ``sf_bf16`` is the prelude's 16-bit storage type, this GCC has no
#: ``__bf16``). Bools are stored as bytes (0/1, numpy's layout; ``uint8_t`` loads
#: vectorize where C++ ``bool`` loads do not) and computed as ``bool``.
COMPUTE_CTYPE = dict(STORAGE_CTYPE, float16="float", bfloat16="float", bool="bool",
                     **{t: "float" for t in float8.FLOAT8})  # (float8: a byte, codegen/float8.py)
#: The generic kernels' argument types: float16 values as their bits, converted by the prelude's
#: ``sf_h2f``/``sf_f2h`` (integer and float32 steps that GCC vectorizes; its own ``_Float16`` conversions
#: go one value at a time and kept every loop over float16 values scalar). Templates keep ``_Float16``.
_ARG_CTYPE = dict(STORAGE_CTYPE, float16="uint16_t")

_SMALL_INTS = {"int8", "int16", "uint8", "uint16"}
_ARITH = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_CMP = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_BITS = {"bitand": "&", "bitor": "|", "bitxor": "^"}
_HELPER_BIN = {"floordiv": "sf_floordiv", "mod": "sf_mod", "fmod": "sf_fmod", "truncdiv": "sf_truncdiv",
               "pow": "sf_pow", "shl": "sf_shl", "shr": "sf_shr", "max": "sf_max", "min": "sf_min"}
_OWN_MATH = {"exp": "sf_exp", "log": "sf_log", "tanh": "sf_tanh", "erf": "sf_erf", "sqrt": "sf_sqrt",
             "rsqrt": "sf_rsqrt", "sigmoid": "sf_sigmoid", "round": "sf_round"}
#: float32 helpers with forms under the vector function ABI (helpers.h, ``cpu_library/vmath.h``): printed for
#: calls that are not under a condition nor in a reduction's loop (also the float16 loads, stores and roundings:
#: ``sfv_h2f``, ``sfv_f2h``, ``sfv_f16_round``)
_VECTOR_ABI = {"exp": "sfv_exp", "sigmoid": "sfv_sigmoid"}
_STD_MATH = {"sin": "std::sin", "cos": "std::cos", "tan": "std::tan", "asin": "std::asin", "acos": "std::acos",
             "atan": "std::atan", "sinh": "std::sinh", "cosh": "std::cosh", "asinh": "std::asinh",
             "acosh": "std::acosh", "atanh": "std::atanh", "log1p": "std::log1p", "expm1": "std::expm1",
             "floor": "std::floor", "ceil": "std::ceil"}


#: Reduction loops shorter than this are not marked ``omp simd``.
SIMD_MIN_EXTENT = 16

#: Most copies of one innermost loop that unswitching (:meth:`_Printer.loop`) makes: a concatenation of that
#: many parts is split per part, more stay branches inside the loop.
UNSWITCH_MAX_COPIES = 16

#: Arg-reductions over at least this many values run in two vectorized passes (:meth:`_Printer.arg_scan`),
#: testing this many values at a time for the best one's position.
ARG_SCAN_MIN_EXTENT = 64
ARG_SCAN_BLOCK = 16
_ARG_SCAN_CTYPES = ("float", "double", "int32_t", "int64_t")


def _kind(dt: str) -> str:
    return dtype_kind(dt)


# ---------------------------------------------------------------------------------------------
# literals and conversions
# ---------------------------------------------------------------------------------------------

def literal(value, dtype: str) -> str:
    """``value`` as a C++ literal of the compute type of ``dtype``."""
    k = _kind(dtype)
    if k == "b":
        return "true" if bool(value) else "false"
    if k in "iu":
        v = int(value)
        info = np.iinfo(dtype)
        v = int(np.array(v).astype(dtype)) if not (info.min <= v <= info.max) else v
        ct = COMPUTE_CTYPE[dtype]
        if dtype == "int64":
            return "INT64_C(-9223372036854775807) - 1" if v == info.min else f"INT64_C({v})"
        if dtype == "uint64":
            return f"UINT64_C({v})"
        if dtype == "int32" and v == info.min:
            return "(-2147483647 - 1)"
        return f"{ct}({v})" if ct != "int32_t" else str(v)
    v = float(value)
    f32 = dtype in ("float32", "float16", "bfloat16") or dtype in float8.FLOAT8
    if math.isnan(v):
        return "std::numeric_limits<float>::quiet_NaN()" if f32 else "std::numeric_limits<double>::quiet_NaN()"
    if math.isinf(v):
        s = "std::numeric_limits<float>::infinity()" if f32 else "std::numeric_limits<double>::infinity()"
        return s if v > 0 else f"(-{s})"
    if dtype == "float16":
        v = float(np.float16(v))
    if dtype == "bfloat16":
        v = float(np.float32(v).astype(numpy_type("bfloat16")))
    if dtype in float8.FLOAT8:
        v = float8.round_value(v, dtype)
        if math.isnan(v):
            return "std::numeric_limits<float>::quiet_NaN()"
        if math.isinf(v):
            return "std::numeric_limits<float>::infinity()" if v > 0 else "(-std::numeric_limits<float>::infinity())"
    if f32:
        r = repr(float(np.float32(v)))
        r = r if ("." in r or "e" in r or "inf" in r) else r + ".0"
        return r + "f"
    r = repr(v)
    return r if ("." in r or "e" in r) else r + ".0"


def convert(s: str, src: str | None, dst: str, vector_abi: bool = False) -> str:
    """C++ for converting the value ``s`` (compute type of ``src``) to the compute type of ``dst``
    with numpy's ``astype`` semantics. ``vector_abi``: a float32 value's rounding to float16 calls the
    helper's form under the vector function ABI (``sfv_f16_round``, helpers.h)."""
    if src == dst or src is None:
        return s
    if dst == "bool":
        return f"({s} != 0)" if src != "bool" else s
    if dst == "float16":  # (rounded once: from float32 or float64 straight to float16)
        if COMPUTE_CTYPE[src] in ("float", "double"):
            if COMPUTE_CTYPE[src] == "float":
                return f"{'sfv' if vector_abi else 'sf'}_f16_round({s})"
            return f"sf_h2f(sf_f2h({s}))"
        return f"(float)(_Float16)({s})"
    if dst == "bfloat16":
        return f"sf_bf16_round({s})" if COMPUTE_CTYPE[src] == "float" else f"sf_bf16_round((float)({s}))"
    if dst in float8.FLOAT8:
        return float8.rounded(s if COMPUTE_CTYPE[src] == "float" else f"(float)({s})", dst)
    ks, kd = _kind(src), _kind(dst)
    ct = COMPUTE_CTYPE[dst]
    if kd in "iu" and ks == "f":
        if dst in _SMALL_INTS:
            return f"({ct})(int32_t)({s})"
        if dst == "uint32":
            return f"({ct})(int64_t)({s})"
        return f"({ct})({s})"
    if COMPUTE_CTYPE[src] == ct:
        return s
    return f"({ct})({s})"


# ---------------------------------------------------------------------------------------------
# printing one kernel
# ---------------------------------------------------------------------------------------------


def _bound_operand(e: BinOp):
    """The operand of ``e`` that is a float constant other than NaN and zero, if any."""
    for c in (e.b, e.a):
        if isinstance(c, Const) and isinstance(c.value, (int, float, np.integer, np.floating)) \
                and not isinstance(c.value, bool):
            v = float(c.value)
            if v == v and v != 0.0:
                return c
    return None


class _Printer:
    def __init__(self, kernel: Kernel):
        self.k = kernel
        self.dtypes: dict = {}
        self.lines: list[str] = []
        self.var_names: dict[int, str] = {}
        self.used_names: set[str] = set()
        self.simd_minmax: dict[str, str] = {}
        self.unswitch_left = 0  # (the splits the innermost loop being printed may still make)
        self.unswitching = False  # (printing the copies of an unswitched loop)
        # (printing a branch of a select or an if, whose calls run for some elements only, or a reduction's loop,
        # whose accumulators a call would send through memory: there the helpers with vector forms (_VECTOR_ABI)
        # stay inline)
        self.inline_math = 0

    # names ------------------------------------------------------------------------------------
    def var(self, v: Var) -> str:
        n = self.var_names.get(id(v))
        if n is None:
            if v.kind == "reduce":
                # reduction variables get per-kernel names in order of use (the IR numbers them
                # process-wide), so the same op always prints the same text: same symbol, cache hits
                base = f"k{sum(1 for x in self.used_names if x.startswith('k'))}"
            elif re.fullmatch(r"[im]\d+(_\d+)?", v.name):
                base = v.name
            else:
                base = "v_" + re.sub(r"\W", "_", v.name)
            n, j = base, 2
            while n in self.used_names:
                n, j = f"{base}_{j}", j + 1
            self.used_names.add(n)
            self.var_names[id(v)] = n
        return n

    # expressions ------------------------------------------------------------------------------
    def dt(self, e: Expr) -> str | None:
        return value_dtype(e, self.dtypes)

    def unrounded(self, e: Expr, half: str) -> Expr:
        """``e`` (of float32 or ``half`` values, computed in float32) without the roundings to ``half`` inside it
        that a rounding of its value to ``half`` makes redundant: rounding to nearest even is monotone and
        symmetric, so ``round(max(round(a), b)) == max(round(a), round(b)) == round(max(a, b))``, and likewise
        through ``min``, negation, ``abs`` and the branches of a select (a float16 or bfloat16 model's
        rounding before a Relu, then at the store; passes/precision.HalfModelInFloat32)."""
        def wide(x: Expr) -> bool:
            return self.dt(x) in ("float32", half)

        if isinstance(e, Cast) and e.dtype in ("float32", half) and wide(e.a):
            inner = e.a
            if e.dtype == "float32" and isinstance(inner, Cast) and inner.dtype == half \
                    and self.dt(inner.a) == "float32":
                return self.unrounded(inner.a, half)
            if e.dtype == half and self.dt(inner) == "float32":
                return self.unrounded(inner, half)
            return e
        if isinstance(e, BinOp) and e.op in ("max", "min") and wide(e.a) and wide(e.b):
            return BinOp(e.op, self.unrounded(e.a, half), self.unrounded(e.b, half))
        if isinstance(e, UnaryOp) and e.op in ("neg", "abs") and wide(e.a):
            return UnaryOp(e.op, self.unrounded(e.a, half))
        if isinstance(e, IfThenElse) and wide(e.then) and wide(e.other):
            return IfThenElse(e.cond, self.unrounded(e.then, half), self.unrounded(e.other, half))
        return e

    def expr(self, e: Expr, want: str | None = None) -> str:
        """``e`` as C++ in the compute type of ``want`` (default: its own dtype)."""
        if isinstance(e, Const):
            return literal(e.value, want or e.dtype or ("float64" if isinstance(e.value, float) else
                                                        "bool" if isinstance(e.value, bool) else "int64"))
        init = reduce_init(e)
        if init is not None:
            return self.init_value(*init) if want is None else self.convert(self.init_value(*init), init[1], want)
        s = self._expr(e)
        return self.convert(s, self.dt(e), want) if want else s

    def convert(self, s: str, src: str | None, dst: str) -> str:
        """:func:`convert`, a rounding to float16 in its vector form where the exponentials take theirs."""
        return convert(s, src, dst, vector_abi=not self.inline_math)

    def truth(self, e: Expr) -> str:
        d = self.dt(e)
        s = self.expr(e)
        return s if d == "bool" else f"({s} != 0)"

    def init_value(self, op: str, dtype: str) -> str:
        k = _kind(dtype)
        if op in ("sum", "mean"):
            return literal(0, dtype)
        if op == "prod":
            return literal(1, dtype)
        low = op in ("max", "argmax")
        if k == "f":
            return literal(-math.inf if low else math.inf, dtype)
        if k == "b":
            return "false" if low else "true"
        info = np.iinfo(dtype)
        return literal(info.min if low else info.max, dtype)

    def index(self, buf: Buffer, indices: Sequence[Expr]) -> str:
        terms = []
        for ix, st, ext in zip(indices, buf.strides, buf.shape):
            if ext == 1:
                continue
            s = self.expr(ix, "int64")
            terms.append(s if st == 1 else f"{s} * {st}")
        return " + ".join(terms) if terms else "0"

    def _expr(self, e: Expr) -> str:
        if isinstance(e, Var):
            return self.var(e)
        if isinstance(e, Local):
            return e.name
        if isinstance(e, TensorElement):
            buf: Buffer = e.tensor
            s = f"{buf.name}[{self.index(buf, e.indices)}]"
            if buf.role in ("temp", "local"):
                return s
            if buf.dtype == "float16":
                return f"sfv_h2f({s})" if not self.inline_math else f"sf_h2f({s})"
            if buf.dtype == "bfloat16":
                return f"sf_bf16_to_float({s})"
            if buf.dtype in float8.FLOAT8:
                return float8.load(s, buf.dtype)
            if buf.dtype == "bool":
                return f"({s} != 0)"
            return s
        if isinstance(e, Cast):
            src = self.dt(e.a)
            dst = self.dt(e) if e.dtype not in ML_FLOATS else e.dtype  # (bfloat16, float8: computed as float32)
            if src is None:
                return self.expr(e.a, dst)
            if dst in ("float16", "bfloat16") and src == "float32":
                return self.convert(self.expr(self.unrounded(e.a, dst)), src, dst)
            return self.convert(self.expr(e.a), src, dst)
        if isinstance(e, BinOp):
            return self._binop(e)
        if isinstance(e, UnaryOp):
            return self._unop(e)
        if isinstance(e, IfThenElse):
            r = self.dt(e)
            cond = self.truth(e.cond)
            self.inline_math += 1
            try:
                return f"({cond} ? {self.expr(e.then, r)} : {self.expr(e.other, r)})"
            finally:
                self.inline_math -= 1
        raise CodegenError(f"cannot print expression node {type(e).__name__}")

    def _binop(self, e: BinOp) -> str:
        op = e.op
        if op in _CMP:
            t = promote(e.a, e.b, self.dtypes)
            return f"({self.expr(e.a, t)} {_CMP[op]} {self.expr(e.b, t)})"
        if op in ("and", "or"):
            # both sides are pure and safe to evaluate: & and | keep loops free of branches
            return f"({self.truth(e.a)} {'&' if op == 'and' else '|'} {self.truth(e.b)})"
        if op == "xor":
            return f"({self.truth(e.a)} != {self.truth(e.b)})"
        r = self.dt(e)
        ct = COMPUTE_CTYPE[r]
        if op == "div":
            return f"({self.expr(e.a, r)} / {self.expr(e.b, r)})"
        a, b = self.expr(e.a, r), self.expr(e.b, r)
        if op in _ARITH:
            s = f"({a} {_ARITH[op]} {b})"
            return f"({ct}){s}" if (r in _SMALL_INTS or r == "bool") else s
        if op in _BITS:
            s = f"({a} {_BITS[op]} {b})"
            return f"({ct}){s}" if (r in _SMALL_INTS or r == "bool") else s
        if op in _HELPER_BIN:
            if r == "bool" and op in ("max", "min"):
                return f"({a} {'||' if op == 'max' else '&&'} {b})"
            if _kind(r) == "f":
                bound = _bound_operand(e)
                if op in ("max", "min") and bound is not None:
                    # np.maximum(x, c) for a constant c neither NaN nor zero in one comparison
                    # (helpers.h): the two tests of sf_max became branches that stopped a QDQ
                    # model's clamped quantize chains from vectorizing
                    c = a if bound is e.a else b
                    x = b if bound is e.a else a
                    return f"sf_{op}_const({x}, {c})"
                if op == "pow" and ct == "float" and isinstance(e.b, Const) and e.b.value in (2, 3):
                    # a square or a cube (GELU's) as sf_pow computes them, without its general path: in a
                    # float16 model's GELU, with a rounding after each op, that path's selects stopped GCC
                    # from vectorizing the loop
                    return f"sf_{'square' if e.b.value == 2 else 'cube'}({a})"
                return f"{_HELPER_BIN[op]}({a}, {b})"
            return f"{_HELPER_BIN[op]}<{ct}>({a}, {b})"
        raise CodegenError(f"binary op {op} is not supported by the cpu emitter")

    def _unop(self, e: UnaryOp) -> str:
        op = e.op
        src = self.dt(e.a) or self.dt(e)
        r = self.dt(e)
        if op == "not":
            return f"(!{self.truth(e.a)})"
        if op in ("isnan", "isinf", "isposinf", "isneginf"):
            if _kind(src) != "f":
                return "false"
            a = self.expr(e.a, src)
            return {"isnan": f"sf_isnan({a})", "isinf": f"std::isinf({a})",
                    "isposinf": f"({a} == std::numeric_limits<{COMPUTE_CTYPE[src]}>::infinity())",
                    "isneginf": f"({a} == -std::numeric_limits<{COMPUTE_CTYPE[src]}>::infinity())"}[op]
        ct = COMPUTE_CTYPE[r]
        if op == "bitnot":
            a = self.expr(e.a, r)
            return f"(!{a})" if r == "bool" else f"({ct})(~{a})"
        if op == "neg":
            a = self.expr(e.a, r)
            return f"({ct})(-{a})" if r in _SMALL_INTS else f"(-{a})"
        if op == "abs":
            return f"sf_abs<{ct}>({self.expr(e.a, r)})"
        if op == "sign":
            return f"sf_sign<{ct}>({self.expr(e.a, r)})"
        if op == "reciprocal":
            return f"sf_reciprocal<{ct}>({self.expr(e.a, r)})"
        if op in ("floor", "ceil", "round") and _kind(r) != "f":
            return self.expr(e.a, r)
        if _kind(r) != "f":  # erf of ints (the evaluator casts back to the input's dtype)
            fn = _OWN_MATH.get(op) or _STD_MATH[op]
            return convert(f"{fn}((double)({self.expr(e.a)}))", "float64", r)
        a = self.expr(e.a, r)
        nonpos = isinstance(e, ExpOfNonPositive)
        if COMPUTE_CTYPE[r] == "float" and not self.inline_math and (nonpos or op in _VECTOR_ABI):
            # (GCC calls a vector form where it vectorizes the loop, helpers.h; not under a condition, the forms
            # being unmasked (GCC would leave the loop scalar), nor in a reduction's loop, whose vector accumulators
            # a call would spill and reload every iteration (a softmax row's sum of exponentials 1.16x slower))
            return f"{'sfv_exp_nonpos' if nonpos else _VECTOR_ABI[op]}({a})"
        if isinstance(e, ExpOfNonPositive):
            return f"sf_exp_nonpos({a})"
        if op in _OWN_MATH:
            return f"{_OWN_MATH[op]}({a})"
        if op in _STD_MATH:
            return f"{_STD_MATH[op]}({a})"
        raise CodegenError(f"unary op {op} is not supported by the cpu emitter")

    # statements -------------------------------------------------------------------------------
    def emit(self, line: str, depth: int):
        self.lines.append("  " * depth + line)

    def stmts(self, body: list, depth: int):
        for s in body:
            self.stmt(s, depth)

    def stmt(self, s, depth: int):
        if isinstance(s, Comment):
            self.emit(f"// {s.text}", depth)
        elif isinstance(s, Block):
            self.emit("{" + (f"  // {s.comment}" if s.comment else ""), depth)
            self.stmts(s.body, depth + 1)
            self.emit("}", depth)
        elif isinstance(s, Let):
            self.emit(f"{COMPUTE_CTYPE[s.local.dtype]} {s.local.name} = {self.expr(s.value, s.local.dtype)};", depth)
        elif isinstance(s, Declare):
            self.emit(f"{COMPUTE_CTYPE[s.local.dtype]} {s.local.name};", depth)
        elif isinstance(s, Assign):
            self.emit(f"{s.local.name} = {self.expr(s.value, s.local.dtype)};", depth)
        elif isinstance(s, Accumulate):
            self.accumulate(s, depth)
        elif isinstance(s, Store):
            buf = s.buffer
            target = f"{buf.name}[{self.index(buf, s.indices)}]"
            if buf.dtype == "float16" and buf.role not in ("temp", "local"):
                value = self.unrounded(s.value, "float16")  # (the store rounds)
                src = self.dt(value)
                v = self.expr(value) if src is not None and _kind(src) == "f" else self.expr(value, "float32")
                vector = not self.inline_math and (src is None or COMPUTE_CTYPE.get(src) != "double")
                self.emit(f"{target} = {'(uint16_t)sfv_f2h' if vector else 'sf_f2h'}({v});", depth)
            elif buf.dtype == "bfloat16" and buf.role not in ("temp", "local"):
                self.emit(f"{target} = sf_float_to_bf16({self.expr(self.unrounded(s.value, 'bfloat16'), 'float32')});",
                          depth)
            elif buf.dtype in float8.FLOAT8 and buf.role not in ("temp", "local"):
                self.emit(f"{target} = {float8.store(self.expr(s.value, 'float32'), buf.dtype)};", depth)
            elif buf.dtype == "bool" and buf.role not in ("temp", "local"):
                self.emit(f"{target} = (uint8_t)({self.expr(s.value, 'bool')});", depth)
            else:
                self.emit(f"{target} = {self.expr(s.value, buf.dtype)};", depth)
        elif isinstance(s, If):
            self.emit(f"if ({self.truth(s.cond)}) {{", depth)
            self.inline_math += 1
            self.stmts(s.then, depth + 1)
            if s.other:
                self.emit("} else {", depth)
                self.stmts(s.other, depth + 1)
            self.inline_math -= 1
            self.emit("}", depth)
        elif isinstance(s, LocalArray):
            b = s.buffer
            self.emit(f"alignas(64) {COMPUTE_CTYPE[b.dtype]} {b.name}[{b.size}];", depth)
        elif isinstance(s, Loop):
            self.loop(s, depth)
        elif isinstance(s, FlatLoop):
            self.flat_loop(s, depth)
        else:
            raise CodegenError(f"cannot print statement {type(s).__name__}")

    def accumulate(self, s: Accumulate, depth: int):
        acc, dt = s.acc.name, s.acc.dtype
        if s.op in ("sum", "mean"):
            self.emit(f"{acc} += {self.expr(s.value, dt)};", depth)
        elif s.op == "prod":
            self.emit(f"{acc} *= {self.expr(s.value, dt)};", depth)
        elif s.op in ("max", "min"):
            flag = self.simd_minmax.get(acc)
            if flag is not None:  # inside an omp simd max/min reduction: NaN tracked by a flag
                cmp = ">" if s.op == "max" else "<"
                self.emit(f"{{ const {COMPUTE_CTYPE[dt]} v_ = {self.expr(s.value, dt)}; {flag} |= (v_ != v_); "
                          f"{acc} = v_ {cmp} {acc} ? v_ : {acc}; }}", depth)
            elif dt == "bool":
                self.emit(f"{acc} = {acc} {'||' if s.op == 'max' else '&&'} {self.expr(s.value, dt)};", depth)
            else:
                fn = "sf_max" if s.op == "max" else "sf_min"
                tmpl = "" if _kind(dt) == "f" else f"<{COMPUTE_CTYPE[dt]}>"
                self.emit(f"{acc} = {fn}{tmpl}({acc}, {self.expr(s.value, dt)});", depth)
        else:
            better = "sf_better_max" if s.op == "argmax" else "sf_better_min"
            self.emit(f"{{ const {COMPUTE_CTYPE[dt]} v_ = {self.expr(s.value, dt)};", depth)
            self.emit(f"  if ({better}(v_, {acc})) {{ {acc} = v_; {s.index.name} = "
                      f"{self.expr(s.index_value, 'int64')}; }} }}", depth)

    def loop(self, s: Loop, depth: int):
        v = self.var(s.var)
        if (s.reduction is not None and s.reduction[1] in ("argmax", "argmin") and s.extent >= ARG_SCAN_MIN_EXTENT
                and COMPUTE_CTYPE[s.reduction[0].dtype] in _ARG_SCAN_CTYPES and s.body
                and all(isinstance(x, Let) for x in s.body[:-1]) and isinstance(s.body[-1], Accumulate)):
            self.arg_scan(s, v, depth)
            return
        if s.extent == 1:
            self.emit(f"{{ const int64_t {v} = 0;", depth)
            self.stmts(s.body, depth + 1)
            self.emit("}", depth)
            return
        if not self.unswitching and self.unswitched(s, depth):
            return
        flag = None
        if s.parallel:
            self.emit("#pragma omp parallel for schedule(static)", depth)
        elif s.simd:
            self.emit("#pragma omp simd", depth)
        elif s.reduction is not None:
            acc, op = s.reduction
            ct = COMPUTE_CTYPE[acc.dtype]
            # (a short loop, such as a pooling window's row, is unrolled as it is: a vectorized
            # reduction's set-up and final combine cost more than its few elements)
            if ct in ("float", "double") and s.extent >= SIMD_MIN_EXTENT and _simple_body(s.body):
                if op in ("sum", "mean", "prod"):
                    self.emit(f"#pragma omp simd reduction({'*' if op == 'prod' else '+'}:{acc.name})", depth)
                elif op in ("max", "min"):
                    # OpenMP's max/min ignore NaN; numpy's propagate it: keep a NaN flag beside
                    flag = f"{acc.name}_nan"
                    self.emit(f"int {flag} = 0;", depth)
                    self.emit(f"#pragma omp simd reduction({op}:{acc.name}) reduction(|:{flag})", depth)
                    self.simd_minmax[acc.name] = flag
        self.emit(f"for (int64_t {v} = 0; {v} < {s.extent}; ++{v}) {{", depth)
        reducing = s.reduction is not None
        self.inline_math += reducing
        self.stmts(s.body, depth + 1)
        self.inline_math -= reducing
        self.emit("}", depth)
        if flag is not None:
            del self.simd_minmax[s.reduction[0].name]
            self.emit(f"if ({flag}) {s.reduction[0].name} = std::numeric_limits<{ct}>::quiet_NaN();", depth)

    def unswitched(self, s: Loop, depth: int, top: bool = True) -> bool:
        """Print ``s``, an innermost loop without a reduction, as an ``if`` around copies of itself when its
        body branches on a condition its iterations share (a concatenation's part, chosen by an outer index,
        in a loop over the last axis: ``if (i1 < 2) t = a[...]; else t = silu(b[...])``): each copy one
        branch's loop, which the C++ compiler vectorizes plainly, where it if-converted the branches into
        masked vector code that computed every branch for every element, on lanes the masks left holding
        denormals (assists: YOLOv8n's concatenations with a SiLU part 25x slower, rfcs/0002 "Loops
        unswitched"). A condition is shared when it reads only outer
        loop variables and constants (no local, no memory). At most :data:`UNSWITCH_MAX_COPIES` copies;
        False (nothing printed) when there is nothing to split."""
        if s.parallel or s.reduction is not None or any(isinstance(x, (Loop, FlatLoop, Block)) for x in s.body):
            return False
        if top:
            self.unswitch_left = UNSWITCH_MAX_COPIES - 1
        at = next((k for k, x in enumerate(s.body) if isinstance(x, If) and self._shared(x.cond, s.var)), None)
        if at is None or self.unswitch_left <= 0:
            return False
        self.unswitch_left -= 1
        iff = s.body[at]
        self.emit(f"if ({self.truth(iff.cond)}) {{", depth)
        for k, branch in enumerate((iff.then, iff.other)):
            if k:
                self.emit("} else {", depth)
            part = replace(s, body=s.body[:at] + list(branch) + s.body[at + 1:])
            if not self.unswitched(part, depth + 1, top=False):
                self.unswitching = True
                try:
                    self.loop(part, depth + 1)
                finally:
                    self.unswitching = False
        self.emit("}", depth)
        return True

    @staticmethod
    def _shared(cond: Expr, var: Var) -> bool:
        """Whether ``cond`` reads only variables other than ``var`` and constants."""
        return all(isinstance(e, (Var, Const, BinOp, UnaryOp, Cast, IfThenElse)) and e is not var for e in walk(cond))

    def arg_scan(self, s: Loop, v: str, depth: int):
        """An arg-reduction's loop in two passes that the C++ compiler vectorizes, where one loop of
        ``sf_better_max`` tests (a branch per value) stays scalar: the best value first (an ``omp simd``
        max/min reduction, NaN tracked by a flag as in :meth:`loop`), then its first position, blocks of
        :data:`ARG_SCAN_BLOCK` values tested together (a vector compare each) until one holds it, which a
        scalar scan then searches. The same index as the one loop: its first value equal to the best (a
        zero of either sign equal to both), or its first NaN when it has one (numpy's)."""
        acc, op = s.reduction
        ct, acc_name = COMPUTE_CTYPE[acc.dtype], acc.name
        final: Accumulate = s.body[-1]
        lets = s.body[:-1]
        flag, blk, start, hit = f"{acc_name}_nan", f"{v}_b", f"{v}_s", f"{acc_name}_hit"
        cmp = ">" if op == "argmax" else "<"
        red = "max" if op == "argmax" else "min"
        n, block = s.extent, ARG_SCAN_BLOCK
        full = n // block * block

        def body(d: int, line: str):
            self.stmts(lets, d)
            self.emit(f"const {ct} v_ = {self.expr(final.value, acc.dtype)};", d)
            self.emit(line, d)

        match = f"({flag} ? (v_ != v_) : (v_ == {acc_name}))"
        self.emit(f"int {flag} = 0;", depth)
        self.emit(f"#pragma omp simd reduction({red}:{acc_name}) reduction(|:{flag})", depth)
        self.emit(f"for (int64_t {v} = 0; {v} < {n}; ++{v}) {{", depth)
        body(depth + 1, f"{flag} |= (v_ != v_); {acc_name} = v_ {cmp} {acc_name} ? v_ : {acc_name};")
        self.emit("}", depth)
        self.emit(f"int64_t {start} = {full};", depth)
        if full:
            self.emit(f"for (int64_t {blk} = 0; {blk} < {full}; {blk} += {block}) {{", depth)
            self.emit(f"int {hit} = 0;", depth + 1)
            self.emit(f"#pragma omp simd reduction(|:{hit})", depth + 1)
            self.emit(f"for (int64_t {v} = {blk}; {v} < {blk} + {block}; ++{v}) {{", depth + 1)
            body(depth + 2, f"{hit} |= {match};")
            self.emit("}", depth + 1)
            self.emit(f"if ({hit}) {{ {start} = {blk}; break; }}", depth + 1)
            self.emit("}", depth)
        self.emit(f"for (int64_t {v} = {start}; {v} < {n}; ++{v}) {{", depth)
        body(depth + 1, f"if {match} {{ {final.index.name} = {self.expr(final.index_value, 'int64')}; break; }}")
        self.emit("}", depth)
        if ct in ("float", "double"):
            self.emit(f"if ({flag}) {acc_name} = std::numeric_limits<{ct}>::quiet_NaN();", depth)

    def flat_loop(self, s: FlatLoop, depth: int):
        vars_ = s.vars
        total = math.prod(v.extent for v in vars_)
        if len(vars_) == 1:
            self.loop(Loop(vars_[0], vars_[0].extent, s.body, parallel=s.parallel and total > 1), depth)
            return
        if s.parallel and total > 1:
            self.emit("#pragma omp parallel for schedule(static)", depth)
        f = "f_" + "_".join(self.var(v) for v in vars_[:1])
        self.emit(f"for (int64_t {f} = 0; {f} < {total}; ++{f}) {{", depth)
        rest = f
        for d in range(len(vars_) - 1, -1, -1):
            v = vars_[d]
            name = self.var(v)
            if v.extent == 1:
                self.emit(f"const int64_t {name} = 0;", depth + 1)
            elif d == 0:
                self.emit(f"const int64_t {name} = {rest};", depth + 1)
            else:
                self.emit(f"const int64_t {name} = {rest} % {v.extent};", depth + 1)
                if d > 0:
                    nxt = f"{f}_{d}"
                    self.emit(f"const int64_t {nxt} = {rest} / {v.extent};", depth + 1)
                    rest = nxt
        self.stmts(s.body, depth + 1)
        self.emit("}", depth)


def _simple_body(body: list) -> bool:
    """A reduction loop body that is safe and worth marking ``omp simd``: no nested loops."""
    for s in body:
        if isinstance(s, (Loop, FlatLoop)):
            return False
        if isinstance(s, If) and not (_simple_body(s.then) and _simple_body(s.other)):
            return False
    return True


def _signature_comment(op) -> str:
    ins = ", ".join(f"{t.dtype}{list(t.shape)}" for t in op.inputs)
    outs = ", ".join(f"{t.dtype}{list(t.shape)}" for t in op.outputs)
    attrs = ", ".join(f"{k}={v!r}" for k, v in sorted(op.attrs.items()) if not isinstance(v, np.ndarray))
    if len(attrs) > 160:
        attrs = attrs[:157] + "..."
    return f"{op.op_type}({ins}) -> {outs}" + (f" {{{attrs}}}" if attrs else "")


def _arg_decls(kernel: Kernel) -> list[str]:
    lines = []
    for b in kernel.inputs:
        ct = _ARG_CTYPE[b.dtype]
        lines.append(f"const {ct}* __restrict__ {b.name} = static_cast<const {ct}*>(inputs[{b.index}]);")
    for b in kernel.outputs:
        ct = _ARG_CTYPE[b.dtype]
        lines.append(f"{ct}* __restrict__ {b.name} = static_cast<{ct}*>(outputs[{b.index}]);")
    if kernel.temps:
        off = 0
        offs = []
        for t in kernel.temps:
            offs.append(off)
            off += (t.size * _compute_itemsize(t.dtype) + 63) // 64 * 64
        lines.append(f"char* ws_ = static_cast<char*>(sf_workspace(0, {off}));")
        for t, o in zip(kernel.temps, offs):
            ct = COMPUTE_CTYPE[t.dtype]
            lines.append(f"{ct}* __restrict__ {t.name} = reinterpret_cast<{ct}*>(ws_ + {o});")
    return lines


def _compute_itemsize(dt: str) -> int:
    """Bytes of one value of ``dt`` in its compute type (a temporary holds computed values)."""
    return 4 if COMPUTE_CTYPE[dt] == "float" else np.dtype(dt).itemsize


def constant_scalars(op) -> dict:
    """Index -> value of the inputs of ``op`` that are constants of one element (a GELU's 0.5, 3 and
    0.044715, a LayerNorm's epsilon as a tensor): the generic kernel writes them as literals."""
    out = {}
    for k, t in enumerate(op.inputs):
        if t.is_constant and t.size == 1 and t.dtype in COMPUTE_CTYPE:
            out[k] = np.asarray(t.value).reshape(()).item()
    return out


def generic_kernel_body(op, in_place: int | None = None) -> str:
    """The body (statements between the braces) of the generic kernel for ``op``; constant scalar
    inputs are literals in it (:func:`constant_scalars`); ``in_place``: :func:`.lower.lower_task`'s."""
    kernel = lower_task(op.task, op.name, op.op_type, constant_scalars(op), in_place)
    p = _Printer(kernel)
    for line in _arg_decls(kernel):
        p.emit(line, 1)
    p.stmts(kernel.body, 1)
    return "\n".join(p.lines)


# ---------------------------------------------------------------------------------------------
# the translation unit
# ---------------------------------------------------------------------------------------------

@dataclass
class CpuSource:
    """Generated C++ for a kernel library.

    ``header`` (helpers, GEMM) followed by ``kernels`` (``[(symbol, definition), ...]``) is the one
    translation unit of the library (:attr:`text`); :meth:`units` cuts it into several units that
    compile in parallel. ``symbols[op.name]`` is the exported symbol of every lowered op,
    ``skipped[op.name]`` the reason an op was left out, ``users[symbol]`` the ops sharing a kernel.
    """
    header: str = ""
    kernels: list = field(default_factory=list)
    symbols: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    users: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The whole library as one translation unit."""
        return self.units(1)[0][0]

    @property
    def lines(self) -> dict:
        """``{symbol: (first_line, last_line, op names)}`` in :attr:`text`."""
        return self.units(1)[0][1]

    @classmethod
    def merge(cls, sources: Sequence[CpuSource]) -> CpuSource:
        """One library with every kernel of ``sources`` (several ranks' libraries): a symbol names its
        kernel's code (:func:`kernel_source`), so a symbol in several sources is one kernel.
        ``symbols`` and ``skipped`` are the union by op name (ops of the same name in different
        ranks may take different kernels: the ranks' own ``symbols`` say which). The headers must be
        equal (they are unless some sources need the float8 helpers): ValueError otherwise."""
        if len(sources) == 1:
            return sources[0]
        if not sources:
            raise ValueError("no sources to merge")
        out = cls(sources[0].header)
        for s in sources:
            if s.header != out.header:
                raise ValueError("the sources have different headers; compile them as separate libraries")
            for sym, text in s.kernels:
                if sym not in out.users:
                    out.kernels.append((sym, text))
                users = out.users.setdefault(sym, [])
                users.extend(n for n in s.users.get(sym, ()) if n not in users)
            out.symbols.update(s.symbols)
            out.skipped.update(s.skipped)
        return out

    def units(self, n: int) -> list[tuple[str, dict]]:
        """The library as ``n`` translation units (kernels split by size; the exported library
        helpers go to the first), each with its ``{symbol: (first, last, op names)}`` line map."""
        n = max(1, min(n, len(self.kernels)))
        groups: list[list] = [[] for _ in range(n)]
        sizes = [0] * n
        for sym, text in sorted(self.kernels, key=lambda kv: -len(kv[1])):
            g = sizes.index(min(sizes))
            groups[g].append((sym, text))
            sizes[g] += len(text)
        order = {sym: k for k, (sym, _) in enumerate(self.kernels)}
        res = []
        for g, group in enumerate(groups):
            group.sort(key=lambda kv: order[kv[0]])
            head = self.header + ("\n" + _LIBRARY_EXTRAS if g == 0 else "") + "\n"
            line = head.count("\n") + 1
            parts, lmap = [head], {}
            for sym, text in group:
                cnt = text.count("\n")
                lmap[sym] = (line, line + cnt, list(self.users.get(sym, [])))
                line += cnt + 1
                parts.append(text)
            res.append(("\n".join(parts), lmap))
        return res


#: Exported once per library: thread control and the GEMM's instruction set, for the runtime.
_LIBRARY_EXTRAS = r"""// ---- library information ----
SF_EXPORT int shardflow_num_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}
SF_EXPORT void shardflow_set_num_threads(int n) {
#if defined(_OPENMP)
  if (n > 0) omp_set_num_threads(n);
#endif
}
SF_EXPORT const char* shardflow_cpu_isa() {
  const SfUkr& u = sf_ukr();
  return u.nr == 32 ? "avx512" : (u.nr == 16 ? "avx2" : "generic");
}
SF_EXPORT const char* shardflow_cpu_bf16_isa() {
  const int isa = sf_bf16_isa();
  return isa == SF_ISA_AMX ? "amx" : (isa == SF_ISA_AVX512BF16 ? "avx512bf16" : "widened");
}
SF_EXPORT const char* shardflow_cpu_int8_isa() {
#if defined(__x86_64__)
  if (sf_i8_amx()) return "amx";  // (for 16 rows or more; fewer take the kernel below)
#endif
  const int isa = sf_i8_isa();  // (not the table itself: a library without an integer GEMM does not build it)
  return isa == SF_ISA_AVX512 ? "avx512vnni" : (isa == SF_ISA_AVX2 ? "avx2" : "generic");
}
"""


def kernel_source(op, clones: bool | str = False, in_place: int | None = None) -> tuple[str, str]:
    """``(symbol, definition)`` of ``op``'s kernel; the symbol is derived from the text, so equal
    kernels get equal symbols. ``clones``: whether to compile the kernel for x86-64-v3 and v4 too,
    or a policy of :func:`generate_cpu_source` applied to the kernel's body. ``in_place``: the
    input whose bytes output 0 is written over (for the generic kernel; a template ignores it)."""
    from .templates_cpu import CLONED_TEMPLATES, FILE_SCOPE_BEGIN, FILE_SCOPE_END, template_body, template_kind
    body = template_body(op)
    templated = body is not None
    if not templated:
        from .fusion import coalesce_elementwise
        body = generic_kernel_body(coalesce_elementwise(op), in_place)
    if isinstance(clones, str):
        clones = _wants_clones(op, clones, body)
    # a template's functions of the file (a conv's epilogue): cloned as a generic kernel would be
    scoped_attr = "SF_CLONES " if clones else ""
    if templated and template_kind(op) not in CLONED_TEMPLATES:
        clones = False  # a GEMM template's kernel only calls the GEMM, which dispatches on the CPU itself
    scoped = []
    while FILE_SCOPE_BEGIN in body:
        a = body.index(FILE_SCOPE_BEGIN)
        b = body.index(FILE_SCOPE_END, a)
        scoped.append(body[a + len(FILE_SCOPE_BEGIN):b].strip("\n").replace("SF_ATTR ", scoped_attr) + "\n")
        body = body[:a] + body[b + len(FILE_SCOPE_END):].lstrip("\n")
    attr = "SF_CLONES " if clones else ""
    digest = hashlib.sha256((attr + "".join(scoped) + body).encode()).hexdigest()[:16]
    sym = f"sf_{re.sub(r'[^a-z0-9]', '', op.op_type.lower())[:24]}_{digest}"
    text = ("".join(scoped) + f"{attr}static void {sym}_impl(const void* const* inputs, void* const* outputs) {{\n"
            f"{body.rstrip()}\n}}\n"
            f"SF_EXPORT void {sym}(const void* const* inputs, void* const* outputs) {{ {sym}_impl(inputs, outputs); }}\n")
    return sym, text.replace("SF_SYM", sym)


#: Calls of helpers whose x86-64-v2 code is several times slower than the v3/v4 clones' (four lanes
#: and no FMA for the exponential's and the others' polynomials; float16 conversions one value at a
#: time, by libgcc)
_COSTLY_CALL = re.compile(r"\bsfv?_(?:exp|exp_nonpos|tanh|erf|log|pow|sigmoid|sqrt|rsqrt|h2f|h2f32|f16_round"
                          r"|bf16_round)\(")


def _wants_clones(op, policy: str, body: str) -> bool:
    """Whether ``op``'s kernel (``body``) is compiled for x86-64-v3 and v4 too, under ``policy``
    (:func:`generate_cpu_source`): "auto" clones a kernel touching 16 Ki elements or more, and one
    whose outputs times the costly calls in its body (:data:`_COSTLY_CALL`) make 256 or more (an
    LSTM step's gates, 8 x 256 values with three exponentials each: 10 -> 3 us on a Zen 4)."""
    if policy == "none":
        return False
    if policy == "all":
        return True
    outputs = sum(int(np.prod(t.shape, dtype=np.int64)) for t in op.outputs)
    work = outputs + sum(int(np.prod(t.shape, dtype=np.int64)) for t in op.inputs)
    return work >= (1 << 14) or outputs * len(_COSTLY_CALL.findall(body)) >= 256


def generate_cpu_source(ops: Sequence, clones: str = "auto", in_place: Mapping[str, int] | None = None
                        ) -> CpuSource:
    """Generate the C++ for a library with the kernels of ``ops``.

    Parameters
    ----------
    ops
        Operators (graph nodes); ops that are not lowerable are skipped and listed in
        ``CpuSource.skipped``.
    clones
        ``"auto"`` compiles kernels that touch at least 16 Ki elements for x86-64-v2, v3 (AVX2/FMA)
        and v4 (AVX-512) and picks one when the library loads; ``"all"``/``"none"`` for every/no
        kernel.
    in_place
        ``{op name: input index}``: the ops whose output the program writes over that input's
        bytes (:func:`kernel_source`).
    """
    from .templates_cpu import library_header, template_kind
    in_place = in_place or {}
    f8 = ("namespace {\n" + float8.prelude("SF_INLINE", "std::numeric_limits<float>::quiet_NaN()",
                                             "std::numeric_limits<float>::infinity()") + "}  // namespace\n"
          if float8.used_by(ops) else "")
    out = CpuSource(library_header(f8))
    defs: dict[str, str] = {}
    users: dict[str, list] = {}
    for op in ops:
        # (a template implements its op whatever the op's definition is: TopK's is an extern)
        why = None if template_kind(op) is not None else why_not_lowerable(op)
        if why is not None:
            out.skipped[op.name] = why
            continue
        try:
            sym, text = kernel_source(op, clones, in_place.get(op.name))
        except RecursionError as e:  # pragma: no cover - pathological expression depth
            raise CodegenError(f"{op.name} ({op.op_type}): expression too deep to lower") from e
        out.symbols[op.name] = sym
        if sym not in defs:
            defs[sym] = text
            users[sym] = [op]
        else:
            users[sym].append(op)
    for sym, text in defs.items():
        us = users[sym]
        names = ", ".join(o.name for o in us[:4]) + (f" (+{len(us) - 4} more)" if len(us) > 4 else "")
        out.kernels.append((sym, f"// {_signature_comment(us[0])}\n// ops: {names}\n" + text))
        out.users[sym] = [o.name for o in us]
    return out


def _clones_macro() -> str:
    return ('#if defined(__x86_64__) && !defined(SF_NO_CLONES)\n'
            '#define SF_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))\n'
            '#else\n#define SF_CLONES\n#endif\n')
