"""Property-based fuzz of every RPC the gateway serves, against real processes (redis-server, a
gateway process, one worker on the fake engine): requests drawn from the message descriptors (every
field, odd strings, integer extremes, nan/inf/-0.0, repeated fields, maps, nested messages,
presence), and raw garbage bytes sent to each method's path.

The properties: no call ends INTERNAL or UNKNOWN (a bug's status: every client mistake has its own
code), nor UNAVAILABLE (Redis and the worker are up all along: a request that gets it was taken for
an outage), every call ends within its deadline, and afterwards both processes still run and a plain
Generate still works. Hypothesis is derandomized and keeps no example database, so a run is the
same everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
import pytest
from google.protobuf import text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamamesh.v1 import admin_pb2, batch_pb2, generation_pb2
from tests.e2e.conftest import ProcessNode, e2e_redis  # noqa: F401  (the session's redis-server)
from tests.redisproc import RedisProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "smollm2-135m-instruct"
DEADLINE_S = 5.0
# A stream is read this far, then cancelled: what it does after is not this test's concern.
STREAM_READS = 4
EXAMPLES = 150
GARBAGE_EXAMPLES = 60
# Statuses that mean a bug: anything a client can send has its own code, and nothing here is down.
BUGS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE}


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

SERVICES = [
    f.DESCRIPTOR.services_by_name[name]
    for f, name in (
        (generation_pb2, "GenerationService"),
        (batch_pb2, "BatchService"),
        (admin_pb2, "AdminService"),
    )
]
METHODS: list[MethodDescriptor] = [m for s in SERVICES for m in s.methods]


def path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


# ---- the gateway under test ----------------------------------------------------------------------


@dataclass
class Target:
    node: ProcessNode
    channel: grpc.Channel
    request_id: str  # a finished Generate's id
    batch_id: str  # a batch that exists


@pytest.fixture(scope="module")
def target(e2e_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:  # noqa: F811
    workdir: Path = tmp_path_factory.mktemp("fuzz-node")
    node = ProcessNode(
        workdir,
        e2e_redis,
        engine="fake",
        extra_env={
            # Short outputs, at once: accepted requests and batch items end immediately.
            "LLAMAMESH_GATEWAY_MAX_TOKENS_CAP": "16",
            "LLAMAMESH_GATEWAY_DEFAULT_MAX_TOKENS": "4",
            "LLAMAMESH_GATEWAY_NO_WORKER_WAIT_S": "2",
            "LLAMAMESH_WORKER_FAKE_STEP_S": "0",
            "LLAMAMESH_WORKER_MAX_INFLIGHT": "64",
            # Adapter loads are seen in heartbeats: LoadAdapter/UnloadAdapter answer within one.
            "LLAMAMESH_WORKER_HEARTBEAT_S": "0.2",
        },
    )
    node.start(timeout_s=60)
    channel = grpc.insecure_channel(node.address)
    try:
        request_id = plain_generate(channel)
        batch = call_unary(
            channel,
            "BatchService",
            "BatchGenerate",
            batch_pb2.BatchGenerateRequest(
                batch_id="fuzz-known",
                items=[batch_pb2.BatchItem(custom_id="a", request=generation_pb2.GenerateRequest(prompt="hi"))],
            ),
        )
        yield Target(node, channel, request_id, batch.batch_id)
    finally:
        channel.close()
        node.stop()


def method_of(service: str, name: str) -> MethodDescriptor:
    return next(m for m in METHODS if m.containing_service.name == service and m.name == name)


def call_unary(channel: grpc.Channel, service: str, name: str, request: Message) -> Any:
    m = method_of(service, name)
    stub = channel.unary_unary(
        path(m),
        request_serializer=type(request).SerializeToString,
        response_deserializer=GetMessageClass(m.output_type).FromString,
    )
    return stub(request, timeout=DEADLINE_S)


def plain_generate(channel: grpc.Channel) -> str:
    """A normal Generate to its end; returns its request id."""
    m = method_of("GenerationService", "Generate")
    stub = channel.unary_stream(
        path(m),
        request_serializer=generation_pb2.GenerateRequest.SerializeToString,
        response_deserializer=generation_pb2.GenerateResponse.FromString,
    )
    call = stub(generation_pb2.GenerateRequest(model=MODEL, prompt="hello", max_tokens=4), timeout=30)
    out = list(call)
    assert out and out[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH, out
    assert sum(len(r.token_ids) for r in out) == 4
    return str(dict(call.initial_metadata())["x-request-id"])


# ---- requests from the descriptors ---------------------------------------------------------------

INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
ODD_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -1.0, 0.5, 2.0, 1e-45, 3.4e38, -3.4e38]
ODD_DOUBLES = [*ODD_FLOATS, 5e-324, 1.7976931348623157e308, -1.7976931348623157e308]
ODD_STRINGS = [
    "", " ", "\n", "\x00", "\x00" * 64, "a\x00b", "\t\r\n\x0b\x0c", "\x7f\x1b[31m", "\u202e\u200b\ufeff",
    "😀" * 20, "\U0010ffff\ud7ff\ue000", "\uff41\uff42\uff43", "é" * 100, "null", "None", "-1", "NaN", "0", "true",
    "{document}", "{document}{document}", "{", "}", "{0}", "%s%n%x", "${jndi:x}", "'; DROP TABLE x; --",
    "../../../../etc/passwd", "*", "?", "[", "\\", "/", ":", "{b:x}", "user", "assistant", "system", "tool",
    MODEL, "0-0", "1-0", "0", "18446744073709551615-18446744073709551615", "99999999999999999999-0",
    "x" * 1000, "y" * 70_000,
]  # fmt: skip


def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (lo, lo + 1, -1, 0, 1, 2, 255, 2**31 - 1, 2**32 - 1, hi - 1, hi) if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def floats(width: Literal[32, 64]) -> st.SearchStrategy[float]:
    odd = ODD_FLOATS if width == 32 else ODD_DOUBLES
    return st.one_of(st.sampled_from(odd), st.floats(width=width))


# How hostile the values are: "odd" (extremes and junk everywhere), "plain" (values a client would
# send, so requests get past validation into the queue and the workers), "mixed" (plain, with an
# odd one here and there).
Mode = str


def scalar(field: FieldDescriptor, ids: list[str], mode: Mode) -> st.SearchStrategy[Any]:
    if mode == "mixed":
        plain = scalar(field, ids, "plain")
        return st.one_of(plain, plain, plain, plain, plain, plain, plain, scalar(field, ids, "odd"))
    if mode == "plain":
        return plain_scalar(field, ids)
    t = field.type
    if t in INT_RANGES:
        return ints(*INT_RANGES[t])
    if t == FieldDescriptor.TYPE_FLOAT:
        return floats(32)
    if t == FieldDescriptor.TYPE_DOUBLE:
        return floats(64)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(
            st.sampled_from(ODD_STRINGS + ids),
            st.text(st.characters(exclude_categories=["Cs"]), max_size=40),  # surrogate-free
        )
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_ENUM:  # open enums: unknown numbers too
        assert field.enum_type is not None
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), ints(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for {field.full_name} (type {t})")


def plain_scalar(field: FieldDescriptor, ids: list[str]) -> st.SearchStrategy[Any]:
    t = field.type
    if t in INT_RANGES:
        return st.integers(0, 20)
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0, 1.5])
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        words = st.text(st.characters(min_codepoint=ord("a"), max_codepoint=ord("z")), min_size=1, max_size=12)
        return st.one_of(st.sampled_from(["", MODEL, "user", "assistant", "hello there", "{document}", *ids]), words)
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=8)
    if t == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        return st.sampled_from([v.number for v in field.enum_type.values])
    raise TypeError(f"no strategy for {field.full_name} (type {t})")


def is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def value(field: FieldDescriptor, ids: list[str], mode: Mode, depth: int) -> st.SearchStrategy[Any]:
    """One value of a singular field (a message: a built message)."""
    if field.message_type is not None:
        return messages(field.message_type, ids, mode, depth + 1)
    return scalar(field, ids, mode)


def field_strategy(field: FieldDescriptor, ids: list[str], mode: Mode, depth: int) -> st.SearchStrategy[Any]:
    if is_map(field):
        assert field.message_type is not None
        key, val = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(scalar(key, ids, mode), value(val, ids, mode, depth), max_size=4)
    if field.is_repeated:
        return st.lists(value(field, ids, mode, depth), max_size=5)
    return value(field, ids, mode, depth)


def build(descriptor: Descriptor, values: dict[str, Any]) -> Message:
    msg = GetMessageClass(descriptor)()
    for name, v in values.items():
        field = descriptor.fields_by_name[name]
        target: Any = getattr(msg, name)
        if field.message_type is not None and is_map(field):
            for k, item in v.items():
                if field.message_type.fields_by_name["value"].message_type is not None:
                    target[k].CopyFrom(item)
                else:
                    target[k] = item
        elif field.is_repeated and field.message_type is not None:
            for item in v:
                target.add().CopyFrom(item)
        elif field.is_repeated:
            target.extend(v)
        elif field.message_type is not None:
            target.CopyFrom(v)
        else:
            setattr(msg, name, v)
    return msg


def requests(descriptor: Descriptor, ids: list[str], bases: list[Message]) -> st.SearchStrategy[Message]:
    """Requests of every kind of hostility (``Mode``), and valid ones with a field or two changed
    (most random requests stop at validation; these get into the queue and the workers)."""
    drawn = [messages(descriptor, ids, mode) for mode in ("plain", "mixed", "odd")]
    return st.one_of(mutants(descriptor, ids, bases), mutants(descriptor, ids, bases), *drawn)


def mutants(descriptor: Descriptor, ids: list[str], bases: list[Message]) -> st.SearchStrategy[Message]:
    """One of ``bases`` with up to two of its fields replaced by a plain or an odd value."""
    fields = {f.name: f for f in descriptor.fields}
    if not fields:
        return st.sampled_from(bases)

    def mutate(base: Message, changes: dict[str, Any]) -> Message:
        msg = type(base)()
        msg.CopyFrom(base)
        for name, v in changes.items():
            msg.ClearField(name)
            msg.MergeFrom(build(descriptor, {name: v}))
        return msg

    def changed(names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
        return st.fixed_dictionaries(
            {
                n: st.one_of(field_strategy(fields[n], ids, "plain", 0), field_strategy(fields[n], ids, "odd", 0))
                for n in names
            }
        )

    chosen = st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)
    return st.builds(mutate, st.sampled_from(bases), chosen.flatmap(changed))


def valid_requests(request_id: str, batch_id: str) -> dict[str, list[Message]]:
    """Valid requests of each input type, by its full name."""
    g, b = generation_pb2, batch_pb2
    chat = [g.ChatMessage(role="system", content="be brief"), g.ChatMessage(role="user", content="hi")]
    return {
        "llamamesh.v1.GenerateRequest": [
            g.GenerateRequest(model=MODEL, prompt="hello", max_tokens=4),
            g.GenerateRequest(
                messages=chat,
                max_tokens=3,
                temperature=0.5,
                top_p=0.9,
                stop=["w1"],
                seed=7,
                logprobs=2,
                metadata={"k": "v"},
            ),
            g.GenerateRequest(prompt="again", resumable=True, min_tokens=1, ignore_eos=True, stop_token_ids=[5]),
        ],
        "llamamesh.v1.AttachRequest": [
            g.AttachRequest(request_id=request_id),
            g.AttachRequest(request_id=request_id, offset=2),
        ],
        "llamamesh.v1.CancelRequest": [g.CancelRequest(request_id=request_id)],
        "llamamesh.v1.ListModelsRequest": [g.ListModelsRequest()],
        "llamamesh.v1.TokenizeRequest": [
            g.TokenizeRequest(model=MODEL, prompt="hello"),
            g.TokenizeRequest(messages=chat),
        ],
        "llamamesh.v1.BatchGenerateRequest": [
            b.BatchGenerateRequest(
                items=[
                    b.BatchItem(custom_id="a", request=g.GenerateRequest(prompt="hi", max_tokens=2)),
                    b.BatchItem(custom_id="b", request=g.GenerateRequest(messages=chat)),
                ],
                metadata={"k": "v"},
            ),
            b.BatchGenerateRequest(
                summarise=b.Summarise(documents=[b.Document(custom_id="d", text="some text")]), completion_window_s=60
            ),
        ],
        "llamamesh.v1.GetBatchRequest": [b.GetBatchRequest(batch_id=batch_id)],
        "llamamesh.v1.ListBatchesRequest": [b.ListBatchesRequest(page_size=2), b.ListBatchesRequest()],
        "llamamesh.v1.CancelBatchRequest": [b.CancelBatchRequest(batch_id=batch_id)],
        "llamamesh.v1.StreamBatchResultsRequest": [
            b.StreamBatchResultsRequest(batch_id=batch_id),
            b.StreamBatchResultsRequest(batch_id=batch_id, cursor="0-0", follow=False),
        ],
        "llamamesh.v1.ListBackendsRequest": [admin_pb2.ListBackendsRequest()],
        "llamamesh.v1.LoadAdapterRequest": [
            admin_pb2.LoadAdapterRequest(adapter="fuzz", path="/adapters/fuzz", wait_s=2),
            admin_pb2.LoadAdapterRequest(model=MODEL, adapter="fuzz-missing", path="missing/x"),
        ],
        "llamamesh.v1.UnloadAdapterRequest": [admin_pb2.UnloadAdapterRequest(adapter="fuzz")],
    }


def messages(descriptor: Descriptor, ids: list[str], mode: Mode, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``: each field set or left out (presence too), at most one field of
    a real oneof, nested messages down to a few levels."""
    if depth > 4:
        return st.just(GetMessageClass(descriptor)())
    real_oneofs = [o for o in descriptor.oneofs if not (len(o.fields) == 1 and o.name.startswith("_"))]
    in_oneof = {f.name for o in real_oneofs for f in o.fields}
    optional = {f.name: field_strategy(f, ids, mode, depth) for f in descriptor.fields if f.name not in in_oneof}
    parts: list[st.SearchStrategy[dict[str, Any]]] = [st.fixed_dictionaries({}, optional=optional)]
    for o in real_oneofs:  # one of its fields, or none
        choices = [st.fixed_dictionaries({f.name: field_strategy(f, ids, mode, depth)}) for f in o.fields]
        parts.append(st.one_of(st.just({}), *choices))
    return st.tuples(*parts).map(lambda ds: build(descriptor, {k: v for d in ds for k, v in d.items()}))


