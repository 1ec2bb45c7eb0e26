"""A service's share of the scanner's queue (SCHEDULER_SERVICE_QUEUED).

The scan reads due runs in due order, and SCHEDULER_MAX_QUEUED bounds what waits in the
broker. One service's burst (thousands of runs due at one instant) used to fill that
room, and every other service's run due a moment later waited in the store until the
whole burst had been queued. Past its share, a service's runs are stepped over and the
others' are queued in the same scan; its own runs wait behind it, in the store.

Real PostgreSQL, the real scan (scanners.scan.scan_once); the broker is left out
(publish=False): what is queued is the store's `queued`.
"""
from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from jobs.models import Job
from jobs.services import service_account_ensure
from runs import claims
from runs.models import Run
from scanners import shares
from scanners.scan import scan_once
from scanners.shares import SLOW_LANE, ShareFloors
from tests.factories import make_job, make_run

pytestmark = [pytest.mark.django_db]
S = Run.Status
BURST = 1_500


def burst_and_neighbour() -> tuple[int, Run]:
    """Alpha's BURST runs due a second ago (one job's, as a backfill makes them), beta's
    one run due now: after all of them in due order."""
    alpha, _ = service_account_ensure(name="alpha")
    beta, _ = service_account_ensure(name="beta")
    now = claims.store_now()
    job = make_job(alpha, name="burst")
    Run.objects.bulk_create(Run(job=job, scheduled_for=now - timedelta(seconds=1, microseconds=i),
                                due_at=now - timedelta(seconds=1), partition=job.pk % 16, is_backfill=True)
                            for i in range(BURST))
    neighbour = make_job(beta, name="neighbour")
    run = Run.objects.create(job=neighbour, scheduled_for=now, due_at=now, partition=neighbour.pk % 16)
    return job.pk, run


def queued_of(job_id: int) -> int:
    return Run.objects.filter(job_id=job_id, status=S.QUEUED).count()


@pytest.mark.embedded
@pytest.mark.parametrize("share", [200, 0])
def test_past_its_share_a_services_burst_is_stepped_over_and_anothers_run_is_queued_in_the_same_scan(
    share: int,
) -> None:
    burst, neighbour = burst_and_neighbour()
    with override_settings(SCHEDULER_SERVICE_QUEUED=share, SCHEDULER_MAX_QUEUED=1_000, SCHEDULER_SCAN_BATCH=100):
        floors: dict = {}
        result = scan_once(partitions=list(range(16)), publish=False, floors=floors, share_floors=ShareFloors())
    if share:
        # The neighbour's run is queued in the burst's first scan; the burst stops at its
        # share, give or take a scan batch, and waits in the store.
        assert Run.objects.get(pk=neighbour.pk).status == S.QUEUED
        assert share <= queued_of(burst) <= share + 100
        assert result.shared_out
        # The floors stay below the burst's waiting runs: the next scan (the share free
        # again once workers have taken the queued ones) reads them from there.
        Run.objects.filter(job_id=burst, status=S.QUEUED).update(status=S.SUCCEEDED)
        with override_settings(SCHEDULER_SERVICE_QUEUED=share, SCHEDULER_MAX_QUEUED=1_000, SCHEDULER_SCAN_BATCH=100):
            scan_once(partitions=list(range(16)), publish=False, floors=floors, share_floors=ShareFloors())
        assert share <= queued_of(burst) <= share + 100
    else:
        # Without a share the burst fills SCHEDULER_MAX_QUEUED and the neighbour waits.
        assert queued_of(burst) == 1_000
        assert Run.objects.get(pk=neighbour.pk).status == S.SCHEDULED
        assert not result.shared_out


