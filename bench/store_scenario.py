"""`store`: what a finished run costs in PostgreSQL: bytes, WAL and row writes.

The load is `sustained`'s (`rate * 60` every-minute jobs, each run spread over a
59 s window, the production layout, a no-op target). Around its measured part:

- **bytes per run**: every table of the bench database (heap, free-space and
  visibility maps, TOAST, indexes; `pg_total_relation_size`), after `VACUUM`,
  at the start (jobs and their first runs loaded) and at the end; the growth
  divided by the runs finished. Each job always has one open run, so the rows
  added are exactly the finished runs and what they wrote.
- **WAL bytes per run**: `pg_current_wal_lsn()` at the first due time and after
  the drain. The server is shared, and WAL is the cluster's: every record
  between the two positions is read back with `pg_walinspect` and counted as
  ours when its first block is in this database (or, for a record without
  blocks such as a commit, when its transaction wrote a block here). A
  temporary physical replication slot keeps that WAL until it is read; it goes
  with the session. The cluster-wide figure, `pg_stat_wal` and a quiet interval
  before the load are reported beside it.
- **row writes per run**: `pg_stat_user_tables` inserts, updates (HOT ones
  too) and deletes over the same interval, per table.
- **over time**, every `--sample-seconds`: each table's and index's size, live
  and dead tuples, autovacuums, and the WAL position, for a plot of a long run.
- **vacuum**: on a server with autovacuum off (a CI configuration) nothing is
  reclaimed during the run, so the bench applies autovacuum's own rule itself
  every `--vacuum-every` seconds (0: never); with autovacuum on, it leaves it be.

`--baseline-into PATH` (run from a tree of an older commit with today's bench/
overlaid) writes this run's figures under `baseline` in PATH; a plain run keeps
the `baseline` already in bench/results/store.json (or <OUT_NAME>.json with
`--out-name`; the plot goes to <OUT_NAME>-growth.png).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from bench import harness, scenarios
from bench.harness import print_table, write_result

UTC = timezone.utc
QUIET_SECONDS = 10
SLOT = f"store_{harness.BENCH_DB}"[:63]

# A partition counts to its partitioned table (runs_open and runs_history to runs:
# migration runs 0015); a plain table to itself.
def _root(oid: str, name: str) -> str:
    return (f"COALESCE((SELECT p.relname FROM pg_inherits h JOIN pg_class p ON p.oid = h.inhparent "
            f"WHERE h.inhrelid = {oid}), {name})")


TABLE_SIZES_SQL = f"""
SELECT {_root("c.oid", "c.relname")},
       pg_relation_size(c.oid, 'main'),
       pg_relation_size(c.oid, 'fsm') + pg_relation_size(c.oid, 'vm'),
       COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0),
       pg_indexes_size(c.oid),
       pg_total_relation_size(c.oid)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' AND c.relkind = 'r'
"""
INDEX_SIZES_SQL = f"""
SELECT {_root("t.oid", "t.relname")}, c.relname, pg_relation_size(c.oid)
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_class t ON t.oid = i.indrelid
JOIN pg_namespace n ON n.oid = t.relnamespace
WHERE n.nspname = 'public' AND c.relkind = 'i'
"""
TABLE_STATS_SQL = f"""
SELECT {_root("s.relid", "s.relname")}, n_tup_ins, n_tup_upd, n_tup_del, n_tup_hot_upd, n_live_tup, n_dead_tup,
       autovacuum_count, autoanalyze_count
FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid WHERE s.schemaname = 'public' AND c.relkind = 'r'
"""
# Every WAL record between two positions, grouped by whose it is. A record is ours
# when its first block is in this database; one without blocks (a commit) when its
# transaction wrote a block here in the same stretch. "none": neither (checkpoints,
# running-transaction snapshots), which no database owns.
WAL_BY_OWNER_SQL = r"""
WITH r AS MATERIALIZED (
    SELECT xid, resource_manager AS rm, record_type, record_length AS len, fpi_length AS fpi,
           regexp_match(block_ref, '^blkref #\d+: rel \d+/(\d+)/(\d+)') AS m
    FROM pg_get_wal_records_info(%(start)s::pg_lsn, %(end)s::pg_lsn)
), ours AS (
    SELECT DISTINCT xid FROM r WHERE m[1]::oid = %(db)s AND xid <> 0
)
SELECT CASE
         WHEN m IS NOT NULL THEN CASE WHEN m[1]::oid = %(db)s THEN 'own' ELSE 'other' END
         WHEN xid <> 0 AND xid IN (SELECT xid FROM ours) THEN 'own'
         WHEN xid <> 0 THEN 'other'
         ELSE 'none'
       END AS owner,
       CASE WHEN m[1]::oid = %(db)s THEN m[2]::oid END AS filenode,
       rm || '/' || record_type, count(*), sum(len), sum(fpi)
FROM r GROUP BY 1, 2, 3
"""
# filenode -> (relation, the table it belongs to): an index or TOAST relation counts to its table.
RELATION_OF_FILENODE_SQL = f"""
SELECT f, rel.relname,
       {_root("COALESCE(idx_table.oid, toast_table.oid, toast_idx_table.oid, rel.oid)",
              "COALESCE(idx_table.relname, toast_table.relname, toast_idx_table.relname, rel.relname)")},
       n.nspname
