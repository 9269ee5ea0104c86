"""CPU time of single ops without a GEMM or conv in them, against onnxruntime: a survey for ops whose
generic lowering does more work than the op (rfcs/0002, session 25).

Each case is one ONNX node, compiled for one cpu rank. Prints the kernel's time alone
(``Program.profile``, 20 runs), our whole ``run()`` (its input and output copies included) and
onnxruntime's whole call (same thread count; alternating blocks of 10 calls, the minimum of 5
blocks), the ratios, and the largest difference of the first output (for the random draws, whose
generators differ, the two outputs' means and standard deviations).

    OPENBLAS_NUM_THREADS=1 python benchmarks/cpu_op_survey.py [--threads T] [CASE ...]    # default: every case

(``OPENBLAS_NUM_THREADS=1``: numpy's OpenBLAS threads otherwise spin beside the runs.) ``--threads T``:
``OMP_NUM_THREADS`` of our kernels and onnxruntime's intra-op threads (default: 2 for onnxruntime,
OpenMP's default for ours, one per core). The cases ``s1_*`` are the single ops of rfcs/0002's first
"Measured" table (session 1; products and convs among them), run with ``--threads 1``.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from shardflow.compiler import compile
from shardflow.runtime import load


def _f32(name, shape):
    return oh.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _i64(name, shape):
    return oh.make_tensor_value_info(name, TensorProto.INT64, shape)


def _const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def _case(op, inputs, outputs, consts=(), **attrs):
    """(model, input shapes): one ``op`` node reading ``inputs`` ({name: shape}) and constants."""
    node = oh.make_node(op, list(inputs) + [c.name for c in consts], [o.name for o in outputs], **attrs)
    graph = oh.make_graph([node], op, [_f32(n, s) for n, s in inputs.items()], outputs, list(consts))
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)])
    onnx.checker.check_model(model)
    return model, inputs


def cases(rng):
    pads = _const("p", np.array([0, 0, 3, 3, 0, 0, 3, 3], np.int64))
    img, padded = [1, 64, 128, 128], [1, 64, 134, 134]
    act, half = [8, 128, 768], [8, 128, 384]
    scales2 = [_const("roi", np.zeros(0, np.float32)), _const("sc", np.array([1, 1, 2, 2], np.float32))]
    return {
        "instnorm_64_128": _case("InstanceNormalization", {"x": img}, [_f32("y", img)],
                                 [_const("s", rng.standard_normal(64).astype(np.float32)),
                                  _const("b", rng.standard_normal(64).astype(np.float32))], epsilon=1e-5),
        "layernorm_512_768": _case("LayerNormalization", {"x": [512, 768]}, [_f32("y", [512, 768])],
                                   [_const("s", rng.standard_normal(768).astype(np.float32)),
                                    _const("b", rng.standard_normal(768).astype(np.float32))], axis=-1),
        "softmax_12_512": _case("Softmax", {"x": [12, 512, 512]}, [_f32("y", [12, 512, 512])], axis=-1),
        "pad_reflect": _case("Pad", {"x": img}, [_f32("y", padded)], [pads], mode="reflect"),
        "pad_edge": _case("Pad", {"x": img}, [_f32("y", padded)], [pads], mode="edge"),
        "pad_constant": _case("Pad", {"x": img}, [_f32("y", padded)], [pads], mode="constant"),
        "reducemean_hw": _case("ReduceMean", {"x": [1, 256, 56, 56]}, [_f32("y", [1, 256, 1, 1])],
                               [_const("a", np.array([2, 3], np.int64))], keepdims=1),
        "reduce_l2": _case("ReduceL2", {"x": [512, 1024]}, [_f32("y", [512])], [_const("a", np.array([1], np.int64))],
                           keepdims=0),
        "argmax": _case("ArgMax", {"x": [512, 1024]}, [_i64("y", [512])], axis=1, keepdims=0),
        "depth_to_space": _case("DepthToSpace", {"x": [1, 256, 64, 64]}, [_f32("y", [1, 64, 128, 128])], blocksize=2,
                                mode="CRD"),
        "cumsum": _case("CumSum", {"x": [64, 4096]}, [_f32("y", [64, 4096])], [_const("a", np.array(1, np.int64))]),
        "gelu": _case("Gelu", {"x": [512, 3072]}, [_f32("y", [512, 3072])]),
        "hardswish": _case("HardSwish", {"x": [1, 64, 112, 112]}, [_f32("y", [1, 64, 112, 112])]),
        "topk_64": _case("TopK", {"x": [64, 4096]}, [_f32("y", [64, 64]), _i64("i", [64, 64])],
                         [_const("k", np.array([64], np.int64))], axis=-1),
        "tile": _case("Tile", {"x": [1, 64, 64, 64]}, [_f32("y", [2, 64, 128, 128])],
                      [_const("r", np.array([2, 1, 2, 2], np.int64))]),
        "transpose_nhwc": _case("Transpose", {"x": img}, [_f32("y", [1, 128, 128, 64])], perm=[0, 2, 3, 1]),
        "einsum_bmm": _case("Einsum", {"x": [8, 128, 64], "w": [8, 64, 128]}, [_f32("y", [8, 128, 128])],
                            equation="bij,bjk->bik"),
        # an einsum projection (two row labels; session 94) and ViTDet's relative positions (rows apart)
        "einsum_proj": _case("Einsum", {"x": act}, [_f32("y", act)],
                             [_const("w", rng.standard_normal((768, 768)).astype(np.float32))], equation="bsh,hd->bsd"),
        "einsum_relpos": _case("Einsum", {"x": [12, 28, 28, 64]}, [_f32("y", [12, 28, 28, 28])],
                               [_const("r", rng.standard_normal((28, 28, 64)).astype(np.float32))],
                               equation="bhwc,hkc->bhwk"),
        "reducemax_mid": _case("ReduceMax", {"x": [64, 4096, 16]}, [_f32("y", [64, 16])],
                               [_const("a", np.array([1], np.int64))], keepdims=0),
        "softmax_mid": _case("Softmax", {"x": [16, 512, 64]}, [_f32("y", [16, 512, 64])], axis=1),
        "reducesum_mid1": _case("ReduceSum", {"x": [1, 2048, 4096]}, [_f32("y", [1, 4096])],
                                [_const("a", np.array([1], np.int64))], keepdims=0),
        "reducesum_cols": _case("ReduceSum", {"x": [2048, 4096]}, [_f32("y", [4096])],
                                [_const("a", np.array([0], np.int64))], keepdims=0),
        "layernorm_cf": _channels_first_layernorm(rng, [1, 96, 56, 56]),
        # a transformer's activations [8, 128, 768] and a CNN's images (session 88)
        "concat_last": _case("Concat", {"a": half, "b": half}, [_f32("y", act)], axis=-1),
        "split_last": _case("Split", {"x": act}, [_f32("y0", half), _f32("y1", half)], axis=-1, num_outputs=2),
        "expand": _case("Expand", {"x": [1, 128, 768]}, [_f32("y", act)], [_const("s", np.array(act, np.int64))]),
        "add_bias": _case("Add", {"a": act, "b": [768]}, [_f32("y", act)]),
        "exp": _case("Exp", {"x": act}, [_f32("y", act)]),
        "erf": _case("Erf", {"x": act}, [_f32("y", act)]),
        "tanh": _case("Tanh", {"x": act}, [_f32("y", act)]),
        "sigmoid": _case("Sigmoid", {"x": act}, [_f32("y", act)]),
        "maxpool": _case("MaxPool", {"x": [1, 64, 112, 112]}, [_f32("y", [1, 64, 56, 56])], kernel_shape=[3, 3],
                         strides=[2, 2], pads=[1, 1, 1, 1]),
        "avgpool": _case("AveragePool", {"x": [1, 64, 112, 112]}, [_f32("y", [1, 64, 56, 56])], kernel_shape=[3, 3],
                         strides=[2, 2], pads=[1, 1, 1, 1]),
        "global_avgpool": _case("GlobalAveragePool", {"x": [1, 512, 28, 28]}, [_f32("y", [1, 512, 1, 1])]),
        "resize_nearest": _case("Resize", {"x": [1, 64, 64, 64]}, [_f32("y", [1, 64, 128, 128])], scales2,
                                mode="nearest"),
        "resize_linear": _case("Resize", {"x": [1, 64, 64, 64]}, [_f32("y", [1, 64, 128, 128])], scales2,
                               mode="linear"),
        "reducemean_last": _case("ReduceMean", {"x": act}, [_f32("y", [8, 128, 1])],
                                 [_const("a", np.array([-1], np.int64))]),
        "bmm_scores": _case("MatMul", {"a": [12, 128, 64], "b": [12, 64, 128]}, [_f32("y", [12, 128, 128])]),
        "slice_step2": _case("Slice", {"x": act}, [_f32("y", half)], [_const(n, np.array([v], np.int64)) for n, v in
                                                                       (("st", 0), ("en", 768), ("ax", 2), ("sp", 2))]),
        "transpose_heads": _case("Transpose", {"x": [8, 128, 12, 64]}, [_f32("y", [8, 12, 128, 64])],
                                 perm=[0, 2, 1, 3]),
        "layernorm_8x128": _case("LayerNormalization", {"x": act}, [_f32("y", act)],
                                 [_const("s", rng.standard_normal(768).astype(np.float32)),
                                  _const("b", rng.standard_normal(768).astype(np.float32))], axis=-1),
        # rfcs/0002's first measured table (session 1: one thread)
        "s1_matmul_128x768x768": _case("MatMul", {"x": [128, 768]}, [_f32("y", [128, 768])],
                                       [_const("w", rng.standard_normal((768, 768)).astype(np.float32))]),
        "s1_conv3x3_64_56": _case("Conv", {"x": [1, 64, 56, 56]}, [_f32("y", [1, 64, 56, 56])],
                                  [_const("w", rng.standard_normal((64, 64, 3, 3)).astype(np.float32))],
                                  pads=[1, 1, 1, 1]),
        "s1_conv7x7s2_3_224": _case("Conv", {"x": [1, 3, 224, 224]}, [_f32("y", [1, 64, 112, 112])],
                                    [_const("w", rng.standard_normal((64, 3, 7, 7)).astype(np.float32))],
                                    pads=[3, 3, 3, 3], strides=[2, 2]),
        "s1_softmax_12_128": _case("Softmax", {"x": [12, 128, 128]}, [_f32("y", [12, 128, 128])], axis=-1),
        "s1_layernorm_128_768": _case("LayerNormalization", {"x": [128, 768]}, [_f32("y", [128, 768])],
                                      [_const("s", rng.standard_normal(768).astype(np.float32)),
                                       _const("b", rng.standard_normal(768).astype(np.float32))], axis=-1),
        "s1_erf_128_3072": _case("Erf", {"x": [128, 3072]}, [_f32("y", [128, 3072])]),
        "s1_tanh_128_3072": _case("Tanh", {"x": [128, 3072]}, [_f32("y", [128, 3072])]),
        # random draws (the engines' generators differ: 'moments' instead of a difference)
        "random_uniform": _case("RandomUniformLike", {"x": [1024, 1024]}, [_f32("y", [1024, 1024])], seed=1.0),
        "random_normal": _case("RandomNormalLike", {"x": [1024, 1024]}, [_f32("y", [1024, 1024])], seed=1.0),
    }


def _channels_first_layernorm(rng, shape):
    """A LayerNorm over the channels of NCHW as ConvNeXt's downsampling layers write it (ReduceMean, Sub,
    Pow, ReduceMean, Add, Sqrt, Div, Mul, Add): statistics over a middle axis."""
    c = shape[1]
    nodes = [oh.make_node("ReduceMean", ["x", "ax"], ["u"], keepdims=1), oh.make_node("Sub", ["x", "u"], ["d"]),
             oh.make_node("Pow", ["d", "two"], ["d2"]), oh.make_node("ReduceMean", ["d2", "ax"], ["s"], keepdims=1),
             oh.make_node("Add", ["s", "eps"], ["se"]), oh.make_node("Sqrt", ["se"], ["sq"]),
             oh.make_node("Div", ["d", "sq"], ["n"]), oh.make_node("Mul", ["n", "g"], ["ng"]),
             oh.make_node("Add", ["ng", "b"], ["y"])]
    consts = [_const("ax", np.array([1], np.int64)), _const("two", np.float32(2)), _const("eps", np.float32(1e-6)),
              _const("g", rng.standard_normal((c, 1, 1)).astype(np.float32)),
              _const("b", rng.standard_normal((c, 1, 1)).astype(np.float32))]
    graph = oh.make_graph(nodes, "layernorm_cf", [_f32("x", shape)], [_f32("y", shape)], consts)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)])
    onnx.checker.check_model(model)
    return model, {"x": shape}


def _calls(fn, blocks=5, per=10):
    fn()
    best = float("inf")
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(per):
            fn()
        best = min(best, (time.perf_counter() - t) / per * 1e3)
    return best


def main(argv) -> None:
    threads = 2
    if "--threads" in argv:
        at = argv.index("--threads")
        threads = int(argv[at + 1])
        os.environ["OMP_NUM_THREADS"] = str(threads)  # (read when the first kernel library loads OpenMP)
        argv = argv[:at] + argv[at + 2:]
    only = argv
    rng = np.random.default_rng(0)
    work = tempfile.mkdtemp(prefix="sf-op-survey-")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    for name, (model, shapes) in cases(rng).items():
        if only and name not in only:
            continue
        feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        out = f"{work}/{name}"
        compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=out)
        prog = load(out)
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        first = model.graph.output[0].name
        a, b = prog.run(feeds)[first], sess.run(None, feeds)[0]
        agree = (f"max |diff| {float(np.abs(a - b).max()):.1e}" if not name.startswith("random") else
                 f"moments: mean {a.mean():+.4f} / {b.mean():+.4f}, sd {a.std():.4f} / {b.std():.4f}")
        kernel = sum(p["ms"] for p in prog.profile(feeds, repeat=20, warmup=3))
        ours = theirs = float("inf")
        for _ in range(2):  # alternate the engines
            ours = min(ours, _calls(lambda: prog.run(feeds)))
            theirs = min(theirs, _calls(lambda: sess.run(None, feeds)))
        print(f"{name:20s} kernel {kernel:8.3f} ms  run {ours:8.3f} ms  onnxruntime {theirs:8.3f} ms  "
              f"run/ort {ours / theirs:5.2f}  kernel/ort {kernel / theirs:5.2f}  {agree}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
