"""From due to done with real processes: two scanners (ZooKeeper leases), two Celery
workers (Redis), PostgreSQL, the API on a live server and a loopback HTTP target.

The tests marked `amqp` run again with the processes' broker on a fresh RabbitMQ
vhost (tests/integration/conftest.py: the `broker` fixture), where the bulkhead's
slots are rows in the database (SCHEDULER_BULKHEAD's default for any broker but Redis)."""
from __future__ import annotations

import signal
import time
from collections import Counter
from datetime import datetime, timedelta, timezone as dt_timezone
from typing import Any

import pytest
from django.conf import settings

from jobs.models import Job
from jobs.services import job_create, service_account_ensure
from runs.models import Run, TargetSlot
from tests.integration.conftest import Api, Broker, PrivateRedis, Stack, wait_for
from tests.target import LoopbackTarget
from tests.factories import timeline_types, entry

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]
S = Run.Status


def run_of(job: dict[str, Any] | Job) -> Run:
    pk = int(job["id"].split("_")[1]) if isinstance(job, dict) else job.pk
    return Run.objects.filter(job_id=pk).order_by("scheduled_for").first()  # type: ignore[return-value]


def runs_of(job_id: int) -> list[Run]:
    return list(Run.objects.filter(job_id=job_id).order_by("scheduled_for"))


def job_pk(job: dict[str, Any]) -> int:
    return int(job["id"].split("_")[1])


def finished(job: dict[str, Any], status: str = S.SUCCEEDED) -> Run | None:
    run = Run.objects.filter(job_id=job_pk(job), status=status).order_by("scheduled_for").first()
    return run


def event_types(run: Run) -> list[str]:
    return timeline_types(run)


@pytest.mark.amqp
def test_runs_created_through_the_api_reach_succeeded_with_one_call_each(
    stack: Stack, api: Api, target: LoopbackTarget
) -> None:
    for name in ("scanner-a", "scanner-b"):
        stack.scanner(name)
    for name in ("worker-a", "worker-b"):
        stack.worker(name)
    at = (datetime.now(dt_timezone.utc) + timedelta(seconds=4)).strftime("%Y-%m-%dT%H:%M:%SZ")
    jobs = [
        api.create_job(name="delayed", delay="2s", target=target.url("/delay"), payload={"n": 1}),
        api.create_job(name="one-off", at=at, target=target.url("/at")),
        api.create_job(name="cron", schedule="* * * * *", target=target.url("/cron"), headers={"X-Team": "reports"}),
    ]
    done = {j["id"]: wait_for(lambda j=j: finished(j), 90, what=f"{j['name']} to succeed") for j in jobs}

    keys = Counter(c.headers["Idempotency-Key"] for c in target.calls())
    for job in jobs:
        run = done[job["id"]]
        assert keys[run.idempotency_key] == 1, keys
        detail = api.get(f"/api/runs/{run.public_id}/")
        assert detail["status"] == "succeeded"
        types = [e["type"] for e in detail["events"]]
        assert types == ["scheduled", "queued", "claimed", "target_answered", "succeeded"]
        # A cron job's next run is named on the run that ended.
        assert ("next_run" in detail["events"][-1]["detail"]) == (job["name"] == "cron")
        claimed = detail["events"][2]["detail"]
        assert claimed["fence"] == 1
        assert claimed["worker"].startswith(("worker-a@", "worker-b@")), claimed
    cron_call = target.calls("/cron")[0]
    cron_run = done[jobs[2]["id"]]
    assert cron_call.headers["X-Fence-Token"] == "1" and cron_call.headers["X-Attempt"] == "1"
    assert cron_call.headers["X-Run-Id"] == cron_run.public_id
    assert cron_call.headers["X-Scheduled-For"] == cron_run.scheduled_for.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert cron_call.headers["X-Team"] == "reports"
    assert Job.objects.get(pk=job_pk(jobs[0])).state == Job.State.COMPLETED
    assert Run.objects.filter(job_id=job_pk(jobs[2]), status=S.SCHEDULED).count() == 1


