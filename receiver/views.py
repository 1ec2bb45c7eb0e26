"""`idempotent_run`: a Django view decorator for targets of the scheduler.

When `RECEIVER_SIGNING_SECRETS` (a list of the service's signing secrets) is
set, it first checks `X-Signature` (see `verify_signature`) and refuses (401)
a call that is unsigned, signed with another secret, changed on the way, or
signed more than `RECEIVER_SIGNATURE_TOLERANCE` seconds (default 300) away from
now: a replay. Two secrets may be set during a rotation; any match is enough.

Then it reads `Idempotency-Key` and `X-Fence-Token` and, in one database
transaction with the view's own writes:

- refuses (409) a fence lower than the highest this key has seen: an old
  lease holder that woke up late;
- answers a key already applied with the stored answer, without running the
  view again: a retry after a lost answer;
- otherwise runs the view, and stores its answer if it is a 2xx.

Because the view runs inside the same transaction as the bookkeeping, its
database effects and the "applied" mark commit together: the effect happens
once. Effects outside the database (an e-mail, a call elsewhere) should carry
the same key onwards.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import time
from collections.abc import Sequence
from typing import Any, Callable

from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from receiver.models import Delivery

View = Callable[..., HttpResponse]


def _fence(request: HttpRequest) -> int | None:
    raw = request.headers.get("X-Fence-Token", "")
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 18 else None


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


def verify_signature(
    header: str, body: bytes, secrets: Sequence[str], *, tolerance: int, now: float | None = None
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


def _signature_refusal(request: HttpRequest) -> HttpResponse | None:
    secrets = getattr(settings, "RECEIVER_SIGNING_SECRETS", None) or []
    if not secrets:
        return None  # verification is off until the target configures its secrets
    tolerance = int(getattr(settings, "RECEIVER_SIGNATURE_TOLERANCE", 300))
    problem = verify_signature(request.headers.get("X-Signature", ""), request.body, secrets, tolerance=tolerance)
    if problem is None:
        return None
    response = JsonResponse({"detail": problem}, status=401)
    response["WWW-Authenticate"] = 'X-Signature realm="scheduler"'
    return response


def idempotent_run(view: View) -> View:
    @csrf_exempt
    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        # Before any bookkeeping: a forged call must leave no trace in Delivery either.
        refusal = _signature_refusal(request)
        if refusal is not None:
            return refusal
        key = request.headers.get("Idempotency-Key", "")
        fence = _fence(request)
        if not key or len(key) > 200 or fence is None:
            return JsonResponse({"detail": "Idempotency-Key and a numeric X-Fence-Token are required"}, status=400)
        with transaction.atomic():
            return _handle(request, key, fence, view, args, kwargs)

    return wrapper


STALE, REPLAY, APPLY = "stale", "replay", "apply"


def delivery_admit(key: str, fence: int) -> tuple[Delivery, str]:
    """The rule, shared by idempotent_run and receiver.tasks.idempotent_task; inside
    the caller's transaction, the key's row locked until it ends (one call per key at
    a time). STALE: a fence lower than the highest this key has seen (an old lease
    holder), refused. REPLAY: the key was applied already, not applied again. APPLY:
    run the effect, then mark the row applied in the same transaction."""
    Delivery.objects.bulk_create([Delivery(key=key)], ignore_conflicts=True)
    delivery = Delivery.objects.select_for_update().get(key=key)
    delivery.calls += 1
    if fence < delivery.highest_fence:
        delivery.save(update_fields=["calls"])
        return delivery, STALE
    delivery.highest_fence = fence
    if delivery.applied:
        delivery.save(update_fields=["calls", "highest_fence"])
        return delivery, REPLAY
    return delivery, APPLY


def _handle(request: HttpRequest, key: str, fence: int, view: View, args: Any, kwargs: Any) -> HttpResponse:
    delivery, verdict = delivery_admit(key, fence)
    if verdict == STALE:
        return JsonResponse(
            {"detail": f"fence {fence} is older than {delivery.highest_fence}: refused"}, status=409
        )
    if verdict == REPLAY:
        return _replay(delivery)
    sid = transaction.savepoint()
    response = view(request, *args, **kwargs)
    if 200 <= response.status_code < 300:
        transaction.savepoint_commit(sid)
        delivery.applied, delivery.applied_at = True, timezone.now()
        delivery.status = response.status_code
        delivery.body = bytes(getattr(response, "content", b""))
        delivery.content_type = response.get("Content-Type", "")
    else:
        transaction.savepoint_rollback(sid)  # a failed try leaves no effect behind
    delivery.save()
    return response


def _replay(delivery: Delivery) -> HttpResponse:
    response = HttpResponse(bytes(delivery.body), status=delivery.status or 200, content_type=delivery.content_type or None)
    response["Idempotent-Replay"] = "true"
    return response
