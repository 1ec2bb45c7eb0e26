"""Counts database statements per process, for the benches (off unless
SCHEDULER_COUNT_STATEMENTS_DIR is set). Each process writes `<dir>/<pid>.json`
about once a second: {"statements": N}. With SCHEDULER_COUNT_STATEMENTS_BY_SQL set
too, also {"by_sql": {"<process kind>: <the statement's first words>": N}}, to see
which statements a bench's figure is made of, and {"ms_by_sql": {...}}: the time each
kind of statement took, as this process waited for it (the round trip included).
"""
from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

_lock = threading.Lock()
_count = 0
_flusher_pid = 0
_kind = ""  # this process's kind, for the by-statement keys (set at its first statement)
_by_sql: dict[str, int] = {}
_ms_by_sql: dict[str, float] = {}
_SAVEPOINT_NAME = re.compile(r'"s\d+_x\d+"')  # one name a savepoint: counted as one statement


def _counter(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
    global _count, _flusher_pid, _kind
    with _lock:
        if _flusher_pid != os.getpid():  # first statement in this process (prefork children too)
            _flusher_pid, _kind = os.getpid(), _kind_of_process()
            _count = 0  # a prefork child starts from its parent's count: its own file counts from 0
            _by_sql.clear()
            _ms_by_sql.clear()
            threading.Thread(target=_flush_forever, daemon=True).start()
        _count += 1
        if not os.environ.get("SCHEDULER_COUNT_STATEMENTS_BY_SQL"):
            key = ""
        else:
            key = f"{_kind}: {_SAVEPOINT_NAME.sub('<name>', ' '.join(sql.split())[:100])}"
            _by_sql[key] = _by_sql.get(key, 0) + 1
    if not key:
        return execute(sql, params, many, context)
    started = time.perf_counter()
    try:
        return execute(sql, params, many, context)
    finally:
        took = (time.perf_counter() - started) * 1000
        with _lock:
            _ms_by_sql[key] = _ms_by_sql.get(key, 0.0) + took


def _kind_of_process() -> str:
    args = " ".join(sys.argv)
    return "scanner" if "scanner" in args else "worker" if "celery" in args else os.path.basename(sys.argv[0])


def note() -> None:
    """Count a statement that does not pass through Django's execute wrappers (COPY)."""
    if os.environ.get("SCHEDULER_COUNT_STATEMENTS_DIR"):
        _counter(lambda *args: None, "COPY", None, False, None)


def _flush_forever() -> None:
    path = Path(os.environ["SCHEDULER_COUNT_STATEMENTS_DIR"]) / f"{os.getpid()}.json"
    while True:
        with _lock:
            body: dict[str, Any] = {"statements": _count}
            if _by_sql:
                body["by_sql"] = dict(_by_sql)
                body["ms_by_sql"] = {k: round(v, 3) for k, v in _ms_by_sql.items()}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(path)  # a reader never sees half a file
        time.sleep(1.0)


def install() -> None:
    if not os.environ.get("SCHEDULER_COUNT_STATEMENTS_DIR"):
        return
    from django.db.backends.signals import connection_created

    def add_wrapper(sender: Any, connection: Any, **kwargs: Any) -> None:
        if _counter not in connection.execute_wrappers:
            connection.execute_wrappers.append(_counter)

    connection_created.connect(add_wrapper, weak=False)
