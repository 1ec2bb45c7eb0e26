"""The HTTP call to a target, and the headers every call carries (docs/reference.md,
what a target receives)."""
from __future__ import annotations

import email.utils
import html
import http.client
import json
import logging
import os
import re
import socket
import ssl
import threading
import time
import unicodedata
import urllib.parse
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timezone as dt_timezone
from typing import Callable, Generic, TypeVar, cast

from django.conf import settings
from urllib3.exceptions import HTTPError as Urllib3Error, NameResolutionError, SSLError as Urllib3SSLError
from urllib3.exceptions import NewConnectionError, TimeoutError as Urllib3TimeoutError
from urllib3.util import parse_url

from jobs.models import Job
from jobs.public_ids import format_id
from jobs.secrets import decrypt_headers
from runs.claims import Claim
from runs.connections import Deadline, Deadlines, IdleConnections, Origin, connect
from runs.models import Run

logger = logging.getLogger("scheduler.delivery")
RETRYABLE_STATUSES = frozenset({408, 429})
USER_AGENT = "django-job-scheduler/1.0"
READ_CAP = 64 * 1024  # bytes of an answer read at most; a longer answer's connection is closed
EXCERPT_CHARS = 200  # of a failed answer, kept as the reason
# What a failed connection is reported as: these words and nothing else (no library
# text, no address or port a service could map a private network with).
REFUSED, TIMED_OUT, RESET, DNS_FAILURE, TLS_ERROR, PROTOCOL_ERROR = (
    "connection refused", "timed out", "connection reset", "DNS failure", "TLS error", "protocol error"
)
CONNECTION_FAILED, REQUEST_FAILED = "connection failed", "request failed"
# Headers that frame the request or belong to one hop: the scheduler sets them (or
# none), never a job. A job carrying one (a row from before the API refused them)
# is not sent: it could leave bytes on a connection another service's call reuses.
FRAMING_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer", "upgrade"}
)
_TOKEN_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE_RE = re.compile(r"[\x20-\x7e\t]*")

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


# The worker process's idle keep-alive connections, by origin (runs.connections), and
# the one thread that cuts a call off at its deadline.
_idle = _PerProcess(lambda: IdleConnections(per_origin=max(8, settings.SCHEDULER_WORKER_CALLS)))
_deadlines = _PerProcess(Deadlines)
IDLE_THREAD_SECONDS = 30.0  # a call thread with nothing to do for this long ends


