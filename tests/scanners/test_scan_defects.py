"""Issue 12, the scanner's defects: times inside their grace are not missed (6),
one bad row costs that row only (9), republishing is back-pressured (10).

Real PostgreSQL throughout; where publishing matters, the real Redis broker's
run queue is read back (kombu's JSON messages), not a stand-in.
"""
from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta, timezone as dt_timezone
from typing import Any, Iterator

import pytest
import redis
from django.conf import settings
from django.db import connection
from django.db.models import F
from django.test import override_settings

from jobs.models import Job
from jobs.services import job_create
from runs import claims, invariants
from runs.models import Run
from runs.nextrun import run_next_create
from scanners import probe, scan
from scanners.scan import scan_once
from tests.factories import entries, entry, expire_lease, make_job, make_run, timeline_types, utc

pytestmark = pytest.mark.django_db
S = Run.Status
ALL = frozenset(range(16))
T0 = utc("2026-10-28T20:29:30Z")
BACK = utc("2026-10-28T20:32:30Z")  # the scanner was down over 20:30, 20:31 and 20:32


def per_minute(owner: Any, **fields: Any) -> Job:
    values: dict[str, Any] = {"name": "m", "schedule": "* * * * *", "target": "http://127.0.0.1:9/h"}
    values.update(fields)
    return job_create(owner=owner, fields=values, now=T0)


def hhmm(when: datetime) -> str:
    return f"{when:%H:%M}"


def times_with(job: Job, status: str) -> list[str]:
    return [hhmm(r.scheduled_for) for r in Run.objects.filter(job=job, status=status).order_by("scheduled_for")]


def finish_as_a_worker_would(run_id: int, now: datetime) -> None:
    """The run succeeded and its job got its next run (the worker's outcome transaction)."""
    run = Run.objects.select_related("job").get(pk=run_id)
    Run.objects.filter(pk=run_id).update(status=S.SUCCEEDED, finished_at=now)
    run_next_create(job=run.job, now=now)


# ------------------------------------------------------------------ defect 6


@pytest.mark.embedded
@override_settings(SCHEDULER_MISFIRE_GRACE=60)
@pytest.mark.parametrize(
    ("policy", "ran", "skipped"),
    [
        # 20:30 and 20:31 are past their window plus the grace; 20:32 is 30 s old at
        # 20:32:30, inside its grace: under every policy it runs, on time.
        ("skip", ["20:32"], ["20:30", "20:31"]),
        ("run_once", ["20:30", "20:32"], ["20:31"]),
        ("run_all", ["20:30", "20:31", "20:32"], []),
    ],
)
def test_a_time_still_inside_its_grace_is_not_missed_but_becomes_the_next_run(
    service: Any, policy: str, ran: list[str], skipped: list[str]
) -> None:
    job = per_minute(service.user, misfire=policy)
    queued: list[str] = []
    for _ in range(4):  # bounded: a scan per time at most, and one more
        for run_id in scan_once(partitions=ALL, now=BACK, publish=False).queued:
            queued.append(hhmm(Run.objects.get(pk=run_id).scheduled_for))
            finish_as_a_worker_would(run_id, BACK)
    assert queued == ran
    assert times_with(job, S.SKIPPED) == skipped
    on_time = Run.objects.get(job=job, scheduled_for=utc("2026-10-28T20:32:00Z"))
    assert "misfired" not in timeline_types(on_time)


@pytest.mark.embedded
@override_settings(SCHEDULER_MISFIRE_GRACE=60)
def test_a_skipped_late_run_is_followed_by_the_first_time_whose_window_and_grace_have_not_passed(service: Any) -> None:
    # Window 120 s: 20:30 is late after 20:33:00, 20:31 only after 20:34:00.
    job = per_minute(service.user, misfire="skip", window_seconds=120)
    scan_once(partitions=ALL, now=utc("2026-10-28T20:33:30Z"), publish=False)
    assert times_with(job, S.SKIPPED) == ["20:30"]
    nxt = Run.objects.get(job=job, status=S.SCHEDULED)
    assert hhmm(nxt.scheduled_for) == "20:31"
    assert nxt.scheduled_for <= nxt.due_at <= nxt.scheduled_for + timedelta(seconds=120)


# ------------------------------------------------------------------ the broker, read back


