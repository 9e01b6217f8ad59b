"""One registered worker pool: its blocks, index, eviction order, leases and counters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvcache_service.block_pool import BlockPool
from kvcache_service.errors import InvalidArgument, NotFound, OutOfBlocks, UnknownLease
from kvcache_service.eviction import EvictionOrder
from kvcache_service.ids import BlockId, LeaseId, Namespace, PoolId, Tokens
from kvcache_service.inflight import InFlight, chain_hashes
from kvcache_service.integrity import IntegritySnapshot
from kvcache_service.leases import Deferral, Grant, Lease
from kvcache_service.radix_index import Match, RadixIndex


@dataclass(frozen=True, slots=True)
class PoolSpec:
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


@dataclass(slots=True)
class PoolCounters:
    acquires: int = 0
    acquire_hits: int = 0
    deferrals: int = 0
    exhausted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evicted_blocks: int = 0
    expired_leases: int = 0


@dataclass(frozen=True, slots=True)
class Lookup:
    cached_tokens: int
    matched_blocks: tuple[BlockId, ...]
    pending_tokens: int
    blocks_needed: int


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class PoolState:
    """Block metadata of one worker pool. Pure domain: no clocks, no gRPC, no locks.

    Every block is in exactly one state: free; referenced (refcount > 0: listed by live
    leases); or cached (indexed, refcount 0), which is evictable unless pinned. A referenced
    block is never evicted, reassigned or written by a second lease: blocks a lease writes
    come off the free list and are only shared once committed, when they are full.
    """

    def __init__(self, spec: PoolSpec, incarnation: int, namespace_quota: int = 0) -> None:
        self.spec = spec
        self.incarnation = incarnation
        self.block_size = spec.block_size
        self.namespace_quota = namespace_quota
        self.blocks = BlockPool(spec.num_blocks)
        self.index = RadixIndex(spec.block_size)
        self.order = EvictionOrder()
        self.inflight = InFlight()
        self.leases: dict[LeaseId, Lease] = {}
        self.counters = PoolCounters()
        # Blocks charged to each namespace (its leases' own blocks and its indexed blocks).
        self._block_ns: dict[BlockId, Namespace] = {}
        self._ns_used: Counter[Namespace] = Counter()
        self._pins: dict[tuple[Namespace, Tokens], tuple[BlockId, ...]] = {}

    # -- the lease lifecycle ------------------------------------------------------------------

    def acquire(
        self,
        lease_id: LeaseId,
        ns: Namespace,
        prompt: Tokens,
        reserve: int,
        expires_at: float,
        now: float,
        allow_defer: bool = False,
        skip_cache: bool = False,
    ) -> Grant | Deferral:
        bs = self.block_size
        match = Match() if skip_cache else self.index.match(ns, prompt)
        # At least one prompt token is always computed, so the model yields logits for the
        # first output token: a fully cached prompt shares its last block copy-on-write.
        cached = min(match.num_tokens(bs), len(prompt) - 1)
        full, part = divmod(cached, bs)
        shared = list(match.blocks[:full])
        cow_src = None
        if part:
            cow_src = match.blocks[full] if full < len(match.blocks) else match.partial_block
        chain = chain_hashes(ns, prompt, bs)
        if allow_defer and not skip_cache and full < len(chain):
            run, filler = self.inflight.pending_run(chain, full)
            pending = min((full + run) * bs, len(prompt) - 1) - cached
            if filler is not None and pending > 0:
                self.counters.deferrals += 1
                return Deferral(filler, cached, pending)

        need = blocks_for(len(prompt) + reserve, bs) - full
        held = [*shared, cow_src] if cow_src is not None else shared
        evictions = self._plan({ns: need}, held)
        lease = Lease(lease_id, ns, prompt, [], cached, None, full, chain=chain)
        for pos, b in enumerate(held):
            self._ref(lease, b, pos)
        fresh = self._allocate(evictions, need, ns)
        for pos, b in enumerate(fresh, start=full):
            self._ref(lease, b, pos)
        lease.table = shared + fresh
        lease.indexed_blocks = full
        if cow_src is not None:
            lease.cow = (cow_src, fresh[0])
        self.inflight.register(lease_id, chain, full)
        self.leases[lease_id] = lease
        self.index.touch(held, now)
        c = self.counters
        c.acquires += 1
        c.acquire_hits += cached > 0
        c.prompt_tokens += len(prompt)
        c.cached_tokens += cached
        return self.grant(lease, expires_at)

    def grant(self, lease: Lease, expires_at: float) -> Grant:
        cow = (lease.cow,) if lease.cow is not None else ()
        return Grant(lease.lease_id, tuple(lease.table), lease.cached_tokens, cow, expires_at)

    def extend(self, items: list[tuple[LeaseId, int]]) -> list[tuple[LeaseId, list[BlockId]]]:
        """Grows each lease to cover its token count; all or nothing."""
        needs: Counter[Namespace] = Counter()
        plan = []
        for lease_id, num_tokens in items:
            lease = self.lease(lease_id)
            n = max(0, blocks_for(num_tokens, self.block_size) - len(lease.table))
            needs[lease.namespace] += n
            plan.append((lease, n))
        evictions = self._plan(dict(needs), [])
        out = []
        for lease, n in plan:
            fresh = self._allocate(evictions, n, lease.namespace)
            for pos, b in enumerate(fresh, start=len(lease.table)):
                self._ref(lease, b, pos)
            lease.table.extend(fresh)
            out.append((lease.lease_id, fresh))
        return out

    def commit(self, lease_id: LeaseId, tokens: Tokens, now: float) -> int:
        """Publishes the lease's full blocks of `tokens` (the sequence whose KV is written)."""
        lease = self.lease(lease_id)
        bs = self.block_size
        if len(tokens) > len(lease.table) * bs:
            raise InvalidArgument(
                f"lease {lease_id} covers {len(lease.table) * bs} tokens, commit has {len(tokens)}"
            )
        common = min(len(tokens), len(lease.tokens))
        if tokens[:common] != lease.tokens[:common]:
            raise InvalidArgument(f"commit tokens disagree with lease {lease_id}'s sequence")
        if len(tokens) > len(lease.tokens):
            lease.tokens = tokens
        nfull = len(tokens) // bs
        if nfull <= lease.indexed_blocks:
            return lease.indexed_blocks * bs
        canonical = self.index.insert(lease.namespace, tokens[: nfull * bs], lease.table[:nfull])
        for pos in range(lease.indexed_blocks, nfull):
            if canonical[pos] != lease.table[pos]:
                self._ref(lease, canonical[pos], pos)  # adopt: keeps its path referenced
        lease.indexed_blocks = nfull
        self.inflight.committed(lease_id, set(lease.chain[:nfull]))
        self.index.touch(canonical, now)
        return nfull * bs

    def release(self, lease_id: LeaseId, tokens: Tokens, now: float) -> int:
        indexed = self.commit(lease_id, tokens, now) if tokens else 0
        self._end(self.lease(lease_id))
        return indexed

    def expire_all(self) -> list[LeaseId]:
        expired = list(self.leases)
        for lease_id in expired:
            self._end(self.leases[lease_id])
        self.counters.expired_leases += len(expired)
        return expired

    def lease(self, lease_id: LeaseId) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise UnknownLease(f"no live lease {lease_id} on pool {self.spec.pool_id!r}")
        return lease

    def _end(self, lease: Lease) -> None:
        del self.leases[lease.lease_id]
        self.inflight.ended(lease.lease_id)
        # Deepest first, so the eviction order keeps children ahead of their parents.
        for b, _pos in sorted(lease.refs.items(), key=lambda kv: -kv[1]):
            self._unref(b)

    # -- references and the budget ------------------------------------------------------------

    def _ref(self, lease: Lease, block: BlockId, pos: int) -> None:
        if block in lease.refs:
            return
        lease.refs[block] = pos
        if self.blocks.refcount[block] == 0 and block in self.order:
            self.order.remove(block)
        self.blocks.refcount[block] += 1

    def _unref(self, block: BlockId) -> None:
        self.blocks.refcount[block] -= 1
        if self.blocks.refcount[block]:
            return
        if block not in self.index:
            self._free(block)
        elif not self.blocks.pins[block]:
            self.order.push(block, self._block_ns[block])

    def _plan(
        self, needs: dict[Namespace, int], held: list[BlockId]
    ) -> dict[Namespace | None, int]:
        """Checks that `needs` fresh blocks fit; returns how many to evict, per namespace
        (quota) and globally (None). Raises OutOfBlocks before anything changes.

        Blocks in `held` are about to be referenced: cache hits count as already present,
        so they are neither evicted to make room nor counted as evictable.
        """
        held_evictable = Counter(self._block_ns[b] for b in held if b in self.order)
        plan: dict[Namespace | None, int] = {}
        if self.namespace_quota:
            for ns, n in needs.items():
                over = self._ns_used[ns] + n - self.namespace_quota
                if over <= 0:
                    continue
                if over > self.order.count(ns) - held_evictable[ns]:
                    self.counters.exhausted += 1
                    raise OutOfBlocks(f"namespace {ns!r} is over its quota of blocks")
                plan[ns] = over
        by_quota = sum(plan.values())
        short = sum(needs.values()) - self.blocks.num_free - by_quota
        evictable = len(self.order) - sum(held_evictable.values()) - by_quota
        if short > evictable:
            self.counters.exhausted += 1
            raise OutOfBlocks(
                f"need {sum(needs.values())} blocks: {self.blocks.num_free} free, "
                f"{len(self.order) - sum(held_evictable.values())} evictable"
            )
        plan[None] = max(0, short)
        return plan

    def _allocate(self, plan: dict[Namespace | None, int], n: int, ns: Namespace) -> list[BlockId]:
        for target in [k for k in plan if plan[k]]:
            for _ in range(plan.pop(target)):
                self._evict(self.order.oldest(target))
        fresh = self.blocks.allocate(n)
        for b in fresh:
            self._block_ns[b] = ns
        self._ns_used[ns] += n
        return fresh

    def _evict(self, block: BlockId) -> None:
        self.order.remove(block)
        self.index.remove_leaf_block(block)
        self._free(block)
        self.counters.evicted_blocks += 1

    def _free(self, block: BlockId) -> None:
        ns = self._block_ns.pop(block)
        self._ns_used[ns] -= 1
        if not self._ns_used[ns]:
            del self._ns_used[ns]
        self.blocks.free(block)

    # -- admin --------------------------------------------------------------------------------

    def evict_lru(self, n: int) -> int:
        done = 0
        while done < n and len(self.order):
            self._evict(self.order.oldest())
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

    def _evict_all(self, leaves_first: list[BlockId]) -> int:
        done = 0
        for b in leaves_first:
            # A referenced or pinned block's ancestors are referenced or pinned too, so
            # skipping it never strands an evictable child.
            if b in self.order:
                self._evict(b)
                done += 1
        return done

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
            self.blocks.pins[b] += 1
            if b in self.order:
                self.order.remove(b)
        return len(match.blocks)

    def unpin(self, ns: Namespace, prefix: Tokens) -> int:
        blocks = self._pins.pop(self._pin_key(ns, prefix), None)
        if blocks is None:
            raise NotFound(f"that prefix is not pinned in namespace {ns!r}")
        for b in reversed(blocks):
            self.blocks.pins[b] -= 1
            if not self.blocks.pins[b] and not self.blocks.refcount[b]:
                self.order.push(b, self._block_ns[b])
        return len(blocks)

    def _pin_key(self, ns: Namespace, prefix: Tokens) -> tuple[Namespace, Tokens]:
        return ns, prefix[: len(prefix) // self.block_size * self.block_size]

    def lookup(self, ns: Namespace, prompt: Tokens) -> Lookup:
        bs = self.block_size
        match = self.index.match(ns, prompt)
        cached = min(match.num_tokens(bs), len(prompt) - 1)
        full = cached // bs
        chain = chain_hashes(ns, prompt, bs)
        run, _ = self.inflight.pending_run(chain, full) if full < len(chain) else (0, None)
        pending = max(0, min((full + run) * bs, len(prompt) - 1) - cached)
        return Lookup(cached, match.blocks[:full], pending, blocks_for(len(prompt), bs) - full)

    def match_tokens(self, ns: Namespace, prompt: Tokens) -> int:
        return min(self.index.match(ns, prompt).num_tokens(self.block_size), len(prompt) - 1)

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
        rc = self.blocks.refcount
        listed: Counter[BlockId] = Counter()
        for lease in self.leases.values():
            listed.update(lease.refs.keys())
            for pos in range(lease.indexed_blocks, len(lease.table)):
                b = lease.table[pos]
                if pos >= lease.shared_blocks and (rc[b] != 1 or b in self.index):
                    found.append(f"writable block {b} of lease {lease.lease_id} is shared")
            if set(lease.table) - lease.refs.keys():
                found.append(f"lease {lease.lease_id} does not reference its whole table")
        indexed = frozenset(self.index_blocks())
        seen: dict[BlockId, int] = {}
        for i, b in enumerate(self.order):
            seen[b] = i
        for b, i in seen.items():
            parent = self.index.parent_block(b) if b in indexed else None
            if parent is not None and parent in seen and seen[parent] < i:
                found.append(f"block {b} is younger than its parent {parent} in the LRU order")
        if Counter(self._block_ns.values()) != self._ns_used:
            found.append("namespace charges disagree")
        pin_counts: Counter[BlockId] = Counter()
        for blocks in self._pins.values():
            pin_counts.update(blocks)
        found += self.inflight.check_integrity(set(self.leases))
        return IntegritySnapshot(
            label=f"pool {self.spec.pool_id!r}",
            blocks=self.blocks.snapshot(),
            found=found,
            listed=listed,
            indexed=indexed,
            evictable=frozenset(seen),
            charged=frozenset(self._block_ns),
            pin_counts=pin_counts,
        )
