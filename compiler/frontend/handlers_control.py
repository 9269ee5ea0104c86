"""Handlers for control flow: ``If``, ``Loop`` and ``Scan``, imported inline.

A compiled Shardflow program is a static graph: shapes, and therefore branches and trip counts,
are fixed at compile time. So control flow is resolved at import:

* ``If`` imports the branch its condition selects. The condition must be known at import (a
  constant, arithmetic on static shapes, or an input bound with ``input_values``).
* ``Loop`` is unrolled: the body is imported once per iteration, with the iteration number as a
  constant. The trip count and the condition must be known at import at every iteration (the
  condition may be computed by the body from the iteration number and other known values).
* ``Scan`` is unrolled over the (static) length of its scan axis.

A body sees the names of its enclosing scopes; its ops are named
``<node>/<branch or iterK>/<op>``, so the sharding plan and the kernels can be traced back to the
iteration. At most :data:`MAX_TRIPS` iterations per node (and
:data:`~.onnx_importer.MAX_INLINED_NODES` imported body nodes per model) are unrolled; longer
loops are refused with an :class:`UnsupportedOperatorError`.
"""
from __future__ import annotations

import numpy as np

from ..ir.graph import Tensor
from .registry import NodeContext, onnx_op

#: Most iterations of one Loop or Scan node that are unrolled.
MAX_TRIPS = 4096

#: The opset of the helper nodes (slices, stacking) the handlers import.
_HELPER_OPSET = 13


def _known(ctx: NodeContext, t: Tensor, what: str, index: int | None = None):
    """The import-time value of ``t`` (input ``index`` of the node, if it is one), or a typed
    error: control flow is resolved at import."""
    if t.value is None and index is not None:
        ctx.const(index)  # raises the error every handler gives for an input it needs to know
    if t.value is None:
        raise ctx.unsupported(f"{what} that depends on the data of graph inputs (control flow is resolved at "
                              "compile time; bind the inputs it depends on with input_values if they are fixed)")
    v = np.asarray(t.value)
    if v.size != 1:
        raise ctx.invalid(f"{what} must hold one value, got shape {list(v.shape)}")
    return v.reshape(()).item()


def _check_trips(ctx: NodeContext, n: int) -> None:
    if n > MAX_TRIPS:
        raise ctx.unsupported(f"{n} iterations (more than {MAX_TRIPS} are not unrolled)")


def _take(ctx: NodeContext, x: Tensor, index: int, axis: int) -> Tensor:
    """``x`` at ``index`` along ``axis``, that axis removed."""
    return ctx.emit("Gather", [x, ctx.constant(np.array(index, np.int64))], _HELPER_OPSET, axis=axis)


def _stack(ctx: NodeContext, ts: list[Tensor], axis: int) -> Tensor:
    """``ts`` (equal shapes) stacked along a new axis ``axis``."""
    rank = ts[0].ndim + 1
    if not -rank <= axis < rank:
        raise ctx.invalid(f"output axis {axis} is out of range for outputs of rank {rank}")
    if any(t.shape != ts[0].shape or t.dtype != ts[0].dtype for t in ts):
        raise ctx.shape_error(f"the iterations give outputs of different shapes or types "
                              f"({sorted({(t.shape, t.dtype) for t in ts})}); they cannot be stacked")
    axes = ctx.constant(np.array([axis % rank], np.int64))
    parts = [ctx.emit("Unsqueeze", [t, axes], _HELPER_OPSET) for t in ts]
    return parts[0] if len(parts) == 1 else ctx.emit("Concat", parts, _HELPER_OPSET, axis=axis % rank)


# If -------------------------------------------------------------------------------------------

@onnx_op("If")
def if_(ctx):
    branch = "then_branch" if _known(ctx, ctx.input(0), "a condition", 0) else "else_branch"
    body = ctx.graph_attr(branch)
    if len(body.input):
        raise ctx.invalid(f"{branch} declares inputs; If branches take none")
    outs = ctx.subgraph(body, [], branch)
    if len(outs) != len(ctx.node.output):
        raise ctx.invalid(f"{branch} has {len(outs)} outputs, the node {len(ctx.node.output)}")
    return outs


# Loop -----------------------------------------------------------------------------------------

@onnx_op("Loop")
def loop(ctx):
    body = ctx.graph_attr("body")
    carried = [ctx.input(k) for k in range(2, ctx.num_inputs)]
    n_scan = len(body.output) - 1 - len(carried)
    if len(body.input) != 2 + len(carried) or n_scan < 0:
        raise ctx.invalid(f"the body takes {len(body.input)} inputs and gives {len(body.output)} outputs for "
                          f"{len(carried)} loop-carried values (expected {2 + len(carried)} inputs and at least "
                          f"{1 + len(carried)} outputs)")
    trips = int(_known(ctx, ctx.input(0), "a trip count", 0)) if ctx.has_input(0) else None
    cond = ctx.input(1) if ctx.has_input(1) else ctx.constant(np.array(True))
    if trips is None and not ctx.has_input(1):
        raise ctx.invalid("neither a trip count nor a condition: the loop never ends")
    if trips is not None:
        _check_trips(ctx, trips)
    scans: list[list[Tensor]] = [[] for _ in range(n_scan)]
    i = 0
    while (trips is None or i < trips) and _known(ctx, cond, "a loop condition", 1 if i == 0 else None):
        _check_trips(ctx, i + 1)
        outs = ctx.subgraph(body, [ctx.constant(np.array(i, np.int64)), cond] + carried, f"iter{i}")
        cond, carried = outs[0], outs[1:1 + len(carried)]
        for k, t in enumerate(outs[1 + len(carried):]):
            scans[k].append(t)
        i += 1
    if n_scan and i == 0:
        raise ctx.unsupported("scan outputs of a loop that runs no iteration (their shape is not known)")
    return carried + [_stack(ctx, ts, 0) for ts in scans]


