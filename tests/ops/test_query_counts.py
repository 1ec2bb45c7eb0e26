"""The run list, the job list and the system page read in a bounded number of queries,
whatever the number of rows."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs.models import Job
from runs.models import Run, RunEvent
from tests.factories import make_job
from tests.ops.conftest import ago

pytestmark = pytest.mark.django_db
S = Run.Status


def many_runs(owner: Any, count: int) -> None:
    """`count` runs over 50 jobs in every shape the pages show: dead with their `dead`
    event, late, waiting, running."""
    jobs = [make_job(owner, name=f"job-{i}", target=f"http://host{i % 5}.test:80{i % 3}/x") for i in range(50)]
    start = ago(days=3)
    statuses = [S.DEAD, S.SUCCEEDED, S.QUEUED, S.SCHEDULED, S.RUNNING]
    rows = []
    for i in range(count):
        job = jobs[i % len(jobs)]
        when = start + timedelta(seconds=i)
        status = statuses[i % len(statuses)]
        started = when + timedelta(seconds=i % 120) if status in (S.DEAD, S.SUCCEEDED, S.RUNNING) else None
        rows.append(
            Run(
                job=job,
                scheduled_for=when,
                due_at=when,
                partition=job.pk % settings.SCHEDULER_PARTITIONS,
                status=status,
                is_backfill=True,
                attempt=1 + i % 3,
                started_at=started,
                finished_at=started if status in (S.DEAD, S.SUCCEEDED) else None,
            )
        )
    runs = Run.objects.bulk_create(rows)
    RunEvent.objects.bulk_create(
        RunEvent(run=r, at=timezone.now(), scheduled_for=r.scheduled_for, type="dead",
                 detail={"notified": "x@example.test"})
        for r in runs
        if r.status == S.DEAD
    )


def count_queries(client: Client, url: str, **params: Any) -> int:
    with CaptureQueriesContext(connection) as queries:
        response = client.get(url, params)
    assert response.status_code == 200, response
    return len(queries)


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"dead": "unhandled"},
        {"late": "yes"},
        {"retried": "yes", "status__exact": "dead"},
        {"host": "host1.test:801"},
        {"q": "job-3"},
    ],
)
def test_the_run_list_runs_a_bounded_number_of_queries_with_1000_runs(
    operator_client: Client, owner: Any, params: dict[str, str]
) -> None:
    many_runs(owner, 20)
    few = count_queries(operator_client, "/admin/runs/run/", **params)
    many_runs(owner, 1000)
    assert Run.objects.count() == 1020
    many = count_queries(operator_client, "/admin/runs/run/", **params)
    print(f"run list {params}: {few} queries with 20 runs, {many} with 1020")
    assert many == few and many <= 10, (few, many)


def test_the_job_list_runs_a_bounded_number_of_queries(operator_client: Client, owner: Any) -> None:
    many_runs(owner, 1000)
    queries = count_queries(operator_client, "/admin/jobs/job/")
    print(f"job list: {queries} queries with 50 jobs and 1000 runs")
    assert queries <= 12
    assert Job.objects.count() == 50


@pytest.mark.embedded
def test_the_system_page_runs_a_bounded_number_of_queries_with_1000_runs(operator_client: Client, owner: Any) -> None:
    many_runs(owner, 10)
    few = count_queries(operator_client, "/admin/system/")
    many_runs(owner, 1000)
    many = count_queries(operator_client, "/admin/system/")
    print(f"system page: {few} queries with 10 runs, {many} with 1010")
    assert many == few and many <= 10, (few, many)
    page = operator_client.get("/admin/system/").content.decode()
    for section in ("Scanners and partitions", "Queue", "late now", "Lag, due to start", "Targets"):
        assert section in page