@pytest.mark.amqp
def test_a_flaky_target_is_retried_with_one_key_and_rising_fences(stack: Stack, api: Api, target: LoopbackTarget) -> None:
    stack.scanner("scanner-a")
    stack.worker("worker-a")
    target.script("/flaky", [500, 500, 200])
    target.script("/bad", [400])
    target.script("/down", [503])
    flaky = api.create_job(delay="1s", target=target.url("/flaky"), retry={"max": 3, "base": "1s", "cap": "2s"})
    bad = api.create_job(delay="1s", target=target.url("/bad"), retry={"max": 3, "base": "1s"})
    down = api.create_job(delay="1s", target=target.url("/down"), retry={"max": 2, "base": "1s", "cap": "2s"})

    run = wait_for(lambda: finished(flaky), 60, what="the flaky run to succeed")
    calls = target.calls("/flaky")
    assert [c.headers["X-Attempt"] for c in calls] == ["1", "2", "3"]
    assert len({c.headers["Idempotency-Key"] for c in calls}) == 1
    assert [int(c.headers["X-Fence-Token"]) for c in calls] == [1, 2, 3]
    assert event_types(run).count("retry_scheduled") == 2 and run.attempt == 3

    dead_bad = wait_for(lambda: finished(bad, S.DEAD), 30, what="the 400 run to be dead")
    assert len(target.calls("/bad")) == 1 and "HTTP 400" in dead_bad.last_error
    dead_down = wait_for(lambda: finished(down, S.DEAD), 60, what="the failing run to be dead")
    assert len(target.calls("/down")) == 3 and dead_down.attempt == 3
    dead_list = api.get("/api/runs/", status="dead")
    assert {r["id"] for r in dead_list["results"]} == {dead_bad.public_id, dead_down.public_id}
    told = entry(dead_down, "dead")
    assert told.detail["notified"] == "owner@example.test"
    assert "dead" in stack.procs[1].output()  # the worker logged it


def _kill_env(stack: Stack) -> None:
    stack.env["SCHEDULER_LEASE_SECONDS"] = "3"


@pytest.mark.amqp
def test_a_worker_killed_mid_call_is_replaced_with_a_higher_fence(
    stack: Stack, api: Api, target: LoopbackTarget, broker: Broker
) -> None:
    _kill_env(stack)
    stack.scanner("scanner-a")
    doomed = stack.worker("doomed")
    target.delay("/slow", 2)
    job = api.create_job(delay="1s", target=target.url("/slow"))
    wait_for(lambda: target.calls("/slow"), 30, what="the first call to arrive")
    if broker.kind == "amqp":
        # Not Redis: the doomed call's bulkhead slot is a row, which its lease must free for the rescuer.
        assert TargetSlot.objects.count() == 1
    doomed.kill()
    stack.worker("rescuer")
    run = wait_for(lambda: finished(job), 60, what="the run to succeed after the kill")
    fences = [int(c.headers["X-Fence-Token"]) for c in target.calls("/slow")]
    assert fences == [1, 2] and run.fence == 2
    types = event_types(run)
    assert types.count("claimed") == 2 and "lease_expired" in types


@pytest.mark.amqp
def test_a_frozen_workers_late_result_is_refused_by_the_fence(stack: Stack, api: Api, target: LoopbackTarget) -> None:
    _kill_env(stack)
    # RabbitMQ pushes messages to every consumer with room in its prefetch window, the
    # frozen worker's too: the run put back on the queue when the lease runs out may be
    # pushed to the frozen worker, where it waits until a scanner publishes it again
    # (SCHEDULER_REQUEUE_AFTER, 30 s by default; 5 s here). Redis is pulled from: only
    # a worker that is awake takes a message.
    stack.env["SCHEDULER_REQUEUE_AFTER"] = "5"
    stack.scanner("scanner-a")
    frozen = stack.worker("frozen")
    target.delay("/slow", 1)
    job = api.create_job(delay="1s", target=target.url("/slow"))
    wait_for(lambda: target.calls("/slow"), 30, what="the first call to arrive")
    frozen.signal(signal.SIGSTOP)
    stack.worker("rescuer")
    run = wait_for(lambda: finished(job), 60, what="the rescuer to finish the run")
    frozen.signal(signal.SIGCONT)
    rejected = wait_for(
        lambda: run.events.filter(type="stale_write_rejected").first(), 30, what="the late write to be refused"
    )
    assert rejected.detail["fence"] == 1
    run.refresh_from_db()
    assert run.status == S.SUCCEEDED and run.fence == 2


def test_runs_queued_when_redis_is_flushed_still_succeed(
    stack: Stack, api: Api, target: LoopbackTarget, private_redis: PrivateRedis
) -> None:
    stack.env["CELERY_BROKER_URL"] = private_redis.url
    stack.env["SCHEDULER_REQUEUE_AFTER"] = "3"
    stack.scanner("scanner-a")
    jobs = [api.create_job(delay="1s", target=target.url(f"/r{i}")) for i in range(5)]
    wait_for(lambda: all(run_of(j).status == S.QUEUED for j in jobs), 30, what="the runs to be queued")
    queue = stack.env["SCHEDULER_RUN_QUEUE"]
    # One message carries the five runs (one target host, SCHEDULER_DISPATCH_BATCH per message).
    wait_for(lambda: private_redis.llen(queue) >= 1, 10, what="the message to be on the queue")
    private_redis.flushall()  # the messages are gone; no worker ever saw them
    stack.worker("worker-a")
    for job in jobs:
        run = wait_for(lambda j=job: finished(j), 60, what="each run to succeed after FLUSHALL")
        assert "requeued" in event_types(run)
    assert len(target.calls()) == 5


