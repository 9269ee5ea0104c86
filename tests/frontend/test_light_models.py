"""The 9 "light" CNNs shipped with the onnx package (AlexNet, DenseNet-121, Inception v1/v2,
ResNet-50, ShuffleNet, SqueezeNet, VGG-19, ZFNet-512) against their shipped reference outputs.

The models carry their weights as ``ConstantOfShape`` nodes; the onnx backend runner feeds them
``arange(n).reshape(shape) / n`` and stores the result in ``<model>_output_0.pb`` (see
``onnx.backend.test.runner``). Those outputs are mostly a uniform softmax, so each test also
exposes the input of the last node (the logits) and compares it with onnxruntime. Where the
logits are so large that the shipped softmax only records how they rounded (see the test), the
output is checked as the softmax of our logits instead.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from shardflow.compiler import load_onnx

LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
MODELS = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet",
          "vgg19", "zfnet512"]


def dummy_input(model: onnx.ModelProto) -> tuple[str, np.ndarray]:
    """The single non-initializer input and the value the onnx runner feeds it."""
    inits = {i.name for i in model.graph.initializer}
    (vi,) = [i for i in model.graph.input if i.name not in inits]
    shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim)
    n = int(np.prod(shape))
    return vi.name, (np.arange(n).reshape(shape) / n).astype(np.float32)


def expose_logits(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """A copy of ``model`` that also outputs the first input of its last node."""
    inferred = onnx.shape_inference.infer_shapes(model)
    name = model.graph.node[-1].input[0]
    (info,) = [v for v in inferred.graph.value_info if v.name == name]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.output.append(info)
    return out, name


def test_all_light_models_are_covered():
    shipped = sorted(f[len("light_"):-len(".onnx")] for f in os.listdir(LIGHT_DIR) if f.endswith(".onnx"))
    assert shipped == sorted(MODELS)


@pytest.mark.parametrize("name", MODELS)  # each takes under 10 s (VGG-19 the longest): none is marked slow
def test_light_model_matches_reference(name):
    ort = pytest.importorskip("onnxruntime")
    model = onnx.load(os.path.join(LIGHT_DIR, f"light_{name}.onnx"))
    want = numpy_helper.to_array(onnx.load_tensor(os.path.join(LIGHT_DIR, f"light_{name}_output_0.pb")))
    input_name, x = dummy_input(model)
    model, logits = expose_logits(model)

    got = load_onnx(model).run({input_name: x})

    out_name = model.graph.output[0].name
    assert got[out_name].shape == want.shape and got[out_name].dtype == want.dtype
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ref_logits = session.run([logits], {input_name: x})[0]
    np.testing.assert_allclose(got[logits], ref_logits, rtol=1e-3, atol=1e-3 * max(1.0, np.abs(ref_logits).max()))

    if np.spacing(np.abs(ref_logits).max()) <= 1e-6:
        np.testing.assert_allclose(got[out_name], want, rtol=1e-3, atol=1e-3)
    else:
        # Logits of 1e9 to 1e31 (the runner's ramp of weights): one ulp of a logit is 1024 or more,
        # and the shipped softmax is uniform only because every logit rounded to the same float.
        # Another summation order (numpy's BLAS on another CPU) breaks such ties by an ulp and
        # moves the softmax by up to 1/ties. So the output is checked as the softmax of our logits.
        assert model.graph.node[-1].op_type == "Softmax", name
        z = got[logits].astype(np.float64)
        axis = next((a.i for a in model.graph.node[-1].attribute if a.name == "axis"), -1 if
                    model.opset_import[0].version >= 13 else 1)
        if axis != -1 and model.opset_import[0].version < 13:
            z = z.reshape(z.shape[:axis] + (-1,))  # opset < 13: softmax over the flattened tail
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        np.testing.assert_allclose(got[out_name], (e / e.sum(axis=-1, keepdims=True)).reshape(want.shape),
                                   rtol=1e-3, atol=1e-3)
