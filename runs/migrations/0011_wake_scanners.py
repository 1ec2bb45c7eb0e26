"""Triggers on runs, notices and jobs that wake the scanners (PostgreSQL only;
scanners/wakeups.py listens).

A run that becomes scheduled and not held, due within the notify horizon (the
statement's clock plus 60 s, scanners.wakeups.NOTIFY_HORIZON), sends
`NOTIFY scheduler_due, '<its partition>'`: a new job's first run, the next run
after an outcome, a retry, run-now, a requeue or replay, a resume, a defer by the
bulkhead or the breaker, an edit that brings it sooner. A pending notice due
within the horizon sends '0' (the scanner of partition 0 publishes the sender).
A paused job given a resume time within the horizon sends '*', every scanner:
the trigger does not know SCHEDULER_PARTITIONS, and a bulk pause folds into one.

An insert (a statement of new runs: the API's one, the worker's COPY of next
runs, a bulk load) is one trigger call per statement over its rows (a transition
table), one notification per partition among them. An update is a row trigger
whose WHEN decides without calling the function, so a row that wakes nobody (a
claim, a heartbeat, an outcome, a run due next week) costs only the test; the
functions call pg_notify as a plain expression, not a query (no executor per
row). PostgreSQL folds equal notifications of one transaction into one: a bulk
write sends one per partition. bench/wake_cost.py measures what they cost.
"""
from django.db import migrations

HORIZON = "interval '60 seconds'"  # scanners.wakeups.NOTIFY_HORIZON
RUN_WAKES = f"NEW.status = 'scheduled' AND NOT NEW.held AND NEW.due_at < statement_timestamp() + {HORIZON}"
NOTICE_WAKES = f"NEW.status = 'pending' AND NEW.due_at < statement_timestamp() + {HORIZON}"
RESUME_WAKES = (
    f"NEW.paused AND NEW.paused_until IS NOT NULL AND NEW.paused_until < statement_timestamp() + {HORIZON}"
)

FORWARD = f"""
CREATE FUNCTION scheduler_wake_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('scheduler_due', p::text)
       FROM (SELECT DISTINCT i.partition AS p FROM inserted AS i
              WHERE {RUN_WAKES.replace("NEW.", "i.")}) AS woken;
    RETURN NULL;
END $$;

CREATE FUNCTION scheduler_wake_partition() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    sent boolean;
BEGIN
    sent := pg_notify('scheduler_due', NEW.partition::text) IS NULL;  -- an expression: cheaper than PERFORM
    RETURN NULL;
END $$;

CREATE FUNCTION scheduler_wake_named() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    sent boolean;
BEGIN
    sent := pg_notify('scheduler_due', TG_ARGV[0]) IS NULL;  -- the trigger's argument: '0' or '*'
    RETURN NULL;
END $$;

CREATE TRIGGER runs_wake_scanner_insert AFTER INSERT ON runs
    REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT
    EXECUTE FUNCTION scheduler_wake_inserted();

CREATE TRIGGER runs_wake_scanner_update AFTER UPDATE OF status, held, due_at ON runs FOR EACH ROW
    WHEN ({RUN_WAKES} AND (OLD.status <> 'scheduled' OR OLD.held OR NEW.due_at < OLD.due_at))
    EXECUTE FUNCTION scheduler_wake_partition();

CREATE TRIGGER notices_wake_scanner_insert AFTER INSERT ON notices FOR EACH ROW
    WHEN ({NOTICE_WAKES})
    EXECUTE FUNCTION scheduler_wake_named('0');

CREATE TRIGGER notices_wake_scanner_update AFTER UPDATE OF status, due_at ON notices FOR EACH ROW
    WHEN ({NOTICE_WAKES} AND (OLD.status <> 'pending' OR NEW.due_at < OLD.due_at))
    EXECUTE FUNCTION scheduler_wake_named('0');

CREATE TRIGGER jobs_wake_scanner_insert AFTER INSERT ON jobs FOR EACH ROW
    WHEN ({RESUME_WAKES})
    EXECUTE FUNCTION scheduler_wake_named('*');

CREATE TRIGGER jobs_wake_scanner_update AFTER UPDATE OF paused, paused_until ON jobs FOR EACH ROW
    WHEN ({RESUME_WAKES} AND (NOT OLD.paused OR OLD.paused_until IS NULL OR NEW.paused_until < OLD.paused_until))
    EXECUTE FUNCTION scheduler_wake_named('*');

"""
BACKWARD = """
DROP TRIGGER IF EXISTS runs_wake_scanner_insert ON runs;

DROP TRIGGER IF EXISTS runs_wake_scanner_update ON runs;

DROP TRIGGER IF EXISTS notices_wake_scanner_insert ON notices;

DROP TRIGGER IF EXISTS notices_wake_scanner_update ON notices;

DROP FUNCTION IF EXISTS scheduler_wake_inserted();

DROP FUNCTION IF EXISTS scheduler_wake_partition();

DROP TRIGGER IF EXISTS jobs_wake_scanner_insert ON jobs;

DROP TRIGGER IF EXISTS jobs_wake_scanner_update ON jobs;

DROP FUNCTION IF EXISTS scheduler_wake_named();

"""


def on_postgresql(sql: str):
    # The embedded SQLite file has no NOTIFY: its scanner wakes by its interval.
    def run(apps, schema_editor) -> None:
        if schema_editor.connection.vendor != "postgresql":
            return
        for statement in sql.split("\n\n"):  # one at a time (the functions' bodies hold ";" too)
            if statement.strip():
                schema_editor.execute(statement, params=None)

    return run


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0010_overlap_allow'),
    ]

    operations = [migrations.RunPython(on_postgresql(FORWARD), on_postgresql(BACKWARD))]