def test_a_service_is_held_to_its_share_while_another_has_jobs_and_not_when_it_is_alone() -> None:
    """With room under SCHEDULER_MAX_QUEUED and no other service's run due, a scan
    still stops a service at its share while another service has jobs (the share is
    what waits in the broker ahead of their runs to come). The scan says so
    (`shared_out`), and the scanner scans again a gap later, not an interval later
    (wakeups.Pacer), queueing more as workers take the queued. A service alone in the
    store has no neighbour to give way to: its scans fill the room, without counting
    by service or stepping over its runs (shares.several_services)."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's due read")
    burst, _ = burst_and_neighbour()
    Run.objects.exclude(job_id=burst).delete()
    with override_settings(SCHEDULER_SERVICE_QUEUED=300, SCHEDULER_MAX_QUEUED=1_000, SCHEDULER_SCAN_BATCH=100):
        result = scan_once(partitions=list(range(16)), publish=False, floors={}, share_floors=ShareFloors())
    assert 300 <= queued_of(burst) <= 400
    assert result.shared_out

    Job.objects.exclude(pk=burst).delete()
    shares.forget_services()
    with override_settings(SCHEDULER_SERVICE_QUEUED=300, SCHEDULER_MAX_QUEUED=1_000, SCHEDULER_SCAN_BATCH=100):
        result = scan_once(partitions=list(range(16)), publish=False, floors={}, share_floors=ShareFloors())
    assert queued_of(burst) == 1_000
    assert not result.shared_out


@pytest.fixture
def run_queue() -> Iterator[tuple[Any, str, str]]:
    """The run queue's lanes on the test's own Redis database, emptied before and after:
    (client, the fast lane's key, the slow lane's key)."""
    if not settings.CELERY_BROKER_URL.startswith("redis"):
        pytest.skip("reads the Redis run queue")
    import redis

    from scheduler_project.celery import app

    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    with app.connection_for_write() as conn:
        slow_key = conn.default_channel._q_for_pri(queue, SLOW_LANE)
    assert slow_key != queue
    client.delete(queue, slow_key)
    yield client, queue, slow_key
    client.delete(queue, slow_key)


def _ids(client: Any, key: str) -> list[int]:
    return [run_id for raw in reversed(client.lrange(key, 0, -1))
            for run_id in json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0]]


def test_past_its_fast_lane_a_services_runs_go_on_the_slow_lane_and_anothers_are_read_first(
    run_queue: tuple[Any, str, str],
) -> None:
    """Its share is what may wait in the broker; of that, all but a message's worth goes
    on the slow lane (a broker priority), so another service's run published after them
    is read before them. The worker's read is kombu's: the lowest priority step first."""
    client, fast_key, slow_key = run_queue
    burst, neighbour = burst_and_neighbour()
    with override_settings(SCHEDULER_SERVICE_QUEUED=1_000, SCHEDULER_MAX_QUEUED=2_000, SCHEDULER_SCAN_BATCH=100,
                           SCHEDULER_DISPATCH_BATCH=200, SCHEDULER_TARGET_CONCURRENCY=100):
        scan_once(partitions=list(range(16)), publish=True, floors={}, share_floors=ShareFloors())
    fast, slow = _ids(client, fast_key), _ids(client, slow_key)
    burst_ids = set(Run.objects.filter(job_id=burst).values_list("pk", flat=True))
    # The burst's first 200 on the fast lane (no count before the scan: from none), the
    # rest of its share on the slow one; the neighbour's run on the fast lane.
    assert len([i for i in fast if i in burst_ids]) == 200
    assert len(slow) == 1_000 - 200 and set(slow) <= burst_ids
    assert neighbour.pk in fast
    from scheduler_project.celery import app

    # A worker's read: the fast lane's messages, the neighbour's among them, before any slow one.
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        order: list[int] = []
        while len(order) < len(fast) + 1:
            message = channel.basic_get(settings.CELERY_TASK_DEFAULT_QUEUE, no_ack=True)
            assert message is not None
            order += message.decode()[0][0]
    assert neighbour.pk in order[:len(fast)]
    assert order[len(fast)] in slow


@pytest.mark.django_db(transaction=True)
def test_a_stepping_read_leaves_the_share_floor_below_a_run_it_could_not_lock() -> None:
    """Alpha holds its share, so the scan steps over its runs. Beta's run is locked by
    another transaction (a worker's deferral, a requeue) while the scan reads: not
    queued, and the share floor stays below it, so the next stepping read takes it
    without waiting for a floor drop. Moving the floor over every run read, as a plain
    read does, left it behind the share floor until the share floors were dropped."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's due read and row locks")
    import psycopg

    from scanners.wakeups import own_connection_params

    alpha, _ = service_account_ensure(name="alpha")
    beta, _ = service_account_ensure(name="beta")
    now = claims.store_now()
    first = make_job(alpha, name="a1")
    part = first.pk % 16
    make_run(first, now - timedelta(seconds=20), partition=part)
    make_run(make_job(alpha, name="a2"), now - timedelta(seconds=19), partition=part)
    held = make_run(make_job(beta, name="b1"), now - timedelta(seconds=18), partition=part)
    share_floors, floors = ShareFloors(), {}

    def scan() -> list[int]:
        return scan_once(partitions=[part], now=claims.store_now(), publish=False, floors=floors,
                         share_floors=share_floors).queued

    with override_settings(SCHEDULER_SERVICE_QUEUED=1, SCHEDULER_MAX_QUEUED=100, SCHEDULER_SCAN_BATCH=1,
                           SCHEDULER_LOOKAHEAD=1.0):
        params = own_connection_params(connection.get_connection_params(), "share-test", "lock")
        with psycopg.connect(**params) as other:
            other.execute("SELECT 1 FROM runs WHERE id = %s FOR UPDATE", (held.pk,))
            assert len(scan()) == 1  # alpha's first: one a batch, then alpha holds its share
            assert scan() == []  # stepping over alpha's; beta's is locked by the other transaction
            assert share_floors.at.get(part, claims.NO_FLOOR) < (held.due_at, held.pk)
            other.rollback()
        assert scan() == [held.pk]


def test_the_share_floors_outlive_the_timed_floor_drop_and_go_with_missed_notifications() -> None:
    """The scanner drops its floors every FLOORS_DROP_EVERY seconds (a plain read's lock
    may have passed a run); the share floors then stay, and go on their own timer
    (SHARE_FLOORS_DROP_EVERY) or when notifications may have been missed. Each clear
    costs the next stepping read a walk over the stepped-over backlog: at every floor
    drop, that was a third of the store's CPU at the top rate."""
    from scanners.management.commands.scanner import Command
    from scanners.wakeups import FLOORS_DROP_EVERY

    key = (claims.store_now(), 7)
    missed = [False]
    command = Command.__new__(Command)
    command.listener = type("Notified", (), {"take_lowered": lambda self: (missed[0], {})})()
    command.floors, command.share_floors = {3: key}, ShareFloors(at={3: key})
    command.share_floors.cleared_at = 1_000.0
    command.floors_dropped_at = 1_000.0

    def turn(at: float) -> None:
        with mock.patch("time.monotonic", return_value=at):
            command._lower_floors(False)

    turn(1_000.0 + FLOORS_DROP_EVERY)
    assert command.floors == {} and command.share_floors.at == {3: key}
    turn(1_000.0 + shares.SHARE_FLOORS_DROP_EVERY)
    assert command.share_floors.at == {}
    command.share_floors.at = {3: key}
    missed[0] = True
    turn(1_000.0 + shares.SHARE_FLOORS_DROP_EVERY + 1)
    assert command.share_floors.at == {}


def test_the_share_floors_hold_while_more_services_are_stepped_over_and_go_when_one_is_not() -> None:
    """Valid for the set of services stepped over and any set that holds it: a run of a
    service no longer stepped over may wait below them."""
    key = (claims.store_now(), 7)
    floors = ShareFloors(skipping=[1], at={3: key})
    assert floors.after([1, 2], {})[3] == key
    assert floors.after([1, 2], {}) == {3: key}
    assert floors.after([2], {}) == {}
    assert floors.at == {}
