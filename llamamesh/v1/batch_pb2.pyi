import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from llamamesh.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BatchState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BATCH_STATE_UNSPECIFIED: _ClassVar[BatchState]
    BATCH_STATE_VALIDATING: _ClassVar[BatchState]
    BATCH_STATE_IN_PROGRESS: _ClassVar[BatchState]
    BATCH_STATE_FINALIZING: _ClassVar[BatchState]
    BATCH_STATE_COMPLETED: _ClassVar[BatchState]
    BATCH_STATE_FAILED: _ClassVar[BatchState]
    BATCH_STATE_EXPIRED: _ClassVar[BatchState]
    BATCH_STATE_CANCELLING: _ClassVar[BatchState]
    BATCH_STATE_CANCELLED: _ClassVar[BatchState]

class BatchItemStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BATCH_ITEM_STATUS_UNSPECIFIED: _ClassVar[BatchItemStatus]
    BATCH_ITEM_STATUS_SUCCEEDED: _ClassVar[BatchItemStatus]
    BATCH_ITEM_STATUS_ERRORED: _ClassVar[BatchItemStatus]
    BATCH_ITEM_STATUS_CANCELLED: _ClassVar[BatchItemStatus]
    BATCH_ITEM_STATUS_EXPIRED: _ClassVar[BatchItemStatus]
BATCH_STATE_UNSPECIFIED: BatchState
BATCH_STATE_VALIDATING: BatchState
BATCH_STATE_IN_PROGRESS: BatchState
BATCH_STATE_FINALIZING: BatchState
BATCH_STATE_COMPLETED: BatchState
BATCH_STATE_FAILED: BatchState
BATCH_STATE_EXPIRED: BatchState
BATCH_STATE_CANCELLING: BatchState
BATCH_STATE_CANCELLED: BatchState
BATCH_ITEM_STATUS_UNSPECIFIED: BatchItemStatus
BATCH_ITEM_STATUS_SUCCEEDED: BatchItemStatus
BATCH_ITEM_STATUS_ERRORED: BatchItemStatus
BATCH_ITEM_STATUS_CANCELLED: BatchItemStatus
BATCH_ITEM_STATUS_EXPIRED: BatchItemStatus

class BatchItem(_message.Message):
    __slots__ = ("custom_id", "request")
    CUSTOM_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    custom_id: str
    request: _generation_pb2.GenerateRequest
    def __init__(self, custom_id: _Optional[str] = ..., request: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ...) -> None: ...

class Summarise(_message.Message):
    __slots__ = ("template", "documents", "params")
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    template: str
    documents: _containers.RepeatedCompositeFieldContainer[Document]
    params: _generation_pb2.GenerateRequest
    def __init__(self, template: _Optional[str] = ..., documents: _Optional[_Iterable[_Union[Document, _Mapping]]] = ..., params: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ...) -> None: ...

class Document(_message.Message):
    __slots__ = ("custom_id", "text")
    CUSTOM_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    custom_id: str
    text: str
    def __init__(self, custom_id: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class BatchGenerateRequest(_message.Message):
    __slots__ = ("batch_id", "items", "summarise", "completion_window_s", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SUMMARISE_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    items: _containers.RepeatedCompositeFieldContainer[BatchItem]
    summarise: Summarise
    completion_window_s: int
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, batch_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[BatchItem, _Mapping]]] = ..., summarise: _Optional[_Union[Summarise, _Mapping]] = ..., completion_window_s: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class BatchCounts(_message.Message):
    __slots__ = ("total", "processing", "succeeded", "errored", "cancelled", "expired")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    ERRORED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    total: int
    processing: int
    succeeded: int
    errored: int
    cancelled: int
    expired: int
    def __init__(self, total: _Optional[int] = ..., processing: _Optional[int] = ..., succeeded: _Optional[int] = ..., errored: _Optional[int] = ..., cancelled: _Optional[int] = ..., expired: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("batch_id", "state", "counts", "owner", "model", "metadata", "completion_window_s", "created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at", "expires_at", "results_expire_at", "usage")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    IN_PROGRESS_AT_FIELD_NUMBER: _ClassVar[int]
    FINALIZING_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    FAILED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_AT_FIELD_NUMBER: _ClassVar[int]
    CANCELLING_AT_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    RESULTS_EXPIRE_AT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    state: BatchState
    counts: BatchCounts
    owner: str
    model: str
    metadata: _containers.ScalarMap[str, str]
    completion_window_s: int
    created_at: _timestamp_pb2.Timestamp
    in_progress_at: _timestamp_pb2.Timestamp
    finalizing_at: _timestamp_pb2.Timestamp
    completed_at: _timestamp_pb2.Timestamp
    failed_at: _timestamp_pb2.Timestamp
    expired_at: _timestamp_pb2.Timestamp
    cancelling_at: _timestamp_pb2.Timestamp
    cancelled_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    results_expire_at: _timestamp_pb2.Timestamp
    usage: BatchUsage
    def __init__(self, batch_id: _Optional[str] = ..., state: _Optional[_Union[BatchState, str]] = ..., counts: _Optional[_Union[BatchCounts, _Mapping]] = ..., owner: _Optional[str] = ..., model: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., completion_window_s: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., in_progress_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finalizing_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., completed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., failed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expired_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., cancelling_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., cancelled_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., results_expire_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., usage: _Optional[_Union[BatchUsage, _Mapping]] = ...) -> None: ...

class BatchUsage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class ListBatchesRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListBatchesResponse(_message.Message):
    __slots__ = ("batches", "next_page_token")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[Batch]
    next_page_token: str
    def __init__(self, batches: _Optional[_Iterable[_Union[Batch, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelBatchRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class StreamBatchResultsRequest(_message.Message):
    __slots__ = ("batch_id", "cursor", "follow")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    cursor: str
    follow: bool
    def __init__(self, batch_id: _Optional[str] = ..., cursor: _Optional[str] = ..., follow: _Optional[bool] = ...) -> None: ...

class BatchResult(_message.Message):
    __slots__ = ("batch_id", "custom_id", "status", "text", "finish_reason", "usage", "error_code", "error_message", "error_reason", "error_field", "cursor", "samples", "logprobs")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    custom_id: str
    status: BatchItemStatus
    text: str
    finish_reason: _generation_pb2.FinishReason
    usage: _generation_pb2.Usage
    error_code: str
    error_message: str
    error_reason: str
    error_field: str
    cursor: str
    samples: _containers.RepeatedCompositeFieldContainer[BatchSample]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, batch_id: _Optional[str] = ..., custom_id: _Optional[str] = ..., status: _Optional[_Union[BatchItemStatus, str]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., error_reason: _Optional[str] = ..., error_field: _Optional[str] = ..., cursor: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[BatchSample, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class BatchSample(_message.Message):
    __slots__ = ("text", "finish_reason", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    finish_reason: _generation_pb2.FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
