"""`python manage.py backfill JOB_ID --since T --until T [--before-created] [--dry-run]`."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from jobs.audit import audit_record
from jobs.management.commands._common import get_job, parse_utc
from jobs.services import BackfillError, backfill_plan, job_backfill
from runs.delivery import iso_z

CHUNK = 500  # runs created per transaction, so a large range shows progress and holds no long lock


class Command(BaseCommand):
    help = (
        "Create the runs a job would have had in [since, until) (ISO 8601 UTC), up to now. "
        "Times that already have a run are left alone, so running it twice creates nothing new."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("job_id", metavar="JOB_ID", help="the job, as job_12 or 12")
        parser.add_argument(
            "--since", required=True, metavar="T",
            help="first time to fill, ISO 8601 UTC like 2026-10-01T00:00:00Z; not before the job was created "
                 "unless --before-created is given",
        )
        parser.add_argument(
            "--until", required=True, metavar="T", help="end of the range (not included), ISO 8601 UTC; capped at now"
        )
        parser.add_argument(
            "--before-created", action="store_true",
            help="also fill times before the job was created (a migration's gap, a past DST night)",
        )
        parser.add_argument("--dry-run", action="store_true", help="say what would be created, create nothing")

    def handle(self, *args: Any, job_id: str, since: str, until: str, dry_run: bool, before_created: bool = False,
               **options: Any) -> None:
        job = get_job(job_id)
        start, end = parse_utc("--since", since), parse_utc("--until", until)
        try:
            plan = backfill_plan(job=job, since=start, until=end, now=timezone.now(), before_created=before_created)
        except BackfillError as exc:
            raise CommandError(str(exc)) from exc
        verb = "would create" if dry_run else "created"
        span = f" from {iso_z(plan.times[0])} to {iso_z(plan.times[-1])}" if plan.times else ""
        if dry_run or not plan.times:
            self.stdout.write(f"{job.public_id}: {verb} {_runs(len(plan.times))}{span}; {_existing(plan.existing)}")
            return
        made = 0
        for i in range(0, len(plan.times), CHUNK):
            made += len(job_backfill(job=job, times=plan.times[i : i + CHUNK]))
            if len(plan.times) > CHUNK:  # a progress bar only when there is something to wait for
                self._progress(i + min(CHUNK, len(plan.times) - i), len(plan.times))
        if made:
            audit_record(
                actor=None,
                via="command",
                action="backfilled",
                obj=job,
                detail={"runs": made, "since": iso_z(start), "until": iso_z(end),
                        **({"before_created": True} if before_created else {})},
            )
        self.stdout.write(f"{job.public_id}: {verb} {_runs(made)}{span}; {_existing(plan.existing)}")

    def _progress(self, done: int, total: int, width: int = 30) -> None:
        """A bar on stderr (stdout stays the one-line result scripts read); redrawn in
        place on a terminal, one line per chunk otherwise (logs)."""
        filled = width * done // total
        bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} runs"
        if self.stderr.isatty():
            self.stderr.write(f"\r{bar}", ending="\n" if done == total else "")
            self.stderr.flush()
        else:
            self.stderr.write(bar)


def _runs(count: int) -> str:
    return f"{count} run{'' if count == 1 else 's'}"


def _existing(count: int) -> str:
    return f"{count} time{' already had a run' if count == 1 else 's already had a run'}"
