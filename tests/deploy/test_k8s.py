"""deploy/k8s: every overlay renders with kustomize, every object is valid Kubernetes, and the
manifests agree with the code: settings, health services, grace periods, probes."""

from __future__ import annotations

import dataclasses
import functools
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from llamamesh.settings import GatewaySettings, Settings, env_name
from services.health import LIVENESS
from services.routing import RoutingPolicy

pytestmark = pytest.mark.timeout(120)

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
# The newest Kubernetes schemas kubernetes-validate bundles.
KUBERNETES_VERSION = "1.37"
KEDA = "keda.sh/"
WORKLOADS = ("Deployment", "StatefulSet")
KUBECTL = shutil.which("kubectl")
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")

# Every variable Settings reads: LLAMAMESH_<SECTION>_<FIELD>.
SETTINGS_ENV = frozenset(
    env_name(sec.name, f.name) for sec in fields(Settings) for f in fields(getattr(Settings(), sec.name))
)


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: cannot render the kustomize overlays")
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


@functools.cache
def render_with(overlay: str, *components: str) -> tuple[dict[str, Any], ...]:
    """An overlay with opt-in components added, as a user's own kustomization would add them (made
    beside the overlays: kustomize takes relative paths only)."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: cannot render the kustomize overlays")
    with tempfile.TemporaryDirectory(dir=K8S, prefix=".render-") as d:
        spec = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [f"../overlays/{overlay}"],
            "components": [f"../components/{c}" for c in components],
        }
        (Path(d) / "kustomization.yaml").write_text(yaml.safe_dump(spec))
        out = subprocess.run([KUBECTL, "kustomize", d], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, f"kubectl kustomize {overlay} + {components} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def of_kind(objs: tuple[dict[str, Any], ...], *kinds: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in kinds]


def named(objs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in of_kind(objs, kind) if o["metadata"]["name"] == name]
    assert found, f"no {kind} {name}"
    return found[0]


def pod_specs(objs: tuple[dict[str, Any], ...]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, its pod template) of every Deployment and StatefulSet."""
    for w in of_kind(objs, *WORKLOADS):
        yield w, w["spec"]["template"]


def containers(objs: tuple[dict[str, Any], ...]) -> Iterator[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    for w, tpl in pod_specs(objs):
        for c in [*tpl["spec"].get("initContainers", []), *tpl["spec"]["containers"]]:
            yield w, tpl, c


def env_of(c: dict[str, Any]) -> dict[str, str]:
    """The container's literal env values (valueFrom ones as "")."""
    return {e["name"]: str(e.get("value", "")) for e in c.get("env", [])}


def settings_of(c: dict[str, Any]) -> Settings:
    return Settings.from_env({k: v for k, v in env_of(c).items() if k.startswith("LLAMAMESH_")})


def component(w: dict[str, Any]) -> str:
    return str(w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component", ""))


def grpc_probe_ports(gw: GatewaySettings) -> set[int]:
    """The ports a gateway's gRPC probes may check: kubelet's gRPC probe speaks plaintext only, so
    the main port only without TLS, and the plaintext health-only port when there is one."""
    ports = {gw.health_port} - {0}
    if not gw.tls_cert:
        ports.add(gw.port)
    return ports


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist) against a label set."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def selects_pods(objs: tuple[dict[str, Any], ...], selector: dict[str, Any]) -> bool:
    return any(matches(selector, tpl["metadata"].get("labels", {})) for _w, tpl in pod_specs(objs))


def worker_pool(objs: tuple[dict[str, Any], ...], deployment: str) -> str:
    w = named(objs, "Deployment", deployment)
    return settings_of(w["spec"]["template"]["spec"]["containers"][0]).worker.pool


@pytest.fixture(params=OVERLAYS)
def objs(request: pytest.FixtureRequest) -> tuple[dict[str, Any], ...]:
    return render(request.param)


@pytest.fixture(params=[o for o in OVERLAYS if o != "cpu-demo"])
def external_redis(request: pytest.FixtureRequest) -> tuple[dict[str, Any], ...]:
    return render(request.param)


def test_the_overlays_the_readme_names_exist() -> None:
    assert {"cpu-demo", "vllm", "trtllm", "tls", "vllm-hpa", "vllm-canary"} <= set(OVERLAYS)


def test_every_object_is_valid_kubernetes(objs: tuple[dict[str, Any], ...]) -> None:
    for o in objs:
        if o["apiVersion"].startswith(KEDA):
            continue  # no KEDA CRD schema in kubernetes-validate: test_keda checks their fields
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)


