"""Tensor-map descriptions (shardflow.runtime.tma) are checked before the CUDA driver is asked."""
from __future__ import annotations

import numpy as np
import pytest

from shardflow.runtime import ShardflowError
from shardflow.runtime.tma import TensorMapError, encode_tensor_map, kernel_args

SPEC = {"arg": 0, "offset": 0, "dtype": "float16", "dims": [64, 128], "strides": [128], "box": [64, 128],
        "swizzle": 128}


def test_kernels_without_tensor_maps_get_their_arrays():
    arrays = [np.zeros(3), np.ones(2)]
    assert kernel_args((), arrays) == tuple(arrays)


def test_misaligned_addresses_and_strides_are_refused_with_the_kernel_named():
    with pytest.raises(TensorMapError, match="kernel k7: .*not multiples of 16 bytes"):
        encode_tensor_map({**SPEC, "offset": 3}, 0x10000, "kernel k7")  # 6 bytes past an aligned start
    with pytest.raises(TensorMapError, match="not multiples of 16 bytes"):
        encode_tensor_map({**SPEC, "strides": [100]}, 0x10000)
    with pytest.raises(TensorMapError, match="unsupported 'int8'"):
        encode_tensor_map({**SPEC, "dtype": "int8"}, 0x10000)
    with pytest.raises(TensorMapError, match="do not match"):
        encode_tensor_map({**SPEC, "box": [64]}, 0x10000)
    assert issubclass(TensorMapError, ShardflowError)


def test_host_arrays_are_refused():
    with pytest.raises(TensorMapError, match="device arrays"):
        kernel_args([SPEC], [np.zeros((128, 64), np.float16)])


def test_maps_are_built_at_aligned_host_addresses():
    from shardflow.runtime.tma import _aligned_map

    for _ in range(8):
        m = _aligned_map()
        assert m.shape == (1,) and m.nbytes == 128 and m.ctypes.data % 128 == 0 and not m.view(np.uint8).any()


def test_no_cuda_driver_is_a_clear_error(monkeypatch):
    import ctypes

    from shardflow.runtime import tma

    def no_driver(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    tma._encoder.cache_clear()
    try:
        with pytest.raises(TensorMapError, match="libcuda.so.1"):
            encode_tensor_map(SPEC, 0x10000)
    finally:
        tma._encoder.cache_clear()
