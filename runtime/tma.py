"""Tensor maps for the Hopper bulk tensor copy engine (TMA), made when a kernel is launched.

Some generated GEMM kernels (``tma*`` tiles of :mod:`shardflow.compiler.codegen.cuda_wgmma`) load
their operand tiles with ``cp.async.bulk.tensor``, which reads a *tensor map*: 128 opaque bytes
that the CUDA driver encodes from the operand's device address, extents, strides, the box (tile)
shape and the shared-memory swizzle. The address is only known where the buffers live, so the
compiler records a description of each map with the launch (``tensor_maps`` in ``program.json``)
and the code that launches the kernel encodes the maps here and passes them after the tensor
arguments, by value (``__grid_constant__`` kernel parameters).

One description (a dict, JSON-ready)::

    {"arg": 0,              # which tensor argument (index into the launch's args)
     "offset": 0,           # elements from the argument's start to the map's origin
     "dtype": "float16",    # or "bfloat16"
     "dims": [K, M],        # extents, innermost first
     "strides": [2 * K],    # bytes between consecutive indices of dims[1:], each a multiple of 16
     "box": [64, 128],      # elements per copy along each dim (the tile)
     "swizzle": 128}        # shared-memory swizzle span in bytes (128, 64, 32 or 0)

Encoding needs the CUDA driver library (``libcuda.so.1``), present wherever a GPU is.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any, Sequence

import numpy as np

from .errors import ShardflowError

__all__ = ["TensorMapError", "encode_tensor_map", "kernel_args"]

_DTYPES = {"float16": (6, 2), "bfloat16": (9, 2), "float32": (7, 4)}  # CUtensorMapDataType, bytes
_SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}  # bytes -> CUtensorMapSwizzle
_L2_PROMOTION_256B = 3
#: a kernel parameter of 128 bytes, passed by value (cupy copies a size-one numpy array's bytes)
_MAP_DTYPE = np.dtype((np.void, 128))


class TensorMapError(ShardflowError):
    """A tensor map cannot be made: no CUDA driver, or the driver refuses the description."""


@functools.lru_cache(maxsize=1)
def _encoder():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise TensorMapError(f"TMA kernels need the CUDA driver library libcuda.so.1 ({exc}); run them on a "
                             "machine with an NVIDIA GPU and driver") from None
    try:
        fn = lib.cuTensorMapEncodeTiled
    except AttributeError:
        raise TensorMapError("the CUDA driver has no cuTensorMapEncodeTiled (a driver for CUDA 12.0 or newer is "
                             "needed for TMA kernels; or compile for an architecture before sm_90)") from None
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def encode_tensor_map(spec: dict, address: int, what: str = "a kernel") -> np.ndarray:
    """The 128-byte tensor map of ``spec`` (see the module docstring) for a tensor whose argument
    starts at device address ``address``, as a size-one numpy array (a kernel argument by value).

    Raises :class:`TensorMapError` naming ``what`` when the driver refuses the description (an
    address or stride that is not 16-byte aligned, a box larger than 256, ...)."""
    try:
        dtype, size = _DTYPES[spec["dtype"]]
        swizzle = _SWIZZLES[int(spec.get("swizzle", 128))]
    except KeyError as exc:
        raise TensorMapError(f"tensor map of {what}: unsupported {exc.args[0]!r}") from None
    dims, strides, box = list(spec["dims"]), list(spec["strides"]), list(spec["box"])
    rank = len(dims)
    if not (1 <= rank <= 5 and len(strides) == rank - 1 and len(box) == rank):
        raise TensorMapError(f"tensor map of {what}: dims {dims}, strides {strides} and box {box} do not match")
    origin = int(address) + int(spec.get("offset", 0)) * size
    if origin % 16 or any(int(s) % 16 for s in strides):
        raise TensorMapError(f"tensor map of {what}: address {origin:#x} or strides {strides} are not multiples "
                             "of 16 bytes, which the copy engine needs")
    out = _aligned_map()
    c_dims = (ctypes.c_uint64 * rank)(*dims)
    c_strides = (ctypes.c_uint64 * max(rank - 1, 1))(*(strides or [0]))
    c_box = (ctypes.c_uint32 * rank)(*box)
    c_elem = (ctypes.c_uint32 * rank)(*([1] * rank))
    status = _encoder()(out.ctypes.data, dtype, rank, ctypes.c_void_p(origin), c_dims, c_strides, c_box, c_elem,
                        0, swizzle, _L2_PROMOTION_256B, 0)
    if status != 0:
        raise TensorMapError(f"tensor map of {what}: cuTensorMapEncodeTiled failed (CUresult {status}) for dims "
                             f"{dims}, strides {strides}, box {box}, address {origin:#x}")
    return out


def _aligned_map() -> np.ndarray:
    """A zeroed size-one array of the map's type at a 128-byte aligned host address (the CUDA
    header declares ``CUtensorMap`` with that alignment; numpy only promises 16)."""
    raw = np.zeros(2 * _MAP_DTYPE.itemsize, np.uint8)
    skip = -raw.ctypes.data % 128
    return raw[skip:skip + _MAP_DTYPE.itemsize].view(_MAP_DTYPE)


def _address(a: Any) -> int:
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)  # cupy arrays
    if ptr is None:
        raise TensorMapError(f"tensor maps need device arrays; got {type(a).__name__}")
    return int(ptr)


def kernel_args(tensor_maps: Sequence[dict], arrays: Sequence[Any], what: str = "a kernel") -> tuple:
    """The arguments of a kernel launch: the tensor ``arrays`` (device arrays, in the launch's
    order), then one encoded tensor map per entry of ``tensor_maps`` (a launch's ``tensor_maps``;
    empty for kernels without TMA loads)."""
    arrays = tuple(arrays)
    maps = tuple(encode_tensor_map(m, _address(arrays[int(m["arg"])]), what) for m in tensor_maps)
    return arrays + maps
