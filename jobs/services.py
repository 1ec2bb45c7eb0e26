"""Writes on jobs. Keyword-only, typed; views, admin and commands call these."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from jobs import schedule
from jobs.models import Job
from jobs.secrets import encrypt_headers, split_headers
from jobs.validators import target_host
from runs import events
from runs.claims import again_if_moved
from runs.delivery import iso_z
from runs.models import JOBS_OPEN_RUN, Run
from runs.nextrun import (
    EXCLUDED_PREFIX,
    excluded_times_skip,
    is_held,
    job_next_run,
    job_next_run_plan,
    job_next_run_time,
    job_next_runs,
    jobs_lock,
    run_create,
)

S = Run.Status
# Fields whose change replaces the waiting run.
TIMING_FIELDS = frozenset({
    "schedule", "schedule_list", "every_seconds", "timezone", "run_at", "window_seconds",
    "starts_at", "ends_at", "exclude",
})
# The kinds of timing: a job has exactly one; setting one clears the others.
TIMING_KINDS = {"schedule": "", "schedule_list": [], "every_seconds": None, "run_at": None}


class BackfillError(ValueError):
    pass


def first_run_time(job: Job, now: datetime) -> datetime:
    """The first run's time of a job whose timing starts at `now` (job_next_run_time's
    rule); None when its timetable has no time left (past its ends_at)."""
    return job_next_run_time(job, latest=None, since=now, now=now)


def _one_timing(fields: dict[str, Any]) -> None:
    """A field of one kind of timing given (a value, not a blank) clears the others'."""
    given = [name for name in TIMING_KINDS if fields.get(name)]
    if len(given) == 1:
        for name, blank in TIMING_KINDS.items():
            if name != given[0]:
                fields.setdefault(name, blank)


def _apply_headers(job: Job, headers: dict[str, str] | None, secret_names: list[str] | None) -> None:
    if secret_names is not None:
        job.secret_header_names = list(secret_names)
    if headers is not None:
        plain, secret = split_headers(headers, job.secret_header_names)
        job.headers = plain
        job.secret_headers = encrypt_headers(secret)


def job_build(*, owner: Any, fields: dict[str, Any]) -> Job:
    """The unsaved job `fields` (JobSerializer.service_fields()) describe: what
    job_create saves, and what sync_jobs compares a stored job with."""
    fields = dict(fields)
    headers = fields.pop("headers", None)
    secret_names = fields.pop("secret_headers", None)
    job = Job(owner=owner, **fields)
    _apply_headers(job, headers or {}, secret_names or [])
    job.state = Job.State.PAUSED if job.paused else Job.State.ACTIVE
    return job


@transaction.atomic
def job_create(*, owner: Any, fields: dict[str, Any], now: datetime | None = None) -> Job:
    """The job and its first run, in one transaction."""
    now = now or timezone.now()
    _check_job_cap(owner)
    job = job_build(owner=owner, fields=fields)
    job.save()
    if job.every_seconds:
        # An `every` job counts from its creation (when it has no starts_at): the
        # instant of this write, not auto_now_add's own reading of the clock.
        Job.objects.filter(pk=job.pk).update(created_at=now)
        job.created_at = now
    if job_next_run(job=job, now=now, since=now) is None:
        job.refresh_from_db(fields=["state", "updated_at"])  # no time left (past ends_at): completed
    return job


@transaction.atomic
def jobs_create_many(*, jobs: list[Job], now: datetime | None = None) -> list[Job]:
    """job_create for many unsaved jobs (job_build's) at once: the cap checked per
    owner, the jobs inserted together, their first runs decided together by
    job_next_runs (the same rule as job_create's). For sync_jobs' thousand jobs."""
    now = now or timezone.now()
    adding: dict[Any, int] = {}
    owners = {}
    for job in jobs:
        adding[job.owner_id] = adding.get(job.owner_id, 0) + 1
        owners[job.owner_id] = job.owner
    for owner_id in sorted(adding):
        _check_job_cap(owners[owner_id], adding=adding[owner_id])
    created = Job.objects.bulk_create(jobs, batch_size=500)
    every = [job.pk for job in created if job.every_seconds]
    if every:  # an `every` job counts from this write's instant, as in job_create
        Job.objects.filter(pk__in=every).update(created_at=now)
    _, found = job_next_runs(jobs=list(jobs_lock([j.pk for j in created]).values()), now=now, since=now)
    events.record_many(found)
    return created


