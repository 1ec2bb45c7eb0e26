"""Runs onto the run queue: the messages a scan publishes (run_messages) and their
publishing over one broker connection (publish_runs), on the fast lane or the slow one
(scanners.shares.SLOW_LANE)."""
from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings

from scanners.shares import SLOW_LANE


def due_slice() -> float:
    """Seconds within which a message's runs not yet due are due (of its first): half
    the look-ahead. The worker holding it claims them as they come due
    (runs.services.CLAIM_WAVE); the next slice goes to another worker child."""
    return settings.SCHEDULER_LOOKAHEAD / 2


def publish_runs(
    run_ids: list[int], hosts: dict[int, str] | None = None, due: dict[int, datetime] | None = None,
    now: datetime | None = None, slow: set[int] | None = None,
) -> None:
    """Runs onto the run queue over one broker connection (see run_messages); those in
    `slow` on its slow lane (SLOW_LANE), in messages of their own."""
    from runs.tasks import execute_runs
    from scheduler_project.celery import app

    # When it was sent, by the clock that stamped the runs' queued_at (claims.claim_many).
    sent = {"sent_at": now.isoformat()} if now is not None else {}
    slow = slow or set()
    lanes = [([i for i in run_ids if i not in slow], {}),
             ([i for i in run_ids if i in slow], {"priority": SLOW_LANE})]
    with app.producer_or_acquire() as producer:
        for lane_ids, options in lanes:
            for ids in run_messages(lane_ids, hosts=hosts or {}, due=due or {}, now=now):
                execute_runs.apply_async((ids,), sent, producer=producer, **options)


def run_messages(
    run_ids: list[int], *, hosts: dict[int, str], due: dict[int, datetime], now: datetime | None
) -> list[list[int]]:
    """The messages for runs in due order: SCHEDULER_DISPATCH_BATCH to a message, each
    message's runs to one target host where the host is known (so one slow host's
    message does not carry another host's runs); runs not yet due at `now` (`due`
    says when, for those queued ahead) in slices of due_slice(). Runs already due go
    together, full batches as ever. The messages go out earliest first."""
    # More runs to one host than its bulkhead holds would only be put back to wait.
    size = max(1, min(settings.SCHEDULER_DISPATCH_BATCH, settings.SCHEDULER_TARGET_CONCURRENCY))
    slice_ = timedelta(seconds=due_slice())
    open_by_host: dict[str, tuple[datetime | None, list[int]]] = {}
    messages: list[tuple[datetime | None, list[int]]] = []
    for run_id in run_ids:
        when = due.get(run_id)
        starts = None if when is None or now is None or when <= now else when  # None: due already
        host = hosts.get(run_id, "")
        first, ids = open_by_host.get(host, (None, []))
        if starts is None:
            fits = first is None  # with the other runs already due
        else:
            fits = first is not None and starts - first <= slice_
        fits = fits and len(ids) < size
        if not ids or not fits:
            ids = []
            messages.append((starts, ids))
            first = starts
        ids.append(run_id)
        open_by_host[host] = (first, ids)
    due_now = [ids for starts, ids in messages if starts is None]
    ahead = sorted((starts, i) for i, (starts, _) in enumerate(messages) if starts is not None)
    return due_now + [messages[i][1] for _, i in ahead]
