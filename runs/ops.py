"""Operator services on runs: the dead list (requeue, mark handled), target holds,
pruning, a run's timeline, and the ops groups. The admin and the management
commands call these; they never write runs themselves.

Choices where the brief was open (docs/admin.md says the same for operators):

- A requeued dead run goes back to `scheduled`, due now, as an *extra* run
  (`is_backfill=True`). A dead run's job already got its next run when it died,
  so as a normal run it would break "one open run per job", and on success the
  lifecycle would try to create that next run a second time. Extra runs never
  misfire and never create a next run: exactly what a re-try of an old time needs.
- It keeps its id, scheduled_for (so the same Idempotency-Key) and fence: the next
  claim raises the fence, which shuts out any old holder. Its `attempt` goes on
  rising (X-Attempt goes up by one per call, docs/reference.md, what a target receives), while
  `attempt_base` records the calls made so far, so the job's retry policy applies
  afresh; the `requeued` event keeps the earlier count (`previous_attempts`).
- A dead run of a paused or deleted job is not requeued (it would sit held, or
  call a job that was ended); the operator resumes the job first.

Every write here records itself in the audit log (jobs.audit) in its own
transaction: `actor` is the admin's user, or None for a command (the OS user).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from jobs.audit import actor_name, audit_record
from jobs.models import Job
from jobs.validators import CELERY_KEY_PREFIX, target_host, validate_queue
from runs import events
from runs.claims import again_if_moved
from runs.delivery import iso_z
from runs.models import PausedTarget, Run, RunEvent, with_status
from runs.nextrun import is_held

S = Run.Status
READONLY_GROUP = "ops-readonly"
OPERATOR_GROUP = "ops-operator"
PRUNE_BATCH = 1000


class OpsError(ValueError):
    """Bad operator input, in words (commands turn it into CommandError)."""


# --------------------------------------------------------------------------- target hosts


def check_host(value: str) -> str:
    """HOST as written in a target URL, port included (`reports.internal`, `127.0.0.1:8080`),
    or a Celery task target's `celery:<queue>` (jobs.validators.target_key)."""
    if (value or "").strip().lower().startswith(CELERY_KEY_PREFIX):
        queue = value.strip()[len(CELERY_KEY_PREFIX):]
        try:
            validate_queue(queue)
        except ValueError as exc:
            raise OpsError(f"{value!r}: the queue {exc}") from exc
        return CELERY_KEY_PREFIX + queue
    host = (value or "").strip().lower()
    if not host:
        raise OpsError("HOST is empty; give a host as written in the target URL, like reports.internal:8443")
    if "://" in host or any(c in host for c in "/?#@ ") or target_host(f"http://{host}/") != host:
        raise OpsError(f"{value!r} is not a host; give it as written in the target URL, like reports.internal:8443")
    return host


def target_host_q(host: str, prefix: str = "") -> Q:
    """Jobs whose target's host (port included) is exactly `host`, as one SQL condition.
    The port is part of the key, so `a.test` does not match `a.test:8080`. A key
    `celery:<queue>` is the task jobs on that queue (jobs.validators.target_key)."""
    if host.startswith(CELERY_KEY_PREFIX):
        queue = host[len(CELERY_KEY_PREFIX):]
        return ~Q(**{f"{prefix}task": ""}) & Q(**{f"{prefix}queue": queue})
    pattern = rf"^https?://([^/?#@]*@)?{re.escape(host)}([/?#]|$)"
    return Q(**{f"{prefix}target__iregex": pattern})


def jobs_on_host(host: str) -> QuerySet[Job]:
    return Job.objects.filter(target_host_q(host))


# --------------------------------------------------------------------------- the dead list


def dead_runs(
    *, job_id: int | None = None, host: str | None = None, since: datetime | None = None, until: datetime | None = None
) -> QuerySet[Run]:
    """Dead runs, oldest death first; `since`/`until` bound when they died (finished_at)."""
    runs = Run.objects.filter(with_status(S.DEAD))
    if job_id is not None:
        runs = runs.filter(job_id=job_id)
    if host is not None:
        runs = runs.filter(target_host_q(host, prefix="job__"))
    if since is not None:
        runs = runs.filter(finished_at__gte=since)
    if until is not None:
        runs = runs.filter(finished_at__lt=until)
    return runs.select_related("job").order_by("finished_at", "id")