def _check_job_cap(owner: Any, adding: int = 1) -> None:
    """SCHEDULER_MAX_JOBS_PER_SERVICE: jobs not deleted count. The owner's row is
    locked first, so two creates at the cap cannot both pass."""
    from django.contrib.auth import get_user_model

    limit = settings.SCHEDULER_MAX_JOBS_PER_SERVICE
    list(get_user_model().objects.select_for_update().filter(pk=owner.pk).values_list("pk"))
    count = Job.objects.filter(owner=owner).exclude(state=Job.State.DELETED).count()
    if count + adding > limit:
        has = f"already has {count} jobs" if adding == 1 else f"has {count} jobs, and {adding} more would be over"
        raise ValueError(
            f"{owner.get_username()} {has}, the most one service may have "
            f"(SCHEDULER_MAX_JOBS_PER_SERVICE={limit}); delete jobs it no longer needs first"
        )


def open_run(job: Job, *, lock: bool = False) -> Run | None:
    query = Run.objects.filter(JOBS_OPEN_RUN, job=job)
    if lock:
        query = query.select_for_update()
    return query.first()


@again_if_moved
@transaction.atomic
def job_update(*, job: Job, fields: dict[str, Any], now: datetime | None = None, by_owner: bool = True) -> Job:
    """PATCH: change fields; a changed schedule, zone, time or window replaces the waiting run;
    `paused` pauses or resumes. An edit not made by the owning service (`by_owner`
    False: the admin, staff through the API) that moves the target to another host
    drops the stored secret headers: they were the owner's to send there, and an
    operator must not be able to send them to a URL of their choosing (they can be
    entered again by a later edit)."""
    now = now or timezone.now()
    fields = dict(fields)
    job = Job.objects.select_for_update().get(pk=job.pk)
    if job.state == Job.State.DELETED:
        raise ValueError("the job is deleted")
    paused = fields.pop("paused", None)
    new_host = "target" in fields and target_host(fields["target"] or "") != target_host(job.target or "")
    _apply_headers(job, fields.pop("headers", None), fields.pop("secret_headers", None))
    if new_host and not by_owner:
        job.secret_headers = ""
    _one_timing(fields)
    changed = {k for k, v in fields.items() if k in TIMING_FIELDS and getattr(job, k) != v}
    timing_changed = bool(changed)
    for key, value in fields.items():
        setattr(job, key, value)
    if changed - {"window_seconds"}:
        job.timing_changed_at = now
    job.save()
    if changed - {"window_seconds"}:
        _cancel_excluded_ahead(job, now)
    if timing_changed and job.state != Job.State.COMPLETED:
        _replace_waiting_run(job, now)
    if job.state == Job.State.COMPLETED and (job.is_recurring and timing_changed or "run_at" in changed):
        # A new schedule, or a new time for a one-off that has run, starts it again
        # (a new window or zone alone does not: the one-off's time has been).
        job.state = Job.State.PAUSED if job.paused else Job.State.ACTIVE
        job.save(update_fields=["state", "updated_at"])
        if open_run(job) is None:
            _next_run_after_edit(job, now)
    if paused is True and not job.paused:
        job_pause(job=job, now=now)
    elif paused is False and job.paused:
        job_resume(job=job, now=now)
    job.refresh_from_db()
    return job


def _cancel_excluded_ahead(job: Job, now: datetime) -> None:
    """The `skipped` rows of excluded times still ahead were the old timing's: they are
    cancelled (a cancelled row is opened again if the new timing runs at that time)."""
    ahead = Run.objects.filter(
        job=job, status=S.SKIPPED, is_backfill=False, scheduled_for__gt=now, last_error__startswith=EXCLUDED_PREFIX
    )
    ids = list(ahead.values_list("pk", flat=True))
    Run.objects.filter(pk__in=ids).update(status=S.CANCELLED)
    events.record_many(events.event(pk, "cancelled", now, reason="the job's timing changed") for pk in ids)


