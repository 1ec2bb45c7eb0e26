"""Partition leases against a real ZooKeeper (no mocks), and the embedded flock.

The ZooKeeper tests need ZOOKEEPER_HOSTS (scripts/zookeeper.sh start serves
127.0.0.1:21810); each test works under its own root node and removes it.
"""
from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from uuid import uuid4

import pytest
from django.conf import settings as django_settings
from django.test import override_settings
from kazoo.client import KazooClient

from scanners.coordination import (
    LocalLeases,
    ZooKeeperLeases,
    make_leases,
    partition_owners,
)

ZK_HOSTS = os.environ.get("ZOOKEEPER_HOSTS", "")
ALL = frozenset(range(16))
SESSION_TIMEOUT = 4.0  # as the integration tests and the soak; scripts/zookeeper.sh ticks every 0.2 s
SCAN_INTERVAL = 0.5  # the scanner loop the takeover tests drive, as the integration tests'

needs_zookeeper = pytest.mark.skipif(
    not ZK_HOSTS,
    reason="needs a ZooKeeper: set ZOOKEEPER_HOSTS (scripts/zookeeper.sh start serves 127.0.0.1:21810)",
)

T = TypeVar("T")


# --------------------------------------------------------------------------- helpers


def wait_for(probe: Callable[[], T], ok: Callable[[T], bool], timeout: float,
             what: str) -> tuple[T, float]:
    """Call probe() every 0.1 s until ok(result); return it and the seconds taken."""
    started = time.monotonic()
    while True:
        value = probe()
        if ok(value):
            return value, time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout} s: {what}; last: {value!r}")
        time.sleep(0.1)


def timed_poll(member: Any) -> frozenset[int]:
    """poll() runs in the scanner's loop: it must never block for long."""
    started = time.monotonic()
    owned = member.poll()
    took = time.monotonic() - started
    assert took < 0.2, f"{member.identifier}.poll() blocked for {took:.2f} s"
    return owned


def poll_all(*members: Any) -> tuple[frozenset[int], ...]:
    return tuple(timed_poll(member) for member in members)


def owner_session(path: str) -> int | None:
    """The session that holds an ephemeral node, read with a client of our own."""
    client = KazooClient(hosts=ZK_HOSTS)
    client.start(timeout=10)
    try:
        stat = client.exists(path)
        return stat.ephemeralOwner if stat else None
    finally:
        client.stop()
        client.close()


def tree_writes(root: str) -> dict[str, tuple[int, int, int]]:
    """Every node under `root` with the zxids of its creation, its last change and its
    children's last change: any write under `root` changes this, a read or a ping does not."""
    client = KazooClient(hosts=ZK_HOSTS)
    client.start(timeout=10)
    try:
        found: dict[str, tuple[int, int, int]] = {}
        todo = [root]
        while todo:
            path = todo.pop()
            children, stat = client.get_children(path, include_data=True)
            found[path] = (stat.czxid, stat.mzxid, stat.pzxid)
            todo += [f"{path}/{child}" for child in children]
        return found
    finally:
        client.stop()
        client.close()


def scanner_turns(member: Any, until: Callable[[frozenset[int]], bool], timeout: float) -> float:
    """Drive `member` as `manage.py scanner` does (poll, then wait() up to a scan
    interval, woken early by the coordinator) until `until(owned)`; the seconds taken."""
    started = time.monotonic()
    while not until(timed_poll(member)):
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{member.identifier}: not within {timeout} s; owns {sorted(member.poll())}")
        member.wait(SCAN_INTERVAL)
    return time.monotonic() - started


def split_between(owned: tuple[frozenset[int], ...]) -> bool:
    """Every member has some, none overlap, and together they have all."""
    union = frozenset().union(*owned)
    return all(owned) and union == ALL and sum(map(len, owned)) == len(ALL)


