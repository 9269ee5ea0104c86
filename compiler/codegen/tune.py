"""Kernel tuning for the cuda target (``optimization_config["search_space"]``).

``search_space`` 0 and 1 use the documented default: :func:`~.cuda_wgmma.choose_wgmma_config`, a
model fitted to H100 measurements (waves × useful fraction × per-tile throughput; within 10% of
the fastest tile on 22 of the 24 float16 benchmark shapes). ``search_space=2`` measures instead:
for each wgmma GEMM of the program, every block tile (:data:`CANDIDATES`: cp.async, TMA, ping-pong and
stream-K; those fed by TMA only for unbatched products) is compiled alone,
launched on random operands of the op's shapes on the GPU of the compiling machine, and timed with
CUDA events (median of 3 × 10 back-to-back launches); the fastest is used. A candidate whose
output on those operands differs from the default tile's (by more than 1% of the output's
largest value, or NaN where the default has a number) is not used: speed must not buy a
wrong kernel. The candidates of all the program's GEMMs are compiled before any is timed, one
compiler process per cpu at once, and their cubins go into the kernel cache like the program's.
Choices are kept as
JSON in ``<kernel cache>/tune/`` keyed by the kernel's source, the GPU's name and the candidates,
so repeated layers and later builds measure nothing. Without a visible GPU (or cupy), level 2
falls back to the default and says so in the log.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import statistics
import tempfile
from typing import Callable, Sequence

import numpy as np

from shardflow.runtime.tma import kernel_args
from ..ir.graph import Operator
from .cache import touch
from .cuda_wgmma import PERSISTENT_SMS, WGMMA_CONFIGS
from .toolchain import default_jobs

__all__ = ["tune_gemms", "gpu_name", "visible_gpu"]

log = logging.getLogger(__name__)

#: the tiles level 2 measures: the cp.async ones, and those fed by TMA (plain, ping-pong and stream-K;
#: each only where it applies, one unbatched product whose operands TMA loads). The ping-pong and
#: stream-K tiles joined in session 77, once an H200 had run their GPU tests and timed them (session
#: 33: a ping-pong tile the fastest on 9 of the 24 float16 benchmark shapes, a stream-K one on 1);
#: the default choice still leaves them out (rfcs/0005 decision 71). Not the cluster tiles (no GPU
#: has run them) nor those that need B stored [N, K] (a layout of the program's weight, not a tile)
CANDIDATES = ("128x256", "128x128", "64x128", "64x64", "tma128x256", "tma128x192", "tma128x128", "tma64x128",
              "pp64x256", "pp64x192", "pp64x128", "sk128x256", "sk128x192", "sk128x128", "sk64x128")
#: the tile families a GPU has run only on float16 and bfloat16 operands: candidates for those only
_HALF_ONLY = ("pp", "sk")


def visible_gpu() -> dict | None:
    """The CUDA device cupy sees: ``name``, ``sm`` (its compute capability as ``90`` for 9.0) and
    ``sms`` (multiprocessors); None without cupy, a driver or a device."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        dev = cupy.cuda.Device()
        name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
        return {"name": name.decode() if isinstance(name, bytes) else str(name), "sm": int(dev.compute_capability),
                "sms": int(dev.attributes["MultiProcessorCount"])}
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device
        return None


def gpu_name() -> str | None:
    """The name of the CUDA device cupy sees, or None (no cupy, no device)."""
    gpu = visible_gpu()
    return gpu["name"] if gpu else None


