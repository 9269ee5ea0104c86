"""Winograd against the direct conv for 3x3 stride-1 convs between blocked convs, per shape, on the cpu target.

Each shape ``C -> OC`` at ``H x H`` is a model ``1x1 conv C -> C, Relu -> 3x3 conv C -> OC, Relu -> 1x1
conv OC -> 16, Relu``, so that the 3x3 reads and writes the blocked layout as it does inside a CNN
(passes/layout.py). It is compiled twice for one cpu rank, ``winograd`` on (with Winograd wherever
its tile rule allows, ``prepack.WINOGRAD_MIN_WORK`` set aside) and off, and each build's 3x3 step is
timed inside whole runs (``Program.profile``); the two builds alternate ``--rounds`` times and the
medians are printed with the ratio Winograd / direct (below 1: Winograd faster) and the tile the
compiler picks by default (``prepack.winograd_tile``, 0: direct). On images of at most 64 pixels
with ``C * 9 >= 1024`` both builds run the direct conv (``prepack.SMALL_MAX_PIXELS``). The 3x3's weights stay in the caches between runs
here, as they do not in a large model; ``benchmarks/cpu_nodes.py`` times the convs of a whole model.

    python benchmarks/cpu_winograd.py [--sizes 7,14,28,56] [--channels 64:64,128:128] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import numpy as np

CHANNELS = "64:64,64:96,96:96,96:128,128:128,128:192,192:192,192:256,256:256,320:320,512:512"


def _model(c: int, oc: int, h: int, path: str) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def w(*shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32))

    inits = [w(c, c, 1, 1), w(oc, c, 3, 3), w(16, oc, 1, 1)]
    for t, name in zip(inits, ("w1", "w3", "w2")):
        t.name = name
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["a"], ["ra"]),
             helper.make_node("Conv", ["ra", "w3"], ["b"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["b"], ["rb"]),
             helper.make_node("Conv", ["rb", "w2"], ["c"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "winograd", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, h, h])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, h, h])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def _step_index(build: str, tensor: str) -> int:
    """The index, among the kernel steps, of the step writing ``tensor``."""
    program = json.load(open(os.path.join(build, "rank0", "program.json")))
    steps = [s for s in program["steps"][program.get("load_steps", 0):] if s["kind"] == "kernel"]
    for k, s in enumerate(steps):
        if program["buffers"][s["outputs"][0]]["name"] == tensor:
            return k
    raise RuntimeError(f"no kernel step writes {tensor} in {build}")


def main(argv=None) -> None:
    from shardflow.compiler import compile
    from shardflow.compiler.passes import prepack
    from shardflow.runtime import load

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="7,14,28,56", help="output heights (= widths)")
    ap.add_argument("--channels", default=CHANNELS, help="comma-separated C:OC pairs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="runs per profile")
    ap.add_argument("--work", default=None)
    args = ap.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="sf-winograd-")
    os.makedirs(work, exist_ok=True)
    print(f"{'C':>5} {'OC':>5} {'H':>4} {'tile':>4}  {'winograd ms':>11} {'direct ms':>10}  {'ratio':>6}  "
          "direct GFLOP/s")
    for pair in args.channels.split(","):
        c, oc = (int(v) for v in pair.split(":"))
        for h in (int(v) for v in args.sizes.split(",")):
            path = os.path.join(work, f"m_{c}_{oc}_{h}.onnx")
            _model(c, oc, h, path)
            x = {"x": np.random.default_rng(1).standard_normal((1, c, h, h)).astype(np.float32)}
            progs, idx = [], []
            for wino in (True, False):
                build = os.path.join(work, f"b_{c}_{oc}_{h}_{int(wino)}")
                if not os.path.exists(build):
                    # Winograd wherever its tile rule allows it, without the work it needs against the
                    # blocked direct conv (the choice this benchmark informs)
                    rule = dict(prepack.WINOGRAD_MIN_WORK)
                    prepack.WINOGRAD_MIN_WORK.update({4: 0, 2: 0})
                    try:
                        compile(path, distributed_config={"mesh_shape": [1]},
                                optimization_config={"target": "cpu", "winograd": wino}, out_dir=build)
                    finally:
                        prepack.WINOGRAD_MIN_WORK.update(rule)
                progs.append(load(build, rank=0))
                idx.append(_step_index(build, "rb"))
            times: list[list[float]] = [[], []]
            for _ in range(args.rounds):
                for k, p in enumerate(progs):
                    prof = [o for o in p.profile(x, repeat=args.reps, warmup=2) if o["kind"] == "kernel"]
                    times[k].append(prof[idx[k]]["ms"])
            wms, dms = statistics.median(times[0]), statistics.median(times[1])
            tile = prepack.winograd_tile(c, oc, h, h, blocked=True)
            flops = 2.0 * c * oc * 9 * h * h
            print(f"{c:5d} {oc:5d} {h:4d} {tile:4d}  {wms:11.3f} {dms:10.3f}  {wms / dms:6.2f}  "
                  f"{flops / dms / 1e6:8.1f}", flush=True)


if __name__ == "__main__":
    main()
