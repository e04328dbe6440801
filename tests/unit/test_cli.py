"""The ``llamamesh`` command: ``--version``, the flags each process command takes, ``config``, the
gateway and worker commands becoming their process, and the old module paths."""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest

from llamamesh.cli import batchfile, main, parser
from llamamesh.settings import Settings
from llamamesh.settings.environment import redacted_url
from llamamesh.v1 import generation_pb2 as pb
from tests.redisproc import free_port

pytestmark = pytest.mark.timeout(60)

CLI = Path(sys.executable).parent / "llamamesh"
NODE_FLAGS = ("--host", "--port", "--redis-url", "--engine", "--threads", "--max-inflight", "--model-path", "--workers")


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The installed command, in an environment without the caller's LLAMAMESH_* variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLAMAMESH_")}
    return subprocess.run([str(CLI), *args], env={**base, **env}, capture_output=True, text=True, timeout=50)


def test_version_prints_the_installed_packages_version() -> None:
    out = run("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"llamamesh {metadata.version('llamamesh')}\n"


@pytest.mark.parametrize(
    ("command", "foreign"),
    [
        ("gateway", "--engine"),
        ("gateway", "--threads"),
        ("gateway", "--model-path"),
        ("gateway", "--workers"),
        ("worker", "--host"),
        ("worker", "--port"),
        ("worker", "--workers"),
    ],
)
def test_gateway_and_worker_refuse_each_others_flags(command: str, foreign: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args([command, foreign, "1"])
    assert exit_.value.code == 2


def test_each_command_keeps_its_own_flags() -> None:
    p = parser()
    gateway = p.parse_args(["gateway", "--host", "0.0.0.0", "--port", "1", "--redis-url", "redis://r"])
    assert (gateway.host, gateway.port, gateway.redis_url) == ("0.0.0.0", 1, "redis://r")
    worker = p.parse_args(
        [
            "worker",
            "--redis-url",
            "redis://r",
            "--engine",
            "fake",
            "--threads",
            "2",
            "--max-inflight",
            "3",
            "--model-path",
            "m.gguf",
        ]
    )
    assert (worker.engine, worker.threads, worker.max_inflight, worker.model_path) == ("fake", 2, 3, "m.gguf")
    values = ["h", "1", "redis://r", "fake", "2", "3", "m.gguf", "4"]
    node = [arg for pair in zip(NODE_FLAGS, values, strict=True) for arg in pair]
    assert p.parse_args(["serve", *node]).workers == 4
    assert p.parse_args(["demo", "hello", *node]).prompt == "hello"


def test_gateway_becomes_python_m_services_with_its_flags_in_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    put: dict[str, str] = {}
    execs: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(os, "putenv", lambda name, value: put.__setitem__(name, value))
    monkeypatch.setattr(os, "execv", lambda path, argv: execs.append((path, argv)))
    with pytest.raises(SystemExit):  # execv, faked, returned
        main(["gateway", "--port", "4321", "--redis-url", "redis://elsewhere:6379/0"])
    assert execs == [(sys.executable, [sys.executable, "-m", "services"])]
    assert put["LLAMAMESH_GATEWAY_PORT"] == "4321" and put["LLAMAMESH_REDIS_URL"] == "redis://elsewhere:6379/0"
    assert set(put) == set(Settings.from_env({}).to_env())  # every setting, so the process rebuilds them


def test_config_prints_every_setting_sorted_with_secrets_redacted() -> None:
    out = run(
        "config",
        "--port",
        "4321",
        LLAMAMESH_CLIENT_API_KEY="sekrit",
        LLAMAMESH_REDIS_URL="redis://user:hunter2@redis:6379/0",
        LLAMAMESH_WORKER_THREADS="3",
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == sorted(lines)
    got = dict(line.split("=", 1) for line in lines)
    assert set(got) == set(Settings.from_env({}).to_env())
    assert got["LLAMAMESH_CLIENT_API_KEY"] == "***" and "sekrit" not in out.stdout
    assert got["LLAMAMESH_REDIS_URL"] == "redis://user:***@redis:6379/0" and "hunter2" not in out.stdout
    assert got["LLAMAMESH_GATEWAY_PORT"] == "4321" and got["LLAMAMESH_WORKER_THREADS"] == "3"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://u:PW@AT5@h:6379", "redis://u:***@h:6379"),  # the host's @ is the last
        ("redis://h:6379/0?password=PWQUERY2", "redis://h:6379/0?password=***"),
        (
            "redis+sentinel://:pw@s1:1,s2:2/svc?sentinel_password=zz&db=1",
            "redis+sentinel://:***@s1:1,s2:2/svc?sentinel_password=***&db=1",
        ),
        ("redis://h:6379/0", "redis://h:6379/0"),
    ],
)
def test_every_password_of_a_redis_url_is_hidden(url: str, shown: str) -> None:
    assert redacted_url(url) == shown


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("LLAMAMESH_GATEWAY_PORT", "many"),
        ("LLAMAMESH_GATEWAY_MODELS", "foo"),
        ("LLAMAMESH_GATEWAY_FALLBACK", "cpu"),
        ("LLAMAMESH_WORKER_ADAPTERS", "foo"),
    ],
)
def test_config_says_which_value_is_bad_in_one_line(variable: str, value: str) -> None:
    out = run("config", **{variable: value})
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("error: ") and variable in out.stderr
    assert len(out.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("llamamesh.node", "llamamesh.cli.node", "Node"),
        ("llamamesh.top", "llamamesh.cli.top", "render"),
        ("llamamesh.batchfile", "llamamesh.cli.batchfile", "result_line"),
        ("llamamesh.embedded", "llamamesh.cli.embedded", "EmbeddedRedis"),
        ("llamamesh.resume", "llamamesh.client.resume", "Resumption"),
    ],
)
def test_an_old_module_path_warns_and_re_exports(
    monkeypatch: pytest.MonkeyPatch, old: str, new: str, name: str
) -> None:
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=new):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_a_command_that_fails_says_why_in_one_line() -> None:
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    cases = [
        ["models", "--address", nobody],
        ["tokenize", "hi", "--address", nobody],
        ["generate", "hi", "--address", nobody, "--wait", "1"],
        ["models", "--address", nobody, "--tls-ca", "/no/such/ca.pem"],
    ]
    for args in cases:
        out = run(*args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), (args, out.stderr)
    assert "LLAMAMESH_CLIENT_TLS_CA (--tls-ca)" in out.stderr
    for args, flag in (
        (["top", "--interval", "0"], "--interval"),
        (["batch", "list", "--limit", "-3"], "--limit"),
        (["batch", "list", "--limit", "101"], "--limit"),
    ):
        out = run(*args, "--address", nobody)
        assert out.returncode == 2 and f"argument {flag}" in out.stderr, out.stderr


