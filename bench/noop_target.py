"""A fast loopback HTTP target for benches: answers 200 to anything, keeps connections alive.

    python bench/noop_target.py --port 18080 [--delay-ms 100] --log arrivals.csv

Each request's arrival (unix time) and X-Run-Id go to the log when it stops (SIGTERM/SIGINT).
Plain asyncio streams: no framework, so the target is not what the bench measures.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import time

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"


class Target:
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.arrivals: list[tuple[float, str]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                at = time.time()
                length, run_id = 0, ""
                for line in head.split(b"\r\n"):
                    lower = line.lower()
                    if lower.startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                    elif lower.startswith(b"x-run-id:"):
                        run_id = line.split(b":", 1)[1].strip().decode()
                if length:
                    await reader.readexactly(length)
                self.arrivals.append((at, run_id))
                if self.delay:
                    await asyncio.sleep(self.delay)
                writer.write(RESPONSE)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


async def main(port: int, delay: float, log: str) -> None:
    target = Target(delay)
    server = await asyncio.start_server(target.handle, "127.0.0.1", port, backlog=1024)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening on 127.0.0.1:{port}", flush=True)
    async with server:
        await stop.wait()
    if log:
        with open(log, "w") as out:
            out.writelines(f"{at:.6f},{run_id}\n" for at, run_id in target.arrivals)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--log", default="")
    args = parser.parse_args()
    asyncio.run(main(args.port, args.delay_ms / 1000.0, args.log))
