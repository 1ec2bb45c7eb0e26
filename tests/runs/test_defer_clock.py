"""A worker's deferral (bulkhead full, breaker open) that waits on another writer's
row lock is stamped after that wait, not before it (found by the soak under load on
RabbitMQ: bulkhead_wait events 3 to 5 s before the requeue they waited on)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction

from runs import claims, events, services
from runs.models import Run, RunEvent
from tests.factories import make_job, make_run

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
