"""Network partitions, with real scanner and worker processes: one process's link to
ZooKeeper or to PostgreSQL goes through a TCP proxy the test owns (tests/netproxy.py),
which is cut by no longer forwarding a byte, both ways, with every socket left open,
as a real partition does; nobody sees a reset. The other processes keep their links.

- A scanner cut off from ZooKeeper but not from PostgreSQL stops scanning within its
  session timeout, measured from its own lines; the other scanner takes its
  partitions only after that (no partition scanned by two); when the link returns it
  rejoins; no run is missed or queued, sent or applied twice.
- A worker cut off from PostgreSQL in the middle of a call: the call lands, its
  outcome cannot be written; its lease runs out, the scanner takes it back, another
  worker claims it under a newer fence and its call is answered as a replay; when
  the link returns (while the new holder's call is in flight) the cut-off worker's
  late outcome is refused by the fence.

Each prints its handover times; docs/reliability.md records them.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from django.db import close_old_connections

from runs.models import Run, RunEvent
from tests.counting_target import CountingTarget
from tests.integration.conftest import Stack, wait_for
from tests.netproxy import NetProxy
from tests.factories import entry, timeline_of
from tests.reliability.outages import (
    ALL, all_succeeded, first_line_after, one_offs, overlaps, owned, problems, split, status_counts, verdict,
)

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]


@pytest.fixture
def counting_target() -> Iterator[CountingTarget]:
    server = CountingTarget().start()
    yield server
    server.stop()


def test_a_scanner_cut_off_from_zookeeper_stops_within_its_session_timeout_and_the_other_takes_over(
        stack: Stack, counting_target: CountingTarget) -> None:
    session = float(stack.env["SCHEDULER_ZK_SESSION_TIMEOUT"])
    scan = float(stack.env["SCHEDULER_SCAN_INTERVAL"])
    zk_host, zk_port = stack.env["ZOOKEEPER_HOSTS"].split(",")[0].rsplit(":", 1)
    proxy = NetProxy(int(zk_port), zk_host).start()
    try:
        cut = stack.scanner("scanner-cut", ZOOKEEPER_HOSTS=proxy.address)
        other = stack.scanner("scanner-other")
        stack.worker("worker", concurrency=2)
        wait_for(lambda: split([cut, other]), 40, what="the two scanners to split the partitions")
        runs = one_offs(counting_target.url(), first_in=1, seconds=20, per_second=2)
        time.sleep(3)  # a few runs through both scanners before the cut

        cut_at = proxy.drop()
        stopped_at = wait_for(lambda: first_line_after(cut, cut_at, lambda parts: not parts), session + 5,
                              what="the cut-off scanner to stop scanning")
        taken_at = wait_for(lambda: first_line_after(other, cut_at, lambda parts: parts == ALL), session + 10,
                            what="the other scanner to take every partition")
        # Cut off for two session timeouts: it must not start scanning again meanwhile.
        wait_for(lambda: time.time() > cut_at + 2 * session, 3 * session, what="the partition to last")
        assert not owned(cut), f"the cut-off scanner scans again while cut off: {owned(cut)}"
        restored_at = proxy.restore()
        rejoined_at = wait_for(lambda: split([cut, other]) and time.time(), 40,
                               what="the scanners to split the partitions again")
        wait_for(lambda: all_succeeded(runs), 60, what=f"every run to succeed ({status_counts(runs)})")
    finally:
        proxy.stop()
    found = verdict(runs, counting_target, once_per_key=True)
    print(f"scanner cut off from ZooKeeper: stopped scanning {stopped_at - cut_at:.2f} s after the cut, "
          f"the other held every partition {taken_at - cut_at:.2f} s after it "
          f"(session {session:g} s, scan {scan:g} s); link back -> partitions split again "
          f"{rejoined_at - restored_at:.2f} s later; {found['runs']} runs, missed {len(found['missed'])}, "
          f"applied twice {len(found['applied_twice'])}, queued twice {len(found['queued_twice'])}")
    assert stopped_at - cut_at <= session, "the cut-off scanner went on scanning past its session timeout"
    assert taken_at >= stopped_at, "the other scanner took the partitions while the cut-off one still scanned them"
    assert taken_at - cut_at <= session + 2 * scan + 1, taken_at - cut_at
    assert overlaps([cut, other]) == []
    assert problems(found) == {}



def test_a_worker_cut_off_from_postgresql_mid_call_is_taken_over_under_a_newer_fence_and_its_late_writes_refused(
        stack: Stack, counting_target: CountingTarget) -> None:
    lease, call = 4, 2.0
    scan = float(stack.env["SCHEDULER_SCAN_INTERVAL"])
    stack.env.update(SCHEDULER_LEASE_SECONDS=str(lease), SCHEDULER_REQUEUE_AFTER="5")
    db = urlsplit(stack.env["DATABASE_URL"])
    # Each worker reaches PostgreSQL through a proxy of its own: the one whose child
    # claims the first run is cut off, in the middle of that run's call.
    proxies = {name: NetProxy(db.port or 5432, db.hostname or "127.0.0.1").start() for name in ("worker-a", "worker-b")}
    try:
        stack.scanner("scanner")
        workers = {name: stack.worker(name, concurrency=2,
                                      DATABASE_URL=db._replace(netloc=f"{db.username}@{proxy.address}").geturl())
                   for name, proxy in proxies.items()}
        wait_for(lambda: all(" ready." in w.output() for w in workers.values()), 40, what="both workers to be ready")
        counting_target.delay(call)
        [first] = one_offs(counting_target.url(), first_in=0, seconds=1, per_second=1)
        wait_for(counting_target.received, 30, what="the first run's call to reach the target")
        claim = entry(first, "claimed")
        name = claim.detail["worker"].split("@", 1)[0]  # "<node name>@<host>/<pid>/<thread>"
        cut, proxy = workers[name], proxies[name]
        cut_at = proxy.drop()  # the call is in flight: it lands, its outcome cannot be written
        runs = [first, *one_offs(counting_target.url(), first_in=1, seconds=8, per_second=2)]

        def after_cut(type_: str, **detail: int) -> RunEvent | None:
            close_old_connections()
            return next((e for e in timeline_of(first) if e.type == type_
                         and all(e.detail.get(k, 0) > v for k, v in detail.items())), None)

        expired = wait_for(lambda: after_cut("lease_expired"), 3 * lease + 30, what="the scanner to take the lease back")
        again = wait_for(lambda: after_cut("claimed", fence=1), 30, interval=0.05,
                         what="the other worker to claim the run")
        # The link back while the new holder's call is in flight: the cut-off worker's
        # outcome, held in the link all this time, reaches the store while the run is
        # running under the newer fence, the moment a store without the fence would take it.
        assert cut.alive() and proxy.dropping
        restored_at = proxy.restore()
        holder = Run.objects.values_list("status", "fence").get(pk=first)
        late = wait_for(lambda: after_cut("stale_write_rejected"), 30,
                        what="the cut-off worker's late outcome to be refused")
        wait_for(lambda: all_succeeded(runs), 60, what=f"every run to succeed ({status_counts(runs)})")
    finally:
        for p in proxies.values():
            p.stop()
    found = verdict(runs, counting_target, once_per_key=False)
    close_old_connections()
    run = Run.objects.get(pk=first)
    calls = [(a.fence, a.outcome) for a in counting_target.arrivals() if a.key == run.idempotency_key]
    taken_back, claimed = expired.at.timestamp() - cut_at, again.at.timestamp() - cut_at
    print(f"worker cut off from PostgreSQL mid-call: lease taken back {taken_back:.2f} s after the cut, the run "
          f"claimed again under fence {again.detail['fence']} after {claimed:.2f} s (lease {lease} s, scan "
          f"{scan:g} s, call {call:g} s); the target saw {calls}; the late outcome refused "
          f"{late.at.timestamp() - restored_at:.2f} s after the link came back; {found['runs']} runs, "
          f"missed {len(found['missed'])}, applied twice {len(found['applied_twice'])}")
    assert run.status == Run.Status.SUCCEEDED and run.fence == again.detail["fence"]
    # The cut-off worker's call landed and was applied; the new holder's was answered as a replay of it.
    assert calls == [(1, "applied"), (again.detail["fence"], "replayed")], calls
    assert holder == (Run.Status.RUNNING, again.detail["fence"]), holder
    assert late.detail["fence"] == 1 and late.at < run.finished_at
    # The lease was last renewed before the cut: it runs out within a lease of it, and a scan later it is back.
    assert taken_back <= lease + 2 * scan + 1, taken_back
    assert problems(found) == {}