def test_a_gateway_that_cannot_start_says_why_in_one_line() -> None:
    out = run("gateway", LLAMAMESH_GATEWAY_MODELS="garbage", LLAMAMESH_REDIS_URL=f"redis://127.0.0.1:{free_port()}")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: the gateway could not start: "), out.stderr


def test_a_process_of_a_node_says_in_one_line_what_it_cannot_start_with(tmp_path: Path) -> None:
    """One process of a node (``gateway``, ``worker``): no Redis url, a tenants file that is not one,
    adapters that are not name=path, a port of its own taken: one line naming the setting, exit 1."""
    redis = f"redis://127.0.0.1:{free_port()}"
    bad_tenants = tmp_path / "tenants.json"
    bad_tenants.write_text('{"tenants": 5}')
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    cases = [
        (("gateway",), {}, "LLAMAMESH_REDIS_URL"),
        (("worker",), {}, "LLAMAMESH_REDIS_URL"),
        (("gateway",), {"LLAMAMESH_AUTH_FILE": str(bad_tenants), "LLAMAMESH_REDIS_URL": redis}, "LLAMAMESH_AUTH_FILE"),
        (("gateway",), {"LLAMAMESH_AUTH_FILE": "/no/such/file", "LLAMAMESH_REDIS_URL": redis}, "LLAMAMESH_AUTH_FILE"),
        (("worker",), {"LLAMAMESH_WORKER_ADAPTERS": "foo", "LLAMAMESH_REDIS_URL": redis}, "LLAMAMESH_WORKER_ADAPTERS"),
        (("worker",), {"LLAMAMESH_WORKER_POOL": " ", "LLAMAMESH_REDIS_URL": redis}, "LLAMAMESH_WORKER_POOL"),
        (
            ("worker",),
            {"LLAMAMESH_WORKER_HEALTH_PORT": port, "LLAMAMESH_WORKER_ENGINE": "fake", "LLAMAMESH_REDIS_URL": redis},
            "LLAMAMESH_WORKER_HEALTH_PORT",
        ),
        (("gateway",), {"LLAMAMESH_GATEWAY_PORT": port, "LLAMAMESH_REDIS_URL": redis}, "LLAMAMESH_GATEWAY_PORT"),
        (
            ("gateway",),
            {
                "LLAMAMESH_GATEWAY_HTTP_PORT": port,
                "LLAMAMESH_GATEWAY_PORT": str(free_port()),
                "LLAMAMESH_REDIS_URL": redis,
            },
            "LLAMAMESH_GATEWAY_HTTP_PORT",
        ),
        (("serve", "--engine", "fake", "--port", port), {}, "LLAMAMESH_GATEWAY_PORT"),
        (("serve", "--engine", "fake"), {"LLAMAMESH_WORKER_HEALTH_PORT": port}, "LLAMAMESH_WORKER_HEALTH_PORT"),
    ]
    with taken, ThreadPoolExecutor(2) as pool:  # each case is a process of its own: two at a time
        outs = list(pool.map(lambda case: run(*case[0], **case[1]), cases))
        for (args, env, setting), out in zip(cases, outs, strict=True):
            last = out.stderr.strip().splitlines()[-1]
            assert out.returncode == 1 and "Traceback" not in out.stderr, (args, env, out.stderr)
            assert last.startswith("error: ") and setting in last, (args, env, out.stderr)
            if "PORT" in setting and "serve" in args:  # stopped before anything started: that line alone
                assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_flags_that_do_not_go_together_are_one_line(tmp_path: Path) -> None:
    nobody = f"127.0.0.1:{free_port()}"
    items = tmp_path / "items.jsonl"
    items.write_text('{"custom_id": "a", "request": {"prompt": "x"}}\n')
    cases = [
        (["generate", "x", "--choice", "yes", "--regex", "a", "--address", nobody], 1, "one response format"),
        (["generate", "x", "--seed", "99999999999999999999", "--address", nobody], 2, "argument --seed"),
        (["generate", "x", "--max-tokens", "9999999999", "--address", nobody], 2, "argument --max-tokens"),
        (["batch", "submit", str(items), "--max-tokens", "3", "--address", nobody], 2, "--max-tokens goes with"),
        (["generate", "x", "--raw", "--system", "be brief", "--address", nobody], 2, "--system goes with a chat"),
        (["batch", "submit", str(items), "--window", "5", "--address", nobody], 2, "argument --window"),
        (["batch", "results", "b", "-o", str(tmp_path / "no" / "x.jsonl"), "--address", nobody], 2, "error: -o "),
    ]
    for args, code, says in cases:
        out = run(*args)
        assert out.returncode == code and "Traceback" not in out.stderr and says in out.stderr, (args, out.stderr)


