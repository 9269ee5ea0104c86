"""A numpy stand-in for cupy, for the cuda engine's tests without a GPU (runtime/cuda_exec.py): "device"
arrays are numpy memory with cupy's ``get``/``set``/``data.ptr``, kernels are Python functions looked up by
symbol, and CUDA graphs record the launches made while a stream captures (each thread its own) and
replay them."""
from __future__ import annotations

import threading
import time
import types

import numpy as np


class _Array(np.ndarray):
    """A "device" array: numpy memory, cupy's ``get``/``set``/``data.ptr``."""

    def get(self, stream=None):
        return np.array(self)

    def set(self, a, stream=None):
        np.copyto(self, a)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0], array=self,
                                     copy_from_device_async=self._copy_from)

    def _copy_from(self, src, nbytes, stream):
        """A device-to-device copy: recorded while a stream captures, like a kernel."""
        copy = (np.copyto, (self.reshape(-1).view(np.uint8)[:nbytes], src.array.reshape(-1).view(np.uint8)[:nbytes]))
        if _Stream.capturing is not None:
            _Stream.capturing.append(copy)
        else:
            copy[0](*copy[1])


_Array.__module__ = "cupy"  # what the engine recognises device arrays by


class _Graph:
    def __init__(self, calls):
        self.calls = calls

    def launch(self, stream):
        for fn, args in self.calls:
            fn(*args)


class _PerThread(type):
    """``_Stream.capturing`` per thread: ranks run as threads of one process (InProcessWorld), each
    capturing its own graphs, as each rank's process does on GPUs."""

    _local = threading.local()

    @property
    def capturing(cls) -> list | None:  # the launches recorded while this thread's stream captures
        return getattr(_PerThread._local, "calls", None)

    @capturing.setter
    def capturing(cls, calls: list | None) -> None:
        _PerThread._local.calls = calls


class _Stream(metaclass=_PerThread):
    """cupy's stream: capture records the thread's launches into a graph that replays them."""

    def __init__(self, non_blocking=False):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def begin_capture(self):
        _Stream.capturing = []

    def end_capture(self):
        calls, _Stream.capturing = _Stream.capturing, None
        return _Graph(calls)

    def synchronize(self):
        pass


class _Event:
    """cupy's CUDA event: the stand-in runs each launch when it is made, so recording one reads the host's
    clock (what the stream reached is what the host did)."""

    def __init__(self, *args, **kwargs):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


def _elapsed(start: _Event, end: _Event) -> float:
    """``cupy.cuda.get_elapsed_time``: milliseconds from ``start`` to ``end``."""
    return (end.t - start.t) * 1e3


class _Function:
    def __init__(self, body, log):
        self.body, self.log = body, log

    def __call__(self, grid, block, args, shared_mem=0):
        if _Stream.capturing is not None:
            _Stream.capturing.append((self.run, (args,)))
        else:
            self.run(args)

    def run(self, args):
        self.log.append(self.body.__name__)
        self.body(*args)


def _fake_cupy(kernels: dict, log: list):
    cp = types.ModuleType("cupy")
    cp.uint8 = np.uint8
    cp.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, CUDARuntimeError=RuntimeError),
        Device=lambda: types.SimpleNamespace(id=0, attributes={"MultiProcessorCount": 132}),
        Stream=_Stream, Event=_Event, get_elapsed_time=_elapsed, get_current_stream=_Stream)
    cp.asarray = lambda a: np.array(a).view(_Array)
    cp.zeros = lambda n, dtype: np.zeros(n, dtype).view(_Array)
    cp.empty = lambda shape, dtype: np.full(shape, np.nan, dtype).view(_Array)
    cp.copyto = np.copyto
    cp.RawModule = lambda path: types.SimpleNamespace(get_function=lambda name: _Function(kernels[name], log))
    return cp
