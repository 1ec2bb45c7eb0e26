"""The bulkhead: calls in flight to one target host are capped across all workers,
and a run over the cap waits as a row, spending no try and holding no worker."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from runs import bulkhead
from runs.models import Run, TargetSlot
from runs.services import run_execute
from tests.factories import make_job, make_run, entry, timeline_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded]
S = Run.Status
LEASE = timedelta(seconds=60)
HOST = "hooks.example.test:8443"


@pytest.fixture(autouse=True, params=["database", "redis"])
def slot_store(request: pytest.FixtureRequest) -> object:
    """Every test against both stores: rows in the database, and Redis's sorted sets."""
    if request.param == "redis" and not settings.CELERY_BROKER_URL.startswith("redis"):
        pytest.skip("no Redis in the embedded layout")
    with override_settings(SCHEDULER_BULKHEAD=request.param, SCHEDULER_BULKHEAD_PREFIX="test:bulkhead:"):
        clear_redis_slots()
        yield request.param
        clear_redis_slots()


def clear_redis_slots() -> None:
    if settings.SCHEDULER_BULKHEAD == "redis":
        client = bulkhead.store().client  # type: ignore[attr-defined]
        for key in client.scan_iter(match=f"{settings.SCHEDULER_BULKHEAD_PREFIX}*"):
            client.delete(key)


def holders(host: str | None = None) -> list[str]:
    """Who holds a slot now, in whichever store is in use."""
    if settings.SCHEDULER_BULKHEAD == "database":
        rows = TargetSlot.objects.all() if host is None else TargetSlot.objects.filter(host=host)
        return sorted(rows.values_list("holder", flat=True))
    client = bulkhead.store().client  # type: ignore[attr-defined]
    keys = list(client.scan_iter(match=f"{settings.SCHEDULER_BULKHEAD_PREFIX}*"))
    if host is not None:
        keys = [k for k in keys if k.decode().endswith(host)]
    return sorted(m.decode() for k in keys for m in client.zrange(k, 0, -1))


def queued(target: str = f"http://{HOST}/hook") -> Run:
    now = timezone.now().replace(microsecond=0)
    return make_run(make_job(target=target), now, status=S.QUEUED, queued_at=now)


@override_settings(SCHEDULER_TARGET_CONCURRENCY=2)
def test_a_host_holds_at_most_its_limit_of_slots() -> None:
    now = timezone.now()
    first = bulkhead.take(host=HOST, holder="1/w", now=now, lease=LEASE)
    second = bulkhead.take(host=HOST, holder="2/w", now=now, lease=LEASE)
    assert first and second and first.pk != second.pk
    assert holders(HOST) == ["1/w", "2/w"]
    assert bulkhead.take(host=HOST, holder="3/w", now=now, lease=LEASE) is None
    assert bulkhead.take(host="other.example.test", holder="4/w", now=now, lease=LEASE) is not None
    bulkhead.release(first)
    assert bulkhead.take(host=HOST, holder="3/w", now=now, lease=LEASE) is not None


@override_settings(SCHEDULER_TARGET_CONCURRENCY=1)
def test_a_slot_whose_holder_died_frees_itself_when_its_lease_runs_out() -> None:
    now = timezone.now()
    dead = bulkhead.take(host=HOST, holder="1/died", now=now, lease=LEASE)
    assert dead is not None
    assert bulkhead.take(host=HOST, holder="2/w", now=now + LEASE - timedelta(seconds=1), lease=LEASE) is None
    assert bulkhead.take(host=HOST, holder="2/w", now=now + LEASE + timedelta(seconds=1), lease=LEASE) is not None
    # The dead holder's late release or heartbeat cannot touch the new holder's slot.
    bulkhead.release(dead)
    assert not bulkhead.extend(dead, now=now, lease=LEASE)
    assert holders() == ["2/w"]


@override_settings(SCHEDULER_TARGET_CONCURRENCY=1, SCHEDULER_BULKHEAD_WAIT=1)
def test_a_run_over_the_limit_goes_back_to_scheduled_without_spending_a_try() -> None:
    busy = bulkhead.take(host=HOST, holder="0/elsewhere", now=timezone.now(), lease=LEASE)
    run = queued()
    before = timezone.now()
    assert run_execute(run_id=run.pk, worker="w1") == "bulkhead_wait"
    run.refresh_from_db()
    assert run.status == S.SCHEDULED and run.attempt == 0 and run.fence == 0 and run.started_at is None
    assert before < run.due_at <= timezone.now() + timedelta(seconds=1.5)
    wait = entry(run, "bulkhead_wait")
    assert wait.detail["host"] == HOST and wait.detail["limit"] == 1
    assert holders() == [busy.holder]  # nothing left behind


@override_settings(SCHEDULER_TARGET_CONCURRENCY=1)
def test_a_full_host_does_not_hold_runs_to_another_host() -> None:
    bulkhead.take(host=HOST, holder="0/elsewhere", now=timezone.now(), lease=LEASE)
    run = queued("http://127.0.0.1:9/nothing-listens")  # another host: called (and refused)
    assert run_execute(run_id=run.pk, worker="w1") == "retry_scheduled"
    run.refresh_from_db()
    assert run.attempt == 1 and not holders("127.0.0.1:9")


def test_a_run_someone_holds_is_neither_deferred_nor_given_a_slot() -> None:
    run = queued()
    Run.objects.filter(pk=run.pk).update(status=S.RUNNING, lease_expires_at=timezone.now() + LEASE, fence=1)
    assert run_execute(run_id=run.pk, worker="w2") == "not_claimed"
    run.refresh_from_db()
    assert run.status == S.RUNNING and not holders() and not timeline_of(run)
