"""The happy path's timeline on the run row (runs.timeline), a narrower
runs_status_idx, and room on each page for a run's updates.

Existing runs keep their event rows and get `on_row = 0`: nothing of theirs is on
the row, so the reader never shows an entry twice. New columns are nullable or
have a constant default: adding them rewrites nothing (PostgreSQL 11+).

`runs_status_idx (status, -id)` leaves out succeeded runs: its readers are the
open-run counts (dashboard, /metrics) and the API's `?status=` lists of the rare
statuses (the dead list); `?status=succeeded`, newest first, reads runs_pkey
backwards, where nearly every row is one. So a run's last version adds no entry.

`fillfactor = 80` keeps a fifth of each heap page free, so a run's updates (queued,
running, done) land on its own page more often: no lock record for the move, and
PostgreSQL logs only the changed part of the tuple (docs/performance.md, "What a run does").
It applies to pages written from now on.
"""
from django.db import migrations, models
import django.utils.timezone


def _fillfactor(value: int):
    def apply(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"ALTER TABLE runs SET (fillfactor = {value})")

    return apply


class Migration(migrations.Migration):
    dependencies = [("runs", "0011_wake_scanners")]

    operations = [
        migrations.AlterField(
            model_name="run", name="created_at", field=models.DateTimeField(default=django.utils.timezone.now)
        ),
        migrations.AddField(model_name="run", name="on_row", field=models.PositiveSmallIntegerField(default=0)),
        migrations.AddField(
            model_name="run", name="on_row_due_at", field=models.DateTimeField(blank=True, null=True)
        ),
        migrations.AddField(
            model_name="run", name="on_row_queued_at", field=models.DateTimeField(blank=True, null=True)
        ),
        migrations.AddField(
            model_name="run", name="on_row_claimed_at", field=models.DateTimeField(blank=True, null=True)
        ),
        migrations.AddField(
            model_name="run", name="on_row_worker", field=models.CharField(blank=True, max_length=200)
        ),
        migrations.AddField(
            model_name="run", name="on_row_answer", field=models.PositiveSmallIntegerField(blank=True, null=True)
        ),
        migrations.AddField(
            model_name="run", name="on_row_duration_ms", field=models.PositiveIntegerField(blank=True, null=True)
        ),
        migrations.AddField(
            model_name="run", name="on_row_made_by", field=models.BigIntegerField(blank=True, null=True)
        ),
        migrations.RemoveIndex(model_name="run", name="runs_status_idx"),
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                condition=models.Q(("status", "succeeded"), _negated=True),
                fields=["status", "-id"],
                name="runs_status_idx",
            ),
        ),
        migrations.RunPython(_fillfactor(80), _fillfactor(100), elidable=False),
    ]
