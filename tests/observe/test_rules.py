"""deploy/monitoring: the alert rules pass promtool's checks and unit tests, the Prometheus config is
valid, the Grafana dashboard is well formed, and every PromQL expression of both parses in a real
Prometheus and, for the dashboard, selects the series llamamesh exports.

The real Prometheus scrapes a static exposition of every metric in METRICS (one series each, with a
sample value for each label): METRICS is the contract between these files and the code that
exports the metrics.
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.redisproc import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

MONITORING = Path(__file__).resolve().parent.parent.parent / "deploy" / "monitoring"
ALERTS = MONITORING / "prometheus" / "alerts.yaml"
ALERTS_TEST = MONITORING / "prometheus" / "alerts_test.yaml"
SCRAPE = MONITORING / "prometheus" / "scrape.yaml"
DASHBOARD = MONITORING / "grafana" / "llamamesh.json"
PROVISIONING = MONITORING / "grafana" / "provisioning"

# Every metric the gateway and the worker export: name -> (type, label names).
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    # gateway
    "llamamesh_requests_total": ("counter", ("method", "code", "pool")),
    "llamamesh_time_to_first_token_seconds": ("histogram", ("pool",)),
    "llamamesh_inter_token_latency_seconds": ("histogram", ("pool",)),
    "llamamesh_request_duration_seconds": ("histogram", ("method",)),
    "llamamesh_queue_wait_seconds": ("histogram", ("pool",)),
    "llamamesh_prompt_tokens_total": ("counter", ("pool",)),
    "llamamesh_generation_tokens_total": ("counter", ("pool",)),
    "llamamesh_inflight_requests": ("gauge", ()),
    "llamamesh_queue_depth": ("gauge", ("pool",)),
    "llamamesh_queue_pending": ("gauge", ("pool",)),
    "llamamesh_breaker_state": ("gauge", ("pool",)),
    "llamamesh_breaker_transitions_total": ("counter", ("pool", "to")),
    "llamamesh_failovers_total": ("counter", ("pool",)),
    "llamamesh_dead_letters_total": ("counter", ("pool",)),
    "llamamesh_admission_rejected_total": ("counter", ("reason",)),
    "llamamesh_prompt_rewrites_total": ("counter", ("rule",)),
    "llamamesh_workers": ("gauge", ("pool", "state")),
    "llamamesh_disconnect_cancel_seconds": ("histogram", ()),
    "llamamesh_batches_at_risk": ("gauge", ()),
    "llamamesh_batches_projected_late": ("gauge", ()),
    "llamamesh_batch_projected_finish_ratio": ("gauge", ()),
    "llamamesh_queue_full": ("gauge", ()),
    "llamamesh_queue_evicting": ("gauge", ()),
    # worker
    "llamamesh_affinity_leases_total": ("counter", ("pool", "kind")),
    "llamamesh_jobs_started_total": ("counter", ("pool",)),
    "llamamesh_worker_inflight_jobs": ("gauge", ("pool",)),
    "llamamesh_batch_items_total": ("counter", ("state",)),
    "llamamesh_jobs_finished_total": ("counter", ("pool", "status")),
    "llamamesh_engine_running_requests": ("gauge", ("pool",)),
    "llamamesh_engine_waiting_requests": ("gauge", ("pool",)),
    "llamamesh_engine_kv_cache_usage_ratio": ("gauge", ("pool",)),
    "llamamesh_worker_generated_tokens_total": ("counter", ("pool",)),
    "llamamesh_engine_steps_total": ("counter", ("pool",)),
    "llamamesh_worker_batch_allowance_slots": ("gauge", ("pool",)),
    "llamamesh_worker_interactive_ttft_p90_seconds": ("gauge", ("pool",)),
    "llamamesh_worker_interactive_ttft_target_seconds": ("gauge", ("pool",)),
}
SAMPLE_LABELS = {
    "pool": "chat",
    "method": "Generate",
    "code": "OK",
    "to": "open",
    "reason": "queue_full",
    "state": "ready",
    "status": "ok",
    "rule": "html-ids",
    "kind": "own",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
RATE_INTERVAL = "1m"  # what $__rate_interval stands for in the dashboard's expressions
SEVERITIES = {"warning", "critical"}


def exposition() -> str:
    """The text format of one series of every metric in METRICS."""
    lines: list[str] = []
    for name, (kind, labels) in METRICS.items():
        pairs = [f'{label}="{SAMPLE_LABELS[label]}"' for label in labels]
        lines.append(f"# TYPE {name} {kind}")
        if kind != "histogram":
            lines.append(f"{name}{{{','.join(pairs)}}} 1")
            continue
        for le, count in (("0.1", 1), ("1", 3), ("+Inf", 4)):
            bucket = ",".join([*pairs, f'le="{le}"'])
            lines.append(f"{name}_bucket{{{bucket}}} {count}")
        lines.append(f"{name}_sum{{{','.join(pairs)}}} 2.5")
        lines.append(f"{name}_count{{{','.join(pairs)}}} 4")
    return "\n".join(lines) + "\n"


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard_panels() for t in p["targets"]]


def substituted(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$pool", SAMPLE_LABELS["pool"])


def metric_names(expr: str) -> set[str]:
    names = set()
    for name in re.findall(r"\bllamamesh_[a-z0-9_]+", expr):
        for suffix in HISTOGRAM_SUFFIXES:
            base = name.removesuffix(suffix)
            if base != name and METRICS.get(base, ("",))[0] == "histogram":
                name = base
        names.add(name)
    return names


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: `apt-get install prometheus`, which ships it)")
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=30, check=False)


# --- promtool ---------------------------------------------------------------------------------


def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


def test_promtool_unit_tests_pass() -> None:
    done = promtool("test", "rules", str(ALERTS_TEST))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_checks_the_scrape_config(tmp_path: Path) -> None:
    """Debian's Prometheus is built without Kubernetes discovery: there the Kubernetes jobs are
    checked for shape here and the rest of the config by promtool."""
    config = yaml.safe_load(SCRAPE.read_text())
    config["rule_files"] = [str(SCRAPE.parent / f) for f in config["rule_files"]]
    assert [j["job_name"] for j in config["scrape_configs"] if "kubernetes_sd_configs" in j] == ["llamamesh-pods"]
    checked = tmp_path / "scrape.yaml"
    checked.write_text(yaml.safe_dump(config))
    done = promtool("check", "config", str(checked))
    if "field kubernetes_sd_configs not found" in done.stdout + done.stderr:
        config["scrape_configs"] = [j for j in config["scrape_configs"] if "kubernetes_sd_configs" not in j]
        checked.write_text(yaml.safe_dump(config))
        done = promtool("check", "config", str(checked))
    assert done.returncode == 0, done.stdout + done.stderr


# --- the files' shape -------------------------------------------------------------------------


def test_every_alert_is_labelled_and_explained() -> None:
    for rule in alert_rules():
        assert rule["alert"].startswith("Llamamesh"), rule
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert {"summary", "description"} <= rule["annotations"].keys(), rule["alert"]


def test_every_alert_is_tested_firing_and_silent() -> None:
    cases = [case for test in yaml.safe_load(ALERTS_TEST.read_text())["tests"] for case in test["alert_rule_test"]]
    fires = {c["alertname"] for c in cases if c["exp_alerts"]}
    silent = {c["alertname"] for c in cases if not c["exp_alerts"]}
    alerts = {rule["alert"] for rule in alert_rules()}
    assert alerts - fires == set(), "alerts never shown firing"
    assert alerts - silent == set(), "alerts never shown silent"
    assert (fires | silent) - alerts == set(), "tests of alerts that do not exist"


def test_dashboard_is_provisioning_ready() -> None:
    dash = dashboard()
    assert dash["uid"] == "llamamesh"
    assert dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["pool"]["query"]["query"].startswith("label_values(")
    assert variables["pool"]["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in dashboard_panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_dashboard_panels_do_not_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in dashboard()["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, panel["title"]
        taken |= cells


def test_provisioning_points_at_the_dashboard_and_prometheus() -> None:
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "datasource.yaml").read_text())["datasources"]
    assert [d["type"] for d in datasources] == ["prometheus"]
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "dashboards.yaml").read_text())["providers"]
    assert [p["type"] for p in providers] == ["file"]
    assert providers[0]["options"]["path"]


def test_metrics_table_is_what_the_code_exports() -> None:
    """METRICS (names with their exposition suffix, types, label names) is llamamesh/metrics.py's."""
    from prometheus_client import Counter, Gauge, Histogram

    from llamamesh import metrics

    exported = {}
    for value in vars(metrics).values():
        if isinstance(value, Counter | Gauge | Histogram):
            kind = value._type  # prometheus_client keeps them private
            name = value._name + ("_total" if kind == "counter" else "")
            exported[name] = (kind, tuple(value._labelnames))
    assert exported == METRICS


