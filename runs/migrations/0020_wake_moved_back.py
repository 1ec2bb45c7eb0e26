"""A run moved back among the open runs wakes its scanner with its due time, from the
store itself (PostgreSQL only; migrations runs 0011 and 0018 have the other wakes).

Since migration 0015 a dead run requeued, a cancelled one reopened (a buffered
overlap time, a backfill or a new timing landing on it) moves from the history to
`runs_open`: PostgreSQL carries that UPDATE out as a DELETE and an INSERT, which fires
neither the parent's row UPDATE trigger nor its INSERT statement trigger. The writers
sent a notification of their own, without the due time, so a scanner whose floor was
above the run waited for its next periodic floor drop.

Now a row trigger on the history's side of the move sends it: `AFTER DELETE` on
`runs`, cloned by PostgreSQL onto every partition, the time partitions made later
included, whose WHEN lets through rows leaving the history only (an ended run
leaving `runs_open` for the history costs the test alone). At the end of the
statement the function reads the moved row in `runs_open` by its key and notifies
`'<partition> <due in µs>'` as the other wakes do, when it waits, is not held and is
due within the horizon. A history row deleted for good (a prune by rows, a new
partition taking its span from the default) finds no open row and sends nothing.
"""
from django.db import migrations

OPEN_KEY = "'9999-12-31 00:00:00+00'::timestamptz"  # runs.models.OPEN_KEPT_FOR_SQL
HORIZON = "interval '60 seconds'"  # scanners.wakeups.NOTIFY_HORIZON
MICROS = "(extract(epoch FROM r.due_at) * 1000000)::bigint::text"

FORWARD = f"""
CREATE FUNCTION scheduler_wake_moved_back() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('scheduler_due', r.partition::text || ' ' || {MICROS})
       FROM runs AS r
      WHERE r.id = OLD.id AND r.kept_for = {OPEN_KEY}
        AND r.status = 'scheduled' AND NOT r.held AND r.due_at < statement_timestamp() + {HORIZON};
    RETURN NULL;
END $$;

CREATE TRIGGER runs_wake_scanner_moved_back AFTER DELETE ON runs FOR EACH ROW
    WHEN (OLD.kept_for <> {OPEN_KEY})
    EXECUTE FUNCTION scheduler_wake_moved_back();
"""

BACKWARD = """
DROP TRIGGER IF EXISTS runs_wake_scanner_moved_back ON runs;

DROP FUNCTION IF EXISTS scheduler_wake_moved_back();
"""


def on_postgresql(sql: str):
    def run(apps, schema_editor) -> None:
        if schema_editor.connection.vendor != "postgresql":
            return
        for statement in sql.split("\n\n"):
            if statement.strip():
                schema_editor.execute(statement, params=None)
    return run


class Migration(migrations.Migration):
    dependencies = [("runs", "0019_run_events_by_time")]

    operations = [migrations.RunPython(on_postgresql(FORWARD), on_postgresql(BACKWARD))]
