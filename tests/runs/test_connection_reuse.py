"""A pooled connection is reused only after a complete, well-framed exchange: one
service's job can never leave bytes on a connection that another service's call uses."""
from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from jobs.models import Job
from runs import delivery
from runs.models import Run
from runs.services import run_execute
from tests.raw_target import RawRequest, RawTarget, answer
from tests.runs.calls import queued_run

pytestmark = pytest.mark.django_db(transaction=True)
S = Run.Status
B_PAYLOAD = {"invoice": 42}


@pytest.fixture(autouse=True)
def _fresh_connections() -> Iterator[None]:
    delivery.close_connections()
    yield
    delivery.close_connections()


def serve(for_a: Callable[[socket.socket], bool]) -> RawTarget:
    """/a answers as the test says; /b answers 201 with a short body and keeps the connection."""

    def handler(conn: socket.socket, request: RawRequest) -> bool:
        if request.path == "/a":
            return for_a(conn)
        conn.sendall(answer(201, b"made"))
        return True

    return RawTarget(handler).start()


def assert_b_arrived_byte_for_byte(target: RawTarget, b_run: Run) -> RawRequest:
    """B's call is exactly one well-formed request on the wire: its request line, its
    own headers, its body, nothing of A's before or after it."""
    assert all(r.well_formed for r in target.requests()), [r.raw[:80] for r in target.requests()]
    [b] = target.requests("/b")
    assert b.raw.startswith(b"POST /b HTTP/1.1\r\n")
    body = json.dumps(B_PAYLOAD, separators=(",", ":")).encode()
    assert b.body == body and b.headers["Content-Length"] == str(len(body))
    assert b.raw == b.raw.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n" + body
    assert b.headers["X-Run-Id"] == b_run.public_id
    b_run.refresh_from_db()
    assert b_run.status == S.SUCCEEDED and b_run.attempt == 1
    return b


def test_a_jobs_framing_header_cannot_leave_its_body_on_a_connection_another_service_uses(
    service: Any, other_service: Any
) -> None:
    target = serve(lambda conn: conn.sendall(answer(200, b"ok")) or True)
    try:
        a_run = queued_run(service.user, target.url("/a"), payload={"smuggled": "GET /admin HTTP/1.1"})
        # Written past the API (which refuses framing headers at creation): a row from before.
        Job.objects.filter(pk=a_run.job_id).update(headers={"Content-Length": "0"})
        b_run = queued_run(other_service.user, target.url("/b"), payload=B_PAYLOAD,
                           secret={"Authorization": "Bearer b-token"})
        run_execute(run_id=a_run.pk)
        assert run_execute(run_id=b_run.pk) == "succeeded"
    finally:
        target.stop()
    b = assert_b_arrived_byte_for_byte(target, b_run)
    assert b.headers["Authorization"] == "Bearer b-token"
    a_run.refresh_from_db()
    assert a_run.status == S.DEAD and "Content-Length" in a_run.last_error  # refused, never sent
    assert target.requests("/a") == []


@pytest.mark.parametrize(
    "a_answer",
    [
        answer(200, b"z" * (200 * 1024)),  # longer than the worker reads
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    ],
    ids=["over-the-read-cap", "length-and-chunked", "unknown-coding", "two-lengths"],
)
def test_an_answer_cut_short_or_in_framing_doubt_closes_its_connection(
    service: Any, other_service: Any, a_answer: bytes
) -> None:
    target = serve(lambda conn: conn.sendall(a_answer) or True)
    try:
        a_run = queued_run(service.user, target.url("/a"))
        b_run = queued_run(other_service.user, target.url("/b"), payload=B_PAYLOAD)
        run_execute(run_id=a_run.pk)
        assert run_execute(run_id=b_run.pk) == "succeeded"
    finally:
        target.stop()
    b = assert_b_arrived_byte_for_byte(target, b_run)
    [a] = target.requests("/a")
    assert b.connection != a.connection  # B never shares the connection A's answer left in doubt
