"""The open runs' indexes name no column the queueing or the claim changes, so that both
are HOT updates (issue 18; docs/performance.md, "What a run does").

PostgreSQL only; the embedded SQLite file and Django's model state are unchanged.

A row's update is HOT (no new index entry, its new version on the old one's page) only
when no column that an index of its table names, in its key or its predicate, changes.
Until now `runs_open` had the indexes of the partitioned table, and three of them name
`stage`, which the queueing changes (`waiting` to `flight`): each run's queueing wrote
an entry in each of its five indexes, 27% of a run's WAL.

Each partition now has only the indexes its rows need:

- `runs_open` (every open run): the primary key, `runs_one_run_per_time` and
  `runs_finished_idx` (partitioned, as before: none of their columns changes while a
  run is open); `runs_due_idx_open` on (partition, due_at, id, held), every open run,
  its waiting runs and those in flight together (`id`: the scanner's reads start after
  the last run it queued, runs.claims.DUE_IDS_SQL, and the runs of a spike share one
  due time); `runs_one_open_run_per_job_open`, unique
  on (job, kept_for) where neither detached nor a backfill (every row of the partition
  is open, so the predicate needs no stage: it is the same key as before).
- each partition of the history (`runs_history`, `runs_p*`): the three partitioned
  indexes and its own `runs_status_idx_*` and `runs_dead_unhandled_idx_*`, as before.
  `runs.partitions.make` builds them on each new partition (HISTORY_INDEXES).

What it costs: a read of waiting runs steps over the runs in flight of its partition
(they are due first), and a read of runs in flight (a lease ran out, a queued run not
claimed, the back-pressure count) reads them among the waiting runs due by now plus
the look-ahead, where the one index told them apart; docs/performance.md has the
measurements.

Locks: the DROPs take ACCESS EXCLUSIVE on `runs` for the migration's transaction; the
new indexes are small (the open runs; the history's non-succeeded runs).
"""
from importlib import import_module

from django.db import migrations

# The history's partitions (every partition but runs_open), read when the migration runs.
HISTORY_PARTITIONS = """
SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'runs'::regclass AND c.relname <> 'runs_open' ORDER BY c.relname
"""

# As runs.partitions.HISTORY_INDEXES says them (a migration keeps its own copy).
HISTORY_INDEXES = [
    ("runs_status_idx", "(stage, id DESC) WHERE NOT stage = 'succeeded'"),
    ("runs_dead_unhandled_idx", "(id) WHERE handled_at IS NULL AND stage = 'dead'"),
]

FORWARD = [
    "LOCK TABLE runs IN ACCESS EXCLUSIVE MODE",
    "DROP INDEX runs_due_idx",
    "DROP INDEX runs_one_open_run_per_job",
    "DROP INDEX runs_status_idx",
    "DROP INDEX runs_dead_unhandled_idx",
    "CREATE INDEX runs_due_idx_open ON runs_open (partition, due_at, id, held)",
    """CREATE UNIQUE INDEX runs_one_open_run_per_job_open ON runs_open (job_id, kept_for)
       WHERE NOT detached AND NOT is_backfill""",
]

# The partitioned indexes of migration 0015, as they were; each history partition's own
# index of the same definition is attached to its parent, not built again.
_0015 = import_module("runs.migrations.0015_partitioned_runs")
BACKWARD = [
    "LOCK TABLE runs IN ACCESS EXCLUSIVE MODE",
    "DROP INDEX runs_due_idx_open",
    "DROP INDEX runs_one_open_run_per_job_open",
    f"""CREATE UNIQUE INDEX runs_one_open_run_per_job ON runs (job_id, kept_for)
        WHERE NOT detached AND NOT is_backfill AND {_0015.OPEN_STAGES}""",
    *[s for s in _0015.SAME_BOTH_WAYS if s.startswith("CREATE INDEX") and "runs_finished_idx" not in s],
    _0015.NAME_PARTITION_INDEXES,
]


def forward(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for statement in FORWARD:
        schema_editor.execute(statement, params=None)
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(HISTORY_PARTITIONS)
        partitions = [name for (name,) in cursor.fetchall()]
    for partition in partitions:
        for name, definition in HISTORY_INDEXES:
            schema_editor.execute(f"CREATE INDEX {name}{partition[len('runs'):]} ON {partition} {definition}",
                                  params=None)


def backward(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for statement in BACKWARD:
        schema_editor.execute(statement, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0016_kept_for_without_trigger'),
    ]

    operations = [
        migrations.RunPython(forward, backward, elidable=False),
    ]
