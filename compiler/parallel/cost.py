"""The cost model: α–β communication per mesh axis and a roofline for compute.

Every mesh axis has a link bandwidth ``bw`` (bytes/s) and a latency ``α`` (s). Collectives over
a group of ``n`` ranks along one axis use the ring formulas, where ``B`` is the bytes of the
*full* tensor the group works on (details per method):

===============  ==========================================  ==============================
collective       time                                        ``B`` is
===============  ==========================================  ==============================
all-reduce       ``2(n-1)/n · B/bw + 2(n-1)·α``              each rank's buffer
all-gather       ``(n-1)/n · B/bw + (n-1)·α``                each rank's output (gathered)
reduce-scatter   ``(n-1)/n · B/bw + (n-1)·α``                each rank's input (unscattered)
all-to-all       ``(n-1)/n · (B/n)/bw + (n-1)·α``            the sum of the ranks' buffers
===============  ==========================================  ==============================

All-to-all is a pairwise exchange: each rank keeps ``1/n`` of its ``B/n`` bytes and sends the
rest, one peer per round. A group of one rank costs nothing. A collective over several mesh
axes runs as one stage per axis and costs the sum of the stages: all-reduce and all-to-all move
``B`` in every stage; reduce-scatter scatters over the first given axis first (later stages see
``B`` divided by the sizes already scattered over) and all-gather is its mirror image.

Defaults: 100 GB/s and 5 µs per axis (an NVLink-class intra-node link; set the real values in
``distributed_config``), and the :data:`H100` device profile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import ConfigError
from ..ir.expr import numpy_type
from .mesh import DeviceMesh

__all__ = ["DeviceProfile", "CostModel", "H100", "H200", "CPU", "DEVICE_PROFILES", "DEVICE_MEMORY_FRACTION",
           "DEFAULT_BANDWIDTH_GBPS", "DEFAULT_LATENCY_US", "COLLECTIVES", "itemsize", "total_bytes"]

DEFAULT_BANDWIDTH_GBPS = 100.0
DEFAULT_LATENCY_US = 5.0
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class DeviceProfile:
    """A device for the roofline compute model.

    Attributes
    ----------
    name
        A label.
    peak_flops
        Peak arithmetic throughput, FLOP/s.
    mem_bandwidth
        Main-memory bandwidth, bytes/s.
    memory_bytes
        What one rank may hold, bytes, or ``None`` when unknown (a host's memory is shared by
        the ranks on it). Without a ``memory_budget_bytes``, the search keeps plans within
        :data:`DEVICE_MEMORY_FRACTION` of it (``search``).
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: float | None = None

    def __post_init__(self):
        if not (self.peak_flops > 0 and self.mem_bandwidth > 0):
            raise ConfigError(f"device profile {self.name!r}: peak_flops and mem_bandwidth must be positive")
        if self.memory_bytes is not None and not self.memory_bytes > 0:
            raise ConfigError(f"device profile {self.name!r}: memory_bytes must be positive (or None: unknown)")


#: NVIDIA H100 SXM: dense BF16 tensor-core peak (989 TFLOP/s), HBM3 bandwidth (3.35 TB/s) and the
#: memory a process sees on an "H100 80GB HBM3" (nvidia-smi: 81559 MiB).
H100 = DeviceProfile("h100-sxm", 989e12, 3.35e12, 81559 * 2**20)
#: NVIDIA H200 (SXM): the H100's tensor cores with HBM3e (4.8 TB/s) and the memory a process saw on
#: the H200 this project was lent (cudaMemGetInfo's total, 150109880320 bytes:
#: benchmarks/results/nvidia-h200-2026-11-28-gpu.json).
H200 = DeviceProfile("h200", 989e12, 4.8e12, 150109880320)
#: A server CPU socket, order of magnitude: 2 TFLOP/s (32 cores x AVX-512 FMA) and 200 GB/s DRAM;
#: its memory is the host's, shared by the ranks on it: not known here.
CPU = DeviceProfile("cpu", 2e12, 200e9)
#: The share of a device's memory a plan's parameters and peak activations may take when no
#: ``memory_budget_bytes`` is given: the rest for what the plan's count leaves out (the CUDA
#: context, NCCL's buffers, the kernels' scratch, the allocator's slack).
DEVICE_MEMORY_FRACTION = 0.9
DEVICE_PROFILES = {"cuda": H100, "cpu": CPU}


def _per_axis(value, ndim: int, names: Sequence[str], default: float, what: str, allow_zero: bool) -> tuple[float, ...]:
    if value is None:
        vals = [default] * ndim
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        vals = [value] * ndim
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ConfigError(f"{what}: unknown mesh axes {unknown}; the axes are {list(names)}")
        vals = [value.get(n, default) for n in names]
    elif isinstance(value, (list, tuple)) and len(value) == ndim:
        vals = list(value)
    else:
        raise ConfigError(f"{what} = {value!r}: give a number, a list of {ndim} numbers or a dict by axis name")
    need = "non-negative" if allow_zero else "positive"
    for v in vals:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (v == 0 and not allow_zero):
            raise ConfigError(f"{what} = {value!r}: values must be {need} numbers")
    return tuple(float(v) for v in vals)


