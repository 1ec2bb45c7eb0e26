"""The soak's user actions, and the reference schedule they are judged against.

A user edits, pauses, resumes, deletes, runs now and backfills the soak's own jobs
while the machine faults go on (bench/soak.py injects both, each kind as a fault
kind). Every action goes through the same services the REST API and the commands
call (jobs.services, jobs.ops), at a `now` the driver stamps, and the driver keeps
each job's history: its timings (schedule, zone, one-off time, window) with the time
each took effect, its paused intervals, and when it was deleted. From that history
`judge` works out which times were due and what must have happened to each:

- a time t of the timing in force at t, after the job's creation or the edit that
  set that timing, before its deletion, with t + window no later than the cutoff,
  must have a run that started;
- a time that fell while the job was paused, or whose run a pause held, is due once
  the job is resumed: resuming applies the misfire policy (docs/reference.md), so under
  `skip` and `run_once` a `skipped` row with a misfire reason answers for it too
  (`run_all` runs every missed time); a pause never resumed leaves it undue;
- a user action may end a time's run before it starts: a run cancelled by a delete
  or an edit, or held by a pause that is never resumed, is excused when the action
  came within the time's window plus SCHEDULER_MISFIRE_GRACE (the lateness the
  contract allows); later than that, the run should have started already: missed;
- an extra run (a backfill, a run-now) made while the job was live must start too,
  under the same excuses (backfills never misfire);
- no run starts while its job is paused or after it was deleted: a `claimed` event
  after the pause or delete took effect is counted, unless it takes over an attempt
  that had started before it ("a run already running finishes").
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone as dt_timezone
from typing import Any, Callable

USER_KINDS = ("user_edit", "user_pause", "user_resume", "user_delete", "user_run_now", "user_backfill",
              "user_overlap", "user_pause_until", "user_delete_paused", "user_retry_dead")
# The overlap action's slow calls: the soak target holds a call this long (`?hold=`),
# longer than a minute, so an every-minute job's next time comes while it is in flight.
OVERLAP_HOLD_S = 65
OVERLAP_SLOW_AT_ONCE = 2  # jobs with held calls at a time: the target's threads are few
# Schedules an edit picks from: dense and sparse ones (a yearly one has no time in a
# soak; edited back to every minute, its next run must follow the new schedule).
CRONS = ("* * * * *", "*/2 * * * *", "*/3 * * * *", "1-59/2 * * * *", "*/5 * * * *", "0 0 1 1 *")
ZONES = ("UTC", "Asia/Kolkata", "Asia/Kathmandu", "America/St_Johns")
MISFIRE = ("run_once", "skip", "run_all")
# The reasons the services write on a run a user action ended.
USER_CANCEL_REASONS = ("job deleted", "the job's timing changed")


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, dt_timezone.utc)


@dataclass(frozen=True)
class Timing:
    """A job's timing from `since` on (one of schedule and run_at)."""

    since: datetime
    schedule: str
    timezone: str
    run_at: datetime | None
    window: int
    run_at_set: datetime  # when run_at took its value (a one-off's time is due once)


@dataclass
class Pause:
    started: datetime  # the `now` the pause was made at: times from here on fell while paused
    took_effect: datetime  # when the pause had committed: a claim after this is a paused start
    resumed: datetime | None = None  # the `now` of the resume


@dataclass
class History:
    job_id: int
    name: str
    misfire: str
    created: datetime
    timings: list[Timing]
    pauses: list[Pause] = field(default_factory=list)
    deleted_at: datetime | None = None
    deleted_took_effect: datetime | None = None

    def paused_at(self, t: datetime) -> Pause | None:
        return next((p for p in self.pauses if p.started <= t and (p.resumed is None or t < p.resumed)), None)

    def open_pause(self) -> Pause | None:
        return self.pauses[-1] if self.pauses and self.pauses[-1].resumed is None else None

    def pause_until_ahead(self, now: datetime) -> Pause | None:
        """A pause with a paused_until still to come (its `resumed` is that time)."""
        last = self.pauses[-1] if self.pauses else None
        return last if last is not None and last.resumed is not None and last.resumed > now else None


