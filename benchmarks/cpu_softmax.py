"""CPU latency of a Softmax over the last axis against onnxruntime: attention scores (12 heads of
512 x 512), a language model's vocabulary (64 rows of 50257) and a small case (4 heads of 128 x 128).
Each is one ONNX node compiled for one cpu rank; prints the median of 40 calls of ours
(``copy_outputs=False``), then of onnxruntime's (same thread count, after a pause: its pool's threads
spin after a run), and the largest difference of the outputs.

    python benchmarks/cpu_softmax.py [--threads 2]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

SHAPES = [(12, 512, 512), (1, 64, 50257), (1, 4, 128, 128)]


def _median_ms(call, n: int = 40) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from shardflow.compiler import compile
    from shardflow.runtime import load

    for shape in SHAPES:
        info = helper.make_tensor_value_info
        g = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "softmax",
                              [info("x", TensorProto.FLOAT, list(shape))], [info("y", TensorProto.FLOAT, list(shape))])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        out = tempfile.mkdtemp(prefix="shardflow-softmax-")
        compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=out)
        prog = load(out, rank=0)
        feeds = {"x": (np.random.default_rng(0).standard_normal(shape) * 3).astype(np.float32)}
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        opts.inter_op_num_threads = 1
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        diff = float(np.abs(prog.run(feeds)["y"] - sess.run(None, feeds)[0]).max())
        ours = _median_ms(lambda: prog.run(feeds, copy_outputs=False))
        time.sleep(0.5)
        theirs = _median_ms(lambda: sess.run(None, feeds))
        print(f"{str(shape):18s} shardflow {ours:8.3f} ms   onnxruntime {theirs:8.3f} ms   ratio {ours / theirs:5.2f}"
              f"   max |diff| {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