# ---- calls ---------------------------------------------------------------------------------------


def shown(request: Message | bytes) -> str:
    text = repr(request) if isinstance(request, bytes) else text_format.MessageToString(request, as_utf8=True)
    return text if len(text) <= 2000 else f"{text[:2000]}... ({len(text)} characters)"


def invoke(channel: grpc.Channel, method: MethodDescriptor, request: Message | bytes) -> grpc.StatusCode:
    """Send ``request`` (raw bytes: through a method without serializers) and read a stream at most
    ``STREAM_READS`` deep; returns how the call ended (OK, or cancelled by us: OK)."""
    ser: Callable[[Any], bytes] | None = None
    de: Callable[[bytes], Any] | None = None
    if isinstance(request, Message):
        ser, de = type(request).SerializeToString, GetMessageClass(method.output_type).FromString
    failed: tuple[grpc.StatusCode, str] | None = None
    try:
        if method.server_streaming:
            call = channel.unary_stream(path(method), request_serializer=ser, response_deserializer=de)(
                request, timeout=DEADLINE_S
            )
            for i, _msg in enumerate(call):
                if i + 1 >= STREAM_READS:
                    call.cancel()
                    break
        else:
            channel.unary_unary(path(method), request_serializer=ser, response_deserializer=de)(
                request, timeout=DEADLINE_S
            )
    except grpc.RpcError as exc:
        failed = exc.code(), exc.details()  # type: ignore[attr-defined]  # the error raised is also a grpc.Call
    if failed is None or (failed[0] is grpc.StatusCode.CANCELLED and method.server_streaming):
        return grpc.StatusCode.OK  # (cancelled: by us)
    code, details = failed
    assert code not in BUGS, f"{path(method)} ended {code.name} ({details}) for:\n{shown(request)}"
    assert code is not grpc.StatusCode.DEADLINE_EXCEEDED, f"{path(method)} took over {DEADLINE_S} s: {shown(request)}"
    return code


