"""`runs` partitioned by `kept_for` (issue 18; docs/performance.md, "The store at scale:
the due read, retention, growth").

PostgreSQL only; the embedded SQLite file keeps the plain table, and Django's model
state is unchanged (its constraints say what the store keeps, not how).

The table becomes `PARTITION BY RANGE (kept_for)`:

- `runs_open`, from `9999-12-31` (runs.models.OPEN_KEPT_FOR) to MAXVALUE: every open
  run and nothing else (the scanner's, the claim's and the outcome's table), with room
  on each page for HOT updates (`fillfactor = 50`);
- `runs_history`, the DEFAULT partition: ended runs, keyed by their scheduled time.
  The outcome that ends a run moves it there in the same statement (the `BEFORE
  UPDATE` trigger of migration 0014 sets its key); a requeued dead run or a reopened
  cancelled one moves back. Day partitions carved out of it come later.

A unique index of a partitioned table must hold its key, so:

- the primary key is (id, kept_for); `id` stays unique by its sequence (an identity
  column is not allowed on a partitioned table in PostgreSQL 15, so `runs_id_seq` is a
  plain sequence owned by the column);
- `runs_one_open_run_per_job` is (job, kept_for) over the open runs: every open run has
  the same key, so it is (job) as before, exactly as enforced;
- `runs_one_run_per_time` is (job, kept_for, scheduled_for): for the ended runs kept_for
  is scheduled_for, so among them it is (job, scheduled_for) across every partition;
  among the open runs, likewise. Between an open and an ended run at the same time, which
  the index no longer sees together, the statement trigger `runs_one_run_per_time`
  refuses the newer row with the same error (SQLSTATE 23505 naming the constraint):
  after each INSERT it locks the new runs' jobs (as every writer of runs does) and looks for
  another row at that time in the open runs and in that time's history. A run's
  `scheduled_for` is never changed once written, and a row that moves between open and
  ended keeps its time, so inserts are the only way in.
- `notices.run` loses its database foreign key (it would need a unique `id` alone);
  the ORM still deletes a run's notices with it, as it does its events.

The copy runs under an ACCESS EXCLUSIVE lock on `runs` (scanners and workers wait): an
`INSERT ... SELECT` of every row, the indexes built after it. docs/performance.md
has its time on 10^6 runs.
"""
from importlib import import_module

from django.db import migrations, models
import django.db.models.deletion

# Migration 0011's triggers on runs (their functions outlive the old table).
RUN_WAKE_TRIGGERS = [
    statement.strip()
    for statement in import_module("runs.migrations.0011_wake_scanners").FORWARD.split("\n\n")
    if statement.strip().startswith("CREATE TRIGGER runs_")
]
assert len(RUN_WAKE_TRIGGERS) == 2, RUN_WAKE_TRIGGERS

OPEN_KEY = "'9999-12-31 00:00:00+00'"
OPEN_STAGES = "stage IN ('waiting', 'flight')"

# Every column but the generated `stage`, in the table's order.
COLUMNS = (
    "id, scheduled_for, due_at, partition, status, held, attempt, fence, lease_owner, lease_expires_at, "
    "queued_at, started_at, finished_at, last_error, is_backfill, created_at, job_id, handled_at, handled_by, "
    "attempt_base, detached, on_row, on_row_due_at, on_row_queued_at, on_row_claimed_at, on_row_worker, "
    "on_row_answer, on_row_duration_ms, on_row_made_by, kept_for"
)

# Each partition's index takes its table's index's name and the partition's
# (runs_due_idx_open, runs_pkey_history), so that a plan says which index it read.
NAME_PARTITION_INDEXES = """
DO $$
DECLARE
    child record;
BEGIN
    FOR child IN
        SELECT ci.relname AS name, pi.relname || '_' || substr(ct.relname, 6) AS wanted
          FROM pg_inherits inh
          JOIN pg_class ci ON ci.oid = inh.inhrelid
          JOIN pg_class pi ON pi.oid = inh.inhparent
          JOIN pg_index x ON x.indexrelid = ci.oid
          JOIN pg_class ct ON ct.oid = x.indrelid
          JOIN pg_index px ON px.indexrelid = pi.oid
         WHERE px.indrelid = 'runs'::regclass AND ci.relname <> pi.relname || '_' || substr(ct.relname, 6)
    LOOP
        EXECUTE format('ALTER INDEX %I RENAME TO %I', child.name, child.wanted);
    END LOOP;
END $$"""