def requeue_refusal(run: Run) -> str | None:
    """Why this run cannot be requeued now, or None."""
    if run.status != S.DEAD:
        return f"{run.public_id} is {run.status}, not dead"
    if run.job.state == Job.State.DELETED:
        return f"{run.job.public_id} is deleted"
    if run.job.paused:
        return f"{run.job.public_id} is paused; resume it first"
    return None


class RetryRefused(ValueError):
    """Why a dead run cannot be put back on the queue now, in words."""


def retry_refusal(run: Run) -> str | None:
    """requeue_refusal, and also while the run's target host is paused (the API's
    retry: a run put back only to sit held would look like a retry that did nothing)."""
    reason = requeue_refusal(run)
    if reason is None and is_held(run.job):
        return f"{run.job.public_id}'s target host is paused (resume_target)"
    return reason


def _lock_run(run: Run) -> Run | None:
    return Run.objects.select_for_update().select_related("job").filter(pk=run.pk).first()


@again_if_moved
@transaction.atomic
def run_requeue_dead(*, run: Run, now: datetime | None = None, actor: Any = None, via: str = "command") -> bool:
    """A dead run gets a new round of tries, same Idempotency-Key. False: not requeued
    (it is no longer dead, or its job is paused or deleted); see requeue_refusal."""
    now = now or timezone.now()
    locked = _lock_run(run)
    if locked is None or requeue_refusal(locked) is not None:
        return False
    return _requeue_locked(locked, now=now, actor=actor, via=via)


@again_if_moved
@transaction.atomic
def run_retry(*, run: Run, now: datetime | None = None, actor: Any = None, via: str = "api") -> Run:
    """`POST /api/runs/{id}/retry/`: run_requeue_dead, deciding from the run as it is
    under the lock, and saying why not (RetryRefused) instead of returning False."""
    now = now or timezone.now()
    locked = _lock_run(run)
    if locked is None:
        raise RetryRefused(f"{run.public_id} no longer exists")
    reason = retry_refusal(locked)
    if reason is not None:
        raise RetryRefused(reason)
    if not _requeue_locked(locked, now=now, actor=actor, via=via):
        raise RetryRefused(f"{locked.public_id} changed meanwhile")  # cannot happen under the lock; be sure
    locked.refresh_from_db()
    return locked


def _requeue_locked(locked: Run, *, now: datetime, actor: Any, via: str) -> bool:
    changed = Run.objects.filter(pk=locked.pk, status=S.DEAD).update(
        status=S.SCHEDULED,
        due_at=now,
        held=is_held(locked.job),
        attempt_base=locked.attempt,
        is_backfill=True,
        finished_at=None,
        queued_at=None,
        lease_owner="",
        lease_expires_at=None,
        handled_at=None,
        handled_by="",
    )
    if changed != 1:
        return False
    events.record(
        locked.pk,
        "requeued",
        now,
        by=actor_name(actor),
        previous_attempts=locked.attempt,
        due_at=iso_z(now),
        reason="requeued from the dead list",
    )
    audit_record(
        actor=actor,
        via=via,
        action="requeued",
        obj=locked,
        at=now,
        detail={"previous_attempts": locked.attempt, "fence": locked.fence},
    )
    return True


@dataclass
class RequeueResult:
    requeued: list[Run] = field(default_factory=list)
    refused: list[tuple[Run, str]] = field(default_factory=list)


def requeue_dead(
    *, runs: Iterable[Run], actor: Any = None, via: str = "command", dry_run: bool = False, now: datetime | None = None
) -> RequeueResult:
    """Requeue each dead run that may be; say why for the others."""
    now = now or timezone.now()
    result = RequeueResult()
    for run in runs:
        reason = requeue_refusal(run)
        if reason is None and (dry_run or run_requeue_dead(run=run, now=now, actor=actor, via=via)):
            result.requeued.append(run)
        else:
            result.refused.append((run, reason or f"{run.public_id} changed meanwhile"))
    return result


@again_if_moved
@transaction.atomic
def runs_mark_handled(
    *, runs: QuerySet[Run], actor: Any = None, via: str = "admin", now: datetime | None = None
) -> int:
    """Dead runs someone has dealt with; runs already handled keep their first mark."""
    now = now or timezone.now()
    marked = list(runs.filter(with_status(S.DEAD), handled_at__isnull=True).select_for_update(of=("self",)))
    Run.objects.filter(pk__in=[r.pk for r in marked]).update(handled_at=now, handled_by=actor_name(actor)[:150])
    for run in marked:
        audit_record(actor=actor, via=via, action="handled", obj=run, at=now)
    return len(marked)


