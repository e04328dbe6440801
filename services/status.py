"""The one table from domain errors to gRPC status codes and rich details.

Clients get the domain message for client, capacity and availability errors;
anything else becomes INTERNAL with a fixed message (the details go to logs).
"""

from __future__ import annotations

import math

import grpc
import structlog
from google.protobuf.duration_pb2 import Duration
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from llamamesh import errors

log = structlog.get_logger(__name__)

# Most specific class first.
TABLE: list[tuple[type[errors.LlamameshError], grpc.StatusCode]] = [
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.QueueOutOfMemory, grpc.StatusCode.RESOURCE_EXHAUSTED),  # before Unavailable, its base
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
]

INTERNAL_MESSAGE = "internal error"


def code_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in TABLE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def to_status(exc: BaseException) -> status_pb2.Status:
    """The google.rpc.Status for an exception: code, safe message, and details."""
    code = code_for(exc)
    if isinstance(exc, errors.SetAside):  # INTERNAL, with our own message: what happened to it
        log.error("request_set_aside", error=str(exc))
        return status_pb2.Status(code=code_pb2.INTERNAL, message=exc.message)
    if code is grpc.StatusCode.INTERNAL or not isinstance(exc, errors.LlamameshError):
        log.error("internal_error", error_type=type(exc).__name__, error=str(exc), exc_info=exc)
        return status_pb2.Status(code=code_pb2.INTERNAL, message=INTERNAL_MESSAGE)
    st = status_pb2.Status(code=code.value[0], message=exc.message)
    if isinstance(exc, errors.InvalidRequest):
        br = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in exc.violations
            ]
        )
        st.details.add().Pack(br)
    if isinstance(exc, errors.CapacityError | errors.QueueUnavailable):
        secs = max(exc.retry_after_s, 0.0)
        delay = Duration(seconds=int(secs), nanos=int((secs - math.floor(secs)) * 1e9))
        st.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    # Last, so that the first detail stays the one callers know (BadRequest, RetryInfo).
    st.details.add().Pack(error_details_pb2.ErrorInfo(reason=exc.code.upper(), domain=errors.ERROR_DOMAIN))
    return st


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status for ``exc`` (raises, as context.abort does)."""
    await context.abort_with_status(rpc_status.to_status(to_status(exc)))
