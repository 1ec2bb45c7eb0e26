"""What a target's failures and answers leave behind: connection errors in a fixed
vocabulary (nothing of the library's text, no address to learn a network from), and
answer text with every secret of the job redacted, on one line."""
from __future__ import annotations

import json
import logging
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import timezone

from runs import delivery, signing
from runs.models import Run
from runs.services import run_execute
from tests.raw_target import RawRequest, RawTarget, answer
from tests.runs.calls import events_of, queued_run

pytestmark = pytest.mark.django_db(transaction=True)
S = Run.Status
VOCABULARY = {"connection refused", "timed out after 1s", "connection reset", "DNS failure", "TLS error",
              "protocol error"}


@pytest.fixture(autouse=True)
def _fresh_connections() -> Iterator[None]:
    delivery.close_connections()
    yield
    delivery.close_connections()


def reset(conn: socket.socket, request: RawRequest) -> bool:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a RST
    return False


def garbage(conn: socket.socket, request: RawRequest) -> bool:
    conn.sendall(b"SSH-2.0-OpenSSH_9.2 at 10.1.2.3:22\r\n\r\n")
    return False


def not_tls() -> tuple[socket.socket, threading.Thread]:
    """A listener that answers a TLS handshake with plain text."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)

    def serve() -> None:
        try:
            conn, _ = listener.accept()
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 400 plain http at 10.1.2.3\r\n\r\n")
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def assert_tells_nothing(error: str, port: int) -> None:
    assert error in VOCABULARY, error
    for leak in ("127.0.0.1", "10.1.2.3", str(port), "Errno", "Connection(", "urllib3", "SSH"):
        assert leak not in error


@pytest.mark.parametrize("kind", ["refused", "reset", "protocol", "tls"])
def test_a_connection_failure_is_reported_in_a_fixed_vocabulary(service: Any, kind: str) -> None:
    expected = {"refused": "connection refused", "reset": "connection reset", "protocol": "protocol error",
                "tls": "TLS error"}[kind]
    stop: Any = None
    if kind == "refused":
        probe = socket.create_server(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()  # nothing listens there now
        url = f"http://127.0.0.1:{port}/x"
    elif kind == "tls":
        listener, _ = not_tls()
        port = listener.getsockname()[1]
        url, stop = f"https://127.0.0.1:{port}/x", listener.close
    else:
        target = RawTarget(reset if kind == "reset" else garbage).start()
        port, url, stop = target.port, target.url("/x"), target.stop
    try:
        run = queued_run(service.user, url, timeout_seconds=1)
        assert run_execute(run_id=run.pk) == "retry_scheduled"
    finally:
        if stop:
            stop()
    run.refresh_from_db()
    assert run.last_error == expected
    assert_tells_nothing(run.last_error, port)
    answered = [d for t, d in events_of(run) if t == "target_answered"][0]
    assert answered["error"] == expected


def test_secrets_a_target_echoes_back_are_redacted_from_the_stored_error_and_the_log_line(
    service: Any, caplog: pytest.LogCaptureFixture
) -> None:
    signing_secret = signing.live_secrets(service.user.service, timezone.now())[0]
    authorization, api_key = "Bearer tok-7f3a9c1e55", "key-0d4e8b2a77"

    def echo(conn: socket.socket, request: RawRequest) -> bool:
        text = (f"bad auth {request.headers['Authorization']!s} key={request.headers['X-Api-Key']} "
                f"(secret {signing_secret})\n2026-12-01 ERROR scheduler.runs forged line\r\n")
        conn.sendall(answer(400, text.encode()))
        return True

    target = RawTarget(echo).start()
    try:
        run = queued_run(service.user, target.url("/echo"), secret={"Authorization": authorization,
                                                                     "X-Api-Key": api_key},
                         secret_header_names=["X-Api-Key"])
        with caplog.at_level(logging.DEBUG):
            assert run_execute(run_id=run.pk) == "dead"
    finally:
        target.stop()
    [request] = target.requests("/echo")
    assert request.headers["Authorization"] == authorization  # the target did get them
    run.refresh_from_db()
    stored = [run.last_error, json.dumps([d for _, d in events_of(run)])]
    logged = [record.getMessage() for record in caplog.records]
    for secret in (authorization, "tok-7f3a9c1e55", api_key, signing_secret):
        for text in stored + logged:
            assert secret not in text
    assert "bad auth" in run.last_error and "forged line" in run.last_error  # the rest of the answer is kept
    dead_lines = [line for line in logged if "is dead" in line]
    assert dead_lines and all("\n" not in line and "\r" not in line for line in dead_lines)
    assert "\n" not in run.last_error


@pytest.mark.parametrize(
    "echo",
    [
        '{"auth":"Bearer s3cr3t\\/Tok+en=="}',  # JSON with escaped slashes
        "auth=Bearer%20s3cr3t%2FTok%2Ben%3D%3D",  # percent-encoded
        "Bearer%2520s3cr3t%252FTok%252Ben%253D%253D",  # percent-encoded twice
        "<p>Bearer s3cr3t&#x2F;Tok&#43;en==</p>",  # HTML entities
        "BEARER S3CR3T/TOK+EN==",  # another case
        "auth=Bearer+s3cr3t%2FTok%2Ben%3D%3D",  # a form's encoding
    ],
)
def test_an_echoed_secret_in_another_spelling_is_redacted(echo: str) -> None:
    """Redaction caught the exact and JSON-escaped forms only: these reached last_error,
    events, the worker's log line and the admin."""
    from runs.delivery import redact

    shown = redact(echo, ("Bearer s3cr3t/Tok+en==",))
    assert "[redacted]" in shown and "s3cr3t" not in shown.lower(), shown


def test_text_with_no_secret_in_any_spelling_is_kept_as_sent() -> None:
    from runs.delivery import redact

    assert redact("a%20b &amp; c", ("Bearer s3cr3t/Tok+en==",)) == "a%20b &amp; c"
