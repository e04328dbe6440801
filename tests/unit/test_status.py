from __future__ import annotations

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2

from llamamesh import errors
from services.status import INTERNAL_MESSAGE, code_for, to_status

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.InvalidRequest.field("top_p", "bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.PromptTooLong.field("prompt", "long"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.NotFound("no model"), grpc.StatusCode.NOT_FOUND),
        (errors.QueueFull("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.RateLimited("slow down"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.NoWorkers("none"), grpc.StatusCode.UNAVAILABLE),
        (errors.QueueUnavailable("down"), grpc.StatusCode.UNAVAILABLE),
        (errors.EngineDead("dead"), grpc.StatusCode.UNAVAILABLE),
        (errors.WorkerLost("lost"), grpc.StatusCode.UNAVAILABLE),
        (errors.DeadlineExceeded("late"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (errors.InternalError("secret detail"), grpc.StatusCode.INTERNAL),
        (RuntimeError("secret detail"), grpc.StatusCode.INTERNAL),
    ],
)
def test_table(exc: BaseException, code: grpc.StatusCode) -> None:
    assert code_for(exc) == code
    st = to_status(exc)
    assert st.code == code.value[0]
    if code is grpc.StatusCode.INTERNAL:
        assert st.message == INTERNAL_MESSAGE  # never str(exc) to the client


def test_invalid_request_carries_every_field_violation() -> None:
    exc = errors.InvalidRequest([errors.FieldViolation("top_p", "a"), errors.FieldViolation("stop[0]", "b")])
    st = to_status(exc)
    br = error_details_pb2.BadRequest()
    assert st.details[0].Unpack(br)
    assert [v.field for v in br.field_violations] == ["top_p", "stop[0]"]
    assert st.code == code_pb2.INVALID_ARGUMENT


def test_capacity_errors_carry_retry_info() -> None:
    st = to_status(errors.QueueFull("full", retry_after_s=2.5))
    ri = error_details_pb2.RetryInfo()
    assert st.details[0].Unpack(ri)
    assert ri.retry_delay.seconds == 2 and ri.retry_delay.nanos == 500_000_000


def test_an_unreachable_redis_says_when_to_try_again() -> None:
    st = to_status(errors.QueueUnavailable("Redis does not answer"))
    ri, info = error_details_pb2.RetryInfo(), error_details_pb2.ErrorInfo()
    assert st.code == code_pb2.UNAVAILABLE
    assert st.details[0].Unpack(ri) and ri.retry_delay.seconds == 1
    assert st.details[-1].Unpack(info) and info.reason == "QUEUE_UNAVAILABLE"


@pytest.mark.parametrize("cls", [errors.InvalidRequest, errors.NotFound, errors.EngineDead, errors.QueueFull])
def test_errors_cross_redis_as_codes(cls: type[errors.LlamameshError]) -> None:
    exc = cls.field("f", "why") if issubclass(cls, errors.InvalidRequest) else cls("why")  # type: ignore[attr-defined]
    back = errors.from_code(exc.code, exc.message, errors.field_of(exc))
    assert type(back) is cls
    assert back.message == exc.message  # "f: why", the field named once
    assert errors.from_code("no-such-code", "x").__class__ is errors.InternalError
