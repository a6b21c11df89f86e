from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoginRequest(_message.Message):
    __slots__ = ("user", "password", "level")
    USER_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    user: str
    password: str
    level: str
    def __init__(self, user: _Optional[str] = ..., password: _Optional[str] = ..., level: _Optional[str] = ...) -> None: ...

class LoginReply(_message.Message):
    __slots__ = ("token", "level", "master_level", "roles")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MASTER_LEVEL_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    token: str
    level: str
    master_level: str
    roles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token: _Optional[str] = ..., level: _Optional[str] = ..., master_level: _Optional[str] = ..., roles: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("queries",)
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, queries: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisteredQuery(_message.Message):
    __slots__ = ("query_id", "rewritten", "r2s", "columns")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    REWRITTEN_FIELD_NUMBER: _ClassVar[int]
    R2S_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    rewritten: str
    r2s: str
    columns: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, query_id: _Optional[str] = ..., rewritten: _Optional[str] = ..., r2s: _Optional[str] = ..., columns: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("queries",)
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedCompositeFieldContainer[RegisteredQuery]
    def __init__(self, queries: _Optional[_Iterable[_Union[RegisteredQuery, _Mapping]]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("query_ids", "resume_after_ts")
    QUERY_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_AFTER_TS_FIELD_NUMBER: _ClassVar[int]
    query_ids: _containers.RepeatedScalarFieldContainer[str]
    resume_after_ts: int
    def __init__(self, query_ids: _Optional[_Iterable[str]] = ..., resume_after_ts: _Optional[int] = ...) -> None: ...

class ResultBatch(_message.Message):
    __slots__ = ("query_id", "first_ts", "last_ts", "arrow", "end", "error", "state")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TS_FIELD_NUMBER: _ClassVar[int]
    LAST_TS_FIELD_NUMBER: _ClassVar[int]
    ARROW_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    first_ts: int
    last_ts: int
    arrow: bytes
    end: bool
    error: str
    state: str
    def __init__(self, query_id: _Optional[str] = ..., first_ts: _Optional[int] = ..., last_ts: _Optional[int] = ..., arrow: _Optional[bytes] = ..., end: _Optional[bool] = ..., error: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class IngestBatch(_message.Message):
    __slots__ = ("stream", "arrow", "labelled", "advance_upto", "producer_id", "seq")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    ARROW_FIELD_NUMBER: _ClassVar[int]
    LABELLED_FIELD_NUMBER: _ClassVar[int]
    ADVANCE_UPTO_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    stream: str
    arrow: bytes
    labelled: bool
    advance_upto: int
    producer_id: str
    seq: int
    def __init__(self, stream: _Optional[str] = ..., arrow: _Optional[bytes] = ..., labelled: _Optional[bool] = ..., advance_upto: _Optional[int] = ..., producer_id: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class IngestAck(_message.Message):
    __slots__ = ("seq", "accepted", "dropped_by_shepherd", "error", "duplicate", "chunks", "shed", "shed_first_ts", "shed_last_ts")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BY_SHEPHERD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SHED_FIELD_NUMBER: _ClassVar[int]
    SHED_FIRST_TS_FIELD_NUMBER: _ClassVar[int]
    SHED_LAST_TS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    accepted: int
    dropped_by_shepherd: int
    error: str
    duplicate: bool
    chunks: int
    shed: int
    shed_first_ts: int
    shed_last_ts: int
    def __init__(self, seq: _Optional[int] = ..., accepted: _Optional[int] = ..., dropped_by_shepherd: _Optional[int] = ..., error: _Optional[str] = ..., duplicate: _Optional[bool] = ..., chunks: _Optional[int] = ..., shed: _Optional[int] = ..., shed_first_ts: _Optional[int] = ..., shed_last_ts: _Optional[int] = ...) -> None: ...

class IngestReply(_message.Message):
    __slots__ = ("accepted", "dropped_by_shepherd", "rejected", "error", "chunks", "shed", "shed_first_ts", "shed_last_ts")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BY_SHEPHERD_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SHED_FIELD_NUMBER: _ClassVar[int]
    SHED_FIRST_TS_FIELD_NUMBER: _ClassVar[int]
    SHED_LAST_TS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    dropped_by_shepherd: int
    rejected: int
    error: str
    chunks: int
    shed: int
    shed_first_ts: int
    shed_last_ts: int
    def __init__(self, accepted: _Optional[int] = ..., dropped_by_shepherd: _Optional[int] = ..., rejected: _Optional[int] = ..., error: _Optional[str] = ..., chunks: _Optional[int] = ..., shed: _Optional[int] = ..., shed_first_ts: _Optional[int] = ..., shed_last_ts: _Optional[int] = ...) -> None: ...

class AdvanceRequest(_message.Message):
    __slots__ = ("upto_ts", "finish")
    UPTO_TS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    upto_ts: int
    finish: bool
    def __init__(self, upto_ts: _Optional[int] = ..., finish: _Optional[bool] = ...) -> None: ...

class AdvanceReply(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    def __init__(self, chunks: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("sid", "cpu", "pid", "state", "chunks_done", "in_flight", "seen_levels", "refused", "identity_key")
    class SeenLevelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SID_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DONE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SEEN_LEVELS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_KEY_FIELD_NUMBER: _ClassVar[int]
    sid: str
    cpu: float
    pid: int
    state: str
    chunks_done: int
    in_flight: int
    seen_levels: _containers.ScalarMap[str, int]
    refused: _containers.ScalarMap[str, int]
    identity_key: bytes
    def __init__(self, sid: _Optional[str] = ..., cpu: _Optional[float] = ..., pid: _Optional[int] = ..., state: _Optional[str] = ..., chunks_done: _Optional[int] = ..., in_flight: _Optional[int] = ..., seen_levels: _Optional[_Mapping[str, int]] = ..., refused: _Optional[_Mapping[str, int]] = ..., identity_key: _Optional[bytes] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("level", "workers", "backlog_chunks", "lag_seconds", "rejected", "counters", "ready_chunks", "timings", "user", "roles", "queries", "cluster", "last_chunk_error", "shedding", "switches", "histograms")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TimingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class HistogramsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    READY_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    LAST_CHUNK_ERROR_FIELD_NUMBER: _ClassVar[int]
    SHEDDING_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAMS_FIELD_NUMBER: _ClassVar[int]
    level: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    backlog_chunks: int
    lag_seconds: float
    rejected: _containers.ScalarMap[str, int]
    counters: _containers.ScalarMap[str, int]
    ready_chunks: int
    timings: _containers.ScalarMap[str, float]
    user: str
    roles: _containers.RepeatedScalarFieldContainer[str]
    queries: _containers.RepeatedCompositeFieldContainer[QueryStatus]
    cluster: bool
    last_chunk_error: str
    shedding: ShedStatus
    switches: _containers.RepeatedCompositeFieldContainer[SwitchStatus]
    histograms: _containers.ScalarMap[str, float]
    def __init__(self, level: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., backlog_chunks: _Optional[int] = ..., lag_seconds: _Optional[float] = ..., rejected: _Optional[_Mapping[str, int]] = ..., counters: _Optional[_Mapping[str, int]] = ..., ready_chunks: _Optional[int] = ..., timings: _Optional[_Mapping[str, float]] = ..., user: _Optional[str] = ..., roles: _Optional[_Iterable[str]] = ..., queries: _Optional[_Iterable[_Union[QueryStatus, _Mapping]]] = ..., cluster: _Optional[bool] = ..., last_chunk_error: _Optional[str] = ..., shedding: _Optional[_Union[ShedStatus, _Mapping]] = ..., switches: _Optional[_Iterable[_Union[SwitchStatus, _Mapping]]] = ..., histograms: _Optional[_Mapping[str, float]] = ...) -> None: ...

class AccessRequest(_message.Message):
    __slots__ = ("user", "query_id", "stream", "grant")
    USER_FIELD_NUMBER: _ClassVar[int]
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    user: str
    query_id: str
    stream: str
    grant: bool
    def __init__(self, user: _Optional[str] = ..., query_id: _Optional[str] = ..., stream: _Optional[str] = ..., grant: _Optional[bool] = ...) -> None: ...

class SwitchStatus(_message.Message):
    __slots__ = ("query_id", "user", "stream", "state", "since", "access_counter", "blocked", "passed")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    ACCESS_COUNTER_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    user: str
    stream: str
    state: str
    since: int
    access_counter: int
    blocked: int
    passed: int
    def __init__(self, query_id: _Optional[str] = ..., user: _Optional[str] = ..., stream: _Optional[str] = ..., state: _Optional[str] = ..., since: _Optional[int] = ..., access_counter: _Optional[int] = ..., blocked: _Optional[int] = ..., passed: _Optional[int] = ...) -> None: ...

class AccessReply(_message.Message):
    __slots__ = ("switch", "instant", "changed")
    SWITCH_FIELD_NUMBER: _ClassVar[int]
    INSTANT_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    switch: SwitchStatus
    instant: int
    changed: bool
    def __init__(self, switch: _Optional[_Union[SwitchStatus, _Mapping]] = ..., instant: _Optional[int] = ..., changed: _Optional[bool] = ...) -> None: ...

class InstantRange(_message.Message):
    __slots__ = ("first", "last")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    first: int
    last: int
    def __init__(self, first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class ShedStatus(_message.Message):
    __slots__ = ("mode", "active", "shed_backlog_rows", "resume_backlog_rows", "rows", "instants", "ranges", "ranges_total", "batches", "episodes")
    class RowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class InstantsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    SHED_BACKLOG_ROWS_FIELD_NUMBER: _ClassVar[int]
    RESUME_BACKLOG_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    INSTANTS_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    RANGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    mode: str
    active: bool
    shed_backlog_rows: int
    resume_backlog_rows: int
    rows: _containers.ScalarMap[str, int]
    instants: _containers.ScalarMap[str, int]
    ranges: _containers.RepeatedCompositeFieldContainer[InstantRange]
    ranges_total: int
    batches: int
    episodes: int
    def __init__(self, mode: _Optional[str] = ..., active: _Optional[bool] = ..., shed_backlog_rows: _Optional[int] = ..., resume_backlog_rows: _Optional[int] = ..., rows: _Optional[_Mapping[str, int]] = ..., instants: _Optional[_Mapping[str, int]] = ..., ranges: _Optional[_Iterable[_Union[InstantRange, _Mapping]]] = ..., ranges_total: _Optional[int] = ..., batches: _Optional[int] = ..., episodes: _Optional[int] = ...) -> None: ...

class QueryStatus(_message.Message):
    __slots__ = ("query_id", "text", "state", "last_ts", "error", "stopped_after")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_TS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STOPPED_AFTER_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    text: str
    state: str
    last_ts: int
    error: str
    stopped_after: int
    def __init__(self, query_id: _Optional[str] = ..., text: _Optional[str] = ..., state: _Optional[str] = ..., last_ts: _Optional[int] = ..., error: _Optional[str] = ..., stopped_after: _Optional[int] = ...) -> None: ...

class Attribute(_message.Message):
    __slots__ = ("name", "type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ...) -> None: ...

class AddStreamRequest(_message.Message):
    __slots__ = ("name", "attributes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    attributes: _containers.RepeatedCompositeFieldContainer[Attribute]
    def __init__(self, name: _Optional[str] = ..., attributes: _Optional[_Iterable[_Union[Attribute, _Mapping]]] = ...) -> None: ...

class StreamInfo(_message.Message):
    __slots__ = ("name", "attributes", "added", "created")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    name: str
    attributes: _containers.RepeatedCompositeFieldContainer[Attribute]
    added: bool
    created: bool
    def __init__(self, name: _Optional[str] = ..., attributes: _Optional[_Iterable[_Union[Attribute, _Mapping]]] = ..., added: _Optional[bool] = ..., created: _Optional[bool] = ...) -> None: ...

class StreamsReply(_message.Message):
    __slots__ = ("streams",)
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    streams: _containers.RepeatedCompositeFieldContainer[StreamInfo]
    def __init__(self, streams: _Optional[_Iterable[_Union[StreamInfo, _Mapping]]] = ...) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("epoch", "owner", "last_seq", "follower", "confirmed")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    FOLLOWER_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    owner: str
    last_seq: int
    follower: str
    confirmed: int
    def __init__(self, epoch: _Optional[int] = ..., owner: _Optional[str] = ..., last_seq: _Optional[int] = ..., follower: _Optional[str] = ..., confirmed: _Optional[int] = ...) -> None: ...

class LogRecord(_message.Message):
    __slots__ = ("kind", "lsn", "body", "data")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LSN_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    kind: str
    lsn: int
    body: bytes
    data: bytes
    def __init__(self, kind: _Optional[str] = ..., lsn: _Optional[int] = ..., body: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("asker", "epoch", "last_seq")
    ASKER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    asker: str
    epoch: int
    last_seq: int
    def __init__(self, asker: _Optional[str] = ..., epoch: _Optional[int] = ..., last_seq: _Optional[int] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("role", "epoch", "owner", "last_seq", "active", "address", "synced", "node")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    role: str
    epoch: int
    owner: str
    last_seq: int
    active: str
    address: str
    synced: bool
    node: str
    def __init__(self, role: _Optional[str] = ..., epoch: _Optional[int] = ..., owner: _Optional[str] = ..., last_seq: _Optional[int] = ..., active: _Optional[str] = ..., address: _Optional[str] = ..., synced: _Optional[bool] = ..., node: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("query_ids",)
    QUERY_IDS_FIELD_NUMBER: _ClassVar[int]
    query_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, query_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("queries",)
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedCompositeFieldContainer[QueryStatus]
    def __init__(self, queries: _Optional[_Iterable[_Union[QueryStatus, _Mapping]]] = ...) -> None: ...

class QuerySpec(_message.Message):
    __slots__ = ("query_id", "text", "level")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    text: str
    level: str
    def __init__(self, query_id: _Optional[str] = ..., text: _Optional[str] = ..., level: _Optional[str] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("level", "queries", "chunk", "epoch")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    level: str
    queries: _containers.RepeatedCompositeFieldContainer[QuerySpec]
    chunk: bytes
    epoch: int
    def __init__(self, level: _Optional[str] = ..., queries: _Optional[_Iterable[_Union[QuerySpec, _Mapping]]] = ..., chunk: _Optional[bytes] = ..., epoch: _Optional[int] = ...) -> None: ...

class ExecuteReply(_message.Message):
    __slots__ = ("results", "seconds")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedScalarFieldContainer[bytes]
    seconds: float
    def __init__(self, results: _Optional[_Iterable[bytes]] = ..., seconds: _Optional[float] = ...) -> None: ...
