"""The worker's connections to targets (runs.delivery makes the calls over them).

- Pinned: a connection goes to the address the call-time check resolved and
  approved (`Origin.address`), never to a second lookup of the name; the name
  travels as `Host`, as TLS SNI and as the name the certificate must carry.
- Reused only after a complete, well-framed exchange: `IdleConnections.give` is
  called by delivery only then, and takes back only a connection with nothing
  left to read on it. Anything else is closed.
- Cut off at the call's deadline: `Deadlines` is one thread per process that
  shuts a call's socket down when its time is up, so no trickle of bytes (in the
  headers, the body, or the TLS handshake) keeps a call open past its timeout.
"""
from __future__ import annotations

import heapq
import itertools
import socket
import ssl
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import certifi
from django.conf import settings
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.exceptions import NewConnectionError
from urllib3.util.wait import wait_for_read

MAX_ORIGINS = 256  # origins with idle connections kept; the least recently used one's are closed


@dataclass(frozen=True)
class Origin:
    scheme: str  # "http" or "https"
    addresses: tuple[str, ...]  # the checked IP addresses the socket may connect to, in order
    port: int
    hostname: str  # the URL's host: the Host header, SNI and the certificate's name


_tls_lock = threading.Lock()
_tls_held: tuple[str, ssl.SSLContext] | None = None  # (SCHEDULER_TLS_CA_FILE, the process's one verifying context)


def _tls_context() -> ssl.SSLContext:
    """One verifying context for the process, shared by its call threads (OpenSSL's
    context is safe to share; urllib3 sets the same verify mode on it every time). A
    context holds its own copy of the CA bundle, 785 KiB of resident memory measured
    here: one a thread, a worker child's 200 call threads would hold 157 MB of them."""
    global _tls_held
    extra = settings.SCHEDULER_TLS_CA_FILE or ""
    with _tls_lock:
        if _tls_held is None or _tls_held[0] != extra:  # none yet, or a changed CA file (tests, a reload)
            context = ssl.create_default_context(cafile=certifi.where())
            if extra:  # an internal CA, trusted besides certifi's
                context.load_verify_locations(cafile=extra)
            _tls_held = (extra, context)
        return _tls_held[1]


class _Pinned(HTTPConnection):
    """Connects to the checked addresses only, one after another (as a lookup's
    answers would be tried), never to a fresh lookup of the name."""

    addresses: tuple[str, ...] = ()

    def _new_conn(self) -> socket.socket:
        failed: Exception | None = None
        for address in self.addresses:
            self._dns_host = address
            try:
                return super()._new_conn()
            except NewConnectionError as exc:  # refused, unreachable: the next address (a timeout is not)
                failed = exc
        assert failed is not None
        raise failed


class _PinnedTLS(_Pinned, HTTPSConnection):
    pass


def connect(origin: Origin) -> HTTPConnection:
    """A new (not yet opened) connection to the origin's checked addresses."""
    conn: _Pinned
    if origin.scheme == "https":
        conn = _PinnedTLS(
            origin.addresses[0],
            origin.port,
            server_hostname=origin.hostname,
            assert_hostname=origin.hostname,
            ssl_context=_tls_context(),
        )
    else:
        conn = _Pinned(origin.addresses[0], origin.port)
    conn.addresses = origin.addresses
    return conn


def is_quiet(conn: HTTPConnection) -> bool:
    """Open, with nothing waiting to be read: not closed by the target, no stray bytes."""
    sock = conn.sock
    if sock is None:
        return False
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return False
    try:
        return not wait_for_read(sock, timeout=0.0)
    except (OSError, ValueError):
        return False


class IdleConnections:
    """Open keep-alive connections waiting for the next call to the same origin: at
    most `per_origin` each, for the MAX_ORIGINS origins used last."""

    def __init__(self, per_origin: int = 8) -> None:
        self.per_origin = per_origin
        self._lock = threading.Lock()
        self._idle: OrderedDict[Origin, list[HTTPConnection]] = OrderedDict()

    def take(self, origin: Origin) -> HTTPConnection | None:
        """The most recently used idle connection that is still quiet, or None."""
        while True:
            with self._lock:
                waiting = self._idle.get(origin)
                if not waiting:
                    return None
                conn = waiting.pop()
            if is_quiet(conn):
                return conn
            conn.close()  # the target closed it, or left bytes on it: never reused

    def give(self, origin: Origin, conn: HTTPConnection) -> None:
        evicted: list[HTTPConnection] = []
        kept = False
        if is_quiet(conn):
            with self._lock:
                waiting = self._idle.setdefault(origin, [])
                self._idle.move_to_end(origin)
                if len(waiting) < self.per_origin:
                    waiting.append(conn)
                    kept = True
                while len(self._idle) > MAX_ORIGINS:
                    evicted.extend(self._idle.popitem(last=False)[1])
        for old in evicted if kept else [*evicted, conn]:
            old.close()

    def clear(self) -> None:
        with self._lock:
            waiting = [conn for conns in self._idle.values() for conn in conns]
            self._idle.clear()
        for conn in waiting:
            conn.close()

    def count(self) -> int:
        with self._lock:
            return sum(len(conns) for conns in self._idle.values())


class Deadline:
    """One call's deadline: the socket it watches, and whether it fired."""

    def __init__(self, at: float) -> None:
        self.at = at
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._conn: HTTPConnection | None = None
        self.fired = False
        self._done = False

    def remaining(self) -> float:
        """Seconds left; a TimeoutError when there are none."""
        left = self.at - time.monotonic()
        if left <= 0 or self.fired:
            raise TimeoutError("deadline")
        return left

    def watch(self, conn: HTTPConnection) -> None:
        with self._lock:
            if self.fired:
                raise TimeoutError("deadline")
            self._conn = conn
            if conn.sock is not None:
                self._sockets.append(conn.sock)

    def fire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.fired = True
            sockets = list(self._sockets)
            if self._conn is not None and self._conn.sock is not None:
                sockets.append(self._conn.sock)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # a blocked read or write returns at once
            except OSError:
                pass

    def is_finished(self) -> bool:
        return self._done

    def finish(self) -> bool:
        """The call is over: no firing from now on. False if it had already fired."""
        with self._lock:
            self._done = True
            return not self.fired


class Deadlines:
    """The process's one deadline thread: fires each watched call's deadline on time."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._started = 0
        threading.Thread(target=self._run, name="call-deadlines", daemon=True).start()

    def start(self, seconds: float) -> Deadline:
        deadline = Deadline(time.monotonic() + seconds)
        with self._cond:
            self._started += 1
            if self._started % 1024 == 0:  # finished calls' deadlines wait for their time: drop them
                self._heap = [entry for entry in self._heap if not entry[2].is_finished()]
                heapq.heapify(self._heap)
            heapq.heappush(self._heap, (deadline.at, next(self._order), deadline))
            if self._heap[0][2] is deadline:
                self._cond.notify()
        return deadline

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, _, deadline = heapq.heappop(self._heap)
                    deadline.fire()  # a finished call's deadline does nothing
                self._cond.wait(self._heap[0][0] - now if self._heap else None)
