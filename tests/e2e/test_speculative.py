"""Speculative decoding on vLLM (its n-gram proposer: several tokens per engine step) through the whole
path: the streamed text is the text of its tokens, indexes stay contiguous, and Attach from any offset
gives exactly the rest (marker gpu: skipped without CUDA and vLLM)."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

from llamamesh.client import Client
from llamamesh.v1 import generation_pb2 as pb
from tests.contract.conftest import NGRAM
from tests.e2e.conftest import ProcessNode, vllm_node
from tests.redisproc import RedisProcess, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.gpu, pytest.mark.timeout(300)]

# A greedy answer that repeats itself: the proposer finds its drafts in the context.
REPEATING = [("user", "Repeat this sentence five times: the quick brown fox jumps over the lazy dog.")]
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


@pytest.fixture(scope="module")
def ngram_node(e2e_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessNode]:
    env = {
        "LLAMAMESH_VLLM_EXTRA_ARGS": json.dumps({"speculative_config": NGRAM}),
        "LLAMAMESH_VLLM_GPU_MEMORY_UTILIZATION": "0.2",
        "LLAMAMESH_WORKER_METRICS_PORT": str(free_port()),
    }
    node = vllm_node(tmp_path_factory.mktemp("ngram-node"), e2e_redis, env)
    try:
        node.start()
        yield node
    finally:
        node.stop()


def accepted_tokens(node: ProcessNode) -> float:
    """Draft tokens vLLM accepted so far, summed over the worker's series."""
    body = urllib.request.urlopen(node.metrics_url("worker"), timeout=10).read().decode()
    return sum(float(m) for m in re.findall(rf"^{re.escape(ACCEPTED)}(?:{{[^}}]*}})? (\S+)$", body, re.M))


def decode(node: ProcessNode, token_ids: list[int]) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(node.env["LLAMAMESH_WORKER_MODEL_PATH"], local_files_only=True)
    return str(tokenizer.decode(token_ids, skip_special_tokens=True))


async def test_several_tokens_per_step_stream_read_and_attach_exactly(ngram_node: ProcessNode) -> None:
    before = accepted_tokens(ngram_node)
    request_id = uuid.uuid4().hex
    fields = {"max_tokens": 96, "temperature": 0.0, "ignore_eos": True, "request_id": request_id}
    async with Client(ngram_node.address) as client:
        got = [m async for m in client.generate(messages=REPEATING, **fields)]
        tokens = [t for m in got for t in m.token_ids]
        text = "".join(m.text for m in got)
        assert len(tokens) == 96 and got[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert accepted_tokens(ngram_node) > before, "the proposer's drafts were never accepted"
        assert max(len(m.token_ids) for m in got) >= 2, [len(m.token_ids) for m in got]
        at = 0
        for m in (m for m in got if m.token_ids):
            assert m.index == at, (m.index, at)
            at += len(m.token_ids)
        assert text == decode(ngram_node, tokens)  # what a non-streamed call returns
        # Every offset a caller can hold (a message boundary), and one inside a message of several tokens.
        ends = [sum(len(m.token_ids) for m in got[: i + 1]) for i in range(len(got))]
        inside = next(ends[i] + 1 for i, m in enumerate(got[1:]) if len(m.token_ids) >= 2)
        for offset in [0, *ends[:-1], inside]:
            attached = [m async for m in client.stub.Attach(pb.AttachRequest(request_id=request_id, offset=offset))]
            assert [t for m in attached for t in m.token_ids] == tokens[offset:], offset
            assert attached[0].index == offset and attached[-1].finish_reason == pb.FINISH_REASON_LENGTH
            if offset != inside:
                held = "".join(m.text for m, end in zip(got, ends, strict=True) if end <= offset)
                assert held + "".join(m.text for m in attached) == text, offset
