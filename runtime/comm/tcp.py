"""TCP rendezvous store and a TCP communicator for CPU ranks started without MPI.

* :class:`TCPStoreServer` / :class:`TCPStore` — a tiny key-value store (like torch's
  ``TCPStore``) served by rank 0 at ``MASTER_ADDR:MASTER_PORT``. Ranks use it to find each
  other, to share the NCCL unique id and the watchdog's address.
* :class:`TCPCommunicator` — a full mesh of TCP connections between the ranks; every
  collective is built from grouped, non-blocking send/recv (:meth:`TCPCommunicator.exchange`),
  reductions happen in member order (bit-identical on every rank). It is the CPU backend of
  ``shardflow run`` when ``mpiexec`` is not available, and the bootstrap of the NCCL backend.

A peer that closes its connection (it died) raises :class:`RankFailedError` naming it.
"""
from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import time

import numpy as np

from ..errors import number_from_env
from .base import Communicator, CommError, RankFailedError, byte_view

__all__ = ["TCPStoreServer", "TCPStore", "TCPCommunicator", "local_ip_towards"]

log = logging.getLogger(__name__)

_MAGIC = 0x53464C57  # "SFLW"
_CHUNK = 1 << 22
#: Microseconds an exchange polls its sockets without sleeping before it waits in ``select``,
#: unless ``SHARDFLOW_TCP_SPIN_US`` says otherwise when the communicator is made (0 turns it off).
#: A sleeping rank takes tens of microseconds to wake when its peer's bytes arrive; polling
#: first, as MPI's shared-memory transport does, saves that on short messages and costs a busy
#: core for at most this long.
SPIN_US = 100.0


def spin_us_from_env() -> float:
    """``SHARDFLOW_TCP_SPIN_US`` as a number of microseconds (:data:`SPIN_US` when unset)."""
    return number_from_env("SHARDFLOW_TCP_SPIN_US", SPIN_US, "microseconds (0 turns the polling off)", CommError)


def local_ip_towards(host: str) -> str:
    """The address of this machine's interface that reaches ``host``."""
    if host in ("localhost", "127.0.0.1", "::1", ""):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        k = sock.recv_into(view[pos:], n - pos)
        if k == 0:
            raise ConnectionError("connection closed")
        pos += k
    return bytes(buf)


# ---------------------------------------------------------------------------------------
# key-value store
# ---------------------------------------------------------------------------------------
class TCPStoreServer:
    """Serve a key-value store on ``port`` (all interfaces) from a daemon thread.

    Requests: ``S key value`` stores; ``G key timeout_ms`` waits until the key exists (or the
    timeout passes) and returns its value.
    """

    def __init__(self, port: int, host: str = ""):
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise CommError(f"cannot serve the rendezvous store on port {port}: {exc}; pick another MASTER_PORT") \
                from None
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="shardflow-store", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                op = conn.recv(1)
                if not op:
                    return
                (klen,) = struct.unpack("<I", _recv_exact(conn, 4))
                key = _recv_exact(conn, klen).decode()
                if op == b"S":
                    (vlen,) = struct.unpack("<Q", _recv_exact(conn, 8))
                    value = _recv_exact(conn, vlen)
                    with self._cond:
                        self._data[key] = value
                        self._cond.notify_all()
                    conn.sendall(b"\x00")
                elif op == b"G":
                    (timeout_ms,) = struct.unpack("<Q", _recv_exact(conn, 8))
                    deadline = time.monotonic() + timeout_ms / 1000
                    with self._cond:
                        while key not in self._data:
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break
                            self._cond.wait(min(left, 1.0))
                        value = self._data.get(key)
                    if value is None:
                        conn.sendall(b"\x01")
                    else:
                        conn.sendall(b"\x00" + struct.pack("<Q", len(value)) + value)
                else:
                    return
        except (OSError, ConnectionError):
            return
        finally:
            conn.close()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