FROM unnest(%s::oid[]) AS f
JOIN pg_class rel ON rel.oid = pg_filenode_relation(0, f)
JOIN pg_namespace n ON n.oid = rel.relnamespace
LEFT JOIN pg_index i ON i.indexrelid = rel.oid
LEFT JOIN pg_class idx_table ON idx_table.oid = i.indrelid AND idx_table.relkind <> 't'
LEFT JOIN pg_class toast_table ON toast_table.reltoastrelid = rel.oid
LEFT JOIN pg_class toast_idx_table ON toast_idx_table.reltoastrelid = i.indrelid
"""


def run(args: argparse.Namespace) -> int:
    scenarios._prepare()
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        cursor.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
    stats_dir = Path(harness.tempfile.mkdtemp(prefix="sched-stmts-"))
    layout = scenarios._layout(args, stats_dir, **_history_env(args))
    slot = _reserve_wal()
    try:
        measured = _measure(args, layout, stats_dir)
        figures = _figures(args, measured)  # reads the WAL back: before the slot lets it go
    finally:
        layout.cleanup()
        harness.stop_zookeeper()
        harness.shutil.rmtree(stats_dir, ignore_errors=True)
        slot.close()  # the temporary slot goes with its session
    _report(args, figures)
    return 0


def _history_env(args: argparse.Namespace) -> dict[str, str]:
    """The history's partitions and retention for the processes (issue 18, item 3: a
    long run with partitions of minutes and a retention of ten)."""
    env = {}
    if getattr(args, "partition_width", ""):
        env["SCHEDULER_RUN_PARTITION_WIDTH"] = args.partition_width
    if getattr(args, "retention", ""):
        env["SCHEDULER_RUN_RETENTION"] = args.retention
    return env


def _reserve_wal() -> Any:
    """A temporary physical slot: PostgreSQL keeps the WAL from here until this session ends."""
    import psycopg

    conn = psycopg.connect(f"{harness.PG}/{harness.BENCH_DB}", autocommit=True)
    conn.execute("SELECT pg_create_physical_replication_slot(%s, true, true)", [SLOT])
    return conn


def _measure(args: argparse.Namespace, layout: harness.Layout, stats_dir: Path) -> dict[str, Any]:
    from bench import load

    load_start = _load_average()
    target = layout.target(scenarios.TARGET_PORT)
    first = (datetime.now(UTC) + timedelta(seconds=105)).replace(second=0, microsecond=0)  # >= 45 s: load, quiet, start
    load.cron_jobs_with_first_runs(
        count=args.rate * 60, schedule_expr="* * * * *", target=f"http://127.0.0.1:{scenarios.TARGET_PORT}/hook",
        window_seconds=59, after=first - timedelta(seconds=1),
    )
    _vacuum("VACUUM ANALYZE")
    quiet = _quiet_interval()
    scenarios._start_processes(layout, args)
    end = first + timedelta(minutes=args.minutes)
    scenarios._sleep_until(first)
    before = _snapshot()
    stmts0 = scenarios._statements(stats_dir)
    vacuum_every = 0.0 if _autovacuum_on() else args.vacuum_every
    series = _sample_until(end + timedelta(seconds=2), args.sample_seconds, before, vacuum_every)
    scenarios._stop_processes_after_drain(layout, time.time() + 60, lambda: scenarios._count_open_due(end))
    scenarios._stop_target(target)
    time.sleep(1.5)  # backends flush their table counters on exit
    after = _snapshot()
    load_end = _load_average()
    series.append(_sample(after, before))
    stmts = scenarios._statements(stats_dir) - stmts0
    finished = _finished_runs()
    unvacuumed = _sizes()
    vacuum_lsn0 = _lsn()
    _vacuum("VACUUM")
    vacuum_lsn1 = _lsn()
    vacuumed = _sizes()
    return {
        "first": first, "end": end, "quiet": quiet, "before": before, "after": after, "series": series,
        "finished": finished, "unvacuumed": unvacuumed, "vacuumed": vacuumed, "statements": stmts,
        "vacuum_wal": (vacuum_lsn0, vacuum_lsn1), "load_start": load_start, "load_end": load_end,
        "vacuum": {"server_autovacuum": "on" if _autovacuum_on() else "off", "bench_vacuum_every_s": vacuum_every,
                   "bench_vacuums": _count_vacuums(series)},
    }


def _count_vacuums(series: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for point in series:
        for table in point.get("vacuumed", []):
            counts[table] = counts.get(table, 0) + 1
    return counts


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _vacuum(statement: str) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(statement)


def _one(sql: str, params: Any = None) -> Any:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()[0]


def _rows(sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())


def _lsn() -> str:
    return str(_one("SELECT pg_current_wal_lsn()"))


def _wait_flushed(lsn: str) -> None:
    """pg_walinspect reads only flushed WAL; the walwriter gets there within a moment."""
    harness.wait_for(lambda: _one("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", [lsn]), 10, "the WAL flush")


def _db_oid() -> int:
    return int(_one("SELECT oid FROM pg_database WHERE datname = current_database()"))


def _quiet_interval() -> dict[str, Any]:
    """The cluster's WAL while nothing of ours runs: what the other databases write."""
    lsn0, wal0, t0 = _lsn(), _stat_wal(), time.time()
    time.sleep(QUIET_SECONDS)
    lsn1, wal1, t1 = _lsn(), _stat_wal(), time.time()
    seconds = t1 - t0
    owners = _wal_by_owner([lsn0, lsn1])["by_owner"]
    return {
        "seconds": round(seconds, 1),
        "cluster_wal_bytes_per_s": round(_lsn_diff(lsn0, lsn1) / seconds),
        "stat_wal_bytes_per_s": round((wal1["wal_bytes"] - wal0["wal_bytes"]) / seconds) if wal0 else None,
        "own_wal_bytes": owners.get("own", {}).get("bytes", 0),
    }


def _stat_wal() -> dict[str, int]:
    row = _rows("SELECT wal_records, wal_fpi, wal_bytes FROM pg_stat_wal")
    return {"wal_records": int(row[0][0]), "wal_fpi": int(row[0][1]), "wal_bytes": int(row[0][2])} if row else {}


def _lsn_diff(a: str, b: str) -> int:
    return int(_one("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)", [b, a]))


def _sizes() -> dict[str, Any]:
    tables: dict[str, dict[str, int]] = {}
    for name, *sizes in _rows(TABLE_SIZES_SQL):  # a partitioned table's partitions summed
        into = tables.setdefault(name, dict.fromkeys(("heap", "fsm_vm", "toast", "indexes", "total"), 0))
        for key, value in zip(into, sizes):
            into[key] += int(value)
    indexes: dict[str, dict[str, int]] = {}
    for table, index, size in _rows(INDEX_SIZES_SQL):
        indexes.setdefault(table, {})[index] = size
    return {"tables": tables, "indexes": indexes}


