"""`idempotent_task`: the receiver's rule for Celery task targets of the scheduler.

A task job's run publishes a Celery message whose headers carry
`idempotency_key`, `fence_token`, `run_id`, `attempt` and `scheduled_for`; Celery
puts custom message headers on the task's request, so a bound task reads them as
`self.request.idempotency_key` (or `self.request.get("idempotency_key")`).

Put the decorator under `@app.task(bind=True, ...)` (it needs the bound `self`)::

    from receiver.tasks import idempotent_task

    @app.task(bind=True, name="billing.tasks.sync")
    @idempotent_task
    def sync(self, account_id):
        Invoice.objects.create(account_id=account_id)

Then, in one transaction of the target's own database (the same rule as
`receiver.views.idempotent_run`, receiver.views.delivery_admit):

- a fence lower than the highest this key has seen is refused: the task body does
  not run (an old lease holder's message, delivered late);
- a key already applied is not applied again: the body does not run (a second
  delivery of the same run: a re-publish after the scheduler's worker died between
  the broker's acceptance and its outcome's write, or the broker's redelivery);
- otherwise the body runs, and its database writes commit together with the
  "applied" mark. If it raises, both roll back and the exception goes to Celery.

Refused or replayed, the wrapper returns None and logs why; it never raises for
them, so Celery does not retry them. A message without the two headers (the task
called by something other than the scheduler) raises MissingRunHeaders.

Depends on Django and this app's `Delivery` table only, never on the scheduler's
settings: add "receiver" to INSTALLED_APPS of the target's project and migrate.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from django.db import transaction
from django.utils import timezone

from receiver.views import REPLAY, STALE, delivery_admit

logger = logging.getLogger("receiver.tasks")
MAX_KEY_LENGTH = 200


class MissingRunHeaders(ValueError):
    """The message has no usable idempotency_key / fence_token headers."""


def run_headers(request: Any) -> tuple[str, int]:
    """(idempotency_key, fence_token) from a Celery task's request, checked."""
    key = request.get("idempotency_key")
    fence = request.get("fence_token")
    if isinstance(fence, str) and fence.isascii() and fence.isdigit() and len(fence) <= 18:
        fence = int(fence)
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise MissingRunHeaders("the message has no idempotency_key header (is it from the scheduler?)")
    if not isinstance(fence, int) or isinstance(fence, bool) or fence < 0:
        raise MissingRunHeaders("the message has no numeric fence_token header (is it from the scheduler?)")
    return key, fence


def idempotent_task(body: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a bound Celery task's function: its effect happens once per run."""

    @functools.wraps(body)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        key, fence = run_headers(self.request)
        failure: Exception | None = None
        with transaction.atomic():
            delivery, verdict = delivery_admit(key, fence)
            if verdict == STALE:
                logger.warning("%s: fence %s is older than %s: refused", key, fence, delivery.highest_fence)
                return None
            if verdict == REPLAY:
                logger.info("%s: already applied; fence %s not applied again", key, fence)
                return None
            sid = transaction.savepoint()
            try:
                result = body(self, *args, **kwargs)
            except Exception as exc:
                # A failed try leaves no effect behind, but the fence it came with stays seen.
                transaction.savepoint_rollback(sid)
                failure = exc
            else:
                transaction.savepoint_commit(sid)
                delivery.applied, delivery.applied_at = True, timezone.now()
            delivery.save()
        if failure is not None:
            raise failure
        return result

    return wrapper
