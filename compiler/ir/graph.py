"""Flow-graph IR: :class:`Tensor`, :class:`Operator` and :class:`FlowGraph`.

An operator owns a compute definition (:class:`~shardflow.compiler.ir.task.Task`) built from its
input shapes and attributes, and a fast numpy implementation used by :meth:`FlowGraph.run`.
Every subclass defines ``compute(*placeholders)`` (the definition) and may override ``numpy``
(the default evaluates the definition directly, which is exact but slow).
"""
from __future__ import annotations

import itertools
import logging
import math
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from shardflow.runtime.errors import format_bytes

from ..errors import DtypeError, GraphError, MemoryLimitError, ShapeError, ShardflowError
from .evaluate import evaluate_task
from .expr import ML_FLOATS, infer_dtype, numpy_type
from .spill import spill
from .task import ExternCompute, GridCompute, Task, TensorInput

__all__ = ["Tensor", "Operator", "FlowGraph", "const_tensor", "RNG_STEP", "RNG_STEP_NEXT"]

#: The graph input the random ops read (ops/random.py: which run of the program this is; int64, 0-d)
#: and the output holding its successor: the importer adds both to a model with random ops, and
#: ``compile`` keeps the pair as the program's state, so each run draws new values.
RNG_STEP, RNG_STEP_NEXT = "shardflow_rng_step", "shardflow_rng_step_next"

log = logging.getLogger(__name__)
_names = itertools.count()


