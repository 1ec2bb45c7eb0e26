"""`Authorization: Token <token>` for the API (jobs.tokens), with guessing slowed.

A missing header is anonymous (the permission check answers 401); `Bearer` is a 401
that names the scheme to use; a bad token is
401 with `WWW-Authenticate: Token` and counts as one failure for the caller's
address. SCHEDULER_TOKEN_FAILURES failures from one address lock that address out
for SCHEDULER_TOKEN_LOCKOUT seconds: every token call from it, good tokens too, is
a 429 with Retry-After until then (answering a good token would tell a guesser
when it hit). The counts live in the cache, shared by every API process when
SCHEDULER_CACHE_URL is set.
"""
from __future__ import annotations

import math
import time
from typing import Any

from django.conf import settings
from django.core.cache import cache
from rest_framework.authentication import TokenAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed, Throttled
from rest_framework.request import Request

from jobs.audit import client_address
from jobs.tokens import token_user

KEYWORD = "Token"
PREFIX = "scheduler:token-failures:"
BEARER_REFUSED = "This API's scheme is Token, not Bearer: send `Authorization: Token <token>`."


def lockout_wait(addr: str, now: float | None = None) -> int:
    """Seconds `addr` must still wait, or 0 when it is not locked out."""
    until = cache.get(f"{PREFIX}locked:{addr}")
    if until is None:
        return 0
    left = float(until) - (time.time() if now is None else now)
    return max(1, math.ceil(left)) if left > 0 else 0


def failure_count(addr: str, now: float | None = None) -> None:
    """One more bad token from `addr`; the limit-th within the window locks it out."""
    window = int(settings.SCHEDULER_TOKEN_LOCKOUT)
    key = f"{PREFIX}count:{addr}"
    cache.add(key, 0, timeout=window)  # the window starts at the first failure
    try:
        count = cache.incr(key)
    except ValueError:  # expired between add and incr: this failure starts a new window
        cache.add(key, 1, timeout=window)
        count = 1
    if count >= int(settings.SCHEDULER_TOKEN_FAILURES):
        until = (time.time() if now is None else now) + window
        cache.set(f"{PREFIX}locked:{addr}", until, timeout=window)
        cache.delete(key)


class ServiceTokenAuthentication(TokenAuthentication):
    """DRF's TokenAuthentication's header and schema (drf-spectacular documents it as
    `tokenAuth`), with tokens looked up by hash: DRF's own lookup is never used."""

    keyword = KEYWORD

    def authenticate(self, request: Request) -> tuple[Any, str] | None:
        words = get_authorization_header(request).split()
        if words and words[0].lower() == b"bearer":
            # A common guess (OAuth's scheme); say which one this API takes. The token is not
            # looked at, so this tells a guesser nothing and counts as no failure.
            raise AuthenticationFailed(BEARER_REFUSED)
        if not words or words[0].lower() != KEYWORD.lower().encode():
            return None
        addr = client_address(request._request)
        wait = lockout_wait(addr)
        if wait:
            raise Throttled(wait=wait, detail=f"Too many bad tokens from this address; try again in {wait} seconds.")
        user = None
        if len(words) == 2:
            try:
                user = token_user(words[1].decode("ascii"))
            except UnicodeDecodeError:
                user = None
        if user is None:
            failure_count(addr)
            raise AuthenticationFailed("Invalid token.")
        return user, words[1].decode("ascii")

    def authenticate_header(self, request: Request) -> str:
        return KEYWORD
