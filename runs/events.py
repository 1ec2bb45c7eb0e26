"""A run's timeline: one row per thing that happened to it.

Events are written in bulk where runs are handled in bulk. On PostgreSQL a batch
goes in with COPY, several times cheaper than an INSERT of model instances (no
model objects, no per-field preparation); elsewhere with bulk_create.
"""
from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NamedTuple

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection

from runs.models import RunEvent
from scheduler_project import statement_counter

if TYPE_CHECKING:
    from runs.models import Run

COPY_SQL = "COPY run_events (run_id, at, type, detail) FROM STDIN"
# Below this many rows an INSERT costs about what a COPY does.
COPY_FROM = 8


class Event(NamedTuple):
    run_id: int
    type: str
    at: datetime
    detail: dict[str, Any]


def event(run_id: int, type_: str, at: datetime, **detail: Any) -> Event:
    return Event(run_id, type_, at, detail)


def record(run_id: int, type_: str, at: datetime, **detail: Any) -> None:
    RunEvent.objects.create(run_id=run_id, type=type_, at=at, detail=detail)
    _count([Event(run_id, type_, at, detail)], None)


def record_many(events: Iterable[Event], *, runs: Mapping[int, "Run"] | None = None) -> None:
    """`runs` (optional: the batch's runs, job loaded, as read before this write) lets
    the rollups (runs.rollups) label calls by host and measure a first start's lag."""
    rows = list(events)
    if not rows:
        return
    _write(rows)
    _count(rows, runs)


def _count(rows: list[Event], runs: Mapping[int, "Run"] | None) -> None:
    from runs import rollups

    rollups.note(rows, runs)


def _write(rows: list[Event]) -> None:
    if connection.vendor == "postgresql" and len(rows) >= COPY_FROM:
        dumps = DjangoJSONEncoder(separators=(",", ":")).encode
        with connection.cursor() as cursor, cursor.cursor.copy(COPY_SQL) as copy:
            for e in rows:
                copy.write_row((e.run_id, e.at, e.type, dumps(e.detail)))
        statement_counter.note()  # COPY bypasses Django's execute wrappers
        return
    RunEvent.objects.bulk_create(RunEvent(run_id=e.run_id, type=e.type, at=e.at, detail=e.detail) for e in rows)
