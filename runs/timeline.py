"""A run's timeline, as every reader sees it: its `run_events` rows and the entries
its row carries (Run.on_row).

The happy path (scheduled, queued, claimed, target_answered, succeeded) writes no
event rows: each step sets its bit in `on_row` and its facts in the `on_row_*`
columns in the statement it writes anyway (the run's insert, the queueing, the
claim, the outcome). Everything else is a row, as before. The first row written
for a run turns the entries on its row into rows first (runs.events.settle), so
the entries still on a row are always later than every row of that run: the
timeline is the rows in (at, id) order, then the row's entries, merged by time.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from jobs.public_ids import format_id
from runs.models import (
    ON_ROW_ANSWERED,
    ON_ROW_CLAIMED,
    ON_ROW_QUEUED,
    ON_ROW_SCHEDULED,
    ON_ROW_SUCCEEDED,
    Run,
    RunEvent,
)

# What a reader needs of a run to put its on-row entries together.
ON_ROW_FIELDS = (
    "id", "job_id", "scheduled_for", "created_at", "fence", "attempt", "finished_at", "on_row", "on_row_due_at",
    "on_row_queued_at", "on_row_claimed_at", "on_row_worker", "on_row_answer", "on_row_duration_ms",
)


def _iso(value) -> str:  # type: ignore[no-untyped-def]
    from runs.delivery import iso_z

    return iso_z(value)


def on_row_entries(run: Run, next_runs: dict[int, tuple[int, object]] | None = None) -> list[RunEvent]:
    """The entries `run`'s row carries, oldest first, as unsaved RunEvent objects.
    `next_runs`: by run id, the (id, scheduled_for) of the run its outcome made (its
    `on_row_made_by`); looked up when not given."""
    bits = run.on_row
    if not bits:
        return []
    found: list[RunEvent] = []

    def add(type_: str, at: object, **detail: object) -> None:
        found.append(RunEvent(run_id=run.pk, at=at, type=type_, detail=detail))

    if bits & ON_ROW_SCHEDULED:
        add("scheduled", run.created_at, scheduled_for=_iso(run.scheduled_for), due_at=_iso(run.on_row_due_at))
    if bits & ON_ROW_QUEUED:
        add("queued", run.on_row_queued_at)
    if bits & ON_ROW_CLAIMED:
        add("claimed", run.on_row_claimed_at, fence=run.fence, worker=run.on_row_worker, attempt=run.attempt)
    if bits & ON_ROW_ANSWERED:
        add("target_answered", run.finished_at, fence=run.fence, duration_ms=run.on_row_duration_ms,
            status=run.on_row_answer)
    if bits & ON_ROW_SUCCEEDED:
        then: dict[str, object] = {}
        nxt = (next_runs if next_runs is not None else made_by([run])).get(run.pk)
        if nxt is not None:
            then = {"next_run": format_id("run", nxt[0]), "next_scheduled_for": _iso(nxt[1])}
        add("succeeded", run.finished_at, fence=run.fence, **then)
    return found


def made_by(runs: Iterable[Run]) -> dict[int, tuple[int, object]]:
    """The next run each succeeded run's outcome made (on_row_made_by), as (id,
    scheduled_for) by that run's id: a range read of runs_one_run_per_time after
    each run's time (a next run is always later than the run that made it)."""
    ended = [r for r in runs if r.on_row & ON_ROW_SUCCEEDED]
    if not ended:
        return {}
    if len(ended) == 1:
        run = ended[0]
        later = Run.objects.filter(job_id=run.job_id, scheduled_for__gt=run.scheduled_for, on_row_made_by=run.pk)
        found = later.order_by("scheduled_for").values_list("pk", "scheduled_for").first()
        return {run.pk: found} if found else {}
    result: dict[int, tuple[int, object]] = {}
    for start in range(0, len(ended), 2000):
        chunk = ended[start:start + 2000]
        rows = Run.objects.filter(job_id__in={r.job_id for r in chunk}, on_row_made_by__in=[r.pk for r in chunk])
        for pk, by, when in rows.values_list("pk", "on_row_made_by", "scheduled_for"):
            result[by] = (pk, when)
    return result


def merge(rows: list[RunEvent], on_row: list[RunEvent]) -> list[RunEvent]:
    """Rows (any order) and a row's entries as one timeline, oldest first. The rows
    go by (at, id); an on-row entry is newer than every row (see the module), so at
    the same instant it comes after them."""
    ordered = sorted(rows, key=lambda e: (e.at, e.pk or 0))
    if not on_row:
        return ordered
    keyed = [((e.at, 0, e.pk or 0, 0), e) for e in ordered] + [((e.at, 1, 0, i), e) for i, e in enumerate(on_row)]
    return [e for _, e in sorted(keyed, key=lambda pair: pair[0])]


def timeline(run: Run, limit: int | None = None) -> list[RunEvent]:
    """One run's whole timeline, oldest first: what the API's `events` shows.
    `limit`: its first that many entries only (the live view's bound)."""
    # Its time too: on PostgreSQL the events partition of the run's span alone.
    rows = RunEvent.objects.filter(run_id=run.pk, scheduled_for=run.scheduled_for).order_by("at", "id")
    found = merge(list(rows if limit is None else rows[:limit]), on_row_entries(run))
    return found if limit is None else found[:limit]


def timelines(runs: Iterable[Run]) -> dict[int, list[RunEvent]]:
    """The timelines of many runs: their rows, and the next runs their succeeded
    entries name, a read each per few thousand runs."""
    runs = list(runs)
    rows: dict[int, list[RunEvent]] = defaultdict(list)
    ids = [r.pk for r in runs]
    for start in range(0, len(ids), 5000):
        for event in RunEvent.objects.filter(run_id__in=ids[start:start + 5000]):
            rows[event.run_id].append(event)
    next_runs = made_by(runs)
    return {r.pk: merge(rows.get(r.pk, []), on_row_entries(r, next_runs)) for r in runs}


def timeline_types(run: Run) -> list[str]:
    """The types of a run's timeline, oldest first (for tests and commands)."""
    return [e.type for e in timeline(run)]


def timelines_by_id(run_ids: Iterable[int] | None = None, types: Iterable[str] | None = None
                    ) -> dict[int, list[RunEvent]]:
    """timelines() by run id, for every run (None) or these; only entries of `types`
    when given. For the benches and soaks that read many runs' timelines."""
    wanted = set(types) if types is not None else None
    runs = Run.objects.only(*ON_ROW_FIELDS)
    if run_ids is None:
        found = timelines(runs.iterator(chunk_size=5000))
    else:
        ids = list(run_ids)
        found = {}
        for start in range(0, len(ids), 5000):
            found.update(timelines(runs.filter(pk__in=ids[start:start + 5000])))
    if wanted is None:
        return found
    return {pk: [e for e in entries if e.type in wanted] for pk, entries in found.items()}
