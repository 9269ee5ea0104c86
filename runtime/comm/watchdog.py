"""Failure detection across ranks: a rank that dies makes every other rank exit non-zero.

Rank 0 hosts a monitor; every other rank keeps a TCP connection to it and exchanges heartbeats
from a daemon thread (communication and kernels release the GIL, so the thread runs while
the main thread waits in a collective). When a rank's connection closes before it said it
was done (it crashed, was killed, or exited on an error), or no heartbeat arrives for
``timeout_s``, the monitor tells every other rank which rank failed; each logs the message and
leaves with :data:`EXIT_PEER_FAILED` right away — never waiting in a collective that cannot
complete. When rank 0 itself goes away, the others see their connection close and exit the same
way.

This works the same under ``mpiexec``, ``srun``, torchrun-style variables and ``shardflow run``'s
own spawner: the monitor's address travels through the host communicator.
"""
from __future__ import annotations

import logging
import os
import selectors
import socket
import struct
import threading
import time
from typing import Callable

from ..errors import number_from_env
from .base import Communicator, CommError
from .tcp import local_ip_towards

__all__ = ["Watchdog", "EXIT_PEER_FAILED"]

log = logging.getLogger(__name__)

#: Exit status of a rank that stops because another rank failed.
EXIT_PEER_FAILED = 3

_HB, _DONE, _ABORT, _BYE, _HELLO = b"H", b"D", b"X", b"B", b"E"
#: an abort's header after its tag: the message's length and the failed rank (-1 if none)
_ABORT_HEAD = "<Hi"


def _default_fail(message: str, rank: int | None) -> None:
    log.critical("%s", message)
    for h in logging.getLogger().handlers + logging.getLogger("shardflow").handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - best effort before leaving
            pass
    os._exit(EXIT_PEER_FAILED)


