"""Shape variants on cpu: one out_dir with a program per sequence length, against onnxruntime running the
same dynamic-shape model, and what a process holds with every variant loaded.

Exports GPT-2 small (124M parameters, random weights; needs torch + transformers) with dynamic batch and
sequence dims, compiles it with ``compile_variants`` at ``--seqs`` (one rank), then in a fresh process per
figure: each variant's median latency beside onnxruntime's on the same inputs (one session for every
length: its shapes are dynamic), and the process's resident memory (``VmRSS``) after running every
variant, with the variants reading each other's large weights (the default) and without (the out_dir's
``variants.json`` without its ``weights`` regions: each variant reads its whole file).

    python benchmarks/cpu_variants.py [--seqs 32,64,128] [--repeat 20] [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cpu_latency import _medians_ms  # noqa: E402


def export(path: str) -> None:
    """GPT-2 small with dynamic ``batch`` and ``seq`` dims (TorchScript exporter, opset 17)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))
    from export_models import export_dynamic_gpt2

    export_dynamic_gpt2(path)


def _feeds(seq: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(seq)
    return {"input_ids": rng.integers(0, 50257, (1, seq)).astype(np.int64),
            "attention_mask": np.ones((1, seq), np.int64)}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(out_dir: str, model: str, seqs: list[int], repeat: int, latency: bool) -> dict:
    """(in a fresh process) Every variant run; their latencies beside onnxruntime's if ``latency``,
    and the resident memory after running all of them."""
    import numpy as np

    from shardflow.runtime import load

    prog = load(out_dir)
    res = {"rss_before_mb": _rss_mb(), "latency": {}}
    sess = None
    if latency:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
        sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    for seq in seqs:
        feeds = _feeds(seq)
        got = prog.run(feeds)["logits"]
        if sess is None:
            continue
        want = sess.run(None, feeds)[0]
        # blocks of 5 calls in turn, each after 50 ms idle (onnxruntime's pool spins after a run: cpu_latency)
        ours, theirs = _medians_ms([lambda: prog.run(feeds), lambda: sess.run(None, feeds)], repeat, block=5)
        res["latency"][seq] = (ours, theirs, float(np.max(np.abs(got - want))))
    res["rss_after_mb"] = _rss_mb()
    res["borrowed_mb"] = prog.borrowed_bytes / 2**20
    return res


def _disk_mb(folder: str) -> float:
    """The bytes of the files under ``folder``, each file (inode) once."""
    seen, total = set(), 0
    for root, _, files in os.walk(folder):
        for name in files:
            st = os.stat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total / 1e6


def _child(*args) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(args)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="32,64,128")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--work", default=None, help="keep the model and the out_dirs here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(*json.loads(args.child))))
        return
    seqs = [int(s) for s in args.seqs.split(",")]
    work = args.work or tempfile.mkdtemp(prefix="sf-variants-")
    model = os.path.join(work, "gpt2_dynamic.onnx")
    if not os.path.exists(model):
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r}); import cpu_variants; "
                        f"cpu_variants.export({model!r})"], check=True)
    from shardflow.compiler import compile_variants

    out = os.path.join(work, "out")
    res = compile_variants(model, variants=[{"seq": s} for s in seqs], dim_sizes={"batch": 1},
                           distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=out)
    print(f"GPT-2 small (dynamic batch and seq), {len(seqs)} variants, one rank; threads: "
          f"{os.environ.get('OMP_NUM_THREADS', os.cpu_count())}")
    for v, r in zip(res.variants, res.results):
        print(f"  {v['dir']} seq {v['dim_sizes']['seq']:4d}: compile {r.timings['total']:6.1f} s, its weights file "
              f"{r.ranks[0]['weights_bytes'] / 1e6:7.1f} MB")
    print(f"  out_dir on disk {_disk_mb(out):7.1f} MB ({res.external_bytes / 1e6:.1f} MB of weights read from an "
          "earlier variant's file instead of stored again)")
    alone = os.path.join(work, "alone")  # the same variants, each reading its whole weights file
    shutil.rmtree(alone, ignore_errors=True)
    shutil.copytree(out, alone, copy_function=os.link)
    spec = json.load(open(os.path.join(out, "variants.json")))
    for v in spec["variants"]:
        v.pop("weights")
        v.pop("external", None)  # (each then reads its external regions from the earlier file itself)
    os.unlink(os.path.join(alone, "variants.json"))
    with open(os.path.join(alone, "variants.json"), "w") as f:
        json.dump(spec, f)
    timed = _child(out, model, seqs, args.repeat, True)
    for seq, (ours, theirs, err) in timed["latency"].items():
        print(f"  seq {int(seq):4d}: shardflow {ours:8.2f} ms   onnxruntime {theirs:8.2f} ms   "
              f"ratio {ours / theirs:5.2f}   max |diff| {err:.1e}")
    for name, d in (("regions shared", out), ("each its own", alone)):
        m = _child(d, model, seqs, args.repeat, False)
        print(f"  every variant run, {name:14s}: resident {m['rss_after_mb']:7.1f} MiB (after load's imports "
              f"{m['rss_before_mb']:6.1f} MiB), weights read from another variant {m['borrowed_mb']:6.1f} MiB")


if __name__ == "__main__":
    main()
