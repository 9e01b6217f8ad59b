"""Randomized operation sequences against the naive reference model (tests/kvcache/reference.py).

Every step runs one operation on the real CacheAuthority and mirrors it on the reference;
then the index content, refcounts, free count, eviction order and lease tables must agree,
and check_integrity() must find nothing. Twice: without a namespace quota, and with one
(a namespace over it evicts its own blocks first).
"""

from __future__ import annotations

import grpc
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gateway.errors import PoolTooSmall, from_status
from kvcache_service.authority import AuthorityConfig, CacheAuthority
from kvcache_service.errors import NeverFits, NotFound, OutOfBlocks
from kvcache_service.ids import Namespace, PoolId
from kvcache_service.leases import AcquireRequest, Deferral, Grant, Reuse, SequenceUpdate
from kvcache_service.pool import PoolSpec, PoolState
from kvcache_service.tokens import pack
from tests.kvcache.reference import RefLease, RefPool

TTL = 10.0
POOLS = {"a": (14, 3), "b": (24, 2)}  # pool id -> (num_blocks, block_size)
NAMESPACES = ["", "tenant-1"]
STEMS = [
    (1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2),
    (1, 2, 3, 3, 2, 1, 0, 0, 1, 1, 2, 2, 3, 3),
    (2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2),
]


def real_index_view(pool: PoolState) -> dict[tuple[str, tuple[int, ...]], int]:
    """(namespace, prefix through the block) -> block, read off the real tree."""
    bs = pool.block_size
    out = {}
    for ns, root in pool.index.roots.items():
        stack = [(child, ()) for child in root.children.values()]
        while stack:
            node, head = stack.pop()
            for j, b in enumerate(node.blocks):
                out[(ns, head + node.tokens[: (j + 1) * bs])] = b
            stack.extend((c, head + node.tokens) for c in node.children.values())
    return out


def machine_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


prompts = st.builds(
    lambda stem, cut, tail: stem[:cut] + tuple(tail),
    st.sampled_from(STEMS),
    st.integers(1, 14),
    st.lists(st.integers(0, 3), max_size=5),
)


