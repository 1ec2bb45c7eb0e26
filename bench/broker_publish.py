"""Publish rate of the run queue's messages on a broker: what a scanner's publish
costs on Redis, on RabbitMQ with publisher confirms (the scheduler's setting on
AMQP) and without them.

    python bench/broker_publish.py redis://127.0.0.1:6379/14 amqp://guest:guest@127.0.0.1:5672/VHOST [-n 2000]

Each message is a run batch's size (ten run ids, JSON), persistent, on a queue of
its own that is deleted after. Prints one line per broker and mode.
"""
from __future__ import annotations

import argparse
import time
import uuid

from kombu import Connection, Exchange, Queue


def rate(url: str, n: int, confirm: bool) -> float:
    name = f"bench-publish-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name, durable=True)
    options = {"confirm_publish": True} if confirm else {}
    with Connection(url, transport_options=options) as conn:
        producer = conn.Producer(serializer="json")
        body = {"args": [[1000 + i for i in range(10)]], "kwargs": {}}
        producer.publish(body, exchange=queue.exchange, routing_key=name, declare=[queue], delivery_mode=2)
        start = time.perf_counter()
        for _ in range(n):
            producer.publish(body, exchange=queue.exchange, routing_key=name, delivery_mode=2, retry=True)
        took = time.perf_counter() - start
        queue(conn.default_channel).delete()
    return n / took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("urls", nargs="+")
    parser.add_argument("-n", type=int, default=2000)
    args = parser.parse_args()
    for url in args.urls:
        modes = [False, True] if url.startswith("amqp") else [False]
        for confirm in modes:
            shown = url.split("@")[-1]
            print(f"{shown:40} confirms={'on ' if confirm else 'off'} {rate(url, args.n, confirm):8.0f} messages/s")


if __name__ == "__main__":
    main()
