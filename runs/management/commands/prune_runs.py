"""`python manage.py prune_runs --older-than 90d [--dry-run]`."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.schedule import parse_duration
from runs.delivery import iso_z
from runs.ops import OpsError, prune_runs


class Command(BaseCommand):
    help = (
        "Delete finished runs (succeeded, dead, skipped, cancelled) that finished longer ago than --older-than, "
        "with their timelines, in batches. Never an open run."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than", required=True, metavar="AGE", help='a duration like "90d" (s, m, h or d)')
        parser.add_argument("--dry-run", action="store_true", help="count what would be deleted, delete nothing")

    def handle(self, *args: Any, older_than: str, dry_run: bool, **options: Any) -> None:
        try:
            age = parse_duration(older_than)
        except ValueError as exc:
            raise CommandError(f"--older-than: {exc}") from exc
        if not age:
            raise CommandError(f"--older-than must be more than 0s, not {older_than!r}; give an age like 90d")
        try:
            result = prune_runs(older_than=age, dry_run=dry_run)
        except OpsError as exc:
            raise CommandError(str(exc)) from exc
        verb = "would delete" if dry_run else "deleted"
        dropped = f" ({len(result.dropped)} history partition(s) dropped whole)" if result.dropped else ""
        self.stdout.write(
            f"{verb} {result.runs} finished run(s) and {result.events} event(s) finished before {iso_z(result.cutoff)}"
            f"{dropped}"
        )