def test_expressions_name_only_exported_metrics() -> None:
    for expr in [*dashboard_exprs(), *(rule["expr"] for rule in alert_rules())]:
        names = metric_names(expr)
        assert names, expr
        assert names <= METRICS.keys(), f"unknown metrics {names - METRICS.keys()} in {expr}"


# --- a real Prometheus ------------------------------------------------------------------------


class Exposition(http.server.BaseHTTPRequestHandler):
    body = exposition().encode()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> dict[str, Any]:
        """The JSON answer of an API call; Prometheus's own error (a 4xx with a JSON body) is returned, not raised."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return json.loads(reply.read())  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())  # type: ignore[no-any-return]

    def query(self, expr: str) -> dict[str, Any]:
        return self.get("/api/v1/query", query=expr)

    def wait_for(self, expr: str, what: str, timeout_s: float = 30.0) -> None:
        """Poll until expr returns a series."""
        wait_until(
            lambda: self.query(expr).get("data", {}).get("result"), timeout_s, f"Prometheus to have {what}", poll_s=0.1
        )


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A real Prometheus scraping a static exposition of METRICS every second, with alerts.yaml loaded,
    once it has scraped three times (every rate() over RATE_INTERVAL has two samples)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian: `apt-get install prometheus`)")
    exporter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Exposition)
    serving = threading.Thread(target=exporter.serve_forever, daemon=True)
    serving.start()
    workdir = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": "static", "static_configs": [{"targets": [f"127.0.0.1:{exporter.server_address[1]}"]}]}
        ],
    }
    (workdir / "prometheus.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={workdir / 'prometheus.yaml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        prom = Prometheus(f"http://127.0.0.1:{port}")

        def failed() -> str:
            return f"prometheus did not start: {(workdir / 'prometheus.log').read_text()[-2000:]}"

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError):
                pass
            if proc.poll() is not None:
                raise RuntimeError(failed())
            return False

        try:
            wait_until(ready, 30, "Prometheus to be ready")
        except TimeoutError:
            raise RuntimeError(failed()) from None
        prom.wait_for('count_over_time(up{job="static"}[1m]) >= 3 and up{job="static"} == 1', "three good scrapes")
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        exporter.shutdown()
        exporter.server_close()
        serving.join(timeout=5)


def test_every_exported_metric_is_scraped(prometheus: Prometheus) -> None:
    result = prometheus.query('count by (__name__) ({__name__=~"llamamesh_.+"})')["data"]["result"]
    scraped = {r["metric"]["__name__"] for r in result}
    expected = {
        f"{name}{suffix}" if kind == "histogram" else name
        for name, (kind, _) in METRICS.items()
        for suffix in (HISTOGRAM_SUFFIXES if kind == "histogram" else ("",))
    }
    assert scraped == expected


@pytest.mark.parametrize("expr", dashboard_exprs())
def test_dashboard_expression_selects_series(prometheus: Prometheus, expr: str) -> None:
    answer = prometheus.query(substituted(expr))
    assert answer["status"] == "success", answer
    assert answer["data"]["result"], f"no series for {substituted(expr)}"


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_expression_parses(prometheus: Prometheus, rule: dict[str, Any]) -> None:
    answer = prometheus.query(rule["expr"])
    assert answer["status"] == "success", answer


def test_prometheus_evaluates_every_rule(prometheus: Prometheus) -> None:
    expected = {rule["alert"] for rule in alert_rules()}

    def health() -> dict[str, tuple[str, str]]:
        groups = prometheus.get("/api/v1/rules")["data"]["groups"]
        got = {r["name"]: (r["health"], r.get("lastError", "")) for g in groups for r in g["rules"]}
        assert not [h for h in got.values() if h[0] == "err"], got
        return got

    every_rule_ok = lambda got: got.keys() == expected and all(h[0] == "ok" for h in got.values())  # noqa: E731
    wait_until(health, 30, "every rule evaluated", done=every_rule_ok, poll_s=0.1)


def test_pool_variable_lists_pools(prometheus: Prometheus) -> None:
    query = dashboard()["templating"]["list"][1]["query"]["query"]
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", query).groups()  # type: ignore[union-attr]
    values = prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": metric})["data"]
    assert values == [SAMPLE_LABELS["pool"]]
