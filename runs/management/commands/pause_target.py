"""`python manage.py pause_target HOST [--dry-run]`."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.models import Job
from runs.ops import OpsError, check_host, jobs_on_host, target_pause


class Command(BaseCommand):
    help = (
        "Hold every waiting run whose target is on HOST (as written in the target URL, port included), and every "
        "run those jobs get until resume_target HOST. A call already in flight finishes."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("host", metavar="HOST", help="as written in the target URL, like reports.internal:8443")
        parser.add_argument("--dry-run", action="store_true", help="say what would be held, change nothing")
        parser.add_argument(
            "--force", action="store_true", help="pause HOST even though no job calls it yet (its future jobs are held)"
        )

    def handle(self, *args: Any, host: str, dry_run: bool, force: bool, **options: Any) -> None:
        try:
            if not force and not jobs_on_host(check_host(host)).exclude(state=Job.State.DELETED).exists():
                # Most likely a typo (or the port left out): pausing it would hold nothing and say "paused".
                raise CommandError(
                    f"no job calls {check_host(host)} (the host as written in target URLs, port included); "
                    "check the spelling, or pass --force to pause it before any job uses it"
                )
            result = target_pause(host=host, dry_run=dry_run)
        except OpsError as exc:
            raise CommandError(str(exc)) from exc
        if dry_run:
            state = "would pause" if result.changed_target else "is already paused; would hold"
            self.stdout.write(f"{result.host} {state}: {result.runs} waiting run(s) of {result.jobs} job(s)")
            return
        state = "paused" if result.changed_target else "was already paused"
        self.stdout.write(f"{result.host} {state}: held {result.runs} waiting run(s) of {result.jobs} job(s)")
