"""The idempotency rule without Django, on sqlite3 through receiver.rules.Deliveries."""
from __future__ import annotations

import sqlite3

import pytest

from receiver.rules import Deliveries, Seen, check_headers, decide

KEY = "job_7@2026-10-28T20:30:00Z"


def test_the_rule_refuses_an_older_fence_replays_an_applied_key_and_applies_a_new_one() -> None:
    assert decide(None, 1) == "apply"
    assert decide(Seen(highest_fence=3), 2) == "refuse"
    assert decide(Seen(highest_fence=3, applied=True), 4) == "replay"
    assert decide(Seen(highest_fence=3, applied=True), 1) == "refuse"


@pytest.mark.parametrize(("key", "fence"), [("", "1"), (KEY, None), (KEY, "x"), (KEY, "-1"), ("k" * 201, "1")])
def test_a_call_without_a_usable_key_or_fence_is_refused(key: str, fence: str | None) -> None:
    assert check_headers(key, fence) is not None
    assert check_headers(KEY, "41") is None


def apply_once(conn: sqlite3.Connection, deliveries: Deliveries, fence: int, effects: list[str]) -> str:
    """A target's handler: the effect and the bookkeeping in one transaction."""
    with conn:
        cur = conn.cursor()
        action, _ = deliveries.begin(cur, KEY, fence)
        if action == "apply":
            cur.execute("INSERT INTO reports (kind) VALUES ('daily')")
            deliveries.applied(cur, KEY, 201, b'{"ok": true}', "application/json")
        effects.append(action)
        return action


def test_on_sqlite_the_effect_happens_once_across_retries_and_a_late_old_holder() -> None:
    conn = sqlite3.connect(":memory:")
    deliveries = Deliveries()
    with conn:
        deliveries.create_table(conn.cursor())
        conn.execute("CREATE TABLE reports (id INTEGER PRIMARY KEY, kind TEXT)")
    effects: list[str] = []
    assert apply_once(conn, deliveries, 1, effects) == "apply"
    assert apply_once(conn, deliveries, 2, effects) == "replay"  # a retry after a lost answer
    assert apply_once(conn, deliveries, 1, effects) == "refuse"  # the first holder, waking up late
    assert conn.execute("SELECT count(*) FROM reports").fetchone()[0] == 1
    assert conn.execute("SELECT highest_fence, calls, status FROM receiver_deliveries").fetchone() == (2, 3, 201)


def test_a_failed_effect_rolls_back_with_its_bookkeeping() -> None:
    conn = sqlite3.connect(":memory:")
    deliveries = Deliveries()
    with conn:
        deliveries.create_table(conn.cursor())
    with pytest.raises(RuntimeError):
        with conn:
            deliveries.begin(conn.cursor(), KEY, 1)
            raise RuntimeError("the effect failed")
    assert conn.execute("SELECT count(*) FROM receiver_deliveries").fetchone()[0] == 0
