"""What a gateway's error status says beyond its code: the fields an INVALID_ARGUMENT named, and the
reason of llamamesh's own ``google.rpc.ErrorInfo``."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from llamamesh.errors import ERROR_DOMAIN


def field_violations(err: grpc.RpcError) -> list[str]:
    """The field names of a BadRequest detail in an error status (empty if none)."""
    st = rpc_status.from_call(err)
    out: list[str] = []
    for d in st.details if st is not None else ():
        br = error_details_pb2.BadRequest()
        if d.Unpack(br):
            out.extend(v.field for v in br.field_violations)
    return out


def error_reason(err: grpc.RpcError) -> str:
    """The reason of the gateway's ``google.rpc.ErrorInfo`` in an error status ("" if none: the
    status is not llamamesh's own, e.g. a broken connection)."""
    st = rpc_status.from_call(err)
    for d in st.details if st is not None else ():
        info = error_details_pb2.ErrorInfo()
        if d.Unpack(info) and info.domain == ERROR_DOMAIN:
            return str(info.reason)
    return ""
