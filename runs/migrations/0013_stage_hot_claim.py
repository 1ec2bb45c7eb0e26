"""A claim that writes no index entry: `Run.stage` (generated: `waiting`, `flight`, or
the status once ended) stands for `status` in every index, the queued and lease
indexes go (their reads take the runs in flight from runs_due_idx), and each heap
page keeps half its room for a run's next versions (`fillfactor = 50`).

An update is HOT (a new version on the same page, no new index entry) only when no
index names a column it changes, by its keys or its predicate; every partial index
named `status`, so each of a run's three updates wrote an entry in five indexes.
Now the claim (queued to running: `flight` both) writes none; the queueing and the
end still do. bench/partition_wal.py measured the shape (docs/performance.md, "What a
run does"); `bench/run.py store` measures it through the system.

Adding a stored generated column rewrites `runs` under an ACCESS EXCLUSIVE lock (the
same as any `ALTER TABLE ... ADD COLUMN ... STORED`): on PostgreSQL, minutes for tens
of millions of rows, with the scanners and workers waiting. The fillfactor applies to
pages written from then on, the rewrite's included.
"""
from django.db import migrations, models


def _fillfactor(value: int):
    def apply(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"ALTER TABLE runs SET (fillfactor = {value})")

    return apply


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0012_overlap_allow'),
        ('runs', '0012_timeline_on_row'),
    ]

    operations = [
        # Before the column, so that its rewrite of the table writes pages to the new fill.
        migrations.RunPython(_fillfactor(50), _fillfactor(80), elidable=False),
        migrations.RemoveConstraint(
            model_name='run',
            name='runs_one_open_run_per_job',
        ),
        migrations.RemoveIndex(
            model_name='run',
            name='runs_due_idx',
        ),
        migrations.RemoveIndex(
            model_name='run',
            name='runs_queued_idx',
        ),
        migrations.RemoveIndex(
            model_name='run',
            name='runs_lease_idx',
        ),
        migrations.RemoveIndex(
            model_name='run',
            name='runs_dead_unhandled_idx',
        ),
        migrations.RemoveIndex(
            model_name='run',
            name='runs_status_idx',
        ),
        migrations.AddField(
            model_name='run',
            name='stage',
            field=models.GeneratedField(db_persist=True, expression=models.Case(models.When(status='scheduled', then=models.Value('waiting')), models.When(status__in=['queued', 'running'], then=models.Value('flight')), default=models.F('status')), output_field=models.CharField(max_length=16)),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('stage__in', ['waiting', 'flight'])), fields=['partition', 'stage', 'held', 'due_at'], name='runs_due_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('stage', 'succeeded'), _negated=True), fields=['stage', '-id'], name='runs_status_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('handled_at__isnull', True), ('stage', 'dead')), fields=['id'], name='runs_dead_unhandled_idx'),
        ),
        migrations.AddConstraint(
            model_name='run',
            constraint=models.UniqueConstraint(condition=models.Q(('detached', False), ('is_backfill', False), ('stage__in', ['waiting', 'flight'])), fields=('job',), name='runs_one_open_run_per_job'),
        ),
    ]