@pytest.fixture
def broker() -> Iterator[redis.Redis]:
    """The run queue on the test's own Redis database, emptied before and after."""
    if not settings.CELERY_BROKER_URL.startswith("redis"):
        pytest.skip("reads the Redis run queue")
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    client.delete(settings.CELERY_TASK_DEFAULT_QUEUE)
    yield client
    client.delete(settings.CELERY_TASK_DEFAULT_QUEUE)


def published(client: redis.Redis) -> list[int]:
    """Every run id in the messages waiting on the run queue (one per copy sent)."""
    ids: list[int] = []
    for raw in client.lrange(settings.CELERY_TASK_DEFAULT_QUEUE, 0, -1):
        message = json.loads(raw)
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        ids += args[0]
    return ids


# ------------------------------------------------------------------ defect 9


def _seventeen_late_jobs(owner: Any, **fields: Any) -> list[Job]:
    """Seventeen per-minute jobs: over every partition, the first and last in one."""
    jobs = [per_minute(owner, name=f"m{i}", **fields) for i in range(settings.SCHEDULER_PARTITIONS + 1)]
    assert jobs[0].partition == jobs[-1].partition
    return jobs


@override_settings(SCHEDULER_MISFIRE_GRACE=60)
@pytest.mark.parametrize(
    ("column", "value", "why"),
    [("schedule", "61 * * * *", "not a valid cron expression"), ("timezone", "Mars/Olympus_Mons", "unknown time zone")],
)
def test_a_late_run_whose_stored_schedule_no_longer_parses_costs_that_run_only(
    service: Any, broker: redis.Redis, column: str, value: str, why: str
) -> None:
    jobs = _seventeen_late_jobs(service.user)
    bad, good = jobs[0], jobs[1:]
    with connection.cursor() as cursor:  # as a bad migration or a tzdata upgrade would leave it
        cursor.execute(f"UPDATE jobs SET {column} = %s WHERE id = %s", [value, bad.pk])
    result = scan_once(partitions=ALL, now=BACK, publish=True)
    late = {j.pk: Run.objects.get(job=j, scheduled_for=utc("2026-10-28T20:30:00Z")) for j in jobs}
    # Every good job's late run is queued and published, the one in the bad job's partition too.
    assert sorted(result.queued) == sorted(late[j.pk].pk for j in good)
    assert all(late[j.pk].status == S.QUEUED for j in good)
    assert sorted(published(broker)) == sorted(late[j.pk].pk for j in good)
    # The bad one is dead, its reason on its timeline, and is not tried again.
    dead = late[bad.pk]
    assert dead.status == S.DEAD and why in dead.last_error
    error = entry(dead, "scan_error")
    assert why in error.detail["reason"]
    assert len(entries(dead, "dead")) == 1
    again = scan_once(partitions=ALL, now=BACK + timedelta(seconds=1), publish=False)
    assert dead.pk not in again.queued and len(entries(dead, "scan_error")) == 1
    assert Run.objects.filter(job=bad, status__in=[S.SCHEDULED, S.QUEUED]).count() == 0
    assert "next_run_error" in entry(dead, "dead").detail  # no next time can be worked out
    assert invariants.timelines() == [] and invariants.one_open_run_per_job() == []


@override_settings(SCHEDULER_MISFIRE_GRACE=60)
def test_a_late_run_whose_next_time_is_taken_goes_on_at_the_first_free_time(service: Any, broker: redis.Redis) -> None:
    # Was "...clashes_on_insert_costs_that_run_only" (the clash set the run aside);
    # since the one next-run decision (runs.nextrun.job_next_run) steps over a time
    # that already has a run, a clash costs nothing at all.
    jobs = _seventeen_late_jobs(service.user, misfire="skip")
    clashing = jobs[0]
    for t in ("2026-10-28T20:32:00Z", "2026-10-28T20:33:00Z"):  # the times skip would go on at
        make_run(clashing, utc(t), is_backfill=True)
    result = scan_once(partitions=ALL, now=BACK, publish=True)
    late = Run.objects.get(job=clashing, scheduled_for=utc("2026-10-28T20:30:00Z"))
    assert late.status == S.SKIPPED and not late.events.filter(type="scan_error").exists()
    # The other sixteen jobs went on at their next time; everything due was queued.
    for job in jobs[1:]:
        assert Run.objects.filter(job=job, status=S.SCHEDULED).count() == 1
    backfill = Run.objects.get(job=clashing, scheduled_for=utc("2026-10-28T20:32:00Z"))
    assert backfill.status == S.QUEUED and backfill.pk in published(broker)
    assert result.skipped >= 16 and result.set_aside == []
    # The job goes on at the first time no run has: after both backfills.
    nxt = Run.objects.get(job=clashing, status=S.SCHEDULED, is_backfill=False)
    assert nxt.scheduled_for == utc("2026-10-28T20:34:00Z")
    assert entry(late, "next_run_created").detail["run"] == nxt.public_id
    assert invariants.timelines() == [] and invariants.one_open_run_per_job() == []


