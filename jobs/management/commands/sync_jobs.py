"""`python manage.py sync_jobs [--dry-run] [--prune]`: the jobs the apps' schedules.py define."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs import code
from jobs.validators import escape_controls


def _show(value: Any) -> str:
    return "null" if value is None else escape_controls(repr(value))


class Command(BaseCommand):
    help = (
        "Create and update the jobs defined in the installed apps' schedules.py modules (keyed by owner and "
        "name, code-owned, read-only in the API and the admin). All or nothing: one bad definition writes "
        "nothing. Running it twice changes nothing."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="print the diff, write nothing")
        parser.add_argument("--prune", action="store_true", help="delete code-owned jobs no longer defined")

    def handle(self, *args: Any, dry_run: bool, prune: bool, **options: Any) -> None:
        try:
            result = code.sync(dry_run=dry_run, prune=prune)
        except ValueError as exc:  # DefinitionError, or a service's refusal (the job cap)
            raise CommandError(escape_controls(str(exc))) from exc
        self._report(result, dry_run=dry_run, prune=prune)

    def _report(self, result: code.SyncPlan, *, dry_run: bool, prune: bool) -> None:
        would = "would " if dry_run else ""
        for definition, wanted in result.create:
            made = f"{wanted.public_id} " if wanted.pk else ""
            self.stdout.write(f"{would}create {made}{self._key(definition.key)} ({definition.source})")
        for change in result.change:
            self.stdout.write(f"{would}change {change.job.public_id} {self._key(change.definition.key)}:")
            for name, (old, new) in change.diff.items():
                line = f"    {name}: changed" if name == code.SECRET_VALUES else f"    {name}: {_show(old)} -> {_show(new)}"
                self.stdout.write(line)
        for gone in result.gone:
            key = self._key((gone.owner.get_username(), gone.name))
            if prune:
                self.stdout.write(f"{would}prune {gone.public_id} {key} (no longer defined in {gone.code_source})")
            else:
                self.stdout.write(f"not defined any more: {gone.public_id} {key} (kept; --prune deletes it)")
        pruned = len(result.gone) if prune else 0
        counts = (len(result.create), len(result.change), result.unchanged, pruned)
        if dry_run:
            self.stdout.write("dry run, nothing written: {} to create, {} to change, {} unchanged, {} to prune".format(*counts))
        elif not (result.create or result.change or pruned):
            self.stdout.write(f"nothing to change: {result.unchanged} unchanged")
        else:
            self.stdout.write("{} created, {} changed, {} unchanged, {} pruned".format(*counts))

    @staticmethod
    def _key(key: tuple[str, str]) -> str:
        # Names reach an operator's terminal: format characters (U+202E turns text
        # around) and line separators written as escapes, like import_beat's table.
        return escape_controls(f"{key[0]}/{key[1]}")
