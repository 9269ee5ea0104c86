"""The committed transformer/CNN exports (tests/models, both exporters) imported, simplified and
run with numpy equal onnxruntime (rtol/atol 1e-3); simplification leaves no shape glue."""
import json
import os

import numpy as np
import onnxruntime as ort
import pytest

from shardflow.compiler import load_onnx

MODELS = os.path.join(os.path.dirname(__file__), "..", "models")
MANIFEST = json.load(open(os.path.join(MODELS, "MANIFEST.json")))
EXPORTS = {e["file"]: e for e in MANIFEST["exports"] if e["status"] == "ok"}
FILES = sorted(EXPORTS)


def inputs_for(file):
    return dict(np.load(os.path.join(MODELS, EXPORTS[file]["inputs_file"])))


def test_every_model_exported_with_both_exporters():
    kinds = {(e["model"], e["exporter"]) for e in EXPORTS.values()}
    models = {m for m, _ in kinds} - {"llama_sdpa"}  # exported at opset 23 only, for its Attention ops
    assert models == {"gpt2", "bert", "llama", "neox", "vit", "t5_encoder", "resnet", "mlp"}
    assert all((m, x) in kinds for m in models for x in ("torchscript", "dynamo"))
    assert EXPORTS["llama_sdpa_dynamo23.onnx"]["op_types"]["Attention"] == 2


@pytest.mark.parametrize("file", FILES)
def test_model_matches_onnxruntime(file):
    path = os.path.join(MODELS, file)
    feeds = inputs_for(file)
    graph = load_onnx(path)
    got = graph.run(feeds)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    for name, want in zip(names, sess.run(None, feeds)):
        np.testing.assert_allclose(got[name], want, rtol=1e-3, atol=1e-3, err_msg=f"{file}: output {name}")
    glue = {"Shape", "ShapeOf", "Size", "SizeOf", "ConstantOfShape", "Full", "Range", "Unsqueeze", "Squeeze"}
    assert not glue & set(graph.op_types()), f"{file}: shape glue left after simplification: {graph.op_types()}"
    if file.startswith("gpt2_ts"):
        assert "Concat" not in graph.op_types()
