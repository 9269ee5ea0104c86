"""Helpers shared by the GPU benchmarks: making ``shardflow`` importable, a time budget, the
device name, and plain-text tables."""
from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))


def load_by_path(name: str, relpath: str):
    """The module at ``relpath`` (from the repository root), loaded once under ``name``: for the
    scripts whose file names other folders reuse (``tests/models/export_models.py`` and this
    folder's), which a process running both, such as pytest, would otherwise mix up."""
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, relpath))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def ensure_shardflow() -> None:
    """Make ``import shardflow.compiler`` / ``shardflow.runtime`` work from a plain checkout.

    When the package is not installed (and no ``PYTHONPATH`` provides it), a folder holding a
    ``shardflow`` directory with symlinks to this checkout's ``compiler/`` and ``runtime/`` is put
    on ``sys.path`` (what ``pip install -e .`` would map).
    """
    try:
        import shardflow.compiler  # noqa: F401
        import shardflow.runtime  # noqa: F401
        return
    except ImportError:
        pass
    for mod in [m for m in sys.modules if m == "shardflow" or m.startswith("shardflow.")]:
        del sys.modules[mod]
    root = os.path.join(tempfile.gettempdir(), f"shardflow-bench-pkg-{os.getuid()}")
    pkg = os.path.join(root, "shardflow")
    os.makedirs(pkg, exist_ok=True)
    for sub in ("compiler", "runtime"):
        link = os.path.join(pkg, sub)
        target = os.path.join(REPO, sub)
        if os.path.realpath(link) != os.path.realpath(target):
            if os.path.islink(link):
                os.unlink(link)
            os.symlink(target, link)
    sys.path.insert(0, root)
    import shardflow.compiler  # noqa: F401
    import shardflow.runtime  # noqa: F401


class Budget:
    """Wall-clock budget of a whole run; optional steps ask :meth:`allows` before starting."""

    def __init__(self, seconds: float | None):
        self.t0 = time.monotonic()
        self.seconds = seconds

    def left(self) -> float:
        """Seconds left (infinite without a budget)."""
        if self.seconds is None:
            return float("inf")
        return self.seconds - (time.monotonic() - self.t0)

    def allows(self, need_s: float) -> bool:
        """Whether a step expected to take ``need_s`` seconds still fits."""
        return self.left() >= need_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def device_name() -> str:
    """The GPU's name as torch (else cupy) reports it, or ``"no-gpu"``."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - no cupy or no device
        pass
    return "no-gpu"


def slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def today() -> str:
    return datetime.date.today().isoformat()


def table(header: list[str], rows: list[list], align: str | None = None) -> str:
    """A fixed-width text table; ``align`` has one ``<`` or ``>`` per column (default: text left,
    numbers right)."""
    cells = [[str(c) for c in header]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    if align is None:
        align = "".join(">" if rows and isinstance(rows[0][i], (int, float)) else "<" for i in range(len(header)))
    lines = []
    for k, r in enumerate(cells):
        lines.append("  ".join(f"{c:{a}{w}}" for c, a, w in zip(r, align, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def dump_json(path: str | None, data: dict) -> None:
    """Write ``data`` to ``path`` (nothing when ``path`` is None)."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=str)


def fmt(x, spec: str = ".3f") -> str:
    """Format a number, or ``-`` for a missing one."""
    return "-" if x is None else format(x, spec)


def build_cases(build_one, cases: list, work: str, arch: str, jobs: int) -> dict:
    """``build_one(case, work, arch)`` for every case, ``jobs`` at a time (nvcc runs in its own
    processes): the results by ``case.id``."""
    import concurrent.futures

    ensure_shardflow()
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        futs = {pool.submit(build_one, c, work, arch): c for c in cases}
        return {futs[f].id: f.result() for f in concurrent.futures.as_completed(futs)}


def kernel_bench_args(ap, reps: int = 20) -> None:
    """The options every per-kernel benchmark takes (``ap``: its ``argparse`` parser): ``--reps``,
    ``--arch``, ``--jobs``, ``--dry-run`` and ``--json``."""
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--dry-run", action="store_true", help="build every kernel, run nothing (no GPU needed)")
    ap.add_argument("--json", help="write the results here")


def print_built(cases: list, built: dict) -> None:
    """A dry run's table: each case's kernel kind, grid, shared memory and build time."""
    rows = [[c.id, built[c.id][1].kind, "x".join(map(str, built[c.id][1].grid)), str(built[c.id][1].shared_mem),
             f"{built[c.id][2]:.1f}"] for c in cases]
    print(table(["case", "kind", "grid", "smem B", "build s"], rows, align="<<<>>"))


