"""A worker's deferral (bulkhead full, breaker open) that waits on a scan's row lock
is not stamped before what that scan wrote (found by the soak under load on
RabbitMQ: bulkhead_wait events 3 to 5 s before the requeue they waited on)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

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
def test_a_deferral_that_waited_on_a_row_lock_is_stamped_after_the_wait() -> None:
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
    stale = claims.store_now()  # the wave's clock, read before the deferral waits
    got = services._defer(Run.objects.select_related("job").get(pk=run.pk), stale,
                          stale + timedelta(seconds=5), "bulkhead_wait", host="127.0.0.1:9", limit=1)
    thread.join(10)
    assert got == "bulkhead_wait"
    waited = RunEvent.objects.get(run_id=run.pk, type="bulkhead_wait")
    requeued = RunEvent.objects.get(run_id=run.pk, type="requeued")
    assert requeued.at == released["at"]
    assert waited.at >= requeued.at, (waited.at, requeued.at)
    assert waited.at - stale >= timedelta(seconds=HOLD * 0.9)



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
    got = services._defer(Run.objects.select_related("job").get(pk=run.pk), wave_now,
                          scan_now - timedelta(seconds=1), "bulkhead_wait", host="127.0.0.1:9", limit=1)
    assert got == "bulkhead_wait"
    result = scan_once(partitions=range(settings.SCHEDULER_PARTITIONS), now=scan_now, publish=False)
    assert run.pk in result.queued
    found = [(e.type, e.at) for e in timeline_of(run.pk)]
    assert [t for t, _ in found][-2:] == ["bulkhead_wait", "queued"], found
    assert found[-2][1] == wave_now
