"""Low-bit weight products under a half ``precision`` on the cuda target.

A :class:`~shardflow.compiler.ops.linalg.MatMulNBits` (onnxruntime's 2/4/8-bit block-quantized weight,
kept packed by the importer) is what the plan sees, what the rank stores and what the kernels read:
the cpu target's ``cpu_library/lowbit.h``, and on cuda the kernels of its compute definition (the GEMV
template for up to 15 rows, a tensor-core GEMM dequantizing in its operand loads beyond).

The precision pass rounds the operands of the float32 contractions it knows (MatMul, Gemm, ...); a
low-bit product's weight is no stored tensor it could convert, so :class:`HalfLowBitOperands` asks the
op itself to round: ``operand_dtype`` makes its compute definition read ``a`` and the dequantized
weight rounded to the half type, products exact in float32 and float32 sums, the values a GEMM on half
operands computes (and the cuda GEMM then takes the half tensor cores), where the product has rows
enough for them. The cpu target computes these products in float32 at every precision (its template
takes no ``operand_dtype``).
"""
from __future__ import annotations

import logging

import numpy as np

from ..codegen.cuda_gemv import GEMV_MAX_ROWS
from ..ir.graph import FlowGraph
from .base import GraphPass, splice

__all__ = ["HalfLowBitOperands"]

log = logging.getLogger(__name__)


class HalfLowBitOperands(GraphPass):
    """Each float32 MatMulNBits of more rows than the cuda GEMV template takes (more than
    :data:`~shardflow.compiler.codegen.cuda_gemv.GEMV_MAX_ROWS`: the tensor-core GEMMs' products)
    becomes the same op with ``operand_dtype=dtype`` (``"float16"`` or ``"bfloat16"``), of the same
    name. Fewer rows (a decoding step) keep float32 operands: the GEMV they get uses no tensor cores,
    so rounding would only lose accuracy (and keep the kernel from reading the codes a word at a time)."""

    def __init__(self, dtype: str):
        self.dtype = dtype

    def run(self, graph: FlowGraph) -> FlowGraph:
        after, replace = {}, {}
        for op in graph.nodes:
            if op.op_type != "MatMulNBits" or op.attrs.get("operand_dtype") or op.outputs[0].dtype != "float32" \
                    or int(np.prod(op.inputs[0].shape[:-1])) <= GEMV_MAX_ROWS:
                continue
            new = type(op)(list(op.inputs), name=op.name, **{**op.attrs, "operand_dtype": self.dtype})
            after[id(op)] = [new]
            replace[id(op.outputs[0])] = new.outputs[0]
        if after:
            log.info("precision %s: %d low-bit weight product(s) read %s operands", self.dtype, len(after), self.dtype)
        return splice(graph, after, replace)
