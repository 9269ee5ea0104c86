"""Per-node times of a cpu rank program against onnxruntime's, node by node, inside whole runs.

    python benchmarks/cpu_nodes.py MODEL.onnx [--build DIR] [--reps 20] [--threads 2] [key=value ...]

The model's nodes are renamed ``n0, n1, ...`` (onnxruntime's profiler names its events after them),
it is compiled for one cpu rank (``key=value``: more ``optimization_config``, ``true``/``false`` for
switches; ``--build`` keeps or reuses the build) and profiled with ``Program.profile`` (each kernel
step's time inside whole runs, load steps left out); onnxruntime runs the same random inputs with its
profiler on and the same thread count. A step is matched with onnxruntime's node that writes the
same tensor (its NCHWc nodes are named after that tensor, the others after the renamed node; a fused
group is named after its last op, and onnxruntime fuses too, so some rows have no match: ``nan``). Prints per step: its output, kind, our median ms, onnxruntime's, the ratio and the
shapes; then both totals. Unlike ``cpu_profile.py`` (each kernel called on its own, warm), the
figures include what a kernel pays for the caches the kernels before it left.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile

import numpy as np


def main(argv=None) -> None:
    import onnx
    import onnxruntime as ort

    from shardflow.compiler import compile
    from shardflow.runtime import load

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("options", nargs="*", help="optimization_config key=value")
    ap.add_argument("--build", default=None, help="build folder (kept; reused when it exists)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="sf-nodes-")
    m = onnx.load(args.model)
    for i, n in enumerate(m.graph.node):
        n.name = f"n{i}"
    named = os.path.join(work, "named.onnx")
    onnx.save(m, named)
    build = args.build or os.path.join(work, "build")
    opt = {"target": "cpu"}
    for kv in args.options:
        k, v = kv.split("=", 1)
        opt[k] = {"true": True, "false": False}.get(v, v)
    if not os.path.exists(build):
        compile(named, distributed_config={"mesh_shape": [1]}, optimization_config=opt, out_dir=build)
    prog = load(build, rank=0)
    inits = {i.name for i in m.graph.initializer}
    rng = np.random.default_rng(0)
    feeds = {}
    for i in m.graph.input:
        if i.name in inits:
            continue
        shape, dtype = [d.dim_value for d in i.type.tensor_type.shape.dim], onnx.helper.tensor_dtype_to_np_dtype(
            i.type.tensor_type.elem_type)
        if dtype.kind == "f":
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
        else:  # token ids below every vocabulary's size; masks of ones
            feeds[i.name] = np.ones(shape, dtype) if "mask" in i.name else rng.integers(0, 100, shape).astype(dtype)
    ours = [o for o in prog.profile(feeds, repeat=args.reps, warmup=2) if o["kind"] == "kernel"]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(work, "ort")
    sess = ort.InferenceSession(named, opts, providers=["CPUExecutionProvider"])
    for _ in range(args.reps + 3):
        sess.run(None, feeds)
    events = json.load(open(sess.end_profiling()))
    per, run = collections.defaultdict(list), -1
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            run += 1
        elif e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and run >= 3:
            per[(e["name"][:-len("_kernel_time")], e["args"].get("op_name"))].append(e["dur"] / 1e3)
    # onnxruntime's node name -> (op, median ms); its layout-changed copies end in _nchwc
    theirs = {nm.replace("_nchwc", ""): (op, statistics.median(v)) for (nm, op), v in per.items()}
    out_node = {o: n.name for n in m.graph.node for o in n.output}
    program = json.load(open(os.path.join(build, "rank0", "program.json")))
    bufs = program["buffers"]
    steps = [s for s in program["steps"][program.get("load_steps", 0):] if s["kind"] == "kernel"]
    total = [0.0, 0.0]
    for st, o in zip(steps, ours):
        out = bufs[st["outputs"][0]]
        # its NCHWc nodes are named after their output tensor, the others keep the node's name
        op, ms = theirs.get(out["name"]) or theirs.get(out_node.get(out["name"], ""), ("?", float("nan")))
        total[0] += o["ms"]
        total[1] += 0.0 if ms != ms else ms
        ins = [bufs[i]["shape"] for i in st["inputs"] if bufs[i]["storage"] != "weights"]
        print(f"{out['name'][-48:]:48} {o['what']:12} ours {o['ms']:7.3f} ort {ms:7.3f} ratio {o['ms'] / ms:5.2f} "
              f"{op:12} in {ins[0] if ins else '-'} out {out['shape']}")
    print(f"kernels summed: ours {total[0]:.3f} ms, onnxruntime's matched nodes {total[1]:.3f} ms, all its nodes "
          f"{sum(v for _, v in theirs.values()):.3f} ms")


if __name__ == "__main__":
    main()
