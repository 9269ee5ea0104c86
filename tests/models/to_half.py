"""A float32 ONNX model as the same graph in float16 or bfloat16 (what an export of the module in
that type stores), for tests and benchmarks: ``to_half(model, half)``. No torch needed."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, numpy_helper

_CODES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def _numpy_type(half: str):
    import ml_dtypes

    return np.float16 if half == "float16" else ml_dtypes.bfloat16


def to_half(model: onnx.ModelProto, half: str = "bfloat16") -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """``(low, ref)``: ``low`` is ``model`` with its float32 weights, constants, casts and graph
    types in ``half`` (``"float16"`` or ``"bfloat16"``); ``ref`` is the float32 model with the same
    (rounded) weights, which onnxruntime runs as the reference computing every op in float32 (it
    has no bfloat16 products on the CPU)."""
    nt, code = _numpy_type(half), _CODES[half]
    low, ref = onnx.ModelProto(), onnx.ModelProto()
    low.CopyFrom(model)
    ref.CopyFrom(model)

    def rounded(t: TensorProto, keep_float32: bool) -> None:
        if t.data_type == TensorProto.FLOAT:
            with np.errstate(over="ignore"):  # (a float32 mask's finfo.min is -inf in float16)
                v = numpy_helper.to_array(t).astype(nt)
            t.CopyFrom(numpy_helper.from_array(v.astype(np.float32) if keep_float32 else v, t.name))

    for m, keep in ((low, False), (ref, True)):
        for t in m.graph.initializer:
            rounded(t, keep)
        for n in m.graph.node:
            for a in n.attribute:
                if a.type == AttributeProto.TENSOR:
                    rounded(a.t, keep)
                elif not keep and a.name == "to" and a.i == TensorProto.FLOAT:
                    a.i = code
    for vi in list(low.graph.input) + list(low.graph.output) + list(low.graph.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = code
    return low, ref


def half_feeds(feeds: dict, half: str = "bfloat16") -> tuple[dict, dict]:
    """``(low, ref)``: the float32 arrays of ``feeds`` rounded to ``half``, and the same values as float32."""
    nt = _numpy_type(half)
    low = {k: v.astype(nt) if v.dtype == np.float32 else v for k, v in feeds.items()}
    return low, {k: v.astype(np.float32) if v.dtype != feeds[k].dtype else v for k, v in low.items()}
