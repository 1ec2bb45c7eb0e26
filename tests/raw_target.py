"""A raw TCP target on loopback for tests: records the exact bytes of every request,
one connection at a time, and answers with whatever bytes a handler writes.

    target = RawTarget(lambda conn, request: conn.sendall(OK) or True).start()
    ... target.url("/a") ... target.requests() ... target.closed_by_peer ...
    target.stop()

Where `LoopbackTarget` (tests/target.py) is a well-behaved HTTP server, this one
lets a test misbehave on purpose (trickle, answer 100 MB, send garbage) and see
what arrived on the wire, byte for byte.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

IDLE_SECONDS = 10.0  # a connection thread gives up after this long without a byte


@dataclass(frozen=True)
class RawRequest:
    connection: int  # which accepted connection it came on (1, 2, ...)
    raw: bytes  # exactly what arrived for it: head and body
    request_line: str
    headers: dict[str, str]
    body: bytes

    @property
    def path(self) -> str:
        parts = self.request_line.split(" ")
        return parts[1] if len(parts) == 3 else ""

    @property
    def well_formed(self) -> bool:
        parts = self.request_line.split(" ")
        return len(parts) == 3 and parts[0].isalpha() and parts[0].isupper() and parts[2] == "HTTP/1.1"


# handler(connection socket, the request) -> keep the connection open for another request?
Handler = Callable[[socket.socket, RawRequest], bool]


def answer(status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}"]
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@dataclass
class RawTarget:
    handler: Handler
    host: str = "127.0.0.1"
    port_wanted: int = 0
    _requests: list[RawRequest] = field(default_factory=list)
    closed_by_peer: list[int] = field(default_factory=list)  # connections the client closed
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _connections: int = 0
    _stopped: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((self.host, self.port_wanted))
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self._open: list[socket.socket] = []

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def url(self, path: str, host: str | None = None) -> str:
        return f"http://{host or self.host}:{self.port}{path}"

    def start(self) -> "RawTarget":
        threading.Thread(target=self._accept, daemon=True, name="raw-target").start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self.listener.close()
        with self._lock:
            for conn in self._open:
                try:
                    conn.close()
                except OSError:
                    pass

    def requests(self, path: str | None = None) -> list[RawRequest]:
        with self._lock:
            return [r for r in self._requests if path is None or r.path == path]

    @property
    def connections(self) -> int:
        with self._lock:
            return self._connections

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            with self._lock:
                self._connections += 1
                number = self._connections
                self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        conn.settimeout(IDLE_SECONDS)
        pending = b""
        try:
            while not self._stopped.is_set():
                request, pending = self._read_request(conn, number, pending)
                if request is None:
                    self._note_close(number)
                    return
                with self._lock:
                    self._requests.append(request)
                if not request.well_formed:
                    conn.sendall(answer(400, b"garbage"))
                    return
                if not self.handler(conn, request):
                    return
        except OSError:
            self._note_close(number)
        finally:
            conn.close()

    def _note_close(self, number: int) -> None:
        with self._lock:
            self.closed_by_peer.append(number)

    def _read_request(self, conn: socket.socket, number: int, pending: bytes) -> tuple[RawRequest | None, bytes]:
        data = pending
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None, b""
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip()] = value.strip()
        length = int(headers.get("Content-Length", "0") or 0) if headers.get("Content-Length", "0").isdigit() else 0
        while len(rest) < length:
            chunk = conn.recv(65536)
            if not chunk:
                break
            rest += chunk
        body, after = rest[:length], rest[length:]
        raw = head + b"\r\n\r\n" + body
        return RawRequest(number, raw, lines[0], headers, body), after


def wait_for(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    """True once `condition()` holds, False if it did not within `seconds` (polled every 20 ms)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
