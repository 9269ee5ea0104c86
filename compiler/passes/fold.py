"""Per-channel affine ops folded into the convolution before them.

A conv followed by an inference ``BatchNormalization``, or by element-wise ``Mul``/``Div``/``Add``/``Sub``
with a constant that varies along the output channels only (a scalar, ``[C]``-like ``[C, 1, 1]`` or
``[1, C, 1, 1]``), computes ``a[oc] * conv(x, w)[oc] + b[oc]``: the same as one conv of weight
``a[oc] * w[oc]`` and bias ``a[oc] * bias[oc] + b[oc]``. :class:`FoldAffineIntoConv` rewrites such a
chain into that one conv, its weight and bias computed here in float64 and rounded once to the
weight's dtype. Models exported from frameworks at training time carry these chains (BatchNorm after
every conv, often with a ``Mul``/``Add`` pair after it, as the onnx package's light Inception-v2 and
DenseNet-121 do); each op of the chain would otherwise cost a pass over the conv's output, or an
epilogue step per element (onnxruntime folds them as well, its ``ConvBNFusion``/``ConvMulFusion``/
``ConvAddFusion``).

Values change by rounding only: the product ``(a·w)·x`` is rounded where the model rounds ``a·(w·x)``
(rfcs/0002, "Affine ops folded into convs"). An op is folded only when the conv's result, and each
intermediate of the chain, has no other reader and is not a graph output; a ``Div`` only by a constant
with no zero; only float32 and float64 convs with constant weights (and constant bias, if any) of the
same dtype. Weights of identical convs folded with identical constants stay one tensor.
``compile`` runs the pass on the imported graph, before the plan (``optimization_config["fold_affine"]``).
"""
from __future__ import annotations

import logging

import numpy as np

from ..ir.graph import FlowGraph, Operator, Tensor, const_tensor
from .base import GraphPass, per_channel, splice

__all__ = ["FoldAffineIntoConv"]

log = logging.getLogger(__name__)

_FLOATS = ("float32", "float64")


def _channel_values(c: Tensor, y: Tensor) -> np.ndarray | None:
    """``c``'s value as one float64 number per channel of ``y [N, C, ...]`` when ``c`` broadcasts against
    ``y`` along the channel dim only (and does not widen ``y``); else ``None``."""
    if c.dtype != y.dtype or not per_channel(c, y):
        return None
    v = np.asarray(c.value, np.float64).reshape(-1)
    return np.broadcast_to(v, (y.shape[1],)) if np.all(np.isfinite(v)) else None


def _affine(op: Operator, y: Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """``(a, b)`` with ``op(y) = a[c] * y + b[c]`` per channel ``c`` of ``y``, when ``op`` is one of the
    foldable forms reading ``y``; else ``None``."""
    c = y.shape[1]
    if op.op_type == "BatchNorm":
        if op.inputs[0] is not y or any(not t.is_constant or t.dtype != y.dtype or t.shape != (c,)
                                        for t in op.inputs[1:]):
            return None
        scale, bias, mean, var = (np.asarray(t.value, np.float64) for t in op.inputs[1:])
        with np.errstate(all="ignore"):
            a = scale / np.sqrt(var + np.float64(np.dtype(y.dtype).type(op.attrs["epsilon"])))
        if not np.all(np.isfinite(a)) or not np.all(np.isfinite(bias - mean * a)):
            return None
        return a, bias - mean * a
    if op.op_type != "Binary" or len(op.inputs) != 2 or op.outputs[0].shape != y.shape:
        return None
    fn = op.attrs["fn"]
    first = op.inputs[0] is y
    other = op.inputs[1] if first else op.inputs[0]
    if other is y:
        return None
    v = _channel_values(other, y)
    if v is None:
        return None
    one, zero = np.ones(c), np.zeros(c)
    if fn == "add":
        return one, v
    if fn == "mul":
        return v, zero
    if fn == "sub":
        return (one, -v) if first else (-one, v)
    if fn == "div" and first and np.all(v != 0):
        return 1.0 / v, zero
    return None


class FoldAffineIntoConv(GraphPass):
    """Fold each chain of per-channel affine ops after a conv into the conv's weight and bias (see the
    module docstring). The folded conv keeps the conv's node name and takes the chain's last tensor name."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.conv import Conv

        consumers = graph.consumers()
        outputs = {id(t) for t in graph.outputs}

        def only_reader(t: Tensor) -> Operator | None:
            readers = consumers.get(id(t), [])
            return readers[0] if len(readers) == 1 and id(t) not in outputs else None

        after: dict[int, list[Operator]] = {}
        replace: dict[int, Tensor] = {}
        folded: dict[tuple, tuple[Tensor, Tensor]] = {}
        n_ops = 0
        for op in graph.nodes:
            if type(op) is not Conv or not op.inputs[1].is_constant or op.outputs[0].dtype not in _FLOATS \
                    or op.inputs[1].dtype != op.outputs[0].dtype \
                    or (len(op.inputs) > 2 and not op.inputs[2].is_constant):
                continue
            y = op.outputs[0]
            a, b, chain = np.ones(y.shape[1]), np.zeros(y.shape[1]), []
            nxt = only_reader(y)
            while nxt is not None:
                ab = _affine(nxt, y)
                if ab is None:
                    break
                a, b = ab[0] * a, ab[0] * b + ab[1]
                chain.append(nxt)
                y = nxt.outputs[0]
                nxt = only_reader(y)
            if not chain:
                continue
            w0 = op.inputs[1]
            b0 = op.inputs[2] if len(op.inputs) > 2 else None
            key = (id(w0), id(b0), tuple(_chain_key(f) for f in chain))
            if key not in folded:
                dt = w0.dtype
                w = np.asarray(w0.value, np.float64) * a.reshape((-1,) + (1,) * (w0.ndim - 1))
                bias = a * (np.asarray(b0.value, np.float64) if b0 is not None else 0.0) + b
                folded[key] = (const_tensor(w.astype(dt), f"{op.name}.folded_w"),
                               const_tensor(bias.astype(dt), f"{op.name}.folded_b"))
            w, bias = folded[key]
            new = Conv([op.inputs[0], w, bias], name=op.name, **op.attrs)
            new.outputs[0].name = y.name
            after[id(chain[-1])] = [new]
            replace[id(y)] = new.outputs[0]
            n_ops += len(chain)
        if after:
            log.debug("folded %d per-channel affine ops into %d convs", n_ops, len(after))
        return splice(graph, after, replace)


def _chain_key(op: Operator) -> tuple:
    """What makes one folded op's constants the same as another's: its kind, attributes and constant inputs."""
    return (op.op_type, tuple(sorted((k, str(v)) for k, v in op.attrs.items())),
            tuple(id(t) for t in op.inputs if t.is_constant),
            tuple(k for k, t in enumerate(op.inputs) if not t.is_constant))
