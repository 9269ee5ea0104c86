"""ONNX → FlowGraph import.

The importer walks the ONNX graph in order and calls one handler per node (see
:mod:`.registry`). Values known at import time (initializers, ``Shape`` of static tensors and the
arithmetic on them) are propagated eagerly: an op whose inputs all have values gets output
values too, so handlers can read shape arguments with ``ctx.const``. The nodes themselves stay in
the graph; the constant-folding pass removes them.
"""
from __future__ import annotations

import itertools
import logging
import mmap
import os
from typing import Mapping, Sequence

import numpy as np
import onnx
import onnx.inliner
import onnx.shape_inference

from shardflow.runtime.errors import ADDRESSABLE_BYTES, format_bytes

from ..errors import (DtypeError, MemoryLimitError, ModelFormatError, ShapeError, ShardflowError,
                      UnsupportedOperatorError)
from ..ir.graph import RNG_STEP, RNG_STEP_NEXT, FlowGraph, Operator, Tensor, const_tensor
from ..ops.elementwise import Binary, Identity
from ..ir.expr import dtype_kind, numpy_type
from .external_data import initializer_array, resolve_external_data
from .wire import split_weights
from .qdq import FOUR_BIT
from .registry import (EMPTY_OPTIONAL_READERS, SEQUENCE_READERS, EmptyOptional, NodeContext, TensorSeq, find_handler,
                       onnx_dtype, sequence_item)

__all__ = ["import_onnx", "read_model"]

log = logging.getLogger(__name__)

#: Largest result (elements) computed eagerly at import; bigger ones stay ops.
EAGER_LIMIT = 1 << 24
#: Most nodes imported from control-flow bodies (unrolled loops) in one model.
MAX_INLINED_NODES = 200_000
_SUPPORTED_DOMAINS = ("", "ai.onnx")


def read_model(model: "str | os.PathLike | bytes | onnx.ModelProto") -> onnx.ModelProto:
    """Load and check an ONNX model, raising :class:`ModelFormatError` on any defect."""
    if isinstance(model, onnx.ModelProto):
        proto = model
        where = "the given ModelProto"
    elif isinstance(model, (bytes, bytearray)):
        where = "the given bytes"
        proto = _parse(bytes(model), where)
    elif isinstance(model, (str, os.PathLike)):
        where = os.fspath(model)
        if not os.path.isfile(where):
            raise ModelFormatError(f"{where}: no such file")
        proto = _parse_file(where)
        # external weights stay in their files, mapped when the importer decodes them
        resolve_external_data(proto, os.path.dirname(os.path.abspath(where)), where)
    else:
        raise ModelFormatError(f"expected a path, bytes or onnx.ModelProto, got {type(model).__name__}")
    if not proto.graph.node and not proto.graph.output:
        raise ModelFormatError(f"{where}: not an ONNX model (no graph); is this the right file?")
    try:
        onnx.checker.check_model(_without_weights(_ort_default_domain_ops_moved(proto)))
    except Exception as exc:
        msg = str(exc).strip().splitlines()
        raise ModelFormatError(f"{where}: fails onnx.checker: {' '.join(msg)[:800]}; fix or re-export the model") \
            from None
    return proto


