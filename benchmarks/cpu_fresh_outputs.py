"""A cpu program's outputs written into fresh arrays vs copied out of the arena (rfcs/0003).

Exports GPT-2 small (tests/models/export_models.py: 12 layers, 768 wide, 50257 words; random
weights) at ``--batch`` x ``--seq`` tokens, compiles it for one cpu rank in float32 and as a
bfloat16 copy (tests/models/to_half.py), loads each program twice and times ``run(feeds)`` on both,
alternating: the first as built (its ``program.json`` ``fresh_outputs``: the logits written straight
into the array ``run`` returns), the second with that list cleared (``RankProgram._fresh``: every
output copied out of the arena after the steps, as before session 72). Prints the medians and their
ratio; both programs' outputs are checked equal first. Needs torch + transformers.

    HF_HUB_OFFLINE=1 python benchmarks/cpu_fresh_outputs.py --batch 8
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))


def _paired_ms(a, b, feeds, repeat: int) -> tuple[float, float]:
    """Median ms of ``a.run(feeds)`` and ``b.run(feeds)``, timed in alternating order."""
    for _ in range(3):
        a.run(feeds)
        b.run(feeds)
    ta: list[float] = []
    tb: list[float] = []
    for i in range(repeat):
        for p, ts in ((a, ta), (b, tb)) if i % 2 else ((b, tb), (a, ta)):
            t0 = time.perf_counter()
            p.run(feeds)
            ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ta), 1e3 * statistics.median(tb)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=40)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import onnx
    from export_models import export_gpt2
    from to_half import half_feeds, to_half

    from shardflow.compiler import compile
    from shardflow.runtime import load

    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "gpt2_small.onnx")
        info = export_gpt2(path, n_layer=12, n_embd=768, n_head=12, vocab_size=50257, seq_len=args.seq,
                           batch=args.batch)
        rng = np.random.default_rng(0)
        feeds = {i["name"]: rng.integers(0, 50257, i["shape"]).astype(np.int64) if i["name"] == "input_ids"
                 else np.ones(i["shape"], np.int64) for i in info["inputs"]}
        for tag in ("float32", "bfloat16"):
            model = onnx.load(path) if tag == "float32" else to_half(onnx.load(path), "bfloat16")[0]
            f = feeds if tag == "float32" else half_feeds(feeds, "bfloat16")[0]
            out = os.path.join(work, tag)
            compile(model, distributed_config={"mesh_shape": [1]}, optimization_config={"target": "cpu"}, out_dir=out)
            fresh, copied = load(out), load(out)
            names = [e["output"] for e in fresh.program.get("fresh_outputs", ())]
            copied._fresh = []
            got, want = fresh.run(f), copied.run(f)
            for k in want:
                np.testing.assert_array_equal(got[k], want[k], err_msg=k)
            ms_fresh, ms_copied = _paired_ms(fresh, copied, f, args.repeat)
            print(f"gpt2_small {args.batch}x{args.seq} {tag:<9} fresh outputs {names}  {ms_fresh:9.2f} ms   "
                  f"copied {ms_copied:9.2f} ms   ratio {ms_fresh / ms_copied:.3f}", flush=True)
            del fresh, copied


if __name__ == "__main__":
    main()
