"""Handlers for ONNX sequences inside a graph: ``SequenceEmpty``, ``SequenceConstruct``,
``SequenceInsert``, ``SequenceErase``, ``SequenceAt``, ``SequenceLength``, ``SplitToSequence``,
``ConcatFromSequence`` and ``SequenceMap``, resolved at import.

A compiled program is a static graph, and control flow is unrolled at import (handlers_control), so
every sequence has a length and every position a value known at import: a sequence is a
:class:`~.registry.TensorSeq`, a list of the graph's tensors, and the sequence ops only build and
read that list. What reaches the flow graph are the ops of its tensors: the slices of a
``SplitToSequence``, the concatenation of a ``ConcatFromSequence``, the body of a ``SequenceMap``
imported once per element. A sequence passes through ``Identity`` and a ``Loop``'s carried values,
so a loop that appends to a list and concatenates it afterwards imports; a sequence returned as a
graph output is returned item by item, as the outputs ``name[0]``, ``name[1]``, ..., and a sequence
graph input is taken item by item, as the inputs ``name[0]``, ``name[1]``, ..., whose shapes are given
as a list (``input_shapes={name: [shape, ...]}``) or whose values are bound (``input_values={name:
[array, ...]}``) (``onnx_importer``). A position computed from graph inputs is refused (bind those
inputs with ``input_values``).
"""
from __future__ import annotations

import numpy as np

from ..ir.graph import Tensor
from ..ops.elementwise import Identity
from .registry import NodeContext, TensorSeq, onnx_dtype, onnx_op

#: The opset of the helper nodes (slices, concatenations) the handlers import.
_HELPER_OPSET = 13


def _seq(ctx: NodeContext, i: int) -> TensorSeq:
    """Input ``i``, which must be a sequence."""
    s = ctx.input(i)
    if not isinstance(s, TensorSeq):
        raise ctx.invalid(f"input {i} ({ctx.node.input[i]!r}) must be a sequence, got a tensor")
    return s


def _tensor(ctx: NodeContext, i: int) -> Tensor:
    t = ctx.input(i)
    if isinstance(t, TensorSeq):
        raise ctx.invalid(f"input {i} ({ctx.node.input[i]!r}) must be a tensor, got a sequence")
    return t


def _position(ctx: NodeContext, i: int, n: int, default: int, last: int) -> int:
    """Input ``i`` (a position, known at import; ``default`` when absent) in ``[-n, last]``, made
    non-negative."""
    if not ctx.has_input(i):
        return default
    v = np.asarray(ctx.const(i))
    if v.size != 1 or v.dtype.kind not in "iu":
        raise ctx.invalid(f"the position must be one integer, got {v.dtype} of shape {list(v.shape)}")
    p = int(v.reshape(()))
    if not -n <= p <= last:
        raise ctx.shape_error(f"position {p} is outside [{-n}, {last}] for a sequence of {n} tensors")
    return p + n if p < 0 else p


def _new(ctx: NodeContext, items: list[Tensor], dtype: str) -> TensorSeq:
    return TensorSeq(items, dtype, ctx.name)


@onnx_op("SequenceEmpty", since=11)
def sequence_empty(ctx):
    code = ctx.attr("dtype", 1)  # (FLOAT by default)
    return [_new(ctx, [], onnx_dtype(code, f"node {ctx.name}"))]


@onnx_op("SequenceConstruct", since=11)
def sequence_construct(ctx):
    items = [_tensor(ctx, k) for k in range(ctx.num_inputs)]
    if not items:
        raise ctx.invalid("no input (SequenceEmpty makes an empty sequence)")
    types = sorted({t.dtype for t in items})
    if len(types) > 1:
        raise ctx.invalid(f"the inputs have different element types {types}; a sequence holds one")
    return [_new(ctx, items, types[0])]


@onnx_op("SequenceInsert", since=11)
def sequence_insert(ctx):
    s, t = _seq(ctx, 0), _tensor(ctx, 1)
    if t.dtype != s.dtype:
        raise ctx.invalid(f"a {t.dtype} tensor inserted into a sequence of {s.dtype}")
    n = len(s.items)
    at = _position(ctx, 2, n, n, n)
    return [_new(ctx, s.items[:at] + [t] + s.items[at:], s.dtype)]


@onnx_op("SequenceErase", since=11)
def sequence_erase(ctx):
    s = _seq(ctx, 0)
    n = len(s.items)
    if n == 0:
        raise ctx.shape_error("erasing from an empty sequence")
    at = _position(ctx, 1, n, n - 1, n - 1)
    return [_new(ctx, s.items[:at] + s.items[at + 1:], s.dtype)]


@onnx_op("SequenceAt", since=11)
def sequence_at(ctx):
    s = _seq(ctx, 0)
    n = len(s.items)
    if not ctx.has_input(1):
        raise ctx.invalid("input 1 (the position) is required but missing")
    # (an Identity, as the Identity and OptionalGetElement handlers make: an output named after the node,
    # which the passes bypass as any Identity)
    return [ctx.add(Identity([s.items[_position(ctx, 1, n, 0, n - 1)]], name=ctx.name))]