def _without_weights(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto``'s structure for onnx's checker: a copy in which the main graph's initializers
    are graph inputs of their types and shapes, without their bytes. The checker validates the
    nodes against their schemas and the graph's names and types; on the weights it spent most of
    its time (2.4 of 3.3 s importing GPT-2 small, 650 MB: it re-read them), and the importer
    decodes each weight itself (:meth:`Importer._initializers`, a typed error naming it)."""
    if not proto.graph.initializer:
        return proto
    copy = onnx.ModelProto()
    _copy_fields(proto, copy, skip="graph")
    _copy_fields(proto.graph, copy.graph, skip="initializer")
    declared = {i.name for i in proto.graph.input}
    for t in proto.graph.initializer:
        if t.name not in declared:
            declared.add(t.name)
            copy.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return copy


def _copy_fields(src, dst, skip: str) -> None:
    """Every field of the protobuf message ``src`` set in ``dst`` but ``skip``."""
    for field, value in src.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):  # (a repeated field)
            getattr(dst, field.name).extend(value)
        elif field.message_type is not None:
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


#: Operators onnxruntime registers in the default domain although ONNX does not define them (its
#: optimizer writes them there; handlers_contrib.py imports them).
ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})


def _ort_default_domain_ops_moved(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` itself, or, where it has default-domain nodes of :data:`ORT_DEFAULT_DOMAIN_OPS`, a copy
    with those nodes in onnxruntime's domain, which the checker then leaves to their runtime."""
    if not any(n.op_type in ORT_DEFAULT_DOMAIN_OPS and n.domain in ("", "ai.onnx") for n in _all_nodes(proto.graph)):
        return proto
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for n in _all_nodes(copy.graph):
        if n.op_type in ORT_DEFAULT_DOMAIN_OPS and n.domain in ("", "ai.onnx"):
            n.domain = "com.microsoft"
    if not any(o.domain == "com.microsoft" for o in copy.opset_import):
        copy.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return copy


def _parse_file(where: str) -> onnx.ModelProto:
    """Parse the file ``where`` from a read-only mapping of it: protobuf copies what it keeps, so
    the file's bytes are not also held in a bytes object while it parses (650 MB for GPT-2 small,
    and 0.4 s of copying), and the large initializers' bytes are left in the file, to be mapped
    (:func:`~.wire.split_weights`)."""
    try:
        with open(where, "rb") as f:
            try:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (ValueError, OSError):  # (an empty file, or one that cannot be mapped)
                return _parse(f.read(), where)
    except OSError as exc:
        raise ModelFormatError(f"{where}: cannot read ({exc.strerror})") from None
    with mapped, memoryview(mapped) as view:
        split = split_weights(view)
        if split is None:
            return _parse(view, where)
        small, weights = split
    # the large initializers' bytes stay in the file: external data of the file itself, which
    # read_model checks and the importer maps like a side file's (frontend/wire.py)
    proto = _parse(small, where)
    location = os.path.basename(where)
    for t in proto.graph.initializer:
        if t.name in weights and not t.HasField("raw_data"):
            offset, length = weights[t.name]
            t.data_location = onnx.TensorProto.EXTERNAL
            del t.external_data[:]
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
    return proto


def _parse(data: bytes | memoryview, where: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as exc:
        raise ModelFormatError(f"{where}: not a valid ONNX protobuf ({type(exc).__name__}); the file may be "
                               "truncated or not an ONNX model") from None
    return proto


class _Importer:
    def __init__(self, proto: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]] | None,
                 input_values: Mapping[str, object] | None = None, routed_experts: bool = False,
                 dim_sizes: Mapping[str, int] | None = None):
        self.proto = proto
        self.opset = _default_opset(proto)
        self.input_shapes = dict(input_shapes or {})
        self.input_values = dict(input_values or {})
        self.dim_sizes = dict(dim_sizes or {})
        self.nodes: list[Operator] = []
        self.env: dict[str, Tensor] = {}
        self._counter = itertools.count()
        self._used_names: set[str] = set()
        #: prefix of the names of ops imported from a subgraph (``"loop/iter3/"``); see import_subgraph
        self.scope = ""
        self._graph_input_ids: dict[int, str] = {}
        self._inlined_nodes = 0
        #: initializers of ONNX's 4-bit types, held as int8/uint8 values: their type, by tensor id
        self.four_bit: dict[int, str] = {}
        #: every MoE on its chosen experts only (import_onnx's routed_experts)
        self.routed_experts = routed_experts
        #: the random ops' step input (:meth:`rng_step`), made by the first of them
        self._rng_step: Tensor | None = None

    def rng_step(self) -> Tensor:
        """The graph input ``RNG_STEP`` (int64, 0-d) that the random ops read (ops/random.py): which
        run of the program this is. Made on first use; :meth:`run` adds it to the graph's inputs
        and its successor to the outputs as ``RNG_STEP_NEXT`` (``compile`` keeps the pair as state)."""
        if self._rng_step is None:
            if RNG_STEP in self._used_names or RNG_STEP in self.env:
                raise ModelFormatError(f"the model names a tensor {RNG_STEP!r}, the name Shardflow gives the random "
                                       "ops' step input; rename it")
            self._rng_step = Tensor(RNG_STEP, (), "int64")
            self._used_names.add(RNG_STEP)
        return self._rng_step

    def fresh_name(self, base: str) -> str:
        while True:
            name = f"{base}{next(self._counter)}"
            if name not in self._used_names:
                self._used_names.add(name)
                return name

    def add_op(self, op: Operator) -> None:
        self.nodes.append(op)
        if all(t.value is not None for t in op.inputs) and sum(t.size for t in op.outputs) <= EAGER_LIMIT:
            for t, v in zip(op.outputs, op.run(*[t.value for t in op.inputs])):
                t.value = v

    def run(self) -> FlowGraph:
        g = self.proto.graph
        self._check_supported()
        self._initializers(g)
        inputs = self._graph_inputs()
        for node in g.node:
            self._import_node(node)
        outputs, names = [], []
        for vi in g.output:
            if vi.name not in self.env:
                raise ModelFormatError(f"graph output {vi.name!r} is not produced by any node")
            if isinstance(self.env[vi.name], TensorSeq):
                self._sequence_output(vi.name, self.env[vi.name], outputs, names)
                continue
            if isinstance(self.env[vi.name], EmptyOptional):
                raise UnsupportedOperatorError(f"graph output {vi.name!r} is an empty optional (from "
                                               f"{self.env[vi.name].name!r}): a compiled program returns tensors, "
                                               "and this output would hold none")
            self._check_output_type(vi, self.env[vi.name])
            outputs.append(self.env[vi.name])
            names.append(vi.name)
        if self._rng_step is not None:
            if RNG_STEP_NEXT in names:
                raise ModelFormatError(f"the model has an output {RNG_STEP_NEXT!r}, the name Shardflow gives the "
                                       "random ops' next step; rename it")
            one = const_tensor(np.array(1, np.int64), self.fresh_name("rng_step/one"))
            step_next = Binary([self._rng_step, one], name=RNG_STEP_NEXT, fn="add")
            self.nodes.append(step_next)
            inputs.append(self._rng_step)
            outputs.append(step_next.outputs[0])
            names.append(RNG_STEP_NEXT)
        return FlowGraph(inputs, outputs, self.nodes, names, name=g.name or "graph")

    def _sequence_output(self, name: str, seq: TensorSeq, outputs: list[Tensor], names: list[str]) -> None:
        """A graph output that is a sequence (a scripted module returning a list): one output per item,
        ``name[0]``, ``name[1]``, ... (its length is known at import, as every shape is; an empty
        sequence gives none). Each is an ``Identity`` of the item, named after the output, as the Identity
        handler makes (the passes bypass it as any other: an item returned twice, or a graph input returned,
        is then one tensor under two output names, which the pipeline handles)."""
        log.info("graph output %r is a sequence of %d tensors: returned as the outputs %s", name, len(seq.items),
                 ", ".join(sequence_item(name, k) for k in range(len(seq.items))) or "(none)")
        graph_names = {vi.name for vi in self.proto.graph.output}
        for k, t in enumerate(seq.items):
            item = sequence_item(name, k)
            if item in graph_names:
                raise ModelFormatError(f"graph output {name!r} is a sequence, whose items are returned as "
                                       f"{name}[0], {name}[1], ...; but the model has an output named {item!r} too")
            op = Identity([t], name=item)
            op.outputs[0].name = item if item not in self._used_names else self.fresh_name(item + "_")
            self._used_names.add(op.outputs[0].name)
            self.add_op(op)
            outputs.append(op.outputs[0])
            names.append(item)

    def _check_output_type(self, vi: onnx.ValueInfoProto, t: Tensor) -> None:
        """A graph output declared with an element type other than the one its node computes is a
        broken model (onnxruntime refuses it): :class:`DtypeError` rather than returning another type."""
        tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if tt is None or tt.elem_type == onnx.TensorProto.UNDEFINED:
            return
        declared = onnx_dtype(tt.elem_type, f"graph output {vi.name!r}")
        if declared != t.dtype:
            raise DtypeError(f"graph output {vi.name!r} is declared {declared}, but the node producing it computes "
                             f"{t.dtype}; correct the output's type in the model")

    def _initializers(self, g: onnx.GraphProto) -> None:
        for init in g.initializer:
            try:
                arr = initializer_array(init)
            except ShardflowError:
                raise
            except Exception as exc:
                raise ModelFormatError(f"initializer {init.name!r} cannot be decoded ({exc})") from None
            four = FOUR_BIT.get(init.data_type)
            if four:  # the values, one per int8/uint8 (the only ops defined on these types read values)
                arr = np.asarray(arr).astype(np.int8 if four == "int4" else np.uint8)
            else:
                onnx_dtype(init.data_type, f"initializer {init.name!r}")
            # not ascontiguousarray: it would turn a 0-d (scalar) initializer into shape (1,)
            name = init.name if init.name not in self._used_names else self.fresh_name(init.name + "_")
            self.env[init.name] = const_tensor(np.asarray(arr, order="C"), name)
            self._used_names.add(name)
            if four:
                self.four_bit[id(self.env[init.name])] = four

    def input_dependencies(self, t: Tensor) -> list[str]:
        """The graph inputs whose values ``t`` depends on (for errors asking to bind them)."""
        producer = {id(o): op for op in self.nodes for o in op.outputs}
        found, seen, todo = set(), set(), [t]
        while todo:
            u = todo.pop()
            if id(u) in seen:
                continue
            seen.add(id(u))
            if id(u) in self._graph_input_ids:
                found.add(self._graph_input_ids[id(u)])
            elif id(u) in producer:
                todo.extend(x for x in producer[id(u)].inputs if x.value is None)
        return sorted(found)

    # subgraphs (If, Loop, Scan: handlers_control) --------------------------------------------
    def import_subgraph(self, graph: onnx.GraphProto, bindings: Sequence[Tensor], scope: str) -> list[Tensor]:
        """Import the nodes of ``graph`` (a control-flow body) inline, its formal inputs bound to
        ``bindings``, and return its outputs. Names of the enclosing scopes stay visible in the
        body and the body's names do not leak out; the ops it adds are named ``scope + name``
        (``scope`` is the full prefix, e.g. ``"loop/iter3/"``)."""
        if len(bindings) != len(graph.input):
            raise ModelFormatError(f"{scope.rstrip('/')}: the body takes {len(graph.input)} inputs, "
                                   f"{len(bindings)} given")
        saved_env, saved_scope = self.env, self.scope
        self.env, self.scope = dict(saved_env), scope
        try:
            self._initializers(graph)
            for vi, t in zip(graph.input, bindings):
                self.env[vi.name] = t
            for node in graph.node:
                self._inlined_nodes += 1
                if self._inlined_nodes > MAX_INLINED_NODES:
                    raise UnsupportedOperatorError(
                        f"{self.scope.rstrip('/')}: unrolling the model's loops would import more than "
                        f"{MAX_INLINED_NODES} nodes; loops that long are not supported")
                self._import_node(node)
            outs = []
            for vi in graph.output:
                if vi.name not in self.env:
                    raise ModelFormatError(f"{self.scope.rstrip('/')}: body output {vi.name!r} is not produced "
                                           "by any node")
                outs.append(self.env[vi.name])
            return outs
        finally:
            self.env, self.scope = saved_env, saved_scope

    def emit(self, op_type: str, inputs: Sequence[Tensor], opset: int, base: str, **attrs) -> Tensor:
        """Import one ONNX node ``op_type`` of ``opset`` reading ``inputs``, named ``base/<op_type><k>``:
        a handler's way to reuse other handlers (a slice, a concatenation). Returns its output."""
        key = self.fresh_name(f"{base}/{op_type}")
        names = [f"{key}:in{k}" for k in range(len(inputs))]
        self.env.update(zip(names, inputs))
        node = onnx.helper.make_node(op_type, names, [key], name=key, **attrs)
        saved_scope, self.scope = self.scope, ""  # the name is complete already
        try:
            self._import_node(node, opset=opset)
            return self.env.pop(key)
        finally:
            self.scope = saved_scope
            for n in names:
                self.env.pop(n, None)

    def _check_supported(self) -> None:
        missing: dict[str, list[str]] = {}
        for n in _all_nodes(self.proto.graph):
            domain = "" if n.domain in _SUPPORTED_DOMAINS else n.domain
            opset = self.opset if not domain else _domain_opset(self.proto, domain)
            if find_handler(domain, n.op_type, opset) is None:
                key = f"{n.domain}::{n.op_type}" if domain else n.op_type
                if find_handler(domain, n.op_type, 10_000) or _any_handler(domain, n.op_type):
                    key = f"{key} (opset {opset})"
                missing.setdefault(key, []).append(n.name or f"<{n.op_type} producing {list(n.output)}>")
        if missing:
            parts = [f"{op} used by {len(ns)} node(s): {', '.join(ns[:5])}{' ...' if len(ns) > 5 else ''}"
                     for op, ns in sorted(missing.items())]
            raise UnsupportedOperatorError(
                "the model uses operators Shardflow does not support: " + "; ".join(parts)
                + ". See shardflow.compiler.supported_ops() for the supported set.", missing)

    def _graph_inputs(self) -> list[Tensor]:
        g = self.proto.graph
        init_names = {i.name for i in g.initializer}
        real = [vi for vi in g.input if vi.name not in init_names]
        names = {vi.name for vi in real}
        for what, given in (("input_shapes", self.input_shapes), ("input_values", self.input_values)):
            unknown = sorted(set(given) - names)
            if unknown:
                raise ShapeError(f"{what} names {unknown}, which are not inputs of the model; "
                                 f"its inputs are {sorted(names)}")
        both = sorted(set(self.input_shapes) & set(self.input_values))
        if both:
            raise ShapeError(f"inputs {both} are in both input_shapes and input_values; a bound input's shape is "
                             "its value's, so give it in input_values only")
        res, missing = [], []
        named = self._named_dims(real)
        for vi in real:
            if vi.name in self.input_values and self.input_values[vi.name] is None:
                if not vi.type.HasField("optional_type"):
                    raise ShapeError(f"input_values[{vi.name!r}] is None, but only an optional input can be bound "
                                     "to None (empty); give an array")
                log.info("graph input %r bound at import to an empty optional", vi.name)
                self.env[vi.name] = EmptyOptional(vi.name)
                self._used_names.add(vi.name)
                continue
            tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
            if vi.type.HasField("optional_type") and vi.type.optional_type.elem_type.HasField("tensor_type"):
                # an optional tensor is compiled as present: the program takes the tensor (no way to pass none)
                tt = vi.type.optional_type.elem_type.tensor_type
                log.info("graph input %r is an optional tensor: compiled as present", vi.name)
            seq = vi.type.sequence_type if vi.type.HasField("sequence_type") else None
            if vi.type.HasField("optional_type") and vi.type.optional_type.elem_type.HasField("sequence_type"):
                seq = vi.type.optional_type.elem_type.sequence_type  # (compiled as present, as a tensor's)
                log.info("graph input %r is an optional sequence: compiled as present", vi.name)
            if tt is None and seq is not None and seq.elem_type.HasField("tensor_type"):
                self._sequence_input(vi.name, seq.elem_type.tensor_type, names, res)
                continue
            if tt is None:
                raise UnsupportedOperatorError(f"graph input {vi.name!r} is not a tensor, an optional tensor or a "
                                               "sequence of tensors (map inputs are not supported)")
            dtype = onnx_dtype(tt.elem_type, f"graph input {vi.name!r}")
            if vi.name in self.input_values:
                self.env[vi.name] = self._bound_input(vi.name, tt, dtype)
                self._used_names.add(vi.name)
                continue
            shape = self._input_shape(vi.name, tt, named)
            if shape is None:
                missing.append((vi.name, self._declared(tt)))
                continue
            t = Tensor(vi.name, shape, dtype)
            _check_addressable(t, f"graph input {vi.name!r}")
            self._graph_input_ids[id(t)] = vi.name
            self.env[vi.name] = t
            self._used_names.add(vi.name)
            res.append(t)
        if missing:
            listed = ", ".join(f"{n!r} {['?' if d is None else d for d in dims]}" for n, dims in missing)
            first = missing[0][0]
            raise ShapeError(f"graph input(s) with dynamic dims and no shape: {listed}; pass their shapes as "
                             f"input_shapes={{{first!r}: (...), ...}} (on the command line --shape {first}=2x128, "
                             "one --shape per input); an input whose dynamic dims all have names (dim_param) takes "
                             "their sizes from the inputs given with dims of those names, or from dim_sizes="
                             "{name: size} (--dim NAME=SIZE)")
        return res

    def _checked_dim_sizes(self, inputs) -> dict[str, int]:
        """``dim_sizes`` checked: each key a ``dim_param`` of a graph input (the error lists them),
        each value a non-negative int."""
        names = sorted({d.dim_param for vi in inputs if vi.type.HasField("tensor_type")
                        for d in vi.type.tensor_type.shape.dim if d.dim_param})
        unknown = sorted(str(n) for n in self.dim_sizes if n not in names)
        if unknown:
            raise ShapeError(f"dim_sizes names {unknown}, which no input of the model has as a named dim; its "
                             f"inputs' named dims are {names}" if names else
                             f"dim_sizes names {unknown}, but no input of the model has named dims (dim_param); "
                             "give the inputs' shapes in input_shapes")
        res = {}
        for name, size in self.dim_sizes.items():
            if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size < 0:
                raise ShapeError(f"dim_sizes[{name!r}] = {size!r} is not a non-negative int")
            res[name] = int(size)
        return res

    def _named_dims(self, inputs) -> dict[str, int]:
        """The sizes of the models' named dynamic dims (``dim_param``): those ``dim_sizes`` gives,
        and those the inputs given in ``input_shapes`` or ``input_values`` fix: ONNX's dims of one
        name are one size, so an input whose dynamic dims all have such names needs no shape of its
        own (``attention_mask``'s ``[batch, sequence]`` from ``input_ids``'). A name the given inputs
        size twice is left out (logged); a given input that contradicts ``dim_sizes`` is an error."""
        fixed = self._checked_dim_sizes(inputs)
        sizes: dict[str, set[int]] = {}
        for vi in inputs:
            if not vi.type.HasField("tensor_type"):
                continue
            declared = self._declared(vi.type.tensor_type)
            if vi.name in self.input_shapes:
                given = self.input_shapes[vi.name]
            elif vi.name in self.input_values:
                given = np.shape(self.input_values[vi.name])
            else:
                continue
            try:
                given = [int(d) for d in given]
            except (TypeError, ValueError):
                continue  # (reported with the input's own shape)
            if declared is None or len(declared) != len(given):
                continue
            for d, (want, got) in enumerate(zip(declared, given)):
                if isinstance(want, str) and want in fixed and got != fixed[want]:
                    what = "input_shapes" if vi.name in self.input_shapes else "input_values"
                    raise ShapeError(f"{what}[{vi.name!r}] has {got} in dim {d}, the model's dim {want!r}, but "
                                     f"dim_sizes[{want!r}] = {fixed[want]}; give one size")
                if isinstance(want, str):
                    sizes.setdefault(want, set()).add(got)
        clash = sorted(n for n, v in sizes.items() if len(v) > 1 and n not in fixed)
        if clash:
            log.warning("the inputs given set the model's dims %s to different sizes (%s); inputs that share "
                        "those dims need their own shapes", clash, {n: sorted(sizes[n]) for n in clash})
        return {**{n: next(iter(v)) for n, v in sizes.items() if len(v) == 1}, **fixed}

    def _sequence_input(self, name: str, tt, names: set[str], res: list[Tensor]) -> None:
        """A graph input that is a sequence of tensors (handlers_sequence): its length is not in the model,
        so its items' shapes are given as a list in ``input_shapes`` (the program takes the items as the
        inputs ``name[0]``, ``name[1]``, ..., appended to ``res``) or its items bound as a list of arrays in
        ``input_values``."""
        dtype = onnx_dtype(tt.elem_type, f"graph input {name!r}'s items")
        how = (f"give its items' shapes as a list, input_shapes={{{name!r}: [(...), ...]}} (on the command line "
               f"--shape {name}=[2x3,4x3]; the program then takes the items as the inputs {name}[0], {name}[1], "
               f"...), or bind them, input_values={{{name!r}: [array, ...]}}")
        bound = name in self.input_values
        given = self.input_values[name] if bound else self.input_shapes.get(name)
        if given is None:
            raise ShapeError(f"graph input {name!r} is a sequence, whose length the model does not fix; {how}")
        what = f"{'input_values' if bound else 'input_shapes'}[{name!r}]"
        if not isinstance(given, (list, tuple)) or not all(
                isinstance(v, np.ndarray) if bound else isinstance(v, (list, tuple)) for v in given):
            raise ShapeError(f"{what} = {given!r}: the input is a sequence; {how}")
        items = []
        for k, v in enumerate(given):
            item = sequence_item(name, k)
            if item in names:
                raise ModelFormatError(f"graph input {name!r} is a sequence, whose items are the inputs {name}[0], "
                                       f"{name}[1], ...; but the model has an input named {item!r} too")
            if bound:
                t = self._bound_input(item, tt, dtype, v, f"{what}[{k}]")
            else:
                t = Tensor(item, self._given_shape(tt, v, f"{what}[{k}]"), dtype)
                _check_addressable(t, f"graph input {name!r}'s item {k}")
                self._graph_input_ids[id(t)] = name
                res.append(t)
            self._used_names.add(item)
            items.append(t)
        log.info("graph input %r is a sequence of %d tensors: %s", name, len(items),
                 "bound at import" if bound else f"taken as the inputs {name}[0], ...")
        self.env[name] = TensorSeq(items, dtype, name)

    def _bound_input(self, name: str, tt, dtype: str, given=None, what: str | None = None) -> Tensor:
        """Graph input ``name`` bound to ``given`` (default ``input_values[name]``, ``what`` in errors): a
        constant of the declared type."""
        what = what or f"input_values[{name!r}]"
        given = self.input_values[name] if given is None else given
        try:
            arr = np.asarray(given)
        except Exception as exc:
            raise ShapeError(f"{what} is not array-like ({type(exc).__name__}: {exc})") from None
        kind = dtype_kind(arr.dtype) if arr.dtype.kind == "V" else arr.dtype.kind
        if kind not in "biuf" or (kind == "b") != (dtype == "bool"):
            raise DtypeError(f"{what} has dtype {arr.dtype}, but the model declares {dtype}")
        if kind == "f" and dtype_kind(dtype) in "iu":
            raise DtypeError(f"{what} holds floats (dtype {arr.dtype}), but the model declares "
                             f"{dtype}; pass integers")
        converted = arr.astype(numpy_type(dtype))
        if arr.dtype.kind in "iu" and not np.array_equal(converted.astype(arr.dtype), arr):
            raise DtypeError(f"{what} does not fit the declared type {dtype}")
        self._check_declared(tt, tuple(arr.shape), f"{what} of shape {tuple(arr.shape)}")
        log.info("graph input %r bound at import to a constant of shape %s", name, list(arr.shape))
        return const_tensor(np.asarray(converted, order="C"), name)

    @staticmethod
    def _declared(tt) -> list | None:
        if not tt.HasField("shape"):
            return None
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]

    def _check_declared(self, tt, shape: tuple[int, ...], label: str) -> None:
        """``shape`` (described by ``label`` in errors) against the input's declared shape."""
        declared = self._declared(tt)
        if declared is None:
            return
        if len(declared) != len(shape):
            raise ShapeError(f"{label} has rank {len(shape)}, but the model declares rank {len(declared)} "
                             f"({declared})")
        for d, (want, got) in enumerate(zip(declared, shape)):
            if isinstance(want, int) and want != got:
                raise ShapeError(f"{label}: dim {d} is fixed to {want} by the model")

    def _given_shape(self, tt, given, what: str) -> tuple[int, ...]:
        """``given`` (``what`` in errors) as a shape, checked against the declared one."""
        try:
            shape = tuple(int(d) for d in given)
        except (TypeError, ValueError):
            raise ShapeError(f"{what} = {given!r} is not a tuple of ints") from None
        if any(d < 0 for d in shape):
            raise ShapeError(f"{what} = {shape} has a negative dim")
        self._check_declared(tt, shape, f"{what} = {shape}")
        return shape

    def _input_shape(self, name: str, tt, named: dict[str, int]) -> tuple[int, ...] | None:
        """The input's shape: given, declared, or its named dynamic dims' sizes from ``named``
        (:meth:`_named_dims`); ``None`` when a dynamic dim has none of these."""
        declared = self._declared(tt)
        if name in self.input_shapes:
            return self._given_shape(tt, self.input_shapes[name], f"input_shapes[{name!r}]")
        if declared is None:
            raise ShapeError(f"graph input {name!r} has no declared shape; pass input_shapes={{{name!r}: (...)}}")
        if any(not isinstance(d, int) for d in declared):
            if not all(isinstance(d, int) or d in named for d in declared):
                return None
            shape = tuple(d if isinstance(d, int) else named[d] for d in declared)
            log.info("graph input %r: shape %s from its named dims %s", name, list(shape), declared)
            return shape
        return tuple(declared)

    def _import_node(self, node: onnx.NodeProto, opset: int | None = None) -> None:
        domain = "" if node.domain in _SUPPORTED_DOMAINS else node.domain
        if opset is None:
            opset = self.opset if not domain else _domain_opset(self.proto, domain)
        handler = find_handler(domain, node.op_type, opset)
        inputs: list[Tensor | None] = []
        for name in node.input:
            if name == "":
                inputs.append(None)
            elif name in self.env:
                inputs.append(self.env[name])
            else:
                raise ModelFormatError(f"node {node.name or node.op_type} reads {name!r}, which no earlier node "
                                       "produces (the nodes are not in topological order or an input is missing)")
        ctx = NodeContext(node, opset, inputs, self)
        for k, t in enumerate(inputs):
            if isinstance(t, TensorSeq) and node.op_type not in SEQUENCE_READERS:
                raise ctx.unsupported(f"input {k} ({node.input[k]!r}), a sequence (the sequence ops, Identity, "
                                      "Loop and the Optional ops read sequences; take a tensor out with "
                                      "SequenceAt or ConcatFromSequence)")
            if isinstance(t, EmptyOptional) and node.op_type not in EMPTY_OPTIONAL_READERS:
                raise ctx.unsupported(f"input {k} ({node.input[k]!r}), an empty optional (from {t.name!r}; "
                                      "OptionalHasElement, OptionalGetElement and Identity read optionals)")
        try:
            outs = handler.fn(ctx)
        except ShardflowError:
            raise
        except RecursionError:
            raise
        except Exception as exc:  # malformed attributes or shapes surface here as numpy/python errors
            log.debug("handler for %s failed", ctx.name, exc_info=True)
            raise ModelFormatError(f"node {ctx.name} ({node.op_type}) cannot be imported: "
                                   f"{type(exc).__name__}: {exc}") from exc
        created = {id(t) for op in ctx.created for t in op.outputs}
        for name, t in zip(node.output, outs):
            if not name or t is None:
                continue
            if id(t) in created:  # ONNX names are unique per graph, not across unrolled loop bodies
                t.name = name if name not in self._used_names else self.fresh_name(name + "_")
            self._used_names.add(t.name)
            self.env[name] = t
        for op in ctx.created:  # (after the outputs took their names)
            for t in op.outputs:
                _check_addressable(t, f"node {ctx.name} ({node.op_type})")
        for name in node.output[len(outs):]:
            if name:
                raise ctx.unsupported(f"output {name!r}")


