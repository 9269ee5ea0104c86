"""``optimization_config["precision"]``: float16 contractions (compiler/passes/precision.py) on
the cpu target against onnxruntime, the graph it produces, and the cuda kernels it selects.

Tolerance for ``float16`` (documented in rfcs/0004-precision-and-fusion.md): operands of
contractions are rounded to float16 (relative error 2**-11 each) and accumulated in float32, so
outputs stay within ``5e-3 * max|reference|`` of the float32 model on the test models (measured
worst: 7e-4 on the ResNet and T5 exports).
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardflow.compiler import compile
from shardflow.compiler.ir import Tensor, const_tensor
from shardflow.compiler.ir.graph import FlowGraph
from shardflow.compiler.ops.elementwise import Binary
from shardflow.compiler.ops.linalg import MatMul
from shardflow.compiler.passes.precision import HalfPrecisionContractions
from shardflow.runtime import load

MODELS = Path(__file__).parent.parent / "models"


def test_the_pass_rounds_operands_and_keeps_biases_and_outputs_float32():
    rng = np.random.default_rng(0)
    x = Tensor("x", (5, 7), "float32")
    w = rng.standard_normal((7, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    mm = MatMul([x, const_tensor(w)])
    add = Binary([mm.outputs[0], const_tensor(b)], fn="add")
    g = FlowGraph([x], add.outputs)
    xv = rng.standard_normal((5, 7)).astype(np.float32)
    g = HalfPrecisionContractions("float16").run(g)
    g.validate()
    halves = [t for t in g.constants() if t.dtype == "float16"]
    assert [t.shape for t in halves] == [(7, 3)]  # the weight, stored in float16; the bias stays
    got = g.run({"x": xv})[g.output_names[0]]
    want = xv.astype(np.float16).astype(np.float32) @ w.astype(np.float16).astype(np.float32) + b
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
@pytest.mark.parametrize("model", ["gpt2_ts17", "resnet_ts17"])
def test_float16_model_on_cpu_matches_onnxruntime(tmp_path, model):
    ort = pytest.importorskip("onnxruntime")
    feeds = dict(np.load(MODELS / f"{model.rsplit('_', 1)[0]}_inputs.npz"))
    sess = ort.InferenceSession(str(MODELS / f"{model}.onnx"), providers=["CPUExecutionProvider"])
    ref = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    sizes = {}
    for prec in ("float32", "float16"):
        out = tmp_path / prec
        compile(MODELS / f"{model}.onnx", distributed_config={"mesh_shape": [1]},
                optimization_config={"precision": prec}, out_dir=out)
        got = load(out).run(feeds)
        for k, v in ref.items():
            scale = float(np.abs(v).max())
            tol = 1e-4 if prec == "float32" else 5e-3
            np.testing.assert_allclose(got[k], v, rtol=tol, atol=tol * scale, err_msg=f"{prec} {k}")
        program = json.loads((out / "rank0" / "program.json").read_text())
        sizes[prec] = program["weights_bytes"]
        dtypes = {b["dtype"] for b in program["buffers"] if b["storage"] == "weights"}
        assert ("float16" in dtypes) == (prec == "float16")
    assert sizes["float16"] < 0.75 * sizes["float32"]


def test_float16_cuda_kernels_use_the_half_tensor_cores(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    out = tmp_path / "o"
    compile(MODELS / "gpt2_ts17.onnx", distributed_config={"mesh_shape": [1]},
            optimization_config={"precision": "float16", "target": "cuda"}, out_dir=out)
    program = json.loads((out / "rank0" / "program.json").read_text())
    kinds = [s["launch"]["kind"] for s in program["steps"] if s["kind"] == "kernel"]
    # every projection (weight operand) is a float16 tensor-core GEMM with its casts fused
    assert kinds.count("gemm-f16") >= 8 and kinds.count("gemm-f32") <= 1, kinds
