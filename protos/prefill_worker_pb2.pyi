from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling_json", "receiver_devices", "token_mask", "prompt_logprobs", "top_logprobs", "score_only", "lora_adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_JSON_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_DEVICES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SCORE_ONLY_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_json: str
    receiver_devices: int
    token_mask: bytes
    prompt_logprobs: bool
    top_logprobs: int
    score_only: bool
    lora_adapter: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling_json: _Optional[str] = ..., receiver_devices: _Optional[int] = ..., token_mask: _Optional[bytes] = ..., prompt_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., score_only: _Optional[bool] = ..., lora_adapter: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_row", "first_columns", "transfer_address", "uuid", "prefix_json", "queue_depth", "prompt_logprobs_json")
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    FIRST_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_JSON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_JSON_FIELD_NUMBER: _ClassVar[int]
    first_row: bytes
    first_columns: int
    transfer_address: str
    uuid: int
    prefix_json: str
    queue_depth: int
    prompt_logprobs_json: str
    def __init__(self, first_row: _Optional[bytes] = ..., first_columns: _Optional[int] = ..., transfer_address: _Optional[str] = ..., uuid: _Optional[int] = ..., prefix_json: _Optional[str] = ..., queue_depth: _Optional[int] = ..., prompt_logprobs_json: _Optional[str] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("uuid",)
    UUID_FIELD_NUMBER: _ClassVar[int]
    uuid: int
    def __init__(self, uuid: _Optional[int] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("freed",)
    FREED_FIELD_NUMBER: _ClassVar[int]
    freed: bool
    def __init__(self, freed: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("role", "queue_depth", "registered", "ready", "signature_json", "max_prefill_length", "max_seq_len", "prefills", "prefix_cache_queries", "prefix_cache_hits")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    role: str
    queue_depth: int
    registered: int
    ready: bool
    signature_json: str
    max_prefill_length: int
    max_seq_len: int
    prefills: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, role: _Optional[str] = ..., queue_depth: _Optional[int] = ..., registered: _Optional[int] = ..., ready: _Optional[bool] = ..., signature_json: _Optional[str] = ..., max_prefill_length: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., prefills: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...
