"""A write that waits on a run while another transaction ends it (or reopens it).

On the partitioned store (migration runs 0015) the statement that ends a run moves
its row from the open runs' partition into the history, and a requeue moves it back.
A second transaction that was waiting for that row's lock does not see a newer
version to re-check, as it did in one table: PostgreSQL raises "tuple to be locked
was already moved to another partition due to concurrent update" (SQLSTATE 40001).
For the store's writers that must mean what it meant before: the run is no longer
what the write was for (a heartbeat, a stale holder's outcome, a second claim, a
second operator's action get "no", not an error). Each case below makes the race
for real: the writer's statement is seen waiting on the lock before the move commits.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from runs import claims, ops
from runs.models import Run
from tests.factories import expire_lease, make_job, make_run, utc

LEASE = timedelta(seconds=60)
S = Run.Status

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="rows move between partitions on PostgreSQL only"),
]


def running_run() -> tuple[Run, claims.Claim]:
    run = make_run(make_job(), utc("2026-10-28T20:30:00Z"), status=S.QUEUED, queued_at=timezone.now())
    claim = claims.claim(run_id=run.pk, worker="w1", lease=LEASE)
    assert claim is not None
    return run, claim


def _waiting_backends() -> int:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")  # read afresh inside a transaction
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def race(move: Callable[[], Any], write: Callable[[], Any], *, waits: bool = True) -> Any:
    """`move` runs in a transaction on this thread; once it has written, `write` starts on
    another connection and (`waits`) must be seen waiting on a lock before `move`
    commits. Returns what `write` returned; re-raises what it raised."""
    moved, out = threading.Event(), {}

    def writer() -> None:
        try:
            moved.wait(10)
            out["value"] = write()
        except BaseException as e:  # handed back to the test's thread
            out["error"] = e
        finally:
            connection.close()

    thread = threading.Thread(target=writer)
    thread.start()
    with transaction.atomic():
        move()
        moved.set()
        deadline = time.monotonic() + 10
        while waits and _waiting_backends() == 0:
            if "error" in out:
                raise out["error"]
            assert time.monotonic() < deadline, "the writer never waited on the run's lock: no race was made"
            time.sleep(0.01)
    thread.join(20)
    assert not thread.is_alive()
    if "error" in out:
        raise out["error"]
    return out["value"]


def end(run: Run, claim: claims.Claim) -> Callable[[], None]:
    def move() -> None:
        landed = claims.record_outcomes(
            [claims.Outcome(run_id=run.pk, fence=claim.fence, status=S.SUCCEEDED, now=timezone.now())]
        )
        assert landed == {run.pk}

    return move


def test_a_heartbeat_waiting_on_the_outcome_that_ends_its_run_says_the_lease_is_gone() -> None:
    run, claim = running_run()
    assert race(end(run, claim), lambda: claims.heartbeat(run_id=run.pk, fence=claim.fence, lease=LEASE)) is False
    run.refresh_from_db()
    assert run.status == S.SUCCEEDED and run.lease_expires_at is None


def test_a_stale_holders_outcome_waiting_on_the_current_holders_is_refused() -> None:
    run, first = running_run()
    expire_lease(run.pk)
    second = claims.claim(run_id=run.pk, worker="w2", lease=LEASE)
    assert second is not None
    stale = claims.Outcome(run_id=run.pk, fence=first.fence, status=S.DEAD, now=timezone.now(), error="late")
    # Its fence no longer matches the version it reads, so it does not even wait.
    assert race(end(run, second), lambda: claims.record_outcomes([stale]), waits=False) == set()
    run.refresh_from_db()
    assert (run.status, run.fence, run.last_error) == (S.SUCCEEDED, second.fence, "")


def test_a_stale_holders_single_finish_waiting_on_the_current_holders_outcome_is_refused() -> None:
    run, first = running_run()
    expire_lease(run.pk)
    second = claims.claim(run_id=run.pk, worker="w2", lease=LEASE)
    assert second is not None
    late = lambda: claims.finish(run_id=run.pk, fence=first.fence, status=S.DEAD, now=timezone.now())  # noqa: E731
    assert race(end(run, second), late, waits=False) is False
    run.refresh_from_db()
    assert (run.status, run.fence) == (S.SUCCEEDED, second.fence)


def test_a_claim_of_a_run_whose_lease_ran_out_waiting_on_its_holders_outcome_takes_nothing() -> None:
    run, claim = running_run()
    expire_lease(run.pk)
    assert race(end(run, claim), lambda: claims.claim(run_id=run.pk, worker="w2", lease=LEASE)) is None
    run.refresh_from_db()
    assert (run.status, run.fence, run.lease_owner) == (S.SUCCEEDED, claim.fence, "")


def test_a_holders_second_write_of_its_outcome_waiting_on_its_first_is_refused() -> None:
    run, claim = running_run()
    again = claims.Outcome(run_id=run.pk, fence=claim.fence, status=S.DEAD, now=timezone.now(), error="twice")
    assert race(end(run, claim), lambda: claims.record_outcomes([again])) == set()
    run.refresh_from_db()
    assert (run.status, run.last_error) == (S.SUCCEEDED, "")


def test_marking_a_dead_run_handled_while_it_is_requeued_marks_nothing() -> None:
    run, claim = running_run()
    assert claims.record_outcomes(
        [claims.Outcome(run_id=run.pk, fence=claim.fence, status=S.DEAD, now=timezone.now(), error="x")]
    ) == {run.pk}
    run.refresh_from_db()

    def requeue() -> None:
        assert ops.run_requeue_dead(run=run, via="command")

    marked = race(requeue, lambda: ops.runs_mark_handled(runs=Run.objects.filter(pk=run.pk), via="command"))
    assert marked == 0
    run.refresh_from_db()
    assert run.status == S.SCHEDULED and run.handled_at is None