def test_a_run_the_bulk_queue_statement_cannot_write_is_set_aside_and_the_rest_are_queued(
    service: Any, broker: redis.Redis
) -> None:
    jobs = [per_minute(service.user, name=f"m{i}") for i in range(settings.SCHEDULER_PARTITIONS + 1)]
    runs = {j.pk: Run.objects.get(job=j) for j in jobs}
    bad = runs[jobs[0].pk]
    with connection.cursor() as cursor:  # a row the store refuses to queue (rolled back with the test)
        cursor.execute(
            """
            CREATE FUNCTION refuse_one_run() RETURNS trigger AS $$
            BEGIN
              IF NEW.id = %s AND NEW.status = 'queued' THEN RAISE EXCEPTION 'this row cannot be queued'; END IF;
              RETURN NEW;
            END $$ LANGUAGE plpgsql;
            CREATE TRIGGER refuse_one_run BEFORE UPDATE ON runs FOR EACH ROW EXECUTE FUNCTION refuse_one_run();
            """.replace("%s", str(bad.pk))
        )
    result = scan_once(partitions=ALL, now=T0 + timedelta(seconds=31), publish=True)
    good = sorted(r.pk for r in runs.values() if r.pk != bad.pk)
    assert sorted(result.queued) == good and sorted(published(broker)) == good
    bad.refresh_from_db()
    assert bad.status == S.DEAD and "this row cannot be queued" in entry(bad, "scan_error").detail["reason"]


# ------------------------------------------------------------------ defect 10

# Runs a scan may republish with the queue at its limit (scanners.WHEN_FULL).
WHEN_FULL = getattr(scan, "REPUBLISH_WHEN_FULL", 10)


def _queued_backlog(owner: Any, count: int) -> list[int]:
    """`count` runs queued at T0 + 31 s, none claimed (the workers are behind)."""
    for i in range(count):
        per_minute(owner, name=f"b{i}")
    queued = scan_once(partitions=ALL, now=T0 + timedelta(seconds=31), publish=False).queued
    assert len(queued) == count
    return queued


@override_settings(SCHEDULER_MAX_QUEUED=40, SCHEDULER_REQUEUE_AFTER=30)
def test_a_backlog_at_the_queue_limit_is_not_republished_whole(service: Any, broker: redis.Redis) -> None:
    backlog = _queued_backlog(service.user, 40)
    later = T0 + timedelta(seconds=31 + 31)  # every one of them waited past SCHEDULER_REQUEUE_AFTER
    result = scan_once(partitions=ALL, now=later, publish=True)
    assert len(result.republished) == WHEN_FULL < len(backlog)
    assert sorted(published(broker)) == sorted(result.republished)


