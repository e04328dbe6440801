from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from llamamesh.settings import ClientSettings, GatewaySettings, Range, Settings, WorkerSettings
from llamamesh.settings.environment import all_specs, sections
from llamamesh.settings.schema import Section, section_from_env, setting, specs

pytestmark = pytest.mark.timeout(10)


def test_env_maps_one_to_one_to_fields() -> None:
    s = Settings.from_env(
        {
            "LLAMAMESH_REDIS_URL": "redis://h:1/0",
            "LLAMAMESH_WORKER_MAX_INFLIGHT": "7",
            "LLAMAMESH_WORKER_FAKE_STEP_S": "0.5",
            "LLAMAMESH_GATEWAY_MODELS": "a=gpu, b=cpu",
            "UNRELATED": "x",
        }
    )
    assert s.redis.url == "redis://h:1/0"
    assert s.worker.max_inflight == 7 and s.worker.fake_step_s == 0.5
    assert [(m.id, m.pool, m.default) for m in s.gateway.model_table()] == [("a", "gpu", True), ("b", "cpu", False)]


def test_round_trip_through_the_environment() -> None:
    s = Settings.from_env({}).with_overrides(worker={"engine": "fake", "threads": 3}, gateway={"port": None})
    assert Settings.from_env(s.to_env()) == s
    assert s.gateway.port == 50051


def test_bad_values_name_the_variable() -> None:
    with pytest.raises(ValueError, match="LLAMAMESH_WORKER_MAX_INFLIGHT"):
        Settings.from_env({"LLAMAMESH_WORKER_MAX_INFLIGHT": "many"})
    for models in ("nopool", "a=b=c", "a=cpu,a=gpu"):
        with pytest.raises(ValueError, match="LLAMAMESH_GATEWAY_MODELS"):
            Settings.from_env({"LLAMAMESH_GATEWAY_MODELS": models}).gateway.model_table()


def test_threads_default_leaves_a_core_free() -> None:
    assert Settings.from_env({}).worker.torch_threads() >= 1
    assert Settings.from_env({"LLAMAMESH_WORKER_THREADS": "4"}).worker.torch_threads() == 4


def test_vllm_section_reads_its_env_vars() -> None:
    s = Settings.from_env(
        {
            "LLAMAMESH_VLLM_TOKENIZER": "/tok",
            "LLAMAMESH_VLLM_DTYPE": "bfloat16",
            "LLAMAMESH_VLLM_TENSOR_PARALLEL_SIZE": "2",
            "LLAMAMESH_VLLM_MAX_MODEL_LEN": "8192",
            "LLAMAMESH_VLLM_GPU_MEMORY_UTILIZATION": "0.85",
            "LLAMAMESH_VLLM_BLOCK_SIZE": "32",
            "LLAMAMESH_VLLM_ENABLE_PREFIX_CACHING": "false",
            "LLAMAMESH_VLLM_QUANTIZATION": "fp8",
            "LLAMAMESH_VLLM_LOAD_FORMAT": "dummy",
            "LLAMAMESH_VLLM_ENFORCE_EAGER": "true",
            "LLAMAMESH_VLLM_MAX_NUM_SEQS": "512",
            "LLAMAMESH_VLLM_MAX_NUM_BATCHED_TOKENS": "16384",
            "LLAMAMESH_VLLM_SWAP_SPACE": "4",
            "LLAMAMESH_VLLM_SEED": "7",
            "LLAMAMESH_VLLM_EXTRA_ARGS": '{"kv_cache_dtype": "fp8"}',
        }
    )
    v = s.vllm
    assert (v.tokenizer, v.dtype, v.tensor_parallel_size, v.max_model_len) == ("/tok", "bfloat16", 2, 8192)
    assert (v.gpu_memory_utilization, v.block_size, v.enable_prefix_caching) == (0.85, 32, False)
    assert (v.quantization, v.load_format, v.enforce_eager) == ("fp8", "dummy", True)
    assert (v.max_num_seqs, v.max_num_batched_tokens, v.swap_space, v.seed) == (512, 16384, 4.0, 7)
    assert v.extra_args == '{"kv_cache_dtype": "fp8"}'
    assert Settings.from_env(s.to_env()) == s


