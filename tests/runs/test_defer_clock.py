"""A worker's deferral (bulkhead full, breaker open) is never stamped before what a
scan wrote to the run (found by the soak under load on RabbitMQ: bulkhead_wait
events 3 to 5 s before the requeue they waited on). Deferrals are one statement for
a wave's held runs now (services._defer_many), and a run a scan holds locked is
skipped, not waited for: the scan is publishing it again."""
from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction

from runs import claims, events, services
from runs.models import Run, RunEvent
from scanners.scan import scan_once
from tests.factories import make_job, make_run, timeline_of

pytestmark = pytest.mark.django_db(transaction=True)

HOLD = 1.5  # seconds the other writer keeps the row locked


@pytest.mark.skipif(connection.vendor != "postgresql", reason="row locks: PostgreSQL")
def test_a_run_a_scan_holds_is_not_deferred_and_keeps_the_scans_timeline() -> None:
    job = make_job()
    now = claims.store_now()
    run = make_run(job, now.replace(microsecond=0), status=Run.Status.QUEUED, queued_at=now)
    locked, released = threading.Event(), {}

    def other_writer() -> None:
        # A scan holding the run (select_for_update) that writes its event just before it commits.
        try:
            with transaction.atomic():
                list(Run.objects.select_for_update().filter(pk=run.pk).values_list("pk", flat=True))
                locked.set()
                time.sleep(HOLD)
                released["at"] = claims.store_now()
                # What claims.touch_unclaimed and the scan's _republish write.
                Run.objects.filter(pk=run.pk).update(queued_at=released["at"])
                events.record(run.pk, "requeued", released["at"])
        finally:
            connection.close()

    thread = threading.Thread(target=other_writer)
    thread.start()
    assert locked.wait(10)
    stale = claims.store_now()  # the wave's clock
    other = make_run(make_job(), stale.replace(microsecond=0), status=Run.Status.QUEUED,
                     queued_at=stale)  # held back in the same wave, locked by nobody
    wave = list(Run.objects.select_related("job").filter(pk__in=[run.pk, other.pk]).order_by("pk"))
    started = time.monotonic()
    got = services._defer_many([(r, stale + timedelta(seconds=5), {"host": "127.0.0.1:9", "limit": 1}) for r in wave],
                               stale, "bulkhead_wait")
    waited_s = time.monotonic() - started
    thread.join(10)
    assert got == {run.pk: "not_claimed", other.pk: "bulkhead_wait"}
    assert waited_s < HOLD / 2  # skipped, not waited for
    assert not RunEvent.objects.filter(run_id=run.pk, type="bulkhead_wait").exists()
    assert RunEvent.objects.get(run_id=run.pk, type="requeued").at == released["at"]
    run.refresh_from_db()
    assert (run.status, run.queued_at) == (Run.Status.QUEUED, released["at"])  # the scan's copy stands
    other.refresh_from_db()
    assert (other.status, other.due_at) == (Run.Status.SCHEDULED, stale + timedelta(seconds=5))
    assert RunEvent.objects.get(run_id=other.pk, type="bulkhead_wait").at == stale


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the store's clock: PostgreSQL")
def test_a_deferral_is_stamped_no_earlier_than_the_runs_last_copy() -> None:
    # A scan published the run again after the wave read its clock: the deferral comes
    # after that `requeued` in the timeline.
    job = make_job()
    wave_now = claims.store_now()
    copied_at = wave_now + timedelta(milliseconds=300)
    run = make_run(job, wave_now.replace(microsecond=0), status=Run.Status.QUEUED, queued_at=copied_at)
    events.record(run.pk, "requeued", copied_at)
    got = services._defer_many([(Run.objects.select_related("job").get(pk=run.pk), wave_now + timedelta(seconds=5),
                                 {"host": "127.0.0.1:9", "limit": 1})], wave_now, "bulkhead_wait")
    assert got == {run.pk: "bulkhead_wait"}
    assert RunEvent.objects.get(run_id=run.pk, type="bulkhead_wait").at == copied_at



