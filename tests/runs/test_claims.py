"""The fenced statements, on a real database, with two connections where it matters."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import time_machine
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from runs import claims
from runs.models import Run
from tests.factories import expire_lease, make_job, make_run, utc

NOW = utc("2026-10-28T20:30:05Z")
LEASE = timedelta(seconds=60)
S = Run.Status

pytestmark = pytest.mark.django_db(transaction=True)


def queued_run() -> Run:
    return make_run(make_job(), utc("2026-10-28T20:30:00Z"), status=S.QUEUED, queued_at=NOW)


def test_a_claim_takes_the_lease_and_raises_the_fence_and_attempt() -> None:
    run = queued_run()
    before = claims.store_now()
    claim = claims.claim(run_id=run.pk, worker="w1", lease=LEASE)
    after = claims.store_now()
    assert claim is not None and (claim.fence, claim.attempt) == (1, 1)
    run.refresh_from_db()
    assert run.status == S.RUNNING and run.lease_owner == "w1"
    assert before + LEASE <= run.lease_expires_at <= after + LEASE and before <= run.started_at <= after


@pytest.mark.embedded
def test_a_second_claim_on_a_live_lease_changes_nothing() -> None:
    run = queued_run()
    assert claims.claim(run_id=run.pk, worker="w1", lease=LEASE) is not None
    assert claims.claim(run_id=run.pk, worker="w2", lease=LEASE) is None
    run.refresh_from_db()
    assert (run.fence, run.lease_owner) == (1, "w1")


@pytest.mark.embedded
def test_an_expired_lease_can_be_claimed_again_with_a_higher_fence() -> None:
    run = queued_run()
    first = claims.claim(run_id=run.pk, worker="w1", lease=LEASE)
    expire_lease(run.pk)
    second = claims.claim(run_id=run.pk, worker="w2", lease=LEASE)
    assert first is not None and second is not None
    assert second.fence == first.fence + 1 and second.attempt == 2


@pytest.mark.embedded
def test_a_stale_fence_cannot_write_a_result() -> None:
    run = queued_run()
    first = claims.claim(run_id=run.pk, worker="w1", lease=LEASE)
    expire_lease(run.pk)
    second = claims.claim(run_id=run.pk, worker="w2", lease=LEASE)
    assert first and second
    assert not claims.finish(run_id=run.pk, fence=first.fence, status=S.SUCCEEDED, now=NOW + LEASE * 2)
    assert not claims.heartbeat(run_id=run.pk, fence=first.fence, lease=LEASE)
    assert not claims.schedule_retry(run_id=run.pk, fence=first.fence, due_at=NOW, error="x")
    assert claims.finish(run_id=run.pk, fence=second.fence, status=S.SUCCEEDED, now=NOW + LEASE * 2)
    run.refresh_from_db()
    assert run.status == S.SUCCEEDED and run.fence == second.fence


def test_a_held_run_cannot_be_claimed() -> None:
    run = queued_run()
    Run.objects.filter(pk=run.pk).update(held=True)
    assert claims.claim(run_id=run.pk, worker="w1", lease=LEASE) is None


def test_a_scheduled_run_cannot_be_claimed_before_the_scanner_queues_it() -> None:
    run = make_run(make_job(), utc("2026-10-28T20:30:00Z"))
    assert claims.claim(run_id=run.pk, worker="w1", lease=LEASE) is None


def test_two_workers_racing_for_one_run_get_one_claim() -> None:
    run = queued_run()
    results: list[object] = []
    barrier = threading.Barrier(8)

    def race(name: str) -> None:
        try:
            barrier.wait()
            results.append(claims.claim(run_id=run.pk, worker=name, lease=LEASE))
        finally:
            connection.close()

    threads = [threading.Thread(target=race, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if r is not None]
    assert len(results) == 8 and len(won) == 1
    run.refresh_from_db()
    assert run.fence == 1


def test_a_job_cannot_have_two_open_runs() -> None:
    job = make_job()
    make_run(job, utc("2026-10-28T20:30:00Z"))
    with pytest.raises(IntegrityError), transaction.atomic():
        make_run(job, utc("2026-10-28T20:31:00Z"), status=S.QUEUED)


def test_backfill_runs_are_not_counted_as_the_open_run() -> None:
    job = make_job()
    make_run(job, utc("2026-10-28T20:30:00Z"))
    make_run(job, utc("2026-10-27T20:30:00Z"), is_backfill=True)
    assert Run.objects.filter(job=job, status=S.SCHEDULED).count() == 2


def test_no_time_can_get_two_runs() -> None:
    job = make_job()
    make_run(job, utc("2026-10-28T20:30:00Z"), status=S.SUCCEEDED)
    with pytest.raises(IntegrityError), transaction.atomic():
        make_run(job, utc("2026-10-28T20:30:00Z"), is_backfill=True)


def test_expired_leases_go_back_to_the_queue_keeping_their_fence() -> None:
    run = queued_run()
    claim = claims.claim(run_id=run.pk, worker="w1", lease=LEASE)
    assert claim
    with transaction.atomic():
        assert claims.release_expired_leases(partitions=[run.partition], now=NOW, limit=10) == []
    expire_lease(run.pk)
    with transaction.atomic():
        released = claims.release_expired_leases(partitions=[run.partition], now=NOW, limit=10)
    assert released == [run.pk]
    run.refresh_from_db()
    assert run.status == S.QUEUED and run.fence == claim.fence and run.lease_owner == ""


def test_queued_runs_nobody_claimed_are_touched_for_publishing_again() -> None:
    run = queued_run()
    wait = timedelta(seconds=30)
    with transaction.atomic():
        assert claims.touch_unclaimed(partitions=[run.partition], now=NOW + wait / 2, older_than=wait, limit=10) == []
    later = NOW + wait * 2
    with transaction.atomic():
        assert claims.touch_unclaimed(partitions=[run.partition], now=later, older_than=wait, limit=10) == [run.pk]
    run.refresh_from_db()
    assert run.queued_at == later


@pytest.mark.embedded
def test_each_copy_of_an_unclaimed_run_waits_as_long_as_the_run_had_waited() -> None:
    # The soak under load (2026-12-01): a backlog the republish cut misjudged had every
    # waiting run sent again every SCHEDULER_REQUEUE_AFTER. A run due at D and not
    # claimed gets copies at D + 1, 2, 4, 8 x the wait, then one every
    # REPUBLISH_BACKOFF_CAP x the wait: a few copies a run, however long the backlog.
    wait = timedelta(seconds=5)
    due = utc("2026-10-28T20:30:00Z")
    run = make_run(make_job(), due, status=S.QUEUED, queued_at=due)
    copies: list[int] = []
    t = due
    while t < due + wait * 40:
        t += timedelta(seconds=1)
        with transaction.atomic():
            if claims.touch_unclaimed(partitions=[run.partition], now=t, older_than=wait, limit=10):
                copies.append(int((t - due) / timedelta(seconds=1)))
    # In 1 s steps, each copy the first second strictly past its time: 6 (> 5), 13
    # (> 2 x 6), 27, 55, then every 41 s (> 8 x 5 after the last).
    assert claims.REPUBLISH_BACKOFF_CAP == 8
    assert copies == [6, 13, 27, 55, 96, 137, 178]


# One clock for leases, the store's (PostgreSQL: on SQLite, the embedded mode, the
# machine's clock is the store's). A worker's wrong clock moves none of these.
SKEW = timedelta(seconds=120)


def test_a_worker_whose_clock_runs_ahead_cannot_take_or_release_a_live_lease() -> None:
    run = queued_run()
    assert claims.claim(run_id=run.pk, worker="true-clock", lease=LEASE) is not None
    with time_machine.travel(timezone.now() + SKEW, tick=True):
        assert claims.claim(run_id=run.pk, worker="fast", lease=LEASE) is None
        assert not claims.defer(run_id=run.pk, due_at=timezone.now())
        with transaction.atomic():
            assert claims.release_expired_leases(partitions=[run.partition], now=timezone.now(), limit=10) == []
    run.refresh_from_db()
    assert (run.status, run.fence, run.lease_owner) == (S.RUNNING, 1, "true-clock")


@pytest.mark.parametrize("skew", [-SKEW, SKEW], ids=["behind", "ahead"])
def test_a_lease_is_written_in_the_stores_clock_whatever_the_workers_clock(skew: timedelta) -> None:
    run = queued_run()
    before = claims.store_now()
    with time_machine.travel(timezone.now() + skew, tick=True):
        claim = claims.claim(run_id=run.pk, worker="skewed", lease=LEASE)
        assert claim is not None
        run.refresh_from_db()
        assert before + LEASE <= run.lease_expires_at <= claims.store_now() + LEASE
        Run.objects.filter(pk=run.pk).update(lease_expires_at=before)  # an old lease, about to run out
        assert claims.heartbeat(run_id=run.pk, fence=claim.fence, lease=LEASE)
        run.refresh_from_db()
        assert before + LEASE < run.lease_expires_at <= claims.store_now() + LEASE


def test_the_store_clock_is_the_databases_not_the_processes() -> None:
    with time_machine.travel(timezone.now() + SKEW, tick=True):
        skewed, store = timezone.now(), claims.store_now()
    assert timedelta(seconds=110) < skewed - store < timedelta(seconds=130)


@pytest.mark.embedded
def test_the_soaks_deliberate_bug_still_lets_a_live_lease_be_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The seam the soak's self-test turns on (claims._fence_checks_disabled) rewrites the
    # claim's lease check; it must still bite with the check in the store's clock.
    run = queued_run()
    assert claims.claim(run_id=run.pk, worker="w1", lease=LEASE) is not None
    monkeypatch.setenv("SCHEDULER_TESTING", "1")
    monkeypatch.setenv("SCHEDULER_TEST_DISABLE_FENCE", "1")
    assert [c.fence for c in claims.claim_many(run_ids=[run.pk], worker="w2", lease=LEASE)] == [2]


@pytest.mark.embedded
def test_detach_many_detaches_the_runs_held_under_their_fence_only() -> None:
    held = [queued_run() for _ in range(3)]
    taken = {c.run_id: c.fence for c in claims.claim_many(run_ids=[r.pk for r in held], worker="w", lease=LEASE)}
    assert set(taken) == {r.pk for r in held}
    mine, stale, again = held
    fences = {mine.pk: taken[mine.pk], stale.pk: taken[stale.pk] - 1, again.pk: taken[again.pk]}
    assert claims.detach_many(fences=fences) == sorted([mine.pk, again.pk])  # not under a superseded fence
    assert claims.detach_many(fences=fences) == []  # detached already
    assert sorted(Run.objects.filter(detached=True).values_list("pk", flat=True)) == sorted([mine.pk, again.pk])
