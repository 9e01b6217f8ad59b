"""Tiers in the lease book and the authority: which blocks an acquire is granted to load from
a pool's tiers (``Grant.tier_blocks``), what Route and Lookup say of them, the registration's
tiers and UpdateTiers' rules. The domain, no gRPC (test_tiers_servicer.py goes over the wire).
"""

from __future__ import annotations

import pytest

from kvcache_service.authority import AuthorityConfig, CacheAuthority
from kvcache_service.errors import FencedIncarnation, InvalidArgument, RegistrationLimit
from kvcache_service.ids import Namespace, PoolId
from kvcache_service.inflight import chain_hashes, chain_seed
from kvcache_service.leases import AcquireRequest, Deferral, Grant, Reuse, SequenceUpdate
from kvcache_service.pool import PoolSpec, PoolState
from kvcache_service.tier_index import Medium, TierBlock
from kvcache_service.tokens import TOKEN_BYTES, pack

BS = 4
POOL = PoolId("w")
NS = Namespace("")
PROMPT = list(range(1, 22))  # 5 full blocks and one token


class World:
    """One pool with a DISK tier (and a HOST one, if asked) on a manual clock."""

    def __init__(self, tiers: tuple[tuple[Medium, int], ...] = ((Medium.DISK, 64),)) -> None:
        self.now = 1000.0
        self.auth = CacheAuthority(AuthorityConfig(lease_ttl_s=30), clock=lambda: self.now)
        self.inc = self.auth.register_pool(PoolSpec(POOL, 32, BS, tiers=tiers)).incarnation

    @property
    def pool(self) -> PoolState:
        return self.auth.pools[POOL]

    def acquire(
        self, prompt: list[int], reuse: Reuse = Reuse.SHARE, ns: Namespace = NS
    ) -> Grant | Deferral:
        req = AcquireRequest(POOL, self.inc, ns, pack(prompt, "p"), 0, reuse)
        result, _ = self.auth.acquire(req)
        return result

    def grant(self, prompt: list[int], reuse: Reuse = Reuse.SHARE) -> Grant:
        result = self.acquire(prompt, reuse)
        assert isinstance(result, Grant), result
        return result

    def serve(self, prompt: list[int]) -> None:
        """A request that computes ``prompt``, commits it and ends."""
        grant = self.grant(prompt)
        self.auth.release(POOL, self.inc, grant.lease_id, SequenceUpdate.whole(pack(prompt, "p")))

    def spill(self, prompt: list[int], medium: Medium = Medium.DISK, ns: Namespace = NS) -> list:
        """Reports every full block of ``prompt`` stored in ``medium``; returns their keys."""
        keys = block_keys(prompt, ns)
        parents = [chain_seed(ns), *keys[:-1]]
        stored = [TierBlock(k, p, ns, medium) for k, p in zip(keys, parents, strict=True)]
        assert self.auth.update_tiers(POOL, self.inc, stored, []) == []
        return keys

    def check(self) -> None:
        assert self.auth.check_integrity() == []


def block_keys(prompt: list[int], ns: Namespace = NS) -> list[int]:
    return chain_hashes(chain_seed(ns), pack(prompt, "p"), 0, BS * TOKEN_BYTES)


def test_blocks_evicted_from_the_device_are_loaded_from_the_tier() -> None:
    w = World()
    w.serve(PROMPT)
    w.spill(PROMPT)
    w.pool.admin.flush()  # the device forgot them; the disk did not
    assert len(w.pool.index) == 0
    grant = w.grant(PROMPT)
    assert (grant.cached_tokens, grant.tier_blocks, grant.copy_on_write) == (0, 5, ())
    assert len(grant.block_table) == 6  # the loaded blocks are the lease's own
    assert w.pool.counters.tier_hit_tokens == 20
    assert w.pool.tiers.counters(Medium.DISK).loaded == 5
    w.check()


def test_at_least_one_prompt_token_is_computed() -> None:
    """A prompt of exactly 5 blocks, all on disk: 4 are loaded, the last is computed."""
    w = World()
    prompt = PROMPT[:20]
    w.spill(prompt)
    grant = w.grant(prompt)
    assert (grant.cached_tokens, grant.tier_blocks) == (0, 4)


def test_tier_blocks_follow_the_device_match() -> None:
    """The device holds the first two blocks, the tier all five: the tier's blocks are granted
    from the third on, and the deepest device block is touched in the tier."""
    w = World()
    w.serve(PROMPT[:8])
    keys = w.spill(PROMPT)
    w.pool.tiers.touch([keys[0], *keys[2:]])
    assert w.pool.tiers.keys(Medium.DISK)[0] == keys[1]  # the tier's oldest
    grant = w.grant(PROMPT)
    assert (grant.cached_tokens, grant.tier_blocks) == (8, 3)
    order = w.pool.tiers.keys(Medium.DISK)
    assert order[-4:] == [keys[1], *keys[2:]]  # touched: the matched block, then the loaded
    assert w.pool.tiers.counters(Medium.DISK).loaded == 3
    w.check()


