"""Idempotent creates: `POST /api/jobs/` with an `Idempotency-Key` request header.

The same key from the same service within CREATE_KEY_HOURS replays the first
answer (the 201 and its body, with `Idempotent-Replayed: true`) and creates
nothing; the same key with a different body is a 422. So a service that retries
a create after a dropped connection (the server may have committed) gets one job.

The key's row is written in the job's own transaction (jobs.api): a create that
committed has its key. Two requests with one key at once: the unique
(owner, key) makes the second wait for the first's commit and fail its insert,
rolling its job back; it then replays the first's answer. Only 201 answers are
kept: a 400 writes nothing, so a corrected body may use the same key.
"""
from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timedelta
from typing import Any

from rest_framework import status
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from jobs.models import CREATE_KEY_HOURS, CreateKey, Job

HEADER = "Idempotency-Key"
_KEY_RE = re.compile(r"[\x21-\x7e]{1,255}")  # visible ASCII, as a header carries it plainly


class KeyReused(APIException):
    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_code = "idempotency_key_reused"


def key_of(request: Request) -> str | None:
    """The request's Idempotency-Key, or None; a 400 naming the header when malformed."""
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    if not _KEY_RE.fullmatch(raw):
        raise ValidationError({HEADER: [
            "must be 1 to 255 visible ASCII characters (a UUID is a good key), "
            f"not {raw[:40]!r}" + ("..." if len(raw) > 40 else "")
        ]})
    return raw


def body_digest(body: dict[str, Any]) -> str:
    """The body as parsed, keys sorted: the same JSON sent with other spacing or key
    order is the same body."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def replay(owner: Any, key: str, digest: str, now: datetime) -> Response | None:
    """The first answer under this key, or None when the key is new (or older than
    CREATE_KEY_HOURS); a 422 when it was used for another body."""
    kept = CreateKey.objects.filter(owner=owner, key=key, created_at__gte=now - timedelta(hours=CREATE_KEY_HOURS)).first()
    if kept is None:
        return None
    if kept.body_sha256 != digest:
        raise KeyReused(
            f"{HEADER} {key!r} was used by this service at {kept.created_at:%Y-%m-%dT%H:%M:%SZ} for another body; "
            "send a new key for a new job"
        )
    return Response(kept.answer, status=status.HTTP_201_CREATED, headers={"Idempotent-Replayed": "true"})


def keep(owner: Any, key: str, digest: str, job: Job, answer: dict[str, Any], now: datetime) -> None:
    """In the create's transaction: the key and its answer. A row of this key past
    CREATE_KEY_HOURS is replaced; a few other expired rows of the owner go too."""
    old = CreateKey.objects.filter(owner=owner, created_at__lt=now - timedelta(hours=CREATE_KEY_HOURS))
    old.filter(key=key).delete()
    stale = list(old.values_list("pk", flat=True)[:100])
    if stale:
        CreateKey.objects.filter(pk__in=stale).delete()
    CreateKey.objects.create(owner=owner, key=key, body_sha256=digest, job=job, answer=answer, created_at=now)
