from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("max_tokens", "text_content", "token_content", "metadata", "num_samples", "lora_adapter_id", "has_bos", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "logit_bias", "json_schema", "json_object", "regex", "choice", "grammar")
    class TextContent(_message.Message):
        __slots__ = ("text",)
        TEXT_FIELD_NUMBER: _ClassVar[int]
        text: str
        def __init__(self, text: _Optional[str] = ...) -> None: ...
    class TokenContent(_message.Message):
        __slots__ = ("token_ids",)
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
    class Metadata(_message.Message):
        __slots__ = ("start_time",)
        START_TIME_FIELD_NUMBER: _ClassVar[int]
        start_time: float
        def __init__(self, start_time: _Optional[float] = ...) -> None: ...
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class Choices(_message.Message):
        __slots__ = ("choices",)
        CHOICES_FIELD_NUMBER: _ClassVar[int]
        choices: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CONTENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_BOS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    text_content: DecodeRequest.TextContent
    token_content: DecodeRequest.TokenContent
    metadata: DecodeRequest.Metadata
    num_samples: int
    lora_adapter_id: str
    has_bos: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    json_schema: str
    json_object: bool
    regex: str
    choice: DecodeRequest.Choices
    grammar: str
    def __init__(self, max_tokens: _Optional[int] = ..., text_content: _Optional[_Union[DecodeRequest.TextContent, _Mapping]] = ..., token_content: _Optional[_Union[DecodeRequest.TokenContent, _Mapping]] = ..., metadata: _Optional[_Union[DecodeRequest.Metadata, _Mapping]] = ..., num_samples: _Optional[int] = ..., lora_adapter_id: _Optional[str] = ..., has_bos: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[DecodeRequest.Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("initial_content", "stream_content")
    class InitialContent(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class StreamContent(_message.Message):
        __slots__ = ("samples",)
        class Sample(_message.Message):
            __slots__ = ("text", "token_ids", "logprobs", "top_logprobs", "finish_reason")
            class TopLogprob(_message.Message):
                __slots__ = ("token_id", "logprob")
                TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
                LOGPROB_FIELD_NUMBER: _ClassVar[int]
                token_id: int
                logprob: float
                def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...
            class TopLogprobs(_message.Message):
                __slots__ = ("alternatives",)
                ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
                alternatives: _containers.RepeatedCompositeFieldContainer[DecodeResponse.StreamContent.Sample.TopLogprob]
                def __init__(self, alternatives: _Optional[_Iterable[_Union[DecodeResponse.StreamContent.Sample.TopLogprob, _Mapping]]] = ...) -> None: ...
            TEXT_FIELD_NUMBER: _ClassVar[int]
            TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
            LOGPROBS_FIELD_NUMBER: _ClassVar[int]
            TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
            FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
            text: str
            token_ids: _containers.RepeatedScalarFieldContainer[int]
            logprobs: _containers.RepeatedScalarFieldContainer[float]
            top_logprobs: _containers.RepeatedCompositeFieldContainer[DecodeResponse.StreamContent.Sample.TopLogprobs]
            finish_reason: str
            def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[DecodeResponse.StreamContent.Sample.TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ...) -> None: ...
        SAMPLES_FIELD_NUMBER: _ClassVar[int]
        samples: _containers.RepeatedCompositeFieldContainer[DecodeResponse.StreamContent.Sample]
        def __init__(self, samples: _Optional[_Iterable[_Union[DecodeResponse.StreamContent.Sample, _Mapping]]] = ...) -> None: ...
    INITIAL_CONTENT_FIELD_NUMBER: _ClassVar[int]
    STREAM_CONTENT_FIELD_NUMBER: _ClassVar[int]
    initial_content: DecodeResponse.InitialContent
    stream_content: DecodeResponse.StreamContent
    def __init__(self, initial_content: _Optional[_Union[DecodeResponse.InitialContent, _Mapping]] = ..., stream_content: _Optional[_Union[DecodeResponse.StreamContent, _Mapping]] = ...) -> None: ...

class HealthCheckRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthCheckResponse(_message.Message):
    __slots__ = ("is_live",)
    IS_LIVE_FIELD_NUMBER: _ClassVar[int]
    is_live: bool
    def __init__(self, is_live: _Optional[bool] = ...) -> None: ...
