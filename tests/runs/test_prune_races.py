"""A retention prune never takes the timeline of a run reopened while it runs.

The prune reads old finished runs, then deletes their events and notices, then the
runs. A dead run past retention retried between the read and the deletes used to be
reopened with no event rows at all (its `requeued` event deleted too). Now the read
locks the runs: the retry waits, then finds the run gone (the API's 409), or the
prune skips a run the retry already holds. Real PostgreSQL, two connections.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from runs import ops
from runs.models import Run, RunEvent
from tests.factories import drop_time_partitions, make_job, make_run

S = Run.Status
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def no_time_partitions(transactional_db: None) -> Any:
    drop_time_partitions()  # every ended run in the default partition: the row path
    yield
    drop_time_partitions()


def old_dead_run() -> Run:
    long_ago = timezone.now() - timedelta(days=100)
    run = make_run(make_job(), long_ago, status=S.DEAD, finished_at=long_ago, attempt=4, fence=4)
    RunEvent.objects.create(run=run, at=long_ago, type="dead", detail={"reason": "target answered 500"})
    return run


def retried_after_the_read(prune: Callable[[], Any], run: Run) -> dict[str, Any]:
    """`prune` runs here; right after its read of the runs to delete, the API's retry of
    `run` starts on a connection of its own, and the prune goes on once the retry has
    ended or has waited on a lock for a second."""
    out: dict[str, Any] = {}
    done = threading.Event()

    def retry() -> None:
        try:
            out["run"] = ops.run_retry(run=Run.objects.get(pk=run.pk), now=timezone.now())
        except Exception as exc:  # noqa: BLE001 - handed back to the test's thread
            out["error"] = exc
        finally:
            done.set()
            connection.close()

    started: list[threading.Thread] = []

    def after_the_read(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        answer = execute(sql, params, many, context)
        if not started and "finished_at" in sql and sql.lstrip().upper().startswith("SELECT"):
            thread = threading.Thread(target=retry)
            thread.start()
            started.append(thread)
            done.wait(1.0)  # the old prune: the retry commits here; the new: it waits on the lock
        return answer

    with connection.execute_wrapper(after_the_read):
        prune()
    assert started, "the prune never read the runs to delete: no race was made"
    started[0].join(20)
    assert not started[0].is_alive()
    return out


@pytest.mark.skipif(connection.vendor != "postgresql", reason="two writers at once: PostgreSQL")
@pytest.mark.parametrize("whole_partitions_only", [True, False], ids=["upkeep-default-partition", "command-rows"])
def test_a_dead_run_retried_while_the_prune_runs_keeps_its_whole_timeline_or_is_gone(
    whole_partitions_only: bool,
) -> None:
    run = old_dead_run()

    out = retried_after_the_read(
        lambda: ops.prune_runs(older_than=timedelta(days=90), whole_partitions_only=whole_partitions_only), run)

    found = Run.objects.filter(pk=run.pk).first()
    types = list(RunEvent.objects.filter(run_id=run.pk).order_by("at", "id").values_list("type", flat=True))
    if found is None:
        # The prune took it first: the retry was told so, and nothing of it is left.
        assert isinstance(out.get("error"), ops.RetryRefused), out
        assert types == []
    else:
        # The retry took it first: reopened, with its whole timeline.
        assert found.status == S.SCHEDULED
        assert types == ["dead", "requeued"], types


@pytest.mark.parametrize("whole_partitions_only", [True, False], ids=["upkeep", "command"])
def test_an_excluded_times_skipped_row_written_ahead_outlives_retention_until_its_time_has_come(
    whole_partitions_only: bool,
) -> None:
    """A yearly job's excluded date gets its `skipped` row when the plan passes over it,
    weeks or months ahead. Its retention counts from its time, not from the write."""
    from jobs.services import job_create
    from tests.factories import utc

    now = utc("2026-12-07T10:00:00Z")
    owner = make_job().owner
    job = job_create(owner=owner, fields={"name": "new year", "schedule": "0 3 1 1 *", "target": "http://127.0.0.1:9/",
                                          "exclude": ["2027-01-01"]}, now=now)
    [skipped] = Run.objects.filter(job=job, status=S.SKIPPED)
    assert skipped.scheduled_for == utc("2027-01-01T03:00:00Z")

    ops.prune_runs(older_than=timedelta(days=1), now=now + timedelta(days=3), whole_partitions_only=whole_partitions_only)
    assert Run.objects.filter(pk=skipped.pk).exists()
    ops.prune_runs(older_than=timedelta(days=1), now=utc("2027-01-03T04:00:00Z"), whole_partitions_only=False)
    assert not Run.objects.filter(pk=skipped.pk).exists()
