"""tests/models/synth_llama.py: the Llama-shaped ONNX model written without torch is transformers'
Llama (same weights, same logits), runs in onnxruntime and in the importer's graph alike, and
leaves no partial files."""
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from shardflow.compiler import load_onnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from synth_llama import PRESETS, build  # noqa: E402

TINY = PRESETS["tiny"]


def _ids(batch=2, seq=8):
    return np.random.default_rng(0).integers(0, TINY["vocab"], (batch, seq))


@pytest.mark.parametrize("dtype,kv_heads", [("float32", 2), ("float32", 4), ("float16", 2)])
def test_the_synthetic_model_is_transformers_llama(tmp_path, dtype, kv_heads):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = str(tmp_path / "m.onnx")
    cfg = dict(TINY, kv_heads=kv_heads)
    n = build(path, dtype=dtype, max_positions=16, **cfg)  # dynamic batch and sequence
    model = onnx.load(path)
    weights = {t.name: onnx.numpy_helper.to_array(t, base_dir=str(tmp_path)).astype(np.float32)
               for t in model.graph.initializer if t.name.startswith(("model.", "lm_head"))}
    assert n == sum(w.size for w in weights.values())
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], num_key_value_heads=kv_heads, vocab_size=cfg["vocab"],
        rms_norm_eps=1e-5, attn_implementation="eager", tie_word_embeddings=False)).eval()
    state = {k: torch.from_numpy(v.T.copy() if k.endswith("proj.weight") or k == "lm_head.weight" else v)
             for k, v in weights.items()}
    hf.load_state_dict(state, strict=True)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for shape in ((2, 8), (1, 16), (3, 1)):
        with torch.no_grad():
            want = hf(torch.from_numpy(_ids(*shape))).logits.numpy()
        got = sess.run(None, {"input_ids": _ids(*shape)})[0]
        tol = 1e-5 if dtype == "float32" else 2e-3
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=tol, atol=tol, err_msg=str(shape))


@pytest.mark.parametrize("dims", [{"batch": 2, "seq": 8}, {}])
def test_the_synthetic_model_imports_and_runs_like_onnxruntime(tmp_path, dims):
    """Declared static, and dynamic with the shapes given at import."""
    path = str(tmp_path / "m.onnx")
    build(path, dtype="float32", max_positions=16, **dims, **TINY)
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]  # no .partial left
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"input_ids": _ids()})[0]
    graph = load_onnx(path, input_shapes=None if dims else {"input_ids": [2, 8]})
    np.testing.assert_allclose(graph.run({"input_ids": _ids()})["logits"], want, rtol=1e-4, atol=1e-5)


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="heads"):
        build(str(tmp_path / "m.onnx"), **dict(TINY, kv_heads=3))
    with pytest.raises(ValueError, match="dtype"):
        build(str(tmp_path / "m.onnx"), dtype="int8", **TINY)
    assert os.listdir(tmp_path) == []
