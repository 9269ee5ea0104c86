"""Compute definitions: tasks built from ``compute`` and ``reduce`` (Hidet/TVM style).

A :class:`Task` names its inputs (:class:`TensorInput` placeholders) and outputs. Each output is
either a :class:`GridCompute` — ``compute(shape, lambda *axes: expr)`` — or, for the few ops whose
result cannot be written as an index expression (sorting), an :class:`ExternCompute` that states
which output axes are independent element-wise maps of input axes and why the rest is opaque.
A task whose output *shape* depends on input values has ``data_dependent`` set to the reason.

Example::

    A = tensor_input("A", (M, K), "float32")
    B = tensor_input("B", (K, N), "float32")
    C = compute("C", (M, N), lambda i, j: reduce((K,), lambda k: A[i, k] * B[k, j], "sum"))
    task = Task("matmul", [A, B], [C])
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .expr import Expr, Reduce, TensorElement, Var, as_expr, format_expr, walk

__all__ = ["TensorInput", "GridCompute", "ExternCompute", "Task", "tensor_input", "compute", "reduce",
           "extern"]


class TensorInput:
    """A placeholder for one input of a task; index it to read elements: ``A[i, k]``."""

    __slots__ = ("name", "shape", "dtype")

    def __init__(self, name: str, shape: Sequence[int], dtype: str):
        self.name, self.shape, self.dtype = name, tuple(int(d) for d in shape), str(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, idx) -> TensorElement:
        if not isinstance(idx, tuple):
            idx = (idx,)
        if len(idx) != len(self.shape):
            raise IndexError(f"{self.name} has rank {len(self.shape)}, indexed with {len(idx)} indices")
        return TensorElement(self, tuple(as_expr(i) for i in idx))

    def __repr__(self):
        return f"{self.name}{list(self.shape)}:{self.dtype}"


class GridCompute:
    """An output whose element at ``axes`` is ``value``. Indexable like an input, so one compute
    can read another (a fused definition)."""

    __slots__ = ("name", "shape", "dtype", "axes", "value")

    def __init__(self, name: str, shape: tuple[int, ...], axes: tuple[Var, ...], value: Expr, dtype: str | None):
        self.name, self.shape, self.axes, self.value = name, shape, axes, value
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    __getitem__ = TensorInput.__getitem__

    def reduces(self) -> list[Reduce]:
        return [n for n in walk(self.value) if isinstance(n, Reduce)]

    def __repr__(self):
        ax = ", ".join(a.name for a in self.axes)
        return f"{self.name}[{ax}] = {format_expr(self.value)}"


@dataclass
class ExternCompute:
    """An output not expressible as an index expression (sort, top-k, unique).

    ``axis_map[d]`` is ``(input_position, input_dim)`` when output axis ``d`` is an independent
    element-wise copy of that input dim (rows of a row-wise top-k), else ``None``. ``reason`` says
    what makes the rest opaque.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    axis_map: tuple[tuple[int, int] | None, ...]
    reason: str

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass
class Task:
    """A compute definition: inputs, outputs and attributes of one operator."""

    name: str
    inputs: list[TensorInput]
    outputs: list[GridCompute | ExternCompute]
    attrs: dict = field(default_factory=dict)
    data_dependent: str | None = None

    @property
    def is_extern(self) -> bool:
        return any(isinstance(o, ExternCompute) for o in self.outputs)

    def __str__(self) -> str:
        lines = [f"task {self.name}({', '.join(map(repr, self.inputs))})"]
        for o in self.outputs:
            if isinstance(o, ExternCompute):
                lines.append(f"  {o.name}{list(o.shape)}: extern ({o.reason})")
            else:
                lines.append(f"  {o!r}")
        if self.data_dependent:
            lines.append(f"  data-dependent: {self.data_dependent}")
        return "\n".join(lines)


def tensor_input(name: str, shape: Sequence[int], dtype: str) -> TensorInput:
    """Declare a task input."""
    return TensorInput(name, shape, dtype)


def _arity(fn: Callable) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return len(params)


def _make_vars(prefix: str, shape: Sequence[int], kind: str, fn: Callable) -> tuple[Var, ...]:
    n = _arity(fn)
    if n is not None and n != len(shape):
        raise ValueError(f"compute function takes {n} axes but the shape has rank {len(shape)}")
    return tuple(Var(f"{prefix}{d}", ext, kind) for d, ext in enumerate(shape))


def compute(name: str, shape: Sequence[int], fcompute: Callable[..., Expr], dtype: str | None = None) -> GridCompute:
    """Define a tensor of ``shape`` whose element at ``axes`` is ``fcompute(*axes)``.

    ``dtype`` fixes the output dtype; by default it is inferred by the op (see ``Operator``).
    """
    shape = tuple(int(d) for d in shape)
    axes = _make_vars("i", shape, "spatial", fcompute)
    value = as_expr(fcompute(*axes))
    return GridCompute(name, shape, axes, value, dtype)


_reduce_counter = [0]


def reduce(shape: Sequence[int], fcompute: Callable[..., Expr], op: str = "sum") -> Reduce:
    """``op`` of ``fcompute(*k)`` over ``k`` in ``shape``; an expression usable inside ``compute``."""
    _reduce_counter[0] += 1
    tag = _reduce_counter[0]
    vs = tuple(Var(f"k{tag}_{d}", ext, "reduce") for d, ext in enumerate(shape))
    n = _arity(fcompute)
    if n is not None and n != len(vs):
        raise ValueError(f"reduce function takes {n} axes but the shape has rank {len(vs)}")
    return Reduce(vs, as_expr(fcompute(*vs)), op)


def extern(name: str, shape: Sequence[int], dtype: str, axis_map: Sequence[tuple[int, int] | None],
           reason: str) -> ExternCompute:
    """Declare an output that index expressions cannot describe (see :class:`ExternCompute`)."""
    return ExternCompute(name, tuple(int(d) for d in shape), str(dtype), tuple(axis_map), reason)
