"""The receiver helper applies a run's effect once and refuses an older fence."""
from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Group
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory

from receiver.models import Delivery
from receiver.views import idempotent_run

pytestmark = pytest.mark.django_db
KEY = "job_7@2026-10-28T20:30:00Z"


@idempotent_run
def make_group(request: HttpRequest) -> HttpResponse:
    # The effect: a row in the target's own database (a Group stands in for "a report").
    group = Group.objects.create(name=json.loads(request.body)["name"])
    return JsonResponse({"created": group.pk}, status=201)


@idempotent_run
def always_fails(request: HttpRequest) -> HttpResponse:
    Group.objects.create(name="half-done")
    return HttpResponse("busy", status=503)


def call(view: object, key: str = KEY, fence: int = 1, name: str = "report") -> HttpResponse:
    request = RequestFactory().post(
        "/hook", data=json.dumps({"name": name}), content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key, HTTP_X_FENCE_TOKEN=str(fence),
    )
    return view(request)  # type: ignore[operator]


def test_the_same_key_twice_applies_the_effect_once_and_replays_the_answer() -> None:
    first = call(make_group, fence=1)
    second = call(make_group, fence=2)  # a retry after a lost answer, under a newer lease
    assert first.status_code == 201 and second.status_code == 201
    assert second.content == first.content and second["Idempotent-Replay"] == "true"
    assert Group.objects.filter(name="report").count() == 1
    assert Delivery.objects.get(key=KEY).calls == 2


def test_a_lower_fence_after_a_higher_one_is_refused() -> None:
    assert call(make_group, fence=5).status_code == 201
    late = call(make_group, fence=4)
    assert late.status_code == 409
    assert b"older" in late.content
    assert Group.objects.filter(name="report").count() == 1


def test_a_lower_fence_is_refused_even_before_anything_was_applied() -> None:
    assert call(always_fails, fence=3).status_code == 503
    assert call(make_group, fence=2).status_code == 409
    assert not Group.objects.filter(name="report").exists()


def test_a_failed_try_leaves_no_effect_and_a_later_try_applies() -> None:
    assert call(always_fails, fence=1).status_code == 503
    assert not Group.objects.filter(name="half-done").exists()
    assert call(make_group, fence=2).status_code == 201
    assert Group.objects.filter(name="report").count() == 1


def test_different_keys_each_apply() -> None:
    call(make_group, key="job_7@2026-10-28T20:30:00Z", name="a")
    call(make_group, key="job_7@2026-10-29T20:30:00Z", name="b")
    assert set(Group.objects.filter(name__in=["a", "b", "report"]).values_list("name", flat=True)) == {"a", "b"}


@pytest.mark.parametrize("headers", [{}, {"HTTP_IDEMPOTENCY_KEY": KEY}, {"HTTP_IDEMPOTENCY_KEY": KEY, "HTTP_X_FENCE_TOKEN": "x"}])
def test_a_call_without_key_or_fence_is_refused(headers: dict[str, str]) -> None:
    request = RequestFactory().post("/hook", data="{}", content_type="application/json", **headers)
    assert make_group(request).status_code == 400
    assert not Delivery.objects.exists()
