"""The scanners' wake-up names the due time too: `NOTIFY scheduler_due, '<partition>
<due_at in microseconds since the epoch>'` (PostgreSQL only; migration runs 0011 has
the triggers, which are unchanged: only their two functions for runs are replaced).

Since migration runs 0017 a scanner reads each partition's waiting runs from after the
last run it took there (its floor, scanners.scan.scan_once), and a run that turns
waiting behind the floor (run now, a retry, a deferral, a resume, an edit that brings it
sooner: what the triggers notify) would not be seen until the floor is dropped. With the
due time in the notification the scanner lowers the floor to it
(scanners.wakeups.Listener.take_lowered). A statement of inserts sends one per
partition, with the earliest due time among its rows; an update sends one per row
(PostgreSQL folds only equal notifications of a transaction into one).
"""
from django.db import migrations

RUN_WAKES = "i.status = 'scheduled' AND NOT i.held AND i.due_at < statement_timestamp() + interval '60 seconds'"
MICROS = "(extract(epoch FROM {0}) * 1000000)::bigint::text"

WITH_DUE = f"""
CREATE OR REPLACE FUNCTION scheduler_wake_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('scheduler_due', woken.p::text || ' ' || {MICROS.format("woken.d")})
       FROM (SELECT i.partition AS p, min(i.due_at) AS d FROM inserted AS i
              WHERE {RUN_WAKES} GROUP BY i.partition) AS woken;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION scheduler_wake_partition() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    sent boolean;
BEGIN
    sent := pg_notify('scheduler_due', NEW.partition::text || ' ' || {MICROS.format("NEW.due_at")}) IS NULL;
    RETURN NULL;
END $$;
"""

WITHOUT_DUE = f"""
CREATE OR REPLACE FUNCTION scheduler_wake_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('scheduler_due', p::text)
       FROM (SELECT DISTINCT i.partition AS p FROM inserted AS i
              WHERE {RUN_WAKES}) AS woken;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION scheduler_wake_partition() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    sent boolean;
BEGIN
    sent := pg_notify('scheduler_due', NEW.partition::text) IS NULL;  -- an expression: cheaper than PERFORM
    RETURN NULL;
END $$;
"""

FORWARD, BACKWARD = WITH_DUE, WITHOUT_DUE


def on_postgresql(sql: str):
    def run(apps, schema_editor) -> None:
        if schema_editor.connection.vendor != "postgresql":
            return
        for statement in sql.split("\n\n"):
            if statement.strip():
                schema_editor.execute(statement, params=None)
    return run


class Migration(migrations.Migration):
    dependencies = [("runs", "0017_open_runs_hot_queueing")]

    operations = [migrations.RunPython(on_postgresql(FORWARD), on_postgresql(BACKWARD))]
