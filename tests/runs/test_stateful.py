"""The model-based test of issue 12's two promises ("every due run starts", "effect once")
under any interleaving of user actions with the run path.

A hypothesis `RuleBasedStateMachine` drives the real services on real PostgreSQL:
job create (cron, one-off `at`, `delay`, each misfire policy, windows), edit of
schedule / zone / target, pause, resume, delete, run now, backfill, the clock (the one
thing mocked: time_machine, frozen and moved by the rules), one scan, a worker batch
(`run_execute_many` against a real loopback target whose answer the rule chooses), and
the run path split in two so that anything can happen between a claim and its outcome
(a claim in one rule; the call and the outcome in a later one), lease expiry (the clock
past the lease, then a scan) and a second holder.

The reference model (`ModelJob`) is small on purpose: per job, the list of its timings
(a `Segment` per creation or timing edit: cron or one-off time, zone, from when), its
misfire policy and window, whether it is paused or deleted, and the runs that were in
flight at an edit (they keep the old timing). From that it says which runs must exist:
each time of a segment, from the segment's start up to the job's latest run in it, has
a row (a run, or a `skipped`/`cancelled` row with a reason); a job that is live has
exactly one open normal run, at a time of its current timing after the edit; a paused
or deleted job has nothing claimable. What it leaves out: which of run / skipped a time
gets (that is the misfire policy's, checked only through its grace rule), due_at
spreading inside the window, retry delays, the dead list's requeue, target pauses,
breakers and bulkheads (the breaker is set out of reach), and times that passed while
a run was in flight before an edit (no row is required for those).

The run lifecycle's job policies are in it too: `overlap` (skip, buffer_one; changed
by an edit rule): a `skipped` row with reason overlap is a time that passed while a run
of its job was in flight (from that run's claim to its outcome, written by that
outcome), and the run that outcome made is the next future time (skip) or the latest
passed one (buffer_one); `pause_after_failures`: the model counts each job's normal
runs that ended dead in a row (a success starts again) and says when the job has
paused itself (with its audit entry); `paused_until`: a rule pauses a job until a time,
and the first scan at or after it resumes it (with its audit entry).

And where features meet: schedule lists (the union of their times), a job deleted
while paused until a time (a deleted job keeps no resume time), the retry of a dead run
(an extra run, outside the timetable), and a mixed batch: runs of jobs with a slow and
a fast endpoint on one host in one message, the slow one answering only after the
clock has moved on; each outcome is stamped at its own answer (runs.flights), so the
fast job's next times are not taken for overlaps.

Run it longer with `--hypothesis-profile=long` (tests/conftest.py registers the profiles).
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Any, Iterator
from zoneinfo import ZoneInfo

import pytest
import time_machine
from unittest import mock
from django.conf import settings as django_settings
from django.db import connection
from django.db.models import Max
from django.test import override_settings
from django.utils import timezone
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from jobs import schedule
from jobs.models import AuditEntry, Job
from jobs.ops import TriggerRefused, job_trigger
from jobs.public_ids import format_id
from jobs.services import (
    BackfillError,
    job_backfill,
    job_create,
    job_delete,
    job_pause,
    job_resume,
    job_update,
    backfill_plan,
    service_account_ensure,
)
from runs import claims, nextrun
from runs import ops as run_ops
from runs import services as run_services
from runs.models import JOBS_OPEN_RUN, Run, RunEvent, kept_for_of
from runs.timeline import timelines
from runs.outcomes import Call, run_record_outcomes
from runs.services import lease_length, run_claim_many, run_execute_many
from scanners.scan import scan_once
from tests.factories import utc
from tests.target import LoopbackTarget

S = Run.Status
T0 = utc("2026-10-28T20:29:30Z")
SCHEDULES = ["*/5 * * * *", "*/2 * * * *", "0 * * * *", "0 0 1 1 *", "30 21 * * *"]
# Schedule lists (the union of their times; a time two of them share runs once).
SCHEDULE_LISTS = [("*/5 * * * *", "*/2 * * * *"), ("0 * * * *", "30 21 * * *"), ("*/5 * * * *", "0 * * * *")]
# An edit goes to a frequent schedule more often than not: a sparse schedule edited to a
# frequent one is where a lost run shows soonest (issue 12, defect 1).
EDITED_SCHEDULES = ["*/5 * * * *", "*/2 * * * *", "*/5 * * * *", "0 * * * *", "0 0 1 1 *", "30 21 * * *"]
ZONES = ["UTC", "Europe/London", "America/New_York"]
# Excluded dates around T0 (in the job's zone): none most often, the first day, the next, both.
EXCLUDES = [(), (), ("2026-10-28",), ("2026-10-29",), ("2026-10-28", "2026-10-29")]
EVERY_SECONDS = [120, 300, 3600, 420]


def _dates(days: list[str] | tuple[str, ...]) -> frozenset[date]:
    return frozenset(date.fromisoformat(d) for d in days)
MISFIRES = ["skip", "run_once", "run_all"]
OVERLAPS = ["skip", "buffer_one", "allow"]
IN_FLIGHT = "passed while the job's run was in flight"  # the start of an overlap row's last_error
ANSWERS = {"ok": (200, 0.0), "fail": (500, 0.0), "hang": (200, 1.3)}  # hang: past the 1 s timeout
OUTCOME_EVENTS = ("succeeded", "dead", "retry_scheduled")
WORKER_OUTCOMES = {"succeeded", "retry_scheduled", "dead", "not_claimed", "bulkhead_wait"}
EXAMPLES_RUN = {"count": 0}  # machines started in this process (see the test at the end)
# Emptied before each example (DELETE: a TRUNCATE of these costs a quarter of a second),
# and the ids started again, so that a replayed example gets the same ids (a job's id
# decides its partition and where its runs fall in their windows).
EMPTIED = ("run_events", "notices", "runs", "audit_log", "target_breaker_transitions", "target_breakers", "target_slots", "jobs")
RESTARTED = ("run_events", "runs", "jobs")
# The answers a call may get; a hang is rare (it costs the 1 s timeout in real time).
ANSWER_CHOICES = ["ok", "ok", "fail"] * 3 + ["hang"]


class ChosenAnswerTarget(LoopbackTarget):
    """The loopback target, answering every path with the answer the rule chose. A path
    in `slow` answers only once every other call of its batch has landed, and after the
    frozen clock has moved on that many seconds (`traveller`: the machine's clock).
    `answered`: the clock when each path last answered."""

    answer: tuple[int, float] = ANSWERS["ok"]
    slow: dict[str, int] = {}
    traveller: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.answered: dict[str, datetime] = {}

    def _answer(self, path: str) -> tuple[int, float, dict[str, str]]:
        if path in self.slow:
            # The other calls of the batch land first (their outcomes owe nothing to this
            # one); a worker that held them for it would have them wait here, half a
            # second at most (inside the jobs' 1 s timeout).
            deadline = time.monotonic() + 0.5
            while run_services.process_flights().in_flight() > 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            self.traveller.shift(self.slow[path])
        self.answered[path] = timezone.now()
        return self.answer[0], self.answer[1], {}


# What each example did (note), and in how many examples each thing happened: printed
# at the end of the run, and the rules added with the overlap, list, delete-while-paused
# and retry features must each fire in at least a tenth of the examples (a dead run
# retried, the rarest, needs a dead run first; it picks a live job's when there is one).
FIRED: set[str] = set()
FIRED_IN: Counter[str] = Counter()
MUST_FIRE = ("a job with a schedule list", "a job deleted while paused until a time", "a dead run retried",
             "a mixed batch: a slow and a fast call in one message")


def note(what: str) -> None:
    """Counted in hypothesis's statistics (--hypothesis-show-statistics) when the
    machine runs under hypothesis; the replays below run it step by step, outside.
    Also counted once per example in FIRED_IN."""
    FIRED.add(what)
    if currently_in_test_context():
        event(what)


# --------------------------------------------------------------------------- the reference model


@dataclass(frozen=True)
class Segment:
    """One timing of a job, in force for times in (start, next segment's start]."""

    start: datetime
    cron: str  # "" for a one-off or an every job
    zone: str
    run_at: datetime | None
    every: int = 0  # seconds: anchor + k * every, k >= 1 (the anchor is the job's creation)
    anchor: datetime | None = None
    exclude: frozenset[date] = frozenset()  # dates in `zone`: their times are skipped rows, reason excluded

    @property
    def one_off(self) -> bool:
        return not self.cron and not self.every

    @property
    def crons(self) -> list[str]:
        return self.cron.split("|") if self.cron else []  # a schedule list: "a|b"

    def has_time(self, t: datetime) -> bool:
        if self.every:
            assert self.anchor is not None
            return t > self.anchor and (t - self.anchor) % timedelta(seconds=self.every) == timedelta(0)
        if not self.cron:
            return t == self.run_at
        return any(schedule.next_cron_time(c, self.zone, t - timedelta(seconds=1)) == t for c in self.crons)

    def excludes(self, t: datetime) -> bool:
        return not self.one_off and t.astimezone(ZoneInfo(self.zone)).date() in self.exclude

    def times(self, until: datetime) -> Iterator[datetime]:
        """Its times in (start, until]."""
        if self.every:
            assert self.anchor is not None
            step = timedelta(seconds=self.every)
            t = self.anchor + step * max(1, (self.start - self.anchor) // step + 1)
            while t <= until:
                yield t
                t += step
            return
        if not self.cron:
            if self.run_at is not None and self.start < self.run_at <= until:
                yield self.run_at
            return
        union: set[datetime] = set()
        for cron in self.crons:
            union.update(schedule.cron_times(cron, self.zone, self.start, until + timedelta(seconds=1)))
        yield from sorted(union)


@dataclass
class ModelJob:
    """What the job must look like, whatever the interleaving."""

    pk: int
    misfire: str
    window: int
    segments: list[Segment]
    paused: bool = False
    deleted: bool = False
    carried: set[int] = field(default_factory=set)  # runs in flight at an edit: the old timing's
    # (mark, policy): the overlap policy in force for outcomes whose event id is above
    # `mark`, the highest event id when it was set (event ids, not times: the clock is
    # frozen, and an edit and an outcome at one instant come in the order they ran).
    overlaps: list[tuple[int, str]] = field(default_factory=list)
    pause_after_failures: int = 0
    # Its normal runs that ran (succeeded or dead), as (scheduled_for, outcome): under
    # overlap allow they end in any order, and pause_after_failures counts the latest
    # by time (for every other policy one run is in flight at a time: the same order).
    ran: list[tuple[datetime, str]] = field(default_factory=list)
    paused_itself: int = 0  # times it paused itself (each with an audit entry)
    paused_until: datetime | None = None
    resumed_itself: int = 0  # times the scanner resumed it at its paused_until
    # The overlap policy in force when each of its normal runs ended (by scheduled_for):
    # a happy-path outcome's entry is on the run row (runs.timeline), with no event id.
    policy_at_end: dict[datetime, str] = field(default_factory=dict)

    def overlap_at(self, event_id: int) -> str:
        return [policy for mark, policy in self.overlaps if mark < event_id][-1]

    def ended(self, outcome: str, scheduled_for: datetime) -> None:
        self.ended_together([(outcome, scheduled_for)])

    def ended_together(self, outcomes: list[tuple[str, datetime]], running: tuple[datetime, ...] = ()) -> None:
        """Normal runs of the job ended (a worker's batch): pause_after_failures, when one
        of them is dead, if the job's latest `limit` runs that ran (by time) all ended
        dead, and none of its runs that started and have not ended (`running`: in
        flight under overlap allow, or waiting for a retry) is later than those. The
        store judges each outcome as it lands, and such a later run keeps the row from
        being all dead: so a later run that succeeds in the same batch keeps the job
        running, whichever call ends first."""
        ran = [(t, outcome) for outcome, t in outcomes if outcome in ("succeeded", "dead")]
        for t, outcome in ran:
            self.policy_at_end[t] = self.overlaps[-1][1]
            self.ran.append((t, outcome))
        if any(outcome == "dead" for _, outcome in ran):
            limit = self.pause_after_failures
            latest = [o for _, o in sorted(self.ran)[-limit:]] if limit else []
            if limit and len(latest) == limit and any(t > sorted(self.ran)[-limit][0] for t in running):
                return
            if limit and len(latest) == limit and set(latest) == {"dead"} and not (self.paused or self.deleted) \
                    and not self.current.one_off:  # a recurring job: cron or every
                self.paused = True
                self.paused_itself += 1
                note("a job paused itself")

    @property
    def current(self) -> Segment:
        return self.segments[-1]

    def segment_of(self, t: datetime) -> Segment | None:
        """The timing in force at time t: the last one that started before it."""
        found = None
        for seg in self.segments:
            if seg.start < t:
                found = seg
        return found

    def expected_state(self, rows: list[Run]) -> str:
        if self.deleted:
            return Job.State.DELETED
        seg = self.current
        # A one-off's time has one row: once it has ended the job is completed, and stays
        # so when its dead run is retried (the retry is an extra run: is_backfill, with
        # the tries it had in attempt_base).
        if seg.one_off and any(
            r.scheduled_for == seg.run_at
            and (r.status in (S.SUCCEEDED, S.DEAD, S.SKIPPED) or (r.is_backfill and r.attempt_base > 0))
            for r in rows
        ):
            return Job.State.COMPLETED
        return Job.State.PAUSED if self.paused else Job.State.ACTIVE


# --------------------------------------------------------------------------- the machine


def forget_bulkhead_slots() -> None:
    """Slots in Redis outlive an example's rows (as tests/conftest.py says of a test's)."""
    if django_settings.SCHEDULER_BULKHEAD == "redis":
        import redis

        client = redis.Redis.from_url(django_settings.SCHEDULER_BULKHEAD_REDIS_URL)
        for key in client.scan_iter(match=f"{django_settings.SCHEDULER_BULKHEAD_PREFIX}*"):
            client.delete(key)


@dataclass
class InFlight:
    """A claim whose call has not been made yet: its outcome comes in a later rule."""

    call: Call
    job_key: int


class SchedulerMachine(RuleBasedStateMachine):
    jobs = Bundle("jobs")

    def __init__(self, owner: Any, target: ChosenAnswerTarget) -> None:
        super().__init__()
        EXAMPLES_RUN["count"] += 1
        FIRED.clear()
        self.owner, self.target = owner, target
        with connection.cursor() as cursor:  # each example starts from an empty store
            # Not a durability test: commits need not wait for the disk (5 ms each on a busy VM).
            cursor.execute("SET synchronous_commit TO off")
            for table in EMPTIED:
                cursor.execute(f"DELETE FROM {table}")
            for table in RESTARTED:
                cursor.execute(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), 1, false)")
        forget_bulkhead_slots()
        self.clock = time_machine.travel(T0, tick=False)
        self.traveller = self.clock.start()
        # The store's clock (leases, due times) is the model's clock too: the one seam
        # for a test that mocks time (runs.claims._clock_in_the_database).
        self.store_clock = mock.patch.object(claims, "_clock_in_the_database", lambda: False)
        self.store_clock.start()
        self.model: dict[int, ModelJob] = {}
        self.in_flight: list[InFlight] = []

    def teardown(self) -> None:
        FIRED_IN.update(FIRED)
        FIRED.clear()
        self.store_clock.stop()
        self.clock.stop()
        with connection.cursor() as cursor:
            cursor.execute("SET synchronous_commit TO DEFAULT")

    # ---------------------------------------------------------------- helpers

    def now(self) -> datetime:
        return timezone.now()

    def job(self, key: int) -> Job:
        return Job.objects.get(pk=key)

    def path(self, key: int, other: bool = False) -> str:
        return self.target.url(f"/job-{key}{'-b' if other else ''}")

    def running(self, key: int) -> tuple[datetime, ...]:
        """The times of the job's normal runs that have started and not ended (in flight
        under overlap allow, or waiting for a retry): the store reads the same when it
        judges pause_after_failures."""
        return tuple(Run.objects.filter(job_id=key, is_backfill=False, status__in=Run.OPEN, started_at__isnull=False)
                     .values_list("scheduled_for", flat=True))

    def open_normal_run(self, key: int) -> Run | None:
        """The job's own open run (JOBS_OPEN_RUN): under overlap allow, not one in flight."""
        return Run.objects.filter(JOBS_OPEN_RUN, job_id=key).first()

    # ---------------------------------------------------------------- user actions

    NEW_JOB = dict(
        kind=st.sampled_from(["cron", "cron", "list", "list", "every", "at", "delay"]),
        cron=st.sampled_from(SCHEDULES),
        exclude=st.sampled_from(EXCLUDES),
        zone=st.sampled_from(ZONES),
        misfire=st.sampled_from(MISFIRES),
        window=st.sampled_from([0, 0, 30, 300]),
        later=st.integers(1, 7200),
        overlap=st.sampled_from(OVERLAPS),
        failures=st.sampled_from([0, 0, 1, 2]),
        retries=st.sampled_from([1, 1, 0]),
    )

    @initialize(target=jobs, **NEW_JOB)
    def first_job(self, kind: str, cron: str, exclude: tuple[str, ...], zone: str, misfire: str, window: int,
                  later: int, overlap: str = "skip", failures: int = 0, retries: int = 1) -> int:
        """Every example starts with a job, so that its steps have something to act on."""
        return self.create_job(kind, cron, exclude, zone, misfire, window, later, overlap, failures, retries)

    @precondition(lambda self: len(self.model) < 3)
    @rule(target=jobs, **NEW_JOB)
    def create_job(self, kind: str, cron: str, exclude: tuple[str, ...], zone: str, misfire: str, window: int,
                   later: int, overlap: str = "skip", failures: int = 0, retries: int = 1) -> int:
        now = self.now()
        fields: dict[str, Any] = {"name": "m", "target": self.target.url("/pending"), "timezone": zone,
                                  "misfire": misfire, "window_seconds": window, "timeout_seconds": 1,
                                  "retry_max": retries, "retry_base_seconds": 1, "overlap": overlap,
                                  "pause_after_failures": failures}
        if kind in ("cron", "list", "every"):
            fields["exclude"] = list(exclude)
        if kind == "cron":
            fields["schedule"] = cron
        elif kind == "list":
            fields["schedule_list"] = list(SCHEDULE_LISTS[later % len(SCHEDULE_LISTS)])
            note("a job with a schedule list")
        elif kind == "every":
            fields["every_seconds"] = EVERY_SECONDS[later % len(EVERY_SECONDS)]
        elif kind == "at":  # a whole minute, as a user writes it
            fields["run_at"] = (now + timedelta(seconds=later)).replace(second=0) + timedelta(minutes=1)
        else:  # delay: the serializer's now + delay, rounded up to a second
            fields["run_at"] = schedule.round_up_to_second(now + timedelta(seconds=later))
        job = job_create(owner=self.owner, fields=fields, now=now)
        Job.objects.filter(pk=job.pk).update(target=self.path(job.pk))
        seg = Segment(start=now, cron="|".join(job.cron_expressions), zone=zone, run_at=job.run_at,
                      every=job.every_seconds or 0,
                      anchor=job.created_at.replace(microsecond=0), exclude=_dates(job.exclude))
        self.model[job.pk] = ModelJob(pk=job.pk, misfire=misfire, window=window, segments=[seg],
                                      overlaps=[(0, overlap)], pause_after_failures=failures)
        return job.pk

    @rule(job=jobs, kind=st.sampled_from(["cron", "cron", "at", "zone"]), cron=st.sampled_from(EDITED_SCHEDULES),
          later=st.integers(1, 7200), zone=st.sampled_from([None, *ZONES]))
    def edit_timing(self, job: int, kind: str, cron: str, later: int, zone: str | None) -> None:
        """A PATCH of the schedule (cron, or a one-off `at`), of the zone, or of both."""
        now, mj = self.now(), self.model[job]
        fields: dict[str, Any] = {}
        if kind == "cron":
            fields["schedule"] = cron
        elif kind == "at":
            fields["run_at"] = (now + timedelta(seconds=later)).replace(second=0) + timedelta(minutes=1)
        if zone is not None:
            fields["timezone"] = zone
        self._edit(mj, fields)

    @rule(job=jobs, exclude=st.sampled_from(EXCLUDES))
    def edit_exclude(self, job: int, exclude: tuple[str, ...]) -> None:
        """A PATCH of a recurring job's excluded dates (the API refuses them on a one-off)."""
        if self.model[job].current.one_off:
            return
        self._edit(self.model[job], {"exclude": list(exclude)})

    @rule(job=jobs, other=st.booleans())
    def edit_target(self, job: int, other: bool) -> None:
        self._edit(self.model[job], {"target": self.path(job, other)})

    def _edit(self, mj: ModelJob, fields: dict[str, Any]) -> None:
        now, before = self.now(), mj.current
        new = Segment(
            start=now,
            cron=fields.get("schedule", "" if "run_at" in fields else before.cron),
            zone=fields.get("timezone", before.zone),
            run_at=fields.get("run_at", None if "schedule" in fields else before.run_at),
            every=0 if "schedule" in fields or "run_at" in fields else before.every,
            anchor=before.anchor,
            exclude=_dates(fields["exclude"]) if "exclude" in fields else before.exclude,
        )
        waiting = self.open_normal_run(mj.pk)
        # Overlap allow: the runs in flight beside the waiting one keep the old timing too.
        beside = set(Run.objects.filter(job_id=mj.pk, detached=True, status__in=Run.OPEN).values_list("pk", flat=True))
        try:
            job_update(job=self.job(mj.pk), fields=fields, now=now)
        except ValueError as exc:
            # Refused, and nothing written: a deleted job, or a one-off time that has had its run.
            assert mj.deleted or "already has a run" in str(exc), exc
            return
        assert not mj.deleted, "a deleted job was edited"
        if (new.cron, new.zone, new.run_at, new.every, new.exclude) != (
            before.cron, before.zone, before.run_at, before.every, before.exclude
        ):
            mj.segments.append(new)
            mj.carried |= beside
            if waiting is not None and (waiting.status != S.SCHEDULED or waiting.attempt > 0):
                mj.carried.add(waiting.pk)  # on its way: it keeps the old timing

    @rule(job=jobs, overlap=st.sampled_from(OVERLAPS), failures=st.sampled_from([0, 1, 2]))
    def edit_lifecycle(self, job: int, overlap: str, failures: int) -> None:
        """A PATCH of the overlap policy and pause_after_failures."""
        mj, now = self.model[job], self.now()
        try:
            job_update(job=self.job(job), fields={"overlap": overlap, "pause_after_failures": failures}, now=now)
        except ValueError:
            assert mj.deleted, "an edit of a live job was refused"
            return
        mj.overlaps.append((RunEvent.objects.aggregate(m=Max("id"))["m"] or 0, overlap))
        mj.pause_after_failures = failures

    @rule(job=jobs)
    def pause(self, job: int) -> None:
        job_pause(job=self.job(job), now=self.now())
        self.model[job].paused = True

    @rule(job=jobs, minutes=st.sampled_from([1, 5, 61]))
    def pause_until(self, job: int, minutes: int) -> None:
        """PATCH {"paused": true, "paused_until": now + minutes}."""
        mj, now = self.model[job], self.now()
        until = now + timedelta(minutes=minutes)
        try:
            job_update(job=self.job(job), fields={"paused": True, "paused_until": until}, now=now)
        except ValueError:
            assert mj.deleted, "pausing a live job until a time was refused"
            return
        mj.paused, mj.paused_until = True, until

    @rule(job=jobs)
    def resume(self, job: int) -> None:
        job_resume(job=self.job(job), now=self.now())
        self.model[job].paused = False
        self.model[job].paused_until = None

    @rule(job=jobs)
    def delete(self, job: int) -> None:
        job_delete(job=self.job(job), now=self.now())
        self.model[job].deleted = True
        self.model[job].paused_until = None  # a deleted job never resumes

    @rule(job=jobs, minutes=st.sampled_from([1, 5]))
    def delete_while_paused_until(self, job: int, minutes: int) -> None:
        """A job paused until a time, then deleted before it comes (by the API, the
        admin or sync_jobs --prune): it must not stay in the scanner's resume list."""
        self.pause_until(job, minutes)
        if self.model[job].paused_until is not None:
            note("a job deleted while paused until a time")
        self.delete(job)

    @rule(job=jobs)
    def run_now(self, job: int) -> None:
        mj = self.model[job]
        try:
            run = job_trigger(job=self.job(job), now=self.now())
        except TriggerRefused:
            assert mj.deleted or mj.paused, "run now was refused for a live job"
            return
        assert not (mj.deleted or mj.paused), "run now was let through for a paused or deleted job"
        assert run.is_backfill and run.scheduled_for >= self.now()

    @rule(job=jobs, hours=st.integers(1, 3))
    def backfill(self, job: int, hours: int) -> None:
        now, mj = self.now(), self.model[job]
        # A backfill reaches back no further than the job's creation (backfill_plan refuses earlier).
        since = max(now - timedelta(hours=hours), self.job(job).created_at)
        if since >= now:
            return
        try:
            plan = backfill_plan(job=self.job(job), since=since, until=now, now=now)
        except BackfillError:
            assert mj.deleted, "a backfill of a live job was refused"
            return
        made = job_backfill(job=self.job(job), times=plan.times, now=now)
        assert all(r.is_backfill for r in made)

    @rule()
    def retry_dead_again(self) -> None:
        """retry_dead, drawn as a rule of its own too: a retry needs a dead run of a live
        job first, so it is drawn twice as often (it fired in 6 to 19% of the CI
        profile's examples drawn once, against the tenth the rules added for it need)."""
        self.retry_dead(newest=False)

    @rule(newest=st.booleans())
    def retry_dead(self, newest: bool) -> None:
        """POST /api/runs/{id}/retry/ on a dead run: it goes back on the queue, an extra
        run (the job's timetable goes on without it), refused while its job is paused
        or deleted."""
        def dead_runs() -> list[Run]:
            return list(Run.objects.filter(job_id__in=list(self.model), status=S.DEAD).order_by("pk"))

        def of_live_jobs(runs: list[Run]) -> list[Run]:
            return [r for r in runs if not (self.model[r.job_id].deleted or self.model[r.job_id].paused)]

        for _ in range(4):  # none of a live job yet: the next calls fail until one is out of tries
            if of_live_jobs(dead_runs()):
                break
            self.worker_batch("fail")
        dead = dead_runs()
        if not dead:
            return
        # Not drawn from the store's rows (hypothesis replays draws): a live job's dead run
        # when there is one (the newest or the oldest), else a paused or deleted job's, whose
        # refusal is checked.
        live = of_live_jobs(dead)
        pool = live or dead
        run = pool[-1] if newest else pool[0]
        mj = self.model[run.job_id]
        try:
            retried = run_ops.run_retry(run=run, now=self.now())
        except run_ops.RetryRefused:
            assert mj.deleted or mj.paused, "the retry of a live job's dead run was refused"
            return
        assert not (mj.deleted or mj.paused), "a paused or deleted job's dead run was retried"
        assert retried.status == S.SCHEDULED and retried.is_backfill and retried.attempt_base == run.attempt
        # From here it is an extra run: its death no longer counts in pause_after_failures'
        # row (the store counts normal runs only), whatever its new attempt gives.
        if not run.is_backfill:
            mj.ran = [(t, outcome) for t, outcome in mj.ran if t != run.scheduled_for]
        note("a dead run retried")

    # ---------------------------------------------------------------- the clock and the scanner

    @rule(seconds=st.sampled_from([1, 30, 59, 61, 90, 180, 299, 3600]))
    def advance_clock(self, seconds: int) -> None:
        self.traveller.shift(seconds)

    @rule()
    def scan(self) -> None:
        now = self.now()
        result = scan_once(partitions=frozenset(range(django_settings.SCHEDULER_PARTITIONS)), now=now, publish=False)
        # A paused job whose paused_until has come is resumed by this very scan.
        due = {mj.pk for mj in self.model.values()
               if mj.paused and mj.paused_until is not None and mj.paused_until <= now and not mj.deleted}
        assert set(result.resumed) == due, f"resumed {result.resumed}, the model says {sorted(due)}"
        for pk in due:
            mj = self.model[pk]
            mj.paused, mj.paused_until = False, None
            mj.resumed_itself += 1
            note("a job resumed at its paused_until")
        expired = Run.objects.filter(status=S.RUNNING, lease_expires_at__lt=now)
        assert not expired.exists(), "a scan left a run whose lease ran out running"
        waiting = Run.objects.filter(status=S.SCHEDULED, held=False, due_at__lte=now, attempt=0, is_backfill=False)
        # A next run the misfire path made in this very scan (a time still inside its
        # grace) is due already; the next scan queues it.
        waiting = waiting.exclude(created_at=now)
        assert not waiting.exists(), "a scan left a due run neither queued nor misfired"

    @rule()
    def lease_expiry(self) -> None:
        """Every worker freezes for longer than a lease; the next scan releases their runs."""
        self.traveller.shift(lease_length().total_seconds() + 1)
        self.scan()

    # ---------------------------------------------------------------- the run path

    def claimable(self) -> list[Run]:
        """The runs a worker could claim now; with none, the clock first moves on to the
        next due run and a scan queues it (a worker waiting for work). A run the scan
        queued ahead of its due time (SCHEDULER_LOOKAHEAD) is not claimable until then."""
        for _ in range(2):
            now = self.now()
            found = [r for r in Run.objects.select_related("job").order_by("pk")
                     if claims.may_claim(r, now) and r.due_at <= now]
            nxt = Run.objects.filter(status=S.SCHEDULED, held=False).order_by("due_at").first()
            if found or nxt is None:
                return found
            if nxt.due_at > now:
                self.traveller.move_to(nxt.due_at)
            self.scan()
        return found

    @rule(answer=st.sampled_from(ANSWER_CHOICES), mixed=st.sampled_from([False, False, True]))
    def worker_batch(self, answer: str, mixed: bool = False) -> None:
        """The real worker path, claim to outcome in one go, for every claimable run; a
        third of the time a mixed batch (mixed_batch), as one host's endpoints differ."""
        if mixed:
            self.mixed_batch(slow=150)
            return
        ids = [r.pk for r in self.claimable()]
        if not ids:
            return
        self.target.answer = ANSWERS[answer]
        # Batches as the scanner publishes them: at most a host's bulkhead of runs each.
        size = max(1, min(django_settings.SCHEDULER_DISPATCH_BATCH, django_settings.SCHEDULER_TARGET_CONCURRENCY))
        normal = {pk: (job_id, t) for pk, job_id, t in
                  Run.objects.filter(pk__in=ids, is_backfill=False).values_list("pk", "job_id", "scheduled_for")}
        for start in range(0, len(ids), size):
            outcomes = run_execute_many(run_ids=ids[start : start + size], worker="batch-worker")
            assert set(outcomes.values()) <= WORKER_OUTCOMES, outcomes
            # One transaction for the batch's outcomes: each job's judged once it landed.
            by_job: dict[int, list[tuple[str, datetime]]] = defaultdict(list)
            for run_id, outcome in outcomes.items():
                if run_id in normal:
                    by_job[normal[run_id][0]].append((outcome, normal[run_id][1]))
            for job_key, ended in by_job.items():
                self.model[job_key].ended_together(ended, self.running(job_key))

    @rule(slow=st.sampled_from([61, 150, 400]))
    def mixed_batch(self, slow: int) -> None:
        """Two jobs' runs in one message, one job's endpoint slow: it answers once the
        other calls have landed, after the clock has moved `slow` seconds. Each outcome is
        stamped at its own answer, never at the slow call's (runs.flights): a fast job's
        flight ends at its answer, and its next times are not overlaps."""
        def waiting() -> list[Run]:
            return list(Run.objects.filter(job_id__in=list(self.model), status=S.SCHEDULED, held=False,
                                           is_backfill=False).order_by("due_at"))

        if len({r.job_id for r in waiting()}) < 2 and len(self.model) < 3:
            # A second job beside the first (a frequent one), so that the batch is mixed.
            self.create_job("cron", "*/2 * * * *", (), "UTC", "run_once", 0, 1, "skip", 0, 1)
        found = waiting()
        jobs = list(dict.fromkeys(r.job_id for r in found))[:2]
        if len(jobs) < 2:
            return
        waiting_runs = found
        due = max(r.due_at for r in waiting_runs if r.job_id in jobs)
        if due > self.now():
            self.traveller.move_to(due)
        self.scan()
        runs = [r for r in self.claimable() if not r.is_backfill]
        # One run of each of two jobs (a time the clock passed may have misfired: any two).
        mine = list({r.job_id: r for r in reversed(runs)}.values())[:2]
        if len(mine) < 2:
            return
        slow_path = Job.objects.get(pk=mine[0].job_id).target.rsplit(str(self.target.port), 1)[1]
        self.target.answer, self.target.slow, self.target.traveller = ANSWERS["ok"], {slow_path: slow}, self.traveller
        self.target.answered.clear()
        try:
            outcomes = run_execute_many(run_ids=[r.pk for r in mine], worker="mixed-worker")
        finally:
            self.target.slow = {}
        assert set(outcomes.values()) <= WORKER_OUTCOMES, outcomes
        for run in mine:
            self.model[run.job_id].ended_together([(outcomes[run.pk], run.scheduled_for)], self.running(run.job_id))
        note("a mixed batch: a slow and a fast call in one message")
        for run in mine:
            ended = Run.objects.get(pk=run.pk)
            path = Job.objects.get(pk=run.job_id).target.rsplit(str(self.target.port), 1)[1]
            if outcomes[run.pk] == "succeeded" and path in self.target.answered:
                assert ended.finished_at == self.target.answered[path], (
                    f"run {describe([ended])} ended at {ended.finished_at:%H:%M:%S}, its call answered at "
                    f"{self.target.answered[path]:%H:%M:%S}: its outcome waited for its batch's slow call")

    @rule(many=st.booleans())
    def claim(self, many: bool) -> None:
        """A worker claims (as run_execute_many does) and is slow: its call comes later."""
        runs = self.claimable()
        runs = runs if many else runs[:1]
        if not runs:
            return
        worker = f"slow-{len(self.in_flight)}"
        # The run path's claim step (under overlap allow it also makes the job's next run).
        taken = run_claim_many(runs=runs, worker=worker, lease=lease_length())
        assert {c.run_id for c in taken} == {r.pk for r in runs}, "a claimable run could not be claimed"
        by_id = {c.run_id: c for c in taken}
        for run in runs:
            claim = by_id[run.pk]
            run.fence, run.attempt = claim.fence, claim.attempt
            self.in_flight.append(InFlight(call=Call(run=run, claim=claim), job_key=run.job_id))

    @precondition(lambda self: bool(self.in_flight))
    @rule(data=st.data())
    def second_holder(self, data: st.DataObject) -> None:
        """Claiming a run someone holds a live lease on gets nothing."""
        held = data.draw(st.sampled_from(self.in_flight)).call.claim
        run = Run.objects.get(pk=held.run_id)
        if run.status != S.RUNNING or run.lease_expires_at is None or run.lease_expires_at < self.now():
            return
        got = claims.claim_many(run_ids=[run.pk], worker="second", lease=lease_length())
        assert got == [], "a second holder took a live lease"

    @precondition(lambda self: bool(self.in_flight))
    @rule(data=st.data(), answer=st.sampled_from(ANSWER_CHOICES), lasts=st.sampled_from([0, 0, 0, 150, 400]))
    def answer(self, data: st.DataObject, answer: str, lasts: int) -> None:
        """A slow worker's call is made now, answered as chosen after `lasts` seconds (on
        the clock; nobody scans meanwhile, so its lease is not taken over), and its
        outcome recorded: a long call, over which the job's next times pass."""
        self.answer_call(data.draw(st.sampled_from(self.in_flight)), answer, lasts)

    def answer_call(self, flight: InFlight, answer: str, lasts: int = 0) -> None:
        self.in_flight.remove(flight)
        self.traveller.shift(lasts)
        call = flight.call
        current = Run.objects.get(pk=call.run.pk)
        stale = current.status != S.RUNNING or current.fence != call.claim.fence
        run_services._prepare([call])  # the worker's own checks and request
        if call.request is not None:
            self.target.answer = ANSWERS[answer]
            call.result = run_services._call_one(call)
        [outcome] = run_record_outcomes([call]).values()
        assert (outcome == "stale_write_rejected") == stale, (outcome, stale)
        if not call.run.is_backfill:
            self.model[flight.job_key].ended_together([(outcome, call.run.scheduled_for)], self.running(flight.job_key))

    # ---------------------------------------------------------------- invariants

    @invariant()
    def both_promises_hold(self) -> None:
        if not self.model:
            return
        now = self.now()
        jobs = {j.pk: j for j in Job.objects.filter(pk__in=list(self.model))}
        rows: dict[int, list[Run]] = {pk: [] for pk in self.model}
        for run in Run.objects.filter(job_id__in=list(self.model)).order_by("scheduled_for"):
            rows[run.job_id].append(run)
        # Each run's timeline as the API reads it (runs.timeline: rows, then the row's entries).
        timeline: dict[int, list[RunEvent]] = timelines(r for job_rows in rows.values() for r in job_rows)
        audited = Counter(AuditEntry.objects.filter(actor="scheduler").values_list("object_id", "action"))
        for pk, mj in self.model.items():
            state = mj.expected_state(rows[pk])
            check_state(mj, jobs[pk], state)
            check_one_open_run(mj, rows[pk], state, timeline)
            check_nothing_claimable(mj, rows[pk], timeline, extra=False)
            check_nothing_claimable(mj, rows[pk], timeline, extra=True)
            check_runs_follow_their_timing(mj, rows[pk])
            check_every_due_time_has_a_row(mj, rows[pk], timeline)
            check_excluded_times_are_skipped(mj, rows[pk], timeline)
            check_misfire_grace(mj, rows[pk])
            check_overlap(mj, rows[pk], timeline)
            check_lifecycle(mj, jobs[pk], audited)
        for run in (r for job_rows in rows.values() for r in job_rows):
            check_lease(run, timeline.get(run.pk, []), now)
            check_fences(run, timeline.get(run.pk, []))
            check_kept_for(run)


# --------------------------------------------------------------------------- the invariants, one each


def check_kept_for(run: Run) -> None:
    """The history's key follows the status, whichever path wrote the row (the store's
    trigger keeps it on updates that do not name it; issue 18)."""
    want = kept_for_of(run.status, run.scheduled_for)
    assert run.kept_for == want, f"{run.public_id} is {run.status} with kept_for {run.kept_for}, not {want}"


def check_state(mj: ModelJob, job: Job, state: str) -> None:
    assert job.state == state, f"job {mj.pk} is {job.state}, the model says {state}"


def check_one_open_run(mj: ModelJob, rows: list[Run], state: str, timeline: dict[int, list[RunEvent]]) -> None:
    """A live job has exactly one open normal run (JOBS_OPEN_RUN: under overlap allow,
    any number of detached runs are in flight beside it); a deleted or completed one has
    none waiting (a call in flight when it was deleted may finish, its lease recovered).
    A detached run is one that was claimed."""
    for run in rows:
        assert not run.detached or run.started_at is not None, f"{describe([run])} detached but never claimed"
    open_rows = [r for r in rows if r.status in Run.OPEN and not r.is_backfill and not r.detached]
    if state in (Job.State.ACTIVE, Job.State.PAUSED):
        assert len(open_rows) == 1, f"live job {mj.pk} has {len(open_rows)} open runs: {describe(open_rows)}"
    else:
        waiting = [
            r for r in open_rows
            if r.status != S.RUNNING and not (r.status == S.QUEUED and _lease_lost_since_claim(timeline.get(r.pk, [])))
        ]
        assert not waiting, f"{state} job {mj.pk} has runs waiting: {describe(waiting)}"


def check_nothing_claimable(mj: ModelJob, rows: list[Run], timeline: dict[int, list[RunEvent]], *, extra: bool) -> None:
    """No run of a paused or deleted job can be claimed: it is held, or cancelled. Its
    normal runs (retries included) and its extra ones (backfills, run now) are checked
    apart (`extra`), so that hypothesis reports them as two defects. A run queued again
    after its lease ran out is the recovery of a call already started, which may finish."""
    if not (mj.paused or mj.deleted):
        return
    what = "deleted" if mj.deleted else "paused"
    for run in rows:
        recovering = run.status == S.QUEUED and _lease_lost_since_claim(timeline.get(run.pk, []))
        if run.is_backfill != extra or run.status not in (S.SCHEDULED, S.QUEUED) or recovering:
            continue
        assert run.held and not mj.deleted, f"a run of {what} job {mj.pk} is claimable: {describe([run])}"


def check_runs_follow_their_timing(mj: ModelJob, rows: list[Run]) -> None:
    """Each normal run is at a time of the timing in force at that time: after an edit,
    the next run follows the new timing from the edit time."""
    for run in rows:
        if run.is_backfill or run.status == S.CANCELLED or run.pk in mj.carried:
            continue
        seg = mj.segment_of(run.scheduled_for)
        assert seg is not None and seg.has_time(run.scheduled_for), (
            f"job {mj.pk}'s run {describe([run])} is not a time of its timing {seg}"
        )


def check_every_due_time_has_a_row(mj: ModelJob, rows: list[Run], timeline: dict[int, list[RunEvent]]) -> None:
    """Every time of each timing, from its start up to the job's latest run under it, has
    a row: a run, or a skipped (or cancelled) one with a reason. Nothing is silently lost."""
    by_time = {r.scheduled_for: r for r in rows}
    capped = _capped_gaps(rows, timeline)
    ends = [seg.start for seg in mj.segments[1:]] + [None]
    for seg, end in zip(mj.segments, ends):
        mine = [
            r.scheduled_for for r in rows
            if not r.is_backfill and r.status != S.CANCELLED and r.pk not in mj.carried
            and r.scheduled_for > seg.start and (end is None or r.scheduled_for <= end)
        ]
        if not mine:
            continue
        for t in seg.times(max(mine)):
            row = by_time.get(t)
            if row is None and any(after < t < before for after, before in capped):
                continue  # counted on the misfire's event, not written row by row
            assert row is not None, f"job {mj.pk} lost its run at {t:%Y-%m-%d %H:%M} ({seg}; rows {describe(rows)})"
            if row.status in (S.SKIPPED, S.CANCELLED):
                assert _reason(row, timeline.get(row.pk, [])), f"{describe([row])} has no reason"


def _capped_gaps(rows: list[Run], timeline: dict[int, list[RunEvent]]) -> list[tuple[datetime, datetime]]:
    """Spans left without rows on purpose: a misfire after a long outage writes
    `skipped` rows for the latest SCHEDULER_MISFIRE_MAX_SKIPPED missed times only and
    counts the earlier ones on its `misfired` event (`other_missed_times`); so does an
    outcome for the times that passed while its run was in flight (`passed_in_flight`); a next-run
    decision writes rows for the first SCHEDULER_EXCLUDE_MAX_SKIPPED excluded times
    only and counts the rest on the last one's `skipped` event (`excluded_without_row`)."""
    cap = django_settings.SCHEDULER_MISFIRE_MAX_SKIPPED
    ordered = sorted(rows, key=lambda r: r.scheduled_for)
    gaps = [
        (run.scheduled_for, ordered[i + 1].scheduled_for)
        for i, run in enumerate(ordered[:-1])
        if any(e.type == "misfired" and e.detail.get("other_missed_times", 0) > cap for e in timeline.get(run.pk, []))
    ]
    # The excluded times without a row run up to the job's next row of its own (an
    # earlier timing's cancelled rows may lie between).
    lived = [r for r in ordered if r.status != S.CANCELLED and not r.is_backfill]
    # Times that passed while a run was in flight: the latest SCHEDULER_MISFIRE_MAX_SKIPPED
    # get `skipped` rows and every one is counted on their events (`passed_in_flight`);
    # the earlier ones lie between the job's row before the first of those and it (the
    # long profile found the model missing a month-long flight's counted times).
    first_of_flight: dict[str, Run] = {}
    for run in lived:
        for e in timeline.get(run.pk, []):
            if (e.type == "skipped" and e.detail.get("reason") == "overlap"
                    and e.detail.get("passed_in_flight", 0) > cap):
                first_of_flight.setdefault(e.detail.get("in_flight", ""), run)
    by_id = {format_id("run", r.pk): r for r in ordered}
    for in_flight, first in first_of_flight.items():
        # From the job's row before them, or from the run that flew if that is earlier
        # or the only one (an extra run, a requeued dead one, flying past the cap: the
        # long profile's second find).
        i = lived.index(first)
        starts = [lived[i - 1].scheduled_for] if i > 0 else []
        flew = by_id.get(in_flight)
        if flew is not None and flew.scheduled_for < first.scheduled_for:
            starts.append(flew.scheduled_for)
        if starts:
            gaps.append((min(starts), first.scheduled_for))
    return gaps + [
        (run.scheduled_for, lived[i + 1].scheduled_for)
        for i, run in enumerate(lived[:-1])
        if any(e.type == "skipped" and e.detail.get("excluded_without_row", 0) > 0 for e in timeline.get(run.pk, []))
    ]


def check_excluded_times_are_skipped(mj: ModelJob, rows: list[Run], timeline: dict[int, list[RunEvent]]) -> None:
    """A normal run at a time on an excluded date (of the timing in force then) is a
    `skipped` row with reason `excluded`; and only those are."""
    for run in rows:
        if run.is_backfill or run.status == S.CANCELLED or run.pk in mj.carried:
            continue
        seg = mj.segment_of(run.scheduled_for)
        reasons = [e.detail.get("reason") for e in timeline.get(run.pk, []) if e.type == "skipped"]
        # A row's latest word counts: an edit can cancel an excluded time's row and open it again.
        skipped_as_excluded = run.status == S.SKIPPED and reasons[-1:] == ["excluded"]
        if seg is not None and seg.excludes(run.scheduled_for):
            assert skipped_as_excluded, (
                f"job {mj.pk}'s run {describe([run])} is on an excluded date of {seg} but not skipped as excluded"
            )
        else:
            assert not skipped_as_excluded, f"job {mj.pk}'s run {describe([run])} is skipped as excluded; {seg}"


def check_misfire_grace(mj: ModelJob, rows: list[Run]) -> None:
    """A time is missed only once it is past its own window plus the grace:
    max(scheduled_for + window, due_at) + SCHEDULER_MISFIRE_GRACE (docs/reference.md, settings)."""
    grace = timedelta(seconds=django_settings.SCHEDULER_MISFIRE_GRACE)
    for run in rows:
        if run.status != S.SKIPPED or run.finished_at is None or run.last_error.startswith(IN_FLIGHT):
            continue  # an overlap row is check_overlap's
        if run.last_error.startswith("excluded:"):
            continue  # an excluded time is skipped when the timetable passes over it, not missed
        deadline = schedule.misfire_deadline(
            scheduled_for=run.scheduled_for, due_at=run.due_at, window=timedelta(seconds=mj.window), grace=grace
        )
        assert run.finished_at > deadline, f"job {mj.pk}: {describe([run])} skipped inside its window plus grace"


def check_overlap(mj: ModelJob, rows: list[Run], timeline: dict[int, list[RunEvent]]) -> None:
    """A `skipped` row with reason overlap is a time that passed while a normal run of
    its job was in flight: from that run's claim to its outcome, which wrote the row.
    The run that outcome made (its `next_scheduled_for`) is, under skip, a time after
    the outcome; under buffer_one, the latest time that passed (unless another row
    already had that time: then the next after it)."""
    flights: dict[str, list[Run]] = {}
    for row in rows:
        if row.status == S.SKIPPED and row.last_error.startswith(IN_FLIGHT):
            said = [e for e in timeline.get(row.pk, []) if e.type == "skipped" and e.detail.get("reason") == "overlap"]
            assert said, f"{describe([row])}: no skipped event with reason overlap"
            flights.setdefault(said[0].detail["in_flight"], []).append(row)
    by_id = {r.public_id: r for r in rows}
    for flight, skipped in flights.items():
        ran = by_id.get(flight)
        if ran is not None and ran.is_backfill and ran.attempt_base > 0:
            continue  # it ended dead, then was retried: an extra run now, its flight's rows stand
        assert ran is not None and not ran.is_backfill and ran.status in (S.SUCCEEDED, S.DEAD), (
            f"job {mj.pk}: overlap rows {describe(skipped)} name {flight}, not an ended run of the job"
        )
        ended_at = ran.finished_at
        assert ran.started_at is not None and ended_at is not None
        assert all(r.finished_at == ended_at for r in skipped), f"{describe(skipped)} not written by {flight}'s outcome"
        for row in skipped:
            assert ran.started_at <= row.scheduled_for <= ended_at, (
                f"job {mj.pk}: {describe([row])} skipped for overlap outside {describe([ran])}'s flight "
                f"({ran.started_at:%H:%M:%S} to {ended_at:%H:%M:%S})"
            )
        told = [e for e in timeline.get(ran.pk, []) if e.type in ("succeeded", "dead")]
        nxt = told[-1].detail.get("next_scheduled_for") if told else None
        if nxt is None:
            continue  # deleted, or a one-off: no next run
        nxt_at = datetime.fromisoformat(nxt.replace("Z", "+00:00"))
        latest = max(r.scheduled_for for r in skipped)
        policy = mj.overlap_at(told[-1].id) if told[-1].id is not None else mj.policy_at_end[ran.scheduled_for]
        note(f"overlap rows under {policy}")
        capped = [e for r in skipped for e in timeline.get(r.pk, []) if e.detail.get("rest_to_misfire_policy")]
        if capped:
            # MAX_OVERLAP_TIMES looked at: the next run is the first time after them, passed,
            # and the misfire policy's (its rows and its count are checked like any misfire's).
            assert latest < nxt_at <= ended_at, f"job {mj.pk} (overlap, capped): next run {nxt} after {latest}"
            note("overlap times past the cap handed to the misfire policy")
            continue
        if policy == "skip" or nxt_at > ended_at:
            assert nxt_at > ended_at, f"job {mj.pk} (overlap skip): its next run {nxt} has passed at {ended_at}"
            if policy == "buffer_one":  # the latest time had a row already
                assert any(latest < r.scheduled_for <= ended_at and r.status != S.SKIPPED for r in rows), (
                    f"job {mj.pk} (buffer_one): nothing ran for the latest time before {ended_at}"
                )
        else:
            assert latest < nxt_at <= ended_at, f"job {mj.pk} (buffer_one): next run {nxt}, skipped up to {latest}"


def check_lifecycle(mj: ModelJob, job: Job, audited: Counter[tuple[str, str]]) -> None:
    """The job paused itself, and was resumed at its paused_until, as often as the
    model says, each with its audit entry (actor: the scheduler); its paused_until is
    the model's."""
    paused, resumed = audited[(job.public_id, "paused")], audited[(job.public_id, "resumed")]
    assert paused == mj.paused_itself, f"job {mj.pk} paused itself {paused} times, the model says {mj.paused_itself}"
    assert resumed == mj.resumed_itself, f"job {mj.pk} resumed itself {resumed} times, the model says {mj.resumed_itself}"
    assert job.paused_until == mj.paused_until, f"job {mj.pk}: paused_until {job.paused_until}, model {mj.paused_until}"


def check_lease(run: Run, timeline: list[RunEvent], now: datetime) -> None:
    """A running run has a lease: the latest claim's holder and fence, with an expiry."""
    if run.status != S.RUNNING:
        return
    claimed = [e for e in timeline if e.type == "claimed"]
    assert claimed and run.lease_owner and run.lease_expires_at is not None, f"{describe([run])} runs without a lease"
    assert (run.fence, run.lease_owner) == (claimed[-1].detail["fence"], claimed[-1].detail["worker"]), (
        f"{describe([run])} is held by {run.lease_owner}/{run.fence}, not its latest claim {claimed[-1].detail}"
    )


def check_fences(run: Run, timeline: list[RunEvent]) -> None:
    """Every outcome landed under the fence of the latest claim before it."""
    fence = None
    for ev in timeline:
        if ev.type == "claimed":
            fence = ev.detail["fence"]
        elif ev.type in OUTCOME_EVENTS and "fence" in ev.detail:
            assert ev.detail["fence"] == fence, f"{describe([run])}: {ev.type} under fence {ev.detail['fence']}, latest claim {fence}"


def _lease_lost_since_claim(timeline: list[RunEvent]) -> bool:
    """The run was claimed, and its lease ran out after its latest claim."""
    types = [e.type for e in timeline]
    if "claimed" not in types:
        return False
    last_claim = len(types) - 1 - types[::-1].index("claimed")
    return "lease_expired" in types[last_claim:]


def _reason(run: Run, timeline: list[RunEvent]) -> str:
    said = [e.detail.get("reason", "") for e in timeline if e.type in ("skipped", "cancelled")]
    return run.last_error or next((r for r in said if r), "")


def describe(rows: list[Run]) -> str:
    """Runs in a line; a long list is cut in the middle (a misfire can make a thousand rows)."""
    shown = rows if len(rows) <= 12 else [*rows[:8], None, *rows[-3:]]
    return ", ".join(
        "..." if r is None else
        f"{r.pk}@{r.scheduled_for:%m-%d %H:%M:%S} {r.status}{' held' if r.held else ''}"
        f"{' backfill' if r.is_backfill else ''}"
        for r in shown
    )


# --------------------------------------------------------------------------- the tests


@pytest.fixture
def target() -> Iterator[ChosenAnswerTarget]:
    server = ChosenAnswerTarget().start()
    yield server
    server.stop()


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_edits_pauses_deletes_and_the_run_path_keep_both_promises(target: ChosenAnswerTarget) -> None:
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    before = EXAMPLES_RUN["count"]
    FIRED_IN.clear()
    run_state_machine_as_test(
        lambda: SchedulerMachine(owner, target),
        settings=settings(
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            # 18 steps at least (the CI profile's 12 left a rule the features
            # added under a tenth of the examples in one run of three): each of the 23
            # rules is drawn in more examples; the long profile keeps its 20.
            stateful_step_count=max(settings.default.stateful_step_count, 18),
        ),
    )
    # The profile's examples really ran (hypothesis may stop early only when it has
    # tried everything it can think of, which a machine this size never is).
    ran = EXAMPLES_RUN["count"] - before
    assert ran >= settings.default.max_examples
    print(f"\n{ran} examples; in how many each happened:")
    for what, count in sorted(FIRED_IN.items(), key=lambda item: -item[1]):
        print(f"  {count:5d} ({100 * count / ran:5.1f}%)  {what}")
    rare = {what: FIRED_IN[what] for what in MUST_FIRE if FIRED_IN[what] < ran / 10}
    assert not rare, f"fired in under a tenth of the {ran} examples: {rare}"


def test_the_ci_profile_runs_at_least_200_examples_and_the_long_one_5000() -> None:
    assert settings.get_profile("ci").max_examples >= 200
    assert settings.get_profile("long").max_examples >= 5000
    assert settings.default.max_examples >= 200, "the CI run loads a profile with fewer than 200 examples"


# --------------------------------------------------------------------------- the examples it found

# Hypothesis's minimal falsifying examples on main at 40a7cbc, replayed step by step
# through the same machine: each holds once its defect is fixed, whatever the random
# search happens to try in a given run.


def replay(owner: Any, target: ChosenAnswerTarget, steps: list[tuple[str, dict[str, Any]]]) -> None:
    machine = SchedulerMachine(owner, target)
    try:
        machine.both_promises_hold()
        for name, args in steps:
            if name == "answer":
                args = dict(args)
                machine.answer_call(machine.in_flight[args.pop("flight", 0)], **args)
            else:
                getattr(machine, name)(**args)
            machine.both_promises_hold()
    finally:
        machine.teardown()


FIRST_JOB = {"kind": "cron", "cron": "*/5 * * * *", "exclude": (), "zone": "UTC", "misfire": "skip", "window": 0,
             "later": 1}


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_the_model_finds_no_run_lost_after_a_schedule_edit(target: ChosenAnswerTarget) -> None:
    """Issue 12, defect 1: */5 edited to */2 at 20:31:01 replaces 20:35 with 20:32; the
    run after 20:32 must be 20:34, not the first */2 time after the cancelled 20:35."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", FIRST_JOB),
        ("advance_clock", {"seconds": 30}),
        ("lease_expiry", {}),
        ("edit_timing", {"job": 1, "kind": "cron", "cron": "*/2 * * * *", "later": 1, "zone": None}),
        ("worker_batch", {"answer": "ok"}),
    ])


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
@pytest.mark.parametrize("action", ["delete", "pause"])
def test_the_model_finds_no_runnable_next_run_after_a_delete_or_pause_during_the_call(
    target: ChosenAnswerTarget, action: str
) -> None:
    """Issue 12, defect 3: the job deleted (or paused) between the claim and the outcome
    gets no claimable next run."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", FIRST_JOB),
        ("claim", {"many": False}),
        (action, {"job": 1}),
        ("answer", {"answer": "ok"}),
    ])


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_the_model_checks_the_times_a_long_call_spans_under_each_overlap_policy(
    target: ChosenAnswerTarget, overlap: str
) -> None:
    """A */5 job's call lasts an hour (claimed, the clock on 3600 s, then answered):
    eleven times pass in flight, and the model's overlap check reads their rows."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {**FIRST_JOB, "overlap": overlap}),
        ("claim", {"many": False}),
        ("advance_clock", {"seconds": 3000}),
        ("answer", {"answer": "ok", "lasts": 600}),
        ("scan", {}),
        ("worker_batch", {"answer": "ok"}),
    ])
    expected = {"skip": 12, "buffer_one": 11, "allow": 0}[overlap]  # allow: nothing passes unrun
    assert Run.objects.filter(last_error__startswith=IN_FLIGHT).count() == expected


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=600)
def test_the_model_follows_allow_runs_side_by_side_that_end_out_of_order(target: ChosenAnswerTarget) -> None:
    """Overlap allow: two runs of one job claimed one after the other (each claim makes
    the next run), the later one ends dead first, then the earlier one succeeds;
    pause_after_failures 2 counts them by time, so a later dead run pauses the job."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {**FIRST_JOB, "overlap": "allow", "failures": 2, "retries": 0}),
        ("claim", {"many": False}),
        ("claim", {"many": False}),  # the clock on to the next run's time, a scan, its claim
        ("answer", {"flight": 1, "answer": "fail"}),  # the later run ends dead first
        ("answer", {"flight": 0, "answer": "ok"}),  # then the earlier one succeeds
        ("worker_batch", {"answer": "fail"}),  # the next run ends dead: the latest two by time are dead
    ])
    assert Run.objects.filter(detached=True).count() == 3
    assert Job.objects.get().paused
    assert AuditEntry.objects.filter(actor="scheduler", action="paused").count() == 1


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_the_model_judges_pause_after_failures_once_a_workers_batch_has_landed(target: ChosenAnswerTarget) -> None:
    """Found by the model (2026-12-05): overlap allow, pause_after_failures 1, no retries.
    Two runs are claimed by a slow worker whose leases then run out; the next worker's
    batch finds both out of tries (dead: leases lost) and calls the job's next run, which
    succeeds. The store writes the batch's outcomes in one transaction and then judges the
    job: its latest run by time succeeded, so it keeps running. The model judged each dead
    run as it came and paused the job."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {**FIRST_JOB, "cron": "*/5 * * * *", "overlap": "allow", "failures": 1, "retries": 0}),
        *[("lease_expiry", {})] * 5,
        ("claim", {"many": False}),
        ("claim", {"many": False}),
        ("worker_batch", {"answer": "ok"}),
    ])
    dead = Run.objects.filter(status=S.DEAD, last_error__contains="leases lost")
    assert dead.count() == 2
    latest = Run.objects.filter(status__in=[S.SUCCEEDED, S.DEAD]).order_by("-scheduled_for").first()
    assert latest is not None and latest.status == S.SUCCEEDED
    assert not Job.objects.get().paused
    assert not AuditEntry.objects.filter(actor="scheduler", action="paused").exists()


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_the_model_finds_the_excluded_times_of_a_new_schedule_skipped_when_its_next_run_keeps_its_time(
    target: ChosenAnswerTarget,
) -> None:
    """Found by the model on the first version of exclude: */5 excluded on 10-28 and 10-29,
    edited to */2, keeps 10-30 00:00 as its next run; the waiting run was only re-spread,
    so the */2 times of 10-28 had no `skipped` rows (the old */5 rows were cancelled)."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {**FIRST_JOB, "exclude": ("2026-10-28", "2026-10-29")}),
        ("edit_timing", {"job": 1, "kind": "cron", "cron": "*/2 * * * *", "later": 1, "zone": None}),
        ("worker_batch", {"answer": "ok"}),
    ])


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_the_model_follows_a_job_that_pauses_itself_and_one_paused_until_a_time(target: ChosenAnswerTarget) -> None:
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {**FIRST_JOB, "failures": 1}),
        ("worker_batch", {"answer": "fail"}),  # retry_scheduled
        ("worker_batch", {"answer": "fail"}),  # dead: the job pauses itself
        ("resume", {"job": 1}),
        ("pause_until", {"job": 1, "minutes": 5}),
        ("advance_clock", {"seconds": 299}),
        ("scan", {}),
        ("advance_clock", {"seconds": 1}),
        ("scan", {}),  # resumed
        ("worker_batch", {"answer": "ok"}),
    ])
    assert AuditEntry.objects.filter(actor="scheduler", action="paused").count() == 1
    assert AuditEntry.objects.filter(actor="scheduler", action="resumed").count() == 1


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_the_model_finds_a_date_taken_out_of_exclude_runs_again(target: ChosenAnswerTarget) -> None:
    """An excluded time's `skipped` row is cancelled by the edit that takes its date out of
    `exclude`, and opened again as the job's next run."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {**FIRST_JOB, "exclude": ("2026-10-28",)}),
        ("edit_exclude", {"job": 1, "exclude": ()}),
        ("worker_batch", {"answer": "ok"}),
    ])


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_the_model_finds_the_excluded_times_a_long_call_spans_skipped_as_excluded(target: ChosenAnswerTarget) -> None:
    """Found by the model once allow was in it: a */5 job's call, claimed at 20:30, lasts
    until 10-29 00:00 while 10-29 is excluded; the overlap plan passed over 10-29's times
    without their `excluded` rows (now written by the outcome, as the next-run path does)."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", FIRST_JOB),
        ("create_job", {**FIRST_JOB, "exclude": ("2026-10-28",)}),
        ("claim", {"many": False}),
        ("edit_exclude", {"job": 1, "exclude": ("2026-10-29",)}),
        ("worker_batch", {"answer": "ok"}),  # the clock to 10-29 00:00: the call's lease ran out, claimed again
    ])
    assert Run.objects.filter(job_id=1, last_error__startswith=nextrun.EXCLUDED_PREFIX).exists()


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_the_model_reads_an_overlap_edit_at_the_instant_of_an_outcome_in_the_order_they_ran(
    target: ChosenAnswerTarget,
) -> None:
    """Found by the model: an outcome under skip, then, at the same frozen instant, an
    edit to buffer_one; the model took the edit's policy for the outcome (it compared
    times; it now compares event ids)."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", FIRST_JOB),
        ("create_job", {**FIRST_JOB, "exclude": ("2026-10-28",)}),
        ("claim", {"many": False}),
        ("worker_batch", {"answer": "ok"}),
        ("edit_lifecycle", {"job": 1, "overlap": "buffer_one", "failures": 0}),
    ])
    assert Run.objects.filter(job_id=1, last_error__startswith=IN_FLIGHT).exists()


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_the_model_knows_an_every_job_pauses_itself_after_failures(target: ChosenAnswerTarget) -> None:
    """Found by the model: it paused only cron jobs itself, not `every` jobs."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {**FIRST_JOB, "kind": "every", "failures": 1, "retries": 0}),
        ("worker_batch", {"answer": "fail"}),
    ])
    assert Job.objects.get().paused


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=600)
def test_the_model_finds_a_fast_runs_outcome_stamped_at_its_own_answer_beside_a_slow_call(
    target: ChosenAnswerTarget,
) -> None:
    """Issue 47, defect 1: two jobs' runs in one message, the first job's endpoint slow
    (it answers 150 s later on the clock): the second job's outcome is stamped at its own
    answer; before, every outcome of the batch waited for the slowest call."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {**FIRST_JOB, "cron": "*/2 * * * *"}),
        ("create_job", {**FIRST_JOB, "cron": "*/2 * * * *"}),
        ("mixed_batch", {"slow": 150}),
    ])
    fast, slow = sorted(Run.objects.filter(status=S.SUCCEEDED, started_at__isnull=False),
                        key=lambda r: r.finished_at)
    assert slow.finished_at - fast.finished_at == timedelta(seconds=150)


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_a_retried_dead_run_leaves_the_pause_after_failures_row(target: ChosenAnswerTarget) -> None:
    """pause_after_failures=2: the 20:30 run dies and is retried (an extra run from then
    on), the 21:30 run dies: one normal run dead in a row, so the job keeps running, and
    the next retry is taken (the CI profile found the model counting the retried run)."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {**FIRST_JOB, "retries": 1, "failures": 2, "overlap": "skip"}),
        ("retry_dead", {"newest": False}),
        ("advance_clock", {"seconds": 3600}),
        ("retry_dead", {"newest": False}),
    ])


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_the_model_counts_the_times_a_requeued_dead_run_flew_past_without_rows(target: ChosenAnswerTarget) -> None:
    """The long profile's second find (5,000 examples): a dead run requeued (an extra
    run, `is_backfill`) flew in a mixed batch for a month of its every-two-minutes job;
    the store wrote rows for the latest 1,000 times and counted all on their events. The
    model looked for the counted span's start among the job's own runs only, found none
    before it (the extra run was the only row), and took the earlier times for lost."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {"kind": "cron", "overlap": "skip", "cron": "*/5 * * * *", "misfire": "skip", "window": 0,
                       "exclude": (), "zone": "UTC", "later": 5296, "failures": 0, "retries": 1}),
        ("pause_until", {"job": 1, "minutes": 1}),
        ("pause_until", {"job": 1, "minutes": 1}),
        ("pause_until", {"job": 1, "minutes": 1}),
        ("retry_dead_again", {}),
        ("mixed_batch", {"slow": 61}),
        ("create_job", {"cron": "0 0 1 1 *", "exclude": (), "failures": 0, "kind": "cron", "later": 922,
                        "misfire": "skip", "overlap": "skip", "retries": 1, "window": 0, "zone": "UTC"}),
        ("claim", {"many": True}),
        ("retry_dead_again", {}),
    ])


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_the_model_counts_the_times_of_a_month_long_flight_without_rows(target: ChosenAnswerTarget) -> None:
    """The long profile's find (5,000 examples): a mixed batch's slow call moved the clock
    a month on an every-two-minutes job; of the 20,000 times that passed in flight the
    store writes rows for the latest 1,000 and counts all on their events
    (`passed_in_flight`). The model took the earlier ones for lost."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {"failures": 0, "cron": "0 0 1 1 *", "retries": 0, "kind": "cron", "zone": "UTC", "exclude": (),
                       "later": 1111, "overlap": "skip", "window": 0, "misfire": "skip"}),
        ("run_now", {"job": 1}),
        ("run_now", {"job": 1}),
        ("edit_timing", {"cron": "*/5 * * * *", "job": 1, "kind": "zone", "later": 1312, "zone": "UTC"}),
        ("retry_dead", {"newest": True}),
        ("run_now", {"job": 1}),
        ("edit_timing", {"cron": "0 0 1 1 *", "job": 1, "kind": "zone", "later": 383, "zone": "UTC"}),
        ("mixed_batch", {"slow": 150}),
        ("edit_target", {"job": 1, "other": True}),
        ("edit_target", {"job": 1, "other": False}),
        ("edit_target", {"job": 1, "other": True}),
        ("backfill", {"hours": 2, "job": 1}),
        ("claim", {"many": True}),
        ("retry_dead", {"newest": False}),
        ("claim", {"many": False}),
        ("mixed_batch", {"slow": 150}),
    ])


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_a_scan_an_hour_after_an_edit_leaves_no_due_run_behind(target: ChosenAnswerTarget) -> None:
    """The long profile's find on 9c1c1d5: */5 edited to hourly (21:00 runs, 22:00 waits),
    then to */2 (22:00 cancelled, 21:02 waits); at 22:01:01 misfire `skip` skipped
    21:02 to 21:58 and left the missed 22:00 as its cancelled row, so the job's next
    run, the first time after the skipped rows, was 22:00: the cancelled row reopened,
    waiting, already missed, and no scan ever took it (the misfire path had run)."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {"kind": "cron", "cron": "*/5 * * * *", "exclude": (), "zone": "UTC", "misfire": "skip",
                       "window": 0, "later": 1, "overlap": "skip", "failures": 0, "retries": 1}),
        ("edit_target", {"job": 1, "other": False}),
        ("edit_timing", {"cron": "0 * * * *", "job": 1, "kind": "cron", "later": 1, "zone": None}),
        ("worker_batch", {"answer": "ok", "mixed": False}),
        ("edit_timing", {"cron": "*/2 * * * *", "job": 1, "kind": "cron", "later": 1, "zone": None}),
        ("advance_clock", {"seconds": 3600}),
        ("lease_expiry", {}),
    ])


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_LEASE_SECONDS=60)
def test_run_all_after_a_pause_runs_the_times_before_an_excluded_day(target: ChosenAnswerTarget) -> None:
    """The CI profile's find (it fails on 9c1c1d5 as well): a run_all job excluding
    29 October, paused from 20:29:30 until 20:30:30, resumed by a scan at 30 October
    00:00 (the clock went on to another job's run). The late 20:30 ran, and the misfire
    path wrote the excluded day's 288 `skipped` rows at once: the job's latest rows, so
    when 20:30 ended its next run was 30 October 00:05, and 20:35 to 23:55 on the 28th,
    each to run in turn, were lost."""
    owner, _ = service_account_ensure(name="stateful", email="stateful@example.test")
    replay(owner, target, [
        ("first_job", {"kind": "cron", "cron": "*/5 * * * *", "exclude": (), "zone": "UTC", "misfire": "skip",
                       "window": 0, "later": 1, "overlap": "skip", "failures": 0, "retries": 1}),
        ("edit_lifecycle", {"failures": 0, "job": 1, "overlap": "skip"}),
        ("create_job", {"cron": "*/5 * * * *", "exclude": ("2026-10-29",), "failures": 0, "kind": "cron", "later": 1,
                        "misfire": "run_all", "overlap": "skip", "retries": 1, "window": 0, "zone": "UTC"}),
        ("edit_exclude", {"exclude": ("2026-10-28", "2026-10-29"), "job": 1}),
        ("pause_until", {"job": 2, "minutes": 1}),
        ("retry_dead_again", {}),
    ])
