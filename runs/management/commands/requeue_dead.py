"""`python manage.py requeue_dead [--job ID] [--target HOST] [--since T] [--until T] [--dry-run]`."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.management.commands._common import get_job, parse_utc
from runs.delivery import iso_z
from runs.ops import OpsError, check_host, dead_runs, requeue_dead


class Command(BaseCommand):
    help = (
        "Give dead runs a new round of tries, same Idempotency-Key. --since/--until (ISO 8601 UTC) bound when "
        "they died. Runs of paused or deleted jobs are left dead. Running it twice requeues nothing new."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--job", metavar="JOB_ID", help="only this job's dead runs (job_12 or 12)")
        parser.add_argument(
            "--target", metavar="HOST", help="only runs whose target is on HOST (as in the URL, port included)"
        )
        parser.add_argument("--since", metavar="T", help="died at or after this time (ISO 8601 UTC)")
        parser.add_argument("--until", metavar="T", help="died before this time (ISO 8601 UTC)")
        parser.add_argument("--dry-run", action="store_true", help="list what would be requeued, change nothing")

    def handle(
        self,
        *args: Any,
        job: str | None,
        target: str | None,
        since: str | None,
        until: str | None,
        dry_run: bool,
        **options: Any,
    ) -> None:
        start = parse_utc("--since", since) if since else None
        end = parse_utc("--until", until) if until else None
        if start and end and end <= start:
            raise CommandError("--until must be after --since")
        try:
            host = check_host(target) if target is not None else None
        except OpsError as exc:
            raise CommandError(f"--target: {exc}") from exc
        job_id = get_job(job).pk if job is not None else None
        runs = dead_runs(job_id=job_id, host=host, since=start, until=end)
        result = requeue_dead(runs=runs, dry_run=dry_run)
        verb = "would requeue" if dry_run else "requeued"
        for run in result.requeued:
            self.stdout.write(
                f"{verb} {run.public_id} ({run.idempotency_key}, {run.attempt} attempt(s), "
                f"dead since {iso_z(run.finished_at) if run.finished_at else '?'})"
            )
        for run, reason in result.refused:
            self.stdout.write(f"left {run.public_id} dead: {reason}")
        self.stdout.write(f"{verb} {len(result.requeued)} dead run(s); {len(result.refused)} left dead")
