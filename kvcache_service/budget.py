"""The budget of one pool: block states, namespace charges, admission and eviction."""

from __future__ import annotations

from collections import Counter

from kvcache_service.block_pool import BlockPool
from kvcache_service.counters import PoolCounters
from kvcache_service.errors import OutOfBlocks
from kvcache_service.eviction import EvictionOrder
from kvcache_service.ids import BlockId, Namespace
from kvcache_service.radix_index import RadixIndex

# Blocks to evict before an allocation: per namespace over its quota, then globally (None).
EvictionPlan = dict[Namespace | None, int]


class Budget:
    """Moves blocks between their states and charges every allocated block to a namespace.

    Every block is in exactly one state: free; referenced (refcount > 0: listed by live
    leases); or cached (indexed, refcount 0), which is evictable unless pinned. The budget is
    the only writer of the free list, the refcounts, the pin counts and the eviction order; the
    lease book and the admin operations change them through it.

    Admission is planned before anything changes (``plan``): fresh blocks fit when the free
    blocks plus the evictable ones cover them and, under a namespace quota, when the
    namespace's own evictable blocks cover what it would hold beyond the quota. A namespace at
    its quota evicts its own blocks, never another's.
    """

    def __init__(
        self,
        blocks: BlockPool,
        index: RadixIndex,
        order: EvictionOrder,
        counters: PoolCounters,
        quota: int | None,
    ) -> None:
        self.blocks = blocks
        self.index = index
        self.order = order
        self.counters = counters
        self.quota = quota  # blocks one namespace may hold (None: no quota)
        # Blocks charged to each namespace (its leases' own blocks and its indexed blocks):
        # from allocation until the block is free again.
        self._charged: dict[BlockId, Namespace] = {}
        self._used: Counter[Namespace] = Counter()

    # -- references and pins ------------------------------------------------------------------

    def ref(self, block: BlockId) -> None:
        """One more live lease lists `block`: it is not evictable while any does."""
        if self.blocks.refcount[block] == 0 and block in self.order:
            self.order.remove(block)
        self.blocks.refcount[block] += 1

    def ref_all(self, blocks: list[BlockId]) -> None:
        """`ref` of each of `blocks` (distinct), in one loop: an acquire refs a whole prefix."""
        # Evictable blocks are unreferenced, so all of them leave the order.
        self.order.discard_all(blocks)
        rc = self.blocks.refcount
        for b in blocks:
            rc[b] += 1

    def unref_all(self, blocks: list[BlockId]) -> None:
        """One reference fewer on each of `blocks`. The last reference frees an unindexed
        block and makes an indexed one evictable (unless pinned); callers pass a sequence's
        blocks deepest first, so that the eviction order keeps children ahead of parents."""
        rc, indexed = self.blocks.refcount, self.index.indexed
        unindexed: list[BlockId] = []
        evictable: list[BlockId] = []
        for b in blocks:  # ~65 ns a block; every call or C-speed filter pass costs more
            r = rc[b] - 1
            rc[b] = r
            if r:
                continue
            if b in indexed:
                evictable.append(b)
            else:
                unindexed.append(b)
        self._free(unindexed)
        if self.blocks.any_pinned:
            pins = self.blocks.pins
            evictable = [b for b in evictable if not pins[b]]
        self.order.push_all(evictable, self._charged)

    def pin(self, block: BlockId) -> None:
        self.blocks.pins[block] += 1
        self.blocks.any_pinned = True
        if block in self.order:
            self.order.remove(block)

    def unpin(self, block: BlockId) -> None:
        self.blocks.pins[block] -= 1
        if not self.blocks.pins[block] and not self.blocks.refcount[block]:
            self.order.push(block, self._charged[block])

    # -- admission and eviction ---------------------------------------------------------------

    def plan(self, needs: dict[Namespace, int], held: list[BlockId]) -> EvictionPlan:
        """Checks that `needs` fresh blocks (per namespace) fit; returns how many to evict, per
        namespace (quota) and globally (None). Raises OutOfBlocks before anything changes.

        Blocks in `held` are about to be referenced: cache hits count as already present,
        so they are neither evicted to make room nor counted as evictable.
        """
        held_evictable = self.order.among(held)
        plan: EvictionPlan = {}
        if self.quota is not None:
            held_by_ns = Counter(self._charged[b] for b in held_evictable)
            for ns, n in needs.items():
                over = self._used[ns] + n - self.quota
                if over <= 0:
                    continue
                if over > self.order.count(ns) - held_by_ns[ns]:
                    self.counters.exhausted += 1
                    raise OutOfBlocks(f"namespace {ns!r} is over its quota of blocks")
                plan[ns] = over
        by_quota = sum(plan.values())
        short = sum(needs.values()) - self.blocks.num_free - by_quota
        evictable = len(self.order) - len(held_evictable) - by_quota
        if short > evictable:
            self.counters.exhausted += 1
            raise OutOfBlocks(
                f"need {sum(needs.values())} blocks: {self.blocks.num_free} free, "
                f"{len(self.order) - len(held_evictable)} evictable"
            )
        plan[None] = max(0, short)
        return plan

    def beyond_reach(self, ns: Namespace, fresh: int, held: list[BlockId]) -> str | None:
        """Why `fresh` new blocks beside `held` could never be had in this pool, even with every
        lease ended and every evictable block evicted: pinned blocks stay (and, under a quota,
        the namespace's pinned and held blocks count against it); None if they could be.
        Called only once `plan` found no room: it looks at every pin (O(num_blocks))."""
        keep = set(held)
        pinned = [b for b, p in enumerate(self.blocks.pins) if p and b not in keep]
        reach = self.blocks.num_blocks - len(pinned)
        if len(held) + fresh > reach:
            return (
                f"the request needs {len(held) + fresh} KV blocks; this pool can give at most "
                f"{reach} of its {self.blocks.num_blocks} ({len(pinned)} are pinned)"
            )
        if self.quota is not None:
            own = sum(1 for b in pinned if self._charged.get(BlockId(b)) == ns)
            own += sum(1 for b in held if self._charged.get(b) == ns)
            if fresh + own > self.quota:
                return (
                    f"the request needs {fresh + own} KV blocks in namespace {ns!r}, over its "
                    f"quota of {self.quota} ({own} of them pinned or shared and kept)"
                )
        return None

    def allocate(self, plan: EvictionPlan, n: int, ns: Namespace) -> list[BlockId]:
        """Carries out what is left of `plan` (the first call of a batch evicts it all), then
        takes `n` free blocks charged to `ns`, each referenced once by the caller's lease. The
        blocks `plan` was made for must already be referenced, or the oldest evictable block
        could be one of them."""
        for target in [k for k in plan if plan[k]]:
            self._evict_oldest(plan.pop(target), target)
        fresh = self.blocks.allocate(n)
        self._charged.update(dict.fromkeys(fresh, ns))
        self._used[ns] += n
        return fresh

    def _evict_oldest(self, n: int, ns: Namespace | None) -> None:
        """Evicts the `n` oldest evictable blocks (of `ns`, if given): O(1) each, in batch."""
        victims = self.order.pop_oldest(n, ns)
        self.index.remove_leaves(victims)
        self._free(victims)
        self.counters.evicted_blocks += n

    def evict(self, block: BlockId) -> None:
        """Drops an evictable block (the last block of a leaf) from the index and frees it."""
        self.order.remove(block)
        self.index.remove_leaf_block(block)
        self._free([block])
        self.counters.evicted_blocks += 1

    def _free(self, blocks: list[BlockId]) -> None:
        """Uncharges `blocks` and returns them to the free list, in order."""
        if not blocks:
            return
        namespaces = list(map(self._charged.pop, blocks))
        first = namespaces[0]
        # Mostly one namespace: one C-speed count instead of a Counter.
        tally = (
            {first: len(namespaces)}
            if namespaces.count(first) == len(namespaces)
            else Counter(namespaces)
        )
        used = self._used
        for ns, k in tally.items():
            used[ns] -= k
            if not used[ns]:
                del used[ns]
        self.blocks.free(blocks)

    # -- accounting ---------------------------------------------------------------------------

    @property
    def charged(self) -> frozenset[BlockId]:
        return frozenset(self._charged)

    def check_integrity(self) -> list[str]:
        """The eviction order keeps every block ahead of its parent; charges add up."""
        found = []
        rank = {b: i for i, b in enumerate(self.order)}
        for b, i in rank.items():
            parent = self.index.parent_block(b) if b in self.index else None
            if parent is not None and parent in rank and rank[parent] < i:
                found.append(f"block {b} is younger than its parent {parent} in the LRU order")
        if Counter(self._charged.values()) != self._used:
            found.append("namespace charges disagree")
        return found