def _check_addressable(t: Tensor, where: str) -> None:
    """Raise :class:`MemoryLimitError` if tensor ``t`` (made by ``where``) is larger than a process can address:
    no machine could hold it, so its shape comes from inputs sized wrongly (or values bound so)."""
    nbytes = t.nbytes
    if nbytes > ADDRESSABLE_BYTES:
        raise MemoryLimitError(f"{where} makes {t.name!r} of shape {list(t.shape)} ({t.dtype}): "
                               f"{format_bytes(nbytes)}, more than a process can address "
                               f"({format_bytes(ADDRESSABLE_BYTES)}); check the input shapes and bound values "
                               "(input_shapes, dim_sizes, input_values) it follows from")


def _all_nodes(graph: onnx.GraphProto):
    """The nodes of ``graph`` and, recursively, of the subgraphs in their attributes."""
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _all_nodes(g)


def _default_opset(proto: onnx.ModelProto) -> int:
    """The model's default-domain opset. A model that imports none (its nodes all of other
    domains, e.g. the training optimizers') gets the newest the onnx package knows: only the
    default-domain nodes that handlers compose, each at an opset of its own, use it then."""
    for imp in proto.opset_import:
        if imp.domain in _SUPPORTED_DOMAINS:
            return int(imp.version)
    if any(n.domain in _SUPPORTED_DOMAINS for n in _all_nodes(proto.graph)):
        raise ModelFormatError("the model imports no version of the default ONNX operator set but uses its "
                               "operators")
    return int(onnx.defs.onnx_opset_version())


