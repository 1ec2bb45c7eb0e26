"""Partition leases: which partitions of the runs table this scanner may scan now.

Runs are partitioned ``job_id % SCHEDULER_PARTITIONS``. Each scanner process
loops: ``poll()`` (advance the lease state, learn what it owns right now), scan
those partitions, ``wait()`` up to a scan interval (woken early when the
coordinator sees a change). Two coordinators exist:

* ``ZooKeeperLeases`` (``ZOOKEEPER_HOSTS`` set): members join a kazoo
  ``Party``; each partition is guarded by its own kazoo ``Lock``, and each
  member holds up to ceil(partitions / members) of them. Watches on the party
  and the locks wake the members when one leaves or dies, so its partitions
  are taken and scanned as soon as its session ends. Each member publishes
  what it owns under ``{root}/owners/{identifier}`` for the ops pages.
* ``LocalLeases`` (embedded, no server): one member owns everything while it
  holds an exclusive ``flock`` on ``DATA_DIR/scanner.lock``.

A lease is advisory: a member that froze may still believe it owns partitions
for a moment after resuming. The fence in the runs store is what makes that
safe; this module only has to stop claiming partitions as soon as it *knows*
it may have lost them.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError
from kazoo.protocol.states import KazooState
from kazoo.recipe.lock import Lock
from kazoo.recipe.party import Party
from kazoo.recipe.watchers import ChildrenWatch
from kazoo.retry import KazooRetry

from scanners.leases import (  # noqa: F401 - names callers import from here too
    NOTHING, CoordinatorUnavailable, PartitionLeases, _Wakeable, all_partitions, check_identifier,
    default_identifier, owner_record, parse_record, partitions_in, utc_now_iso,
)
from scanners.local_leases import LocalLeases, local_owners

logger = logging.getLogger("scheduler.scanners.coordination")

# How long stop() waits for ZooKeeper work before closing the client anyway.
# Closing the session releases everything server-side, so waiting longer buys
# nothing but a slower shutdown.
STOP_GRACE_SECONDS = 5.0
# Upper bound on start()'s wait for the first connection (the brief: <= ~30 s).
CONNECT_WAIT_SECONDS = 15.0
# kazoo's default retry backs off to an hour between attempts; a scanner that
# lost ZooKeeper for a few minutes must notice it is back within seconds.
RETRY_MAX_DELAY_SECONDS = 2.0


def make_leases(identifier: str | None = None) -> PartitionLeases:
    """ZooKeeper leases when ZOOKEEPER_HOSTS is set, else the embedded lock."""
    ident = check_identifier(identifier or default_identifier())
    if settings.ZOOKEEPER_HOSTS:
        return ZooKeeperLeases(ident)
    return LocalLeases(ident)


def partition_owners() -> dict[str, list[int]]:
    """Who holds which partitions now, {identifier: [partitions]}, for the ops pages.

    Raises CoordinatorUnavailable when ZooKeeper cannot be reached, so a page
    can say "unknown" rather than "nobody".
    """
    if settings.ZOOKEEPER_HOSTS:
        return zookeeper_owners()
    return local_owners()


# --------------------------------------------------------------------------- ZooKeeper


def zk_paths() -> tuple[str, str]:
    """(partitions root, owners root). Under the partitions root: `members`
    (the Party) and `locks/<partition>` (one Lock each)."""
    root = settings.SCHEDULER_ZK_ROOT.rstrip("/")
    return f"{root}/partitions", f"{root}/owners"


def new_kazoo_client(hosts: str) -> KazooClient:
    retry = {"max_tries": -1, "delay": 0.1, "backoff": 2, "max_delay": RETRY_MAX_DELAY_SECONDS}
    return KazooClient(
        hosts=hosts,
        timeout=settings.SCHEDULER_ZK_SESSION_TIMEOUT,
        connection_retry=retry,
        # Commands give up after a session's worth of retrying so that a
        # background step blocked on a dead link ends and is tried again later.
        command_retry={**retry, "deadline": settings.SCHEDULER_ZK_SESSION_TIMEOUT},
    )


class PartitionLock(Lock):
    """kazoo's Lock, with its retries bounded like our client's commands.

    Lock retries a lost connection forever, backing off to a minute between
    tries; a take that met a dropped link must end soon, so the other steps
    (a new session after a ZooKeeper restart) can run. A try that gave up may
    leave its node behind: _next_step finds and removes such leftovers.
    """

    def __init__(self, client: KazooClient, path: str, identifier: str) -> None:
        super().__init__(client, path, identifier)
        # kazoo offers no parameter for it; the attribute is what acquire() copies.
        self._retry = KazooRetry(max_tries=3, delay=0.1, backoff=2, max_delay=RETRY_MAX_DELAY_SECONDS,
                                 sleep_func=client.handler.sleep_func)


def _side_by_side(call: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """call(item) for each item on a few threads at once; the results in order.
    The first exception is raised once all calls ended."""
    if len(items) <= 1:
        return [call(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(8, len(items)), thread_name_prefix="leases-each") as pool:
        futures = [pool.submit(call, item) for item in items]
    return [future.result() for future in futures]


def fair_share(partitions: int, members: int) -> int:
    """How many partitions one member may hold: ceil(partitions / members)."""
    return -(-partitions // max(1, members))


class ZooKeeperLeases(_Wakeable):
    """A member of a kazoo ``Party``, holding one kazoo ``Lock`` per partition it owns.

    Each member takes free partitions up to its share, ceil(partitions /
    members), and hands back what is above it. Every node is ephemeral: when a
    member's session ends (a clean stop, or the server expiring a dead one),
    its party node and its locks go at once, and the watches the others keep
    on the party and on every partition's lock wake their scanner loops
    (``wait()``), which take the freed partitions and scan them straight away.
    Nothing waits for the membership to settle, so a dead scanner's partitions
    move after its session expires plus milliseconds.

    poll() must never block for long, but kazoo's synchronous calls wait for a
    reply and, while the link is down, wait until it comes back. So poll()
    only reads state; the calls that talk to ZooKeeper (join, watch, take,
    hand back, publish) run one at a time on a short-lived background thread.
    The lock paths' children are known from the watches, so a poll with
    nothing to change writes nothing to ZooKeeper.
    """

    kind = "zookeeper"

    def __init__(self, identifier: str) -> None:
        self.identifier = check_identifier(identifier)
        self._hosts: str = settings.ZOOKEEPER_HOSTS
        partitions_path, owners_path = zk_paths()
        self._members_path = f"{partitions_path}/members"
        self._locks_path = f"{partitions_path}/locks"
        self._owners_path = owners_path
        self._owner_path = f"{owners_path}/{self.identifier}"
        self._set = tuple(sorted(all_partitions()))
        self._client: KazooClient | None = None
        # Set by kazoo's thread on CONNECTED, cleared on SUSPENDED/LOST: the
        # one signal poll() trusts to drop its partitions at once.
        self._connected = threading.Event()
        # When the link went down (monotonic), None while connected: see _next_step.
        self._link_lost_at: float | None = time.monotonic()
        # Counts connections: watches last one connection (kazoo drops them on
        # SUSPENDED), so each new connection arms them again.
        self._epoch = 0
        self._armed_epoch = -1
        # Which arming the watch callbacks belong to; an older one's stop.
        self._watch_gen = 0
        self._stopping = False
        # Set whenever the scanner loop should look again (a watch fired, a
        # step changed what we hold, the link changed): see wait().
        self._wake = threading.Event()
        self._task: threading.Thread | None = None
        # A poll that came while a step was in flight could not start the next
        # step; the step, when it ends, wakes the loop for another poll.
        self._steps_lock = threading.Lock()
        self._step_running = False
        self._poll_missed = False
        # The session our party node and locks belong to; they end with it.
        self._joined_session: int | None = None
        self._party: Party | None = None
        self._locks: dict[int, PartitionLock] = {}
        self._held: set[int] = set()
        # Above our share, waiting to be handed back: no longer scanned.
        self._releasing: set[int] = set()
        # What the watches last saw: party members, and each lock path's children.
        self._members: list[str] | None = None
        self._lock_children: dict[int, list[str]] = {}
        self._owned: frozenset[int] = NOTHING
        self._since = utc_now_iso()
        # (session id, partitions) last written to the owners node: a new
        # session means the ephemeral node is gone and must be written again.
        self._published: tuple[int, frozenset[int]] | None = None

    # ----------------------------------------------------------------- public API

    def start(self) -> None:
        if self._client is not None:
            return
        self._stopping = False
        client = new_kazoo_client(self._hosts)
        client.add_listener(self._on_state)
        self._client = client
        client.start_async()
        # Our listener's flag, not kazoo's own event: that one is set just
        # before the listeners run.
        if not self._connected.wait(CONNECT_WAIT_SECONDS):
            # Keep trying in the background instead of failing the process: a
            # scanner started while ZooKeeper restarts should join once it is
            # back. poll() returns nothing until then.
            logger.warning("scanner %s: ZooKeeper %s not reachable yet; retrying",
                           self.identifier, self._hosts)
            return
        # Join and take a first share now, so the first poll has partitions.
        self._run_steps(self._join)

    def poll(self) -> frozenset[int]:
        with self._steps_lock:
            if self._step_running:
                self._poll_missed = True
            else:
                # Before reading what we own: a step may set partitions aside to
                # hand back, and those must not be in the scan that follows.
                step = self._next_step()
                if step is not None:
                    self._step_running = True
                    try:
                        self._spawn(step)
                    except BaseException:
                        self._step_running = False
                        raise
        owned = self._owned_now()
        self._note(owned)
        return owned

    def stop(self) -> None:
        client = self._client
        if client is None:
            return
        self._stopping = True
        self._note(NOTHING)
        self._join_task(STOP_GRACE_SECONDS)
        try:
            # Closing the session removes its ephemeral nodes (party member,
            # locks, owners entry) in one transaction, and the others' watches
            # fire at once. On a dead link the server expires the session instead.
            client.stop()
        finally:
            client.close()
            self._join_task(STOP_GRACE_SECONDS)
            self._client = None
            self._forget()
            self._connected.clear()
            self._wake.set()

    def describe(self) -> dict[str, Any]:
        return {
            "identifier": self.identifier,
            "kind": self.kind,
            "state": self._state_name(),
            "owned": sorted(self._owned),
        }

    # ----------------------------------------------------------------- kazoo threads

    def _on_state(self, state: KazooState) -> None:
        # Runs on kazoo's connection thread: no blocking, no ZooKeeper calls.
        if state == KazooState.CONNECTED:
            self._link_lost_at = None
            self._epoch += 1
            self._connected.set()
        else:  # SUSPENDED or LOST: we may no longer hold our locks
            self._connected.clear()
            if self._link_lost_at is None:
                self._link_lost_at = time.monotonic()
        self._wake.set()

    def _watch_members(self, gen: int) -> Callable[[list[str]], bool]:
        def seen(children: list[str]) -> bool:
            if gen != self._watch_gen or self._stopping:
                return False  # an older connection's watch: stop it
            self._members = list(children)
            self._wake.set()
            return True
        return seen

    def _watch_lock(self, gen: int, partition: int) -> Callable[[list[str]], bool]:
        def seen(children: list[str]) -> bool:
            if gen != self._watch_gen or self._stopping:
                return False
            self._lock_children[partition] = list(children)
            self._wake.set()
            return True
        return seen

    # ----------------------------------------------------------------- reading state

    def _session(self) -> int | None:
        client_id = self._client.client_id if self._client is not None else None
        return client_id[0] if client_id else None

    def _joined(self) -> bool:
        return self._joined_session is not None and self._joined_session == self._session()

    def _owned_now(self) -> frozenset[int]:
        if self._stopping or not self._connected.is_set() or not self._joined():
            # Locks taken in an earlier session ended with it.
            return NOTHING
        return frozenset(self._held - self._releasing)

    def _share(self) -> int:
        members = set(self._members or ())
        if self._party is not None:
            members.add(self._party.node)  # ourselves, before the watch has seen us
        return fair_share(len(self._set), len(members))

    def _note(self, owned: frozenset[int]) -> None:
        if owned != self._owned:
            logger.info("scanner %s owns partitions %s", self.identifier, sorted(owned))
            self._owned = owned
            self._since = utc_now_iso()

    def _state_name(self) -> str:
        if self._client is None:
            return "stopped"
        if not self._connected.is_set():
            return "disconnected"
        if not self._joined() or self._armed_epoch != self._epoch:
            return "joining"
        return "acquired"

    # ----------------------------------------------------------------- steps

    def _next_step(self, from_poll: bool = True) -> Callable[[], None] | None:
        """The next ZooKeeper step, if any. Only poll() (from_poll) may decide to hand
        partitions back: it runs between scans, so none is being scanned then."""
        if self._stopping:
            return None
        if not self._connected.is_set():
            lost_at = self._link_lost_at
            if lost_at is not None and time.monotonic() - lost_at > settings.SCHEDULER_ZK_SESSION_TIMEOUT * 1.5:
                # kazoo has no client-side expiry: it keeps offering the old session and
                # the last zxid it saw. A ZooKeeper that restarted with its state wiped
                # refuses such a client until its own zxid catches up, which in a quiet
                # cluster is never. The session is over server-side by now anyway: a new
                # one starts from zxid 0.
                return self._renew_session
            return None  # nothing to do until kazoo reconnects
        session = self._session()
        if not self._joined():
            return self._join
        if self._armed_epoch != self._epoch:
            return self._arm_watches
        lost = [p for p in sorted(self._held) if not self._still_ours(p)]
        if lost:
            return lambda: self._check_held(lost)
        leftovers = self._leftovers()
        if leftovers:
            return lambda: self._remove(leftovers)
        share = self._share()
        if from_poll and len(self._held) > share and not self._releasing:
            # Hand back the highest ones. Only decided here, in poll(), after the
            # scan that used them has finished; poll() stops returning them now.
            self._releasing = set(sorted(self._held)[share:])
        if self._releasing:
            releasing = sorted(self._releasing)
            return lambda: self._release(releasing)
        if len(self._held) < share:
            free = [p for p in self._set if p not in self._held and not self._lock_children.get(p, [None])]
            if free:
                # In a random order: members taking at the same moment (a dead one's
                # partitions freed at once) then seldom try the same ones.
                wanted = random.sample(free, min(len(free), share - len(self._held)))
                return lambda: self._acquire(wanted)
        owned = self._owned_now()
        if session is not None and self._published != (session, owned):
            return lambda: self._publish(session, owned)
        return None

    def _still_ours(self, partition: int) -> bool:
        """Our lock node is among what the watch last saw (a missing one is checked)."""
        lock = self._locks.get(partition)
        children = self._lock_children.get(partition)
        if lock is None or lock.node is None or children is None:
            return True  # nothing seen yet to say otherwise
        return lock.node in children

    def _leftovers(self) -> list[str]:
        """Our lock nodes on partitions we do not hold: left by a try that gave up
        mid-way. Nobody could take those partitions while they stay."""
        found = []
        for p, lock in self._locks.items():
            if p in self._held:
                continue
            found += [f"{self._locks_path}/{p}/{child}" for child in self._lock_children.get(p, ())
                      if child.startswith(lock.prefix)]
        return found

    def _spawn(self, step: Callable[[], None]) -> None:
        name = getattr(step, "__name__", "step").strip("_<>")
        self._task = threading.Thread(target=self._run_steps, args=(step,),
                                      name=f"leases-{name}-{self.identifier}", daemon=True)
        self._task.start()

    def _run_steps(self, step: Callable[[], None] | None) -> None:
        """Run `step`, then whatever follows it (join, watch, take, publish) without
        waiting for a poll; a bounded chain, ended by the first failure. Then wake
        the scanner loop if what it would scan changed (only then: a step that
        keeps changing nothing must not spin the loop)."""
        try:
            for _ in range(8):
                if step is None or not self._run_step(step):
                    break
                step = self._next_step(from_poll=False)
        finally:
            with self._steps_lock:
                self._step_running = False
                missed, self._poll_missed = self._poll_missed, False
        if missed or self._owned_now() != self._owned:
            self._wake.set()

    def _run_step(self, step: Callable[[], None]) -> bool:
        try:
            step()
        except KazooException as exc:
            # Retried on a later poll; the link state decides what happens next.
            logger.warning("scanner %s: ZooKeeper step failed: %r", self.identifier, exc)
            return False
        except Exception:
            logger.exception("scanner %s: ZooKeeper step failed", self.identifier)
            return False
        return True

    def _join_task(self, timeout: float) -> None:
        task = self._task
        if task is not None and task is not threading.current_thread():
            task.join(timeout)

    def _forget(self) -> None:
        """Drop what belonged to an ended session: its locks and party node are gone."""
        self._joined_session = None
        self._party = None
        self._locks = {}
        self._held = set()
        self._releasing = set()

    def _join(self) -> None:
        """Join the party on this session, with a fresh lock object per partition."""
        client = self._client
        if client is None or self._stopping:
            return
        session = self._session()
        self._forget()
        party = Party(client, self._members_path, self.identifier)
        party.join()
        if self._stopping:  # stop() raced us; don't leave a member behind
            party.leave()
            return
        self._locks = {p: PartitionLock(client, f"{self._locks_path}/{p}", self.identifier) for p in self._set}
        self._party = party
        self._joined_session = session

    def _arm_watches(self) -> None:
        """Watch the party and every partition's lock, for this connection."""
        client = self._client
        if client is None or self._stopping:
            return
        epoch = self._epoch
        for path in (self._members_path, self._owners_path, self._locks_path):
            client.ensure_path(path)
        # After a ZooKeeper that lost its state, every lock path is made again:
        # side by side, as the writes share the server's log syncs.
        _side_by_side(client.ensure_path, [f"{self._locks_path}/{p}" for p in self._set])
        self._watch_gen += 1
        gen = self._watch_gen
        # Each calls its function once now (filling what we know) and then on
        # every change, until the connection drops (kazoo clears its watches
        # then; the next connection arms new ones).
        ChildrenWatch(client, self._members_path, self._watch_members(gen), allow_session_lost=False)
        for p in self._set:
            ChildrenWatch(client, f"{self._locks_path}/{p}", self._watch_lock(gen, p),
                          allow_session_lost=False)
        self._armed_epoch = epoch

    def _acquire(self, wanted: list[int]) -> None:
        """Take free partitions without waiting: a lock someone else got first is left.

        The tries run side by side: each lock node is a write the server syncs
        to its log, and concurrent writes share a sync, so a dead member's
        share is taken in about the time of one write rather than one each."""
        client = self._client
        locks = self._locks

        def take(p: int) -> bool:
            try:
                return bool(locks[p].acquire(blocking=False))
            except KazooException as exc:  # its node, if one was left, is removed as a leftover
                logger.warning("scanner %s: taking partition %s: %r", self.identifier, p, exc)
                return False

        taken: list[int] = []
        for _ in range(3):
            if client is None or self._stopping or not self._joined() or not wanted:
                break
            results = _side_by_side(take, wanted)
            got = [p for p, ok in zip(wanted, results) if ok]
            self._held.update(got)
            taken += got
            room = self._share() - len(self._held)
            if room <= 0 or len(got) == len(wanted):
                break
            # Some went to another member trying at the same moment: see what is
            # still free now, read afresh (the watches lag behind our own tries).
            others = [p for p in self._set if p not in self._held]
            children = _side_by_side(lambda p: client.get_children(f"{self._locks_path}/{p}"), others)
            free = [p for p, kids in zip(others, children) if not kids]
            wanted = random.sample(free, min(len(free), room))
        if taken:
            logger.info("scanner %s took partitions %s", self.identifier, sorted(taken))

    def _release(self, partitions: list[int]) -> None:
        locks = self._locks
        _side_by_side(lambda p: locks[p].release() if p in locks else None, partitions)
        self._held.difference_update(partitions)
        self._releasing.difference_update(partitions)
        logger.info("scanner %s handed back partitions %s", self.identifier, partitions)

    def _check_held(self, partitions: list[int]) -> None:
        """Locks whose node a watch no longer saw: read again, and drop those really gone."""
        client = self._client
        if client is None:
            return
        for p in partitions:
            lock = self._locks[p]
            try:
                present = lock.node is not None and lock.node in client.get_children(f"{self._locks_path}/{p}")
            except NoNodeError:
                present = False
            if not present:
                logger.warning("scanner %s: its lock on partition %s is gone", self.identifier, p)
                self._held.discard(p)
                self._locks[p] = PartitionLock(client, f"{self._locks_path}/{p}", self.identifier)

    def _remove(self, paths: list[str]) -> None:
        client = self._client
        if client is None:
            return
        for path in paths:
            try:
                client.delete(path)
                logger.warning("scanner %s: removed its leftover lock node %s", self.identifier, path)
            except NoNodeError:
                pass  # the watch had not caught up with its removal yet

    def _renew_session(self) -> None:
        """Start a new session after the link was down past the session timeout."""
        client = self._client
        if client is None or self._stopping:
            return
        self._link_lost_at = time.monotonic()  # one renewal per session timeout at most
        logger.warning("scanner %s: link down past the session timeout; starting a new ZooKeeper session",
                       self.identifier)
        self._forget()
        client.stop()
        if not self._stopping:  # stop() closes the client; don't reopen it
            client.start_async()

    def _publish(self, session: int, owned: frozenset[int]) -> None:
        client = self._client
        if client is None:
            return
        data = owner_record(self.identifier, owned, self._since)
        stat = client.exists(self._owner_path)
        if stat is not None and stat.ephemeralOwner != session:
            # Left by an earlier session (ours before a LOST, or a previous
            # process with the same identifier): it vanishes when that session
            # ends, so writing into it would not keep us listed.
            try:
                client.delete(self._owner_path)
            except NoNodeError:
                pass
            stat = None
        try:
            if stat is None:
                client.create(self._owner_path, data, ephemeral=True, makepath=True)
            else:
                client.set(self._owner_path, data)
        except (NodeExistsError, NoNodeError):
            return  # raced with another writer or an expiry; next poll retries
        self._published = (session, owned)


def zookeeper_owners() -> dict[str, list[int]]:
    _, owners_path = zk_paths()
    client = new_kazoo_client(settings.ZOOKEEPER_HOSTS)
    try:
        client.start(timeout=5)
    except Exception as exc:  # kazoo raises the handler's timeout class
        raise CoordinatorUnavailable(f"ZooKeeper {settings.ZOOKEEPER_HOSTS}: {exc}") from exc
    try:
        try:
            children = client.get_children(owners_path)
        except NoNodeError:
            return {}
        owners: dict[str, list[int]] = {}
        for child in sorted(children):
            try:
                data, _ = client.get(f"{owners_path}/{child}")
            except NoNodeError:
                continue  # its session ended while we were reading
            owners[child] = partitions_in(parse_record(data))
        return owners
    except Exception as exc:  # the link lost after start(): kazoo's ConnectionLoss, or its handler's timeout
        raise CoordinatorUnavailable(f"ZooKeeper {settings.ZOOKEEPER_HOSTS}: {type(exc).__name__} {exc}") from exc
    finally:
        client.stop()
        client.close()


