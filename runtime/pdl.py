"""Kernel launches with programmatic dependent launch (PDL, Hopper and newer).

A program compiled with ``optimization_config["pdl"]`` starts every kernel with
``griddepcontrol.wait`` (it waits until the kernel before it in the stream has completed and its
writes are visible) followed by ``griddepcontrol.launch_dependents`` (the next kernel may be
launched). Launched with the attribute ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``,
the next kernel's blocks are then scheduled while this kernel's last blocks still run, and wait on
the GPU instead of behind the launch: the gap between dependent kernels shrinks (rfcs/0005
decision 29). Nothing a kernel does comes before its wait but setting up its shared memory and
copying weights (decision 48: a tensor-core GEMM's first stages of a weight, which no kernel
writes), so each kernel still sees all the work before it (its predecessor completed only after
the predecessor's own wait returned).

cupy's kernel calls take no launch attributes, so these launches go through the CUDA driver's
``cuLaunchKernelEx`` (``libcuda.so.1``) with cupy's function and stream handles; they are captured
into CUDA graphs like any launch on the stream.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any, Sequence

import numpy as np

from .errors import ShardflowError
from .tma import _MAP_DTYPE

__all__ = ["PdlError", "LaunchConfig", "LaunchAttribute", "pdl_launcher", "launch_config"]

#: ``CUlaunchAttributeID`` of the attribute (cuda.h)
PROGRAMMATIC_STREAM_SERIALIZATION = 6


class PdlError(ShardflowError):
    """A launch with programmatic dependent launch failed (no driver, or the driver refused it)."""


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise PdlError(f"programmatic dependent launch needs the CUDA driver library libcuda.so.1 ({exc})") from None
    try:
        launch, name = lib.cuLaunchKernelEx, lib.cuGetErrorName
    except AttributeError:
        raise PdlError("the CUDA driver has no cuLaunchKernelEx (a driver for CUDA 12.0 or newer is needed for "
                       "programmatic dependent launch; or compile without optimization_config['pdl'])") from None
    launch.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                       ctypes.c_void_p]
    launch.restype = ctypes.c_int
    name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    name.restype = ctypes.c_int
    return launch, name


def launch_config(grid: Sequence[int], block: Sequence[int], shared_mem: int, stream: int) -> tuple:
    """The ``CUlaunchConfig`` of one launch with the programmatic-serialization attribute set (and
    the attribute array it points to, which must outlive the call)."""
    attr = (LaunchAttribute * 1)()
    attr[0].id = PROGRAMMATIC_STREAM_SERIALIZATION
    attr[0].value[0] = 1  # programmaticStreamSerializationAllowed (an int at the union's start)
    g = tuple(grid) + (1,) * (3 - len(grid))
    b = tuple(block) + (1,) * (3 - len(block))
    cfg = LaunchConfig(*g, *b, int(shared_mem), ctypes.c_void_p(int(stream)), attr, 1)
    return cfg, attr


def _params(args: Sequence[Any]) -> tuple:
    """``void* kernelParams[]`` for ``args``: device arrays (their data pointers, passed as the
    kernel's pointer parameters) and tensor maps (128-byte host arrays, passed by value); with the
    storage the pointers point at."""
    keep = []
    for a in args:
        ptr = getattr(getattr(a, "data", None), "ptr", None)
        if isinstance(a, np.ndarray) and a.dtype == _MAP_DTYPE:
            keep.append(a)  # a tensor map (runtime/tma.py), by value
        elif ptr is not None:  # a device array: its address, the kernel's pointer parameter
            keep.append(ctypes.c_void_p(int(ptr)))
        else:
            raise PdlError(f"a kernel argument of type {type(a).__name__} cannot be passed to cuLaunchKernelEx")
    addrs = (ctypes.c_void_p * max(1, len(keep)))(
        *[a.ctypes.data if isinstance(a, np.ndarray) else ctypes.addressof(a) for a in keep])
    return addrs, keep


def pdl_launcher(function: Any, what: str) -> Any:
    """A callable ``(grid, block, args, shared_mem=0)`` like a cupy kernel function's, launching
    ``function`` (a cupy ``Function``) on the current cupy stream with programmatic dependent
    launch; ``what`` names the kernel in errors."""
    import cupy as cp

    def launch(grid, block, args, shared_mem: int = 0) -> None:
        fn, name = _driver()
        cfg, attr = launch_config(grid, block, shared_mem, cp.cuda.get_current_stream().ptr)
        params, keep = _params(args)  # (attr and keep: alive until the driver has read them)
        status = fn(ctypes.byref(cfg), ctypes.c_void_p(int(function.ptr)), params, None)
        if status != 0:
            text = ctypes.c_char_p()
            name(status, ctypes.byref(text))
            raise PdlError(f"cuLaunchKernelEx of {what} failed: {(text.value or b'?').decode()} ({status}); compile "
                           "without optimization_config['pdl'] if this driver or GPU does not take it")
    return launch