def _domain_opset(proto: onnx.ModelProto, domain: str) -> int:
    for imp in proto.opset_import:
        if imp.domain == domain:
            return int(imp.version)
    return 1


def _any_handler(domain: str, op_type: str) -> bool:
    return find_handler(domain, op_type, 10_000) is not None or find_handler(domain, op_type, 1) is not None


#: Domain under which ops are expanded into the function bodies of their ONNX schemas.
_EXPANDED_DOMAIN = "ai.shardflow.expanded"


def inline_functions(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with its model-local functions inlined, and with every node of an op that has no
    handler here but that the ONNX schema defines as a function of other ops (e.g.
    ``DynamicQuantizeLinear``) replaced by that body, converted to the model's opset. Returns
    ``proto`` itself when there is nothing to inline."""
    opset = _default_opset(proto)
    bodies: dict[str, onnx.FunctionProto] = {}
    for n in _all_nodes(proto.graph):
        if n.domain not in _SUPPORTED_DOMAINS or n.op_type in bodies or find_handler("", n.op_type, opset):
            continue
        try:
            schema = onnx.defs.get_schema(n.op_type, opset, "")
        except onnx.defs.SchemaError:
            continue
        if schema.has_function:
            bodies[n.op_type] = schema.function_body
    if not proto.functions and not bodies:
        return proto
    if bodies:
        log.info("expanding %s into their ONNX function bodies", sorted(bodies))
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)  # the caller's proto stays as it was
        proto = copy
        for n in _all_nodes(proto.graph):
            if n.domain in _SUPPORTED_DOMAINS and n.op_type in bodies:
                n.domain = _EXPANDED_DOMAIN
        for op, body in bodies.items():
            f = proto.functions.add()
            f.CopyFrom(body)
            f.domain, f.name = _EXPANDED_DOMAIN, op
        proto.opset_import.append(onnx.helper.make_opsetid(_EXPANDED_DOMAIN, 1))
    try:
        return onnx.inliner.inline_local_functions(proto, convert_version=True)
    except Exception as exc:
        first = exc
    # Converting a body written for another opset (DynamicQuantizeLinear's is opset 11) needs the
    # types of the values at each call, which a model need not declare (onnxruntime's
    # quantize_dynamic declares none): infer them, inline, and keep only the value_info the model had.
    try:
        typed = onnx.shape_inference.infer_shapes(proto)
        declared = {v.name for v in proto.graph.value_info}
        out = onnx.inliner.inline_local_functions(typed, convert_version=True)
    except Exception:
        raise ModelFormatError(f"the model's functions cannot be inlined ({type(first).__name__}: {first})") from None
    kept = [v for v in out.graph.value_info if v.name in declared]
    del out.graph.value_info[:]
    out.graph.value_info.extend(kept)
    return out


def import_onnx(model, input_shapes: Mapping[str, Sequence[int]] | None = None,
                input_values: Mapping[str, object] | None = None, int8_qdq: bool = False,
                routed_experts: bool = False, dim_sizes: Mapping[str, int] | None = None) -> FlowGraph:
    """Import an ONNX model (path, bytes or ModelProto) into an unsimplified FlowGraph.

    Model-local functions are inlined first (:func:`inline_functions`) and quantize/dequantize
    round trips with one scale dropped (:func:`~shardflow.compiler.frontend.qdq.drop_requantizations`,
    exact), and MatMuls of blockwise-dequantized 4-bit weights become ``MatMulNBits`` on the packed
    codes (:func:`~shardflow.compiler.frontend.qdq.four_bit_matmuls`). ``input_values`` binds
    graph inputs to constants (they leave the graph's inputs); ``int8_qdq`` rewrites QDQ MatMuls
    into integer products (:func:`~shardflow.compiler.frontend.qdq.fuse_qdq_matmuls`);
    ``routed_experts`` computes every ``MoE`` on the chosen experts only; ``dim_sizes`` sizes named
    dynamic dims; see :func:`shardflow.compiler.load_onnx`.
    """
    from .qdq import drop_requantizations, four_bit_matmuls, fuse_qdq_matmuls

    proto = four_bit_matmuls(drop_requantizations(inline_functions(read_model(model))))
    if int8_qdq:
        proto = fuse_qdq_matmuls(proto)
    return _Importer(proto, input_shapes, input_values, routed_experts, dim_sizes).run()
