"""X-Signature, checked: plain Python, no Django (any WSGI or ASGI target can use it).

    X-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">[,v1=...]

The HMAC is keyed by the service's signing secret (UTF-8) over the ASCII digits of
`t`, a `.`, and the body exactly as sent. After a rotation the scheduler signs with
the new and the old secret (two `v1=`): any `v1` matching any secret is enough.
"""
from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence

DEFAULT_TOLERANCE = 300  # seconds either way; an older signature is refused as a replay


def parse_signature(header: str) -> tuple[int | None, list[str]]:
    """`t=1793219401,v1=5f0c...,v1=...` -> (1793219401, ["5f0c...", ...]).
    Unknown keys are ignored (room for a later scheme); a bad t is None."""
    t: int | None = None
    macs: list[str] = []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t" and value.isascii() and value.isdigit() and len(value) <= 12:
            t = int(value)
        elif key == "v1" and value:
            macs.append(value)
    return t, macs


def sign(body: bytes, secrets: Sequence[str], t: int | None = None) -> str:
    """The X-Signature value the scheduler would send for `body` (for tests of a target)."""
    t = int(time.time()) if t is None else t
    signed = str(t).encode() + b"." + body
    macs = [hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest() for secret in secrets]
    return ",".join([f"t={t}", *(f"v1={mac}" for mac in macs)])


def verify_signature(
    header: str, body: bytes, secrets: Sequence[str], *, tolerance: int = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> str | None:
    """None when `header` is a valid X-Signature of `body` under any of `secrets`;
    otherwise why not, in words."""
    if not header:
        return "X-Signature is missing"
    t, macs = parse_signature(header)
    if t is None or not macs:
        return "X-Signature is malformed: expected t=<unix seconds>,v1=<hex>"
    age = (time.time() if now is None else now) - t
    if abs(age) > tolerance:
        return f"X-Signature was made {int(age)}s from now; more than {tolerance}s is refused as a replay"
    signed = str(t).encode() + b"." + body
    for secret in secrets:
        expected = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
        if any(hmac.compare_digest(expected, mac) for mac in macs):
            return None
    return "X-Signature does not match the body under any configured secret"
