"""GEMM: Shardflow's generated tensor-core MatMul kernels vs cuBLAS, on transformer projection shapes.

    python benchmarks/gpu/gemm.py [--m 128,1024,8192] [--shapes gpt2,llama7b] [--dtypes float16,bfloat16]
                                  [--dry-run] [--jobs 8] [--json OUT.json] [--search-space 2]

What is compared
    ``C[M,N] = A[M,K] @ B[K,N]``, all three row-major (B is ``[K, N]`` as our ``MatMul`` takes it;
    cuBLAS gets exactly the same buffers through ``torch.matmul(A, B, out=C)``, which runs a cuBLAS
    GEMM on this layout), fp16 or bf16 operands and output, fp32 accumulation on both sides.
    ``--dtypes tf32``: float32 operands and output, one TF32 product on both sides (ours compiled
    with ``precision="tf32"``, cuBLAS with ``allow_tf32``); ``--dtypes float32``: float32-accurate
    products on both sides (ours 3xTF32, cuBLAS's SGEMM with TF32 off). Ours on the Hopper
    template (``wgmma_fp32``, rfcs/0005 decisions 33-34); B is then stored ``[N, K]``, as the
    compiler stores a weight for those kernels (they read K-major operands only).
    M in {128, 1024, 8192} x (N, K) of

    * GPT-2 small: qkv 2304x768, attn_out 768x768, fc1 3072x768, fc2 768x3072;
    * Llama-7B: qkv 12288x4096 (q, k and v fused into one projection, as inference engines do; a
      separate q/k/v projection is 4096x4096, the same shape as ``o``), o 4096x4096,
      gate|up 11008x4096 (each of the two; unfused), down 4096x11008.

Our kernel
    One ``MatMul`` op on two float16/bfloat16 ``Tensor`` inputs, lowered by the cuda code
    generator and compiled by ``build_cuda_library`` (nvcc, ``--arch``, default sm_90) into its own
    cubin (one per case, built ``--jobs`` at a time), launched with cupy (``RawModule`` +
    ``KernelLaunch`` grid/block/shared memory) on device buffers that torch allocated.

Timing (same method for ours and cuBLAS)
    Warm-up launches, then a CUDA graph of n back-to-back launches is captured on one stream
    (torch's graph capture; our cupy launches go to the same stream) and replayed; CUDA events
    around each replay give the time of n launches; the figure is the median over ``--reps``
    replays divided by n. The graph removes the host launch overhead, which would otherwise
    dominate the M=128 cases. If capture fails, both sides fall back to events around n plain
    back-to-back launches (``method`` in the JSON says which was used).
    The launches rotate over enough input/output sets that the sets add up to at least three
    times the L2 cache (50 MB on an H100), each set used once per graph (n = max(20, sets), at
    most 256 sets): every launch reads its A and B from device memory, as a layer of a real model
    reads its weights, not from L2. Large cases need only one set (n = 20).
    TFLOP/s = 2*M*N*K / time. ``ratio`` = our TFLOP/s / cuBLAS TFLOP/s (higher is better; the
    issue's goal is >= 0.9 on every shape); ``gemm_vs_cublas_min`` is its minimum over all cases.

Correctness
    Before timing, C is poisoned (all bits set: NaN in fp16 and bf16), our kernel runs once, and C
    is compared with an fp32 product of the same (rounded) operands computed by torch with TF32 off:
    ``err = max|C - ref| / max|ref|`` must be <= 1e-2 (fp16/bf16 output rounding alone gives ~4e-3
    for bf16) and no NaN may remain. cuBLAS's own ``err`` is reported beside it. A failing case
    is marked ``WRONG`` and makes ``all_correct`` false; its timing is still reported.

Programmatic dependent launch
    ``--pdl`` compiles ours as ``optimization_config["pdl"]`` does and launches it with the
    attribute (``runtime/pdl.py``), B declared a weight (no kernel writes it): each launch of the
    graph then sets up, and loads its first stages of B, while the launch before it finishes, and
    waits on the GPU for it (rfcs/0005 decisions 29 and 48); cuBLAS is timed as without it. A
    model's products run this way in a ``pdl`` program; the records say ``pdl``.

Tuned tiles
    ``--search-space 2`` builds each case as ``optimization_config["search_space"] = 2`` does: the
    compiler's tuner (``codegen/tune.py``) compiles every candidate tile of the product, times each
    on this GPU and keeps the fastest (the builds then run one at a time). Without it, ours is the
    default tile choice (the fitted model of ``choose_wgmma_config``), which the issue's figure
    is taken on; the records say ``search_space``.

``--dry-run`` generates and compiles every kernel (nvcc, no GPU needed) and prints the launch
configuration of each; nothing runs.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import math
import os
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_alone, dump_json, ensure_shardflow, fmt, table  # noqa: E402

M_VALUES = (128, 1024, 8192)
PROJECTIONS = (  # (model, projection, N, K)
    ("gpt2", "qkv", 2304, 768),
    ("gpt2", "attn_out", 768, 768),
    ("gpt2", "fc1", 3072, 768),
    ("gpt2", "fc2", 768, 3072),
    ("llama7b", "qkv", 12288, 4096),
    ("llama7b", "o", 4096, 4096),
    ("llama7b", "gate|up", 11008, 4096),
    ("llama7b", "down", 4096, 11008),
)
DTYPES = ("float16", "bfloat16")
#: the float32 products of ``--dtypes tf32`` and ``float32`` (not in the default list: the issue's
#: goal is half types)
TF32 = "tf32"
FLOAT32 = (TF32, "float32")
LAUNCHES_PER_GRAPH = 20  # at least; more when more input sets rotate
MAX_SETS = 256
TOLERANCE = 1e-2


@dataclass(frozen=True)
class Case:
    model: str
    proj: str
    M: int
    N: int
    K: int
    dtype: str
    b_layout: str = "kn"  # B stored [K, N] (MatMul's weight), or "nk": [N, K] (a Linear's, Gemm transB)

    @property
    def id(self) -> str:
        return f"{self.model}_{self.proj.replace('|', '_')}_M{self.M}_{self.dtype}" + \
            ("_nk" if self.b_layout == "nk" else "")

    @property
    def flops(self) -> float:
        return 2.0 * self.M * self.N * self.K


def make_cases(m_values=M_VALUES, shapes=None, dtypes=DTYPES, b_layout: str = "kn") -> list[Case]:
    """Cases for ``m_values`` x the projections selected by ``shapes`` (names ``gpt2``,
    ``llama7b`` or ``model.proj`` such as ``gpt2.attn_out``; default all) x ``dtypes``, B stored
    as ``b_layout`` says."""
    want = set(shapes) if shapes else None
    projs = [p for p in PROJECTIONS if want is None or p[0] in want or f"{p[0]}.{p[1]}" in want]
    if want is not None:
        known = {p[0] for p in PROJECTIONS} | {f"{p[0]}.{p[1]}" for p in PROJECTIONS}
        bad = sorted(want - known)
        if bad:
            raise SystemExit(f"unknown shape(s) {bad}; choose from {sorted(known)}")
    return [Case(m, p, M, n, k, dt, "nk" if dt in FLOAT32 else b_layout) for dt in dtypes for (m, p, n, k) in projs
            for M in m_values]


# ----------------------------------------------------------------------------------------------
# building (nvcc; no GPU)
# ----------------------------------------------------------------------------------------------

def case_op(case: Case, weight_b: bool = False):
    """The case's product as one op on two graph inputs ``a`` and ``b`` (``weight_b``: ``b`` a
    constant, as a model's weight is to the code generator, which only reads that it is one)."""
    import numpy as np

    from shardflow.compiler.ir import Tensor
    from shardflow.compiler.ops.linalg import Gemm, MatMul

    dt = "float32" if case.dtype in FLOAT32 else case.dtype
    a = Tensor("a", (case.M, case.K), dt)
    shape = (case.N, case.K) if case.b_layout == "nk" else (case.K, case.N)
    b = Tensor("b", shape, dt, value=np.broadcast_to(np.zeros((), np.float32), shape) if weight_b else None)
    if case.b_layout == "nk":
        return Gemm([a, b], name=case.id, trans_b=True)
    return MatMul([a, b], name=case.id)


