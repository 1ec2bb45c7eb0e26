"""A noisy service's targets for the noisy-neighbour bench, on loopback, in one process.

    python bench/bad_targets.py --hang 19000-19049 --fail 19050 [--hang-seconds 600]

Each `--hang` port accepts connections, reads whatever comes and never answers (a
target that hangs to the caller's timeout; a TLS client waits there for the server's
hello, so an https webhook to it hangs too). The `--fail` port answers every request
500 at once. Connections are closed after --hang-seconds; the process ends on
SIGTERM/SIGINT. Prints `listening` once every port is open.
"""
from __future__ import annotations

import argparse
import asyncio
import signal

FAILED = (b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: 17\r\n\r\n"
          b"{\"error\":\"noisy\"}")


def ports(spec: str) -> list[int]:
    found: list[int] = []
    for part in filter(None, spec.split(",")):
        low, _, high = part.partition("-")
        found += list(range(int(low), int(high or low) + 1))
    return found


async def main(hang: list[int], fail: list[int], hang_seconds: float) -> None:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(hang_seconds):
                while await reader.read(65536):
                    pass
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                writer.write(FAILED)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    servers = [await asyncio.start_server(hold, "127.0.0.1", port, backlog=256) for port in hang]
    servers += [await asyncio.start_server(refuse, "127.0.0.1", port, backlog=256) for port in fail]
    print("listening", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--hang", default="", help="ports that never answer: 19000-19049,19060")
    parser.add_argument("--fail", default="", help="ports that answer 500")
    parser.add_argument("--hang-seconds", type=float, default=600.0)
    args = parser.parse_args()
    asyncio.run(main(ports(args.hang), ports(args.fail), args.hang_seconds))