def _table_stats() -> dict[str, dict[str, int]]:
    keys = ("ins", "upd", "del", "hot_upd", "live", "dead", "autovacuums", "autoanalyzes")
    out: dict[str, dict[str, int]] = {}
    for row in _rows(TABLE_STATS_SQL):  # a partitioned table's partitions summed
        into = out.setdefault(row[0], dict.fromkeys(keys, 0))
        for key, value in zip(keys, row[1:]):
            into[key] += int(value)
    return out


def _checkpoints() -> int:
    """Checkpoints of the cluster so far: after each, a page's first change writes its full image."""
    return int(_one("SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"))


def _snapshot() -> dict[str, Any]:
    _rows("SELECT 1 FROM pg_stat_clear_snapshot()")
    return {"t": time.time(), "lsn": _lsn(), "stat_wal": _stat_wal(), "checkpoints": _checkpoints(),
            "stats": _table_stats(), "sizes": _sizes(), "time_partitions": _time_partitions()}


def _time_partitions() -> int:
    """The runs history's time partitions now (runs.partitions: runs_p<start>)."""
    return int(_one("SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                    "WHERE i.inhparent = to_regclass('runs') AND c.relname ~ '^runs_p[0-9]'"))


def _sample(snap: dict[str, Any], start: dict[str, Any]) -> dict[str, Any]:
    """One point of the time series: sizes, tuples, and the WAL position."""
    runs_inserted = snap["stats"].get("runs", {}).get("ins", 0) - start["stats"].get("runs", {}).get("ins", 0)
    tables = {}
    for name, size in snap["sizes"]["tables"].items():
        st, was = snap["stats"].get(name, {}), start["stats"].get(name, {})
        written = any(st.get(k, 0) != was.get(k, 0) for k in ("ins", "upd", "del"))
        if written or size["total"] != start["sizes"]["tables"].get(name, {}).get("total"):
            tables[name] = {**size, "live": st.get("live", 0), "dead": st.get("dead", 0),
                            "autovacuums": st.get("autovacuums", 0), "index_sizes": snap["sizes"]["indexes"].get(name, {})}
    return {"s": round(snap["t"] - start["t"], 1), "lsn": snap["lsn"], "runs_inserted": runs_inserted,
            "time_partitions": snap.get("time_partitions", 0),
            "checkpoints": snap["checkpoints"] - start["checkpoints"], "tables": tables}


def _sample_until(until: datetime, every: float, start: dict[str, Any], vacuum_every: float) -> list[dict[str, Any]]:
    series = [_sample(start, start)]
    vacuum_at = time.time() + vacuum_every
    while time.time() < until.timestamp():
        time.sleep(max(0.0, min(every, until.timestamp() - time.time())))
        vacuumed = []
        if vacuum_every and time.time() >= vacuum_at:
            vacuumed, vacuum_at = _vacuum_due(), time.time() + vacuum_every
        series.append({**_sample(_snapshot(), start), "vacuumed": vacuumed})
    return series


# Autovacuum's own rule (the server's settings), for a server that runs with it off:
# dead tuples past threshold + scale factor x reltuples, or inserts since the last
# vacuum past the insert threshold and its scale factor.
VACUUM_DUE_SQL = """
SELECT s.relname
FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
WHERE s.schemaname = 'public' AND (
      s.n_dead_tup > current_setting('autovacuum_vacuum_threshold')::float
                   + current_setting('autovacuum_vacuum_scale_factor')::float * greatest(c.reltuples, 0)
   OR s.n_ins_since_vacuum > current_setting('autovacuum_vacuum_insert_threshold')::float
                   + current_setting('autovacuum_vacuum_insert_scale_factor')::float * greatest(c.reltuples, 0))
ORDER BY s.relname
"""


def _vacuum_due() -> list[str]:
    """What autovacuum would vacuum now; vacuumed here (this bench's stand-in for it)."""
    _rows("SELECT 1 FROM pg_stat_clear_snapshot()")
    tables = [row[0] for row in _rows(VACUUM_DUE_SQL)]
    for table in tables:
        _vacuum(f'VACUUM "{table}"')
    return tables


def _autovacuum_on() -> bool:
    return str(_one("SHOW autovacuum")) == "on"


def _finished_runs() -> int:
    """Finished runs in the store, and those the retention pruned meanwhile (the
    upkeep's audit entries say how many)."""
    from jobs.models import AuditEntry

    pruned = sum(int(e.detail.get("runs", 0)) for e in AuditEntry.objects.filter(action="pruned"))
    return int(_one("SELECT count(*) FROM runs WHERE finished_at IS NOT NULL")) + pruned


def _wal_from_lsns(lsns: list[str]) -> dict[str, Any]:
    """--skip-wal-detail: the cluster's WAL between the positions, all counted as ours
    (a long run's gigabytes are not read back; the other databases' share, a few
    hundred bytes a second when quiet, is in it)."""
    total = _lsn_diff(lsns[0], lsns[-1])
    return {"by_owner": {"own": {"records": 0, "bytes": total, "fpi_bytes": 0}}, "by_filenode": {}, "by_type": {},
            "per_interval": [_lsn_diff(a, b) for a, b in zip(lsns, lsns[1:])]}


def _wal_by_owner(lsns: list[str]) -> dict[str, Any]:
    """WAL records between consecutive positions, by owner, and ours by relation and record type."""
    db = _db_oid()
    by_owner: dict[str, dict[str, int]] = {}
    by_filenode: dict[tuple[int, str], dict[str, int]] = {}
    by_type: dict[str, dict[str, int]] = {}
    per_interval: list[int] = []
    _wait_flushed(lsns[-1])
    for a, b in zip(lsns, lsns[1:]):
        own = 0
        if _lsn_diff(a, b) <= 0:
            per_interval.append(0)
            continue
        for owner, filenode, kind, n, length, fpi in _rows(WAL_BY_OWNER_SQL, {"start": a, "end": b, "db": db}):
            _add(by_owner.setdefault(owner, {}), n, length, fpi)
            if owner == "own":
                own += int(length)
                _add(by_type.setdefault(kind, {}), n, length, fpi)
                if filenode is not None:
                    _add(by_filenode.setdefault((int(filenode), kind), {}), n, length, fpi)
        per_interval.append(own)
    return {"by_owner": by_owner, "by_filenode": by_filenode, "by_type": by_type, "per_interval": per_interval}


def _add(into: dict[str, int], n: int, length: int, fpi: int) -> None:
    into["records"] = into.get("records", 0) + int(n)
    into["bytes"] = into.get("bytes", 0) + int(length)
    into["fpi_bytes"] = into.get("fpi_bytes", 0) + int(fpi)


def _wal_by_relation(by_filenode: dict[tuple[int, str], dict[str, int]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Ours by relation (index, table, TOAST; with its record types) and summed by the
    table each belongs to."""
    filenodes = sorted({f for f, _ in by_filenode})
    names = {int(f): (rel, table, ns) for f, rel, table, ns in _rows(RELATION_OF_FILENODE_SQL, [filenodes])}
    by_relation: dict[str, dict[str, Any]] = {}
    by_table: dict[str, dict[str, int]] = {}
    for (filenode, kind), counts in by_filenode.items():
        rel, table, ns = names.get(filenode, (f"filenode {filenode}", "(dropped or rewritten since)", ""))
        if table.startswith("pg_"):
            rel = table = "catalogs"
        elif ns == "pg_toast":
            rel = f"{table} (TOAST)"
        one = by_relation.setdefault(rel, {"types": {}})
        _add(one, counts["records"], counts["bytes"], counts["fpi_bytes"])
        _add(one["types"].setdefault(kind, {}), counts["records"], counts["bytes"], counts["fpi_bytes"])
        _add(by_table.setdefault(table, {}), counts["records"], counts["bytes"], counts["fpi_bytes"])
    return by_relation, by_table


def _per_run(counts: dict[str, dict[str, Any]], finished: int) -> dict[str, dict[str, Any]]:
    """Each entry's counts per finished run, biggest first; those under a byte a run left out."""
    out: dict[str, dict[str, Any]] = {}
    for name, c in sorted(counts.items(), key=lambda kv: -kv[1]["bytes"]):
        if c["bytes"] / finished < 1:
            continue
        out[name] = {k: round(v / finished, 2) for k, v in c.items() if k != "types"}
        if "types" in c:
            out[name]["types"] = _per_run(c["types"], finished)
    return out


def _bytes_breakdown(start: dict[str, Any], end: dict[str, Any], finished: int) -> dict[str, Any]:
    tables: dict[str, Any] = {}
    for name, size in end["tables"].items():
        was = start["tables"].get(name, {k: 0 for k in size})
        growth = {k: size[k] - was[k] for k in size}
        if not any(growth.values()):
            continue
        idx_was = start["indexes"].get(name, {})
        tables[name] = {
            **{k: round(v / finished, 1) for k, v in growth.items()},
            "index_bytes": {i: round((s - idx_was.get(i, 0)) / finished, 1)
                            for i, s in sorted(end["indexes"].get(name, {}).items(), key=lambda kv: -kv[1])},
            "total_bytes_at_end": size["total"],
        }
    return dict(sorted(tables.items(), key=lambda kv: -kv[1]["total"]))


def _row_writes(before: dict[str, Any], after: dict[str, Any], finished: int) -> tuple[float, dict[str, Any]]:
    by_table: dict[str, Any] = {}
    total = 0
    for name, st in after["stats"].items():
        was = before["stats"].get(name, {})
        d = {k: st[k] - was.get(k, 0) for k in ("ins", "upd", "del", "hot_upd")}
        writes = d["ins"] + d["upd"] + d["del"]
        if writes:
            total += writes
            by_table[name] = {"writes": round(writes / finished, 3), **{k: round(v / finished, 3) for k, v in d.items()}}
    return round(total / finished, 3), dict(sorted(by_table.items(), key=lambda kv: -kv[1]["writes"]))


def _events_by_type(finished: int) -> dict[str, Any]:
    rows = _rows(
        "SELECT type, count(*), avg(pg_column_size(e.*)), avg(pg_column_size(e.detail)) "
        "FROM run_events e GROUP BY type ORDER BY count(*) DESC"
    )
    return {
        t: {"rows_per_run": round(n / finished, 3), "avg_row_bytes": round(float(row)), "avg_detail_bytes": round(float(det))}
        for t, n, row, det in rows
    }


def _row_sizes() -> dict[str, Any]:
    """Average tuple bytes (pg_column_size of the row: header included, line pointer not)."""
    out = {}
    for table in ("runs", "run_events"):
        out[table] = round(float(_one(f"SELECT avg(pg_column_size(t.*)) FROM {table} t") or 0))
    return out


def _tuple_stats() -> dict[str, Any]:
    """pgstattuple after VACUUM: live bytes, dead bytes and free space of the two big tables,
    and each index's leaf density."""
    out: dict[str, Any] = {}
    for table in ("runs", "run_events"):
        # pgstattuple reads plain tables: a partitioned one's partitions, summed.
        length, live, dead_len, free = _rows(
            "SELECT sum(s.table_len), sum(s.tuple_len), sum(s.dead_tuple_len), sum(s.free_space) FROM pg_class c, "
            "LATERAL pgstattuple(c.oid) s WHERE c.relkind = 'r' AND (c.oid = %s::regclass OR c.oid IN "
            "(SELECT inhrelid FROM pg_inherits WHERE inhparent = %s::regclass))", [table, table]
        )[0]
        out[table] = {"table_len": int(length), "live_tuple_len": int(live), "dead_tuple_len": int(dead_len),
                      "free_space": int(free)}
    for table, index, _ in _rows(INDEX_SIZES_SQL):
        if table in ("runs", "run_events"):
            density = _one("SELECT avg_leaf_density FROM pgstatindex(%s)", [index])
            out.setdefault("index_leaf_density_pct", {})[index] = None if density != density else float(density)
    return out


def _figures(args: argparse.Namespace, m: dict[str, Any]) -> dict[str, Any]:
    finished = max(1, m["finished"])
    before, after = m["before"], m["after"]
    lsns = [s["lsn"] for s in m["series"]]
    wal = _wal_from_lsns(lsns) if getattr(args, "skip_wal_detail", False) else _wal_by_owner(lsns)
    own = wal["by_owner"].get("own", {"records": 0, "bytes": 0, "fpi_bytes": 0})
    cluster = _lsn_diff(before["lsn"], after["lsn"])
    by_relation, by_table = _wal_by_relation(wal["by_filenode"])
    vacuum = (_wal_from_lsns if getattr(args, "skip_wal_detail", False) else _wal_by_owner)(
        list(m["vacuum_wal"]))["by_owner"].get("own", {}).get("bytes", 0)
    for point, own_bytes in zip(m["series"][1:], wal["per_interval"]):
        point["own_wal_bytes"] = own_bytes
    bytes_tables = _bytes_breakdown(before["sizes"], m["vacuumed"], finished)
    row_writes, writes_by_table = _row_writes(before, after, finished)
    stat_wal = (after["stat_wal"].get("wal_bytes", 0) - before["stat_wal"].get("wal_bytes", 0)) if before["stat_wal"] else None
    seconds = after["t"] - before["t"]
    return {
        "load_average": {"start": m["load_start"], "end": m["load_end"]},
        "vacuum": m["vacuum"],
        "bytes_per_run": round(sum(t["total"] for t in bytes_tables.values()), 1),
        "bytes_per_run_before_vacuum": round(
            sum(t["total"] for t in _bytes_breakdown(before["sizes"], m["unvacuumed"], finished).values()), 1
        ),
        "wal_bytes_per_run": round(own["bytes"] / finished, 1),
        # Full-page images follow the cluster's checkpoints, which on a shared server the
        # other databases' WAL sets the pace of: this part compares across runs.
        "wal_bytes_per_run_without_fpi": round((own["bytes"] - own["fpi_bytes"]) / finished, 1),
        "checkpoints_during": after["checkpoints"] - before["checkpoints"],
        "seconds_measured": round(seconds, 1),
        "row_writes_per_run": row_writes,
        "runs_finished": m["finished"],
        "runs_due": args.rate * 60 * args.minutes,
        "statements_per_run": round(m["statements"] / finished, 3),
        "bytes_by_table": bytes_tables,
        "row_writes_by_table": writes_by_table,
        "wal": {
            "own_records_per_run": round(own["records"] / finished, 2),
            "own_fpi_bytes_per_run": round(own["fpi_bytes"] / finished, 1),
            "by_table": _per_run(by_table, finished),
            "by_relation": _per_run(by_relation, finished),
            "by_record_type": _per_run(wal["by_type"], finished),
            "cluster_bytes": cluster,
            "cluster_bytes_per_run": round(cluster / finished, 1),
            "stat_wal_bytes": stat_wal,
            "by_owner_bytes": {k: v["bytes"] for k, v in wal["by_owner"].items()},
            "page_headers_and_alignment_bytes": cluster - sum(v["bytes"] for v in wal["by_owner"].values()),
            "other_databases_bytes_per_s": round(wal["by_owner"].get("other", {}).get("bytes", 0) / seconds),
            "quiet_interval_before": m["quiet"],
            "final_vacuum_own_bytes_per_run": round(vacuum / finished, 1),
        },
        "events_by_type": _events_by_type(finished),
        "avg_row_bytes": _row_sizes(),
        "after_vacuum": _tuple_stats(),
        "series": m["series"],
    }


def _commit() -> str:
    try:
        return harness.sh("git", "rev-parse", "--short", "HEAD", cwd=harness.ROOT).stdout.strip()
    except Exception:  # noqa: BLE001 (a tree without git: the figure stands without its commit)
        return "unknown"


def _report(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    figures.update({
        "commit": _commit(),
        "history": {**_history_env(args), "wal_detail": not getattr(args, "skip_wal_detail", False)},
        "offered_rate": args.rate,
        "minutes": args.minutes,
        "sample_seconds": args.sample_seconds,
        "layout": scenarios._layout_summary(args),
    })
    _print(figures)
    if args.baseline_into:
        path = Path(args.baseline_into)
        doc = json.loads(path.read_text()) if path.exists() else {}
        doc["baseline"] = {**figures, "machine": harness.machine(), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        _add_ratios(doc)
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        print("baseline written into", path)
        return
    out = harness.ROOT / "bench" / "results" / f"{args.out_name}.json"
    if out.exists():
        kept = json.loads(out.read_text()).get("baseline")
        if kept:
            figures["baseline"] = kept
            _add_ratios(figures)
    print("written", write_result(args.out_name, figures))
    if not args.no_plot:
        print("plot", _plot(figures, f"{args.out_name}-growth.png"))


def _add_ratios(doc: dict[str, Any]) -> None:
    base = doc.get("baseline") or {}
    if "bytes_per_run" not in doc or not base:
        return
    doc["ratio_to_baseline"] = {
        k: round(doc[k] / base[k], 3) for k in ("bytes_per_run", "wal_bytes_per_run", "wal_bytes_per_run_without_fpi", "row_writes_per_run")
        if base.get(k)
    }


def _print(f: dict[str, Any]) -> None:
    print_table("store", [(k, v) for k, v in f.items() if not isinstance(v, (dict, list))])
    for name, t in list(f["bytes_by_table"].items())[:4]:
        print(f"  {name}: {t['total']} B/run (heap {t['heap']}, indexes {t['indexes']}, toast {t['toast']})")
    for name, w in list(f["wal"]["by_relation"].items())[:8]:
        print(f"  WAL {name}: {w['bytes']} B/run in {w['records']} records")


def _plot(f: dict[str, Any], file_name: str) -> str:
    """Table sizes and dead tuples over the run: the picture of a long run's growth."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install -r bench/requirements.txt)"
    series = f["series"]
    names = [n for n in ("runs", "run_events") if n in series[-1]["tables"]]
    partitioned = any(p.get("time_partitions") for p in series)
    fig, axes = plt.subplots(3 if partitioned else 2, 1, figsize=(9, 8 if partitioned else 6), sharex=True)
    top, bottom = axes[0], axes[1]
    xs = [p["s"] / 60 for p in series]
    for name in names:
        top.plot(xs, [p["tables"].get(name, {}).get("total", 0) / 2**20 for p in series], label=f"{name} (all)")
        top.plot(xs, [p["tables"].get(name, {}).get("indexes", 0) / 2**20 for p in series], "--", label=f"{name} indexes")
        bottom.plot(xs, [p["tables"].get(name, {}).get("dead", 0) for p in series], label=name)
    top.set_ylabel("MiB")
    bottom.set_ylabel("dead tuples")
    if partitioned:
        axes[2].step(xs, [p.get("time_partitions", 0) for p in series], where="post")
        axes[2].set_ylabel("history partitions")
    axes[-1].set_xlabel("minutes")
    history = f.get("history") or {}
    kept = (f", partitions {history['SCHEDULER_RUN_PARTITION_WIDTH']}" if "SCHEDULER_RUN_PARTITION_WIDTH" in history else "") + \
        (f", retention {history['SCHEDULER_RUN_RETENTION']}" if "SCHEDULER_RUN_RETENTION" in history else "")
    top.set_title(f"store: {f['offered_rate']} runs/s offered{kept}, commit {f['commit']}")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    for point in series:
        if point.get("vacuumed"):
            bottom.axvline(point["s"] / 60, color="grey", linewidth=0.5, linestyle=":")
    path = harness.ROOT / "bench" / "results" / file_name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path.relative_to(harness.ROOT))

