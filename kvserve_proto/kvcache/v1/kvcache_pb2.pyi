from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIUM_UNSPECIFIED: _ClassVar[Medium]
    MEDIUM_DEVICE: _ClassVar[Medium]
    MEDIUM_HOST: _ClassVar[Medium]
    MEDIUM_DISK: _ClassVar[Medium]
MEDIUM_UNSPECIFIED: Medium
MEDIUM_DEVICE: Medium
MEDIUM_HOST: Medium
MEDIUM_DISK: Medium

class TierSpec(_message.Message):
    __slots__ = ("medium", "capacity_blocks")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    medium: Medium
    capacity_blocks: int
    def __init__(self, medium: _Optional[_Union[Medium, str]] = ..., capacity_blocks: _Optional[int] = ...) -> None: ...

class TierBlock(_message.Message):
    __slots__ = ("key", "parent_key", "namespace", "medium")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    key: int
    parent_key: int
    namespace: str
    medium: Medium
    def __init__(self, key: _Optional[int] = ..., parent_key: _Optional[int] = ..., namespace: _Optional[str] = ..., medium: _Optional[_Union[Medium, str]] = ...) -> None: ...

class UpdateTiersRequest(_message.Message):
    __slots__ = ("pool", "stored", "dropped")
    POOL_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    stored: _containers.RepeatedCompositeFieldContainer[TierBlock]
    dropped: _containers.RepeatedCompositeFieldContainer[TierBlock]
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., stored: _Optional[_Iterable[_Union[TierBlock, _Mapping]]] = ..., dropped: _Optional[_Iterable[_Union[TierBlock, _Mapping]]] = ...) -> None: ...

class UpdateTiersResponse(_message.Message):
    __slots__ = ("evict",)
    EVICT_FIELD_NUMBER: _ClassVar[int]
    evict: _containers.RepeatedCompositeFieldContainer[TierBlock]
    def __init__(self, evict: _Optional[_Iterable[_Union[TierBlock, _Mapping]]] = ...) -> None: ...

class PoolLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "bytes_per_block")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_block: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., bytes_per_block: _Optional[int] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("pool_id", "model_fingerprint", "layout", "num_blocks", "block_size", "worker_address", "model", "incarnation", "tiers")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    model_fingerprint: str
    layout: PoolLayout
    num_blocks: int
    block_size: int
    worker_address: str
    model: str
    incarnation: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierSpec]
    def __init__(self, pool_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., layout: _Optional[_Union[PoolLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., worker_address: _Optional[str] = ..., model: _Optional[str] = ..., incarnation: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierSpec, _Mapping]]] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("incarnation", "lease_ttl_s", "heartbeat_interval_s", "max_namespace_chars", "wire_revision")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_NAMESPACE_CHARS_FIELD_NUMBER: _ClassVar[int]
    WIRE_REVISION_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    lease_ttl_s: float
    heartbeat_interval_s: float
    max_namespace_chars: int
    wire_revision: int
    def __init__(self, incarnation: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., max_namespace_chars: _Optional[int] = ..., wire_revision: _Optional[int] = ...) -> None: ...

class PoolRef(_message.Message):
    __slots__ = ("pool_id", "incarnation")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    incarnation: int
    def __init__(self, pool_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("expired_lease_ids", "live_leases", "tier_evict")
    EXPIRED_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    TIER_EVICT_FIELD_NUMBER: _ClassVar[int]
    expired_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    live_leases: int
    tier_evict: _containers.RepeatedCompositeFieldContainer[TierBlock]
    def __init__(self, expired_lease_ids: _Optional[_Iterable[int]] = ..., live_leases: _Optional[int] = ..., tier_evict: _Optional[_Iterable[_Union[TierBlock, _Mapping]]] = ...) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("pool", "namespace", "prompt_token_ids", "prompt_tokens", "reserve_tokens", "allow_defer", "skip_cache")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_DEFER_FIELD_NUMBER: _ClassVar[int]
    SKIP_CACHE_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    namespace: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: bytes
    reserve_tokens: int
    allow_defer: bool
    skip_cache: bool
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., namespace: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[bytes] = ..., reserve_tokens: _Optional[int] = ..., allow_defer: _Optional[bool] = ..., skip_cache: _Optional[bool] = ...) -> None: ...

