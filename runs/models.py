"""The run: one execution of a job at one scheduled time, and its timeline."""
from __future__ import annotations

from datetime import datetime, timezone as dt_timezone
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models.lookups import In
from django.utils import timezone
from django.utils.functional import cached_property

from jobs.models import Job
from jobs.public_ids import format_id


# Run.kept_for of an open run: past any scheduled time, so that the open runs sit
# apart from the history of ended ones (docs/performance.md, "The store at scale:
# the due read, retention, growth").
OPEN_KEPT_FOR = datetime(9999, 12, 31, tzinfo=dt_timezone.utc)
# The same, for PostgreSQL statements written by hand: naming it lets the planner read
# the open runs' partition alone (migration runs 0015), not every day of the history.
OPEN_KEPT_FOR_SQL = "'9999-12-31 00:00:00+00'::timestamptz"


def kept_for_of(status: str, scheduled_for: datetime) -> datetime:
    """The rule the store keeps (migration runs 0014): OPEN_KEPT_FOR while a run is
    open (Run.OPEN), its scheduled time once it has ended."""
    return OPEN_KEPT_FOR if status in Run.OPEN else scheduled_for


class KeptForField(models.DateTimeField):
    """Run.kept_for, computed from the row on every insert and save (bulk ones too:
    Django asks pre_save of each field of each row). An UPDATE through the ORM that
    names `status` or `scheduled_for` gets it from RunQuerySet.update; a statement
    written by hand that moves a run between open and ended names it itself, and on
    PostgreSQL the check constraint `runs_kept_for_rule` refuses one that does not."""

    def pre_save(self, model_instance: models.Model, add: bool) -> datetime:
        value = kept_for_of(model_instance.status, model_instance.scheduled_for)
        setattr(model_instance, self.attname, value)
        return value


# What decides kept_for (kept_for_of): an UPDATE naming any of them also sets it.
KEPT_FOR_FROM = ("status", "scheduled_for", "kept_for")


def kept_for_expression(status: object, scheduled_for: object) -> object:
    """kept_for as an UPDATE sets it, from the new status and scheduled time (each a
    value or an expression of the old row, as in the statement's SET)."""
    if isinstance(status, str):
        return OPEN_KEPT_FOR if status in Run.OPEN else scheduled_for
    if not hasattr(status, "resolve_expression"):
        status = models.Value(status, output_field=models.CharField())
    return models.Case(
        models.When(In(status, list(Run.OPEN)), then=models.Value(OPEN_KEPT_FOR)),
        default=scheduled_for,
        output_field=models.DateTimeField(),
    )


class RunQuerySet(models.QuerySet):
    def update(self, **kwargs: object) -> int:
        """An update that names the status or the scheduled time (or the key) sets the
        key from them, in the same statement: kept_for_of, as the store checks it.
        Setting it here rather than in a BEFORE UPDATE trigger matters on PostgreSQL:
        a table with such a trigger has every updated row locked first, one WAL record
        a row, whether the trigger fires or not (the claim and the outcome paid 54
        bytes a run each; docs/performance.md, "What a run does")."""
        if any(name in kwargs for name in KEPT_FOR_FROM):
            kwargs["kept_for"] = kept_for_expression(
                kwargs.get("status", models.F("status")), kwargs.get("scheduled_for", models.F("scheduled_for")))
        return super().update(**kwargs)

    update.alters_data = True  # type: ignore[attr-defined]


