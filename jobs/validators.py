"""Checks shared by the API serializers, the admin forms and the worker.

Each raises ValueError with a sentence that says what is wrong; the callers
attach the field name.
"""
from __future__ import annotations

import fnmatch
import ipaddress
import re
import socket
from datetime import datetime, timedelta, timezone as dt_timezone
from itertools import islice
from urllib.parse import urlsplit

from django.conf import settings

from jobs import schedule

# Never called, whatever the allowlist says: link-local (cloud metadata lives
# there) and the AWS IPv6 metadata address.
REFUSED_NETWORKS = (
    ipaddress.ip_network("169.254.0.0/16"),
    ipaddress.ip_network("fe80::/10"),
    ipaddress.ip_network("fd00:ec2::254/128"),
)
REFUSED_HOSTNAMES = frozenset({"metadata.google.internal", "metadata"})
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def is_refused_address(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return any(ip in net for net in REFUSED_NETWORKS)


def target_host(url: str) -> str:
    """The host as written in the URL, port included (the bulkhead's key)."""
    return urlsplit(url).netloc.rsplit("@", 1)[-1].lower()


def validate_target(url: str) -> None:
    """At creation: http(s), a host, allowed by the allowlist, not a refused address."""
    if len(url) > 2000:
        raise ValueError("must be at most 2000 characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"must be an http or https URL, not {parts.scheme or 'a relative'!r} one")
    try:
        hostname = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"has a bad host or port ({exc})") from exc
    if not hostname:
        raise ValueError("must name a host")
    if parts.username or parts.password:
        raise ValueError("must not carry a user name or password; use headers")
    if hostname in REFUSED_HOSTNAMES or is_refused_address(hostname):
        raise ValueError(f"host {hostname} is a link-local or metadata address, which is never called")
    allow = settings.SCHEDULER_TARGET_ALLOWLIST
    if allow and not any(fnmatch.fnmatch(hostname, pattern.lower()) for pattern in allow):
        raise ValueError(f"host {hostname} is not in SCHEDULER_TARGET_ALLOWLIST")


def check_resolved_target(url: str) -> list[str]:
    """At call time: resolve the target's name once and check every address it has.

    Returns the addresses, which the call connects to (it never looks the name up
    again, so a second answer from DNS cannot send it elsewhere). A ValueError when
    the target is refused; a failed lookup raises socket.gaierror (an OSError): a
    failed call, tried again, never an allowed one.
    """
    validate_target(url)
    from urllib3.util import parse_url  # the parser the call connects with

    parsed = parse_url(url)
    hostname = (parsed.host or "").strip("[]")
    written = (urlsplit(url).hostname or "").lower()
    try:
        as_ascii = written.encode("idna").decode("ascii")  # urllib3 sends an IDN as its xn-- form
    except UnicodeError:
        as_ascii = written
    if hostname.lower() not in (written, as_ascii):
        raise ValueError("its host reads differently to different URL parsers; write it plainly")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
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


def validate_header_name(name: str) -> None:
    if not name or any(c in name for c in " :\r\n\t") or not name.isascii() or not _TOKEN_RE.fullmatch(name):
        raise ValueError(f"{name!r} is not a valid HTTP header name")


# SCHEDULER_MIN_INTERVAL: the gaps of a schedule are read off a fixed sample of its
# times in UTC, so the answer does not depend on the day it is asked or the job's
# zone (a spring-forward gap can bring two runs closer once a year; that is allowed).
# Four years from a leap year's start holds every calendar shape (Feb 29, month ends).
_GAP_SAMPLE_START = datetime(2000, 1, 1, tzinfo=dt_timezone.utc)
_GAP_SAMPLE_END = datetime(2004, 1, 2, tzinfo=dt_timezone.utc)
_GAP_SAMPLE_TIMES = 10_000


def validate_min_interval(expr: str) -> None:
    """A valid cron expression whose runs come closer than SCHEDULER_MIN_INTERVAL is a
    ValueError naming the gap. "1m" (the default) allows every 5-field cron."""
    floor = schedule.parse_duration(settings.SCHEDULER_MIN_INTERVAL)
    if floor <= timedelta(minutes=1):
        return  # cron cannot fire more often than once a minute
    times = islice(schedule.cron_times(expr, "UTC", _GAP_SAMPLE_START, _GAP_SAMPLE_END), _GAP_SAMPLE_TIMES)
    previous = None
    for current in times:
        if previous is not None and current - previous < floor:
            gap = schedule.format_duration(current - previous)
            raise ValueError(
                f"runs only {gap} apart (at {previous:%H:%M} and {current:%H:%M}); runs must be at least "
                f"{schedule.format_duration(floor)} apart here (SCHEDULER_MIN_INTERVAL)"
            )
        previous = current
