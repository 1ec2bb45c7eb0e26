"""An idempotent HTTP target on loopback that counts what it applied, per Idempotency-Key.

It follows the receiver's rule (receiver.views.delivery_admit), in memory: a call
whose X-Fence-Token is lower than the highest its key has seen is refused (409); a
key already applied is answered again without applying (a replay, with
`Idempotent-Replay: true`); otherwise the effect is applied, once, and recorded as
a runs.invariants.Applied. Every call is recorded, whatever became of it, so a test
can also see how often each key was sent.

    target = CountingTarget().start()   # CountingTarget(port): on a given port
    target.delay(2.0)                   # each call takes this long (before it applies)
    ... target.url("/hook") ... target.applied() ... target.calls_per_key() ...
    target.stop()
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from runs.invariants import Applied


@dataclass(frozen=True)
class Arrival:
    key: str
    fence: int
    run_id: str
    outcome: str  # applied, replayed, refused
    at: float


class CountingTarget:
    def __init__(self, port: int = 0) -> None:
        self._lock = threading.Lock()
        self._highest: dict[str, int] = {}
        self._applied: list[Applied] = []
        self._applied_keys: set[str] = set()  # the same keys, for the admission (hundreds of calls a second)
        self._arrivals: list[Arrival] = []
        self._received: list[tuple[str, int, float]] = []  # (key, fence, at) as each call comes in
        self._delay = 0.0
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "CountingTarget":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def delay(self, seconds: float) -> None:
        with self._lock:
            self._delay = seconds

    def applied(self) -> list[Applied]:
        with self._lock:
            return list(self._applied)

    def arrivals(self) -> list[Arrival]:
        with self._lock:
            return list(self._arrivals)

    def received(self) -> list[tuple[str, int, float]]:
        """Every call as it came in, before its delay: the calls in flight too."""
        with self._lock:
            return list(self._received)

    def calls_per_key(self) -> Counter[str]:
        return Counter(a.key for a in self.arrivals())

    def _admit(self, key: str, fence: int, run_id: str) -> str:
        """The receiver's rule, under the lock: one call per key decides at a time."""
        with self._lock:
            applied = key in self._applied_keys
            if fence < self._highest.get(key, 0):
                outcome = "refused"
            else:
                self._highest[key] = fence
                outcome = "replayed" if applied else "applied"
                if outcome == "applied":
                    self._applied.append(Applied(key, fence))
                    self._applied_keys.add(key)
            self._arrivals.append(Arrival(key, fence, run_id, outcome, time.time()))
            return outcome

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        target = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                key = self.headers.get("Idempotency-Key", "")
                fence = self.headers.get("X-Fence-Token", "")
                if not key or not fence.isdigit():
                    self._answer(400, b'{"detail": "Idempotency-Key and X-Fence-Token are required"}')
                    return
                with target._lock:
                    delay = target._delay
                    target._received.append((key, int(fence), time.time()))
                if delay:
                    time.sleep(delay)  # the call in flight, before the effect
                outcome = target._admit(key, int(fence), self.headers.get("X-Run-Id", ""))
                if outcome == "refused":
                    self._answer(409, b'{"detail": "stale fence"}')
                else:
                    self._answer(200, b'{"ok": true}', replay=outcome == "replayed")

            do_GET = do_PUT = do_PATCH = do_DELETE = do_POST

            def _answer(self, status: int, payload: bytes, replay: bool = False) -> None:
                self.send_response(status)
                if replay:
                    self.send_header("Idempotent-Replay", "true")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler
