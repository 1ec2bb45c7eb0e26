"""The soak's load (`bench/soak.py --rate R`) and its accounting, set-based.

The load is bench/scenarios.py `sustained`'s: `R * 60` every-minute cron jobs, each
run spread over a window (59 s by default) by the project's own `spread_due_at`, so
R runs come due every second, steadily, for as long as the soak lasts. The jobs are
bulk-inserted (bench/load.py) with the soak's retries (5, exponential from 1 s, cap
8 s), `misfire=run_all` and `overlap=allow` (every minute's run must start, whatever
became of the one before: a retry across the minute does not excuse the next), half
on each of the target's two ports (two target hosts: the bulkhead and the breaker are
per host), and no user action touches them.

Their accounting covers every run, in SQL, not in a Python loop over rows: the
reference schedule of each load job is every minute from its first run's time until
the last one whose window has closed by the cutoff (generate_series), and each such
time must have a normal run that started (`started_at`, which the claim sets and
nothing clears). A run waiting past the cutoff on purpose (its target's bulkhead or
breaker put its due_at there) is not judged, as in bench/soak_actions.judge.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any


DEFERRALS = ("bulkhead_wait", "held_by_breaker")


def insert_load_jobs(*, rate: int, window_s: int, urls: list[str], first: datetime) -> tuple[int, int]:
    """`rate * 60` every-minute jobs, spread over `urls` in turn, each with its first run
    at `first` (a whole minute); returns the (lowest, highest) job id, a contiguous range."""
    from django.db import connection

    from bench import load
    from jobs import schedule
    from jobs.models import Job

    count = rate * 60
    ids: list[int] = []
    for i, url in enumerate(urls):
        n = count // len(urls) + (1 if i < count % len(urls) else 0)
        columns, values = load.defaults_sql(Job, {
            "owner_id": "%s", "name": "'load'", "schedule": "'* * * * *'", "target": "%s",
            "payload": """'{"load": 1}'""", "window_seconds": "%s", "misfire": "'run_all'", "retry_max": "5",
            "retry_backoff": "'exponential'", "retry_base_seconds": "1", "retry_cap_seconds": "8",
            "overlap": "'allow'",
            "timeout_seconds": "10", "created_at": "now()", "updated_at": "now()",
        })
        with connection.cursor() as cursor:
            cursor.execute(f"INSERT INTO jobs ({columns}) SELECT {values} FROM generate_series(1, %s) RETURNING id",
                           [load.owner_id(), url, window_s, n])
            ids += [row[0] for row in cursor.fetchall()]
    ids.sort()
    assert ids == list(range(ids[0], ids[-1] + 1)), "load job ids are one contiguous range"
    window = timedelta(seconds=window_s)
    load.insert_runs([(i, first, schedule.spread_due_at(i, first, window)) for i in ids])
    load.analyze()
    return ids[0], ids[-1]


def _one(sql: str, params: Any) -> tuple[Any, ...]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()


def _all(sql: str, params: Any) -> list[tuple[Any, ...]]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


# A run's timeline in SQL: its event rows and the entries on its run row (runs.timeline:
# the happy path's queued, claimed, target_answered and succeeded, by the bits of
# runs.on_row), one relation with run_events' columns.
TIMELINE = """(
    SELECT run_id, at, type, detail FROM run_events
    UNION ALL SELECT id, on_row_queued_at, 'queued', '{}'::jsonb FROM runs WHERE on_row & 2 <> 0
    UNION ALL SELECT id, on_row_claimed_at, 'claimed',
                     jsonb_build_object('fence', fence, 'worker', on_row_worker, 'attempt', attempt)
                FROM runs WHERE on_row & 4 <> 0
    UNION ALL SELECT id, finished_at, 'target_answered',
                     jsonb_build_object('fence', fence, 'status', on_row_answer, 'duration_ms', on_row_duration_ms)
                FROM runs WHERE on_row & 8 <> 0
    UNION ALL SELECT id, finished_at, 'succeeded', jsonb_build_object('fence', fence) FROM runs WHERE on_row & 16 <> 0
)"""

def accounting(*, lo: int, hi: int, first: datetime, window_s: int, cutoff: datetime,
               steady: tuple[datetime, datetime] | None = None) -> dict[str, Any]:
    """Due, started, missed, and the rest, for every run of the load jobs; with `steady`
    (from, to), the runs started per second in that span (the throughput, when the
    offered rate is above it) and the start lag of first attempts due in it."""
    last = cutoff - timedelta(seconds=window_s)  # the latest time whose window has closed
    ref = """
        WITH ref AS (
            SELECT j.id AS job_id, t
            FROM jobs j, generate_series(%(first)s::timestamptz, %(last)s::timestamptz, interval '1 minute') t
            WHERE j.id BETWEEN %(lo)s AND %(hi)s
        ), judged AS (
            SELECT ref.job_id, ref.t, r.id AS run_id, r.status, r.started_at, r.held,
                   (r.status = 'scheduled' AND r.due_at > %(cutoff)s AND EXISTS (
                        SELECT 1 FROM run_events e WHERE e.run_id = r.id AND e.type = ANY(%(deferrals)s))) AS deferred
            FROM ref LEFT JOIN runs r ON r.job_id = ref.job_id AND r.scheduled_for = ref.t AND NOT r.is_backfill
        )
    """
    params = {"first": first, "last": last, "lo": lo, "hi": hi, "cutoff": cutoff, "deferrals": list(DEFERRALS)}
    due, started, deferred = _one(ref + """
        SELECT count(*) FILTER (WHERE NOT coalesce(deferred, false)),
               count(*) FILTER (WHERE started_at IS NOT NULL AND NOT coalesce(deferred, false)),
               count(*) FILTER (WHERE coalesce(deferred, false))
        FROM judged""", params)
    missed = _all(ref + """
        SELECT job_id, t, run_id, status, held FROM judged
        WHERE started_at IS NULL AND NOT coalesce(deferred, false) ORDER BY t, job_id LIMIT 50""", params)
    statuses = dict(_all("SELECT status, count(*) FROM runs WHERE job_id BETWEEN %s AND %s AND NOT is_backfill"
                         " AND scheduled_for <= %s GROUP BY status", [lo, hi, last]))
    dead = _all("SELECT last_error, count(*) FROM runs WHERE job_id BETWEEN %s AND %s AND status = 'dead'"
                " AND scheduled_for <= %s GROUP BY last_error", [lo, hi, last])
    late = _one("""
        SELECT count(*), max(late), percentile_disc(0.99) WITHIN GROUP (ORDER BY late),
               percentile_disc(0.5) WITHIN GROUP (ORDER BY late)
        FROM (SELECT extract(epoch FROM min(e.at) - (r.scheduled_for + make_interval(secs => %s))) AS late
              FROM runs r JOIN """ + TIMELINE + """ e ON e.run_id = r.id AND e.type = 'claimed'
              WHERE r.job_id BETWEEN %s AND %s AND r.scheduled_for <= %s GROUP BY r.id, r.scheduled_for) x""",
                [window_s, lo, hi, last])
    throughput: dict[str, Any] = {}
    if steady is not None:
        (started_in,) = _one("SELECT count(*) FROM runs WHERE job_id BETWEEN %s AND %s AND started_at >= %s"
                             " AND started_at < %s", [lo, hi, steady[0], steady[1]])
        lags = _one("""
            SELECT percentile_disc(0.5) WITHIN GROUP (ORDER BY l), percentile_disc(0.99) WITHIN GROUP (ORDER BY l),
                   max(l), count(*)
            FROM (SELECT extract(epoch FROM started_at - due_at) AS l FROM runs
                  WHERE job_id BETWEEN %s AND %s AND attempt = 1 AND due_at >= %s AND due_at < %s
                    AND started_at IS NOT NULL) x""", [lo, hi, steady[0], steady[1]])
        seconds = (steady[1] - steady[0]).total_seconds()
        throughput = {"from": steady[0].isoformat(), "to": steady[1].isoformat(), "seconds": round(seconds, 1),
                      "started": started_in, "started_per_s": round(started_in / seconds, 1) if seconds > 0 else None,
                      "start_lag_s": {"p50": _round(lags[0]), "p99": _round(lags[1]), "max": _round(lags[2]),
                                      "runs": lags[3], "measured": "started_at - due_at, first attempts due in the span"}}
    return {
        "steady": throughput,
        "jobs": hi - lo + 1, "window_s": window_s, "first": first.isoformat(), "last_judged": last.isoformat(),
        "due_times": due, "started": started, "deferred_past_cutoff": deferred, "missed": due - started,
        "missed_runs": [f"job_{job} at {t:%H:%M:%S}: " + (f"run_{run} never started ({status}{', held' if held else ''})"
                                                          if run else "no run") for job, t, run, status, held in missed],
        "statuses": statuses, "dead_errors": dead,
        "lateness_past_window_s": {"n": late[0], "max": _round(late[1]), "p99": _round(late[2]),
                                   "p50": _round(late[3])},
    }


def _round(value: Any) -> float | None:
    return None if value is None else round(float(value), 2)


def recorded_applied_twice(run_ids_above: int | None = None) -> list[str]:
    """bench/soak.recorded_applied_twice in one statement, over every run: the fences
    under which the store took a success (`succeeded`), with the fence of the latest
    claim when its holder got a 2xx (`target_answered`); a run with two is a finding."""
    rows = _all("""
        WITH latest AS (
            SELECT run_id, max((detail->>'fence')::bigint) AS fence FROM """ + TIMELINE + """ t
            WHERE type = 'claimed' AND jsonb_typeof(detail->'fence') = 'number' GROUP BY run_id
        ), fences AS (
            SELECT run_id, (detail->>'fence')::bigint AS fence FROM """ + TIMELINE + """ t
            WHERE type = 'succeeded' AND jsonb_typeof(detail->'fence') = 'number'
            UNION
            SELECT e.run_id, (e.detail->>'fence')::bigint FROM """ + TIMELINE + """ e JOIN latest l ON l.run_id = e.run_id
            WHERE e.type = 'target_answered' AND jsonb_typeof(e.detail->'fence') = 'number'
              AND (e.detail->>'fence')::bigint = l.fence AND jsonb_typeof(e.detail->'status') = 'number'
              AND (e.detail->>'status')::numeric BETWEEN 200 AND 299
        )
        SELECT run_id, array_agg(fence ORDER BY fence) FROM fences GROUP BY run_id HAVING count(*) > 1
        ORDER BY run_id""", [])
    return [f"run_{run} recorded as applied under fences {fences}" for run, fences in rows]


def event_counts() -> dict[str, int]:
    return dict(_all("SELECT type, count(*) FROM " + TIMELINE + " t GROUP BY type", []))



def flowing_again(since: datetime, within_s: float = 180) -> datetime | None:
    """The first claim of a run queued (or published again) after `since`: the whole
    path (store, scanner, broker, worker) works again. bench/restarts.py's first_call_s,
    from the store's events."""
    row = _one("""
        SELECT min(c.at) FROM """ + TIMELINE + """ q JOIN """ + TIMELINE + """ c ON c.run_id = q.run_id AND c.type = 'claimed'
            AND c.at >= q.at
        WHERE q.type IN ('queued', 'requeued') AND q.at > %s AND q.at < %s""",
               [since, since + timedelta(seconds=within_s)])
    return row[0] if row else None