def build_alone(op, work: str, arch: str, **options) -> tuple:
    """``(cubin path, launch, build seconds)`` of ``op``'s kernel compiled alone into ``work``
    (``build_cuda_library``'s ``options``): what each case of :func:`build_cases` gives."""
    from shardflow.compiler.codegen.cuda import build_cuda_library

    path = os.path.join(work, f"{op.name}.cubin")
    t0 = time.perf_counter()
    launches = build_cuda_library([op], path, arch=arch, **options)
    return path, launches[op.name], time.perf_counter() - t0


def first_run_error(ours, cstream, y, reference, torch) -> float | None:
    """Our kernel's first launch (``ours(0)``, on ``cstream``) into ``y``, poisoned with NaN before,
    against ``reference()`` (a higher-precision tensor, computed after): ``max|y - ref| / max|ref|``,
    or None when ``y`` keeps a NaN (an element not written)."""
    torch.cuda.synchronize()
    y.fill_(float("nan"))
    torch.cuda.synchronize()
    ours(0)
    cstream.synchronize()
    ref = reference()
    if bool(torch.isnan(y).any().item()):
        return None
    return (y.to(ref.dtype) - ref).abs().max().item() / ref.abs().max().item()


def run_cases(run_case, cases: list, built: dict, reps: int, line) -> tuple[list[dict], str]:
    """``run_case(case, cubin, launch, reps, l2_bytes, torch, cupy, *more)`` for every case built by
    :func:`build_cases` (``(cubin, launch, seconds, *more)`` by id), printing ``line(record)`` after each;
    returns the records and the device's name."""
    import cupy as cp
    import torch

    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 0) or 50 * 2 ** 20)
    records = []
    for c in cases:  # (what a build gives past its build seconds goes to run_case after cupy)
        rec = run_case(c, built[c.id][0], built[c.id][1], reps, l2, torch, cp, *built[c.id][3:])
        torch.cuda.empty_cache()
        records.append(rec)
        print(line(rec), flush=True)
    return records, torch.cuda.get_device_name(0)


def our_launcher(cubin: str, launch, sets: list, torch, cp, stream=None):
    """``(stream, cstream, ours)`` for timing one of our kernels (``launch`` of ``cubin``): a torch
    stream (``stream``, or a new one), cupy's view of it, and ``ours(i)``, which launches the kernel
    on that stream with the tensors of input set ``sets[i % len(sets)]`` as its arguments, in order."""
    from gemm import _cupy_view

    module = cp.RawModule(path=cubin)
    fn = module.get_function(launch.symbol)
    if launch.shared_mem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = int(launch.shared_mem)
    stream = stream or torch.cuda.Stream()
    cstream = cp.cuda.ExternalStream(stream.cuda_stream)
    views = [[_cupy_view(x, cp) for x in s] for s in sets]
    grid, block, smem = tuple(launch.grid), tuple(launch.block), int(launch.shared_mem)

    def ours(i):
        fn(grid, block, views[i % len(views)], shared_mem=smem, stream=cstream)

    ours.module = module  # (kept alive with the function)
    return stream, cstream, ours


def err_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def failed(rec: dict, key: str, exc: BaseException, what: str, log, verbose: bool) -> None:
    """Record a step's failure in ``rec[key]``, log it (``what failed: ...``) and, ``verbose``,
    print its traceback; the benchmark goes on."""
    import traceback

    rec[key] = err_text(exc)
    log(f"{what} failed: {rec[key]}")
    if verbose:
        traceback.print_exc()


