"""Fewer writes per run: drop two indexes another index already covers, and the
timeline's per-row foreign-key trigger.

Written by hand: the autodetected AlterField(db_index=False) on runs.job drops every
single-column index on job_id, the partial unique runs_one_open_run_per_job with
it. Here the state changes as the models say, and the database loses exactly:
- runs_job_id_1c443ccb (runs.job_id; runs_one_run_per_time leads with job_id),
- run_events_run_id_f873bc13 (run_events.run_id; run_events_run_idx leads with it),
- on PostgreSQL, the run_events -> runs foreign-key constraint (deletes go through
  the ORM, which removes a run's events with it). SQLite keeps it: it is part of the
  table's definition there, and the embedded layout does not need the speed.
"""
import django.db.models.deletion
from django.db import migrations, models


def drop(apps, schema_editor):
    execute = schema_editor.execute
    execute("DROP INDEX IF EXISTS runs_job_id_1c443ccb")
    execute("DROP INDEX IF EXISTS run_events_run_id_f873bc13")
    if schema_editor.connection.vendor == "postgresql":
        execute("ALTER TABLE run_events DROP CONSTRAINT IF EXISTS run_events_run_id_f873bc13_fk_runs_id")


def restore(apps, schema_editor):
    execute = schema_editor.execute
    execute("CREATE INDEX IF NOT EXISTS runs_job_id_1c443ccb ON runs (job_id)")
    execute("CREATE INDEX IF NOT EXISTS run_events_run_id_f873bc13 ON run_events (run_id)")
    if schema_editor.connection.vendor == "postgresql":
        execute(
            "ALTER TABLE run_events ADD CONSTRAINT run_events_run_id_f873bc13_fk_runs_id FOREIGN KEY (run_id) "
            "REFERENCES runs (id) DEFERRABLE INITIALLY DEFERRED"
        )


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0002_signingsecret_auditentry"),
        ("runs", "0003_bulkhead_and_breakers"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="run",
                    name="job",
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name="runs", to="jobs.job"
                    ),
                ),
                migrations.AlterField(
                    model_name="runevent",
                    name="run",
                    field=models.ForeignKey(
                        db_constraint=False, db_index=False, on_delete=django.db.models.deletion.CASCADE,
                        related_name="events", to="runs.run",
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(drop, restore)],
        ),
    ]
