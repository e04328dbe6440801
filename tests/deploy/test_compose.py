"""deploy/compose: both compose files (the GPU host's and the CPU stack's) are valid for
docker-compose, name only real settings, give each process more time to stop than its own grace
periods, mount files that exist, and their Prometheus configs pass promtool as the container sees
them and scrape every metrics port; the GPU one reserves the GPUs and /dev/shm for vLLM.

Nothing is started here: `docker-compose config` validates and renders the files
(tests/deploy/test_compose_stack.py runs the CPU stack).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from llamamesh.settings import Settings

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE = COMPOSE_DIR / "compose.yaml"
CPU = COMPOSE_DIR / "compose.cpu.yaml"
BOTH = pytest.mark.parametrize("path", [COMPOSE, CPU], ids=["gpu", "cpu"])
# Variables of the compose files themselves (interpolated by compose, never seen by a process):
# they must not look like settings.
COMPOSE_VARIABLES = {
    "MODEL_DIR",
    "MODEL_NAME",
    "GRAFANA_ADMIN_PASSWORD",
    "GATEWAY_IMAGE",
    "WORKER_IMAGE",
    "REDIS_IMAGE",
    "PROMETHEUS_IMAGE",
    "GATEWAY_PORT",
    "HTTP_PORT",
    "PROMETHEUS_PORT",
}
# A margin above a grace period: the process's own shutdown after its grace (closing Redis, the engine).
MARGIN_S = 5.0


def raw(path: Path = COMPOSE) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def services(path: Path = COMPOSE) -> dict[str, dict[str, Any]]:
    return dict(raw(path)["services"])


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def seconds(duration: str) -> float:
    """A compose duration (1m30s, 45s, 1.5s) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), f"cannot read duration {duration!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def bind_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of the service's volumes that are host paths (named volumes left out)."""
    out = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            # source:target[:mode]; a source may be ${VAR:-default}, colon included.
            match = re.fullmatch(r"(\$\{[^}]*\}|[^:]+):([^:]+)(?::[a-z,]+)?", volume)
            assert match, f"cannot read volume {volume!r}"
            source, target = match.groups()
        else:
            source, target = volume["source"], volume["target"]
        if source.startswith((".", "/", "${")):
            out.append((source, target))
    return out


