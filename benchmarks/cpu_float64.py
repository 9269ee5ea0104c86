"""CPU latency of float64 products against onnxruntime (rfcs/0002 "Float64 products"): single MatMul and Gemm
nodes of float64 operands, each compiled for one cpu rank and timed next to onnxruntime with the same thread
count (``cpu_latency.bench``).

    python benchmarks/cpu_float64.py [--threads 2] [--repeat 10]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_latency  # noqa: E402

#: name: (op, A's shape, B's shape, Gemm's transB)
CASES = {"matmul_f64_256x512x512": ("MatMul", (256, 512), (512, 512), 0),
         "matmul_f64_1024x1024x1024": ("MatMul", (1024, 1024), (1024, 1024), 0),
         "matmul_f64_batched_16x128x64x128": ("MatMul", (16, 128, 64), (16, 64, 128), 0),
         "gemm_f64_7x300x45_bias": ("Gemm", (7, 300), (45, 300), 1)}


def model(op: str, a: tuple, b: tuple, trans_b: int, path: str) -> dict:
    """One float64 ``op`` of an input ``a`` and a constant ``b`` (Gemm: with a bias) written to ``path``."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    n = b[0] if trans_b else b[-1]
    inits = [numpy_helper.from_array(rng.standard_normal(b), "b")]
    attrs = {}
    if op == "Gemm":
        inits.append(numpy_helper.from_array(rng.standard_normal(n), "c"))
        attrs = dict(transB=trans_b)
    out = a[:-1] + (n,)
    graph = helper.make_graph([helper.make_node(op, ["a", "b"] + (["c"] if op == "Gemm" else []), ["y"], **attrs)],
                              op, [helper.make_tensor_value_info("a", TensorProto.DOUBLE, a)],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, out)], inits)
    with open(path, "wb") as f:
        f.write(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return {"a": rng.standard_normal(a)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args(argv)
    print(f"cpu: {cpu_latency._cpu_model()}, {os.cpu_count()} logical cores; threads: {args.threads}", flush=True)
    with tempfile.TemporaryDirectory() as work:
        for name, case in CASES.items():
            path = os.path.join(work, f"{name}.onnx")
            cpu_latency.bench(name, path, model(*case, path), args.threads, args.repeat, work)


if __name__ == "__main__":
    main()