class TCPStore:
    """Client of a :class:`TCPStoreServer` at ``host:port``.

    Parameters
    ----------
    host, port
        The server (``MASTER_ADDR``, ``MASTER_PORT``).
    timeout_s
        How long to keep retrying the connection, and the default wait of :meth:`get`.
    """

    def __init__(self, host: str, port: int, timeout_s: float = 60.0):
        self.host, self.port, self.timeout_s = host, int(port), float(timeout_s)
        deadline = time.monotonic() + self.timeout_s
        last: Exception | None = None
        while True:
            try:
                self._sock = socket.create_connection((host, self.port), timeout=5.0)
                break
            except OSError as exc:
                last = exc
                if time.monotonic() > deadline:
                    raise CommError(f"cannot reach the rendezvous store at {host}:{port} within {self.timeout_s:g} s "
                                    f"({last}); is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?") from None
                time.sleep(0.05)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``."""
        k = key.encode()
        with self._lock:
            self._sock.sendall(b"S" + struct.pack("<I", len(k)) + k + struct.pack("<Q", len(value)) + value)
            _recv_exact(self._sock, 1)

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout_s`` for another rank to set it."""
        t = self.timeout_s if timeout_s is None else timeout_s
        k = key.encode()
        with self._lock:
            try:
                self._sock.sendall(b"G" + struct.pack("<I", len(k)) + k + struct.pack("<Q", int(t * 1000)))
                status = _recv_exact(self._sock, 1)
                if status != b"\x00":
                    raise CommError(f"rendezvous: no rank published {key!r} within {t:g} s (a rank did not start, or "
                                    "the ranks were started with different world sizes)")
                (n,) = struct.unpack("<Q", _recv_exact(self._sock, 8))
                return _recv_exact(self._sock, n)
            except (OSError, ConnectionError) as exc:
                raise RankFailedError(f"lost the rendezvous store at {self.host}:{self.port} ({exc}); rank 0 died?",
                                      0) from None

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