class CopyOnWrite(_message.Message):
    __slots__ = ("src_block", "dst_block")
    SRC_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    src_block: int
    dst_block: int
    def __init__(self, src_block: _Optional[int] = ..., dst_block: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "block_table", "cached_tokens", "copy_on_write", "expires_at", "tier_blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COPY_ON_WRITE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    copy_on_write: _containers.RepeatedCompositeFieldContainer[CopyOnWrite]
    expires_at: float
    tier_blocks: int
    def __init__(self, lease_id: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., copy_on_write: _Optional[_Iterable[_Union[CopyOnWrite, _Mapping]]] = ..., expires_at: _Optional[float] = ..., tier_blocks: _Optional[int] = ...) -> None: ...

class Deferred(_message.Message):
    __slots__ = ("waiting_on_lease_id", "cached_tokens", "pending_tokens")
    WAITING_ON_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    waiting_on_lease_id: int
    cached_tokens: int
    pending_tokens: int
    def __init__(self, waiting_on_lease_id: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., pending_tokens: _Optional[int] = ...) -> None: ...

class AcquireLeaseResponse(_message.Message):
    __slots__ = ("lease", "deferred", "expired_lease_ids")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    deferred: Deferred
    expired_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., deferred: _Optional[_Union[Deferred, _Mapping]] = ..., expired_lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ExtendItem(_message.Message):
    __slots__ = ("lease_id", "num_tokens")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    num_tokens: int
    def __init__(self, lease_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ExtendLeasesRequest(_message.Message):
    __slots__ = ("pool", "items")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    items: _containers.RepeatedCompositeFieldContainer[ExtendItem]
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., items: _Optional[_Iterable[_Union[ExtendItem, _Mapping]]] = ...) -> None: ...

class ExtendedLease(_message.Message):
    __slots__ = ("lease_id", "new_blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    new_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., new_blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class ExtendLeasesResponse(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[ExtendedLease]
    def __init__(self, leases: _Optional[_Iterable[_Union[ExtendedLease, _Mapping]]] = ...) -> None: ...

class CommitItem(_message.Message):
    __slots__ = ("lease_id", "token_ids", "update")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    update: SequenceUpdate
    def __init__(self, lease_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., update: _Optional[_Union[SequenceUpdate, _Mapping]] = ...) -> None: ...

class SequenceUpdate(_message.Message):
    __slots__ = ("written_tokens", "appended_from", "appended_tokens")
    WRITTEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPENDED_FROM_FIELD_NUMBER: _ClassVar[int]
    APPENDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    written_tokens: int
    appended_from: int
    appended_tokens: bytes
    def __init__(self, written_tokens: _Optional[int] = ..., appended_from: _Optional[int] = ..., appended_tokens: _Optional[bytes] = ...) -> None: ...

class CommitLeasesRequest(_message.Message):
    __slots__ = ("pool", "items")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    items: _containers.RepeatedCompositeFieldContainer[CommitItem]
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., items: _Optional[_Iterable[_Union[CommitItem, _Mapping]]] = ...) -> None: ...

class CommitLeasesResponse(_message.Message):
    __slots__ = ("indexed_tokens",)
    INDEXED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    indexed_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, indexed_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("pool", "lease_id", "token_ids", "update")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    lease_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    update: SequenceUpdate
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., lease_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., update: _Optional[_Union[SequenceUpdate, _Mapping]] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("indexed_tokens",)
    INDEXED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    indexed_tokens: int
    def __init__(self, indexed_tokens: _Optional[int] = ...) -> None: ...

class AcquireItem(_message.Message):
    __slots__ = ("namespace", "prompt_tokens", "prompt_token_ids", "reserve_tokens", "allow_defer", "skip_cache")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_DEFER_FIELD_NUMBER: _ClassVar[int]
    SKIP_CACHE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    prompt_tokens: bytes
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    reserve_tokens: int
    allow_defer: bool
    skip_cache: bool
    def __init__(self, namespace: _Optional[str] = ..., prompt_tokens: _Optional[bytes] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., reserve_tokens: _Optional[int] = ..., allow_defer: _Optional[bool] = ..., skip_cache: _Optional[bool] = ...) -> None: ...

class AcquireLeasesRequest(_message.Message):
    __slots__ = ("pool", "items")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    items: _containers.RepeatedCompositeFieldContainer[AcquireItem]
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., items: _Optional[_Iterable[_Union[AcquireItem, _Mapping]]] = ...) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class AcquireResult(_message.Message):
    __slots__ = ("lease", "deferred", "error")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    deferred: Deferred
    error: ItemError
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., deferred: _Optional[_Union[Deferred, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class AcquireLeasesResponse(_message.Message):
    __slots__ = ("results", "expired_lease_ids")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[AcquireResult]
    expired_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, results: _Optional[_Iterable[_Union[AcquireResult, _Mapping]]] = ..., expired_lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseItem(_message.Message):
    __slots__ = ("lease_id", "update")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    update: SequenceUpdate
    def __init__(self, lease_id: _Optional[int] = ..., update: _Optional[_Union[SequenceUpdate, _Mapping]] = ...) -> None: ...

class ReleaseLeasesRequest(_message.Message):
    __slots__ = ("pool", "items")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    items: _containers.RepeatedCompositeFieldContainer[ReleaseItem]
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., items: _Optional[_Iterable[_Union[ReleaseItem, _Mapping]]] = ...) -> None: ...

class ReleaseResult(_message.Message):
    __slots__ = ("indexed_tokens", "error")
    INDEXED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    indexed_tokens: int
    error: ItemError
    def __init__(self, indexed_tokens: _Optional[int] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class ReleaseLeasesResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReleaseResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ReleaseResult, _Mapping]]] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("namespace", "prompt_token_ids", "model", "prompt_tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    model: str
    prompt_tokens: bytes
    def __init__(self, namespace: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., prompt_tokens: _Optional[bytes] = ...) -> None: ...

class PoolRoute(_message.Message):
    __slots__ = ("pool_id", "worker_address", "cached_tokens", "free_blocks", "evictable_blocks", "live_leases", "alive", "model", "tier_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    worker_address: str
    cached_tokens: int
    free_blocks: int
    evictable_blocks: int
    live_leases: int
    alive: bool
    model: str
    tier_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., free_blocks: _Optional[int] = ..., evictable_blocks: _Optional[int] = ..., live_leases: _Optional[int] = ..., alive: _Optional[bool] = ..., model: _Optional[str] = ..., tier_tokens: _Optional[int] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolRoute]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolRoute, _Mapping]]] = ...) -> None: ...