# Byte strings that are not messages, or are near ones: truncated, wrong wire types, lengths past
# the end, deep nesting, invalid UTF-8 in a string field, unknown fields, huge varints.
GARBAGE = [
    b"\xff" * 16,
    b"\x0a",  # field 1, length-delimited, no length
    b"\x0a\xff\xff\xff\xff\x0f",  # a length far past the end
    b"\x0a\x02\xc3\x28",  # field 1 (a string) holding invalid UTF-8
    b"\x12\x03\xed\xa0\x80",  # field 2 holding an encoded surrogate
    b"\x08" + b"\xff" * 10 + b"\x01",  # a varint past 64 bits
    b"\x0b\x0c",  # a group where none is declared
    b"\x0f",  # wire type 7
    b"\x00",  # field number 0
    b"\xf8\xff\xff\xff\x0f\x01",  # the largest field number
    b"\x1a" + b"\x80\x80\x04" + b"\x1a\xfd\xff\x03" * 2,  # nested lengths that disagree
    b"\x12\x7f" + b"\x12\x7d" * 64,  # deep nesting
    b"\x2a" * 10_000,
    b"",
]


# ---- the properties ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS, ids=[path(m) for m in METHODS])
def test_fuzzed_requests_never_end_internal(target: Target, method: MethodDescriptor) -> None:
    seen: dict[str, int] = {}
    ids = [target.request_id, target.batch_id]
    bases = valid_requests(*ids)[method.input_type.full_name]

    @FUZZ
    @given(request=requests(method.input_type, ids, bases))
    def run(request: Message) -> None:
        code = invoke(target.channel, method, request)
        seen[code.name] = seen.get(code.name, 0) + 1

    run()
    print(f"{path(method)}: {seen}")
    assert target.node.procs["gateway"].poll() is None and target.node.procs["worker"].poll() is None


