"""The HTTP call to a target, and the headers the CONTRACT promises it."""
from __future__ import annotations

import email.utils
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone as dt_timezone
from typing import Callable, Generic, TypeVar

import certifi
import urllib3
from django.conf import settings
from urllib3.exceptions import NewConnectionError

from jobs.models import Job
from jobs.public_ids import format_id
from jobs.secrets import decrypt_headers
from runs.claims import Claim
from runs.models import Run

RETRYABLE_STATUSES = frozenset({408, 429})
USER_AGENT = "django-job-scheduler/1.0"

T = TypeVar("T")


class _PerProcess(Generic[T]):
    """A value made once per process, on first use: a forked worker child makes its
    own instead of sharing its parent's sockets or threads."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._held: tuple[int, T] | None = None

    def get(self) -> T:
        with self._lock:
            if self._held is None or self._held[0] != os.getpid():
                self._held = (os.getpid(), self._make())
            return self._held[1]

    def made(self) -> T | None:
        """This process's value, if it has been made."""
        held = self._held
        return held[1] if held is not None and held[0] == os.getpid() else None


# One keep-alive connection pool per worker process (urllib3 is thread-safe).
# urllib3, the library under `requests`, without the layer on top: about a third
# of the CPU per call (docs/performance.md).
_http = _PerProcess(lambda: urllib3.PoolManager(
    num_pools=256, maxsize=max(8, settings.SCHEDULER_WORKER_CALLS), retries=False, ca_certs=certifi.where()
))
# The worker process's threads for calls in flight (SCHEDULER_WORKER_CALLS of them):
# a batch's calls go out side by side, each thread with its own keep-alive connections.
_calls = _PerProcess(lambda: ThreadPoolExecutor(max_workers=settings.SCHEDULER_WORKER_CALLS, thread_name_prefix="call"))


def http() -> urllib3.PoolManager:
    return _http.get()


def call_pool() -> ThreadPoolExecutor:
    return _calls.get()


def close_connections() -> None:
    """Drop the process's pooled connections (tests: a live server's threads)."""
    pool = _http.made()
    if pool is not None:
        pool.clear()


@dataclass(frozen=True)
class Request:
    method: str
    url: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class CallResult:
    status: int | None = None  # the HTTP status, or None when no answer came
    error: str = ""  # "timeout", "connection refused: ..." when no answer came
    duration_ms: int = 0
    retry_after_seconds: float | None = None
    excerpt: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def retryable(self) -> bool:
        # 408, 429, 5xx, a timeout and a refused connection are tried again;
        # any other answer is final.
        if self.status is None:
            return True
        return self.status in RETRYABLE_STATUSES or self.status >= 500

    def describe(self) -> str:
        if self.status is None:
            return self.error
        text = f"HTTP {self.status}"
        return f"{text}: {self.excerpt}" if self.excerpt else text


def iso_z(value: datetime) -> str:
    return value.astimezone(dt_timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_request(*, run: Run, job: Job, claim: Claim, signer: "Signer | None" = None) -> Request:
    body = b"" if job.payload is None else json.dumps(job.payload, separators=(",", ":")).encode()
    headers: dict[str, str] = {"User-Agent": USER_AGENT}
    headers.update(job.headers or {})
    headers.update(decrypt_headers(job.secret_headers))
    # Ours last, so a job cannot forge them.
    headers.update(
        {
            "Idempotency-Key": run.idempotency_key,
            "X-Fence-Token": str(claim.fence),
            "X-Run-Id": format_id("run", run.pk),
            "X-Attempt": str(claim.attempt),
            "X-Scheduled-For": iso_z(run.scheduled_for),
        }
    )
    if body:
        headers.setdefault("Content-Type", "application/json")
    if signer is not None:
        headers["X-Signature"] = signer(body)
    return Request(method=job.method, url=job.target, headers=headers, body=body)


class Signer:  # a callable body -> X-Signature value (runs.signing provides one)
    def __call__(self, body: bytes) -> str:  # pragma: no cover - protocol only
        raise NotImplementedError


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # not "¹": float() refuses what isdigit() allows
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt_timezone.utc)
    return max(0.0, (when - datetime.now(dt_timezone.utc)).total_seconds())


def call(request: Request, *, timeout_seconds: float) -> CallResult:
    started = time.monotonic()
    try:
        response = http().request(
            request.method,
            request.url,
            headers=request.headers,
            body=request.body or None,
            timeout=urllib3.Timeout(total=timeout_seconds),
            redirect=False,  # a redirect could lead anywhere: it is an answer, not a hop
            retries=False,
        )
    except NewConnectionError as exc:  # a subclass of the connect timeout: test it first
        return CallResult(error=f"connection error: {_short(exc)}", duration_ms=_ms(started))
    except urllib3.exceptions.TimeoutError:
        return CallResult(error=f"timeout after {timeout_seconds:g}s", duration_ms=_ms(started))
    except (urllib3.exceptions.ProtocolError, urllib3.exceptions.SSLError, OSError) as exc:
        return CallResult(error=f"connection error: {_short(exc)}", duration_ms=_ms(started))
    except urllib3.exceptions.HTTPError as exc:
        return CallResult(error=f"request failed: {_short(exc)}", duration_ms=_ms(started))
    ok = 200 <= response.status < 300
    excerpt = "" if ok else response.data[:800].decode("utf-8", errors="replace")[:200]
    return CallResult(
        status=response.status,
        duration_ms=_ms(started),
        retry_after_seconds=parse_retry_after(response.headers.get("Retry-After")),
        excerpt=excerpt,
    )


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


def _short(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 300 else text[:297] + "..."
