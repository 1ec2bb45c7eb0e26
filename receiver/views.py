"""`idempotent_run`: a Django view decorator for targets of the scheduler.

For each call it reads `Idempotency-Key` and `X-Fence-Token` and, in one
database transaction with the view's own writes:

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
from typing import Any, Callable

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from receiver.models import Delivery

View = Callable[..., HttpResponse]


def _fence(request: HttpRequest) -> int | None:
    raw = request.headers.get("X-Fence-Token", "")
    return int(raw) if raw.isdigit() else None


def idempotent_run(view: View) -> View:
    @csrf_exempt
    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        key = request.headers.get("Idempotency-Key", "")
        fence = _fence(request)
        if not key or len(key) > 200 or fence is None:
            return JsonResponse({"detail": "Idempotency-Key and a numeric X-Fence-Token are required"}, status=400)
        with transaction.atomic():
            return _handle(request, key, fence, view, args, kwargs)

    return wrapper


def _handle(request: HttpRequest, key: str, fence: int, view: View, args: Any, kwargs: Any) -> HttpResponse:
    Delivery.objects.bulk_create([Delivery(key=key)], ignore_conflicts=True)
    delivery = Delivery.objects.select_for_update().get(key=key)  # one call per key at a time
    delivery.calls += 1
    if fence < delivery.highest_fence:
        delivery.save(update_fields=["calls"])
        return JsonResponse(
            {"detail": f"fence {fence} is older than {delivery.highest_fence}: refused"}, status=409
        )
    delivery.highest_fence = fence
    if delivery.applied:
        delivery.save(update_fields=["calls", "highest_fence"])
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
