"""Programmatic dependent launch (runtime/pdl.py, rfcs/0005 decision 29) without a GPU: the driver
structures against cuda.h, the kernel parameters, and the cuda engine launching every kernel
through ``cuLaunchKernelEx`` (a stand-in driver that runs the test's numpy kernels) when the
program says ``pdl``, eagerly, in graphs and for the fresh-output tail. The real launches run in
tests/runtime/test_gpu_runtime.py (``pytest -m gpu``)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from fake_cupy import _Array, _fake_cupy, _Stream
from test_cuda_engine_fake import _program, add, twice

from shardflow.runtime import pdl
from shardflow.runtime.pdl import LaunchAttribute, LaunchConfig

CUDA_H = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include" / "cuda.h"


@pytest.mark.skipif(not CUDA_H.is_file() or shutil.which("cc") is None, reason="needs cuda.h and a C compiler")
def test_structures_match_cuda_h(tmp_path):
    """Sizes and field offsets of CUlaunchConfig and CUlaunchAttribute, and the attribute's id, as
    the CUDA header lays them out (compiled here: no GPU needed)."""
    fields = [f for f, _ in LaunchConfig._fields_]
    prog = tmp_path / "layout.c"
    prog.write_text("#include <stdio.h>\n#include <stddef.h>\n#include <cuda.h>\nint main(void) {\n"
                    '  printf("%zu %zu %zu %zu %d\\n", sizeof(CUlaunchConfig), sizeof(CUlaunchAttribute), '
                    "offsetof(CUlaunchAttribute, value), sizeof(CUlaunchAttributeValue), "
                    "(int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n"
                    + "".join(f'  printf("%zu\\n", offsetof(CUlaunchConfig, {f}));\n' for f in fields)
                    + "  return 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["cc", f"-I{CUDA_H.parent}", str(prog), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    assert [int(x) for x in out[:5]] == [ctypes.sizeof(LaunchConfig), ctypes.sizeof(LaunchAttribute),
                                         LaunchAttribute.value.offset, 64, pdl.PROGRAMMATIC_STREAM_SERIALIZATION]
    assert [int(x) for x in out[5:]] == [getattr(LaunchConfig, f).offset for f in fields]


def test_launch_config_and_parameters():
    cfg, attr = pdl.launch_config((3, 2), (128,), 4096, 0xABC)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (3, 2, 1, 128,
                                                                                                         1, 1)
    assert cfg.sharedMemBytes == 4096 and cfg.hStream == 0xABC and cfg.numAttrs == 1
    assert cfg.attrs[0].id == 6 and bytes(cfg.attrs[0].value[:4]) == (1).to_bytes(4, sys.byteorder)
    a, b = np.zeros(4, np.float32).view(_Array), np.zeros(2, np.int64).view(_Array)
    tmap = np.zeros(1, np.dtype((np.void, 128)))
    params, keep = pdl._params([a, b, tmap])
    ptr = lambda i: ctypes.cast(params[i], ctypes.POINTER(ctypes.c_void_p)).contents.value  # noqa: E731
    assert ptr(0) == a.data.ptr and ptr(1) == b.data.ptr  # each parameter: the address of a device pointer
    assert params[2] == tmap.ctypes.data  # a tensor map: its 128 bytes, by value
    with pytest.raises(pdl.PdlError, match="int"):
        pdl._params([3])


class _FakeDriver:
    """cuLaunchKernelEx over the fake cupy's numpy "device" arrays: runs the kernel (or records it
    while the stream captures) and keeps each launch's configuration."""

    def __init__(self, functions: dict, arrays):
        self.functions, self.arrays, self.configs = functions, arrays, []  # arrays(): those that exist

    def __call__(self, cfg_ref, func, params, extra):
        cfg = ctypes.cast(cfg_ref, ctypes.POINTER(LaunchConfig)).contents
        self.configs.append((cfg.gridDimX, cfg.blockDimX, cfg.sharedMemBytes, cfg.hStream, cfg.attrs[0].id,
                             cfg.attrs[0].value[0]))
        fn = self.functions[func.value]
        args = []
        for i in range(fn.nargs):
            address = ctypes.cast(params[i], ctypes.POINTER(ctypes.c_void_p)).contents.value
            args.append(next(a for a in self.arrays() if a.data.ptr == address and a.size))
        if _Stream.capturing is not None:
            _Stream.capturing.append((fn.run, (args,)))
        else:
            fn.run(args)
        return 0


def test_engine_launches_every_kernel_with_pdl(monkeypatch):
    """A program marked ``pdl``: eager run, graphs, and the fresh-output tail all go through
    cuLaunchKernelEx with the attribute, on the current stream, and compute what they should."""
    log: list = []
    cp = _fake_cupy({"add": add, "twice": twice}, log)
    stream = types.SimpleNamespace(ptr=0x5EED)
    cp.cuda.get_current_stream = lambda: stream
    functions = {}
    get = cp.RawModule

    def raw_module(path):
        mod = get(path)
        inner = mod.get_function

        def get_function(name):
            f = inner(name)
            f.ptr, f.nargs = 1000 + len(functions), {"add": 3, "twice": 2}[name]
            functions[f.ptr] = f
            return f
        return types.SimpleNamespace(get_function=get_function)
    cp.RawModule = raw_module
    monkeypatch.setitem(sys.modules, "cupy", cp)
    from shardflow.runtime.cuda_exec import CudaEngine

    fresh = []  # the arrays the engine allocates for fresh outputs
    empty = cp.empty
    cp.empty = lambda shape, dtype: fresh.append(empty(shape, dtype)) or fresh[-1]
    prog = types.SimpleNamespace(program=_program(), weights=np.arange(4, dtype=np.float32).view(np.uint8),
                                 buffers=[None] * 4, directory=Path("."), rank=0, groups={})
    engine = CudaEngine(prog, pdl=True)
    driver = _FakeDriver(functions, lambda: list(engine.views) + fresh)
    monkeypatch.setattr(pdl, "_driver", lambda: (driver, None))
    x = np.ones(4, np.float32)
    for _ in range(3):  # eager, then the graph of every step
        np.testing.assert_array_equal(engine.run({"x": x})["y"], 2 * (x + np.arange(4)))
    assert len(driver.configs) == 4 and set(driver.configs) == {(1, 32, 0, 0x5EED, 6, 1)}  # eager 2, capture 2
    assert log == ["add", "twice"] * 3
    for _ in range(2):  # device inputs: the graph without the tail, whose kernel writes a fresh array
        y = engine.run({"x": x.view(_Array)})["y"]
        np.testing.assert_array_equal(y, 2 * (x + np.arange(4)))
        assert y is fresh[-1]
    assert len(driver.configs) == 7 and set(driver.configs) == {(1, 32, 0, 0x5EED, 6, 1)}  # + capture 1, tail 2


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_compiled_program_asks_for_pdl(tmp_path):
    """``optimization_config["pdl"]``: the rank's manifest says so (the runtime then launches with
    it) and its cubin builds; without the key, neither."""
    import json

    from shardflow.compiler import compile

    models = Path(__file__).parent.parent / "models"
    for pdl_on in (True, False):
        res = compile(models / "mlp_ts17.onnx", distributed_config={"mesh_shape": [1]},
                      optimization_config={"target": "cuda", "arch": "sm_90", **({"pdl": True} if pdl_on else {})},
                      out_dir=tmp_path / str(pdl_on))
        manifest = json.loads((res.out_dir / "rank0" / "manifest.json").read_text())
        assert manifest["pdl"] is pdl_on and (res.out_dir / "rank0" / "kernels.cubin").stat().st_size > 0