class Run(models.Model):
    class Status(models.TextChoices):
        SCHEDULED = "scheduled"
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        DEAD = "dead"
        SKIPPED = "skipped"
        CANCELLED = "cancelled"

    OPEN = (Status.SCHEDULED, Status.QUEUED, Status.RUNNING)
    TERMINAL = (Status.SUCCEEDED, Status.DEAD, Status.SKIPPED, Status.CANCELLED)

    # No index of its own: runs_one_run_per_time (job, scheduled_for) leads with job.
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="runs", db_index=False)
    scheduled_for = models.DateTimeField()  # the nominal time, whole seconds, UTC
    due_at = models.DateTimeField()  # when it may start: inside the window, or the retry time
    partition = models.SmallIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.SCHEDULED)
    # Held runs are not scanned: the job is paused, or its target host is paused.
    held = models.BooleanField(default=False)
    attempt = models.PositiveIntegerField(default=0)  # calls made (claims that call the target)
    # Calls made before the run was last requeued from the dead list: the retry
    # policy counts `attempt - attempt_base`, while X-Attempt keeps rising.
    attempt_base = models.PositiveIntegerField(default=0)
    fence = models.BigIntegerField(default=0)  # +1 on every lease handed out
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    queued_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    is_backfill = models.BooleanField(default=False)
    # Overlap `allow`: set at the run's first claim, when the job's next run is made
    # (runs.services._detach_claimed). From then on it is no longer the job's waiting
    # run: it runs beside the next one, and its outcome makes no next run.
    detached = models.BooleanField(default=False)
    # The dead list: an operator marks a dead run handled (or requeues it).
    handled_at = models.DateTimeField(null=True, blank=True)
    handled_by = models.CharField(max_length=150, blank=True)
    # Set by whoever makes the run (the `scheduled` entry's time when it is on the row);
    # a default, not auto_now_add, so that a writer's own clock reading is kept.
    created_at = models.DateTimeField(default=timezone.now)

    # The happy path's timeline, on the row (runs.timeline): which entries are here
    # rather than in run_events (ON_ROW_* bits), and the facts they are read from.
    # Columns of their own, written only by the step that sets the bit (the run's
    # creation, the queueing, the claim, the outcome), so no other write can change
    # what an entry says; the first event row written for a run turns its on-row
    # entries into rows first (runs.events.settle) and clears the bits.
    on_row = models.PositiveSmallIntegerField(default=0)
    on_row_due_at = models.DateTimeField(null=True, blank=True)  # `scheduled`: due_at as made
    on_row_queued_at = models.DateTimeField(null=True, blank=True)  # `queued`
    on_row_claimed_at = models.DateTimeField(null=True, blank=True)  # `claimed` (fence, attempt: the row's)
    on_row_worker = models.CharField(max_length=200, blank=True)  # `claimed`'s worker
    on_row_answer = models.PositiveSmallIntegerField(null=True, blank=True)  # `target_answered` status
    on_row_duration_ms = models.PositiveIntegerField(null=True, blank=True)  # `target_answered`
    # The run whose outcome made this one: that run's `succeeded` entry names this run
    # (set with the insert, so the outcome needs no second write to name its next run).
    on_row_made_by = models.BigIntegerField(null=True, blank=True)

    # The history's key (issue 18): OPEN_KEPT_FOR while the run is open, its
    # scheduled_for once it has ended (kept_for_of). Not a generated column, which
    # PostgreSQL does not take as a partition key: the model computes it on insert
    # and save, RunQuerySet.update on any other ORM update, the hand-written
    # statements themselves; on PostgreSQL a check constraint refuses a row that
    # breaks the rule (migrations runs 0014 and 0016).
    kept_for = KeptForField(default=OPEN_KEPT_FOR)

    objects = RunQuerySet.as_manager()

    # What the indexes read instead of `status` (generated by the store): `waiting` while
    # scheduled, `flight` while queued or running, the status itself once ended. No
    # index names `status`, `queued_at` or the lease. On PostgreSQL the open runs'
    # partition has no index that names `stage` either (migration runs 0017: the
    # indexes below are what SQLite has; PostgreSQL's open partition has the key, the
    # two unique ones, runs_finished_idx and runs_due_idx_open on (partition, held,
    # due_at), the history the rest), so the queueing (scheduled to queued) and the
    # claim (queued to running) are HOT updates: a new version on the same page and no
    # index entry (an index names a column also by its predicate). Only a run's insert
    # and its end write index entries (docs/performance.md, "What a run does").
    stage = models.GeneratedField(
        expression=models.Case(
            models.When(status="scheduled", then=models.Value("waiting")),
            models.When(status__in=["queued", "running"], then=models.Value("flight")),
            default=models.F("status"),
        ),
        output_field=models.CharField(max_length=16),
        db_persist=True,
    )

    class Meta:
        db_table = "runs"
        constraints = [
            models.UniqueConstraint(fields=["job", "scheduled_for"], name="runs_one_run_per_time"),
            # A job has at most one open run, backfills and detached runs (overlap
            # `allow`: runs in flight beside the next one) apart: its waiting run.
            models.UniqueConstraint(
                fields=["job"],
                condition=models.Q(stage__in=["waiting", "flight"], is_backfill=False, detached=False),
                name="runs_one_open_run_per_job",
            ),
        ]
        indexes = [
            # The open runs: the scanner's question (`waiting`, not held, by due_at: one
            # short range read per partition) and the runs in flight that its recovery
            # and back-pressure read (`flight`: at most SCHEDULER_MAX_QUEUED and those
            # running), neither of which the claim moves a run out of.
            models.Index(
                fields=["partition", "stage", "held", "due_at"],
                condition=models.Q(stage__in=["waiting", "flight"]),
                name="runs_due_idx",
            ),
            # The open-run counts and the `?status=` lists of every status but succeeded
            # (the dead list): `?status=succeeded`, newest first, reads runs_pkey
            # backwards, where nearly every row is one. So a run's last version adds no
            # entry, and its claim none either (queued and running are both `flight`).
            models.Index(fields=["stage", "-id"], condition=~models.Q(stage="succeeded"), name="runs_status_idx"),
            # prune_runs and the lag figures read finished runs only: open runs (and
            # their updates on the way to done) stay out of this index.
            models.Index(
                fields=["finished_at"], condition=models.Q(finished_at__isnull=False), name="runs_finished_idx"
            ),
            # The dashboard's "dead, not handled": a count of this small index, not of the table.
            models.Index(
                fields=["id"], condition=models.Q(stage="dead", handled_at__isnull=True), name="runs_dead_unhandled_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.public_id} {self.status}"

    def save(self, *args: object, **kwargs: object) -> None:
        # A save of some fields only: the key goes with the status or time it follows.
        fields = kwargs.get("update_fields")
        if fields is not None and any(name in fields for name in KEPT_FOR_FROM):
            kwargs["update_fields"] = {*fields, "kept_for"}
        super().save(*args, **kwargs)

    @property
    def public_id(self) -> str:
        return format_id("run", self.pk)

    @property
    def idempotency_key(self) -> str:
        return f"{format_id('job', self.job_id)}@{self.scheduled_for.strftime('%Y-%m-%dT%H:%M:%SZ')}"

    @property
    def is_open(self) -> bool:
        return self.status in self.OPEN

    @cached_property
    def timeline(self) -> list["RunEvent"]:
        """Its whole timeline, oldest first: event rows and the entries on this row."""
        from runs.timeline import timeline

        return timeline(self)


# The job's own open run, the one runs_one_open_run_per_job keeps to one: scheduled,
# queued or running, not an extra run (a backfill, run-now, a requeued dead run) and not
# detached (overlap `allow`: a run in flight beside it). An allow-job's detached runs
# are its other open runs; every other job's open run is this one.
JOBS_OPEN_RUN = models.Q(stage__in=("waiting", "flight"), is_backfill=False, detached=False, kept_for=OPEN_KEPT_FOR)

# Run.stage of each status (the generated column's rule, for the queries that name it).
STAGE_OF = {"scheduled": "waiting", "queued": "flight", "running": "flight"}


def with_status(*statuses: str) -> models.Q:
    """Runs in any of these statuses, said so that the indexes (which name `stage`,
    never `status`) can serve it: the statuses' stages, and the statuses themselves
    where a stage holds more than one. When they are all open (or all ended) it names
    the history's key too, so that on the partitioned store (migration runs 0015) the
    planner reads only the open runs' partition (or only the history's)."""
    stages = sorted({STAGE_OF.get(s, s) for s in statuses})
    q = models.Q(stage=stages[0]) if len(stages) == 1 else models.Q(stage__in=stages)
    if any(s in STAGE_OF for s in statuses):
        q &= models.Q(status=statuses[0]) if len(statuses) == 1 else models.Q(status__in=statuses)
    if all(s in STAGE_OF for s in statuses):
        q &= models.Q(kept_for=OPEN_KEPT_FOR)
    elif not any(s in STAGE_OF for s in statuses):
        q &= models.Q(kept_for__lt=OPEN_KEPT_FOR)
    return q


def ended_newest_first(statuses: tuple[str, ...], **filters: object) -> models.QuerySet:
    """Ended runs in these statuses, newest scheduled time first, in the order of the
    (job, kept_for, scheduled_for) index: an ended run's key is its scheduled time
    (kept_for_of), so with a job named each history partition gives its newest row and
    a merge takes the first. Ordered by `scheduled_for` alone, every partition read all
    of the job's runs in it and sorted them (1,440 a day's partition for an
    every-minute job). (job, kept_for, scheduled_for) is unique: no tie to break."""
    assert not any(s in STAGE_OF for s in statuses), statuses
    return Run.objects.filter(with_status(*statuses), **filters).order_by("-kept_for", "-scheduled_for")

# Run.on_row bits: the happy path's five timeline entries, each on the row while set.
ON_ROW_SCHEDULED = 1
ON_ROW_QUEUED = 2
ON_ROW_CLAIMED = 4
ON_ROW_ANSWERED = 8
ON_ROW_SUCCEEDED = 16


class RunEvent(models.Model):
    """One line of a run's timeline."""

    # The timeline is append-only and written in bulk: no foreign-key trigger per row
    # (a run's events go with it through the ORM: prune_runs, admin deletes), and no
    # index of its own (run_events_run_idx leads with run).
    run = models.ForeignKey(
        Run, on_delete=models.CASCADE, related_name="events", db_index=False, db_constraint=False
    )
    at = models.DateTimeField()
    type = models.CharField(max_length=40)
    detail = models.JSONField(default=dict, blank=True)
    # Its run's scheduled_for, which never changes: on PostgreSQL the key the events
    # are partitioned by (migration runs 0019), so that a run's events sit in the
    # partition of the same span as its ended row and go with it (runs.partitions).
    scheduled_for = models.DateTimeField()

    class Meta:
        db_table = "run_events"
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["run", "at"], name="run_events_run_idx")]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%dT%H:%M:%SZ} {self.type}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.scheduled_for is None:  # one row through the ORM (an admin, a test)
            self.scheduled_for = self.run.scheduled_for
        super().save(*args, **kwargs)