def _replace_waiting_run(job: Job, now: datetime) -> None:
    """A changed timing: the waiting run (not yet on its way) makes way for the run
    the new timing gives, from the edit on (runs.nextrun.job_next_run decides it).
    A run queued, running or retrying stays; its end makes the next run, under the
    new timing (the worker's outcome reads the job again)."""
    waiting = open_run(job, lock=True)
    if waiting is not None and (waiting.status != S.SCHEDULED or waiting.attempt > 0):
        return  # on its way or retrying: the new timing applies from the next run on
    new_time = first_run_time(job, now)
    if waiting is not None and waiting.scheduled_for == new_time:
        # Same time (only the window changed, or the same schedule spelt differently,
        # or a new timing that comes to the same next time): a new row would break
        # runs_one_run_per_time, so re-spread this one. The excluded times the new
        # timing passes over before it still get their rows.
        plan = job_next_run_plan(job, latest=None, since=now, now=now)
        events.record_many(excluded_times_skip([(job, plan)], now))
        due_at = schedule.spread_due_at(job.pk, new_time, timedelta(seconds=job.window_seconds))
        if due_at != waiting.due_at:
            Run.objects.filter(pk=waiting.pk).update(due_at=due_at)
            events.record(waiting.pk, "rescheduled", now, due_at=iso_z(due_at), reason="the job's window changed")
        return
    if waiting is not None:
        Run.objects.filter(pk=waiting.pk).update(status=S.CANCELLED, finished_at=now)
        events.record(waiting.pk, "cancelled", now, reason="the job's timing changed")
    _next_run_after_edit(job, now)


def _next_run_after_edit(job: Job, now: datetime) -> Run | None:
    """The job's next run under its new timing, from the edit on (job_next_run). A
    one-off's new time that already has a run that happened (or an extra run) is a
    ValueError, so the caller hears why (the API's 400); a cron time that has one
    is covered by it, and job_next_run moves on to the next."""
    if not job.is_recurring:
        earlier = Run.objects.filter(job=job, scheduled_for=job.run_at).exclude(status=S.CANCELLED).first()
        if earlier is not None:
            raise ValueError(
                f"{job.public_id} already has a run at {iso_z(earlier.scheduled_for)} ({earlier.status}); "
                "choose another time"
            )
    return job_next_run(job=job, now=now, since=now, reason="the job's timing changed")


def _live(job: Job) -> models.QuerySet[Job]:
    return Job.objects.filter(pk=job.pk, state__in=(Job.State.ACTIVE, Job.State.PAUSED))


def _waiting_runs(job: Job) -> models.QuerySet[Run]:
    """Every run of the job not yet on its way: its own waiting run, and its extra
    runs (backfills, run-now, dead runs requeued)."""
    return Run.objects.filter(job=job, status__in=(S.SCHEDULED, S.QUEUED))


@again_if_moved
@transaction.atomic
def job_pause(*, job: Job, now: datetime | None = None) -> Job:
    """Every waiting run of the job (its own, and its backfills and run-now runs) is
    held; a run already running finishes, and what follows it is created held."""
    now = now or timezone.now()
    Job.objects.filter(pk=job.pk).update(paused=True, updated_at=now)  # locks the job first
    # Only a live job's state follows `paused`: a completed or deleted one keeps its state.
    _live(job).update(state=Job.State.PAUSED)
    ids = list(_waiting_runs(job).filter(held=False).select_for_update().values_list("pk", flat=True))
    # A queued one goes back to scheduled: its message then finds nothing to claim.
    Run.objects.filter(pk__in=ids).update(held=True, status=S.SCHEDULED, queued_at=None)
    events.record_many(events.event(pk, "held", now, reason="job paused") for pk in ids)
    job.refresh_from_db()
    return job