def render(path: Path) -> dict[str, Any]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (Debian: `apt-get install docker-compose`)")
    env = {**os.environ, "GRAFANA_ADMIN_PASSWORD": "not-a-secret"}
    done = subprocess.run(
        [binary, "-f", str(path), "config"], capture_output=True, text=True, timeout=45, check=False, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(yaml.safe_load(done.stdout))


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    return render(COMPOSE)


def test_docker_compose_accepts_them(rendered: dict[str, Any]) -> None:
    assert set(rendered["services"]) == {"redis", "gateway", "worker-vllm", "prometheus", "grafana"}
    cpu = render(CPU)
    assert set(cpu["services"]) == {"redis", "gateway", "worker-a", "worker-b", "prometheus"}
    ports = [p for s in cpu["services"].values() for p in s.get("ports", [])]
    assert ports and all(str(p.get("host_ip", p) if isinstance(p, dict) else p).startswith("127.0.0.1") for p in ports)


def test_grafana_admin_password_is_required_not_defaulted() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed")
    env = {k: v for k, v in os.environ.items() if k != "GRAFANA_ADMIN_PASSWORD"}
    done = subprocess.run(
        [binary, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=45, check=False, env=env
    )
    assert done.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in done.stderr


@BOTH
def test_every_llamamesh_variable_is_a_setting(path: Path) -> None:
    real = set(Settings().to_env())
    assert not COMPOSE_VARIABLES & real
    for name, service in services(path).items():
        unknown = {k for k in environment(service) if k.startswith("LLAMAMESH_")} - real
        assert not unknown, f"{name}: no setting in llamamesh/settings.py: {sorted(unknown)}"
    interpolated = set(re.findall(r"\$\{(\w+)", path.read_text()))
    assert interpolated <= COMPOSE_VARIABLES | real, interpolated - COMPOSE_VARIABLES


@BOTH
def test_stop_grace_period_exceeds_the_grace_settings(path: Path) -> None:
    rendered = render(path)
    defaults = Settings()
    gateway = rendered["services"]["gateway"]
    env = environment(gateway)
    settle = float(env.get("LLAMAMESH_GATEWAY_SETTLE_S", defaults.gateway.settle_s))
    grace = float(env.get("LLAMAMESH_GATEWAY_GRACE_S", defaults.gateway.grace_s))
    assert seconds(gateway["stop_grace_period"]) >= settle + grace + MARGIN_S

    workers = [name for name in rendered["services"] if name.startswith("worker")]
    assert workers
    for name in workers:
        worker = rendered["services"][name]
        grace = float(environment(worker).get("LLAMAMESH_WORKER_GRACE_S", defaults.worker.grace_s))
        assert seconds(worker["stop_grace_period"]) >= grace + MARGIN_S, name
    for name in ("gateway", *workers):
        assert rendered["services"][name].get("stop_signal", "SIGTERM") == "SIGTERM"


@BOTH
def test_mounted_files_exist(path: Path) -> None:
    for name, service in services(path).items():
        for source, target in bind_mounts(service):
            if source.startswith("${"):
                continue  # the operator's path (the model folder)
            assert (COMPOSE_DIR / source).resolve().exists(), f"{name}: mounts {source} -> {target}: missing"
    builds = [s["build"] for s in services(path).values() if "build" in s]
    assert builds
    for build in builds:
        assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve().is_file(), build


def test_the_model_is_mounted_read_only_from_an_operator_path() -> None:
    worker = services()["worker-vllm"]
    mounts = {t: s for s, t in bind_mounts(worker)}
    assert mounts.get("/models") == "${MODEL_DIR:-./models}"
    assert "/models:ro" in worker["volumes"][0]
    assert environment(worker)["LLAMAMESH_WORKER_MODEL_PATH"] == "/models"


@BOTH
def test_promtool_checks_the_prometheus_config(path: Path, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: `apt-get install prometheus`, which ships it)")
    prometheus = services(path)["prometheus"]
    (flag,) = [a for a in prometheus["command"] if a.startswith("--config.file=")]
    config_target = flag.partition("=")[2]
    # Lay the mounted files out as the container sees them, under tmp_path.
    for source, target in bind_mounts(prometheus):
        copy = tmp_path / target.lstrip("/")
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(COMPOSE_DIR / source, copy)
    config = tmp_path / config_target.lstrip("/")
    assert config.is_file(), f"{config_target} is not mounted"
    rules = yaml.safe_load(config.read_text())["rule_files"]
    assert rules and all((config.parent / r).is_file() for r in rules), rules
    done = subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


@BOTH
def test_prometheus_scrapes_the_metrics_ports(path: Path) -> None:
    svc = services(path)
    (config_file,) = [s for s, t in bind_mounts(svc["prometheus"]) if t == "/etc/prometheus/prometheus.yaml"]
    config = yaml.safe_load((COMPOSE_DIR / config_file).read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = {f"gateway:{environment(svc['gateway'])['LLAMAMESH_GATEWAY_METRICS_PORT']}"}
    for name in [n for n in svc if n.startswith("worker")]:
        worker = environment(svc[name])
        expected.add(f"{name}:{worker['LLAMAMESH_WORKER_METRICS_PORT']}")
        assert worker["LLAMAMESH_WORKER_METRICS_HOST"] == "0.0.0.0"  # reachable from the prometheus container
    assert targets == expected


def test_grafana_provisioning_is_mounted_where_it_expects() -> None:
    grafana = services()["grafana"]
    mounts = {t: s for s, t in bind_mounts(grafana)}
    provisioning = COMPOSE_DIR / mounts["/etc/grafana/provisioning"]
    providers = yaml.safe_load((provisioning / "dashboards" / "dashboards.yaml").read_text())["providers"]
    (folder,) = [p["options"]["path"] for p in providers]
    dashboards = [t for t in mounts if t.startswith(folder + "/")]
    assert dashboards and all(t.endswith(".json") for t in dashboards)
    datasources = yaml.safe_load((provisioning / "datasources" / "datasource.yaml").read_text())["datasources"]
    assert [d["url"] for d in datasources] == ["http://prometheus:9090"]


def test_the_worker_gets_the_gpus_and_shared_memory(rendered: dict[str, Any]) -> None:
    worker = rendered["services"]["worker-vllm"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]} in [
        {**d, "count": str(d["count"])} for d in devices
    ]
    shm = re.fullmatch(r"(\d+)([gm])b?", str(worker["shm_size"]).lower())
    assert shm and int(shm.group(1)) * (1024 if shm.group(2) == "g" else 1) >= 1024, worker["shm_size"]


def test_redis_keeps_its_data(rendered: dict[str, Any]) -> None:
    redis = rendered["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert re.fullmatch(r"redis:7\.\d+\.\d+.*", redis["image"])
    assert any(v.split(":")[1] == "/data" and v.split(":")[0] in rendered["volumes"] for v in redis["volumes"])
    for name in ("gateway", "worker-vllm"):
        url = environment(rendered["services"][name])["LLAMAMESH_REDIS_URL"]
        assert url == "redis://redis:6379/0"


@pytest.mark.parametrize("name", ["redis", "gateway", "worker-vllm", "prometheus", "grafana"])
def test_services_are_hardened(rendered: dict[str, Any], name: str) -> None:
    service = rendered["services"][name]
    assert service["read_only"] is True
    assert service["cap_drop"] == ["ALL"] and not service.get("cap_add")
    assert "no-new-privileges:true" in service["security_opt"]
    uid = str(service["user"]).partition(":")[0]
    assert uid.isdigit() and int(uid) > 0
    image = service["image"]
    if "build" not in service:
        assert re.search(r":v?\d+\.\d+\.\d+", image) and not image.endswith(":latest"), image
    if name in ("gateway", "worker-vllm"):
        assert "/tmp" in service["tmpfs"]


def test_ports_are_published_on_loopback_only(rendered: dict[str, Any]) -> None:
    for name, service in rendered["services"].items():
        for port in service.get("ports", []):
            published = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port['published']}"
            assert published.startswith("127.0.0.1:"), f"{name}: {port}"
