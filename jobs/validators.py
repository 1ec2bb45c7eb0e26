"""Checks shared by the API serializers, the admin forms and the worker.

Each raises ValueError with a sentence that says what is wrong; the callers
attach the field name.
"""
from __future__ import annotations

import fnmatch
import functools
import ipaddress
import re
import socket
import unicodedata
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone
from itertools import islice

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import validate_email
from urllib3.exceptions import LocationParseError
from urllib3.util import Url, parse_url

from jobs import schedule

# Never called, whatever the allowlist says: link-local (cloud metadata lives
# there) and the AWS IPv6 metadata address.
REFUSED_NETWORKS = (
    ipaddress.ip_network("169.254.0.0/16"),
    ipaddress.ip_network("fe80::/10"),
    ipaddress.ip_network("fd00:ec2::254/128"),
)
REFUSED_HOSTNAMES = frozenset(
    {"metadata.google.internal", "metadata", "instance-data", "instance-data.ec2.internal"}
)
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
MAX_TARGET_LENGTH = 2000
# IPv6 prefixes whose last 32 bits are an IPv4 address something on the path turns
# them into: IPv4-compatible (::a.b.c.d), IPv4-translated (::ffff:0:a.b.c.d) and
# NAT64's well-known prefix and local-use block (RFC 6052, RFC 8215; a /96 inside
# the local-use /48, as it is deployed).
_EMBEDS_IPV4_LAST_32 = (
    ipaddress.ip_network("::/96"),
    ipaddress.ip_network("::ffff:0:0:0/96"),
    ipaddress.ip_network("64:ff9b::/96"),
    ipaddress.ip_network("64:ff9b:1::/48"),
)


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _addresses_behind(ip: Address) -> list[Address]:
    """The address itself and every IPv4 address an IPv6 one carries inside it."""
    found: list[Address] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            found.append(ip.ipv4_mapped)
        if ip.sixtofour is not None:
            found.append(ip.sixtofour)
        if ip.teredo is not None:
            found.extend(ip.teredo)
        if any(ip in net for net in _EMBEDS_IPV4_LAST_32):
            found.append(ipaddress.IPv4Address(ip.packed[-4:]))
    return found


def is_refused_address(address: str) -> bool:
    """Whether an address (v4 or v6, a zone id allowed) reaches a refused network,
    directly or through an IPv4 address embedded in an IPv6 one."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    return any(a in net for a in _addresses_behind(ip) for net in REFUSED_NETWORKS if a.version == net.version)


@dataclass(frozen=True)
class ParsedTarget:
    """A target URL as urllib3 (the library that connects) reads it."""

    scheme: str
    host: str  # lower case; an IPv6 address in brackets
    port: int | None

    @property
    def netloc(self) -> str:
        """host[:port] as written: the bulkhead's, breaker's and pause's key."""
        return f"{self.host}:{self.port}" if self.port is not None else self.host

    @property
    def hostname(self) -> str:
        """The host without IPv6 brackets: what is resolved and checked."""
        return self.host[1:-1] if self.host.startswith("[") else self.host


# One rule for the whole URL: visible ASCII only. A space, a control or format
# character, a backslash or a non-ASCII letter is where parsers disagree (urlsplit
# reads `a\.b` as one host, urllib3 as host `a` and path `\.b`; IDNA turns `１２７．０．０．１`
# into 127.0.0.1), so such a URL is refused rather than read one way or the other.
_VISIBLE_ASCII = re.compile(r"[!-~]*")
_AUTHORITY = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)")
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
# A last label that is a number (decimal, octal or hex) makes the OS resolver
# (inet_aton) read the whole host as an IPv4 address: 2852039166, 0xa9fea9fe, 127.1.
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")


def _character_problem(url: str) -> str | None:
    if _VISIBLE_ASCII.fullmatch(url) and "\\" not in url:
        return None
    bad = next(c for c in url if not ("!" <= c <= "~") or c == "\\")
    where = url.index(bad)
    if bad == "\\":
        return f"must not contain a backslash (at position {where}); parsers disagree on where its host ends"
    if bad.isascii() or unicodedata.category(bad)[0] in "CZ":
        return f"must not contain spaces or control characters ({bad!r} at position {where})"
    return (
        f"must be ASCII ({bad!r} at position {where}): percent-encode the path and give a "
        "non-ASCII host in its xn-- (punycode) form"
    )