def test_vllm_defaults_mean_vllms_own() -> None:
    v = Settings.from_env({}).vllm
    assert (v.tensor_parallel_size, v.max_model_len, v.gpu_memory_utilization, v.max_num_seqs) == (0, 0, 0.0, 0)
    assert (v.tokenizer, v.dtype, v.enable_prefix_caching, v.extra_args) == ("", "", None, "")
    assert v.enforce_eager is False
    with pytest.raises(ValueError, match="LLAMAMESH_VLLM_MAX_NUM_SEQS"):
        Settings.from_env({"LLAMAMESH_VLLM_MAX_NUM_SEQS": "lots"})


def test_trtllm_section_reads_its_env_vars() -> None:
    s = Settings.from_env(
        {
            "LLAMAMESH_TRTLLM_BACKEND": "tensorrt",
            "LLAMAMESH_TRTLLM_MAX_NUM_TOKENS": "4096",
            "LLAMAMESH_TRTLLM_FREE_GPU_MEMORY_FRACTION": "0.85",
            "LLAMAMESH_TRTLLM_ENABLE_BLOCK_REUSE": "false",
            "LLAMAMESH_TRTLLM_TRUST_REMOTE_CODE": "true",
        }
    )
    t = s.trtllm
    assert (t.backend, t.max_num_tokens, t.free_gpu_memory_fraction) == ("tensorrt", 4096, 0.85)
    assert (t.enable_block_reuse, t.trust_remote_code) == (False, True)
    assert Settings.from_env(s.to_env()) == s
    d = Settings.from_env({}).trtllm
    assert (d.backend, d.tensor_parallel_size, d.max_seq_len, d.free_gpu_memory_fraction) == ("pytorch", 0, 0, 0.0)
    with pytest.raises(ValueError, match="LLAMAMESH_TRTLLM_MAX_BATCH_SIZE"):
        Settings.from_env({"LLAMAMESH_TRTLLM_MAX_BATCH_SIZE": "lots"})


def test_normalize_rules_come_from_their_env_var() -> None:
    rules = '[{"name": "html-ids", "pattern": "id=\\"[a-z0-9-]+\\"", "replacement": "id=\\"REDACTED\\""}]'
    s = Settings.from_env({"LLAMAMESH_GATEWAY_NORMALIZE_RULES": rules})
    assert s.gateway.normalize_rules == rules
    assert Settings.from_env(s.to_env()) == s
    assert Settings.from_env({}).gateway.normalize_rules == ""