@override_settings(SCHEDULER_MAX_QUEUED=40, SCHEDULER_REQUEUE_AFTER=30)
def test_lost_messages_of_a_full_queue_are_each_republished_once_oldest_first(service: Any) -> None:
    backlog = _queued_backlog(service.user, 40)
    base = T0 + timedelta(seconds=31)
    for i, run_id in enumerate(backlog):  # distinct queue times: the order to republish in
        Run.objects.filter(pk=run_id).update(queued_at=base - timedelta(seconds=i))
    later = base + timedelta(seconds=31)
    sent: list[int] = []
    for step in range(len(backlog) // WHEN_FULL + 1):  # bounded
        sent += scan_once(partitions=ALL, now=later + timedelta(seconds=step), publish=False).republished
    assert sent == list(reversed(backlog))  # oldest first, each once


@override_settings(SCHEDULER_MAX_QUEUED=100, SCHEDULER_REQUEUE_AFTER=30)
def test_with_room_under_the_queue_limit_every_unclaimed_run_is_republished_at_once(service: Any) -> None:
    backlog = _queued_backlog(service.user, 20)
    result = scan_once(partitions=ALL, now=T0 + timedelta(seconds=31 + 31), publish=False)
    assert sorted(result.republished) == sorted(backlog)


@override_settings(SCHEDULER_MAX_QUEUED=40, SCHEDULER_REQUEUE_AFTER=30)
def test_due_runs_take_the_queues_room_first_and_republishing_gets_what_is_left(service: Any) -> None:
    backlog = _queued_backlog(service.user, 40)
    Run.objects.filter(pk__in=backlog[:20]).update(status=S.SUCCEEDED)  # the workers took 20
    fresh = [per_minute(service.user, name=f"f{i}") for i in range(5)]  # due at 20:30, not queued yet
    result = scan_once(partitions=ALL, now=T0 + timedelta(seconds=31 + 31), publish=False)
    assert sorted(result.queued) == sorted(Run.objects.get(job=j).pk for j in fresh)
    assert len(result.republished) == 40 - 20 - 5  # the room left after the due runs


@override_settings(SCHEDULER_MAX_QUEUED=40, SCHEDULER_REQUEUE_AFTER=30, SCHEDULER_DISPATCH_BATCH=200)
def test_a_queue_at_its_limit_is_fed_a_message_at_a_time_not_a_run_at_a_time(service: Any) -> None:
    # The soak under load (2026-12-01, 135 runs/s): a queue at SCHEDULER_MAX_QUEUED was
    # fed whatever room each scan found, claims fell to a median of 2 runs, and the
    # workers to about 35 runs/s. A scan now waits for a message's worth of room
    # (here a quarter of the limit: 10).
    from scanners.scan import queue_chunk

    assert queue_chunk() == 10
    backlog = _queued_backlog(service.user, 40)
    Run.objects.filter(pk__in=backlog[:5]).update(status=S.SUCCEEDED)  # the workers took 5: room for 5
    fresh = [per_minute(service.user, name=f"f{i}") for i in range(12)]
    now = T0 + timedelta(seconds=40)  # nothing waited past SCHEDULER_REQUEUE_AFTER: no republishing
    assert scan_once(partitions=ALL, now=now, publish=False).queued == []
    Run.objects.filter(pk__in=backlog[5:10]).update(status=S.SUCCEEDED)  # 5 more: room for 10
    result = scan_once(partitions=ALL, now=now, publish=False)
    assert sorted(result.queued) == sorted(Run.objects.filter(job__in=fresh, status=S.QUEUED).values_list("pk", flat=True))
    assert len(result.queued) == 10


def _messages(client: redis.Redis) -> list[list[int]]:
    return [json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0]
            for raw in reversed(client.lrange(settings.CELERY_TASK_DEFAULT_QUEUE, 0, -1))]


@override_settings(SCHEDULER_MAX_QUEUED=40, SCHEDULER_LOOKAHEAD=10, SCHEDULER_TARGET_CONCURRENCY=100)
@pytest.mark.parametrize("backlog", [0, 10])
def test_behind_the_workers_runs_queued_ahead_go_in_full_messages(
    service: Any, broker: redis.Redis, backlog: int
) -> None:
    # The soak under load (2026-12-01, 135 runs/s): runs queued ahead went out sliced by
    # due time, a few to a message, and were taken long after their time, the claims at a
    # median of 2 runs. With a message's worth already waiting (here 10), no slicing.
    now = T0 + timedelta(minutes=5)
    if backlog:
        _queued_backlog(service.user, backlog)
        broker.delete(settings.CELERY_TASK_DEFAULT_QUEUE)
    ahead = [job_create(owner=service.user, now=now, fields={"name": f"a{i}", "target": "http://127.0.0.1:9/h",
                                                             "run_at": now + timedelta(seconds=s)})
             for i, s in enumerate((1, 1, 8, 8))]  # two slices of SCHEDULER_LOOKAHEAD / 2 = 5 s
    result = scan_once(partitions=ALL, now=now, publish=True)
    runs = sorted(Run.objects.filter(job__in=ahead).values_list("pk", flat=True))
    assert sorted(result.queued) == runs
    sizes = sorted(len(m) for m in _messages(broker) if set(m) & set(runs))  # (the backlog is republished too)
    assert sizes == ([4] if backlog else [2, 2])