class EventCursor(_message.Message):
    __slots__ = ("log_id", "seq")
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    log_id: int
    seq: int
    def __init__(self, log_id: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("pool_id", "after")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    after: EventCursor
    def __init__(self, pool_id: _Optional[str] = ..., after: _Optional[_Union[EventCursor, _Mapping]] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ("namespace", "parent_block", "blocks", "tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    parent_block: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    tokens: bytes
    def __init__(self, namespace: _Optional[str] = ..., parent_block: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., tokens: _Optional[bytes] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class PoolCleared(_message.Message):
    __slots__ = ("reason",)
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[PoolCleared.Reason]
        REASON_REGISTERED: _ClassVar[PoolCleared.Reason]
        REASON_FORGOTTEN: _ClassVar[PoolCleared.Reason]
    REASON_UNSPECIFIED: PoolCleared.Reason
    REASON_REGISTERED: PoolCleared.Reason
    REASON_FORGOTTEN: PoolCleared.Reason
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: PoolCleared.Reason
    def __init__(self, reason: _Optional[_Union[PoolCleared.Reason, str]] = ...) -> None: ...

class TierBlocksStored(_message.Message):
    __slots__ = ("medium", "namespace", "keys", "parent_keys")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    medium: Medium
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[int]
    parent_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, medium: _Optional[_Union[Medium, str]] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[int]] = ..., parent_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class TierBlocksRemoved(_message.Message):
    __slots__ = ("medium", "keys")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    medium: Medium
    keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, medium: _Optional[_Union[Medium, str]] = ..., keys: _Optional[_Iterable[int]] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared", "tier_stored", "tier_removed")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    TIER_STORED_FIELD_NUMBER: _ClassVar[int]
    TIER_REMOVED_FIELD_NUMBER: _ClassVar[int]
    stored: BlocksStored
    removed: BlocksRemoved
    cleared: PoolCleared
    tier_stored: TierBlocksStored
    tier_removed: TierBlocksRemoved
    def __init__(self, stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[PoolCleared, _Mapping]] = ..., tier_stored: _Optional[_Union[TierBlocksStored, _Mapping]] = ..., tier_removed: _Optional[_Union[TierBlocksRemoved, _Mapping]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("cursor", "pool_id", "incarnation", "block_size", "pool_seq", "timestamp", "events")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOL_SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    cursor: EventCursor
    pool_id: str
    incarnation: int
    block_size: int
    pool_seq: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, cursor: _Optional[_Union[EventCursor, _Mapping]] = ..., pool_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., block_size: _Optional[int] = ..., pool_seq: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class EventsReset(_message.Message):
    __slots__ = ("reason", "cursor")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[EventsReset.Reason]
        REASON_NO_CURSOR: _ClassVar[EventsReset.Reason]
        REASON_OTHER_LOG: _ClassVar[EventsReset.Reason]
        REASON_TOO_OLD: _ClassVar[EventsReset.Reason]
        REASON_AHEAD: _ClassVar[EventsReset.Reason]
    REASON_UNSPECIFIED: EventsReset.Reason
    REASON_NO_CURSOR: EventsReset.Reason
    REASON_OTHER_LOG: EventsReset.Reason
    REASON_TOO_OLD: EventsReset.Reason
    REASON_AHEAD: EventsReset.Reason
    REASON_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    reason: EventsReset.Reason
    cursor: EventCursor
    def __init__(self, reason: _Optional[_Union[EventsReset.Reason, str]] = ..., cursor: _Optional[_Union[EventCursor, _Mapping]] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("batch", "reset", "synced")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    batch: KVEventBatch
    reset: EventsReset
    synced: EventCursor
    def __init__(self, batch: _Optional[_Union[KVEventBatch, _Mapping]] = ..., reset: _Optional[_Union[EventsReset, _Mapping]] = ..., synced: _Optional[_Union[EventCursor, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pool_id", "incarnation", "worker_address", "model_fingerprint", "block_size", "num_blocks", "free_blocks", "cached_blocks", "referenced_blocks", "pinned_blocks", "peak_used_blocks", "live_leases", "acquires", "acquire_hits", "deferrals", "exhausted", "prompt_tokens", "cached_tokens", "evicted_blocks", "expired_leases", "alive", "token_hit_rate", "request_hit_rate", "indexed_blocks", "bytes_per_block", "tiers", "tier_hit_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REFERENCED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEAK_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    ACQUIRES_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_HITS_FIELD_NUMBER: _ClassVar[int]
    DEFERRALS_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    incarnation: int
    worker_address: str
    model_fingerprint: str
    block_size: int
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    referenced_blocks: int
    pinned_blocks: int
    peak_used_blocks: int
    live_leases: int
    acquires: int
    acquire_hits: int
    deferrals: int
    exhausted: int
    prompt_tokens: int
    cached_tokens: int
    evicted_blocks: int
    expired_leases: int
    alive: bool
    token_hit_rate: float
    request_hit_rate: float
    indexed_blocks: int
    bytes_per_block: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    tier_hit_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., worker_address: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., referenced_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., peak_used_blocks: _Optional[int] = ..., live_leases: _Optional[int] = ..., acquires: _Optional[int] = ..., acquire_hits: _Optional[int] = ..., deferrals: _Optional[int] = ..., exhausted: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., expired_leases: _Optional[int] = ..., alive: _Optional[bool] = ..., token_hit_rate: _Optional[float] = ..., request_hit_rate: _Optional[float] = ..., indexed_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., tier_hit_tokens: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("medium", "blocks", "capacity_blocks", "stored_blocks", "loaded_blocks", "dropped_blocks")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    medium: Medium
    blocks: int
    capacity_blocks: int
    stored_blocks: int
    loaded_blocks: int
    dropped_blocks: int
    def __init__(self, medium: _Optional[_Union[Medium, str]] = ..., blocks: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., loaded_blocks: _Optional[int] = ..., dropped_blocks: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ...) -> None: ...

class InspectTreeRequest(_message.Message):
    __slots__ = ("pool_id", "namespace", "max_depth")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    namespace: str
    max_depth: int
    def __init__(self, pool_id: _Optional[str] = ..., namespace: _Optional[str] = ..., max_depth: _Optional[int] = ...) -> None: ...

class TreeNode(_message.Message):
    __slots__ = ("node_id", "parent_id", "namespace", "depth", "num_tokens", "blocks", "refcounts", "token_preview", "last_used_at", "pinned")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REFCOUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PREVIEW_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_AT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    node_id: int
    parent_id: int
    namespace: str
    depth: int
    num_tokens: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    refcounts: _containers.RepeatedScalarFieldContainer[int]
    token_preview: _containers.RepeatedScalarFieldContainer[int]
    last_used_at: float
    pinned: bool
    def __init__(self, node_id: _Optional[int] = ..., parent_id: _Optional[int] = ..., namespace: _Optional[str] = ..., depth: _Optional[int] = ..., num_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., refcounts: _Optional[_Iterable[int]] = ..., token_preview: _Optional[_Iterable[int]] = ..., last_used_at: _Optional[float] = ..., pinned: _Optional[bool] = ...) -> None: ...

class InspectTreeResponse(_message.Message):
    __slots__ = ("nodes", "truncated")
    NODES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[TreeNode]
    truncated: bool
    def __init__(self, nodes: _Optional[_Iterable[_Union[TreeNode, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("pool_id", "namespace", "prompt_token_ids")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    namespace: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool_id: _Optional[str] = ..., namespace: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PoolLookup(_message.Message):
    __slots__ = ("pool_id", "cached_tokens", "matched_blocks", "pending_tokens", "blocks_needed", "copied_tokens", "tier_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_NEEDED_FIELD_NUMBER: _ClassVar[int]
    COPIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    cached_tokens: int
    matched_blocks: _containers.RepeatedScalarFieldContainer[int]
    pending_tokens: int
    blocks_needed: int
    copied_tokens: int
    tier_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., matched_blocks: _Optional[_Iterable[int]] = ..., pending_tokens: _Optional[int] = ..., blocks_needed: _Optional[int] = ..., copied_tokens: _Optional[int] = ..., tier_tokens: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolLookup]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolLookup, _Mapping]]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("pool_id", "num_blocks", "namespace", "prefix")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_blocks: int
    namespace: str
    prefix: PrefixRef
    def __init__(self, pool_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., namespace: _Optional[str] = ..., prefix: _Optional[_Union[PrefixRef, _Mapping]] = ...) -> None: ...

class PrefixRef(_message.Message):
    __slots__ = ("namespace", "token_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted_blocks",)
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    evicted_blocks: int
    def __init__(self, evicted_blocks: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("pool_id", "medium")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    medium: Medium
    def __init__(self, pool_id: _Optional[str] = ..., medium: _Optional[_Union[Medium, str]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("pool_id", "prefix")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    prefix: PrefixRef
    def __init__(self, pool_id: _Optional[str] = ..., prefix: _Optional[_Union[PrefixRef, _Mapping]] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class CheckIntegrityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckIntegrityResponse(_message.Message):
    __slots__ = ("ok", "problems", "pools_checked")
    OK_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    POOLS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    problems: _containers.RepeatedScalarFieldContainer[str]
    pools_checked: int
    def __init__(self, ok: _Optional[bool] = ..., problems: _Optional[_Iterable[str]] = ..., pools_checked: _Optional[int] = ...) -> None: ...
