"""Partition leases: which partitions of the runs table this scanner may scan now.

Runs are partitioned ``job_id % SCHEDULER_PARTITIONS``. Each scanner process
loops: ``poll()`` (advance the lease state, learn what it owns right now), scan
those partitions, sleep. Two coordinators exist:

* ``ZooKeeperLeases`` (``ZOOKEEPER_HOSTS`` set): kazoo's ``SetPartitioner``
  splits the partitions among the live members, each partition guarded by a
  ZooKeeper lock. Each member publishes what it owns under
  ``{root}/owners/{identifier}`` for the ops pages.
* ``LocalLeases`` (embedded, no server): one member owns everything while it
  holds an exclusive ``flock`` on ``DATA_DIR/scanner.lock``.

A lease is advisory: a member that froze may still believe it owns partitions
for a moment after resuming. The fence in the runs store is what makes that
safe; this module only has to stop claiming partitions as soon as it *knows*
it may have lost them.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from django.conf import settings
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError
from kazoo.protocol.states import KazooState
from kazoo.recipe.partitioner import SetPartitioner

logger = logging.getLogger("scheduler.scanners.coordination")

NOTHING: frozenset[int] = frozenset()
LOCK_FILE = "scanner.lock"
OWNER_FILE = "scanner.owner.json"

# How long stop() waits for ZooKeeper work before closing the client anyway.
# Closing the session releases everything server-side, so waiting longer buys
# nothing but a slower shutdown.
STOP_GRACE_SECONDS = 5.0
# Upper bound on start()'s wait for the first connection (the brief: <= ~30 s).
CONNECT_WAIT_SECONDS = 15.0
# kazoo's default retry backs off to an hour between attempts; a scanner that
# lost ZooKeeper for a few minutes must notice it is back within seconds.
RETRY_MAX_DELAY_SECONDS = 2.0


@runtime_checkable
class PartitionLeases(Protocol):
    identifier: str

    def start(self) -> None: ...

    def poll(self) -> frozenset[int]: ...

    def stop(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


def default_identifier() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


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


class CoordinatorUnavailable(RuntimeError):
    pass


def check_identifier(identifier: str) -> str:
    # The identifier names ZooKeeper nodes (party member, owners entry).
    if not identifier or "/" in identifier or identifier in (".", ".."):
        raise ValueError(f"scanner identifier {identifier!r} cannot name a ZooKeeper node")
    return identifier


def all_partitions() -> frozenset[int]:
    return frozenset(range(settings.SCHEDULER_PARTITIONS))


def utc_now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def owner_record(identifier: str, owned: frozenset[int], since: str) -> bytes:
    return json.dumps(
        {"identifier": identifier, "partitions": sorted(owned), "since": since}
    ).encode()


# --------------------------------------------------------------------------- ZooKeeper


def zk_paths() -> tuple[str, str]:
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


class ZooKeeperLeases:
    """A SetPartitioner member, driven from poll().

    poll() must never block for long, but kazoo's synchronous calls wait for a
    reply and, while the link is down, wait until it comes back. So poll()
    only reads state; the calls that talk to ZooKeeper (join, release, publish)
    run one at a time on a short-lived background thread, and poll() returns
    nothing while the partitioner is not ACQUIRED.
    """

    kind = "zookeeper"

    def __init__(self, identifier: str) -> None:
        self.identifier = check_identifier(identifier)
        self._hosts: str = settings.ZOOKEEPER_HOSTS
        self._partitions_path, owners_path = zk_paths()
        self._owner_path = f"{owners_path}/{self.identifier}"
        self._set = tuple(sorted(all_partitions()))
        self._time_boundary = settings.SCHEDULER_ZK_TIME_BOUNDARY
        self._client: KazooClient | None = None
        # Set by kazoo's thread on CONNECTED, cleared on SUSPENDED/LOST: the
        # one signal poll() trusts to drop its partitions at once.
        self._connected = threading.Event()
        # When the link went down (monotonic), None while connected: see _next_step.
        self._link_lost_at: float | None = time.monotonic()
        self._stopping = False
        self._partitioner: SetPartitioner | None = None
        self._partitioner_session: int | None = None
        self._task: threading.Thread | None = None
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
        # Join now, so the time_boundary countdown starts before the first poll.
        self._run_step(self._join)

    def poll(self) -> frozenset[int]:
        owned = self._owned_now()
        self._note(owned)
        if self._task is None or not self._task.is_alive():
            step = self._next_step()
            if step is not None:
                self._spawn(step)
        return owned

    def stop(self) -> None:
        client = self._client
        if client is None:
            return
        self._stopping = True
        self._note(NOTHING)
        self._join_task(STOP_GRACE_SECONDS)
        if self._connected.is_set():
            # Leave explicitly (locks, party, owners entry) so the others start
            # rebalancing at once. Bounded: closing the session below removes
            # the same nodes anyway, and also unblocks a call on a dead link.
            leave = threading.Thread(target=self._leave, name=f"leases-leave-{self.identifier}",
                                     daemon=True)
            leave.start()
            leave.join(STOP_GRACE_SECONDS)
        try:
            client.stop()
        finally:
            client.close()
            self._join_task(STOP_GRACE_SECONDS)
            self._client = None
            self._partitioner = None
            self._connected.clear()

    def describe(self) -> dict[str, Any]:
        return {
            "identifier": self.identifier,
            "kind": self.kind,
            "state": self._state_name(),
            "owned": sorted(self._owned),
        }

    # ----------------------------------------------------------------- kazoo thread

    def _on_state(self, state: KazooState) -> None:
        # Runs on kazoo's connection thread: no blocking, no ZooKeeper calls.
        if state == KazooState.CONNECTED:
            self._link_lost_at = None
            self._connected.set()
        else:  # SUSPENDED or LOST: we may no longer hold our locks
            self._connected.clear()
            if self._link_lost_at is None:
                self._link_lost_at = time.monotonic()

    # ----------------------------------------------------------------- reading state

    def _session(self) -> int | None:
        client_id = self._client.client_id if self._client is not None else None
        return client_id[0] if client_id else None

    def _owned_now(self) -> frozenset[int]:
        if self._stopping or not self._connected.is_set():
            return NOTHING
        partitioner = self._partitioner
        # A partitioner from an earlier session lost its locks with it, even
        # if kazoo has not yet moved it to FAILURE.
        if partitioner is None or self._partitioner_session != self._session():
            return NOTHING
        if not partitioner.acquired:
            # wait_for_acquire() only waits on the event ACQUIRED sets, so
            # reading the state is the non-blocking form of it.
            return NOTHING
        return frozenset(partitioner)

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
        partitioner = self._partitioner
        if partitioner is None or self._partitioner_session != self._session():
            return "joining"
        return str(partitioner.state).lower()

    # ----------------------------------------------------------------- steps

    def _next_step(self) -> Callable[[], None] | None:
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
        partitioner = self._partitioner
        session = self._session()
        if partitioner is not None and partitioner.failed and self._partitioner_session == session:
            return self._renew_session
        if partitioner is None or partitioner.failed or self._partitioner_session != session:
            return self._join
        if partitioner.release:
            # The party changed (or the link blipped): hand our locks back so
            # the new split can be acquired. Only ever done from poll(), i.e.
            # after the scan that used them has finished.
            return partitioner.release_set
        if session is not None and self._published != (session, self._owned):
            owned = self._owned
            return lambda: self._publish(session, owned)
        return None

    def _spawn(self, step: Callable[[], None]) -> None:
        name = getattr(step, "__name__", "step").strip("_<>")
        self._task = threading.Thread(target=self._run_step, args=(step,),
                                      name=f"leases-{name}-{self.identifier}", daemon=True)
        self._task.start()

    def _run_step(self, step: Callable[[], None]) -> None:
        try:
            step()
        except KazooException as exc:
            # Retried on a later poll; the link state decides what happens next.
            logger.warning("scanner %s: ZooKeeper step failed: %r", self.identifier, exc)
        except Exception:
            logger.exception("scanner %s: ZooKeeper step failed", self.identifier)

    def _join_task(self, timeout: float) -> None:
        task = self._task
        if task is not None and task is not threading.current_thread():
            task.join(timeout)

    def _join(self) -> None:
        """(Re)create the partitioner: first join, or after FAILURE / a new session."""
        client = self._client
        if client is None or self._stopping:
            return
        old, self._partitioner = self._partitioner, None
        if old is not None:
            self._discard(client, old)
        session = self._session()
        partitioner = SetPartitioner(
            client,
            path=self._partitions_path,
            set=self._set,
            identifier=self.identifier,
            time_boundary=self._time_boundary,
        )
        if self._stopping:  # stop() raced us; don't leave a member behind
            partitioner.finish()
            return
        self._partitioner_session = session
        self._partitioner = partitioner

    def _renew_session(self) -> None:
        """Replace a partitioner that failed while our session lived on.

        kazoo swallows errors when a failing partitioner releases its locks
        and leaves the party, so a lock or party node of ours may survive in
        this session: a lock would stall the next allocation forever, a party
        node would count a member that takes no partitions. Only a new
        session is sure to remove them; poll() then joins on that session.
        """
        client = self._client
        old, self._partitioner = self._partitioner, None
        if client is None or self._stopping:
            return
        self._link_lost_at = time.monotonic()  # one renewal per session timeout at most
        if old is not None:
            client.remove_listener(old._establish_sessionwatch)
        logger.warning("scanner %s: partitioner failed or link down past the session timeout; "
                       "starting a new ZooKeeper session", self.identifier)
        client.stop()
        if not self._stopping:  # stop() closes the client; don't reopen it
            client.start_async()

    @staticmethod
    def _discard(client: KazooClient, partitioner: SetPartitioner) -> None:
        # The old partitioner's session listener stays registered unless the
        # session was LOST (it removes itself then); drop it so repeated
        # failures don't pile listeners up. kazoo offers no public handle.
        client.remove_listener(partitioner._establish_sessionwatch)
        try:
            # Releases any locks and the party node still held in this
            # session; on a new session these are gone and this is a no-op.
            partitioner.finish()
        except KazooException:
            pass

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

    def _leave(self) -> None:
        client = self._client
        partitioner = self._partitioner
        try:
            if partitioner is not None:
                partitioner.finish()
            session = self._session()
            stat = client.exists(self._owner_path) if client is not None else None
            if client is not None and stat is not None and stat.ephemeralOwner == session:
                client.delete(self._owner_path)
        except KazooException as exc:
            logger.warning("scanner %s: leaving ZooKeeper: %r", self.identifier, exc)


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
    finally:
        client.stop()
        client.close()


def parse_record(data: bytes) -> dict[str, Any]:
    try:
        record = json.loads(data or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def partitions_in(record: dict[str, Any]) -> list[int]:
    try:
        return sorted(int(p) for p in record.get("partitions", []))
    except (ValueError, TypeError):
        return []


# --------------------------------------------------------------------------- embedded


class LocalLeases:
    """The embedded single-node coordinator: all partitions, while holding the lock.

    A second embedded scanner on the same machine gets nothing until the
    first exits (the kernel drops a flock when its holder dies, even by
    SIGKILL), then takes over on its next poll.
    """

    kind = "local"

    def __init__(self, identifier: str) -> None:
        self.identifier = check_identifier(identifier)
        data_dir = Path(settings.DATA_DIR)
        self._lock_path = data_dir / LOCK_FILE
        self._owner_path = data_dir / OWNER_FILE
        self._partitions = all_partitions()
        self._fd: int | None = None
        self._started = False

    def start(self) -> None:
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        self._started = True

    def poll(self) -> frozenset[int]:
        if not self._started:
            return NOTHING
        if self._fd is not None and not self._lock_file_is_ours():
            self._drop()
        if self._fd is None:
            self._try_lock()
        return self._partitions if self._fd is not None else NOTHING

    def stop(self) -> None:
        self._started = False
        if self._fd is not None:
            # Remove the owner record while still holding the lock, so no
            # other holder's record can be removed by mistake.
            try:
                self._owner_path.unlink()
            except FileNotFoundError:
                pass
            self._drop()

    def describe(self) -> dict[str, Any]:
        state = "stopped" if not self._started else ("acquired" if self._fd is not None else "waiting")
        return {
            "identifier": self.identifier,
            "kind": self.kind,
            "state": state,
            "owned": sorted(self._partitions) if self._fd is not None else [],
        }

    def _try_lock(self) -> None:
        # A fresh open each try: flock belongs to the open file description,
        # and a lock file someone deleted must not stay locked by us alone.
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            return
        self._fd = fd
        if not self._lock_file_is_ours():  # deleted between our open and flock
            self._drop()
            return
        self._write_owner()
        logger.info("scanner %s holds %s: owns all %d partitions",
                    self.identifier, self._lock_path, len(self._partitions))

    def _lock_file_is_ours(self) -> bool:
        # If the file was deleted or replaced, a newcomer would lock a
        # different inode and both would scan: give ours up and retry.
        assert self._fd is not None
        try:
            on_disk = os.stat(self._lock_path)
        except FileNotFoundError:
            return False
        held = os.fstat(self._fd)
        return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)

    def _write_owner(self) -> None:
        # Written to a temporary file and renamed, so a reader never sees half.
        tmp = self._owner_path.with_name(f".{OWNER_FILE}.{os.getpid()}.{id(self)}")
        tmp.write_bytes(owner_record(self.identifier, self._partitions, utc_now_iso()))
        os.replace(tmp, self._owner_path)

    def _drop(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None
            logger.info("scanner %s released %s", self.identifier, self._lock_path)


def local_owners() -> dict[str, list[int]]:
    data_dir = Path(settings.DATA_DIR)
    try:
        fd = os.open(data_dir / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    try:
        try:
            # Getting a shared lock means nobody holds the exclusive one, so a
            # leftover owner file (from a killed holder) means nothing. This
            # can make a waiting scanner's try fail once; it retries next poll.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        else:
            return {}
        try:
            record = parse_record((data_dir / OWNER_FILE).read_bytes())
        except FileNotFoundError:
            record = {}
        if not record.get("identifier"):
            return {}  # the holder has not written its record yet
        return {str(record["identifier"]): partitions_in(record)}
    finally:
        os.close(fd)