def _parse(url: str) -> Url:
    try:
        return parse_url(url)
    except LocationParseError as exc:
        raise ValueError(f"is not a URL the scheduler can call ({exc})") from exc


def parse_target(url: str) -> ParsedTarget:
    """Parse a target once, with urllib3's parser (the one that connects), and refuse
    anything it could read differently from a person or another parser: userinfo,
    percent-encoded or zone-id hosts, trailing dots, empty labels, numeric hosts not
    written as a dotted quad, a port not written as a plain number."""
    if len(url) > MAX_TARGET_LENGTH:
        raise ValueError(f"must be at most {MAX_TARGET_LENGTH} characters")
    problem = _character_problem(url)
    if problem:
        raise ValueError(problem)
    if "#" in url:
        # A fragment is never sent, and `#` before an `@` is where readers disagree on
        # the host (`http://127.0.0.1#@x.internal/`: 127.0.0.1 to urllib3 and browsers,
        # x.internal to a reader who takes `127.0.0.1#` for a user name).
        raise ValueError("must not have a #fragment (it is never sent to the target)")
    parsed = _parse(url)
    scheme = (parsed.scheme or "").lower()
    if scheme not in ("http", "https"):
        if not parsed.scheme:
            raise ValueError("must be a full URL starting with http:// or https://, like https://reports.internal/rebuild")
        raise ValueError(f"must start with http:// or https://, not {parsed.scheme}:")
    written = _AUTHORITY.match(url)
    if not parsed.host or written is None or not written.group(1):
        raise ValueError("must name a host")
    authority = written.group(1)
    _check_authority(authority)
    if url[written.end():written.end() + 1] == "?":
        # `http://127.0.0.1?@x.internal:8080/`: a `?` ends the host for urllib3 and
        # browsers, not for a reader who takes `127.0.0.1?` for a user name.
        raise ValueError(f"must have a / between its host and the ?query (write {url[:written.end()]}/?...)")
    target = ParsedTarget(scheme=scheme, host=parsed.host.lower(), port=parsed.port)
    if target.port == 0:
        raise ValueError("has port 0; a port is 1 to 65535")
    if authority.lower() != target.netloc:
        raise ValueError(
            f"has its host and port written as {authority!r}, which the connection reads as "
            f"{target.netloc!r}; write {target.netloc!r}"
        )
    if not target.host.startswith("["):
        _check_hostname(target.host)
    return target


def _check_authority(authority: str) -> None:
    if "@" in authority:
        raise ValueError("must not carry a user name or password before the host; send credentials in headers")
    if "%" in authority:
        if authority.startswith("["):
            raise ValueError("must not give an IPv6 zone id (the %... in the brackets)")
        raise ValueError("must not percent-encode the host; write it as plain letters and digits")


def _check_hostname(host: str) -> None:
    if host.endswith("."):
        raise ValueError(f"host {host!r} ends with a dot; write it without the trailing dot")
    labels = host.split(".")
    if "" in labels:
        raise ValueError(f"host {host!r} has an empty label (two dots together, or a leading dot)")
    if len(host) > 253:
        raise ValueError(f"host is {len(host)} characters; a host name is at most 253")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        _check_dotted_quad(host)
        return
    for label in labels:
        if not _LABEL.fullmatch(label):
            raise ValueError(
                f"host label {label!r} must be 1 to 63 letters, digits, hyphens or underscores, "
                "not starting or ending with a hyphen"
            )


def _check_dotted_quad(host: str) -> None:
    """A numeric host is an IPv4 address written as four decimal numbers, nothing else:
    the OS reads 2852039166, 0xa9fea9fe, 0251.0376.0251.0376 and 169.254.43518 all
    as 169.254.169.254."""
    try:
        canonical = str(ipaddress.IPv4Address(host))
    except ValueError:
        canonical = None
    if canonical != host:
        raise ValueError(
            f"host {host!r} is a number the connection would read as an IPv4 address; "
            "write an address as four decimal numbers without leading zeros, like 10.0.0.1"
        )