@pytest.mark.parametrize("method", METHODS, ids=[path(m) for m in METHODS])
def test_garbage_bytes_never_end_internal(target: Target, method: MethodDescriptor) -> None:
    seen: dict[str, int] = {}

    @settings(FUZZ, max_examples=GARBAGE_EXAMPLES)
    @given(request=st.one_of(st.sampled_from(GARBAGE), st.binary(max_size=512)))
    def run(request: bytes) -> None:
        code = invoke(target.channel, method, request)
        seen[code.name] = seen.get(code.name, 0) + 1

    run()
    print(f"{path(method)} (bytes): {seen}")


@pytest.mark.parametrize("token", ["nan", "NaN", "-nan", "inf", " nan "])
def test_found_by_the_fuzz_a_non_finite_page_token_is_invalid_argument(target: Target, token: str) -> None:
    """The fuzz found ListBatches(page_token="nan") ending UNAVAILABLE (float() takes it, Redis
    does not): now INVALID_ARGUMENT."""
    code = grpc.StatusCode.OK
    try:
        call_unary(target.channel, "BatchService", "ListBatches", batch_pb2.ListBatchesRequest(page_token=token))
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]  # the error raised is also a grpc.Call
    assert code is grpc.StatusCode.INVALID_ARGUMENT


def test_the_gateway_and_worker_survive_and_serve(target: Target) -> None:
    for name, proc in target.node.procs.items():
        assert proc.poll() is None, f"{name} exited ({proc.returncode}):\n{target.node.log(name)[-3000:]}"
    plain_generate(target.channel)
    assert "Traceback" not in target.node.log("gateway"), target.node.log("gateway")[-5000:]
