"""`run_events` partitioned by its run's scheduled time (issue 18; docs/performance.md,
"The store at scale: the due read, retention, growth").

Each event row carries its run's `scheduled_for` (`RunEvent.scheduled_for`), which
never changes once the run is written. On PostgreSQL the table becomes `PARTITION BY
RANGE (scheduled_for)`, with the same spans as the runs history's time partitions
(runs.partitions makes and drops the two together) and a DEFAULT partition,
`run_events_default`, for the rest. An ended run's row is kept under its scheduled
time (`runs.kept_for`), so a run's events sit in the partition of the same span as its
ended row, and a whole old span goes with two DROPs instead of a DELETE of its events.
An open run's events sit in its span's partition too; prune_runs moves them out before
dropping it (runs.partitions.drop), so prune_runs' rule (never an open run) keeps its
timeline too.

A unique index of a partitioned table must hold its key: the primary key is (id,
scheduled_for), and `id` stays unique by its sequence (a plain sequence owned by the
column: PostgreSQL 15 allows no identity column on a partitioned table).

The copy runs under an ACCESS EXCLUSIVE lock on `run_events` (every writer of events
waits): an `INSERT ... SELECT` joined to its runs, the index built after it. The
new column sits with the other fixed-width ones, before `type`: no alignment padding.
docs/performance.md has its time on 10^6 runs. SQLite keeps the plain table and fills
the column in place.
"""
from django.db import migrations, models

OPEN_KEY = "'9999-12-31 00:00:00+00'"

# The runs history's time partitions (runs.partitions.spans; not runs_open, not the default).
RUN_PARTITIONS = r"""
SELECT c.relname, b.m[1], b.m[2]
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
 CROSS JOIN LATERAL (SELECT regexp_match(pg_get_expr(c.relpartbound, c.oid),
                                         'FROM \(''([^'']+)''\) TO \(''([^'']+)''\)') AS m) b
 WHERE i.inhparent = 'runs'::regclass AND c.relname <> 'runs_open' AND b.m IS NOT NULL
"""

# An event whose run is gone (none should be: the ORM deletes a run's events with it)
# takes its own time as its key.
FORWARD_COPY = """
INSERT INTO run_events_new (id, run_id, at, scheduled_for, type, detail)
SELECT e.id, e.run_id, e.at, COALESCE(r.scheduled_for, e.at), e.type, e.detail
  FROM run_events e LEFT JOIN runs r ON r.id = e.run_id
"""


def _field(model, *, null: bool) -> models.DateTimeField:
    field = models.DateTimeField(null=null)
    field.set_attributes_from_name("scheduled_for")
    field.model = model
    return field


def forward(apps, schema_editor) -> None:
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        # SQLite: the column added empty, filled from the runs, then made NOT NULL.
        model = apps.get_model("runs", "RunEvent")
        schema_editor.add_field(model, _field(model, null=True))
        schema_editor.execute(
            """UPDATE run_events SET scheduled_for = COALESCE(
                   (SELECT r.scheduled_for FROM runs r WHERE r.id = run_events.run_id), at)"""
        )
        schema_editor.alter_field(model, _field(model, null=True), _field(model, null=False))
        return
    with connection.cursor() as cursor:
        cursor.execute("LOCK TABLE run_events IN ACCESS EXCLUSIVE MODE")
        cursor.execute("CREATE SEQUENCE run_events_new_id_seq AS bigint")
        cursor.execute(
            """CREATE TABLE run_events_new (
                   id bigint NOT NULL DEFAULT nextval('run_events_new_id_seq'),
                   run_id bigint NOT NULL,
                   at timestamptz NOT NULL,
                   scheduled_for timestamptz NOT NULL,
                   type varchar(40) NOT NULL,
                   detail jsonb NOT NULL
               ) PARTITION BY RANGE (scheduled_for)"""
        )
        cursor.execute("ALTER SEQUENCE run_events_new_id_seq OWNED BY run_events_new.id")
        cursor.execute("CREATE TABLE run_events_default PARTITION OF run_events_new DEFAULT")
        cursor.execute(RUN_PARTITIONS)
        for name, start, end in cursor.fetchall():
            cursor.execute(
                f"CREATE TABLE run_events{name[len('runs'):]} PARTITION OF run_events_new "
                "FOR VALUES FROM (%s) TO (%s)", [start, end]
            )
        cursor.execute(FORWARD_COPY)
        cursor.execute("SELECT setval('run_events_new_id_seq', "
                       "COALESCE((SELECT max(id) FROM run_events_new), 0) + 1, false)")
        cursor.execute("DROP TABLE run_events")
        cursor.execute("ALTER TABLE run_events_new RENAME TO run_events")
        cursor.execute("ALTER SEQUENCE run_events_new_id_seq RENAME TO run_events_id_seq")
        cursor.execute("ALTER TABLE run_events ADD CONSTRAINT run_events_pkey PRIMARY KEY (id, scheduled_for)")
        cursor.execute("CREATE INDEX run_events_run_idx ON run_events (run_id, at)")
        _name_indexes(cursor)
        cursor.execute("ANALYZE run_events")