class Watchdog:
    """Heartbeats between every rank and rank 0; see the module docstring.

    Parameters
    ----------
    comm
        A host communicator of the world (used once, to share rank 0's address).
    heartbeat_s
        Seconds between heartbeats.
    timeout_s
        Silence after which a rank counts as hung (default ``SHARDFLOW_HEARTBEAT_TIMEOUT`` or 30).
    on_failure
        Called as ``on_failure(message, failed_rank)`` when a peer fails; the default logs the
        message and exits the process with :data:`EXIT_PEER_FAILED`.
    """

    def __init__(self, comm: Communicator, heartbeat_s: float = 1.0, timeout_s: float | None = None,
                 on_failure: Callable[[str, int | None], None] | None = None):
        self.rank, self.size = comm.rank, comm.size
        self.global_ranks = comm.global_ranks
        self.heartbeat_s = heartbeat_s
        self.timeout_s = float(timeout_s if timeout_s is not None
                               else number_from_env("SHARDFLOW_HEARTBEAT_TIMEOUT", 30.0, "seconds", CommError))
        self.on_failure = on_failure or _default_fail
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._finished = False
        self._failed = False
        if self.size == 1:
            return
        if self.rank == 0:
            self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._listener.bind(("", 0))
            self._listener.listen(self.size)
            host = os.environ.get("MASTER_ADDR") or socket.gethostname()
            addr = f"{local_ip_towards(host) if os.environ.get('MASTER_ADDR') else _my_ip()}:" \
                   f"{self._listener.getsockname()[1]}"
            comm.broadcast_bytes(addr.encode())
            self._conns: dict[int, socket.socket] = {}
            self._last: dict[int, float] = {}
            self._done: set[int] = set()
            self._all_done = threading.Event()
            self._thread = threading.Thread(target=self._monitor, name="shardflow-watchdog", daemon=True)
        else:
            host, port = comm.broadcast_bytes(None).decode().rsplit(":", 1)
            self._sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
            self._sock.sendall(_HELLO + struct.pack("<I", self.rank))
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._thread = threading.Thread(target=self._client, name="shardflow-watchdog", daemon=True)
        self._thread.start()

    def _name(self, member: int) -> str:
        return f"rank {self.global_ranks[member]}"

    def _fail(self, message: str, member: int | None) -> None:
        if self._failed or self._stop.is_set():
            return
        self._failed = True
        self.on_failure(message, None if member is None else self.global_ranks[member])

    # ------------------------------------------------------------------ rank 0 ------------
    def _monitor(self) -> None:
        sel = selectors.DefaultSelector()
        self._listener.setblocking(False)
        sel.register(self._listener, selectors.EVENT_READ, None)
        start = time.monotonic()
        last_hb = 0.0
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=min(self.heartbeat_s, 0.5)):
                if key.data is None:
                    try:
                        s, _ = self._listener.accept()
                    except OSError:
                        continue
                    s.setblocking(True)
                    s.settimeout(5.0)
                    try:
                        hello = s.recv(5, socket.MSG_WAITALL)
                    except OSError:
                        s.close()
                        continue
                    if len(hello) != 5 or hello[:1] != _HELLO:
                        s.close()
                        continue
                    (member,) = struct.unpack("<I", hello[1:])
                    s.setblocking(False)
                    self._conns[member] = s
                    self._last[member] = time.monotonic()
                    sel.register(s, selectors.EVENT_READ, member)
                    continue
                member = key.data
                s = key.fileobj
                try:
                    data = s.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(s)
                    s.close()
                    self._conns.pop(member, None)
                    if member not in self._done:
                        self._broadcast_failure(f"{self._name(member)} died or exited before finishing (its "
                                                "connection to the watchdog closed)", member)
                        return
                    continue
                self._last[member] = time.monotonic()
                if _DONE in data:
                    self._done.add(member)
                    if len(self._done) == self.size - 1:
                        self._all_done.set()
            now = time.monotonic()
            missing = [m for m in range(1, self.size) if m not in self._conns and m not in self._done]
            if missing and now - start > self.timeout_s:
                self._broadcast_failure(f"{', '.join(self._name(m) for m in missing)} never reached the watchdog "
                                        f"within {self.timeout_s:g} s", missing[0])
                return
            for m, t in list(self._last.items()):
                if m not in self._done and m in self._conns and now - t > self.timeout_s:
                    self._broadcast_failure(f"{self._name(m)} stopped answering (no heartbeat for "
                                            f"{now - t:.0f} s)", m)
                    return
            if now - last_hb >= self.heartbeat_s:
                last_hb = now
                self._send_all(_HB)
        sel.close()

    def _send_all(self, data: bytes) -> None:
        with self._lock:
            for s in list(self._conns.values()):
                try:
                    s.setblocking(True)
                    s.settimeout(2.0)
                    s.sendall(data)
                except OSError:
                    pass
                finally:
                    try:
                        s.setblocking(False)
                    except OSError:
                        pass

    def _broadcast_failure(self, message: str, member: int | None) -> None:
        if self._stop.is_set():
            return
        text = message.encode()[:60000]  # (with the failed rank: the others record it)
        self._send_all(_ABORT + struct.pack(_ABORT_HEAD, len(text), -1 if member is None else member) + text)
        self._fail(f"shardflow: {message}; {self._name(0)} stops", member)

    # ---------------------------------------------------------------- other ranks ----------
    def _client(self) -> None:
        s = self._sock
        try:
            s.settimeout(min(self.heartbeat_s, 0.5))
        except OSError:  # (closed before this thread ran: finished, stopped, or the connection lost)
            if not (self._finished or self._stop.is_set()):
                self._fail(f"shardflow: lost the watchdog connection to {self._name(0)}; "
                           f"{self._name(self.rank)} stops", 0)
            return
        last_sent = 0.0
        last_recv = time.monotonic()
        buf = b""
        while not self._stop.is_set():
            try:
                data = s.recv(65536)
                if not data:
                    if self._finished or self._stop.is_set():
                        return
                    self._fail(f"shardflow: {self._name(0)} died (its watchdog connection closed); "
                               f"{self._name(self.rank)} stops", 0)
                    return
                last_recv = time.monotonic()
                buf += data
                while buf:
                    if buf[:1] == _ABORT:
                        head = 1 + struct.calcsize(_ABORT_HEAD)
                        if len(buf) < head:
                            break
                        n, failed = struct.unpack(_ABORT_HEAD, buf[1:head])
                        if len(buf) < head + n:
                            break
                        msg = buf[head:head + n].decode(errors="replace")
                        self._fail(f"shardflow: {msg}; {self._name(self.rank)} stops", None if failed < 0 else failed)
                        return
                    if buf[:1] == _BYE:
                        return
                    buf = buf[1:]
            except socket.timeout:
                pass
            except OSError:
                if self._finished or self._stop.is_set():
                    return
                self._fail(f"shardflow: lost the watchdog connection to {self._name(0)}; it probably died; "
                           f"{self._name(self.rank)} stops", 0)
                return
            now = time.monotonic()
            if now - last_recv > self.timeout_s and not self._finished:
                self._fail(f"shardflow: {self._name(0)} stopped answering (no heartbeat for {now - last_recv:.0f} s); "
                           f"{self._name(self.rank)} stops", 0)
                return
            if now - last_sent >= self.heartbeat_s:
                last_sent = now
                try:
                    with self._lock:
                        s.sendall(_HB)
                except OSError:
                    pass

    # -------------------------------------------------------------------- finish ----------
    def finish(self, timeout_s: float = 60.0) -> None:
        """Say this rank completed; rank 0 waits (up to ``timeout_s``) for every rank to finish.

        After this, a peer that goes away is no failure.
        """
        if self.size == 1 or self._stop.is_set():
            return
        if self.rank == 0:
            if not self._all_done.wait(timeout_s):
                late = [m for m in range(1, self.size) if m not in self._done]
                log.warning("ranks %s did not finish within %g s of rank 0", [self.global_ranks[m] for m in late],
                            timeout_s)
            self._stop.set()
            self._send_all(_BYE)
            for s in list(self._conns.values()):  # the monitor thread may still drop closed peers
                s.close()
            self._listener.close()
        else:
            self._finished = True
            try:
                with self._lock:
                    self._sock.sendall(_DONE)
            except OSError:
                pass
            self._stop.set()
        self._thread.join(timeout=5.0)
        if self.rank != 0:
            self._sock.close()

    def stop(self) -> None:
        """Stop watching without the finish handshake (the process is about to exit anyway)."""
        self._stop.set()


def _my_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