def _running_since_queued(owner: Any, queued_at: datetime) -> Run:
    """A run a worker holds now, started by a message sent at `queued_at`."""
    job = make_job(owner, name="in-flight")
    return make_run(job, T0 - timedelta(minutes=5), status=S.RUNNING, queued_at=queued_at, fence=1, attempt=1,
                    lease_owner="w/1", lease_expires_at=datetime.now(dt_timezone.utc) + timedelta(hours=1))  # leases: the store's clock


@override_settings(SCHEDULER_MAX_QUEUED=100, SCHEDULER_REQUEUE_AFTER=30)
def test_while_the_workers_are_behind_the_unclaimed_runs_are_not_published_again(service: Any) -> None:
    # The soak under load (2026-12-01, Redis, 160 runs/s for 30 minutes): a backlog
    # longer than SCHEDULER_REQUEUE_AFTER but under SCHEDULER_MAX_QUEUED had every
    # waiting run published again every 5 s, 1,069,103 times for 281,801 queued.
    backlog = _queued_backlog(service.user, 20)  # queued at T0 + 31 s
    _running_since_queued(service.user, T0 + timedelta(seconds=31))  # the workers are taking runs queued then
    result = scan_once(partitions=ALL, now=T0 + timedelta(seconds=31 + 31), publish=False)
    assert result.republished == []
    assert Run.objects.filter(pk__in=backlog, status=S.QUEUED).count() == len(backlog)


def _finished_since_queued(owner: Any, queued_at: datetime, finished_at: datetime) -> Run:
    """A run a worker finished at `finished_at`, started by a message sent at `queued_at`."""
    job = make_job(owner, name="done")
    return make_run(job, T0 - timedelta(minutes=5), status=S.SUCCEEDED, queued_at=queued_at, fence=1, attempt=1,
                    finished_at=finished_at)


@override_settings(SCHEDULER_MAX_QUEUED=100, SCHEDULER_REQUEUE_AFTER=30)
def test_between_two_calls_the_runs_just_finished_say_how_far_the_workers_have_got(service: Any) -> None:
    # The second 30-minute soak (2026-12-01, 135 runs/s): the load's calls take
    # milliseconds, so at the moment of a scan often no run was running, the rule fell
    # back to the plain cut and every waiting run was sent again (12,671 copies in a
    # minute). A run finished within SCHEDULER_REQUEUE_AFTER counts like a running one.
    backlog = _queued_backlog(service.user, 20)  # queued at T0 + 31 s
    now = T0 + timedelta(seconds=31 + 31)
    _finished_since_queued(service.user, T0 + timedelta(seconds=31), finished_at=now - timedelta(seconds=10))
    result = scan_once(partitions=ALL, now=now, publish=False)
    assert result.republished == []
    assert Run.objects.filter(pk__in=backlog, status=S.QUEUED).count() == len(backlog)


@override_settings(SCHEDULER_MAX_QUEUED=100, SCHEDULER_REQUEUE_AFTER=30)
def test_with_nothing_taken_for_the_wait_the_unclaimed_runs_are_published_again(service: Any) -> None:
    # The last outcome is older than SCHEDULER_REQUEUE_AFTER and nothing runs: the
    # workers have taken none of these messages that long (a flushed broker): the plain cut.
    backlog = _queued_backlog(service.user, 20)
    now = T0 + timedelta(seconds=31 + 31)
    _finished_since_queued(service.user, T0 + timedelta(seconds=31), finished_at=now - timedelta(seconds=31))
    result = scan_once(partitions=ALL, now=now, publish=False)
    assert sorted(result.republished) == sorted(backlog)


