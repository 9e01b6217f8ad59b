"""The live leases of one pool and their lifecycle: acquire, extend, commit, release, expire.

Over 300 lines on purpose: one class whose steps all move the same references, in-flight
entries and index insertions; the refcount invariant (a block's refcount is the live leases
listing it) holds only if every step keeps it, so they stay side by side.
"""

from __future__ import annotations

from collections import Counter

from kvcache_service.block_pool import blocks_for
from kvcache_service.budget import Budget
from kvcache_service.counters import PoolCounters
from kvcache_service.errors import InvalidArgument, NeverFits, OutOfBlocks, UnknownLease
from kvcache_service.ids import BlockId, LeaseId, Namespace, PoolId, Tokens
from kvcache_service.inflight import InFlight, chain_hashes, chain_seed
from kvcache_service.leases import AcquireRequest, Deferral, Grant, Lease, Reuse, SequenceUpdate
from kvcache_service.radix_index import Match, RadixIndex
from kvcache_service.tier_index import TierIndex
from kvcache_service.tokens import TOKEN_BYTES, count


def reusable_tokens(match: Match, block_size: int, prompt_len: int) -> int:
    """How many of a prompt's tokens a lease reuses from `match`. At least one prompt token
    is always computed, so the model yields logits for the first output token: a fully cached
    prompt shares its last block copy-on-write."""
    return min(match.num_tokens(block_size), prompt_len - 1)


