"""The container tests' Docker images, prepared in the background while the other tests run.

tests/conftest.py starts a :class:`Preparation` once collection ends, when tests of the
`containers` mark were collected, and puts those tests last. It makes: a Docker daemon that
answers (the running one, or one started here as root at the lowest CPU priority and stopped when
the session ends); a local Debian bookworm base made with mmdebstrap and `docker import` (no
registry); the product's gateway and CPU worker images from deploy/docker, with their own install
steps from the lock; and stand-ins for the public Redis and Prometheus images of deploy/compose,
from Debian's packages (tests/deploy/images). Every build runs at the lowest CPU share, so the
tests running meanwhile keep the CPUs. Where Docker or mmdebstrap is missing, or the disk has too
little room for the images, :meth:`result` raises :class:`Unavailable` saying why, and the tests skip
with it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.redisproc import free_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
BASE = "llamamesh-test-base:bookworm"
# What the base holds: what every Debian-based Python image has (python3 and its venv module),
# CA certificates for pip, and passwd for the Dockerfiles' useradd.
BASE_PACKAGES = "python3,python3-venv,ca-certificates,passwd"
# The product's images (deploy/docker) and the stand-ins for public ones (tests/deploy/images).
PRODUCTS = ("gateway", "worker-cpu")
STAND_INS = ("redis", "prometheus")
# The lowest priority: a nice value for processes, a CPU share for build containers.
NICE = ["nice", "-n", "19"]
CPU_SHARES = "2"
# Free disk the images need where Docker keeps them: a cold build of all four and the base peaks at
# about 3 GiB (the CPU worker's torch is most of it). Short of that and room for the tests that write
# meanwhile (Redis AOFs, model folders), the container tests skip rather than fill the disk under them.
NEED_FREE_GIB = 6.0


class Unavailable(Exception):
    """Docker images cannot be had on this machine; the message says why."""


@dataclass(frozen=True)
class Images:
    products: dict[str, str]  # deploy/docker's images: name -> tag
    stand_ins: dict[str, str]  # the public images' stand-ins: name -> tag


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check:
        assert done.returncode == 0, f"docker {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def image_id(tag: str) -> str:
    """The id of the image ``tag`` names, or "" where there is none."""
    done = docker("image", "inspect", "-f", "{{.Id}}", tag, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def daemon_answers() -> bool:
    return docker("info", check=False, timeout=30).returncode == 0


class Preparation:
    """The images, made by one background thread; :meth:`result` waits for them."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._future: Future[Images] = Future()
        self._daemon: subprocess.Popen[bytes] | None = None
        self._closing = threading.Event()
        self._running: subprocess.Popen[str] | None = None

    def start(self) -> None:
        threading.Thread(target=self._prepare, name="container-images", daemon=True).start()

    def result(self, timeout_s: float) -> Images:
        return self._future.result(timeout_s)

    def close(self) -> None:
        """Stop what runs (a build still going: the session ended first) and the daemon started here."""
        self._closing.set()
        if self._running is not None and self._running.poll() is None:
            self._running.kill()
        if self._daemon is not None:
            self._daemon.terminate()
            try:
                self._daemon.wait(60)
            except subprocess.TimeoutExpired:
                self._daemon.kill()
                self._daemon.wait(10)

    def _prepare(self) -> None:
        try:
            self._ensure_daemon()
            self._check_disk()
            base = self._base()
            with local_wheels() as wheel_args:
                products = {
                    name: self._build(
                        f"llamamesh-{name}:test",
                        ROOT / "deploy" / "docker" / f"{name}.Dockerfile",
                        ROOT,
                        ["--build-arg", f"BASE={base}", *wheel_args],
                    )
                    for name in PRODUCTS
                }
            here = ROOT / "tests" / "deploy" / "images"
            stand_ins = {
                name: self._build(
                    f"llamamesh-test-{name}:local", here / f"{name}.Dockerfile", here, ["--build-arg", f"BASE={base}"]
                )
                for name in STAND_INS
            }
            self._future.set_result(Images(products, stand_ins))
        except BaseException as exc:  # handed to the waiting test, whatever it is
            self._future.set_exception(exc)

    def _ensure_daemon(self) -> None:
        if shutil.which("docker") is None:
            raise Unavailable("docker is not installed (Debian: `apt-get install docker.io`)")
        if daemon_answers():
            return
        if shutil.which("dockerd") is None or os.geteuid() != 0:
            raise Unavailable("no Docker daemon answers, and this process cannot start one (not root, or no dockerd)")
        log = self._workdir / "dockerd.log"
        with log.open("ab") as out:
            self._daemon = subprocess.Popen([*NICE, "dockerd"], stdout=out, stderr=out, start_new_session=True)
        daemon = self._daemon
        with suppress(TimeoutError):
            wait_until(lambda: daemon_answers() or daemon.poll() is not None, 60, "dockerd to answer", poll_s=0.5)
        if daemon.poll() is not None or not daemon_answers():
            raise Unavailable(f"dockerd did not start; its log ends: {log.read_text()[-500:]}")

    def _check_disk(self) -> None:
        root = docker("info", "--format", "{{.DockerRootDir}}").stdout.strip() or "/"
        free_gib = shutil.disk_usage(root if Path(root).exists() else "/").free / 2**30
        if free_gib < NEED_FREE_GIB:
            raise Unavailable(
                f"only {free_gib:.1f} GiB of disk is free under {root}; the images need {NEED_FREE_GIB:g} GiB"
                " (building them would fill the disk the other tests write to)"
            )

    def _base(self) -> str:
        """The local Debian base, made once per machine (an image already there is reused)."""
        if docker("image", "inspect", BASE, check=False).returncode == 0:
            return BASE
        if shutil.which("mmdebstrap") is None:
            raise Unavailable("mmdebstrap is not installed (Debian: `apt-get install mmdebstrap`): no local base")
        with tempfile.TemporaryDirectory() as d:
            tar = Path(d) / "base.tar"
            cmd = ["mmdebstrap", "--variant=apt", f"--include={BASE_PACKAGES}", *local_trust(), "bookworm", str(tar)]
            self._run([*NICE, *cmd], 900, "mmdebstrap")
            docker("import", str(tar), BASE, timeout=300)
        return BASE

    def _build(self, tag: str, dockerfile: Path, context: Path, args: list[str]) -> str:
        """``docker build`` with the legacy builder (BuildKit would fetch its frontend from a registry),
        host networking (pip and apt reach their indexes as this machine does) and the lowest CPU share."""
        cmd = ["docker", "build", "--network", "host", "--cpu-shares", CPU_SHARES, *args]
        before = image_id(tag)
        self._run([*cmd, "-f", str(dockerfile), "-t", tag, str(context)], 1500, f"building {tag}")
        if before and before != image_id(tag):  # the image this build replaced: its layers, untagged, only take disk
            docker("image", "rm", before, check=False)
        return tag

    def _run(self, cmd: list[str], timeout_s: float, what: str) -> None:
        if self._closing.is_set():
            raise Unavailable("the session ended before the images were made")
        env = {**os.environ, "DOCKER_BUILDKIT": "0"}
        self._running = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            out, err = self._running.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._running.kill()
            out, err = self._running.communicate()
        assert self._running.returncode == 0, (
            f"{what} failed ({self._running.returncode}):\n{out[-4000:]}\n{err[-3000:]}"
        )


