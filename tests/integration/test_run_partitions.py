"""In the production layout: the scanner holding partition 0 has a worker make the
runs history's time partitions ahead (runs.retention.keep), and a run that ends
lands in the partition of its time."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from runs import partitions
from runs.models import Run
from tests.factories import drop_time_partitions
from tests.integration.conftest import Api, Stack, wait_for
from tests.target import LoopbackTarget

pytestmark = [
    pytest.mark.integration,
    pytest.mark.zookeeper,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="the history is partitioned on PostgreSQL only"),
]


@pytest.fixture
def no_time_partitions(transactional_db: None) -> Any:
    drop_time_partitions()
    yield
    drop_time_partitions()


def test_the_scanner_has_partitions_made_ahead_and_a_finished_run_lands_in_its_times(
    no_time_partitions: None, stack: Stack, api: Api, target: LoopbackTarget
) -> None:
    width = {"SCHEDULER_RUN_PARTITION_WIDTH": "5m", "SCHEDULER_RUN_PARTITIONS_AHEAD": "2"}
    stack.env.update(width)
    assert partitions.spans() == []
    stack.scanner("scanner-a")
    stack.worker("worker-a")
    made = wait_for(lambda: len(partitions.spans()) >= 3 and partitions.spans(), 60, what="partitions made ahead")
    now = timezone.now()
    assert made[0].start <= now < made[0].end and made[0].end - made[0].start == timedelta(minutes=5)
    assert [s.start for s in made[1:3]] == [made[0].end, made[0].end + timedelta(minutes=5)]

    job = api.create_job(name="lands", delay="1s", target=target.url("/ok"))
    run = wait_for(lambda: Run.objects.filter(job_id=int(job["id"].split("_")[1]), status=Run.Status.SUCCEEDED).first(),
                   60, what="the run to succeed")
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableoid::regclass::text FROM runs WHERE id = %s", [run.pk])
        assert cursor.fetchone()[0] == partitions.span_at(run.scheduled_for, timedelta(minutes=5)).name