def test_a_partial_match_gives_way_to_a_tier_block() -> None:
    """The device matches block 0 and half of block 1 (copy on write); the tier holds block 1
    whole: it is loaded instead, and nothing is copied."""
    w = World()
    other = [*PROMPT[:6], 99, 99, 99]
    w.serve(other)
    plain = w.grant(PROMPT)
    assert plain.cached_tokens == 6 and len(plain.copy_on_write) == 1
    w.auth.release(POOL, w.inc, plain.lease_id)
    w.spill(PROMPT)
    grant = w.grant(PROMPT)
    assert (grant.cached_tokens, grant.copy_on_write, grant.tier_blocks) == (4, (), 4)
    # Route and Lookup say the same, without touching anything.
    before = w.pool.tiers.keys(Medium.DISK)
    (route,) = w.auth.route(NS, pack(PROMPT, "p"))
    assert (route.cached_tokens, route.tier_tokens) == (4, 16)
    (_, lookup), *_ = w.auth.lookup(None, NS, PROMPT)
    assert (lookup.cached_tokens, lookup.copied_tokens, lookup.tier_tokens) == (4, 0, 16)
    assert w.pool.tiers.keys(Medium.DISK) == before
    w.check()


def test_a_partial_match_stays_when_no_tier_block_follows() -> None:
    w = World()
    w.serve([*PROMPT[:6], 99, 99, 99])
    w.spill([7, 7, 7, 7])  # the tier holds something, not this prompt
    grant = w.grant(PROMPT)
    assert (grant.cached_tokens, grant.tier_blocks, len(grant.copy_on_write)) == (6, 0, 1)


def test_a_second_acquire_waits_for_the_first_to_load() -> None:
    w = World()
    w.spill(PROMPT)
    first = w.grant(PROMPT, Reuse.SHARE_OR_DEFER)
    assert first.tier_blocks == 5
    second = w.acquire([*PROMPT, 50], Reuse.SHARE_OR_DEFER)
    assert isinstance(second, Deferral)
    assert (second.waiting_on, second.pending_tokens) == (first.lease_id, 20)
    # Once the first committed what it loaded, the second shares it from the device.
    update = SequenceUpdate.whole(pack(PROMPT, "p"))
    w.auth.release(POOL, w.inc, first.lease_id, update)
    again = w.grant([*PROMPT, 50], Reuse.SHARE_OR_DEFER)
    assert (again.cached_tokens, again.tier_blocks) == (21, 0)
    w.check()


def test_no_reuse_loads_nothing() -> None:
    w = World()
    w.spill(PROMPT)
    grant = w.grant(PROMPT, Reuse.NONE)
    assert (grant.cached_tokens, grant.tier_blocks) == (0, 0)
    assert w.pool.tiers.counters(Medium.DISK).loaded == 0


def test_a_block_the_worker_dropped_is_not_granted() -> None:
    w = World()
    keys = w.spill(PROMPT)
    evicted = w.auth.update_tiers(POOL, w.inc, [], [(keys[2], Medium.DISK)])
    # Blocks 3 and 4 are of no use without block 2: they go too, and the worker deletes them.
    assert evicted == [(keys[3], Medium.DISK), (keys[4], Medium.DISK)]
    grant = w.grant(PROMPT)
    assert grant.tier_blocks == 2  # blocks 0 and 1; block 2 is computed, and all after it
    assert w.pool.tiers.counters(Medium.DISK).dropped == 3
    w.check()


def test_namespaces_do_not_share_tier_blocks() -> None:
    w = World()
    w.spill(PROMPT, ns=Namespace("t1"))
    assert w.grant(PROMPT).tier_blocks == 0
    other = w.acquire(PROMPT, ns=Namespace("t1"))
    assert isinstance(other, Grant) and other.tier_blocks == 5


def test_a_block_is_loaded_from_the_fastest_tier_holding_it() -> None:
    w = World(((Medium.HOST, 2), (Medium.DISK, 64)))
    keys = w.spill(PROMPT)
    host = [TierBlock(keys[0], chain_seed(NS), NS, Medium.HOST)]
    w.auth.update_tiers(POOL, w.inc, host, [])
    assert w.grant(PROMPT).tier_blocks == 5
    t = w.pool.tiers
    assert (t.counters(Medium.HOST).loaded, t.counters(Medium.DISK).loaded) == (1, 4)


def test_capacity_evictions_are_answered_once() -> None:
    w = World(((Medium.DISK, 3),))
    keys = block_keys(PROMPT)
    parents = [chain_seed(NS), *keys[:-1]]
    stored = [TierBlock(k, p, NS, Medium.DISK) for k, p in zip(keys, parents, strict=True)]
    # A chain of 5 in a tier of 3: the deepest go (they are leaves; their parents are not).
    evicted = w.auth.update_tiers(POOL, w.inc, stored, [])
    assert evicted == [(keys[4], Medium.DISK), (keys[3], Medium.DISK)]
    assert w.auth.heartbeat(POOL, w.inc)[2] == []  # told once
    assert w.grant(PROMPT).tier_blocks == 3
    # A flush: everything, told in the next heartbeat.
    assert w.auth.flush(None, Medium.DISK) == 3
    assert w.auth.heartbeat(POOL, w.inc)[2] == [(k, Medium.DISK) for k in keys[:3]]
    w.check()