@functools.lru_cache(maxsize=4096)
def target_host(url: str) -> str:
    """The host as written in the URL, port included (the bulkhead's, breaker's and
    pause's key), from the same parse as the connection's. Cached: a pure function of
    the string, asked for several times a run on the worker's path (target_key)."""
    try:
        return (_parse(url).netloc or "").lower()
    except ValueError:
        # A stored target urllib3 cannot parse is never called (the worker checks it
        # again); it still needs a key, so it gets its authority as written.
        written = _AUTHORITY.match(url)
        return written.group(1).lower() if written else ""


def validate_target(url: str) -> ParsedTarget:
    """At creation: http(s), a host read one way only, allowed by the allowlist, not a
    refused address. Returns the parse, for callers that need the host."""
    target = parse_target(url)
    if target.hostname in REFUSED_HOSTNAMES or is_refused_address(target.hostname):
        raise ValueError(f"host {target.host} is a link-local or metadata address, which is never called")
    allow = settings.SCHEDULER_TARGET_ALLOWLIST
    if allow and not any(fnmatch.fnmatchcase(target.hostname, pattern.lower()) for pattern in allow):
        raise ValueError(f"host {target.host} is not in SCHEDULER_TARGET_ALLOWLIST")
    return target


def escape_controls(text: str) -> str:
    """`text` as an operator's terminal should get it (a command's table or error):
    control characters, a terminal's escape sequences among them, written as escapes."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)


# Control characters (C0, DEL and C1): never in a name shown on pages and terminals.
# The same set as a store's regular expression (NUL cannot be stored, so it starts at 1).
CONTROL_CHARACTERS_REGEX = r"[\x01-\x1f\x7f-\x9f]"


def first_control_character(value: str) -> str | None:
    """The first control character in `value` (C0, DEL or C1), or None."""
    return next((c for c in value if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F), None)


def notify_is_webhook(value: str) -> bool:
    """A `notify` that is a webhook (an https URL, its scheme in any case: URLs' schemes
    are case-insensitive), not an e-mail address."""
    return value[:8].lower() == "https://"


def validate_notify(value: str) -> str:
    """`notify`: an e-mail address (at most 254 characters, RFC 5321) or an https URL
    checked like a target (it is called like one); either allowed by
    SCHEDULER_NOTIFY_ALLOWLIST when it is set."""
    if "://" in value:
        if not notify_is_webhook(value):
            raise ValueError("must be an e-mail address or an https URL")
        validate_target(value)
    else:
        if len(value) > 254:
            raise ValueError(f"is {len(value)} characters; an e-mail address is at most 254")
        try:
            validate_email(value)
        except DjangoValidationError as exc:
            raise ValueError("must be an e-mail address or an https URL") from exc
    refusal = notify_refusal(value)
    if refusal:
        raise ValueError(refusal)
    return value


def notify_refusal(value: str) -> str | None:
    """Why a notice may not go to `value` under SCHEDULER_NOTIFY_ALLOWLIST (an e-mail
    address by its domain, a webhook by its host), or None. Empty list: anywhere."""
    allow = [pattern.lower() for pattern in settings.SCHEDULER_NOTIFY_ALLOWLIST]
    if not allow or not value:
        return None
    if notify_is_webhook(value):
        try:
            where = parse_target(value).hostname
        except ValueError:
            return "is not a URL the scheduler can read"
        what = f"host {where}"
    else:
        where = value.rsplit("@", 1)[-1].lower()
        what = f"e-mail domain {where}"
    if any(fnmatch.fnmatchcase(where, pattern) for pattern in allow):
        return None
    return f"{what} is not in SCHEDULER_NOTIFY_ALLOWLIST"


def validate_notify_on(value: object) -> list[str]:
    """`notify_on`: which runs the owner is told about, a list of "dead" and "skipped"
    (each at most once; an empty list tells about none)."""
    from jobs.models import NOTIFY_ON_CHOICES

    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError('must be a list like ["dead", "skipped"]')
    for item in value:
        if item not in NOTIFY_ON_CHOICES:
            raise ValueError(f'cannot hold {item!r}: the choices are "dead" and "skipped"')
    if len(set(value)) != len(value):
        raise ValueError("names a kind twice")
    return [kind for kind in NOTIFY_ON_CHOICES if kind in value]


def check_resolved_target(url: str) -> list[str]:
    """At call time: resolve the target's name once and check every address it has.

    Returns the addresses, which the call connects to (it never looks the name up
    again, so a second answer from DNS cannot send it elsewhere). A ValueError when
    the target is refused; a failed lookup raises socket.gaierror (an OSError): a
    failed call, tried again, never an allowed one.
    """
    # One reading of the URL, urllib3's (the one that connects), which refuses
    # anything two parsers could read differently (parse_target).
    target = validate_target(url)
    hostname = target.hostname
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except UnicodeError as exc:
        raise ValueError(f"host {hostname} cannot be looked up") from exc
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        if is_refused_address(address):
            raise ValueError(f"host {hostname} resolves to {address}, a link-local or metadata address")
    if not addresses:
        raise socket.gaierror(socket.EAI_NONAME, "no address")
    return addresses


def validate_method(method: str) -> str:
    upper = method.upper()
    if upper not in METHODS:
        raise ValueError(f"must be one of {', '.join(METHODS)}, not {method!r}")
    return upper


# RFC 9110 "token": what a header name may be made of. Anything else (a NUL, a
# control character) would fail later, in PostgreSQL or in the call itself.
_TOKEN_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# RFC 9110 field-value, kept to what every hop sends the same way: visible ASCII,
# space and tab. Not obs-text (bytes over 0x7f, which http.client sends as Latin-1
# and a target may read as anything) and no control character (a line break would
# start a header of its own).
_FIELD_VALUE_RE = re.compile(r"[\t\x20-\x7e]*")
# The worker sets these on every call (docs/reference.md, what a target receives): a job's
# own value would be overwritten, so refusing it up front says so instead.
SET_BY_SCHEDULER = frozenset(
    {"idempotency-key", "x-fence-token", "x-run-id", "x-attempt", "x-scheduled-for", "x-signature"}
)
# Headers that frame the message or belong to one connection hop. On a pooled
# keep-alive connection shared by every service, a job's Content-Length or
# Transfer-Encoding would make the target read the next service's request as the
# rest of this one (request smuggling); the HTTP client sets them itself.
FRAMING_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer", "upgrade"}
)


def validate_header_name(name: str) -> None:
    if not name or not name.isascii() or not _TOKEN_RE.fullmatch(name):
        raise ValueError(f"{name!r} is not a valid HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)")


def validate_header(name: object, value: object) -> None:
    """One job header, checked the same for the API and the admin: a token name the
    job may set, and a value the call sends byte for byte as stored."""
    if not isinstance(name, str):
        raise ValueError(f"{name!r} is not a header name")
    validate_header_name(name)
    lowered = name.lower()
    if lowered in SET_BY_SCHEDULER:
        raise ValueError(f"{name!r} is set by the scheduler on every call and cannot be given")
    if lowered in FRAMING_HEADERS or lowered.startswith("proxy-"):
        raise ValueError(
            f"{name!r} frames the request or belongs to one connection hop; the HTTP client sets it, a job cannot"
        )
    if not isinstance(value, str):
        raise ValueError(f"the value of {name!r} must be a string, not {type(value).__name__}")
    if not _FIELD_VALUE_RE.fullmatch(value):
        bad = next(c for c in value if not _FIELD_VALUE_RE.fullmatch(c))
        raise ValueError(
            f"the value of {name!r} must be visible ASCII, spaces and tabs only; it has {bad!r} "
            f"at position {value.index(bad)}"
        )


# SCHEDULER_MIN_INTERVAL: the gaps of a schedule are read off a fixed sample of its
# times in UTC, so the answer does not depend on the day it is asked or the job's
# zone (a spring-forward gap can bring two runs closer once a year; that is allowed).
# Four years from a leap year's start holds every calendar shape (Feb 29, month ends).
_GAP_SAMPLE_START = datetime(2000, 1, 1, tzinfo=dt_timezone.utc)
_GAP_SAMPLE_END = datetime(2004, 1, 2, tzinfo=dt_timezone.utc)
_GAP_SAMPLE_TIMES = 10_000


def validate_min_interval(expr: str | list[str]) -> None:
    """A valid cron expression (or list of them: their union) whose runs come closer
    than SCHEDULER_MIN_INTERVAL is a ValueError naming the gap. "1m" (the default)
    allows every 5-field cron."""
    floor = schedule.parse_duration(settings.SCHEDULER_MIN_INTERVAL)
    if floor <= timedelta(minutes=1):
        return  # cron cannot fire more often than once a minute
    crons = tuple(expr) if isinstance(expr, list) else (expr,)
    timetable = schedule.Timetable(zone="UTC", crons=crons, ends_at=_GAP_SAMPLE_END)
    times = islice(schedule.timetable_times(timetable, _GAP_SAMPLE_START), _GAP_SAMPLE_TIMES)
    previous = None
    for current in times:
        if previous is not None and current - previous < floor:
            gap = schedule.format_duration(current - previous)
            raise ValueError(
                f"runs only {gap} apart (at {previous:%H:%M} and {current:%H:%M}); runs must be at least "
                f"{schedule.format_duration(floor)} apart here (SCHEDULER_MIN_INTERVAL)"
            )
        previous = current


# --------------------------------------------------------------------------- Celery task targets
#
# A task job names a Celery task (`task`), with `args`, `kwargs` and a `queue`. The
# name is a dotted path of Python identifiers (ASCII), the form every Celery task
# name takes by default (`module.function`); the queue a plain broker queue name.
# Both end up in a broker message and in the key `celery:<queue>` that pause_target,
# the bulkhead and the breaker use (target_key), so both are kept plain.

MAX_TASK_NAME_LENGTH = 200
MAX_QUEUE_LENGTH = 100
MAX_TASK_PREFIXES = 100
DEFAULT_QUEUE = "celery"
CELERY_KEY_PREFIX = "celery:"
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_TASK_NAME_RE = re.compile(rf"{_IDENTIFIER}(?:\.{_IDENTIFIER})*")
_TASK_PREFIX_RE = re.compile(rf"{_IDENTIFIER}(?:\.{_IDENTIFIER})*\.?")
_QUEUE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def validate_task_name(name: str) -> str:
    """A Celery task name: dotted Python identifiers, like billing.tasks.sync."""
    if len(name) > MAX_TASK_NAME_LENGTH:
        raise ValueError(f"must be at most {MAX_TASK_NAME_LENGTH} characters, not {len(name)}")
    if not _TASK_NAME_RE.fullmatch(name):
        raise ValueError(
            f"{name[:80]!r} is not a Celery task name: give dotted Python identifiers (ASCII letters, digits "
            "and _, not starting with a digit), like billing.tasks.sync"
        )
    return name


def validate_queue(name: str) -> str:
    """A broker queue name: letters, digits, _, . and -, not starting with . or -."""
    if not name:
        raise ValueError(f"must not be empty (the default is {DEFAULT_QUEUE!r})")
    if len(name) > MAX_QUEUE_LENGTH:
        raise ValueError(f"must be at most {MAX_QUEUE_LENGTH} characters, not {len(name)}")
    if not _QUEUE_RE.fullmatch(name):
        raise ValueError(
            f"{name[:80]!r} is not a queue name: ASCII letters, digits, _, . and - only, "
            "not starting with . or -"
        )
    return name


# Queue names no task job may name: the scheduler's own run queue (SCHEDULER_RUN_QUEUE,
# "runs" by default), Celery's shared default queue (a job leaves `queue` out to use
# it) and the keys the broker transport keeps beside the queues on the same server
# (kombu's Redis transport: `unacked`, `unacked_index`, `unacked_mutex`,
# `_kombu.binding.*`; Celery's events and remote control: `celeryev*`, `*.pidbox`,
# `*.reply.celery.pidbox`). A publish to one of them turned a key the scheduler's own
# worker reads into a list (WRONGTYPE, the worker down) or put a tenant's message on
# the scheduler's run queue. The tasks broker defaults to the run queue's server, so
# these stay refused whatever SCHEDULER_TASK_BROKER_URL says.
RESERVED_QUEUES = ("runs", DEFAULT_QUEUE, "celeryev")
RESERVED_QUEUE_PREFIXES = ("unacked", "_kombu.", "celeryev.", "celery.", "amq.")  # amq.*: RabbitMQ's own
RESERVED_QUEUE_SUFFIXES = (".pidbox",)


def queue_refusal(name: str) -> str | None:
    """Why a task job may not name the queue `name`, or None. Reads SCHEDULER_RUN_QUEUE
    at call time, so a renamed run queue is refused as well as the default's name."""
    from django.conf import settings

    own = {settings.CELERY_TASK_DEFAULT_QUEUE, *RESERVED_QUEUES}
    folded = name.lower()
    if folded == DEFAULT_QUEUE:
        return (f"{name!r} is Celery's shared default queue: leave queue out to publish there, "
                "or name a queue of your service's own")
    if folded in own:
        return f"{name!r} is the scheduler's own queue or a broker key; name a queue of your service's own"
    if folded.startswith(RESERVED_QUEUE_PREFIXES) or folded.endswith(RESERVED_QUEUE_SUFFIXES):
        return (f"{name!r} is in the broker transport's own names ({', '.join(p + '*' for p in RESERVED_QUEUE_PREFIXES)}, "
                f"*{RESERVED_QUEUE_SUFFIXES[0]}); name a queue of your service's own")
    return None


