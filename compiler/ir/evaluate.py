"""Direct (reference) evaluation of compute definitions with numpy.

Every axis variable becomes a broadcastable ``arange`` occupying its own array dimension, so a
whole grid compute is evaluated in a handful of vectorized numpy calls. Memory grows with the
product of the grid and reduction extents: meant for tests on small shapes.

Reads in the untaken branch of a select may be out of bounds (padding, masks); indices are
clamped before reading and the select discards those values.
"""
from __future__ import annotations

import numpy as np

from .expr import (BINARY_FUNCS, UNARY_FUNCS, BinOp, Cast, Const, Expr, IfThenElse, Reduce,
                   TensorElement, UnaryOp, Var, numpy_type, walk)
from .task import GridCompute, Task

__all__ = ["evaluate_task", "evaluate_compute"]

_REDUCERS = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min, "mean": np.mean}


def evaluate_task(task: Task, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Evaluate every output of ``task`` on ``inputs`` (one array per task input)."""
    if task.is_extern:
        raise TypeError(f"task {task.name} has an extern output; it has no index-expression definition")
    if len(inputs) != len(task.inputs):
        raise ValueError(f"task {task.name} takes {len(task.inputs)} inputs, got {len(inputs)}")
    bound: dict[int, np.ndarray] = {}
    for ti, arr in zip(task.inputs, inputs):
        arr = np.asarray(arr)
        if arr.shape != ti.shape:
            raise ValueError(f"input {ti.name} of {task.name}: shape {arr.shape}, expected {ti.shape}")
        bound[id(ti)] = arr
    outs = []
    for out in task.outputs:
        res = evaluate_compute(out, bound)
        bound[id(out)] = res  # (bfloat16 values as float32 for the task's later computes)
        outs.append(res.astype(numpy_type("bfloat16")) if out.dtype == "bfloat16" else res)
    return outs


def evaluate_compute(gc: GridCompute, bound: dict[int, np.ndarray]) -> np.ndarray:
    """Evaluate one grid compute; ``bound`` maps ``id(placeholder)`` to its array."""
    reduces = [n for n in walk(gc.value) if isinstance(n, Reduce)]
    dims: dict[Var, int] = {v: d for d, v in enumerate(gc.axes)}
    nd = len(gc.axes)
    for r in reduces:
        for v in r.vars:
            dims[v] = nd
            nd += 1
    env = {v: _axis_array(v.extent, d, nd) for v, d in dims.items()}
    ev = _Evaluator(env, dims, nd, bound)
    val = np.asarray(ev.eval(gc.value))
    if val.ndim < nd:
        val = val.reshape((1,) * (nd - val.ndim) + val.shape)
    val = np.broadcast_to(val, gc.shape + val.shape[len(gc.axes):])
    val = val.reshape(gc.shape)
    if gc.dtype is not None and gc.dtype != "bfloat16":
        val = val.astype(gc.dtype, copy=False)
    return np.ascontiguousarray(val).reshape(gc.shape)  # ascontiguousarray makes 0-d arrays 1-d


def _axis_array(extent: int, dim: int, nd: int) -> np.ndarray:
    shape = [1] * nd
    shape[dim] = extent
    return np.arange(extent, dtype=np.int64).reshape(shape)


class _Evaluator:
    def __init__(self, env, dims, nd, bound):
        self.env, self.dims, self.nd, self.bound = env, dims, nd, bound
        self.memo: dict[int, object] = {}

    def eval(self, e: Expr):
        key = id(e)
        if key in self.memo:
            return self.memo[key]
        res = self._eval(e)
        self.memo[key] = res
        return res

    def _eval(self, e: Expr):
        if isinstance(e, Var):
            return self.env[e]
        if isinstance(e, Const):
            return np.array(e.value, dtype=e.dtype) if e.dtype else e.value
        if isinstance(e, BinOp):
            a, b = self.eval(e.a), self.eval(e.b)
            with np.errstate(all="ignore"):
                return BINARY_FUNCS[e.op](a, b)
        if isinstance(e, UnaryOp):
            with np.errstate(all="ignore"):
                return UNARY_FUNCS[e.op](self.eval(e.a))
        if isinstance(e, Cast):
            v = np.asarray(self.eval(e.a))
            with np.errstate(all="ignore"):
                # (bfloat16 values computed in float32, rounded here, as the kernels round them)
                return v.astype(e.dtype) if e.dtype != "bfloat16" else \
                    v.astype(numpy_type("bfloat16")).astype(np.float32)
        if isinstance(e, IfThenElse):
            return np.where(self.eval(e.cond), self.eval(e.then), self.eval(e.other))
        if isinstance(e, TensorElement):
            return self._read(e)
        if isinstance(e, Reduce):
            return self._reduce(e)
        raise TypeError(f"cannot evaluate {type(e).__name__}")

    def _read(self, e: TensorElement):
        t = e.tensor
        if id(t) not in self.bound:
            raise KeyError(f"tensor {t.name} is not bound")
        arr = self.bound[id(t)]
        idx = []
        for ext, ie in zip(arr.shape, e.indices):
            iv = np.asarray(self.eval(ie))
            if iv.dtype.kind not in "iu":
                iv = iv.astype(np.int64)
            idx.append(np.clip(iv, 0, max(ext - 1, 0)))
        if not idx:
            return arr[()]
        if arr.size == 0:
            shape = np.broadcast_shapes(*(i.shape for i in idx))
            return np.zeros(shape, arr.dtype)
        return arr[tuple(idx)]

    def _reduce(self, r: Reduce):
        body = np.asarray(self.eval(r.body))
        if body.ndim < self.nd:
            body = body.reshape((1,) * (self.nd - body.ndim) + body.shape)
        axes = tuple(self.dims[v] for v in r.vars)
        full = list(body.shape)
        for v, ax in zip(r.vars, axes):
            full[ax] = v.extent
        body = np.broadcast_to(body, full)
        if r.op in ("argmax", "argmin"):
            ax = axes[0]
            if body.shape[ax] == 0:
                raise ValueError("arg-reduction over an empty axis")
            f = np.argmax if r.op == "argmax" else np.argmin
            return np.expand_dims(f(body, axis=ax), ax).astype(np.int64)
        with np.errstate(all="ignore"):
            return _REDUCERS[r.op](body, axis=axes, keepdims=True)
