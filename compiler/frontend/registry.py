"""Registry of ONNX op handlers and the per-node context handlers work with.

A handler turns one ONNX node into flow-graph operators::

    @onnx_op("Relu")                      # every opset from 1 on
    def relu(ctx):
        return [ctx.add(Unary([ctx.input(0)], fn="relu"))]

    @onnx_op("Reshape", since=5)          # shape as an input from opset 5 on
    def reshape(ctx): ...

A handler returns the output tensors, one per ONNX output (trailing optional outputs may be
left off). ``ctx.const(i)`` demands that input ``i`` is known at import (weights, folded shape
arithmetic) and otherwise raises an error that names the node.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import DtypeError, ModelFormatError, ShapeError, UnsupportedOperatorError
from ..ir.graph import Operator, Tensor, const_tensor

__all__ = ["onnx_op", "find_handler", "supported_ops", "NodeContext", "TensorSeq", "EmptyOptional", "sequence_item",
           "onnx_dtype", "REQUIRED"]

REQUIRED = object()

_DTYPES = {
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64", onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.FLOAT8E4M3FN: "float8_e4m3fn",
    onnx.TensorProto.FLOAT8E4M3FNUZ: "float8_e4m3fnuz", onnx.TensorProto.FLOAT8E5M2: "float8_e5m2",
    onnx.TensorProto.FLOAT8E5M2FNUZ: "float8_e5m2fnuz",
    onnx.TensorProto.INT8: "int8", onnx.TensorProto.INT16: "int16", onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT64: "int64", onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.UINT16: "uint16",
    onnx.TensorProto.UINT32: "uint32", onnx.TensorProto.UINT64: "uint64", onnx.TensorProto.BOOL: "bool",
}


#: The floating-point dtype names (handlers that take floats only check against these).
FLOATS = ("float16", "bfloat16", "float32", "float64")

#: ONNX element type of each dtype name (the inverse of ``_DTYPES``).
_CODES = {v: k for k, v in _DTYPES.items()}


@functools.lru_cache(maxsize=None)
def _schema_float_default(op_type: str, domain: str, opset: int, name: str) -> float | None:
    """The float default of attribute ``name`` in the op's onnx schema at ``opset``, or None."""
    try:
        a = onnx.defs.get_schema(op_type, opset, domain).attributes.get(name)
    except Exception:  # noqa: BLE001 - no schema (another domain's op)
        return None
    if a is None or a.type != onnx.AttributeProto.FLOAT or not a.default_value.name:
        return None
    return float(a.default_value.f)


def onnx_dtype(code: int, where: str) -> str:
    """Map an ONNX element type to a numpy dtype name, or raise :class:`DtypeError` naming ``where``."""
    if code in _DTYPES:
        return _DTYPES[code]
    name = onnx.TensorProto.DataType.Name(code) if code in onnx.TensorProto.DataType.values() else str(code)
    raise DtypeError(f"{where}: element type {name} is not supported (supported: "
                     f"{sorted(set(_DTYPES.values()))})")


@dataclass(frozen=True)
class Handler:
    op_type: str
    since: int
    until: int | None
    fn: Callable[["NodeContext"], list]
    domain: str = ""


class TensorSeq:
    """An ONNX sequence value at import (``SequenceConstruct``, ``SplitToSequence``, a loop's list): its
    tensors in order and their element type. Its length is known at import, as every shape is (control
    flow is unrolled), so a sequence is a list of the graph's tensors, not a value of the graph: the
    sequence ops build and read the list, and only the tensors' own ops reach the flow graph."""

    __slots__ = ("items", "dtype", "name")

    def __init__(self, items: list[Tensor], dtype: str, name: str):
        self.items = list(items)
        self.dtype = dtype
        self.name = name

    def __repr__(self) -> str:
        return f"TensorSeq({self.name!r}, {len(self.items)} x {self.dtype})"


