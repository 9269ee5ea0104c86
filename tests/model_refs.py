"""The committed test models' inputs and onnxruntime's outputs for them (tests/models/)."""
from __future__ import annotations

import sys
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
    export of the module in bfloat16 stores; ``models/to_bfloat16.py``), its inputs likewise, and the
    reference: onnxruntime on the float32 model with the same (rounded) weights and inputs, which
    computes every op in float32. Returns ``(bfloat16 model, bfloat16 feeds, reference outputs)``."""
    import onnx

    if str(MODELS) not in sys.path:
        sys.path.insert(0, str(MODELS))
    from to_bfloat16 import bfloat16_feeds, to_bfloat16

    ort = pytest.importorskip("onnxruntime")
    bf, ref = to_bfloat16(onnx.load(str(MODELS / f"{model}.onnx")))
    bf_feeds, ref_feeds = bfloat16_feeds(dict(np.load(MODELS / f"{model.rsplit('_', 1)[0]}_inputs.npz")))
    sess = ort.InferenceSession(ref.SerializeToString(), providers=["CPUExecutionProvider"])
    return bf, bf_feeds, dict(zip([o.name for o in sess.get_outputs()], sess.run(None, ref_feeds)))
