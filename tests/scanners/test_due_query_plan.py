"""The scanner's question is one short index range read, even with a million future runs."""
from __future__ import annotations

import pytest
from django.db import connection, transaction

from runs import claims
from tests.factories import make_job, utc

pytestmark = pytest.mark.django_db(transaction=True)

ROWS = 1_000_000

FILL_JOBS = """
INSERT INTO jobs (owner_id, name, schedule, timezone, target, method, headers, secret_headers,
                  secret_header_names, window_seconds, misfire, retry_max, retry_backoff,
                  retry_base_seconds, retry_cap_seconds, timeout_seconds, notify, paused, state,
                  created_at, updated_at)
SELECT %s, 'bulk', '0 2 * * *', 'UTC', 'http://127.0.0.1:9/h', 'POST', '{}', '', '[]', 0, 'run_once', 3,
       'exponential', 10, 3600, 30, '', false, 'active', now(), now()
  FROM generate_series(1, %s)
"""

# One future run per job, spread over the next year, in 16 partitions.
FILL_RUNS = """
INSERT INTO runs (job_id, scheduled_for, due_at, partition, status, held, attempt, fence, lease_owner,
                  last_error, is_backfill, created_at)
SELECT j.id, t, t, j.id %% 16, 'scheduled', false, 0, 0, '', '', false, now()
  FROM (SELECT id, %s::timestamptz + (id %% 525600) * interval '1 minute' AS t FROM jobs WHERE name = 'bulk') j
"""


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the plan is PostgreSQL's")
def test_the_due_query_is_an_index_scan_on_the_partial_index_with_a_million_future_runs() -> None:
    owner = make_job().owner
    now = utc("2026-10-28T20:30:00Z")
    with connection.cursor() as cursor:
        cursor.execute(FILL_JOBS, [owner.pk, ROWS])
        cursor.execute(FILL_RUNS, [utc("2026-10-28T21:00:00Z")])
        cursor.execute("ANALYZE runs")
        cursor.execute("SELECT count(*) FROM runs WHERE status = 'scheduled'")
        assert cursor.fetchone()[0] >= ROWS
    with transaction.atomic():
        plan = claims.lock_due(partitions=list(range(16)), now=now, limit=500).explain()
    assert "runs_due_idx" in plan, plan
    assert "Index Scan" in plan or "Index Only Scan" in plan, plan
    assert "Seq Scan" not in plan, plan
