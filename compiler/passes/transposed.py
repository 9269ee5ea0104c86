"""Depthwise transposed convs as one depthwise conv per output phase, which the cpu target's depthwise template
computes, and an interleave of the phases.

A transposed conv of stride ``s`` (dilation 1) writes output row ``o = i * s - p + k`` from input row ``i``
at tap ``k``. Split the output rows by phase ``a = o % s``, ``o = s * j + a``: the taps reaching phase ``a``
are ``k = r + s * m`` with ``r = (a + p) % s`` and ``m < M = ceil((K - r) / s)``, from input rows
``i = j + q - m`` with ``q = (a + p - r) / s``. That is a correlation of ``x`` with the sub-kernel
``w_a[m'] = w[r + s * (M - 1 - m')]`` and ``M - 1 - q`` rows of padding before: a plain conv of stride 1. So
a depthwise ``ConvTranspose`` (one input and one output channel per group: FCN's and CenterNet's bilinear
upsampling layers, ``groups = channels``) over 2 spatial dims is ``s_h * s_w`` depthwise convs of ``x``,
each giving an output phase ``[N, C, OH / s_h, OW / s_w]``, stacked and interleaved by a transpose (a
depth-to-space). The sums are over the same taps in another order (the nest sums the phase's taps ``m``
up, the conv its ``m'`` down): within an ulp or two. The nest computed each output's
phase and bounds per element, 1.25-1.32x onnxruntime's time (rfcs/0002 "Depthwise transposed convs").
Left alone: dilations, output extents that are not multiples of the strides, a phase with no taps or with
negative padding, weights that are not constants, and windows that tile the output (kernel = stride, no
padding: one tap an output, which the nest reads directly; as phases, the extra interleave made a 2x2
stride-2 one slower).
"""
from __future__ import annotations

import logging

import numpy as np

from ..ir.graph import FlowGraph, Operator, const_tensor
from .base import GraphPass, splice_rewrites

__all__ = ["PhasedDepthwiseTransposedConvs"]

log = logging.getLogger(__name__)


def _phase(a: int, s: int, p: int, k: int, n_in: int, n_out: int) -> tuple[list[int], int, int] | None:
    """Output phase ``a`` of one dim (stride ``s``, padding before ``p``, kernel ``k``, ``n_in`` input and
    ``n_out`` output positions of the phase): ``(taps, pad before, pad after)`` of the phase's conv, its
    taps in the conv's order (the transposed kernel's index for each of the conv's), or ``None``."""
    r = (a + p) % s
    m = (k - r + s - 1) // s
    if m < 1:
        return None
    q = (a + p - r) // s
    before = m - 1 - q
    after = n_out - 1 + m - n_in - before
    if before < 0 or after < 0:
        return None
    return [r + s * (m - 1 - t) for t in range(m)], before, after


class PhasedDepthwiseTransposedConvs(GraphPass):
    """Every float32 depthwise ``ConvTranspose`` over 2 spatial dims (constant weights, stride above 1,
    dilation 1, output extents multiples of the strides, windows that overlap or leave gaps) written as a
    depthwise conv per output phase and an interleave."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.conv import Conv
        from ..ops.transform import Concat, Reshape, Transpose

        insert: dict[int, list[Operator]] = {}
        for op in graph.nodes:
            if op.op_type != "ConvTranspose" or len(op.outputs) != 1 or op.inputs[0].ndim != 4:
                continue
            x, w = op.inputs[0], op.inputs[1]
            n, c, h, wd = x.shape
            _, _, oh, ow = op.outputs[0].shape
            (sh, sw) = tuple(op.attrs.get("strides") or (1, 1))
            pads = tuple(op.attrs.get("pads") or (0,) * 4)
            if x.dtype != "float32" or op.outputs[0].dtype != "float32" or not w.is_constant \
                    or int(op.attrs.get("group", 1)) != c or w.shape[:2] != (c, 1) or max(sh, sw) < 2 \
                    or tuple(op.attrs.get("dilations") or (1, 1)) != (1, 1) or oh % sh or ow % sw \
                    or op.tiles_output():
                continue  # (windows that tile the output have one tap an output, which the nest reads directly)
            rows = [_phase(a, sh, pads[0], w.shape[2], h, oh // sh) for a in range(sh)]
            cols = [_phase(b, sw, pads[1], w.shape[3], wd, ow // sw) for b in range(sw)]
            if any(ph is None for ph in rows + cols):
                continue
            weights, bias = np.asarray(w.value), list(op.inputs[2:3])
            convs, views = [], []  # (per phase, in row-major order of (a, b))
            for a, (rk, rb, ra) in enumerate(rows):
                for b, (ck, cb, ca) in enumerate(cols):
                    sub = const_tensor(np.ascontiguousarray(weights[:, :, rk][:, :, :, ck]), f"{op.name}.w{a}{b}")
                    convs.append(Conv([x, sub, *bias], name=f"{op.name}.p{a}{b}", group=c, pads=(rb, cb, ra, ca)))
                    views.append(Reshape([convs[-1].outputs[0]], name=f"{op.name}.p{a}{b}.v",
                                         shape=(n, c, 1, oh // sh, ow // sw)))
            if any(tuple(p.outputs[0].shape) != (n, c, oh // sh, ow // sw) for p in convs):
                continue  # (the phases' extents agree; checked, not assumed)
            stacked = Concat([v.outputs[0] for v in views], name=f"{op.name}.phases", axis=2)
            grid = Reshape([stacked.outputs[0]], name=f"{op.name}.grid", shape=(n, c, sh, sw, oh // sh, ow // sw))
            moved = Transpose([grid.outputs[0]], name=f"{op.name}.interleave", perm=(0, 1, 4, 2, 5, 3))
            back = Reshape([moved.outputs[0]], name=f"{op.name}.2d", shape=(n, c, oh, ow))
            insert[id(op)] = [op_ for pair in zip(convs, views) for op_ in pair] + [stacked, grid, moved, back]
        if insert:
            log.info("transposed convs: %d depthwise ones as a depthwise conv per output phase", len(insert))
        return splice_rewrites(graph, insert, "phased transposed conv")