def _build_one(case: Case, work: str, arch: str, cache_dir: str | None, extra: dict, config: str | None):
    if config:  # one forced tile configuration for every case
        extra = dict(extra, gemm_configs={case.id: config})
    if case.dtype in FLOAT32:  # (the Hopper kernels of float32 operands: opt-in in the compiler)
        extra = dict(extra, precision=case.dtype, wgmma_fp32=True)
    op = case_op(case, weight_b=bool(extra.get("pdl")))  # (--pdl: B a weight, whose first stages load early)
    return build_alone(op, work, arch, cache_dir=cache_dir, **extra)


def build(cases: list[Case], work: str, arch: str = "sm_90", jobs: int = 1, cache_dir: str | None = None,
          search_space: int | None = None, config: str | None = None, log=print, pdl: bool = False) -> dict:
    """Compile every case's kernel; returns ``{case.id: (cubin path, KernelLaunch, seconds)}``."""
    ensure_shardflow()
    from shardflow.compiler.codegen.cuda import build_cuda_library

    params = inspect.signature(build_cuda_library).parameters
    extra = {"search_space": search_space} if search_space is not None and "search_space" in params else {}
    if (search_space or 0) >= 2 and jobs > 1:
        jobs = 1  # (each build times its candidates on the GPU: builds side by side would skew each other's)
    if pdl:
        extra["pdl"] = True
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    out = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        futs = {pool.submit(_build_one, c, work, arch, cache_dir, extra, config): c for c in cases}
        for f in concurrent.futures.as_completed(futs):
            out[futs[f].id] = f.result()
    log(f"built {len(cases)} GEMM kernels for {arch} in {time.perf_counter() - t0:.1f} s ({jobs} at a time)")
    return out


