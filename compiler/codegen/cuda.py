"""CUDA C code generation for ``target="cuda"``.

:func:`build_cuda_library` turns a list of operators into one CUDA translation unit with one
``extern "C" __global__`` kernel per operator, compiles it to a ``.cubin`` (``nvcc``, or NVRTC
through cupy where ``nvcc`` is missing) and returns how to launch each kernel
(:class:`KernelLaunch`). Collectives and ops with extern outputs (sorting) get no kernel.

Kernel interface
    A kernel takes one pointer per op input, then one per op output, in the op's order; every
    tensor is dense row-major with the op's static shape baked into the code. Inputs are
    ``const T* __restrict__`` and outputs must not alias inputs. bool is 1 byte, float16 is
    ``__half``, bfloat16 ``__nv_bfloat16``.

Ops whose kernels come out identical (repeated layers) share one kernel, which keeps the compile
time of deep models close to that of one layer.

Lowering (each op output is one *part* of the op's kernel; parts run one after another)
    * no reduction: one thread per output element, grid-stride loop; where the output reads a
      whole tensor transposed (its innermost axis another output axis: a channels-last copy, a
      Kᵀ), by 32 x 32 tiles through shared memory, so that loads and stores are both coalesced;
    * reductions shared by several outputs (softmax, normalizations, hardmax...): the output axes
      the reductions depend on form a *row*; a warp (short rows) or a block of 256 threads (long
      rows) computes each hoisted reduction once per row with shuffles (and shared memory across
      warps), then its lanes write the row's elements. Nothing is O(n²) in the row length;
    * one reduction per output element: a thread per element with a serial loop when there are
      many outputs or short reductions, else a warp or block per element;
    * a sum of a product of two operands that separate into (batch, M, K) and (batch, N, K)
      index spaces (MatMul, Gemm, batched/broadcast matmul, Einsum, convolution as implicit
      GEMM) in float32/float16/bfloat16 with M, N >= 16: the tensor-core GEMM template of
      :mod:`.cuda_templates` (3xTF32 for float32, or TF32 with ``precision="tf32"``; see there
      for the tolerances), with the rest of
      the expression as its epilogue. On ``sm_90`` a float16/bfloat16 product whose operands
      are dense half-precision tensors (16-byte aligned rows) takes the Hopper template of
      :mod:`.cuda_wgmma` instead (``wgmma`` fed by a ``cp.async`` pipeline, or for unbatched
      products by the bulk tensor copy engine in a persistent kernel; compiled for ``sm_90a``),
      and, with ``wgmma_fp32`` (opt-in, not yet run on a GPU) or on a forced tile, so does a
      float32 product whose operands are both K-major (one TF32 product, or 3xTF32; the driver
      stores the weights ``[N, K]`` for it). A half operand read through a window (a convolution
      over a channels-last image, its padding a select against zero) is gathered by the
      ``cp.async`` pipeline in runs of 8 K values (:func:`_gather_operand`; the driver makes the
      copy, ``passes/channels_last.py``).
      With fewer than 16 rows on one side (decoding) and at least 16 on the other, the GEMV
      template of :mod:`.cuda_gemv` (the larger operand streamed once, coalesced along its unit
      stride, the rows' sums in registers; float32 products and sums).

Semantics follow the reference evaluator (:mod:`shardflow.compiler.ir.evaluate`) node by node:
numpy's result dtypes (computed by numpy itself on empty arrays), floor division and modulo,
NaN-propagating max/min, round half to even, first-index arg-reductions, float16 rounded after
every operation as numpy does, out-of-range reads clamped (reads in an untaken select branch may
be out of bounds). Known differences: float to integer conversions of NaN or out-of-range
values saturate on the GPU, sums are accumulated in a different order (fp32 rounding
differences), and bfloat16 values are rounded to bfloat16 where the numpy evaluator, which has no
bfloat16, keeps float32.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import itertools
import logging
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..ir.expr import (BINARY_FUNCS, ML_FLOATS, UNARY_FUNCS, BinOp, Cast, Const, Expr, IfThenElse, Reduce,
                       TensorElement, UnaryOp, Var, affine_expr, affine_form, format_expr, rebuild, walk)
from ..ir.graph import Operator
from ..ir.task import GridCompute
from ..passes.channels_last import channels_last_copy, channels_last_output, channels_last_read
from . import float8
from .cuda_gemv import GEMV_MAX_ROWS, Codes, gemv_kernel
from .cuda_topk import topk_kernel
from .cuda_templates import PRELUDE, choose_gemm_config, gemm_kernel
from .cuda_wgmma import (PDL_ENTER, PERSISTENT_SMS, SPLIT_HELPERS, STREAM_K_WORKSPACE, WGMMA_ARCHS, WGMMA_DTYPES,
                         DirectOperand, GatherOperand, check_sms, target_sms, wgmma_gemm_kernel,
                         wgmma_helpers)
from .lower import CodegenError, hashcons, kept_select
from .cache import touch
from .toolchain import CompileError, ToolchainError, default_cache_dir

__all__ = ["KernelLaunch", "CudaSource", "CudaCodegenError", "build_cuda_library", "generate_cuda_source",
           "cuda_compile_command", "compile_arch", "lowerable"]

log = logging.getLogger(__name__)


class CudaCodegenError(CodegenError):
    """An op cannot be lowered to CUDA (unsupported dtype or expression)."""


@dataclass(frozen=True)
class KernelLaunch:
    """How to launch one generated kernel.

    Attributes
    ----------
    symbol
        The kernel's ``extern "C"`` name in the cubin. Ops whose kernels are identical (same
        shapes, dtypes and attributes, as in repeated layers) share one symbol.
    grid, block
        Launch dimensions; launch with exactly these (kernels rely on their block size).
    shared_mem
        Dynamic shared memory bytes to pass at launch (the wgmma GEMMs use up to 227 KB: raise the
        kernel's dynamic shared memory limit to this before launching when it exceeds 48 KB).
    args
        Names of the tensors passed as pointers, in order: the op's inputs, then its outputs.
    num_inputs
        How many of ``args`` are inputs.
    op_name
        The op the kernel computes.
    kind
        ``"elementwise"``, ``"row"``, ``"gemm-tf32"``, ``"gemm-f16"``, ``"gemm-bf16"`` (the kinds of
        its parts, joined by ``+`` for multi-output ops).
    tensor_maps
        Descriptions of the tensor maps the kernel takes after its tensor arguments (TMA-fed wgmma
        GEMMs; see :mod:`shardflow.runtime.tma`, whose ``kernel_args`` builds the arguments).
    persistent
        The blocks loop over the work (``gridDim.x`` at a time): ``grid`` is sized for 132
        multiprocessors, and a launcher may lower ``grid[0]`` to the device's count (any value
        is correct; more blocks than multiprocessors would run in a second, unbalanced wave).
    cluster
        Blocks per cluster (the kernel's ``__cluster_dims__``, along x; 1: no clusters). A launcher
        that lowers a persistent grid keeps it a multiple of this.
    """

    symbol: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    args: tuple[str, ...]
    num_inputs: int
    op_name: str
    kind: str = "elementwise"
    tensor_maps: tuple = ()
    persistent: bool = False
    cluster: int = 1

    def to_dict(self) -> dict:
        """Plain JSON-ready form (what a rank program stores; the runtime reads it without the
        compiler)."""
        d = {"symbol": self.symbol, "grid": list(self.grid), "block": list(self.block),
             "shared_mem": self.shared_mem, "args": list(self.args), "num_inputs": self.num_inputs,
             "op_name": self.op_name, "kind": self.kind}
        if self.tensor_maps:
            d["tensor_maps"] = [dict(m) for m in self.tensor_maps]
        if self.persistent:
            d["persistent"] = True
        if self.cluster > 1:
            d["cluster"] = self.cluster
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KernelLaunch":
        """Inverse of :meth:`to_dict`."""
        return cls(d["symbol"], tuple(d["grid"]), tuple(d["block"]), int(d["shared_mem"]), tuple(d["args"]),
                   int(d["num_inputs"]), d["op_name"], d.get("kind", "elementwise"),
                   tuple(d.get("tensor_maps", ())), bool(d.get("persistent", False)), int(d.get("cluster", 1)))


# ----------------------------------------------------------------------------------------------
# dtypes
# ----------------------------------------------------------------------------------------------

_STORE_CTYPE = {
    "bool": "bool", "int8": "signed char", "uint8": "unsigned char", "int16": "short", "uint16": "unsigned short",
    "int32": "int", "uint32": "unsigned int", "int64": "long long", "uint64": "unsigned long long",
    "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double",
    **{t: "unsigned char" for t in float8.FLOAT8},  # (a byte: codegen/float8.py)
}
_REG_CTYPE = dict(_STORE_CTYPE, float16="float", bfloat16="float", **{t: "float" for t in float8.FLOAT8})
_STORE_BYTES = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
                "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, **{t: 1 for t in float8.FLOAT8}}
_FLOATS = {"float16", "bfloat16", "float32", "float64", *float8.FLOAT8}
_INTS = {"int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"}
_INT_RANGE = {d: (int(np.iinfo(d).min), int(np.iinfo(d).max)) for d in _INTS}
_INT_RANGE["bool"] = (0, 1)
_I32 = _INT_RANGE["int32"]
_SMALL_INTS = {"bool", "int8", "uint8", "int16", "uint16", "int32"}  # every value fits in int32
_CMP = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_BOOL_UNARY = {"not", "isnan", "isinf", "isposinf", "isneginf"}
_FLOAT_FN = {
    "exp": "exp", "log": "log", "sqrt": "sqrt", "sin": "sin", "cos": "cos", "tan": "tan", "asin": "asin",
    "acos": "acos", "atan": "atan", "sinh": "sinh", "cosh": "cosh", "tanh": "tanh", "asinh": "asinh",
    "acosh": "acosh", "atanh": "atanh", "erf": "erf", "floor": "floor", "ceil": "ceil", "round": "rint",
    "log1p": "log1p", "expm1": "expm1",
}


_NP_REDUCERS = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min, "mean": np.mean}


def _np_proxy(dt: str) -> np.ndarray:
    return np.zeros(0, dtype=np.float32 if dt in ML_FLOATS else dt)


def _from_np(r, ml: str | None) -> str:
    """numpy's result dtype ``r`` of an operation on a value of type ``ml`` (bfloat16, a float8
    type, which the proxies compute as float32) or on numpy types (``ml`` None)."""
    r = str(np.dtype(r))
    return ml if ml is not None and r == "float32" else r


def _ml(*dts) -> str | None:
    return next((d for d in dts if d in ML_FLOATS), None)


def _weak_promote(a: Expr, b: Expr) -> str:
    va = a.value if isinstance(a, Const) else 0
    vb = b.value if isinstance(b, Const) else 0
    if isinstance(va, bool) and isinstance(vb, bool):
        return "bool"
    if isinstance(va, float) or isinstance(vb, float):
        return "float32"
    return "int64"


@functools.lru_cache(maxsize=None)
def _unary_result(op: str, dt: str) -> str:
    with np.errstate(all="ignore"):
        r = np.asarray(UNARY_FUNCS[op](_np_proxy(dt))).dtype
    return _from_np(r, _ml(dt))


@functools.lru_cache(maxsize=None)
def _binary_result(fn, da, db, wa, wb) -> str:
    """numpy's result dtype of ``fn`` (a BINARY_FUNCS key, or ``"where"``/``"common"``) on an
    operand of dtype ``da`` (or the weak Python scalar ``wa`` when ``da`` is None) and ``db``/``wb``."""
    x = _np_proxy(da) if da is not None else wa
    y = _np_proxy(db) if db is not None else wb
    with np.errstate(all="ignore"):
        if fn == "common":
            r = np.result_type(x, y)
        elif fn == "where":
            r = np.result_type(x, y)
        else:
            r = np.asarray(BINARY_FUNCS[fn](x, y)).dtype
    return _from_np(r, _ml(da, db))


@functools.lru_cache(maxsize=None)
def _reduce_result(op: str, dt: str) -> str:
    if op in ("argmax", "argmin"):
        return "int64"
    with np.errstate(all="ignore"):
        r = np.asarray(_NP_REDUCERS[op](np.zeros(1, np.float32 if dt in ML_FLOATS else dt))).dtype
    return _from_np(r, _ml(dt))


def _float_literal(x: float, reg: str) -> str:
    """A C literal for float value ``x`` in a ``float`` or ``double`` register."""
    if reg == "double":
        if math.isnan(x):
            return "__longlong_as_double(0x7ff8000000000000LL)"
        if math.isinf(x):
            return "__longlong_as_double(0x7ff0000000000000LL)" if x > 0 else "__longlong_as_double(0xfff0000000000000LL)"
        return repr(float(x))
    if math.isnan(x):
        return "__int_as_float(0x7fc00000)"
    if math.isinf(x):
        return "__int_as_float(0x7f800000)" if x > 0 else "__int_as_float(0xff800000)"
    s = repr(float(x))
    if "e" not in s and "." not in s:
        s += ".0"
    return s + "f"


def _round_bf16(x: float) -> float:
    a = np.array([x], np.float32).view(np.uint32)
    if np.isnan(x):
        return float(x)
    lsb = (a >> 16) & 1
    a = ((a + 0x7FFF + lsb) >> 16) << 16
    return float(a.astype(np.uint32).view(np.float32)[0])


def _literal(v, dt: str) -> str:
    """C literal of Python/numpy value ``v`` converted to dtype ``dt`` (numpy ``astype`` rules)."""
    with np.errstate(all="ignore"):
        if dt == "bool":
            return "true" if bool(v) else "false"
        if dt in _FLOATS:
            if dt == "float64":
                return _float_literal(float(v), "double")
            if dt == "float16":
                return _float_literal(float(np.float16(v)), "float")
            if dt == "bfloat16":
                return _float_literal(_round_bf16(float(np.float32(v))), "float")
            if dt in float8.FLOAT8:
                return _float_literal(float8.round_value(v, dt), "float")
            return _float_literal(float(np.float32(v)), "float")
        if isinstance(v, float) and not math.isfinite(v):
            iv = 0
        else:
            try:
                iv = int(np.array(v).astype(dt))
            except (OverflowError, ValueError):
                iv = int(np.array(v, dtype=np.int64).astype(dt))
    if dt == "int64":
        return "(-9223372036854775807LL - 1)" if iv == -2 ** 63 else f"{iv}LL"
    if dt == "uint64":
        return f"{iv}ULL"
    if dt == "int32":
        return "(-2147483647 - 1)" if iv == -2 ** 31 else str(iv)
    if dt == "uint32":
        return f"{iv}u"
    return f"(({_STORE_CTYPE[dt]}){iv})"


def _convert(x: str, src: str, dst: str) -> str:
    """C expression converting register value ``x`` of dtype ``src`` to dtype ``dst``."""
    if src == dst:
        return x
    if dst == "bool":
        return f"(({x}) != 0)"
    if dst == "float16":
        if _REG_CTYPE[src] == "float":
            return f"sf_rh({x})"
        if src == "float64":
            return f"sf_rh_d({x})"
        return f"sf_rh((float)({x}))"
    if dst == "bfloat16":
        if _REG_CTYPE[src] == "float":
            return f"sf_rb({x})"
        if src == "float64":
            return f"sf_rb_d({x})"
        return f"sf_rb((float)({x}))"
    if dst in float8.FLOAT8:  # (from float64 through float32: rounded twice, off only next to a tie)
        return float8.rounded(x if _REG_CTYPE[src] == "float" else f"(float)({x})", dst)
    if dst == "float32":
        return x if _REG_CTYPE[src] == "float" else f"(float)({x})"
    if dst == "float64":
        return f"(double)({x})"
    # integer destination
    ct = _REG_CTYPE[dst]
    if src in _FLOATS:
        # x86 numpy converts through a wide integer and truncates (no saturation for small types)
        if dst in ("int8", "uint8", "int16", "uint16"):
            return f"(({ct})(int)({x}))"
        if dst == "uint32":
            return f"(({ct})(long long)({x}))"
    return f"(({ct})({x}))"


_ROUNDERS = {"float16": "sf_rh", "bfloat16": "sf_rb", **{t: float8.rounder(t) for t in float8.FLOAT8}}


def _rounded_arg(expr: str, fn: str) -> str | None:
    """``X`` when ``expr`` is exactly ``fn(X)`` (the call's parentheses enclose the rest), else None."""
    if not (expr.startswith(fn + "(") and expr.endswith(")")):
        return None
    depth = 0
    for i, ch in enumerate(expr[len(fn):]):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and i != len(expr) - len(fn) - 1:
            return None  # the first parenthesis closes before the end: fn(a) op g(b)
    return expr[len(fn) + 1:-1]


def _store(x: str, dt: str) -> str:
    if dt == "float16":
        return f"__float2half_rn({x})"
    if dt == "bfloat16":
        return f"__float2bfloat16_rn({x})"
    if dt in float8.FLOAT8:
        return float8.store(x, dt)
    return x


def _load(x: str, dt: str) -> str:
    if dt == "float16":
        return f"__half2float({x})"
    if dt == "bfloat16":
        return f"__bfloat162float({x})"
    if dt in float8.FLOAT8:
        return float8.load(x, dt)
    return x


def _check_dtype(dt: str, where: str) -> None:
    if dt not in _STORE_CTYPE:
        raise CudaCodegenError(f"{where}: dtype {dt} is not supported by the cuda target")


# ----------------------------------------------------------------------------------------------
# expression analysis
# ----------------------------------------------------------------------------------------------

#: the unsigned type in which a non-negative integer of each type is divided (plain division and
#: remainder, shifts and masks for powers of two), and each type's bit width
_UNSIGNED_AS = {"int32": "unsigned", "int64": "unsigned long long"}
_INT_BITS = {"int32": 32, "int64": 64}


class _Analysis:
    """Memoized per-node facts: numpy dtype, free variables, integer bounds, 32-bit narrowing."""

    def __init__(self):
        self._dt: dict[int, str | None] = {}
        self._fv: dict[int, frozenset] = {}
        self._bd: dict[int, tuple[int, int] | None] = {}
        self._nw: dict[int, bool] = {}
        self._keep: list = []  # keep analysed nodes alive so ids stay unique

    # dtype ------------------------------------------------------------------------------
    def dtype(self, e: Expr) -> str | None:
        k = id(e)
        if k not in self._dt:
            self._keep.append(e)
            self._dt[k] = self._dtype(e)
        return self._dt[k]

    def _weak(self, e: Expr):
        return e.value if isinstance(e, Const) and e.dtype is None else None

    def _pair(self, fn: str, a: Expr, b: Expr) -> str:
        da, db = self.dtype(a), self.dtype(b)
        if da is None and db is None:
            r = _weak_promote(a, b)
            if fn == "div" and r in ("int64", "bool"):
                return "float64"
            if fn in _CMP or fn in ("and", "or", "xor"):
                return "bool"
            return r
        try:
            return _binary_result(fn, da, db, self._weak(a) if da is None else None,
                                  self._weak(b) if db is None else None)
        except (OverflowError, TypeError, ValueError) as exc:
            raise CudaCodegenError(f"no numpy semantics for {fn} on {da or repr(self._weak(a))} and "
                                   f"{db or repr(self._weak(b))}: {exc}") from None

    def _dtype(self, e: Expr) -> str | None:
        if isinstance(e, Var):
            return "int64"
        if isinstance(e, Const):
            return e.dtype
        if isinstance(e, TensorElement):
            return str(e.tensor.dtype)
        if isinstance(e, Cast):
            return e.dtype
        if isinstance(e, BinOp):
            return self._pair(e.op, e.a, e.b)
        if isinstance(e, UnaryOp):
            d = self.dtype(e.a)
            if d is None:
                d = {"bool": "bool", "int64": "int64"}.get(_weak_promote(e.a, e.a), "float32")
            try:
                return _unary_result(e.op, d)
            except (TypeError, ValueError) as exc:
                raise CudaCodegenError(f"no numpy semantics for {e.op} on {d}: {exc}") from None
        if isinstance(e, IfThenElse):
            return self._pair("where", e.then, e.other)
        if isinstance(e, Reduce):
            d = self.dtype(e.body)
            if d is None:
                d = _weak_promote(e.body, e.body)
            return _reduce_result(e.op, d)
        raise CudaCodegenError(f"cannot lower expression node {type(e).__name__}")

    def cdtype(self, e: Expr, fallback: str) -> str:
        d = self.dtype(e)
        return fallback if d is None else d

    # free variables ------------------------------------------------------------------------
    def free(self, e: Expr) -> frozenset:
        k = id(e)
        r = self._fv.get(k)
        if r is None:
            if isinstance(e, Var):
                r = frozenset((e,))
            elif isinstance(e, Reduce):
                r = self.free(e.body) - frozenset(e.vars)
            else:
                r = frozenset().union(*(self.free(c) for c in e.children())) if e.children() else frozenset()
            self._keep.append(e)
            self._fv[k] = r
        return r

    # integer bounds ------------------------------------------------------------------------
    def bounds(self, e: Expr) -> tuple[int, int] | None:
        k = id(e)
        if k not in self._bd:
            self._keep.append(e)
            self._bd[k] = self._bounds(e)
        return self._bd[k]

    def _bounds(self, e: Expr):
        if isinstance(e, Var):
            return (0, max(e.extent - 1, 0))
        if isinstance(e, Const):
            if isinstance(e.value, (bool, int, np.integer)):
                return (int(e.value), int(e.value))
            return None
        dt = self.dtype(e)
        if isinstance(e, TensorElement):
            return _INT_RANGE.get(dt) if dt in ("bool", "int8", "uint8", "int16", "uint16", "int32") else None
        if isinstance(e, Cast):
            if dt == "bool":
                return (0, 1)
            b = self.bounds(e.a)
            if b is None or dt not in _INT_RANGE or self.dtype(e.a) in _FLOATS:
                return None
            lo, hi = _INT_RANGE[dt]
            return b if lo <= b[0] and b[1] <= hi else None
        if isinstance(e, BinOp):
            if e.op in _CMP or e.op in ("and", "or", "xor"):
                return (0, 1)
            if dt not in _INT_RANGE:
                return None
            a, b = self.bounds(e.a), self.bounds(e.b)
            if a is None or b is None:
                if e.op == "mod" and b is not None and b[0] > 0:
                    return (0, b[1] - 1)
                return None
            if e.op == "add":
                return (a[0] + b[0], a[1] + b[1])
            if e.op == "sub":
                return (a[0] - b[1], a[1] - b[0])
            if e.op == "mul":
                ps = [a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]]
                return (min(ps), max(ps))
            if e.op == "floordiv" and b[0] > 0:
                return (min(a[0] // b[0], a[0] // b[1]), max(a[1] // b[0], a[1] // b[1]))
            if e.op == "mod" and b[0] > 0:
                if a[0] >= 0 and a[1] < b[0]:
                    return a
                return (0, b[1] - 1)
            if e.op == "max":
                return (max(a[0], b[0]), max(a[1], b[1]))
            if e.op == "min":
                return (min(a[0], b[0]), min(a[1], b[1]))
            return None
        if isinstance(e, UnaryOp):
            if e.op in _BOOL_UNARY:
                return (0, 1)
            b = self.bounds(e.a)
            if b is None or dt not in _INT_RANGE:
                return None
            if e.op == "neg":
                return (-b[1], -b[0])
            if e.op == "abs":
                return (0 if b[0] <= 0 <= b[1] else min(abs(b[0]), abs(b[1])), max(abs(b[0]), abs(b[1])))
            if e.op == "sign":
                return (-1, 1)
            return None
        if isinstance(e, IfThenElse):
            a, b = self.bounds(e.then), self.bounds(e.other)
            if a is None or b is None:
                return None
            return (min(a[0], b[0]), max(a[1], b[1]))
        if isinstance(e, Reduce):
            if e.op in ("argmax", "argmin"):
                return (0, max(e.vars[0].extent - 1, 0))
            if e.op in ("max", "min") and dt in _INT_RANGE:
                return self.bounds(e.body)
            return None
        return None

    # 32-bit narrowing of int64 index arithmetic ----------------------------------------------
    def narrow(self, e: Expr) -> bool:
        """True when an int64 node can be computed exactly in 32-bit ints (it and every int64
        operand it is computed from stay within int32)."""
        k = id(e)
        r = self._nw.get(k)
        if r is None:
            r = self._narrow(e)
            self._keep.append(e)
            self._nw[k] = r
        return r

    def _narrow(self, e: Expr) -> bool:
        if self.dtype(e) != "int64":
            return False
        b = self.bounds(e)
        if b is None or b[0] < _I32[0] or b[1] > _I32[1]:
            return False
        if isinstance(e, (Var, Const)):
            return True
        if isinstance(e, Reduce):
            return e.op in ("argmax", "argmin")
        if isinstance(e, TensorElement):
            return False
        if isinstance(e, BinOp) and e.op in ("shl", "shr", "pow"):
            return False
        kids = (e.then, e.other) if isinstance(e, IfThenElse) else e.children()
        for c in kids:
            dc = self.dtype(c)
            if dc == "int64" and not self.narrow(c):
                return False
            if dc is not None and dc not in _SMALL_INTS and dc != "int64":
                return False
        return True

    def eff(self, e: Expr) -> str | None:
        """The dtype a node is computed in: numpy's, except int64 index math narrowed to int32."""
        return "int32" if self.narrow(e) else self.dtype(e)


# ----------------------------------------------------------------------------------------------
# inlining reads of other computes of the same task
# ----------------------------------------------------------------------------------------------



def _map_tree(e: Expr, fn, memo: dict) -> Expr:
    """Rebuild ``e`` bottom-up; ``fn(node, new_children)`` may return a replacement or None."""
    k = id(e)
    if k in memo:
        return memo[k]
    kids = [_map_tree(c, fn, memo) for c in e.children()]
    r = fn(e, kids)
    if r is None:
        r = e if all(a is b for a, b in zip(kids, e.children())) else rebuild(e, kids)
    memo[k] = r
    return r


#: dtypes whose one-element constant inputs are written into the kernel as literals
_BAKED = ("float32", "float64", "int32", "int64", "bool")


def _scalar_constants(op: Operator) -> dict[int, Const]:
    """``id(placeholder) -> Const`` for the one-element constant inputs of ``op`` (weights such
    as GPT-2's GELU constants and its cube's exponent 3): the kernel uses their values as literals
    instead of reading them, so ``Pow(x, 3)`` becomes ``x * x * x`` at code generation (not a
    test per element with ``pow``'s general path compiled beside it) and the reads go away."""
    return {id(ph): Const(np.asarray(t.value).reshape(()).item(), ph.dtype)
            for ph, t in zip(op.task.inputs, op.inputs)
            if t.is_constant and t.size == 1 and ph.dtype in _BAKED}


def _bake(value: Expr, scalars: dict[int, Const]) -> Expr:
    """``value`` with its reads of the ``scalars`` placeholders replaced by their constants."""
    if not scalars:
        return value
    return _map_tree(value, lambda e, _k: scalars.get(id(e.tensor)) if isinstance(e, TensorElement) else None, {})


def _inline_computes(value: Expr, an: _Analysis) -> Expr:
    """Replace reads of other grid computes (fused definitions) by their definitions, with the
    read indices clamped as the evaluator does."""
    if not any(isinstance(n, TensorElement) and isinstance(n.tensor, GridCompute) for n in walk(value)):
        return value
    cache: dict[int, Expr] = {}

    def fn(e, kids):
        if isinstance(e, TensorElement) and isinstance(e.tensor, GridCompute):
            gc = e.tensor
            if id(gc) not in cache:
                cache[id(gc)] = _inline_computes(gc.value, an)
            body = cache[id(gc)]
            sub = {}
            for ax, ix, ext in zip(gc.axes, kids, gc.shape):
                b = an.bounds(ix)
                if not (b is not None and b[0] >= 0 and b[1] <= ext - 1):
                    ix = BinOp("min", BinOp("max", ix, Const(0)), Const(max(ext - 1, 0)))
                sub[ax] = ix
            r = _map_tree(body, lambda n, _k: sub.get(n) if isinstance(n, Var) else None, {})
            if gc.dtype is not None and an.dtype(r) != gc.dtype:
                r = Cast(r, gc.dtype)
            return r
        return None

    return _map_tree(value, fn, {})


# ----------------------------------------------------------------------------------------------
# the emitter: SSA C code with loop-invariant hoisting
# ----------------------------------------------------------------------------------------------

class _Block:
    """A C scope: its own lines, the variables it binds and the values computed in it."""

    __slots__ = ("parent", "binds", "lines", "cache", "coop")

    def __init__(self, parent: "_Block | None", binds: dict | None = None, coop: "_Coop | None" = None):
        self.parent = parent
        self.binds: dict[Var, tuple[str, str]] = binds or {}
        self.lines: list[str] = []
        self.cache: dict[int, tuple[str, str]] = {}
        self.coop = coop

    def chain(self):
        b = self
        while b is not None:
            yield b
            b = b.parent


@dataclass
class _Coop:
    """Lanes that compute hoisted reductions together: a warp (32) or the whole block."""

    lanes: int
    lane: str = "sf_lane"


@dataclass
class _Lanes:
    """Consecutive outputs along axis ``var`` that one thread's GEMM epilogue computes together:
    lane ``j`` of ``width`` is the output at ``var + j``. A read that steps one element with
    ``var`` (and starts on a multiple of ``width``) is one vector load, made by lane 0
    (``loaded``: read node -> the loaded vector's name); the other lanes take their element."""

    var: Var
    width: int
    j: int = 0
    loaded: dict[int, str] = field(default_factory=dict)

    def unit_stride(self, e: TensorElement, shape: tuple[int, ...], an: "_Analysis") -> bool:
        f = _flat_affine(e, shape, an)  # None: not affine, or clamped
        if f is None:
            return False
        flat, const = f
        return (flat.get(self.var) == 1 and const % self.width == 0
                and all(k % self.width == 0 for v, k in flat.items() if v is not self.var))


class _Emitter:
    def __init__(self, an: _Analysis, reads: dict[int, tuple[str, tuple[int, ...], str]], names):
        self.an = an
        self.reads = reads  # id(placeholder) -> (pointer name, shape, dtype)
        self.names = names
        self.subst: dict[int, tuple[str, str]] = {}
        self.coop_ids: set[int] = set()
        self.uses_block_smem = False
        self.lanes: _Lanes | None = None  # set while a vectorized GEMM epilogue is emitted
        #: half-precision SSA values -> the float they round (a store rounds that once: stored())
        self.unrounded: dict[str, str] = {}
        #: ids of the half products a float32 sum adds unrounded (:meth:`_exact_product`)
        self.exact: set[int] = set()

    def new(self, prefix: str = "v") -> str:
        return f"{prefix}{next(self.names)}"

    # values ------------------------------------------------------------------------------
    def value(self, e: Expr, blk: _Block) -> tuple[str, str]:
        k = id(e)
        if k in self.subst:
            return self.subst[k]
        if isinstance(e, Const):
            dt = e.dtype or _weak_promote(e, e)
            return _literal(e.value, dt), dt
        if isinstance(e, Var):
            for b in blk.chain():
                if e in b.binds:
                    return b.binds[e]
            raise CudaCodegenError(f"axis variable {e.name} is not bound (malformed compute definition)")
        for b in blk.chain():
            if k in b.cache:
                return b.cache[k]
        tgt = self._target(e, blk)
        res = self._emit(e, tgt)
        tgt.cache[k] = res
        return res

    def value_as(self, e: Expr, dt: str, blk: _Block) -> str:
        if isinstance(e, Const) and id(e) not in self.subst:
            v = e.value
            if e.dtype is not None and e.dtype != dt:
                with np.errstate(all="ignore"):
                    v = np.array(v, dtype=np.float32 if e.dtype in ML_FLOATS else e.dtype)[()]
            return _literal(v, dt)
        x, src = self.value(e, blk)
        return _convert(x, src, dt)

    def _target(self, e: Expr, blk: _Block) -> _Block:
        fv = self.an.free(e)
        last = blk
        for b in blk.chain():
            if fv and any(v in b.binds for v in fv):
                return b
            last = b
        return last

    def _ssa(self, blk: _Block, dt: str, expr: str) -> tuple[str, str]:
        name = self.new()
        inner = _rounded_arg(expr, _ROUNDERS[dt]) if dt in _ROUNDERS else None
        if inner is not None:  # the unrounded value named too: a store of this value rounds it once
            self.unrounded[name] = self.new()
            blk.lines.append(f"const float {self.unrounded[name]} = {inner};")
            expr = f"{_ROUNDERS[dt]}({self.unrounded[name]})"
        blk.lines.append(f"const {_REG_CTYPE[dt]} {name} = {expr};")
        return name, dt

    def stored(self, x: str, dt: str) -> str:
        """The C expression storing register value ``x`` as ``dt``: a float16/bfloat16 value that is
        the rounding of a float is stored from that float (rounding twice to the same type gives the
        same value; the conversion back and forth is saved)."""
        inner = _rounded_arg(x, _ROUNDERS[dt]) if dt in _ROUNDERS else None
        return _store(self.unrounded.get(x) or inner or x, dt)

    # nodes -------------------------------------------------------------------------------
    def _emit(self, e: Expr, blk: _Block) -> tuple[str, str]:
        if isinstance(e, TensorElement):
            return self._read(e, blk)
        if isinstance(e, Cast):
            x, src = self.value(e.a, blk)
            dt = self.an.eff(e)
            return self._ssa(blk, dt, _convert(x, src, dt))
        if isinstance(e, BinOp):
            return self._binop(e, blk)
        if isinstance(e, UnaryOp):
            return self._unary(e, blk)
        if isinstance(e, IfThenElse):
            dt = self.an.eff(e) or _weak_promote(e.then, e.other)
            c = self.value_as(e.cond, "bool", blk)
            a = self.value_as(e.then, dt, blk)
            b = self.value_as(e.other, dt, blk)
            return self._ssa(blk, dt, f"({c} ? {a} : {b})")
        if isinstance(e, Reduce):
            if id(e) in self.coop_ids and blk.coop is not None:
                return self._reduce(e, blk, coop=blk.coop)
            return self._reduce(e, blk, coop=None)
        raise CudaCodegenError(f"cannot lower expression node {type(e).__name__}")

    def _read(self, e: TensorElement, blk: _Block) -> tuple[str, str]:
        ref = self.reads.get(id(e.tensor))
        if ref is None:
            raise CudaCodegenError(f"read of tensor {getattr(e.tensor, 'name', '?')} that is not an input of the op")
        ptr, shape, dt = ref
        size = int(np.prod(shape, dtype=np.int64))
        if size == 0:
            return _literal(0, dt), dt
        lanes = self.lanes
        vector = lanes is not None and lanes.unit_stride(e, shape, self.an)
        if vector and lanes.j > 0:
            return self._ssa(blk, dt, _load(f"{lanes.loaded[id(e)]}.v[{lanes.j}]", dt))
        wide = size > _I32[1]
        terms = []
        for ie, ext, st in zip(e.indices, shape, _row_major_strides(shape)):
            if ext == 1:
                continue
            x, src = self.value(ie, blk)
            if src in _FLOATS:
                x, src = f"(long long)({x})", "int64"
            elif src not in ("int32", "int64"):
                x, src = _convert(x, src, "int64"), "int64"
            b = self.an.bounds(ie)
            if not (b is not None and b[0] >= 0 and b[1] <= ext - 1):
                ct = _REG_CTYPE[src]
                tmp = self.new("ix")
                blk.lines.append(f"const {ct} {tmp} = {x};")
                x = f"({tmp} < ({ct})0 ? ({ct})0 : ({tmp} > ({ct}){ext - 1} ? ({ct}){ext - 1} : {tmp}))"
            if src == "int64" and not wide:
                x = f"(int)({x})"
            terms.append(x if st == 1 else f"({x}) * {st}{'LL' if wide else ''}")
        off = " + ".join(terms) if terms else "0"
        if vector:  # lane 0: the lanes' elements in one access
            vt = f"SfVec{lanes.width}<{_STORE_CTYPE[dt]}>"
            q = lanes.loaded[id(e)] = self.new("q")
            blk.lines.append(f"const {vt} {q} = *reinterpret_cast<const {vt}*>({ptr} + {off});")
            return self._ssa(blk, dt, _load(f"{q}.v[0]", dt))
        name = self.new()
        blk.lines.append(f"const {_REG_CTYPE[dt]} {name} = {_load(f'{ptr}[{off}]', dt)};")
        return name, dt

    def _binop(self, e: BinOp, blk: _Block) -> tuple[str, str]:
        an, op = self.an, e.op
        if op in _CMP:
            cd = an._pair("common", e.a, e.b)
            if cd == "int64":
                ok = True
                for c in (e.a, e.b):
                    if isinstance(c, Const):
                        ok = ok and isinstance(c.value, (bool, int)) and _I32[0] <= int(c.value) <= _I32[1]
                    else:
                        ok = ok and an.eff(c) in _SMALL_INTS
                if ok:
                    cd = "int32"
            a, b = self.value_as(e.a, cd, blk), self.value_as(e.b, cd, blk)
            return self._ssa(blk, "bool", f"({a} {_CMP[op]} {b})")
        if op in ("and", "or", "xor"):
            a, b = self.value_as(e.a, "bool", blk), self.value_as(e.b, "bool", blk)
            sym = {"and": "&&", "or": "||", "xor": "!="}[op]
            return self._ssa(blk, "bool", f"({a} {sym} {b})")
        dt = an.eff(e)
        if dt is None:
            dt = an._pair(op, e.a, e.b)
        a, b = self.value_as(e.a, dt, blk), self.value_as(e.b, dt, blk)
        is_f = dt in _FLOATS
        ct = _REG_CTYPE[dt]
        if dt == "bool":
            expr = {"add": f"({a} || {b})", "mul": f"({a} && {b})", "max": f"({a} || {b})", "min": f"({a} && {b})",
                    "bitand": f"({a} && {b})", "bitor": f"({a} || {b})", "bitxor": f"({a} != {b})"}.get(op)
            if expr is None:
                raise CudaCodegenError(f"operation {op} on booleans has no numpy semantics")
            return self._ssa(blk, dt, expr)
        if op in ("add", "sub", "mul"):
            sym = {"add": "+", "sub": "-", "mul": "*"}[op]
            expr = f"({a} {sym} {b})"
            if not is_f:
                expr = f"(({ct}){expr})"
        elif op == "div" or (op == "truncdiv" and is_f):
            expr = f"({a} / {b})"
        elif op == "truncdiv":
            expr = f"sf_truncdiv_int<{ct}>({a}, {b})"
        elif op in ("floordiv", "mod") and dt in _UNSIGNED_AS and self._non_negative(e.a) \
                and (an.bounds(e.b) or (0, 0))[0] > 0:
            # (index arithmetic: numpy's floor semantics are C's on non-negative values, and in
            # unsigned arithmetic a power-of-two divisor is a shift or a mask)
            ut = _UNSIGNED_AS[dt]
            expr = f"(({ct})(({ut}){a} {'/' if op == 'floordiv' else '%'} ({ut}){b}))"
        elif op == "floordiv":
            expr = f"sf_floordiv_f<{ct}>({a}, {b})" if is_f else f"sf_floordiv<{ct}>({a}, {b})"
        elif op == "mod":
            expr = f"sf_mod_f<{ct}>({a}, {b})" if is_f else f"sf_mod<{ct}>({a}, {b})"
        elif op == "fmod":
            expr = f"fmod({a}, {b})" if is_f else f"sf_fmod_int<{ct}>({a}, {b})"
        elif op == "pow":
            if is_f:
                if isinstance(e.b, Const) and not isinstance(e.b.value, bool) and e.b.value in (2, 3, 4):
                    # small integer powers as products (GPT-2's GELU cubes): pow() takes the slow
                    # general path (logarithm, exponential, special cases) for every element
                    expr = "(" + " * ".join([a] * int(e.b.value)) + ")"
                else:  # the same, tested at run time (an exponent read from a weight)
                    expr = f"sf_fpow({a}, ({ct}){b})"
            else:
                expr = f"sf_ipow<{ct}>({a}, {b})"
        elif op in ("max", "min"):
            expr = f"sf_f{op}<{ct}>({a}, {b})" if is_f else f"sf_i{op}<{ct}>({a}, {b})"
        elif op in ("bitand", "bitor", "bitxor"):
            if is_f:
                raise CudaCodegenError(f"bitwise {op} on {dt} has no numpy semantics")
            sym = {"bitand": "&", "bitor": "|", "bitxor": "^"}[op]
            expr = f"(({ct})({a} {sym} {b}))"
        elif op in ("shl", "shr"):
            if is_f:
                raise CudaCodegenError(f"shift {op} on {dt} has no numpy semantics")
            nb = an.bounds(e.b)
            if op == "shr" and dt in _UNSIGNED_AS and nb is not None and 0 <= nb[0] and nb[1] < _INT_BITS[dt]:
                expr = f"(({ct})({a} >> {b}))"  # (a count known to be in range: a low-bit code's)
            else:
                expr = f"sf_{op}<{ct}>({a}, {b})"
        else:
            raise CudaCodegenError(f"binary operation {op} is not supported by the cuda target")
        rounded = op not in ("max", "min") and id(e) not in self.exact  # (exact: _exact_product)
        if dt == "float16" and rounded:
            expr = f"sf_rh({expr})"
        elif dt == "bfloat16" and rounded:
            expr = f"sf_rb({expr})"
        elif dt in float8.FLOAT8 and op not in ("max", "min"):
            raise CudaCodegenError(f"{op} on {dt} values: ONNX has no float8 arithmetic; cast to float32 first")
        return self._ssa(blk, dt, expr)

    def _non_negative(self, e: Expr) -> bool:
        b = self.an.bounds(e)
        return b is not None and b[0] >= 0

    def _unary(self, e: UnaryOp, blk: _Block) -> tuple[str, str]:
        an, op = self.an, e.op
        src = an.cdtype(e.a, _weak_promote(e.a, e.a))
        if op in _BOOL_UNARY:
            if op == "not":
                x = self.value_as(e.a, "bool", blk)
                return self._ssa(blk, "bool", f"(!{x})")
            x, xs = self.value(e.a, blk)
            if xs not in _FLOATS:
                return "false", "bool"
            expr = {"isnan": f"isnan({x})", "isinf": f"isinf({x})", "isposinf": f"(isinf({x}) && {x} > 0)",
                    "isneginf": f"(isinf({x}) && {x} < 0)"}[op]
            return self._ssa(blk, "bool", expr)
        dt = an.eff(e) or _unary_result(op, src)
        x = self.value_as(e.a, dt, blk)
        is_f = dt in _FLOATS
        ct = _REG_CTYPE[dt]
        suffix = "f" if ct == "float" else ""
        if dt == "bool":
            expr = {"neg": None, "abs": x, "bitnot": f"(!{x})", "sign": None, "floor": x, "ceil": x, "round": x,
                    "reciprocal": None}.get(op)
            if expr is None:
                raise CudaCodegenError(f"operation {op} on booleans is not supported by the cuda target")
            return self._ssa(blk, dt, expr)
        if op == "neg":
            expr = f"(-{x})" if is_f else f"(({ct})(-{x}))"
        elif op == "abs":
            expr = f"fabs{suffix}({x})" if is_f else (x if dt.startswith("uint") else f"(({ct})({x} < 0 ? -{x} : {x}))")
        elif op == "sign":
            expr = f"sf_sign_f<{ct}>({x})" if is_f else f"sf_sign_i<{ct}>({x})"
        elif op == "bitnot":
            if is_f:
                raise CudaCodegenError(f"bitnot on {dt} has no numpy semantics")
            expr = f"(({ct})(~{x}))"
        elif op in ("floor", "ceil", "round") and not is_f:
            expr = x
        elif op == "reciprocal":
            expr = f"(1.0{suffix} / {x})" if is_f else f"sf_recip_int<{ct}>({x})"
        elif op == "rsqrt":
            expr = f"(1.0{suffix} / sqrt{suffix}({x}))" if is_f else None
        elif op == "sigmoid":
            expr = f"(1.0{suffix} / (1.0{suffix} + exp{suffix}(-{x})))" if is_f else None
        elif op in _FLOAT_FN:
            expr = f"{_FLOAT_FN[op]}{suffix}({x})" if is_f else None
        else:
            expr = None
        if expr is None:
            raise CudaCodegenError(f"unary operation {op} on {dt} is not supported by the cuda target")
        if dt == "float16" and op not in ("neg", "abs", "sign", "floor", "ceil", "round"):
            expr = f"sf_rh({expr})"
        elif dt == "bfloat16" and op not in ("neg", "abs", "sign", "floor", "ceil", "round"):
            expr = f"sf_rb({expr})"
        elif dt in float8.FLOAT8 and op not in ("neg", "abs", "sign", "floor", "ceil", "round"):
            raise CudaCodegenError(f"{op} on {dt} values: ONNX has no float8 arithmetic; cast to float32 first")
        return self._ssa(blk, dt, expr)

    # reductions ----------------------------------------------------------------------------
    def _acc_type(self, e: Reduce) -> tuple[str, str]:
        """(body dtype used for combining, accumulator dtype)."""
        an = self.an
        bd = an.cdtype(e.body, _weak_promote(e.body, e.body))
        rd = an.dtype(e)
        if bd in float8.FLOAT8 and e.op not in ("max", "min", "argmax", "argmin"):
            raise CudaCodegenError(f"a {e.op} of {bd} values: ONNX has no float8 arithmetic; cast to float32 first")
        if e.op in ("argmax", "argmin"):
            return bd, ("int32" if bd in ("bool", "int8", "uint8", "int16", "uint16") else
                        "float32" if bd in ("float16", "bfloat16") or bd in float8.FLOAT8 else bd)
        if e.op in ("sum", "prod"):
            if bd in ("float16", "bfloat16", "float32"):
                return bd, "float32"
            return bd, rd
        if e.op == "mean":
            if bd in ("float16", "bfloat16", "float32"):
                return bd, "float32"
            return bd, "float64"
        # max / min
        if bd in ("bool", "int8", "int16", "int32"):
            return bd, "int32"
        if bd in ("uint8", "uint16", "uint32"):
            return bd, "uint32"
        if bd in ("float16", "bfloat16") or bd in float8.FLOAT8:
            return bd, "float32"
        return bd, bd

    def _identity(self, op: str, acc: str) -> str:
        if op in ("sum", "mean"):
            return _literal(0, acc)
        if op == "prod":
            return _literal(1, acc)
        if op in ("argmax", "argmin"):
            return _literal(0, acc)
        if acc in _FLOATS:
            return _literal(float("-inf") if op == "max" else float("inf"), acc)
        lo, hi = _INT_RANGE[acc]
        return _literal(lo if op == "max" else hi, acc)

    def _combine(self, op: str, acc: str, bd: str, a: str, b: str, ai: str = "", bi: str = "") -> list[str]:
        """Statements folding value ``b`` (index ``bi``) into accumulator ``a`` (``ai``)."""
        is_f = acc in _FLOATS
        ct = _REG_CTYPE[acc]
        if op in ("sum", "mean"):
            return [f"{a} = {a} + {b};" if is_f or acc in ("int64", "uint64", "float64") else f"{a} = ({ct})({a} + {b});"]
        if op == "prod":
            if bd == "float16":
                return [f"{a} = sf_rh({a} * {b});"]
            if bd == "bfloat16":
                return [f"{a} = sf_rb({a} * {b});"]
            return [f"{a} = {a} * {b};" if is_f else f"{a} = ({ct})({a} * {b});"]
        if op in ("max", "min"):
            return [f"{a} = sf_{'f' if is_f else 'i'}{op}<{ct}>({a}, {b});"]
        kind = "f" if is_f else "i"
        return [f"if (sf_{op}_take_{kind}<{ct}>({a}, {ai}, {b}, {bi})) {{ {a} = {b}; {ai} = {bi}; }}"]

    def _reduce(self, e: Reduce, blk: _Block, coop: _Coop | None) -> tuple[str, str]:
        an = self.an
        bd, acc = self._acc_type(e)
        act = _REG_CTYPE[acc]
        rd = an.dtype(e)
        a = self.new("acc")
        is_arg = e.op in ("argmax", "argmin")
        ai = a + "i" if is_arg else ""
        blk.lines.append(f"{act} {a} = {self._identity(e.op, acc)};")
        if is_arg:
            blk.lines.append(f"long long {ai} = -1;")
        exts = [v.extent for v in e.vars]
        total = int(np.prod(exts, dtype=np.int64)) if exts else 1
        it = "long long" if total > _I32[1] else "int"
        binds = {}
        names = []
        for v in e.vars:
            nm = self.new("k")
            names.append(nm)
            binds[v] = (nm, "int64" if it == "long long" else "int32") if v.extent != 1 else ("0", "int32")
        body_blk = _Block(blk, binds, coop=None)
        if total > 0:
            product = self._exact_product(e, bd, acc)
            if product is not None:
                self.exact.add(id(product))
            bx, bsrc = self.value(e.body, body_blk)
            bv = _convert(bx, bsrc, acc if not is_arg else acc)
            if is_arg:
                idx = names[0] if e.vars[0].extent != 1 else "0"
                body_blk.lines += self._combine(e.op, acc, bd, a, bv, ai, f"(long long){idx}")
            else:
                body_blk.lines += self._combine(e.op, acc, bd, a, bv)
        if coop is None:
            if total > 0:
                head, tail = [], []
                for v, nm in zip(e.vars, names):
                    if v.extent == 1:
                        continue
                    head.append(f"for ({it} {nm} = 0; {nm} < {v.extent}; ++{nm}) {{")
                    tail.append("}")
                if head:
                    blk.lines.append(" ".join(head))
                    blk.lines += ["  " + ln for ln in body_blk.lines]
                    blk.lines.append(" ".join(tail))
                else:
                    blk.lines.append("{")
                    blk.lines += ["  " + ln for ln in body_blk.lines]
                    blk.lines.append("}")
        else:
            if total > 0:
                r = self.new("r")
                # several independent loads in flight per lane (same order of additions)
                blk.lines += _lane_loop(it, r, coop.lane, total, coop.lanes)
                inner = 1
                dec = []
                big = [v for v in e.vars if v.extent != 1]
                for v, nm in reversed(list(zip(e.vars, names))):
                    if v.extent != 1:
                        if v is big[0]:  # the outermost varying variable needs no modulo (r < total)
                            dec.append(f"  const {it} {nm} = {r} / {inner};" if inner > 1 else f"  const {it} {nm} = {r};")
                        else:
                            dec.append(f"  const {it} {nm} = ({r} / {inner}) % {v.extent};" if inner > 1
                                       else f"  const {it} {nm} = {r} % {v.extent};")
                    inner *= v.extent
                blk.lines += list(reversed(dec))
                blk.lines += ["  " + ln for ln in body_blk.lines]
                blk.lines.append("}")
            blk.lines += self._allreduce(e.op, acc, bd, a, ai, coop)
        # final value
        if e.op == "mean":
            if acc == "float32":
                fin = f"(float)((double){a} / {float(total)!r})"
                fin = _convert(fin, "float32", rd) if rd != "float32" else fin
            else:
                fin = _convert(f"({a} / {float(total)!r})", "float64", rd)
            return self._ssa(blk, rd, fin)
        if is_arg:
            return self._ssa(blk, "int64", f"({ai} < 0 ? 0LL : {ai})")
        return self._ssa(blk, rd, _convert(a, acc, rd))

    def _exact_product(self, e: Reduce, bd: str, acc: str) -> BinOp | None:
        """The product of two half values read from tensors that the float32 sum ``e`` adds (its
        body, or the taken branch of a select whose other one is zero: a conv's padded or strided
        tap), where the product depends on ``e``'s axes (computed in its loop alone). The product
        of two float16 or bfloat16 values is exact in float32: rounded to the half type before a
        float32 accumulation it would only lose accuracy that the tensor-core templates (and
        cuDNN, onnxruntime) keep. ``None`` where there is none."""
        if e.op not in ("sum", "mean") or bd not in ("float16", "bfloat16") or acc != "float32":
            return None

        def zero(x: Expr) -> bool:
            return isinstance(x, Const) and not isinstance(x.value, bool) and x.value == 0

        def read(x: Expr) -> bool:  # (an operand as read, not computed: a tensor's element, a cast
            # of one, a padded read; a product of computed values, a fused Mul(d, d) before a
            # ReduceMean, keeps the rounding of the tensor its op wrote)
            if isinstance(x, IfThenElse):
                return all(read(c) or zero(c) for c in (x.then, x.other))
            return isinstance(x, (TensorElement, Const)) or (isinstance(x, Cast) and read(x.a))

        body = e.body
        while isinstance(body, IfThenElse):
            if zero(body.other) and not zero(body.then):
                body = body.then
            elif zero(body.then) and not zero(body.other):
                body = body.other
            else:
                return None
        if not (isinstance(body, BinOp) and body.op == "mul" and self.an.dtype(body) == bd
                and self.an.dtype(body.a) == bd and self.an.dtype(body.b) == bd and read(body.a) and read(body.b)
                and self.an.free(body) & frozenset(e.vars)):
            return None
        return body

    def _allreduce(self, op: str, acc: str, bd: str, a: str, ai: str, coop: _Coop) -> list[str]:
        ct = _REG_CTYPE[acc]
        ov, oi = self.new("o"), self.new("oi")
        step = [f"const {ct} {ov} = __shfl_xor_sync(SF_FULL_MASK, {a}, sf_off);"]
        if ai:
            step.append(f"const long long {oi} = __shfl_xor_sync(SF_FULL_MASK, {ai}, sf_off);")
        step += self._combine(op, acc, bd, a, ov, ai, oi)
        lines = ["#pragma unroll", "for (int sf_off = 16; sf_off > 0; sf_off >>= 1) {"]
        lines += ["  " + s for s in step]
        lines.append("}")
        if coop.lanes > 32:
            self.uses_block_smem = True
            nw = coop.lanes // 32
            lines += ["__syncthreads();",
                      f"if ((threadIdx.x & 31) == 0) {{ reinterpret_cast<{ct}*>(sf_red)[threadIdx.x >> 5] = {a};"
                      + (f" sf_redi[threadIdx.x >> 5] = {ai};" if ai else "") + " }",
                      "__syncthreads();",
                      f"{a} = reinterpret_cast<{ct}*>(sf_red)[0];"]
            if ai:
                lines.append(f"{ai} = sf_redi[0];")
            w, wv, wi = self.new("w"), self.new("o"), self.new("oi")
            lines.append(f"for (int {w} = 1; {w} < {nw}; ++{w}) {{")
            lines.append(f"  const {ct} {wv} = reinterpret_cast<{ct}*>(sf_red)[{w}];")
            if ai:
                lines.append(f"  const long long {wi} = sf_redi[{w}];")
            lines += ["  " + s for s in self._combine(op, acc, bd, a, wv, ai, wi)]
            lines.append("}")
        return lines


# ----------------------------------------------------------------------------------------------
# lowering one op
# ----------------------------------------------------------------------------------------------

_THREADS = 256
_MAX_GRID = 32768
_WIDE = 2 ** 31 - 2 ** 25  # loop counters above this use 64-bit ints (grid-stride steps must not overflow)


#: unroll factor of the lane loops of row kernels (LayerNorm, softmax, reductions): a warp per row
#: of GPT-2's 1024 x 768 LayerNorm leaves the GPU at 8 warps per multiprocessor, latency-bound
#: unless each lane has several loads in flight
_ROW_UNROLL = 4
#: lane loops of at most this many steps per lane are unrolled completely, so that every load of
#: a pass over the row is in flight at once (GPT-2's LayerNorm: 24 steps, three passes)
_ROW_FULL_UNROLL = 32


def _lane_loop(it: str, var: str, lane: str, total: int, lanes: int) -> list[str]:
    """The head of a loop of ``var`` over ``lane, lane + lanes, ... < total``, opening a ``{``.

    A short loop (at most ``_ROW_FULL_UNROLL`` steps per lane) counts steps from 0, so its trip
    count is a constant and it unrolls completely; a longer one is unrolled by ``_ROW_UNROLL``.
    Either way each lane visits the same elements in the same order.
    """
    steps = -(-total // lanes)
    if steps <= _ROW_FULL_UNROLL and steps > 1:
        step = f"{var}_s"
        head = ["#pragma unroll", f"for (int {step} = 0; {step} < {steps}; ++{step}) {{",
                f"  const {it} {var} = {lane} + {step} * {lanes};"]
        if total % lanes:
            head.append(f"  if ({var} >= {total}) break;")
        return head
    head = [f"#pragma unroll {_ROW_UNROLL}"] if total >= _ROW_UNROLL * lanes else []
    return head + [f"for ({it} {var} = {lane}; {var} < {total}; {var} += {lanes}) {{"]


def _row_major_strides(shape) -> list[int]:
    """Element strides of a dense row-major array of ``shape``."""
    strides, s = [], 1
    for ext in reversed(shape):
        strides.append(s)
        s *= ext
    return strides[::-1]


def _prod(xs) -> int:
    return int(np.prod(list(xs), dtype=np.int64)) if xs else 1


def _decompose(flat: str, axes: list[Var], it: str, prefix: str, names) -> tuple[list[str], dict]:
    """Lines splitting row-major index ``flat`` over ``axes``, and the bindings they make."""
    lines, binds = [], {}
    inner = 1
    vt = "int64" if it == "long long" else "int32"
    for v in reversed(axes):
        if v.extent == 1:
            binds[v] = ("0", "int32")
            continue
        nm = f"{prefix}{next(names)}"
        if inner == 1:
            lines.append(f"const {it} {nm} = {flat} % {v.extent};" if v is not axes[0] else f"const {it} {nm} = {flat};")
        else:
            lines.append(f"const {it} {nm} = ({flat} / {inner}) % {v.extent};" if v is not axes[0]
                         else f"const {it} {nm} = {flat} / {inner};")
        inner *= v.extent
        binds[v] = (nm, vt)
    lines.reverse()
    return lines, binds


def _indent(lines: list[str], n: int) -> list[str]:
    return [" " * n + ln if ln else ln for ln in lines]


@dataclass
class _Part:
    code: list[str]
    grid: int
    kind: str
    block_smem: bool = False


def _plan_rows(gc: GridCompute, value: Expr, an: _Analysis):
    """Choose how to map an output with reductions: ``(row_axes, coop_reduce_ids, lanes)`` or
    ``None`` for one thread per element with serial reductions."""
    reduces = [n for n in walk(value) if isinstance(n, Reduce)]
    if not reduces:
        return None
    axes = list(gc.axes)
    axset = set(axes)
    cands = [r for r in reduces if an.free(r) <= axset]
    if not cands:
        return None

    def ext_of(vs):
        return _prod([v.extent for v in vs])

    full = set().union(*(an.free(r) for r in cands))
    if ext_of([v for v in axes if v not in full]) <= 1:
        shared = [r for r in cands if ext_of([v for v in axes if v not in an.free(r)]) > 1]
        rows_axes = set().union(*(an.free(r) for r in shared)) if shared else set(axes)
        if shared and ext_of([v for v in axes if v not in rows_axes]) > 1:
            full = rows_axes
        else:
            full = set(axes)
    row_axes = [v for v in axes if v in full]
    coop = [r for r in cands if an.free(r) <= full]
    rows = ext_of(row_axes)
    inner = ext_of([v for v in axes if v not in full])
    red = max(_prod([v.extent for v in r.vars]) for r in coop)
    if inner <= 1:
        # One reduction set per output element. Lanes split a reduction when it is long enough and
        # its reads are contiguous along the reduced axis (a row sum); a thread per output walks it
        # alone when reductions are short, or strided across outputs (a column sum: neighbouring
        # threads then read neighbouring addresses).
        if red <= 16 or (rows >= 4096 and not any(_contiguous_reduction(r) for r in coop)):
            return None
    work = max(red, inner)
    lanes = _THREADS if (work >= 2048 or (rows < 512 and work >= 512)) else 32
    return row_axes, {id(r) for r in coop}, lanes


def _contiguous_reduction(r: Reduce) -> bool:
    """Whether some read in ``r``'s body walks memory with unit stride along ``r``'s last variable."""
    last = [v for v in r.vars if v.extent > 1]
    if not last:
        return False
    k = last[-1]
    for n in walk(r.body):
        if isinstance(n, TensorElement) and n.indices:
            f = affine_form(n.indices[-1])
            if f is not None and f[0].get(k) == 1:
                return True
    return False


_ELEMENTS_PER_THREAD = 4


#: a kept select's rows (:func:`_kept_rows_part`): the fewest elements a row of the condition must
#: cover (a block's threads each take at least one), and the most blocks (a wave: as many a multiprocessor
#: as its 2048 threads hold)
_KEPT_ROW_MIN, _KEPT_ROW_BLOCKS = _THREADS, PERSISTENT_SMS * (2048 // _THREADS)


def _kept_rows_part(gc: GridCompute, select: tuple[Expr, Expr], out_ptr: str, em: "_Emitter", root: _Block,
                    it: str, names, strides) -> "_Part | None":
    """A kept select ``c ? x[i] : e`` (an output written over its input, a KV cache's present) whose
    condition ``c`` reads only some of the output's axes (``j != pos``: the cache row), as rows of
    those axes: each block walks rows (``gridDim.x`` apart), evaluates ``c`` once per row (the same
    in every thread: no divergence) and, only where it fails, stores ``e`` over the row's other axes
    with its threads. A step that changes one row of a 4096-row cache then tests 4096 rows, not
    every element (one thread per element: 16.7M for a batch of 8, 8 heads of 64). None where a
    row would hold fewer than ``_KEPT_ROW_MIN`` elements (the thread-per-element kernel is then no
    more work)."""
    free = em.an.free(select[0])
    row_axes = [v for v in gc.axes if v.extent > 1 and v in free]
    inner_axes = [v for v in gc.axes if v.extent > 1 and v not in free]
    rows, inner = _prod([v.extent for v in row_axes]), _prod([v.extent for v in inner_axes])
    if not row_axes or inner < _KEPT_ROW_MIN:
        return None
    r, t = em.new("r"), em.new("t")
    rdec, rbinds = _decompose(r, row_axes, it, "i", names)
    rblk = _Block(root, rbinds)
    c = em.value_as(select[0], "bool", rblk)
    tdec, tbinds = _decompose(t, inner_axes, it, "i", names)
    tblk = _Block(rblk, tbinds)
    x = em.value_as(select[1], gc.dtype, tblk)
    binds = {**rbinds, **tbinds}
    off = " + ".join(f"({it}){binds[v][0]} * {st}" for v, st in zip(gc.axes, strides) if v.extent > 1) or "0"
    code = list(root.lines)
    code.append(f"for ({it} {r} = blockIdx.x; {r} < {rows}; {r} += gridDim.x) {{  // the condition's rows")
    code += _indent(rdec + rblk.lines, 2)
    code += [f"  if ({c}) continue;  // (the row keeps its input: nothing to store)",
             f"  for ({it} {t} = threadIdx.x; {t} < {inner}; {t} += blockDim.x) {{"]
    code += _indent(tdec + tblk.lines + [f"{out_ptr}[{off}] = {em.stored(x, gc.dtype)};"], 4)
    code += ["  }", "}"]
    return _Part(code, max(1, min(rows, _KEPT_ROW_BLOCKS)), "elementwise")


def _lower_generic_part(gc: GridCompute, value: Expr, out_ptr: str, an: _Analysis,
                        reads, names, kept=None) -> _Part:
    """One output's kernel code (a thread per element, or a warp or block per row of reductions).
    ``kept``: the input placeholder the output is written over, if any (:func:`.lower.kept_select`)."""
    em = _Emitter(an, reads, names)
    n = _prod(gc.shape)
    it = "long long" if n > _WIDE else "int"
    root = _Block(None)
    for v in gc.axes:
        if v.extent == 1:
            root.binds[v] = ("0", "int32")
    plan = _plan_rows(gc, value, an)
    out_dt = gc.dtype
    strides = _row_major_strides(gc.shape)

    # (a thread per element only: a row's cooperative reductions must not sit in a divergent branch)
    select = kept_select(value, gc.axes, lambda t: t is kept) if plan is None and kept is not None else None

    def store(blk: _Block, off: str):
        if select is not None:  # (the kept elements are neither read nor written)
            c = em.value_as(select[0], "bool", blk)
            # the branch binds every variable again, so that what only e needs is computed in it
            inner = _Block(blk, {v: x for b in reversed(list(blk.chain())) for v, x in b.binds.items()})
            x = em.value_as(select[1], out_dt, inner)
            blk.lines += [f"if (!{c}) {{"] + _indent(inner.lines + [f"{out_ptr}[{off}] = {em.stored(x, out_dt)};"], 2)
            blk.lines.append("}")
            return
        x = em.value_as(value, out_dt, blk)
        blk.lines.append(f"{out_ptr}[{off}] = {em.stored(x, out_dt)};")

    if select is not None:
        part = _kept_rows_part(gc, select, out_ptr, em, root, it, names, strides)
        if part is not None:
            return part
    if plan is None and select is None:
        part = _transpose_part(gc, value, out_ptr, em, root)
        if part is not None:
            return part
    if plan is None:
        e = em.new("e")
        dec, binds = _decompose(e, [v for v in gc.axes], it, "i", names)
        binds = {v: b for v, b in binds.items() if v.extent != 1}
        blk = _Block(root, binds)
        store(blk, e)
        code = list(root.lines)
        # large outputs: each thread takes several elements (a quarter of the blocks, the loop
        # unrolled) so that several independent loads are in flight per thread
        per = _ELEMENTS_PER_THREAD if n >= _ELEMENTS_PER_THREAD * _THREADS * 264 else 1
        if per > 1:
            code.append(f"#pragma unroll {per}")
        code.append(f"for ({it} {e} = ({it})blockIdx.x * blockDim.x + threadIdx.x; {e} < {n}; "
                    f"{e} += ({it})gridDim.x * blockDim.x) {{")
        code += _indent(dec, 2) + _indent(blk.lines, 2)
        code.append("}")
        grid = max(1, min(_MAX_GRID, -(-n // (_THREADS * per))))
        return _Part(code, grid, "elementwise")

    row_axes, coop_ids, lanes = plan
    em.coop_ids = coop_ids
    coop = _Coop(lanes)
    root.coop = coop
    inner_axes = [v for v in gc.axes if v not in set(row_axes)]
    rows = _prod([v.extent for v in row_axes])
    inner = _prod([v.extent for v in inner_axes])
    row = em.new("row")
    rdec, rbinds = _decompose(row, row_axes, it, "i", names)
    rbinds = {v: b for v, b in rbinds.items() if v.extent != 1}
    rblk = _Block(root, rbinds, coop=coop)
    el = em.new("e")
    edec, ebinds = _decompose(el, inner_axes, it, "i", names)
    ebinds = {v: b for v, b in ebinds.items() if v.extent != 1}
    eblk = _Block(rblk, ebinds)
    terms = []
    for v, st in zip(gc.axes, strides):
        b = rbinds.get(v) or ebinds.get(v)
        if b is None:
            continue
        terms.append(b[0] if st == 1 else f"{b[0]} * {st}{'LL' if it == 'long long' else ''}")
    store(eblk, " + ".join(terms) if terms else "0")
    code = []
    if lanes == 32:
        code.append("const int sf_lane = threadIdx.x & 31;")
        wpb = _THREADS // 32
        head = (f"for ({it} {row} = ({it})blockIdx.x * {wpb} + (threadIdx.x >> 5); {row} < {rows}; "
                f"{row} += ({it})gridDim.x * {wpb}) {{")
        grid = max(1, min(_MAX_GRID, -(-rows // wpb)))
    else:
        code.append("const int sf_lane = threadIdx.x;")
        head = f"for ({it} {row} = blockIdx.x; {row} < {rows}; {row} += gridDim.x) {{"
        grid = max(1, min(_MAX_GRID, rows))
    code += root.lines
    code.append(head)
    code += _indent(rdec, 2) + _indent(rblk.lines, 2)
    code += _indent(_lane_loop(it, el, "sf_lane", inner, lanes), 2)
    code += _indent(edec, 4) + _indent(eblk.lines, 4)
    code.append("  }")
    code.append("}")
    return _Part(code, grid, "row", block_smem=em.uses_block_smem)


#: a transposing kernel's tile (:func:`_transpose_part`): 32 x 32 elements, 8 rows of threads
_TILE, _TILE_ROWS = 32, _THREADS // 32
#: a row of the tile in shared memory, by element size: an odd number of 4-byte words, so that
#: the threads of a warp reading down a column hit distinct banks
_TILE_PITCH = {1: 36, 2: 34, 4: 33, 8: 33}


def _transposed_read(gc: GridCompute, value: Expr, reads) -> tuple[list[TensorElement], list[Var]] | None:
    """The reads of the one tensor that ``value`` (element-wise: no reduction) reads as a
    permutation of the output's axes whose innermost dims are other output axes than the output's
    innermost (every such read of it at the same index), with those axes: the longest run of the
    input's innermost dims that is a run of the output's axes too, in the same order (an NCHW
    image's ``(h, w)`` in its NHWC copy: one axis of ``H*W`` elements to both); it and the output's
    innermost axis at least 16 long. Else None."""
    if any(isinstance(n, Reduce) for n in walk(value)):
        return None
    live = [v for v in gc.axes if v.extent != 1]
    if len(live) < 2 or live[-1].extent < 16:
        return None
    tes = list({id(n): n for n in walk(value) if isinstance(n, TensorElement)}.values())
    for te in tes:
        ref = reads.get(id(te.tensor))
        if ref is None:
            continue
        ix = [i for i, ext in zip(te.indices, ref[1]) if ext != 1]
        if not ix or not all(isinstance(i, Var) for i in ix) or len({id(i) for i in ix}) != len(ix) \
                or {id(i) for i in ix} != {id(v) for v in live} or ix[-1] is live[-1]:
            continue
        pos = live.index(ix[-1])
        run = 1
        while run < len(ix) and pos - run >= 0 and live[pos - run] is ix[-1 - run]:
            run += 1
        group = ix[-run:]
        if _prod([v.extent for v in group]) < 16:
            continue
        same = [t for t in tes if t.tensor is te.tensor]
        if all(format_expr(t) == format_expr(te) for t in same):
            return same, group
    return None


def _transpose_part(gc: GridCompute, value: Expr, out_ptr: str, em: "_Emitter", root: _Block) -> _Part | None:
    """An element-wise output that reads a whole tensor transposed (:func:`_transposed_read`: an
    NCHW image's channels-last copy, a Kᵀ stored as such) by 32 x 32 tiles: a block reads a tile
    along the input's innermost axis into shared memory, then computes and stores it along the
    output's, so that both the loads and the stores are coalesced (one thread per element reads
    the input ``extent`` elements apart otherwise). Other reads of ``value`` are made per element."""
    found = _transposed_read(gc, value, em.reads)
    if found is None:
        return None
    same, group = found
    ptr, shape, dt = em.reads[id(same[0].tensor)]
    size = _STORE_BYTES.get(dt)
    if size is None:
        return None
    live = [v for v in gc.axes if v.extent != 1]
    a = live[-1]
    rest = [v for v in live if v is not a and all(v is not g for g in group)]
    eb = _prod([v.extent for v in group])  # (the tile's columns: the group's axes as one)
    ta, tb = -(-a.extent // _TILE), -(-eb // _TILE)
    tiles = _prod([v.extent for v in rest]) * ta * tb
    wide = _prod(gc.shape) > _I32[1]
    names = em.names
    q = em.new("tq")
    dec, binds = _decompose(q, rest, "int", "i", names)  # (q: the tile's index past its a and b tiles)
    binds = {v: x for v, x in binds.items() if v.extent != 1}

    def offset(axes_shape, indices, at) -> str:
        terms = []
        for ix, st in zip(indices, _row_major_strides(axes_shape)):
            if ix is None:  # (a dim of extent 1)
                continue
            x = at[ix][0]
            terms.append(f"(long long)({x}) * {st}LL" if wide else (x if st == 1 else f"({x}) * {st}"))
        return " + ".join(terms) or "0"

    def split(flat: str) -> dict:  # the group's axes of its composite index ``flat`` (a C name)
        out, inner = {}, 1
        for k in range(len(group) - 1, -1, -1):
            x = flat if inner == 1 else f"{flat} / {inner}"
            out[group[k]] = (f"({x} % {group[k].extent})" if k else f"({x})", "int32")
            inner *= group[k].extent
        return out

    pitch = _TILE_PITCH[size]
    ct = _STORE_CTYPE[dt]
    load_at = {**binds, a: ("(sf_a0 + sf_ty + sf_r)", "int32"), **split("sf_lb")}
    src_ix = [i if ext != 1 else None for i, ext in zip(same[0].indices, shape)]
    blk = _Block(root, {**binds, a: ("sf_ia", "int32"), **split("sf_ib")})
    tv = em.new("tv")
    for t in same:
        em.subst[id(t)] = (tv, dt)
    x = em.value_as(value, gc.dtype, blk)
    out_ix = [v if v.extent != 1 else None for v in gc.axes]
    code = list(root.lines) + [
        f"__shared__ {ct} sf_tile[{_TILE}][{pitch}];",
        "const int sf_tx = threadIdx.x & 31, sf_ty = threadIdx.x >> 5;",
        f"for (int sf_t = blockIdx.x; sf_t < {tiles}; sf_t += gridDim.x) {{",
        f"  const int sf_b0 = sf_t % {tb} * {_TILE}, sf_a0 = sf_t / {tb} % {ta} * {_TILE};"] + (
        [f"  const int {q} = sf_t / {tb * ta};"] + _indent(dec, 2) if rest else []) + [
        "  const int sf_lb = sf_b0 + sf_tx;",
        f"  for (int sf_r = 0; sf_r < {_TILE}; sf_r += {_TILE_ROWS})  // along the input's rows",
        f"    if (sf_a0 + sf_ty + sf_r < {a.extent} && sf_lb < {eb})",
        f"      sf_tile[sf_ty + sf_r][sf_tx] = {ptr}[{offset(shape, src_ix, load_at)}];",
        "  __syncthreads();",
        f"  for (int sf_r = 0; sf_r < {_TILE}; sf_r += {_TILE_ROWS}) {{  // along the output's rows",
        "    const int sf_ia = sf_a0 + sf_tx, sf_ib = sf_b0 + sf_ty + sf_r;",
        f"    if (sf_ia < {a.extent} && sf_ib < {eb}) {{",
        f"      const {_REG_CTYPE[dt]} {tv} = {_load('sf_tile[sf_tx][sf_ty + sf_r]', dt)};"] + _indent(blk.lines, 6) + [
        f"      {out_ptr}[{offset(gc.shape, out_ix, blk.binds)}] = {em.stored(x, gc.dtype)};",
        "    }",
        "  }",
        "  __syncthreads();",
        "}"]
    return _Part(code, max(1, min(_MAX_GRID, tiles)), "transpose")


# --- tensor-core GEMM pattern --------------------------------------------------------------------

def _factors(e: Expr) -> list[Expr]:
    if isinstance(e, BinOp) and e.op == "mul":
        return _factors(e.a) + _factors(e.b)
    return [e]


def _product(fs: list[Expr]) -> Expr | None:
    if not fs:
        return None
    r = fs[0]
    for f in fs[1:]:
        r = BinOp("mul", r, f)
    return r


@dataclass
class _GemmPlan:
    red: Reduce
    prec: str
    a: Expr
    b: Expr
    m_axes: list
    n_axes: list
    b_axes: list
    a_k_fast: bool = True
    b_n_fast: bool = True
    #: the order of the reduction's axes in the product's K (outermost first; None: ``red.vars``'):
    #: both operands' reads are laid out along it (:func:`_wgmma_plan`)
    k_vars: tuple | None = None


_GEMM_PREC = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
#: ``precision`` values of :func:`build_cuda_library` and the template float32 GEMMs use with each
FP32_GEMM = {"float32": "f32", "tf32": "tf32", "float16": "f32", "bfloat16": "f32"}


def _plan_gemm(gc: GridCompute, value: Expr, an: _Analysis, fp32: str = "f32",
               skinny: bool = False) -> _GemmPlan | None:
    """The GEMM pattern in ``value``: a sum of products whose factors separate into an ``(M, K)`` and
    an ``(N, K)`` side. ``M, N >= 16`` (the tensor-core templates), or with ``skinny`` one side of
    at most :data:`~.cuda_gemv.GEMV_MAX_ROWS` and the other of at least 16, the small side then
    ``a`` (the rows of :func:`~.cuda_gemv.gemv_kernel`)."""
    reduces = [n for n in walk(value) if isinstance(n, Reduce)]
    # a fused epilogue that reads the product several times (x * f(x)) holds equal copies of it
    if not reduces or len({format_expr(r) for r in reduces}) != 1 or reduces[0].op != "sum":
        return None
    red = reduces[0]
    if any(isinstance(n, Reduce) for n in walk(red.body) if n is not red):
        return None
    bd = an.dtype(red.body)
    prec = fp32 if bd == "float32" else _GEMM_PREC.get(bd or "")
    if prec is None:
        return None
    axes = list(gc.axes)
    axset = set(axes)
    if not an.free(red) <= axset:
        return None
    fs = _factors(red.body)
    if len(fs) < 2 or len(fs) > 6:
        return None
    sets = [frozenset(an.free(f) & axset) for f in fs]
    dep = [i for i, s in enumerate(sets) if s]
    neutral = [i for i, s in enumerate(sets) if not s]
    best = None
    # (skinny: every split, one side possibly empty: a vector read by all the outputs, M = 1)
    for mask in range(0 if skinny else 1, 2 ** len(dep) - (0 if skinny else 1)):
        ga = [dep[j] for j in range(len(dep)) if mask >> j & 1]
        gb = [dep[j] for j in range(len(dep)) if not mask >> j & 1]
        sa = frozenset().union(*(sets[i] for i in ga))
        sb = frozenset().union(*(sets[i] for i in gb))
        m_ax = [v for v in axes if v in sa and v not in sb]
        n_ax = [v for v in axes if v in sb and v not in sa]
        mm, nn = _prod([v.extent for v in m_ax]), _prod([v.extent for v in n_ax])
        if skinny:
            if mm > nn:
                ga, gb, m_ax, n_ax, mm, nn = gb, ga, n_ax, m_ax, nn, mm
            if mm > GEMV_MAX_ROWS or nn < 16 or not (ga or neutral) or not gb:
                continue
            score = (nn, mm)
        elif mm < 16 or nn < 16:
            continue
        else:
            score = (min(mm, nn), mm * nn)
        if best is None or score > best[0]:
            best = (score, ga, gb, m_ax, n_ax)
    if best is None:
        return None
    _, ga, gb, m_ax, n_ax = best
    if m_ax and _prod([v.extent for v in m_ax]) > 64 * 65535:
        return None
    b_ax = [v for v in axes if v not in m_ax and v not in n_ax]
    a_expr = _product([fs[i] for i in ga + neutral])
    b_expr = _product([fs[i] for i in gb])
    for x in (a_expr, b_expr):
        if any(isinstance(n, Reduce) for n in walk(x)):
            return None
    if bd == "float32":
        # float32 products of half values (operands rounded to float16/bfloat16, e.g. by the
        # precision pass): exact on the half-precision tensor cores
        ha, hb = _half_source(a_expr, an), _half_source(b_expr, an)
        if ha is not None and ha == hb:
            prec = _GEMM_PREC[ha]
    kvars = set(red.vars)
    plan = _GemmPlan(red, prec, a_expr, b_expr, m_ax, n_ax, b_ax)
    plan.a_k_fast = _fast_dim(a_expr, kvars, set(m_ax), default=True)
    plan.b_n_fast = not _fast_dim(b_expr, kvars, set(n_ax), default=False)
    return plan


def _simplified_divisions(value: Expr) -> Expr:
    """``value`` with each ``X // c`` and ``X % c`` of an affine ``X`` (positive constant ``c``)
    that the axes' ranges decide rewritten without the division: ``X = c * Q + R`` with ``Q`` the
    terms whose coefficients ``c`` divides (and the constant's quotient) and ``R`` the rest; where
    ``R`` stays within ``[0, c)`` over the axes' ranges, ``X // c = Q`` and ``X % c = R``, exactly. A
    grouped conv whose output channel a reshape splits into ``(g, o)`` (a channel shuffle fused as
    its epilogue) reads input channel ``((g * OCg + o) // OCg) * Cg + c``: ``g * Cg + c``."""
    def fn(e, kids):
        if not (isinstance(e, BinOp) and e.op in ("floordiv", "mod") and isinstance(kids[1], Const)
                and type(kids[1].value) is int and kids[1].value > 0):
            return None
        f = affine_form(kids[0])
        if f is None or not all(isinstance(v, Var) for v in f[0]):
            return None
        c = kids[1].value
        coefs, const = f
        q = {v: k // c for v, k in coefs.items() if k % c == 0}
        r = {v: k for v, k in coefs.items() if k % c}
        lo = const % c + sum(min(0, k * (v.extent - 1)) for v, k in r.items())
        hi = const % c + sum(max(0, k * (v.extent - 1)) for v, k in r.items())
        if lo < 0 or hi >= c:
            return None
        return affine_expr(list(q.items()), const // c) if e.op == "floordiv" else affine_expr(list(r.items()),
                                                                                                const % c)
    return _map_tree(value, fn, {})


def _split_divided_axes(gc: GridCompute, value: Expr, an: _Analysis,
                        fp32: str) -> tuple[GridCompute, Expr, _GemmPlan] | None:
    """A GEMM plan for ``value`` with each output axis ``v`` that it reads as ``v // c`` (or ``v %
    c``; one ``c`` per axis, ``v``'s extent a multiple of it) split into ``(v // c, v % c)``, the
    output written in the same places (the row-major offsets of ``[.., E / c, c, ..]`` are those of
    ``[.., E, ..]``), or None. A grouped convolution reads the input channel ``(oc // OCg) * Cg +
    c``: its output channel is in both operands, so :func:`_plan_gemm` finds no column axis;
    split, the group is a batch axis (each group's product reads its own channels and weights) and
    the channel in the group the columns (RFC 0005 decision 62). A transposed convolution of
    non-overlapping windows reads input ``o // s`` at tap ``o % s``: split, the input pixels are
    the rows and the output channels and taps the columns (decision 65). Divisions the axes'
    ranges decide go first (:func:`_simplified_divisions`: a grouped conv whose output a reshape
    already splits)."""
    if not any(isinstance(n, Reduce) and n.op == "sum" for n in walk(value)):
        return None  # (no product)
    simpler = _simplified_divisions(value)
    if simpler is not value:
        plan = _plan_gemm(gc, simpler, an, fp32)
        if plan is not None:
            return gc, simpler, plan
        value = simpler
    axes = {id(v): v for v in gc.axes}
    divisors: dict[int, set] = {}
    for e in walk(value):
        if isinstance(e, BinOp) and e.op in ("floordiv", "mod") and id(e.a) in axes and isinstance(e.b, Const) \
                and type(e.b.value) is int and 1 < e.b.value < e.a.extent and e.a.extent % e.b.value == 0:
            divisors.setdefault(id(e.a), set()).add(e.b.value)
    parts = {}  # id(axis) -> (divisor, outer axis, inner axis, the axis rebuilt)
    for i, cs in divisors.items():
        if len(cs) == 1:
            (c,) = cs
            v = axes[i]
            hi, lo = Var(f"{v.name}_hi", v.extent // c), Var(f"{v.name}_lo", c)
            parts[i] = (c, hi, lo, BinOp("add", BinOp("mul", hi, Const(c)), lo))
    if not parts:
        return None

    def fn(e, _kids):
        if id(e) in parts:
            return parts[id(e)][3]
        if isinstance(e, BinOp) and e.op in ("floordiv", "mod") and id(e.a) in parts and isinstance(e.b, Const) \
                and type(e.b.value) is int and e.b.value == parts[id(e.a)][0]:
            return parts[id(e.a)][1 if e.op == "floordiv" else 2]
        return None
    split_value = _map_tree(value, fn, {})
    shape, new_axes = [], []
    for v, ext in zip(gc.axes, gc.shape):
        if id(v) in parts:
            c, hi, lo, _ = parts[id(v)]
            shape += [ext // c, c]
            new_axes += [hi, lo]
        else:
            shape.append(ext)
            new_axes.append(v)
    split = GridCompute(gc.name, tuple(shape), tuple(new_axes), split_value, gc.dtype)
    plan = _plan_gemm(split, split_value, an, fp32)
    return None if plan is None else (split, split_value, plan)


def _half_source(e: Expr, an: _Analysis) -> str | None:
    """``float16``/``bfloat16`` when ``e`` is a float32 cast of a value of that type (possibly
    selected against zero, as convolution padding reads are), else None: its values are then
    exact in that type."""
    if isinstance(e, Cast) and e.dtype == "float32":
        dt = an.dtype(e.a)
        if dt in ("float16", "bfloat16"):
            return dt
    if isinstance(e, IfThenElse):
        sides = [x for x in (e.then, e.other) if not (isinstance(x, Const) and x.value == 0)]
        found = {_half_source(x, an) for x in sides}
        if len(found) == 1 and None not in found:
            return found.pop()
    return None


def _fast_dim(e: Expr, kvars: set, other: set, default: bool) -> bool:
    """Whether consecutive threads should walk the reduction axis (True) or the other side's axes
    (False) to read ``e`` with unit stride: judged from the last index of its tensor reads."""
    for n in walk(e):
        if isinstance(n, TensorElement) and n.indices:
            f = affine_form(n.indices[-1])
            if f is None:  # (k % 32) / 2, a low-bit code's byte: judged by the variables it uses
                used = {x for x in walk(n.indices[-1]) if isinstance(x, Var)}
                if used and used <= kvars:
                    return True
                if used and used <= other:
                    return False
                continue
            coefs, _ = f
            k_unit = any(v in kvars and c == 1 for v, c in coefs.items())
            o_unit = any(v in other and c == 1 for v, c in coefs.items())
            if k_unit and not o_unit:
                return True
            if o_unit and not k_unit:
                return False
    return default


#: output columns one thread's Hopper GEMM epilogue handles together (RFC 0005 decision 22)
_EPILOGUE_VEC = 4


def _nbits_codes(op: Operator, plan: _GemmPlan) -> Codes | None:
    """The low-bit codes a skinny ``plan``'s ``B`` side reads, when ``op`` is (or holds) a float32
    ``MatMulNBits`` whose weight is exactly that side (its codes, scales and zero points the only
    tensors ``B`` reads, ``A`` none of them; its columns the plan's ``N``) with blocks and ``K``
    multiples of 8: :func:`~.cuda_gemv.gemv_kernel` then reads them a word at a time."""
    nb = [m for m in getattr(op, "members", [op]) if m.op_type == "MatMulNBits"]
    if len(nb) != 1 or nb[0].attrs.get("operand_dtype") or int(nb[0].attrs["bits"]) not in (2, 4, 8):
        return None
    m, bs = nb[0], int(nb[0].attrs["block_size"])
    k, n = m.inputs[0].shape[-1], m.inputs[1].shape[0]
    if bs % 8 or k % 8 or plan.b_axes or len(plan.n_axes) != 1 or plan.n_axes[0].extent != n \
            or len(plan.red.vars) != 1 or plan.red.vars[0].extent != k:
        return None
    slots = [next((i for i, t in enumerate(op.inputs) if t is x), None) for x in m.inputs[1:]]
    if None in slots:
        return None
    weight = {id(op.task.inputs[i]) for i in slots}
    reads = lambda e: {id(x.tensor) for x in walk(e) if isinstance(x, TensorElement)}  # noqa: E731
    if reads(plan.b) != weight or reads(plan.a) & weight:
        return None
    zp = m.inputs[3].value if len(m.inputs) > 3 else None
    whole = zp is not None and bool(np.all((np.asarray(zp) == np.round(zp)) & (np.abs(zp) < 2 ** 22)))
    return Codes(f"in{slots[0]}", f"in{slots[1]}", f"in{slots[2]}" if len(slots) > 2 else None, bs, whole,
                 int(m.attrs["bits"]))


def _rows_of_a(plan: _GemmPlan, an: _Analysis, reads, names) -> tuple[str, str] | None:
    """``(pointer, code setting long long sf_ao from sf_m)`` when the plan's ``A`` is a float32
    tensor read at ``sf_ao + k`` with ``sf_ao`` a multiple of 4 for every row: a run of 8 of its
    elements from ``k`` a multiple of 8 on is then two 16-byte loads (where the pointer is 16-byte
    aligned: the kernel checks)."""
    e = plan.a
    ref = reads.get(id(e.tensor)) if isinstance(e, TensorElement) else None
    if ref is None or ref[2] != "float32" or len(plan.red.vars) != 1:
        return None
    f = _flat_affine(e, ref[1], an)
    k = plan.red.vars[0]
    if f is None or f[0].get(k) != 1 or f[1] % 4 \
            or any(v is not k and (v not in plan.m_axes or c % 4) for v, c in f[0].items()):
        return None
    mdec, mbinds = _decompose("sf_m", plan.m_axes, "int", "m", names)
    terms = [f"(long long){mbinds[v][0]} * {c}" for v, c in f[0].items() if v is not k] + [str(f[1])]
    return ref[0], "\n".join(mdec + [f"sf_ao = {' + '.join(terms)};"])


def _lower_gemm(gc: GridCompute, value: Expr, plan: _GemmPlan, symbol: str, params: str,
                out_ptr: str, an: _Analysis, reads, names, wgmma: bool = False,
                config: str | None = None, gemv: bool = False,
                codes: Codes | None = None, wgmma_fp32: bool = False,
                sms: int = PERSISTENT_SMS, pdl: bool = False,
                weights: frozenset | set = frozenset()) -> tuple[str, dict, tuple | None]:
    """The kernel of a GEMM ``plan`` (:func:`_plan_gemm`): a tensor-core template, or with ``gemv``
    (a skinny plan) :func:`~.cuda_gemv.gemv_kernel` (``codes``: its ``B`` read as low-bit codes).
    ``wgmma``: half-precision products may take the Hopper template, and float32 ones (TF32 or
    3xTF32) with ``wgmma_fp32`` or on a forced ``config``. ``sms``: the target's multiprocessors.
    ``pdl``: a program for programmatic dependent launch, whose persistent GEMMs may load the first
    stages of an operand read straight from one of ``weights`` (kernel parameters) before they wait."""
    em = _Emitter(an, reads, names)
    half = plan.prec not in ("tf32", "f32")

    def usable(da: DirectOperand | None, db: DirectOperand | None) -> bool:
        # float32 operands (TF32, 3xTF32; not measured on a GPU yet: opt-in, wgmma_fp32 or a tile
        # forced for the op) must be K-major, which the TF32 instruction reads only: the driver
        # stores weights [N, K] for it
        return da is not None and db is not None and (half or da.k_major and db.k_major
                                                      and (wgmma_fp32 or config is not None))

    wgmma = wgmma and not gemv and plan.prec in WGMMA_DTYPES
    if wgmma:
        plan = _wgmma_plan(gc, plan, WGMMA_DTYPES[plan.prec], an, reads, usable)
    red = plan.red
    root = _Block(None)
    for v in list(gc.axes) + list(red.vars):  # the reduction's too (a 1x1 conv's window taps)
        if v.extent == 1:
            root.binds[v] = ("0", "int32")
    M = _prod([v.extent for v in plan.m_axes])
    N = _prod([v.extent for v in plan.n_axes])
    K = _prod([v.extent for v in red.vars])
    B = _prod([v.extent for v in plan.b_axes])
    bdec, bbinds = _decompose("sf_bz", plan.b_axes, "int", "b", names)
    bblk = _Block(root, {v: x for v, x in bbinds.items() if v.extent != 1})
    rd = an.dtype(red)

    def side(expr: Expr, idx_var: str, axes: list) -> str:
        mdec, mbinds = _decompose(idx_var, axes, "int", "m", names)
        kdec, kbinds = _decompose("sf_k", list(red.vars), "int", "k", names)
        binds = {v: x for v, x in {**mbinds, **kbinds}.items() if v.extent != 1}
        blk = _Block(bblk, binds)
        x = em.value_as(expr, "float32" if gemv or plan.prec in ("tf32", "f32") else an.dtype(red.body), blk)
        lines = mdec + kdec + blk.lines + [f"sf_v = {x};"]
        return "\n".join(lines)

    direct = None
    if wgmma:
        dt = WGMMA_DTYPES[plan.prec]
        kv = list(plan.k_vars or red.vars)
        da = _direct_operand(plan.a, plan.m_axes, kv, plan.b_axes, dt, M, K, an, reads, bblk)
        db = _direct_operand(plan.b, plan.n_axes, kv, plan.b_axes, dt, N, K, an, reads, bblk)
        if usable(da, db):
            direct = (da, db)
    if direct is None:
        load_a = side(plan.a, "sf_m", plan.m_axes)
        load_b = side(plan.b, "sf_n", plan.n_axes)
    # epilogue
    mdec, mbinds = _decompose("sf_m", plan.m_axes, "int", "m", names)
    ndec, nbinds = _decompose("sf_n", plan.n_axes, "int", "n", names)
    binds = {v: x for v, x in {**mbinds, **nbinds}.items() if v.extent != 1}
    wide = _prod(gc.shape) > _I32[1]

    def out_index(bs: dict) -> str:
        terms = []
        for v, st in zip(gc.axes, _row_major_strides(gc.shape)):
            b = bs.get(v) or bblk.binds.get(v)
            if b is None:
                continue
            nm = f"(long long){b[0]}" if wide else b[0]
            terms.append(nm if st == 1 else f"{nm} * {st}{'LL' if wide else ''}")
        return " + ".join(terms) if terms else "0"

    def emit(blk: _Block, acc: str) -> str:  # the output value, with every copy of the product = acc
        for r in walk(value):
            if isinstance(r, Reduce):
                em.subst[id(r)] = (acc if rd == "float32" else _convert(acc, "float32", rd), rd)
        return em.stored(em.value_as(value, gc.dtype, blk), gc.dtype)

    # the Hopper templates give each thread four consecutive columns when the row's last axis
    # allows (RFC 0005 decision 22); the lanes share what does not depend on that axis
    inner = next((v for v in reversed(plan.n_axes) if v.extent != 1), None)
    vec = _EPILOGUE_VEC if direct is not None and inner is not None and inner.extent % _EPILOGUE_VEC == 0 else 1
    if vec == 1:
        eblk = _Block(bblk, binds)
        x = emit(eblk, "sf_acc")
        epi = mdec + ndec + eblk.lines + [f"{out_ptr}[{out_index(binds)}] = {x};"]
    else:
        sblk = _Block(bblk, {v: x for v, x in binds.items() if v is not inner})
        first, it = binds[inner]
        em.lanes = _Lanes(inner, vec)
        lane_blocks, outs = [], []
        for j in range(vec):
            em.lanes.j = j
            lb = _Block(sblk, {inner: (first if j == 0 else f"({first} + {j})", it)})
            outs.append(emit(lb, f"sf_acc[{j}]"))
            lane_blocks.append(lb)
        em.lanes = None
        epi = mdec + ndec + sblk.lines + [ln for lb in lane_blocks for ln in lb.lines]
        if [v for v in gc.axes if v.extent != 1][-1] is inner:  # contiguous in the output too: one store
            vt = f"SfVec{vec}<{_STORE_CTYPE[gc.dtype]}>"
            epi += [f"{vt} sf_o;"] + [f"sf_o.v[{j}] = {x};" for j, x in enumerate(outs)]
            epi.append(f"*reinterpret_cast<{vt}*>({out_ptr} + {out_index(binds)}) = sf_o;")
        else:
            epi += [f"{out_ptr}[{out_index({**binds, inner: lb.binds[inner]})}] = {x};"
                    for lb, x in zip(lane_blocks, outs)]
    if gemv:
        src, launch = gemv_kernel(symbol=symbol, params=params, M=M, N=N, K=K, batch=B, root="\n".join(root.lines),
                                  batch_code="\n".join(bdec + bblk.lines), load_a=load_a, load_b=load_b,
                                  k_fast=codes is not None or not plan.b_n_fast, epilogue="\n".join(epi),
                                  codes=codes, a_rows=_rows_of_a(plan, an, reads, names) if codes else None)
        return src, launch, None
    if direct is not None:
        return wgmma_gemm_kernel(symbol=symbol, params=params, ab=plan.prec, M=M, N=N, K=K, batch=B,
                                 root="\n".join(root.lines), batch_code="\n".join(bdec + bblk.lines),
                                 a=direct[0], b=direct[1], epilogue="\n".join(epi), config=config, vec=vec,
                                 row_reads=_reads_per_row(value, plan.m_axes, an), sms=sms, pdl=pdl,
                                 constant=(direct[0].ptr in weights, direct[1].ptr in weights))
    src, launch = gemm_kernel(symbol=symbol, params=params, prec=plan.prec, M=M, N=N, K=K, batch=B,
                              root="\n".join(root.lines), batch_code="\n".join(bdec + bblk.lines),
                              load_a=load_a, load_b=load_b, a_k_fast=plan.a_k_fast, b_n_fast=plan.b_n_fast,
                              epilogue="\n".join(epi), config=choose_gemm_config(M, N, B, sms))
    return src, launch, None


def _wgmma_plan(gc: GridCompute, plan: _GemmPlan, dtype: str, an: _Analysis, reads, usable) -> _GemmPlan:
    """The form of ``plan`` the wgmma template takes best: its operands direct reads of ``dtype``
    (:func:`_direct_operand`) that the template takes (``usable(a, b)``), or ``plan`` itself.

    * **Columns along the output's rows.** Where the output's innermost axis is one of the plan's
      rows (M), the sides swap when the swapped plan is usable: an NCHW convolution's output
      ``y[n, o, h, w]`` then has its pixels as columns, and each thread of the epilogue stores
      four consecutive ones at once (the template's vector epilogue, RFC 0005 decision 22) where
      it stored single elements ``H*W`` apart.
    * **Leading axes into the batch.** A batched 1x1 convolution reads its input
      ``x[n, c, h, w]`` with the pixels ``(n, h, w)``: ``h, w`` are one run of stride 1, but ``n``
      steps by ``C * H * W``, so they have no single stride and the product would take the portable
      template; with ``n`` a batch axis (its offset the batch's base, the weight's 0) the pixels
      ``(h, w)`` are evenly strided. The fewest axes move, and both sides keep at least 16 rows
      (:func:`_plan_gemm`'s bound) (RFC 0005 decision 55).
    * **The order of K.** The reduction's axes are laid out in the product's K in their own order
      or, where that leaves an operand without a contiguous run of K, in the order of one operand's
      strides (:func:`_k_orders`): a convolution over a channels-last image reduces over
      ``(c, kh, kw)`` but reads runs of channels at each tap, so its K is ``(kh, kw, c)`` (the
      weight, stored ``[OC, KH, KW, C]``, is read along it too; RFC 0005 decision 57)."""
    K = _prod([v.extent for v in plan.red.vars])
    order = {v: i for i, v in enumerate(gc.axes)}

    def direct(p: _GemmPlan) -> _GemmPlan | None:  # p, its K axes in the first order both operands take
        probe = _Block(None, {v: ("0", "int32") for v in p.b_axes})  # (names only: nothing is emitted)
        for kv in _k_orders(p, an, reads):
            if usable(*(_direct_operand(e, ax, kv, p.b_axes, dtype, _prod([v.extent for v in ax]), K, an, reads,
                                        probe) for e, ax in ((p.a, p.m_axes), (p.b, p.n_axes)))):
                return p if kv == list(p.red.vars) else dataclasses.replace(p, k_vars=tuple(kv))
        return None

    def batched(p: _GemmPlan) -> _GemmPlan | None:
        d = direct(p)
        if d is not None:
            return d
        cuts = sorted(((cm, cn) for cm in range(len(p.m_axes)) for cn in range(len(p.n_axes)) if cm or cn), key=sum)
        for cm, cn in cuts:
            m_ax, n_ax = p.m_axes[cm:], p.n_axes[cn:]
            if _prod([v.extent for v in m_ax]) < 16 or _prod([v.extent for v in n_ax]) < 16:
                continue
            b_ax = sorted(p.b_axes + p.m_axes[:cm] + p.n_axes[:cn], key=order.__getitem__)
            if _prod([v.extent for v in b_ax]) > 65535:  # (the batch is the grid's third dimension)
                continue
            moved = direct(dataclasses.replace(p, m_axes=m_ax, n_axes=n_ax, b_axes=b_ax))
            if moved is not None:
                return moved
        return None

    live = [v for v in gc.axes if v.extent != 1]
    if live and live[-1] in plan.m_axes:
        swapped = batched(dataclasses.replace(plan, a=plan.b, b=plan.a, m_axes=plan.n_axes, n_axes=plan.m_axes))
        if swapped is not None:
            return swapped
    return batched(plan) or plan


def _operand_read(e: Expr) -> tuple[TensorElement | None, Expr | None]:
    """The tensor read of a GEMM operand ``e`` (possibly cast to float32, possibly selected against
    zero, as a window's padding is) and the select's condition (None when there is none)."""
    if isinstance(e, Cast) and e.dtype == "float32":
        e = e.a
    cond = None
    if isinstance(e, IfThenElse) and isinstance(e.other, Const) and e.other.value == 0:
        cond, e = e.cond, e.then
        if isinstance(e, Cast) and e.dtype == "float32":
            e = e.a
    return (e, cond) if isinstance(e, TensorElement) else (None, None)


def _k_orders(p: _GemmPlan, an: _Analysis, reads) -> list[list]:
    """The orders of ``p``'s reduction axes to try in its K (:func:`_wgmma_plan`): their own, then
    by decreasing stride in each operand's tensor read (a channels-last window: taps, then channels)."""
    orders = [list(p.red.vars)]
    for e in (p.b, p.a):
        read, _ = _operand_read(e)
        ref = reads.get(id(read.tensor)) if read is not None else None
        flat = _flat_affine(read, ref[1], an, guarded=True) if ref is not None else None
        if flat is not None:
            kv = sorted(p.red.vars, key=lambda v: -abs(flat[0].get(v, 0)))
            if kv not in orders:
                orders.append(kv)
    return orders


def _guard_atoms(cond: Expr) -> list[tuple[dict, int]] | None:
    """``cond`` as affine inequalities ``sum(c * v) + k >= 0`` (``(coefficients, k)``, zero
    coefficients left out) that must all hold, or None when it is not such a conjunction."""
    if isinstance(cond, BinOp) and cond.op == "and":
        a, b = _guard_atoms(cond.a), _guard_atoms(cond.b)
        return None if a is None or b is None else a + b
    if not (isinstance(cond, BinOp) and cond.op in ("ge", "gt", "le", "lt")):
        return None
    fa, fb = affine_form(cond.a), affine_form(cond.b)
    if fa is None or fb is None:
        return None
    sign = 1 if cond.op in ("ge", "gt") else -1  # a >= b: a - b >= 0; a < b: b - a - 1 >= 0 (integers)
    diff = {v: sign * (fa[0].get(v, 0) - fb[0].get(v, 0)) for v in set(fa[0]) | set(fb[0])}
    strict = cond.op in ("gt", "lt")
    return [({v: c for v, c in diff.items() if c}, sign * (fa[1] - fb[1]) - strict)]


def _unclamped(idx: Expr, ext: int) -> Expr:
    """``i`` for an index clamped into its dim, ``min(max(i, 0), ext - 1)`` (either way round), as
    a read in a select's branch is made safe; ``idx`` itself otherwise. (Where the select's
    condition keeps ``i`` inside the dim, both read the same element.)"""
    for outer, inner, bo, bi in (("min", "max", ext - 1, 0), ("max", "min", 0, ext - 1)):
        if isinstance(idx, BinOp) and idx.op == outer and isinstance(idx.b, Const) and idx.b.value == bo \
                and isinstance(idx.a, BinOp) and idx.a.op == inner and isinstance(idx.a.b, Const) \
                and idx.a.b.value == bi:
            return idx.a.a
    return idx


def _gather_operand(e: Expr, outer: list, kvars: list, batch: list, dtype: str, an: _Analysis, reads,
                    bblk: _Block) -> GatherOperand | None:
    """``e`` as a K-major read of a half-precision tensor that the wgmma template gathers 16 bytes
    at a time (:class:`~.cuda_wgmma.GatherOperand`: a convolution's windows over a channels-last
    image), or None. Every index that may leave its dim must be guarded by the select around the
    read (``i >= 0``, ``i < extent``, as a window's padding is)."""
    read, cond = _operand_read(e)
    ref = reads.get(id(read.tensor)) if read is not None else None
    if ref is None or ref[2] != dtype or dtype not in ("float16", "bfloat16"):
        return None
    atoms = _guard_atoms(cond) if cond is not None else []
    if atoms is None:
        return None
    ptr, shape, _ = ref
    coefs: dict = {}
    const = 0
    for idx, ext, st in zip(read.indices, shape, _row_major_strides(shape)):
        if ext == 1:
            continue
        idx = _unclamped(idx, ext)
        f, b = affine_form(idx), an.bounds(idx)
        if f is None or b is None:
            return None
        if b[0] < 0 and (f[0], f[1]) not in atoms \
                or b[1] > ext - 1 and ({v: -c for v, c in f[0].items()}, ext - 1 - f[1]) not in atoms:
            return None
        for v, c in f[0].items():
            coefs[v] = coefs.get(v, 0) + c * st
        const += f[1] * st
    coefs = {v: c for v, c in coefs.items() if c}
    live_k = [v for v in kvars if v.extent != 1]
    guarded = {v for a, _ in atoms for v in a}
    if not live_k or not set(coefs) | guarded <= set(outer) | set(kvars) | set(batch) or guarded & set(batch):
        return None
    last = live_k[-1]
    if coefs.get(last) != 1 or last.extent % 8 or last in guarded or const % 8 \
            or any(c % 8 for v, c in coefs.items() if v is not last):
        return None

    def axes(vs):
        return tuple((v.extent, coefs.get(v, 0), tuple(a.get(v, 0) for a, _ in atoms)) for v in vs)

    terms = [f"(long long){bblk.binds[v][0]} * {coefs[v]}LL" for v in batch if coefs.get(v) and v.extent != 1]
    return GatherOperand(ptr, " + ".join(terms) or "0LL", const, axes(outer), axes(kvars), tuple(k for _, k in atoms))


def _reads_per_row(value: Expr, m_axes: list, an: _Analysis) -> bool:
    """Whether a GEMM's epilogue (``value`` outside its product) reads a tensor element that changes
    with the output row, as a residual does (a bias does not): such reads miss the caches and are
    worth issuing together (RFC 0005 decision 28)."""
    rows = {v for v in m_axes if v.extent != 1}
    stack, seen = [value], set()
    while stack:
        e = stack.pop()
        if id(e) in seen or isinstance(e, Reduce):
            continue
        seen.add(id(e))
        if isinstance(e, TensorElement) and any(an.free(ix) & rows for ix in e.indices):
            return True
        stack.extend(e.children())
    return False


def _half_cast(op: Operator) -> bool:
    return op.op_type == "Cast" and op.outputs[0].dtype in ("float16", "bfloat16")


#: ops that move elements without computing them: the fused attention reads its operands through them
_MOVES = ("Reshape", "Transpose", "Slice", "Squeeze", "Unsqueeze", "Identity")


def _product_operand_casts(ops: Sequence[Operator]) -> set[str]:
    """The names of the half casts whose value reaches, through element moves and casts, a reader
    that is not element-wise (a GEMM, an attention, a reduction): on Hopper those are written by
    their producer's kernel for it (a product reads its half operand from memory as it is). A cast
    that only element-wise ops read (a half model's ``RMSNorm(x).to(half) * weight``) fuses with
    them."""
    readers: dict[int, list[Operator]] = {}
    for op in ops:
        for t in op.inputs:
            readers.setdefault(id(t), []).append(op)
    found = set()
    for op in ops:
        if not _half_cast(op):
            continue
        todo = [op.outputs[0]]
        while todo and op.name not in found:
            for r in readers.get(id(todo.pop()), []):
                if channels_last_copy(r):  # (written by the cast's kernel: the conv reads the copy)
                    continue
                if r.op_type in _MOVES or r.op_type == "Cast":  # (a float32 model's product reads float32(half(x)))
                    todo.append(r.outputs[0])
                elif not getattr(r, "injective", False):
                    found.add(op.name)
    return found


def _epilogue_operand_casts(ops: Sequence[Operator]) -> set[str]:
    """The names of the half casts of :func:`_product_operand_casts` whose input its producer
    writes for them alone: the producer's kernel would take the cast as its epilogue, and with it
    the precision pass's cast back to float32 before the product, so that the product read float32
    values and ran in float32 (a float32 model's last LayerNorm before its head, a conv's ReLU
    before the next conv). Written by their producer's kernel, the product reads the half values
    (every GPU; on Hopper every such cast is, :func:`kernel_groups`)."""
    producer = {id(t): op for op in ops for t in op.outputs}
    readers: dict[int, int] = {}
    for op in ops:
        for t in {id(t): t for t in op.inputs}.values():
            readers[id(t)] = readers.get(id(t), 0) + 1
    casts = _product_operand_casts(ops)
    return {op.name for op in ops if op.name in casts and id(op.inputs[0]) in producer
            and readers.get(id(op.inputs[0])) == 1}


def _attention_operands(ops: Sequence[Operator], through, pick) -> set[str]:
    """The names of the ops that ``pick`` selects among those an ``Attention`` op's Q, K or V comes
    from, walking back through the ops ``through`` lets pass (their first input)."""
    producer = {id(t): op for op in ops for t in op.outputs}
    found = set()
    for op in ops:
        if op.op_type != "Attention":
            continue
        for t in op.inputs[:3]:
            p = producer.get(id(t))
            while p is not None and through(p):
                p = producer.get(id(p.inputs[0]))
            if p is not None and pick(p):
                found.add(p.name)
    return found


def _attention_operand_casts(ops: Sequence[Operator]) -> set[str]:
    """The names of the half casts an ``Attention`` op's Q, K or V comes from through element moves
    alone: fused into the attention they would leave the kernel a float32 read to convert, which
    its copies cannot; written by their producer's kernel, the attention reads half values."""
    return _attention_operands(ops, lambda p: p.op_type in _MOVES, _half_cast)


def _attention_operand_copies(ops: Sequence[Operator]) -> set[str]:
    """The names of the transposes that move the last axis of their input away from the last
    place and feed an ``Attention``'s Q, K or V (through casts and scalings): inlined, the kernel's
    operand would not have its head dimension contiguous (a Kᵀ stored as such, whose rows
    ``FuseAttention`` makes a transposed copy of); written by their own kernel, it has."""
    def scaling(p: Operator) -> bool:
        return p.op_type == "Cast" or p.op_type == "Binary" and p.attrs.get("fn") in ("mul", "div") \
            and p.inputs[1].size == 1
    return _attention_operands(ops, scaling, lambda p: p.op_type == "Transpose"
                               and tuple(p.attrs["perm"])[-1] != p.inputs[0].ndim - 1)


def _composite_stride(axes: list, coefs: dict) -> int | None:
    """The stride of the row-major composite index of ``axes`` (last fastest) in a flat offset
    with coefficients ``coefs``, or None when the axes are not nested that way."""
    live = [v for v in axes if v.extent != 1]
    if not live:
        return None
    unit = coefs.get(live[-1], 0)
    run = unit
    for v in reversed(live):
        if coefs.get(v, 0) != run:
            return None
        run *= v.extent
    return unit or None


def _flat_affine(e: TensorElement, shape, an: _Analysis, guarded: bool = False) -> tuple[dict, int] | None:
    """The flat row-major offset of read ``e`` (of a tensor of ``shape``) as ``(coefficient per
    variable, constant)``, or None when it is not affine or an index may leave its dim. With
    ``guarded`` (a read a select guards) indices clamped into their dims count as unclamped
    (:func:`_unclamped`) and may leave them."""
    coefs: dict = {}
    const = 0
    for idx, ext, st in zip(e.indices, shape, _row_major_strides(shape)):
        if ext == 1:
            continue
        if guarded:
            idx = _unclamped(idx, ext)
        f = affine_form(idx)
        b = an.bounds(idx)
        if f is None or b is None or not guarded and (b[0] < 0 or b[1] > ext - 1):
            return None
        for v, c in f[0].items():
            coefs[v] = coefs.get(v, 0) + c * st
        const += f[1] * st
    return {v: c for v, c in coefs.items() if c}, const


def _direct_operand(e: Expr, outer: list, kvars: list, batch: list, dtype: str, extent_o: int, K: int,
                    an: _Analysis, reads, bblk: _Block) -> DirectOperand | GatherOperand | None:
    """``e`` as a dense read of a ``dtype`` tensor (a half type, or float32 for TF32) that the wgmma
    template can copy 16 bytes at a time (:class:`~.cuda_wgmma.DirectOperand`), else as a gathered
    one (:func:`_gather_operand`), or None."""
    inner = e.a if isinstance(e, Cast) and e.dtype == "float32" else e
    if not isinstance(inner, TensorElement):
        return _gather_operand(e, outer, kvars, batch, dtype, an, reads, bblk)
    ref = reads.get(id(inner.tensor))
    if ref is None or ref[2] != dtype:
        return None
    vec = 4 if dtype == "float32" else 8  # elements in 16 bytes
    ptr, shape, _ = ref
    flat = _flat_affine(inner, shape, an)
    if flat is None or not set(flat[0]) <= set(outer) | set(kvars) | set(batch):
        return _gather_operand(e, outer, kvars, batch, dtype, an, reads, bblk)
    coefs, const = flat
    so, sk = _composite_stride(outer, coefs), _composite_stride(kvars, coefs)
    if so is None or sk is None:
        return _gather_operand(e, outer, kvars, batch, dtype, an, reads, bblk)
    if sk == 1 and so % vec == 0 and K % vec == 0:
        k_major = True
    elif so == 1 and sk % vec == 0 and extent_o % vec == 0:
        k_major = False
    else:
        return None
    terms = [str(const)] if const else []
    for v in batch:
        c = coefs.get(v, 0)
        if c and v.extent != 1:
            if c % vec:
                return None
            terms.append(f"(long long){bblk.binds[v][0]} * {c}LL")
    if const % vec:
        return None
    return DirectOperand(ptr, " + ".join(terms) or "0LL", so, sk, k_major)


# --- fused attention -----------------------------------------------------------------------------

def _attention_member(op: Operator) -> Operator | None:
    """The ``Attention`` op that ``op`` is or holds (a fused group's member) if the fused kernel
    may compute it: a mixed-precision one (half operands, ``acc_dtype="float32"``), or one on
    float32 operands (FuseAttention's float32 form, or a float32 model's own op)."""
    members = getattr(op, "members", [op])
    att = [m for m in members if m.op_type == "Attention"]
    if len(att) != 1:
        return None
    a = att[0].attrs
    mixed = a.get("acc_dtype") == "float32" and a.get("probs_dtype") in ("float16", "bfloat16")
    float32 = a.get("acc_dtype") in (None, "float32") and not a.get("probs_dtype") and \
        all(t.dtype == "float32" for t in att[0].inputs[:3])
    if not (mixed or float32) or a.get("qk_mode") is not None or a.get("softmax_dtype"):
        return None  # (past_len and nonpad_kv_seqlen move only the diagonal and the last key seen)
    return att[0]


def _attention_type(att: Operator, fp32: str) -> str:
    """The fused kernel's operand type for ``att`` (:func:`_attention_member`'s): its half type, or
    the float32 products' ``fp32`` (``"tf32"``, or ``"f32"`` for 3xTF32)."""
    half = att.attrs.get("probs_dtype")
    return _GEMM_PREC[half] if half else fp32


def _lower_attention(op: Operator, att: Operator, symbol: str, params: str, an: _Analysis, reads,
                     names, fp32: str = "f32", sms: int = PERSISTENT_SMS) -> tuple[str, dict] | None:
    """``op`` (an ``Attention`` with its fused prologue and element-wise epilogue) as the fused
    attention kernel (:mod:`.cuda_attention`; float32 operands: ``fp32``'s products; split-KV for
    ``sms`` multiprocessors), or None where that kernel does not apply."""
    from ..ir.task import TensorInput
    from .cuda_attention import AttnOperand, attention_kernel, packs_heads, takes_heads
    from .fusion import chain

    q_t, k_t, v_t = att.inputs[:3]
    half = att.attrs.get("probs_dtype") or "float32"  # (the operands' type)
    if not (q_t.dtype == k_t.dtype == v_t.dtype == half):
        return None
    vec = 4 if half == "float32" else 8  # elements in a 16-byte copy
    b_, hq, hk, s_len, l_len, d_len, dv = att._geometry(q_t, k_t, v_t)
    if not takes_heads(d_len, dv, float32=half == "float32"):
        return None
    mask = att.inputs[3] if att.attrs.get("has_mask") else None
    if mask is not None and (mask.dtype not in ("float32", "bool") or mask.shape[-1] > l_len):
        return None
    nonpad = att.inputs[3 + (mask is not None)] if att.attrs.get("has_nonpad") else None
    bound = bool(att.attrs.get("nonpad_bound"))  # (nonpad only bounds the keys the biases leave)
    if nonpad is not None and not nonpad.dtype.startswith(("int", "uint")):
        return None
    sink = att.inputs[3 + (mask is not None) + (nonpad is not None)] if att.attrs.get("has_sink") else None
    # the group's definitions up to the attention, which becomes a placeholder for the epilogue
    members = getattr(op, "members", [op])
    y_shape = tuple(att.outputs[0].shape)
    acc_ph = TensorInput("sf_attention", y_shape, "float32")
    env = chain(members, op.inputs, op.task.inputs, given={id(att.outputs[0]): acc_ph})
    vb, vh, vhk, vi, vj = (Var(n, e) for n, e in (("sf_b", b_), ("sf_h", hq), ("sf_hk", hk), ("sf_i", s_len),
                                                  ("sf_j", l_len)))

    def operand(t, head, row, width) -> AttnOperand | None:
        vd = Var("sf_d", width)
        if t.ndim == 4:
            idx = [vb, head, row, vd]
        else:
            idx = [vb, row, BinOp("add", BinOp("mul", head, Const(width)), vd)]
        e = _inline_computes(TensorElement(env[id(t)], idx), an)
        if not isinstance(e, TensorElement) or id(e.tensor) not in reads:
            return None
        ptr, shape, dt = reads[id(e.tensor)]
        flat = _flat_affine(e, shape, an) if dt == half else None
        if flat is None:
            return None
        coefs, const = flat
        if set(coefs) - {vb, head, row, vd} or coefs.get(vd) != 1:
            return None
        o = AttnOperand(ptr, const, coefs.get(vb, 0), coefs.get(head, 0), coefs.get(row, 0))
        if any(x % vec for x in (o.const, o.sb, o.sh, o.sr)):
            return None  # 16-byte copies
        return o

    q_op, k_op, v_op = operand(q_t, vh, vi, d_len), operand(k_t, vhk, vj, d_len), operand(v_t, vhk, vj, dv)
    if q_op is None or k_op is None or v_op is None:
        return None
    em = _Emitter(an, reads, names)
    # a block's head; with the group's heads packed in its rows (packs_heads) a row's: bound per row
    pack = packs_heads(s_len, hq // hk)
    row_head = {vh: ("sf_h", "int32")} if pack else {}
    root = _Block(None, {vb: ("sf_b", "int32"), vhk: ("sf_hk", "int32"), **({} if pack else {vh: ("sf_h", "int32")})})
    # the additive masks at (b, h, i, j), broadcast as the op's definition reads them, in its order
    scalars = _scalar_constants(op)
    biases = []
    adds = att.inputs[len(att.inputs) - att.attrs.get("extra_biases", 0):]
    for m in ([mask] if mask is not None else []) + adds:
        full = (b_, hq, s_len, l_len)
        off = 4 - m.ndim
        pos = (vb, vh, vi, vj)[off:]
        idx = [Const(0) if ext == 1 and full[off + n] != 1 else pos[n] for n, ext in enumerate(m.shape)]
        bias = _bake(_inline_computes(TensorElement(env[id(m)], idx), an), scalars)
        bblk = _Block(root, {**row_head, vi: ("sf_i", "int32"), vj: ("sf_j", "int32")})
        neg_inf = "__int_as_float(0xff800000)"
        if m.dtype == "bool":  # a key the mask does not allow: -inf
            x = f"({em.value_as(bias, 'bool', bblk)} ? 0.0f : {neg_inf})"
        else:
            x = em.value_as(bias, "float32", bblk)
        lines = bblk.lines + [f"sf_bias = {x};"]
        if m.shape[-1] < l_len:  # keys past the mask's last one: -inf (and nothing read there)
            lines = [f"if (sf_j < {m.shape[-1]}) {{"] + _indent(lines, 2) + ["} else {", f"  sf_bias = {neg_inf};",
                                                                              "}"]
        biases.append("\n".join(lines))
    # the epilogue: the group's output element, reading the attention's value at its own index
    last = env[id(members[-1].outputs[0])]
    gc = op.task.outputs[0]
    axes, out_shape = list(gc.axes), tuple(gc.shape)
    if out_shape != y_shape:  # views after the attention alone (the same elements in the same order): its own index
        if any(m.op_type != "Reshape" for m in members[members.index(att) + 1:]):
            return None
        axes, out_shape = [Var(f"sf_y{j}", e) for j, e in enumerate(y_shape)], y_shape
        value = TensorElement(acc_ph, axes)
    else:
        value = TensorElement(acc_ph, axes) if last is acc_ph else _bake(_inline_computes(last.value, an), scalars)
    for n in walk(value):
        if isinstance(n, TensorElement) and n.tensor is acc_ph:
            if list(n.indices) != axes:
                return None  # not element-wise at its own index
            em.subst[id(n)] = ("sf_acc", "float32")
    out_idx = ["sf_b", "sf_h", "sf_i", "sf_e"] if len(y_shape) == 4 else ["sf_b", "sf_i", f"(sf_h * {dv} + sf_e)"]
    # the band of keys a query sees: j <= i + hi (causal, right window), j >= i + off - left (left window)
    a = att.attrs
    off, left, right = int(a.get("past_len", 0)), int(a.get("left_window", -1)), int(a.get("right_window", -1))
    keys = None
    if nonpad is not None:  # keys j < nonpad[b] (at most L); the diagonal at nonpad[b] - S without a past
        e = _bake(_inline_computes(TensorElement(env[id(nonpad)], [vb]), an), scalars)
        n = em.value_as(e, "int64", root)
        seen = (f"const int sf_np = (int)max(0LL, min(sf_npv, {l_len}LL));  // the keys the rows see" if not bound
                else f"const int sf_np = sf_npv <= 0 ? {l_len} : (int)min(sf_npv, {l_len}LL);  // (a bound: none, "
                     "every key, the biases decide)")
        root.lines += [f"const long long sf_npv = max(-(1LL << 30), min((long long)({n}), 1LL << 30));", seen,
                       f"const int sf_npo = (int)sf_npv - {s_len};  // their diagonal's offset"]
        keys = "sf_np"
    def shift(d: int) -> int | str:  # the diagonal (key i + offset for query i) moved by d keys
        if nonpad is None or off or bound:
            return off + d
        return f"sf_npo + {d}" if d >= 0 else f"sf_npo - {-d}"
    sink_at = None
    if sink is not None:  # the head's sink, read once per block (packed heads: a function of the row's head)
        e = _bake(_inline_computes(TensorElement(env[id(sink)], [vh]), an), scalars)
        if pack:
            sblk = _Block(root, row_head)
            x = em.value_as(e, "float32", sblk)
            root.lines += ["auto sf_sink_of = [&](int sf_h) -> float {", *_indent(sblk.lines, 2),
                           f"  return {x};", "};"]
            sink_at = "sf_sink_of(sf_h)"
        else:
            root.lines.append(f"const float sf_sink = {em.value_as(e, 'float32', root)};")
            sink_at = "sf_sink"
    hi = shift(0) if a.get("is_causal") else None
    if right >= 0:  # (with a causal mask too, the window's upper edge is past the diagonal: the diagonal)
        hi = shift(right) if hi is None else hi
    eblk = _Block(root, {v: (f"sf_x{j}", "int32") for j, v in enumerate(axes)})
    x = em.value_as(value, gc.dtype, eblk)
    offset = " + ".join(f"(long long)sf_x{j} * {st}LL" for j, st in enumerate(_row_major_strides(out_shape)))
    epi = [f"const int sf_x{j} = {ix};" for j, ix in enumerate(out_idx)] + eblk.lines + \
        [f"out0[{offset}] = {em.stored(x, gc.dtype)};"]
    scale = float(a.get("scale", a.get("scale_sqrt", 1.0) ** 2))  # (a float32 op of its own may give scale_sqrt only)
    return attention_kernel(symbol=symbol, params=params, ab=_attention_type(att, fp32), B=b_, H=hq, S=s_len, L=l_len,
                            D=d_len, Dv=dv, rep=hq // hk, q=q_op, k=k_op, v=v_op, scale=scale,
                            root="\n".join(root.lines), biases=biases, epilogue="\n".join(epi),
                            empty_rows_zero=bool(a.get("has_mask") or a.get("is_causal") or left >= 0 or right >= 0
                                                 or (nonpad is not None and not bound)),
                            causal=hi, lo=None if left < 0 else shift(-left), softcap=float(a.get("softcap", 0.0)),
                            keys=keys, sink=sink_at, sms=sms)


# --- one op --------------------------------------------------------------------------------------

def _is_collective(op: Operator) -> bool:
    return bool(getattr(type(op), "collective", ""))


def lowerable(op: Operator) -> bool:
    """Whether :func:`build_cuda_library` generates a kernel for ``op`` (collectives run elsewhere;
    of the ops with extern outputs, only TopK has a kernel, :mod:`.cuda_topk`)."""
    return not (_is_collective(op) or (op.task.is_extern and op.op_type != "TopK"))


_SANITIZE = re.compile(r"[^A-Za-z0-9_]")
_PLACEHOLDER = "SF_KERNEL_SYMBOL_"


def _symbol(text: str, op: Operator) -> str:
    """The symbol of the kernel ``text`` (written with :data:`_PLACEHOLDER` for its name), first
    generated for ``op``: a digest of the text, so that equal kernels in different ranks' units
    (:meth:`CudaSource.merge`) are one, and the op's name, for profilers' listings."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"sf_k{digest}_{_SANITIZE.sub('_', op.name)[:40]}"


#: the shortest reduction the gemv template takes (shorter ones: a thread per output, serial sums)
_GEMV_MIN_K = 16


def _lower_op(op: Operator, symbol: str, fp32: str = "f32", wgmma: bool = False,
              config: str | None = None, mma: bool = False,
              in_place: int | None = None, wgmma_fp32: bool = False,
              sms: int = PERSISTENT_SMS, pdl: bool = False) -> tuple[str, KernelLaunch, tuple | None]:
    task = op.task
    if op.op_type == "TopK":  # (its definition is an extern: its own template)
        x = op.inputs[0]
        src, grid, block = topk_kernel(symbol, x.dtype, tuple(x.shape), int(op.attrs["k"]), int(op.attrs["axis"]),
                                       bool(op.attrs.get("largest", True)))
        args = (x.name,) + tuple(t.name for t in op.outputs)
        return src, KernelLaunch(symbol, grid, block, 0, args, 1, op.name, "topk"), None
    an = _Analysis()
    names = itertools.count()
    reads: dict[int, tuple[str, tuple[int, ...], str]] = {}
    params = []
    for i, (ph, t) in enumerate(zip(task.inputs, op.inputs)):
        _check_dtype(ph.dtype, f"input {i} of {op.name} ({op.op_type})")
        reads[id(ph)] = (f"in{i}", tuple(ph.shape), ph.dtype)
        params.append(f"const {_STORE_CTYPE[ph.dtype]}* __restrict__ in{i}")
    for j, gc in enumerate(task.outputs):
        _check_dtype(gc.dtype, f"output {j} of {op.name} ({op.op_type})")
        params.append(f"{_STORE_CTYPE[gc.dtype]}* __restrict__ out{j}")
    param_text = ", ".join(params) if params else ""
    args = tuple(t.name for t in op.inputs) + tuple(t.name for t in op.outputs)
    scalars = _scalar_constants(op)
    # (each read of a fused producer inlines a copy of it: one object per distinct value again)
    values = [hashcons(_bake(_inline_computes(gc.value, an), scalars)) for gc in task.outputs]

    att = _attention_member(op) if mma and len(task.outputs) == 1 else None
    if att is not None:
        fused = _lower_attention(op, att, symbol, param_text, an, reads, names, fp32, sms)
        if fused is None:
            log.warning("%s: the fused attention kernel does not apply (operand layout, head size or "
                        "epilogue); it gets the generic kernel, which recomputes the scores per output "
                        "element", op.name)
        else:
            src, cfg = fused
            return src, KernelLaunch(symbol, cfg["grid"], cfg["block"], cfg["shared_mem"], args, len(op.inputs),
                                     op.name, f"attention-{_attention_type(att, fp32)}"), None
    if len(task.outputs) == 1 and _prod(task.outputs[0].shape) > 0:
        gc, value = task.outputs[0], values[0]
        plan = _plan_gemm(gc, value, an, fp32)
        if plan is None:  # (a grouped or transposed convolution: output axes split, decisions 62 and 65)
            split = _split_divided_axes(gc, value, an, fp32)
            if split is not None:
                gc, value, plan = split
        if plan is not None:
            # (pdl: the parameters no kernel writes, whose first stages a GEMM may load before its wait)
            weights = {f"in{i}" for i, t in enumerate(op.inputs) if t.is_constant} if pdl else set()
            src, cfg, wrapper = _lower_gemm(gc, value, plan, symbol, param_text, "out0", an, reads, names, wgmma,
                                            config, wgmma_fp32=wgmma_fp32, sms=sms, pdl=pdl, weights=weights)
            kind = f"gemm-wgmma-{plan.prec}" if wrapper else f"gemm-{plan.prec}"
            launch = KernelLaunch(symbol, cfg["grid"], cfg["block"], cfg.get("shared_mem", 0), args,
                                  len(op.inputs), op.name, kind, tuple(cfg.get("tensor_maps", ())),
                                  bool(cfg.get("persistent", False)), int(cfg.get("cluster", 1)))
            return src, launch, wrapper
        # fewer than 16 rows (decoding): the weight streamed once, the rows' sums in registers
        plan = _plan_gemm(gc, value, an, fp32, skinny=True)
        if plan is not None and _prod([v.extent for v in plan.red.vars]) >= _GEMV_MIN_K:
            src, cfg, _ = _lower_gemm(gc, value, plan, symbol, param_text, "out0", an, reads, names, gemv=True,
                                      codes=_nbits_codes(op, plan))
            return src, KernelLaunch(symbol, cfg["grid"], cfg["block"], 0, args, len(op.inputs), op.name, "gemv"), None

    parts: list[_Part] = []
    for j, (gc, value) in enumerate(zip(task.outputs, values)):
        if _prod(gc.shape) == 0:
            continue
        kept = task.inputs[in_place] if in_place is not None and j == 0 else None
        parts.append(_lower_generic_part(gc, value, f"out{j}", an, reads, names, kept))
    body = []
    if any(p.block_smem for p in parts):
        body += ["__shared__ unsigned long long sf_red[32];", "__shared__ long long sf_redi[32];"]
    for j, p in enumerate(parts):
        body.append("{")
        body += _indent(p.code, 2)
        body.append("}")
    src = (f'extern "C" __global__ void __launch_bounds__({_THREADS}) {symbol}({param_text}) {{\n'
           + "\n".join(_indent(body, 2)) + "\n}\n")
    grid = max([p.grid for p in parts], default=1)
    kind = "+".join(dict.fromkeys(p.kind for p in parts)) or "empty"
    return src, KernelLaunch(symbol, (grid, 1, 1), (_THREADS, 1, 1), 0, args, len(op.inputs), op.name, kind), None


# ----------------------------------------------------------------------------------------------
# translation unit, toolchain, cache
# ----------------------------------------------------------------------------------------------

@dataclass
class CudaKernel:
    """One kernel of a :class:`CudaSource`: its definition and what it needs before it."""

    symbol: str
    #: the definition (``extern "C" __global__ void <symbol>(...) {...}``)
    text: str
    #: ``// node <name> (<type>) -> <kind>``: the op it was generated for
    comment: str
    #: helpers that must precede it (:data:`_HELPER_ORDER`'s keys), and its wgmma instruction wrapper
    needs: tuple[str, ...] = ()
    wrapper: tuple | None = None
    #: the ops that launch it
    ops: list[str] = field(default_factory=list)


@dataclass
class CudaSource:
    """A generated translation unit: its text, the launches, and the source lines of each op.

    ``header`` (the prelude every kernel reads) and ``kernels`` are the parts ``text`` is made of
    (:meth:`assemble`): :meth:`merge` joins several ranks' sources into one unit, each distinct
    kernel once."""

    text: str
    launches: dict[str, KernelLaunch]
    lines: dict[str, tuple[int, int]] = field(default_factory=dict)
    header: str = ""
    kernels: list[CudaKernel] = field(default_factory=list)
    #: the architecture it was generated for (``generate_cuda_source``'s ``arch``)
    arch: str = ""

    @classmethod
    def assemble(cls, header: str, kernels: Sequence[CudaKernel], launches: dict[str, KernelLaunch],
                 arch: str = "") -> "CudaSource":
        """The unit of ``kernels`` after ``header``: each helper a kernel needs is written once,
        before the first kernel that needs it; ``lines`` gives every op of a kernel its lines."""
        chunks = [header]
        line = header.count("\n") + 1
        lines: dict[str, tuple[int, int]] = {}
        done: set = set()
        wrappers: set = set()
        for k in kernels:
            pre = []
            if k.wrapper is not None and k.wrapper not in wrappers:
                pre.append(wgmma_helpers({k.wrapper}, common=not wrappers))
                wrappers.add(k.wrapper)
            for key in _HELPER_ORDER:
                if key in k.needs and key not in done:
                    pre.append(_helper_text(key))
                    done.add(key)
            text = "".join(pre) + k.comment + k.text + "\n"
            n = text.count("\n")
            span = (line, line + n - 1)
            line += n
            chunks.append(text)
            for name in k.ops:
                lines[name if lines.get(name, span) == span else f"{name} ({k.symbol})"] = span
        return cls("".join(chunks), launches, lines, header, list(kernels), arch)

    @classmethod
    def merge(cls, sources: Sequence["CudaSource"]) -> "CudaSource":
        """One unit with every kernel of ``sources`` (several ranks' units): a symbol names its
        kernel's code (:func:`_symbol`), so a symbol in several sources is one kernel. ``launches``
        is the union by op name (an op of the same name may take different kernels in different
        ranks: the ranks' own launches say which). The architectures and headers must be equal
        (the headers are unless some sources need the float8 helpers): ValueError otherwise."""
        if not sources:
            raise ValueError("no sources to merge")
        if len(sources) == 1:
            return sources[0]
        kernels: dict[str, CudaKernel] = {}
        launches: dict[str, KernelLaunch] = {}
        archs = sorted({s.arch for s in sources})
        if len(archs) != 1:
            raise ValueError(f"the units are for different architectures {archs}; compile them apart")
        for s in sources:
            if s.header != sources[0].header:
                raise ValueError("the sources have different headers; compile them as separate units")
            for k in s.kernels:
                if k.symbol not in kernels:
                    kernels[k.symbol] = dataclasses.replace(k, ops=list(k.ops))
                else:
                    kernels[k.symbol].ops.extend(n for n in k.ops if n not in kernels[k.symbol].ops)
            launches.update(s.launches)
        return cls.assemble(sources[0].header, list(kernels.values()), launches, sources[0].arch)


#: Helpers some kernels share, written once per unit before the first kernel that needs them, in
#: this order (a kernel's wgmma instruction wrappers come before them all)
_HELPER_ORDER = ("split", "stream-k", "attention-float", "attention")


def _helper_text(key: str) -> str:
    if key == "split":  # the 3xTF32 split
        return SPLIT_HELPERS
    if key == "stream-k":  # the stream-K workspace, shared by the unit's kernels
        return STREAM_K_WORKSPACE
    from .cuda_attention import ATTENTION_FLOAT_HELPERS, ATTENTION_HELPERS
    return ATTENTION_FLOAT_HELPERS if key == "attention-float" else ATTENTION_HELPERS


def generate_cuda_source(ops: Sequence[Operator], precision: str = "float32", arch: str = "sm_80",
                         gemm_configs: dict[str, str] | None = None, pdl: bool = False,
                         in_place: dict[str, int] | None = None, wgmma_fp32: bool = False,
                         sms: int = PERSISTENT_SMS) -> CudaSource:
    """Generate the CUDA translation unit for ``ops`` (no compilation).

    Parameters
    ----------
    ops
        Operators with static shapes; collectives and extern ops are skipped.
    precision
        See :func:`build_cuda_library`.
    arch
        ``sm_90``/``sm_90a`` let half-precision GEMMs with dense operands use the Hopper ``wgmma``
        template (:mod:`.cuda_wgmma`; such a unit must be compiled for ``sm_90a``, see
        :func:`compile_arch`); other architectures get the portable ``wmma`` template only.
    gemm_configs
        Block tile of the wgmma GEMM of some ops (op name -> a :data:`~.cuda_wgmma.WGMMA_CONFIGS`
        name; the tuner's choices); the others get :func:`~.cuda_wgmma.choose_wgmma_config`'s.
    pdl
        Every kernel calls :data:`PDL_ENTER` (sm_90 and newer): launched with programmatic
        dependent launch (``runtime/pdl.py``), a kernel waits on the GPU for the one before it.
        The call opens the kernel, but in the tensor-core GEMMs that first set up their barriers
        or issue the copies of a weight's first stages (RFC 0005 decision 48).
    in_place
        ``{op name: input index}``: ops whose (one) output the program writes over that input;
        where the output is ``c ? x[i] : e`` with ``x`` that input read at the output's own index,
        the kernel stores ``e`` only where ``c`` does not hold (``build_cuda_library``'s).
    wgmma_fp32
        On sm_90: float32 products whose operands are both K-major take the wgmma template too
        (one TF32 product at ``precision="tf32"``, else 3xTF32; rfcs/0005 decisions 33, 34), not
        only those on a tile ``gemm_configs`` forces. Not measured on a GPU yet: off by default.
    sms
        The target GPU's multiprocessors (default 132, an H100 SXM's or H200's): the wgmma tile
        choice, K splits and persistent grids, the portable GEMM's tile and the attention's KV
        splits are sized for them (a launcher lowers a persistent grid to the device's count, so
        any value runs correctly; a wrong one only fills the GPU less well).

    Returns
    -------
    CudaSource
        ``text`` (the ``.cu`` source), ``launches`` (by op name; ops with identical kernels share a
        symbol, derived from the kernel's text: equal kernels of different ranks' units have equal
        symbols, see :meth:`CudaSource.merge`) and ``lines`` (the 1-based line range of each op's
        kernel, for error messages).

    Raises
    ------
    CudaCodegenError
        if an op uses a dtype or expression the cuda target cannot lower, or two ops share a name.
    """
    if precision not in FP32_GEMM:
        raise CudaCodegenError(f"precision {precision!r}: choose one of {sorted(FP32_GEMM)}")
    fp32 = FP32_GEMM[precision]
    sms = target_sms(sms) if arch in WGMMA_ARCHS else check_sms(sms)
    if pdl and _sm(arch) < 90:
        raise CudaCodegenError(f"programmatic dependent launch (pdl) needs sm_90 or newer, not {arch!r}")
    head = PRELUDE + (PDL_HELPER if pdl else "")
    if float8.used_by(ops):
        head += float8.prelude("__device__ __forceinline__", "__int_as_float(0x7fc00000)", "__int_as_float(0x7f800000)")
    launches: dict[str, KernelLaunch] = {}
    kernels: dict[str, CudaKernel] = {}  # by kernel text (symbol left out)
    for op in ops:
        if not lowerable(op):
            continue
        if op.name in launches:
            raise CudaCodegenError(f"two ops are named {op.name!r}; kernel names must be unique")
        try:
            src, launch, wrapper = _lower_op(op, _PLACEHOLDER, fp32, arch in WGMMA_ARCHS,
                                             (gemm_configs or {}).get(op.name), _sm(arch) >= 80,
                                             (in_place or {}).get(op.name), wgmma_fp32, sms, pdl)
        except CudaCodegenError as exc:
            raise CudaCodegenError(f"cannot lower node {op.name} ({op.op_type}) to CUDA: {exc}") from None
        src = _with_pdl_entry(src) if pdl else src
        k = kernels.get(src)
        if k is None:  # else the same shapes and attributes as an earlier op (repeated layers): its kernel
            needs = tuple(key for key, used in (
                ("attention", launch.kind.startswith("attention")),
                ("attention-float", launch.kind in ("attention-tf32", "attention-f32")),
                ("stream-k", "sf_sk_ws" in src), ("split", "sf_split4(" in src)) if used)
            symbol = _symbol(src, op)
            comment = f"// node {re.sub(r'[^ -~]', '?', op.name)} ({op.op_type}) -> {launch.kind}\n"
            k = kernels[src] = CudaKernel(symbol, src.replace(_PLACEHOLDER, symbol), comment, needs, wrapper)
        k.ops.append(op.name)
        launches[op.name] = dataclasses.replace(launch, symbol=k.symbol)
    return CudaSource.assemble(head, list(kernels.values()), launches, arch)


#: :data:`PDL_ENTER` (``.cuda_wgmma``'s), the first statement of every kernel of a program compiled
#: with ``pdl`` (RFC 0005 decision 29) but the persistent GEMMs', which place it after their set-up:
#: wait until the kernel before it has completed and its writes are visible (immediately when it
#: was not launched with programmatic dependent launch), then let the next kernel be launched (it
#: waits in turn, so nothing runs ahead of its inputs)
PDL_HELPER = """__device__ __forceinline__ void sf_pdl_enter() {
  asm volatile("griddepcontrol.wait;\\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\\n" ::: "memory");
}
"""
_KERNEL_ENTRY = re.compile(r'^(extern "C" __global__ [^\n]*\{\n)', re.M)


def _with_pdl_entry(src: str) -> str:
    """``src`` (one op's kernel) with :data:`PDL_ENTER` first in its body, unless the kernel
    places it itself (the persistent GEMMs, :func:`.cuda_wgmma._tma_kernel`)."""
    if PDL_ENTER in src:
        return src
    out, n = _KERNEL_ENTRY.subn(lambda m: m.group(1) + "  " + PDL_ENTER + "\n", src)
    assert n == 1, n  # (every template writes its signature and brace on one line)
    return out


def _sm(arch: str) -> int:
    """The compute capability of ``sm_XY[a]`` as ``XY`` (0 when it is not of that form)."""
    m = re.fullmatch(r"sm_(\d+)a?", arch)
    return int(m.group(1)) if m else 0


def _arch_flags(arch: str) -> list[str]:
    m = re.fullmatch(r"sm_(\d+)(a?)", arch)
    if not m:
        raise CudaCodegenError(f"arch {arch!r} is not a CUDA GPU architecture like 'sm_90' or 'sm_90a'")
    if m.group(2):
        return [f"-gencode=arch=compute_{m.group(1)}a,code=sm_{m.group(1)}a"]
    return [f"-arch={arch}"]


def compile_arch(arch: str, src: "CudaSource") -> str:
    """The architecture ``src`` is compiled for: ``sm_90a`` when it holds wgmma kernels (they need
    the Hopper-specific target; an ``sm_90a`` cubin runs on the same GPUs as an ``sm_90`` one),
    else ``arch``."""
    if arch == "sm_90" and any(l.kind.startswith("gemm-wgmma") for l in src.launches.values()):
        return "sm_90a"
    return arch


def cuda_compile_command(arch: str, src: str, out: str, nvcc: str = "nvcc") -> list[str]:
    """The ``nvcc`` command line that compiles ``src`` to the cubin ``out`` for ``arch``."""
    return [nvcc, "-cubin", *_arch_flags(arch), "-O3", "-std=c++17", "-o", out, src]


@functools.lru_cache(maxsize=8)
def _nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainError(f"cannot run {nvcc} --version: {exc}") from None


def _find_nvcc() -> str | None:
    cand = os.environ.get("SHARDFLOW_NVCC") or shutil.which("nvcc")
    if cand:
        return cand
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return None


def _atomic_write(path: str, data: bytes) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _culprits(log_text: str, src: CudaSource, fname: str) -> list[str]:
    bad = set()
    for m in re.finditer(re.escape(fname) + r"\((\d+)\)", log_text):
        ln = int(m.group(1))
        for name, (a, b) in src.lines.items():
            if a <= ln <= b:
                bad.add(name)
    return sorted(bad) or sorted(src.lines)


def _compile_nvcc(nvcc: str, src: CudaSource, arch: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="shardflow-cuda-") as tmp:
        cu = os.path.join(tmp, "kernels.cu")
        out = os.path.join(tmp, "kernels.cubin")
        with open(cu, "w") as f:
            f.write(src.text)
        cmd = cuda_compile_command(arch, cu, out, nvcc)
        log.info("compiling %d CUDA kernels with %s", len(src.launches), " ".join(cmd[:-3]))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            names = _culprits(proc.stderr + proc.stdout, src, "kernels.cu")
            msg = (proc.stderr or proc.stdout).strip()
            if len(msg) > 4000:
                msg = msg[:4000] + "\n..."
            raise CompileError(f"nvcc failed on the kernels of {', '.join(names[:10])}"
                               f"{' and others' if len(names) > 10 else ''}:\n{msg}", names)
        with open(out, "rb") as f:
            return f.read()


def _nvrtc_include_dirs() -> list[str]:
    dirs = []
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "include", "cuda_fp16.h")):
            dirs.append(os.path.join(root, "include"))
    try:
        import cupy  # type: ignore
        p = cupy.cuda.get_cuda_path()
        if p and os.path.exists(os.path.join(p, "include", "cuda_fp16.h")):
            dirs.append(os.path.join(p, "include"))
    except Exception:  # pragma: no cover - depends on the installation
        pass
    try:
        import nvidia  # type: ignore
        for base in getattr(nvidia, "__path__", []):
            for sub in ("cuda_runtime/include", "cu13/include", "cuda_nvrtc/include"):
                d = os.path.join(base, sub)
                if os.path.exists(os.path.join(d, "cuda_fp16.h")):
                    dirs.append(d)
    except ImportError:
        pass
    return list(dict.fromkeys(dirs))


def _nvrtc_version() -> str:
    from cupy.cuda import nvrtc  # type: ignore
    return "nvrtc %d.%d" % nvrtc.getVersion()


def _compile_nvrtc(src: CudaSource, arch: str) -> bytes:
    try:
        from cupy.cuda import nvrtc  # type: ignore
    except ImportError:
        raise ToolchainError("neither nvcc nor NVRTC (through cupy) is available to compile CUDA kernels; "
                             "install the CUDA toolkit or cupy-cuda12x/cupy-cuda13x") from None
    m = re.fullmatch(r"sm_(\d+)(a?)", arch)
    if not m:
        raise CudaCodegenError(f"arch {arch!r} is not a CUDA GPU architecture like 'sm_90'")
    opts = [f"--gpu-architecture=sm_{m.group(1)}{m.group(2)}", "-std=c++17", "--device-as-default-execution-space"]
    opts += [f"-I{d}" for d in _nvrtc_include_dirs()]
    prog = nvrtc.createProgram(src.text, "kernels.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError:
            logtxt = nvrtc.getProgramLog(prog)
            names = _culprits(logtxt, src, "kernels.cu")
            raise CompileError(f"NVRTC failed on the kernels of {', '.join(names[:10])}:\n{logtxt[:4000]}",
                               names) from None
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _match_tiles(ops: Sequence[Operator], tiles: dict[str, str]) -> dict[str, list[str]]:
    """Pattern -> the names of the ops (kernels) it forces a tile on: the first pattern of
    ``tiles`` that matches an op's name, or the name of an op fused into it."""
    res: dict[str, list[str]] = {pattern: [] for pattern in tiles}
    for op in ops:
        names = [op.name] + [m.name for m in getattr(op, "members", [])]
        pattern = next((p for p in tiles if any(fnmatch.fnmatchcase(n, p) for n in names)), None)
        if pattern is not None:
            res[pattern].append(op.name)
    return res


def kernel_groups(ops: Sequence[Operator], arch: str, *, fuse: bool = True, keep: Sequence[str] = (),
                  views: Sequence[str] = ()) -> list[Operator]:
    """The ops that get a kernel each, as :func:`build_cuda_library` makes them: with ``fuse``,
    fused groups (:mod:`.fusion`; ``keep``: tensors still written) with the casts that feed
    tensor-core operands, and the transposed copies that feed the fused attention, written by
    their producers; the views (``views``: names) that no group
    took dropped."""
    from .fusion import drop_views
    if fuse:
        from .fusion import fuse as fuse_ops
        # on Hopper, half-precision GEMM operands are best read from memory as they are: a cast to
        # float16/bfloat16 is written by its producer's kernel rather than inlined into the GEMM; on
        # every GPU so are the casts that the fused attention's Q, K and V come from (it copies them),
        # and those that would join their producer's kernel with the cast back to float32 after them
        feeds = _product_operand_casts(ops) if arch in WGMMA_ARCHS \
            else _attention_operand_casts(ops) | _epilogue_operand_casts(ops)
        feeds |= _attention_operand_copies(ops)
        feeds |= {op.name for op in ops if channels_last_copy(op)}  # (their readers gather from them)
        # (a conv's output copied or kept channels-last, and a pool's kept so: stored so by its
        # kernel; a conv's read of a channels-last value back as NCHW stays in the conv's kernel)
        ops = fuse_ops(list(ops), keep=keep, views=views, materialize=lambda op: op.name in feeds,
                       permuted_epilogue=lambda op: channels_last_copy(op) or channels_last_output(op),
                       no_prologue=channels_last_read)
    return drop_views(ops, views)


def build_cuda_library(ops: Sequence[Operator], path: str, *, arch: str = "sm_90", cache_dir: str | None = None,
                       compiler: str = "auto", precision: str = "float32", fuse: bool = False,
                       keep: Sequence[str] = (), gemm_configs: dict[str, str] | None = None,
                       search_space: int = 1, views: Sequence[str] = (),
                       gemm_tiles: dict[str, str] | None = None, pdl: bool = False, wgmma_fp32: bool = False,
                       in_place: dict[str, str] | None = None,
                       sms: int = PERSISTENT_SMS) -> dict[str, KernelLaunch | None]:
    """Generate, compile and cache the CUDA kernels of ``ops`` into the cubin ``path``.

    Parameters
    ----------
    ops
        Operators (one rank's program, in any order); collectives and ops with extern outputs get
        no kernel and are absent from the result.
    path
        Where to write the ``.cubin`` (written to a temporary file and renamed).
    arch
        GPU architecture, ``sm_XX`` (``sm_90a`` for Hopper-specific instructions). No GPU is
        needed to compile.
    cache_dir
        Kernel cache folder (default: the cpu target's, ``$SHARDFLOW_CACHE_DIR`` or
        ``~/.cache/shardflow/kernels``). Entries (``<sha256>.cubin``) are keyed by the sha256 of
        the source, the compile command and the compiler version, so a second build of the same
        program does not recompile.
    compiler
        ``"auto"`` (nvcc when found, else NVRTC through cupy), ``"nvcc"`` or ``"nvrtc"``. nvcc is
        ``$SHARDFLOW_NVCC``, the one on ``PATH``, or ``$CUDA_HOME/bin/nvcc``.
    precision
        How float32 contractions use the tensor cores: ``"float32"`` (default) 3xTF32, accurate
        to fp32 rounding; ``"tf32"`` one TF32 product (about 3x faster on the tensor cores,
        relative error up to ~``1e-3``). ``"float16"``/``"bfloat16"`` programs use half-precision
        GEMMs for their half-precision ops and 3xTF32 for any float32 one.
    fuse
        Fuse injective ops into their neighbours' kernels (:mod:`.fusion`: element-wise epilogues
        of GEMMs and reductions, cheap prologues). ``keep`` names tensors that must still be
        written (graph outputs, inputs of collectives or of ops compiled elsewhere).
    gemm_configs
        Block tiles of wgmma GEMMs by op name (see :func:`generate_cuda_source`).
    gemm_tiles
        ``{fnmatch pattern: tile}``: the tile of the GEMM kernels whose op, or one of the ops fused
        into it, matches a pattern (the first that does); over the tuned choices, under
        ``gemm_configs`` (``optimization_config["gemm_tiles"]``).
    search_space
        ``0``/``1``: the default tile choice; ``2``: measure the wgmma GEMMs' tiles on this
        machine's GPU when one is visible (:mod:`.tune`; choices cached beside the kernels).
    views
        Names of ops in ``ops`` that can run as views (no kernel): fusion may fold them into a
        neighbour's kernel; the others get no kernel and no entry in the result.
    pdl
        Kernels for programmatic dependent launch (see :func:`generate_cuda_source`).
    wgmma_fp32
        Float32 products on the Hopper template (see :func:`generate_cuda_source`;
        ``optimization_config["wgmma_fp32"]``).
    in_place
        ``{output tensor name: input tensor name}``: outputs the program writes over that input's
        bytes (a state, ``compile(state=...)``; the caller makes sure the program aliases them). The
        kernel writing such an output as a select that keeps the input's element (``c ? x[i] :
        e``) stores only where ``c`` does not hold (a KV cache's new rows, not the whole cache).
    sms
        The target GPU's multiprocessors (see :func:`generate_cuda_source`;
        ``optimization_config["sm_count"]``).

    Returns
    -------
    dict[str, KernelLaunch | None]
        The launch of each lowered op, by op name. With ``fuse``, a fused group's launch (its
        ``args`` name the group's inputs and output) is under its last op and the group's other
        ops map to ``None``.

    Raises
    ------
    CudaCodegenError
        if an op cannot be lowered.
    ToolchainError
        if no CUDA compiler is available.
    CompileError
        if compilation fails; its ``ops`` (and message) name the ops whose kernels failed.
    """
    t0 = time.perf_counter()
    launches, src = prepare_cuda_library(ops, arch=arch, cache_dir=cache_dir, compiler=compiler, precision=precision,
                                         fuse=fuse, keep=keep, gemm_configs=gemm_configs,
                                         search_space=search_space, views=views, gemm_tiles=gemm_tiles, pdl=pdl,
                                         wgmma_fp32=wgmma_fp32, in_place=in_place, sms=sms)
    compile_cuda_sources([src], path, cache_dir=cache_dir, compiler=compiler, source_seconds=time.perf_counter() - t0)
    return launches


def prepare_cuda_library(ops: Sequence[Operator], *, arch: str = "sm_90", cache_dir: str | None = None,
                         compiler: str = "auto", precision: str = "float32", fuse: bool = False,
                         keep: Sequence[str] = (), gemm_configs: dict[str, str] | None = None,
                         search_space: int = 1, views: Sequence[str] = (),
                         gemm_tiles: dict[str, str] | None = None, pdl: bool = False, wgmma_fp32: bool = False,
                         in_place: dict[str, str] | None = None,
                         sms: int = PERSISTENT_SMS) -> tuple[dict[str, KernelLaunch | None], CudaSource]:
    """The kernels of ``ops`` as CUDA, not compiled yet: what :func:`build_cuda_library` returns,
    and the unit :func:`compile_cuda_sources` compiles (alone, or merged with other ranks' units).
    The parameters are :func:`build_cuda_library`'s (``cache_dir`` and ``compiler`` serve the
    tuner's candidate kernels, ``search_space`` 2)."""
    _check_compiler(compiler)
    _arch_flags(arch)
    ops = kernel_groups(ops, arch, fuse=fuse, keep=keep, views=views)
    from .fusion import aliased_inputs
    aliased = aliased_inputs(ops, in_place)
    matched = _match_tiles(ops, gemm_tiles or {})
    forced = {name: gemm_tiles[pattern] for pattern, names in matched.items() for name in names}
    tuned = {}
    if search_space >= 2 and arch in WGMMA_ARCHS:
        from .tune import tune_gemms
        cache = cache_dir or default_cache_dir()
        tuned = tune_gemms([op for op in ops if op.name not in forced], arch=arch, precision=precision,
                           wgmma_fp32=wgmma_fp32, sms=sms, cache_dir=cache,
                           compile_source=lambda s: _cached_cubin(s, arch, cache, compiler)[0])
    src = generate_cuda_source(ops, precision, arch, {**tuned, **forced, **(gemm_configs or {})}, pdl=pdl,
                               wgmma_fp32=wgmma_fp32, in_place=aliased, sms=sms)
    for pattern, names in matched.items():
        if not any(src.launches[n].kind.startswith("gemm-wgmma") for n in names if n in src.launches):
            log.warning("gemm_tiles: pattern %r names no GEMM kernel of this program (wgmma)", pattern)
    if fuse:
        return {m.name: None for op in ops for m in getattr(op, "members", [])[:-1]} | dict(src.launches), src
    return dict(src.launches), src


def compile_cuda_sources(sources: Sequence[CudaSource], path: str, *, cache_dir: str | None = None,
                         compiler: str = "auto", source_seconds: float | None = None) -> bool:
    """Compile one cubin ``path`` with the kernels of every unit in ``sources`` (from
    :func:`prepare_cuda_library`, for one architecture; their headers must be equal, see
    :meth:`CudaSource.merge`), through the kernel cache. The ranks of a plan mostly run the same
    kernels: one cubin for all of them compiles each distinct kernel once, where a cubin per rank
    compiled them all again whenever one kernel differed (a slice at the rank's offset). Returns
    True on a cache hit."""
    _check_compiler(compiler)
    t1 = time.perf_counter()
    src = CudaSource.merge(sources)
    data, hit = _cached_cubin(src, src.arch, cache_dir or default_cache_dir(), compiler)
    _atomic_write(path, data)
    log.info("cuda library %s (%s): %d ops, %d kernels%s%s, %s %.2f s", path, compile_arch(src.arch, src),
             len(src.launches), len(src.kernels), f" (of {len(sources)} units)" if len(sources) > 1 else "",
             f", source {source_seconds:.2f} s" if source_seconds is not None else "",
             "cache hit" if hit else "compile", time.perf_counter() - t1)
    return hit


def _check_compiler(compiler: str) -> None:
    if compiler not in ("auto", "nvcc", "nvrtc"):
        raise CudaCodegenError(f"compiler must be 'auto', 'nvcc' or 'nvrtc', not {compiler!r}")


def _cached_cubin(src: CudaSource, arch: str, cache: str, compiler: str) -> tuple[bytes, bool]:
    """The cubin of ``src`` for ``arch`` from the kernel cache ``cache``, else compiled (by
    ``compiler``, see :func:`build_cuda_library`) and cached; and whether it was a hit. Entries are
    keyed by the text, the compile command and the compiler's version."""
    nvcc = _find_nvcc() if compiler in ("auto", "nvcc") else None
    if compiler == "nvcc" and nvcc is None:
        raise ToolchainError("nvcc was not found (set SHARDFLOW_NVCC or CUDA_HOME, or use compiler='nvrtc')")
    target = compile_arch(arch, src)
    if nvcc is not None:
        tool = " ".join(cuda_compile_command(target, "SRC", "OUT", "nvcc")) + "\n" + _nvcc_version(nvcc)
    else:
        try:
            tool = f"nvrtc {target}\n" + _nvrtc_version()
        except ImportError:
            raise ToolchainError("neither nvcc nor NVRTC (through cupy) is available to compile CUDA kernels; "
                                 "install the CUDA toolkit or cupy-cuda12x/cupy-cuda13x") from None
    key = hashlib.sha256((src.text + "\0" + tool).encode()).hexdigest()
    cached = os.path.join(cache, key[:2], key + ".cubin")
    try:
        with open(cached, "rb") as f:
            data = f.read()
    except FileNotFoundError:  # (never built, or taken out of the cache: `shardflow cache prune`)
        pass
    else:
        touch(cached)
        return data, True
    data = _compile_nvcc(nvcc, src, target) if nvcc is not None else _compile_nvrtc(src, target)
    try:
        _atomic_write(cached, data)
    except OSError as exc:  # a read-only cache must not fail the build
        log.warning("cannot write the kernel cache %s: %s", cached, exc)
    return data, False