def tier_reuse(
    tiers: TierIndex, chain: list[int], cached: int, block_size: int, prompt_len: int
) -> tuple[int, int]:
    """(cached tokens, tier blocks) once the pool's tiers are asked: how many blocks from
    block ``cached // block_size`` on (``chain``: their keys) the tiers hold, so many that at
    least one prompt token is still computed. When they hold any, a partial match into the
    first of them is dropped: loading the whole block beats copying part of it. No side
    effects: Route and Lookup ask it too."""
    full = cached // block_size
    limit = (prompt_len - 1) // block_size - full
    if limit <= 0 or not tiers:
        return cached, 0
    k = tiers.run(chain[:limit])
    return (full * block_size if k else cached), k


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
        tiers: TierIndex | None = None,
    ) -> None:
        self.pool_id = pool_id
        self.block_size = block_size
        self.index = index
        self.budget = budget
        self.counters = counters
        self.tiers = tiers if tiers is not None else TierIndex()
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
        self, lease_id: LeaseId, req: AcquireRequest, prompt: Tokens, now: float, expires_at: float
    ) -> Grant | Deferral:
        """A lease on `prompt` (`req.prompt` checked and packed) plus its reserve: the matched
        prefix shared, a partially matched block copied on write into the first fresh block
        (or, a tail nobody holds, taken over: see `_adoptable`), fresh blocks for the rest
        (evicting cached ones if needed). Or a Deferral (SHARE_OR_DEFER only); OutOfBlocks
        where the pool has no room now, NeverFits where it never could (pins, a quota).

        Past the shared prefix, the blocks the pool's tiers hold (``tier_reuse``) are granted
        to be loaded (``Grant.tier_blocks``): ordinary fresh blocks of the lease, in the
        in-flight map like the rest, so that a concurrent acquire of the prefix waits for
        them instead of loading them twice."""
        bs = self.block_size
        ns, n = req.namespace, count(prompt)
        match = Match() if req.reuse is Reuse.NONE else self.index.match(ns, prompt)
        cached = reusable_tokens(match, bs, n)
        full, part = divmod(cached, bs)
        shared = list(match.blocks[:full])
        cow_src = None
        if part:
            cow_src = match.blocks[full] if full < len(match.blocks) else match.partial_block
        # Only the blocks past the shared prefix are hashed: the index knows the rest.
        base = self.index.chain_hash(shared[-1]) if shared else chain_seed(ns)
        chain = chain_hashes(base, prompt, full, self.index.chunk_bytes)
        if req.reuse is Reuse.SHARE_OR_DEFER:
            pending, filler = self.pending(chain, full, cached, n)
            if filler is not None and pending > 0:
                self.counters.deferrals += 1
                return Deferral(filler, cached, pending)
        tier_blocks = 0
        if req.reuse is not Reuse.NONE and self.tiers:
            cached, tier_blocks = tier_reuse(self.tiers, chain, cached, bs, n)
            if tier_blocks:
                cow_src = None  # nor copied nor taken over: the whole block is loaded

        adopt = cow_src is not None and self._adoptable(cow_src)
        need = blocks_for(n + req.reserve_tokens, bs) - full
        held = [*shared, cow_src] if cow_src is not None else shared
        own = self._take_blocks(ns, need - adopt, held)
        if adopt:
            assert cow_src is not None
            self.index.remove_leaves([cow_src])  # this lease's own block now, not a cache entry
            own.insert(0, cow_src)
            cow_src = None
        lease = Lease(lease_id, ns, prompt, shared + own, cached, None, full, adopted=adopt)
        lease.refs = dict(zip(held, range(len(held)), strict=True))
        lease.refs.update(zip(own, range(full, full + need), strict=True))
        lease.indexed_blocks = full
        lease.last_indexed = shared[-1] if shared else None
        lease.chain_base, lease.chain = base, chain
        if cow_src is not None:
            lease.cow = (cow_src, own[0])
        self.inflight.register(lease_id, chain, full)
        self.live[lease_id] = lease
        used = cow_src if cow_src is not None else shared[-1] if shared else None
        if used is not None:
            self.index.touch(used, now)
        c = self.counters
        if req.reuse is not Reuse.NONE and self.tiers:
            if shared:  # hot prefixes stay young in the tiers too
                self.tiers.touch((base,))
            self.tiers.load(chain[:tier_blocks])
            c.tier_hit_tokens += tier_blocks * bs
        c.acquires += 1
        c.acquire_hits += cached > 0
        c.prompt_tokens += n
        c.cached_tokens += cached
        cow = (lease.cow,) if lease.cow is not None else ()
        return Grant(lease_id, tuple(lease.table), cached, cow, expires_at, tier_blocks)

    def _take_blocks(self, ns: Namespace, need: int, held: list[BlockId]) -> list[BlockId]:
        """``need`` fresh blocks for ``ns`` (evicting cached ones if needed), with ``held``
        referenced first so the evictions spare them. OutOfBlocks where the pool has no room
        now, NeverFits where it never could."""
        try:
            plan = self.budget.plan({ns: need}, held)
        except OutOfBlocks:
            if (why := self.budget.beyond_reach(ns, need, held)) is not None:
                raise NeverFits(why) from None
            raise
        self.budget.ref_all(held)  # referenced first: the plan's evictions spare them
        return self.budget.allocate(plan, need, ns)

    def _adoptable(self, block: BlockId) -> bool:
        """Whether a lease whose prompt continues a tail (a finished sequence's partial last
        block) takes it over instead of copying it: when no lease holds it and it is not
        pinned, the tail is what the next turn of its chat extends, and a copy would leave it
        behind as a second cached version of the same tokens, outlived by the longer one."""
        rc, pins = self.budget.blocks.refcount, self.budget.blocks.pins
        return not rc[block] and not pins[block] and self.index.holds_tail(block)

    def pending(
        self, chain: list[int], full: int, cached: int, prompt_len: int
    ) -> tuple[int, LeaseId | None]:
        """Prompt tokens past the `cached` ones (`full` blocks) that live leases are still
        filling, and the lease filling the first of them; `chain`: the prompt's chain hashes
        from block `full` on."""
        if not chain:
            return 0, None
        run, filler = self.inflight.pending_run(chain)
        return max(0, min((full + run) * self.block_size, prompt_len - 1) - cached), filler

    def extend(self, items: list[tuple[LeaseId, int]]) -> list[tuple[LeaseId, list[BlockId]]]:
        """Grows each lease to cover its token count; all or nothing."""
        needs: dict[Namespace, int] = {}
        grow = []
        for lease_id, num_tokens in items:
            lease = self.get(lease_id)
            n = max(0, blocks_for(num_tokens, self.block_size) - len(lease.table))
            needs[lease.namespace] = needs.get(lease.namespace, 0) + n
            grow.append((lease, n))
        plan = self.budget.plan(needs, [])
        out = []
        for lease, n in grow:
            fresh = self.budget.allocate(plan, n, lease.namespace)
            end = len(lease.table)
            lease.refs.update(zip(fresh, range(end, end + n), strict=True))
            lease.table += fresh
            out.append((lease.lease_id, fresh))
        return out

    def commit(self, lease_id: LeaseId, update: SequenceUpdate, now: float) -> int:
        """Applies ``update`` to the lease's sequence and publishes the full blocks of its
        written tokens; returns the leading tokens now indexed. A refused update changes
        nothing.

        Only what is new is indexed: the walk starts where the lease's last commit ended.
        """
        lease = self.get(lease_id)
        bs = self.block_size
        lease.tokens = tokens = self._updated(lease, update)
        n = update.written
        nfull = n // bs
        start = lease.indexed_blocks
        if nfull <= start:
            return start * bs
        shared = lease.shared_blocks
        hashes = self._chain_through(lease, nfull)[start - shared : nfull - shared]
        canonical = self.index.insert(
            lease.namespace, tokens, start, lease.last_indexed, lease.table[start:nfull], hashes
        )
        table = lease.table
        for pos, b in enumerate(canonical, start):
            if b != table[pos]:
                self._ref(lease, b, pos)  # adopt: keeps its path referenced
        lease.indexed_blocks = nfull
        lease.last_indexed = canonical[-1]
        self.inflight.committed(lease_id, nfull)
        self.index.touch(canonical[-1], now)
        return nfull * bs

    def _updated(self, lease: Lease, update: SequenceUpdate) -> Tokens:
        """The lease's sequence with ``update`` applied, checked: appended from no later than
        its end, agreeing where they overlap (one memcmp), within the lease's table, and at
        least ``update.written`` tokens long."""
        known, add = lease.tokens, update.appended
        at = update.appended_from * TOKEN_BYTES
        if at > len(known):
            raise InvalidArgument(
                f"lease {lease.lease_id} knows {len(known) // TOKEN_BYTES} tokens; an update "
                f"cannot append from {update.appended_from}"
            )
        overlap = min(len(known) - at, len(add))
        # One memcmp (a whole-bytes slice is the object itself, not a copy).
        if not known.startswith(add[:overlap], at, at + overlap):
            raise InvalidArgument(f"tokens disagree with lease {lease.lease_id}'s sequence")
        tokens = known if at + len(add) <= len(known) else Tokens(known + add[overlap:])
        covered = len(lease.table) * self.block_size
        n = len(tokens) // TOKEN_BYTES
        if n > covered:
            raise InvalidArgument(f"lease {lease.lease_id} covers {covered} tokens, update has {n}")
        if not 0 <= update.written <= n:
            raise InvalidArgument(
                f"lease {lease.lease_id}: {update.written} tokens written of {n} known"
            )
        return tokens

    def _chain_through(self, lease: Lease, nfull: int) -> list[int]:
        """The lease's chain, hashed through block `nfull - 1` (blocks past its prompt are
        hashed here, once: `lease.tokens` holds them by now)."""
        chain = lease.chain
        have = lease.shared_blocks + len(chain)
        if nfull > have:
            seed = chain[-1] if chain else lease.chain_base
            cb = self.index.chunk_bytes
            chain += chain_hashes(seed, lease.tokens, have, cb, nfull)
        return chain

    def release(self, lease_id: LeaseId, update: SequenceUpdate | None, now: float) -> int:
        """Applies ``update`` (when given: see commit) and ends the lease; returns the tokens
        indexed, its partial last block's included (see _index_tail). A refused update leaves
        the lease live."""
        if update is None:
            self._end(self.get(lease_id))
            return 0
        indexed = self.commit(lease_id, update, now)
        lease = self.get(lease_id)
        tail = self._index_tail(lease, update.written, now)
        # The tail enters the eviction order with the lease's other blocks, by recency like
        # them (deepest first, so before its parents). It used to go to the old end, first to
        # be evicted: worth 0.4% of the trace replay's token hit rate, but on a pool full of
        # cached blocks (any server that has run a while) every chat's tail went at the next
        # allocation, before blocks untouched for minutes: the next turn of 2 chats in 4
        # prefilled up to a block more, 54 -> 80 tokens (docs/architecture.md, tails).
        self._end(lease)
        return indexed if tail is None else update.written

    def _index_tail(self, lease: Lease, written: int, now: float) -> BlockId | None:
        """Indexes the partial block the ending lease wrote last, so that the next turn of a
        chat reuses all of its history (copying the block on write), not only its full blocks.

        Only a block of the lease's own whose tokens' KV it holds: written past what the lease
        reused (a copy-on-write destination is filled at the first write, so a lease that
        wrote nothing may hold an empty copy), or a tail it took over (which held its tokens
        from the start: a turn that ends before writing gives it back). And only right after
        its last indexed block (a commit that adopted another lease's canonical blocks still
        ends there).
        """
        nfull, part = divmod(written, self.block_size)
        if not part or lease.indexed_blocks != nfull:
            return None
        if written <= lease.cached_tokens and not lease.adopted:
            return None
        if nfull >= len(lease.table) or nfull < lease.shared_blocks:
            return None
        block = lease.table[nfull]
        if block in self.index:
            return None
        tokens = Tokens(lease.tokens[: written * TOKEN_BYTES])
        if not self.index.insert_tail(lease.namespace, tokens, nfull, lease.last_indexed, block):
            return None
        self.index.touch(block, now)
        return block

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
        # Deepest first, so the eviction order keeps children ahead of their parents; equal
        # positions (a copy-on-write source, an adopted block) in the order they were taken.
        # Mostly the refs are the table, whose reversal is that order, or the table and the
        # copy-on-write source, taken before the block it was copied into (~half each here).
        refs, table = lease.refs, lease.table
        if len(refs) == len(table):
            deepest_first = table[::-1]
        elif len(refs) == len(table) + 1 and lease.cow is not None:
            deepest_first = table[::-1]
            deepest_first.insert(len(table) - 1 - lease.shared_blocks, lease.cow[0])
        else:  # stable: reverse=True keeps equal positions in insertion order
            deepest_first = sorted(refs, key=refs.__getitem__, reverse=True)
        self.budget.unref_all(deepest_first)

    # -- accounting ---------------------------------------------------------------------------

    def references(self) -> Counter[BlockId]:
        """How many live leases reference each block (what its refcount must be)."""
        listed: Counter[BlockId] = Counter()
        for lease in self.live.values():
            listed.update(lease.refs.keys())
        return listed

    def check_integrity(self) -> list[str]:
        """Blocks a lease writes are its own; every lease references its whole table; the
        walk of its next commit starts at its last indexed block."""
        found = []
        rc = self.budget.blocks.refcount
        for lease in self.live.values():
            for pos in range(lease.indexed_blocks, len(lease.table)):
                b = lease.table[pos]
                if pos >= lease.shared_blocks and (rc[b] != 1 or b in self.index):
                    found.append(f"writable block {b} of lease {lease.lease_id} is shared")
            if set(lease.table) - lease.refs.keys():
                found.append(f"lease {lease.lease_id} does not reference its whole table")
            last = lease.last_indexed
            if (last is None) != (lease.indexed_blocks == 0) or (
                last is not None
                and (last not in self.index or lease.refs.get(last) != lease.indexed_blocks - 1)
            ):
                found.append(f"lease {lease.lease_id}: its last indexed block is not held")
        return found + self.inflight.check_integrity(set(self.live))
