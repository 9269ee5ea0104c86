"""NCCL communicator through ``cupy.cuda.nccl`` (NCCL from the nvidia-nccl wheels).

Bootstrap: rank 0 of a group creates the NCCL unique id and shares it through a host
communicator — MPI broadcast when the ranks run under MPI, else the TCP rendezvous store at
``MASTER_ADDR:MASTER_PORT`` (see :func:`shardflow.runtime.comm.create_world`). Sub-communicators
(one per mesh-axis group) get their own NCCL communicator, bootstrapped the same way.

Buffers are cupy arrays on this rank's device; calls are issued on cupy's current stream, so
they order with the kernels around them. NCCL does not allow two ranks on one GPU: use the MPI
backend (host staging) for that.
"""
from __future__ import annotations

import logging

import numpy as np

from .base import Communicator, CommError, _my_group, contiguous

__all__ = ["NCCLCommunicator", "nccl_available"]

log = logging.getLogger(__name__)


def nccl_available() -> bool:
    """True when cupy with NCCL support can be imported."""
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return bool(getattr(nccl, "available", True))


def _nccl():
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001
        raise CommError(f"the nccl backend needs cupy with NCCL ({exc}); pip install 'shardflow[cuda12]' "
                        "(or [cuda13])") from None
    if not getattr(nccl, "available", True):
        raise CommError("cupy was built without NCCL support; install nvidia-nccl-cu12 (or -cu13)")
    return cupy, nccl


