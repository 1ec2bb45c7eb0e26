"""A TCP proxy on loopback that a test can cut, like a network partition.

    proxy = NetProxy(upstream_port=5432).start()   # listens on 127.0.0.1:<proxy.port>
    proxy.drop()     # stop forwarding bytes, both ways; every socket stays open
    proxy.restore()  # forward again, the bytes held meanwhile first
    proxy.stop()

While dropping, the proxy still accepts new connections (the kernel would
anyway: the listening socket's backlog) but forwards nothing on them either,
and reads nothing, so a peer's writes fill the socket buffers and then block,
as they would on a link that went dark. Nobody sees a reset or an end of file:
only timeouts can tell either side that the link is gone. Only loopback
addresses are ever used.
"""
from __future__ import annotations

import selectors
import socket
import threading
import time


class NetProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", listen_host: str = "127.0.0.1") -> None:
        # listen_host: loopback, or the host side of a test namespace's own link (tests/netns.py).
        assert upstream_host in ("127.0.0.1", "localhost", "::1"), "loopback targets only"
        self.upstream = (upstream_host, upstream_port)
        self.listen_host = listen_host
        self._listener = socket.create_server((listen_host, 0))
        self._listener.setblocking(False)
        self._dropping = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._thread = threading.Thread(target=self._serve, name=f"netproxy-{self.port}", daemon=True)
        self.accepted = 0

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    def start(self) -> "NetProxy":
        self._thread.start()
        return self

    def drop(self) -> float:
        """Cut the link; returns the time it was cut (time.time())."""
        self._dropping.set()
        return time.time()

    def restore(self) -> float:
        self._dropping.clear()
        return time.time()

    @property
    def dropping(self) -> bool:
        return self._dropping.is_set()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        with self._lock:
            for a, b in self._pairs:
                a.close()
                b.close()
            self._pairs.clear()
        self._listener.close()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        peer: dict[socket.socket, socket.socket] = {}
        while not self._stopping.is_set():
            dropping = self._dropping.is_set()
            # While dropping, nothing is read: the bytes wait in the kernel's buffers
            # and are forwarded, late, once the link is restored.
            for key, _ in sel.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    self._accept(sel, peer)
                elif not dropping:
                    self._forward(sock, peer, sel)
            if dropping:
                time.sleep(0.02)  # the sockets stay readable: don't spin on them
        sel.close()

    def _accept(self, sel: selectors.BaseSelector, peer: dict[socket.socket, socket.socket]) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            client.close()
            return
        for s in (client, upstream):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer[client], peer[upstream] = upstream, client
        sel.register(client, selectors.EVENT_READ, None)
        sel.register(upstream, selectors.EVENT_READ, None)
        with self._lock:
            self._pairs.append((client, upstream))
        self.accepted += 1

    def _forward(self, sock: socket.socket, peer: dict[socket.socket, socket.socket],
                 sel: selectors.BaseSelector) -> None:
        other = peer.get(sock)
        if other is None:
            return
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            try:
                other.setblocking(True)
                other.settimeout(5)
                other.sendall(data)
                other.setblocking(False)
                return
            except OSError:
                pass
        # One side closed (or failed): close both, as a real link would pass the FIN on.
        for s in (sock, other):
            try:
                sel.unregister(s)
            except (KeyError, ValueError):
                pass
            peer.pop(s, None)
            s.close()
