"""The GPU benchmark suite in one run: GEMM vs cuBLAS, then GPT-2 small and a Llama-style model vs
torch eager and torch.compile; prints every table and writes the results.

    python benchmarks/gpu/run_all.py [--only gemm|models] [--quick] [--dry-run] [--out-dir DIR]
                                     [--budget-s 540] [--precision float32] [--jobs 8]

Writes ``DIR/<device>-<date>-gpu.json`` (default DIR: ``benchmarks/results``; device from
``torch.cuda.get_device_name``, e.g. ``nvidia-h100-80gb-hbm3-2026-11-22-gpu.json``) and the printed
tables as ``.txt`` beside it. The JSON holds

* ``gemm_vs_cublas_min``: minimum over the GEMM cases of our TFLOP/s / cuBLAS TFLOP/s (``gemm.py``);
* ``gpt2_small_vs_torch_compile``: our GPT-2 small latency / torch.compile latency, the worst of
  batches 1x128 and 8x128 (torch.compile: the faster of its modes per batch; ``models.py``), and
  the same for ``llama`` and against torch eager; ``*_vs_torch_compile_static_outputs``: the
  same with the outputs left in place on both sides (ours ``copy_outputs=False`` against torch's
  reduce-overhead mode, whose outputs stay in its CUDA graph's memory);
  ``*_vs_torch_compile_interleaved``: ours and torch.compile timed in alternating rounds after
  both are warm (``models.py --interleave``), so that a drift of the machine between the two
  sequential timings does not fall on one side;
* ``device``, ``date``, software versions, the command line, and every raw figure (sections
  ``gemm`` and ``models``).

The file is rewritten after every step, so a run stopped by a time limit still leaves what it
measured. ``--budget-s`` (default 540) is the time the whole run may take: steps that no longer
fit (torch.compile of the Llama model first, as it comes last) are skipped and marked skipped.
``--quick``: 10 graph replays per GEMM case, 20 timed calls per model contender, GPT-2 small only.
``--dry-run``: builds every GEMM kernel and exports and compiles both models for ``--arch`` with
nvcc, runs nothing (no GPU needed); writes results only with an explicit ``--out-dir``.
See gemm.py and models.py for the methods.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, Budget, device_name, ensure_shardflow, fmt, slug, today  # noqa: E402

HEADLINES = ("gemm_vs_cublas_min", "gpt2_small_vs_torch_compile", "gpt2_small_vs_torch_compile_static_outputs",
             "gpt2_small_vs_torch_compile_interleaved", "gpt2_small_vs_torch_eager", "llama_vs_torch_compile",
             "llama_vs_torch_compile_static_outputs", "llama_vs_torch_compile_interleaved", "llama_vs_torch_eager")


def _versions() -> dict:
    v = {"python": platform.python_version(), "host": platform.node()}
    for mod in ("torch", "cupy", "transformers", "onnx", "numpy"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            v[mod] = None
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=30).stdout
        v["nvcc"] = next((ln.strip() for ln in out.splitlines() if "release" in ln), None)
    except (OSError, subprocess.SubprocessError):
        v["nvcc"] = None
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            v["gpu"] = {"name": p.name, "sm": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
                        "memory_bytes": p.total_memory, "l2_bytes": getattr(p, "L2_cache_size", None)}
            v["cuda_runtime"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,temperature.gpu",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
        v["nvidia_smi"] = out.strip() or None
    except (OSError, subprocess.SubprocessError):
        v["nvidia_smi"] = None
    try:
        v["git_commit"] = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True,
                                         timeout=30).stdout.strip() or None
        # a copied working tree (the device tool's) can carry a stale .git: say when files differ
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=60).stdout.strip()
        v["git_dirty"] = bool(dirty)
    except (OSError, subprocess.SubprocessError):
        v["git_commit"] = None
    return v


def _merge(rep: "Report", path: str, sections: set) -> None:
    """Copy ``sections`` of the results file ``path`` (and the headline figures that come from them)
    into ``rep``, noting where they came from."""
    with open(path) as f:
        old = json.load(f)
    if old.get("device") != rep.data["device"]:
        rep.log(f"note: merging {path}, measured on {old.get('device')!r}, into a run on {rep.data['device']!r}")
    merged = []
    for name in sorted(sections):
        if name in old:
            rep.data[name] = old[name]
            keys = HEADLINES[:1] if name == "gemm" else HEADLINES[1:]
            rep.data.update({k: old.get(k) for k in keys})
            merged.append(name)
    rep.data["merged_from"] = {"path": os.path.abspath(path), "date": old.get("date"), "sections": merged,
                               "command": old.get("command"), "versions": old.get("versions")}
    rep.log(f"# sections {merged} merged from {path} ({old.get('date')})")
    for name in merged:
        if rep.data[name].get("table"):
            rep.log(f"\n## {name} (from {os.path.basename(path)})\n{rep.data[name]['table']}")


class Report:
    """Collects the printed text and the JSON, and writes both (atomically) after every step."""

    def __init__(self, json_path: str | None):
        self.json_path = json_path
        self.text = io.StringIO()
        self.data: dict = {}

    def log(self, msg: str = "") -> None:
        print(msg, flush=True)
        self.text.write(msg + "\n")

    def save(self) -> None:
        if not self.json_path:
            return
        d = os.path.dirname(os.path.abspath(self.json_path))
        os.makedirs(d, exist_ok=True)
        for path, payload in ((self.json_path, json.dumps(self.data, indent=1, default=str) + "\n"),
                              (self.json_path[:-5] + ".txt", self.text.getvalue())):
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                f.write(payload)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)


def main(argv=None) -> dict:
    import gemm
    import models

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("gemm", "models"), help="run one section")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, GPT-2 small only")
    ap.add_argument("--dry-run", action="store_true", help="build/export/compile only (no GPU needed)")
    ap.add_argument("--out-dir", help="where the JSON and .txt go (default benchmarks/results; none for --dry-run)")
    ap.add_argument("--work-dir", help="scratch folder for kernels and artifacts (default: temporary)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="time the whole run may take (0: unlimited)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="parallel nvcc builds (GEMM)")
    ap.add_argument("--cache-dir", help="kernel cache for the GEMM builds (default: shardflow's)")
    ap.add_argument("--merge", help="an earlier results JSON: its sections that this run does not redo (with "
                                    "--only) are copied in, with their headline figures and printed tables")
    gemm.add_arguments(ap, prefix="gemm-")
    models.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.gemm_reps = min(args.gemm_reps, 10)
        args.repeat = min(args.repeat, 20)
        args.models = "gpt2_small"
    budget = Budget(args.budget_s or None)
    ensure_shardflow()

    dev = device_name()
    out_dir = args.out_dir or (None if args.dry_run else os.path.join(REPO, "benchmarks", "results"))
    suffix = "-gpu-dry-run.json" if args.dry_run else "-gpu.json"
    json_path = os.path.join(out_dir, f"{slug(dev)}-{today()}{suffix}") if out_dir else None
    rep = Report(json_path)
    rep.data.update(device=dev, date=today(), dry_run=args.dry_run, arch=args.arch,
                    command=sys.argv[:1] + list(argv or sys.argv[1:]), versions=_versions(),
                    **{k: None for k in HEADLINES})
    v = rep.data["versions"]
    rep.log(f"# Shardflow GPU benchmarks on {dev}, {today()} (torch {v.get('torch')}, cupy {v.get('cupy')}, "
            f"{v.get('nvcc')}, driver/clocks {v.get('nvidia_smi')})")
    if args.merge:
        _merge(rep, args.merge, {"gemm", "models"} - ({args.only} if args.only else {"gemm", "models"}))
    rep.save()

    with tempfile.TemporaryDirectory(prefix="sf-gpu-bench-", dir=args.work_dir) as work:
        if args.only in (None, "gemm"):
            rep.log("\n## GEMM vs cuBLAS (C[M,N] = A[M,K] @ B[K,N], row-major, fp32 accumulation)")
            t0 = time.perf_counter()
            cases = gemm.cases_from_args(args, prefix="gemm-")
            try:
                sec = gemm.bench(cases, os.path.join(work, "gemm"), arch=args.arch, jobs=args.jobs,
                                 dry_run=args.dry_run, reps=args.gemm_reps, use_graph=not args.gemm_no_graph,
                                 cache_dir=args.cache_dir, budget=budget, log=rep.log, pdl=args.gemm_pdl)
            except Exception as exc:  # noqa: BLE001 - keep going to the models
                sec = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
                rep.log(f"GEMM section failed: {sec['error']}")
            sec["seconds"] = time.perf_counter() - t0
            rep.data["gemm"] = sec
            rep.data["gemm_vs_cublas_min"] = sec.get("gemm_vs_cublas_min")
            if "table" in sec:
                rep.log(sec["table"])
            if not args.dry_run and "error" not in sec:
                rep.log(f"gemm_vs_cublas_min = {fmt(sec.get('gemm_vs_cublas_min'))} "
                        f"({sec.get('gemm_vs_cublas_min_case')}); geometric mean "
                        f"{fmt(sec.get('gemm_vs_cublas_geomean'))}; all correct: {sec.get('all_correct')}")
            rep.save()

        if args.only in (None, "models"):
            rep.log("\n## End to end: one cuda rank vs torch eager and torch.compile (latency per call)")
            t0 = time.perf_counter()
            sec: dict = {}
            rep.data["models"] = sec

            def save():
                for k in HEADLINES[1:]:
                    if k in sec:
                        rep.data[k] = sec[k]
                rep.save()

            try:
                models.bench(args, os.path.join(work, "models"), budget, log=rep.log, save=save, section=sec)
            except Exception as exc:  # noqa: BLE001
                sec["error"] = f"{type(exc).__name__}: {exc}"[:1000]
                rep.log(f"models section failed: {sec['error']}")
            sec["seconds"] = time.perf_counter() - t0
            if "table" not in sec and sec.get("models"):
                sec["table"] = models.format_table(sec["models"])
            if "table" in sec:
                rep.log(sec["table"])
            ran = {n: m for n, m in sec.get("models", {}).items() if "torch_tf32" in m}
            if ran:
                rep.log(f"precision {args.precision}; torch allow_tf32: "
                        f"{ {n: m['torch_tf32'] for n, m in ran.items()} }; torch attention: "
                        f"{ {n: m.get('attention') for n, m in ran.items()} }; the torch.compile figure is the "
                        "faster of its modes per batch")
            save()

    rep.data["elapsed_s"] = budget.elapsed()
    rep.log("\n## Headline")
    for k in HEADLINES:
        rep.log(f"{k} = {fmt(rep.data[k])}")
    rep.log(f"elapsed {rep.data['elapsed_s']:.0f} s")
    if json_path:
        rep.log(f"wrote {json_path} and {json_path[:-5]}.txt")
    rep.save()
    return rep.data


if __name__ == "__main__":
    main()
