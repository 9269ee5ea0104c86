"""CPU latency of single convolutions (each followed by a Relu, fused into it) vs onnxruntime.
The ``silu_`` shapes are followed by SiLU written as ``x * sigmoid(x)`` instead.
The ``int8_`` shapes are ``ConvInteger`` nodes instead (uint8 image, int8 weight, int32 output: the
integer conv, ``cpu_library/conv_int8.h``).

The shapes are ResNet-50's (one 224x224 image): 3x3 and 1x1 convs at 56x56, 28x28, 14x14 and
7x7, the 7x7 stride-2 stem and the stride-2 ones; and VGG-19's wider 3x3s. Each is compiled for one cpu rank and run with
``shardflow.runtime.load``; onnxruntime (all graph optimizations, so its NCHWc kernels) runs the
same model with the same thread count, timed apart from ours (its pool's threads spin after a run).
Prints median latencies, GFLOP/s, the ratio (ours / onnxruntime; lower is better) and the largest
difference of the outputs.

``--dirs A,B`` instead loads builds made earlier with ``--build-only --tag A`` (e.g. one per
commit) and times them round-robin in one process, so that two versions of the kernels are
compared under the same drift of the machine's speed.

    python benchmarks/cpu_conv.py [--threads 2] [--repeat 30] [--only 3x3_56,stem]
    python benchmarks/cpu_conv.py --build-only --tag old --work /tmp/convs   # at one commit
    python benchmarks/cpu_conv.py --dirs old,new --work /tmp/convs           # after building both
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_latency import _cpu_model, _medians_ms  # noqa: E402

# name: (input channels, input height = width, output channels, kernel, stride, pad)
SHAPES = {
    "3x3_56": (64, 56, 64, 3, 1, 1), "1x1_56_64_256": (64, 56, 256, 1, 1, 0), "1x1_56_256_64": (256, 56, 64, 1, 1, 0),
    "1x1_28_512_128": (512, 28, 128, 1, 1, 0), "1x1_28_128_512": (128, 28, 512, 1, 1, 0),
    "3x3_28": (128, 28, 128, 3, 1, 1), "3x3_14": (256, 14, 256, 3, 1, 1), "3x3_7": (512, 7, 512, 3, 1, 1),
    "1x1_14_1024_256": (1024, 14, 256, 1, 1, 0), "1x1_14_256_1024": (256, 14, 1024, 1, 1, 0),
    "1x1_7_512_2048": (512, 7, 2048, 1, 1, 0), "1x1_7_2048_512": (2048, 7, 512, 1, 1, 0),
    "stem_7x7_s2": (3, 224, 64, 7, 2, 3), "3x3_s2_56": (128, 56, 128, 3, 2, 1),
    "1x1_s2_56_256_512": (256, 56, 512, 1, 2, 0),
    # VGG-19's 3x3s beyond ResNet-50's (wide channels on large images)
    "3x3_224_64": (64, 224, 64, 3, 1, 1), "3x3_112_128": (128, 112, 128, 3, 1, 1),
    "3x3_56_256": (256, 56, 256, 3, 1, 1), "3x3_28_512": (512, 28, 512, 3, 1, 1),
    "3x3_14_512": (512, 14, 512, 3, 1, 1),
    # stride-2 3x3s of 512 <= K < 1024 (Inception-v2's 96->96 at 28x28; wider images)
    "3x3_s2_28_96": (96, 28, 96, 3, 2, 1), "3x3_s2_56_64_128": (64, 56, 128, 3, 2, 1),
    "3x3_s2_112_64": (64, 112, 64, 3, 2, 1), "3x3_s2_112_32_64": (32, 112, 64, 3, 2, 1),
}


# grouped 3x3s (a 7th field: the groups): RegNetY-4GF's (64 channels a group; stage 0's at 112x112 stride 2
# and 56x56, stage 1's 192 in 3 groups, stage 2's 512 in 8, stage 3's 1088 in 17) and ResNeXt-50's
# (32 groups of 4 to 32 channels)
SHAPES.update({"g2_3x3_s2_112_128": (128, 112, 128, 3, 2, 1, 2), "g2_3x3_56_128": (128, 56, 128, 3, 1, 1, 2),
               "g3_3x3_28_192": (192, 28, 192, 3, 1, 1, 3), "g8_3x3_14_512": (512, 14, 512, 3, 1, 1, 8),
               "g17_3x3_7_1088": (1088, 7, 1088, 3, 1, 1, 17), "g32_3x3_56_128": (128, 56, 128, 3, 1, 1, 32),
               "g32_3x3_28_256": (256, 28, 256, 3, 1, 1, 32), "g32_3x3_14_512": (512, 14, 512, 3, 1, 1, 32)})

# the same shapes as ConvInteger (uint8 image with a zero point, int8 weight, int32 output; PackedConvInteger,
# cpu_library/conv_int8.h), no Relu; "GFLOP/s" counts their multiply-adds as two operations
SHAPES.update({f"int8_{k}": SHAPES[k] for k in ("3x3_56", "1x1_56_64_256", "1x1_56_256_64", "3x3_28", "3x3_14",
                                                "3x3_7", "1x1_14_1024_256", "1x1_7_2048_512", "stem_7x7_s2",
                                                "3x3_s2_56")})

# SiLU (x * sigmoid(x), as exporters write it) instead of the Relu: YOLO- and EfficientNet-style convs; the
# conv's value read twice, the conv template's epilogue computes both (rfcs/0002, session 87)
SHAPES.update({"silu_1x1_80_64": (64, 80, 64, 1, 1, 0), "silu_3x3_160_32_64": (32, 160, 64, 3, 1, 1),
               "silu_3x3_40_128": (128, 40, 128, 3, 1, 1), "silu_1x1_20_256": (256, 20, 256, 1, 1, 0),
               "silu_3x3_s2_80_64_128": (64, 80, 128, 3, 2, 1),
               # YOLOv8n's bottleneck convs: one block of 16 channels in and out
               "silu_3x3_160_16": (16, 160, 16, 3, 1, 1)})


def _model(name: str, path: str):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    C, H, OC, K, S, P, *grouped = SHAPES[name]
    G = grouped[0] if grouped else 1
    rng = np.random.default_rng(0)
    if name.startswith("int8_"):
        OH = (H + 2 * P - K) // S + 1
        node = helper.make_node("ConvInteger", ["x", "w", "xzp"], ["y"], kernel_shape=[K, K], strides=[S, S],
                                pads=[P] * 4)
        g = helper.make_graph([node], name, [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, C, H, H])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [1, OC, OH, OH])],
                              [numpy_helper.from_array(rng.integers(-128, 128, (OC, C, K, K)).astype(np.int8), "w"),
                               numpy_helper.from_array(np.array(117, np.uint8), "xzp")])
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
        return rng.integers(0, 256, (1, C, H, H)).astype(np.uint8), 2.0 * OC * C * K * K * OH * OH
    w = (rng.standard_normal((OC, C // G, K, K)) * 0.1).astype(np.float32)
    b = rng.standard_normal(OC).astype(np.float32)
    OH = (H + 2 * P - K) // S + 1
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[K, K], strides=[S, S], pads=[P] * 4,
                              group=G)]
    if name.startswith("silu_"):
        nodes += [helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["y"])]
    else:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, H, H])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, OC, OH, OH])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return rng.standard_normal((1, C, H, H)).astype(np.float32), 2.0 * OC * (C // G) * K * K * OH * OH


def main(argv=None, shapes=None, model=None, description=None) -> None:
    """Time one compiled model per shape name against onnxruntime (``model(name, path)`` writes the
    model with input ``x`` and output ``y`` and returns ``(x, flops)``, or ``(x, flops, ort_path)`` when
    onnxruntime is to run another model with the same input and output, e.g. the float32 graph of a
    float16 model's values); :mod:`cpu_gemm` reuses it."""
    shapes, model = shapes or SHAPES, model or _model
    ap = argparse.ArgumentParser(description=(description or __doc__).split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated shape names")
    ap.add_argument("--work", default=None, help="folder for the models and builds (default: a temporary one)")
    ap.add_argument("--build-only", action="store_true", help="compile the builds tagged --tag and stop")
    ap.add_argument("--tag", default="current")
    ap.add_argument("--dirs", default="", help="comma-separated tags of earlier builds to time round-robin")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import onnxruntime as ort

    from shardflow.compiler import compile
    from shardflow.runtime import load

    names = [n for n in args.only.split(",") if n] or list(shapes)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        ap.error(f"--only: unknown shape name(s) {unknown}; the names are {', '.join(shapes)}")
    work = args.work or tempfile.mkdtemp(prefix="shardflow-kernels-")
    os.makedirs(work, exist_ok=True)
    tags = [t for t in args.dirs.split(",") if t] or [args.tag]
    print(f"cpu: {_cpu_model()}, {os.cpu_count()} logical cores; threads: {args.threads}; onnxruntime "
          f"{ort.__version__}; builds: {', '.join(tags)}")
    for name in names:
        path = os.path.join(work, f"{name}.onnx")
        x, flops, *ort_path = model(name, path)
        if not args.dirs:
            compile(path, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                    out_dir=os.path.join(work, f"{name}-{args.tag}"))
        if args.build_only:
            continue
        progs = [load(os.path.join(work, f"{name}-{t}"), rank=0) for t in tags]
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        opts.inter_op_num_threads = 1
        sess = ort.InferenceSession(ort_path[0] if ort_path else path, opts, providers=["CPUExecutionProvider"])
        ref = sess.run(None, {"x": x})[0]
        err = max(float(np.max(np.abs(p.run({"x": x})["y"] - ref))) for p in progs)
        *ours, theirs = _medians_ms([lambda p=p: p.run({"x": x}, copy_outputs=False) for p in progs]
                                    + [lambda: sess.run(None, {"x": x})], args.repeat, block=5)
        cols = "  ".join(f"{t} {m:7.3f} ms ({flops / m / 1e6:5.1f} GF/s, ratio {m / theirs:4.2f})"
                         for t, m in zip(tags, ours))
        print(f"{name:<18} {cols}   onnxruntime {theirs:7.3f} ms ({flops / theirs / 1e6:5.1f} GF/s)   "
              f"max |diff| {err:.0e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
