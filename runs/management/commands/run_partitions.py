"""`python manage.py run_partitions [--ahead N] [--check]`: the runs history's time partitions."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from runs import partitions


class Command(BaseCommand):
    help = (
        "Make the runs history's partition of now and the next --ahead ones (PostgreSQL; the scanner holding "
        "partition 0 does this too), then list them. --check makes nothing and fails if any is missing."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--ahead", type=int, default=None, metavar="N",
                            help="partitions after now's (default SCHEDULER_RUN_PARTITIONS_AHEAD)")
        parser.add_argument("--check", action="store_true", help="make nothing; exit 1 if a partition is missing")

    def handle(self, *args: Any, ahead: int | None, check: bool, **options: Any) -> None:
        if not partitions.in_use():
            self.stdout.write("runs is not partitioned here (the embedded SQLite store keeps one table)")
            return
        ahead = settings.SCHEDULER_RUN_PARTITIONS_AHEAD if ahead is None else ahead
        if ahead < 0:
            raise CommandError(f"--ahead must be 0 or more, not {ahead}")
        now = timezone.now()
        if check:
            gaps = partitions.missing(now, ahead)
            if gaps:
                raise CommandError(f"no runs partition for {', '.join(map(str, gaps))}; "
                                   "run `python manage.py run_partitions` (or a scanner) to make them")
        else:
            for span in partitions.make_ahead(now, ahead):
                self.stdout.write(f"made {span.name}")
        for span in partitions.spans():
            self.stdout.write(f"{span.name}  {span.start:%Y-%m-%dT%H:%MZ} to {span.end:%Y-%m-%dT%H:%MZ}")
