"""X-Signature: how a target knows a call comes from the scheduler, unchanged.

    X-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">[,v1=...]

keyed by the owning service's signing secret (jobs.SigningSecret, stored
encrypted). After `rotate_signing_secret` the old secret keeps signing, as a
second `v1=`, until SCHEDULER_SIGNING_OVERLAP has passed, so a target can switch
to the new secret at its own pace. The receiving side is `receiver.views`.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets as random_secrets
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from cryptography.fernet import InvalidToken
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from jobs.models import ServiceAccount, SigningSecret
from jobs.schedule import parse_duration
from jobs.secrets import fernet
from runs.delivery import Signer

logger = logging.getLogger("scheduler.signing")
SECRET_PREFIX = "whsec_"
# How long a worker reuses what it read: the hot path queries once per service per
# 30 s, not once per call. A rotation reaches other workers within that time, and
# the old secret still signs meanwhile (the overlap), so nothing breaks.
CACHE_SECONDS = 30.0

_cache: dict[int, tuple[float, Signer | None]] = {}
_cache_lock = threading.Lock()


def signature(body: bytes, secret_values: Sequence[str], t: int) -> str:
    """The X-Signature value for `body` sent at unix time `t`: one v1 per secret."""
    signed = str(t).encode() + b"." + body
    macs = [hmac.new(value.encode(), signed, hashlib.sha256).hexdigest() for value in secret_values]
    return ",".join([f"t={t}", *(f"v1={mac}" for mac in macs)])


class HmacSigner(Signer):
    """Signs with the service's live secrets, current one first."""

    def __init__(self, secret_values: Sequence[str], clock: Callable[[], float] = time.time) -> None:
        self.secret_values = tuple(secret_values)
        self.clock = clock

    def __call__(self, body: bytes) -> str:
        return signature(body, self.secret_values, int(self.clock()))

    def __repr__(self) -> str:  # never the secrets themselves, in a log or a traceback
        return f"HmacSigner({len(self.secret_values)} secrets)"


def overlap() -> timedelta:
    return parse_duration(settings.SCHEDULER_SIGNING_OVERLAP)


def new_secret_value() -> str:
    return SECRET_PREFIX + random_secrets.token_urlsafe(32)


def _store(service: ServiceAccount, value: str) -> None:
    SigningSecret.objects.create(service=service, secret=fernet().encrypt(value.encode()).decode())


def live_secrets(service: ServiceAccount, now: datetime) -> list[str]:
    """The secrets that sign now, in clear: the current one first, then those still
    inside their overlap, newest first. One that cannot be decrypted (SECRET_KEY or
    SCHEDULER_ENCRYPTION_KEY changed) is left out, with an error in the log."""
    rows = SigningSecret.objects.filter(service=service).exclude(retires_at__lte=now)
    ordered = sorted(rows, key=lambda row: (row.retires_at is not None, -row.created_at.timestamp(), -row.pk))
    values = []
    for row in ordered:
        try:
            values.append(fernet().decrypt(row.secret.encode()).decode())
        except InvalidToken:
            logger.error(
                "signing secret %s of %s cannot be decrypted (was SECRET_KEY or SCHEDULER_ENCRYPTION_KEY "
                "changed?); run rotate_signing_secret %s", row.pk, service, service,
            )
    return values


@transaction.atomic
def signing_secret_ensure(*, service: ServiceAccount) -> None:
    """Give the service a current secret if it has none (at creation, or lazily at
    its first call). The service row is locked so two workers make only one."""
    ServiceAccount.objects.select_for_update().filter(pk=service.pk).first()
    if not SigningSecret.objects.filter(service=service, retires_at__isnull=True).exists():
        _store(service, new_secret_value())
        forget(service.user_id)


@transaction.atomic
def signing_secret_rotate(*, service: ServiceAccount, now: datetime | None = None) -> str:
    """A new current secret; the old one retires at now + SCHEDULER_SIGNING_OVERLAP.
    Returns the new secret in clear (the only time it is shown)."""
    now = now or timezone.now()
    ServiceAccount.objects.select_for_update().filter(pk=service.pk).first()
    SigningSecret.objects.filter(service=service, retires_at__isnull=True).update(retires_at=now + overlap())
    value = new_secret_value()
    _store(service, value)
    forget(service.user_id)
    return value


def forget(owner_id: int) -> None:
    """Drop this process's cached signer for the owner (after a change made here)."""
    with _cache_lock:
        _cache.pop(owner_id, None)


def signer_for_owner(owner_id: int) -> Signer | None:
    """The signer for calls of jobs owned by `owner_id`, cached for CACHE_SECONDS.

    None when the owner is not a service account (a person's job: there is no
    service secret to sign with) or when no secret can be decrypted."""
    now = time.monotonic()
    with _cache_lock:
        cached = _cache.get(owner_id)
    if cached is not None and cached[0] > now:
        return cached[1]
    signer = _load_signer(owner_id)
    with _cache_lock:
        _cache[owner_id] = (now + CACHE_SECONDS, signer)
    return signer


def _load_signer(owner_id: int) -> Signer | None:
    service = ServiceAccount.objects.select_related("user").filter(user_id=owner_id).first()
    if service is None:
        return None
    values = live_secrets(service, timezone.now())
    if not values and not SigningSecret.objects.filter(service=service, retires_at__isnull=True).exists():
        signing_secret_ensure(service=service)  # a service made before signing existed
        values = live_secrets(service, timezone.now())
    return HmacSigner(values) if values else None
