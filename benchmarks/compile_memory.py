"""Peak memory of ``shardflow compile``: the process's own (anonymous) pages and the mapped file pages.

Runs ``shardflow compile MODEL ARGS...`` in this process while a thread samples
``/proc/self/status`` every 10 ms (Linux), and prints the peaks of ``RssAnon`` (memory the compile
allocated: what runs a machine out of memory) and ``RssFile`` (pages of files mapped into the
process, such as external weight data, which the kernel can drop and read again). ``--external``
first saves the model with its weights in one external data file (in a temporary folder), the
form of models above 2 GB, whose weights the importer maps instead of reading.

    python benchmarks/compile_memory.py MODEL.onnx [--external] -- --target cuda --mesh 4 --algo megatron

The constants the compile makes stay in memory up to ``SHARDFLOW_SPILL_BUDGET`` bytes (default half
the available memory) and are spilled to files past it (``compiler/ir/spill.py``): set it in the
environment (``SHARDFLOW_SPILL_BUDGET=0`` spills every one) to measure the compile under a budget.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time


def _status(keys=("RssAnon", "RssFile")) -> dict[str, int]:
    res = {}
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(":")[0]
            if k in keys:
                res[k] = int(line.split()[1]) * 1024
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--external", action="store_true", help="compile a copy with its weights in an external file")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    extra = argv[cut + 1:]  # shardflow compile's options
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.external:
            import onnx

            model = os.path.join(tmp, "model.onnx")
            onnx.save_model(onnx.load(args.model), model, save_as_external_data=True, all_tensors_to_one_file=True,
                            location="model.onnx.data", size_threshold=1024)
        peak = {"RssAnon": 0, "RssFile": 0}
        start = _status()
        done = threading.Event()

        def sample():
            while not done.is_set():
                for k, v in _status().items():
                    peak[k] = max(peak[k], v)
                time.sleep(0.01)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        from shardflow.compiler.cli import main as cli

        t0 = time.perf_counter()
        try:
            rc = cli(["compile", model, "-o", os.path.join(tmp, "out"), "-q"] + extra)
        finally:
            done.set()
            th.join()
        mb = 1 / 1e6
        print(f"{os.path.basename(args.model)}{' (external data)' if args.external else ''} {' '.join(extra)}: "
              f"exit {rc}, {time.perf_counter() - t0:.2f} s; peak RssAnon {peak['RssAnon'] * mb:.0f} MB "
              f"(at start {start.get('RssAnon', 0) * mb:.0f}), peak RssFile {peak['RssFile'] * mb:.0f} MB")


if __name__ == "__main__":
    main()
