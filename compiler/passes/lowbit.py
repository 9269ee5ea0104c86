"""Low-bit weights dequantized per rank where the target has no kernel on the codes.

A :class:`~shardflow.compiler.ops.linalg.MatMulNBits` (onnxruntime's 2/4/8-bit block-quantized weight,
kept packed by the importer) is what the plan sees: it splits the weight's columns or whole blocks of
``K`` and counts the packed bytes. The cpu target computes on the codes (``cpu_library/lowbit.h``). The
cuda target has no low-bit GEMM yet: :class:`DequantizeLowBitWeights` turns each rank's MatMulNBits into a
MatMul on its shard of the weight dequantized to float32 (``W[k, n] = (code - zero point) * scale``),
which the tensor-core GEMM then takes (rounded to half under ``precision``). The rank then holds 8x the
bytes of a 4-bit weight; the plan counted the codes (a log line says so).
"""
from __future__ import annotations

import logging

import numpy as np

from ..ir.graph import FlowGraph, const_tensor
from .base import GraphPass, splice

__all__ = ["DequantizeLowBitWeights"]

log = logging.getLogger(__name__)


class DequantizeLowBitWeights(GraphPass):
    """Each MatMulNBits with constant codes, scales and zero points becomes ``MatMul(a, W)`` with the
    float32 ``W[K, N]`` it stands for, of the same name."""

    def run(self, graph: FlowGraph) -> FlowGraph:
        from ..ops.linalg import MatMul

        after, replace = {}, {}
        weights: dict[tuple[int, ...], object] = {}  # one dequantized copy per stored weight
        added = 0
        for op in graph.nodes:
            if op.op_type != "MatMulNBits" or not all(t.is_constant for t in op.inputs[1:]):
                continue
            a = op.inputs[0]
            key = tuple(id(t) for t in op.inputs[1:]) + (a.shape[-1],)
            if key not in weights:
                bq, scales, *zp = (np.asarray(t.value) for t in op.inputs[1:])
                w = op.dequantized(bq, scales, zp[0] if zp else None, a.shape[-1])
                weights[key] = const_tensor(w, f"{op.inputs[1].name}.dequantized")
                added += w.nbytes - sum(int(np.asarray(t.value).nbytes) for t in op.inputs[1:])
            new = MatMul([a, weights[key]], name=op.name)
            after[id(op)] = [new]
            replace[id(op.outputs[0])] = new.outputs[0]
        if after:
            log.info("%d low-bit weight product(s) on dequantized float32 weights (%.1f MB more than the plan "
                     "counted: this target has no kernel on the codes)", len(after), added / 2 ** 20)
        return splice(graph, after, replace)
