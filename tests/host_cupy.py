"""Run a compiled cuda out_dir on the host, without a GPU (a test tool, not part of shardflow).

:func:`use_host_cuda` makes the cuda target's compile write each library's CUDA source where its
cubin goes (nvcc not run), and replaces cupy by the numpy stand-in of ``fake_cupy.py`` whose
``RawModule`` compiles that source with g++ against ``cuda_host.py``'s emulation of CUDA and runs
its kernels there, with the emulation's tensor maps for the TMA-fed ones (and programmatic dependent
launches as plain ones, one after another). So a whole program
(``program.json``'s buffers, load steps, state, the engine's captured graphs, shape variants)
runs through the runtime's own cuda engine, and its outputs can be compared with onnxruntime's.
What it cannot show is what ``cuda_host.py`` says it cannot (timing, the memory model, limits),
nor anything about cupy, the driver or NCCL themselves.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import types
from pathlib import Path

import numpy as np
from cuda_host import _aligned, build, tensor_map
from fake_cupy import _Array, _fake_cupy, _Stream


def _asarray(a, dtype=None, order=None) -> _Array:
    a = np.asarray(a, dtype)
    return _full(a.shape, a, a.dtype)


def _full(shape, value, dtype) -> _Array:
    """A "device" array of ``shape`` and ``dtype`` (aligned as the arena places buffers) holding ``value``."""
    res = _aligned(shape, dtype).view(_Array)
    res[...] = value
    return res


#: one launch at a time: the emulation keeps its scheduler in globals, and ranks run as threads of one
#: process (InProcessWorld); a launch never waits for another rank, so holding it across one is safe
_LAUNCH = threading.Lock()
#: the multiprocessors of the stand-in's device (an H100 SXM's)
_SMS = 132


class _HostFunction:
    """A kernel of the emulated library, launched as cupy's ``RawKernel``s are (recorded while the
    thread's stream captures, like ``fake_cupy``'s)."""

    def __init__(self, kernels, symbol: str, cluster: int, waits: bool, log: list):
        self.kernels, self.symbol, self.cluster, self.waits, self.log = kernels, symbol, cluster, waits, log

    def __call__(self, grid, block, args, shared_mem=0):
        if _Stream.capturing is not None:
            _Stream.capturing.append((self.run, (grid, block, args, shared_mem)))
        else:
            self.run(grid, block, args, shared_mem)

    def run(self, grid, block, args, shared_mem):
        self.log.append(self.symbol)
        # blocks resident at once: one cluster, or for a kernel whose blocks wait for each other (split-K
        # spread over a persistent grid, stream-K: sf_grid_wait) as many as an H100 guarantees (one a
        # multiprocessor). (Not always all: the emulation's static __shared__ arrays are one per process.)
        blocks = int(np.prod(grid))
        resident = -(-min(blocks, _SMS) // self.cluster) * self.cluster if self.waits else self.cluster
        with _LAUNCH:
            self.kernels.launch(self.symbol, tuple(grid), tuple(block), list(args), int(shared_mem), 1, resident,
                                1, self.cluster)


def _host_tensor_map(spec: dict, address: int, what: str = "a kernel") -> np.ndarray:
    """The emulation's tensor map of ``spec`` at device address ``address`` (runtime/tma.py's
    ``encode_tensor_map`` asks the driver for the real one)."""
    return tensor_map(spec, types.SimpleNamespace(ctypes=types.SimpleNamespace(data=int(address))))


def host_cupy(work_dir: str, log: list | None = None) -> types.ModuleType:
    """cupy's stand-in whose modules are the emulated kernels of a library written by a compile under
    :func:`use_host_cuda` (its "cubin" is the CUDA source); ``log`` collects the kernels launched."""
    log = [] if log is None else log
    cp = _fake_cupy({}, log)
    cp.asarray = _asarray
    cp.asnumpy = lambda a, stream=None: np.array(a)
    cp.stack = lambda arrays, axis=0: np.stack([np.asarray(a) for a in arrays], axis).view(_Array)
    cp.zeros = lambda shape, dtype=np.float64: _full(shape, 0, dtype)
    cp.empty = lambda shape, dtype=np.float64: _full(shape, 0, dtype)
    cp.full = lambda shape, value, dtype=None: _full(shape, value, np.asarray(value).dtype if dtype is None else dtype)
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint16", "uint32"):
        setattr(cp, name, getattr(np, name))
    # (what the communicators' generic and prepared collectives call on device arrays: runtime/comm)
    for name in ("moveaxis", "ascontiguousarray", "concatenate", "maximum", "minimum", "pad", "trunc"):
        setattr(cp, name, lambda *a, _f=getattr(np, name), **k: np.asarray(_f(*a, **k)).view(_Array))
    cp.cuda.runtime.deviceSynchronize = lambda: None
    built: dict[str, tuple] = {}  # source -> its emulated kernels, clusters and waiting kernels

    def raw_module(path):
        text = Path(path).read_text()
        if text not in built:
            # each kernel's blocks per cluster (its __cluster_dims__; a program's launches say the same),
            # and whether its blocks wait for each other
            clusters, waits = {}, set()
            for chunk in text.split('extern "C" __global__')[1:]:
                m = re.match(r"\s*void\s+__launch_bounds__\([^)]*\)\s*(?:__cluster_dims__\((\d+), 1, 1\)\s*)?(\w+)\(",
                             chunk)
                if m:
                    clusters[m.group(2)] = int(m.group(1) or 1)
                    if "sf_grid_wait(&" in chunk:
                        waits.add(m.group(2))
            built[text] = (build(text, work_dir), clusters, waits)
        kernels, clusters, waits = built[text]
        return types.SimpleNamespace(get_function=lambda name: _HostFunction(
            kernels, name, clusters.get(name, 1), name in waits, log))

    cp.RawModule = raw_module
    cp.cuda.Device = lambda device=None: types.SimpleNamespace(id=0, attributes={"MultiProcessorCount": _SMS},
                                                               compute_capability="90")
    return cp


def use_host_cuda(monkeypatch, work_dir: str, log: list | None = None) -> None:
    """From here on (the test's ``monkeypatch``), cuda compiles keep their CUDA source as the cubin and
    cuda programs load and run on the host emulation (see the module docstring)."""
    from shardflow.compiler.codegen import cuda
    from shardflow.runtime import cuda_exec, tma

    os.makedirs(work_dir, exist_ok=True)
    monkeypatch.setattr(cuda, "_cached_cubin", lambda src, arch, cache, compiler: (src.text.encode(), False))
    monkeypatch.setitem(sys.modules, "cupy", host_cupy(work_dir, log))
    monkeypatch.setattr(tma, "encode_tensor_map", _host_tensor_map)  # (kernel_args' maps: the emulation's)
    # programmatic dependent launch: the emulation runs one launch after another, each kernel's
    # griddepcontrol wait already met (its own shim), so a PDL launch is a plain one here
    monkeypatch.setattr(cuda_exec, "pdl_launcher", lambda function, what: function)
