"""A deleted job keeps no resume time (jobs_deleted_no_resume).

Before this, deleting a job paused with `paused_until` kept the time: the scanner's
resume read (oldest first, a batch at a time) met the deleted job on every scan, and
a batch's worth of them kept a live job's later resume time from being read at all.
The rows deleted that way lose the time first; then the store refuses it.
"""
from django.db import migrations, models


def clear_deleted_resume_times(apps, schema_editor) -> None:
    Job = apps.get_model("jobs", "Job")
    Job.objects.filter(state="deleted", paused_until__isnull=False).update(paused_until=None)


class Migration(migrations.Migration):
    dependencies = [("jobs", "0012_overlap_allow")]

    operations = [
        migrations.RunPython(clear_deleted_resume_times, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name="job",
            constraint=models.CheckConstraint(
                condition=~(models.Q(state="deleted") & models.Q(paused_until__isnull=False)),
                name="jobs_deleted_no_resume",
            ),
        ),
    ]
