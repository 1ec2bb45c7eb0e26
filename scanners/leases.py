"""What every partition-lease coordinator shares (scanners.coordination chooses one):
the PartitionLeases protocol, the owner record the ops pages read, and the scanner
loop's sleep.
"""
from __future__ import annotations

import json
import os
import socket
import threading
from datetime import datetime, timezone
from typing import Any, Protocol, runtime_checkable

from django.conf import settings

NOTHING: frozenset[int] = frozenset()
LOCK_FILE = "scanner.lock"
OWNER_FILE = "scanner.owner.json"

@runtime_checkable
class PartitionLeases(Protocol):
    identifier: str

    def start(self) -> None: ...

    def poll(self) -> frozenset[int]: ...

    def stop(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...

    def wait(self, timeout: float) -> bool: ...

    def wake(self) -> None: ...


def default_identifier() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


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


class _Wakeable:
    """The scanner loop's sleep: until the leases change (`wake`) or the timeout."""

    _wake: threading.Event

    def wait(self, timeout: float) -> bool:
        """Sleep until something changed (True) or `timeout` passed (False)."""
        woken = self._wake.wait(max(0.0, timeout))
        self._wake.clear()
        return woken

    def wake(self) -> None:
        self._wake.set()


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