def test_every_llamamesh_variable_is_a_setting_and_parses(objs: tuple[dict[str, Any], ...]) -> None:
    for w, _tpl, c in containers(objs):
        unknown = sorted(k for k in env_of(c) if k.startswith("LLAMAMESH_") and k not in SETTINGS_ENV)
        assert not unknown, f"{w['metadata']['name']}/{c['name']}: not settings: {unknown}"
        s = settings_of(c)  # a value that does not parse raises here
        if component(w) == "gateway":
            s.gateway.model_table()
            s.gateway.fallback_table()
            RoutingPolicy.parse(s.gateway.routes)


def test_image_tags_are_pinned(objs: tuple[dict[str, Any], ...]) -> None:
    for w, _tpl, c in containers(objs):
        image = c["image"]
        tag = image.rpartition("/")[2].partition(":")[2]
        assert "@sha256:" in image or (tag and tag != "latest"), f"{w['metadata']['name']}: unpinned {image}"


def test_containers_have_resources_probes_and_a_restricted_security_context(objs: tuple[dict[str, Any], ...]) -> None:
    for w, tpl, c in containers(objs):
        where = f"{w['metadata']['name']}/{c['name']}"
        res = c.get("resources", {})
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res.get(part, {})), f"{where}: resources.{part} needs cpu and memory"
        assert "livenessProbe" in c and "readinessProbe" in c, f"{where}: needs liveness and readiness probes"
        sc = c.get("securityContext", {})
        assert sc.get("runAsNonRoot") is True and sc.get("runAsUser") == 10001, where
        assert sc.get("readOnlyRootFilesystem") is True, where
        assert sc.get("allowPrivilegeEscalation") is False, where
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
        assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        pod = tpl["spec"].get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser") == 10001, where
        assert pod.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        volumes = {v["name"] for v in tpl["spec"].get("volumes", [])}
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        assert set(mounts) <= volumes | claims, f"{where}: mounts a volume it does not declare"
        assert "/tmp" in mounts.values(), f"{where}: the root filesystem is read-only: /tmp needs a volume"


def test_service_accounts_carry_no_token(objs: tuple[dict[str, Any], ...]) -> None:
    accounts = {o["metadata"]["name"]: o for o in of_kind(objs, "ServiceAccount")}
    assert all(a.get("automountServiceAccountToken") is False for a in accounts.values())
    for w, tpl in pod_specs(objs):
        name = tpl["spec"].get("serviceAccountName")
        assert name in accounts, f"{w['metadata']['name']}: runs as service account {name!r}, not in the overlay"
        assert tpl["spec"].get("automountServiceAccountToken") is False


