"""CPU latency of a mixture of experts (onnxruntime's ``MoE``) routed and dense, vs onnxruntime.

Each shape is one ``MoE`` node as onnxruntime-genai's builder writes gpt-oss's (SwiGLU on interleaved
columns with alpha 1.702, beta 1 and limit 7, biases, routing weights renormalized), on float32
activations ``x[T, H]``, compiled for one cpu rank. Side by side in one run: ours as the import writes
it routed (``ExpertMatMul``: each token's k experts, the slots grouped by expert, each chosen expert's
weight read once) and dense (every expert on every token, then the weighted sum), with what
``handlers_contrib.moe_routed`` picks for the cpu target (routed) and the others noted, and
onnxruntime's MoE CPU kernel. Prints median latencies, the ratios to onnxruntime and the
largest difference from it.

    python benchmarks/cpu_moe.py [--threads 2] [--repeat 20] [--only e32k4_h768_t1]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_latency import _cpu_model, _medians_ms, _onnxruntime  # noqa: E402

# name: (tokens T, experts E, chosen k, hidden H, expert width F): gpt-oss's routing (32 experts, 4 chosen)
# at a quarter of gpt-oss-20b's width (2880), decoding 1-7 tokens and prompts of 8-128; Mixtral's (8, 2)
SHAPES = {
    "e32k4_h768_t1": (1, 32, 4, 768, 768), "e32k4_h768_t2": (2, 32, 4, 768, 768),
    "e32k4_h768_t4": (4, 32, 4, 768, 768), "e32k4_h768_t7": (7, 32, 4, 768, 768),
    "e32k4_h768_t8": (8, 32, 4, 768, 768), "e32k4_h768_t16": (16, 32, 4, 768, 768),
    "e32k4_h768_t32": (32, 32, 4, 768, 768), "e32k4_h768_t64": (64, 32, 4, 768, 768),
    "e32k4_h768_t128": (128, 32, 4, 768, 768), "e8k2_h1024_t1": (1, 8, 2, 1024, 1024),
    "e8k2_h1024_t3": (3, 8, 2, 1024, 1024), "e8k2_h1024_t8": (8, 8, 2, 1024, 1024),
    "e8k2_h1024_t32": (32, 8, 2, 1024, 1024),
}


def _model(name: str, path: str) -> tuple[np.ndarray, np.ndarray]:
    """Write the shape's MoE node to ``path``; return its ``x`` and router logits."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    T, E, k, H, F = SHAPES[name]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((E, 2 * F, H)) / np.sqrt(H)).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal((E, 2 * F)) * 0.1).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((E, H, F)) / np.sqrt(F)).astype(np.float32), "w2"),
             numpy_helper.from_array((rng.standard_normal((E, H)) * 0.1).astype(np.float32), "b2")]
    node = helper.make_node("MoE", ["x", "router", "w1", "b1", "w2", "b2"], ["y"], domain="com.microsoft", k=k,
                            activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.702, activation_beta=1.0,
                            swiglu_limit=7.0, normalize_routing_weights=1)
    g = helper.make_graph([node], name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, H]),
                                         helper.make_tensor_value_info("router", TensorProto.FLOAT, [T, E])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, H])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(g, opset_imports=opsets), path)
    return rng.standard_normal((T, H)).astype(np.float32), rng.standard_normal((T, E)).astype(np.float32)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated shape names")
    ap.add_argument("--work", default=None, help="folder for the models and builds (default: a temporary one)")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import onnxruntime as ort

    from shardflow.compiler import compile
    from shardflow.compiler.frontend import handlers_contrib
    from shardflow.runtime import load

    names = [n for n in args.only.split(",") if n] or list(SHAPES)
    work = args.work or tempfile.mkdtemp(prefix="shardflow-moe-")
    os.makedirs(work, exist_ok=True)
    print(f"cpu: {_cpu_model()}, {os.cpu_count()} logical cores; threads: {args.threads}; onnxruntime "
          f"{ort.__version__}; MoE with SwiGLU, biases, float32")
    routed_rule = handlers_contrib.moe_routed
    for name in names:
        T, E, k, H, F = SHAPES[name]
        path = os.path.join(work, f"{name}.onnx")
        x, router = _model(name, path)
        feeds = {"x": x, "router": router}
        progs = {}
        for kind in ("routed", "dense"):
            handlers_contrib.moe_routed = (lambda *_: True) if kind == "routed" else (lambda *_: False)
            try:
                out = os.path.join(work, f"{name}-{kind}-out")
                compile(path, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"},
                        out_dir=out)
            finally:
                handlers_contrib.moe_routed = routed_rule
            progs[kind] = load(out, rank=0)
        sess = _onnxruntime(path, args.threads)
        ref = sess.run(None, feeds)[0]
        errs = {kind: float(np.max(np.abs(p.run(feeds)["y"] - ref)) / np.max(np.abs(ref))) for kind, p in progs.items()}
        fns = [lambda p=p: p.run(feeds, copy_outputs=False) for p in progs.values()]
        times = dict(zip(list(progs) + ["onnxruntime"], _medians_ms(fns + [lambda: sess.run(None, feeds)], args.repeat,
                                                                      block=5)))
        ort_ms = times["onnxruntime"]
        cols = "  ".join(f"{kind} {times[kind]:8.3f} ms (ratio {times[kind] / ort_ms:5.2f}, diff {errs[kind]:.0e})"
                         for kind in progs)
        pick = "routed" if routed_rule(T, k, E) else "dense"
        print(f"{name:<15} T {T:>3} E {E:>2} k {k}  {cols}  onnxruntime {ort_ms:8.3f} ms  (the import: routed for "
              f"cpu, {pick} for cuda)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
