"""The BEFORE UPDATE trigger that kept Run.kept_for right (migration 0014) is gone
(issue 18; docs/performance.md, "What a run does").

On PostgreSQL a table with a BEFORE UPDATE row trigger has every row an UPDATE touches
locked before the trigger is even asked whether it fires (its WHEN and its column list
come after): one Heap/LOCK WAL record a row, 54 bytes. The claim, the outcome and every
heartbeat paid it, about 108 bytes a run of the 2,429 measured in step 5.

Who sets the key now: the model on insert and save (runs.models.KeptForField), every
ORM update that names the status or the scheduled time (runs.models.RunQuerySet), and
the hand-written outcome statement (runs.claims.OUTCOMES_SQL). The check constraint
`runs_kept_for_rule` of migration 0014 stays: a writer that moves a run between open and
ended without its key is refused (SQLSTATE 23514), not let through. SQLite keeps its AFTER
triggers, which cost nothing of the kind.
"""
from importlib import import_module

from django.db import migrations

OPEN_STATUSES = "('scheduled', 'queued', 'running')"
OPEN_KEY = "'9999-12-31 00:00:00+00'::timestamptz"

FORWARD = [
    "DROP TRIGGER runs_kept_for ON runs",
    "DROP FUNCTION runs_kept_for()",
]
# Migration 0014's function and trigger, as they were.
BACKWARD = [
    f"""CREATE FUNCTION runs_kept_for() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.kept_for := CASE WHEN NEW.status IN {OPEN_STATUSES} THEN {OPEN_KEY} ELSE NEW.scheduled_for END;
    RETURN NEW;
END
$$""",
    f"""CREATE TRIGGER runs_kept_for BEFORE UPDATE OF status, scheduled_for, kept_for ON runs FOR EACH ROW
    WHEN ((NEW.status IN {OPEN_STATUSES}) IS DISTINCT FROM (OLD.status IN {OPEN_STATUSES})
          OR NEW.scheduled_for IS DISTINCT FROM OLD.scheduled_for
          OR NEW.kept_for IS DISTINCT FROM OLD.kept_for)
    EXECUTE FUNCTION runs_kept_for()""",
]


# Migration 0015's runner: these statements on PostgreSQL, nothing on SQLite.
on_postgresql = import_module("runs.migrations.0015_partitioned_runs").on_postgresql


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0015_partitioned_runs'),
    ]

    operations = [
        migrations.RunPython(on_postgresql(FORWARD), on_postgresql(BACKWARD), elidable=False),
    ]
