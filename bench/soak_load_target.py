"""The soak's target under load (`bench/soak.py --rate R`): an idempotent receiver
cheap enough for hundreds of calls a second, recording every call.

    python bench/soak_load_target.py --ports 18401,18402 --db postgres://.../sched_soak_target \
        --control /tmp/.../target-control.json

One asyncio process serving every port (each port a target host to the scheduler),
plain HTTP/1.1 with keep-alive, no framework. It follows the receiver's rule
(`receiver.views.delivery_admit`, as tests/counting_target.py does), in memory: a
call whose X-Fence-Token is lower than the highest its Idempotency-Key has seen is
refused (409); a key already applied is answered again without applying (a replay,
`Idempotent-Replay: true`); otherwise the effect is applied, once.

Its records are the soak's evidence, in the same two tables as bench/soak_target.py
(bench/soak_stack.py's TARGET_SCHEMA): every applied effect a row of `soak_effects`,
every call a row of `soak_calls` (applied, replayed, refused, failed). They are written
in batches: a thread COPYs what came in every 0.25 s, on one connection, so recording
costs a few statements a second whatever the rate. The in-memory state is the target's
truth while it runs (the soak never kills the target); the batch is flushed before it
exits on SIGTERM, and the soak reads the tables only after that.

`soak_effects` is written from the applications themselves, not deduplicated by the
table: a key applied twice (the in-memory rule broken, or two applications racing)
is two rows, which the soak counts.

The soak tells a port to misbehave for a while through the control file
(SOAK_TARGET_CONTROL, as bench/soak_target.py reads it): {"<port>": {"mode": "slow" |
"error", "until": <unix time>, "slow_s": 3}}, read again at most every 0.2 s. "error"
answers 503 before the effect, "slow" applies it after `slow_s` seconds; otherwise
each call takes --min-ms to --max-ms, so the soak can catch a worker mid-call.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import threading
import time
from datetime import datetime, timezone
from typing import Any

import psycopg

FLUSH_EVERY_S = 0.25


class Records:
    """Effects and calls as they come in, COPYed to the target's database in batches."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.lock = threading.Lock()
        self.effects: list[tuple[Any, ...]] = []
        self.calls: list[tuple[Any, ...]] = []
        self.stopping = threading.Event()
        self.flushed = {"effects": 0, "calls": 0, "batches": 0}
        self.thread = threading.Thread(target=self._run, name="records", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _take(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        with self.lock:
            effects, calls = self.effects, self.calls
            self.effects, self.calls = [], []
        return effects, calls

    def _run(self) -> None:
        conn = psycopg.connect(self.url, autocommit=False)
        try:
            while True:
                stopping = self.stopping.wait(FLUSH_EVERY_S)
                effects, calls = self._take()
                if effects or calls:
                    with conn.cursor() as cur:
                        if effects:
                            with cur.copy("COPY soak_effects (key, fence, run_id, port, applied_at) FROM STDIN") as cp:
                                for row in effects:
                                    cp.write_row(row)
                        if calls:
                            with cur.copy("COPY soak_calls (key, fence, attempt, run_id, port, outcome, status, "
                                          "arrived, answered) FROM STDIN") as cp:
                                for row in calls:
                                    cp.write_row(row)
                    conn.commit()
                    self.flushed["effects"] += len(effects)
                    self.flushed["calls"] += len(calls)
                    self.flushed["batches"] += 1
                if stopping:
                    return
        finally:
            conn.close()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=60)


class Control:
    def __init__(self, path: str) -> None:
        self.path, self.read_at, self.modes = path, 0.0, {}  # type: ignore[var-annotated]

    def mode(self, port: int) -> tuple[str, float]:
        now = time.time()
        if now - self.read_at > 0.2:
            self.read_at = now
            try:
                with open(self.path) as f:
                    self.modes = json.load(f)
            except (OSError, ValueError):
                self.modes = {}
        entry = self.modes.get(str(port)) or {}
        if float(entry.get("until", 0)) <= now:
            return "ok", 0.0
        return str(entry.get("mode", "ok")), float(entry.get("slow_s", 3))


class Receiver:
    def __init__(self, records: Records, control: Control, min_s: float, max_s: float) -> None:
        self.records, self.control, self.min_s, self.max_s = records, control, min_s, max_s
        self.highest: dict[str, int] = {}
        self.applied: set[str] = set()

    def _admit(self, key: str, fence: int) -> str:
        """The receiver's rule; 'apply' reserves the key (a call racing it is a replay)."""
        if fence < self.highest.get(key, 0):
            return "refused"
        self.highest[key] = max(fence, self.highest.get(key, 0))
        return "replayed" if key in self.applied else "apply"

    async def call(self, port: int, headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
        arrived = time.time()
        key = headers.get("idempotency-key", "")
        fence_text, attempt_text = headers.get("x-fence-token", ""), headers.get("x-attempt", "")
        fence = int(fence_text) if fence_text.isdigit() else 0
        run_id = headers.get("x-run-id", "")
        mode, slow = self.control.mode(port)
        extra: dict[str, str] = {}
        if mode == "error":
            status, outcome, body = 503, "failed", b'{"error": "told to fail"}'
        else:
            await asyncio.sleep(slow if mode == "slow" else random.uniform(self.min_s, self.max_s))
            verdict = self._admit(key, fence)
            if verdict == "refused":
                status, outcome, body = 409, "refused", b'{"error": "superseded fence"}'
            elif verdict == "replayed":
                status, outcome, body = 200, "replayed", b'{"replayed": true}'
                extra["Idempotent-Replay"] = "true"
            else:
                self.applied.add(key)
                status, outcome, body = 200, "applied", b'{"applied": true}'
                with self.records.lock:
                    self.records.effects.append((key, fence, run_id, port, _ts(time.time())))
        with self.records.lock:
            self.records.calls.append((key, fence if fence_text.isdigit() else None,
                                       int(attempt_text) if attempt_text.isdigit() else None, run_id, port,
                                       outcome, status, arrived, time.time()))
        return status, body, extra


def _ts(t: float) -> datetime:
    return datetime.fromtimestamp(t, timezone.utc)


REASONS = {200: b"OK", 409: b"Conflict", 503: b"Service Unavailable", 400: b"Bad Request"}


async def serve(receiver: Receiver, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            headers: dict[str, str] = {}
            for line in head.split(b"\r\n")[1:]:
                if b":" in line:
                    name, value = line.split(b":", 1)
                    headers[name.strip().lower().decode()] = value.strip().decode(errors="replace")
            length = int(headers.get("content-length", "0") or 0)
            if length:
                await reader.readexactly(length)
            status, body, extra = await receiver.call(port, headers)
            lines = [b"HTTP/1.1 %d %s" % (status, REASONS.get(status, b"OK")), b"Content-Type: application/json",
                     b"Content-Length: %d" % len(body)]
            lines += [f"{k}: {v}".encode() for k, v in extra.items()]
            writer.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
        pass
    finally:
        writer.close()


async def main(args: argparse.Namespace) -> None:
    records = Records(args.db)
    records.start()
    receiver = Receiver(records, Control(args.control), args.min_ms / 1000, args.max_ms / 1000)
    servers = []
    for port in [int(p) for p in args.ports.split(",")]:
        servers.append(await asyncio.start_server(
            lambda r, w, p=port: serve(receiver, p, r, w), "127.0.0.1", port, backlog=2048))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening on 127.0.0.1:{args.ports}", flush=True)
    await stop.wait()
    for server in servers:
        server.close()
    records.stop()
    print(f"records flushed: {json.dumps(records.flushed)}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", required=True, help="comma-separated loopback ports")
    parser.add_argument("--db", required=True, help="the target's database URL")
    parser.add_argument("--control", default=os.environ.get("SOAK_TARGET_CONTROL", ""))
    parser.add_argument("--min-ms", type=float, default=5)
    parser.add_argument("--max-ms", type=float, default=60)
    asyncio.run(main(parser.parse_args()))
