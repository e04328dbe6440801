"""Docker for the container tests: a daemon that answers (started here as root when none runs, and
stopped again at the end), a local Debian base made with mmdebstrap (no registry is needed), and
the images built on it: the product's gateway and CPU worker images from deploy/docker with their
own install steps (from the lock), and stand-ins for the Redis and Prometheus images of
deploy/compose built from Debian's packages. Each fixture skips, saying why, where it cannot run."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redisproc import free_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
BASE = "llamamesh-test-base:bookworm"
# What the base holds: what every Debian-based Python image has (python3 and its venv module),
# CA certificates for pip, and passwd for the Dockerfiles' useradd.
BASE_PACKAGES = "python3,python3-venv,ca-certificates,passwd"
# The product's images (deploy/docker) and the stand-ins for public ones (tests/deploy/images).
IMAGES = ("gateway", "worker-cpu")
STAND_INS = ("redis", "prometheus")


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check:
        assert done.returncode == 0, f"docker {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def daemon_answers() -> bool:
    return docker("info", check=False, timeout=30).returncode == 0


@pytest.fixture(scope="session")
def dockerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A Docker daemon that answers: the running one, or one started here (as root) and stopped
    when the session ends (the images it built stay in /var/lib/docker for the next run)."""
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed (Debian: `apt-get install docker.io`)")
    if daemon_answers():
        yield
        return
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        pytest.skip("no Docker daemon answers, and this process cannot start one (not root, or no dockerd)")
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with log.open("ab") as out:
        daemon = subprocess.Popen(["dockerd"], stdout=out, stderr=out, start_new_session=True)
    try:
        try:
            wait_until(daemon_answers, 60, "dockerd to answer", poll_s=0.5)
        except TimeoutError as exc:
            pytest.skip(f"dockerd did not start: {exc}; its log: {log.read_text()[-500:]}")
        yield
    finally:
        daemon.terminate()
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(10)


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


@pytest.fixture(scope="session")
def base_image(dockerd: None) -> str:
    """The local Debian base, made once per machine (an image already there is reused)."""
    if docker("image", "inspect", BASE, check=False).returncode == 0:
        return BASE
    if shutil.which("mmdebstrap") is None:
        pytest.skip("mmdebstrap is not installed (Debian: `apt-get install mmdebstrap`): no local Debian base")
    with tempfile.TemporaryDirectory() as d:
        tar = Path(d) / "base.tar"
        made = subprocess.run(
            ["mmdebstrap", "--variant=apt", f"--include={BASE_PACKAGES}", *local_trust(), "bookworm", str(tar)],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert made.returncode == 0, made.stderr[-3000:]
        docker("import", str(tar), BASE, timeout=300)
    return BASE


@pytest.fixture(scope="session")
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


def build(tag: str, dockerfile: Path, context: Path, args: list[str]) -> str:
    """``docker build`` with the legacy builder (BuildKit would fetch its frontend from a registry)
    and host networking (pip and apt reach their indexes as they do from this machine)."""
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    cmd = ["docker", "build", "--network", "host", *args, "-f", str(dockerfile), "-t", tag, str(context)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env, check=False)
    assert done.returncode == 0, f"building {tag}:\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    return tag


@pytest.fixture(scope="session")
def images(base_image: str, local_wheels: list[str]) -> dict[str, str]:
    """The product's images, built from the repository as users build them (but on the local base)."""
    return {
        name: build(
            f"llamamesh-{name}:test",
            ROOT / "deploy" / "docker" / f"{name}.Dockerfile",
            ROOT,
            ["--build-arg", f"BASE={base_image}", *local_wheels],
        )
        for name in IMAGES
    }


@pytest.fixture(scope="session")
def stand_ins(base_image: str) -> dict[str, str]:
    """Local images in place of the public Redis and Prometheus images (no registry here)."""
    here = Path(__file__).parent / "images"
    return {
        name: build(
            f"llamamesh-test-{name}:local", here / f"{name}.Dockerfile", here, ["--build-arg", f"BASE={base_image}"]
        )
        for name in STAND_INS
    }