# --------------------------------------------------------------------------- target holds


@dataclass(frozen=True)
class HoldResult:
    host: str
    changed_target: bool  # the PausedTarget row was created (pause) or removed (resume)
    runs: int  # runs held (pause) or released (resume)
    jobs: int  # jobs whose target is on the host


def _waiting_runs(host: str) -> QuerySet[Run]:
    return Run.objects.filter(target_host_q(host, prefix="job__"), with_status(S.SCHEDULED, S.QUEUED))


@again_if_moved
@transaction.atomic
def target_pause(
    *, host: str, actor: Any = None, via: str = "command", dry_run: bool = False, now: datetime | None = None
) -> HoldResult:
    """Hold every waiting run (scheduled or queued; a queued one goes back to scheduled,
    so its message finds nothing to claim) of every job on HOST; new runs of those jobs
    are created held (runs.nextrun.is_held). A running call finishes."""
    now = now or timezone.now()
    host = check_host(host)
    exists = PausedTarget.objects.filter(host=host).exists()
    ids = list(_waiting_runs(host).filter(held=False).select_for_update(of=("self",)).values_list("pk", flat=True))
    jobs = jobs_on_host(host).count()
    if dry_run:
        return HoldResult(host, not exists, len(ids), jobs)
    by = actor_name(actor)
    if not exists:
        PausedTarget.objects.create(host=host, paused_by=by[:150])
    Run.objects.filter(pk__in=ids).update(held=True, status=S.SCHEDULED, queued_at=None)
    events.record_many(events.event(pk, "held", now, reason=f"target {host} paused", by=by) for pk in ids)
    if not exists or ids:  # a second pause changes nothing, and says nothing
        audit_record(actor=actor, via=via, action="paused", obj=host, at=now, detail={"runs_held": len(ids)})
    return HoldResult(host, not exists, len(ids), jobs)


@again_if_moved
@transaction.atomic
def target_resume(
    *, host: str, actor: Any = None, via: str = "command", dry_run: bool = False, now: datetime | None = None
) -> HoldResult:
    """Release HOST's held runs, except those of paused jobs (the job's own pause holds them)."""
    now = now or timezone.now()
    host = check_host(host)
    exists = PausedTarget.objects.filter(host=host).exists()
    held = _waiting_runs(host).filter(held=True, job__paused=False)
    ids = list(held.select_for_update(of=("self",)).values_list("pk", flat=True))
    jobs = jobs_on_host(host).count()
    if dry_run:
        return HoldResult(host, exists, len(ids), jobs)
    by = actor_name(actor)
    PausedTarget.objects.filter(host=host).delete()
    Run.objects.filter(pk__in=ids).update(held=False)
    events.record_many(events.event(pk, "released", now, reason=f"target {host} resumed", by=by) for pk in ids)
    if exists or ids:
        audit_record(actor=actor, via=via, action="resumed", obj=host, at=now, detail={"runs_released": len(ids)})
    return HoldResult(host, exists, len(ids), jobs)


# --------------------------------------------------------------------------- pruning


@dataclass(frozen=True)
class PruneResult:
    cutoff: datetime
    runs: int
    events: int
    dropped: tuple[str, ...] = ()  # the history partitions dropped whole (runs.partitions)