def test_gateway_grace_probes_and_services(objs: tuple[dict[str, Any], ...]) -> None:
    gw = named(objs, "Deployment", "llamamesh-gateway")
    spec = gw["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    s = settings_of(c)
    assert s.gateway.host == "0.0.0.0"
    assert s.gateway.metrics_port == 9400
    assert spec["terminationGracePeriodSeconds"] > s.gateway.settle_s + s.gateway.grace_s
    assert s.gateway.settle_s > 0, "the gateway should settle (NOT_SERVING while serving) before it drains"
    if s.gateway.tls_cert:
        assert s.gateway.health_port, "a TLS port: kubelet's gRPC probes need LLAMAMESH_GATEWAY_HEALTH_PORT"
    assert s.gateway.health_port != s.gateway.port
    for probe_name, want in (("livenessProbe", LIVENESS), ("readinessProbe", "")):
        probe = c[probe_name]
        assert "grpc" in probe, f"{probe_name}: kubelet's native gRPC probe"
        if s.gateway.tls_cert:
            assert probe["grpc"]["port"] == s.gateway.health_port, f"{probe_name}: the plaintext health port"
        service = probe["grpc"].get("service", "")
        assert service == want, f"{probe_name}: health service {service!r}"
    ports = {"grpc": s.gateway.port, "http": s.gateway.http_port}
    assert s.gateway.http_port, "the OpenAI-compatible HTTP door is on"
    for svc_name, headless in (("llamamesh-gateway", False), ("llamamesh-gateway-headless", True)):
        svc = named(objs, "Service", svc_name)
        assert (svc["spec"].get("clusterIP") == "None") is headless
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
        assert matches({"matchLabels": svc["spec"]["selector"]}, gw["spec"]["template"]["metadata"]["labels"])


def test_grpc_probes_check_a_plaintext_gateway_port(objs: tuple[dict[str, Any], ...]) -> None:
    for w, _tpl, c in containers(objs):
        where = f"{w['metadata']['name']}/{c['name']}"
        for probe_name in PROBES:
            probe = c.get(probe_name, {})
            if "grpc" not in probe:
                continue
            assert component(w) == "gateway", f"{where}: {probe_name}: only gateways serve gRPC"
            port, gw = probe["grpc"]["port"], settings_of(c).gateway
            assert port in grpc_probe_ports(gw), f"{where}: {probe_name} checks {port}, not a plaintext health port"
            assert port in {p["containerPort"] for p in c.get("ports", [])}, f"{where}: {port} is no containerPort"


def test_gateway_routes_and_models_name_deployed_pools(objs: tuple[dict[str, Any], ...]) -> None:
    (c,) = named(objs, "Deployment", "llamamesh-gateway")["spec"]["template"]["spec"]["containers"]
    s = settings_of(c).gateway
    pools = {
        settings_of(w["spec"]["template"]["spec"]["containers"][0]).worker.pool
        for w in of_kind(objs, "Deployment")
        if component(w) == "worker"
    }
    wanted = {m.pool for m in s.model_table()} | set(RoutingPolicy.parse(s.routes).pools)
    wanted |= set(s.fallback_table()) | set(s.fallback_table().values())
    assert wanted <= pools, f"the gateway routes to pools no worker serves: {sorted(wanted - pools)}"


def test_workers_grace_startup_and_health(objs: tuple[dict[str, Any], ...]) -> None:
    workers = [w for w in of_kind(objs, "Deployment") if component(w) == "worker"]
    assert workers
    for w in workers:
        spec = w["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        s = settings_of(c).worker
        where = w["metadata"]["name"]
        assert w["metadata"]["labels"]["llamamesh.io/pool"] == s.pool, where
        assert spec["terminationGracePeriodSeconds"] > s.grace_s + 10, f"{where}: leave the engine time to stop"
        assert s.health_port and s.metrics_port and s.metrics_host == "0.0.0.0", where
        probes = (("livenessProbe", "/livez"), ("readinessProbe", "/readyz"), ("startupProbe", "/readyz"))
        for probe_name, path in probes:
            probe = c[probe_name]
            assert probe["httpGet"] == {"path": path, "port": s.health_port}, f"{where}: {probe_name}"
        start = c["startupProbe"]
        waits = start.get("initialDelaySeconds", 0) + start["failureThreshold"] * start["periodSeconds"]
        assert waits >= s.start_timeout_s, f"{where}: the startupProbe gives up before the engine's start may end"
        assert s.cache_dir in {m["mountPath"] for m in c["volumeMounts"]}, f"{where}: cache dir not writable"


def min_replicas(objs: tuple[dict[str, Any], ...], w: dict[str, Any]) -> int:
    """The fewest replicas ``w`` runs: its own count, or its autoscaler's minimum."""
    name = w["metadata"]["name"]
    for so in of_kind(objs, "ScaledObject"):
        if so["spec"]["scaleTargetRef"]["name"] == name:
            return int(so["spec"]["minReplicaCount"])
    for hpa in of_kind(objs, "HorizontalPodAutoscaler"):
        if hpa["spec"]["scaleTargetRef"]["name"] == name:
            return int(hpa["spec"]["minReplicas"])
    return int(w["spec"].get("replicas", 1))


def startup_window_s(w: dict[str, Any]) -> int:
    """How long the pod's containers may take to start before their startupProbe gives up."""
    longest = 0
    for c in w["spec"]["template"]["spec"]["containers"]:
        probe = c.get("startupProbe") or c.get("readinessProbe") or {}
        period = probe.get("periodSeconds", 10)
        longest = max(longest, probe.get("initialDelaySeconds", 0) + probe.get("failureThreshold", 3) * period)
    return longest


def test_no_rollout_or_drain_removes_a_pools_last_ready_worker(objs: tuple[dict[str, Any], ...]) -> None:
    """Either the new pod is ready before an old one goes (maxSurge >= 1, maxUnavailable 0), or the
    pool runs two or more, loses one at a time, and its PDB keeps one through drains."""
    pdbs = of_kind(objs, "PodDisruptionBudget")
    for w in of_kind(objs, *WORKLOADS):
        where = w["metadata"]["name"]
        if w["kind"] != "Deployment" or component(w) not in ("worker", "gateway"):
            continue
        rolling = w["spec"]["strategy"]["rollingUpdate"]
        surge, unavailable = int(rolling.get("maxSurge", 1)), int(rolling.get("maxUnavailable", 1))
        least = min_replicas(objs, w)
        if unavailable:
            assert least > unavailable, f"{where}: a rollout of {least} replica(s) takes {unavailable} down at once"
        else:
            assert surge >= 1, where
        labels = w["spec"]["template"]["metadata"]["labels"]
        (pdb,) = [b for b in pdbs if matches(b["spec"]["selector"], labels)]
        kept = pdb["spec"].get("minAvailable")
        if kept is None:
            kept = least - int(pdb["spec"]["maxUnavailable"])
        if least >= 2:
            assert int(kept) >= 1, f"{where}: a drain may take every replica"
        else:  # one replica: a PDB keeping it would block every node drain for good
            assert pdb["spec"].get("maxUnavailable") == 1, where


def test_rollouts_wait_for_a_slow_start(objs: tuple[dict[str, Any], ...]) -> None:
    """progressDeadlineSeconds (600 unset) longer than the startup window: `kubectl rollout status`
    and Argo CD must not call a cold start that is still within it a failed rollout."""
    for w in of_kind(objs, "Deployment"):
        deadline = w["spec"].get("progressDeadlineSeconds", 600)
        assert deadline > startup_window_s(w), f"{w['metadata']['name']}: {deadline} s"


def test_gateway_readiness_holds_through_a_redis_blip(objs: tuple[dict[str, Any], ...]) -> None:
    """Readiness follows Redis only after a hold: a failover does not empty the Service at once."""
    gw = named(objs, "Deployment", "llamamesh-gateway")
    (c,) = gw["spec"]["template"]["spec"]["containers"]
    assert settings_of(c).gateway.unreachable_hold_s >= 10


def test_gpu_workers(objs: tuple[dict[str, Any], ...]) -> None:
    for w in of_kind(objs, "Deployment"):
        spec = w["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        s = settings_of(c).worker
        if component(w) != "worker" or s.engine not in ("vllm", "trtllm"):
            continue
        where = w["metadata"]["name"]
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1, where
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
        assert shm["medium"] == "Memory" and shm.get("sizeLimit"), where
        model = [m for path, m in mounts.items() if s.model_path.startswith(path.rstrip("/") + "/")]
        assert model and model[0].get("readOnly") is True, f"{where}: the model comes from a read-only volume"
        assert "persistentVolumeClaim" in volumes[model[0]["name"]], where
        assert any(t.get("key") == "nvidia.com/gpu" for t in spec["tolerations"]), where
        assert spec.get("nodeSelector"), where
        keys = {t["topologyKey"] for t in spec["topologySpreadConstraints"]}
        assert {"kubernetes.io/hostname", "topology.kubernetes.io/zone"} <= keys, where
        for t in spec["topologySpreadConstraints"]:
            assert matches(t["labelSelector"], w["spec"]["template"]["metadata"]["labels"]), where


def test_prometheus_annotations_match_the_metrics_ports(objs: tuple[dict[str, Any], ...]) -> None:
    for w, tpl in pod_specs(objs):
        if component(w) not in ("gateway", "worker"):
            continue
        notes, labels = tpl["metadata"]["annotations"], tpl["metadata"]["labels"]
        # deploy/monitoring/prometheus/scrape.yaml keeps pods by these.
        assert labels["app.kubernetes.io/name"] == "llamamesh"
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
        s = settings_of(tpl["spec"]["containers"][0])
        port = s.gateway.metrics_port if component(w) == "gateway" else s.worker.metrics_port
        assert notes["prometheus.io/port"] == str(port), w["metadata"]["name"]


def test_pdbs_and_services_select_pods(objs: tuple[dict[str, Any], ...]) -> None:
    pdbs = of_kind(objs, "PodDisruptionBudget")
    for pdb in pdbs:
        assert selects_pods(objs, pdb["spec"]["selector"]), f"PDB {pdb['metadata']['name']} selects no pod"
    for w in of_kind(objs, "Deployment"):
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert any(matches(p["spec"]["selector"], labels) for p in pdbs), f"no PDB for {w['metadata']['name']}"
    for svc in of_kind(objs, "Service"):
        assert selects_pods(objs, {"matchLabels": svc["spec"]["selector"]}), svc["metadata"]["name"]


def test_network_policies_select_pods(objs: tuple[dict[str, Any], ...]) -> None:
    policies = of_kind(objs, "NetworkPolicy")
    for np in policies:
        name = np["metadata"]["name"]
        assert selects_pods(objs, np["spec"]["podSelector"]), f"NetworkPolicy {name} selects no pod"
        for rule in np["spec"].get("ingress", []):
            for peer in rule["from"]:
                if "namespaceSelector" not in peer:  # a peer of this namespace: one of ours
                    assert selects_pods(objs, peer["podSelector"]), f"NetworkPolicy {name}: a peer selects no pod"
    for w, tpl in pod_specs(objs):
        covered = [np for np in policies if matches(np["spec"]["podSelector"], tpl["metadata"]["labels"])]
        assert covered, f"no NetworkPolicy for {w['metadata']['name']}"
    gateway = named(objs, "NetworkPolicy", "llamamesh-gateway")
    ports = {p["port"] for rule in gateway["spec"]["ingress"] for p in rule["ports"]}
    assert ports == {50051, 8000, 9400}
    # The health-only port is for kubelet, which probes from the node: no caller-facing rule opens it.
    (c,) = named(objs, "Deployment", "llamamesh-gateway")["spec"]["template"]["spec"]["containers"]
    assert settings_of(c).gateway.health_port not in ports


# What gateways and workers may reach: DNS, Redis (plain, TLS, Sentinel) and the OTLP collector.
EGRESS_PORTS = {53, 6379, 6380, 26379, 4317}


def test_network_policies_name_the_callers_namespaces_and_limit_egress(objs: tuple[dict[str, Any], ...]) -> None:
    """The gRPC and HTTP ports open to namespaces named by kubernetes.io/metadata.name (set by whoever
    creates the namespace, unlike a pod label any caller can give itself); gateways and workers
    reach DNS, Redis and the OTLP collector and nothing else."""
    gateway = named(objs, "NetworkPolicy", "llamamesh-gateway")
    (grpc_rule,) = [r for r in gateway["spec"]["ingress"] if {p["port"] for p in r["ports"]} == {50051, 8000}]
    for peer in grpc_rule["from"]:
        (named_ns,) = peer["namespaceSelector"]["matchExpressions"]
        assert named_ns["key"] == "kubernetes.io/metadata.name" and named_ns["operator"] == "In", peer
        assert named_ns["values"] and "podSelector" not in peer, peer
    for name in ("llamamesh-gateway", "llamamesh-worker"):
        np = named(objs, "NetworkPolicy", name)
        assert "Egress" in np["spec"]["policyTypes"], name
        ports = {p["port"] for rule in np["spec"]["egress"] for p in rule["ports"]}
        assert ports == EGRESS_PORTS, (name, ports)
    for w, _tpl, c in containers(objs):
        url = settings_of(c).redis.url
        if url:
            port = url.rsplit(":", 1)[-1].split("/")[0]
            assert int(port) in EGRESS_PORTS, (w["metadata"]["name"], url)


def test_the_model_fill_job_fills_what_the_workers_wait_for_and_read() -> None:
    """components/model-fill: from nothing to serving with the manifests alone. The Job writes the
    claim the workers mount read-only, into the folder LLAMAMESH_WORKER_MODEL_PATH names, marker
    last; each worker's init container waits for that marker."""
    objs = render_with("vllm", "model-fill")
    for o in objs:
        if not o["apiVersion"].startswith(KEDA):
            kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
    job = named(objs, "Job", "llamamesh-model-fill")["spec"]["template"]["spec"]
    (fill,) = job["containers"]
    dest = env_of(fill)["DEST"]
    assert ":" in fill["image"] and not fill["image"].endswith(":latest")
    assert fill["securityContext"]["readOnlyRootFilesystem"] and fill["securityContext"]["runAsNonRoot"]
    assert "rclone sync" in fill["args"][0] and fill["args"][0].rstrip().endswith('> "$DEST/.llamamesh-complete"')
    (job_mount,) = [m for m in fill["volumeMounts"] if dest.startswith(m["mountPath"] + "/")]
    claim = {v["name"]: v for v in job["volumes"]}[job_mount["name"]]["persistentVolumeClaim"]
    assert not job_mount.get("readOnly") and not claim.get("readOnly")
    worker = named(objs, "Deployment", "llamamesh-worker-vllm")["spec"]["template"]["spec"]
    (c,) = worker["containers"]
    assert settings_of(c).worker.model_path == dest
    (wait,) = worker["initContainers"]
    assert f"{dest}/.llamamesh-complete" in wait["args"][0]
    volumes = {v["name"]: v for v in worker["volumes"]}
    for mount in [*wait["volumeMounts"], *c["volumeMounts"]]:
        if dest.startswith(mount["mountPath"] + "/"):
            assert mount["readOnly"] is True
            assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim["claimName"]


def test_external_redis_comes_from_a_secret(external_redis: tuple[dict[str, Any], ...]) -> None:
    assert not of_kind(external_redis, "StatefulSet")
    for w, _tpl, c in containers(external_redis):
        (url,) = [e for e in c["env"] if e["name"] == env_name("redis", "url")]
        assert url["valueFrom"]["secretKeyRef"] == {"name": "llamamesh-redis", "key": "url"}, w["metadata"]["name"]


def test_cpu_demo_runs_its_own_persistent_redis() -> None:
    objs = render("cpu-demo")
    redis = named(objs, "StatefulSet", "llamamesh-redis")
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    args = [*c.get("command", []), *c.get("args", [])]
    assert args[args.index("--appendonly") + 1] == "yes"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] in {m["name"] for m in c["volumeMounts"]}
    svc = named(objs, "Service", "llamamesh-redis")
    assert [p["port"] for p in svc["spec"]["ports"]] == [6379]
    for w, _tpl, wc in containers(objs):
        if component(w) in ("gateway", "worker"):
            assert settings_of(wc).redis.url == "redis://llamamesh-redis:6379/0"
    # Only the gateways and workers reach Redis.
    policy = named(objs, "NetworkPolicy", "llamamesh-redis")
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [6379]
    peers = {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in rule["from"]}
    assert peers == {"gateway", "worker"}
    (worker,) = [w for w in of_kind(objs, "Deployment") if component(w) == "worker"]
    s = settings_of(worker["spec"]["template"]["spec"]["containers"][0]).worker
    assert s.engine == "transformers" and s.threads >= 1 and not s.model_path
    assert "nvidia.com/gpu" not in str(worker)


def test_keda(objs: tuple[dict[str, Any], ...]) -> None:
    """KEDA objects by hand (no KEDA CRD schema in kubernetes-validate): two prometheus triggers, the
    pool-wide queue depth (every tenant's streams) and a saturation trigger whose threshold is a share
    of each worker's KV cache, and a fallback size for while Prometheus does not answer."""
    assert not of_kind(objs, "TriggerAuthentication", "ClusterTriggerAuthentication")
    for so in of_kind(objs, "ScaledObject"):
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        spec = so["spec"]
        target = spec["scaleTargetRef"]
        assert target.get("kind", "Deployment") == "Deployment"
        pool = worker_pool(objs, target["name"])
        assert spec["minReplicaCount"] >= 1, "no scale-to-zero for a GPU pool: a cold start takes minutes"
        assert spec["maxReplicaCount"] >= spec["minReplicaCount"]
        triggers = spec["triggers"]
        assert [t["type"] for t in triggers] == ["prometheus", "prometheus"], triggers
        # KEDA's fallback applies only to AverageValue metrics, the prometheus trigger's default.
        assert all(t.get("metricType", "AverageValue") == "AverageValue" for t in triggers), triggers
        queries = {t["metadata"]["query"]: float(t["metadata"]["threshold"]) for t in triggers}
        (depth,) = [q for q in queries if "llamamesh_queue_depth" in q]
        (saturation,) = [q for q in queries if "llamamesh_engine_kv_cache_usage_ratio" in q]
        assert all(f'pool="{pool}"' in q for q in queries), queries
        assert queries[depth] > 0 and 0 < queries[saturation] < 1
        assert depth.startswith("max("), "every gateway exports the pool-wide depth: a sum counts it per gateway"
        assert saturation.startswith("sum("), "KEDA divides by the replicas: the pool's total, not one worker's"
        fallback = spec.get("fallback")
        assert fallback, "no fallback: while Prometheus does not answer the pool would keep whatever size it had"
        assert fallback["failureThreshold"] >= 1
        assert spec["minReplicaCount"] <= fallback["replicas"] <= spec["maxReplicaCount"]


def test_no_scaledobject_reads_a_redis_stream() -> None:
    """With a tenants file each tenant's jobs wait in a stream of their own, and a trigger on one
    stream sees one tenant's: queue depth comes from Prometheus (llamamesh_queue_depth, every stream)."""
    scaled = [(overlay, so) for overlay in OVERLAYS for so in of_kind(render(overlay), "ScaledObject")]
    assert scaled
    for overlay, so in scaled:
        for t in so["spec"]["triggers"]:
            assert not t["type"].startswith("redis"), (overlay, so["metadata"]["name"], t["type"])
            assert "stream" not in t["metadata"] and "authenticationRef" not in t, (overlay, t)


def test_podmonitors_scrape_every_gateway_and_worker_on_its_metrics_port() -> None:
    objs = render_with("vllm", "podmonitors")
    monitors = of_kind(objs, "PodMonitor")
    assert {m["apiVersion"] for m in monitors} == {"monitoring.coreos.com/v1"} and len(monitors) == 2
    for w, tpl in pod_specs(objs):
        labels = tpl["metadata"]["labels"]
        (m,) = [m for m in monitors if matches(m["spec"]["selector"], labels)]
        (endpoint,) = m["spec"]["podMetricsEndpoints"]
        (c,) = tpl["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        s = settings_of(c)
        want = s.gateway.metrics_port if component(w) == "gateway" else s.worker.metrics_port
        assert ports[endpoint["port"]] == want and endpoint["path"] == "/metrics", w["metadata"]["name"]


def test_hpa(objs: tuple[dict[str, Any], ...]) -> None:
    keda_targets = {so["spec"]["scaleTargetRef"]["name"] for so in of_kind(objs, "ScaledObject")}
    for hpa in of_kind(objs, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]["name"]
        assert target not in keda_targets, f"{target}: KEDA and an HPA would both scale it"
        pool = worker_pool(objs, target)
        assert hpa["spec"]["minReplicas"] >= 1
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == "llamamesh_queue_depth"
        assert metric["external"]["metric"]["selector"]["matchLabels"] == {"pool": pool}


def test_hpa_overlay_has_an_hpa_and_no_keda() -> None:
    objs = render("vllm-hpa")
    assert of_kind(objs, "HorizontalPodAutoscaler")
    assert not [o for o in objs if o["apiVersion"].startswith(KEDA)]


def test_canary_gets_a_weighted_share() -> None:
    objs = render("vllm-canary")
    (c,) = named(objs, "Deployment", "llamamesh-gateway")["spec"]["template"]["spec"]["containers"]
    policy = RoutingPolicy.parse(settings_of(c).gateway.routes)
    assert set(policy.pools) == {"vllm", "vllm-canary"}
    stable = named(objs, "Deployment", "llamamesh-worker-vllm")["spec"]["template"]["spec"]["containers"][0]
    canary = named(objs, "Deployment", "llamamesh-worker-vllm-canary")["spec"]["template"]["spec"]["containers"][0]
    assert canary["image"] != stable["image"]
    assert settings_of(canary).worker.pool == "vllm-canary"
    assert settings_of(canary).worker.model == settings_of(stable).worker.model
    # Only the image and the pool differ: the canary's figures compare with the stable pool's.
    same = dataclasses.replace(settings_of(canary), worker=dataclasses.replace(settings_of(canary).worker, pool="vllm"))
    assert same == settings_of(stable)


def test_the_vllm_pool_is_set_up_for_both_tiers() -> None:
    """A pool serving interactive and batch work holds batch items to a quarter of
    its slots and keeps engine steps short (the configuration measured in docs/benchmarks.md)."""
    (worker,) = named(render("vllm"), "Deployment", "llamamesh-worker-vllm")["spec"]["template"]["spec"]["containers"]
    s = settings_of(worker)
    assert s.batch.max_share == 0.25
    assert s.vllm.max_num_batched_tokens == 4096


def test_every_install_but_the_demo_needs_tls_and_api_keys(objs: tuple[dict[str, Any], ...]) -> None:
    """Off the CPU demo the gateway port speaks TLS and every call needs a key of the tenants file,
    both from Secrets the pod cannot start without (none optional)."""
    gw = named(objs, "Deployment", "llamamesh-gateway")["spec"]["template"]["spec"]
    (c,) = gw["containers"]
    s = settings_of(c)
    demo = not of_kind(objs, "Deployment") or any(
        settings_of(wc).worker.engine == "transformers" for w, _t, wc in containers(objs) if component(w) == "worker"
    )
    if demo:
        assert not s.gateway.tls_cert and not s.auth.file
        return
    secret_of = {v["name"]: v["secret"] for v in gw["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    for path, secret in ((s.gateway.tls_cert, "llamamesh-gateway-tls"), (s.auth.file, "llamamesh-tenants")):
        assert path, f"{secret}: not set"
        (volume,) = [name for mount, name in mounts.items() if path.startswith(mount + "/")]
        assert secret_of[volume]["secretName"] == secret and not secret_of[volume].get("optional"), secret
    # What reads appProtocol must not speak cleartext to these TLS ports.
    for svc in of_kind(objs, "Service"):
        if svc["metadata"]["name"].startswith("llamamesh-gateway"):
            protocols = {p["port"]: p.get("appProtocol") for p in svc["spec"]["ports"]}
            assert protocols == {50051: "tls", 8000: "https"}, svc["metadata"]["name"]


def test_tls_overlay_mounts_its_certificates() -> None:
    objs = render("tls")
    (c,) = named(objs, "Deployment", "llamamesh-gateway")["spec"]["template"]["spec"]["containers"]
    s = settings_of(c)
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    for path in (s.gateway.tls_cert, s.gateway.tls_key, s.gateway.tls_client_ca, s.redis.tls_ca):
        assert path and any(path.startswith(m + "/") for m in mounts), path
    volumes = named(objs, "Deployment", "llamamesh-gateway")["spec"]["template"]["spec"]["volumes"]
    secrets = {v["secret"]["secretName"] for v in volumes if "secret" in v}
    assert secrets == {"llamamesh-gateway-tls", "llamamesh-tenants", "llamamesh-client-ca", "llamamesh-redis-ca"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["grpc-health"] == s.gateway.health_port
    for w, _tpl, wc in containers(objs):
        if component(w) == "worker":
            assert settings_of(wc).redis.tls_ca


def test_prometheus_adapter_rule() -> None:
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    config = yaml.safe_load((K8S / "prometheus-adapter" / "config.yaml").read_text())
    assert values["rules"]["default"] is False
    assert values["rules"]["external"] == config["externalRules"]
    (rule,) = config["externalRules"]
    assert rule["seriesQuery"].startswith("llamamesh_queue_depth{")
    assert rule["name"]["as"] == "llamamesh_queue_depth"
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    assert "<<.LabelMatchers>>" in rule["metricsQuery"]
