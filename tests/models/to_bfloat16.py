"""A float32 ONNX model as the same graph in bfloat16 (what an export of the module in bfloat16
stores), for tests and benchmarks: ``to_bfloat16(model)``. No torch needed."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, numpy_helper


def to_bfloat16(model: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """``(bf, ref)``: ``bf`` is ``model`` with its float32 weights, constants, casts and graph
    types in bfloat16; ``ref`` is the float32 model with the same (rounded) weights, which
    onnxruntime runs (it has no bfloat16 products on the CPU) as the reference computing every op
    in float32."""
    import ml_dtypes

    bf, ref = onnx.ModelProto(), onnx.ModelProto()
    bf.CopyFrom(model)
    ref.CopyFrom(model)

    def rounded(t: TensorProto, keep_float32: bool) -> None:
        if t.data_type == TensorProto.FLOAT:
            v = numpy_helper.to_array(t).astype(ml_dtypes.bfloat16)
            t.CopyFrom(numpy_helper.from_array(v.astype(np.float32) if keep_float32 else v, t.name))

    for m, keep in ((bf, False), (ref, True)):
        for t in m.graph.initializer:
            rounded(t, keep)
        for n in m.graph.node:
            for a in n.attribute:
                if a.type == AttributeProto.TENSOR:
                    rounded(a.t, keep)
                elif not keep and a.name == "to" and a.i == TensorProto.FLOAT:
                    a.i = TensorProto.BFLOAT16
    for vi in list(bf.graph.input) + list(bf.graph.output) + list(bf.graph.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.BFLOAT16
    return bf, ref


def bfloat16_feeds(feeds: dict) -> tuple[dict, dict]:
    """``(bf, ref)``: the float32 arrays of ``feeds`` rounded to bfloat16, and the same values as float32."""
    import ml_dtypes

    bf = {k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v for k, v in feeds.items()}
    return bf, {k: v.astype(np.float32) if v.dtype.name == "bfloat16" else v for k, v in bf.items()}
