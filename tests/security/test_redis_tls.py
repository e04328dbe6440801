"""The queue over TLS: Debian's redis-server on a TLS-only port asking for client certificates, a
gateway and a worker (fake engine) talking to it through ``rediss://``, and clients it refuses."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from llamamesh.client import Client
from llamamesh.errors import QueueUnavailable
from llamamesh.queue.redisio import tls_options
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import GatewaySettings, RedisSettings, WorkerSettings
from services.server import start_gateway
from tests.redisproc import free_port, wait_answering
from tests.security.conftest import PKI
from tests.stacks import stop_in_process
from workers.engines.fake import FakeEngine
from workers.worker import Worker

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


class TLSRedis:
    """redis-server with only a TLS port (``--port 0``), clients must present a certificate of the CA."""

    def __init__(self, workdir: Path, pki: PKI) -> None:
        self.dir, self.pki, self.port = workdir, pki, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        path = shutil.which("redis-server")
        if path is None:
            pytest.skip("redis-server is not installed")
        p = self.pki
        self.proc = subprocess.Popen(
            [
                path,
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--logfile",
                str(self.dir / "server.log"),
                "--tls-cert-file",
                str(p.server.cert),
                "--tls-key-file",
                str(p.server.key),
                "--tls-ca-cert-file",
                str(p.ca.cert),
                "--tls-auth-clients",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(
            host="127.0.0.1",
            port=self.port,
            ssl=True,
            ssl_ca_certs=str(p.ca.cert),
            ssl_certfile=str(p.client.cert),
            ssl_keyfile=str(p.client.key),
            socket_connect_timeout=0.2,
        )

        def failed() -> str:
            log_file = self.dir / "server.log"
            return f"redis-server (TLS) did not start: {log_file.read_text()[-2000:] if log_file.exists() else ''}"

        wait_answering(client, self.proc, timeout_s, failed)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def tls_redis(pki: PKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSRedis]:
    server = TLSRedis(tmp_path_factory.mktemp("redis-tls"), pki)
    server.start()
    yield server
    server.stop()


def queue_settings(server: TLSRedis, tls_ca: str = "", tls_cert: str = "", tls_key: str = "") -> RedisSettings:
    return RedisSettings(
        url=server.url,
        prefix=f"test:{uuid.uuid4().hex[:10]}",
        block_ms=200,
        tls_ca=tls_ca,
        tls_cert=tls_cert,
        tls_key=tls_key,
    )


def client_files(pki: PKI) -> dict[str, str]:
    return {"tls_ca": str(pki.ca.cert), "tls_cert": str(pki.client.cert), "tls_key": str(pki.client.key)}


async def test_a_generation_through_a_tls_queue(tls_redis: TLSRedis, pki: PKI) -> None:
    rs = queue_settings(tls_redis, **client_files(pki))
    gw_queue, w_queue = RedisQueue.from_settings(rs), RedisQueue.from_settings(rs)
    gw = await start_gateway(gw_queue, GatewaySettings(port=0, models="tiny=cpu"), port=0)
    ws = WorkerSettings(pool="cpu", model="tiny", engine="fake", max_inflight=4, consumer="w-tls")
    engine = FakeEngine(ws)
    await engine.start()
    worker = Worker(ws, w_queue, engine, block_ms=100)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(worker.ready.wait(), 10)
        async with Client(f"127.0.0.1:{gw.port}") as c:
            replies = [m async for m in c.generate("hello over TLS", max_tokens=5, timeout=20)]
        assert replies[-1].usage.completion_tokens == 5
        assert len("".join(m.text for m in replies).split()) == 5
    finally:
        await stop_in_process(stop, task, gw, engine, gw_queue, w_queue)


@pytest.mark.parametrize(
    "how",
    ["plaintext", "no client certificate", "another CA's client certificate", "server from another CA"],
)
async def test_clients_the_tls_queue_refuses_fail_cleanly(tls_redis: TLSRedis, pki: PKI, how: str) -> None:
    good = client_files(pki)
    rs = {
        "plaintext": RedisSettings(url=tls_redis.url.replace("rediss://", "redis://")),
        "no client certificate": queue_settings(tls_redis, tls_ca=good["tls_ca"]),
        "another CA's client certificate": queue_settings(
            tls_redis, tls_ca=good["tls_ca"], tls_cert=str(pki.other_client.cert), tls_key=str(pki.other_client.key)
        ),
        "server from another CA": queue_settings(tls_redis, **{**good, "tls_ca": str(pki.other_ca.cert)}),
    }[how]
    queue = RedisQueue.from_settings(rs)
    try:
        with pytest.raises(QueueUnavailable, match="unreachable"):
            await asyncio.wait_for(queue.ping(), 20)
    finally:
        await queue.close()


def test_tls_files_without_a_rediss_url_are_refused(tmp_path: Path) -> None:
    ca, cert = tmp_path / "ca.pem", tmp_path / "c.pem"
    ca.write_text("(a PEM)")
    cert.write_text("(a PEM)")
    assert tls_options(RedisSettings(url="redis://h:1/0")) == {}
    assert tls_options(RedisSettings(url="rediss://h:1/0", tls_ca=str(ca))) == {"ssl_ca_certs": str(ca)}
    with pytest.raises(ValueError, match="not rediss://"):
        tls_options(RedisSettings(url="redis://h:1/0", tls_ca=str(ca)))
    with pytest.raises(ValueError, match="together"):
        tls_options(RedisSettings(url="rediss://h:1/0", tls_cert=str(cert)))
