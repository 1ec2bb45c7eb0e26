"""Operator services on jobs that the API does not offer: "run now".

`job_trigger` makes an *extra* run (`is_backfill=True`) at now rounded up to a
whole second, due at once, with a `triggered` event. Extra, because the job
keeps its own timetable: its waiting run stays where it is (one open run per
job counts non-backfill runs only), and an extra run neither misfires nor
creates a next run when it ends. A time that already has a run (the job's own
run due this very second) moves the extra run on by a second, so
`(job, scheduled_for)` stays unique and each run keeps its own Idempotency-Key.

`once_per_second=True` (the API's `POST /api/jobs/{id}/run/`) refuses instead a
second manual run in the same second: a manual run's Idempotency-Key is
`<job id>@<now, whole seconds>` (docs/reference.md, what a target receives), and
two calls in one second are a double submit, not two wishes; the caller is told
which run already has that second.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from jobs import schedule
from jobs.audit import actor_name, audit_record
from jobs.models import Job
from runs import events
from runs.delivery import iso_z
from runs.models import Run, RunEvent
from runs.nextrun import is_held


class TriggerRefused(ValueError):
    pass


def trigger_refusal(job: Job) -> str | None:
    if job.state == Job.State.DELETED:
        return f"{job.public_id} is deleted"
    if job.paused:
        return f"{job.public_id} is paused; resume it first"
    if is_held(job):
        return f"{job.public_id}'s target host is paused (resume_target)"
    return None


def _manual_run_at(job: Job, when: datetime) -> Run | None:
    """The run someone asked for in the second that rounds up to `when` (its
    `triggered` event's time), wherever a clash moved it to."""
    # A manual run is for the second it was asked in or, moved by a clash, a later
    # one: no older events partition is read.
    asked = RunEvent.objects.filter(
        run__job=job, type="triggered", at__gt=when - timedelta(seconds=1), at__lte=when,
        scheduled_for__gt=when - timedelta(seconds=1),
    ).select_related("run")
    event = asked.order_by("id").first()
    return event.run if event is not None else None


@transaction.atomic
def job_trigger(
    *,
    job: Job,
    now: datetime | None = None,
    actor: Any = None,
    via: str = "admin",
    once_per_second: bool = False,
) -> Run:
    """Run the job now, once, besides its schedule. TriggerRefused says why not."""
    now = now or timezone.now()
    job = Job.objects.select_for_update().get(pk=job.pk)
    reason = trigger_refusal(job)
    if reason is not None:
        raise TriggerRefused(reason)
    when = schedule.round_up_to_second(now)
    if once_per_second:
        earlier = _manual_run_at(job, when)
        if earlier is not None:
            raise TriggerRefused(
                f"{job.public_id} already has a manual run for {iso_z(when)} ({earlier.public_id}); "
                "a manual run for this second exists"
            )
    while Run.objects.filter(job=job, scheduled_for=when).exists():  # rare: a second someone else has
        when += timedelta(seconds=1)
    run = Run.objects.create(
        job=job,
        scheduled_for=when,
        due_at=when,
        partition=job.partition,
        is_backfill=True,
    )
    detail = {"scheduled_for": iso_z(when), "due_at": iso_z(when), "reason": "run now"}
    events.record_many(
        [
            events.of(run, "scheduled", now, **detail),
            events.of(run, "triggered", now, by=actor_name(actor)),
        ]
    )
    audit_record(actor=actor, via=via, action="triggered", obj=job, at=now, detail={"run": run.public_id})
    return run
