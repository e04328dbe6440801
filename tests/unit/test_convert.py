from __future__ import annotations

import pytest

from llamamesh.errors import InvalidRequest, NotFound
from llamamesh.settings import GatewaySettings
from llamamesh.types import Finished, FinishReason, GenerationRequest, JobEvent, Usage
from llamamesh.v1 import generation_pb2 as pb
from services import convert

pytestmark = pytest.mark.timeout(10)

S = GatewaySettings(max_tokens_cap=100, default_max_tokens=20, models="m1=cpu,m2=gpu")
MODELS = S.model_table()


def test_valid_request_converts_with_defaults_and_unset_fields() -> None:
    req, model = convert.generate_request(
        pb.GenerateRequest(prompt="hi", temperature=0.0, metadata={"k": "v"}), S, MODELS
    )
    assert model.id == "m1" and model.pool == "cpu"
    assert req.prompt == "hi" and req.messages is None
    assert req.sampling.max_tokens == 20  # the gateway default
    assert req.sampling.temperature == 0.0  # set to zero, not "unset"
    assert req.sampling.top_p is None
    assert dict(req.metadata) == {"k": "v"}
    assert len(req.request_id) == 32 and req.accepted_unix_ns > 0


def test_all_violations_are_reported_at_once() -> None:
    with pytest.raises(InvalidRequest) as ei:
        convert.generate_request(pb.GenerateRequest(prompt="x", top_p=2, top_k=-9, stop=[""]), S, MODELS)
    assert [v.field for v in ei.value.violations] == ["top_p", "top_k", "stop[0]"]


def test_model_resolution() -> None:
    _req, model = convert.generate_request(pb.GenerateRequest(prompt="x", model="m2"), S, MODELS)
    assert model.pool == "gpu"
    with pytest.raises(NotFound):
        convert.generate_request(pb.GenerateRequest(prompt="x", model="m3"), S, MODELS)


def test_final_response_carries_usage_timings_and_finish() -> None:
    req = GenerationRequest(request_id="r", model="m1", prompt="x", accepted_unix_ns=1_000)
    ev = JobEvent(
        text="!",
        token_ids=(9,),
        index=4,
        finished=Finished(FinishReason.STOP_SEQUENCE, Usage(3, 5), started_unix_ns=2_000, first_token_unix_ns=5_000),
    )
    msg = convert.generate_response(req, ev, now_ns=9_000)
    assert msg.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens) == (3, 5)
    assert msg.timings.queue_wait.ToNanoseconds() == 1_000
    assert msg.timings.time_to_first_token.ToNanoseconds() == 4_000
    assert msg.timings.total.ToNanoseconds() == 8_000
    assert (msg.text, list(msg.token_ids), msg.index, msg.request_id) == ("!", [9], 4, "r")


def test_intermediate_response_has_no_finish() -> None:
    req = GenerationRequest(request_id="r", model="m1", prompt="x")
    msg = convert.generate_response(req, JobEvent(text="a", token_ids=(1,)))
    assert msg.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not msg.HasField("usage")
