from __future__ import annotations

from types import MappingProxyType

import pytest

from llamamesh.errors import InvalidRequest
from llamamesh.queue import codec
from llamamesh.types import (
    ChatMessage,
    Failure,
    Finished,
    FinishReason,
    GenerationRequest,
    JobEvent,
    JobKind,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    Usage,
)

pytestmark = pytest.mark.timeout(10)


def test_job_round_trip_keeps_unset_distinct_from_zero() -> None:
    req = GenerationRequest(
        request_id="r1",
        model="m",
        messages=(ChatMessage("system", "be brief"), ChatMessage("user", "hi")),
        sampling=SamplingParams(
            max_tokens=5,
            temperature=0.0,
            top_k=0,
            stop=("\n",),
            stop_token_ids=(2,),
            seed=0,
            ignore_eos=False,
            logprobs=0,
        ),
        priority=3,
        metadata=MappingProxyType({"team": "a"}),
        kind=JobKind.GENERATE,
        accepted_unix_ns=123,
        resume_token_ids=(5, 0, 7),
    )
    back = codec.decode_job(codec.encode_job(req))
    assert back == req
    assert back.sampling.temperature == 0.0 and back.sampling.top_p is None


def test_samples_round_trip() -> None:
    req = GenerationRequest(
        request_id="r1~1",
        model="m",
        prompt="p",
        sampling=SamplingParams(n=3, seed=2),
        resume_samples=MappingProxyType({0: (4, 5), 2: ()}),
        origin_id="r1",
    )
    back = codec.decode_job(codec.encode_job(req))
    assert back == req and back.sampling.samples == 3
    assert codec.decode_job(codec.encode_job(GenerationRequest(request_id="x", model="m"))).sampling.n is None


def test_prompt_job_and_tokenize_kind() -> None:
    req = GenerationRequest(request_id="r2", model="m", prompt="", kind=JobKind.TOKENIZE)
    back = codec.decode_job(codec.encode_job(req))
    assert back.prompt == "" and back.messages is None and back.kind is JobKind.TOKENIZE


def test_undecodable_job_is_invalid_request() -> None:
    with pytest.raises(InvalidRequest):
        codec.decode_job(b"\xff\xff\xff")


@pytest.mark.parametrize(
    "event",
    [
        JobEvent(
            text="héllo 🌊",
            token_ids=(1, 2),
            index=7,
            logprobs=(TokenLogprob(1, -0.5, (TopLogprob(1, -0.5), TopLogprob(9, -2.0))),),
            worker="w",
        ),
        JobEvent(finished=Finished(FinishReason.STOP_SEQUENCE, Usage(10, 3), 5, 6)),
        JobEvent(failed=Failure("invalid_argument", "bad", False, "logprobs")),
        JobEvent(token_ids=(4, 5, 6), tokenized=True),
        JobEvent(text=" a", token_ids=(3,), index=2, sample=4, sample_end=FinishReason.LENGTH),
        JobEvent(sample=1, finished=Finished(FinishReason.STOP, Usage(3, 9))),
        JobEvent(worker="w", handed_back=True),
        JobEvent(worker="w", handed_back=True, engine_died=True),
    ],
)
def test_event_round_trip(event: JobEvent) -> None:
    assert codec.decode_event(codec.encode_event(event)) == event
