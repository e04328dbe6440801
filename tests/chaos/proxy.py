"""A TCP proxy in front of a Redis server that can lose a reply after the write it answers applied.

It runs on threads of its own (not the test's event loop), one pair per proxied connection:
client -> server bytes are forwarded as they come; server -> client bytes too, unless the
connection is marked to drop. ``drop_after_next_write()`` arms one drop: the next chunk from a
client that carries an ``XADD`` marks its connection, is forwarded to Redis, and when Redis's
reply arrives (proof that the write was applied) the reply is discarded and both sockets are
closed. The client sees its connection reset with no answer: it cannot tell whether the write
happened. ``drop_every_write(True)`` does the same to every write until it is turned off (a link
that keeps failing, longer than a client's own retries).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field


@dataclass
class _Pair:
    client: socket.socket
    server: socket.socket
    dropping: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for s in (self.client, self.server):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


class ReplyDropper:
    """Listens on a free loopback port and forwards to ``127.0.0.1:upstream_port``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._armed = 0
        self._every = False
        self._pairs: list[_Pair] = []
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.connections = 0  # accepted, in all
        self.drops = 0  # replies lost after their write applied
        self.connections_at_drop: list[int] = []  # self.connections when each drop happened

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self._spawn(self._accept, "proxy-accept")

    def close(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            pairs = list(self._pairs)
        for p in pairs:
            p.close()
        for t in self._threads:
            t.join(5)

    def drop_after_next_write(self) -> None:
        """Lose the reply to the next chunk of writes (XADD) any client sends, once."""
        with self._lock:
            self._armed += 1

    def drop_every_write(self, on: bool) -> None:
        """Lose the reply to every chunk of writes (XADD) until turned off."""
        with self._lock:
            self._every = on

    def wait_drops(self, n: int, timeout_s: float) -> None:
        """Block until ``n`` drops in all have happened, at most ``timeout_s``."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.drops >= n, timeout_s):
                raise TimeoutError(f"only {self.drops} of {n} drops happened in {timeout_s:g} s")

    def _spawn(self, target, name: str, *args: object) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                client, _addr = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                client.close()  # Redis is down: so is the proxied connection
                continue
            server.settimeout(None)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, server)
            with self._lock:
                self._pairs.append(pair)
                self.connections += 1
            self._spawn(self._upstream, "proxy-up", pair)
            self._spawn(self._downstream, "proxy-down", pair)

    def _upstream(self, p: _Pair) -> None:
        """client -> server; a write chunk may take the armed drop."""
        try:
            while chunk := p.client.recv(65536):
                if not p.dropping and b"XADD" in chunk:
                    with self._lock:
                        if self._every or self._armed:
                            self._armed -= 0 if self._every else 1
                            p.dropping = True  # before the write goes out, so its reply is caught
                # redis-py sends one command or pipeline at a time per connection and waits for its
                # answer, so the next bytes Redis sends on this connection answer this write.
                p.server.sendall(chunk)
        except OSError:
            pass
        p.close()

    def _downstream(self, p: _Pair) -> None:
        """server -> client, unless the connection waits to drop: then its reply is lost."""
        try:
            while chunk := p.server.recv(65536):
                if p.dropping:
                    # Redis answered: the write applied; the client will never know.
                    p.close()
                    with self._changed:
                        self.drops += 1
                        self.connections_at_drop.append(self.connections)
                        self._changed.notify_all()
                    return
                p.client.sendall(chunk)
        except OSError:
            pass
        p.close()