# ----------------------------------------------------------------------------------------------
# running (GPU)
# ----------------------------------------------------------------------------------------------

def _cupy_view(t, cp):
    """A cupy int16 array over a torch tensor's memory (a pointer argument for our kernels; cupy
    has no bfloat16 and the kernel only needs the address)."""
    mem = cp.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t)
    return cp.ndarray((t.numel() * t.element_size() // 2,), cp.int16, cp.cuda.MemoryPointer(mem, 0))


def _time(enqueue, stream, reps: int, torch, use_graph: bool, n: int) -> float:
    """Median milliseconds per launch over ``reps`` timings of ``n`` launches; ``enqueue(i)`` puts
    launch ``i`` on torch's current stream."""
    with torch.cuda.stream(stream):
        for i in range(3):
            enqueue(i)
        stream.synchronize()
        graph = None
        if use_graph:
            graph = torch.cuda.CUDAGraph()
            # relaxed: our launches come from cupy, which torch's default ("global") mode would
            # police for calls it does not know to be capture-safe
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="relaxed"):
                for i in range(n):
                    enqueue(i)
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record(stream)
            if graph is not None:
                graph.replay()
            else:
                for i in range(n):
                    enqueue(i)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


def run_case(case: Case, cubin: str, launch, reps: int, l2_bytes: int, use_graph: bool, torch, cp,
             profile: bool = False, pdl: bool = False) -> dict:
    """Check and time one case (ours and cuBLAS); returns its JSON-ready record. With ``profile``,
    one more launch of each (after the timings, on the first input set) runs between
    ``cudaProfilerStart`` and ``cudaProfilerStop``: the launches ``ncu --profile-from-start off``
    profiles. ``pdl``: ours was built for programmatic dependent launch and is launched with it."""
    dt = torch.float32 if case.dtype in FLOAT32 else {"float16": torch.float16, "bfloat16": torch.bfloat16}[case.dtype]
    dev = torch.device("cuda")
    set_bytes = (4 if case.dtype in FLOAT32 else 2) * (case.M * case.K + case.K * case.N + case.M * case.N)
    nsets = max(1, min(MAX_SETS, math.ceil(3 * l2_bytes / set_bytes)))
    n = max(LAUNCHES_PER_GRAPH, nsets)  # every set used once per graph
    nk = case.b_layout == "nk"  # B stored [N, K]
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(case.id.encode()))
    sets = []
    for _ in range(nsets):
        a = torch.randn(case.M, case.K, device=dev, generator=gen).to(dt)
        b = torch.randn(*((case.N, case.K) if nk else (case.K, case.N)), device=dev, generator=gen).to(dt)
        c = torch.empty(case.M, case.N, device=dev, dtype=dt)
        sets.append((a, b, c))
    from shardflow.runtime.tma import kernel_args

    module = cp.RawModule(path=cubin)
    fn = module.get_function(launch.symbol)
    if launch.shared_mem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = launch.shared_mem
    stream = torch.cuda.Stream()
    cstream = cp.cuda.ExternalStream(stream.cuda_stream)
    views = [kernel_args(launch.tensor_maps, [_cupy_view(x, cp) for x in s]) for s in sets]
    grid, block, smem = tuple(launch.grid), tuple(launch.block), int(launch.shared_mem)

    if pdl:
        from shardflow.runtime.pdl import pdl_launcher

        launch_pdl = pdl_launcher(fn, case.id)

        def ours(i):
            with cstream:  # (the launcher takes cupy's current stream)
                launch_pdl(grid, block, views[i % nsets], shared_mem=smem)
    else:
        def ours(i):
            fn(grid, block, views[i % nsets], shared_mem=smem, stream=cstream)

    def cublas(i):  # (B [N, K]: the transposed view, which cuBLAS takes as is; tf32: one TF32 product)
        a, b, c = sets[i % nsets]
        torch.backends.cuda.matmul.allow_tf32 = case.dtype == TF32
        try:
            torch.matmul(a, b.t() if nk else b, out=c)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False

    # correctness: poison, run once, compare with an fp32 product of the same operands (TF32 off)
    a, b, c = sets[0]
    torch.cuda.synchronize()
    c.view(torch.int16).fill_(-1)
    torch.cuda.synchronize()
    ours(0)
    cstream.synchronize()
    ref = a.float() @ (b.float().t() if nk else b.float())
    scale = ref.abs().max().item()
    nan = bool(torch.isnan(c).any().item())
    err = (c.float() - ref).abs().max().item() / scale
    cublas(0)
    err_cublas = (c.float() - ref).abs().max().item() / scale
    del ref
    record = asdict(case)
    record.update(id=case.id, symbol=launch.symbol, kind=launch.kind, grid=list(grid), block=list(block),
                  shared_mem=smem, input_sets=nsets, launches_per_graph=n, pdl=pdl, err=None if nan else err,
                  err_cublas=err_cublas, ok=(not nan) and err <= TOLERANCE)
    method = "cuda-graph" if use_graph else "stream-loop"
    try:
        t_ours = _time(ours, stream, reps, torch, use_graph, n)
        t_cublas = _time(cublas, stream, reps, torch, use_graph, n)
    except Exception as exc:  # noqa: BLE001 - capture refused: time both sides without graphs
        if not use_graph:
            raise
        torch.cuda.synchronize()
        record["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        method = "stream-loop"
        t_ours = _time(ours, stream, reps, torch, False, n)
        t_cublas = _time(cublas, stream, reps, torch, False, n)
    if profile:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        ours(0)
        cstream.synchronize()
        with torch.cuda.stream(stream):
            cublas(0)
        stream.synchronize()
        torch.cuda.profiler.stop()
    record.update(method=method, ours_ms=t_ours, cublas_ms=t_cublas, ours_tflops=case.flops / t_ours / 1e9,
                  cublas_tflops=case.flops / t_cublas / 1e9, ratio=t_cublas / t_ours)
    return record


def run(cases: list[Case], built: dict, reps: int = 30, use_graph: bool = True, log=print, budget=None,
        profile: bool = False, pdl: bool = False) -> list[dict]:
    """Check and time every built case on the GPU; returns one record per case (``profile``,
    ``pdl``: see ``run_case``)."""
    import cupy as cp
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference products
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 0) or 50 * 2 ** 20)
    records = []
    for k, case in enumerate(cases):
        if budget is not None and not budget.allows(5):
            log(f"time budget spent: skipping the remaining {len(cases) - k} GEMM cases")
            break
        cubin, launch, _ = built[case.id]
        rec = run_case(case, cubin, launch, reps, l2, use_graph, torch, cp, profile=profile, pdl=pdl)
        torch.cuda.empty_cache()  # the case's buffers are gone with run_case's frame
        rec["build_s"] = built[case.id][2]
        records.append(rec)
        log(f"  {case.id:<34} ours {rec['ours_tflops']:7.1f} TFLOP/s  cuBLAS {rec['cublas_tflops']:7.1f}  "
            f"ratio {rec['ratio']:.3f}  err {fmt(rec['err'], '.1e')}{'' if rec['ok'] else '  WRONG'}")
    return records


