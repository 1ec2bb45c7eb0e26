"""`python manage.py pause_target HOST [--dry-run]`."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runs.ops import OpsError, target_pause


class Command(BaseCommand):
    help = (
        "Hold every waiting run whose target is on HOST (as written in the target URL, port included), and every "
        "run those jobs get until resume_target HOST. A call already in flight finishes."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("host")
        parser.add_argument("--dry-run", action="store_true", help="say what would be held, change nothing")

    def handle(self, *args: Any, host: str, dry_run: bool, **options: Any) -> None:
        try:
            result = target_pause(host=host, dry_run=dry_run)
        except OpsError as exc:
            raise CommandError(str(exc)) from exc
        if dry_run:
            state = "would pause" if result.changed_target else "is already paused; would hold"
            self.stdout.write(f"{result.host} {state}: {result.runs} waiting run(s) of {result.jobs} job(s)")
            return
        state = "paused" if result.changed_target else "was already paused"
        self.stdout.write(f"{result.host} {state}: held {result.runs} waiting run(s) of {result.jobs} job(s)")