def test_when_a_scanner_is_killed_the_other_takes_its_partitions_and_no_run_is_missed(
    stack: Stack, api: Api, target: LoopbackTarget
) -> None:
    survivor = stack.scanner("scanner-a")
    doomed = stack.scanner("scanner-b")
    stack.worker("worker-a", concurrency=4)
    wait_for(lambda: "partitions [" in doomed.output() and "partitions [" in survivor.output(), 30,
             what="both scanners to own partitions")
    wait_for(lambda: _owned(survivor) and len(_owned(survivor)) < 16, 30, what="the partitions to be split")
    # Due from 6 s on: making the 32 jobs takes about 2 s, so no run is due (nor within
    # the look-ahead) when the doomed scanner is killed. A run it had queued and not
    # yet published when killed is the unclaimed-run recovery's, after
    # SCHEDULER_REQUEUE_AFTER (a fresh-clone run, 2026-12-01: delays from 2 s put the
    # first run's queueing on the kill); this test is about the handover.
    created = time.time()
    jobs = [api.create_job(delay=f"{6 + i % 10}s", target=target.url(f"/s{i}")) for i in range(32)]
    partitions = {job_pk(j) % settings.SCHEDULER_PARTITIONS for j in jobs}
    assert partitions - _owned(survivor), "some jobs must live in the doomed scanner's partitions"
    killed_at = time.time()
    assert killed_at - created < 5, "the jobs took too long to make: a run may be due at the kill"
    doomed.kill()
    for job in jobs:
        wait_for(lambda j=job: finished(j), 60, what="every run to succeed")
    assert len(target.calls()) == 32
    assert _owned(survivor) == set(range(16))
    latest = max(c.at for c in target.calls())
    assert latest - created < 4 + 1 + 16  # session timeout + one scan + the latest due time (margin: 1 s)


def _owned(proc: Any) -> set[int]:
    lines = [line for line in proc.output().splitlines() if line.startswith("partitions [")]
    if not lines:
        return set()
    inside = lines[-1].split("[", 1)[1].split("]", 1)[0]
    return {int(p) for p in inside.split(",") if p.strip()}


@pytest.mark.parametrize(
    ("policy", "calls", "skipped"),
    [("run_once", 1, 2), ("skip", 0, 3), ("run_all", 3, 0)],
)
def test_a_restarted_scanner_applies_the_misfire_policy(
    stack: Stack, target: LoopbackTarget, policy: str, calls: int, skipped: int
) -> None:
    stack.env["SCHEDULER_MISFIRE_GRACE"] = "1"
    now = datetime.now(dt_timezone.utc)
    if now.second < 2:
        time.sleep(2)
        now = datetime.now(dt_timezone.utc)
    minute = now.replace(second=0, microsecond=0)
    owner, _ = service_account_ensure(name="misfire")
    # The job's three due times (minute-2, minute-1, minute) passed while no scanner ran.
    job = job_create(
        owner=owner,
        fields={"schedule": "* * * * *", "target": target.url("/m"), "misfire": policy},
        now=minute - timedelta(minutes=2, seconds=30),
    )
    missed = [minute - timedelta(minutes=2), minute - timedelta(minutes=1), minute]
    stack.scanner("scanner-a")
    stack.worker("worker-a")

    def settled() -> bool:
        rows = {r.scheduled_for: r.status for r in runs_of(job.pk)}
        return all(rows.get(t) in (S.SUCCEEDED, S.SKIPPED) for t in missed)

    wait_for(settled, 45, what="the missed times to be settled")
    time.sleep(1.5)  # a scan or two more: nothing else may happen to the missed times
    rows = {r.scheduled_for: r for r in runs_of(job.pk)}
    called = [c.headers["X-Scheduled-For"] for c in target.calls("/m")]
    missed_text = [t.strftime("%Y-%m-%dT%H:%M:%SZ") for t in missed]
    assert [t for t in called if t in missed_text] == missed_text[:calls]
    assert sum(rows[t].status == S.SKIPPED for t in missed) == skipped
    late_ones = missed if policy == "run_all" else missed[:1]
    assert all("misfired" in event_types(rows[t]) for t in late_ones)
