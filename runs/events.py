"""A run's timeline: one row per thing that happened to it, but the happy path's.

The happy path's entries (scheduled, queued, claimed, target_answered, succeeded)
are on the run row (runs.timeline): the step that writes the row sets them, and
hands its events here marked `on_row` only to be counted (runs.rollups). Any other
event is a row; before the first rows of a run are written, the entries on its row
become rows (settle), so a timeline reads rows, then the row's entries.

Events are written in bulk where runs are handled in bulk. On PostgreSQL a batch
goes in with COPY, several times cheaper than an INSERT of model instances (no
model objects, no per-field preparation); elsewhere with bulk_create.

Each row carries its run's scheduled time (`RunEvent.scheduled_for`, the key of the
events' time partitions on PostgreSQL): from the event where its maker had the run
(`Event.scheduled_for`), else read for the batch (`run_times`).
"""
from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NamedTuple

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, transaction

from runs.models import Run, RunEvent
from scheduler_project import statement_counter

if TYPE_CHECKING:
    from runs.models import Run

COPY_SQL = "COPY run_events (run_id, at, scheduled_for, type, detail) FROM STDIN"
# Below this many rows an INSERT costs about what a COPY does.
COPY_FROM = 8


class Event(NamedTuple):
    run_id: int
    type: str
    at: datetime
    detail: dict[str, Any]
    # Already on the run row (its writer set Run.on_row): counted, not written.
    on_row: bool = False
    # The run's scheduled_for, where the maker had it; read by run_times otherwise.
    scheduled_for: datetime | None = None


def event(run_id: int, type_: str, at: datetime, **detail: Any) -> Event:
    return Event(run_id, type_, at, detail)


def of(run: "Run", type_: str, at: datetime, **detail: Any) -> Event:
    """An event of a run at hand: its row carries the run's time without a read."""
    return Event(run.pk, type_, at, detail, scheduled_for=run.scheduled_for)


def on_row(found: Event) -> Event:
    return found._replace(on_row=True)


def record(run_id: int, type_: str, at: datetime, **detail: Any) -> None:
    record_many([Event(run_id, type_, at, detail)])


def record_many(events: Iterable[Event], *, runs: Mapping[int, "Run"] | None = None) -> None:
    """`runs` (optional: the batch's runs, job loaded, as read before this write) lets
    the rollups (runs.rollups) label calls by host and measure a first start's lag."""
    found = list(events)
    if not found:
        return
    rows = [e for e in found if not e.on_row]
    if rows:
        with transaction.atomic():
            _write(settle({e.run_id for e in rows}) + rows)
    _count(found, runs)


def write_settled(run_ids: Iterable[int]) -> None:
    """The entries on these runs' rows written as rows (see settle)."""
    with transaction.atomic():
        _write(settle(run_ids))


def settle(run_ids: Iterable[int]) -> list[Event]:
    """The entries on these runs' rows (runs.timeline), cleared from the rows (they
    are locked until the transaction ends), as events for the caller to write before
    its own: a run's rows are then always older than the entries on its row."""
    from runs.claims import again_if_moved
    from runs.timeline import ON_ROW_FIELDS, on_row_entries

    ids = sorted(run_ids)
    if not ids:
        return []
    assert connection.in_atomic_block, "settle writes the entries in the caller's transaction"

    # A run another transaction moved between partitions meanwhile (its end, a requeue)
    # is locked where it is now: the move keeps the entries on its row.
    @again_if_moved
    def lock(chunk: list[int]) -> list[Run]:
        return list(Run.objects.select_for_update().filter(pk__in=chunk).exclude(on_row=0).only(*ON_ROW_FIELDS))

    found: list[Event] = []
    for start in range(0, len(ids), 5000):
        chunk = ids[start:start + 5000]
        runs = lock(chunk)
        if not runs:
            continue
        Run.objects.filter(pk__in=[r.pk for r in runs]).update(on_row=0)
        for run in runs:
            found += [Event(run.pk, e.type, e.at, e.detail, scheduled_for=run.scheduled_for)
                      for e in on_row_entries(run)]
    return found


def run_times(run_ids: Iterable[int]) -> dict[int, datetime]:
    """The scheduled time of each of these runs: the open runs' partition first (the
    runs most events are about), then the others. A run that is gone is left out."""
    from runs.models import OPEN_KEPT_FOR

    wanted = sorted(set(run_ids))
    found: dict[int, datetime] = {}
    for start in range(0, len(wanted), 5000):
        chunk = wanted[start:start + 5000]
        found.update(Run.objects.filter(pk__in=chunk, kept_for=OPEN_KEPT_FOR).values_list("pk", "scheduled_for"))
        rest = [pk for pk in chunk if pk not in found]
        if rest:
            found.update(Run.objects.filter(pk__in=rest).values_list("pk", "scheduled_for"))
    return found


def _count(rows: list[Event], runs: Mapping[int, "Run"] | None) -> None:
    from runs import rollups

    rollups.note(rows, runs)


def _write(rows: list[Event]) -> None:
    if not rows:
        return
    times = run_times(e.run_id for e in rows if e.scheduled_for is None)
    # An event of a run that is gone (none is written so, but the column is NOT NULL)
    # is kept under its own time.
    rows = [e if e.scheduled_for is not None else e._replace(scheduled_for=times.get(e.run_id, e.at))
            for e in rows]
    if connection.vendor == "postgresql" and len(rows) >= COPY_FROM:
        dumps = DjangoJSONEncoder(separators=(",", ":")).encode
        with connection.cursor() as cursor, cursor.cursor.copy(COPY_SQL) as copy:
            for e in rows:
                copy.write_row((e.run_id, e.at, e.scheduled_for, e.type, dumps(e.detail)))
        statement_counter.note()  # COPY bypasses Django's execute wrappers
        return
    RunEvent.objects.bulk_create(
        RunEvent(run_id=e.run_id, type=e.type, at=e.at, detail=e.detail, scheduled_for=e.scheduled_for)
        for e in rows
    )
