"""CPU latency of single weight products (x @ W + b, W constant) vs onnxruntime.

The shapes are the projections of the transformers in ``cpu_latency.py --sized`` at 1x128 tokens
(GPT-2 small and BERT-base: 768 -> 2304/768/3072 and back; the Llama-style model: 1024 -> 2816
and back; GPT-2's tied lm_head 768 -> 50257), other token counts (1, 8, 32, 512) and ViT-base's 197. Each is an ONNX
``MatMul`` + ``Add``, compiled for one cpu rank (a PackedMatMul with the bias in its epilogue)
and run with ``shardflow.runtime.load``; onnxruntime runs the same model with the same thread
count. Prints median latencies, GFLOP/s, the ratio (ours / onnxruntime) and the largest difference.
The ``int8_`` shapes are ``MatMulInteger`` nodes instead (uint8 ``x`` with a zero point times a constant
int8 ``W``, int32 ``y``: a PackedMatMulInteger, ``cpu_library/gemm_int8.h``; "GFLOP/s" counts their
multiply-adds as two operations too). The ``f16_`` shapes are a float16 model's product (``x`` cast to
float16, ``MatMul`` + ``Add`` of float16 ``W`` and ``b``, the output cast back to float32): ours reads ``W`` as
float16 panels (``SfHalfPrepacked``, the float16 GEMV at one row); onnxruntime runs the float32 graph with the
same rounded ``W`` and ``b`` (the float32 GEMM's time; its float16 MatMul was not timed here). The ``bf16_``
shapes likewise in bfloat16 (the bfloat16 GEMM, ``cpu_library/gemm_bf16.h``, its output a bfloat16 C, then the
cast to float32; onnxruntime has no bfloat16 MatMul on the CPU: it runs the float32 graph).

    python benchmarks/cpu_gemm.py [--threads 2] [--repeat 30] [--only fc_768_3072]
    python benchmarks/cpu_gemm.py --build-only --tag old --work /tmp/gemms   # at one commit
    python benchmarks/cpu_gemm.py --dirs old,new --work /tmp/gemms           # both, round-robin
"""
from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_conv import main as _time_models  # noqa: E402

# name: (tokens M, input features K, output features N)
SHAPES = {
    "qkv_768_2304": (128, 768, 2304), "proj_768_768": (128, 768, 768), "fc_768_3072": (128, 768, 3072),
    "fc2_3072_768": (128, 3072, 768), "up_1024_2816": (128, 1024, 2816), "down_2816_1024": (128, 2816, 1024),
    "lm_head_768_50257": (128, 768, 50257), "fc_m1_768_3072": (1, 768, 3072), "fc_m8_768_3072": (8, 768, 3072),
    "fc_m32_768_3072": (32, 768, 3072), "fc_m512_768_3072": (512, 768, 3072),
    # ViT-base's products (197 tokens: 196 patches and the class token)
    "proj_m197_768_768": (197, 768, 768), "fc_m197_768_3072": (197, 768, 3072), "fc2_m197_3072_768": (197, 3072, 768),
    # Whisper-base's encoder (1500 frames, 512 wide)
    "proj_m1500_512_512": (1500, 512, 512), "fc_m1500_512_2048": (1500, 512, 2048),
    "fc2_m1500_2048_512": (1500, 2048, 512),
}
SHAPES.update({f"int8_{k}": SHAPES[k] for k in ("proj_768_768", "fc_768_3072", "fc2_3072_768", "lm_head_768_50257",
                                                "fc_m1_768_3072", "fc_m8_768_3072", "fc_m32_768_3072",
                                                "fc_m512_768_3072")})
SHAPES.update({f"f16_{k}": SHAPES[k] for k in ("fc_768_3072", "fc2_3072_768", "lm_head_768_50257", "fc_m1_768_3072",
                                               "fc_m8_768_3072", "fc_m32_768_3072")})
SHAPES.update({"fc_m1_4096_11008": (1, 4096, 11008), "f16_fc_m1_4096_11008": (1, 4096, 11008)})
SHAPES.update({f"bf16_{k}": SHAPES[k] for k in ("qkv_768_2304", "fc_768_3072", "fc2_3072_768", "lm_head_768_50257",
                                                "fc_m1_768_3072", "fc_m32_768_3072")})


def _model(name: str, path: str):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    M, K, N = SHAPES[name]
    rng = np.random.default_rng(0)
    if name.startswith("int8_"):
        inits = [numpy_helper.from_array(rng.integers(-128, 128, (K, N)).astype(np.int8), "w"),
                 numpy_helper.from_array(np.array(117, np.uint8), "xzp")]
        g = helper.make_graph([helper.make_node("MatMulInteger", ["x", "w", "xzp"], ["y"])], name,
                              [helper.make_tensor_value_info("x", TensorProto.UINT8, [M, K])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [M, N])], inits)
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
        return rng.integers(0, 256, (M, K)).astype(np.uint8), 2.0 * M * K * N
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    half = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}.get(name.split("_")[0])
    if half is not None:  # (values that the half type holds: the float32 reference computes on the same ones)
        w, b, x = (v.astype(half).astype(np.float32) for v in (w, b, x))

    def write(out: str, half) -> None:
        dt = helper.np_dtype_to_tensor_dtype(np.dtype(half)) if half else TensorProto.FLOAT
        nodes = [helper.make_node("MatMul", ["xh" if half else "x", "w"], ["m"]),
                 helper.make_node("Add", ["m", "b"], ["yh" if half else "y"])]
        if half:
            nodes = [helper.make_node("Cast", ["x"], ["xh"], to=dt)] + nodes + [
                helper.make_node("Cast", ["yh"], ["y"], to=TensorProto.FLOAT)]
        inits = [numpy_helper.from_array(v.astype(half) if half else v, k) for k, v in (("w", w), ("b", b))]
        g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])], inits)
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), out)

    write(path, half)
    if half is None:
        return x, 2.0 * M * K * N
    write(path[:-len(".onnx")] + "_float32.onnx", None)
    return x, 2.0 * M * K * N, path[:-len(".onnx")] + "_float32.onnx"


if __name__ == "__main__":
    sys.exit(_time_models(shapes=SHAPES, model=_model, description=__doc__))
