"""A call ends at its timeout whatever the target does, and reads a bounded answer."""
from __future__ import annotations

import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from runs import delivery
from runs.models import Run
from runs.services import run_execute
from tests.raw_target import RawRequest, RawTarget, wait_for
from tests.runs.calls import events_of, queued_run

pytestmark = pytest.mark.django_db(transaction=True)
S = Run.Status
HUNDRED_MB = 100 * 1024 * 1024


@pytest.fixture(autouse=True)
def _fresh_connections() -> Iterator[None]:
    delivery.close_connections()
    yield
    delivery.close_connections()


def trickle(first: bytes, then: bytes, stop: threading.Event) -> Any:
    """A handler that sends `first`, then `then` one byte every 0.5 s (at most 20 s)."""

    def handler(conn: socket.socket, request: RawRequest) -> bool:
        conn.sendall(first)
        for byte in then[:40]:
            if stop.wait(0.5):
                break
            conn.sendall(bytes([byte]))
        return False

    return handler


@pytest.mark.parametrize(
    "first, then",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"x" * 100),  # the body, a byte at a time
        (b"HTTP/1.1 200 OK\r\n", b"X-Slow: " + b"y" * 60 + b"\r\n"),  # the headers, a byte at a time
    ],
    ids=["body", "headers"],
)
def test_a_trickling_target_ends_at_the_call_timeout(service: Any, first: bytes, then: bytes) -> None:
    stop = threading.Event()
    target = RawTarget(trickle(first, then, stop)).start()
    try:
        run = queued_run(service.user, target.url("/trickle"), timeout_seconds=1)
        started = time.monotonic()
        outcome = run_execute(run_id=run.pk)
        took = time.monotonic() - started
    finally:
        stop.set()
        target.stop()
    assert outcome == "retry_scheduled"
    assert took < 2.5, f"the call took {took:.1f}s with a 1s timeout"
    run.refresh_from_db()
    assert run.last_error == "timed out after 1s"
    answered = [d for t, d in events_of(run) if t == "target_answered"][0]
    assert answered["error"] == "timed out after 1s" and 900 <= answered["duration_ms"] < 2000


class HugeAnswer:
    """Answers 200 with a 100 MB body, sent in 64 KiB pieces from one buffer, and counts
    what it managed to send before the client went away."""

    def __init__(self) -> None:
        self.sent = 0
        self.client_closed = threading.Event()
        self.finished = threading.Event()

    def __call__(self, conn: socket.socket, request: RawRequest) -> bool:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        piece = memoryview(b"z" * 65536)
        try:
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {HUNDRED_MB}\r\n\r\n".encode())
            while self.sent < HUNDRED_MB:
                conn.sendall(piece)
                self.sent += len(piece)
        except OSError:
            self.client_closed.set()
        finally:
            self.finished.set()
        return False


def test_a_100_mb_answer_is_read_only_up_to_the_cap_with_bounded_memory_and_its_connection_closed(
    service: Any,
) -> None:
    huge = HugeAnswer()
    target = RawTarget(huge).start()
    try:
        run = queued_run(service.user, target.url("/huge"), timeout_seconds=20)
        tracemalloc.start()
        try:
            started = time.monotonic()
            outcome = run_execute(run_id=run.pk)
            took = time.monotonic() - started
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert wait_for(huge.finished.is_set, 10)
    finally:
        target.stop()
    assert outcome == "succeeded"  # the status line said 200; the rest of the answer is not ours to read
    assert huge.sent < 16 * 1024 * 1024, f"the target got {huge.sent} bytes out"
    assert huge.client_closed.is_set()  # the worker closed the connection, it did not drain it
    assert peak < 8 * 1024 * 1024, f"peak traced memory {peak} bytes"
    assert took < 10
    assert delivery.idle_connections() == 0  # nothing cut short goes back to the pool


def test_a_complete_answer_leaves_its_connection_in_the_pool_for_the_next_call(service: Any) -> None:
    target = RawTarget(lambda conn, request: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") or True)
    target.start()
    try:
        first = queued_run(service.user, target.url("/a"))
        second = queued_run(service.user, target.url("/b"))
        assert run_execute(run_id=first.pk) == "succeeded"
        assert delivery.idle_connections() == 1
        assert run_execute(run_id=second.pk) == "succeeded"
    finally:
        target.stop()
    assert [r.connection for r in target.requests()] == [1, 1]  # keep-alive still works