class CostModel:
    """α–β communication costs per mesh axis and roofline compute costs (seconds).

    Parameters
    ----------
    mesh
        The device mesh.
    axis_bandwidth_GBps
        Link bandwidth per mesh axis in GB/s (1e9 bytes/s): a number for every axis, a list
        (one per axis) or a dict by axis name. Default :data:`DEFAULT_BANDWIDTH_GBPS` (100).
    axis_latency_us
        Link latency per mesh axis in µs, same forms. Default :data:`DEFAULT_LATENCY_US` (5).
    device
        The device profile for :meth:`compute_time`; default :data:`H100`.

    Notes
    -----
    The model is immutable: :func:`~shardflow.compiler.parallel.connect.connect` caches results
    per cost model.
    """

    def __init__(self, mesh: DeviceMesh, axis_bandwidth_GBps=None, axis_latency_us=None,
                 device: DeviceProfile = H100):
        self.mesh = mesh
        self.bandwidth_GBps = _per_axis(axis_bandwidth_GBps, mesh.ndim, mesh.axis_names, DEFAULT_BANDWIDTH_GBPS,
                                        "axis_bandwidth_GBps", allow_zero=False)
        self.latency_us = _per_axis(axis_latency_us, mesh.ndim, mesh.axis_names, DEFAULT_LATENCY_US,
                                    "axis_latency_us", allow_zero=True)
        if not isinstance(device, DeviceProfile):
            raise ConfigError(f"device must be a DeviceProfile, got {type(device).__name__}")
        self.device = device

    # per-axis parameters ----------------------------------------------------------------
    def bandwidth(self, axis: int | str) -> float:
        """Link bandwidth of mesh axis ``axis``, bytes/s."""
        return self.bandwidth_GBps[self.mesh.axis_index(axis)] * 1e9

    def latency(self, axis: int | str) -> float:
        """Link latency of mesh axis ``axis``, seconds."""
        return self.latency_us[self.mesh.axis_index(axis)] * 1e-6

    def _axes(self, axes) -> tuple[int, ...]:
        return self.mesh._axes(axes)

    # collectives --------------------------------------------------------------------------
    def all_reduce(self, nbytes: float, axes: int | str | Sequence[int | str]) -> float:
        """Time of an all-reduce of a ``nbytes`` buffer (on every rank) over ``axes``."""
        t = 0.0
        for a in self._axes(axes):
            n = self.mesh.shape[a]
            if n > 1:
                t += 2 * (n - 1) / n * nbytes / self.bandwidth(a) + 2 * (n - 1) * self.latency(a)
        return t

    def all_gather(self, nbytes: float, axes: int | str | Sequence[int | str]) -> float:
        """Time of an all-gather producing ``nbytes`` on every rank over ``axes``.

        Over several axes the last given axis gathers first; the stage over the ``k``-th given
        axis produces ``nbytes`` divided by the sizes of the axes given before it.
        """
        return self._staged(nbytes, axes)

    def reduce_scatter(self, nbytes: float, axes: int | str | Sequence[int | str]) -> float:
        """Time of a reduce-scatter of a ``nbytes`` input (on every rank) over ``axes``.

        Over several axes the first given axis scatters first; the stage over the ``k``-th given
        axis reads ``nbytes`` divided by the sizes of the axes given before it.
        """
        return self._staged(nbytes, axes)

    def _staged(self, nbytes: float, axes) -> float:
        t, b = 0.0, float(nbytes)
        for a in self._axes(axes):
            n = self.mesh.shape[a]
            if n > 1:
                t += (n - 1) / n * b / self.bandwidth(a) + (n - 1) * self.latency(a)
            b /= n
        return t

    def all_to_all(self, nbytes: float, axes: int | str | Sequence[int | str]) -> float:
        """Time of an all-to-all over ``axes`` where the group's buffers total ``nbytes``
        (each rank holds ``nbytes / n``)."""
        t = 0.0
        for a in self._axes(axes):
            n = self.mesh.shape[a]
            if n > 1:
                t += (n - 1) / n * (nbytes / n) / self.bandwidth(a) + (n - 1) * self.latency(a)
        return t

    def collective(self, kind: str, nbytes: float, axes: int | str | Sequence[int | str]) -> float:
        """Time of collective ``kind`` (one of :data:`COLLECTIVES`); see the methods for ``nbytes``."""
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")
        return getattr(self, kind)(nbytes, axes)

    # compute -------------------------------------------------------------------------------
    def compute_time(self, flops: float, nbytes: float) -> float:
        """Roofline time of a kernel doing ``flops`` and moving ``nbytes`` of memory traffic:
        ``max(flops / peak_flops, nbytes / mem_bandwidth)``."""
        return max(flops / self.device.peak_flops, nbytes / self.device.mem_bandwidth)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}: {bw:g} GB/s, {lat:g} µs"
                         for n, bw, lat in zip(self.mesh.axis_names, self.bandwidth_GBps, self.latency_us))
        return f"CostModel({axes}; device={self.device.name})"


def total_bytes(shape: Sequence[int], dtype: str) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype`` (``bfloat16`` counts 2 bytes)."""
    return math.prod(int(d) for d in shape) * itemsize(dtype)


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (numpy names, plus ``bfloat16``)."""
    return numpy_type(str(dtype)).itemsize
