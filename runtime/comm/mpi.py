"""MPI communicator (mpi4py) for CPU buffers, and for GPU buffers through host staging.

All-reduce and reduce-scatter use MPI's native collectives for the dtypes MPI can reduce
(floats of 32/64 bits, integers, bool through ``uint8`` max/min); other dtypes (float16) are
gathered and reduced in member order. All-gather moves raw bytes with ``MPI_Allgather``;
all-to-all is grouped ``Isend``/``Irecv``. The into-buffer primitives of prepared collectives
write the result straight into the destination. Sub-communicators come from ``MPI_Comm_split``.

Several ranks may share one GPU through this backend (NCCL refuses that): device arrays are
copied to the host, communicated, and copied back.
"""
from __future__ import annotations

import logging

import numpy as np

from .base import Communicator, CommError, _is_device_array, _my_group, byte_view, contiguous

__all__ = ["MPICommunicator", "mpi_available"]

log = logging.getLogger(__name__)

_TAG = 7177


def mpi_available() -> bool:
    """True when mpi4py can be imported."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise CommError(f"the mpi backend needs mpi4py ({exc}); pip install 'shardflow[mpi]'") from None
    return MPI


class MPICommunicator(Communicator):
    """A communicator over an ``mpi4py`` communicator (default ``MPI.COMM_WORLD``).

    Parameters
    ----------
    comm
        An ``mpi4py.MPI.Comm``; ``None`` for ``COMM_WORLD``.
    """

    backend = "mpi"

    def __init__(self, comm=None):
        MPI = _mpi()
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        super().__init__(self.comm.Get_rank(), self.comm.Get_size())
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "avg": MPI.SUM}

    # primitives ---------------------------------------------------------------------------
    def exchange(self, sends, recvs) -> None:
        reqs = []
        keep = []
        for p, buf in recvs.items():
            if p == self.rank:
                raise CommError("exchange: a rank cannot receive from itself")
            reqs.append(self.comm.Irecv([byte_view(buf), self.MPI.BYTE], source=p, tag=_TAG))
        for p, a in sends.items():
            if p == self.rank:
                raise CommError("exchange: a rank cannot send to itself")
            a = np.ascontiguousarray(a)
            keep.append(a)
            reqs.append(self.comm.Isend([byte_view(a), self.MPI.BYTE], dest=p, tag=_TAG))
        self.MPI.Request.Waitall(reqs)

    def barrier(self) -> None:
        self.comm.Barrier()

    def broadcast_bytes(self, data, root: int = 0) -> bytes:
        return bytes(self.comm.bcast(bytes(data or b"") if self.rank == root else None, root=root))

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        return [bytes(b) for b in self.comm.allgather(bytes(data))]

    def _allgather_equal(self, x):
        x = contiguous(x)
        res = np.empty((self.size,) + x.shape, x.dtype)
        if x.nbytes:
            self.comm.Allgather([byte_view(x), self.MPI.BYTE], [byte_view(res), self.MPI.BYTE])
        return res

    def _native(self, dtype: np.dtype, op: str):
        """(buffer view dtype, MPI op) when MPI can reduce ``dtype`` natively, else ``None``."""
        if dtype == np.bool_:
            return np.uint8, (self.MPI.MIN if op == "min" else self.MPI.MAX)
        if dtype.kind in "iu" or dtype in (np.float32, np.float64):
            return dtype, self._ops[op]
        return None

    def _allreduce(self, x, op: str):
        native = self._native(x.dtype, op)
        if native is None:
            return super()._allreduce(x, op)
        view_dtype, mpi_op = native
        res = np.empty_like(x)
        if x.size:
            self.comm.Allreduce(x.view(view_dtype), res.view(view_dtype), op=mpi_op)
        return _finish_avg(res, op, self.size)

    def _reduce_scatter_equal(self, x, op: str):
        native = self._native(x.dtype, op)
        if native is None:
            return super()._reduce_scatter_equal(x, op)
        view_dtype, mpi_op = native
        c = x.shape[0] // self.size
        res = np.empty((c,) + x.shape[1:], x.dtype)
        if res.size:
            self.comm.Reduce_scatter_block(x.view(view_dtype), res.view(view_dtype), op=mpi_op)
        return _finish_avg(res, op, self.size)

    # into-buffer primitives: MPI writes the result straight into the given host buffer ------
    def _allgather_into(self, x, out) -> None:
        if _is_device_array(x) or _is_device_array(out) or not out.flags.c_contiguous:
            return super()._allgather_into(x, out)
        x = contiguous(x)
        if x.nbytes:
            self.comm.Allgather([byte_view(x), self.MPI.BYTE], [byte_view(out), self.MPI.BYTE])

    def _reduce_into(self, x, out, op: str, call: str) -> bool:
        """MPI ``call`` (Allreduce, Reduce_scatter_block) from ``x`` into ``out``; False when it
        cannot (a dtype MPI does not reduce, device or strided buffers, overlapping ones)."""
        native = self._native(x.dtype, op)
        if (native is None or _is_device_array(x) or _is_device_array(out) or not x.flags.c_contiguous
                or not out.flags.c_contiguous or np.shares_memory(x, out)):
            return False
        view_dtype, mpi_op = native
        if out.size:
            getattr(self.comm, call)(x.view(view_dtype), out.view(view_dtype), op=mpi_op)
        if op == "avg" and out.dtype != np.bool_:
            out[...] = _finish_avg(out, op, self.size)
        return True

    def _allreduce_into(self, x, out, op: str) -> None:
        if self.size == 1 or not self._reduce_into(x, out, op, "Allreduce"):
            super()._allreduce_into(x, out, op)

    def _reduce_scatter_into(self, x, out, op: str) -> None:
        if not self._reduce_into(x, out, op, "Reduce_scatter_block"):
            super()._reduce_scatter_into(x, out, op)

    # sub-communicators --------------------------------------------------------------------
    def split(self, groups) -> "MPICommunicator":
        group = _my_group(groups, self.rank, self.size)
        color = sorted(tuple(g) for g in groups).index(tuple(group))
        sub = MPICommunicator(self.comm.Split(color, group.index(self.rank)))
        sub.global_ranks = tuple(self.global_ranks[r] for r in group)
        return sub

    def close(self) -> None:
        if self.comm is not None and self.comm != self.MPI.COMM_WORLD and self.comm != self.MPI.COMM_NULL:
            try:
                self.comm.Free()
            except Exception:  # noqa: BLE001 - freeing after MPI_Finalize is harmless to skip
                pass
        self.comm = None


def _finish_avg(res: np.ndarray, op: str, n: int) -> np.ndarray:
    if op != "avg" or res.dtype == np.bool_:
        return res
    if res.dtype.kind in "iu":
        return np.trunc(res / n).astype(res.dtype)
    return (res / n).astype(res.dtype)
