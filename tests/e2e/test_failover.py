"""Mid-stream failover with real processes: a gateway, redis-server and two worker processes
running the real SmolLM2-135M-Instruct on the CPU in two pools; ``kill -9`` of the worker that is
streaming an answer. The caller's stream must go on, on the other pool, with exactly the tokens
an uninterrupted run gives (greedy): nothing repeated, nothing missing."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamamesh.client import Client
from llamamesh.v1 import generation_pb2 as pb
from tests.e2e.conftest import ProcessNode
from tests.e2e.test_fallback import BACKUP, FAST, SERVING, _is
from tests.redisproc import RedisProcess
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

# The default bfloat16: the resumed attempt replays the sent tokens through decode steps, as the
# uninterrupted run computed them (LLAMAMESH_WORKER_RESUME_REPLAY_TOKENS), so it goes on to the same bits.
CPU = {"LLAMAMESH_WORKER_THREADS": "1", "LLAMAMESH_WORKER_MAX_INFLIGHT": "4"}
PROMPT = [("user", "Write a short poem about the sea and the wind.")]


@pytest.fixture
def node(e2e_redis: RedisProcess, tmp_path: Path) -> Iterator[ProcessNode]:
    env = {k: v for k, v in FAST.items() if k != "LLAMAMESH_WORKER_FAKE_STEP_S"}
    n = ProcessNode(
        tmp_path,
        e2e_redis,
        engine="transformers",
        pool="primary",
        extra_env={
            **env,
            **CPU,
            "LLAMAMESH_GATEWAY_MODELS": "m=primary",
            "LLAMAMESH_GATEWAY_FALLBACK": "primary=backup",
        },
    )
    try:
        n.start()
        n.spawn("backup", "workers", LLAMAMESH_WORKER_POOL="backup", LLAMAMESH_WORKER_CONSUMER="backup-worker")
        yield n
    finally:
        n.stop()


async def test_kill_mid_stream_continues_with_the_same_tokens(node: ProcessNode) -> None:
    n_tokens = 48
    kwargs = {"messages": PROMPT, "max_tokens": n_tokens, "temperature": 0.0, "ignore_eos": True}
    async with Client(node.address) as c:
        await until(lambda: _is(c, BACKUP, SERVING), 120, "the backup pool to be SERVING", poll_s=0.05)
        reference = [m async for m in c.generate(**kwargs)]  # on the primary (routing prefers it)
        ref_ids = [t for m in reference for t in m.token_ids]
        assert len(ref_ids) == n_tokens

        got: list[pb.GenerateResponse] = []
        killed_after = 0
        async for m in c.generate(**kwargs):
            got.append(m)
            n = sum(len(x.token_ids) for x in got)
            if not killed_after and n >= 8:
                node.procs["worker"].send_signal(signal.SIGKILL)  # the primary's only worker
                node.procs["worker"].wait(10)
                killed_after = n
    assert 8 <= killed_after < n_tokens
    ids = [t for m in got for t in m.token_ids]
    assert ids == ref_ids  # greedy: identical, no duplicate, no gap
    assert [m.index for m in got if m.token_ids] == [
        sum(len(x.token_ids) for x in got[:i]) for i, m in enumerate(got) if m.token_ids
    ]
    assert "".join(m.text for m in got) == "".join(m.text for m in reference)
    last = got[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == n_tokens
    assert last.usage.prompt_tokens == reference[-1].usage.prompt_tokens
    # It moved on because the worker was lost, to the backup pool, resuming from what was sent.
    moved = [json.loads(x) for x in node.log("gateway").splitlines() if '"request_failed_over"' in x]
    assert len(moved) == 1 and moved[0]["pool"] == "primary" and moved[0]["resumed_tokens"] >= killed_after
    done = [json.loads(x) for x in node.log("gateway").splitlines() if '"rpc_finished"' in x]
    mine = [x for x in done if x.get("request_id") == last.request_id]
    assert mine and mine[0]["pool"] == "backup" and mine[0]["failovers"] == 1 and mine[0]["status"] == "ok"


async def test_kill_mid_stream_of_a_json_schema_request_resumes_inside_the_grammar(node: ProcessNode) -> None:
    """The resumed attempt feeds the tokens already sent through the schema's grammar first: the
    caller's text is one JSON value that validates, the same as an uninterrupted run's (greedy)."""
    import jsonschema

    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age", "hobbies"],
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        },
    }
    kwargs = {
        "messages": [("user", "Describe a person as JSON.")],
        "max_tokens": 96,
        "temperature": 0.0,
        "json_schema": schema,
    }
    async with Client(node.address) as c:
        await until(lambda: _is(c, BACKUP, SERVING), 120, "the backup pool to be SERVING", poll_s=0.05)
        reference = "".join([m.text async for m in c.generate(**kwargs)])
        jsonschema.validate(json.loads(reference), schema)
        got: list[pb.GenerateResponse] = []
        async for m in c.generate(**kwargs):
            got.append(m)
            if len(got) == 6:  # a few deltas in: mid-value
                node.procs["worker"].send_signal(signal.SIGKILL)
                node.procs["worker"].wait(10)
    text = "".join(m.text for m in got)
    jsonschema.validate(json.loads(text), schema)
    assert text == reference and got[-1].finish_reason == pb.FINISH_REASON_STOP
    moved = [json.loads(x) for x in node.log("gateway").splitlines() if '"request_failed_over"' in x]
    assert len(moved) == 1 and moved[0]["resumed_tokens"] >= 5


async def test_kill_mid_stream_of_n_samples_resumes_each_from_its_own_tokens(node: ProcessNode) -> None:
    """A request of 3 samples loses its worker with every sample part-way: the gateway resumes each
    unfinished sample on the backup pool from the tokens the caller has of it. Each sample's indexes
    run 0..max_tokens once (no repeat, no gap), each ends with its own finish reason, and the usage
    counts every sample's tokens once."""
    n_tokens = 32
    kwargs = {"messages": PROMPT, "max_tokens": n_tokens, "temperature": 1.0, "seed": 11, "ignore_eos": True, "n": 3}
    async with Client(node.address) as c:
        await until(lambda: _is(c, BACKUP, SERVING), 120, "the backup pool to be SERVING", poll_s=0.05)
        got: list[pb.GenerateResponse] = []
        killed_at: dict[int, int] = {}
        async for m in c.generate(**kwargs):
            got.append(m)
            have = {k: sum(len(x.token_ids) for x in got if x.sample == k) for k in range(3)}
            if not killed_at and min(have.values()) >= 4:
                node.procs["worker"].send_signal(signal.SIGKILL)
                node.procs["worker"].wait(10)
                killed_at = have
    assert killed_at and max(killed_at.values()) < n_tokens
    for k in range(3):
        mine = [m for m in got if m.sample == k]
        idx = [i for m in mine for i in range(m.index, m.index + len(m.token_ids))]
        assert idx == list(range(n_tokens)), (k, idx)
        assert [m.finish_reason for m in mine if m.finish_reason] == [pb.FINISH_REASON_LENGTH]
    assert got[-1].usage.completion_tokens == 3 * n_tokens
    moved = [json.loads(x) for x in node.log("gateway").splitlines() if '"request_failed_over"' in x]
    assert len(moved) == 1 and moved[0]["resumed_tokens"] >= sum(killed_at.values())

    def resumed() -> list[dict]:
        jobs = [json.loads(x) for x in node.log("backup").splitlines() if '"job_finished"' in x]
        return [j for j in jobs if j.get("request_id") == f"{got[-1].request_id}~1"]

    # The worker logs job_finished after its last event is out: the caller may be first.
    await until(resumed, 10, "the backup worker's job_finished line", poll_s=0.05)
    (job,) = resumed()
    assert job["completion_tokens"] == 3 * n_tokens - moved[0]["resumed_tokens"]
