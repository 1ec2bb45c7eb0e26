"""`python manage.py import_beat --owner NAME [--database URL] [--dry-run] [--disable-source]`."""
from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from jobs import beat_import
from jobs.validators import escape_controls
from jobs.models import ServiceAccount
from runs.delivery import iso_z


class Command(BaseCommand):
    help = (
        "One job per django-celery-beat periodic task, for service NAME (docs/from-celery-beat.md). "
        "Prints a table; running it twice creates nothing new; what cannot be carried over exactly "
        "is listed with its reason and skipped."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--owner", required=True, help="the service account that owns the jobs")
        parser.add_argument(
            "--database", help="read the periodic tasks from this database URL (default: this project's database)"
        )
        parser.add_argument("--dry-run", action="store_true", help="print the table, create nothing")
        parser.add_argument(
            "--crontab-timezone", metavar="ZONE",
            help="read every crontab in ZONE, not its own timezone field: for a project that ran beat with "
                 "DJANGO_CELERY_BEAT_TZ_AWARE=False (its crontabs ran in Celery's time zone, ZONE)",
        )
        parser.add_argument(
            "--disable-source", action="store_true", help="switch the imported periodic tasks off in beat's tables"
        )

    def handle(self, *args: Any, owner: str, database: str | None, dry_run: bool, disable_source: bool,
               crontab_timezone: str | None = None, **options: Any) -> None:
        service = _service(owner)
        try:
            alias = beat_import.source_alias(database)
            tasks = beat_import.read_periodic_tasks(alias)
            if crontab_timezone:
                beat_import.read_crontabs_in(tasks, crontab_timezone)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        try:
            self._run(service, alias, tasks, dry_run=dry_run, disable_source=disable_source)
        finally:
            beat_import.source_close(alias)

    def _run(self, service: Any, alias: str, tasks: list[Any], *, dry_run: bool, disable_source: bool) -> None:
        now = timezone.now()
        plans = beat_import.plan_import(tasks, owner=service, now=now)
        if dry_run:
            self._table(plans, dry_run=True)
            self._summary(plans, dry_run=True)
            return
        result = beat_import.beat_import(
            owner=service, plans=plans, now=now, disable_alias=alias if disable_source and alias == "default" else None
        )
        self._table(result.plans, dry_run=False)
        self._summary(result.plans, dry_run=False)
        if disable_source:
            self._disable(alias, result)

    def _disable(self, alias: str, result: beat_import.ImportResult) -> None:
        if alias == "default":
            self.stdout.write(
                f"disabled {result.disabled} periodic tasks in this database, in the import's transaction"
            )
            return
        ids = beat_import.imported_task_ids(result.plans)
        try:
            count = beat_import.disable_periodic_tasks(alias, ids)
        except Exception as exc:
            raise CommandError(
                f"the jobs are imported, but switching the periodic tasks off in --database failed: "
                f"{str(exc).splitlines()[0]}; run again with --disable-source"
            ) from exc
        self.stdout.write(
            f"disabled {count} periodic tasks in --database after the import committed (a separate transaction)"
        )

    def _table(self, plans: list[beat_import.Plan], *, dry_run: bool) -> None:
        header = ("name", "source schedule", "job schedule", "beat next", "job next", "status")
        rows = [header] + [_row(p, dry_run) for p in plans]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row, widths)] + [row[-1]]
            self.stdout.write("  ".join(cells).rstrip())

    def _summary(self, plans: list[beat_import.Plan], *, dry_run: bool) -> None:
        made = sum(1 for p in plans if p.status in ("create", "created"))
        exists = sum(1 for p in plans if p.status == "exists")
        skipped = sum(1 for p in plans if p.status == "skip")
        verb = "would create" if dry_run else "created"
        self.stdout.write(
            f"{len(plans)} periodic tasks: {verb} {made} jobs; {exists} already imported; "
            f"{skipped} skipped (reasons above)"
        )


def _row(plan: beat_import.Plan, dry_run: bool) -> tuple[str, ...]:
    return tuple(escape_controls(cell) for cell in _cells(plan, dry_run))


def _cells(plan: beat_import.Plan, dry_run: bool) -> tuple[str, ...]:
    if plan.status == "skip":
        status = f"skipped: {plan.reason}"
    elif plan.status == "create":
        status = "would create" if dry_run else "create"
    elif plan.status == "created":
        status = f"created {plan.job_id}"
    else:
        status = "already imported"
    return (
        plan.name,
        plan.source,
        plan.job_schedule or "-",
        _times(plan.beat_next),
        _times(plan.ours_next),
        status,
    )


def _times(times: list[Any]) -> str:
    return ", ".join(iso_z(t) for t in times) or "-"


def _service(name: str) -> Any:
    user = get_user_model().objects.filter(username=name).first()
    if user is None or not ServiceAccount.objects.filter(user=user).exists():
        raise CommandError(f"no service account {name!r} (create_service_token {name} makes one)")
    return user