@onnx_op("SequenceLength", since=11)
def sequence_length(ctx):
    return [ctx.constant(np.array(len(_seq(ctx, 0).items), np.int64))]


@onnx_op("SplitToSequence", since=11)
def split_to_sequence(ctx):
    x = _tensor(ctx, 0)
    if x.ndim == 0:
        raise ctx.invalid("the input is a scalar: there is no axis to split")
    axis = int(ctx.attr("axis", 0))
    if not -x.ndim <= axis < x.ndim:
        raise ctx.invalid(f"axis {axis} is out of range for an input of rank {x.ndim}")
    axis %= x.ndim
    extent = x.shape[axis]
    squeeze = False
    if ctx.has_input(1):
        split = np.asarray(ctx.const(1))
        if split.dtype.kind not in "iu" or split.ndim > 1:
            raise ctx.invalid(f"split must be an integer scalar or 1-D tensor, got {split.dtype} of shape "
                              f"{list(split.shape)}")
        if (split < 0).any():
            raise ctx.invalid(f"split {split.tolist()} has a negative length")
        if split.ndim == 0:
            step = int(split)
            if step == 0:
                raise ctx.invalid("a split length of 0 (chunks of no element)")
            sizes = [min(step, extent - s) for s in range(0, extent, step)]
        else:
            sizes = [int(v) for v in split]
            if sum(sizes) != extent:
                raise ctx.shape_error(f"split {sizes} sums to {sum(sizes)}, not to the axis's {extent}")
    else:  # chunks of one, the axis dropped unless keepdims
        sizes = [1] * extent
        squeeze = not ctx.flag("keepdims", 1)
    items, start = [], 0
    axes = ctx.constant(np.array([axis], np.int64))
    for size in sizes:
        bounds = [ctx.constant(np.array([v], np.int64)) for v in (start, start + size)]
        part = ctx.emit("Slice", [x, bounds[0], bounds[1], axes], _HELPER_OPSET)
        items.append(ctx.emit("Squeeze", [part, axes], _HELPER_OPSET) if squeeze else part)
        start += size
    return [_new(ctx, items, x.dtype)]


@onnx_op("ConcatFromSequence", since=11)
def concat_from_sequence(ctx):
    s = _seq(ctx, 0)
    if not s.items:
        raise ctx.unsupported("an empty sequence (its concatenation's shape is not defined)")
    axis = int(ctx.attr("axis"))
    new_axis = ctx.flag("new_axis", 0)
    rank = s.items[0].ndim + new_axis
    if not -rank <= axis < rank:
        raise ctx.invalid(f"axis {axis} is out of range for {'new_axis=1 on ' if new_axis else ''}tensors of "
                          f"rank {s.items[0].ndim}")
    axis %= rank
    items = s.items
    if new_axis:
        axes = ctx.constant(np.array([axis], np.int64))
        items = [ctx.emit("Unsqueeze", [t, axes], _HELPER_OPSET) for t in items]
    return [ctx.emit("Concat", items, _HELPER_OPSET, axis=axis)]


@onnx_op("SequenceMap", since=17)
def sequence_map(ctx):
    """The body once per element of the first input: each sequence input binds its element at that
    position, each tensor input itself; each body output gathered into an output sequence."""
    body = ctx.graph_attr("body")
    inputs = [ctx.input(k) for k in range(ctx.num_inputs)]
    first = _seq(ctx, 0)
    n = len(first.items)
    for k, v in enumerate(inputs):
        if isinstance(v, TensorSeq) and len(v.items) != n:
            raise ctx.shape_error(f"input {k} is a sequence of {len(v.items)} tensors, the first of {n}")
    if len(body.input) != len(inputs):
        raise ctx.invalid(f"the body takes {len(body.input)} inputs for the node's {len(inputs)}")
    results: list[list[Tensor]] = [[] for _ in body.output]
    for i in range(n):
        outs = ctx.subgraph(body, [v.items[i] if isinstance(v, TensorSeq) else v for v in inputs], f"iter{i}")
        for k, t in enumerate(outs):
            if isinstance(t, TensorSeq):
                raise ctx.unsupported(f"a body output ({body.output[k].name!r}) that is a sequence")
            results[k].append(t)
    seqs = []
    for k, ts in enumerate(results):
        if ts:
            dtype = ts[0].dtype
        else:  # (no element: the type the body declares)
            tt = body.output[k].type.tensor_type
            dtype = onnx_dtype(tt.elem_type, f"node {ctx.name}'s body output {body.output[k].name!r}")
        if any(t.dtype != dtype for t in ts):
            raise ctx.invalid(f"the body's output {body.output[k].name!r} has different types across elements")
        seqs.append(_new(ctx, ts, dtype))
    return seqs