@pytest.mark.skipif(connection.vendor != "postgresql", reason="the store's clock: PostgreSQL")
def test_a_deferral_is_not_stamped_after_a_scan_that_queues_the_run_again() -> None:
    # The race the other way round (a fresh-clone run of tests/reliability/test_restarts.py,
    # 2026-12-01, with the deferral stamped by the store's clock after its lock): a
    # worker's wave reads its clock, a scan reads its own, the worker defers the run
    # and lets go of it, and the scan queues it again. The scan queued it after the
    # deferral, so its `queued` must not come first in the timeline (time order).
    job = make_job()
    start = claims.store_now()
    run = make_run(job, start.replace(microsecond=0) - timedelta(seconds=2), status=Run.Status.QUEUED, queued_at=start)
    wave_now = claims.store_now()
    time.sleep(0.02)
    scan_now = claims.store_now()  # the scan's probe
    time.sleep(0.05)
    found = _deferred_then_queued_again(run, wave_now, scan_now - timedelta(seconds=1), now=scan_now)
    assert found[-2][1] == wave_now


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the store's clock: PostgreSQL")
def test_a_deferral_by_a_clock_running_ahead_still_comes_before_the_scan_that_queues_the_run_again() -> None:
    # A fresh-clone run of tests/reliability/test_restarts.py (2026-12-04): a worker's
    # idea of the store's clock (time.time() plus an offset read across a reconnect)
    # ran ahead, its `bulkhead_wait` was stamped 8 ms after the `queued` of the scan
    # that queued the run again once the deferral had let go of it.
    job = make_job()
    start = claims.store_now()
    run = make_run(job, start.replace(microsecond=0) - timedelta(seconds=2), status=Run.Status.QUEUED, queued_at=start)
    ahead = claims.store_now() + timedelta(seconds=2)  # the wave's clock, two seconds fast
    found = _deferred_then_queued_again(run, ahead, start - timedelta(seconds=1), advance=True)
    assert found[-2][1] < ahead  # no later than the store's clock when it locked the run


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the store's clock: PostgreSQL")
def test_a_live_scan_whose_clock_lags_stamps_no_earlier_than_a_deferral_it_found() -> None:
    # The same race from the scan's side: a live scan's batch clock (its probe's
    # reading plus the time since) was read before the statement that locks the
    # rows; a deferral that let go of the run in between is stamped after it.
    job = make_job()
    start = claims.store_now()
    run = make_run(job, start.replace(microsecond=0) - timedelta(seconds=2), status=Run.Status.QUEUED, queued_at=start)
    scan_now = claims.store_now()  # the scan's probe
    time.sleep(0.05)
    wave_now = claims.store_now()
    found = _deferred_then_queued_again(run, wave_now, start - timedelta(seconds=1), now=scan_now, advance=True)
    assert found[-2][1] == wave_now


def _deferred_then_queued_again(run: Run, wave_now: datetime, due_at: datetime, **scan: Any) -> list[tuple[str, datetime]]:
    """`run` deferred by a wave whose clock reads `wave_now` (its host's bulkhead full),
    then queued again by a scan (`scan`: scan_once's `now`, `advance`); its timeline
    as (type, at), which ends with the deferral and then the scan's `queued`."""
    got = services._defer_many([(Run.objects.select_related("job").get(pk=run.pk), due_at,
                                 {"host": "127.0.0.1:9", "limit": 1})], wave_now, "bulkhead_wait")
    assert got == {run.pk: "bulkhead_wait"}
    result = scan_once(partitions=range(settings.SCHEDULER_PARTITIONS), publish=False, **scan)
    assert run.pk in result.queued
    found = [(e.type, e.at) for e in timeline_of(run.pk)]
    assert [t for t, _ in found][-2:] == ["bulkhead_wait", "queued"], found
    return found