class PausedTarget(models.Model):
    """A target host (as written in the URL, port included) whose runs are held."""

    host = models.CharField(max_length=300, unique=True)
    paused_at = models.DateTimeField(auto_now_add=True)
    paused_by = models.CharField(max_length=150, blank=True)

    class Meta:
        db_table = "paused_targets"

    def __str__(self) -> str:
        return self.host


class TargetSlot(models.Model):
    """One call in flight to a target host: the bulkhead's unit (runs.bulkhead).

    A host has slots 0..SCHEDULER_TARGET_CONCURRENCY-1; a row is a slot taken.
    The unique (host, slot) pair is what makes taking one atomic without locks,
    and `expires_at` (a lease, extended by the call's heartbeat) is what frees
    the slot of a worker that died holding it.
    """

    host = models.CharField(max_length=300)
    slot = models.PositiveSmallIntegerField()
    holder = models.CharField(max_length=300)  # "<run id>/<worker>"
    taken_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "target_slots"
        constraints = [models.UniqueConstraint(fields=["host", "slot"], name="target_slots_one_holder")]

    def __str__(self) -> str:
        return f"{self.host}#{self.slot}"


class TargetBreaker(models.Model):
    """A circuit breaker per target host (runs.breakers). No row: closed, never failed."""

    class State(models.TextChoices):
        CLOSED = "closed"
        OPEN = "open"  # runs are held until next_probe_at
        HALF_OPEN = "half_open"  # one probe run is in flight

    host = models.CharField(max_length=300, unique=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.CLOSED)
    failures = models.PositiveIntegerField(default=0)  # consecutive
    opened_at = models.DateTimeField(null=True, blank=True)
    next_probe_at = models.DateTimeField(null=True, blank=True)
    probe_holder = models.CharField(max_length=300, blank=True)
    probe_until = models.DateTimeField(null=True, blank=True)  # a probe whose worker died frees itself
    last_failure_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    # Whose run that failure was: a host is shared, its failure text (a target may echo
    # the request, secrets and all) is shown to that service and staff only.
    last_error_owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "target_breakers"

    def __str__(self) -> str:
        return f"{self.host} {self.state}"


