"""The gateway and CPU worker images built for real from the repository, with the Dockerfiles' own
install steps (from the lock), on a local base: a Debian bookworm root filesystem made with
mmdebstrap and imported with `docker import`, so no registry is needed. Then each image is run as
it ships: as uid 10001 on a read-only root with every capability dropped.

Needs Docker (dockerd is started when it is not running and this runs as root) and mmdebstrap;
skipped, saying why, without them. Each image's size is printed (deploy/README.md keeps them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redisproc import free_port
from tests.waiting import wait_until

pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
BASE = "llamamesh-test-base:bookworm"
# What the base holds: what every Debian-based Python image has (python3 and its venv module),
# CA certificates for pip, and passwd for the Dockerfiles' useradd.
BASE_PACKAGES = "python3,python3-venv,ca-certificates,passwd"
IMAGES = ("gateway", "worker-cpu")
SECURE_RUN = ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check:
        assert done.returncode == 0, f"docker {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def daemon_answers() -> bool:
    return docker("info", check=False, timeout=30).returncode == 0


@pytest.fixture(scope="session")
def dockerd(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A Docker daemon that answers: the running one, or one started here (as root)."""
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed")
    if daemon_answers():
        return
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        pytest.skip("no Docker daemon answers, and this process cannot start one (not root, or no dockerd)")
    log = (tmp_path_factory.mktemp("dockerd") / "dockerd.log").open("ab")
    subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)  # a daemon: it outlives the run
    try:
        wait_until(daemon_answers, 60, "dockerd to answer", poll_s=0.5)
    except TimeoutError as exc:
        pytest.skip(f"dockerd did not start: {exc}")


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
        pytest.skip("mmdebstrap is not installed: cannot make the local Debian base")
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
    port = free_port()
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


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def images(base_image: str, local_wheels: list[str]) -> dict[str, str]:
    """Both images, built with the legacy builder (BuildKit would fetch its frontend from a
    registry) and host networking (pip reaches PyPI as `make install` does)."""
    built = {}
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    for name in IMAGES:
        tag = f"llamamesh-{name}:test"
        args = ["docker", "build", "--network", "host", "--build-arg", f"BASE={base_image}", *local_wheels]
        args += ["-f", str(ROOT / "deploy" / "docker" / f"{name}.Dockerfile"), "-t", tag, str(ROOT)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=1500, env=env, check=False)
        assert done.returncode == 0, f"building {name}:\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
        built[name] = tag
    return built


def size_mb(tag: str) -> float:
    return int(docker("image", "inspect", "-f", "{{.Size}}", tag).stdout) / 1e6


def run_python(tag: str, code: str) -> subprocess.CompletedProcess[str]:
    return docker("run", "--rm", *SECURE_RUN, "--entrypoint", "python", tag, "-c", code, check=False, timeout=300)


def test_both_images_build_and_the_gateway_carries_no_torch(images: dict[str, str]) -> None:
    sizes = {name: size_mb(tag) for name, tag in images.items()}
    print("image sizes (MB):", {name: round(mb) for name, mb in sizes.items()})
    assert sizes["gateway"] < sizes["worker-cpu"] / 2, sizes
    no_torch = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    assert run_python(images["gateway"], no_torch).returncode == 0, "torch in the gateway image"
    cpu_torch = (
        "import torch, transformers, workers.engines.transformers; "
        "from workers.engines.transformers_model import default_model_path; "
        "assert torch.version.cuda is None and default_model_path().is_file(); print(torch.__version__)"
    )
    got = run_python(images["worker-cpu"], cpu_torch)
    assert got.returncode == 0 and "+cpu" in got.stdout, got.stderr[-2000:]


@pytest.mark.parametrize("name", IMAGES)
def test_each_image_runs_as_uid_10001_and_stops_on_a_bad_setting_in_one_line(images: dict[str, str], name: str) -> None:
    tag = images[name]
    assert docker("image", "inspect", "-f", "{{.Config.User}}", tag).stdout.strip() == "10001:10001"
    assert run_python(tag, "import os; print(os.getuid(), os.getgid())").stdout.split() == ["10001", "10001"]
    # The entrypoint itself, with a typo in a setting: exit 1 and one line naming it, no traceback.
    done = docker("run", "--rm", *SECURE_RUN, "-e", "LLAMAMESH_WORKER_MAX_INFLIGHT=0", tag, check=False, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "LLAMAMESH_WORKER_MAX_INFLIGHT=0" in lines[0], done.stderr
