"""PostgreSQL failover under load, with real scanner and worker processes: a private
primary and its synchronous streaming standby (tests/pgpair.py), every process (this
test's own ORM too) on a DATABASE_URL naming both hosts with
`target_session_attrs=read-write`. A steady stream of one-off runs to an idempotent
counting target; the primary killed (`pg_ctl stop -m immediate`) once runs are
flowing, the standby promoted once the processes have seen the store go. No process
is restarted or told: each finds the new primary on its own (libpq skips the dead
host and, until the promotion, the read-only one).

Asserts: nothing committed before the kill is lost (synchronous replication), every
run succeeds, none is applied twice (by the target's count and the store's record),
no invariant is broken. Prints the time to recover (kill -> the first run succeeding
on the promoted standby); docs/reliability.md records it.
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from django.db import connections

from runs.models import Run, RunEvent
from tests.counting_target import CountingTarget
from tests.integration.conftest import ROOT, Stack, wait_for
from tests.pgpair import PgPair, orm_on, running
from tests.reliability.outages import ALL, all_succeeded, one_offs, owned, problems, status_counts, verdict
from tests.factories import timelines_of

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]


@pytest.fixture
def pair() -> Iterator[PgPair]:
    with running(PgPair) as made:
        yield made


def fresh_call_in_flight(target: CountingTarget) -> bool:
    """A call that came in under half its duration ago and is not answered yet: it
    is still in flight when the primary is killed a moment later."""
    answered = {a.key for a in target.arrivals()}
    return any(key not in answered and at > time.time() - 0.5 for key, _, at in target.received())


def test_the_primary_killed_under_load_and_the_standby_promoted_loses_no_commit_and_runs_flow_again(
        pair: PgPair, stack: Stack, counting_target: CountingTarget) -> None:
    lease, call = 5, 1.0
    pair.psql(pair.primary_port, "create database sched")
    url = pair.url("sched")
    stack.env.update(DATABASE_URL=url, SCHEDULER_LEASE_SECONDS=str(lease), SCHEDULER_REQUEUE_AFTER="5")
    subprocess.run([sys.executable, "manage.py", "migrate", "--verbosity", "0"], cwd=ROOT, env=stack.env,
                   check=True, timeout=120)
    with orm_on(url):
        connection = connections["default"]
        assert connection.settings_dict["HOST"] == "127.0.0.1,127.0.0.1"
        scanner = stack.scanner("scanner")
        workers = [stack.worker(name, concurrency=2) for name in ("worker-a", "worker-b")]
        wait_for(lambda: owned(scanner) == ALL and all(" ready." in w.output() for w in workers), 40,
                 what="the scanner to hold every partition and both workers to be ready")
        counting_target.delay(call)  # calls in flight at the kill: their outcomes cannot be written
        runs = one_offs(counting_target.url(), first_in=1, seconds=16, per_second=2)
        wait_for(lambda: len(counting_target.applied()) >= 10, 40, what="runs to flow before the kill")
        wait_for(lambda: fresh_call_in_flight(counting_target), 10, interval=0.02, what="a call in flight")

        # What is committed (read back, so acknowledged) just before the kill.
        # Every entry of the runs' timelines (rows, and the entries on the run rows).
        committed_events = _entries(runs)
        succeeded_before = set(Run.objects.filter(pk__in=runs, status=Run.Status.SUCCEEDED)
                               .values_list("pk", flat=True))
        killed_at = pair.kill_primary()
        connection.close()  # this test's own socket died with the primary
        # The processes see the store gone before the promotion: the scanner's scan
        # fails, and every call in flight at the kill comes back to a worker that
        # cannot write its outcome (the run stays `running` until its lease runs out).
        in_flight = [key for key, _, at in counting_target.received() if at <= killed_at
                     and not any(a.key == key for a in counting_target.arrivals() if a.at <= killed_at)]
        wait_for(lambda: "scan failed" in scanner.output()
                 and len(counting_target.arrivals()) == len(counting_target.received()), 20,
                 what="the scanner to see the primary gone and the calls in flight to come back")
        promoted_at = pair.promote_standby()
        assert not pair.in_recovery(pair.standby_port)
        first_call = wait_for(lambda: min((at for _, _, at in counting_target.received() if at > promoted_at),
                                          default=None), 60, what="a call after the promotion")
        wait_for(lambda: all_succeeded(runs), 90, what=f"every run to succeed ({status_counts(runs)})")
        assert all(p.alive() for p in [scanner, *workers]), "a process died instead of reconnecting"

        lost_events = committed_events - _entries(runs)
        lost_success = succeeded_before - set(Run.objects.filter(pk__in=succeeded_before,
                                                                 status=Run.Status.SUCCEEDED)
                                              .values_list("pk", flat=True))
        killed = datetime.fromtimestamp(killed_at, timezone.utc)
        first_success = (Run.objects.filter(pk__in=runs, status=Run.Status.SUCCEEDED, finished_at__gt=killed)
                         .order_by("finished_at").values_list("finished_at", flat=True).first())
        found = verdict(runs, counting_target, once_per_key=False)
        resent = sum(1 for n in counting_target.calls_per_key().values() if n > 1)
        taken_back = {run.idempotency_key for run in Run.objects.filter(
            pk__in=RunEvent.objects.filter(run_id__in=runs, type="lease_expired", at__gt=killed).values("run_id"))}
        fence_of = {run.idempotency_key: run.fence for run in Run.objects.filter(pk__in=runs)}
    recovered = first_success.timestamp() - killed_at
    print(f"PostgreSQL failover: primary killed, standby promoted {promoted_at - killed_at:.2f} s later; first "
          f"call reached the target {first_call - promoted_at:.2f} s after it; first run succeeding on the "
          f"promoted standby {recovered:.2f} s after the kill ({recovered - (promoted_at - killed_at):.2f} s "
          f"after the promotion, a {call:g} s call included; lease {lease} s, scan "
          f"{stack.env['SCHEDULER_SCAN_INTERVAL']} s); "
          f"{len(committed_events)} events committed before the kill, lost {len(lost_events)}; "
          f"{found['runs']} runs, missed {len(found['missed'])}, applied twice {len(found['applied_twice'])}, "
          f"{len(in_flight)} calls in flight at the kill, {len(taken_back)} runs taken back after their "
          f"lease, sent again (answered as replays) {resent}")
    assert lost_events == set() and lost_success == set(), (lost_events, lost_success)
    assert problems(found) == {}
    # The calls in flight at the kill came back to workers that could not write their
    # outcomes. Each such run either had its outcome written once the standby was
    # promoted (the worker's writer tries again while the lease would still hold: one
    # call, fence 1), or was taken back after its lease and called again, the second
    # call answered as a replay: the worker side of the failover was exercised.
    assert in_flight, "no call was in flight at the kill"
    calls = counting_target.calls_per_key()
    for key in in_flight:
        landed_later = calls[key] == 1 and fence_of[key] == 1
        assert landed_later or (key in taken_back and calls[key] >= 2), (key, calls[key], taken_back)


def _entries(run_ids: list[int]) -> set[tuple[int, str, datetime]]:
    """The runs' timeline entries as (run, type, at): an entry on a run row that later
    became a row (runs.events.settle) is the same entry."""
    return {(run_id, e.type, e.at) for run_id, found in timelines_of(run_ids).items() for e in found}