class LinkProxy:
    """A loopback TCP proxy to ZooKeeper whose link the test can break.

    cut(): close every socket and stop listening (the peer sees the drop).
    freeze(): silently drop traffic (a network partition; only timeouts tell).
    heal(): after freeze(), forward again on new connections.
    """

    def __init__(self, upstream: str) -> None:
        host, port = upstream.split(",")[0].rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener: socket.socket | None = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._peers: dict[socket.socket, socket.socket] = {}
        self._frozen = False
        self._heal = threading.Event()
        self._cut = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-link-proxy", daemon=True)
        self._thread.start()

    def cut(self) -> None:
        self._cut.set()
        self._thread.join(5)

    def freeze(self) -> None:
        self._frozen = True

    def heal(self) -> None:
        self._heal.set()

    def _run(self) -> None:
        while not self._cut.is_set():
            if self._heal.is_set():
                self._close_peers()  # their streams lost bytes: start afresh
                self._frozen = False
                self._heal.clear()
            for key, _ in self._selector.select(timeout=0.05):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._forward(key.fileobj)  # type: ignore[arg-type]
        self._close_peers()
        self._selector.unregister(self._listener)
        self._listener.close()
        self._listener = None
        self._selector.close()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            downstream, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self._frozen:
            downstream.close()  # unreachable, as far as the client can tell
            return
        upstream = socket.create_connection(self._upstream, timeout=2)
        for sock, peer in ((downstream, upstream), (upstream, downstream)):
            sock.setblocking(False)
            self._peers[sock] = peer
            self._selector.register(sock, selectors.EVENT_READ)

    def _forward(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close_pair(sock)
        elif not self._frozen:
            try:
                self._peers[sock].sendall(data)
            except OSError:
                self._close_pair(sock)

    def _close_pair(self, sock: socket.socket) -> None:
        for each in (sock, self._peers.get(sock)):
            if each is not None and each in self._peers:
                self._peers.pop(each)
                self._selector.unregister(each)
                each.close()

    def _close_peers(self) -> None:
        for sock in list(self._peers):
            self._close_pair(sock)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every kazoo client, step thread and proxy a test starts is gone after it."""
    before = set(threading.enumerate())
    yield
    _, _ = wait_for(lambda: [t for t in threading.enumerate() if t not in before and t.is_alive()],
                    lambda extra: not extra, timeout=10, what="threads started by the test to end")


@pytest.fixture
def zk_settings(settings: Any) -> Iterator[Any]:
    if not ZK_HOSTS:
        pytest.skip("needs a ZooKeeper: set ZOOKEEPER_HOSTS")
    settings.ZOOKEEPER_HOSTS = ZK_HOSTS
    settings.SCHEDULER_ZK_ROOT = f"/scheduler-test-{uuid4().hex}"
    settings.SCHEDULER_ZK_SESSION_TIMEOUT = SESSION_TIMEOUT
    settings.SCHEDULER_PARTITIONS = len(ALL)
    yield settings
    client = KazooClient(hosts=ZK_HOSTS)
    client.start(timeout=10)
    try:
        client.delete(settings.SCHEDULER_ZK_ROOT, recursive=True)
    finally:
        client.stop()
        client.close()


@pytest.fixture
def member(zk_settings: Any) -> Iterator[Callable[..., ZooKeeperLeases]]:
    """Make started ZooKeeper members (optionally through another address); all stopped after."""
    made: list[ZooKeeperLeases] = []

    def make(identifier: str, hosts: str | None = None) -> ZooKeeperLeases:
        # The members read their settings when built.
        with override_settings(ZOOKEEPER_HOSTS=hosts or ZK_HOSTS):
            leases = make_leases(identifier)
        assert isinstance(leases, ZooKeeperLeases)
        made.append(leases)
        leases.start()
        return leases

    yield make
    for leases in made:
        leases.stop()


@pytest.fixture
def proxy() -> Iterator[LinkProxy]:
    link = LinkProxy(ZK_HOSTS or "127.0.0.1:1")
    yield link
    link.cut()


# --------------------------------------------------------------------------- ZooKeeper


@pytest.mark.zookeeper
@needs_zookeeper
def test_two_members_split_all_partitions_between_them(member) -> None:
    a, b = member("a"), member("b")

    (owned_a, owned_b), _ = wait_for(lambda: poll_all(a, b), split_between, timeout=20,
                                     what="a and b split the 16 partitions")

    assert not owned_a & owned_b
    assert owned_a | owned_b == ALL
    assert a.describe() == {"identifier": "a", "kind": "zookeeper", "state": "acquired",
                            "owned": sorted(owned_a)}


@pytest.mark.zookeeper
@needs_zookeeper
def test_when_one_member_stops_cleanly_the_other_soon_owns_all(member) -> None:
    a, b = member("a"), member("b")
    wait_for(lambda: poll_all(a, b), split_between, timeout=20, what="a and b split")

    b.wait(0)  # forget the wake-ups of the split itself
    a.stop()
    assert a.poll() == frozenset()
    took = scanner_turns(b, lambda owned: owned == ALL, timeout=15)

    print(f"takeover after a clean stop: {took:.2f} s")
    # The party and lock watches wake b at once: no waiting for a scan interval.
    assert took < SCAN_INTERVAL


@pytest.mark.zookeeper
@needs_zookeeper
def test_a_member_whose_connection_drops_returns_no_partitions_at_once(member, proxy) -> None:
    cut_off = member("cut-off", hosts=proxy.address)
    wait_for(cut_off.poll, lambda owned: owned == ALL, timeout=15, what="it owns all first")

    proxy.cut()
    _, took = wait_for(lambda: timed_poll(cut_off), lambda owned: not owned, timeout=8,
                       what="no partitions after the link is closed")

    print(f"empty after the link closed: {took:.2f} s")
    assert cut_off.describe()["state"] == "disconnected"


@pytest.mark.zookeeper
@needs_zookeeper
def test_a_frozen_member_drops_its_partitions_and_rejoins_with_a_new_session(
        member, proxy, zk_settings) -> None:
    frozen = member("frozen", hosts=proxy.address)
    owner_node = f"{zk_settings.SCHEDULER_ZK_ROOT}/owners/frozen"
    wait_for(lambda: timed_poll(frozen), lambda owned: owned == ALL, timeout=15,
             what="it owns all first")
    wait_for(partition_owners, lambda owners: owners == {"frozen": sorted(ALL)}, timeout=5,
             what="it is published")
    first_session = owner_session(owner_node)

    proxy.freeze()  # packets vanish: only kazoo's read timeout tells
    _, took = wait_for(lambda: timed_poll(frozen), lambda owned: not owned, timeout=8,
                       what="no partitions once the link is silent")
    print(f"empty after the link went silent: {took:.2f} s")

    time.sleep(SESSION_TIMEOUT + 3)  # the server expires the session meanwhile
    assert frozen.poll() == frozenset()
    proxy.heal()
    _, took = wait_for(frozen.poll, lambda owned: owned == ALL, timeout=20,
                       what="it owns all again on a new session")
    print(f"owns all again after the link healed: {took:.2f} s")
    wait_for(partition_owners, lambda owners: owners == {"frozen": sorted(ALL)}, timeout=5,
             what="it is published again on its new session")
    # It came back through LOST: the old session expired, a new one holds the node.
    assert owner_session(owner_node) not in (None, first_session)


@pytest.mark.zookeeper
@needs_zookeeper
def test_a_member_whose_lock_node_vanishes_stops_scanning_that_partition_and_takes_it_back(
        member, zk_settings) -> None:
    lone = member("lone")
    scanner_turns(lone, lambda owned: owned == ALL, timeout=15)
    lock_path = f"{zk_settings.SCHEDULER_ZK_ROOT}/partitions/locks/5"
    client = KazooClient(hosts=ZK_HOSTS)
    client.start(timeout=10)
    try:
        (node,) = client.get_children(lock_path)
        client.delete(f"{lock_path}/{node}")  # an operator's mistake, or a bug of ours

        # The lock's watch tells; a re-read confirms it is gone, so partition 5 is
        # dropped and, being free, taken again under a new lock node.
        (again,), took = wait_for(lambda: (timed_poll(lone), client.get_children(lock_path))[1],
                                  lambda children: len(children) == 1 and children != [node], timeout=5,
                                  what="a new lock node of lone's on partition 5")
        print(f"partition 5 taken again after its lock node vanished: {took:.2f} s")
        assert again.startswith(lone._locks[5].prefix)
        assert lone._locks[5].is_acquired and lone.poll() == ALL
    finally:
        client.stop()
        client.close()


@pytest.mark.zookeeper
@needs_zookeeper
def test_a_leftover_lock_node_of_ours_is_removed_so_the_partition_is_not_stuck(
        member, zk_settings) -> None:
    a, b = member("a"), member("b")
    wait_for(lambda: poll_all(a, b), split_between, timeout=20, what="a and b split")
    free = min(ALL - a.poll())  # one of b's
    # What a take that gave up mid-way (its link dropped) can leave behind: a's node, not a's lock.
    a._client.create(f"{zk_settings.SCHEDULER_ZK_ROOT}/partitions/locks/{free}/{a._locks[free].prefix}",
                     b"a", ephemeral=True, sequence=True)
    b.stop()

    took = scanner_turns(a, lambda owned: owned == ALL, timeout=10)
    print(f"a owns all, b's partitions included, {took:.2f} s after b stopped")


@pytest.mark.zookeeper
@needs_zookeeper
def test_idle_polls_write_nothing_to_zookeeper(member, zk_settings) -> None:
    a, b = member("a"), member("b")
    (owned_a, owned_b), _ = wait_for(lambda: poll_all(a, b), split_between, timeout=20, what="a and b split")
    wait_for(lambda: (poll_all(a, b), partition_owners())[1],
             lambda owners: owners == {"a": sorted(owned_a), "b": sorted(owned_b)}, timeout=5,
             what="both published")
    before = tree_writes(zk_settings.SCHEDULER_ZK_ROOT)
    assert len(before) > 16  # the party, 16 lock paths, their locks, the owners

    for _ in range(30):
        assert poll_all(a, b) == (owned_a, owned_b)
        time.sleep(0.05)

    assert tree_writes(zk_settings.SCHEDULER_ZK_ROOT) == before


@pytest.mark.zookeeper
@needs_zookeeper
def test_a_member_killed_hard_is_replaced_after_its_session_expires(member, zk_settings,
                                                                    tmp_path: Path) -> None:
    survivor = member("survivor")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "scheduler_project.settings",
        "ZOOKEEPER_HOSTS": ZK_HOSTS,
        "SCHEDULER_ZK_ROOT": zk_settings.SCHEDULER_ZK_ROOT,
        "SCHEDULER_ZK_SESSION_TIMEOUT": str(SESSION_TIMEOUT),
        "SCHEDULER_PARTITIONS": str(len(ALL)),
    }
    code = (
        "import sys, time, django\n"
        "django.setup()\n"
        "from scanners.coordination import make_leases\n"
        "leases = make_leases('victim')\n"
        "leases.start()\n"
        "while True:\n"
        "    leases.poll()\n"
        "    time.sleep(0.1)\n"
    )
    log = (tmp_path / "victim.log").open("wb")
    victim = subprocess.Popen([sys.executable, "-c", code], cwd=django_settings.BASE_DIR,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def both_hold() -> tuple[frozenset[int], dict[str, list[int]]]:
            return survivor.poll(), partition_owners()

        wait_for(both_hold,
                 lambda s: bool(s[0]) and s[1].get("victim") == sorted(ALL - s[0]),
                 timeout=30, what="survivor and victim split the partitions")

        survivor.wait(0)
        killed = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        scanner_turns(survivor, lambda owned: owned == ALL, timeout=30)
        took = time.monotonic() - killed
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(5)
        log.close()

    print(f"takeover after kill -9: {took:.2f} s (session {SESSION_TIMEOUT} s, scan {SCAN_INTERVAL} s)")
    # The server expires the session on a tick boundary after the timeout (0.2 s ticks
    # here), and the survivor's watches wake it then: within a session and a scan.
    assert took <= SESSION_TIMEOUT + SCAN_INTERVAL
    assert took > SESSION_TIMEOUT / 2  # it waited for the expiry, not less


@pytest.mark.zookeeper
@needs_zookeeper
def test_partition_owners_reports_both_members_and_their_partitions(member) -> None:
    a, b = member("a"), member("b")
    (owned_a, owned_b), _ = wait_for(lambda: poll_all(a, b), split_between, timeout=20,
                                     what="a and b split")

    owners, _ = wait_for(lambda: (poll_all(a, b), partition_owners())[1],
                         lambda owners: set(owners) == {"a", "b"}
                         and owners["a"] == sorted(owned_a) and owners["b"] == sorted(owned_b),
                         timeout=5, what="both published")

    assert owners == {"a": sorted(owned_a), "b": sorted(owned_b)}


# --------------------------------------------------------------------------- embedded


@pytest.mark.embedded
def test_local_leases_let_one_scanner_own_all_until_it_stops(settings, tmp_path: Path) -> None:
    settings.ZOOKEEPER_HOSTS = ""
    settings.DATA_DIR = tmp_path
    settings.SCHEDULER_PARTITIONS = len(ALL)
    first, second = make_leases("first"), make_leases("second")
    assert isinstance(first, LocalLeases) and isinstance(second, LocalLeases)
    try:
        first.start()
        second.start()

        assert first.poll() == ALL
        assert second.poll() == frozenset()
        assert first.poll() == ALL  # still held on later polls
        assert partition_owners() == {"first": sorted(ALL)}
        assert second.describe() == {"identifier": "second", "kind": "local",
                                     "state": "waiting", "owned": []}

        first.stop()
        assert first.poll() == frozenset()
        assert second.poll() == ALL
        assert partition_owners() == {"second": sorted(ALL)}
    finally:
        first.stop()
        second.stop()
    assert partition_owners() == {}


@pytest.mark.embedded
def test_local_leases_give_up_a_lock_file_that_was_deleted(settings, tmp_path: Path) -> None:
    settings.DATA_DIR = tmp_path
    first, second = LocalLeases("first"), LocalLeases("second")
    try:
        first.start()
        second.start()
        assert first.poll() == ALL
        (tmp_path / "scanner.lock").unlink()

        # The newcomer locks the new file; the old holder must not go on too.
        assert second.poll() == ALL
        assert first.poll() == frozenset()
    finally:
        first.stop()
        second.stop()


@pytest.mark.zookeeper
@needs_zookeeper
def test_partition_owners_says_unavailable_when_the_link_goes_dark_after_it_connected(
    zk_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the soak (2026-12-05): /metrics answered 500 once while ZooKeeper went
    away, because partition_owners turned only a failed connect into
    CoordinatorUnavailable, not a read that lost its link after connecting. A real
    ZooKeeper behind a proxy that goes dark the moment the client is connected; the
    hook only times the cut."""
    from kazoo.protocol.states import KazooState

    from scanners import coordination
    from tests.netproxy import NetProxy

    port = int(ZK_HOSTS.split(",")[0].rsplit(":", 1)[1])
    proxy = NetProxy(upstream_port=port).start()
    made = coordination.new_kazoo_client

    def cut(state: Any) -> None:
        if state == KazooState.CONNECTED:
            proxy.drop()

    def cut_once_connected(hosts: str) -> KazooClient:
        client = made(hosts)
        client.add_listener(cut)
        return client

    monkeypatch.setattr(coordination, "new_kazoo_client", cut_once_connected)
    zk_settings.ZOOKEEPER_HOSTS = proxy.address
    zk_settings.SCHEDULER_ZK_SESSION_TIMEOUT = 2.0
    try:
        with pytest.raises(coordination.CoordinatorUnavailable, match="ZooKeeper"):
            partition_owners()
        assert proxy.dropping
    finally:
        proxy.stop()
