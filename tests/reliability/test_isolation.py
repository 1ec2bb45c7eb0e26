"""A hanging target does not take the worker pool hostage: with real processes, runs
to a healthy host due at the same second as a crowd of runs to a hanging host start
on time, because the bulkhead lets the hanging host hold only its share of slots
and the runs over it wait as rows, not in a worker."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from jobs import schedule
from jobs.services import job_create, service_account_ensure
from runs.invariants import timelines
from runs.models import Run, RunEvent
from tests.integration.conftest import Stack, wait_for
from tests.integration.test_due_to_done import _owned
from tests.target import LoopbackTarget

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]
S = Run.Status


def test_runs_to_a_healthy_host_start_within_2s_while_another_host_hangs_30s_on_every_call(stack: Stack) -> None:
    stack.env["SCHEDULER_TARGET_CONCURRENCY"] = "2"
    hanging, healthy = LoopbackTarget().start(), LoopbackTarget().start()
    hanging.delay("/hang", 30)
    try:
        scanner = stack.scanner("scanner-a")
        worker = stack.worker("worker-a", concurrency=4)
        every = set(range(settings.SCHEDULER_PARTITIONS))
        wait_for(lambda: _owned(scanner) == every, 30, what="the scanner to own every partition")
        owner, _ = service_account_ensure(name="isolation")
        due = schedule.round_up_to_second(timezone.now() + timedelta(seconds=4))
        for i in range(8):
            job_create(owner=owner, fields={"name": f"hang{i}", "run_at": due, "target": hanging.url("/hang")})
        for i in range(6):
            job_create(owner=owner, fields={"name": f"ok{i}", "run_at": due, "target": healthy.url(f"/ok{i}")})

        calls = wait_for(lambda: len(healthy.calls()) == 6 and healthy.calls(), 30, what="every healthy run's call")
        late = sorted(round(call.at - due.timestamp(), 2) for call in calls)
        print(f"healthy calls after their due time (s): {late}")
        assert late[-1] <= 2.0, late
        assert len(hanging.calls()) == 2  # the hanging host holds its two slots, no more
        # The six runs over the limit wait as rows (scheduled, or queued again to check), spending no try.
        waiting = Run.objects.filter(job__target__startswith=hanging.url(""), status__in=(S.SCHEDULED, S.QUEUED))
        assert waiting.count() == 6 and all(run.attempt == 0 and run.fence == 0 for run in waiting)
        assert RunEvent.objects.filter(type="bulkhead_wait", run__in=waiting).exists()
        assert timelines() == []
        worker.kill()  # its two calls would hang a graceful shutdown for 30 s
    finally:
        hanging.stop()
        healthy.stop()