@override_settings(SCHEDULER_MAX_QUEUED=100, SCHEDULER_REQUEUE_AFTER=30)
def test_a_run_claimed_from_an_earlier_copy_does_not_move_the_cut(service: Any) -> None:
    # Two first versions of the rule read a running run's queued_at as the time of
    # its last copy: a run claimed from an earlier copy pulled the cut forward, and
    # the republishing fed itself (70,389 and 120,247 copies in the soak's first 4
    # minutes). The claim now sets queued_at to when its message was sent.
    backlog = _queued_backlog(service.user, 20)  # queued at T0 + 31 s
    job = make_job(service.user, name="copied")
    copied = make_run(job, T0 - timedelta(minutes=5), status=S.QUEUED, queued_at=T0 + timedelta(seconds=31 + 31))
    taken = claims.claim_many(run_ids=[copied.pk], worker="w/1", lease=timedelta(hours=1),
                              sent_at=T0 + timedelta(seconds=31))  # its first message, not its last copy
    assert [c.run_id for c in taken] == [copied.pk]
    copied.refresh_from_db()
    assert copied.queued_at == T0 + timedelta(seconds=31)
    result = scan_once(partitions=ALL, now=T0 + timedelta(seconds=31 + 31), publish=False)
    assert result.republished == []
    assert Run.objects.filter(pk__in=backlog, status=S.QUEUED).count() == len(backlog)


def test_a_message_without_a_send_time_leaves_queued_at_alone(service: Any) -> None:
    job = make_job(service.user, name="old-message")
    run = make_run(job, T0 - timedelta(minutes=5), status=S.QUEUED, queued_at=T0)
    assert claims.claim_many(run_ids=[run.pk], worker="w/1", lease=timedelta(hours=1))
    run.refresh_from_db()
    assert (run.status, run.queued_at) == (S.RUNNING, T0)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the store's clock: PostgreSQL")
def test_a_send_time_from_the_future_is_taken_as_now(service: Any) -> None:
    # A message's word: a time after the store's clock would pull the cut forward.
    job = make_job(service.user, name="future")
    run = make_run(job, T0 - timedelta(minutes=5), status=S.QUEUED, queued_at=T0)
    before = claims.store_now()
    assert claims.claim_many(run_ids=[run.pk], worker="w/1", lease=timedelta(hours=1),
                             sent_at=before + timedelta(days=1))
    run.refresh_from_db()
    assert before <= run.queued_at <= claims.store_now()


def test_a_send_time_in_a_message_is_read_only_if_it_is_a_time() -> None:
    from runs.tasks import _sent_at

    assert _sent_at("2026-12-01T19:00:00.250000+00:00") == utc("2026-12-01T19:00:00.25Z")
    assert _sent_at("2026-12-01T19:00:00Z") == utc("2026-12-01T19:00:00Z")
    for bad in (None, 7, "", "soon", "2026-12-01T19:00:00", ["2026"]):
        assert _sent_at(bad) is None  # type: ignore[arg-type]


@override_settings(SCHEDULER_MAX_QUEUED=100, SCHEDULER_REQUEUE_AFTER=30)
def test_runs_the_workers_went_past_are_published_again(service: Any) -> None:
    # The workers are taking runs queued 31 s after these: these messages are lost.
    backlog = _queued_backlog(service.user, 20)
    _running_since_queued(service.user, T0 + timedelta(seconds=31 + 31))
    result = scan_once(partitions=ALL, now=T0 + timedelta(seconds=31 + 31), publish=False)
    assert sorted(result.republished) == sorted(backlog)


@override_settings(SCHEDULER_SCAN_BATCH=5)
def test_a_live_scan_stamps_each_batch_by_the_time_it_has_taken(service: Any, monkeypatch: Any) -> None:
    # The soak under load: a scan through a backlog took seconds, and its later
    # batches' `misfired` and `queued` were stamped with the probe's clock, up to 2.4 s
    # before a deferral written before them (40,336 timeline violations).
    for i in range(12):
        per_minute(service.user, name=f"s{i}")
    # A live scan stamps no earlier than the store's clock of the statement that locked
    # its batch: the runs are moved to the store's clock, a second before now.
    now = claims.store_now()
    shift = now - (T0 + timedelta(seconds=31))
    Run.objects.update(due_at=F("due_at") + shift, scheduled_for=F("scheduled_for") + shift)
    ticks = iter(range(100))
    monkeypatch.setattr(scan, "monotonic", lambda: float(next(ticks)))  # a second a reading
    result = scan_once(partitions=ALL, now=now, publish=False, advance=True)
    assert len(result.queued) == 12
    stamps = sorted({r.queued_at for r in Run.objects.filter(pk__in=result.queued)})
    assert stamps == [now + timedelta(seconds=s) for s in (1, 2, 3)]  # 5, 5 and 2 runs