def prune_runs(
    *,
    older_than: timedelta,
    dry_run: bool = False,
    now: datetime | None = None,
    batch: int = PRUNE_BATCH,
    actor: Any = None,
    via: str = "command",
    whole_partitions_only: bool = False,
) -> PruneResult:
    """Delete finished runs (terminal statuses) that finished before now - older_than,
    with their events, `batch` runs per transaction. Never an open run.

    On the partitioned store (runs.partitions) a time partition whose span ended before
    the cutoff and whose runs all finished before it is dropped whole, first. Then the
    rows: every old run left (a partition holding a run that finished after the cutoff
    keeps its younger runs, and loses its old ones row by row) or, with
    `whole_partitions_only` (the retention upkeep, every few minutes: row deletes
    there would be a steady load), only those of the default partition; a time
    partition's old runs then wait until it can be dropped."""
    from runs import partitions

    if older_than <= timedelta(0):
        raise OpsError("the age must be more than 0s")
    now = now or timezone.now()
    cutoff = now - older_than
    partitioned = partitions.in_use()
    old = Run.objects.filter(status__in=Run.TERMINAL, finished_at__lt=cutoff)
    if dry_run:
        if partitioned and whole_partitions_only:
            runs, run_events = partitions.counted(partitions.droppable(cutoff))
            more_runs, more_events = partitions.prune_default(cutoff, list(Run.TERMINAL), batch, dry_run=True)
            return PruneResult(cutoff, runs + more_runs, run_events + more_events)
        return PruneResult(cutoff, old.count(), RunEvent.objects.filter(run__in=old).count())
    dropped = partitions.drop_older_than(cutoff) if partitioned else []
    runs, run_events = sum(d.runs for d in dropped), sum(d.events for d in dropped)
    if partitioned and whole_partitions_only:
        more_runs, more_events = partitions.prune_default(cutoff, list(Run.TERMINAL), batch)
        runs, run_events = runs + more_runs, run_events + more_events
    else:
        while True:
            with transaction.atomic():
                # Locked as read (a requeue locks the run before it reopens it, and then
                # finds it gone); a run someone holds now is left for the next prune.
                ids = list(old.order_by("finished_at").select_for_update(skip_locked=True)
                           .values_list("pk", flat=True)[:batch])
                if not ids:
                    break
                run_events += RunEvent.objects.filter(run_id__in=ids).delete()[0]
                runs += Run.objects.filter(pk__in=ids, status__in=Run.TERMINAL).delete()[0]
    _prune_rollups(cutoff)
    _analyze_partitioned_runs(dropped=bool(dropped))
    return _pruned(PruneResult(cutoff, runs, run_events, tuple(d.name for d in dropped)), now=now, actor=actor,
                   via=via)


def _pruned(result: PruneResult, *, now: datetime, actor: Any, via: str) -> PruneResult:
    if result.runs or result.dropped:
        detail: dict[str, Any] = {"runs": result.runs, "events": result.events}
        if result.dropped:
            detail["partitions dropped"] = list(result.dropped)
        audit_record(actor=actor, via=via, action="pruned", obj=("runs", f"finished before {iso_z(result.cutoff)}"),
                     at=now, detail=detail)
    return result


# When this process last analyzed `runs` (time.monotonic()), for _analyze_partitioned_runs.
_ANALYZED_AT: list[float] = []
ANALYZE_EVERY = 3600.0


def _analyze_partitioned_runs(*, dropped: bool = False) -> None:
    """ANALYZE the partitioned `runs` (PostgreSQL, migration runs 0015): autovacuum
    analyzes each partition but never the partitioned table itself, whose figures the
    planner reads for joins over it (the admin's run list joins jobs, and planned a
    sequential scan of the history without them, or with a table's of another shape:
    `test_run_reads_use_indexes` after `test_due_query_plan`). prune_runs analyzes:

    - when the table was never analyzed, or its partitions (whose figures autovacuum
      keeps) hold over twice or under half the rows its own figures say;
    - else, at most once an hour in a process, and not in a call that dropped a
      partition: ANALYZE samples every partition (seconds at 10^7 runs), and a day's
      partition dropped of many changes little."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT c.relkind, c.reltuples,
                      (SELECT coalesce(sum(greatest(p.reltuples, 0)), 0) FROM pg_inherits i
                         JOIN pg_class p ON p.oid = i.inhrelid WHERE i.inhparent = c.oid)
                 FROM pg_class c WHERE c.oid = 'runs'::regclass"""
        )
        kind, own, partitions_sum = cursor.fetchone()
        if kind != "p":
            return
        drifted = own < 0 or partitions_sum > 2 * own + 1000 or partitions_sum < own / 2
        due = not dropped and (not _ANALYZED_AT or time.monotonic() - _ANALYZED_AT[-1] > ANALYZE_EVERY)
        if drifted or due:
            cursor.execute("ANALYZE runs")
            _ANALYZED_AT[:] = [time.monotonic()]


def _prune_rollups(cutoff: datetime) -> None:
    """Per-minute rollup rows older than the cutoff go too (the all-time rows stay:
    the /metrics counters keep counting what was pruned)."""
    from runs.models import RunRollup
    from runs.rollups import TOTAL_MINUTE

    RunRollup.objects.filter(minute__lt=cutoff, minute__gt=TOTAL_MINUTE).delete()


# --------------------------------------------------------------------------- a run's timeline