class NCCLCommunicator(Communicator):
    """An NCCL communicator for the ranks of ``bootstrap`` (one GPU per rank).

    Parameters
    ----------
    bootstrap
        A host communicator over the same ranks (MPI or TCP), used to share the unique id,
        for barriers and for :meth:`split`.
    device
        CUDA device of this rank (default: cupy's current device).
    """

    backend = "nccl"
    host_only = False

    def __init__(self, bootstrap: Communicator, device: int | None = None):
        cupy, nccl = _nccl()
        super().__init__(bootstrap.rank, bootstrap.size)
        self.cupy, self.nccl = cupy, nccl
        self.bootstrap = bootstrap
        self.global_ranks = bootstrap.global_ranks
        if device is not None:
            cupy.cuda.Device(device).use()
        self.device = cupy.cuda.Device().id
        uid = nccl.get_unique_id() if bootstrap.rank == 0 else None
        if uid is not None:  # cupy returns bytes (recent) or a tuple of ints (older)
            uid = b"B" + bytes(uid) if isinstance(uid, (bytes, bytearray)) else b"T" + np.asarray(uid, np.int64).tobytes()
        raw = bootstrap.broadcast_bytes(uid)
        uid = raw[1:] if raw[:1] == b"B" else tuple(int(v) for v in np.frombuffer(raw[1:], np.int64))
        self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._types = {np.dtype(k): getattr(nccl, v) for k, v in (
            ("float16", "NCCL_FLOAT16"), ("float32", "NCCL_FLOAT32"), ("float64", "NCCL_FLOAT64"),
            ("int8", "NCCL_INT8"), ("uint8", "NCCL_UINT8"), ("int32", "NCCL_INT32"), ("uint32", "NCCL_UINT32"),
            ("int64", "NCCL_INT64"), ("uint64", "NCCL_UINT64")) if hasattr(nccl, v)}
        # ncclAvg (NCCL >= 2.10) is 4; older cupy builds do not name it
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN,
                     "avg": getattr(nccl, "NCCL_AVG", 4)}
        log.debug("rank %d: NCCL communicator of %d ranks on device %d", self.rank, self.size, self.device)

    def _stream(self) -> int:
        return self.cupy.cuda.get_current_stream().ptr

    def _dev(self, x):
        if not type(x).__module__.startswith("cupy"):
            raise CommError(f"the nccl backend communicates device (cupy) arrays, got {type(x).__name__}; use the "
                            "mpi backend for host arrays")
        return contiguous(x)

    # primitives ---------------------------------------------------------------------------
    def exchange(self, sends, recvs) -> None:
        nccl = self.nccl
        keep = []
        nccl.groupStart()
        try:
            for p, a in sends.items():
                a = self._dev(a)
                keep.append(a)
                self.comm.send(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, p, self._stream())
            for p, buf in recvs.items():
                if not buf.flags.c_contiguous:
                    raise CommError("exchange: receive buffers must be C-contiguous")
                self.comm.recv(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, p, self._stream())
        finally:
            nccl.groupEnd()

    def wait(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()

    def barrier(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        self.bootstrap.barrier()

    def broadcast_bytes(self, data, root: int = 0) -> bytes:
        return self.bootstrap.broadcast_bytes(data, root)

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        return self.bootstrap.allgather_bytes(data)

    def _allgather_equal(self, x):
        x = self._dev(x)
        res = self.cupy.empty((self.size,) + tuple(x.shape), x.dtype)
        self._allgather_into(x, res)
        return res

    def _native(self, dtype, op: str):
        """``(dtype viewed, NCCL op)`` for a reduction NCCL does natively, else ``None`` (the generic
        algorithm of the base class runs then): bool as uint8 max/min, float averages as ``ncclAvg``;
        integer averages are not native (they round toward zero, done by the generic path)."""
        dtype = np.dtype(dtype)
        if dtype == np.bool_:
            return np.dtype(np.uint8), (self.nccl.NCCL_MIN if op == "min" else self.nccl.NCCL_MAX)
        if dtype not in self._types or (op == "avg" and dtype.kind != "f"):
            return None
        return dtype, self._ops[op]

    def _native_reduce(self, call: str, x, out, op: str) -> bool:
        """NCCL ``call`` (allReduce or reduceScatter) from ``x`` into ``out``; False when not native."""
        native = self._native(x.dtype, op)
        if native is None:
            return False
        vt, nop = native
        if out.size:
            getattr(self.comm, call)(x.view(vt).data.ptr, out.view(vt).data.ptr, out.size, self._types[vt], nop,
                                     self._stream())
        return True

    def _allreduce(self, x, op: str):
        x = self._dev(x)
        res = self.cupy.empty_like(x)
        return res if self._native_reduce("allReduce", x, res, op) else super()._allreduce(x, op)

    def _reduce_scatter_equal(self, x, op: str):
        x = self._dev(x)
        res = self.cupy.empty((x.shape[0] // self.size,) + tuple(x.shape[1:]), x.dtype)
        return res if self._native_reduce("reduceScatter", x, res, op) else super()._reduce_scatter_equal(x, op)

    # into-buffer primitives: stream-ordered NCCL calls on preallocated buffers (capturable) ---
    capture_safe = True

    def _capturable(self, dtype, op: str | None) -> bool:
        return op is None or self._native(dtype, op) is not None

    def _allgather_into(self, x, out) -> None:
        if x.nbytes:
            self.comm.allGather(x.data.ptr, out.data.ptr, x.nbytes, self.nccl.NCCL_UINT8, self._stream())

    def _allreduce_into(self, x, out, op: str) -> None:
        if not self._native_reduce("allReduce", x, out, op):
            super()._allreduce_into(x, out, op)

    def _reduce_scatter_into(self, x, out, op: str) -> None:
        if not self._native_reduce("reduceScatter", x, out, op):
            super()._reduce_scatter_into(x, out, op)

    # sub-communicators --------------------------------------------------------------------
    def split(self, groups) -> "NCCLCommunicator":
        _my_group(groups, self.rank, self.size)
        sub_boot = self.bootstrap.split(groups)
        return NCCLCommunicator(sub_boot, self.device)

    def close(self) -> None:
        if getattr(self, "comm", None) is not None:
            try:
                self.comm.destroy()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self.comm = None
