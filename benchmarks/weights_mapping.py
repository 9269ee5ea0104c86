"""A rank's weights read into its memory against mapped (``shardflow.runtime.load(map_weights=)``,
rfcs/0003 "Mapped weights"): load time, the process's anonymous and file-backed memory after loading,
and, for a cpu out_dir, the run time of both programs interleaved in one process.

Each way loads in a fresh process (so that one's memory does not count in the other's), ``--rounds``
times alternately; then, for a cpu out_dir, one process loads both and times ``--repeat`` runs of each in
turn (the same inputs, both outputs compared bit for bit). A cuda out_dir is loaded without a GPU: the
engine that would upload the weights is replaced by a stand-in, so what it shows is the host's side
(what the rank keeps in its own memory once loaded), not a run.

    python benchmarks/weights_mapping.py OUT_DIR [--inputs IN.npz] [--rounds 2] [--repeat 100]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

CHILD = r"""
import json, sys, time
way, out_dir, target = sys.argv[1:4]
if target == "cuda":  # (no GPU needed: the weights' upload is not what this measures)
    import shardflow.runtime.cuda_exec as cuda_exec

    class Engine:
        def __init__(self, prog, **kw):
            pass
    cuda_exec.CudaEngine = Engine
from shardflow.runtime import load
t = time.perf_counter()
prog = load(out_dir, map_weights=way == "mapped")
dt = time.perf_counter() - t
kb = {l.split(":")[0]: int(l.split(":")[1].split()[0]) for l in open("/proc/self/status")
      if l.startswith(("RssAnon", "RssFile"))}
print(json.dumps({"load_s": dt, "anon_mb": kb["RssAnon"] / 1024, "file_mb": kb["RssFile"] / 1024,
                  "weights_mb": prog.weights.nbytes / 2**20}))
"""


def _loads(out_dir: str, target: str, rounds: int) -> None:
    for r in range(rounds):
        for way in ("read", "mapped"):
            res = subprocess.run([sys.executable, "-c", CHILD, way, out_dir, target], capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(res.stderr[-2000:])
            f = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"round {r}  {way:6s}  load {f['load_s']:6.2f} s   RssAnon {f['anon_mb']:8.1f} MB   "
                  f"RssFile {f['file_mb']:8.1f} MB   (weights {f['weights_mb']:.1f} MB)", flush=True)


def _runs(out_dir: str, inputs: str, repeat: int) -> None:
    from shardflow.runtime import load

    feeds = dict(np.load(inputs))
    progs = {"read": load(out_dir, map_weights=False), "mapped": load(out_dir, map_weights=True)}
    outs = {k: p.run(feeds) for k, p in progs.items()}
    same = all(np.array_equal(outs["read"][n], outs["mapped"][n]) for n in outs["read"])
    for _ in range(3):
        for p in progs.values():
            p.run(feeds)
    times: dict[str, list[float]] = {k: [] for k in progs}
    for _ in range(repeat):
        for k, p in progs.items():
            t = time.perf_counter()
            p.run(feeds)
            times[k].append(time.perf_counter() - t)
    print("runs (interleaved, median of %d): " % repeat
          + ", ".join(f"{k} {np.median(v) * 1e3:.2f} ms" for k, v in times.items())
          + f"; outputs bit-identical: {same}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", help="a compiled out_dir of one rank")
    ap.add_argument("--inputs", default=None, help="an npz of the program's inputs (cpu: time runs too)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=100)
    args = ap.parse_args(argv)
    with open(f"{args.out_dir}/rank0/manifest.json") as f:
        target = json.load(f)["target"]
    print(f"{args.out_dir}: target {target}")
    _loads(args.out_dir, target, args.rounds)
    if target == "cpu" and args.inputs:
        _runs(args.out_dir, args.inputs, args.repeat)


if __name__ == "__main__":
    main()
