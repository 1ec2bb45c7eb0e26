"""The embedded single-node coordinator (no server): one scanner owns every partition
while it holds an exclusive flock on DATA_DIR/scanner.lock.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
from pathlib import Path
from typing import Any

from django.conf import settings

from scanners.leases import (
    LOCK_FILE, NOTHING, OWNER_FILE, _Wakeable, all_partitions, check_identifier, owner_record, parse_record,
    partitions_in, utc_now_iso,
)

logger = logging.getLogger("scheduler.scanners.coordination")


class LocalLeases(_Wakeable):
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
        self._wake = threading.Event()

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