@again_if_moved
@transaction.atomic
def job_resume(*, job: Job, now: datetime | None = None) -> Job:
    """Every run the pause held is released (unless its target host is paused); the
    scanner applies the misfire policy to one that is late. A live job with no
    waiting run of its own gets one (job_next_run). Its paused_until is cleared."""
    now = now or timezone.now()
    # Resumed, by hand or at its paused_until: a resume time no longer applies.
    Job.objects.filter(pk=job.pk).update(paused=False, paused_until=None, updated_at=now)  # locks the job first
    _live(job).update(state=Job.State.ACTIVE)
    job.refresh_from_db()
    if not is_held(job):  # else its target host is paused: target_resume releases them
        ids = list(_waiting_runs(job).filter(held=True).select_for_update().values_list("pk", flat=True))
        Run.objects.filter(pk__in=ids).update(held=False)
        events.record_many(events.event(pk, "released", now, reason="job resumed") for pk in ids)
    if job.state == Job.State.ACTIVE and open_run(job) is None:
        job_next_run(job=job, now=now)
    return job


def job_resume_due(*, job_id: int, now: datetime) -> Job | None:
    """A paused job whose paused_until has come resumes (job_resume), with an audit
    entry `resumed` (actor: the scheduler). None when it is not due (resumed, paused
    again without a time, or deleted meanwhile) or another transaction holds it (the
    next scan looks again). The caller's transaction."""
    from jobs.audit import audit_record
    from runs.outcomes import SCHEDULER_ACTOR

    job = (
        Job.objects.select_for_update(skip_locked=True)
        .filter(pk=job_id, paused=True, paused_until__lte=now)
        .exclude(state=Job.State.DELETED)
        .first()
    )
    if job is None:
        return None
    until = job.paused_until
    job = job_resume(job=job, now=now)
    audit_record(actor=SCHEDULER_ACTOR, via="command", action="resumed", obj=job, at=now,
                 detail={"reason": "paused_until", "paused_until": iso_z(until) if until else None})
    return job


@again_if_moved
@transaction.atomic
def job_delete(*, job: Job, now: datetime | None = None) -> None:
    """Ends the job: its waiting run is cancelled; history stays readable.
    A run already running finishes, and no next run follows it. A resume time goes
    with it (the store refuses a deleted job that keeps one: jobs_deleted_no_resume),
    so the scanner's resume read never meets a deleted job."""
    now = now or timezone.now()
    Job.objects.filter(pk=job.pk).update(state=Job.State.DELETED, deleted_at=now, updated_at=now, paused_until=None)
    for run in Run.objects.select_for_update().filter(job=job, status__in=(S.SCHEDULED, S.QUEUED)):
        Run.objects.filter(pk=run.pk).update(status=S.CANCELLED, finished_at=now, queued_at=None)
        events.record(run.pk, "cancelled", now, reason="job deleted")


@dataclass(frozen=True)
class BackfillPlan:
    times: list[datetime]  # times that get a run
    existing: int  # times in range that already had a run


def backfill_plan(*, job: Job, since: datetime, until: datetime, now: datetime,
                  before_created: bool = False) -> BackfillPlan:
    """The runs a job would have had in [since, until), up to now, less those that exist.
    `before_created`: times before the job was created too (a migration's gap, a past
    DST night), which are otherwise refused."""
    if job.state == Job.State.DELETED:
        raise BackfillError(f"{job.public_id} is deleted")
    if until <= since:
        raise BackfillError("--until must be after --since")
    created = job.created_at.replace(microsecond=0)
    if since < created and not before_created:
        # A job has no runs from before it existed; filling them in silently would call
        # the target for times nobody asked for: only when asked (--before-created).
        raise BackfillError(
            f"--since {iso_z(since)} is before {job.public_id} was created ({iso_z(created)}); "
            f"give --since {iso_z(created)} or later, or --before-created to fill the times before it too"
        )
    end = min(until, now)
    if job.is_recurring:
        wanted: list[datetime] = []
        timetable = job.timetable()
        for t in schedule.timetable_times(timetable, since - timedelta(seconds=1)):
            if t >= end:
                break
            if timetable.is_excluded(t):
                continue  # not a time the job runs at
            wanted.append(t)
            if len(wanted) > settings.SCHEDULER_BACKFILL_MAX_RUNS:
                raise BackfillError(
                    f"the range holds more than {settings.SCHEDULER_BACKFILL_MAX_RUNS} runs "
                    "(SCHEDULER_BACKFILL_MAX_RUNS); backfill a shorter range at a time"
                )
    else:
        wanted = [job.run_at] if job.run_at and since <= job.run_at < end else []
    have = set(Run.objects.filter(job=job, scheduled_for__in=wanted).values_list("scheduled_for", flat=True))
    return BackfillPlan(times=[t for t in wanted if t not in have], existing=len(have))