class EmptyOptional:
    """An empty ONNX optional at import (an ``Optional`` node without an input, or an optional graph input
    bound to ``None``). Like a sequence it is not a value of the graph: ``OptionalHasElement`` reads it as
    a constant false, ``Identity`` passes it on, and any other reader is refused (``OptionalGetElement``
    of it fails in onnxruntime too)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"EmptyOptional({self.name!r})"


def sequence_item(name: str, k: int) -> str:
    """The name of item ``k`` of the sequence graph input or output ``name`` (a program takes and returns
    a sequence item by item): ``name[k]``."""
    return f"{name}[{k}]"


#: The op types that take a sequence (:class:`TensorSeq`) as an input; any other op given one is refused.
SEQUENCE_READERS = frozenset({"SequenceAt", "SequenceInsert", "SequenceErase", "SequenceLength",
                              "ConcatFromSequence", "SequenceMap", "Identity", "Loop", "Optional",
                              "OptionalHasElement", "OptionalGetElement"})


#: The op types that take an empty optional (:class:`EmptyOptional`) as an input.
EMPTY_OPTIONAL_READERS = frozenset({"Identity", "OptionalHasElement", "OptionalGetElement"})


_HANDLERS: dict[tuple[str, str], list[Handler]] = {}


def onnx_op(op_type: str, since: int = 1, until: int | None = None, domain: str = ""):
    """Register a handler for ``op_type`` valid for opsets ``since`` ≤ v ≤ ``until``."""

    def deco(fn):
        _HANDLERS.setdefault((domain, op_type), []).append(Handler(op_type, since, until, fn, domain))
        return fn

    return deco


def find_handler(domain: str, op_type: str, opset: int) -> Handler | None:
    """The handler for ``op_type`` at ``opset`` (newest ``since`` not above it), or None."""
    best = None
    for h in _HANDLERS.get((domain, op_type), []):
        if h.since <= opset and (h.until is None or opset <= h.until):
            if best is None or h.since > best.since:
                best = h
    return best


def supported_ops() -> dict[str, list[tuple[int, int | None]]]:
    """Every supported op type with the opset ranges its handlers accept."""
    res: dict[str, list[tuple[int, int | None]]] = {}
    for (domain, op), hs in sorted(_HANDLERS.items()):
        key = f"{domain}::{op}" if domain else op
        res[key] = sorted((h.since, h.until) for h in hs)
    return res


class NodeContext:
    """What a handler sees of its node: inputs, attributes, the opset, and ways to add ops."""

    def __init__(self, node: onnx.NodeProto, opset: int, inputs: list[Tensor | None], importer):
        self.node = node
        self.opset = opset
        self.inputs = inputs
        self._importer = importer
        self.name = self.scope + (node.name or f"{node.op_type}({', '.join(node.output)})")
        self._attrs = {a.name: a for a in node.attribute}
        self.created: list[Operator] = []

    # errors ---------------------------------------------------------------------------
    def unsupported(self, what: str) -> UnsupportedOperatorError:
        """An error saying that ``what`` (an attribute value, a mode) of this node is not supported."""
        return UnsupportedOperatorError(f"node {self.name} ({self.node.op_type}): {what} is not supported",
                                        {self.node.op_type: [self.name]})

    def invalid(self, what: str) -> ModelFormatError:
        return ModelFormatError(f"node {self.name} ({self.node.op_type}): {what}")

    def shape_error(self, what: str) -> ShapeError:
        return ShapeError(f"node {self.name} ({self.node.op_type}): {what}")

    # inputs ---------------------------------------------------------------------------
    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    def has_input(self, i: int) -> bool:
        return i < len(self.inputs) and self.inputs[i] is not None

    def input(self, i: int) -> Tensor:
        if not self.has_input(i):
            raise self.invalid(f"input {i} is required but missing")
        return self.inputs[i]

    def const(self, i: int, default: Any = REQUIRED) -> np.ndarray | Any:
        """The value of input ``i``, which must be known at import time."""
        if not self.has_input(i):
            if default is REQUIRED:
                raise self.invalid(f"input {i} is required but missing")
            return default
        t = self.inputs[i]
        if t.value is None:
            deps = self._importer.input_dependencies(t)
            raise UnsupportedOperatorError(
                f"node {self.name} ({self.node.op_type}): input {i} ({self.node.input[i]!r}) must be known at "
                f"compile time (a constant or computable from shapes), but it depends on graph inputs {deps}; "
                "data-dependent shapes and parameters are not supported. If those inputs are fixed for your "
                "use, bind them at import: load_onnx(..., input_values={name: array}), "
                "compile(..., input_values=...) or --value NAME=FILE.npy",
                {self.node.op_type: [self.name]})
        return t.value

    @property
    def routed_experts(self) -> bool:
        """Whether every ``MoE`` computes its chosen experts only (``import_onnx``'s option)."""
        return self._importer.routed_experts

    def rng_step(self) -> Tensor:
        """The random ops' step input (the importer's ``rng_step``: which run of the program this is)."""
        return self._importer.rng_step()

    @property
    def scope(self) -> str:
        """The prefix of the names of a subgraph's ops (``"loop/iter3/"``), ``""`` at the top level."""
        return getattr(self._importer, "scope", "")

    def four_bit(self, i: int) -> str | None:
        """``"int4"`` or ``"uint4"`` when input ``i`` is an initializer of that ONNX type (imported as
        int8/uint8 values, one per element), else None."""
        return self._importer.four_bit.get(id(self.inputs[i])) if self.has_input(i) else None

    def is_const(self, i: int) -> bool:
        return self.has_input(i) and self.inputs[i].value is not None

    # attributes -----------------------------------------------------------------------
    def has_attr(self, name: str) -> bool:
        return name in self._attrs

    def attr(self, name: str, default: Any = REQUIRED) -> Any:
        """Attribute ``name`` as a Python value (ints, floats, strings, lists, numpy tensors). A float
        attribute left out takes the default of the op's schema where it has one, a float32 value
        (BatchNormalization's momentum 0.9 is 0.8999999762, as onnxruntime and onnx's reference take it,
        which a float64 model's results show), else ``default`` (a value computed from the inputs, such
        as Attention's scale)."""
        if name not in self._attrs:
            if default is REQUIRED:
                raise self.invalid(f"required attribute {name!r} is missing")
            if type(default) is float:
                domain = "" if self.node.domain == "ai.onnx" else self.node.domain
                spec = _schema_float_default(self.node.op_type, domain, self.opset, name)
                return default if spec is None else spec
            return default
        a = self._attrs[name]
        try:
            v = helper.get_attribute_value(a)
        except Exception as exc:  # corrupted attribute protos
            raise self.invalid(f"attribute {name!r} cannot be read ({exc})") from None
        if isinstance(v, bytes):
            return v.decode("utf-8", "replace")
        if isinstance(v, onnx.TensorProto):
            return self.tensor_value(v)
        if isinstance(v, list) and v and isinstance(v[0], bytes):
            return [x.decode("utf-8", "replace") for x in v]
        if isinstance(v, onnx.GraphProto) or (isinstance(v, list) and v and isinstance(v[0], onnx.GraphProto)):
            raise self.unsupported(f"subgraph attribute {name!r} (control flow)")
        return v

    def flag(self, name: str, default: int) -> bool:
        """Attribute ``name``, a switch the spec defines as 0 or 1 (``keepdims``, ``transA``, ...), as a
        bool; any other value is a :class:`ModelFormatError` (runtimes read such values differently:
        onnxruntime takes ``keepdims = 2`` as 0 and ``ceil_mode = 3`` as 0, not as true)."""
        v = self.attr(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v not in (0, 1):
            raise self.invalid(f"attribute {name!r} must be 0 or 1, got {v!r}")
        return bool(v)

    def graph_attr(self, name: str) -> onnx.GraphProto:
        """Subgraph attribute ``name`` (the body of If, Loop, Scan)."""
        a = self._attrs.get(name)
        if a is None or a.type != onnx.AttributeProto.GRAPH:
            raise self.invalid(f"required subgraph attribute {name!r} is missing")
        return a.g

    def subgraph(self, graph: onnx.GraphProto, bindings: list[Tensor], scope: str) -> list[Tensor]:
        """Import ``graph`` inline with its inputs bound to ``bindings``; its outputs. The ops it
        adds are named ``<this node>/<scope>/<their name>``."""
        return self._importer.import_subgraph(graph, bindings, f"{self.name}/{scope}/")

    def cast(self, t: Tensor, dtype: str) -> Tensor:
        """``t`` converted to ``dtype`` by an ONNX ``Cast`` (``t`` itself when it has that type)."""
        return t if t.dtype == dtype else self.emit("Cast", [t], 13, to=_CODES[dtype])

    def emit(self, op_type: str, inputs: list[Tensor], opset: int, **attrs) -> Tensor:
        """Import one ``op_type`` node of ``opset`` (another handler's work) reading ``inputs``."""
        return self._importer.emit(op_type, inputs, opset, self.name, **attrs)

    def tensor_value(self, proto: onnx.TensorProto) -> np.ndarray:
        onnx_dtype(proto.data_type, f"node {self.name}")
        try:
            return numpy_helper.to_array(proto).copy()
        except Exception as exc:
            raise self.invalid(f"tensor attribute cannot be decoded ({exc})") from None

    # building -------------------------------------------------------------------------
    def add(self, op: Operator) -> Tensor:
        """Add ``op`` to the graph and return its first output (``op.outputs`` has all)."""
        self._importer.add_op(op)
        self.created.append(op)
        return op.outputs[0]

    def constant(self, value: np.ndarray | Any, dtype: str | None = None) -> Tensor:
        """A new constant tensor."""
        arr = np.asarray(value, dtype=dtype)
        return const_tensor(arr, self._importer.fresh_name(f"{self.name}/const"))
