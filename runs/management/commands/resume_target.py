"""`python manage.py resume_target HOST [--dry-run]`."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runs.ops import OpsError, target_resume


class Command(BaseCommand):
    help = (
        "Release the runs pause_target HOST held. Runs of paused jobs stay held: the job's own pause holds them. "
        "A late run is then handled by its job's misfire policy."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("host", metavar="HOST", help="as given to pause_target, like reports.internal:8443")
        parser.add_argument("--dry-run", action="store_true", help="say what would be released, change nothing")

    def handle(self, *args: Any, host: str, dry_run: bool, **options: Any) -> None:
        try:
            result = target_resume(host=host, dry_run=dry_run)
        except OpsError as exc:
            raise CommandError(str(exc)) from exc
        if dry_run:
            state = "would resume" if result.changed_target else "is not paused; would release"
            self.stdout.write(f"{result.host} {state}: {result.runs} held run(s) of {result.jobs} job(s)")
            return
        state = "resumed" if result.changed_target else "was not paused"
        self.stdout.write(f"{result.host} {state}: released {result.runs} held run(s) of {result.jobs} job(s)")
