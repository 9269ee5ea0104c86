"""The communicator interface shared by every backend.

A :class:`Communicator` connects the ``size`` ranks of one process group. Backends implement a
few primitives (grouped point-to-point :meth:`Communicator.exchange`, and optionally native
all-gather / all-reduce / reduce-scatter of equal blocks); this base class turns them into the
four collectives the rank programs use, with exactly the semantics of the compiler's in-process
oracle (``shardflow.compiler.parallel.simulate``):

* :meth:`~Communicator.all_reduce` — element-wise ``sum``, ``max``, ``min`` or ``avg``
  (``avg`` of integers rounds toward zero, as ``ncclAvg``);
* :meth:`~Communicator.all_gather` — member ``j`` holds chunk ``j`` of a dim of ``global_size``
  (``torch.chunk`` bounds: every chunk has ``ceil(size / n)`` entries except trailing short or
  empty ones); every member gets the whole dim;
* :meth:`~Communicator.reduce_scatter` — reduce, then member ``j`` keeps chunk ``j`` of ``dim``;
* :meth:`~Communicator.all_to_all` — move the split from ``src_dim`` to ``dst_dim``, built from
  grouped send/recv.

Uneven chunks are padded to ``ceil(size / n)`` on the wire and trimmed on arrival.

Sub-communicators: :meth:`Communicator.split` makes one communicator per process group (for
example one per mesh-axis group from ``mesh.json``); it is collective over the parent.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import ShardflowError

__all__ = ["Communicator", "SelfCommunicator", "GroupView", "CommError", "RankFailedError", "REDUCE_OPS",
           "chunk_bounds", "padded_chunk", "reduce_stacked", "array_module", "byte_view"]

log = logging.getLogger(__name__)

#: The reductions every backend supports.
REDUCE_OPS = ("sum", "max", "min", "avg")


class CommError(ShardflowError):
    """A collective could not complete (peer gone, protocol mismatch, bad arguments)."""


class RankFailedError(CommError):
    """Another rank died or stopped answering; ``rank`` is its global rank (``None`` if unknown)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


