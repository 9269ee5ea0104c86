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
