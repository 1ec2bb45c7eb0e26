"""A loopback HTTP/1.1 target on raw sockets that keeps every byte it received, per
connection, and reads them as strictly as a careful server would.

Unlike tests/target.py (http.server, which forgives a lot), this one notes every
framing doubt as a problem: a bare CR or LF, a folded header line, a header name
that is not a token, a byte outside visible ASCII in a value, Content-Length and
Transfer-Encoding together, a body cut short, bytes left over after the last
request. A smuggled body shows up here as a garbled next request on the same
connection, which is what a real server behind the scheduler would see.

The answer is chosen by the request's path: `/e5...` a 500 and `/e4...` a 404,
both echoing the request (its credentials first, then its raw bytes) as a target
that reflects its input would,
anything else a 200. It listens on 127.0.0.1 and, when the machine has it, on ::1,
on the same port.
"""
from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass, field

TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
REQUEST_LINE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) (\S+) HTTP/1\.1")
VISIBLE = re.compile(rb"[\x20-\x7e\t]*")
ECHO_MARKER = b"echo from the target"
CREDENTIAL = re.compile(r"(?i)auth|cookie|key|token|secret")
PARTIAL_WAIT = 0.5  # seconds a started request may pause before it counts as cut short
IDLE_WAIT = 30.0  # an idle keep-alive connection is closed after this
MAX_BYTES = 1 << 20  # per connection: a runaway client is cut off, not buffered forever


class Malformed(Exception):
    """The connection cannot go on: answered 400 and closed."""


@dataclass
class Exchange:
    raw: bytes
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    problems: list[str] = field(default_factory=list)

    def values(self, name: str) -> list[str]:
        return [v for n, v in self.headers if n.lower() == name.lower()]

    def value(self, name: str) -> str | None:
        found = self.values(name)
        return found[0] if len(found) == 1 else None


@dataclass
class Connection:
    peer: tuple
    raw: bytearray = field(default_factory=bytearray)
    exchanges: list[Exchange] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