def test_a_batch_file_line_that_is_not_an_item_is_named() -> None:
    bad = [
        ('{"custom_id": "x", "request": null}', '"request" object'),
        ('{"custom_id": null, "request": {"prompt": "x"}}', '"custom_id" must be a string'),
        ('{"custom_id": "x", "request": "hello"}', '"request" object'),
        ('{"custom_id": "x", "reqest": {"prompt": "x"}}', "unknown key 'reqest'"),
        ('{"custom_id": "x", "request": {"maxtokens": 3}}', 'no field named "maxtokens"'),
        ('{"custom_id": "x", "request": {"metadata": ' + "[" * 5000 + "]" * 5000 + "}}", "not JSON"),
    ]
    for line, says in bad:
        with pytest.raises(ValueError, match="line 2: ") as exc:
            batchfile.items(['{"custom_id": "ok", "request": {"prompt": "x"}}', line])
        assert says in str(exc.value) and "\n" not in str(exc.value), (line, exc.value)
    with pytest.raises(ValueError, match='line 1: "custom_id" must be a string'):
        batchfile.summarise_request(['{"custom_id": 7, "text": "a document"}'], pb.GenerateRequest())


def test_a_reader_that_went_away_ends_the_command_quietly() -> None:
    read, write = os.pipe()
    os.close(read)  # (| head that has read its fill)
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLAMAMESH_")}
    done = subprocess.run([str(CLI), "config"], stdout=write, stderr=subprocess.PIPE, env=base, timeout=50)
    os.close(write)
    assert done.returncode == 141 and done.stderr == b"", done.stderr


