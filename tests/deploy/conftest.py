"""The container tests' images: made in the background while the other tests run (tests/images.py,
started by tests/conftest.py); these fixtures wait for them, or skip saying why they cannot be had."""

from __future__ import annotations

import pytest

from tests.images import PREPARATION, Images, Unavailable

# The longest a test waits for the images (a cold build on two cores takes a few minutes).
WAIT_S = 1800


@pytest.fixture(scope="session")
def prepared(request: pytest.FixtureRequest) -> Images:
    preparation = request.config.stash.get(PREPARATION, None)
    assert preparation is not None, "tests/conftest.py starts the preparation of the images"
    try:
        return preparation.result(WAIT_S)
    except Unavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def images(prepared: Images) -> dict[str, str]:
    """The product's images (deploy/docker), built from the repository as users build them."""
    return prepared.products


@pytest.fixture(scope="session")
def stand_ins(prepared: Images) -> dict[str, str]:
    """Local images in place of the public Redis and Prometheus images (no registry here)."""
    return prepared.stand_ins
