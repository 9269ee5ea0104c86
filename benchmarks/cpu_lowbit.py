"""CPU latency of 4-bit weight products (onnxruntime's ``MatMulNBits``) vs onnxruntime and vs float32.

Each shape is one ``MatMulNBits`` node (4-bit codes, blocks of 32 along K, a scale and a zero point per
block, as ``MatMulNBitsQuantizer`` writes them) on float32 activations ``x[M, K]``, compiled for one cpu
rank (the weight kept packed: ``cpu_library/lowbit.h``, a GEMV on the codes for M <= 4, else the GEMM
dequantizing each panel where a tile uses it). Side by side in one run: onnxruntime on the same node at
``accuracy_level`` 0 (float32 activations, like ours) and 4 (activations quantized to int8, its fastest
and an approximation we do not make), and our compiled float32 ``MatMul`` on the dequantized weight
(8x the bytes). Prints median latencies, the weight bytes streamed per call over the time (GB/s), the
ratios and the largest difference from onnxruntime at level 0.

    python benchmarks/cpu_lowbit.py [--threads 2] [--repeat 30] [--only llama7b_up_m1]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_latency import _cpu_model, _medians_ms  # noqa: E402

BLOCK = 32
# name: (tokens M, input features K, output features N): Llama-7B's projections (4096 -> 4096, 11008 and
# back) and the Llama-style test model's (1024 -> 2816), at one token (decoding), 2-32 and 128 (a prompt)
SHAPES = {
    "llama7b_qo_m1": (1, 4096, 4096), "llama7b_up_m1": (1, 4096, 11008), "llama7b_down_m1": (1, 11008, 4096),
    "llama7b_qo_m2": (2, 4096, 4096), "llama7b_qo_m4": (4, 4096, 4096), "llama7b_qo_m8": (8, 4096, 4096),
    "llama7b_qo_m16": (16, 4096, 4096), "llama7b_qo_m32": (32, 4096, 4096), "llama7b_qo_m128": (128, 4096, 4096),
    "llama170m_up_m1": (1, 1024, 2816), "llama170m_up_m128": (128, 1024, 2816),
}


def _models(name: str, work: str) -> tuple[np.ndarray, dict[str, str]]:
    """Write the shape's MatMulNBits models (accuracy levels 0 and 4) and the float32 MatMul on the same
    dequantized weight; return ``x`` and the paths."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    M, K, N = SHAPES[name]
    rng = np.random.default_rng(0)
    blocks = -(-K // BLOCK)
    codes = rng.integers(0, 16, (N, blocks * BLOCK)).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(N, blocks, BLOCK // 2)
    scales = (rng.uniform(0.5, 1.5, (N, blocks)) / np.sqrt(K) / 4).astype(np.float32)
    zp_codes = rng.integers(6, 10, (N, blocks + blocks % 2)).astype(np.uint8)
    zp = (zp_codes[:, 0::2] | (zp_codes[:, 1::2] << 4)).reshape(-1)
    paths = {}
    x_info = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])]
    y_info = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])]
    for level in (0, 4):
        node = helper.make_node("MatMulNBits", ["x", "B", "scales", "zp"], ["y"], domain="com.microsoft", K=K, N=N,
                                bits=4, block_size=BLOCK, accuracy_level=level)
        inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "scales"),
                 numpy_helper.from_array(zp, "zp")]
        g = helper.make_graph([node], name, x_info, y_info, inits)
        paths[f"nbits{level}"] = os.path.join(work, f"{name}-acc{level}.onnx")
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("com.microsoft", 1)]), paths[f"nbits{level}"])
    g_of_k = np.arange(K) // BLOCK
    w = ((codes[:, :K].astype(np.float32) - zp_codes[:, g_of_k]) * scales[:, g_of_k]).T.astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], name, x_info, y_info,
                          [numpy_helper.from_array(np.ascontiguousarray(w), "w")])
    paths["float32"] = os.path.join(work, f"{name}-f32.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), paths["float32"])
    return rng.standard_normal((M, K)).astype(np.float32), paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated shape names")
    ap.add_argument("--work", default=None, help="folder for the models and builds (default: a temporary one)")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import onnxruntime as ort

    from shardflow.compiler import compile
    from shardflow.runtime import load

    names = [n for n in args.only.split(",") if n] or list(SHAPES)
    work = args.work or tempfile.mkdtemp(prefix="shardflow-lowbit-")
    os.makedirs(work, exist_ok=True)
    print(f"cpu: {_cpu_model()}, {os.cpu_count()} logical cores; threads: {args.threads}; onnxruntime "
          f"{ort.__version__}; 4-bit codes in blocks of {BLOCK}")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    for name in names:
        M, K, N = SHAPES[name]
        x, paths = _models(name, work)
        progs = {}
        for kind in ("nbits0", "float32"):
            out = os.path.join(work, f"{name}-{kind}-out")
            compile(paths[kind], distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                    out_dir=out)
            progs[kind] = load(out, rank=0)
        sess = {lv: ort.InferenceSession(paths[f"nbits{lv}"], opts, providers=["CPUExecutionProvider"])
                for lv in (0, 4)}
        ref = sess[0].run(None, {"x": x})[0]
        err = float(np.max(np.abs(progs["nbits0"].run({"x": x})["y"] - ref)) / np.max(np.abs(ref)))
        ours, f32, ort0, ort4 = _medians_ms(
            [lambda: progs["nbits0"].run({"x": x}, copy_outputs=False),
             lambda: progs["float32"].run({"x": x}, copy_outputs=False),
             lambda: sess[0].run(None, {"x": x}), lambda: sess[4].run(None, {"x": x})], args.repeat, block=5)
        gbs = N * K / 2 / ours / 1e6  # 4-bit codes streamed per call
        print(f"{name:<18} M {M:>3}  ours 4-bit {ours:8.3f} ms ({gbs:5.1f} GB/s of codes)  ours float32 {f32:8.3f} ms "
              f"(x{f32 / ours:4.1f})  onnxruntime acc0 {ort0:8.3f} ms (ratio {ours / ort0:4.2f})  acc4 {ort4:8.3f} ms "
              f"(ratio {ours / ort4:4.2f})  max rel diff {err:.0e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
