"""A fast job beside a slow one on one host: `python bench/run.py neighbours [--minutes 10]`.

Two every-minute jobs on one target host, both due at the top of each minute, so the
scanner puts their runs in one message: the slow one's endpoint answers after 65 s
(`timeout: 90s`, no retries), the fast one's at once. The production layout with its
defaults (two scanners, one worker with two children). Over the measured minutes,
each minute must have one succeeded run of the fast job, no `skipped` row of it, and
its `finished_at` within 1 s of its answer at the target: a run's flight ends at its
own answer, not its batch's slowest call (runs.flights). Writes
bench/results/neighbours.json.
"""
from __future__ import annotations

import argparse
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bench import harness
from bench.harness import Layout, print_table, write_result

UTC = timezone.utc
SLOW_SECONDS = 65.0


class _Target:
    """Loopback: /slow answers after SLOW_SECONDS, anything else at once; each answer's
    time (time.time(), when its status line is written) is kept by path."""

    def __init__(self) -> None:
        self.answers: list[tuple[str, float, str]] = []  # (path, at, Idempotency-Key)
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - the library's name
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.startswith("/slow"):
                    time.sleep(SLOW_SECONDS)
                with owner.lock:
                    owner.answers.append((self.path, time.time(), self.headers.get("Idempotency-Key", "")))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run(args: argparse.Namespace) -> int:
    harness.setup_django()
    from django.db import connections

    connections.close_all()
    harness.reset_database()
    harness.reset_redis()
    harness.start_zookeeper()
    from jobs.services import job_create, service_account_ensure
    from runs.models import Run

    target = _Target()
    layout = Layout(env=harness.bench_env())
    try:
        owner, _ = service_account_ensure(name="neighbours")
        common = {"schedule": "* * * * *", "retry_max": 0}
        slow = job_create(owner=owner, fields={**common, "name": "slow", "target": f"{target.url}/slow",
                                                "timeout_seconds": 90})
        fast = job_create(owner=owner, fields={**common, "name": "fast", "target": f"{target.url}/fast"})
        for i in range(2):
            layout.scanner(f"scanner-{i + 1}")
        layout.worker("worker-1", concurrency=2)
        now = datetime.now(UTC)
        first = (now + timedelta(minutes=2)).replace(second=0, microsecond=0)  # a minute or more to warm up
        end = first + timedelta(minutes=args.minutes)
        harness.wait_for(lambda: datetime.now(UTC) > end + timedelta(seconds=20), (end - now).total_seconds() + 60,
                         "the measured minutes to pass", interval=1.0)
        runs = list(Run.objects.filter(job=fast, scheduled_for__gte=first, scheduled_for__lt=end)
                    .order_by("scheduled_for"))
        answered = {key: at for path, at, key in target.answers if path.startswith("/fast")}
        minutes = []
        for i in range(args.minutes):
            t = first + timedelta(minutes=i)
            mine = [r for r in runs if r.scheduled_for == t]
            ok = [r for r in mine if r.status == Run.Status.SUCCEEDED]
            gap = (abs(ok[0].finished_at.timestamp() - answered[ok[0].idempotency_key])
                   if len(ok) == 1 and ok[0].idempotency_key in answered else None)
            minutes.append({"minute": t.strftime("%H:%M"), "rows": [r.status for r in mine],
                            "finished_after_answer_s": round(gap, 3) if gap is not None else None})
        good = [m for m in minutes if m["rows"] == ["succeeded"] and m["finished_after_answer_s"] is not None
                and m["finished_after_answer_s"] < 1.0]
        slow_calls = sum(1 for path, _, _ in target.answers if path.startswith("/slow"))
        summary: dict[str, Any] = {
            "holds": len(good) == args.minutes,  # every measured minute as the promise says
            "minutes": args.minutes,
            "slow_call_s": SLOW_SECONDS,
            "fast_minutes_with_one_succeeded_run_within_1s": len(good),
            "fast_skipped_rows": sum(m["rows"].count("skipped") for m in minutes),
            "fast_worst_finished_after_answer_s": max((m["finished_after_answer_s"] or 0.0) for m in minutes),
            "slow_calls_answered": slow_calls,
            "slow_runs_skipped_as_overlap": Run.objects.filter(job=slow, status=Run.Status.SKIPPED,
                                                               scheduled_for__gte=first, scheduled_for__lt=end).count(),
            "per_minute": minutes,
            "layout": {"scanners": 2, "workers": 1, "concurrency": 2, "settings_changed": "none"},
        }
        print_table("neighbours", [(k, v) for k, v in summary.items() if not isinstance(v, (list, dict))])
        print("written", write_result("neighbours", summary))
        return 0  # the figures say whether it held ("holds"); an older commit's are kept as its baseline
    finally:
        layout.cleanup()
        target.stop()
        harness.stop_zookeeper()