def test_the_gateways_names_of_a_files_items_are_its_lines() -> None:
    named = batchfile.line_names(['{"custom_id": "a"}\n', "\n", '{"custom_id": "b"}\n', '{"custom_id": "a"}\n'])
    assert (
        named("items[2].custom_id: the custom_id of items[0] too") == "line 4: custom_id: the custom_id of line 1 too"
    )
    assert named("items[1].request.temperature") == "line 3: temperature"
    assert named("summarise.documents[1] ('b'): model 'x' is not served here") == (
        "line 3 ('b'): model 'x' is not served here"
    )
    assert named("items[9].custom_id") == "items[9].custom_id"  # not an item of this file


def test_demo_takes_the_port_setting_and_logs_to_a_file_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``llamamesh demo`` uses LLAMAMESH_GATEWAY_PORT as ``--port`` (else a free port), and each run
    writes its logs to a new file of its own, so another user's leftover file stops no one."""
    from llamamesh.cli import serve
    from llamamesh.cli.node import StartFailed

    made: list[tuple[int, Path]] = []

    class Stub:
        def __init__(self, settings: Settings, workers: int, log_file: Path) -> None:
            made.append((settings.gateway.port, log_file))

        def start(self) -> None:
            raise StartFailed("stub")

        def stop(self, timeout_s: float = 30.0) -> None:
            pass

    monkeypatch.setattr(serve, "Node", Stub)
    monkeypatch.setattr(serve.logs, "configure", lambda *a, **k: False)  # the test process's logging stays
    for name in [n for n in os.environ if n.startswith("LLAMAMESH_")]:
        monkeypatch.delenv(name)
    args = parser().parse_args(["demo", "hello"])
    assert serve.cmd_demo(args) == 1
    monkeypatch.setenv("LLAMAMESH_GATEWAY_PORT", "40123")
    assert serve.cmd_demo(parser().parse_args(["demo", "hello"])) == 1
    assert serve.cmd_demo(parser().parse_args(["demo", "hello", "--port", "40124"])) == 1
    assert made[0][0] != 40123 and [port for port, _ in made[1:]] == [40123, 40124]
    logs = [log for _, log in made]
    assert len(set(logs)) == 3 and all(log.is_file() and log.name.startswith("llamamesh-demo-") for log in logs)
    for log in logs:
        log.unlink()