@override_settings(SCHEDULER_SCAN_BATCH=5)
def test_a_scan_whose_partitions_are_lost_meanwhile_stops_after_its_batch(service: Any) -> None:
    for i in range(12):
        per_minute(service.user, name=f"k{i}")
    asked: list[int] = []

    def keep_going() -> bool:
        asked.append(1)
        return False  # the lease was lost during the first batch

    result = scan_once(partitions=ALL, now=T0 + timedelta(seconds=31), publish=False, keep_going=keep_going)
    assert len(result.queued) == 5 and asked == [1]
    assert Run.objects.filter(status=S.SCHEDULED).count() == 7


def test_the_republish_budget_is_the_room_left_at_least_a_few_at_most_a_batch() -> None:
    assert scan.republish_budget(room_left=300, batch=500) == 300
    assert scan.republish_budget(room_left=3000, batch=500) == 500
    assert scan.republish_budget(room_left=0, batch=500) == scan.REPUBLISH_WHEN_FULL
    assert scan.republish_budget(room_left=-20, batch=500) == scan.REPUBLISH_WHEN_FULL
    assert scan.republish_budget(room_left=0, batch=4) == 4


def test_a_scan_through_late_runs_stops_within_its_batch_when_its_partitions_are_lost(service: Any) -> None:
    # Each late run is a savepoint, a job lock and its misfire policy: under load a
    # batch of them took seconds, and a scanner cut off from ZooKeeper went on writing
    # through it, 6.29 s after the cut (session timeout 4 s; the soak under load,
    # 2026-12-01). The lease is asked every LATE_RUNS_PER_ASK late runs, and a batch
    # that finds it lost is undone.
    n = 2 * scan.LATE_RUNS_PER_ASK + 5
    for i in range(n):
        per_minute(service.user, name=f"late{i}", misfire="run_once")
    answers = iter([True, False])
    asked: list[bool] = []

    def keep_going() -> bool:
        asked.append(next(answers))
        return asked[-1]

    late = T0 + timedelta(hours=1)
    result = scan_once(partitions=ALL, now=late, publish=False, keep_going=keep_going)
    assert asked == [True, False] and result.queued == [] and result.misfired == 0
    assert Run.objects.filter(status=S.SCHEDULED).count() == n  # nothing of the batch kept
    assert not Run.objects.filter(status=S.QUEUED).exists()
    # With the lease kept, the same scan handles them all.
    result = scan_once(partitions=ALL, now=late, publish=False, keep_going=lambda: True)
    assert len(result.queued) == n


@override_settings(SCHEDULER_MAX_QUEUED=100, SCHEDULER_REQUEUE_AFTER=30)
def test_a_scan_given_its_probe_looks_only_for_the_kinds_of_work_it_says_are_due(service: Any) -> None:
    # A steady stream of due runs has a scanner scanning every few tens of
    # milliseconds; the resume, lease and republish reads were half of each scan's
    # statements (the soak at 155 runs/s, 2026-12-02). The probe (next_work) says when
    # each kind is next due, and a scan given it skips the kinds that are not.
    backlog = _queued_backlog(service.user, 5)  # queued at T0 + 31 s, none claimed
    later = T0 + timedelta(seconds=31 + 31)
    not_yet = probe.Work(now=later, queued=T0 + timedelta(seconds=33))  # the oldest waited 29 s
    assert scan_once(partitions=ALL, now=later, publish=False, work=not_yet).republished == []
    assert sorted(scan_once(partitions=ALL, now=later, publish=False,
                            work=probe.Work(now=later, queued=T0 + timedelta(seconds=31))).republished) == sorted(backlog)
    # A lease that ran out is taken back only when the probe says one has.
    lost = _running_since_queued(service.user, T0)
    expire_lease(lost.pk)
    now = claims.store_now()
    assert scan_once(partitions=ALL, now=now, publish=False, work=probe.Work(now=now)).lease_expired == []
    assert Run.objects.get(pk=lost.pk).status == S.RUNNING
    found = scan_once(partitions=ALL, now=now, publish=False, work=probe.Work(now=now, lease=now - timedelta(seconds=1)))
    assert found.lease_expired == [lost.pk]
