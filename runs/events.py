"""A run's timeline: one row per thing that happened to it."""
from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable

from runs.models import RunEvent


def event(run_id: int, type_: str, at: datetime, **detail: Any) -> RunEvent:
    return RunEvent(run_id=run_id, type=type_, at=at, detail=detail)


def record(run_id: int, type_: str, at: datetime, **detail: Any) -> None:
    RunEvent.objects.create(run_id=run_id, type=type_, at=at, detail=detail)


def record_many(events: Iterable[RunEvent]) -> None:
    RunEvent.objects.bulk_create(list(events))