class CallPool:
    """Threads for calls in flight, at most `limit`, made as calls need them. The thread
    that went idle last takes the next call, so a steady stream keeps only as many
    threads as it has calls in flight, and a thread left idle for `idle_seconds` ends:
    the threads a burst made (a slow host, a backlog) go once it is over, and with them
    their stacks and their share of the allocator, where a ThreadPoolExecutor keeps every
    thread it ever made (docs/performance.md, "Memory"). Calls over
    the limit wait in order for a thread."""

    def __init__(self, limit: int, *, idle_seconds: float = IDLE_THREAD_SECONDS, name: str = "call",
                 at_end: Callable[[], None] | None = None) -> None:
        self.limit = max(1, limit)
        self.idle_seconds = idle_seconds
        self._name = name
        self._at_end = at_end  # called by each thread as it ends (its own clean-up)
        self._lock = threading.Lock()
        self._idle: list[_Hand] = []  # idle threads' hands, the last to go idle on top
        self._waiting: deque[_Work] = deque()  # calls waiting for a thread (all busy)
        self._threads = 0
        self._made = 0

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        # Never None with wait=True: a call that finds no thread waits for one.
        return cast("Future[T]", self._start(fn, args, wait=True))

    def offer(self, fn: Callable[..., T], *args: object) -> Future[T] | None:
        """As submit, but only to a thread free now or made now: None when all
        `limit` are busy (the caller does the work itself)."""
        return self._start(fn, args, wait=False)

    def _start(self, fn: Callable[..., T], args: tuple[object, ...], *, wait: bool) -> Future[T] | None:
        work: _Work = (Future(), fn, args)
        with self._lock:
            if not wait and not self._idle and self._threads >= self.limit:
                return None
            if self._idle:
                hand = self._idle.pop()
                hand.work = work
                hand.ready.set()
            elif self._threads < self.limit:
                self._threads += 1
                self._made += 1
                thread = threading.Thread(target=self._serve, args=(work,), name=f"{self._name}-{self._made}", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # no thread to be had: the call waits for a busy one, if any
                    self._threads -= 1
                    if not wait:
                        return None
                    if not self._threads:
                        raise
                    self._waiting.append(work)
            else:
                self._waiting.append(work)
        return work[0]

    def backlog(self) -> int:
        """Calls waiting for a thread (every one busy)."""
        with self._lock:
            return len(self._waiting)

    def threads(self) -> int:
        """Threads alive in the pool, busy or idle (tests, metrics)."""
        with self._lock:
            return self._threads

    def _serve(self, work: _Work | None) -> None:
        hand = _Hand()
        while work is not None:
            future, fn, args = work
            result: object = None
            failed: BaseException | None = None
            ran = future.set_running_or_notify_cancel()
            if ran:
                try:
                    result = fn(*args)
                except BaseException as exc:  # the caller's future carries it, as an executor's does
                    failed = exc
            # Back among the idle before the caller hears: its next call finds this thread.
            work = self._waiting_or_idle(hand)
            if ran and failed is None:
                future.set_result(result)
            elif ran:
                future.set_exception(failed)
            del future, fn, args, result, failed  # nothing of a finished call is held while idle
            if work is None:
                work = self._wait(hand)
        if self._at_end is not None:
            self._at_end()

    def _waiting_or_idle(self, hand: _Hand) -> _Work | None:
        with self._lock:
            if self._waiting:
                return self._waiting.popleft()
            hand.work = None
            hand.ready.clear()
            self._idle.append(hand)
            return None

    def _wait(self, hand: _Hand) -> _Work | None:
        hand.ready.wait(self.idle_seconds)
        with self._lock:
            work, hand.work = hand.work, None
            if work is None:  # no call came: this thread ends
                self._idle.remove(hand)
                self._threads -= 1
            return work


_Work = tuple[Future, Callable[..., object], tuple[object, ...]]


class _Hand:
    """Where an idle thread is handed its next call."""

    __slots__ = ("ready", "work")

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.work: _Work | None = None


# The worker process's threads for calls in flight (SCHEDULER_WORKER_CALLS at most): a
# batch's calls go out side by side.
_calls = _PerProcess(lambda: CallPool(settings.SCHEDULER_WORKER_CALLS))


def call_pool() -> CallPool:
    return _calls.get()


def close_connections() -> None:
    """Drop the process's pooled connections (tests: a live server's threads)."""
    pool = _idle.made()
    if pool is not None:
        pool.clear()


def idle_connections() -> int:
    """How many connections this process keeps open for reuse (tests, metrics)."""
    pool = _idle.made()
    return pool.count() if pool is not None else 0


@dataclass(frozen=True)
class Request:
    method: str
    url: str
    headers: dict[str, str] = field(repr=False)
    body: bytes = field(repr=False)
    addresses: tuple[str, ...] = ()  # what the call-time check approved; none: resolved (and checked) here
    secrets: tuple[str, ...] = field(default=(), repr=False)  # redacted from any text the target sends back


class PreparationError(ValueError):
    """A run's call cannot be made as it stands (its reason is safe to store and show)."""


@dataclass(frozen=True)
class CallResult:
    status: int | None = None  # the HTTP status, or None when no answer came
    error: str = ""  # when no answer came: one of the fixed words above (e.g. "timed out after 30s")
    duration_ms: int = 0
    retry_after_seconds: float | None = None
    excerpt: str = field(default="", repr=False)
    # A task target's publish that the broker accepted: the `published` event's detail
    # (runs.publishing). A URL target's call never sets it.
    published: dict[str, str] | None = None

    @property
    def ok(self) -> bool:
        if self.published is not None:
            return True
        return self.status is not None and 200 <= self.status < 300

    @property
    def retryable(self) -> bool:
        # 408, 429, 5xx, a timeout and a refused connection are tried again;
        # any other answer is final. A task the broker accepted is a success, not
        # trouble (it has no HTTP status): else the breaker opens after 5 publishes.
        if self.published is not None:
            return False
        if self.status is None:
            return True
        return self.status in RETRYABLE_STATUSES or self.status >= 500

    def describe(self) -> str:
        if self.status is None:
            return self.error
        text = f"HTTP {self.status}"
        return f"{text}: {self.excerpt}" if self.excerpt else text


def iso_z(value: datetime) -> str:
    """`2026-10-28T20:30:00Z`: the instant in UTC, to the second (the fraction dropped).
    isoformat, not strftime: a few times a run on the worker's path, at 70% of the cost."""
    if value.tzinfo is not dt_timezone.utc:
        value = value.astimezone(dt_timezone.utc)
    return value.isoformat(timespec="seconds")[:19] + "Z"


@dataclass(frozen=True)
class RunIdentity:
    """What every call of a run carries (docs/reference.md, what a target receives): a URL
    target gets it as HTTP headers (build_request), a task target as message headers
    (runs.publishing). Worked out here only, so both carry the same values."""

    idempotency_key: str
    fence_token: int
    run_id: str
    attempt: int
    scheduled_for: str

    def http_headers(self) -> dict[str, str]:
        return {
            "Idempotency-Key": self.idempotency_key,
            "X-Fence-Token": str(self.fence_token),
            "X-Run-Id": self.run_id,
            "X-Attempt": str(self.attempt),
            "X-Scheduled-For": self.scheduled_for,
        }

    def message_headers(self) -> dict[str, str | int]:
        return {
            "idempotency_key": self.idempotency_key,
            "fence_token": self.fence_token,
            "run_id": self.run_id,
            "attempt": self.attempt,
            "scheduled_for": self.scheduled_for,
        }


def run_identity(run: Run, claim: Claim) -> RunIdentity:
    return RunIdentity(
        idempotency_key=run.idempotency_key,
        fence_token=claim.fence,
        run_id=format_id("run", run.pk),
        attempt=claim.attempt,
        scheduled_for=iso_z(run.scheduled_for),
    )


def build_request(
    *, run: Run, job: Job, claim: Claim, signer: "Signer | None" = None, addresses: tuple[str, ...] = ()
) -> Request:
    """The call a run makes. A PreparationError when it cannot be made as the job stands."""
    body = b"" if job.payload is None else json.dumps(job.payload, separators=(",", ":")).encode()
    secret = _secret_headers(job)
    own = {**(job.headers or {}), **secret}
    for name, value in own.items():
        _check_header(name, value)
    headers: dict[str, str] = {"User-Agent": USER_AGENT}
    headers.update(own)
    # Ours last, so a job cannot forge them.
    headers.update(run_identity(run, claim).http_headers())
    if body:
        headers.setdefault("Content-Type", "application/json")
    if signer is not None:
        headers["X-Signature"] = signer(body)
    secrets = (*secret.values(), *(signer.secret_values if signer is not None else ()))
    return Request(method=job.method, url=job.target, headers=headers, body=body, addresses=addresses,
                   secrets=tuple(value for value in secrets if value))


def _secret_headers(job: Job) -> dict[str, str]:
    try:
        return decrypt_headers(job.secret_headers)
    except Exception as exc:  # InvalidToken, bad base64, bad JSON: the key changed or the row did
        raise PreparationError(
            "the job's secret headers could not be decrypted (SECRET_KEY or SCHEDULER_ENCRYPTION_KEY "
            "changed?); set them again"
        ) from exc


def _check_header(name: str, value: object) -> None:
    """A header that http.client would refuse, or that would frame the request for us."""
    if not isinstance(name, str) or not _TOKEN_RE.fullmatch(name):
        raise PreparationError("a header name is not an RFC 9110 token; the job's headers must be set again")
    if name.lower() in FRAMING_HEADERS or name.lower().startswith("proxy-"):
        raise PreparationError(f"header {name} is set by the scheduler, never by a job: remove it from the job")
    if not isinstance(value, str) or not _VALUE_RE.fullmatch(value):
        raise PreparationError(
            f"header {name} has a value that cannot be sent (visible ASCII, space and tab only): set it again"
        )


class Signer:  # a callable body -> X-Signature value (runs.signing provides one)
    secret_values: tuple[str, ...] = ()  # what it signs with: redacted from a target's answer

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
    """One call, over in `timeout_seconds` whatever the target does; never raises."""
    started = time.monotonic()
    deadline = _deadlines.get().start(timeout_seconds)
    try:
        answer = _exchange(request, deadline)
    except Exception as exc:
        deadline.finish()
        result = CallResult(error=_failure(exc, deadline, timeout_seconds), duration_ms=_ms(started))
    else:
        excerpt = "" if 200 <= answer.status < 300 else _excerpt(answer.body, request.secrets, cut=answer.cut)
        result = CallResult(
            status=answer.status,
            duration_ms=_ms(started),
            retry_after_seconds=parse_retry_after(answer.retry_after),
            excerpt=excerpt,
        )
    # No path, header or answer text here: the status or the fixed words only.
    logger.debug("%s %s: %s in %d ms", request.method, parse_url(request.url).netloc,
                 result.status or result.error, result.duration_ms)
    return result


@dataclass(frozen=True)
class _Answer:
    status: int
    retry_after: str | None
    body: bytes  # at most READ_CAP bytes of it
    cut: bool  # the answer went on past what was read


def _exchange(request: Request, deadline: Deadline) -> _Answer:
    """Send, and read a bounded answer, on a pooled connection to the checked address.
    The connection goes back to the pool only after a complete, well-framed exchange."""
    origin, path = _origin(request)
    pool = _idle.get()
    conn = pool.take(origin) or connect(origin)
    reusable = False
    try:
        deadline.watch(conn)
        conn.timeout = deadline.remaining()
        conn.request(request.method, path, body=request.body or None, headers=_wire_headers(request, origin),
                     preload_content=False, decode_content=False)
        deadline.watch(conn)  # now connected: its socket can be cut off
        sock = conn.sock
        assert sock is not None
        sock.settimeout(deadline.remaining())
        response = http.client.HTTPConnection.getresponse(conn)  # http.client's, for read1()
        body = _read_bounded(response, sock, deadline)
        complete = response.isclosed() or (not response.chunked and response.length == 0)
        response.close()
        if not deadline.finish():
            raise TimeoutError("deadline")  # cut off: whatever was read is not the answer
        reusable = complete and not response.will_close and _well_framed(response)
        return _Answer(response.status, response.getheader("Retry-After"), body, cut=not complete)
    finally:
        if deadline.finish() and reusable:
            pool.give(origin, conn)
        else:
            conn.close()


def _read_bounded(response: http.client.HTTPResponse, sock: socket.socket, deadline: Deadline) -> bytes:
    """At most READ_CAP bytes of the body, each read limited to the time left."""
    chunks: list[bytes] = []
    got = 0
    while got < READ_CAP:
        sock.settimeout(deadline.remaining())
        piece = response.read1(READ_CAP - got)
        if not piece:
            break
        chunks.append(piece)
        got += len(piece)
    return b"".join(chunks)


def _well_framed(response: http.client.HTTPResponse) -> bool:
    """No doubt where the answer ended: one length, or plain chunked, never both."""
    lengths = response.msg.get_all("Content-Length") or []
    coding = response.msg.get_all("Transfer-Encoding") or []
    if len(lengths) > 1 or len(coding) > 1 or response.status < 200:
        return False
    return not coding or (not lengths and coding[0].strip().lower() == "chunked")


def _origin(request: Request) -> tuple[Origin, str]:
    """Where the call connects (the checked address) and the path it asks for."""
    url = parse_url(request.url)
    scheme = (url.scheme or "http").lower()
    hostname = (url.host or "").strip("[]")
    port = url.port or (443 if scheme == "https" else 80)
    addresses = request.addresses or _checked_addresses(request.url)
    return Origin(scheme=scheme, addresses=addresses, port=port, hostname=hostname), url.request_uri


def _checked_addresses(url: str) -> tuple[str, ...]:
    """For a Request made without them: resolve once and check, as the worker does."""
    from jobs.validators import check_resolved_target

    return tuple(check_resolved_target(url))


def _wire_headers(request: Request, origin: Origin) -> dict[str, str]:
    """The request's headers, with the Host the URL names (the socket goes to its checked address)."""
    url = parse_url(request.url)
    host = url.host or origin.hostname
    if url.port is not None and url.port != (443 if origin.scheme == "https" else 80):
        host = f"{host}:{url.port}"
    return {"Host": host, **request.headers}


def _failure(exc: Exception, deadline: Deadline, timeout_seconds: float) -> str:
    """The fixed words for a call that got no answer."""
    causes = _causes(exc)
    if deadline.fired or time.monotonic() >= deadline.at or any(_is_timeout(c) for c in causes):
        return f"{TIMED_OUT} after {timeout_seconds:g}s"
    if any(isinstance(c, (socket.gaierror, NameResolutionError)) for c in causes):
        return DNS_FAILURE
    if any(isinstance(c, (ssl.SSLError, ssl.CertificateError, Urllib3SSLError)) for c in causes):
        return TLS_ERROR
    if any(isinstance(c, ConnectionRefusedError) for c in causes):
        return REFUSED
    if any(isinstance(c, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)) for c in causes):
        return RESET
    if any(isinstance(c, (http.client.HTTPException, Urllib3Error)) for c in causes):
        return PROTOCOL_ERROR
    if any(isinstance(c, OSError) for c in causes):
        return CONNECTION_FAILED
    # Not the target's doing: worth a log line (its type only: its text may hold a header).
    logger.warning("a call failed unexpectedly: %s", type(exc).__name__)
    return REQUEST_FAILED


