import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadAdapterRequest(_message.Message):
    __slots__ = ("model", "adapter", "path", "wait_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    adapter: str
    path: str
    wait_s: int
    def __init__(self, model: _Optional[str] = ..., adapter: _Optional[str] = ..., path: _Optional[str] = ..., wait_s: _Optional[int] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("workers", "pending")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedScalarFieldContainer[str]
    pending: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, workers: _Optional[_Iterable[str]] = ..., pending: _Optional[_Iterable[str]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("model", "adapter", "wait_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    adapter: str
    wait_s: int
    def __init__(self, model: _Optional[str] = ..., adapter: _Optional[str] = ..., wait_s: _Optional[int] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("pending",)
    PENDING_FIELD_NUMBER: _ClassVar[int]
    pending: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pending: _Optional[_Iterable[str]] = ...) -> None: ...

class ListBackendsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBackendsResponse(_message.Message):
    __slots__ = ("backends",)
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[Backend]
    def __init__(self, backends: _Optional[_Iterable[_Union[Backend, _Mapping]]] = ...) -> None: ...

class Backend(_message.Message):
    __slots__ = ("pool", "breaker_state", "serving", "fallback", "workers", "transitions", "probes", "last_probe_error", "queue_depth", "queue_pending", "queue_wait_s", "tokens_per_s")
    POOL_FIELD_NUMBER: _ClassVar[int]
    BREAKER_STATE_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONS_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    LAST_PROBE_ERROR_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_PENDING_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    pool: str
    breaker_state: str
    serving: bool
    fallback: str
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    transitions: _containers.RepeatedCompositeFieldContainer[BreakerTransition]
    probes: int
    last_probe_error: str
    queue_depth: int
    queue_pending: int
    queue_wait_s: float
    tokens_per_s: float
    def __init__(self, pool: _Optional[str] = ..., breaker_state: _Optional[str] = ..., serving: _Optional[bool] = ..., fallback: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., transitions: _Optional[_Iterable[_Union[BreakerTransition, _Mapping]]] = ..., probes: _Optional[int] = ..., last_probe_error: _Optional[str] = ..., queue_depth: _Optional[int] = ..., queue_pending: _Optional[int] = ..., queue_wait_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("name", "adapters", "adapter_errors", "model", "engine", "inflight", "max_inflight", "running", "waiting", "kv_cache_usage", "state", "detail", "since")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ERRORS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    adapter_errors: _containers.RepeatedScalarFieldContainer[str]
    model: str
    engine: str
    inflight: int
    max_inflight: int
    running: int
    waiting: int
    kv_cache_usage: float
    state: str
    detail: str
    since: _timestamp_pb2.Timestamp
    def __init__(self, name: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ..., adapter_errors: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., inflight: _Optional[int] = ..., max_inflight: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class BreakerTransition(_message.Message):
    __slots__ = ("at", "from_state", "to_state", "reason")
    AT_FIELD_NUMBER: _ClassVar[int]
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    at: _timestamp_pb2.Timestamp
    from_state: str
    to_state: str
    reason: str
    def __init__(self, at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., from_state: _Optional[str] = ..., to_state: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