def summarize(records: list[dict]) -> dict:
    """The headline figures: minimum and geometric mean of the ratio, per dtype and overall."""
    out: dict = {"cases": len(records), "all_correct": all(r["ok"] for r in records) if records else None}
    if not records:
        out["gemm_vs_cublas_min"] = None
        return out
    worst = min(records, key=lambda r: r["ratio"])
    out["gemm_vs_cublas_min"] = worst["ratio"]
    out["gemm_vs_cublas_min_case"] = worst["id"]
    out["gemm_vs_cublas_geomean"] = math.exp(sum(math.log(r["ratio"]) for r in records) / len(records))
    for dt in sorted({r["dtype"] for r in records}):
        rs = [r["ratio"] for r in records if r["dtype"] == dt]
        out[f"gemm_vs_cublas_min_{dt}"] = min(rs)
    return out


def format_table(records: list[dict]) -> str:
    rows = [[r["model"], r["proj"], r["M"], r["N"], r["K"], r["dtype"], fmt(r["ours_ms"], ".4f"),
             fmt(r["ours_tflops"], ".1f"), fmt(r["cublas_ms"], ".4f"), fmt(r["cublas_tflops"], ".1f"),
             fmt(r["ratio"], ".3f"), fmt(r["err"], ".1e") if r["ok"] else f"WRONG {fmt(r['err'], '.1e')}",
             r["kind"], f"{r['grid'][0]}x{r['grid'][1]}x{r['grid'][2]}/{r['block'][0]}"]
            for r in records]
    return table(["model", "proj", "M", "N", "K", "dtype", "ours ms", "ours TF/s", "cuBLAS ms", "cuBLAS TF/s",
                  "ratio", "err", "kind", "grid/block"], rows, align="<<>>><>>>>><<<")


