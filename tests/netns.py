"""Links a test can silence at the packet level, for processes in a network
namespace of the test's own.

tests/netproxy.py cuts a link in user space: the proxy stops reading, but its
kernel still acknowledges every byte and every keepalive probe, so no TCP timeout
can ever fire on the far side. A dead host or a partition is silent below that:
nothing is acknowledged. Here a process runs in its own network namespace, and
each service it may reach (PostgreSQL, Redis...) is one veth pair of its own, a
/30 on that pair, and a NetProxy listening on the pair's host side that forwards
to the service on loopback. `cut(name)` sets that pair's host side down: every
packet either way is dropped, silently (the neighbours are permanent entries, so
not even an ARP failure says so); the other links stay up. `restore(name)` sets
it up again.

    links = SilentLinks({"pg": 5432, "redis": 6379}).start()
    url = f"postgres://postgres@{links.address('pg')}/sched"
    proc = Proc(..., links.argv([sys.executable, ...]), ...)   # runs inside the namespace
    links.cut("pg"); ...; links.restore("pg")
    links.stop()

Needs root (ip netns, ip link): a test skips without it. The only addresses used
are loopback and the pairs' own /30s (10.213.0.0/16), which exist only on this
machine, between its root namespace and the test's.
"""
from __future__ import annotations

import os
import random
import subprocess
import time
import uuid

from tests.netproxy import NetProxy


class LinksUnavailable(RuntimeError):
    """This machine (or this account) cannot make network namespaces."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if result.returncode != 0:
        raise LinksUnavailable(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _used_addresses() -> str:
    return subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, timeout=10).stdout


class SilentLinks:
    def __init__(self, upstreams: dict[str, int]) -> None:
        self.upstreams = upstreams
        tag = uuid.uuid4().hex[:6]
        self.namespace = f"sched-{tag}"
        self._tag = tag
        self._devices: dict[str, str] = {}  # name -> host-side device
        self._proxies: dict[str, NetProxy] = {}
        self._made = False

    def start(self) -> "SilentLinks":
        if os.geteuid() != 0:
            raise LinksUnavailable("network namespaces need root")
        _ip("netns", "add", self.namespace)
        self._made = True
        try:
            _ip("-n", self.namespace, "link", "set", "lo", "up")
            for i, (name, port) in enumerate(self.upstreams.items()):
                self._link(i, name, port)
        except Exception:
            self.stop()
            raise
        return self

    def _link(self, i: int, name: str, port: int) -> None:
        host_dev, ns_dev = f"sl{self._tag}h{i}", f"sl{self._tag}n{i}"
        used = _used_addresses()
        for _ in range(50):
            base = f"10.213.{random.randrange(256)}.{4 * random.randrange(64)}"
            prefix = base.rsplit(".", 1)[0]
            last = int(base.rsplit(".", 1)[1])
            host_ip, ns_ip = f"{prefix}.{last + 1}", f"{prefix}.{last + 2}"
            if f"{prefix}.{last + 1}/" not in used and f"{prefix}.{last + 2}/" not in used:
                break
        _ip("link", "add", host_dev, "type", "veth", "peer", "name", ns_dev)
        self._devices[name] = host_dev
        _ip("link", "set", ns_dev, "netns", self.namespace)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_dev)
        _ip("-n", self.namespace, "addr", "add", f"{ns_ip}/30", "dev", ns_dev)
        _ip("link", "set", host_dev, "up")
        _ip("-n", self.namespace, "link", "set", ns_dev, "up")
        # Permanent neighbours: a cut link drops packets silently, it does not fail ARP.
        host_mac = open(f"/sys/class/net/{host_dev}/address").read().strip()
        ns_mac = subprocess.run(["ip", "netns", "exec", self.namespace, "cat", f"/sys/class/net/{ns_dev}/address"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        _ip("-n", self.namespace, "neigh", "replace", host_ip, "lladdr", host_mac, "dev", ns_dev, "nud", "permanent")
        _ip("neigh", "replace", ns_ip, "lladdr", ns_mac, "dev", host_dev, "nud", "permanent")
        self._proxies[name] = NetProxy(port, listen_host=host_ip).start()

    def route_via(self, name: str) -> None:
        """A default route in the namespace through `name`'s link: its processes reach
        the root namespace's own addresses (another namespace's link, say) through it."""
        host_ip = self._proxies[name].listen_host
        _ip("-n", self.namespace, "route", "add", "default", "via", host_ip)

    def address(self, name: str) -> str:
        """host:port that a process inside the namespace connects to for `name`."""
        return self._proxies[name].address

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace (ip execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def cut(self, name: str) -> float:
        """Silence `name`'s link, both ways; returns when (time.time())."""
        _ip("link", "set", self._devices[name], "down")
        return time.time()

    def restore(self, name: str) -> float:
        _ip("link", "set", self._devices[name], "up")
        return time.time()

    def stop(self) -> None:
        for proxy in self._proxies.values():
            proxy.stop()
        self._proxies.clear()
        for dev in self._devices.values():
            subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=10)  # its peer goes with it
        self._devices.clear()
        if self._made:
            subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, timeout=10)
            self._made = False