# Scan -----------------------------------------------------------------------------------------

def _scan(ctx: NodeContext, body, states: list[Tensor], xs: list[Tensor], in_dirs, in_axes,
          scope: str) -> tuple[list[Tensor], list[list[Tensor]]]:
    """Run ``body`` over the slices of ``xs``: the final states and each scan output's slices, in
    iteration order."""
    for name, vals, n in (("scan_input_directions", in_dirs, len(xs)), ("scan_input_axes", in_axes, len(xs))):
        if len(vals) != n:
            raise ctx.invalid(f"{name} has {len(vals)} entries for {n} scan inputs")
    axes = []
    for x, a in zip(xs, in_axes):
        if not -x.ndim <= a < x.ndim:
            raise ctx.invalid(f"scan input axis {a} is out of range for an input of rank {x.ndim}")
        axes.append(a % x.ndim)
    lengths = {x.shape[a] for x, a in zip(xs, axes)}
    if len(lengths) > 1:
        raise ctx.shape_error(f"the scan inputs have different lengths {sorted(lengths)} along their scan axes")
    steps = lengths.pop() if lengths else 0
    _check_trips(ctx, steps)
    if len(body.input) != len(states) + len(xs):
        raise ctx.invalid(f"the body takes {len(body.input)} inputs, expected {len(states) + len(xs)} "
                          f"({len(states)} states and {len(xs)} scan inputs)")
    n_out = len(body.output) - len(states)
    if n_out < 0:
        raise ctx.invalid(f"the body gives {len(body.output)} outputs for {len(states)} states")
    ys: list[list[Tensor]] = [[] for _ in range(n_out)]
    for t in range(steps):
        slices = [_take(ctx, x, steps - 1 - t if d else t, a) for x, d, a in zip(xs, in_dirs, axes)]
        outs = ctx.subgraph(body, states + slices, f"{scope}iter{t}")
        states = outs[:len(states)]
        for k, y in enumerate(outs[len(states):]):
            ys[k].append(y)
    if n_out and steps == 0:
        raise ctx.unsupported("scan outputs of a scan over no element (their shape is not known)")
    return states, ys


@onnx_op("Scan", since=9)
def scan(ctx):
    body = ctx.graph_attr("body")
    n_in = int(ctx.attr("num_scan_inputs"))
    if not 0 < n_in <= ctx.num_inputs:
        raise ctx.invalid(f"num_scan_inputs {n_in} does not fit {ctx.num_inputs} inputs")
    states = [ctx.input(k) for k in range(ctx.num_inputs - n_in)]
    xs = [ctx.input(k) for k in range(ctx.num_inputs - n_in, ctx.num_inputs)]
    states, ys = _scan(ctx, body, states, xs, list(ctx.attr("scan_input_directions", [0] * n_in)),
                       list(ctx.attr("scan_input_axes", [0] * n_in)), "")
    out_dirs = list(ctx.attr("scan_output_directions", [0] * len(ys)))
    out_axes = list(ctx.attr("scan_output_axes", [0] * len(ys)))
    if len(out_dirs) != len(ys) or len(out_axes) != len(ys):
        raise ctx.invalid(f"scan_output_directions/axes have {len(out_dirs)}/{len(out_axes)} entries for "
                          f"{len(ys)} scan outputs")
    return states + [_stack(ctx, y[::-1] if d else y, a) for y, d, a in zip(ys, out_dirs, out_axes)]


@onnx_op("Scan", since=8, until=8)
def scan8(ctx):
    """Opset 8: a batch axis first on every input; the body runs on one batch entry at a time."""
    body = ctx.graph_attr("body")
    n_in = int(ctx.attr("num_scan_inputs"))
    if ctx.has_input(0):
        lens = ctx.const(0)
        full = {x.shape[1] for x in ctx.inputs[ctx.num_inputs - n_in:] if x is not None}
        if np.asarray(lens).size and any(int(v) not in full for v in np.asarray(lens).ravel()):
            raise ctx.unsupported(f"sequence_lens {np.asarray(lens).tolist()} shorter than the sequences")
    values = [ctx.input(k) for k in range(1, ctx.num_inputs)]
    if not 0 < n_in <= len(values):
        raise ctx.invalid(f"num_scan_inputs {n_in} does not fit {len(values)} inputs")
    batch = {t.shape[0] if t.ndim else None for t in values}
    if len(batch) != 1 or None in batch:
        raise ctx.shape_error(f"the inputs do not share a batch axis: shapes {[t.shape for t in values]}")
    dirs = list(ctx.attr("directions", [0] * n_in))
    finals: list[list[Tensor]] = []
    outs: list[list[Tensor]] = []
    for b in range(batch.pop()):
        entry = [_take(ctx, t, b, 0) for t in values]
        states, ys = _scan(ctx, body, entry[:len(values) - n_in], entry[len(values) - n_in:], dirs,
                           [0] * n_in, f"batch{b}/")
        finals.append(states)
        outs.append([_stack(ctx, y, 0) for y in ys])
    return [_stack(ctx, list(ts), 0) for ts in zip(*finals)] + [_stack(ctx, list(ts), 0) for ts in zip(*outs)]
