"""A worker keeps its PostgreSQL connection from one task to the next.

Celery's Django fix-up closes every database connection before and after each task
unless CELERY_DB_REUSE_MAX is set, whatever CONN_MAX_AGE says: each run message
then cost its worker child a new PostgreSQL backend (a fork, the authentication, the
session's set-up, cold catalogue caches). The soak at 155 runs/s (2026-12-02) saw 23
new sessions a second. scheduler_project/celery.py keeps the connection and applies
Django's own rule at each task's start and end instead (CONN_MAX_AGE, and a
connection that failed is dropped; CONN_HEALTH_CHECKS checks it before its first use).

Real processes: a scanner and a worker with one child, on the suite's PostgreSQL,
Redis and ZooKeeper; one-off runs due a second apart, so each is a message of its own.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.db import connection

from jobs.services import job_create, service_account_ensure
from runs.models import Run
from tests.integration.conftest import Stack, wait_for
from tests.target import LoopbackTarget

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]
MESSAGES = 12


def sessions() -> int:
    """Sessions ever opened on the test database (PostgreSQL's own count)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


def test_a_worker_child_keeps_its_database_connection_across_messages(
        stack: Stack, target: LoopbackTarget) -> None:
    owner, _ = service_account_ensure(name="connections")
    scanner = stack.scanner("scanner-a")
    wait_for(lambda: "partitions [" in scanner.output(), 30, what="the scanner to take its partitions")
    worker = stack.worker("worker-a", concurrency=1)
    wait_for(lambda: " ready." in worker.output(), 40, what="the worker to be ready")
    start = datetime.now(dt_timezone.utc).replace(microsecond=0) + timedelta(seconds=3)
    warm = job_create(owner=owner, fields={"name": "warm", "run_at": start, "target": target.url("/warm")})
    wait_for(lambda: Run.objects.filter(job=warm, status=Run.Status.SUCCEEDED).exists(), 30,
             what="the first run to succeed")
    before = sessions()
    jobs = [job_create(owner=owner, fields={"name": f"c{i}", "run_at": start + timedelta(seconds=3 + i),
                                            "target": target.url(f"/c{i}")}) for i in range(MESSAGES)]
    wait_for(lambda: Run.objects.filter(job__in=jobs, status=Run.Status.SUCCEEDED).count() == MESSAGES, 60,
             what=f"the {MESSAGES} runs to succeed")
    stack.stop_all()  # the worker's backends end, and their counts are in
    opened = sessions() - before
    print(f"{MESSAGES} messages, {opened} database sessions opened meanwhile")
    # The runs went to the worker one message at a time (each its own scan and claim)...
    assert len(target.calls()) == MESSAGES + 1
    # ...and the worker did not connect again for each: its child's one connection,
    # and at most a few for the test's own reads and the processes' threads.
    assert opened <= 4, f"{opened} sessions for {MESSAGES} messages"
