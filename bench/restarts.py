"""PostgreSQL and Redis restarted under a steady offered load, and the time until runs
flow again: what the restart bench (`bench/run.py restarts`) and the CI test
(tests/reliability/test_restarts.py) share.

    runs = offered_load(target.url(), rate=200, first_at=..., seconds=180)
    faults = inject(plan(3), pg, redis, target, rate=200, gap=12, warmup=20)
    flows = time_to_flow(faults, run_records(runs), target.received(), rate=200)

The faults, on private servers only (tests/pgpair.PgServer, bench/soak_stack.PrivateRedis):

  pg_fast        PostgreSQL `pg_ctl stop -m fast` (clients cut off, a checkpoint), then a start
  pg_kill        `kill -9` of the postmaster (its backends exit when they see it gone), then a
                 start: crash recovery from the WAL
  redis_restart  Redis (no persistence) stopped and started again, empty: every message it
                 held is lost, every client's connection cut

The time to flow is measured after the fact, from the target's record of every call
and the store's events, so nothing polls the store while it is down. For each fault,
from the moment it began:

  down_s        until the server accepted connections again (the restart itself)
  first_call_s  until the first call of a run queued (or published again) after it began:
                the whole path works again, store, scanner, broker and worker
  rate_back_s   until the end of the first whole second, from that first call on, in which
                runs started at 90% of the offered rate or more
  caught_up_s   until the first due second from which runs start on time again (within
                `late_ok` of their due time, three due seconds in a row): the backlog is gone
  max_late_s    the latest start among runs due from 5 s before it to 5 s before the next
"""
from __future__ import annotations

import bisect
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from bench.harness import percentile

KINDS = ("pg_fast", "pg_kill", "redis_restart")
RATE_BACK = 0.9  # of the offered rate
BASELINE_S = 10  # seconds of steady state before the first fault, for the usual lateness
DUE_SECONDS_ON_TIME = 3


class Calls(Protocol):  # tests/counting_target.CountingTarget
    def received(self) -> list[tuple[str, int, float]]: ...


@dataclass
class Fault:
    kind: str
    began: float
    up: float

    @property
    def down_s(self) -> float:
        return self.up - self.began


