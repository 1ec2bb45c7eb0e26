"""The idempotency rule of a target, without Django: one key, one effect.

Per `Idempotency-Key` a target keeps the highest `X-Fence-Token` seen and whether
the effect was applied (with the answer given then). For each call:

- a fence lower than the highest seen: refuse it (409): an old lease holder;
- a key already applied: answer again with the stored answer, do not apply;
- otherwise apply the effect, and mark the key applied in the same transaction.

`decide` is that rule as a pure function. `Deliveries` keeps the rows in the
target's own database through any DB-API 2 connection (sqlite3, psycopg...), so
the bookkeeping commits or rolls back with the effect.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Action = Literal["refuse", "replay", "apply"]
MAX_KEY = 200


@dataclass(frozen=True)
class Seen:
    """What the target has recorded for one key."""

    highest_fence: int = 0
    applied: bool = False
    status: int | None = None
    body: bytes = b""
    content_type: str = ""


def parse_fence(raw: str | None) -> int | None:
    """X-Fence-Token as a number, or None when it is missing or not a plain number."""
    raw = raw or ""
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 18 else None


def check_headers(key: str | None, fence: str | None) -> str | None:
    """None when the call carries a usable key and fence; otherwise why not."""
    if not key or len(key) > MAX_KEY or parse_fence(fence) is None:
        return "Idempotency-Key and a numeric X-Fence-Token are required"
    return None


def decide(seen: Seen | None, fence: int) -> Action:
    """What to do with a call under `fence`, given what was recorded for its key."""
    seen = seen or Seen()
    if fence < seen.highest_fence:
        return "refuse"
    if seen.applied:
        return "replay"
    return "apply"


class Deliveries:
    """The rule's rows in a table of the target's own database, through its DB-API 2
    connection, inside the transaction the caller opens around the effect:

        with conn:                                   # one transaction (sqlite3)
            action, seen = deliveries.begin(cur, key, fence)
            if action == "apply":
                ... the effect, on the same connection ...
                deliveries.applied(cur, key, 201, b'{"ok": true}', "application/json")

    `paramstyle` is the driver's ("qmark" for sqlite3, "format" for psycopg).
    `lock` adds FOR UPDATE to the read (PostgreSQL, MySQL: one call per key at a
    time); SQLite locks the whole database for a write transaction anyway.
    """

    def __init__(self, table: str = "receiver_deliveries", *, paramstyle: str = "qmark", lock: bool = False) -> None:
        if not table.replace("_", "").isalnum():
            raise ValueError("table must be a plain name")
        self.table = table
        self.mark = "?" if paramstyle == "qmark" else "%s"
        self.lock = lock

    def create_table(self, cursor: Any) -> None:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {self.table} (key VARCHAR({MAX_KEY}) PRIMARY KEY, "
            "highest_fence BIGINT NOT NULL DEFAULT 0, applied BOOLEAN NOT NULL DEFAULT FALSE, "
            "status INTEGER, body BLOB, content_type VARCHAR(100) NOT NULL DEFAULT '', "
            "calls INTEGER NOT NULL DEFAULT 0)"
        )

    def begin(self, cursor: Any, key: str, fence: int) -> tuple[Action, Seen]:
        """Record the call and decide; the caller's transaction keeps it atomic."""
        m = self.mark
        cursor.execute(f"SELECT highest_fence, applied, status, body, content_type FROM {self.table} "
                       f"WHERE key = {m}" + (" FOR UPDATE" if self.lock else ""), (key,))
        row = cursor.fetchone()
        seen = None if row is None else Seen(int(row[0]), bool(row[1]), row[2], bytes(row[3] or b""), row[4] or "")
        action = decide(seen, fence)
        if row is None:
            cursor.execute(f"INSERT INTO {self.table} (key, highest_fence, calls) VALUES ({m}, {m}, 1)", (key, fence))
        elif action == "refuse":
            cursor.execute(f"UPDATE {self.table} SET calls = calls + 1 WHERE key = {m}", (key,))
        else:
            cursor.execute(f"UPDATE {self.table} SET calls = calls + 1, highest_fence = {m} WHERE key = {m}",
                           (fence, key))
        return action, seen or Seen(highest_fence=fence)

    def applied(self, cursor: Any, key: str, status: int, body: bytes, content_type: str = "") -> None:
        """Mark the key applied with the answer given (only for a 2xx)."""
        m = self.mark
        cursor.execute(f"UPDATE {self.table} SET applied = {m}, status = {m}, body = {m}, content_type = {m} "
                       f"WHERE key = {m}", (True, status, body, content_type[:100], key))