def format_dry(cases: list[Case], built: dict) -> str:
    rows = []
    for c in cases:
        _, l, s = built[c.id]
        rows.append([c.model, c.proj, c.M, c.N, c.K, c.dtype, l.kind, f"{l.grid[0]}x{l.grid[1]}x{l.grid[2]}",
                     l.block[0], l.shared_mem, f"{s:.1f}"])
    return table(["model", "proj", "M", "N", "K", "dtype", "kind", "grid", "block", "smem", "build s"], rows,
                 align="<<>>><<>>>>")


# ----------------------------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """The GEMM options (also used by run_all.py, with ``prefix="gemm-"``)."""
    p = "--" + prefix
    ap.add_argument(p + "m", default=",".join(map(str, M_VALUES)), help="comma-separated M values")
    ap.add_argument(p + "shapes", default="", help="comma-separated: gpt2, llama7b or model.proj (default all)")
    ap.add_argument(p + "dtypes", default=",".join(DTYPES))
    ap.add_argument(p + "reps", type=int, default=30, help="graph replays timed per case (median)")
    ap.add_argument(p + "no-graph", action="store_true", help="time plain back-to-back launches")
    ap.add_argument(p + "pdl", action="store_true", help="ours built and launched for programmatic dependent "
                    "launch, B a weight (rfcs/0005 decisions 29, 48)")
    ap.add_argument(p + "b-layout", choices=("kn", "nk"), default="kn",
                    help="B stored [K, N] (MatMul's weight, the default) or [N, K] (a Linear's; cuBLAS gets the "
                         "transposed view)")


