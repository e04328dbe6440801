import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    mode: str
    function: str
    def __init__(self, mode: _Optional[str] = ..., function: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "seed", "ignore_eos", "min_tokens", "logprobs", "response_format", "n", "adapter", "priority", "resumable", "metadata", "prefix_key", "tools", "tool_choice", "parallel_tool_calls")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEY_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    ignore_eos: bool
    min_tokens: int
    logprobs: int
    response_format: ResponseFormat
    n: int
    adapter: str
    priority: int
    resumable: bool
    metadata: _containers.ScalarMap[str, str]
    prefix_key: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., n: _Optional[int] = ..., adapter: _Optional[str] = ..., priority: _Optional[int] = ..., resumable: _Optional[bool] = ..., metadata: _Optional[_Mapping[str, str]] = ..., prefix_key: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choice
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choice, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_wait", "time_to_first_token", "total")
    QUEUE_WAIT_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    queue_wait: _duration_pb2.Duration
    time_to_first_token: _duration_pb2.Duration
    total: _duration_pb2.Duration
    def __init__(self, queue_wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_first_token: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., total: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "index", "logprobs", "finish_reason", "usage", "timings", "model", "sample", "tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    model: str
    sample: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., model: _Optional[str] = ..., sample: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("request_id", "offset", "sample_offsets")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    offset: int
    sample_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., offset: _Optional[int] = ..., sample_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Model(_message.Message):
    __slots__ = ("id", "pool", "default", "base", "adapter")
    ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    id: str
    pool: str
    default: bool
    base: str
    adapter: str
    def __init__(self, id: _Optional[str] = ..., pool: _Optional[str] = ..., default: _Optional[bool] = ..., base: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "prompt", "messages")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "count", "model")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    count: int
    model: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...