def _name_indexes(cursor) -> None:
    """Each partition's index takes its table's index's name and the partition's
    (run_events_run_idx_p20261206_0000), as runs.partitions names them."""
    cursor.execute(
        """SELECT ci.relname, pi.relname || substr(ct.relname, length('run_events') + 1)
             FROM pg_inherits inh
             JOIN pg_class ci ON ci.oid = inh.inhrelid
             JOIN pg_class pi ON pi.oid = inh.inhparent
             JOIN pg_index x ON x.indexrelid = ci.oid
             JOIN pg_class ct ON ct.oid = x.indrelid
             JOIN pg_index px ON px.indexrelid = pi.oid
            WHERE px.indrelid = 'run_events'::regclass"""
    )
    for name, wanted in cursor.fetchall():
        if name != wanted:
            cursor.execute(f'ALTER INDEX "{name}" RENAME TO "{wanted}"')


def backward(apps, schema_editor) -> None:
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        model = apps.get_model("runs", "RunEvent")
        schema_editor.remove_field(model, _field(model, null=False))
        return
    with connection.cursor() as cursor:
        cursor.execute("LOCK TABLE run_events IN ACCESS EXCLUSIVE MODE")
        cursor.execute("ALTER TABLE run_events RENAME TO run_events_partitioned")
        cursor.execute("ALTER TABLE run_events_partitioned RENAME CONSTRAINT run_events_pkey "
                       "TO run_events_partitioned_pkey")
        cursor.execute("ALTER INDEX run_events_run_idx RENAME TO run_events_partitioned_run_idx")
        cursor.execute(
            """CREATE TABLE run_events (
                   id bigint NOT NULL GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
                   at timestamptz NOT NULL,
                   type varchar(40) NOT NULL,
                   detail jsonb NOT NULL,
                   run_id bigint NOT NULL
               )"""
        )
        cursor.execute("""INSERT INTO run_events (id, at, type, detail, run_id)
                          SELECT id, at, type, detail, run_id FROM run_events_partitioned""")
        cursor.execute("DROP TABLE run_events_partitioned")
        cursor.execute("SELECT setval(pg_get_serial_sequence('run_events', 'id'), "
                       "COALESCE((SELECT max(id) FROM run_events), 0) + 1, false)")
        cursor.execute("CREATE INDEX run_events_run_idx ON run_events (run_id, at)")


class Migration(migrations.Migration):

    dependencies = [("runs", "0018_wake_with_due_time")]

    operations = [
        # The model gains the field; the store is changed by hand (forward, backward).
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(model_name="runevent", name="scheduled_for", field=models.DateTimeField()),
            ],
            database_operations=[migrations.RunPython(forward, backward, elidable=False)],
        ),
    ]
