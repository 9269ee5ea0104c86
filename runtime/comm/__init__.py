"""Communicators: the interface (:mod:`.base`) and its backends.

* ``mpi`` — :class:`~.mpi.MPICommunicator` (mpi4py; CPU buffers, GPU buffers through host staging);
* ``nccl`` — :class:`~.nccl.NCCLCommunicator` (cupy's NCCL; one GPU per rank);
* ``tcp`` — :class:`~.tcp.TCPCommunicator` (sockets; the CPU backend without MPI and the
  bootstrap of NCCL without MPI);
* ``inprocess`` — :class:`~.inprocess.InProcessWorld` (threads of one process; tests).

:func:`create_world` picks and connects the backend for a rank started by ``shardflow run``,
``mpiexec``, ``srun`` or a torchrun-style launcher.
"""
from __future__ import annotations

import logging
import os

from .base import (REDUCE_OPS, CommError, Communicator, GroupView, RankFailedError, SelfCommunicator, chunk_bounds,
                   padded_chunk)
from .inprocess import InProcessCommunicator, InProcessWorld

__all__ = ["Communicator", "SelfCommunicator", "GroupView", "CommError", "RankFailedError", "REDUCE_OPS",
           "chunk_bounds", "padded_chunk", "InProcessWorld", "InProcessCommunicator", "create_world", "BACKENDS",
           "host_communicator"]

log = logging.getLogger(__name__)

#: Accepted ``comm_backend`` values.
BACKENDS = ("auto", "mpi", "nccl", "tcp")


def host_communicator(comm: Communicator) -> Communicator:
    """The host (CPU) communicator behind ``comm`` (its bootstrap for NCCL, else itself)."""
    return getattr(comm, "bootstrap", comm)


def create_world(backend: str, *, launched_by: str, rank: int, size: int, target: str = "cpu",
                 master_addr: str | None = None, master_port: int | None = None, local_rank: int = 0,
                 timeout_s: float = 60.0) -> Communicator:
    """Connect this rank to the world with ``backend``.

    Parameters
    ----------
    backend
        ``auto``, ``mpi``, ``nccl`` or ``tcp``. ``auto`` picks ``nccl`` for cuda targets, else
        ``mpi`` when launched under MPI, else ``tcp``.
    launched_by
        ``mpi`` (mpiexec / srun with PMI) or ``env`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
        ``MASTER_PORT``: torchrun style or ``shardflow run``'s own spawner), or ``single``.
    rank, size
        This rank and the world size as the launcher reports them.
    target
        The artifacts' target (``cpu`` or ``cuda``).
    master_addr, master_port
        The rendezvous store (``env`` launches; NCCL bootstrap without MPI).
    local_rank
        The rank's index on its node (selects the GPU for NCCL).
    timeout_s
        Rendezvous timeout.

    Returns
    -------
    Communicator
        The world communicator; for NCCL its host bootstrap is ``.bootstrap``.
    """
    if backend not in BACKENDS:
        raise CommError(f"comm_backend {backend!r} is not one of {list(BACKENDS)}")
    if size == 1 and backend in ("auto", "tcp") and launched_by != "mpi":
        return SelfCommunicator()
    if backend == "auto":
        backend = "nccl" if target == "cuda" else ("mpi" if launched_by == "mpi" else "tcp")
    if backend == "mpi" and launched_by != "mpi" and size > 1:
        raise CommError("comm_backend 'mpi' needs ranks started by mpiexec (or srun with PMI); start them with "
                        f"`mpiexec -n {size} shardflow run ...` or use comm_backend 'auto'")
    host: Communicator
    if size == 1 and launched_by != "mpi":
        host = SelfCommunicator()
    elif launched_by == "mpi":
        from .mpi import MPICommunicator

        host = MPICommunicator()
        if host.size != size or host.rank != rank:
            raise CommError(f"MPI reports rank {host.rank} of {host.size}, the launcher rank {rank} of {size}")
    else:
        host = _tcp_world(rank, size, master_addr, master_port, timeout_s)
    if backend in ("mpi", "tcp"):
        return host
    from .nccl import NCCLCommunicator

    try:
        import cupy

        device = local_rank % max(cupy.cuda.runtime.getDeviceCount(), 1)
    except Exception as exc:  # noqa: BLE001
        raise CommError(f"the nccl backend needs cupy and a CUDA device ({exc})") from None
    return NCCLCommunicator(host, device=device)


def _tcp_world(rank: int, size: int, master_addr: str | None, master_port: int | None,
               timeout_s: float) -> Communicator:
    from .tcp import TCPCommunicator, TCPStore, TCPStoreServer

    addr = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = master_port or os.environ.get("MASTER_PORT")
    if not port:
        raise CommError("ranks started without MPI find each other at MASTER_ADDR:MASTER_PORT; set MASTER_PORT "
                        "(and MASTER_ADDR on several nodes)")
    server = TCPStoreServer(int(port)) if rank == 0 else None
    store = TCPStore(addr, int(port), timeout_s=timeout_s)
    comm = TCPCommunicator.connect(rank, size, store)
    comm._store = store
    comm._store_server = server
    return comm
