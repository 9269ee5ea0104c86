"""3-D max and average pools as two 2-D ones, which the cpu target's pool template computes.

A max over a box of taps is the max over its depth taps of the maxes over its height and width
taps, so ``MaxPool`` of ``x [N, C, D, H, W]`` (kernel ``(KD, KH, KW)``) is a 2-D max pool of ``x``
viewed ``[N, C*D, H, W]`` (kernel ``(KH, KW)``, giving ``[N, C*D, OH, OW]``) followed by a 2-D max
pool of that viewed ``[N, C, D, OH*OW]`` (kernel ``(KD, 1)``, giving ``[N, C, OD, OH*OW]``),
viewed ``[N, C, OD, OH, OW]``. Each dim's output extent depends on that dim's kernel, stride,
dilation, pads and ``ceil_mode`` alone, so the extents agree, and the values are the same
(a maximum in any order; NaN wherever a window holds one). The cpu template covers 1-D and 2-D
pools (its rows vectorize); a 3-D one kept the generic nest, 5.7x onnxruntime's time on a 3-D
UNet's 2x2x2 pool (rfcs/0002 "3-D max pools").

An average is the same two steps: a window's divisor (its taps, or those inside the input without
``count_include_pad``) is the product of each dim's count, so the mean over depth of the plane means is
the box's mean; the sums are rounded in another order than one sum over the box (as the 2-D template's
separable loops already round theirs), within a few units in the last place. The nest took 8-26x
onnxruntime's time on overlapping 3-D windows (rfcs/0002 "3-D average pools"). Pools with indices are
left alone.
"""
from __future__ import annotations

import logging

from ..ir.graph import FlowGraph, Operator
from .base import GraphPass, splice_rewrites

__all__ = ["SeparablePools"]

log = logging.getLogger(__name__)


class SeparablePools(GraphPass):
    """Every float32 ``MaxPool`` and ``AveragePool`` over 3 spatial dims (one output) written as two 2-D ones
    on views."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.conv import Pool
        from ..ops.transform import Reshape

        insert: dict[int, list[Operator]] = {}
        for op in graph.nodes:
            if op.op_type != "Pool" or op.attrs.get("kind") not in ("max", "avg") or op.attrs.get("with_indices") \
                    or len(op.outputs) != 1 or op.inputs[0].ndim != 5 or op.inputs[0].dtype != "float32":
                continue
            (n, c, d, h, w), (_, _, od, oh, ow) = op.inputs[0].shape, op.outputs[0].shape
            (kd, kh, kw), (sd, sh, sw) = op.attrs["kernel"], op.attrs.get("strides") or (1, 1, 1)
            dd, dh, dw = op.attrs.get("dilations") or (1, 1, 1)
            pf, pt, pl, pk, pb, pr = op.attrs.get("pads") or (0,) * 6
            kind = op.attrs["kind"]
            common = dict(kind=kind, ceil_mode=op.attrs.get("ceil_mode", False))
            if kind == "avg":
                common["count_include_pad"] = op.attrs.get("count_include_pad", False)
            planes = Reshape([op.inputs[0]], name=f"{op.name}.planes", shape=(n, c * d, h, w))
            hw = Pool([planes.outputs[0]], name=f"{op.name}.hw", kernel=(kh, kw), strides=(sh, sw),
                      dilations=(dh, dw), pads=(pt, pl, pb, pr), **common)
            rows = Reshape([hw.outputs[0]], name=f"{op.name}.rows", shape=(n, c, d, oh * ow))
            depth = Pool([rows.outputs[0]], name=f"{op.name}.d", kernel=(kd, 1), strides=(sd, 1),
                         dilations=(dd, 1), pads=(pf, 0, pk, 0), **common)
            if tuple(depth.outputs[0].shape) != (n, c, od, oh * ow):  # (the extents agree; checked, not assumed)
                continue
            back = Reshape([depth.outputs[0]], name=f"{op.name}.3d", shape=(n, c, od, oh, ow))
            insert[id(op)] = [planes, hw, rows, depth, back]
        if insert:
            log.info("pools: %d 3-D pools as 2-D ones over height and width, then depth", len(insert))
        return splice_rewrites(graph, insert, "separable pool")
