"""Measured: pipeline stages cut on the cost model's roofline times against cut on the ops' measured times
(``distributed_config["pipeline_balance"]``), on this machine's cpu ranks, in one run.

For each model (onnx's light CNNs, one image) and count of stages P, compiles ``pipeline_stages = P`` on
mesh [P] twice (``pipeline_balance`` ``modeled`` and ``measured``), prints each stage's op count, each
stage's time as a compile-time profile measures it (one rank with the threads a rank of P gets here: the
times the measured cut balances), the bytes crossing the cut and, run with ``shardflow run --nproc P
--repeat R --throughput`` (each rank bound to its share of the cores), a single run's median and the
pace of runs back to back (the stages overlap across runs: the slowest stage's time), with the largest
difference of the output from the model's reference.

    OPENBLAS_NUM_THREADS=1 python benchmarks/cpu_pipeline_balance.py [--models resnet50 densenet121]
        [--stages 2] [--repeat 20]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet50", "densenet121"])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    import onnx
    import onnxruntime as ort

    from cpu_pipeline import _run

    from shardflow.compiler import compile, load_onnx
    from shardflow.compiler.parallel.cost import DEVICE_PROFILES
    from shardflow.compiler.stages import measured_op_times

    light = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    n = args.stages
    print(f"# onnx light models, {n} stages on mesh [{n}]; {os.cpu_count()} cores; `shardflow run --repeat "
          f"{args.repeat} --throughput` (rank 0), measured")
    print(f"{'model':<14} {'balance':<9} {'ops a stage':<18} {'profiled ms a stage':<26} {'cut MB':>8} "
          f"{'run ms':>8} {'pace ms':>8} {'max |diff|':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = os.path.join(light, f"light_{name}.onnx")
            model = onnx.load(path)
            weights = {t.name for t in model.graph.initializer}
            first = next(i for i in model.graph.input if i.name not in weights)  # (old models list weights too)
            x = np.random.default_rng(0).standard_normal([d.dim_value for d in first.type.tensor_type.shape.dim])
            x = x.astype(np.float32)
            inputs = os.path.join(tmp, f"{name}_in.npz")
            np.savez(inputs, **{first.name: x})
            ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {first.name: x})[0]
            g = load_onnx(path)
            # (timed as the compile times them: the threads a rank gets when the n ranks share this machine)
            times = measured_op_times(g, {"target": "cpu"}, DEVICE_PROFILES["cpu"], ranks=n)
            for balance in ("modeled", "measured"):
                out = os.path.join(tmp, f"{name}_{balance}")
                res = compile(path, distributed_config={"mesh_shape": [n], "pipeline_stages": n,
                                                        "pipeline_balance": balance},
                              optimization_config={"target": "cpu"}, out_dir=out)
                ops = [st["ops"] for st in res.pipeline["stages"]]
                crossing = sum(int(np.prod(e["shape"])) * np.dtype(e["dtype"]).itemsize
                               for e in res.pipeline["transfers"] if e["kind"] == "cut")
                at, per = 0, []
                for k in ops:
                    per.append(sum(times[at:at + k]) * 1e3)
                    at += k
                got = os.path.join(tmp, "out.npz")
                one, pace = _run(out, n, inputs, got, args.repeat, throughput=True)
                diff = float(np.abs(next(iter(np.load(got).values())) - ref).max())
                print(f"{name:<14} {balance:<9} {'/'.join(map(str, ops)):<18} "
                      f"{'/'.join(f'{t:.2f}' for t in per):<26} {crossing / 1e6:>8.2f} {one:>8.2f} {pace:>8.2f} "
                      f"{diff:>11.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
