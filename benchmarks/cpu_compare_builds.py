"""Per-kernel times of two cpu builds of one model, paired: which kernels a change made faster or slower.

Both builds (``compile(..., out_dir=DIR)`` with ``mesh_shape [1]`` and target ``cpu``, e.g. one at an old
commit and one at the new) are loaded in one process and profiled in alternating rounds
(``Program.profile``: each kernel step timed on its own, in program order). This VM's speed changes by up to
2x within minutes, so figures taken apart are not comparable; alternating rounds see the same phases, and the
ratio is taken per round (new / old), then its median. Prints per kernel: the old and new minimum over the
rounds (ms), the paired ratio and the node; first the sums, and whole runs (``run``, median of each round's
runs) paired the same way. Builds whose steps differ (a change that removes or fuses kernels) are compared by
their sums and whole runs, and kernel by kernel where a node is in both; the others are listed.

    python benchmarks/cpu_compare_builds.py OLD_DIR NEW_DIR [--rounds 21] [--only conv_3x3] [--build MODEL.onnx]
                                            [--precision bfloat16]

``--build MODEL.onnx`` compiles the model into NEW_DIR first (with the checked-out code; ``--precision``: at that
``optimization_config["precision"]``). Inputs: random
normal floats (the program's input shapes and dtypes), the same for both builds.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import ml_dtypes
import numpy as np


def before_and_after(model: str, feeds: dict, before, title: str, rounds: int, only: str = "") -> None:
    """Compile ``model`` for one cpu rank twice, inside the context manager ``before`` (the code as a
    change found it: ``old``) and as it is (``new``), print ``title``, the paired report of the two
    builds (:func:`main`), then onnxruntime's median on ``model`` with ``feeds`` (as many threads as
    cores, ``5 * rounds`` runs)."""
    import tempfile

    import onnxruntime as ort
    from shardflow.compiler import compile

    work = tempfile.mkdtemp(prefix="sf-before-after-")
    old, new = os.path.join(work, "old"), os.path.join(work, "new")
    with before:
        compile(model, distributed_config={"mesh_shape": [1]}, out_dir=old)
    compile(model, distributed_config={"mesh_shape": [1]}, out_dir=new)
    print(title)
    main([old, new, "--rounds", str(rounds)] + (["--only", only] if only else []))
    so = ort.SessionOptions()
    so.intra_op_num_threads = os.cpu_count() or 1
    sess = ort.InferenceSession(model, so)
    sess.run(None, feeds)
    laps = []
    for _ in range(5 * rounds):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        laps.append(time.perf_counter() - t0)
    print(f"onnxruntime: median {1e3 * float(np.median(laps)):.3f} ms, min {1e3 * min(laps):.3f} ms "
          f"({os.cpu_count()} threads)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--repeat", type=int, default=5, help="runs per round and build")
    ap.add_argument("--only", default="", help="print only the kernels whose node name contains this text")
    ap.add_argument("--build", default="", help="compile this model into NEW first")
    ap.add_argument("--precision", default="float32", help="with --build: the precision it compiles at")
    args = ap.parse_args(argv)
    from shardflow.runtime import load

    if args.build:
        from shardflow.compiler import compile
        compile(args.build, distributed_config={"mesh_shape": [1]},
                optimization_config={"target": "cpu", "precision": args.precision}, out_dir=args.new)
    dirs = [args.old, args.new]
    progs = [json.load(open(os.path.join(d, "rank0", "program.json"))) for d in dirs]
    # the steps a run times: not those run once at load (``load_steps``, compile's "precompute")
    names = [[s["node"] for s in p["steps"][p.get("load_steps", 0):]] for p in progs]
    if names[0] != names[1]:
        only = [[n for n in names[k] if n not in set(names[1 - k])] for k in range(2)]
        print(f"steps only in old: {len(only[0])} {only[0][:8]}{' ...' if len(only[0]) > 8 else ''}")
        print(f"steps only in new: {len(only[1])} {only[1][:8]}{' ...' if len(only[1]) > 8 else ''}")
    bufs = {b["name"]: b for b in progs[0]["buffers"]}
    rng = np.random.default_rng(0)
    dtype = {"bfloat16": ml_dtypes.bfloat16}  # (numpy knows no "bfloat16" by name)
    feeds = {n: rng.standard_normal(bufs[n]["shape"]).astype(dtype.get(bufs[n]["dtype"], bufs[n]["dtype"]))
             for n, _ in progs[0]["inputs"]}
    ps = [load(d, rank=0) for d in dirs]
    times, runs = [[], []], [[], []]
    for _ in range(args.rounds):
        for k in range(2):
            times[k].append([s["ms"] for s in ps[k].profile(feeds, repeat=args.repeat, warmup=1)])
            ps[k].run(feeds, copy_outputs=False)
            laps = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                ps[k].run(feeds, copy_outputs=False)
                laps.append(time.perf_counter() - t0)
            runs[k].append(1e3 * float(np.median(laps)))
    old, new = (np.array(t) for t in times)
    run_old, run_new = (np.array(r) for r in runs)
    print(f"sum of the kernels: old {old.min(0).sum():.3f} ms, new {new.min(0).sum():.3f} ms, "
          f"paired {np.median(new.sum(1) / old.sum(1)):.3f}")
    print(f"whole runs: old {run_old.min():.3f} ms, new {run_new.min():.3f} ms, "
          f"paired {np.median(run_new / run_old):.3f}")
    at = {n: i for i, n in enumerate(names[1])}
    for i, n in enumerate(names[0]):
        if args.only in n and n in at:
            j = at[n]
            print(f"{old[:, i].min():9.4f} {new[:, j].min():9.4f}  paired {np.median(new[:, j] / old[:, i]):5.2f}  {n}")


if __name__ == "__main__":
    main()
