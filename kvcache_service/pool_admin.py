"""What an operator does to one pool: evict, flush, pin and unpin prefixes, look a prompt up."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvcache_service.block_pool import blocks_for
from kvcache_service.budget import Budget
from kvcache_service.errors import NotFound
from kvcache_service.eviction import EvictionOrder
from kvcache_service.ids import BlockId, Namespace, Tokens
from kvcache_service.inflight import chain_hashes, chain_seed
from kvcache_service.lease_book import LeaseBook, reusable_tokens, tier_reuse
from kvcache_service.radix_index import RadixIndex
from kvcache_service.tier_index import Medium
from kvcache_service.tokens import count


@dataclass(frozen=True, slots=True)
class Lookup:
    """A dry run of an acquire: what of a prompt the pool holds, and what it would allocate."""

    cached_tokens: int
    matched_blocks: tuple[BlockId, ...]  # shared as they are: cached_tokens // block_size
    pending_tokens: int  # past the cached ones, being filled by live leases
    blocks_needed: int
    # Of cached_tokens, those past the shared blocks: reused by copying a block that matches
    # only in part (a prompt whose last cached block it does not fill, or that ends inside it:
    # the last prompt token is always computed).
    copied_tokens: int = 0
    # Past cached_tokens, those the pool's tiers hold: loaded, not computed.
    tier_tokens: int = 0


class PoolAdmin:
    """Operator actions on one pool; owns the pinned prefixes. A lookup is what an acquire
    would do, the tiers included (Lookup.tier_tokens), with no side effects.

    Every action is safe while requests run: evictions take only evictable blocks (indexed,
    unreferenced, unpinned), leaves first, through the budget; a pin holds blocks that are
    already indexed. A pinned block is never evicted, by flush either, until unpinned.
    """

    def __init__(
        self,
        block_size: int,
        index: RadixIndex,
        order: EvictionOrder,
        budget: Budget,
        leases: LeaseBook,
    ) -> None:
        self.block_size = block_size
        self.index = index
        self.order = order
        self.budget = budget
        self.leases = leases
        self._pins: dict[tuple[Namespace, Tokens], tuple[BlockId, ...]] = {}

    # -- eviction -----------------------------------------------------------------------------

    def evict_lru(self, n: int) -> int:
        done = 0
        while done < n and len(self.order):
            self.budget.evict(self.order.oldest())
            done += 1
        return done

    def evict_namespace(self, ns: Namespace) -> int:
        root = self.index.roots.get(ns)
        return self._evict_all(self.index.blocks_leaves_first(root)) if root else 0

    def evict_prefix(self, ns: Namespace, prefix: Tokens) -> int:
        starts = self.index.subtrees_under(ns, prefix)
        if not starts:
            raise NotFound(f"no indexed sequence extends that prefix in namespace {ns!r}")
        blocks = [b for node, j in starts for b in self.index.blocks_leaves_first(node, j)]
        return self._evict_all(blocks)

    def flush(self) -> int:
        return sum(self.evict_namespace(ns) for ns in list(self.index.roots))

    def flush_tier(self, medium: Medium) -> int:
        """Drops every block of the pool's ``medium`` tier; its worker is told to delete them
        (the tier index's outbox). InvalidArgument if the pool has no such tier."""
        return self.leases.tiers.clear(medium)

    def _evict_all(self, leaves_first: list[BlockId]) -> int:
        done = 0
        for b in leaves_first:
            # A referenced or pinned block's ancestors are referenced or pinned too, so
            # skipping it never strands an evictable child.
            if b in self.order:
                self.budget.evict(b)
                done += 1
        return done

    # -- pins ---------------------------------------------------------------------------------

    def pin(self, ns: Namespace, prefix: Tokens) -> int:
        """Protects the indexed full blocks of `prefix` from eviction until unpinned."""
        key = self._pin_key(ns, prefix)
        if key in self._pins:
            return len(self._pins[key])
        match = self.index.match(ns, key[1])
        if not match.blocks:
            raise NotFound(f"no full block of that prefix is indexed in namespace {ns!r}")
        self._pins[key] = match.blocks
        for b in match.blocks:
            self.budget.pin(b)
        return len(match.blocks)

    def unpin(self, ns: Namespace, prefix: Tokens) -> int:
        blocks = self._pins.pop(self._pin_key(ns, prefix), None)
        if blocks is None:
            raise NotFound(f"that prefix is not pinned in namespace {ns!r}")
        for b in reversed(blocks):  # deepest first, as the eviction order needs
            self.budget.unpin(b)
        return len(blocks)

    def _pin_key(self, ns: Namespace, prefix: Tokens) -> tuple[Namespace, Tokens]:
        cb = self.index.chunk_bytes
        return ns, Tokens(prefix[: len(prefix) // cb * cb])

    def pin_counts(self) -> Counter[BlockId]:
        """How many pinned prefixes hold each block (what its pin count must be)."""
        counts: Counter[BlockId] = Counter()
        for blocks in self._pins.values():
            counts.update(blocks)
        return counts

    # -- inspection ---------------------------------------------------------------------------

    def lookup(self, ns: Namespace, prompt: Tokens) -> Lookup:
        bs, n = self.block_size, count(prompt)
        match = self.index.match(ns, prompt)
        cached = reusable_tokens(match, bs, n)
        full = cached // bs
        base = self.index.chain_hash(match.blocks[full - 1]) if full else chain_seed(ns)
        chain = chain_hashes(base, prompt, full, self.index.chunk_bytes)
        pending, _ = self.leases.pending(chain, full, cached, n)
        cached, tier_blocks = tier_reuse(self.leases.tiers, chain, cached, bs, n)
        return Lookup(
            cached,
            match.blocks[:full],
            pending,
            blocks_for(n, bs) - full,
            cached - full * bs,
            tier_blocks * bs,
        )
