"""Leases as the engine sees them: plain values, the typed failures of lease traffic, and
:class:`LeaseService`, the cache service as the engine is written against it.

Pure Python (no gRPC, no protos, no MLX): the sequence, the scheduler and the lease sync
import these. The engine takes a ``LeaseService`` as a constructor argument and never names an
implementation: ``worker.lease_client.LeaseClient`` (at the edge, beside the servicer) turns
the cache service's messages and status codes into these values and errors over gRPC, and the
lease-sync tests answer it in process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class LeaseError(Exception):
    """Base of the cache-service failures the engine handles."""


class NoRoom(LeaseError):
    """RESOURCE_EXHAUSTED: wait for blocks to come back, or preempt."""


class NeverFits(NoRoom):
    """OUT_OF_RANGE: more blocks than the pool could ever give (pinned blocks, a namespace
    quota keep the rest). At admission the request is refused; while growing it is room that
    does not come (preempt, as for NoRoom: the preempted one meets this at re-admission)."""


class Fenced(LeaseError):
    """FAILED_PRECONDITION: the pool is unknown (the service restarted) or our incarnation is
    fenced: register again.

    `incarnation` is the one the call was made with. An answer to a call sent before the latest
    registration is stale: the pool has already registered again, and must not do it twice.
    """

    def __init__(self, details: str, incarnation: int = 0) -> None:
        super().__init__(details)
        self.incarnation = incarnation


class LeaseLost(LeaseError):
    """NOT_FOUND: the lease expired or was released."""


class CacheUnavailable(LeaseError):
    """The cache service could not be reached."""


class Rejected(LeaseError):
    """INVALID_ARGUMENT from the cache service: a bug or a bad request."""


class Incompatible(LeaseError):
    """The cache service speaks an older wire revision than this worker needs: registration
    is retried (the service may be upgraded meanwhile), the reason logged each time."""


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: int
    block_table: tuple[int, ...]
    cached_tokens: int
    copy_on_write: tuple[tuple[int, int], ...]
    # Blocks after the cached ones that the pool's tiers hold: load them (worker.tier), or
    # compute them.
    tier_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Deferred:
    waiting_on: int
    cached_tokens: int
    pending_tokens: int


@dataclass(frozen=True, slots=True)
class LeaseAsk:
    """One prompt to acquire a lease for (one item of a batched acquire)."""

    tokens: Sequence[int]
    namespace: str
    reserve: int
    skip_cache: bool


@dataclass(frozen=True, slots=True)
class Written:
    """What a commit or release tells the cache service of a lease's sequence: its first
    ``count`` tokens have their K/V written. The service knows the tokens the lease was
    acquired for, so only the ones past them travel: ``tail`` is the sequence from token
    ``tail_from`` (at most the acquired length) through ``count``."""

    count: int
    tail_from: int
    tail: list[int]


@dataclass(frozen=True, slots=True)
class PoolRegistration:
    pool_id: str
    num_blocks: int
    block_size: int
    model: str
    model_fingerprint: str
    worker_address: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_block: int = 0
    # The worker's tiers beside the pool: (medium, capacity in blocks); medium "disk".
    tiers: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class TierEntry:
    """A block a tier holds, as the cache service is told of it (kvserve_proto.block_keys)."""

    key: int
    parent_key: int
    namespace: str
    medium: str = "disk"  # "host" or "disk"


class LeaseService(Protocol):
    """The cache service, in the engine's values: what the lease sync calls, and all it reads.

    Every call raises a :class:`LeaseError` for a failure of the whole call (typed by what the
    engine does about it: NoRoom, Fenced, LeaseLost, CacheUnavailable, ...); the batched calls
    answer an error per item where one item failed alone. Calls carry ``incarnation``, the
    pool's current one, which ``register`` sets.
    """

    incarnation: int
    lease_ttl_s: float  # as the service announced at registration
    heartbeat_interval_s: float  # how often ``heartbeat`` must be called
    max_namespace_chars: int  # the longest namespace the service stores

    async def register(self, reg: PoolRegistration) -> int:
        """Registers the pool (again, after a restart or a fence); returns the incarnation."""
        ...

    async def heartbeat(self) -> list[int]:
        """Renews the pool's liveness; returns the lease ids that expired since it last heard."""
        ...

    async def acquire(
        self, asks: Sequence[LeaseAsk]
    ) -> tuple[list[Lease | Deferred | LeaseError], list[int]]:
        """One batched acquire, tried in order: per ask a Lease, a Deferred or the error it met
        (NoRoom for the first that did not fit and every one after it), and the expired ids."""
        ...

    async def extend(self, items: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
        """Grows each (lease id, tokens) lease to cover that many tokens, all or nothing;
        returns each lease's new blocks."""
        ...

    async def commit(self, items: Sequence[tuple[int, Written]]) -> None:
        """Publishes the full blocks of running leases to the index."""
        ...

    async def release(self, items: Sequence[tuple[int, Written | None]]) -> list[LeaseError | None]:
        """Releases leases (committing what ``Written`` says); per item None or its error."""
        ...

    async def update_tiers(
        self, stored: Sequence[TierEntry], dropped: Sequence[tuple[int, str]]
    ) -> list[tuple[int, str]]:
        """Tells the service what the tiers now hold and no longer hold ((key, medium)
        pairs); returns the blocks it dropped from a tier, (key, medium), to delete."""
        ...

    def take_tier_evictions(self) -> list[tuple[int, str]]:
        """Tier blocks the service dropped that heartbeats brought back (to delete)."""
        ...

    async def close(self) -> None: ...