class BreakerTransition(models.Model):
    """A breaker's history: each change of state, with why."""

    breaker = models.ForeignKey(TargetBreaker, on_delete=models.CASCADE, related_name="transitions")
    at = models.DateTimeField()
    state = models.CharField(max_length=16, choices=TargetBreaker.State.choices)
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        db_table = "target_breaker_transitions"
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["breaker", "-at"], name="breaker_transitions_idx")]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%dT%H:%M:%SZ} {self.state}"


class Notice(models.Model):
    """The notices outbox (runs.notices): a row is written in the transaction that
    makes a run dead or skipped (or pauses a job), and sent afterwards, one digest
    per job, by runs.notices.notices_send. A worker only ever inserts rows here."""

    class Kind(models.TextChoices):
        DEAD = "dead"
        SKIPPED = "skipped"
        PAUSED = "paused"

    class Status(models.TextChoices):
        PENDING = "pending"
        SENT = "sent"
        FAILED = "failed"  # out of tries, refused, or nowhere to send: last_error says which

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="notices")
    # No database foreign key: runs is partitioned (migration runs 0015), its primary key
    # (id, kept_for). The ORM deletes a run's notices with it.
    run = models.ForeignKey(
        Run, null=True, blank=True, on_delete=models.CASCADE, related_name="notices", db_constraint=False
    )
    kind = models.CharField(max_length=16, choices=Kind.choices)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    # The earliest it may go out: at once, the end of the job's digest window, or a retry's time.
    due_at = models.DateTimeField()
    tries = models.PositiveIntegerField(default=0)
    sent_at = models.DateTimeField(null=True, blank=True)
    sent_to = models.CharField(max_length=2000, blank=True)
    last_error = models.TextField(blank=True)

    class Meta:
        db_table = "notices"
        indexes = [
            models.Index(fields=["due_at"], condition=models.Q(status="pending"), name="notices_due_idx"),
            models.Index(fields=["job", "status"], name="notices_job_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} notice {self.pk} of {self.job.public_id}"


# Lag bucket edges (seconds) of RunRollup: b0 counts lag <= 0.05, b<i> lag in
# (edge[i-1], edge[i]], b12 lag over an hour. /metrics' histogram takes a subset.
ROLLUP_LAG_EDGES = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)


class RunRollup(models.Model):
    """Small counters written where runs move (runs.rollups), so the dashboard and
    `/metrics` read a few hundred rows instead of counting `runs` and `run_events`.

    One row per (minute, kind, reason, host, job, shard); the row whose minute is
    `rollups.TOTAL_MINUTE` (1970-01-01) holds the all-time total of the same key.
    `shard` spreads one minute's hot row over the writing processes (pid % 8).
    """

    minute = models.DateTimeField()
    kind = models.CharField(max_length=24)  # started, succeeded, retry_scheduled, dead, skipped, cancelled, call...
    reason = models.CharField(max_length=24, default="", blank=True)  # skipped: misfire, overlap, excluded, paused
    host = models.CharField(max_length=300, default="", blank=True)  # call, call_failed
    job_id = models.BigIntegerField(default=0)  # skipped: whose run it was (0: not per job)
    shard = models.SmallIntegerField(default=0)
    n = models.BigIntegerField(default=0)
    lag_n = models.BigIntegerField(default=0)  # started: runs measured (first start, on or after due)
    lag_sum = models.FloatField(default=0.0)
    b0 = models.BigIntegerField(default=0)
    b1 = models.BigIntegerField(default=0)
    b2 = models.BigIntegerField(default=0)
    b3 = models.BigIntegerField(default=0)
    b4 = models.BigIntegerField(default=0)
    b5 = models.BigIntegerField(default=0)
    b6 = models.BigIntegerField(default=0)
    b7 = models.BigIntegerField(default=0)
    b8 = models.BigIntegerField(default=0)
    b9 = models.BigIntegerField(default=0)
    b10 = models.BigIntegerField(default=0)
    b11 = models.BigIntegerField(default=0)
    b12 = models.BigIntegerField(default=0)

    class Meta:
        db_table = "run_rollups"
        constraints = [
            models.UniqueConstraint(
                fields=["minute", "kind", "reason", "host", "job_id", "shard"], name="run_rollups_key"
            )
        ]
        # The dashboard reads a few kinds over a range of minutes.
        indexes = [models.Index(fields=["kind", "minute"], name="run_rollups_kind_idx")]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%dT%H:%MZ} {self.kind} {self.n}"


class WorkerHeartbeat(models.Model):
    """A worker process's heartbeat (runs.workers): written every few seconds by the
    worker itself, read by the system page. No broadcast: a dead worker just stops."""

    name = models.CharField(max_length=200, unique=True)
    host = models.CharField(max_length=200)
    pid = models.IntegerField(default=0)
    started_at = models.DateTimeField()
    beat_at = models.DateTimeField()
    in_flight = models.IntegerField(default=0)  # runs this worker holds a live lease on
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "worker_heartbeats"

    def __str__(self) -> str:
        return self.name
