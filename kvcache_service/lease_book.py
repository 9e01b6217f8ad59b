"""The live leases of one pool and their lifecycle: acquire, extend, commit, release, expire."""

from __future__ import annotations

from collections import Counter

from kvcache_service.block_pool import blocks_for
from kvcache_service.budget import Budget
from kvcache_service.counters import PoolCounters
from kvcache_service.errors import InvalidArgument, UnknownLease
from kvcache_service.ids import BlockId, LeaseId, Namespace, PoolId, Tokens
from kvcache_service.inflight import InFlight, chain_hashes
from kvcache_service.leases import AcquireRequest, Deferral, Grant, Lease, Reuse
from kvcache_service.radix_index import Match, RadixIndex


def reusable_tokens(match: Match, block_size: int, prompt_len: int) -> int:
    """How many of a prompt's tokens a lease reuses from `match`. At least one prompt token
    is always computed, so the model yields logits for the first output token: a fully cached
    prompt shares its last block copy-on-write."""
    return min(match.num_tokens(block_size), prompt_len - 1)


class LeaseBook:
    """Grants blocks to requests and takes them back.

    Owns the live leases and the in-flight map (prompt blocks that a live lease is still
    filling); inserts committed blocks into the index; takes fresh blocks from the budget and
    hands every reference back to it. A referenced block is never reassigned or written by a
    second lease: blocks a lease writes come off the free list and are only shared once
    committed, when they are full.
    """

    def __init__(
        self,
        pool_id: PoolId,
        block_size: int,
        index: RadixIndex,
        budget: Budget,
        counters: PoolCounters,
    ) -> None:
        self.pool_id = pool_id
        self.block_size = block_size
        self.index = index
        self.budget = budget
        self.counters = counters
        self.live: dict[LeaseId, Lease] = {}
        self.inflight = InFlight()

    def __len__(self) -> int:
        return len(self.live)

    def get(self, lease_id: LeaseId) -> Lease:
        lease = self.live.get(lease_id)
        if lease is None:
            raise UnknownLease(f"no live lease {lease_id} on pool {self.pool_id!r}")
        return lease

    def acquire(
        self, lease_id: LeaseId, req: AcquireRequest, now: float, expires_at: float
    ) -> Grant | Deferral:
        """A lease on `req.prompt` plus its reserve: the matched prefix shared, a partially
        matched block copied on write into the first fresh block, fresh blocks for the rest
        (evicting cached ones if needed). Or a Deferral (SHARE_OR_DEFER only), or OutOfBlocks."""
        bs = self.block_size
        ns, prompt = req.namespace, req.prompt
        match = Match() if req.reuse is Reuse.NONE else self.index.match(ns, prompt)
        cached = reusable_tokens(match, bs, len(prompt))
        full, part = divmod(cached, bs)
        shared = list(match.blocks[:full])
        cow_src = None
        if part:
            cow_src = match.blocks[full] if full < len(match.blocks) else match.partial_block
        chain = chain_hashes(ns, prompt, bs)
        if req.reuse is Reuse.SHARE_OR_DEFER:
            pending, filler = self.pending(chain, full, cached, len(prompt))
            if filler is not None and pending > 0:
                self.counters.deferrals += 1
                return Deferral(filler, cached, pending)

        need = blocks_for(len(prompt) + req.reserve_tokens, bs) - full
        held = [*shared, cow_src] if cow_src is not None else shared
        plan = self.budget.plan({ns: need}, held)
        lease = Lease(lease_id, ns, prompt, [], cached, None, full, chain=chain)
        for pos, b in enumerate(held):  # referenced first: the plan's evictions spare them
            self._ref(lease, b, pos)
        fresh = self.budget.allocate(plan, need, ns)
        for pos, b in enumerate(fresh, start=full):
            self._ref(lease, b, pos)
        lease.table = shared + fresh
        lease.indexed_blocks = full
        if cow_src is not None:
            lease.cow = (cow_src, fresh[0])
        self.inflight.register(lease_id, chain, full)
        self.live[lease_id] = lease
        self.index.touch(held, now)
        c = self.counters
        c.acquires += 1
        c.acquire_hits += cached > 0
        c.prompt_tokens += len(prompt)
        c.cached_tokens += cached
        cow = (lease.cow,) if lease.cow is not None else ()
        return Grant(lease_id, tuple(lease.table), cached, cow, expires_at)

    def pending(
        self, chain: list[int], full: int, cached: int, prompt_len: int
    ) -> tuple[int, LeaseId | None]:
        """Prompt tokens past the `cached` ones (`full` blocks) that live leases are still
        filling, and the lease filling the first of them."""
        if full >= len(chain):
            return 0, None
        run, filler = self.inflight.pending_run(chain, full)
        return max(0, min((full + run) * self.block_size, prompt_len - 1) - cached), filler

    def extend(self, items: list[tuple[LeaseId, int]]) -> list[tuple[LeaseId, list[BlockId]]]:
        """Grows each lease to cover its token count; all or nothing."""
        needs: Counter[Namespace] = Counter()
        grow = []
        for lease_id, num_tokens in items:
            lease = self.get(lease_id)
            n = max(0, blocks_for(num_tokens, self.block_size) - len(lease.table))
            needs[lease.namespace] += n
            grow.append((lease, n))
        plan = self.budget.plan(dict(needs), [])
        out = []
        for lease, n in grow:
            fresh = self.budget.allocate(plan, n, lease.namespace)
            for pos, b in enumerate(fresh, start=len(lease.table)):
                self._ref(lease, b, pos)
            lease.table.extend(fresh)
            out.append((lease.lease_id, fresh))
        return out

    def commit(self, lease_id: LeaseId, tokens: Tokens, now: float) -> int:
        """Publishes the lease's full blocks of `tokens` (the sequence whose KV is written)."""
        lease = self.get(lease_id)
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
        """Commits `tokens` (when given) and ends the lease; returns the tokens indexed."""
        indexed = self.commit(lease_id, tokens, now) if tokens else 0
        self._end(self.get(lease_id))
        return indexed

    def expire_all(self) -> list[LeaseId]:
        expired = list(self.live)
        for lease_id in expired:
            self._end(self.live[lease_id])
        self.counters.expired_leases += len(expired)
        return expired

    def _ref(self, lease: Lease, block: BlockId, pos: int) -> None:
        if block in lease.refs:
            return
        lease.refs[block] = pos
        self.budget.ref(block)

    def _end(self, lease: Lease) -> None:
        del self.live[lease.lease_id]
        self.inflight.ended(lease.lease_id)
        # Deepest first, so the eviction order keeps children ahead of their parents.
        for b, _pos in sorted(lease.refs.items(), key=lambda kv: -kv[1]):
            self.budget.unref(b)

    # -- accounting ---------------------------------------------------------------------------

    def references(self) -> Counter[BlockId]:
        """How many live leases reference each block (what its refcount must be)."""
        listed: Counter[BlockId] = Counter()
        for lease in self.live.values():
            listed.update(lease.refs.keys())
        return listed

    def check_integrity(self) -> list[str]:
        """Blocks a lease writes are its own; every lease references its whole table."""
        found = []
        rc = self.budget.blocks.refcount
        for lease in self.live.values():
            for pos in range(lease.indexed_blocks, len(lease.table)):
                b = lease.table[pos]
                if pos >= lease.shared_blocks and (rc[b] != 1 or b in self.index):
                    found.append(f"writable block {b} of lease {lease.lease_id} is shared")
            if set(lease.table) - lease.refs.keys():
                found.append(f"lease {lease.lease_id} does not reference its whole table")
        return found + self.inflight.check_integrity(set(self.live))
