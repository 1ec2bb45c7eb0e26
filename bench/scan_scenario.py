"""`scan`: the scanner's due query (time and plan) at 10^4 .. 10^7 runs, most in the future.

The rows are one future run per job for the first 10^4 jobs' worth, then backfill
rows (scheduled, in the future) so 10^7 rows need only 10^4 jobs: they sit in the
same partial index as any waiting run, which is what the query reads.
"""
from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from bench import harness
from bench.harness import print_table, write_result

UTC = timezone.utc
JOBS = 10_000
DUE_NOW = 200  # runs due at the time of the query


def run(args: argparse.Namespace) -> int:
    harness.setup_django()
    harness.reset_database()
    from django.db import connection, transaction

    from bench import load
    from runs import claims

    now = datetime.now(UTC).replace(microsecond=0)
    job_ids = load.insert_jobs(count=JOBS, schedule_expr="0 2 * * *", target="http://127.0.0.1:9/h", window_seconds=0)
    # A few due now, the rest spread over the next years.
    load.insert_runs([(j, now - timedelta(seconds=i % 60), now - timedelta(seconds=i % 60)) for i, j in enumerate(job_ids[:DUE_NOW])])
    load.insert_runs([(j, now + timedelta(minutes=1 + i), now + timedelta(minutes=1 + i)) for i, j in enumerate(job_ids[DUE_NOW:])])
    load.analyze()
    rows = JOBS
    seconds_by_rows: dict[str, float] = {}
    plans: dict[str, str] = {}
    for exp in range(4, args.max_exp + 1):
        target_rows = 10**exp
        if target_rows > rows:
            _fill_backfill_rows(target_rows - rows, now + timedelta(days=3650 + 400 * exp))
            rows = target_rows
            with connection.cursor() as cursor:
                cursor.execute("VACUUM ANALYZE runs")
        timings = []
        for _ in range(30):
            with transaction.atomic():
                started = time.perf_counter()
                got = list(claims.lock_due(partitions=list(range(16)), now=now, limit=500).values_list("pk", flat=True))
                timings.append(time.perf_counter() - started)
                transaction.set_rollback(True)  # read and lock only: leave the rows as they are
        assert len(got) == DUE_NOW, len(got)
        with transaction.atomic():
            plan = claims.lock_due(partitions=list(range(16)), now=now, limit=500).explain()
        seconds_by_rows[f"1e{exp}"] = round(statistics.median(timings), 6)
        plans[f"1e{exp}"] = plan
        print(f"1e{exp} rows: median {seconds_by_rows[f'1e{exp}'] * 1000:.3f} ms, {'index' if 'Index' in plan else 'NOT index'} scan")
    first, last = seconds_by_rows["1e4"], seconds_by_rows[f"1e{args.max_exp}"]
    summary: dict[str, Any] = {
        "due_rows": DUE_NOW,
        "seconds_by_rows": seconds_by_rows,
        f"ratio_1e{args.max_exp}_to_1e4": round(last / first, 3),
        "index_scan_at_every_size": all("runs_due_idx" in p and "Seq Scan" not in p for p in plans.values()),
        "plans": plans,
    }
    print_table("scan", [(k, v) for k, v in summary.items() if not isinstance(v, dict)])
    print("written", write_result("scan", summary))
    return 0


def _fill_backfill_rows(count: int, base: datetime) -> None:
    """`count` future scheduled rows over the existing jobs, straight in SQL."""
    from django.conf import settings
    from django.db import connection

    from bench.load import defaults_sql
    from runs.models import Run

    columns, values = defaults_sql(
        Run,
        {
            "job_id": "j.id", "scheduled_for": "t", "due_at": "t", "partition": f"j.id %% {settings.SCHEDULER_PARTITIONS}",
            "status": "'scheduled'", "is_backfill": "true", "created_at": "now()",
        },
    )
    per_job = count // JOBS + 1
    sql = (
        f"INSERT INTO runs ({columns}) SELECT {values} FROM jobs j, "
        "LATERAL (SELECT %s::timestamptz + ((g * 20000 + j.id) * interval '1 second') AS t "
        "FROM generate_series(1, %s) g) s LIMIT %s"
    )
    started = time.time()
    with connection.cursor() as cursor:
        cursor.execute(sql, [base, per_job, count])
    print(f"  +{count:,} rows in {time.time() - started:.0f} s")