def _random_inputs(op: Operator, cupy):
    rng = np.random.default_rng(0)
    arrays = []
    for t in op.inputs:
        shape = tuple(t.shape)
        if t.dtype in ("float16", "float32", "float64"):
            a = rng.standard_normal(shape).astype(t.dtype)
        elif t.dtype == "bfloat16":
            a = (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        else:  # indices and masks: zeros are in range
            a = np.zeros(shape, np.uint8 if t.dtype == "bool" else t.dtype)
        arrays.append(cupy.asarray(a))
    for t in op.outputs:
        arrays.append(cupy.empty(tuple(t.shape), np.uint16 if t.dtype == "bfloat16" else
                                 (np.uint8 if t.dtype == "bool" else t.dtype)))
    return arrays


def _loaded(cupy, cubin: bytes, launch):
    """The kernel of ``launch`` loaded from ``cubin`` (a module of its own: split-K counters fresh)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        fn = cupy.RawModule(path=path).get_function(launch.symbol)
    finally:
        os.unlink(path)
    if launch.shared_mem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = launch.shared_mem
    return fn


def output_on_gpu(cubin: bytes, launch, op: Operator):
    """The output of one launch of ``launch`` on the random operands :func:`measure_on_gpu` uses
    (the same for every candidate), as a float32 device array; elements it does not write are NaN."""
    import cupy

    fn = _loaded(cupy, cubin, launch)
    arrays = _random_inputs(op, cupy)
    out = arrays[len(op.inputs)]
    bits = out.dtype == cupy.uint16  # bfloat16, stored as its bits
    out[...] = 0xFFFF if bits else np.nan  # (0xFFFF: a NaN in bfloat16)
    fn(launch.grid, launch.block, kernel_args(launch.tensor_maps, arrays), shared_mem=launch.shared_mem)
    return (out.astype(cupy.uint32) << 16).view(cupy.float32) if bits else out.astype(cupy.float32)


def _agrees(got, want) -> bool:
    """``got`` within 1% of ``want``'s largest magnitude, and a number wherever ``want`` is one
    (numpy or cupy arrays)."""
    xp = __import__("cupy") if type(want).__module__.startswith("cupy") else np
    finite = xp.isfinite(want)
    if bool((finite & ~xp.isfinite(got)).any()):
        return False
    scale = float(xp.abs(xp.where(finite, want, 0)).max()) if want.size else 0.0
    return bool((xp.abs(xp.where(finite, got - want, 0)) <= 1e-2 * scale).all())


def measure_on_gpu(cubin: bytes, launch, op: Operator, reps: int = 10) -> float:
    """Milliseconds per launch of ``launch`` (a KernelLaunch in ``cubin``) on random operands."""
    import cupy

    fn = _loaded(cupy, cubin, launch)
    args = kernel_args(launch.tensor_maps, _random_inputs(op, cupy))
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(2):
        fn(launch.grid, launch.block, args, shared_mem=launch.shared_mem)
    times = []
    for _ in range(3):
        start.record()
        for _ in range(reps):
            fn(launch.grid, launch.block, args, shared_mem=launch.shared_mem)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / reps)
    return statistics.median(times)


def tune_gemms(ops: Sequence[Operator], *, arch: str, precision: str, cache_dir: str,
               compile_source: Callable, measure: Callable | None = None, output: Callable | None = None,
               device: str | None = None, wgmma_fp32: bool = False, sms: int = PERSISTENT_SMS) -> dict[str, str]:
    """Measured wgmma tiles for the GEMMs of ``ops``: op name -> tile name (only ops whose
    choice was measured or cached; the others keep the default).

    ``compile_source(src) -> cubin bytes`` compiles a :class:`~.cuda.CudaSource`; ``measure(cubin,
    launch, op) -> ms`` times one kernel (default :func:`measure_on_gpu`); ``output(cubin, launch,
    op)`` is its result on the same operands (default :func:`output_on_gpu`), which must agree with
    the default tile's for the candidate to count; ``device`` names the GPU the choices are for
    (default: the visible one; without one nothing is measured). ``wgmma_fp32``: as
    :func:`~.cuda.generate_cuda_source` takes it (float32 products on the wgmma template too), and
    ``sms`` (the target's multiprocessors: the candidates' K splits and grids).
    """
    from .cuda import _atomic_write, generate_cuda_source

    device = device or gpu_name()
    if device is None:
        log.info("search_space=2: no CUDA device visible here; wgmma GEMMs use the default tile choice")
        return {}
    measure = measure or measure_on_gpu
    output = output or output_on_gpu
    base = generate_cuda_source(list(ops), precision, arch, wgmma_fp32=wgmma_fp32, sms=sms)
    folder = os.path.join(cache_dir, "tune")
    chosen: dict[str, str] = {}
    todo = {}  # cache path -> (op, the default tile's source, {candidate: source}, names of ops with its kernel)
    for op in ops:
        launch = base.launches.get(op.name)
        if launch is None or not launch.kind.startswith("gemm-wgmma"):
            continue
        a, b = base.lines[op.name]
        text = "\n".join(base.text.splitlines()[a - 1:b])
        text = text[text.index('extern "C"'):].replace(launch.symbol, "K")  # the kernel alone
        key = hashlib.sha256("\0".join([text, device, arch, precision, *CANDIDATES]).encode()).hexdigest()
        path = os.path.join(folder, key[:2], key + ".json")
        try:
            with open(path) as f:
                chosen[op.name] = json.load(f)["config"]
        except FileNotFoundError:  # (not measured yet, or taken out of the cache)
            pass
        else:
            touch(path)
            continue
        if path in todo:  # another op with this kernel (a repeated layer): measured once
            todo[path][3].append(op.name)
            continue
        cands = {}
        for cand in CANDIDATES:
            src = generate_cuda_source([op], precision, arch, {op.name: cand}, wgmma_fp32=wgmma_fp32, sms=sms)
            kind, family = src.launches[op.name].kind, WGMMA_CONFIGS[cand][3]
            if family != "cp" and not src.launches[op.name].tensor_maps:
                continue  # (a batched product, a gathered operand: the tile falls back to a cp.async one)
            if family in _HALF_ONLY and kind not in ("gemm-wgmma-f16", "gemm-wgmma-bf16"):
                continue  # (float32 operands: TF32 or 3xTF32 steps, which no GPU has run on these tiles)
            cands[cand] = src
        todo[path] = (op, generate_cuda_source([op], precision, arch, wgmma_fp32=wgmma_fp32, sms=sms), cands,
                      [op.name])
    # every candidate is compiled before any is timed, all at once (nvcc runs apart from Python)
    sources = {s.text: s for _, alone, cands, _ in todo.values() for s in (alone, *cands.values())}
    cubins = _compile_concurrently(list(sources.values()), compile_source)
    for path, (op, alone, cands, names) in todo.items():
        want = output(cubins[alone.text], alone.launches[op.name], op)  # the default tile: the reference
        times, wrong = {}, []
        for cand, src in cands.items():
            cubin, launch = cubins[src.text], src.launches[op.name]
            if not _agrees(output(cubin, launch, op), want):
                wrong.append(cand)
                continue
            times[cand] = float(measure(cubin, launch, op))
        if wrong:
            log.warning("tuning %s: tiles %s give other values than the default tile on the same operands; "
                        "not used", op.name, wrong)
        if not times:
            continue  # (every candidate disagreed: the default stays)
        best = min(times, key=times.get)
        chosen.update(dict.fromkeys(names, best))
        log.info("tuned %s (%s): %s", op.name, ", ".join(f"{c} {t:.4f} ms" for c, t in times.items()), best)
        record = {"config": best, "ms": times, "device": device, "op": op.name, "rejected": wrong}
        try:
            _atomic_write(path, json.dumps(record, indent=1).encode())
        except OSError as exc:  # a read-only cache must not fail the build
            log.warning("cannot write the tuning cache %s: %s", path, exc)
    return chosen


def _compile_concurrently(sources: list, compile_source: Callable) -> dict[str, bytes]:
    """Source text -> cubin for each of ``sources``, compiled by up to one thread per cpu it may use (each
    waits on its own compiler process). The first compile error is raised, after the others end."""
    if not sources:
        return {}
    workers = max(1, min(len(sources), default_jobs()))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="shardflow-tune") as pool:
        futures = [pool.submit(compile_source, s) for s in sources]
        concurrent.futures.wait(futures)
    return {s.text: f.result() for s, f in zip(sources, futures)}
