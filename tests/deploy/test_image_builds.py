"""The gateway and CPU worker images built for real from the repository, with the Dockerfiles' own
install steps (from the lock), on a local base: a Debian bookworm root filesystem made with
mmdebstrap and imported with `docker import`, so no registry is needed. Then each image is run as
it ships: as uid 10001 on a read-only root with every capability dropped.

Needs Docker (dockerd is started when it is not running and this runs as root) and mmdebstrap;
skipped, saying why, without them or without disk room for the images. Each image's size is printed
(deploy/README.md keeps them).
"""

from __future__ import annotations

import subprocess

import pytest

from tests.images import PRODUCTS as IMAGES
from tests.images import docker

pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]

SECURE_RUN = ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]


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
    # xgrammar (structured output) imports and masks logits on the CPU without triton, which is not there.
    cpu_torch = (
        "import importlib.util, torch, transformers, xgrammar, workers.engines.transformers; "
        "from workers.engines.transformers_model import default_model_path; "
        "assert torch.version.cuda is None and default_model_path().is_file(); "
        "assert importlib.util.find_spec('triton') is None; "
        "logits, mask = torch.zeros(1, 64), xgrammar.allocate_token_bitmask(1, 64); mask[0] = 1; "
        "xgrammar.apply_token_bitmask_inplace(logits, mask); assert logits[0, 0] == 0 and logits[0, 63] < -1e30; "
        "print(torch.__version__)"
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
