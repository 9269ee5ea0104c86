"""The committed test models' inputs and onnxruntime's outputs for them (tests/models/)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

MODELS = Path(__file__).parent / "models"


def onnxruntime_reference(model: str) -> tuple[dict, dict]:
    """``(feeds, outputs)`` of ``tests/models/<model>.onnx`` (e.g. ``gpt2_ts17``) on onnxruntime's
    CPU provider; skips the test where onnxruntime is not installed."""
    ort = pytest.importorskip("onnxruntime")
    feeds = dict(np.load(MODELS / f"{model.rsplit('_', 1)[0]}_inputs.npz"))
    sess = ort.InferenceSession(str(MODELS / f"{model}.onnx"), providers=["CPUExecutionProvider"])
    return feeds, dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def bfloat16_model(model: str) -> tuple:
    """``tests/models/<model>.onnx`` in bfloat16 (weights, constants, casts and graph types; what an
    export of the module in bfloat16 stores), its inputs likewise, and the reference: onnxruntime
    on the float32 model with the same (rounded) weights and inputs, which computes every op in
    float32. Returns ``(bfloat16 model, bfloat16 feeds, reference outputs)``."""
    import ml_dtypes
    import onnx
    from onnx import AttributeProto, TensorProto, numpy_helper

    ort = pytest.importorskip("onnxruntime")
    bf = onnx.load(str(MODELS / f"{model}.onnx"))
    ref = onnx.load(str(MODELS / f"{model}.onnx"))

    def rounded(t, keep_float32: bool) -> None:
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
    feeds = dict(np.load(MODELS / f"{model.rsplit('_', 1)[0]}_inputs.npz"))
    bf_feeds = {k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v for k, v in feeds.items()}
    ref_feeds = {k: v.astype(np.float32) if v.dtype.name == "bfloat16" else v for k, v in bf_feeds.items()}
    sess = ort.InferenceSession(ref.SerializeToString(), providers=["CPUExecutionProvider"])
    return bf, bf_feeds, dict(zip([o.name for o in sess.get_outputs()], sess.run(None, ref_feeds)))
