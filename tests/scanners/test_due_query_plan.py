"""The scanner's question is one short index range read, even with a million future runs."""
from __future__ import annotations

import pytest
from django.db import connection, transaction

from runs import claims
from tests.factories import make_job, utc

pytestmark = pytest.mark.django_db(transaction=True)

ROWS = 1_000_000

def fill_sql() -> tuple[str, str]:
    """INSERT ... SELECT statements for a job per row and one future run per job; every
    column not named takes its model default (bench.load.defaults_sql), so new fields need
    no change here."""
    from bench.load import defaults_sql
    from jobs.models import Job
    from runs.models import Run

    job_cols, job_vals = defaults_sql(
        Job,
        {"owner_id": "%s", "name": "'bulk'", "schedule": "'0 2 * * *'", "target": "'http://127.0.0.1:9/h'",
         "created_at": "now()", "updated_at": "now()"},
    )
    run_cols, run_vals = defaults_sql(
        Run,
        {"job_id": "j.id", "scheduled_for": "j.t", "due_at": "j.t", "partition": "j.id %% 16",
         "status": "'scheduled'", "created_at": "now()"},
    )
    fill_jobs = f"INSERT INTO jobs ({job_cols}) SELECT {job_vals} FROM generate_series(1, %s)"
    # One future run per job, spread over the next year, in 16 partitions.
    fill_runs = (
        f"INSERT INTO runs ({run_cols}) SELECT {run_vals} FROM (SELECT id, %s::timestamptz "
        "+ (id %% 525600) * interval '1 minute' AS t FROM jobs WHERE name = 'bulk') j"
    )
    return fill_jobs, fill_runs


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the plan is PostgreSQL's")
def test_the_due_query_is_an_index_scan_on_the_partial_index_with_a_million_future_runs() -> None:
    owner = make_job().owner
    now = utc("2026-10-28T20:30:00Z")
    fill_jobs, fill_runs = fill_sql()
    with connection.cursor() as cursor:
        cursor.execute(fill_jobs, [owner.pk, ROWS])
        cursor.execute(fill_runs, [utc("2026-10-28T21:00:00Z")])
        cursor.execute("ANALYZE runs")
        cursor.execute("SELECT count(*) FROM runs WHERE status = 'scheduled'")
        assert cursor.fetchone()[0] >= ROWS
    with transaction.atomic():
        plan = claims.lock_due(partitions=list(range(16)), now=now, limit=500).explain()
    assert "runs_due_idx" in plan, plan
    assert "Index Scan" in plan or "Index Only Scan" in plan, plan
    assert "Seq Scan" not in plan, plan