# What either shape of the table gets the same: the indexes that hold no unique key,
# the jobs foreign key, and migration 0014's trigger (its function outlives the table).
SAME_BOTH_WAYS = [
    f"CREATE INDEX runs_due_idx ON runs (partition, stage, held, due_at) WHERE {OPEN_STAGES}",
    "CREATE INDEX runs_status_idx ON runs (stage, id DESC) WHERE NOT stage = 'succeeded'",
    "CREATE INDEX runs_finished_idx ON runs (finished_at) WHERE finished_at IS NOT NULL",
    "CREATE INDEX runs_dead_unhandled_idx ON runs (id) WHERE handled_at IS NULL AND stage = 'dead'",
    """ALTER TABLE runs ADD CONSTRAINT runs_job_id_1c443ccb_fk_jobs_id FOREIGN KEY (job_id)
       REFERENCES jobs (id) DEFERRABLE INITIALLY DEFERRED""",
    """CREATE TRIGGER runs_kept_for BEFORE UPDATE OF status, scheduled_for, kept_for ON runs FOR EACH ROW
       WHEN ((NEW.status IN ('scheduled', 'queued', 'running')) IS DISTINCT FROM (OLD.status IN ('scheduled', 'queued', 'running'))
             OR NEW.scheduled_for IS DISTINCT FROM OLD.scheduled_for
             OR NEW.kept_for IS DISTINCT FROM OLD.kept_for)
       EXECUTE FUNCTION runs_kept_for()""",
]

FORWARD = [
    "LOCK TABLE runs IN ACCESS EXCLUSIVE MODE",
    "CREATE SEQUENCE runs_new_id_seq AS bigint",
    """CREATE TABLE runs_new (LIKE runs INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING CONSTRAINTS)
       PARTITION BY RANGE (kept_for)""",
    "ALTER TABLE runs_new ALTER COLUMN id SET DEFAULT nextval('runs_new_id_seq')",
    "ALTER SEQUENCE runs_new_id_seq OWNED BY runs_new.id",
    f"CREATE TABLE runs_open PARTITION OF runs_new FOR VALUES FROM ({OPEN_KEY}) TO (MAXVALUE) WITH (fillfactor = 50)",
    "CREATE TABLE runs_history PARTITION OF runs_new DEFAULT",
    f"INSERT INTO runs_new ({COLUMNS}) SELECT {COLUMNS} FROM runs",
    "SELECT setval('runs_new_id_seq', COALESCE((SELECT max(id) FROM runs_new), 0) + 1, false)",
    "DROP TABLE runs",
    "ALTER TABLE runs_new RENAME TO runs",
    "ALTER SEQUENCE runs_new_id_seq RENAME TO runs_id_seq",
    "ALTER TABLE runs ADD CONSTRAINT runs_pkey PRIMARY KEY (id, kept_for)",
    "ALTER TABLE runs ADD CONSTRAINT runs_one_run_per_time UNIQUE (job_id, kept_for, scheduled_for)",
    f"""CREATE UNIQUE INDEX runs_one_open_run_per_job ON runs (job_id, kept_for)
        WHERE NOT detached AND NOT is_backfill AND {OPEN_STAGES}""",
    *SAME_BOTH_WAYS,
    # No two runs of a job at one time, open and ended together (the docstring). The
    # job's row lock (FOR NO KEY UPDATE, as runs.nextrun.jobs_lock takes it, in id
    # order; a no-op where the writer holds it already, as every writer of runs does)
    # makes two writers of one job take turns; each statement of a plpgsql function
    # reads a fresh snapshot, so the second sees the first's committed row. A row lock
    # is kept on the row, not in the lock table: a statement of a million runs fits.
    # `enable_seqscan = off`: the function's queries are planned once a session; a plan
    # made for a one-row insert (a scan of the new rows per job) was reused for a
    # million rows and ran for over ten minutes. Index probes hold for any size.
    f"""CREATE FUNCTION runs_one_run_per_time() RETURNS trigger LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    clash record;
BEGIN
    PERFORM 1 FROM jobs j WHERE j.id IN (SELECT i.job_id FROM inserted i) ORDER BY j.id FOR NO KEY UPDATE OF j;
    SELECT i.job_id, i.scheduled_for INTO clash
      FROM inserted i
     WHERE EXISTS (SELECT 1 FROM runs r
                    WHERE r.job_id = i.job_id AND r.scheduled_for = i.scheduled_for
                      AND r.kept_for IN (i.scheduled_for, {OPEN_KEY}) AND r.id <> i.id)
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING
            ERRCODE = 'unique_violation',
            CONSTRAINT = 'runs_one_run_per_time',
            TABLE = 'runs',
            MESSAGE = 'duplicate key value violates unique constraint "runs_one_run_per_time"',
            DETAIL = 'Key (job_id, scheduled_for)=(' || clash.job_id || ', ' || clash.scheduled_for || ') already exists.';
    END IF;
    RETURN NULL;
END $$""",
    """CREATE TRIGGER runs_one_run_per_time AFTER INSERT ON runs
       REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT
       EXECUTE FUNCTION runs_one_run_per_time()""",
    *RUN_WAKE_TRIGGERS,
    NAME_PARTITION_INDEXES,
    "ANALYZE runs",
]