def torch_ratios(rec: dict) -> None:
    """A batch record's ratios: torch.compile's figure is its fastest mode's (``torch_compile_ms``,
    ``torch_compile_mode``); ``vs_torch_compile``, ``vs_torch_eager`` (ours ÷ theirs) and, with the
    outputs left in place (``ours_view_ms``), ``vs_torch_compile_static`` against reduce-overhead;
    ``vs_torch_compile_interleaved``: the ratio of :func:`interleave_with`'s rounds against the mode
    fastest there (``interleaved_mode``)."""
    ok = {m: v["ms"] for m, v in rec.get("torch_compile", {}).items() if "ms" in v}
    if ok:
        mode = min(ok, key=ok.get)
        rec["torch_compile_ms"], rec["torch_compile_mode"] = ok[mode], mode
    if rec.get("ours_ms") is not None:
        if rec.get("torch_compile_ms"):
            rec["vs_torch_compile"] = rec["ours_ms"] / rec["torch_compile_ms"]
        if rec.get("torch_eager_ms"):
            rec["vs_torch_eager"] = rec["ours_ms"] / rec["torch_eager_ms"]
    ro = rec.get("torch_compile", {}).get("reduce-overhead", {}).get("ms")
    if rec.get("ours_view_ms") is not None and ro:
        rec["vs_torch_compile_static"] = rec["ours_view_ms"] / ro
    inter = rec.get("interleaved", {})
    if inter:  # (against the mode that was faster in the interleaved rounds)
        mode = min(inter, key=lambda m: inter[m]["torch_ms"])
        rec["vs_torch_compile_interleaved"], rec["interleaved_mode"] = inter[mode]["ratio"], mode


class TorchDevice:
    """What differs between a benchmark's real run (cuda) and its CPU self-test (torch's side)."""

    def __init__(self, target: str):
        import torch

        self.target = target
        self.torch = torch
        self.tdev = torch.device("cuda" if target == "cuda" else "cpu")
        if target == "cuda":
            import cupy

            self.cp = cupy

    def sync(self) -> None:
        if self.target == "cuda":
            self.torch.cuda.synchronize()

    def ours_input(self, ids_np):
        return self.cp.asarray(ids_np) if self.target == "cuda" else ids_np

    def as_torch(self, a, dtype: str = "float32"):
        """Our output (cupy or numpy) as a torch tensor on the torch device (no copy for cupy); a
        bfloat16 output (16-bit patterns: ``uint16`` in cupy, ml_dtypes' type in numpy) as torch's."""
        if dtype == "bfloat16":
            a = a.view("uint16")  # (cupy's, or numpy's of ml_dtypes' bfloat16)
        t = self.torch.as_tensor(a, device=self.tdev) if self.target == "cuda" else self.torch.from_numpy(a)
        return t.view(self.torch.bfloat16) if dtype == "bfloat16" else t

    def set_tf32(self, on: bool) -> None:
        self.torch.backends.cuda.matmul.allow_tf32 = on
        self.torch.backends.cudnn.allow_tf32 = on


