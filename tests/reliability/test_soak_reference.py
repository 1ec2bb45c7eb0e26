"""The soak's reference schedule (bench/soak_actions.py) on made-up histories and run
rows: which times it says were due after edits, pauses and deletes, what it accepts
for each, and which claims it counts as a start while paused or deleted. No
database: the judge reads only what it is given."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from bench.soak_actions import History, Pause, RunFacts, Timing, due_times, judge

T0 = datetime(2026, 12, 1, 10, 0, 30, tzinfo=timezone.utc)
GRACE = 60


def at(minute: int, second: int = 0) -> datetime:
    return datetime(2026, 12, 1, 10, minute, second, tzinfo=timezone.utc)


def cron(since: datetime, expr: str = "* * * * *", window: int = 0) -> Timing:
    return Timing(since, expr, "UTC", None, window, since)


def history(*timings: Timing, misfire: str = "run_once", **more: Any) -> History:
    return History(1, "j", misfire, timings[0].since, list(timings), **more)


def row(t: datetime, *, pk: int | None = None, status: str = "succeeded", claims: list[datetime] | None = None,
        **more: Any) -> RunFacts:
    claims = [t + timedelta(seconds=1)] if claims is None and status == "succeeded" else (claims or [])
    facts: dict[str, Any] = dict(
        pk=pk or t.minute, public_id=f"run_{pk or t.minute}", job_id=1, scheduled_for=t, status=status, held=False,
        is_backfill=False, created=t - timedelta(seconds=50), started=bool(claims), cancelled=None,
        skipped_by_misfire=False, skipped_at=None, was_held=False, deferred_past_cutoff=False,
        claims=[(c, i + 1) for i, c in enumerate(claims)], retries=[],
    )
    facts["ended"] = claims[-1] + timedelta(seconds=1) if status == "succeeded" else None
    facts.update(more)
    return RunFacts(**facts)


def test_after_an_edit_the_times_due_follow_the_new_schedule_from_the_edit_time() -> None:
    h = history(cron(T0), cron(at(3, 10), "*/5 * * * *"))
    times = [t for t, _ in due_times(h, cutoff=at(12))]
    assert times == [at(1), at(2), at(3), at(5), at(10)]


def test_a_time_with_no_run_is_missed_and_one_that_started_is_not() -> None:
    h = history(cron(T0), cron(at(3, 10), "*/5 * * * *"))
    rows = [row(at(1)), row(at(2)), row(at(3)), row(at(10))]  # 10:05 lost (issue 12, defect 1)
    found = judge({1: h}, rows, cutoff=at(12), grace_s=GRACE)
    assert found["due_times"] == 5 and found["due_times_started"] == 4
    assert len(found["missed"]) == 1 and "at 10:05:00: no run" in found["missed"][0]


def test_a_time_that_fell_while_paused_may_be_skipped_on_resume_once_it_is_past_its_grace() -> None:
    pause = Pause(at(1, 30), at(1, 31), resumed=at(5, 0))
    h = history(cron(T0), misfire="skip", pauses=[pause])
    rows = [row(at(1))] + [row(at(m), status="skipped", claims=[], skipped_by_misfire=True, skipped_at=at(5, 1))
                           for m in (2, 3)] + [row(at(m)) for m in (4, 5, 6, 7)]
    found = judge({1: h}, rows, cutoff=at(8), grace_s=GRACE)
    # 10:02 and 10:03 were past their grace at 10:05:01; 10:04 was not, and ran.
    assert found["skipped_after_pause"] == 2 and found["missed"] == []


def test_a_time_skipped_inside_its_grace_is_missed() -> None:
    pause = Pause(at(1, 30), at(1, 31), resumed=at(4, 30))
    h = history(cron(T0), misfire="skip", pauses=[pause])
    rows = [row(at(1)), row(at(2), status="skipped", claims=[], skipped_by_misfire=True, skipped_at=at(4, 31)),
            row(at(3), status="skipped", claims=[], skipped_by_misfire=True, skipped_at=at(4, 31)),
            row(at(4), status="skipped", claims=[], skipped_by_misfire=True, skipped_at=at(4, 31))] \
        + [row(at(m)) for m in (5, 6, 7)]
    found = judge({1: h}, rows, cutoff=at(8), grace_s=GRACE)
    # 10:04 is 31 s old at 10:04:31, inside the 60 s grace: not missed yet, so not to be skipped (defect 6).
    assert [m.split(" at ")[1][:8] for m in found["missed"]] == ["10:04:00"]


def test_under_run_all_every_time_that_fell_while_paused_must_run() -> None:
    pause = Pause(at(1, 30), at(1, 31), resumed=at(5, 0))
    h = history(cron(T0), misfire="run_all", pauses=[pause])
    rows = [row(at(1)), row(at(2), status="skipped", claims=[], skipped_by_misfire=True, skipped_at=at(5, 1)),
            row(at(3)), row(at(4)), row(at(5)), row(at(6))]
    assert len(judge({1: h}, rows, cutoff=at(7), grace_s=GRACE)["missed"]) == 1


def test_times_while_paused_to_the_end_are_not_due_and_a_run_the_pause_held_is_excused() -> None:
    h = history(cron(T0), pauses=[Pause(at(3, 20), at(3, 21))])
    rows = [row(at(1)), row(at(2)), row(at(3), status="scheduled", claims=[], held=True, was_held=True)]
    found = judge({1: h}, rows, cutoff=at(9), grace_s=GRACE)
    assert found["missed"] == [] and found["excused_by_user_action"] == 1 and found["paused_at_end"] == 5


def test_a_deleted_jobs_times_end_at_the_delete_and_its_cancelled_waiting_run_is_excused() -> None:
    h = history(cron(T0), deleted_at=at(3, 5), deleted_took_effect=at(3, 5))
    rows = [row(at(1)), row(at(2)), row(at(3), status="cancelled", claims=[], cancelled=(at(3, 5), "job deleted"))]
    found = judge({1: h}, rows, cutoff=at(9), grace_s=GRACE)
    assert found["due_times"] == 3 and found["missed"] == [] and found["excused_by_user_action"] == 1


def test_a_run_claimed_after_its_job_was_deleted_or_paused_is_counted() -> None:
    deleted = history(cron(T0), deleted_at=at(3, 5), deleted_took_effect=at(3, 6))
    late = row(at(4), pk=99, claims=[at(4, 0)])  # a next run made for a deleted job, and started
    assert len(judge({1: deleted}, [late], cutoff=at(9), grace_s=GRACE)["started_while_paused_or_deleted"]) == 1
    paused = history(cron(T0), pauses=[Pause(at(3, 30), at(3, 31), resumed=at(6, 0))])
    assert len(judge({1: paused}, [row(at(4), claims=[at(4, 1)])], cutoff=at(9),
                     grace_s=GRACE)["started_while_paused_or_deleted"]) == 1


def test_a_run_already_running_when_paused_may_be_taken_over_but_not_retried() -> None:
    paused = history(cron(T0), pauses=[Pause(at(3, 30), at(3, 31), resumed=at(6, 0))])
    taken_over = row(at(3), claims=[at(3, 20), at(3, 40)])  # its worker died mid-call: the attempt goes on
    assert judge({1: paused}, [taken_over], cutoff=at(9), grace_s=GRACE)["started_while_paused_or_deleted"] == []
    retried = row(at(3), claims=[at(3, 20), at(3, 45)], retries=[at(3, 35)])  # a new attempt while paused
    assert len(judge({1: paused}, [retried], cutoff=at(9), grace_s=GRACE)["started_while_paused_or_deleted"]) == 1


def test_a_backfill_held_by_a_pause_must_run_once_the_job_is_resumed() -> None:
    h = history(cron(T0), pauses=[Pause(at(2, 30), at(2, 31), resumed=at(4, 0))])
    backfill = row(at(0), pk=50, status="scheduled", claims=[], held=True, is_backfill=True, created=at(3, 0))
    found = judge({1: h}, [row(at(m)) for m in range(1, 7)] + [backfill], cutoff=at(7), grace_s=GRACE)
    assert found["extra_runs_due"] == 1 and len(found["missed"]) == 1 and "extra run run_50" in found["missed"][0]


def test_a_time_with_no_row_is_missed_even_if_the_job_is_deleted_just_after_unless_its_run_was_in_flight() -> None:
    h = history(cron(T0), deleted_at=at(3, 20), deleted_took_effect=at(3, 20))
    done = [row(at(1)), row(at(2))]  # 10:02 ended at 10:02:02: 10:03's row was owed by 10:03
    assert len(judge({1: h}, done, cutoff=at(9), grace_s=GRACE)["missed"]) == 1
    in_flight = [row(at(1)), row(at(2), status="running", claims=[at(2, 1)])]  # still running at 10:03
    found = judge({1: h}, in_flight, cutoff=at(9), grace_s=GRACE)
    assert found["missed"] == [] and found["excused_by_user_action"] == 1


def test_a_time_the_overlap_policy_skipped_is_accepted_only_while_the_run_before_was_in_flight() -> None:
    h = history(cron(T0, window=20))
    # 10:01's run was claimed at 10:01:15 and ended at 10:02:05 (retries): 10:02 passed in flight.
    long = row(at(1), claims=[at(1, 15), at(1, 40)], ended=at(2, 5))
    skipped = row(at(2), status="skipped", claims=[], skipped_at=at(2, 5), overlapped_by="run_1")
    found = judge({1: h}, [long, skipped, row(at(3))], cutoff=at(4), grace_s=GRACE)
    assert found["skipped_while_in_flight"] == 1 and found["missed"] == []


def test_a_time_skipped_for_a_run_that_was_not_in_flight_is_missed() -> None:
    h = history(cron(T0))
    # The run named in flight had ended at 10:01:02, before 10:02 came: the skip was wrong.
    skipped = row(at(2), status="skipped", claims=[], skipped_at=at(2, 1), overlapped_by="run_1")
    found = judge({1: h}, [row(at(1)), skipped, row(at(3))], cutoff=at(4), grace_s=GRACE)
    assert found["skipped_while_in_flight"] == 0
    assert len(found["missed"]) == 1 and "10:02:00" in found["missed"][0] and "not in flight" in found["missed"][0]
    # A run claimed only after the time passed was not in flight at it either.
    late = row(at(1), claims=[at(2, 10)], ended=at(2, 30))
    found = judge({1: h}, [late, skipped, row(at(3))], cutoff=at(4), grace_s=GRACE)
    assert [m.split(" at ")[1][:8] for m in found["missed"]] == ["10:02:00"]


def test_a_pause_until_a_time_past_the_cutoff_counts_as_paused_to_the_end() -> None:
    # Paused at 10:02:30 until 10:20: at the 10:08 cutoff the scanner had not resumed it.
    h = history(cron(T0), pauses=[Pause(at(2, 30), at(2, 31), resumed=at(20))])
    rows = [row(at(1)), row(at(2))]
    found = judge({1: h}, rows, cutoff=at(8), grace_s=GRACE)
    assert found["missed"] == [] and found["paused_at_end"] == 5  # 10:03 to 10:07


def test_a_retried_dead_run_owes_a_claim_after_the_retry() -> None:
    h = history(cron(T0))
    dead = row(at(1), status="dead", claims=[at(1, 1)])
    retried_again = row(at(2), status="succeeded", claims=[at(2, 1), at(4, 1)])
    found = judge({1: h}, [dead, retried_again, *[row(at(m)) for m in range(3, 8)]], cutoff=at(8), grace_s=GRACE,
                  retried=[(dead.pk, at(3)), (retried_again.pk, at(4))])
    assert found["retried_dead"] == 2 and found["retried_dead_started"] == 1
    assert found["missed"] == [f"job_1 retried {dead.public_id} at 10:03:00: no claim after it (dead)"]


def test_a_retried_run_whose_job_was_paused_at_once_is_excused() -> None:
    h = history(cron(T0), pauses=[Pause(at(3, 5), at(3, 6))])
    dead = row(at(1), status="scheduled", claims=[at(1, 1)], held=True)
    found = judge({1: h}, [dead, row(at(2)), row(at(3))], cutoff=at(8), grace_s=GRACE, retried=[(dead.pk, at(3))])
    assert found["missed"] == [] and found["retried_dead"] == 1 and found["retried_dead_started"] == 0