def test_update_tiers_rules() -> None:
    w = World()
    block = TierBlock(1, 0, NS, Medium.DISK)
    with pytest.raises(InvalidArgument, match="no HOST tier"):
        w.auth.update_tiers(POOL, w.inc, [block._replace(medium=Medium.HOST)], [])
    with pytest.raises(InvalidArgument, match="at most 65536"):
        w.auth.update_tiers(POOL, w.inc, [block] * 65_537, [])
    with pytest.raises(InvalidArgument, match="non-printable"):
        w.auth.update_tiers(POOL, w.inc, [block._replace(namespace=Namespace("a\nb"))], [])
    assert len(w.pool.tiers) == 0  # a refused call changes nothing
    with pytest.raises(FencedIncarnation):
        w.auth.update_tiers(POOL, w.inc - 1, [block], [])
    bare = CacheAuthority(AuthorityConfig())
    inc = bare.register_pool(PoolSpec(POOL, 8, BS)).incarnation
    with pytest.raises(InvalidArgument, match="registered no tiers"):
        bare.update_tiers(POOL, inc, [], [])


def test_registration_rules() -> None:
    auth = CacheAuthority(AuthorityConfig(max_pool_blocks=100))
    for tiers, error in [
        (((Medium.DEVICE, 4),), InvalidArgument),
        (((Medium.DISK, 4), (Medium.DISK, 4)), InvalidArgument),
        (((Medium.HOST, -1),), InvalidArgument),
        (((Medium.DISK, 101),), RegistrationLimit),
    ]:
        with pytest.raises(error):
            auth.register_pool(PoolSpec(POOL, 8, BS, tiers=tiers))
    assert POOL not in auth.pools
    inc = auth.register_pool(PoolSpec(POOL, 8, BS, tiers=((Medium.DISK, 100),))).incarnation
    auth.update_tiers(POOL, inc, [TierBlock(1, 0, NS, Medium.DISK)], [])
    # A new incarnation starts with an empty tier index: the worker sends its manifest again.
    auth.register_pool(PoolSpec(POOL, 8, BS, tiers=((Medium.DISK, 100),)), inc)
    assert len(auth.pools[POOL].tiers) == 0


def test_a_namespace_keeps_to_its_share_of_each_tier() -> None:
    """Under a namespace quota of 8 of the pool's 32 blocks, a namespace may hold a quarter of
    each tier (rounded up): past it, it drops its own oldest blocks, leaves first, never
    another namespace's; the worker is told which."""
    w = World()
    w.auth = CacheAuthority(
        AuthorityConfig(lease_ttl_s=30, namespace_quota_blocks=8), clock=lambda: w.now
    )
    tiers = ((Medium.HOST, 10), (Medium.DISK, 64))
    w.inc = w.auth.register_pool(PoolSpec(POOL, 32, BS, tiers=tiers)).incarnation
    t = w.pool.tiers
    assert (t.quota(Medium.HOST), t.quota(Medium.DISK)) == (3, 16)

    def spill(prompt: list[int], ns: Namespace, medium: Medium = Medium.DISK) -> list:
        keys = block_keys(prompt, ns)
        parents = [chain_seed(ns), *keys[:-1]]
        stored = [TierBlock(k, p, ns, medium) for k, p in zip(keys, parents, strict=True)]
        return w.auth.update_tiers(POOL, w.inc, stored, [])

    quiet, loud = Namespace("quiet"), Namespace("loud")
    assert spill(list(range(100, 109)), quiet) == []  # 2 blocks
    prompts = [[1000 * (i + 1) + t for t in range(21)] for i in range(6)]  # 5 blocks each
    evicted = [e for p in prompts for e in spill(p, loud)]
    # 30 blocks for a quota of 16: the 14 oldest went, the first prompts' deepest first.
    first = [k for p in prompts[:3] for k in reversed(block_keys(p, loud))][:14]
    assert evicted == [(k, Medium.DISK) for k in first]
    assert t.namespace_count(Medium.DISK, loud) == 16 and t.count(Medium.DISK) == 18
    assert t.namespace_count(Medium.DISK, quiet) == 2  # untouched
    assert w.pool.check_integrity() == []
    # The host tier: 3 blocks a namespace.
    assert len(spill(prompts[0], loud, Medium.HOST)) == 2
    assert spill(list(range(100, 109)), quiet, Medium.HOST) == []
    assert (t.namespace_count(Medium.HOST, loud), t.namespace_count(Medium.HOST, quiet)) == (3, 2)
    assert w.pool.check_integrity() == []
