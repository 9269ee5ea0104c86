"""Collectives prepared once for fixed buffers: no allocation per call, CUDA-graph capturable.

A rank program calls the same collectives on the same buffers on every run. :func:`prepare`
allocates, once, the staging buffers a collective needs (the padded, dim-moved send block and
the receive block) and returns a :class:`PreparedCollective` whose call only copies into and out
of them and calls the backend's ``*_into`` primitives, which write into a given buffer. On a
device backend (NCCL) every step is then a stream-ordered kernel or NCCL call on preallocated
memory, so the call can be captured into a CUDA graph together with the kernels around it
(``capturable``); host-staged backends (MPI/TCP with cupy arrays) cannot be captured and are
called eagerly between graph segments. On host arrays, all-gathers and reduce-scatters keep the
buffers' own layout, ``[outer, chunk, inner]``, and stage only what that layout needs (nothing
when every dim before the split one has one entry and the split is even); an all-to-all's own
block goes from ``x`` to ``y`` directly.

The semantics are those of the unprepared methods of
:class:`~shardflow.runtime.comm.base.Communicator` (``torch.chunk`` chunks, padding to
``ceil(size / n)`` on the wire); tests check that both give identical results.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .base import CommError, Communicator, _check_chunk, _check_dim, array_module, chunk_bounds, padded_chunk

__all__ = ["PreparedCollective", "prepare"]


def _moved(xp, a, dim: int):
    """``a`` with ``dim`` moved to the front (a view)."""
    return xp.moveaxis(a, dim, 0)


class PreparedCollective:
    """One collective on fixed buffers ``x`` → ``y`` (see :func:`prepare`). Call it to run it."""

    def __init__(self, comm: Communicator, kind: str, body, capturable: bool, keep: tuple = ()):
        self.comm = comm
        self.kind = kind
        self._body = body
        #: True when a call is only stream-ordered device work (a CUDA graph may capture it).
        self.capturable = capturable
        self._keep = keep  # the staging buffers stay alive as long as the collective

    def __call__(self) -> None:
        self._body()

    def __repr__(self) -> str:
        return f"PreparedCollective({self.kind}, {self.comm.size} members, capturable={self.capturable})"


def prepare(comm: Communicator, kind: str, x: Any, y: Any, attrs: Mapping[str, Any] | None = None
            ) -> PreparedCollective:
    """Prepare collective ``kind`` from this member's ``x`` into ``y`` (both C-contiguous arrays
    of the same module, numpy or cupy, that stay allocated while the result is used).

    ``kind`` and ``attrs`` are those of a rank program's collective step: ``all_reduce``
    (``op``), ``all_gather`` (``dim``, ``global_size``), ``reduce_scatter`` (``dim``, ``op``),
    ``all_to_all`` (``src_dim``, ``dst_dim``, ``src_size``).
    """
    attrs = dict(attrs or {})
    xp = array_module(x)
    if array_module(y) is not xp:
        raise CommError(f"{kind}: input and output must both be numpy or both be cupy arrays")
    device = xp.__name__ == "cupy"
    if device and comm.host_only:
        # staged through host memory on every call: correct, never capturable
        return PreparedCollective(comm, kind, _unprepared(comm, kind, x, y, attrs), False)
    op = attrs.get("op", "sum") if kind in ("all_reduce", "reduce_scatter") else None
    capturable = device and comm.capture_safe and comm._capturable(x.dtype, op)
    n, me = comm.size, comm.rank
    if n == 1 and kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        _check_local(comm, kind, x, attrs)
        if tuple(x.shape) != tuple(y.shape):
            raise CommError(f"{kind} on one member: output shape {tuple(y.shape)} differs from input {tuple(x.shape)}")

        def copy():
            if x is not y:
                y[...] = x
        return PreparedCollective(comm, kind, copy, device)

    if kind == "all_reduce":
        if tuple(x.shape) != tuple(y.shape):
            raise CommError(f"all-reduce: output shape {tuple(y.shape)} differs from input {tuple(x.shape)}")
        return PreparedCollective(comm, kind, lambda: comm._allreduce_into(x, y, op), capturable)

    if kind == "all_gather":
        dim = _check_dim(x, attrs["dim"], "all-gather")
        g = int(attrs["global_size"])
        _check_local(comm, kind, x, attrs)
        c = padded_chunk(g, n)
        rest = tuple(s for i, s in enumerate(x.shape) if i != dim)
        if not device and _host_layout_ok(x, y):
            return _host_all_gather(comm, x, y, dim, g)
        send = xp.zeros((c,) + rest, x.dtype)  # the padding rows stay zero
        recv = xp.empty((n, c) + rest, x.dtype)
        lo, hi = chunk_bounds(g, n, me)
        out_view = _moved(xp, y, dim)
        full = recv.reshape((n * c,) + rest)[:g]

        def all_gather():
            send[:hi - lo] = _moved(xp, x, dim)
            comm._allgather_into(send, recv)
            out_view[...] = full
        return PreparedCollective(comm, kind, all_gather, capturable, (send, recv))

    if kind == "reduce_scatter":
        dim = _check_dim(x, attrs["dim"], "reduce-scatter")
        size = x.shape[dim]
        c = padded_chunk(size, n)
        lo, hi = chunk_bounds(size, n, me)
        rest = tuple(s for i, s in enumerate(x.shape) if i != dim)
        out_view = _moved(xp, y, dim)
        if out_view.shape[0] != hi - lo:
            raise CommError(f"reduce-scatter: {comm.describe_member(me)} expects {hi - lo} entries of dim {dim}, the "
                            f"output buffer has {out_view.shape[0]}")
        if not device and _host_layout_ok(x, y):
            return _host_reduce_scatter(comm, x, y, dim, op)
        send = xp.zeros((n * c,) + rest, x.dtype)
        recv = xp.empty((c,) + rest, x.dtype)

        def reduce_scatter():
            send[:size] = _moved(xp, x, dim)
            comm._reduce_scatter_into(send, recv, op)
            out_view[...] = recv[:hi - lo]
        return PreparedCollective(comm, kind, reduce_scatter, capturable, (send, recv))

    if kind == "all_to_all":
        src = _check_dim(x, attrs["src_dim"], "all-to-all")
        dst = _check_dim(x, attrs["dst_dim"], "all-to-all")
        if src == dst:
            raise CommError(f"all-to-all: src_dim and dst_dim are both {src}")
        src_size = int(attrs["src_size"])
        _check_local(comm, kind, x, attrs)
        dst_size = x.shape[dst]
        cs, cd = padded_chunk(src_size, n), padded_chunk(dst_size, n)
        # blocks[k]: what goes to member k (src chunk padded to cs, dst chunk k padded to cd), with
        # the block index in front and src, dst moved to axes 1 and 2
        rest = tuple(s for i, s in enumerate(x.shape) if i not in (src, dst))
        send = xp.zeros((n, cs, cd) + rest, x.dtype)
        recv = xp.empty((n, cs, cd) + rest, x.dtype)
        xm = xp.moveaxis(x, (src, dst), (0, 1))  # (src_local, dst_size, rest...)
        ym = xp.moveaxis(y, (src, dst), (0, 1))  # (src_size, dst_local, rest...)
        lo_d, hi_d = chunk_bounds(dst_size, n, me)
        if tuple(ym.shape[:2]) != (src_size, hi_d - lo_d):
            raise CommError(f"all-to-all: the output buffer has shape {tuple(y.shape)}, expected {src_size} entries "
                            f"of dim {src} and {hi_d - lo_d} of dim {dst}")
        local_src = xm.shape[0]
        sends_in = []  # (block k, dst range) for the copies into the send blocks
        for k in range(n):
            a, b = chunk_bounds(dst_size, n, k)
            sends_in.append((k, a, b))
        recvs_out = []  # (member j, src range in y)
        for j in range(n):
            a, b = chunk_bounds(src_size, n, j)
            recvs_out.append((j, a, b))
        peers = [p for p in range(n) if p != me]

        # this member's own block goes from x to y directly; only the peers' pass the staging blocks
        own_src = chunk_bounds(src_size, n, me)

        def all_to_all():
            for k, a, b in sends_in:
                if k != me and b > a and local_src:
                    send[k, :local_src, :b - a] = xm[:, a:b]
            comm._exchange_into({p: send[p] for p in peers}, {p: recv[p] for p in peers})
            if own_src[1] > own_src[0] and hi_d > lo_d:
                ym[own_src[0]:own_src[1]] = xm[:, lo_d:hi_d]
            for j, a, b in recvs_out:
                if j != me and b > a and hi_d > lo_d:
                    ym[a:b] = recv[j, :b - a, :hi_d - lo_d]
        return PreparedCollective(comm, kind, all_to_all, capturable, (send, recv))
    raise CommError(f"unknown collective {kind!r}")


def _host_layout_ok(x, y) -> bool:
    """Host buffers the collectives may view in their own layout (C-contiguous, not overlapping)."""
    return x.flags.c_contiguous and y.flags.c_contiguous and not np.shares_memory(x, y)


def _outer_inner(shape, dim: int) -> tuple[int, int]:
    return int(np.prod(shape[:dim], dtype=np.int64)), int(np.prod(shape[dim + 1:], dtype=np.int64))


def _host_all_gather(comm: Communicator, x, y, dim: int, g: int) -> PreparedCollective:
    """All-gather of host buffers in their own layout: ``x`` as ``[outer, chunk, inner]``, ``y``
    as ``[outer, g, inner]``, member ``j``'s chunk landing in ``y[:, lo_j:hi_j]`` in runs of
    ``chunk * inner`` contiguous elements (moving the dim to the front instead made two
    transposing copies). An even split sends ``x`` itself; with ``outer == 1`` as well, the
    members' chunks are ``y``'s consecutive blocks and arrive in place."""
    n, me = comm.size, comm.rank
    c = padded_chunk(g, n)
    outer, inner = _outer_inner(y.shape, dim)
    lo, hi = chunk_bounds(g, n, me)
    even = g % n == 0
    x3, y3 = x.reshape(outer, hi - lo, inner), y.reshape(outer, g, inner)
    if even and outer == 1:
        recv_in_place = y.reshape(n, 1, c, inner)
        return PreparedCollective(comm, "all_gather", lambda: comm._allgather_into(x3, recv_in_place), False)
    send = x3 if even else np.zeros((outer, c, inner), x.dtype)  # padding stays zero
    recv = np.empty((n, outer, c, inner), x.dtype)
    bounds = [chunk_bounds(g, n, j) for j in range(n)]

    def all_gather():
        if not even:
            send[:, :hi - lo] = x3
        comm._allgather_into(send, recv)
        for j, (a, b) in enumerate(bounds):
            if b > a:
                y3[:, a:b] = recv[j, :, :b - a]
    return PreparedCollective(comm, "all_gather", all_gather, False, (send, recv))


def _host_reduce_scatter(comm: Communicator, x, y, dim: int, op: str) -> PreparedCollective:
    """Reduce-scatter of host buffers in their own layout (see :func:`_host_all_gather`): the send
    buffer holds member ``j``'s chunk of ``x`` as block ``j`` (runs of ``chunk * inner``
    elements), or is ``x`` itself when ``outer == 1`` and the split is even; an even split
    reduces straight into ``y``."""
    n, me = comm.size, comm.rank
    size = x.shape[dim]
    c = padded_chunk(size, n)
    outer, inner = _outer_inner(x.shape, dim)
    lo, hi = chunk_bounds(size, n, me)
    even = size % n == 0
    x3, y3 = x.reshape(outer, size, inner), y.reshape(outer, hi - lo, inner)
    if even and outer == 1:
        send_in_place = x.reshape(n, c, inner)  # block j: member j's chunk
        return PreparedCollective(comm, "reduce_scatter", lambda: comm._reduce_scatter_into(send_in_place, y3, op),
                                  False)
    send = np.zeros((n, outer, c, inner), x.dtype)  # padding stays zero
    send_blocks = send.reshape(n * outer, c, inner)
    recv = y3 if even else np.empty((outer, c, inner), x.dtype)
    bounds = [chunk_bounds(size, n, j) for j in range(n)]

    def reduce_scatter():
        for j, (a, b) in enumerate(bounds):
            if b > a:
                send[j, :, :b - a] = x3[:, a:b]
        comm._reduce_scatter_into(send_blocks, recv, op)
        if not even:
            y3[...] = recv[:, :hi - lo]
    return PreparedCollective(comm, "reduce_scatter", reduce_scatter, False, (send, recv))


def _check_local(comm: Communicator, kind: str, x, attrs) -> None:
    """The member's block of the split dim has the ``torch.chunk`` size the collective expects."""
    if kind == "all_gather":
        _check_chunk(comm, x, _check_dim(x, attrs["dim"], "all-gather"), int(attrs["global_size"]), "all-gather")
    elif kind == "all_to_all":
        _check_chunk(comm, x, _check_dim(x, attrs["src_dim"], "all-to-all"), int(attrs["src_size"]), "all-to-all")


def _unprepared(comm: Communicator, kind: str, x, y, attrs):
    if kind == "all_reduce":
        return lambda: comm.all_reduce(x, attrs.get("op", "sum"), y)
    if kind == "all_gather":
        return lambda: comm.all_gather(x, attrs["dim"], attrs["global_size"], y)
    if kind == "reduce_scatter":
        return lambda: comm.reduce_scatter(x, attrs["dim"], attrs.get("op", "sum"), y)
    if kind == "all_to_all":
        return lambda: comm.all_to_all(x, attrs["src_dim"], attrs["dst_dim"], attrs["src_size"], y)
    raise CommError(f"unknown collective {kind!r}")
