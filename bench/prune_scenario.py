"""`prune`: retention in O(1). 10^7 finished runs in day partitions; prune_runs drops
the oldest day, timed, and the scanner's due query is timed before and after the
history is there (issue 18, done-when 2).

The store: 10^4 jobs, each with its open run (DUE_NOW of them due now, the rest
ahead), as `scan` has them; then `--days` day partitions of the history, 100 days
back, each loaded with runs/days succeeded runs straight into the partition (an
INSERT ... SELECT per day: the parent's statement trigger, which checks a new run's
time against the open runs, is not needed for rows made unique by construction),
one in `--events-every` of them with one event row, as a retried run has.
"""
from __future__ import annotations

import argparse
import re
import statistics
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from bench import harness
from bench.harness import print_table, write_result

UTC = timezone.utc
JOBS = 10_000
DUE_NOW = 200
AGE_DAYS = 100


def run(args: argparse.Namespace) -> int:
    harness.setup_django()
    harness.reset_database()
    from django.conf import settings
    from django.db import connection

    from bench import load
    from runs import ops, partitions
    from runs.models import Run, RunEvent

    now = datetime.now(UTC).replace(microsecond=0)
    job_ids = load.insert_jobs(count=JOBS, schedule_expr="0 2 * * *", target="http://127.0.0.1:9/h", window_seconds=0)
    load.insert_runs([(j, now - timedelta(seconds=i % 60), now - timedelta(seconds=i % 60))
                      for i, j in enumerate(job_ids[:DUE_NOW])])
    load.insert_runs([(j, now + timedelta(days=1, minutes=i), now + timedelta(days=1, minutes=i))
                      for i, j in enumerate(job_ids[DUE_NOW:])])
    load.analyze()
    due = {"before": _due_query(args.repeat)}

    first_day = partitions.span_at(now - timedelta(days=AGE_DAYS), timedelta(days=1)).start
    per_day = args.runs // args.days
    columns, values = load.defaults_sql(Run, {
        "job_id": f"{min(job_ids)} + (g %% {JOBS})", "scheduled_for": "t", "due_at": "t",
        "partition": f"({min(job_ids)} + (g %% {JOBS})) %% {settings.SCHEDULER_PARTITIONS}",
        "status": "'succeeded'", "attempt": "1", "fence": "1", "started_at": "t + interval '300 milliseconds'",
        "finished_at": "t + interval '600 milliseconds'", "created_at": "t - interval '1 day'",
    })
    load_seconds = []
    # The events' run time (migration runs 0019), where the tree's model has it: a
    # baseline's older tree has not.
    keyed = "scheduled_for, " if any(f.name == "scheduled_for" for f in RunEvent._meta.fields) else ""
    for day in range(args.days):
        span = partitions.span_at(first_day + timedelta(days=day), timedelta(days=1))
        partitions.make(span)
        started = time.time()
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {span.name} ({columns}) SELECT {values} FROM generate_series(0, %s - 1) g, "
                "LATERAL (SELECT %s::timestamptz + g * (interval '86399 seconds' / %s) AS t) s",
                [per_day, span.start, per_day],
            )
            cursor.execute(
                f"INSERT INTO run_events (run_id, at, {keyed}type, detail) "
                f"SELECT id, finished_at, {keyed}'retry_scheduled', '{{}}' "
                f"FROM {span.name} WHERE id %% %s = 0", [args.events_every],
            )
        load_seconds.append(time.time() - started)
        print(f"  {span.name}: {per_day:,} runs in {load_seconds[-1]:.0f} s")
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE runs")
        cursor.execute("VACUUM ANALYZE run_events")
        cursor.execute("SELECT count(*) FROM runs WHERE kept_for < '9999-12-31'")
        history = cursor.fetchone()[0]
        cursor.execute("SELECT count(*) FROM run_events")
        events = cursor.fetchone()[0]
    due["after"] = _due_query(args.repeat)

    # The cutoff: the end of the oldest day. Its runs are spread over its first
    # 86,399 s and each finished 0.6 s after its time: the last one before the
    # cutoff, the next day's first one after it.
    oldest = partitions.spans()[0]
    older_than = now - oldest.end
    started = time.perf_counter()
    result = ops.prune_runs(older_than=older_than, now=now)
    prune_seconds = time.perf_counter() - started
    assert result.dropped == (oldest.name,), result
    due["after_prune"] = _due_query(args.repeat)
    # A second prune with nothing to drop: what the daily command costs otherwise.
    started = time.perf_counter()
    again = ops.prune_runs(older_than=older_than, now=now)
    idle_seconds = time.perf_counter() - started
    assert again.runs == 0, again

    summary: dict[str, Any] = {
        "history_runs": history,
        "event_rows": events,
        "days": args.days,
        "prune_seconds": round(prune_seconds, 4),
        "pruned_runs": result.runs,
        "pruned_events": result.events,
        "dropped": list(result.dropped),
        "prune_with_nothing_to_drop_seconds": round(idle_seconds, 4),
        "due_query_seconds": {k: v["median"] for k, v in due.items()},
        "due_query_ratio_after_to_before": round(due["after"]["median"] / due["before"]["median"], 3),
        "due_query_plan_unchanged": due["before"]["plan_shape"] == due["after"]["plan_shape"],
        "due_query_plans": {k: v["plan"] for k, v in due.items()},
        "load_seconds_per_day": round(statistics.median(load_seconds), 1),
    }
    print_table("prune", [(k, v) for k, v in summary.items() if not isinstance(v, dict)])
    print("written", write_result(args.out_name, summary))
    return 0


def _due_query(repeat: int) -> dict[str, Any]:
    from django.db import transaction

    from runs import claims

    timings = []
    for _ in range(repeat):
        with transaction.atomic():
            started = time.perf_counter()
            got = list(claims.lock_due(partitions=list(range(16)), now=datetime.now(UTC), limit=500)
                       .values_list("pk", flat=True))
            timings.append(time.perf_counter() - started)
            transaction.set_rollback(True)
    assert len(got) == DUE_NOW, len(got)  # the others are a day ahead or more
    with transaction.atomic():
        plan = claims.lock_due(partitions=list(range(16)), now=datetime.now(UTC), limit=500).explain()
    # The plan's nodes and relations, without its costs and times.
    shape = [re.sub(r"'[^']*'", "'...'", line.split("  (cost")[0].strip()) for line in plan.splitlines()]
    return {"median": round(statistics.median(timings), 6), "plan": plan, "plan_shape": shape}
