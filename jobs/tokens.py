"""Service API tokens: made, found and revoked here, and nowhere else.

A token is 32 random bytes (43 URL-safe characters). Only its SHA-256 is stored:
a token that random cannot be guessed back from its hash, so a plain hash (no
salt, no slow KDF, no key that a SECRET_KEY rotation would invalidate) is enough,
and it makes the lookup one indexed read. The first 8 characters are kept in
clear as the token's `prefix`: it names the token in the admin and the audit log
so an operator can tell which one to revoke. The token itself is shown once,
when it is made (django-rest-knox does the same; DRF's authtoken kept keys in clear).

    token = token_issue(user=service.user)    # give it to the service, once
    user = token_user(token)                 # the API's authentication
    tokens_revoke(user=service.user)         # every token of the service stops working
"""
from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from jobs.models import ServiceToken

PREFIX_LENGTH = 8
# last_used_at is advice for operators, not an audit trail: writing it at most this
# often keeps the hot path to one read per request.
LAST_USED_PRECISION = timedelta(minutes=5)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_issue(*, user: Any) -> str:
    """A new token for `user`, alongside any it has. Returns the token: store nothing else."""
    token = secrets.token_urlsafe(32)
    ServiceToken.objects.create(user=user, prefix=token[:PREFIX_LENGTH], digest=token_digest(token))
    return token


def token_user(token: str) -> Any:
    """The active user whose unrevoked token this is, or None."""
    row = (
        ServiceToken.objects.select_related("user")
        .filter(digest=token_digest(token), revoked_at__isnull=True, user__is_active=True)
        .first()
    )
    if row is None:
        return None
    now = timezone.now()
    if row.last_used_at is None or now - row.last_used_at > LAST_USED_PRECISION:
        ServiceToken.objects.filter(pk=row.pk).update(last_used_at=now)
    return row.user


def tokens_revoke(*, user: Any, keep: str = "") -> list[str]:
    """Revoke every unrevoked token of `user` (but the one whose token is `keep`);
    returns the revoked tokens' prefixes."""
    live = ServiceToken.objects.filter(user=user, revoked_at__isnull=True)
    if keep:
        live = live.exclude(digest=token_digest(keep))
    with transaction.atomic():
        prefixes = list(live.select_for_update().values_list("prefix", flat=True))
        live.update(revoked_at=timezone.now())
    return prefixes
