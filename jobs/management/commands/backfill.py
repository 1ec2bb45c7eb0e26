"""`python manage.py backfill JOB_ID --since T --until T [--dry-run]`."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from jobs.management.commands._common import get_job, parse_utc
from jobs.services import BackfillError, backfill_plan, job_backfill

CHUNK = 500  # runs created per transaction, so a large range shows progress and holds no long lock


class Command(BaseCommand):
    help = (
        "Create the runs a job would have had in [since, until) (ISO 8601 UTC), up to now. "
        "Times that already have a run are left alone, so running it twice creates nothing new."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("job_id")
        parser.add_argument("--since", required=True)
        parser.add_argument("--until", required=True)
        parser.add_argument("--dry-run", action="store_true", help="say what would be created, create nothing")

    def handle(self, *args: Any, job_id: str, since: str, until: str, dry_run: bool, **options: Any) -> None:
        job = get_job(job_id)
        start, end = parse_utc("--since", since), parse_utc("--until", until)
        try:
            plan = backfill_plan(job=job, since=start, until=end, now=timezone.now())
        except BackfillError as exc:
            raise CommandError(str(exc)) from exc
        verb = "would create" if dry_run else "created"
        if dry_run or not plan.times:
            self.stdout.write(f"{job.public_id}: {verb} {len(plan.times)} runs; {plan.existing} times already had a run")
            return
        made = 0
        for i in range(0, len(plan.times), CHUNK):
            made += len(job_backfill(job=job, times=plan.times[i : i + CHUNK]))
            if len(plan.times) > CHUNK:
                self.stderr.write(f"  {made}/{len(plan.times)} runs")
        self.stdout.write(f"{job.public_id}: {verb} {made} runs; {plan.existing} times already had a run")
