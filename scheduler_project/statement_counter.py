"""Counts database statements per process, for the benches (off unless
SCHEDULER_COUNT_STATEMENTS_DIR is set). Each process writes `<dir>/<pid>.json`
about once a second: {"statements": N}.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

_lock = threading.Lock()
_count = 0
_flusher_pid = 0


def _counter(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
    global _count, _flusher_pid
    with _lock:
        _count += 1
        if _flusher_pid != os.getpid():  # first statement in this process (prefork children too)
            _flusher_pid = os.getpid()
            threading.Thread(target=_flush_forever, daemon=True).start()
    return execute(sql, params, many, context)


def note() -> None:
    """Count a statement that does not pass through Django's execute wrappers (COPY)."""
    if os.environ.get("SCHEDULER_COUNT_STATEMENTS_DIR"):
        _counter(lambda *args: None, "COPY", None, False, None)


def _flush_forever() -> None:
    path = Path(os.environ["SCHEDULER_COUNT_STATEMENTS_DIR"]) / f"{os.getpid()}.json"
    while True:
        path.write_text(json.dumps({"statements": _count}))
        time.sleep(1.0)


def install() -> None:
    if not os.environ.get("SCHEDULER_COUNT_STATEMENTS_DIR"):
        return
    from django.db.backends.signals import connection_created

    def add_wrapper(sender: Any, connection: Any, **kwargs: Any) -> None:
        if _counter not in connection.execute_wrappers:
            connection.execute_wrappers.append(_counter)

    connection_created.connect(add_wrapper, weak=False)