def test_a_variable_that_is_no_setting_is_refused_with_the_closest_name() -> None:
    message = "LLAMAMESH_GATEWAY_SETLE_S is not a setting; did you mean LLAMAMESH_GATEWAY_SETTLE_S?"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Settings.from_env({"LLAMAMESH_GATEWAY_SETLE_S": "5"})
    with pytest.raises(ValueError, match=r"^LLAMAMESH_NOTHING_LIKE_IT is not a setting \(docs/configuration.md"):
        Settings.from_env({"LLAMAMESH_NOTHING_LIKE_IT": "1"})
    assert Settings.from_env({"OTHER_SETE_S": "5", "llamamesh_lower_case": "x"}) == Settings()


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("LLAMAMESH_GATEWAY_SETTLE_S", "-5", "LLAMAMESH_GATEWAY_SETTLE_S=-5: expected a number, 0 or more"),
        ("LLAMAMESH_GATEWAY_PORT", "99999", "LLAMAMESH_GATEWAY_PORT=99999: expected an integer, from 0 to 65535"),
        ("LLAMAMESH_WORKER_MAX_INFLIGHT", "0", "LLAMAMESH_WORKER_MAX_INFLIGHT=0: expected an integer, 1 or more"),
        (
            "LLAMAMESH_WORKER_MAX_INFLIGHT",
            "many",
            "LLAMAMESH_WORKER_MAX_INFLIGHT='many': expected an integer, 1 or more",
        ),
        (
            "LLAMAMESH_VLLM_GPU_MEMORY_UTILIZATION",
            "1.5",
            "LLAMAMESH_VLLM_GPU_MEMORY_UTILIZATION=1.5: expected a number, from 0 to 1",
        ),
        ("LLAMAMESH_WORKER_HEARTBEAT_S", "0", "LLAMAMESH_WORKER_HEARTBEAT_S=0: expected a number, more than 0"),
        ("LLAMAMESH_WORKER_HEARTBEAT_S", "nan", "LLAMAMESH_WORKER_HEARTBEAT_S=nan: expected a number, more than 0"),
        ("LLAMAMESH_GATEWAY_GRACE_S", "inf", "LLAMAMESH_GATEWAY_GRACE_S=inf: expected a number, 0 or more"),
        ("LLAMAMESH_GATEWAY_PORT", "1_000", "LLAMAMESH_GATEWAY_PORT='1_000': expected an integer, from 0 to 65535"),
        (  # past what Redis takes as a TTL: every publish would fail
            "LLAMAMESH_REDIS_EVENT_TTL_S",
            "99999999999999999999999999",
            "LLAMAMESH_REDIS_EVENT_TTL_S=99999999999999999999999999: expected an integer, 1 or more, "
            "at most 9007199254740992",
        ),
        (
            "LLAMAMESH_GATEWAY_GRACE_S",
            "1e300",
            "LLAMAMESH_GATEWAY_GRACE_S=1e300: expected a number, 0 or more, at most 9007199254740992",
        ),
        ("LLAMAMESH_GATEWAY_SHARE_PORT", "maybe", "LLAMAMESH_GATEWAY_SHARE_PORT='maybe': expected true or false"),
        ("LLAMAMESH_LOG_FORMAT", "JSON", "LLAMAMESH_LOG_FORMAT='JSON': expected one of auto, json, console"),
        (
            "LLAMAMESH_GATEWAY_EVENT_LOOP",
            "trio",
            "LLAMAMESH_GATEWAY_EVENT_LOOP='trio': expected one of uvloop, asyncio",
        ),
    ],
)
def test_a_bad_value_is_refused_in_one_line_naming_variable_value_and_range(
    variable: str, value: str, message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Settings.from_env({variable: value})


def test_bounds_are_inclusive_where_they_say_so() -> None:
    s = Settings.from_env(
        {
            "LLAMAMESH_GATEWAY_PORT": "0",
            "LLAMAMESH_GATEWAY_HEALTH_PORT": "65535",
            "LLAMAMESH_WORKER_MAX_INFLIGHT": "1",
            "LLAMAMESH_BATCH_MAX_SHARE": "1",
            "LLAMAMESH_BATCH_MIN_SHARE": "0",
            "LLAMAMESH_GATEWAY_SETTLE_S": "0",
            "LLAMAMESH_REDIS_EVENT_TTL_S": str(2**53),
        }
    )
    assert (s.gateway.port, s.gateway.health_port, s.worker.max_inflight) == (0, 65535, 1)
    assert (s.batch.max_share, s.batch.min_share, s.gateway.settle_s) == (1.0, 0.0, 0.0)


def test_values_set_in_code_are_checked_the_same_way() -> None:
    with pytest.raises(ValueError, match=r"^LLAMAMESH_WORKER_MAX_INFLIGHT=0: expected an integer, 1 or more$"):
        WorkerSettings(max_inflight=0)
    with pytest.raises(ValueError, match=r"^LLAMAMESH_GATEWAY_PORT=70000: "):
        Settings().with_overrides(gateway={"port": 70000})  # as the CLI's --port 70000
    with pytest.raises(ValueError, match=r"^LLAMAMESH_GATEWAY_PORT='50051': expected an integer"):
        GatewaySettings(port="50051")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^LLAMAMESH_WORKER_THREADS=True: expected an integer"):
        WorkerSettings(threads=True)  # a bool is no count
    with pytest.raises(ValueError, match=r"^LLAMAMESH_CLIENT_LOAD_BALANCING='random': expected one of"):
        ClientSettings(load_balancing="random")  # type: ignore[arg-type]
    assert GatewaySettings(grace_s=3).grace_s == 3  # an int where a number goes is kept as it is


def test_every_section_is_named_as_its_field_and_every_number_is_bounded() -> None:
    assert {name: cls.section for name, cls in sections().items()} == {name: name for name in sections()}
    unbounded = {s.env for s in all_specs() if s.kind in (int, float) and s.bounds is None}
    # Any integer is meaningful for these two (a seed; a priority, which may be negative).
    free = {"LLAMAMESH_VLLM_SEED", "LLAMAMESH_LIMITS_MAX_PRIORITY"}
    assert unbounded == free


@dataclass(frozen=True)
class _Probe(Section, section="probe"):
    limit: int | None = setting(None, Range(1))
    flag: bool | None = None
    mode: Literal["a", "b"] | None = None


def test_optional_values_read_empty_as_unset() -> None:
    assert section_from_env(_Probe, {}) == _Probe()
    assert section_from_env(_Probe, {"LLAMAMESH_PROBE_LIMIT": "", "LLAMAMESH_PROBE_FLAG": " "}) == _Probe()
    got = section_from_env(
        _Probe, {"LLAMAMESH_PROBE_LIMIT": "3", "LLAMAMESH_PROBE_FLAG": "no", "LLAMAMESH_PROBE_MODE": "b"}
    )
    assert got == _Probe(limit=3, flag=False, mode="b")
    with pytest.raises(ValueError, match=r"^LLAMAMESH_PROBE_LIMIT=0: expected an integer, 1 or more \(or empty\)$"):
        section_from_env(_Probe, {"LLAMAMESH_PROBE_LIMIT": "0"})
    with pytest.raises(ValueError, match=r"^LLAMAMESH_PROBE_MODE='c': expected one of a, b \(or empty\)$"):
        _Probe(mode="c")  # type: ignore[arg-type]
    assert [spec.text(None) for spec in specs(_Probe)] == ["", "", ""]


def test_a_type_no_variable_can_hold_is_refused_when_its_section_is_read() -> None:
    @dataclass(frozen=True)
    class Odd(Section, section="odd"):
        names: tuple[str, ...] = ()

    with pytest.raises(TypeError, match=r"Odd\.names: a setting is a bool, int, float, str or Literal"):
        Odd()


# The entry points, each as its own process: a bad setting stops it at once (it never gets to start
# Redis or a worker) with exit code 1, its last line naming the variable.
ENTRY_POINTS = {
    "llamamesh serve": [str(Path(sys.executable).with_name("llamamesh")), "serve"],
    "python -m services": [sys.executable, "-m", "services"],
    "python -m workers": [sys.executable, "-m", "workers"],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("entry", "variable", "value", "line"),
    [
        (
            "llamamesh serve",
            "LLAMAMESH_GATEWAY_SETLE_S",
            "5",
            "LLAMAMESH_GATEWAY_SETLE_S is not a setting; did you mean LLAMAMESH_GATEWAY_SETTLE_S?",
        ),
        (
            "llamamesh serve",
            "LLAMAMESH_GATEWAY_PORT",
            "99999",
            "LLAMAMESH_GATEWAY_PORT=99999: expected an integer, from 0 to 65535",
        ),
        (
            "llamamesh serve",
            "LLAMAMESH_WORKER_MAX_INFLIGHT",
            "0",
            "LLAMAMESH_WORKER_MAX_INFLIGHT=0: expected an integer, 1 or more",
        ),
        ("python -m services", "LLAMAMESH_GATEWAY_SETLE_S", "5", "LLAMAMESH_GATEWAY_SETLE_S is not a setting"),
        ("python -m workers", "LLAMAMESH_WORKER_MAX_INFLIGHT", "0", "LLAMAMESH_WORKER_MAX_INFLIGHT=0: expected"),
    ],
    ids=["serve-typo", "serve-port", "serve-max-inflight", "services-typo", "workers-max-inflight"],
)
def test_an_entry_point_with_a_bad_setting_exits_1_naming_it(entry: str, variable: str, value: str, line: str) -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"), variable: value}
    done = subprocess.run(ENTRY_POINTS[entry], env=env, capture_output=True, text=True, timeout=45)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and line in lines[0], done.stderr  # one line, no traceback
