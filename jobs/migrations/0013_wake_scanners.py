"""A trigger that wakes the scanners when a paused job gets a resume time within
the notify horizon (PostgreSQL only; runs 0011 has the runs' and notices' and says
why). The payload is '*', every scanner: the trigger does not know
SCHEDULER_PARTITIONS, and a bulk pause folds into one notification."""
from django.db import migrations

HORIZON = "interval '60 seconds'"  # scanners.wakeups.NOTIFY_HORIZON
RESUME_WAKES = (
    f"NEW.paused AND NEW.paused_until IS NOT NULL AND NEW.paused_until < statement_timestamp() + {HORIZON}"
)

FORWARD = f"""
CREATE FUNCTION scheduler_wake_all() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('scheduler_due', '*');
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_wake_scanner_insert AFTER INSERT ON jobs FOR EACH ROW
    WHEN ({RESUME_WAKES})
    EXECUTE FUNCTION scheduler_wake_all();

CREATE TRIGGER jobs_wake_scanner_update AFTER UPDATE OF paused, paused_until ON jobs FOR EACH ROW
    WHEN ({RESUME_WAKES} AND (NOT OLD.paused OR OLD.paused_until IS NULL OR NEW.paused_until < OLD.paused_until))
    EXECUTE FUNCTION scheduler_wake_all();

"""
BACKWARD = """
DROP TRIGGER IF EXISTS jobs_wake_scanner_insert ON jobs;

DROP TRIGGER IF EXISTS jobs_wake_scanner_update ON jobs;

DROP FUNCTION IF EXISTS scheduler_wake_all();

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
        ('jobs', '0012_overlap_allow'),
    ]

    operations = [migrations.RunPython(on_postgresql(FORWARD), on_postgresql(BACKWARD))]
