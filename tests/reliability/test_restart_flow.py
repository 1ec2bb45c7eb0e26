"""The restart bench's and test's measure of "runs flow again" (bench/restarts.py), on
hand-made records: ten runs due each second, called 0.3 s after their due time,
and one outage."""
from __future__ import annotations

from bench.restarts import Fault, RunRecord, time_to_flow

RATE = 10


def load(seconds: range, outage: tuple[float, float] | None = None,
         stale: int = 0) -> tuple[list[RunRecord], list[tuple[str, int, float]]]:
    """Runs due each second of `seconds`, queued 0.1 s and called 0.3 s after their
    due time; in the `outage` (from, to) nothing is queued or called, and what came due
    is queued and called together at its end. `stale`: so many runs queued before the
    outage whose (prefetched) messages are worked off right after it."""
    records, calls = [], []
    for s in seconds:
        for k in range(RATE):
            key = f"job_{s}_{k}@"
            queued, called = s + 0.1, s + 0.3
            if outage and outage[0] <= queued < outage[1]:
                queued, called = outage[1] - 0.1, outage[1]
            elif outage and k < stale and s == int(outage[0]) - 1:
                called = outage[1] - 0.05  # queued before it, called after it
            records.append(RunRecord(key, float(s), [queued]))
            calls.append((key, 1, called))
    return records, calls


def test_an_outage_is_measured_from_its_start_to_the_first_run_published_after_it_and_the_backlog_gone() -> None:
    records, calls = load(range(80, 130), outage=(100.0, 102.5), stale=3)
    flows = time_to_flow([Fault("pg_fast", 100.0, 101.0)], records, calls, rate=RATE)
    (flow,) = flows["faults"]
    assert flows["lateness_before_faults"]["p99_s"] == 0.3 and flows["late_ok_s"] == 1.3
    assert flow["down_s"] == 1.0
    # The prefetched runs called at 102.45 were published before the outage: they do not count.
    assert flow["first_call_s"] == 2.5
    assert flow["rate_back_s"] == 3.5  # the second from the first call on: the backlog and more
    assert flow["caught_up_s"] == 2.0  # due 100 and 101 late (2.5 and 1.5 s), 102 within 1.3 s again
    assert flow["max_late_s"] == 3.45  # the prefetched ones, due 99
    assert flows["by_kind"]["pg_fast"]["first_call_s"] == {"p50": 2.5, "max": 2.5}


def test_a_run_never_called_leaves_its_fault_without_a_latest_start() -> None:
    records, calls = load(range(80, 130), outage=(100.0, 101.5))
    calls = [c for c in calls if c[0] != "job_105_0@"]
    (flow,) = time_to_flow([Fault("redis_restart", 100.0, 100.4)], records, calls, rate=RATE)["faults"]
    assert flow["first_call_s"] == 1.5
    assert flow["caught_up_s"] == 1.0  # due 100 late 1.5 s, 101 to 103 on time (a miss is the verdict's)
    assert flow["max_late_s"] is None


def test_no_flow_after_the_fault_is_said_as_none_not_as_a_time() -> None:
    records, calls = load(range(80, 100))
    (flow,) = time_to_flow([Fault("pg_kill", 99.5, 101.0)], records, calls, rate=RATE)["faults"]
    assert flow["first_call_s"] is None and flow["rate_back_s"] is None
