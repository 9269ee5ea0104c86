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


def half_model(model: str, half: str = "bfloat16") -> tuple:
    """``tests/models/<model>.onnx`` in ``half`` (float16 or bfloat16: weights, constants, casts and
    graph types, what an export of the module in that type stores; ``models/to_half.py``), its
    inputs likewise, and the reference: onnxruntime on the float32 model with the same (rounded)
    weights and inputs, which computes every op in float32. Returns ``(model, feeds, reference
    outputs)``."""
    import onnx

    if str(MODELS) not in sys.path:
        sys.path.insert(0, str(MODELS))
    from to_half import half_feeds, to_half

    ort = pytest.importorskip("onnxruntime")
    low, ref = to_half(onnx.load(str(MODELS / f"{model}.onnx")), half)
    low_feeds, ref_feeds = half_feeds(dict(np.load(MODELS / f"{model.rsplit('_', 1)[0]}_inputs.npz")), half)
    sess = ort.InferenceSession(ref.SerializeToString(), providers=["CPUExecutionProvider"])
    return low, low_feeds, dict(zip([o.name for o in sess.get_outputs()], sess.run(None, ref_feeds)))


def gptoss_step_feeds(seed: int = 4) -> dict:
    """A gpt-oss decoding step after 20 positions: layer 0's window buffer (8 rows, all in use), layer
    1's cache of 24 (20 in use, zeros after), one new token."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((1, 24), np.int64)
    mask[:, :21] = 1
    feeds = {"input_ids": np.array([[77]], np.int64), "attention_mask": mask}
    for kv in ("key", "value"):
        feeds[f"past_key_values.0.{kv}"] = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
        full = np.zeros((1, 2, 24, 16), np.float32)
        full[:, :, :20] = rng.standard_normal((1, 2, 20, 16))
        feeds[f"past_key_values.1.{kv}"] = full
    return feeds


def genai_llama_feeds(step: str, seed: int = 3) -> dict:
    """Inputs of the genai Llamas (``tests/models/llama_genai_*.onnx``): the prompt (two sequences of 8,
    one right-padded to 5) or a decoding step (one token each, a fixed-size cache of 16 with random
    values, 8 and 5 of its rows in use)."""
    rng = np.random.default_rng(seed)
    n, past = (8, 0) if step == "prompt" else (1, 16)
    mask = np.zeros((2, max(n, past)), np.int64)
    mask[0, :n + 8 * (step == "decode")] = 1
    mask[1, :5 + (step == "decode")] = 1
    feeds = {"input_ids": rng.integers(0, 256, (2, n)).astype(np.int64), "attention_mask": mask}
    for layer in range(2):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kv}"] = rng.standard_normal((2, 2, past, 16)).astype(np.float32)
    return feeds