def _is_timeout(exc: BaseException) -> bool:
    # urllib3's NewConnectionError is a subclass of its connect timeout: not one.
    return isinstance(exc, TimeoutError) or (
        isinstance(exc, Urllib3TimeoutError) and not isinstance(exc, NewConnectionError)
    )


def _causes(exc: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in found and len(found) < 10:
        found.append(current)
        current = current.__cause__ or current.__context__
    return found


def _excerpt(body: bytes, secrets: tuple[str, ...], *, cut: bool) -> str:
    """The start of a failed answer, safe to store and log: every secret of the job
    redacted, on one line."""
    text = body.decode("utf-8", errors="replace")
    if cut and secrets:
        # The read stopped somewhere: drop what could be the start of a secret cut in two.
        text = text[: max(0, len(text) - max(len(value) for value in secrets))]
    return one_line(redact(text, secrets))[:EXCERPT_CHARS]


def redact(text: str, secrets: tuple[str, ...]) -> str:
    """`text` with each secret value (and its words of 8 characters or more, and its
    JSON-escaped form) replaced by [redacted]. A target may echo a secret in another
    spelling (percent-encoded, HTML entities, JSON with `\\/`, another case): when the
    text decoded from those holds one, compared without case, the decoded text is kept,
    redacted, instead of the text as sent."""
    forms: set[str] = set()
    for value in secrets:
        forms.add(value)
        forms.add(json.dumps(value)[1:-1])
        forms.update(word for word in value.split() if len(word) >= 8)
    ordered = sorted((f for f in forms if f), key=len, reverse=True)
    for form in ordered:
        text = text.replace(form, "[redacted]")
    if not ordered:
        return text
    for decoded in _spellings(text):
        if any(form.lower() in decoded.lower() for form in ordered):
            for form in ordered:
                decoded = re.sub(re.escape(form), "[redacted]", decoded, flags=re.IGNORECASE)
            return decoded
    return text


def _spellings(text: str) -> list[str]:
    """`text` read back from the encodings an echo may use, one more layer each time
    (twice at most: a value encoded twice)."""
    found, current = [], text
    for _ in range(2):
        current = html.unescape(urllib.parse.unquote(current.replace("\\/", "/")))
        found.append(current)
        found.append(current.replace("+", " "))  # a form's encoding of spaces
    return found


def one_line(text: str) -> str:
    """Control characters and line breaks escaped: a target cannot start a log line."""
    return "".join(
        ch if unicodedata.category(ch) not in ("Cc", "Zl", "Zp") else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