def timing_of(job: Any, since: datetime, previous: Timing | None = None) -> Timing:
    run_at_set = since
    if previous is not None and previous.run_at == job.run_at:
        run_at_set = previous.run_at_set
    return Timing(since, job.schedule, job.timezone, job.run_at, job.window_seconds, run_at_set)


class UserActions:
    """The user: one action at a time, from the soak's action thread."""

    def __init__(self, owner: Any, job_fields: Callable[[str], dict[str, Any]], ports: list[int],
                 target_url: Callable[[int, str], str]) -> None:
        self.owner = owner
        self.job_fields = job_fields
        self.ports = ports
        self.target_url = target_url
        self.histories: dict[int, History] = {}
        self.pool: list[int] = []  # the jobs actions pick from (the delay stream's are left alone)
        self.lock = threading.Lock()
        self.replacements = 0
        self.last_extra: int | None = None  # the job that last got a backfill or a run-now
        self.slow: list[int] = []  # the overlap action's jobs whose calls are held (oldest first)
        self.retried: list[tuple[int, datetime]] = []  # (run pk, when) of each dead run retried
        self.dead_made = 0

    # ------------------------------------------------------------------ history

    def created(self, job: Any, now: datetime, in_pool: bool) -> None:
        with self.lock:
            self.histories[job.pk] = History(job.pk, job.name, job.misfire, now, [timing_of(job, now)])
            if in_pool:
                self.pool.append(job.pk)

    def _pick(self, want: Callable[[Any], bool], in_flight: float = 0.0) -> Any | None:
        """A live job of the pool that `want`s; with probability `in_flight`, one whose
        run is running right now if there is one within 3 s (a user acting while a
        worker calls the target is the interleaving that matters)."""
        from jobs.models import Job
        from runs.models import Run

        with self.lock:
            pool = list(self.pool)
        if random.random() < in_flight:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                busy = set(Run.objects.filter(job_id__in=pool, status=Run.Status.RUNNING).values_list("job_id", flat=True))
                jobs = [j for j in Job.objects.filter(pk__in=busy) if j.state != Job.State.DELETED and want(j)]
                if jobs:
                    return random.choice(jobs)
                time.sleep(0.05)
        jobs = [j for j in Job.objects.filter(pk__in=pool) if j.state != Job.State.DELETED and want(j)]
        return random.choice(jobs) if jobs else None

    # ------------------------------------------------------------------ the actions

    def user_edit(self) -> dict[str, Any]:
        from jobs.services import job_update

        job = self._pick(lambda j: True, in_flight=0.5)
        if job is None:
            return {"error": "no live job"}
        now = utc(time.time())
        what = random.choice(["schedule", "schedule", "schedule", "timezone", "window", "target", "at"])
        if what == "schedule":
            fields: dict[str, Any] = {"schedule": random.choice([c for c in CRONS if c != job.schedule])}
        elif what == "timezone":
            fields = {"timezone": random.choice([z for z in ZONES if z != job.timezone])}
        elif what == "window":
            fields = {"window_seconds": random.choice([w for w in (0, 5, 20) if w != job.window_seconds])}
        elif what == "target":
            port = random.choice([p for p in self.ports if f":{p}/" not in job.target] or self.ports)
            fields = {"target": self.target_url(port, job.name)}
        else:  # a new one-off time (a cron job becomes a one-off)
            fields = {"run_at": utc(int(time.time() + random.uniform(5, 45)) + 1)}
        before = "cron " + job.schedule if job.schedule else "at " + job.run_at.strftime("%H:%M:%S")
        try:
            job = job_update(job=job, fields=fields, now=now)
        except ValueError as exc:  # refused (e.g. a one-off time that already has a run): nothing changed
            return {"job": job.public_id, "change": what, "error": str(exc)}
        with self.lock:
            history = self.histories[job.pk]
            new = timing_of(job, now, history.timings[-1])
            last = history.timings[-1]
            if (new.schedule, new.timezone, new.run_at, new.window) != (last.schedule, last.timezone, last.run_at,
                                                                        last.window):
                history.timings.append(new)
        return {"job": job.public_id, "change": what, "from": before,
                "to": {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in fields.items()}}

    def user_pause(self) -> dict[str, Any]:
        from jobs.services import job_update

        from jobs.models import Job

        job = None
        if self.last_extra is not None and random.random() < 0.3:  # backfill (or run now), then pause
            job = Job.objects.filter(pk=self.last_extra, paused=False).exclude(state=Job.State.DELETED).first()
        job = job or self._pick(lambda j: not j.paused, in_flight=0.5)
        if job is None:
            return {"error": "no active job"}
        now = utc(time.time())
        job_update(job=job, fields={"paused": True}, now=now)
        with self.lock:
            self.histories[job.pk].pauses.append(Pause(now, utc(time.time())))
        return {"job": job.public_id}

    def user_resume(self) -> dict[str, Any]:
        from jobs.services import job_update

        job = self._pick(lambda j: j.paused)
        if job is None:
            return {"error": "no paused job"}
        if random.random() < 0.5:  # half the time the longest paused: some pauses outlast window + grace
            with self.lock:
                paused = {pk: h.open_pause() for pk, h in self.histories.items() if h.open_pause() is not None}
            from jobs.models import Job

            oldest = sorted((p.started, pk) for pk, p in paused.items() if p is not None)
            live = set(Job.objects.filter(pk__in=[pk for _, pk in oldest], paused=True)
                       .exclude(state=Job.State.DELETED).values_list("pk", flat=True))
            job = next((Job.objects.get(pk=pk) for _, pk in oldest if pk in live), job)
        now = utc(time.time())
        job_update(job=job, fields={"paused": False}, now=now)
        with self.lock:
            pause = self.histories[job.pk].open_pause() or self.histories[job.pk].pause_until_ahead(now)
            if pause is not None:
                pause.resumed = now
        return {"job": job.public_id, "paused_s": round((now - pause.started).total_seconds(), 1) if pause else None}

    def user_delete(self) -> dict[str, Any]:
        job = self._pick(lambda j: True, in_flight=0.5)
        if job is None:
            return {"error": "no live job"}
        return self._delete(job)

    def user_delete_paused(self) -> dict[str, Any]:
        """A paused job deleted, half the time one paused until a time (its resume time
        must not outlive it)."""
        from jobs.models import Job

        until = list(Job.objects.filter(pk__in=self.pool, paused=True, paused_until__isnull=False)
                     .exclude(state=Job.State.DELETED))
        job = random.choice(until) if until and random.random() < 0.5 else self._pick(lambda j: j.paused)
        if job is None:
            return {"error": "no paused job"}
        return {**self._delete(job), "paused_until": job.paused_until.isoformat() if job.paused_until else None}

    def _delete(self, job: Any) -> dict[str, Any]:
        from jobs.services import job_create, job_delete

        now = utc(time.time())
        job_delete(job=job, now=now)
        with self.lock:
            self.histories[job.pk].deleted_at = now
            self.histories[job.pk].deleted_took_effect = utc(time.time())
        # A new job takes its place, so the pool does not run dry.
        self.replacements += 1
        fields = self.job_fields(f"r{self.replacements}")
        fields.update(schedule=random.choice(CRONS), window_seconds=random.choice([0, 5, 20]),
                      misfire=random.choice(MISFIRE))
        created_at = utc(time.time())
        new = job_create(owner=self.owner, fields=fields, now=created_at)
        self.created(new, created_at, in_pool=True)
        return {"job": job.public_id, "replaced_by": new.public_id}

    def user_run_now(self) -> dict[str, Any]:
        from jobs.ops import TriggerRefused, job_trigger

        job = self._pick(lambda j: not j.paused, in_flight=0.3)
        if job is None:
            return {"error": "no active job"}
        if random.random() < 0.5:
            # In the last second before a minute: "now" rounds up onto the next cron time.
            wait = (60 - time.time() % 60) - 0.6
            time.sleep(wait if 0 < wait < 8 else 0)
        try:
            run = job_trigger(job=job, now=utc(time.time()), via="command")
        except TriggerRefused as exc:
            return {"job": job.public_id, "error": str(exc)}
        self.last_extra = job.pk
        return {"job": job.public_id, "run": run.public_id, "for": run.scheduled_for.isoformat()}

    def user_backfill(self) -> dict[str, Any]:
        from jobs.services import BackfillError, backfill_plan, job_backfill

        # Now and then a paused job's: a backfill made while paused runs once resumed.
        job = self._pick(lambda j: bool(j.schedule) and j.paused) if random.random() < 0.3 else None
        job = job or self._pick(lambda j: bool(j.schedule))
        if job is None:
            return {"error": "no live cron job"}
        now = utc(time.time())
        since = (now - timedelta(seconds=random.uniform(60, 300))).replace(second=0, microsecond=0)
        since = max(since, job.created_at.replace(microsecond=0))  # a backfill reaches back to the job's creation
        try:
            plan = backfill_plan(job=job, since=since, until=now, now=now)
            made = job_backfill(job=job, times=plan.times, now=now)
        except (BackfillError, ValueError) as exc:
            return {"job": job.public_id, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a clash the store refused is a finding, reported as such
            return {"job": job.public_id, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        self.last_extra = job.pk
        return {"job": job.public_id, "paused": job.paused, "since": since.isoformat(), "runs": len(made),
                "existing": plan.existing}

    def user_overlap(self) -> dict[str, Any]:
        """An every-minute job gets an overlap policy and, most times, calls the target
        holds for OVERLAP_HOLD_S: its next time passes while a call is in flight (skip:
        a `skipped` row naming it; buffer_one: a run that waits for it; allow: both run).
        At most OVERLAP_SLOW_AT_ONCE jobs are slow at a time; the oldest goes back."""
        from jobs.services import job_update

        job = self._pick(lambda j: j.schedule == "* * * * *" and j.pk not in self.slow) \
            or self._pick(lambda j: bool(j.schedule) and j.pk not in self.slow)
        if job is None:
            return {"error": "no live cron job"}
        policy = random.choice(["skip", "skip", "buffer_one", "allow"])
        slow = random.random() < 0.75
        back = None
        if slow and len(self.slow) >= OVERLAP_SLOW_AT_ONCE:
            back = self.slow.pop(0)
            from jobs.models import Job

            old = Job.objects.filter(pk=back).exclude(state=Job.State.DELETED).first()
            if old is not None:
                job_update(job=old, fields={"target": old.target.split("?", 1)[0], "timeout_seconds": 10},
                           now=utc(time.time()))
        base = job.target.split("?", 1)[0]
        fields: dict[str, Any] = {"overlap": policy, "target": f"{base}?hold={OVERLAP_HOLD_S}" if slow else base,
                                  "timeout_seconds": OVERLAP_HOLD_S + 25 if slow else 10}
        job_update(job=job, fields=fields, now=utc(time.time()))
        if slow:
            self.slow.append(job.pk)
        return {"job": job.public_id, "schedule": job.schedule, "overlap": policy, "held_s": OVERLAP_HOLD_S if slow
                else 0, "slow_back": f"job_{back}" if back else None}

    def user_pause_until(self) -> dict[str, Any]:
        """Paused until a time 20 to 100 s ahead: the scanner resumes it then (the
        reference counts the pause as ending at that time; a resume by hand first ends it
        then)."""
        from jobs.services import job_update

        job = self._pick(lambda j: not j.paused, in_flight=0.3)
        if job is None:
            return {"error": "no active job"}
        now = utc(time.time())
        until = utc(int(time.time() + random.uniform(20, 100)) + 1)
        job_update(job=job, fields={"paused": True, "paused_until": until}, now=now)
        with self.lock:
            self.histories[job.pk].pauses.append(Pause(now, utc(time.time()), resumed=until))
        return {"job": job.public_id, "until": until.isoformat()}

    def user_retry_dead(self) -> dict[str, Any]:
        """A dead run retried (POST /api/runs/{id}/retry/'s service): it owes a new start.
        Without a dead run of a live job at hand, one is made: a one-off due now to a
        port nobody listens on, no retries; once dead, its target is moved to the soak
        target, so the retry applies its effect (once)."""
        from jobs.models import Job
        from runs import ops as run_ops
        from runs.models import Run

        dead = (Run.objects.filter(job__owner=self.owner, status=Run.Status.DEAD, job__paused=False)
                .exclude(job__state=Job.State.DELETED).order_by("-pk").first())
        made = None
        if dead is None:
            dead, made = self._make_dead()
            if dead is None:
                return {"error": made or "no dead run"}
        now = utc(time.time())
        try:
            retried = run_ops.run_retry(run=dead, now=now, via="command")
        except run_ops.RetryRefused as exc:
            return {"run": dead.public_id, "error": str(exc)}
        with self.lock:
            self.retried.append((retried.pk, now))
        return {"run": retried.public_id, "job": f"job_{retried.job_id}", "made_dead": made}

    def _make_dead(self) -> tuple[Any, str | None]:
        import socket

        from jobs.services import job_create, job_update
        from runs.models import Run

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            closed = sock.getsockname()[1]
        self.dead_made += 1
        name = f"dead{self.dead_made}"
        fields = self.job_fields(name)
        real = fields["target"]
        fields.update(target=f"http://127.0.0.1:{closed}/hook/{name}", retry_max=0,
                      run_at=utc(int(time.time()) + 1))
        fields.pop("schedule", None)
        created_at = utc(time.time())
        job = job_create(owner=self.owner, fields=fields, now=created_at)
        self.created(job, created_at, in_pool=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            run = Run.objects.filter(job=job, status=Run.Status.DEAD).first()
            if run is not None:
                job_update(job=job, fields={"target": real}, now=utc(time.time()))
                return run, f"job_{job.pk}"
            time.sleep(0.2)
        return None, f"job_{job.pk}'s run was not dead within 30 s"


# ---------------------------------------------------------------------- judging


@dataclass
class RunFacts:
    """What the judge needs of one run row."""

    pk: int
    public_id: str
    job_id: int
    scheduled_for: datetime
    status: str
    held: bool
    is_backfill: bool
    created: datetime | None  # its first `scheduled` event
    started: bool
    cancelled: tuple[datetime, str] | None  # (when, reason) of its `cancelled` event
    skipped_by_misfire: bool
    skipped_at: datetime | None  # when the scanner skipped it
    was_held: bool  # a pause held it at some point
    deferred_past_cutoff: bool  # waiting for its target's breaker or bulkhead past the cutoff
    claims: list[tuple[datetime, int]]  # (at, fence)
    retries: list[datetime]  # `retry_scheduled` times
    ended: datetime | None = None  # its first terminal event
    # A `skipped` row the overlap policy made: the run that was in flight (its public id).
    overlapped_by: str | None = None


def run_facts(run: Any, events: list[tuple[datetime, str, dict[str, Any]]], cutoff: datetime,
              deferrals: tuple[str, ...]) -> RunFacts:
    cancelled = next(((at, str(d.get("reason", ""))) for at, t, d in events if t == "cancelled"), None)
    skipped = run.status == "skipped" and (
        "misfire" in (run.last_error or "")
        or any(t == "skipped" and "misfire" in str(d.get("reason", "")) for _, t, d in events))
    deferred = any(t in deferrals for _, t, _ in events)
    return RunFacts(
        pk=run.pk, public_id=run.public_id, job_id=run.job_id, scheduled_for=run.scheduled_for, status=run.status,
        held=run.held, is_backfill=run.is_backfill,
        created=next((at for at, t, _ in events if t == "scheduled"), None),
        started=run.started_at is not None or any(t == "claimed" for _, t, _ in events),
        cancelled=cancelled, skipped_by_misfire=skipped,
        skipped_at=next((at for at, t, _ in events if t == "skipped"), None),
        was_held=any(t == "held" and "paused" in str(d.get("reason", "")) for _, t, d in events),
        deferred_past_cutoff=run.status == "scheduled" and run.due_at > cutoff and deferred,
        claims=[(at, d.get("fence", 0)) for at, t, d in events if t == "claimed"],
        retries=[at for at, t, _ in events if t == "retry_scheduled"],
        ended=next((at for at, t, _ in events if t in ("succeeded", "dead", "skipped", "cancelled")), None),
        overlapped_by=next((str(d.get("in_flight")) for _, t, d in events
                            if t == "skipped" and d.get("reason") == "overlap" and d.get("in_flight")), None)
        if run.status == "skipped" else None,
    )


def due_times(history: History, cutoff: datetime) -> list[tuple[datetime, Timing]]:
    """Every time the reference schedule says was due, with the timing it belongs to."""
    from jobs import schedule

    end_of_life = min(cutoff, history.deleted_at or cutoff)
    found: dict[datetime, Timing] = {}
    for i, timing in enumerate(history.timings):
        until = history.timings[i + 1].since if i + 1 < len(history.timings) else end_of_life
        until = min(until, end_of_life)
        if until <= timing.since and not timing.run_at:
            continue
        if timing.schedule:
            times = list(schedule.cron_times(timing.schedule, timing.timezone, timing.since, until))
        elif timing.run_at is not None and timing.run_at_set <= timing.run_at < until:
            times = [timing.run_at]
        else:
            times = []
        for t in times:
            if t + timedelta(seconds=timing.window) <= cutoff:
                found.setdefault(t, timing)
    return sorted(found.items())


def judge(histories: dict[int, History], runs: list[RunFacts], cutoff: datetime, grace_s: float,
          retried: list[tuple[int, datetime]] | None = None) -> dict[str, Any]:
    """The reference schedule against the rows: what was missed, what a user action
    excused, and which runs started while their job was paused or deleted. `retried`:
    the dead runs a user retried, each of which owes a new start."""
    grace = timedelta(seconds=grace_s)
    for h in histories.values():
        for p in h.pauses:  # a paused_until still ahead at the cutoff: paused to the end
            if p.resumed is not None and p.resumed > cutoff:
                p.resumed = None
    by_time: dict[tuple[int, datetime], RunFacts] = {}
    for run in runs:
        # A normal row answers for its time before a backfill at the same time would.
        if (run.job_id, run.scheduled_for) not in by_time or not run.is_backfill:
            by_time[(run.job_id, run.scheduled_for)] = run
    missed: list[str] = []
    excuses: list[str] = []  # what a user action excused, for reading the report
    tally = {"due_times": 0, "due_times_started": 0, "skipped_after_pause": 0, "skipped_while_in_flight": 0,
             "excused_by_user_action": 0, "paused_at_end": 0, "extra_runs_due": 0, "extra_runs_started": 0}
    by_public_id = {run.public_id: run for run in runs}

    normal: dict[int, list[RunFacts]] = {}
    for run in runs:
        if not run.is_backfill:
            normal.setdefault(run.job_id, []).append(run)

    def not_made_yet(job_id: int, t: datetime) -> bool:
        """The job's run before t was still open at t: its next run (t's) comes when it
        ends, so no row for t is no fault yet."""
        return any(r.scheduled_for < t and (r.ended is None or r.ended > t) for r in normal.get(job_id, []))

    def in_flight_at(run: RunFacts, t: datetime) -> bool:
        """Whether the job's run the overlap policy skipped `run` for really was in
        flight (from its first claim to its outcome) when t passed."""
        flight = by_public_id.get(run.overlapped_by or "")
        if flight is None or flight.job_id != run.job_id or not flight.claims:
            return False
        claimed = min(at for at, _ in flight.claims)
        return claimed <= t and (flight.ended is None or flight.ended >= t)

    def excused(h: History, run: RunFacts | None, due_by: datetime, t: datetime | None = None) -> bool:
        """A user action ended or held this run before it was owed a start. A time with no
        row at all is excused only if its row could not have been made yet."""
        if run is None and (t is None or not not_made_yet(h.job_id, t)):
            return False
        if run is not None and run.cancelled is not None and run.cancelled[1] in USER_CANCEL_REASONS:
            return run.cancelled[0] <= due_by + grace
        pause = h.open_pause()
        if pause is not None and pause.started <= due_by + grace:
            return run is None or run.held or run.status in ("scheduled", "queued")
        if h.deleted_at is not None and h.deleted_at <= due_by + grace:
            return run is None or run.status in ("cancelled", "scheduled", "queued")
        return False

    for h in histories.values():
        for t, timing in due_times(h, cutoff):
            due_by = t + timedelta(seconds=timing.window)
            pause = h.paused_at(t)
            if pause is not None and pause.resumed is None:
                tally["paused_at_end"] += 1  # fell while paused, never resumed: not due
                continue
            run = by_time.get((h.job_id, t))
            if run is not None and run.deferred_past_cutoff:
                continue
            tally["due_times"] += 1
            if run is not None and run.started:
                tally["due_times_started"] += 1
                continue
            # Resuming applies the misfire policy: a time it found past its window plus the
            # grace may be skipped (skip, run_once); one inside them is not missed yet.
            after_pause = pause is not None or (run is not None and run.was_held)
            if run is not None and run.skipped_by_misfire and after_pause and h.misfire != "run_all" \
                    and run.skipped_at is not None and run.skipped_at > due_by + grace:
                tally["skipped_after_pause"] += 1
                continue
            # The overlap policy `skip` (the default): a time that passed while the job's
            # previous run was in flight gets a `skipped` row, checked against that run's
            # own claim and outcome.
            if run is not None and run.overlapped_by and in_flight_at(run, t):  # set on skipped rows only
                tally["skipped_while_in_flight"] += 1
                continue
            if excused(h, run, due_by, t):
                tally["excused_by_user_action"] += 1
                excuses.append(f"job_{h.job_id} {_timing_text(timing)} at {t:%H:%M:%S}: "
                               + (f"{run.public_id} {run.status}" if run else "no run") + _ended(h, run))
                continue
            why = "no run" if run is None else (
                f"skipped (misfire) at {run.skipped_at:%H:%M:%S}, inside its window plus the grace"
                if run.skipped_by_misfire and after_pause and run.skipped_at is not None else
                "skipped (misfire)" if run.skipped_by_misfire else
                f"skipped (overlap) for {run.overlapped_by}, which was not in flight at that time"
                if run.overlapped_by else
                f"cancelled at {run.cancelled[0]:%H:%M:%S} ({run.cancelled[1]})" if run.cancelled else
                f"never started ({run.status}{', held' if run.held else ''})")
            where = f" ({run.public_id}{', backfill' if run.is_backfill else ''})" if run is not None else ""
            paused = f", paused {pause.started:%H:%M:%S}-{pause.resumed:%H:%M:%S}" if pause and pause.resumed else ""
            missed.append(f"job_{h.job_id} {h.name} {_timing_text(timing)} (since {timing.since:%H:%M:%S}) at "
                          f"{t:%H:%M:%S}{where}: {why}{paused}")

    # Extra runs (backfills and run-now) owe a start too.
    for run in runs:
        h = histories.get(run.job_id)
        if h is None or not run.is_backfill or run.created is None or by_time.get((run.job_id, run.scheduled_for)) \
                is not run:
            continue
        if any(t == run.scheduled_for for t, _ in due_times(h, cutoff)):
            continue  # judged above as a time of the schedule
        if run.created > cutoff or run.deferred_past_cutoff:
            continue
        pause = h.paused_at(run.created)
        if pause is not None and pause.resumed is None:
            continue
        tally["extra_runs_due"] += 1
        if run.started:
            tally["extra_runs_started"] += 1
        elif excused(h, run, run.created):
            tally["excused_by_user_action"] += 1
            excuses.append(f"job_{h.job_id} extra run {run.public_id} {run.status}" + _ended(h, run))
        else:
            missed.append(f"job_{h.job_id} {h.name} extra run {run.public_id} for {run.scheduled_for:%H:%M:%S} "
                          f"made {run.created:%H:%M:%S}: never started ({run.status}{', held' if run.held else ''})")

    # A retried dead run owes a claim after the retry, unless a pause or a delete came first.
    tally["retried_dead"] = tally["retried_dead_started"] = 0
    facts_by_pk = {run.pk: run for run in runs}
    for pk, at in retried or []:
        run = facts_by_pk.get(pk)
        if run is None or at + grace > cutoff or run.deferred_past_cutoff:
            continue
        h = histories.get(run.job_id)
        tally["retried_dead"] += 1
        if any(claimed >= at for claimed, _ in run.claims):
            tally["retried_dead_started"] += 1
        elif h is not None and (h.paused_at(at + grace) is not None or (h.deleted_at and h.deleted_at <= at + grace)):
            tally["excused_by_user_action"] += 1
            excuses.append(f"job_{run.job_id} retried {run.public_id} {run.status}" + _ended(h, run))
        else:
            missed.append(f"job_{run.job_id} retried {run.public_id} at {at:%H:%M:%S}: no claim after it "
                          f"({run.status}{', held' if run.held else ''})")

    started_while_paused = []
    for run in runs:
        h = histories.get(run.job_id)
        if h is None:
            continue
        for at, fence in run.claims:
            why = _not_startable(h, run, at)
            if why:
                made = f", made at {run.created:%H:%M:%S.%f}" if run.created else ""
                started_while_paused.append(
                    f"run_{run.pk} of job_{h.job_id} {h.name} (for {run.scheduled_for:%H:%M:%S}{made}"
                    f"{', a backfill or run-now' if run.is_backfill else ''}) claimed (fence {fence}) at "
                    f"{at:%H:%M:%S.%f} {why}")
                break
    return {**tally, "excused": excuses[:50], "missed": missed,
            "started_while_paused_or_deleted": started_while_paused}


def _ended(h: History, run: RunFacts | None) -> str:
    if run is not None and run.cancelled is not None:
        return f", cancelled at {run.cancelled[0]:%H:%M:%S} ({run.cancelled[1]})"
    pause = h.open_pause()
    if pause is not None:
        return f", job paused from {pause.started:%H:%M:%S} to the end"
    return f", job deleted at {h.deleted_at:%H:%M:%S}" if h.deleted_at else ""


def _not_startable(h: History, run: RunFacts, at: datetime) -> str:
    """Why a claim at `at` should not have happened: its job was paused or deleted,
    and the claim does not take over an attempt that started before that."""
    def continues(since: datetime) -> bool:
        started_before = any(c < since for c, _ in run.claims)
        retried_after = any(since <= r < at for r in run.retries)
        return started_before and not retried_after

    def attempt(since: datetime) -> str:
        return ", a new attempt after a retry written then" if any(c < since for c, _ in run.claims) else ""

    if h.deleted_took_effect is not None and at > h.deleted_took_effect and not continues(h.deleted_at or at):
        return f"after the job was deleted at {h.deleted_took_effect:%H:%M:%S.%f}{attempt(h.deleted_at or at)}"
    for p in h.pauses:
        if p.took_effect < at and (p.resumed is None or at < p.resumed) and not continues(p.started):
            return f"while the job was paused (from {p.took_effect:%H:%M:%S.%f}{attempt(p.started)})"
    return ""


def _timing_text(timing: Timing) -> str:
    if timing.schedule:
        zone = "" if timing.timezone == "UTC" else f" {timing.timezone}"
        return f"[{timing.schedule}{zone}]"
    assert timing.run_at is not None
    return f"[at {timing.run_at:%H:%M:%S}]"
