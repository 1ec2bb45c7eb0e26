"""One clock for leases, the store's, with real processes whose clocks are wrong.

Each skewed process runs under tests/clockshift.py (time-machine, ticking, 120 s
ahead or behind); the database, the target and this test keep the true clock. The
times asserted are read from the store (`SELECT clock_timestamp()`), the clock
every lease is written and compared in.
"""
from __future__ import annotations

import sys
import uuid
from datetime import datetime, timedelta

import pytest
from django.db import connection

from bench.harness import Proc
from jobs.services import job_create, service_account_ensure
from runs.models import Run, RunEvent
from runs.tasks import execute_runs
from tests.integration.conftest import Stack, target, wait_for  # noqa: F401 (target is a fixture)
from tests.target import LoopbackTarget
from tests.factories import timeline_types, entry

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]
S = Run.Status
LEASE = 4  # seconds: short, so a call of a few leases must be heartbeated
SKEW = 120


def store_now() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


def skewed(stack: Stack, name: str, offset: float, argv: list[str], **env: str) -> Proc:
    """A real process whose wall clock runs `offset` seconds off the true one."""
    proc = Proc(name, [sys.executable, "tests/clockshift.py", "--offset", str(offset), "--", *argv],
                {**stack.env, **env}, stack.log_dir)
    stack.procs.append(proc)
    return proc


def scanner_argv(name: str) -> list[str]:
    return ["manage.py", "scanner", "--identifier", name]


def worker_argv(name: str) -> list[str]:
    return ["-m", "celery", "-A", "scheduler_project", "worker", "-l", "INFO", "-c", "2", "-n", f"{name}@%h",
            "--without-heartbeat", "--without-gossip", "--without-mingle"]


def one_off(url: str, at: datetime) -> Run:
    owner, _ = service_account_ensure(name="clocks", email="owner@example.test")
    job = job_create(owner=owner, fields={"name": f"skew-{uuid.uuid4().hex[:6]}", "run_at": at.replace(microsecond=0)
                                          + timedelta(seconds=1), "target": url})
    return Run.objects.get(job=job)


def types(run: Run) -> list[str]:
    return timeline_types(run)


def test_a_fast_worker_and_scanner_neither_claim_nor_release_a_live_lease_of_a_true_clock_worker(
        stack: Stack, target: LoopbackTarget) -> None:  # noqa: F811
    stack.env["SCHEDULER_LEASE_SECONDS"] = str(LEASE)
    fast_queue = f"{stack.env['SCHEDULER_RUN_QUEUE']}-fast"
    target.delay("/slow", 4 * LEASE)
    skewed(stack, "scanner-fast", SKEW, scanner_argv("scanner-fast"))
    stack.worker("worker-true")
    # A worker with a fast clock that gets the live run's message: a duplicate, as a
    # republish makes. It listens on a queue of its own so that only it can get it.
    fast = skewed(stack, "worker-fast", SKEW, worker_argv("worker-fast"), SCHEDULER_RUN_QUEUE=fast_queue)
    run = one_off(target.url("/slow"), store_now())
    later = one_off(target.url("/later"), store_now() + timedelta(seconds=60))

    wait_for(lambda: target.calls("/slow"), 45, what="the true-clock worker's call to arrive")
    called = store_now()
    wait_for(lambda: " ready." in fast.output(), 45, what="the fast worker to be ready")
    for sent in range(1, 4):  # over three leases of the call
        execute_runs.apply_async(([run.pk],), queue=fast_queue)
        wait_for(lambda n=sent: fast.output().count("not_claimed") >= n or len(target.calls("/slow")) > 1, 15,
                 what="the fast worker to take the message")
        wait_for(lambda n=sent: store_now() > called + timedelta(seconds=n * LEASE), 15,
                 what="one more lease to pass")

    wait_for(lambda: Run.objects.get(pk=run.pk).status == S.SUCCEEDED, 30, what="the slow run to succeed")
    run.refresh_from_db()
    assert [c.headers["X-Fence-Token"] for c in target.calls("/slow")] == ["1"]
    assert run.fence == 1 and run.attempt == 1
    assert "lease_expired" not in types(run) and types(run).count("claimed") == 1, types(run)
    assert fast.output().count("not_claimed") >= 3  # the fast worker saw the run and let it be
    # The scanner's due read is the store's clock too: a run due in a minute is not queued yet.
    later.refresh_from_db()
    assert later.status == S.SCHEDULED and target.calls("/later") == []