# ---------------------------------------------------------------------------------------
# communicator
# ---------------------------------------------------------------------------------------
class TCPCommunicator(Communicator):
    """A full mesh of TCP connections between ``size`` ranks.

    Use :meth:`connect`. Collectives come from :class:`Communicator`'s generic algorithms
    over :meth:`exchange`; sub-communicators are views over the same connections.
    """

    backend = "tcp"

    def __init__(self, rank: int, size: int, peers: dict[int, socket.socket], listener: socket.socket | None,
                 timeout_s: float | None = None, spin_us: float | None = None):
        super().__init__(rank, size)
        self._peers = peers
        self._listener = listener
        self.timeout_s = timeout_s
        self.spin_us = spin_us_from_env() if spin_us is None else spin_us
        self._store: TCPStore | None = None
        self._store_server: TCPStoreServer | None = None

    @classmethod
    def connect(cls, rank: int, size: int, store: TCPStore, prefix: str = "tcp",
                timeout_s: float | None = None) -> "TCPCommunicator":
        """Connect rank ``rank`` to every other rank, finding them through ``store``.

        Parameters
        ----------
        rank, size
            This rank and the world size.
        store
            The rendezvous store every rank uses.
        prefix
            Key prefix (to build several communicators through one store).
        timeout_s
            Receive timeout of collectives (``None``: wait forever; the launcher's watchdog
            detects dead ranks). Defaults to ``SHARDFLOW_COMM_TIMEOUT`` when set.
        """
        # Both settings are read before any socket is opened: a bad value leaves nothing behind.
        if timeout_s is None:
            timeout_s = number_from_env("SHARDFLOW_COMM_TIMEOUT", 0.0, "seconds (0: wait forever)", CommError) or None
        spin_us = spin_us_from_env()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("", 0))
        listener.listen(max(size, 1))
        ip = local_ip_towards(store.host)
        store.set(f"{prefix}/addr/{rank}", f"{ip}:{listener.getsockname()[1]}:{size}".encode())
        peers: dict[int, socket.socket] = {}
        for j in range(rank):  # connect to lower ranks (their listeners queue us even before accept)
            host, port, their_size = store.get(f"{prefix}/addr/{j}").decode().rsplit(":", 2)
            if int(their_size) != size:
                raise CommError(f"rank {j} was started with world size {their_size}, rank {rank} with {size}")
            s = socket.create_connection((host, int(port)), timeout=store.timeout_s)
            s.sendall(struct.pack("<III", _MAGIC, rank, size))
            peers[j] = s
        listener.settimeout(store.timeout_s)
        for _ in range(size - 1 - rank):
            try:
                s, _ = listener.accept()
            except socket.timeout:
                missing = sorted(set(range(rank + 1, size)) - set(peers))
                raise CommError(f"rank {rank}: rank(s) {missing} did not connect within {store.timeout_s:g} s") \
                    from None
            s.settimeout(store.timeout_s)
            magic, j, their_size = struct.unpack("<III", _recv_exact(s, 12))
            if magic != _MAGIC or their_size != size or not rank < j < size:
                s.close()
                raise CommError(f"rank {rank}: unexpected handshake (rank {j}, world size {their_size})")
            peers[j] = s
        for s in peers.values():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
        log.debug("rank %d: connected to %d peers over TCP", rank, len(peers))
        return cls(rank, size, peers, listener, timeout_s, spin_us)

    def exchange(self, sends, recvs) -> None:
        sel = selectors.DefaultSelector()
        out_state: dict[int, list] = {}
        in_state: dict[int, list] = {}
        for p, a in sends.items():
            if p == self.rank or p not in self._peers:
                raise CommError(f"exchange: rank {self.rank} cannot send to {p}")
            payload = byte_view(np.ascontiguousarray(a))
            out_state[p] = [memoryview(struct.pack("<Q", payload.nbytes)), memoryview(payload), 0, 0]
        for p, buf in recvs.items():
            if p == self.rank or p not in self._peers:
                raise CommError(f"exchange: rank {self.rank} cannot receive from {p}")
            in_state[p] = [bytearray(8), memoryview(byte_view(buf)), 0, 0]  # header, payload, stage, pos
        if self.spin_us > 0:
            self._poll(out_state, in_state, time.perf_counter() + self.spin_us * 1e-6)
            if not out_state and not in_state:
                sel.close()
                return
        for p in set(out_state) | set(in_state):
            ev = (selectors.EVENT_WRITE if p in out_state else 0) | (selectors.EVENT_READ if p in in_state else 0)
            sel.register(self._peers[p], ev, p)
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        try:
            while out_state or in_state:
                ready = sel.select(timeout=1.0)
                if not ready and deadline is not None and time.monotonic() > deadline:
                    waiting = sorted(set(out_state) | set(in_state))
                    raise RankFailedError(f"rank {self.global_ranks[self.rank]}: no progress with rank(s) "
                                          f"{[self.global_ranks[p] for p in waiting]} for {self.timeout_s:g} s",
                                          self.global_ranks[waiting[0]])
                for key, ev in ready:
                    p = key.data
                    sock = self._peers[p]
                    if ev & selectors.EVENT_WRITE and p in out_state:
                        self._guarded(p, self._send_some, out_state)
                    if ev & selectors.EVENT_READ and p in in_state:
                        self._guarded(p, self._recv_some, in_state)
                    ev_new = (selectors.EVENT_WRITE if p in out_state else 0) | \
                             (selectors.EVENT_READ if p in in_state else 0)
                    if ev_new == 0:
                        sel.unregister(sock)
                    elif ev_new != key.events:
                        sel.modify(sock, ev_new, p)
        finally:
            sel.close()

    def _poll(self, out_state, in_state, until: float) -> None:
        """Move bytes on every pending socket without blocking, until all is done or ``until``."""
        while out_state or in_state:
            for p in list(out_state):
                self._guarded(p, self._send_some, out_state)
            for p in list(in_state):
                self._guarded(p, self._recv_some, in_state)
            if time.perf_counter() > until:
                return

    def _guarded(self, p, step, state) -> None:
        try:
            step(p, self._peers[p], state)
        except (ConnectionError, OSError) as exc:
            raise RankFailedError(f"rank {self.global_ranks[self.rank]}: lost the connection to "
                                  f"{self.describe_member(p)} ({exc}); it probably died",
                                  self.global_ranks[p]) from None

    @staticmethod
    def _send_some(p, sock, out_state) -> None:
        st = out_state[p]
        part = st[st[2]]
        try:
            n = sock.send(part[st[3]:st[3] + _CHUNK])
        except BlockingIOError:
            return
        st[3] += n
        if st[3] == len(part):
            st[2] += 1
            st[3] = 0
            if st[2] == 2 or (st[2] == 1 and len(st[1]) == 0):
                del out_state[p]

    def _recv_some(self, p, sock, in_state) -> None:
        st = in_state[p]
        if st[2] == 0:
            try:
                n = sock.recv_into(memoryview(st[0])[st[3]:], 8 - st[3])
            except BlockingIOError:
                return
            if n == 0:
                raise ConnectionError("connection closed by peer")
            st[3] += n
            if st[3] < 8:
                return
            (length,) = struct.unpack("<Q", bytes(st[0]))
            if length != len(st[1]):
                raise CommError(f"rank {self.global_ranks[self.rank]}: {self.describe_member(p)} sent {length} bytes "
                                f"where {len(st[1])} were expected; the ranks run different programs?")
            st[2], st[3] = 1, 0
            if length == 0:
                del in_state[p]
            return
        try:
            n = sock.recv_into(st[1][st[3]:], len(st[1]) - st[3])
        except BlockingIOError:
            return
        if n == 0:
            raise ConnectionError("connection closed by peer")
        st[3] += n
        if st[3] == len(st[1]):
            del in_state[p]

    def close(self) -> None:
        for s in self._peers.values():
            try:
                s.close()
            except OSError:
                pass
        self._peers = {}
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._store_server is not None:
            self._store_server.close()
            self._store_server = None
