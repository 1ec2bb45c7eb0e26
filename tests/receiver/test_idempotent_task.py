"""`idempotent_task` applies a task's effect once per run and refuses an older fence
(the same rule as idempotent_run: receiver.views.delivery_admit)."""
from __future__ import annotations

from typing import Any

import pytest
from celery.app.task import Context
from django.contrib.auth.models import Group

from receiver.models import Delivery
from receiver.tasks import MissingRunHeaders, idempotent_task

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]
KEY = "job_7@2026-10-28T20:30:00Z"


def made() -> list[str]:
    """The groups the tasks made (the effect; the migrations' own groups left out)."""
    return list(Group.objects.filter(name__startswith="t-").order_by("pk").values_list("name", flat=True))


class BoundTask:
    """What Celery hands a bound task as `self`: its request is Celery's own Context,
    on which a message's custom headers are attributes."""

    def __init__(self, **headers: Any) -> None:
        self.request = Context(headers)


@idempotent_task
def make_group(self: Any, name: str) -> int:
    return Group.objects.create(name=name).pk


@idempotent_task
def fails(self: Any) -> None:
    Group.objects.create(name="t-half-done")
    raise RuntimeError("the task failed")


def test_the_same_key_twice_applies_the_task_once() -> None:
    first = make_group(BoundTask(idempotency_key=KEY, fence_token=1), "t-report")
    second = make_group(BoundTask(idempotency_key=KEY, fence_token=2), "t-report-again")
    assert isinstance(first, int) and second is None
    assert made() == ["t-report"]
    delivery = Delivery.objects.get(key=KEY)
    assert (delivery.applied, delivery.highest_fence, delivery.calls) == (True, 2, 2)


def test_an_older_fence_is_refused_and_the_task_does_not_run() -> None:
    assert fails is not None
    with pytest.raises(RuntimeError):
        fails(BoundTask(idempotency_key=KEY, fence_token=5))
    assert make_group(BoundTask(idempotency_key=KEY, fence_token=4), "t-late") is None
    assert not made()
    assert Delivery.objects.get(key=KEY).highest_fence == 5


def test_a_failed_task_leaves_no_effect_and_the_next_try_applies() -> None:
    with pytest.raises(RuntimeError):
        fails(BoundTask(idempotency_key=KEY, fence_token=1))
    assert not made()
    assert make_group(BoundTask(idempotency_key=KEY, fence_token=2), "t-second-try") is not None
    assert made() == ["t-second-try"]


def test_fence_tokens_sent_as_strings_are_read_as_numbers() -> None:
    make_group(BoundTask(idempotency_key=KEY, fence_token="10"), "t-a")
    assert make_group(BoundTask(idempotency_key=KEY, fence_token="9"), "t-b") is None
    assert Delivery.objects.get(key=KEY).highest_fence == 10


@pytest.mark.parametrize("headers", [{}, {"idempotency_key": KEY}, {"fence_token": 1}, {"idempotency_key": KEY,
                                                                                       "fence_token": "x"}])
def test_a_message_without_the_run_headers_is_refused(headers: dict[str, Any]) -> None:
    with pytest.raises(MissingRunHeaders):
        make_group(BoundTask(**headers), "t-x")
    assert not made() and not Delivery.objects.exists()
