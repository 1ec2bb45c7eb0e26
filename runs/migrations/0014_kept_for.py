"""Run.kept_for: the key the history of ended runs is to be partitioned by (issue 18,
docs/performance.md, "The store at scale: the due read, retention, growth"):
'9999-12-31' while a run is open, its scheduled_for once it has ended.

The model computes it on every insert and save; an UPDATE that changes `status` or
`scheduled_for` and leaves `kept_for` to the store (`Run.objects.filter().update()`,
the raw hot-path statements) is kept right by a trigger, on PostgreSQL a BEFORE
UPDATE one that fires only when the run moves between open and ended (or its time or
key is written), on SQLite an AFTER one. On PostgreSQL a check constraint refuses any
row that breaks the rule, so a writer that gets it wrong fails loudly.

Cost: adding the column with a default writes nothing (PostgreSQL 11+ keeps the
default for the rows already there); setting it on the ended runs rewrites each
ended row once, under the migration's lock on them (a full-table UPDATE, in one
transaction; its time on a big table is not measured yet).
"""
from django.db import migrations

import runs.models

OPEN_STATUSES = "('scheduled', 'queued', 'running')"
OPEN_KEY = "'9999-12-31 00:00:00+00'::timestamptz"

PG_FORWARD = f"""
UPDATE runs SET kept_for = scheduled_for WHERE status NOT IN {OPEN_STATUSES};
CREATE FUNCTION runs_kept_for() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.kept_for := CASE WHEN NEW.status IN {OPEN_STATUSES} THEN {OPEN_KEY} ELSE NEW.scheduled_for END;
    RETURN NEW;
END
$$;
CREATE TRIGGER runs_kept_for BEFORE UPDATE OF status, scheduled_for, kept_for ON runs FOR EACH ROW
    WHEN ((NEW.status IN {OPEN_STATUSES}) IS DISTINCT FROM (OLD.status IN {OPEN_STATUSES})
          OR NEW.scheduled_for IS DISTINCT FROM OLD.scheduled_for
          OR NEW.kept_for IS DISTINCT FROM OLD.kept_for)
    EXECUTE FUNCTION runs_kept_for();
ALTER TABLE runs ADD CONSTRAINT runs_kept_for_rule CHECK (
    kept_for = CASE WHEN status IN {OPEN_STATUSES} THEN {OPEN_KEY} ELSE scheduled_for END);
"""
PG_BACKWARD = """
ALTER TABLE runs DROP CONSTRAINT runs_kept_for_rule;
DROP TRIGGER runs_kept_for ON runs;
DROP FUNCTION runs_kept_for();
"""

SQLITE_RULE = f"CASE WHEN NEW.status IN {OPEN_STATUSES} THEN '9999-12-31 00:00:00' ELSE NEW.scheduled_for END"
SQLITE_FORWARD = [
    f"UPDATE runs SET kept_for = scheduled_for WHERE status NOT IN {OPEN_STATUSES}",
    f"""CREATE TRIGGER runs_kept_for_insert AFTER INSERT ON runs FOR EACH ROW
        WHEN NEW.kept_for IS NOT {SQLITE_RULE}
        BEGIN UPDATE runs SET kept_for = {SQLITE_RULE} WHERE id = NEW.id; END""",
    f"""CREATE TRIGGER runs_kept_for_update AFTER UPDATE OF status, scheduled_for, kept_for ON runs FOR EACH ROW
        WHEN NEW.kept_for IS NOT {SQLITE_RULE}
        BEGIN UPDATE runs SET kept_for = {SQLITE_RULE} WHERE id = NEW.id; END""",
]
SQLITE_BACKWARD = ["DROP TRIGGER runs_kept_for_insert", "DROP TRIGGER runs_kept_for_update"]


def forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PG_FORWARD)
    elif schema_editor.connection.vendor == "sqlite":
        for sql in SQLITE_FORWARD:
            schema_editor.execute(sql)


def backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PG_BACKWARD)
    elif schema_editor.connection.vendor == "sqlite":
        for sql in SQLITE_BACKWARD:
            schema_editor.execute(sql)


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0013_stage_hot_claim'),
    ]

    operations = [
        migrations.AddField(
            model_name='run',
            name='kept_for',
            field=runs.models.KeptForField(default=runs.models.OPEN_KEPT_FOR),
        ),
        migrations.RunPython(forward, backward, elidable=False),
    ]
