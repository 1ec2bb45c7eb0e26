"""What must always hold of the run store, and of what a target applied.

Shared by the soak (bench/soak.py) and the tests. Each check returns a list of
violations in words; an empty list means it holds. Checks read the store, they
never change it.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Count, F

from jobs.public_ids import format_id

from runs.models import JOBS_OPEN_RUN, OPEN_KEPT_FOR, Run, RunEvent, with_status
from runs.timeline import ON_ROW_FIELDS, made_by, on_row_entries

S = Run.Status
TERMINAL_EVENTS = frozenset({"succeeded", "dead", "skipped", "cancelled"})
# The writes a lease holder makes under its fence; the store takes them only from the current one.
OUTCOME_EVENTS = frozenset({"succeeded", "dead", "retry_scheduled"})
# Events that move a run from one status to another (a superseded holder's are not among them).
LIFECYCLE_EVENTS = TERMINAL_EVENTS | {
    "scheduled", "queued", "claimed", "retry_scheduled", "lease_expired", "requeued", "misfired",
    "bulkhead_wait", "service_share_wait", "held_by_breaker", "held", "released", "rescheduled",
}
# The store takes a lease back only when it ran out: the scanner's recovery, or a
# worker putting an expired run back to wait for its target.
TAKEN_BACK = frozenset({"lease_expired", "bulkhead_wait", "service_share_wait", "held_by_breaker"})
# Two writers can touch one run at once (a scanner recovering it while a worker claims
# it): each stamps `at` before its statement may wait on the other's row lock, so
# id order and `at` order can disagree by that wait. Anything more is a bug.
CLOCK_SLACK = timedelta(seconds=2)
TIMELINE_CHUNK = 5_000  # runs read at a time by timelines()


@dataclass(frozen=True)
class Event:
    id: int
    at: datetime
    type: str
    detail: dict[str, Any]


def one_open_run_per_job() -> list[str]:
    """Every job has at most one open run of its own (JOBS_OPEN_RUN), backfills and
    detached runs (overlap `allow`: in flight beside it) apart."""
    rows = (
        Run.objects.filter(JOBS_OPEN_RUN)
        .values("job_id")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
    )
    return [f"job_{r['job_id']} has {r['n']} open runs" for r in rows]


def kept_for_rule() -> list[str]:
    """Every run's kept_for (the history's key) follows its status: OPEN_KEPT_FOR while
    open, its scheduled_for once ended (runs.models.kept_for_of). The store keeps it (a
    trigger; on PostgreSQL a check constraint too): a violation means that broke."""
    wrong = Run.objects.filter(status__in=Run.OPEN).exclude(kept_for=OPEN_KEPT_FOR).union(
        Run.objects.exclude(status__in=Run.OPEN).exclude(kept_for=F("scheduled_for"))
    )
    return [f"{format_id('run', pk)} is {status} with kept_for {kept_for:%Y-%m-%dT%H:%M:%SZ}"
            for pk, status, kept_for in wrong.values_list("pk", "status", "kept_for")]


def timelines(run_ids: Iterable[int] | None = None) -> list[str]:
    """Every run's timeline is in order (see timeline_violations): its event rows and
    the entries on its run row (runs.timeline), which come after every row of their run.

    The runs are read in id order, CHUNK at a time, each chunk with its rows and its
    next runs: memory stays flat and the work linear however many runs the store holds
    (a soak under load has hundreds of thousands, most with no row at all)."""
    runs = Run.objects.all() if run_ids is None else Run.objects.filter(pk__in=list(run_ids))
    problems: list[str] = []
    after = 0
    while True:
        chunk = list(runs.filter(pk__gt=after).order_by("pk").only("status", *ON_ROW_FIELDS)[:TIMELINE_CHUNK])
        if not chunk:
            break
        after = chunk[-1].pk
        found: dict[int, list[Event]] = defaultdict(list)
        rows = RunEvent.objects.filter(run_id__in=[run.pk for run in chunk]).order_by("run_id", "id")
        for run_id, pk, at, type_, detail in rows.values_list("run_id", "id", "at", "type", "detail").iterator():
            found[run_id].append(Event(pk, at, type_, detail or {}))
        carrying = [run for run in chunk if run.on_row]
        next_runs = made_by(carrying)
        for run in carrying:
            # As if their ids were the highest (id 0 in the messages: they have none).
            found[run.pk] += [Event(0, e.at, e.type, e.detail) for e in on_row_entries(run, next_runs)]
        for run in chunk:
            problems += [f"run_{run.pk}: {p}" for p in timeline_violations(run.status, found.get(run.pk, []))]
    return problems


def timeline_violations(status: str, events: list[Event]) -> list[str]:
    """One run's timeline, events in id order (the entries on its row last):

    - `at` never goes backwards (beyond CLOCK_SLACK), a superseded holder's late
      events apart;
    - claims hand out strictly rising fences, and strictly rising attempts (a dead
      run requeued by an operator goes on counting: runs.ops);
    - every outcome (succeeded, dead, retry_scheduled) was written under the fence
      of the latest claim: the store never takes a superseded holder's write;
    - a stale_write_rejected names an older fence, or a lease the store took back
      (lease_expired, or a deferral of an expired lease): the holder of a live lease
      is never shut out;
    - a run in a terminal status has that status's event as its last lifecycle event.
    """
    problems: list[str] = []
    latest_fence, latest_attempt = 0, 0
    latest_at: datetime | None = None
    last_lifecycle = ""
    taken_back = False  # the store took the latest lease back (it ran out)
    for event in events:
        fence = event.detail.get("fence")
        # A superseded holder: a later claim raised the fence, or the store took its
        # lease back and nobody has claimed the run since. Such a holder writes late,
        # stamped by the clock it read when its call answered: a worker cut off from
        # the store mid-call wrote its answer and its refused outcome 4 s after the
        # scanner's `lease_expired`, stamped before it (the soak under load, 2026-12-02).
        superseded = isinstance(fence, int) and (fence < latest_fence or (taken_back and fence == latest_fence))
        if latest_at is not None and event.at < latest_at - CLOCK_SLACK and not superseded:
            problems.append(f"event {event.id} {event.type} at {event.at:%H:%M:%S.%f} is before {latest_at:%H:%M:%S.%f}")
        if not superseded:
            latest_at = max(latest_at or event.at, event.at)
        if event.type == "claimed":
            attempt = event.detail.get("attempt", latest_attempt + 1)
            if not isinstance(fence, int) or fence <= latest_fence:
                problems.append(f"claim {event.id} has fence {fence} after fence {latest_fence}")
            if isinstance(attempt, int) and attempt <= latest_attempt:
                problems.append(f"claim {event.id} has attempt {attempt} after attempt {latest_attempt}")
            latest_fence = max(latest_fence, fence if isinstance(fence, int) else 0)
            latest_attempt = max(latest_attempt, attempt if isinstance(attempt, int) else 0)
            taken_back = False
        elif event.type in TAKEN_BACK:
            taken_back = True
        elif event.type in OUTCOME_EVENTS and isinstance(fence, int) and fence != latest_fence:
            problems.append(f"{event.type} {event.id} written under fence {fence}, but fence {latest_fence} held the lease")
        elif event.type == "stale_write_rejected" and isinstance(fence, int) and fence >= latest_fence \
                and not taken_back:
            problems.append(f"stale_write_rejected {event.id} refused fence {fence}, the holder of a live lease")
        if event.type in LIFECYCLE_EVENTS and not (superseded and event.type in OUTCOME_EVENTS):
            last_lifecycle = event.type
    if status in Run.TERMINAL and events and last_lifecycle != status:
        problems.append(f"status {status} but its last lifecycle event is {last_lifecycle or 'none'}")
    return problems


def due_runs_settled(*, cutoff: datetime) -> list[str]:
    """Every run due by `cutoff` is terminal or running: not still waiting to be
    queued or claimed, and not running on a lease that ran out with nobody taking it
    over. Held runs (a paused job or target) wait on purpose and are left out."""
    waiting = Run.objects.filter(with_status(S.SCHEDULED, S.QUEUED), held=False, due_at__lte=cutoff)
    orphaned = Run.objects.filter(with_status(S.RUNNING), lease_expires_at__lt=cutoff)
    problems = [f"run_{pk} is {status}, due at {due:%H:%M:%S}" for pk, status, due in
                waiting.values_list("pk", "status", "due_at")]
    problems += [f"run_{pk} is running on a lease that ran out at {until:%H:%M:%S}" for pk, until in
                 orphaned.values_list("pk", "lease_expires_at")]
    return problems


# --------------------------------------------------------------------------- what targets applied


@dataclass(frozen=True)
class Applied:
    """One effect a target applied, as the target recorded it."""

    key: str  # the Idempotency-Key
    fence: int


def effects_applied_once(applied: Iterable[Applied]) -> list[str]:
    """No run's effect was applied twice, by two attempts under different fences or
    by the same one twice."""
    fences: dict[str, list[int]] = defaultdict(list)
    for effect in applied:
        fences[effect.key].append(effect.fence)
    return [f"{key} applied {len(f)} times, under fences {sorted(f)}" for key, f in fences.items() if len(f) > 1]


def succeeded_runs_applied(applied: Iterable[Applied], run_ids: Iterable[int] | None = None) -> list[str]:
    """Every succeeded run's effect was applied: a 2xx from the current holder is
    either the application or the replay of one.

    On PostgreSQL the applied keys go into a temporary table (COPY) and the succeeded
    runs without one are found by one anti-join, the key worked out in SQL as
    Run.idempotency_key does: set-based, for hundreds of thousands of runs."""
    keys = {effect.key for effect in applied}
    if connection.vendor != "postgresql":
        return _succeeded_runs_applied_rows(keys, run_ids)
    where, params = "", []  # type: ignore[var-annotated]
    if run_ids is not None:
        where, params = " AND r.id = ANY(%s)", [list(run_ids)]
    with transaction.atomic(), connection.cursor() as cursor:
        # Dropped at the end, and first too: inside a test's transaction an earlier call's may linger.
        cursor.execute("DROP TABLE IF EXISTS invariants_applied_keys")
        cursor.execute("CREATE TEMPORARY TABLE invariants_applied_keys (key text PRIMARY KEY)")
        with cursor.cursor.copy("COPY invariants_applied_keys (key) FROM STDIN") as copy:
            for key in keys:
                copy.write_row((key,))
        cursor.execute(
            f"SELECT r.id, r.job_id, {IDEMPOTENCY_KEY_SQL} FROM runs r WHERE r.status = %s{where}"
            f" AND NOT EXISTS (SELECT 1 FROM invariants_applied_keys a WHERE a.key = {IDEMPOTENCY_KEY_SQL})"
            " ORDER BY r.id",
            [S.SUCCEEDED, *params],
        )
        missing = cursor.fetchall()
        cursor.execute("DROP TABLE invariants_applied_keys")
    return [f"{format_id('run', pk)} ({key}) succeeded but its target never applied it" for pk, _, key in missing]


# Run.idempotency_key, in SQL over `runs r`.
IDEMPOTENCY_KEY_SQL = ("('job_' || r.job_id || '@' || "
                       "to_char(r.scheduled_for AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'))")


def _succeeded_runs_applied_rows(keys: set[str], run_ids: Iterable[int] | None) -> list[str]:
    runs = Run.objects.filter(status=S.SUCCEEDED).select_related("job")
    if run_ids is not None:
        runs = runs.filter(pk__in=list(run_ids))
    return [f"{run.public_id} ({run.idempotency_key}) succeeded but its target never applied it"
            for run in runs.iterator() if run.idempotency_key not in keys]