BACKWARD = [
    "LOCK TABLE runs IN ACCESS EXCLUSIVE MODE",
    "DROP TRIGGER runs_one_run_per_time ON runs",
    "DROP FUNCTION runs_one_run_per_time()",
    "ALTER TABLE runs RENAME TO runs_partitioned",
    "ALTER TABLE runs_partitioned RENAME CONSTRAINT runs_pkey TO runs_partitioned_pkey",
    "ALTER TABLE runs_partitioned RENAME CONSTRAINT runs_one_run_per_time TO runs_partitioned_one_run_per_time",
    "ALTER TABLE runs_partitioned DROP CONSTRAINT runs_job_id_1c443ccb_fk_jobs_id",
    *[f"ALTER INDEX {name} RENAME TO {name}_partitioned" for name in (
        "runs_one_open_run_per_job", "runs_due_idx", "runs_status_idx", "runs_finished_idx",
        "runs_dead_unhandled_idx")],
    "CREATE TABLE runs (LIKE runs_partitioned INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING CONSTRAINTS)",
    "ALTER TABLE runs SET (fillfactor = 50)",
    "ALTER TABLE runs ALTER COLUMN id DROP DEFAULT",
    f"INSERT INTO runs ({COLUMNS}) SELECT {COLUMNS} FROM runs_partitioned",
    "DROP TABLE runs_partitioned",
    "ALTER TABLE runs ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY",
    "SELECT setval(pg_get_serial_sequence('runs', 'id'), COALESCE((SELECT max(id) FROM runs), 0) + 1, false)",
    "ALTER TABLE runs ADD CONSTRAINT runs_pkey PRIMARY KEY (id)",
    "ALTER TABLE runs ADD CONSTRAINT runs_one_run_per_time UNIQUE (job_id, scheduled_for)",
    f"""CREATE UNIQUE INDEX runs_one_open_run_per_job ON runs (job_id)
        WHERE NOT detached AND NOT is_backfill AND {OPEN_STAGES}""",
    *SAME_BOTH_WAYS,
    *RUN_WAKE_TRIGGERS,
]


def on_postgresql(statements: list[str]):
    def run(apps, schema_editor) -> None:
        if schema_editor.connection.vendor != "postgresql":
            return
        for statement in statements:
            schema_editor.execute(statement, params=None)

    return run


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0014_kept_for'),
    ]

    operations = [
        migrations.AlterField(
            model_name='notice',
            name='run',
            field=models.ForeignKey(blank=True, db_constraint=False, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='notices', to='runs.run'),
        ),
        migrations.RunPython(on_postgresql(FORWARD), on_postgresql(BACKWARD), elidable=False),
    ]
