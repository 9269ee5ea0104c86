"""A thread-based communicator: several ranks in one process (for tests and debugging).

``InProcessWorld(n).communicators()`` gives ``n`` communicators whose messages travel through
in-memory queues; run each rank in its own thread. Collectives use the generic algorithms of
:class:`~shardflow.runtime.comm.base.Communicator` (reductions in member order), so results are
bit-identical to the compiler's in-process oracle.
"""
from __future__ import annotations

import queue
import threading

import numpy as np

from .base import Communicator, CommError, RankFailedError, byte_view

__all__ = ["InProcessWorld", "InProcessCommunicator"]


class InProcessWorld:
    """``size`` ranks connected by in-memory mailboxes.

    Parameters
    ----------
    size
        Number of ranks.
    timeout_s
        How long a receive waits before raising :class:`RankFailedError` (a peer thread that
        died or never arrived).
    """

    def __init__(self, size: int, timeout_s: float = 60.0):
        if size < 1:
            raise CommError(f"InProcessWorld needs at least one rank, got {size}")
        self.size = size
        self.timeout_s = timeout_s
        self._boxes = {(s, d): queue.Queue() for s in range(size) for d in range(size) if s != d}
        self._lock = threading.Lock()

    def communicators(self) -> list["InProcessCommunicator"]:
        """One communicator per rank, in rank order."""
        return [InProcessCommunicator(self, r) for r in range(self.size)]


class InProcessCommunicator(Communicator):
    """Rank ``rank`` of an :class:`InProcessWorld`."""

    backend = "inprocess"

    def __init__(self, world: InProcessWorld, rank: int):
        super().__init__(rank, world.size)
        self.world = world

    def exchange(self, sends, recvs) -> None:
        for p, a in sends.items():
            if p == self.rank:
                raise CommError("exchange: a rank cannot send to itself")
            self.world._boxes[(self.rank, p)].put(np.array(a, copy=True))
        for p, buf in recvs.items():
            try:
                got = self.world._boxes[(p, self.rank)].get(timeout=self.world.timeout_s)
            except queue.Empty:
                raise RankFailedError(f"rank {self.global_ranks[self.rank]}: no message from "
                                      f"{self.describe_member(p)} within {self.world.timeout_s} s", p) from None
            if got.nbytes != buf.nbytes:
                raise CommError(f"exchange: {self.describe_member(p)} sent {got.nbytes} bytes, "
                                f"{self.describe_member(self.rank)} expected {buf.nbytes}")
            byte_view(buf)[...] = byte_view(got)
