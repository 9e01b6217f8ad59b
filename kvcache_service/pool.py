"""One registered worker pool: its block state, and the three objects that change it."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache_service.block_pool import BlockPool
from kvcache_service.budget import Budget
from kvcache_service.counters import PoolCounters
from kvcache_service.eviction import EvictionOrder
from kvcache_service.ids import BlockId, Namespace, PoolId, Tokens
from kvcache_service.inflight import chain_hashes, chain_seed
from kvcache_service.integrity import IntegritySnapshot
from kvcache_service.lease_book import LeaseBook, reusable_tokens, tier_reuse
from kvcache_service.pool_admin import PoolAdmin
from kvcache_service.radix_index import RadixIndex
from kvcache_service.tier_index import Medium, TierIndex, tier_quota
from kvcache_service.tokens import count


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What a worker registers. The layout fields are recorded, not used: the service holds
    no tensors."""

    pool_id: PoolId
    num_blocks: int
    block_size: int
    model_fingerprint: str = ""
    model: str = ""
    worker_address: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = ""
    bytes_per_block: int = 0  # 0: not reported
    # The worker's tiers: (medium, capacity in blocks), HOST and DISK at most once each.
    tiers: tuple[tuple[Medium, int], ...] = ()


class PoolState:
    """Block metadata of one worker pool. Pure domain: no clocks, no gRPC, no locks.

    The state: `blocks` (free list, refcounts, pin counts), `index` (token prefixes to
    blocks), `order` (evictable blocks, least recently used first), `tiers` (the blocks the
    worker's host memory and disk hold, by key: tier_index.py) and `counters`. What changes
    it, top down (each uses only those below it):

        admin   (PoolAdmin)  operator actions: evict, flush, pin, unpin, lookup
        leases  (LeaseBook)  the lease lifecycle: acquire, extend, commit, release, expire
        budget  (Budget)     block states, namespace charges and quotas, admission, eviction

    Every block is in exactly one state: free; referenced (listed by live leases); or cached
    (indexed, refcount 0), which is evictable unless pinned. ``check_integrity`` verifies it.
    """

    def __init__(self, spec: PoolSpec, incarnation: int, namespace_quota: int | None) -> None:
        self.spec = spec
        self.incarnation = incarnation
        self.block_size = spec.block_size
        self.blocks = BlockPool(spec.num_blocks)
        self.index = RadixIndex(spec.block_size)
        self.order = EvictionOrder(by_namespace=namespace_quota is not None)
        self.counters = PoolCounters()
        # Empty at every registration, as the index: the worker's manifest follows.
        self.tiers = TierIndex(
            spec.tiers,
            {m: tier_quota(namespace_quota, spec.num_blocks, c) for m, c in spec.tiers},
        )
        self.budget = Budget(self.blocks, self.index, self.order, self.counters, namespace_quota)
        self.leases = LeaseBook(
            spec.pool_id, spec.block_size, self.index, self.budget, self.counters, self.tiers
        )
        self.admin = PoolAdmin(spec.block_size, self.index, self.order, self.budget, self.leases)

    def match_tokens(self, ns: Namespace, prompt: Tokens) -> tuple[int, int]:
        """How many tokens of `prompt` an acquire would reuse, and how many past those it
        would load from the tiers (what Route answers). No side effects."""
        bs, n = self.block_size, count(prompt)
        match = self.index.match(ns, prompt)
        cached = reusable_tokens(match, bs, n)
        if not self.tiers:
            return cached, 0
        full = cached // bs
        base = self.index.chain_hash(match.blocks[full - 1]) if full else chain_seed(ns)
        # Only as far as a tier block may reach: the last prompt token is always computed.
        chain = chain_hashes(base, prompt, full, self.index.chunk_bytes, (n - 1) // bs)
        cached, tier_blocks = tier_reuse(self.tiers, chain, cached, bs, n)
        return cached, tier_blocks * bs

    # -- accounting ---------------------------------------------------------------------------

    @property
    def referenced_blocks(self) -> int:
        return sum(1 for r in self.blocks.refcount if r)

    @property
    def cached_blocks(self) -> int:
        """Indexed and unreferenced (evictable unless pinned)."""
        return len(self.index) - sum(1 for b in self.index_blocks() if self.blocks.refcount[b])

    @property
    def pinned_blocks(self) -> int:
        return sum(1 for p in self.blocks.pins if p)

    def index_blocks(self) -> list[BlockId]:
        return [b for _, node, _ in self.index.nodes() for b in node.blocks]

    def check_integrity(self) -> list[str]:
        """Every invariant of the pool; an empty list when all hold."""
        return self.integrity_snapshot().problems()

    def integrity_snapshot(self) -> IntegritySnapshot:
        """What ``check_integrity`` needs, taken in one step of the caller (the event loop):
        the checks proportional to what is indexed or leased run here, the per-block arrays
        are copied; ``IntegritySnapshot.problems`` does the O(num_blocks) pass, on any thread.
        """
        found = self.index.check_integrity()
        found += self.leases.check_integrity()
        found += self.budget.check_integrity()
        return IntegritySnapshot(
            tiers=self.tiers.snapshot(),
            label=f"pool {self.spec.pool_id!r}",
            blocks=self.blocks.snapshot(),
            found=found,
            listed=self.leases.references(),
            indexed=frozenset(self.index_blocks()),
            evictable=frozenset(self.order),
            charged=self.budget.charged,
            pin_counts=self.admin.pin_counts(),
        )
