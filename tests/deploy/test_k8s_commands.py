"""A manifest that sets a container's ``command`` replaces its image's ENTRYPOINT: the program it
names must be the one the image has (vLLM's and TensorRT-LLM's images have ``python3``, no
``python``; ours have both in their venv), and the module the image runs."""

from __future__ import annotations

import json

import pytest

from tests.deploy.test_images import IMAGES, dockerfile, parse
from tests.deploy.test_k8s import OVERLAYS, containers, render

OURS = "ghcr.io/llamamesh/"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_command_set_in_a_manifest_is_its_images_entrypoint(overlay: str) -> None:
    checked = 0
    for w, _tpl, c in containers(render(overlay)):
        if not c["image"].startswith(OURS) or "command" not in c:
            continue
        name = c["image"].removeprefix(OURS).split(":")[0]
        assert name in IMAGES, c["image"]
        (entry,) = parse(dockerfile(name))[-1].all("ENTRYPOINT")
        assert c["command"] == json.loads(entry), (overlay, w["metadata"]["name"], c["name"])
        checked += 1
    assert checked, f"{overlay}: no container of ours sets a command"