@pytest.mark.parametrize("offset", [-SKEW, SKEW], ids=["behind", "ahead"])
def test_a_skewed_worker_killed_mid_call_has_its_run_recovered_within_a_lease_and_a_scan(
        stack: Stack, target: LoopbackTarget, offset: int) -> None:  # noqa: F811
    stack.env["SCHEDULER_LEASE_SECONDS"] = str(LEASE)
    scan = float(stack.env["SCHEDULER_SCAN_INTERVAL"])
    target.delay("/slow", 10 * LEASE)
    stack.scanner("scanner-true")
    doomed = skewed(stack, "worker-skewed", offset, worker_argv("worker-skewed"))
    run = one_off(target.url("/slow"), store_now())

    wait_for(lambda: target.calls("/slow"), 45, what="the skewed worker's call to arrive")
    called = store_now()
    # Two leases of the call pass: the heartbeats keep the lease live, nobody takes it back.
    wait_for(lambda: store_now() > called + timedelta(seconds=2 * LEASE), 15, what="two leases to pass")
    assert "lease_expired" not in types(run), types(run)
    doomed.kill()
    killed = store_now()

    recovered = wait_for(lambda: RunEvent.objects.filter(run=run, type="lease_expired").exists() and store_now(),
                         3 * LEASE, interval=0.1, what="the scanner to take the lease back")
    print(f"worker {offset:+d} s killed -> lease taken back: {(recovered - killed).total_seconds():.2f} s "
          f"by the store's clock (lease {LEASE} s, scan {scan:g} s)")
    assert recovered - killed <= timedelta(seconds=LEASE + scan + 1.0), recovered - killed
    expired_at = entry(run, "lease_expired").at
    assert expired_at > killed, (killed, expired_at)  # the live lease was not taken back before the kill
    assert Run.objects.get(pk=run.pk).status in (S.QUEUED, S.RUNNING)


@pytest.mark.parametrize("offset", [-SKEW, SKEW], ids=["behind", "ahead"])
def test_a_skewed_worker_calls_a_run_queued_ahead_at_its_due_time_by_the_stores_clock(
        stack: Stack, target: LoopbackTarget, offset: int) -> None:  # noqa: F811
    """SCHEDULER_LOOKAHEAD: the worker waits for the due time on its own clock corrected
    by the store's (ahead by 120 s it would call at once, behind it would wait two
    minutes); the claim refuses a run not yet due in any case."""
    scanner = stack.scanner("scanner-true", SCHEDULER_LOOKAHEAD="2")
    worker = skewed(stack, "worker-skewed", offset, worker_argv("worker-skewed"), SCHEDULER_LOOKAHEAD="2")
    wait_for(lambda: "partitions [" in scanner.output() and " ready." in worker.output(), 45,
             what="the scanner and the worker to start")
    run = one_off(target.url("/ahead"), store_now() + timedelta(seconds=4))

    [call] = wait_for(lambda: target.calls("/ahead"), 30, what="the call")
    run.refresh_from_db()
    queued = entry(run, "queued").at
    assert queued <= run.due_at - timedelta(seconds=1)  # queued ahead (scans every 0.5 s)
    # The target and the store keep the true clock (one machine).
    assert run.due_at.timestamp() <= call.at <= run.due_at.timestamp() + 1.0
    assert types(run).count("claimed") == 1 and "not_yet_due" not in types(run)
