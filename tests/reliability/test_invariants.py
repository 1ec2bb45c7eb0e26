"""The invariants the soak and the tests check, on hand-made timelines."""
from __future__ import annotations

from datetime import timedelta

import pytest

from runs.invariants import Applied, Event, effects_applied_once, one_open_run_per_job, timeline_violations
from runs.models import Run
from tests.factories import make_job, make_run, utc

T0 = utc("2026-10-28T20:30:00Z")


def timeline(*steps: tuple[str, dict[str, object]]) -> list[Event]:
    return [Event(i + 1, T0 + timedelta(seconds=i), type_, detail) for i, (type_, detail) in enumerate(steps)]


HANDOVER = [
    ("scheduled", {}), ("queued", {}), ("claimed", {"fence": 1, "attempt": 1}),
    ("lease_expired", {}), ("claimed", {"fence": 2, "attempt": 2}),
    ("target_answered", {"fence": 2, "status": 200}), ("succeeded", {"fence": 2}), ("next_run_created", {}),
    # The first holder wakes up: its answer is recorded, its outcome refused.
    ("target_answered", {"fence": 1, "status": 200}), ("stale_write_rejected", {"fence": 1}),
]


def test_a_handover_with_a_refused_late_write_is_in_order() -> None:
    assert timeline_violations("succeeded", timeline(*HANDOVER)) == []


def test_an_outcome_written_under_a_superseded_fence_is_a_violation() -> None:
    steps = HANDOVER[:5] + [("target_answered", {"fence": 1, "status": 200}), ("succeeded", {"fence": 1}),
                            ("target_answered", {"fence": 2, "status": 200}), ("stale_write_rejected", {"fence": 2})]
    problems = timeline_violations("succeeded", timeline(*steps))
    assert any("succeeded 7 written under fence 1, but fence 2 held the lease" in p for p in problems)
    assert any("refused fence 2, the holder of a live lease" in p for p in problems)


def test_claims_must_raise_the_fence_and_the_attempt() -> None:
    steps = [("claimed", {"fence": 2, "attempt": 1}), ("claimed", {"fence": 2, "attempt": 1})]
    assert len(timeline_violations("running", timeline(*steps))) == 2


def test_a_terminal_run_ends_with_its_terminal_event() -> None:
    steps = [("scheduled", {}), ("queued", {}), ("claimed", {"fence": 1, "attempt": 1}), ("succeeded", {"fence": 1}),
             ("queued", {})]
    assert timeline_violations("succeeded", timeline(*steps)) == [
        "status succeeded but its last lifecycle event is queued"
    ]


def test_time_going_backwards_beyond_the_slack_is_a_violation() -> None:
    events = timeline(("scheduled", {}), ("queued", {}))
    events[1] = Event(2, T0 - timedelta(seconds=10), "queued", {})
    assert len(timeline_violations("queued", events)) == 1


def test_an_effect_applied_twice_is_a_violation() -> None:
    applied = [Applied("job_1@2026-10-28T20:30:00Z", 1), Applied("job_1@2026-10-28T20:30:00Z", 2),
               Applied("job_1@2026-10-28T20:31:00Z", 1)]
    assert effects_applied_once(applied) == ["job_1@2026-10-28T20:30:00Z applied 2 times, under fences [1, 2]"]


@pytest.mark.django_db
def test_one_open_run_per_job_holds_on_a_fresh_store() -> None:
    job = make_job()
    make_run(job, T0)
    make_run(job, T0 - timedelta(minutes=1), status=Run.Status.SUCCEEDED)
    assert one_open_run_per_job() == []


def test_a_late_write_after_the_scanner_took_the_lease_back_is_refused_in_order() -> None:
    # The holder froze past its lease; the scanner took the run back before anyone claimed it again.
    steps = HANDOVER[:4] + [("target_answered", {"fence": 1, "status": 200}), ("stale_write_rejected", {"fence": 1}),
                            ("queued", {}), ("claimed", {"fence": 2, "attempt": 2}), ("succeeded", {"fence": 2})]
    assert timeline_violations("succeeded", timeline(*steps)) == []


def test_a_holder_whose_lease_was_taken_back_may_write_late_stamped_by_its_own_earlier_reading() -> None:
    # A worker cut off from PostgreSQL mid-call (the soak under load, 2026-12-02): its
    # call answered, it read the store's clock, then its outcome write waited out the
    # cut; meanwhile the scanner took the lease back. Its answer and its refused
    # outcome come after `lease_expired`, stamped seconds before it.
    steps = HANDOVER[:4] + [("target_answered", {"fence": 1, "status": 200}), ("stale_write_rejected", {"fence": 1}),
                            ("queued", {}), ("claimed", {"fence": 2, "attempt": 2}), ("succeeded", {"fence": 2})]
    events = timeline(*steps)
    for i in (4, 5):  # 4 s before the lease_expired written before them
        events[i] = Event(events[i].id, events[3].at - timedelta(seconds=4), events[i].type, events[i].detail)
    assert timeline_violations("succeeded", events) == []
    # A live lease's holder is no such exception: the same late stamps without the
    # lease taken back are the clock going backwards.
    live = [e for e in events if e.type != "lease_expired"]
    assert any("target_answered" in p and "is before" in p for p in timeline_violations("succeeded", live[:5]))
    # Nor is an event of the store's own (no fence) after the lease was taken back.
    late_queue = events[:4] + [Event(5, events[3].at - timedelta(seconds=4), "queued", {})]
    assert any("queued" in p and "is before" in p for p in timeline_violations("queued", late_queue))


def test_a_dead_run_requeued_by_an_operator_goes_on_counting_attempts_with_a_higher_fence() -> None:
    steps = [("claimed", {"fence": 1, "attempt": 1}), ("dead", {"fence": 1}),
             ("requeued", {"previous_attempts": 1}), ("queued", {}), ("claimed", {"fence": 2, "attempt": 2}),
             ("succeeded", {"fence": 2})]
    assert timeline_violations("succeeded", timeline(*steps)) == []
    # Counting again from 1 after a requeue would make X-Attempt go back: caught.
    restarted = [*steps[:4], ("claimed", {"fence": 2, "attempt": 1}), ("succeeded", {"fence": 2})]
    assert any("attempt 1 after attempt 1" in p for p in timeline_violations("succeeded", timeline(*restarted)))


@pytest.mark.django_db
def test_an_allow_jobs_runs_in_flight_beside_its_waiting_run_are_not_a_second_open_run() -> None:
    from django.db import IntegrityError, transaction

    job = make_job(overlap="allow")
    for minutes in (2, 1):  # claimed, detached: in flight beside the waiting run
        make_run(job, T0 - timedelta(minutes=minutes), status=Run.Status.RUNNING, detached=True, started_at=T0)
    make_run(job, T0)
    assert one_open_run_per_job() == []
    # A second waiting run is still refused by the store (runs_one_open_run_per_job).
    with pytest.raises(IntegrityError), transaction.atomic():
        make_run(job, T0 + timedelta(minutes=1))
