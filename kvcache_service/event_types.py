"""What a KV event is: the values the event log (events.py) records and holds, and the
converters (convert.py) put on the wire as WatchEvents messages (docs/kv-events.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvcache_service.ids import BlockId, Namespace, PoolId


@dataclass(frozen=True, slots=True)
class Stored:
    """A run of blocks entered the index along one path, each the child of the one before;
    ``parent`` is the block the run continues (None: at the namespace's root). ``tokens`` are
    packed (tokens.py), block_size per block; the last block may hold fewer (a tail)."""

    namespace: Namespace
    parent: BlockId | None
    blocks: tuple[BlockId, ...]
    tokens: bytes


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks left the index, each a leaf when it went."""

    blocks: tuple[BlockId, ...]


class ClearReason(enum.Enum):
    REGISTERED = "registered"  # a new incarnation: an empty index
    FORGOTTEN = "forgotten"  # the pool is gone


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every block of the pool left the index at once."""

    reason: ClearReason


@dataclass(frozen=True, slots=True)
class TierStored:
    """Blocks entered a tier of the pool (tier_index.Medium's value), by key; ``parents`` the
    key before each."""

    medium: int
    namespace: Namespace
    keys: tuple[int, ...]
    parents: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TierRemoved:
    """Blocks left a tier of the pool."""

    medium: int
    keys: tuple[int, ...]


Event = Stored | Removed | Cleared | TierStored | TierRemoved


@dataclass(frozen=True, slots=True)
class PoolKey:
    """Which pool incarnation a batch is of."""

    pool_id: PoolId
    incarnation: int
    block_size: int


@dataclass(frozen=True, slots=True)
class Batch:
    """One pool's events from one step of the service, in order. ``seq`` numbers batches
    across the log (every pool), ``pool_seq`` this pool's alone; both consecutive."""

    seq: int
    pool: PoolKey
    pool_seq: int
    timestamp: float
    events: tuple[Event, ...]
    cost: int  # bytes held, estimated: what the replay buffer's bound counts


@dataclass(frozen=True, slots=True)
class Cursor:
    """A position in a log: after batch ``seq`` of log ``log_id``."""

    log_id: int
    seq: int


class ResetReason(enum.Enum):
    """Why a watcher starts from a snapshot instead of where it asked."""

    NO_CURSOR = "no cursor"
    OTHER_LOG = "a cursor of another log"
    TOO_OLD = "a cursor older than the replay buffer"
    AHEAD = "a cursor past the log's end"