@transaction.atomic
def job_backfill(*, job: Job, times: list[datetime], now: datetime | None = None) -> list[Run]:
    """Create backfill runs; a time that got a run meanwhile is left alone."""
    now = now or timezone.now()
    # The job as it is now, locked: a pause or a delete that lands meanwhile is seen
    # (a backfill of a paused job is created held; of a deleted one, not at all).
    job = Job.objects.select_for_update().get(pk=job.pk)
    if job.state == Job.State.DELETED:
        raise BackfillError(f"{job.public_id} is deleted")
    created = []
    for t in times:
        if Run.objects.filter(job=job, scheduled_for=t).exists():
            continue
        created.append(run_create(job=job, scheduled_for=t, now=now, is_backfill=True, reason="backfill"))
    return created


@transaction.atomic
def service_account_ensure(*, name: str, email: str = "") -> tuple[Any, str]:
    """Create (or find) the service account NAME and make it a new API token;
    returns (user, that token). Tokens are stored hashed (jobs.tokens), so a token
    can only be handed out when it is made; the service's earlier tokens keep working.

    Its user has no usable password and is not staff: it cannot log into the admin.
    """
    from django.contrib.auth import get_user_model

    from jobs.models import ServiceAccount
    from jobs.tokens import token_issue
    from runs.signing import signing_secret_ensure

    user_model = get_user_model()
    user, created = user_model.objects.get_or_create(username=name, defaults={"email": email})
    if created:
        user.set_unusable_password()
        user.save(update_fields=["password"])
    elif user.is_staff or user.is_superuser or user.has_usable_password():
        raise ValueError(f"{name!r} is a person's account, not a service account")
    account, _ = ServiceAccount.objects.get_or_create(user=user)
    signing_secret_ensure(service=account)  # its first X-Signature key (runs.signing)
    return user, token_issue(user=user)


@transaction.atomic
def service_tasks_grant(*, name: str, prefixes: list[str], revoke: bool = False) -> tuple[list[str], list[str]]:
    """Add (or, with `revoke`, remove) Celery task prefixes on service NAME's grants.
    Returns (the prefixes that changed, the grants now). A ValueError in words for a
    bad prefix or an unknown service; nothing is written then.

    Revoking takes effect on runs already waiting too: the worker checks the grant
    again before it publishes (runs.publishing), and a run whose task is no longer
    granted ends dead with the reason."""
    from jobs.models import ServiceAccount
    from jobs.validators import MAX_TASK_PREFIXES, validate_task_prefix

    if not prefixes:
        raise ValueError("give at least one PREFIX, like billing.")
    for prefix in prefixes:
        validate_task_prefix(prefix)
    account = ServiceAccount.objects.select_for_update().filter(user__username=name).first()
    if account is None:
        raise ValueError(f"there is no service account {name!r} (create_service_token makes one)")
    now = [p for p in account.task_prefixes if isinstance(p, str)]
    if revoke:
        changed = [p for p in dict.fromkeys(prefixes) if p in now]
        now = [p for p in now if p not in changed]
    else:
        changed = [p for p in dict.fromkeys(prefixes) if p not in now]
        now = now + changed
    if len(now) > MAX_TASK_PREFIXES:
        raise ValueError(f"{name} would hold {len(now)} task prefixes; the most is {MAX_TASK_PREFIXES}")
    account.task_prefixes = now
    account.save(update_fields=["task_prefixes"])
    return changed, now