def plan(rounds: int, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """Each kind once a round, in the same order every round."""
    return [kind for _ in range(rounds) for kind in kinds]


def offered_load(url: str, *, rate: int, first_at: datetime, seconds: int) -> list[int]:
    """`rate` one-off runs due every second for `seconds` seconds from `first_at`
    (bulk-inserted: bench/load.py). Returns the run ids."""
    from bench import load
    from runs.models import Run

    first_at = first_at.replace(microsecond=0)
    times = [first_at + timedelta(seconds=s) for s in range(seconds) for _ in range(rate)]
    jobs = load.one_off_jobs(times=times, target=url)
    load.analyze()
    return list(Run.objects.filter(job_id__in=jobs).values_list("pk", flat=True))


def restart(kind: str, pg: Any, redis: Any, hold: float = 0.0) -> Fault:
    """One fault: the server down (and kept down `hold` seconds more, as a slower
    restart would) and up again. Returns when it accepts connections."""
    if kind == "pg_fast":
        began, up = pg.restart_fast(hold=hold)
    elif kind == "pg_kill":
        began, up = pg.restart_killed(hold=hold)
    elif kind == "redis_restart":
        began, up = redis.restart(hold=hold)
    else:
        raise ValueError(f"unknown restart kind {kind!r}")
    return Fault(kind, began, up)


def calls_in_last(target: Calls, seconds: float) -> int:
    since = time.time() - seconds
    received = target.received()
    n = 0
    for _, _, at in reversed(received):
        if at < since:
            break
        n += 1
    return n


def wait_flowing(target: Calls, rate: float, timeout: float) -> bool:
    """Until the last second's calls reach RATE_BACK of `rate` (False at the timeout)."""
    deadline = time.monotonic() + timeout
    while calls_in_last(target, 1.0) < RATE_BACK * rate:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def inject(kinds: list[str], pg: Any, redis: Any, target: Calls, *, rate: float, gap: float, warmup: float,
           hold: float = 0.0, flow_timeout: float = 60, log: Any = print) -> list[Fault]:
    """Once runs flow at the offered rate, `warmup` seconds of it (the lateness before
    the faults), then each fault once runs flow again, and `gap` seconds from one to the
    next. Touches only the servers and the target's records, never the store."""
    from django.db import connections

    faults = []
    for i, kind in enumerate(kinds):
        if not wait_flowing(target, rate, flow_timeout):
            log(f"runs were not flowing at {RATE_BACK:.0%} of {rate:g}/s within {flow_timeout:g} s; {kind} anyway")
        if i == 0:
            time.sleep(warmup)
        fault = restart(kind, pg, redis, hold)
        connections.close_all()  # this process's own connection, if any, died with the server
        faults.append(fault)
        log(f"{kind}: down {fault.down_s:.2f} s")
        time.sleep(max(0.0, gap - fault.down_s))
    return faults


@dataclass
class RunRecord:
    key: str
    due: float
    published: list[float]  # its queued and requeued events, store times
    run_id: int = 0


def run_records(run_ids: list[int]) -> list[RunRecord]:
    from django.db import close_old_connections

    from runs.models import Run
    from bench.timelines import timelines_by_id

    close_old_connections()
    published: dict[int, list[float]] = defaultdict(list)
    for run_id, found in timelines_by_id(run_ids, types=("queued", "requeued")).items():
        published[run_id] += [e.at.timestamp() for e in found]
    records = []
    for start in range(0, len(run_ids), 20_000):
        for run in Run.objects.filter(pk__in=run_ids[start: start + 20_000]).only("pk", "job_id", "scheduled_for"):
            records.append(RunRecord(run.idempotency_key, run.scheduled_for.timestamp(), sorted(published[run.pk]),
                                     run.pk))
    return records


def events_after(run_ids: list[int], types: tuple[str, ...]) -> dict[str, list[float]]:
    from bench.timelines import timelines_by_id

    found: dict[str, list[float]] = {t: [] for t in types}
    for entries in timelines_by_id(run_ids, types=types).values():
        for e in entries:
            found[e.type].append(e.at.timestamp())
    return {t: sorted(v) for t, v in found.items()}


def time_to_flow(faults: list[Fault], records: list[RunRecord], calls: list[tuple[str, int, float]], *,
                 rate: float, late_ok: float | None = None,
                 events: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """Each fault's times (the module's docstring says what each is), and the lateness
    of the runs due in the BASELINE_S seconds that end 5 s before the first fault (the
    steady state), from which `late_ok` is taken when not given (its p99 + 1 s)."""
    by_key = {r.key: r for r in records}
    first = {key: at for key, at in first_calls(calls).items() if key in by_key}
    starts = sorted(first.values())
    late = {key: at - by_key[key].due for key, at in first.items()}
    before = [late[r.key] for r in records
              if r.key in late and faults and faults[0].began - 5 - BASELINE_S <= r.due < faults[0].began - 5]
    baseline = {"n": len(before), "p50_s": _pct(before, 50), "p99_s": _pct(before, 99), "max_s": _pct(before, 100)}
    late_ok = late_ok if late_ok is not None else round((baseline["p99_s"] or 0.0) + 1.0, 2)
    by_due: dict[int, list[float]] = defaultdict(list)
    for r in records:
        by_due[int(r.due)].append(late.get(r.key, float("inf")))
    ordered_calls = sorted((at, key) for key, _, at in calls)
    flows = []
    for i, fault in enumerate(faults):
        until = faults[i + 1].began if i + 1 < len(faults) else float("inf")
        first_call = _first_call_after(fault.began, ordered_calls, by_key)
        flows.append({
            "kind": fault.kind, "at": round(fault.began, 3), "down_s": round(fault.down_s, 2),
            "first_call_s": _since(fault.began, first_call),
            "rate_back_s": _since(fault.began, _rate_back(first_call, starts, rate)),
            "caught_up_s": _since(fault.began, _caught_up(fault.began, by_due, late_ok)),
            "max_late_s": _max_late([late.get(r.key) for r in records if fault.began - 5 <= r.due < until - 5]),
            **{f"{t}_after": sum(1 for at in v if fault.began <= at < until) for t, v in (events or {}).items()},
        })
    return {"late_ok_s": late_ok, "lateness_before_faults": baseline, "faults": flows, "by_kind": by_kind(flows)}


def first_calls(calls: list[tuple[str, int, float]]) -> dict[str, float]:
    """Each key's first call: when its run started."""
    first: dict[str, float] = {}
    for key, _, at in calls:
        first[key] = min(at, first.get(key, at))
    return first


def latest(records: list[RunRecord], calls: list[tuple[str, int, float]], n: int = 5) -> list[tuple[int, float]]:
    """The `n` runs that started latest after their due time (never started: first),
    as (run id, seconds late)."""
    first = first_calls(calls)
    late = [(r.run_id, first.get(r.key, float("inf")) - r.due) for r in records]
    return sorted(late, key=lambda item: -item[1])[:n]


def timelines(run_ids: list[int]) -> dict[int, list[tuple[float, str, dict[str, Any]]]]:
    """Each run's events (store time, type, detail), for the JSON to explain a late run."""
    from bench.timelines import timelines_by_id

    found: dict[int, list[tuple[float, str, dict[str, Any]]]] = defaultdict(list)
    for run_id, entries in timelines_by_id(run_ids).items():
        found[run_id] += [(round(e.at.timestamp(), 3), e.type, e.detail or {}) for e in entries]
    return dict(found)


def per_second(records: list[RunRecord], calls: list[tuple[str, int, float]]) -> dict[str, Any]:
    """Runs due, and runs started (first calls), in each second from the first due time."""
    if not records:
        return {"t0": None, "due": [], "started": []}
    t0 = min(r.due for r in records)
    first = first_calls(calls)
    due, started = _buckets([r.due - t0 for r in records]), _buckets([at - t0 for at in first.values()])
    width = max(len(due), len(started))
    return {"t0": t0, "due": due + [0] * (width - len(due)), "started": started + [0] * (width - len(started))}


def _buckets(offsets: list[float]) -> list[int]:
    counts = [0] * (int(max(offsets, default=-1)) + 1)
    for offset in offsets:
        if offset >= 0:
            counts[int(offset)] += 1
    return counts


def _first_call_after(began: float, ordered_calls: list[tuple[float, str]], by_key: dict[str, RunRecord]) -> float | None:
    """The first call, after `began`, of a run published after `began` and before the call."""
    for at, key in ordered_calls[bisect.bisect_right(ordered_calls, (began, "")):]:
        record = by_key.get(key)
        if record is not None and any(began < p <= at for p in record.published):
            return at
    return None


def _rate_back(since: float | None, starts: list[float], rate: float) -> float | None:
    """The end of the first second [t, t + 1), t from `since` on in 0.1 s steps, in which
    at least RATE_BACK of `rate` runs started."""
    if since is None:
        return None
    t = since
    while t < (starts[-1] if starts else since):
        n = bisect.bisect_left(starts, t + 1) - bisect.bisect_left(starts, t)
        if n >= RATE_BACK * rate:
            return t + 1
        t += 0.1
    return None


def _caught_up(began: float, by_due: dict[int, list[float]], late_ok: float) -> float | None:
    """The first due second at or after `began` from which DUE_SECONDS_ON_TIME due
    seconds in a row started every run within `late_ok`."""
    seconds = sorted(s for s in by_due if s >= int(began))
    for i in range(len(seconds) - DUE_SECONDS_ON_TIME + 1):
        window = seconds[i: i + DUE_SECONDS_ON_TIME]
        if window[-1] - window[0] == DUE_SECONDS_ON_TIME - 1 and \
                all(max(by_due[s]) <= late_ok for s in window):
            return float(max(window[0], began))
    return None


def _max_late(values: list[float | None]) -> float | None:
    """The largest lateness; None when some run was never called."""
    if any(v is None for v in values):
        return None
    return round(max((v for v in values if v is not None), default=0.0), 2)


def _since(began: float, at: float | None) -> float | None:
    return None if at is None else round(at - began, 2)


def _pct(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 3) if values else None


def by_kind(flows: list[dict[str, Any]]) -> dict[str, Any]:
    """p50 and max of each time, per fault kind (None where some fault never got there)."""
    out: dict[str, Any] = {}
    for kind in dict.fromkeys(f["kind"] for f in flows):
        mine = [f for f in flows if f["kind"] == kind]
        out[kind] = {"n": len(mine)}
        for measure in ("down_s", "first_call_s", "rate_back_s", "caught_up_s", "max_late_s"):
            values = [f[measure] for f in mine]
            if any(v is None for v in values):
                out[kind][measure] = {"p50": None, "max": None, "never": sum(v is None for v in values)}
            else:
                out[kind][measure] = {"p50": round(statistics.median(values), 2), "max": round(max(values), 2)}
    return out


def faults_as_dicts(faults: list[Fault]) -> list[dict[str, Any]]:
    return [{**asdict(f), "down_s": round(f.down_s, 2)} for f in faults]
