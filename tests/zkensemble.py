"""A three-node ZooKeeper ensemble on loopback for tests: each node its own process,
killed (kill -9) and started again by its own id.

    ensemble = Ensemble(workdir).start()          # waits for a leader and two followers
    ensemble.hosts                                  # "127.0.0.1:a,127.0.0.1:b,127.0.0.1:c"
    ensemble.leader(); ensemble.kill(n); ensemble.start_node(n)
    ensemble.stop()

Debian's ZooKeeper (/usr/share/java/zookeeper.jar), the same tick and session
bounds as scripts/zookeeper.sh (a short tick keeps session expiry close to the
timeout). Ports are free ones unless ZK_ENSEMBLE_PORTS names nine
(three client, three quorum, three election ports, comma-separated).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

JAR = Path("/usr/share/java/zookeeper.jar")
LOGGER = Path("/usr/share/java/slf4j-simple.jar")
NODES = (1, 2, 3)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def srvr(port: int, timeout: float = 2.0) -> str:
    """The node's answer to `srvr` ("" when it does not answer)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"srvr")
            chunks = []
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                data = s.recv(4096)
                if not data:
                    break
                chunks.append(data)
            return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""


def connections(port: int) -> int:
    """Client connections the node has, this `srvr` one left out (-1: no answer)."""
    for line in srvr(port).splitlines():
        if line.startswith("Connections: "):
            return int(line.split(": ", 1)[1]) - 1
    return -1


def mode(port: int) -> str:
    """leader, follower, or "" (down, or not serving: no quorum)."""
    for line in srvr(port).splitlines():
        if line.startswith("Mode: "):
            return line.split(": ", 1)[1].strip()
    return ""


class Ensemble:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        given = os.environ.get("ZK_ENSEMBLE_PORTS", "")
        ports = [int(p) for p in given.split(",")] if given else free_ports(9)
        assert len(ports) == 9, "ZK_ENSEMBLE_PORTS names nine ports"
        self.client = dict(zip(NODES, ports[0:3]))
        self.quorum = dict(zip(NODES, ports[3:6]))
        self.election = dict(zip(NODES, ports[6:9]))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def hosts(self) -> str:
        return ",".join(f"127.0.0.1:{self.client[n]}" for n in NODES)

    def _config(self, n: int) -> Path:
        node = self.workdir / f"zk{n}"
        (node / "data").mkdir(parents=True, exist_ok=True)
        (node / "data" / "myid").write_text(f"{n}\n")
        servers = "".join(f"server.{k}=127.0.0.1:{self.quorum[k]}:{self.election[k]}\n" for k in NODES)
        cfg = node / "zoo.cfg"
        cfg.write_text(
            "tickTime=200\ninitLimit=25\nsyncLimit=10\nminSessionTimeout=400\nmaxSessionTimeout=60000\n"
            f"dataDir={node / 'data'}\nclientPort={self.client[n]}\nclientPortAddress=127.0.0.1\n"
            "maxClientCnxns=0\nadmin.enableServer=false\n4lw.commands.whitelist=srvr,stat,mntr,conf,ruok\n"
            "cnxTimeout=1000\n" + servers
        )
        return cfg

    def start(self, timeout: float = 60) -> "Ensemble":
        for n in NODES:
            self.start_node(n)
        self.wait_for_quorum(timeout)
        return self

    def start_node(self, n: int) -> None:
        assert n not in self.procs or self.procs[n].poll() is not None, f"node {n} is running"
        cfg = self._config(n)
        cp = f"{JAR}:{LOGGER}" if LOGGER.exists() else str(JAR)
        log = (self.workdir / f"zk{n}.log").open("ab")
        self.procs[n] = subprocess.Popen(
            ["java", "-Xmx128m", "-cp", cp, "org.apache.zookeeper.server.quorum.QuorumPeerMain", str(cfg)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def kill(self, n: int) -> float:
        """kill -9 node n; returns when (time.time())."""
        proc = self.procs[n]
        at = time.time()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        return at

    def modes(self) -> dict[int, str]:
        return {n: mode(self.client[n]) if self.alive(n) else "" for n in NODES}

    def alive(self, n: int) -> bool:
        return n in self.procs and self.procs[n].poll() is None

    def leader(self) -> int | None:
        return next((n for n, m in self.modes().items() if m == "leader"), None)

    def followers(self) -> list[int]:
        return [n for n, m in self.modes().items() if m == "follower"]

    def serving(self) -> bool:
        """A leader and every other live node following it."""
        modes = self.modes()
        live = [n for n in NODES if self.alive(n)]
        return len(live) >= 2 and sorted(modes[n] for n in live) == sorted(["leader"] + ["follower"] * (len(live) - 1))

    def wait_for_quorum(self, timeout: float = 60) -> float:
        """Until a leader and every live node following; returns when (time.time())."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.serving():
                return time.time()
            time.sleep(0.1)
        raise TimeoutError(f"no quorum after {timeout}s: {self.modes()}\n" + "\n".join(self.log(n) for n in NODES))

    def log(self, n: int) -> str:
        path = self.workdir / f"zk{n}.log"
        return f"--- zk{n} ---\n" + (path.read_text(errors="replace")[-3000:] if path.exists() else "")

    def stop(self) -> None:
        for n in NODES:
            if self.alive(n):
                self.kill(n)