def time_calls(call, sync, repeat: int, warmup: int) -> dict:
    for _ in range(warmup):
        call()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t0)
    return {"ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "repeat": repeat}


def time_interleaved(calls: dict, sync, rounds: int, per_round: int) -> dict:
    """The contenders ``calls`` (name -> callable) timed in turn: ``rounds`` times, each one
    untimed call and then ``per_round`` timed ones (a call and a device synchronization, as
    :func:`time_calls`), the order rotating from round to round, so that a drift of the machine
    during the run (clocks, temperature, other work) weighs on every contender alike and none runs
    just after its own warm-up alone. Per contender: the median and fastest of its timed calls."""
    names = list(calls)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            calls[k]()  # (the switch from the other contender falls on an untimed call)
            sync()
            for _ in range(per_round):
                t0 = time.perf_counter()
                calls[k]()
                sync()
                times[k].append(time.perf_counter() - t0)
    return {k: {"ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v), "calls": len(v)} for k, v in times.items()}


def interleave_with(rec: dict, mode: str, ours, theirs, sync, rounds: int, per_round: int, log, what: str) -> None:
    """Ours against torch.compile in ``mode`` by :func:`time_interleaved`: ``rec["interleaved"][mode]``
    gets both medians and their ratio (ours / theirs)."""
    t = time_interleaved({"ours": ours, "torch": theirs}, sync, rounds, per_round)
    ours_t, torch_t = t["ours"], t["torch"]
    rec.setdefault("interleaved", {})[mode] = {
        "ours_ms": ours_t["ms"], "torch_ms": torch_t["ms"], "ours_min_ms": ours_t["min_ms"],
        "torch_min_ms": torch_t["min_ms"], "calls": ours_t["calls"], "ratio": ours_t["ms"] / torch_t["ms"]}
    log(f"{what}: interleaved with torch.compile({mode}): ours {ours_t['ms']:.3f} ms, torch "
        f"{torch_t['ms']:.3f} ms ({rounds} rounds of {per_round} calls each)")


def time_eager(rec: dict, call, dev: "TorchDevice", repeat: int, warmup: int, log, what: str, verbose: bool) -> None:
    """Time torch eager ``call()`` (under ``no_grad``): ``rec`` gets ``torch_eager_ms`` and
    ``torch_eager_min_ms``, or ``torch_eager_error`` (``what``: the case, in the log)."""
    try:
        with dev.torch.no_grad():
            t = time_calls(call, dev.sync, repeat, warmup)
        rec.update(torch_eager_ms=t["ms"], torch_eager_min_ms=t["min_ms"])
        log(f"{what}: torch eager {t['ms']:.3f} ms")
    except Exception as exc:  # noqa: BLE001 - report and go on
        failed(rec, "torch_eager_error", exc, f"{what}: torch eager", log, verbose)


def time_compiled(tc: dict, mode: str, call, ref, dev: "TorchDevice", repeat: int, warmup: int, log, what: str,
                  verbose: bool) -> None:
    """Time a ``torch.compile``'d ``call()`` (its first call compiles): ``tc[mode]`` gets its
    median and fastest latency, its compile seconds and its error against ``ref``; a failure is
    recorded there instead (``what``: the case, in the log)."""
    try:
        with dev.torch.no_grad():
            t0 = time.perf_counter()
            y = call()
            dev.sync()
            compile_s = time.perf_counter() - t0
            d = torch_diff(y, ref)
            del y
            t = time_calls(call, dev.sync, repeat, warmup)
        tc[mode] = {"ms": t["ms"], "min_ms": t["min_ms"], "compile_s": compile_s,
                    "max_abs_diff": d["max_abs_diff"], "rel_diff": d["rel_diff"]}
        log(f"{what}: torch.compile({mode}) {t['ms']:.3f} ms (compiled in {compile_s:.0f} s)")
    except Exception as exc:  # noqa: BLE001 - report and go on
        failed(tc.setdefault(mode, {}), "error", exc, f"{what}: torch.compile({mode})", log, verbose)


def torch_diff(got, ref) -> dict:
    d = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    return {"max_abs_diff": d, "ref_max_abs": scale, "rel_diff": d / scale if scale else None,
            "finite": bool(got.float().isfinite().all().item())}


def kernel_kinds(out_dir: str) -> dict[str, int]:
    """The kernels of a compiled program (``out_dir``, one rank) counted by kind."""
    with open(os.path.join(out_dir, "rank0", "program.json")) as f:
        prog = json.load(f)
    counts: dict[str, int] = {}
    for s in prog["steps"]:
        if s.get("kind") == "kernel":
            k = str(s.get("launch", {}).get("kind", ""))
            counts[k] = counts.get(k, 0) + 1
    return dict(sorted(counts.items()))


def gemm_kinds(out_dir: str) -> list[str]:
    """The GEMM kernel kinds of a compiled program (``out_dir``, one rank)."""
    return sorted({k for kind in kernel_kinds(out_dir) for k in kind.split("+") if k.startswith("gemm")})


def compile_ours(onnx_path: str, batch: int, out_dir: str, *, target: str, arch: str, precision: str,
                 search_space: int | None, gemm_tiles: dict | None = None, pdl: bool = False,
                 wgmma_fp32: bool = False, input_shapes: dict | None = None, channels_last: bool = True) -> dict:
    """Compile one batch size (``input_shapes``: default ``input_ids`` ``[batch, 128]``); returns the
    record (timings, kernel kinds). ``channels_last``: ``optimization_config``'s (cuda)."""
    from shardflow.compiler import compile as sf_compile

    opt = {"target": target, "precision": precision}
    if target == "cuda":
        opt["arch"] = arch
    if search_space is not None:
        opt["search_space"] = search_space
    if gemm_tiles:
        opt["gemm_tiles"] = gemm_tiles
    if pdl:
        opt["pdl"] = True
    if wgmma_fp32:
        opt["wgmma_fp32"] = True
    if not channels_last:
        opt["channels_last"] = False
    t0 = time.perf_counter()
    res = sf_compile(onnx_path, distributed_config={"mesh_shape": [1], "algo": "replicate"}, optimization_config=opt,
                     out_dir=out_dir, input_shapes=input_shapes or {"input_ids": [batch, 128]})
    rec = {"compile_s": time.perf_counter() - t0, "compile_timings": dict(res.timings),
           "kernels": res.ranks[0]["kernels"] if res.ranks else None}
    try:
        rec["gemm_kinds"] = gemm_kinds(str(out_dir))
    except (OSError, KeyError, ValueError):
        rec["gemm_kinds"] = None
    return rec