# ---------------------------------------------------------------------------------------
# chunking (torch.chunk semantics; the same as compiler/parallel/placement.py)
# ---------------------------------------------------------------------------------------
def chunk_bounds(size: int, n: int, idx: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``idx`` of ``size`` entries cut into ``n`` ``torch.chunk`` chunks."""
    if n < 1 or not 0 <= idx < n or size < 0:
        raise ValueError(f"chunk_bounds({size}, {n}, {idx}): need size >= 0, n >= 1 and 0 <= idx < n")
    c = -(-size // n)
    return min(idx * c, size), min((idx + 1) * c, size)


def padded_chunk(size: int, n: int) -> int:
    """The chunk size collectives pad every member's chunk to: ``ceil(size / n)``."""
    return -(-size // n)


def array_module(x: Any):
    """``cupy`` for a cupy array, else ``numpy``."""
    mod = type(x).__module__
    if mod.startswith("cupy"):
        import cupy

        return cupy
    return np


def contiguous(x: Any):
    """``x`` as a C-contiguous array of the same shape, numpy or cupy (not ``ascontiguousarray``,
    which returns a 0-d array as 1-d and broke collectives on scalars)."""
    return array_module(x).asarray(x, order="C")


def _is_device_array(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


def reduce_stacked(blocks: Sequence[Any], op: str):
    """Reduce same-shaped arrays in member order, in their dtype (the oracle's ``reduce_arrays``)."""
    xp = array_module(blocks[0])
    dtype = blocks[0].dtype
    if op == "max":
        acc = blocks[0].copy()
        for b in blocks[1:]:
            acc = xp.maximum(acc, b)
        return acc.astype(dtype, copy=False)
    if op == "min":
        acc = blocks[0].copy()
        for b in blocks[1:]:
            acc = xp.minimum(acc, b)
        return acc.astype(dtype, copy=False)
    acc = blocks[0].astype(dtype, copy=True)
    for b in blocks[1:]:
        acc = acc + b
    acc = acc.astype(dtype, copy=False)
    if op == "sum":
        return acc
    if op == "avg":
        if dtype.kind in "iu":
            return xp.trunc(acc / len(blocks)).astype(dtype)
        return (acc / len(blocks)).astype(dtype)
    raise CommError(f"unknown reduction {op!r}; use one of {list(REDUCE_OPS)}")


def _pad(xp, a, dim: int, size: int):
    if a.shape[dim] == size:
        return a
    width = [(0, 0)] * a.ndim
    width[dim] = (0, size - a.shape[dim])
    return xp.pad(a, width)


def _take(a, dim: int, lo: int, hi: int):
    return a[(slice(None),) * dim + (slice(lo, hi),)]


def byte_view(a) -> np.ndarray:
    """A flat ``uint8`` view of a C-contiguous host array (raises for a non-contiguous one)."""
    if not a.flags.c_contiguous:
        raise CommError(f"communication buffers must be C-contiguous (got an array of shape {tuple(a.shape)} "
                        f"and strides {a.strides})")
    return a.reshape(-1).view(np.uint8)


def _check_dim(x, dim: int, what: str) -> int:
    if not isinstance(dim, (int, np.integer)) or not 0 <= int(dim) < x.ndim:
        raise CommError(f"{what}: dim {dim!r} is out of range for an array of shape {tuple(x.shape)}")
    return int(dim)


class Communicator(ABC):
    """Connects the ``size`` ranks of one process group; this process is ``rank``.

    Subclasses implement :meth:`exchange` and may override the ``_native_*`` hooks with faster
    native collectives. Arrays are numpy arrays (cupy arrays on device backends; host-only
    backends stage them through host memory).

    Parameters
    ----------
    rank
        This process's position in the group, ``0 <= rank < size``.
    size
        Number of ranks in the group.
    """

    #: Backend name (``mpi``, ``nccl``, ``tcp``, ``inprocess``, ``self``).
    backend: str = ""
    #: True when the backend only moves host memory (device arrays are staged through the host).
    host_only: bool = True

    def __init__(self, rank: int, size: int):
        if not 0 <= rank < size:
            raise CommError(f"rank {rank} is outside a group of {size}")
        self.rank = int(rank)
        self.size = int(size)
        #: Global rank of each member (filled by launchers and :meth:`split`; used in messages).
        self.global_ranks: tuple[int, ...] = tuple(range(size))

    # ---------------------------------------------------------------- primitives ----------
    @abstractmethod
    def exchange(self, sends: Mapping[int, Any], recvs: Mapping[int, Any]) -> None:
        """Grouped send/recv: send ``sends[p]`` to peer ``p`` and receive into ``recvs[p]`` from
        peer ``p``, all posted together so that no order of calls can deadlock.

        Every array must be C-contiguous; a receive buffer must have exactly the sender's
        number of bytes. Peers are ranks of this communicator, never ``self.rank``.
        """

    def wait(self) -> None:
        """Block until what this member gave :meth:`exchange` has been sent and received. A host backend's
        exchange returns only then; a device backend's (NCCL) queues its calls on the current stream, and
        its ``wait`` synchronizes that stream (before the receive buffers are read or the sent arrays
        written again by work on another stream)."""

    def barrier(self) -> None:
        """Block until every member has reached the barrier."""
        token = np.zeros(1, np.uint8)
        peers = [p for p in range(self.size) if p != self.rank]
        self.exchange({p: token for p in peers}, {p: np.empty(1, np.uint8) for p in peers})

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """Return ``data`` of rank ``root`` on every member."""
        if self.size == 1:
            return bytes(data or b"")
        peers = [p for p in range(self.size) if p != root]
        if self.rank == root:
            payload = np.frombuffer(bytes(data or b""), np.uint8)
            n = np.array([payload.size], np.int64)
            self.exchange({p: n for p in peers}, {})
            if payload.size:
                self.exchange({p: payload for p in peers}, {})
            return bytes(data or b"")
        n = np.empty(1, np.int64)
        self.exchange({}, {root: n})
        buf = np.empty(int(n[0]), np.uint8)
        if buf.size:
            self.exchange({}, {root: buf})
        return buf.tobytes()

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every member's ``data`` (of any length), in member order."""
        n = np.array([len(data)], np.int64)
        lens = self._allgather_equal(n)
        width = int(lens.max()) if lens.size else 0
        buf = np.zeros(width, np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        got = self._allgather_equal(buf)
        return [got[j, :int(lens[j, 0])].tobytes() for j in range(self.size)]

    def split(self, groups: Sequence[Sequence[int]]) -> "Communicator":
        """A communicator for the group (of ``groups``, which partition this communicator's ranks)
        that contains this rank; members are ordered as in the group.

        Collective: every member of this communicator calls it with the same ``groups``.
        """
        group = _my_group(groups, self.rank, self.size)
        return GroupView(self, group)

    def close(self) -> None:
        """Release the backend's resources (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def describe_member(self, p: int) -> str:
        """``rank g`` for member ``p`` (its global rank)."""
        return f"rank {self.global_ranks[p]}"

    # ----------------------------------------------------- overridable native pieces ---------
    def _allgather_equal(self, x):
        """Stack every member's same-shaped ``x``: shape ``(size,) + x.shape``."""
        xp = array_module(x)
        x = contiguous(x)
        res = xp.empty((self.size,) + tuple(x.shape), x.dtype)
        res[self.rank] = x
        peers = [p for p in range(self.size) if p != self.rank]
        # res[p, ...] is a view even for 0-d x (res[p] would be a numpy scalar, a copy)
        self.exchange({p: x for p in peers}, {p: res[p, ...] for p in peers})
        return res

    def _allreduce(self, x, op: str):
        """``op`` over every member's same-shaped ``x``; default gathers and reduces in member order."""
        stacked = self._allgather_equal(x)
        return reduce_stacked([stacked[j] for j in range(self.size)], op)

    def _reduce_scatter_equal(self, x, op: str):
        """``x`` has shape ``(size * c, ...)``; member ``j`` gets rows ``[j*c, (j+1)*c)`` of the reduction."""
        c = x.shape[0] // self.size
        full = self._allreduce(x, op)
        return full[self.rank * c:(self.rank + 1) * c]

    # ------------------------------------------- into-buffer primitives (prepared calls) -----
    #: True when the ``*_into`` primitives on device arrays are stream-ordered device work only
    #: (no host synchronization, no allocation), so that a CUDA graph may capture them.
    capture_safe: bool = False

    def _capturable(self, dtype, op: str | None) -> bool:
        """Whether the ``*_into`` primitives for ``dtype`` (and reduction ``op``; ``None`` for a
        plain data movement) may be captured into a CUDA graph."""
        return False

    def _allgather_into(self, x, out) -> None:
        """``out`` (shape ``(size,) + x.shape``) receives every member's ``x``."""
        out[...] = self._allgather_equal(x)

    def _allreduce_into(self, x, out, op: str) -> None:
        """``out`` (shape of ``x``) receives ``op`` over every member's ``x``."""
        out[...] = x if self.size == 1 else self._allreduce(x, op)

    def _reduce_scatter_into(self, x, out, op: str) -> None:
        """``x`` has shape ``(size * c, ...)``; ``out`` (``(c, ...)``) receives this member's rows."""
        out[...] = self._reduce_scatter_equal(x, op)

    def _exchange_into(self, sends, recvs) -> None:
        """:meth:`exchange` on C-contiguous blocks of preallocated buffers."""
        self.exchange(sends, recvs)

    # ----------------------------------------------------------------- collectives ----------
    def all_reduce(self, x, op: str = "sum", out=None):
        """Every member gets the element-wise ``op`` of all members' ``x``.

        Parameters
        ----------
        x
            This member's operand (same shape and dtype on every member).
        op
            ``sum``, ``max``, ``min`` or ``avg``.
        out
            Optional destination (shape of ``x``); returned.
        """
        _check_op(op)
        if self.host_only and _is_device_array(x):
            return self._staged(self.all_reduce, x, out, op=op)
        if self.size == 1:
            res = x
        else:
            res = self._allreduce(contiguous(x), op)
        return _deliver(res, out)

    def all_gather(self, x, dim: int, global_size: int, out=None):
        """Concatenate the members' ``torch.chunk`` chunks of a dim of ``global_size`` along ``dim``.

        Member ``j`` must hold exactly chunk ``j`` (possibly short or empty).
        """
        if self.host_only and _is_device_array(x):
            return self._staged(self.all_gather, x, out, dim=dim, global_size=global_size)
        dim = _check_dim(x, dim, "all-gather")
        n = self.size
        _check_chunk(self, x, dim, global_size, "all-gather")
        if n == 1:
            return _deliver(x, out)
        xp = array_module(x)
        c = padded_chunk(global_size, n)
        moved = xp.ascontiguousarray(xp.moveaxis(_pad(xp, x, dim, c), dim, 0))
        stacked = self._allgather_equal(moved)  # (n, c, ...)
        full = stacked.reshape((n * c,) + tuple(moved.shape[1:]))[:global_size]
        return _deliver(xp.moveaxis(full, 0, dim), out)

    def reduce_scatter(self, x, dim: int, op: str = "sum", out=None):
        """Reduce the members' ``x`` with ``op``; member ``j`` keeps chunk ``j`` of ``dim``."""
        _check_op(op)
        if self.host_only and _is_device_array(x):
            return self._staged(self.reduce_scatter, x, out, dim=dim, op=op)
        dim = _check_dim(x, dim, "reduce-scatter")
        n = self.size
        if n == 1:
            return _deliver(x, out)
        xp = array_module(x)
        size = x.shape[dim]
        c = padded_chunk(size, n)
        lo, hi = chunk_bounds(size, n, self.rank)
        moved = xp.ascontiguousarray(xp.moveaxis(_pad(xp, x, dim, n * c), dim, 0))
        block = self._reduce_scatter_equal(moved, op)[:hi - lo]
        return _deliver(xp.moveaxis(block, 0, dim), out)

    def all_to_all(self, x, src_dim: int, dst_dim: int, src_size: int, out=None):
        """Move the split from ``src_dim`` to ``dst_dim`` with grouped send/recv.

        Member ``j`` holds chunk ``j`` of ``src_dim`` (a dim of ``src_size``) and all of
        ``dst_dim``; it sends chunk ``k`` of ``dst_dim`` to member ``k`` and ends with all of
        ``src_dim`` and chunk ``j`` of ``dst_dim``.
        """
        if self.host_only and _is_device_array(x):
            return self._staged(self.all_to_all, x, out, src_dim=src_dim, dst_dim=dst_dim, src_size=src_size)
        src = _check_dim(x, src_dim, "all-to-all")
        dst = _check_dim(x, dst_dim, "all-to-all")
        if src == dst:
            raise CommError(f"all-to-all: src_dim and dst_dim are both {src}")
        n, me = self.size, self.rank
        _check_chunk(self, x, src, src_size, "all-to-all")
        if n == 1:
            return _deliver(x, out)
        xp = array_module(x)
        dst_size = x.shape[dst]
        cs, cd = padded_chunk(src_size, n), padded_chunk(dst_size, n)
        p = _pad(xp, _pad(xp, x, src, cs), dst, n * cd)
        sends = {k: xp.ascontiguousarray(_take(p, dst, k * cd, (k + 1) * cd)) for k in range(n)}
        block_shape = list(p.shape)
        block_shape[dst] = cd
        recvs = {j: xp.empty(block_shape, x.dtype) for j in range(n) if j != me}
        recvs_all = dict(recvs)
        recvs_all[me] = sends.pop(me)
        self.exchange(sends, recvs)
        got = xp.concatenate([recvs_all[j] for j in range(n)], axis=src)
        dlo, dhi = chunk_bounds(dst_size, n, me)
        return _deliver(_take(_take(got, src, 0, src_size), dst, 0, dhi - dlo), out)

    # ------------------------------------------------------------------- helpers ----------
    def _staged(self, fn, x, out, **kw):
        """Run a host-only collective on a device array through host memory."""
        import cupy

        res = fn(cupy.asnumpy(x), **kw)
        dev = cupy.asarray(res)
        if out is None:
            return dev
        out[...] = dev
        return out


def _check_chunk(comm: "Communicator", x, dim: int, total: int, what: str) -> None:
    """``x`` holds exactly this member's ``torch.chunk`` chunk of a dim of ``total`` entries."""
    lo, hi = chunk_bounds(total, comm.size, comm.rank)
    if x.shape[dim] != hi - lo:
        raise CommError(f"{what}: {comm.describe_member(comm.rank)} holds {x.shape[dim]} entries of dim {dim}, but "
                        f"chunk {comm.rank} of {total} over {comm.size} ranks has {hi - lo}")


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise CommError(f"unknown reduction {op!r}; use one of {list(REDUCE_OPS)}")


def _deliver(res, out):
    if out is None:
        return array_module(res).array(res, copy=True)
    if tuple(out.shape) != tuple(res.shape):
        raise CommError(f"collective result has shape {tuple(res.shape)} but the output buffer has {tuple(out.shape)}")
    out[...] = res
    return out


def _my_group(groups: Sequence[Sequence[int]], rank: int, size: int) -> tuple[int, ...]:
    flat = [int(r) for g in groups for r in g]
    if sorted(flat) != list(range(size)):
        raise CommError(f"split: groups {[list(g) for g in groups]} do not partition ranks 0..{size - 1}")
    for g in groups:
        if rank in g:
            return tuple(int(r) for r in g)
    raise CommError(f"split: rank {rank} is in no group")  # unreachable after the check above


class SelfCommunicator(Communicator):
    """The communicator of a world of one rank (every collective is a copy)."""

    backend = "self"

    def __init__(self):
        super().__init__(0, 1)

    def exchange(self, sends, recvs) -> None:
        if sends or recvs:
            raise CommError("a world of one rank has no peers to exchange with")


class GroupView(Communicator):
    """A sub-communicator over some ranks of a parent that supports point-to-point exchange.

    Member ``p`` of the view is parent rank ``group[p]``; messages go through the parent. Used
    by the TCP and in-process backends; pairs of ranks see their messages in program order,
    so views sharing the parent cannot mix up each other's messages.
    """

    def __init__(self, parent: Communicator, group: Sequence[int]):
        group = tuple(int(r) for r in group)
        super().__init__(group.index(parent.rank), len(group))
        self.parent = parent
        self.group = group
        self.backend = parent.backend
        self.host_only = parent.host_only
        self.global_ranks = tuple(parent.global_ranks[r] for r in group)

    def exchange(self, sends, recvs) -> None:
        self.parent.exchange({self.group[p]: a for p, a in sends.items()},
                             {self.group[p]: a for p, a in recvs.items()})

    def wait(self) -> None:
        self.parent.wait()

    def split(self, groups):
        return GroupView(self, _my_group(groups, self.rank, self.size))