class RawRecordingTarget:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connections: list[Connection] = []
        self._stopping = threading.Event()
        first = socket.create_server(("127.0.0.1", 0))
        self.port = int(first.getsockname()[1])
        self._listeners = [first]
        self.addresses = {"127.0.0.1"}
        try:
            self._listeners.append(socket.create_server(("::1", self.port), family=socket.AF_INET6))
            self.addresses.add("::1")
        except OSError:  # no IPv6 loopback here: [::1] URLs then find nothing listening
            pass
        self._threads: list[threading.Thread] = []

    def start(self) -> "RawRecordingTarget":
        for listener in self._listeners:
            listener.settimeout(0.2)
            thread = threading.Thread(target=self._accept, args=(listener,), daemon=True, name="raw-target")
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=5)
        for listener in self._listeners:
            listener.close()

    # ------------------------------------------------------------------ reading what came

    def connections(self) -> list[Connection]:
        with self._lock:
            return list(self._connections)

    def wait_all_closed(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for conn in self.connections():
            if not conn.done.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def take(self) -> list[Connection]:
        """The finished connections, forgotten here (the next batch starts empty)."""
        with self._lock:
            done = [c for c in self._connections if c.done.is_set()]
            self._connections = [c for c in self._connections if not c.done.is_set()]
            return done

    # ------------------------------------------------------------------ serving

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                sock, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn = Connection(peer=peer)
            with self._lock:
                self._connections.append(conn)
            threading.Thread(target=self._serve, args=(sock, conn), daemon=True, name="raw-target-conn").start()

    def _serve(self, sock: socket.socket, conn: Connection) -> None:
        buffer = bytearray()
        try:
            while not self._stopping.is_set():
                head = self._read_head(sock, conn, buffer)
                if head is None:
                    return
                exchange, close = self._exchange(sock, conn, buffer, head)
                conn.exchanges.append(exchange)
                sock.sendall(self._answer(exchange, close))
                if close:
                    return
        except Malformed as exc:
            conn.problems.append(str(exc))
            try:
                sock.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
        except OSError as exc:
            conn.problems.append(f"connection error while reading: {exc}")
        finally:
            sock.close()
            conn.done.set()

    def _recv(self, sock: socket.socket, conn: Connection, wait: float) -> bytes | None:
        """Some bytes; b"" at the end of the stream; None when nothing came in `wait` seconds."""
        sock.settimeout(wait)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return b""
        conn.raw += data
        if len(conn.raw) > MAX_BYTES:
            raise Malformed(f"more than {MAX_BYTES} bytes on one connection")
        return data

    def _read_head(self, sock: socket.socket, conn: Connection, buffer: bytearray) -> bytes | None:
        while b"\r\n\r\n" not in buffer:
            data = self._recv(sock, conn, PARTIAL_WAIT if buffer else IDLE_WAIT)
            if not data:
                if buffer:
                    state = "ended" if data == b"" else "stalled"
                    conn.problems.append(f"the connection {state} with {len(buffer)} bytes that are no complete "
                                         f"request: {bytes(buffer[:120])!r}")
                return None
            buffer += data
        head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
        buffer[:] = rest
        return head

    def _read_exactly(self, sock: socket.socket, conn: Connection, buffer: bytearray, n: int) -> bytes:
        while len(buffer) < n:
            data = self._recv(sock, conn, PARTIAL_WAIT)
            if not data:
                raise Malformed(f"the body was cut short: {len(buffer)} of {n} bytes came")
            buffer += data
        taken = bytes(buffer[:n])
        del buffer[:n]
        return taken

    def _exchange(self, sock: socket.socket, conn: Connection, buffer: bytearray, head: bytes) -> tuple[Exchange, bool]:
        problems: list[str] = []
        lines = head.split(b"\r\n")
        if any(b"\r" in line or b"\n" in line for line in lines):
            problems.append("a bare CR or LF in the request head")
        match = REQUEST_LINE.fullmatch(lines[0])
        if match is None:
            raise Malformed(f"not a request line: {lines[0][:120]!r}")
        headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            if line[:1] in (b" ", b"\t"):
                problems.append(f"a folded header line: {line[:80]!r}")
                continue
            name, colon, value = line.partition(b":")
            if not colon or not TOKEN.fullmatch(name):
                problems.append(f"not a header line: {line[:80]!r}")
                continue
            value = value.strip(b" \t")
            if not VISIBLE.fullmatch(value):
                problems.append(f"header {name.decode()} has bytes outside visible ASCII: {value[:80]!r}")
            headers.append((name.decode("ascii"), value.decode("latin-1")))
        body = self._body(sock, conn, buffer, headers, problems)
        exchange = Exchange(
            raw=head + b"\r\n\r\n" + body, method=match.group(1).decode(), target=match.group(2).decode("latin-1"),
            headers=headers, body=body, problems=problems,
        )
        close = any("close" in v.lower() for n, v in headers if n.lower() == "connection")
        return exchange, close

    def _body(
        self, sock: socket.socket, conn: Connection, buffer: bytearray, headers: list[tuple[str, str]],
        problems: list[str],
    ) -> bytes:
        lengths = [v for n, v in headers if n.lower() == "content-length"]
        codings = [v for n, v in headers if n.lower() == "transfer-encoding"]
        if lengths and codings:
            raise Malformed("both Content-Length and Transfer-Encoding (a smuggling attempt to a real server)")
        if codings:
            if [c.strip().lower() for c in codings] != ["chunked"]:
                raise Malformed(f"a transfer coding this target cannot frame: {codings!r}")
            problems.append("a chunked request body (the scheduler sends a Content-Length)")
            return self._chunked(sock, conn, buffer)
        if not lengths:
            return b""
        if len(set(lengths)) > 1 or not lengths[0].isdigit() or not lengths[0].isascii():
            raise Malformed(f"a Content-Length that frames nothing: {lengths!r}")
        if len(lengths) > 1:
            problems.append("Content-Length given more than once")
        return self._read_exactly(sock, conn, buffer, int(lengths[0]))

    def _chunked(self, sock: socket.socket, conn: Connection, buffer: bytearray) -> bytes:
        body = bytearray()
        for _ in range(10_000):
            while b"\r\n" not in buffer:
                data = self._recv(sock, conn, PARTIAL_WAIT)
                if not data:
                    raise Malformed("a chunked body was cut short")
                buffer += data
            size_line, _, rest = bytes(buffer).partition(b"\r\n")
            buffer[:] = rest
            try:
                size = int(size_line.split(b";")[0], 16)
            except ValueError as exc:
                raise Malformed(f"a bad chunk size: {size_line[:40]!r}") from exc
            chunk = self._read_exactly(sock, conn, buffer, size + 2)
            if size == 0:
                return bytes(body)
            body += chunk[:-2]
        raise Malformed("too many chunks")

    @staticmethod
    def _answer(exchange: Exchange, close: bool) -> bytes:
        path = exchange.target.split("?", 1)[0]
        if path.startswith(("/e5", "/e4")):
            status = b"500 Internal Server Error" if path.startswith("/e5") else b"404 Not Found"
            # Credentials first, as a target that reflects them would: an excerpt cut short still has them.
            credentials = [f"{n}: {v}".encode("latin-1") for n, v in exchange.headers if CREDENTIAL.search(n)]
            payload = b"\r\n".join([ECHO_MARKER, b"X-Forged-Log-Line: yes", *credentials, exchange.raw[:4000]])
        else:
            status, payload = b"200 OK", b'{"ok": true}'
        head = [b"HTTP/1.1 " + status, b"Content-Type: text/plain", b"Content-Length: " + str(len(payload)).encode()]
        if close:
            head.append(b"Connection: close")
        return b"\r\n".join(head) + b"\r\n\r\n" + payload