def stored_queue_refusal(queue: str) -> str | None:
    """Why a stored task job may not publish to `queue` now, or None. A job stored
    before the name was refused publishes nothing there; the default (`queue` left
    out, stored as "" or as Celery's default) is where an ordinary worker listens."""
    queue = queue or DEFAULT_QUEUE
    return None if queue == DEFAULT_QUEUE else queue_refusal(queue)


# Task names no service may be granted: Celery's own (celery.chord, celery.starmap...,
# which run other tasks by name) and the scheduler's (its workers run them).
RESERVED_TASK_ROOTS = ("celery", "runs", "jobs", "scanners", "scheduler_project")


def validate_task_prefix(prefix: str) -> str:
    """A grant: a task name, or one ending with a dot (`billing.`); never one that
    covers Celery's own tasks or the scheduler's (RESERVED_TASK_ROOTS)."""
    if len(prefix) > MAX_TASK_NAME_LENGTH or not _TASK_PREFIX_RE.fullmatch(prefix):
        raise ValueError(
            f"{prefix[:80]!r} is not a task prefix: give dotted Python identifiers, optionally ending with "
            "a dot, like billing. or billing.tasks"
        )
    for root in RESERVED_TASK_ROOTS:
        # It covers the root (`cel` would grant celery.*), or lies under it (`celery.`, `runs.tasks`).
        if task_name_granted(root, [prefix]) or task_name_granted(prefix.rstrip("."), [root]):
            raise ValueError(
                f"{prefix!r} would grant {root}.* tasks: Celery's own tasks and the scheduler's are never granted"
            )
    return prefix


def task_name_granted(name: str, prefixes: list[str]) -> bool:
    """Whether `name` is under one of `prefixes`, on dot boundaries: `billing.` grants
    billing.tasks.sync, never billingx.run; `billing` grants billing and billing.*."""
    for prefix in prefixes:
        if not isinstance(prefix, str) or not prefix:
            continue
        if prefix.endswith("."):
            if name.startswith(prefix):
                return True
        elif name == prefix or name.startswith(prefix + "."):
            return True
    return False


def target_key(job: object) -> str:
    """What a job's calls are keyed by for the bulkhead, the breaker and pause_target:
    a URL target's host as written (target_host), a task target's `celery:<queue>`.
    Every such key of a job is worked out here."""
    task = getattr(job, "task", "")
    if task:
        return CELERY_KEY_PREFIX + (getattr(job, "queue", "") or DEFAULT_QUEUE)
    return target_host(getattr(job, "target", ""))