def cases_from_args(args, prefix: str = "") -> list[Case]:
    g = lambda k: getattr(args, (prefix + k).replace("-", "_"))  # noqa: E731
    return make_cases([int(x) for x in g("m").split(",") if x], [s for s in g("shapes").split(",") if s] or None,
                      [d for d in g("dtypes").split(",") if d], g("b-layout"))


def bench(cases: list[Case], work: str, *, arch: str, jobs: int, dry_run: bool, reps: int, use_graph: bool,
          cache_dir: str | None = None, budget=None, config: str | None = None, log=print,
          profile: bool = False, pdl: bool = False, search_space: int | None = None) -> dict:
    """Build, then (unless ``dry_run``) check and time ``cases``; returns the ``gemm`` JSON section.
    ``search_space=2``: each case's tile measured on this machine's GPU as the compiler's tuner
    measures it (``optimization_config["search_space"]``; the builds then run one at a time)."""
    t0 = time.perf_counter()
    built = build(cases, work, arch=arch, jobs=jobs, cache_dir=cache_dir, config=config, log=log, pdl=pdl,
                  search_space=search_space)
    section: dict = {"arch": arch, "config": config or "auto", "pdl": pdl, "search_space": search_space,
                     "build_s": time.perf_counter() - t0,
                     "dry_run": dry_run,
                     "min_launches_per_graph": LAUNCHES_PER_GRAPH, "reps": reps, "tolerance": TOLERANCE}
    if dry_run:
        section["kernels"] = [dict(asdict(c), id=c.id, **built[c.id][1].to_dict(), build_s=built[c.id][2])
                              for c in cases]
        section["table"] = format_dry(cases, built)
        return section
    records = run(cases, built, reps=reps, use_graph=use_graph, log=log, budget=budget, profile=profile, pdl=pdl)
    section["records"] = records
    section.update(summarize(records))
    section["table"] = format_table(records)
    return section


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="parallel nvcc builds")
    ap.add_argument("--cache-dir", help="kernel cache (default: shardflow's)")
    ap.add_argument("--dry-run", action="store_true", help="build every kernel, run nothing (no GPU needed)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--config", help="force this wgmma block tile (a WGMMA_CONFIGS name) on every case")
    ap.add_argument("--search-space", type=int, choices=(0, 1, 2),
                    help="optimization_config['search_space'] of the builds: 2 times every candidate tile of "
                         "each case on this GPU (codegen/tune.py) and takes the fastest (default: the "
                         "compiler's default, the fitted tile choice)")
    ap.add_argument("--split-min-kt", type=int, help="sweep: fewest K tiles per split-K piece, and per "
                    "stream-K block on average "
                    "(sets cuda_wgmma.SPLIT_MIN_KT for this run)")
    ap.add_argument("--ncu", action="store_true", help="after each case's timings, launch ours and cuBLAS once "
                    "more between cudaProfilerStart/Stop (run under `ncu --profile-from-start off`)")
    args = ap.parse_args(argv)
    ensure_shardflow()
    if args.split_min_kt:
        from shardflow.compiler.codegen import cuda_wgmma
        cuda_wgmma.SPLIT_MIN_KT = args.split_min_kt
    cases = cases_from_args(args)
    with tempfile.TemporaryDirectory(prefix="sf-gemm-") as work:
        section = bench(cases, work, arch=args.arch, jobs=args.jobs, dry_run=args.dry_run, reps=args.reps,
                        use_graph=not args.no_graph, cache_dir=args.cache_dir, config=args.config,
                        profile=args.ncu, pdl=args.pdl, search_space=args.search_space)
    print(section["table"])
    if not args.dry_run:
        print(f"gemm_vs_cublas_min = {fmt(section.get('gemm_vs_cublas_min'))} "
              f"({section.get('gemm_vs_cublas_min_case')}), all correct: {section.get('all_correct')}")
    dump_json(args.json, section)
    return section


if __name__ == "__main__":
    main()