# The state a run is in after each event (None: the event does not change it).
STATE_AFTER = {
    "scheduled": S.SCHEDULED,
    "queued": S.QUEUED,
    "claimed": S.RUNNING,
    "retry_scheduled": S.SCHEDULED,
    "lease_expired": S.QUEUED,
    "succeeded": S.SUCCEEDED,
    "dead": S.DEAD,
    "skipped": S.SKIPPED,
    "cancelled": S.CANCELLED,
    "rescheduled": S.SCHEDULED,
    "held": S.SCHEDULED,  # job or target paused: a queued run goes back to scheduled
    # A worker put it back before claiming: its target's breaker is open, or its bulkhead full.
    "held_by_breaker": S.SCHEDULED,
    "bulkhead_wait": S.SCHEDULED,
    "service_share_wait": S.SCHEDULED,  # its service had its share of a worker's calls in flight
}
ANSWER_KEYS = ("status", "error", "duration_ms")


@dataclass(frozen=True)
class TimelineRow:
    at: datetime
    type: str
    fence: Any
    worker: str
    answer: str
    detail: dict[str, Any]
    state: str  # the run's state from this event to the next
    seconds_in_state: float | None  # until the next event (or now, for an open run); None at the end


@dataclass(frozen=True)
class Timeline:
    rows: list[TimelineRow]
    seconds_by_state: dict[str, float]


def _state_after(event: RunEvent, state: str) -> str:
    if event.type == "requeued":
        # The scanner's "published again" keeps a queued run queued; an operator's requeue schedules it.
        return S.QUEUED if "by" not in event.detail else S.SCHEDULED
    return STATE_AFTER.get(event.type, state)


def _answer(detail: dict[str, Any]) -> str:
    if "status" in detail:
        text = f"HTTP {detail['status']}"
    elif "error" in detail:
        text = str(detail["error"])
    else:
        return ""
    return f"{text} in {detail['duration_ms']} ms" if "duration_ms" in detail else text


def run_timeline(run: Run, found: list[RunEvent], now: datetime | None = None) -> Timeline:
    """Each event with its fence, worker and the target's answer, and how long the run
    stayed in the state the event put it in; the totals per state. `found` oldest first."""
    now = now or timezone.now()
    rows: list[TimelineRow] = []
    spent: Counter[str] = Counter()
    state = S.SCHEDULED
    for i, event in enumerate(found):
        state = _state_after(event, state)
        end = found[i + 1].at if i + 1 < len(found) else (now if state in Run.OPEN else None)
        seconds = (end - event.at).total_seconds() if end is not None else None
        if seconds is not None and state in Run.OPEN:
            spent[state] += seconds
        detail = dict(event.detail or {})
        rows.append(
            TimelineRow(
                at=event.at,
                type=event.type,
                fence=detail.pop("fence", ""),
                worker=str(detail.pop("worker", "")),
                answer=_answer(detail) if event.type == "target_answered" else "",
                detail={k: v for k, v in detail.items() if not (event.type == "target_answered" and k in ANSWER_KEYS)},
                state=state,
                seconds_in_state=seconds,
            )
        )
    return Timeline(rows=rows, seconds_by_state=dict(spent))


# --------------------------------------------------------------------------- roles

VIEW = ("jobs.view_job", "runs.view_run", "runs.view_runevent", "runs.view_pausedtarget")
ACT = (
    "jobs.add_job",
    "jobs.change_job",
    "jobs.delete_job",
    "runs.change_run",
    "runs.add_pausedtarget",
    "runs.change_pausedtarget",
    "runs.delete_pausedtarget",
)


def ensure_ops_groups(**_: Any) -> None:
    """The two ops groups and their permissions (a post_migrate handler, so a fresh
    database has them after `migrate`; running it again changes nothing)."""
    from django.contrib.auth.models import Group, Permission

    def perms(names: tuple[str, ...]) -> list[Permission]:
        wanted = [tuple(name.split(".", 1)) for name in names]
        query = Q()
        for app, codename in wanted:
            query |= Q(content_type__app_label=app, codename=codename)
        return list(Permission.objects.filter(query))

    readonly, _ = Group.objects.get_or_create(name=READONLY_GROUP)
    readonly.permissions.add(*perms(VIEW))
    operator, _ = Group.objects.get_or_create(name=OPERATOR_GROUP)
    operator.permissions.add(*perms(VIEW + ACT))
