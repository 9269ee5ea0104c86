"""Channels-last convolutions for the cuda target on Hopper (RFC 0005 decision 57).

The wgmma GEMM template copies its operands 16 bytes (8 half values) at a time. An NCHW image read
through a convolution's window has no such runs: along ``w`` a tap shifts the row by one element
(the copy would not be 16-byte aligned), along ``c`` the values are ``H * W`` apart. So every conv
with a window wider than 1x1, a stride, padding, or ``H * W`` not a multiple of 8 took the portable
``wmma`` template. :class:`ChannelsLastConvs` gives such a conv:

* its image copied channels-last, ``[N, *spatial, C]`` (a Transpose whose output the cuda target
  writes, :func:`channels_last_copy`: one copy per image, shared by the convs that read it; the
  image's cast to the half type fuses into the copy), read through a Transpose back to
  ``[N, C, *spatial]`` that fuses into the conv's kernel; where ``C`` is not a multiple of 8 (a
  model's first conv, of 3 or 4 channels), the copy has zero channels after the image's up to the
  next multiple (the products by them add nothing);
* its weight stored ``[OC, *kernel, C]`` at compile time (zeros in the channels added), read
  through a Transpose back likewise.

The conv computes the same values (the graph is equivalent op for op); its kernel now reads runs
of 8 channels at each tap, which :func:`shardflow.compiler.codegen.cuda._gather_operand` turns into
the template's gathered operand (K in the order ``(*kernel, C)``, a tap in the padding copied as
zeros). The output stays ``[N, OC, *spatial]`` (the template stores four consecutive pixels at a
time), unless a copy is its only reader: the cuda target's fusion then makes the conv's kernel
store its output channels-last (RFC 0005 decision 60). Depthwise and grouped convs are left as they
are; ``optimization_config["channels_last"] = False`` turns the pass off.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from ..ir.graph import FlowGraph, Operator, Tensor, const_tensor
from .base import GraphPass, take_over

__all__ = ["ChannelsLastConvs", "channels_last_copy"]

log = logging.getLogger(__name__)

_HALF = ("float16", "bfloat16")


def channels_last_copy(op: Operator) -> bool:
    """Whether ``op`` is an image's channels-last copy made by :class:`ChannelsLastConvs` (its
    output is written, not fused into the convs that read it)."""
    return op.op_type == "Transpose" and bool(op.attrs.get("channels_last"))


def _direct(op: Operator) -> bool:
    """A 1x1 conv, stride 1, no padding, over ``H * W`` a multiple of 8 pixels: the wgmma template
    reads its NCHW image as it is (RFC 0005 decision 55)."""
    x = op.inputs[0]
    k = op.inputs[1].shape[2:]
    return all(v == 1 for v in k) and all(s == 1 for s in op.attrs.get("strides") or ()) \
        and not any(op.attrs.get("pads") or ()) and math.prod(x.shape[2:]) % 8 == 0


def _gathered_in_nchw(op: Operator) -> bool:
    """A patch embedding (ViT's 16x16 windows at stride 16, no padding, ``W`` a multiple of 8):
    each window row is a run of a multiple of 8 values at a 16-byte aligned place of the NCHW image,
    which the wgmma template gathers as it is (RFC 0005 decision 57)."""
    x, kw = op.inputs[0], op.inputs[1].shape[-1]
    sw = (op.attrs.get("strides") or (1,) * (x.ndim - 2))[-1]
    dw = (op.attrs.get("dilations") or (1,) * (x.ndim - 2))[-1]
    pads = op.attrs.get("pads") or (0,) * (2 * (x.ndim - 2))
    return kw % 8 == 0 and sw % 8 == 0 and dw == 1 and pads[x.ndim - 3] == 0 and pads[-1] == 0 \
        and x.shape[-1] % 8 == 0


class ChannelsLastConvs(GraphPass):
    """Convs of half images, one group, a constant weight, that the wgmma template cannot read in
    NCHW: the image copied channels-last (its channels padded with zeros to a multiple of 8), the
    weight stored ``[OC, *kernel, C]`` (module docstring). Run after the precision pass: the image
    is a half tensor, read directly or through a ``Cast`` to float32 that only this conv reads (the
    precision pass's form), and so is the weight (a constant)."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        producer = {id(t): op for op in graph.nodes for t in op.outputs}
        readers: dict[int, int] = {}
        for op in graph.nodes:
            for t in {id(t) for t in op.inputs}:
                readers[t] = readers.get(t, 0) + 1
        before: dict[int, list[Operator]] = {}  # id(op) -> new ops to place just before it
        replaced: dict[int, Operator] = {}  # id(conv) -> the conv that takes over its output
        dropped: set[int] = set()  # the float32 casts of the convs' operands (replaced too)
        copies: dict[int, Tensor] = {}  # id(image) -> its channels-last copy
        weights: dict[int, Tensor] = {}  # id(weight) -> its values stored [OC, *kernel, C]

        def half_source(t: Tensor) -> tuple[Tensor, Operator | None] | None:
            """(the half tensor behind conv operand ``t``, the float32 cast between them or None)."""
            if t.dtype in _HALF:
                return t, None
            p = producer.get(id(t))
            if p is not None and p.op_type == "Cast" and p.inputs[0].dtype in _HALF and readers.get(id(t)) == 1:
                return p.inputs[0], p
            return None

        for op in graph.nodes:
            if op.op_type != "Conv" or type(op).__name__ != "Conv" or int(op.attrs.get("group", 1)) != 1 \
                    or op.attrs.get("blocked_in") or op.attrs.get("blocked_out") or len(op.inputs) < 2:
                continue
            x, w, y = op.inputs[0], op.inputs[1], op.outputs[0]
            sx, sw = half_source(x), half_source(w)
            if sx is None or sw is None or not sw[0].is_constant or x.ndim < 3 \
                    or _direct(op) or _gathered_in_nchw(op) or y.shape[1] < 16 \
                    or y.shape[0] * math.prod(y.shape[2:]) < 16:
                continue
            nd = x.ndim
            img, wt = sx[0], sw[0]
            extra = -x.shape[1] % 8  # zero channels that make runs of 8 (a model's first conv: 3 or 4)
            if id(img) not in copies:
                src, ops = img, []
                if extra:
                    ops.append(_pad_channels(img, extra))
                    src = ops[-1].outputs[0]
                ops.append(_transpose(src, (0, *range(2, nd), 1), f"{img.name}.channels_last", channels_last=True))
                before.setdefault(id(op), []).extend(ops)  # (before the first conv that reads it)
                copies[id(img)] = ops[-1].outputs[0]
            if id(wt) not in weights:
                value = np.moveaxis(np.asarray(wt.value), 1, -1)
                value = np.pad(value, [(0, 0)] * (nd - 1) + [(0, extra)])
                weights[id(wt)] = const_tensor(np.ascontiguousarray(value), f"{wt.name}.ohwi")
            back = (0, nd - 1, *range(1, nd - 1))
            new, inputs = [], list(op.inputs)
            for src, (_, cast), k in ((copies[id(img)], sx, 0), (weights[id(wt)], sw, 1)):
                new.append(_transpose(src, back, f"{op.name}.in{k}.nchw"))
                if cast is not None:  # (a new cast: the operand may have more channels than before)
                    new.append(type(cast)([new[-1].outputs[0]], name=cast.name, **cast.attrs))
                    dropped.add(id(cast))
                inputs[k] = new[-1].outputs[0]
            before.setdefault(id(op), []).extend(new)
            replaced[id(op)] = take_over(op, type(op)(inputs, name=op.name, **op.attrs), "channels-last conv")
        if replaced:
            nodes: list[Operator] = []
            for op in graph.nodes:
                nodes.extend(before.get(id(op), []))
                if id(op) not in dropped:
                    nodes.append(replaced.get(id(op), op))
            graph.nodes = nodes
            log.info("cuda: %d convs read channels-last copies of %d images", len(replaced), len(copies))
        return graph


def _transpose(t: Tensor, perm: tuple[int, ...], name: str, **attrs) -> Operator:
    from ..ops.transform import Transpose

    return Transpose([t], name=name, perm=tuple(perm), **attrs)


def _pad_channels(t: Tensor, extra: int) -> Operator:
    """``t [N, C, *spatial]`` with ``extra`` channels of zeros after its own."""
    from ..ops.transform import Pad

    return Pad([t], name=f"{t.name}.pad{t.shape[1] + extra}", begin=(0,) * t.ndim,
               end=(0, extra) + (0,) * (t.ndim - 2), mode="constant", value=0.0)

