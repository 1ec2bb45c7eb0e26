"""The runs' timelines for the benches, on this checkout or on an older commit's code
(bench/baseline.py runs today's scenarios against a commit from before runs.timeline,
when every entry of a timeline was a run_events row)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

CHUNK = 5000  # run ids to a statement


def timelines_by_id(run_ids: Iterable[int] | None = None, types: Iterable[str] | None = None
                    ) -> dict[int, list[Any]]:
    """runs.timeline.timelines_by_id where it exists; else the run_events rows, by run
    id, oldest first. Each entry has `at`, `type` and `detail`."""
    try:
        from runs.timeline import timelines_by_id as read
    except ImportError:
        return _events_by_id(run_ids, types)
    return read(run_ids, types)


def _events_by_id(run_ids: Iterable[int] | None, types: Iterable[str] | None) -> dict[int, list[Any]]:
    from runs.models import RunEvent

    rows = RunEvent.objects.all()
    if types is not None:
        rows = rows.filter(type__in=list(types))
    found: dict[int, list[Any]] = defaultdict(list)
    ids = None if run_ids is None else list(run_ids)
    chunks = [rows] if ids is None else [rows.filter(run_id__in=ids[i:i + CHUNK]) for i in range(0, len(ids), CHUNK)]
    for chunk in chunks:
        for event in chunk.order_by("run_id", "at", "id").iterator(chunk_size=CHUNK):
            found[event.run_id].append(event)
    return dict(found)