class PoolMachine(RuleBasedStateMachine):
    QUOTA: int | None = None  # blocks one namespace may hold in a pool
    SIZES = POOLS

    @initialize()
    def setup(self) -> None:
        self.now = 1000.0
        config = AuthorityConfig(lease_ttl_s=TTL, namespace_quota_blocks=self.QUOTA)
        self.auth = CacheAuthority(config, clock=lambda: self.now)
        self.inc: dict[str, int] = {}
        self.ref: dict[str, RefPool] = {}
        for pool_id in POOLS:
            self._register(pool_id)

    def _register(self, pool_id: str) -> None:
        n, bs = self.SIZES[pool_id]
        # A live pool re-registers only with its own incarnation (None before the first time).
        spec = PoolSpec(pool_id, n, bs)  # type: ignore[arg-type]
        reg = self.auth.register_pool(spec, self.inc.get(pool_id))
        self.inc[pool_id] = reg.incarnation
        self.ref[pool_id] = RefPool(n, bs)

    def _victims(self, ref: RefPool, needs: dict[str, int], held: set[int]) -> list[int] | None:
        """The blocks the pool must evict to allocate `needs` fresh blocks per namespace, or
        None when they do not fit: first, for each namespace the quota would overflow, its own
        oldest evictable blocks; then the globally oldest. `held` (cache hits) never goes."""
        evictable = [b for b in ref.evictable() if b not in held]
        victims: list[int] = []
        for ns, n in needs.items():
            if self.QUOTA is None:
                break
            over = sum(1 for v in ref.allocated.values() if v == ns) + n - self.QUOTA
            if over <= 0:
                continue
            own = [b for b in evictable if ref.allocated[b] == ns]
            if over > len(own):
                return None
            event("quota: evicts its own namespace")
            victims += own[:over]
        rest = [b for b in evictable if b not in victims]
        short = sum(needs.values()) - ref.num_free() - len(victims)
        if short > len(rest):
            return None
        return victims + rest[: max(0, short)]

    def _never(self, ref: RefPool, ns: str, fresh: int, held: set[int]) -> bool:
        """Whether `fresh` blocks beside `held` could never be had, all leases ended and every
        evictable block evicted: pinned blocks stay, and count against the quota too."""
        pinned = {b for b in range(ref.n) if ref.pinned(b)} - held
        if len(held) + fresh > ref.n - len(pinned):
            return True
        if self.QUOTA is None:
            return False
        own = sum(1 for b in pinned | held if ref.allocated.get(b) == ns)
        return fresh + own > self.QUOTA

    def _evict(self, ref: RefPool, victims: list[int] | None) -> None:
        assert victims is not None, "the pool found room the reference does not see"
        for b in victims:
            ref.evict(b)

    # -- lease lifecycle ----------------------------------------------------------------------

    @rule(
        pool_id=st.sampled_from(list(POOLS)),
        ns=st.sampled_from(NAMESPACES),
        prompt=prompts,
        reserve=st.integers(0, 4),
        allow_defer=st.booleans(),
        skip_cache=st.integers(0, 9).map(lambda x: x == 0),
    )
    def acquire(self, pool_id, ns, prompt, reserve, allow_defer, skip_cache) -> None:
        self._acquire(pool_id, ns, prompt, reserve, allow_defer, skip_cache)

    def _acquire(self, pool_id, ns, prompt, reserve, allow_defer, skip_cache) -> None:
        ref = self.ref[pool_id]
        bs = ref.bs
        cached, full_blocks = ref.expected_cached(ns, prompt) if not skip_cache else (0, [])
        full = cached // bs
        pending = ref.pending(ns, prompt, cached)
        expect_defer = allow_defer and not skip_cache and full < len(prompt) // bs and pending > 0
        need = -(-(len(prompt) + reserve) // bs) - full
        held = set(full_blocks[:full])
        reuse = Reuse.SHARE_OR_DEFER if allow_defer else Reuse.SHARE
        reuse = Reuse.NONE if skip_cache else reuse
        req = AcquireRequest(
            PoolId(pool_id), self.inc[pool_id], Namespace(ns), pack(prompt, "p"), reserve, reuse
        )
        try:
            result, _ = self.auth.acquire(req)
        except (OutOfBlocks, NeverFits) as err:
            event(f"acquire: {type(err).__name__}")
            # The copy-on-write source is held too: any indexed block holding the matched part
            # of the prompt's next block may be it. A tail nobody holds is taken over, not
            # copied (one fresh block fewer); one that others hold is copied on write into a
            # fresh block, and held while it is.
            sources = [
                b
                for b in ref.content
                if cached % bs
                and ref.content[b][0] == ns
                and full * bs < len(ref.content[b][1]) <= (full + 1) * bs
                and ref.content[b][1][:cached] == prompt[:cached]
            ]
            cases = [(need, held)] + [
                (need - adopt, held | {src})
                for src in sources
                for adopt in {0, int(len(ref.content[src][1]) % bs != 0)}
            ]
            assert any(self._victims(ref, {ns: fresh}, h) is None for fresh, h in cases)
            # Never rather than not now only where pins (and the quota) keep it out for good.
            never = isinstance(err, NeverFits)
            assert any(self._never(ref, ns, fresh, h) == never for fresh, h in cases)
            if never:  # the worker passes it on (INVALID_ARGUMENT): the gateway fails it over
                said = from_status(grpc.StatusCode.INVALID_ARGUMENT, str(err), "w")
                assert isinstance(said, PoolTooSmall) and said.held_back, str(err)
            return
        event(f"acquire: {type(result).__name__}, cached={cached > 0}")
        if expect_defer:
            assert isinstance(result, Deferral)
            assert (result.cached_tokens, result.pending_tokens) == (cached, pending)
            assert result.waiting_on == ref.inflight[(ns, prompt[: (full + 1) * bs])]
            return
        assert isinstance(result, Grant), result
        assert result.cached_tokens == cached
        assert list(result.block_table[:full]) == full_blocks[:full]
        assert len(result.block_table) == full + need
        lease = RefLease(ns, prompt, list(result.block_table), cached, {}, full)
        for pos, b in enumerate(full_blocks[:full]):
            ref.ref(lease, b, pos)
        adopted = None
        if cached % bs:
            if result.copy_on_write:
                ((src, dst),) = result.copy_on_write
                assert dst == result.block_table[full]
            else:
                src = adopted = result.block_table[full]
            src_ns, src_tokens = ref.content[src]
            assert src_ns == ns and src_tokens[: full * bs] == prompt[: full * bs]
            assert src_tokens[full * bs : cached] == prompt[full * bs : cached]
            # Taken over exactly when it is a tail nobody holds (evictable), else copied.
            takeover = len(src_tokens) % bs != 0 and src in ref.stamp
            assert takeover == (adopted is not None), (src, src_tokens, adopted)
            event(f"acquire: a tail, copied={len(src_tokens) % bs != 0 and not takeover}")
            event(f"acquire: a tail, taken over={takeover}")
            held.add(src)
            ref.ref(lease, src, full)
        else:
            assert result.copy_on_write == ()
        self._evict(ref, self._victims(ref, {ns: need - (adopted is not None)}, held))
        if adopted is not None:
            del ref.by_content[ref.content.pop(adopted)]
            lease.adopted = True
        for pos, b in enumerate(result.block_table[full:], start=full):
            if b == adopted:
                continue
            assert b not in ref.allocated, f"block {b} handed out while in use"
            ref.allocated[b] = ns
            ref.ref(lease, b, pos)
        ref.add_lease(result.lease_id, lease)

    @rule(data=st.data(), allow_defer=st.booleans(), reserve=st.integers(0, 4))
    def acquire_same_prompt(self, data, allow_defer, reserve) -> None:
        """A request arriving while another with the same prompt is still running."""
        if not any(r.leases for r in self.ref.values()):
            return
        pool_id = data.draw(st.sampled_from([p for p, r in self.ref.items() if r.leases]))
        _, lease = self._pick_lease(data, pool_id)
        prompt = lease.tokens[: data.draw(st.integers(1, len(lease.tokens)))]
        self._acquire(pool_id, lease.ns, prompt, reserve, allow_defer, False)

    def _pick_lease(self, data, pool_id: str) -> tuple[int, RefLease]:
        leases = self.ref[pool_id].leases
        lease_id = data.draw(st.sampled_from(sorted(leases)))
        return lease_id, leases[lease_id]

    def _grow(self, data, ref: RefPool, lease: RefLease) -> tuple[int, ...]:
        room = len(lease.table) * ref.bs - len(lease.tokens)
        extra = data.draw(st.lists(st.integers(0, 3), max_size=max(0, room)))
        return lease.tokens + tuple(extra)

    def _update(
        self, data, lease: RefLease, tokens: tuple[int, ...]
    ) -> tuple[SequenceUpdate, tuple[int, ...]]:
        """What a caller sends for ``tokens`` (which extend what the lease knows), in a drawn
        wire form: the whole sequence, or only what follows a drawn point no later than the
        end of what the lease knows, with a drawn count of written tokens. And those."""
        if data.draw(st.booleans()):
            return SequenceUpdate.whole(pack(tokens, "t", True)), tokens
        start = data.draw(st.integers(0, len(lease.tokens)))
        written = data.draw(st.integers(0, len(tokens)))
        return SequenceUpdate(written, pack(tokens[start:], "t", True), start), tokens[:written]

    def _commit_ref(self, ref: RefPool, lease_id: int, tokens, written) -> int:
        lease = ref.leases[lease_id]
        indexed = ref.commit(lease_id, written)
        lease.tokens = max(lease.tokens, tokens, key=len)
        return indexed

    @rule(data=st.data())
    def extend(self, data) -> None:
        if not any(r.leases for r in self.ref.values()):
            return
        pool_id = data.draw(st.sampled_from([p for p, r in self.ref.items() if r.leases]))
        ref = self.ref[pool_id]
        ids = data.draw(st.lists(st.sampled_from(sorted(ref.leases)), min_size=1, unique=True))
        items = [(i, len(ref.leases[i].table) * ref.bs + data.draw(st.integers(0, 5))) for i in ids]
        needs: dict[str, int] = {}
        for i, n in items:
            ns = ref.leases[i].ns
            needs[ns] = needs.get(ns, 0) + max(0, -(-n // ref.bs) - len(ref.leases[i].table))
        victims = self._victims(ref, needs, set())
        try:
            out = self.auth.extend(pool_id, self.inc[pool_id], items)
        except OutOfBlocks:
            assert victims is None
            return
        self._evict(ref, victims)
        for lease_id, fresh in out:
            lease = ref.leases[lease_id]
            for b in fresh:
                assert b not in ref.allocated
                ref.allocated[b] = lease.ns
                ref.ref(lease, b, len(lease.table))
                lease.table.append(b)

    @rule(data=st.data())
    def commit(self, data) -> None:
        if not any(r.leases for r in self.ref.values()):
            return
        pool_id = data.draw(st.sampled_from([p for p, r in self.ref.items() if r.leases]))
        ref = self.ref[pool_id]
        lease_id, lease = self._pick_lease(data, pool_id)
        tokens = self._grow(data, ref, lease)
        update, written = self._update(data, lease, tokens)
        adopted = len(lease.refs)
        (indexed,) = self.auth.commit(pool_id, self.inc[pool_id], [(lease_id, update)])
        assert indexed == self._commit_ref(ref, lease_id, tokens, written)
        event(f"commit: adopted={len(lease.refs) > adopted}")

    @rule(data=st.data(), commit_final=st.booleans())
    def release(self, data, commit_final) -> None:
        if not any(r.leases for r in self.ref.values()):
            return
        pool_id = data.draw(st.sampled_from([p for p, r in self.ref.items() if r.leases]))
        ref = self.ref[pool_id]
        lease_id, lease = self._pick_lease(data, pool_id)
        if commit_final:
            tokens = self._grow(data, ref, lease)
            update, written = self._update(data, lease, tokens)
            self.auth.release(pool_id, self.inc[pool_id], lease_id, update)
            self._commit_ref(ref, lease_id, tokens, written)
            tails = len([c for c in ref.content.values() if len(c[1]) % ref.bs])
            ref.index_tail(lease_id, written)
            event(
                f"release: indexed a tail={tails < len([c for c in ref.content.values() if len(c[1]) % ref.bs])}"
            )
        else:
            self.auth.release(pool_id, self.inc[pool_id], lease_id)
        ref.end(lease_id)

    @rule()
    def expire_everything(self) -> None:
        self.now += TTL + 1
        self.auth.expire_due()
        for pool_id, ref in self.ref.items():
            ended = sorted(ref.leases)
            for lease_id in ended:
                ref.end(lease_id)
            expired, live, _ = self.auth.heartbeat(pool_id, self.inc[pool_id])
            assert (sorted(expired), live) == (ended, 0)

    @rule(pool_id=st.sampled_from(list(POOLS)))
    def reregister(self, pool_id) -> None:
        self._register(pool_id)

    # -- admin --------------------------------------------------------------------------------

    @rule(pool_id=st.sampled_from(list(POOLS)), n=st.integers(0, 6))
    def evict_lru(self, pool_id, n) -> None:
        ref = self.ref[pool_id]
        expected = min(n, len(ref.evictable()))
        assert self.auth.get_pool(pool_id).admin.evict_lru(n) == expected
        for _ in range(expected):
            ref.evict(ref.evictable()[0])

    @rule(pool_id=st.sampled_from(list(POOLS)), ns=st.sampled_from(NAMESPACES))
    def evict_namespace(self, pool_id, ns) -> None:
        ref = self.ref[pool_id]
        victims = [b for b in ref.evictable() if ref.content[b][0] == ns]
        assert self.auth.get_pool(pool_id).admin.evict_namespace(ns) == len(victims)
        for b in victims:
            ref.evict(b)

    @rule(pool_id=st.sampled_from(list(POOLS)), ns=st.sampled_from(NAMESPACES), prefix=prompts)
    def evict_prefix(self, pool_id, ns, prefix) -> None:
        ref = self.ref[pool_id]
        k = (len(prefix) - 1) // ref.bs

        def extends(key) -> bool:
            """An indexed block of a sequence extending the prefix: from the block holding its
            last token on, or a tail (a partial last block) at least as long as the prefix."""
            cns, toks = key
            deep_enough = len(toks) >= (k + 1) * ref.bs or len(toks) % ref.bs != 0
            return (
                cns == ns
                and deep_enough
                and toks[: len(prefix)] == prefix
                and len(toks) >= len(prefix)
            )

        pool = self.auth.get_pool(pool_id).admin
        if not any(extends(key) for key in ref.by_content):
            with pytest.raises(NotFound):
                pool.evict_prefix(ns, pack(prefix, "prefix"))
            return
        victims = [b for b in ref.evictable() if extends(ref.content[b])]
        assert pool.evict_prefix(ns, pack(prefix, "prefix")) == len(victims)
        for b in victims:
            ref.evict(b)

    @rule(pool_id=st.sampled_from(list(POOLS)))
    def flush(self, pool_id) -> None:
        ref = self.ref[pool_id]
        victims = ref.evictable()
        assert self.auth.get_pool(pool_id).admin.flush() == len(victims)
        for b in victims:
            ref.evict(b)

    @rule(pool_id=st.sampled_from(list(POOLS)), ns=st.sampled_from(NAMESPACES), prefix=prompts)
    def pin(self, pool_id, ns, prefix) -> None:
        ref = self.ref[pool_id]
        key = (ns, prefix[: len(prefix) // ref.bs * ref.bs])
        pool = self.auth.get_pool(pool_id).admin
        if key in ref.pins:
            assert pool.pin(ns, pack(prefix, "prefix")) == len(ref.pins[key])
            return
        blocks = ref.full_match(ns, key[1])
        if not blocks:
            with pytest.raises(NotFound):
                pool.pin(ns, pack(prefix, "prefix"))
            return
        assert pool.pin(ns, pack(prefix, "prefix")) == len(blocks)
        ref.pin(key, blocks)

    @rule(data=st.data())
    def unpin(self, data) -> None:
        if not any(r.pins for r in self.ref.values()):
            return
        pool_id = data.draw(st.sampled_from([p for p, r in self.ref.items() if r.pins]))
        ref = self.ref[pool_id]
        ns, tokens = data.draw(st.sampled_from(sorted(ref.pins)))
        assert self.auth.get_pool(pool_id).admin.unpin(ns, pack(tokens, "prefix")) == len(
            ref.pins[(ns, tokens)]
        )
        ref.unpin((ns, tokens))

    # -- the comparison -----------------------------------------------------------------------

    @invariant()
    def agrees_with_reference(self) -> None:
        if not hasattr(self, "auth"):
            return
        assert self.auth.check_integrity() == []
        for pool_id, ref in self.ref.items():
            pool = self.auth.get_pool(pool_id)
            assert real_index_view(pool) == ref.indexed_view()
            assert pool.blocks.num_free == ref.num_free()
            assert list(pool.order) == ref.evictable()
            assert [pool.blocks.refcount[b] for b in range(ref.n)] == [
                ref.refcount(b) for b in range(ref.n)
            ]
            assert {i: lease.table for i, lease in pool.leases.live.items()} == {
                i: lease.table for i, lease in ref.leases.items()
            }


PoolMachine.TestCase.settings = machine_settings(300)
TestPoolModel = PoolMachine.TestCase


class QuotaPoolMachine(PoolMachine):
    # Larger blocks than PoolMachine's, so that most prompts fit within the quota.
    QUOTA = 6
    SIZES = {"a": (14, 4), "b": (20, 5)}

    @rule(pool_id=st.sampled_from(list(POOLS)), ns=st.sampled_from(NAMESPACES), prompt=prompts)
    def whole_request(self, pool_id, ns, prompt) -> None:
        """Acquire, then release committing the prompt: fills a namespace with cached blocks."""
        ref = self.ref[pool_id]
        before = set(ref.leases)
        self._acquire(pool_id, ns, prompt, 0, False, False)
        for lease_id in set(ref.leases) - before:
            update = SequenceUpdate.whole(pack(prompt, "p"))
            self.auth.release(pool_id, self.inc[pool_id], lease_id, update)
            ref.commit(lease_id, prompt)
            ref.index_tail(lease_id, prompt)
            ref.end(lease_id)


QuotaPoolMachine.TestCase.settings = machine_settings(150)
TestQuotaPoolModel = QuotaPoolMachine.TestCase