def local_trust() -> list[str]:
    """mmdebstrap hooks giving the base the certificate authorities this machine added to its own
    trust store (/usr/local/share/ca-certificates: e.g. a proxy that inspects TLS), and pip the
    system bundle, so that pip reaches PyPI from the build as it does from here. None elsewhere."""
    local = Path("/usr/local/share/ca-certificates")
    if not any(local.glob("*.crt")):
        return []
    pip_conf = "printf '[global]\\ncert = /etc/ssl/certs/ca-certificates.crt\\n' > \"$1/etc/pip.conf\""
    return [
        f"--customize-hook=copy-in {local} /usr/local/share",
        '--customize-hook=chroot "$1" update-ca-certificates',
        f"--customize-hook={pip_conf}",
    ]


@contextmanager
def local_wheels() -> Iterator[list[str]]:
    """Build arguments for a machine whose pip finds torch's CPU build in a local folder of wheels
    (pip's find-links, e.g. /opt/wheels) rather than on PyTorch's index: that folder served on
    loopback for the build's pip, and PyPI as the torch index. None where there is no such folder."""
    folders = [Path(f) for f in os.environ.get("PIP_FIND_LINKS", "").split() if Path(f).is_dir()]
    wheels = [f for f in folders if any(f.glob("torch-*+cpu-*.whl"))]
    if not wheels:
        yield []
        return
    port = _stable_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(wheels[0])],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_until(lambda: _answers(url), 10, "the wheel server", poll_s=0.1)
        yield ["--build-arg", f"PIP_FIND_LINKS={url}", "--build-arg", "TORCH_INDEX=https://pypi.org/simple"]
    finally:
        server.terminate()
        server.wait(10)


def _stable_port(preferred: int = 18765) -> int:
    """The same port from run to run where it is free: the wheel server's address is a build
    argument, and a new one would void Docker's build cache of every step after it."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            return free_port()
    return preferred


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


# Where tests/conftest.py keeps the session's preparation.
PREPARATION = pytest.StashKey[Preparation]()


def prepare_in_background(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Puts the `containers` tests last and starts making their images, if any was collected."""
    wanted = [i for i in items if i.get_closest_marker("containers") is not None]
    if not wanted or config.option.collectonly:
        return
    items[:] = [i for i in items if i.get_closest_marker("containers") is None] + wanted
    preparation = Preparation(Path(tempfile.mkdtemp(prefix="llamamesh-images-")))
    config.stash[PREPARATION] = preparation
    config.add_cleanup(preparation.close)
    preparation.start()
