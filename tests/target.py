"""A real HTTP target on loopback for tests: records every call, answers from a script.

    target = LoopbackTarget().start()
    target.script("/flaky", [500, 500, 200])     # answers in order, then the last one forever
    target.delay("/slow", 3.0)                    # sleeps before answering
    ... target.url("/flaky") ... target.calls("/flaky") ...
    target.stop()
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Call:
    path: str
    method: str
    headers: dict[str, str]
    body: bytes
    at: float
    client_port: int = 0  # the caller's end of the connection: one port, one connection


class LoopbackTarget:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[Call] = []
        self._scripts: dict[str, list[int]] = {}
        self._delays: dict[str, float] = {}
        self._extra_headers: dict[str, dict[str, str]] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "LoopbackTarget":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def script(self, path: str, statuses: list[int], headers: dict[str, str] | None = None) -> None:
        with self._lock:
            self._scripts[path] = list(statuses)
            if headers:
                self._extra_headers[path] = headers

    def delay(self, path: str, seconds: float) -> None:
        with self._lock:
            self._delays[path] = seconds

    def calls(self, path: str | None = None) -> list[Call]:
        with self._lock:
            return [c for c in self._calls if path is None or c.path == path]

    def _answer(self, path: str) -> tuple[int, float, dict[str, str]]:
        with self._lock:
            statuses = self._scripts.get(path, [200])
            status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
            return status, self._delays.get(path, 0.0), self._extra_headers.get(path, {})

    def _record(self, call: Call) -> None:
        with self._lock:
            self._calls.append(call)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        target = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # The head and the body are two writes: with Nagle on, the body waits for the
            # caller's delayed ACK, 40 ms a call on a kept-alive connection.
            disable_nagle_algorithm = True

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = self.path.split("?", 1)[0]
                target._record(Call(path, self.command, dict(self.headers.items()), body, time.time(),
                                    int(self.client_address[1])))
                status, delay, extra = target._answer(path)
                if delay:
                    time.sleep(delay)
                payload = b'{"ok": true}' if status < 400 else b'{"error": "scripted"}'
                self.send_response(status)
                for name, value in extra.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

            def log_message(self, *args: Any) -> None:
                pass

        return Handler
