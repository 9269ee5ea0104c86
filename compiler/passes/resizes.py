"""Resizes of a volume's three last dims as two resizes the cpu target's template computes.

The Resize template interpolates the last one or two dims (rfcs/0002); a resize that also scales the
dim before them (a 3-D UNet's trilinear upsampling of ``[N, C, D, H, W]``) ran the generic nest, 3.4-3.6x
onnxruntime's time. Interpolation is separable: each dim's taps and weights depend on that dim's size,
scale and the coordinate mode alone, and a tap's weight in the box is the product of its per-dim weights.
So the resize is one over height and width (the leading dims copied), then one of that viewed ``[N, C, D,
OH*OW]`` over depth (the last dim copied), viewed ``[N, C, OD, OH, OW]``. Nearest picks the same input
element; linear and cubic values are rounded to float32 between the two steps (the nest interpolates the
box in float64 at once): within a few units in the last place. Crops (``tf_crop_and_resize``, whose
extrapolated points would be interpolated by the second step) and resizes of more leading dims are left
alone.
"""
from __future__ import annotations

import logging
import math

from ..ir.graph import FlowGraph, Operator
from .base import GraphPass, splice_rewrites

__all__ = ["SeparableResizes"]

log = logging.getLogger(__name__)


class SeparableResizes(GraphPass):
    """Every float32 ``Resize`` of a dim third from last (and of the last two, or not) written as a resize of
    the last two dims, then one of the depth on a view."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.conv import Resize
        from ..ops.transform import Reshape

        insert: dict[int, list[Operator]] = {}
        for op in graph.nodes:
            if op.op_type != "Resize" or len(op.inputs) != 1 or len(op.outputs) != 1 or op.inputs[0].ndim < 3 \
                    or op.inputs[0].dtype != "float32" \
                    or op.attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize" \
                    or op.attrs.get("roi") is not None:
                continue
            x, y = tuple(op.inputs[0].shape), tuple(op.outputs[0].shape)
            scales, r = tuple(op.attrs["scales"]), len(x)
            if any(x[d] != y[d] or not math.isclose(scales[d], 1.0) for d in range(r - 3)) \
                    or (x[-3] == y[-3] and math.isclose(scales[-3], 1.0)):
                continue  # a leading dim resized too, or the depth not resized (the template's already)
            attrs = {k: v for k, v in op.attrs.items() if k not in ("sizes", "scales")}
            planes = Resize([op.inputs[0]], name=f"{op.name}.hw", sizes=x[:-2] + y[-2:],
                            scales=(1.0,) * (r - 2) + scales[-2:], **attrs)
            rows = Reshape([planes.outputs[0]], name=f"{op.name}.rows", shape=x[:-2] + (y[-2] * y[-1],))
            depth = Resize([rows.outputs[0]], name=f"{op.name}.d", sizes=y[:-2] + (y[-2] * y[-1],),
                           scales=(1.0,) * (r - 3) + (scales[-3], 1.0), **attrs)
            back = Reshape([depth.outputs[0]], name=f"{op.name}.3d", shape=y)
            insert[id(op)] = [planes, rows, depth, back]
        if insert:
            log.info("resizes: %d resizes of volumes as 2-D ones over height and width, then depth", len(insert))
        return splice_rewrites(graph, insert, "separable resize")
