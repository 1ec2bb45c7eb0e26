"""Where features meet: a deleted job never blocks a resume, a retention prune never
takes the timeline of a run reopened while it runs, a run moved back among the open
runs wakes its scanner with its due time.

Real PostgreSQL, the real scanner's scan and the store's own triggers.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import IntegrityError, transaction
from django.test import override_settings

from jobs.models import Job
from jobs.services import job_create, job_delete, job_pause
from scanners.probe import next_work
from scanners.scan import scan_once
from tests.factories import utc

pytestmark = pytest.mark.django_db
ALL = frozenset(range(16))
T0 = utc("2026-10-28T20:00:00Z")


def paused_until(owner: Any, name: str, until: Any) -> Job:
    job = job_create(owner=owner, fields={"name": name, "schedule": "0 3 * * *", "target": "http://127.0.0.1:9/h"},
                     now=T0)
    job_pause(job=job, now=T0)
    Job.objects.filter(pk=job.pk).update(paused_until=until)
    job.refresh_from_db()
    return job


@pytest.mark.embedded
@override_settings(SCHEDULER_SCAN_BATCH=3)
def test_deleted_jobs_paused_until_a_time_never_keep_a_live_jobs_later_resume_from_the_scanner(service: Any) -> None:
    # A batch's worth of deleted jobs whose resume time came first, then a live one.
    for i in range(3):
        job_delete(job=paused_until(service.user, f"gone-{i}", T0 + timedelta(minutes=1)), now=T0)
    live = paused_until(service.user, "live", T0 + timedelta(minutes=2))

    result = scan_once(partitions=ALL, now=T0 + timedelta(minutes=3), publish=False)

    assert result.resumed == [live.pk]
    live.refresh_from_db()
    assert (live.paused, live.paused_until) == (False, None)
    # And nothing is left for the probe to call due: the scanner sleeps.
    assert next_work(partitions=sorted(ALL)).resume is None
    assert Job.objects.filter(state=Job.State.DELETED, paused_until__isnull=False).count() == 0


@pytest.mark.embedded
def test_the_store_refuses_a_deleted_job_that_keeps_a_resume_time(service: Any) -> None:
    job = paused_until(service.user, "gone", T0 + timedelta(minutes=1))
    job_delete(job=job, now=T0)
    with pytest.raises(IntegrityError), transaction.atomic():
        Job.objects.filter(pk=job.pk).update(paused_until=T0 + timedelta(hours=1))
