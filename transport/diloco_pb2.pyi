from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PullKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PULL_KIND_UNSPECIFIED: _ClassVar[PullKind]
    PULL_KIND_UPDATE: _ClassVar[PullKind]
    PULL_KIND_FULL: _ClassVar[PullKind]
PULL_KIND_UNSPECIFIED: PullKind
PULL_KIND_UPDATE: PullKind
PULL_KIND_FULL: PullKind

class TensorMeta(_message.Message):
    __slots__ = ("name", "codec", "dtype", "shape", "block_size", "zstd_level", "nbytes", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ZSTD_LEVEL_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    codec: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    zstd_level: int
    nbytes: int
    offset: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., codec: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., zstd_level: _Optional[int] = ..., nbytes: _Optional[int] = ..., offset: _Optional[_Iterable[int]] = ...) -> None: ...

class PayloadHeader(_message.Message):
    __slots__ = ("tensors", "chunk_count", "total_bytes")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    chunk_count: int
    total_bytes: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., chunk_count: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("run_id", "island", "config_digest", "last_round", "devices", "config_json", "release", "frozen_digest")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    FROZEN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island: str
    config_digest: bytes
    last_round: int
    devices: int
    config_json: str
    release: str
    frozen_digest: bytes
    def __init__(self, run_id: _Optional[str] = ..., island: _Optional[str] = ..., config_digest: _Optional[bytes] = ..., last_round: _Optional[int] = ..., devices: _Optional[int] = ..., config_json: _Optional[str] = ..., release: _Optional[str] = ..., frozen_digest: _Optional[bytes] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("run_id", "round", "lease_s", "needs_full_params", "state", "detail")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FULL_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    lease_s: float
    needs_full_params: bool
    state: str
    detail: str
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., lease_s: _Optional[float] = ..., needs_full_params: _Optional[bool] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("run_id", "island", "round", "step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island: str
    round: int
    step: int
    def __init__(self, run_id: _Optional[str] = ..., island: _Optional[str] = ..., round: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("round", "lease_s", "state")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    round: int
    lease_s: float
    state: str
    def __init__(self, round: _Optional[int] = ..., lease_s: _Optional[float] = ..., state: _Optional[str] = ...) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("run_id", "island")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island: str
    def __init__(self, run_id: _Optional[str] = ..., island: _Optional[str] = ...) -> None: ...

class AttendReply(_message.Message):
    __slots__ = ("member", "state", "reconnect_grace_s")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RECONNECT_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    member: bool
    state: str
    reconnect_grace_s: float
    def __init__(self, member: _Optional[bool] = ..., state: _Optional[str] = ..., reconnect_grace_s: _Optional[float] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("run_id", "island", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., island: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class PushMeta(_message.Message):
    __slots__ = ("run_id", "island", "round", "fragment", "tokens", "inner_steps", "base_digest", "loss", "compute_s", "wall_s", "chunks")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island: str
    round: int
    fragment: int
    tokens: int
    inner_steps: int
    base_digest: bytes
    loss: float
    compute_s: float
    wall_s: float
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkSpan]
    def __init__(self, run_id: _Optional[str] = ..., island: _Optional[str] = ..., round: _Optional[int] = ..., fragment: _Optional[int] = ..., tokens: _Optional[int] = ..., inner_steps: _Optional[int] = ..., base_digest: _Optional[bytes] = ..., loss: _Optional[float] = ..., compute_s: _Optional[float] = ..., wall_s: _Optional[float] = ..., chunks: _Optional[_Iterable[_Union[ChunkSpan, _Mapping]]] = ...) -> None: ...

class ChunkSpan(_message.Message):
    __slots__ = ("chunk", "start", "end")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    start: int
    end: int
    def __init__(self, chunk: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("run_id", "island", "round", "sequences", "source", "source_sequences")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island: str
    round: int
    sequences: int
    source: bytes
    source_sequences: int
    def __init__(self, run_id: _Optional[str] = ..., island: _Optional[str] = ..., round: _Optional[int] = ..., sequences: _Optional[int] = ..., source: _Optional[bytes] = ..., source_sequences: _Optional[int] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("spans", "round")
    SPANS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    spans: _containers.RepeatedCompositeFieldContainer[ChunkSpan]
    round: int
    def __init__(self, spans: _Optional[_Iterable[_Union[ChunkSpan, _Mapping]]] = ..., round: _Optional[int] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("index", "meta", "header", "data", "digest")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    index: int
    meta: PushMeta
    header: PayloadHeader
    data: bytes
    digest: bytes
    def __init__(self, index: _Optional[int] = ..., meta: _Optional[_Union[PushMeta, _Mapping]] = ..., header: _Optional[_Union[PayloadHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., digest: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "round", "detail", "digest")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    round: int
    detail: str
    digest: bytes
    def __init__(self, accepted: _Optional[bool] = ..., round: _Optional[int] = ..., detail: _Optional[str] = ..., digest: _Optional[bytes] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("run_id", "island", "have_round", "fragment", "full", "after_push")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    HAVE_ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    AFTER_PUSH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island: str
    have_round: int
    fragment: int
    full: bool
    after_push: bool
    def __init__(self, run_id: _Optional[str] = ..., island: _Optional[str] = ..., have_round: _Optional[int] = ..., fragment: _Optional[int] = ..., full: _Optional[bool] = ..., after_push: _Optional[bool] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("run_id", "round", "fragment", "kind", "param_digest", "payload")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    fragment: int
    kind: PullKind
    param_digest: bytes
    payload: PayloadHeader
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., fragment: _Optional[int] = ..., kind: _Optional[_Union[PullKind, str]] = ..., param_digest: _Optional[bytes] = ..., payload: _Optional[_Union[PayloadHeader, _Mapping]] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("index", "header", "data", "digest")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    index: int
    header: PullHeader
    data: bytes
    digest: bytes
    def __init__(self, index: _Optional[int] = ..., header: _Optional[_Union[PullHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., digest: _Optional[bytes] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("run_id", "island", "secret_sha256")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    SECRET_SHA256_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island: str
    secret_sha256: bytes
    def __init__(self, run_id: _Optional[str] = ..., island: _Optional[str] = ..., secret_sha256: _Optional[bytes] = ...) -> None: ...

class AdmitReply(_message.Message):
    __slots__ = ("ok", "round", "detail")
    OK_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    round: int
    detail: str
    def __init__(self, ok: _Optional[bool] = ..., round: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class RetireRequest(_message.Message):
    __slots__ = ("run_id", "island", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., island: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RetireReply(_message.Message):
    __slots__ = ("ok", "round", "detail")
    OK_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    round: int
    detail: str
    def __init__(self, ok: _Optional[bool] = ..., round: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IslandStatus(_message.Message):
    __slots__ = ("name", "round", "last_seen_s", "state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    round: int
    last_seen_s: float
    state: str
    def __init__(self, name: _Optional[str] = ..., round: _Optional[int] = ..., last_seen_s: _Optional[float] = ..., state: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("run_id", "round", "state", "islands", "detail_json")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ISLANDS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_JSON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    state: str
    islands: _containers.RepeatedCompositeFieldContainer[IslandStatus]
    detail_json: str
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., state: _Optional[str] = ..., islands: _Optional[_Iterable[_Union[IslandStatus, _Mapping]]] = ..., detail_json: _Optional[str] = ...) -> None: ...