def _fmt_shape(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


class Tensor:
    """A value in the graph: a graph input, a constant (``value`` set, no producer) or an op output.

    An op output may also carry a ``value`` when it was computable at import (constant-foldable).
    """

    __slots__ = ("name", "shape", "dtype", "producer", "value", "__weakref__")

    def __init__(self, name: str, shape: Sequence[int], dtype: str, producer: "Operator | None" = None,
                 value: np.ndarray | None = None):
        self.name = name
        self.shape = tuple(int(d) for d in shape)
        self.dtype = str(dtype)
        self.producer = producer
        self.value = value

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(int(d) for d in self.shape)  # (exact: an int64 product could wrap)

    @property
    def nbytes(self) -> int:
        return self.size * numpy_type(self.dtype).itemsize

    @property
    def is_constant(self) -> bool:
        """A graph constant (weights, folded values): no producer and a known value."""
        return self.producer is None and self.value is not None

    def __repr__(self) -> str:
        kind = "const " if self.is_constant else ""
        return f"%{self.name}: {kind}{self.dtype}{_fmt_shape(self.shape)}"


def const_tensor(value: np.ndarray, name: str | None = None) -> Tensor:
    """Make a constant tensor holding ``value`` (kept in a file when it is large, under
    :func:`~shardflow.compiler.ir.spill.spilling`)."""
    value = spill(np.asarray(value))
    return Tensor(name or f"const_{next(_names)}", value.shape, str(value.dtype), None, value)


class Operator:
    """A node of the flow graph.

    Parameters
    ----------
    inputs
        Input tensors, in the order the op's ``compute`` takes them.
    name
        The node's name (the ONNX node name when imported); used in messages.
    **attrs
        The op's attributes; hashable plain values (ints, floats, strings, tuples).
    """

    op_type: ClassVar[str] = ""
    #: True for ops that only move or broadcast data (reshape, transpose, cast, elementwise): the
    #: planner merges them into their producer and fusion treats them as injective.
    injective: ClassVar[bool] = False

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if not cls.__dict__.get("op_type"):
            cls.op_type = cls.__name__

    def __init__(self, inputs: Sequence[Tensor], name: str = "", **attrs: Any):
        self.inputs: list[Tensor] = list(inputs)
        self.attrs: dict[str, Any] = attrs
        self.name = name or f"{self.op_type}_{next(_names)}"
        placeholders = [TensorInput(f"x{i}", t.shape, t.dtype) for i, t in enumerate(self.inputs)]
        task = self.compute(*placeholders)
        if not isinstance(task, Task):
            outs = list(task) if isinstance(task, (list, tuple)) else [task]
            task = Task(self.op_type, placeholders, outs, dict(attrs))
        for o in task.outputs:
            if isinstance(o, GridCompute) and o.dtype is None:
                o.dtype = infer_dtype(o.value) or "float32"
        self.task: Task = task
        self.outputs: list[Tensor] = [
            Tensor(f"{self.name}:{k}", o.shape, o.dtype, self) for k, o in enumerate(task.outputs)
        ]

    # to be defined by subclasses ---------------------------------------------------
    def compute(self, *inputs: TensorInput) -> Task | GridCompute | ExternCompute | list:
        """Return the compute definition for these input placeholders (and ``self.attrs``)."""
        raise NotImplementedError(f"{type(self).__name__} has no compute definition")

    def numpy(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """Execute the op on numpy arrays; default: evaluate the compute definition."""
        return evaluate_task(self.task, list(arrays))

    # helpers ------------------------------------------------------------------------
    #: bfloat16 (and float8) inputs reach :meth:`numpy` as float32 (exactly), so every op computes
    #: in float32 and rounds its outputs to their type once, as the compiled kernels do (numpy's
    #: bfloat16 sums accumulate in bfloat16). False for ops that read the stored bits.
    widens_ml_floats: ClassVar[bool] = True

    def run(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """Execute with :meth:`numpy` and coerce outputs to the declared shapes and dtypes."""
        if self.widens_ml_floats:
            arrays = tuple(a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype.name in ML_FLOATS else a
                           for a in arrays)
        try:
            outs = self.numpy(*arrays)
        except MemoryError:
            raise MemoryLimitError(
                f"node {self.name} ({self.op_type}): computing its outputs "
                f"({', '.join(f'{t.name!r} {list(t.shape)} {format_bytes(t.nbytes)}' for t in self.outputs)}) "
                "ran out of memory; the reference evaluator holds every value of the graph in this process "
                "(compile the model to run it on ranks, or run it with smaller input shapes)") from None
        res = []
        for t, a in zip(self.outputs, outs):
            a = np.asarray(a)
            want = numpy_type(t.dtype)
            if a.dtype != want:
                a = a.astype(want)
            if a.shape != t.shape:
                raise ShapeError(f"node {self.name} ({self.op_type}) produced shape {a.shape} for "
                                 f"output {t.name}, but its definition says {t.shape}; this is a bug")
            res.append(a)
        return res

    def clone(self, inputs: Sequence[Tensor] | None = None) -> "Operator":
        """A new op of the same type and attributes on ``inputs`` (default: the same inputs)."""
        return type(self)(list(self.inputs if inputs is None else inputs), name=self.name, **self.attrs)

    #: Attributes holding the op's (first) output shape, e.g. a reshape target: rewritten by
    #: :meth:`localize` when the op runs on a shard.
    shape_attrs: ClassVar[tuple[str, ...]] = ("shape", "sizes")

    def localize(self, inputs: Sequence[Tensor], output_shapes: Sequence[Sequence[int]],
                 offset: int | None = None, origin: Sequence[int] | None = None) -> "Operator":
        """This op on local shards ``inputs``, producing ``output_shapes`` (used by partition);
        ``offset``: the inputs of :meth:`offset_split_dims` hold the rows from ``offset`` on;
        ``origin``: where the local output starts in the whole (a :attr:`positional` op's).

        Raises
        ------
        ShapeError
            if the op rebuilt on the shards does not produce the expected local shapes.
        """
        want = [tuple(int(d) for d in s) for s in output_shapes]
        attrs = self.local_attrs(inputs, want)
        if offset is not None:
            attrs.update(self.offset_attrs(offset))
        if origin is not None:
            attrs.update(self.origin_attrs(origin))
        op = type(self)(list(inputs), name=self.name, **attrs)
        got = [t.shape for t in op.outputs]
        if got != want:
            raise ShapeError(f"node {self.name} ({self.op_type}) on local shards gives shapes {got}, "
                             f"the plan expects {want}; this sharding is not supported for this op")
        return op

    def local_attrs(self, inputs: Sequence[Tensor], output_shapes: list[tuple[int, ...]]) -> dict[str, Any]:
        """Attributes for running on shards: in every attribute named in ``shape_attrs`` that
        spells the output shape dim by dim, dims equal to the global extent become the local one
        (broadcast 1s stay). Ops with other global counts in their attributes override this."""
        attrs = dict(self.attrs)
        out, local = self.outputs[0].shape, output_shapes[0]
        for a in self.shape_attrs:
            v = attrs.get(a)
            if isinstance(v, tuple) and len(v) == len(out):
                attrs[a] = tuple(lo if (g != lo and x == g) else x for x, g, lo in zip(v, out, local))
        return attrs

    def index_ranges(self) -> dict[int, tuple[int, int]]:
        """``{input position: (lo, hi)}``: the inputs whose values the op uses as indices, and the
        inclusive range of values it takes (an index outside it is an error in the evaluator; the
        compiled kernels clamp it). Default: none."""
        return {}

    def offset_split_dims(self) -> tuple[tuple[int, int], ...]:
        """The ``(input, dim)`` pairs the op can run on split into row ranges, all of them by the
        same rows (a table and its per-row scales): given where a rank's rows start
        (:meth:`offset_attrs`), an index that falls outside them reads zero, so the ranks' outputs
        add up to the whole op's (a vocab-parallel embedding). The indices come from data, so no
        loop variable of the compute definition splits those dims. Default: none."""
        return ()

    def offset_attrs(self, start: int) -> dict[str, Any]:
        """The attributes that make this op, on the rows ``start`` on of its
        :meth:`offset_split_dims`, read zero outside them."""
        raise ShardflowError(f"node {self.name} ({self.op_type}) cannot run on row ranges of its inputs; "
                             "this is a bug in the plan")

    @property
    def data_dependent(self) -> str | None:
        """Why the op's output shape depends on input values, or ``None``."""
        return self.task.data_dependent

    #: True for ops whose values are not a function of their inputs (random number generators):
    #: never folded or merged.
    data_dependent_values: ClassVar[bool] = False

    #: True for ops whose values depend on the output's position in the whole tensor and that take
    #: that position from attributes (:meth:`origin_attrs`): a random draw. The sharding rules then
    #: split its output axes although they appear in its values, and partition gives each rank's op
    #: the origin of its part.
    positional: ClassVar[bool] = False

    #: True for ops that may split a dim they read as ``v // c`` by whole blocks of ``c`` (a grouped conv's
    #: input channels, by group): the sharding rules then classify such a read by the block number, and
    #: the op's :meth:`local_attrs` must give the local op its share of the blocks (GroupNorm's statistics
    #: read the same form, but its local op keeps the whole group count: not set there).
    splits_by_blocks: ClassVar[bool] = False

    def origin_attrs(self, origin: Sequence[int]) -> dict[str, Any]:
        """The attributes that make this (:attr:`positional`) op compute the part of its output
        that starts at ``origin`` in the whole."""
        raise ShardflowError(f"node {self.name} ({self.op_type}) does not compute parts of its output; "
                             "this is a bug in the plan")

    def passthrough_input(self) -> int | None:
        """The input this op returns unchanged (its single output equals it), or ``None``."""
        return None

    def __repr__(self) -> str:
        return f"{self.op_type}({self.name})"

    def signature(self) -> str:
        """The node as one line of text (used by printing and the plan report)."""
        outs = ", ".join(repr(t) for t in self.outputs)
        ins = ", ".join(f"%{t.name}" for t in self.inputs)
        attrs = ""
        if self.attrs:
            attrs = " {" + ", ".join(f"{k}={_fmt_attr(v)}" for k, v in sorted(self.attrs.items())) + "}"
        return f"{outs} = {self.op_type}({ins}){attrs}"


def _fmt_attr(v) -> str:
    if isinstance(v, np.ndarray):
        return f"array{_fmt_shape(v.shape)}"
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


class FlowGraph:
    """A dataflow graph of operators in topological order.

    Parameters
    ----------
    inputs
        The graph inputs (tensors with no producer and no value).
    outputs
        The graph outputs.
    nodes
        The operators in topological order; computed from the outputs when omitted.
    output_names
        Names the outputs are returned under by :meth:`run` (default: the tensors' names). Kept
        separately because rewriting may replace an output tensor by another one.
    """

    def __init__(self, inputs: Sequence[Tensor], outputs: Sequence[Tensor], nodes: Sequence[Operator] | None = None,
                 output_names: Sequence[str] | None = None, name: str = "graph"):
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.output_names = list(output_names) if output_names is not None else [t.name for t in self.outputs]
        self.name = name
        self.nodes = list(nodes) if nodes is not None else topological_sort(self.outputs)
        #: Free-form annotations of later stages (partition records the rank and the mesh here).
        self.meta: dict[str, Any] = {}

    # queries -------------------------------------------------------------------------
    def consumers(self) -> dict[int, list[Operator]]:
        """Map ``id(tensor)`` → the ops reading it (computed on demand)."""
        res: dict[int, list[Operator]] = {}
        for op in self.nodes:
            for t in op.inputs:
                res.setdefault(id(t), []).append(op)
        return res

    def constants(self) -> list[Tensor]:
        """Constant tensors read by the graph's ops or returned as outputs, in first-use order."""
        seen: dict[int, Tensor] = {}
        for op in self.nodes:
            for t in op.inputs:
                if t.is_constant:
                    seen.setdefault(id(t), t)
        for t in self.outputs:
            if t.is_constant:
                seen.setdefault(id(t), t)
        return list(seen.values())

    def op_types(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for op in self.nodes:
            counts[op.op_type] = counts.get(op.op_type, 0) + 1
        return counts

    # validation ----------------------------------------------------------------------
    def validate(self) -> None:
        """Check that the node list is topologically ordered, closed and uniquely named.

        Raises
        ------
        GraphError
            naming the first offending node or tensor.
        """
        available = {id(t) for t in self.inputs}
        names: dict[str, int] = {}
        for t in self.inputs:
            if t.producer is not None or t.value is not None:
                raise GraphError(f"graph input {t.name} has a producer or a constant value")
            names[t.name] = id(t)
        seen_ops: set[int] = set()
        for op in self.nodes:
            if id(op) in seen_ops:
                raise GraphError(f"node {op.name} appears twice in the node list")
            seen_ops.add(id(op))
            for t in op.inputs:
                if id(t) not in available and not t.is_constant:
                    raise GraphError(f"node {op.name} ({op.op_type}) reads %{t.name} before it is produced "
                                     "(nodes out of topological order, or a dangling tensor)")
            if [tuple(p.shape) for p in op.task.inputs] != [t.shape for t in op.inputs]:
                # (a pass swapped an input of another shape in place: the op's compute definition,
                # built from its inputs' shapes when it was made, no longer describes it)
                raise GraphError(f"node {op.name} ({op.op_type}) reads {[t.shape for t in op.inputs]} but its "
                                 f"compute definition was built for {[tuple(p.shape) for p in op.task.inputs]}; "
                                 "this is a bug (rebuild the op rather than swap its inputs)")
            for t in op.outputs:
                if t.producer is not op:
                    raise GraphError(f"tensor {t.name} lists another producer than {op.name}")
                if t.name in names and names[t.name] != id(t):
                    raise GraphError(f"two tensors are named {t.name}")
                names[t.name] = id(t)
                available.add(id(t))
        for t, n in zip(self.outputs, self.output_names):
            if id(t) not in available and not t.is_constant:
                raise GraphError(f"graph output {n} is not produced by any node")
        if len(set(self.output_names)) != len(self.output_names):
            raise GraphError(f"duplicate graph output names: {self.output_names}")

    # execution -----------------------------------------------------------------------
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Execute the graph on the CPU with numpy.

        Parameters
        ----------
        inputs
            One array per graph input, keyed by input name, with exactly the input's shape and
            dtype. A model with random ops also takes :data:`RNG_STEP` (which run this is; 0 when
            left out) and returns its successor as :data:`RNG_STEP_NEXT`.

        Returns
        -------
        dict
            The outputs keyed by the model's output names.
        """
        env = self._bind_inputs(inputs)
        last_use: dict[int, int] = {}
        for n, op in enumerate(self.nodes):
            for t in op.inputs:
                last_use[id(t)] = n
        keep = {id(t) for t in self.outputs}
        for n, op in enumerate(self.nodes):
            args = [env[id(t)] if id(t) in env else t.value for t in op.inputs]
            for t, v in zip(op.outputs, op.run(*args)):
                env[id(t)] = v
            for t in op.inputs:
                if last_use.get(id(t)) == n and id(t) not in keep:
                    env.pop(id(t), None)
        return {name: (env[id(t)] if id(t) in env else t.value)
                for name, t in zip(self.output_names, self.outputs)}

    def _bind_inputs(self, inputs: dict[str, np.ndarray]) -> dict[int, np.ndarray]:
        if not isinstance(inputs, dict):
            raise ShapeError(f"run() takes a dict of input name -> array, got {type(inputs).__name__}")
        by_name = {t.name: t for t in self.inputs}
        unknown = sorted(set(inputs) - set(by_name))
        if unknown:
            raise ShapeError(f"unknown input(s) {unknown}; the graph's inputs are {sorted(by_name)}")
        if RNG_STEP in by_name and RNG_STEP not in inputs:  # (the random ops' first run)
            inputs = {**inputs, RNG_STEP: np.array(0, np.int64)}
        missing = [n for n in by_name if n not in inputs]
        if missing:
            raise ShapeError(f"missing input(s) {missing}; pass an array for each of {list(by_name)}")
        env = {}
        for name, t in by_name.items():
            a = np.asarray(inputs[name])
            if a.dtype != numpy_type(t.dtype):
                raise DtypeError(f"input {name!r} has dtype {a.dtype}, the graph expects {t.dtype}; "
                                 f"convert it with .astype('{t.dtype}')")
            if a.shape != t.shape:
                raise ShapeError(f"input {name!r} has shape {a.shape}, the graph expects {t.shape}; "
                                 "re-import with input_shapes to change it")
            env[id(t)] = a
        return env

    # rewriting -----------------------------------------------------------------------
    def replace_uses(self, old: Tensor, new: Tensor) -> None:
        """Make every reader of ``old`` (ops and graph outputs) read ``new`` instead."""
        for op in self.nodes:
            if any(t is old for t in op.inputs):
                op.inputs = [new if t is old else t for t in op.inputs]
        self.outputs = [new if t is old else t for t in self.outputs]

    def clone(self) -> "FlowGraph":
        """A deep copy of the structure (constant arrays are shared, not copied)."""
        mapping: dict[int, Tensor] = {}

        def m(t: Tensor) -> Tensor:
            if id(t) not in mapping:
                mapping[id(t)] = Tensor(t.name, t.shape, t.dtype, None, t.value)
            return mapping[id(t)]

        inputs = [m(t) for t in self.inputs]
        nodes = []
        for op in self.nodes:
            new = op.clone([m(t) for t in op.inputs])
            for old_t, new_t in zip(op.outputs, new.outputs):
                new_t.name, new_t.value = old_t.name, old_t.value
                mapping[id(old_t)] = new_t
            nodes.append(new)
        res = FlowGraph(inputs, [m(t) for t in self.outputs], nodes, list(self.output_names), self.name)
        res.meta = dict(self.meta)
        return res

    # printing ------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"graph {self.name}(" + ", ".join(repr(t) for t in self.inputs) + ") {"]
        for op in self.nodes:
            lines.append("  " + op.signature())
        outs = ", ".join(f"{n}=%{t.name}" for n, t in zip(self.output_names, self.outputs))
        lines.append(f"  return {outs}")
        lines.append("}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: node count, op histogram, parameter count."""
        params = sum(t.size for t in self.constants())
        hist = ", ".join(f"{k}×{v}" for k, v in sorted(self.op_types().items(), key=lambda kv: -kv[1]))
        return f"{len(self.nodes)} nodes, {params:,} constant elements: {hist}"


def topological_sort(outputs: Iterable[Tensor]) -> list[Operator]:
    """The ops needed for ``outputs``, producers before consumers (iterative DFS, stable order)."""
    order: list[Operator] = []
    state: dict[int, int] = {}  # 1 = on stack, 2 = done
    for out in outputs:
        if out.producer is None:
            continue
        stack: list[tuple[Operator, int]] = [(out.producer, 0)]
        while stack:
            op, k = stack.pop()
            if k == 0:
                if state.get(id(op)) == 2:
                    continue
                if state.get(id(op)) == 1:
                    raise GraphError(f"cycle through node {op.name}")
                state[id(op)] = 1
            if k < len(op.inputs):
                stack.append((op, k + 1))
                p = op.inputs[k].producer
                if p is not None and state.get(id(p)) != 2:
                    if state.get(id(p)) == 1:
                        raise GraphError(f"cycle through node {p.name}")
                    stack.append((p, 0))
            else:
                state[id(op)] = 2
                order.append(op)
    return order
