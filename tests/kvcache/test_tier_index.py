"""The tier index (kvcache_service/tier_index.py) against a naive model: per medium a dict of
key -> (parent key, namespace, last use), and eviction by a scan of every entry.

Randomized operation sequences mirror every operation on both; after each one the content
and LRU order of every tier, the counters, the outbox and ``run`` must agree, and
``check_integrity`` must find nothing. Keys come from a small universe with parents that are
mostly the key before (chains, shared prefixes; key 0's parent is its namespace's key, a
chain's first block), sometimes the namespace's key (another chain's first block) and sometimes
anything (a cycle, a key its own parent: collisions or a confused worker), so that
leaves-first eviction and its fallback, refused blocks and dropped descendants are all
exercised. After every operation every block a tier holds has its parent held there too, or is
a chain's first block.
"""

from __future__ import annotations

from collections.abc import Callable

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvcache_service.errors import InvalidArgument
from kvcache_service.ids import Namespace
from kvcache_service.tier_index import TIER_MEDIA, Medium, TierBlock, TierIndex
from kvserve_proto.block_keys import namespace_key

KEYS = st.integers(0, 15)
ROOT = namespace_key("")  # the parent key of a first block of namespace ""
NAMESPACES = st.sampled_from([Namespace(""), Namespace("t1")])


class RefTiers:
    """The naive model: what each tier holds, stamped with a logical clock."""

    def __init__(self, capacities: dict[Medium, int], quotas: dict[Medium, int]) -> None:
        self.caps = capacities
        self.quotas = quotas
        self.held: dict[Medium, dict[int, tuple[int, str, int]]] = {m: {} for m in capacities}
        self.clock = 0
        self.outbox: list[tuple[int, Medium]] = []
        self.stored = dict.fromkeys(capacities, 0)
        self.loaded = dict.fromkeys(capacities, 0)
        self.dropped = dict.fromkeys(capacities, 0)

    def media(self) -> list[Medium]:
        return [m for m in TIER_MEDIA if m in self.caps]

    def _stamp(self, m: Medium, key: int, parent: int, ns: str) -> None:
        self.clock += 1
        self.held[m][key] = (parent, ns, self.clock)

    def lru(self, m: Medium) -> list[int]:
        return sorted(self.held[m], key=lambda k: self.held[m][k][2])

    def admissible(self, m: Medium, parent: int, ns: str) -> bool:
        return parent in self.held[m] or parent == namespace_key(ns)

    def update(self, stored: list[TierBlock], dropped: list[tuple[int, Medium]]) -> None:
        # Each block in turn; one whose parent is missing waits for a later block of the call
        # that is its parent, else is refused (to the outbox, unless held: a collision).
        waiting: list[TierBlock] = []
        refused: list[TierBlock] = []

        def settle(b: TierBlock, rest: list[TierBlock]) -> None:
            key, parent, ns, m = b
            if self.admissible(m, parent, ns):
                if key not in self.held[m]:
                    self.stored[m] += 1
                    if (key, m) in self.outbox:
                        self.outbox.remove((key, m))
                self._stamp(m, key, parent, ns)
            elif any((c.key, c.medium) == (parent, m) for c in rest):
                waiting.append(b)
                return
            else:
                refused.append(b)
            released = [w for w in waiting if (w.parent_key, w.medium) == (key, m)]
            waiting[:] = [w for w in waiting if (w.parent_key, w.medium) != (key, m)]
            for w in released:
                settle(w, rest)

        for i, block in enumerate(stored):
            settle(block, stored[i + 1 :])
        for key, _, _, m in refused + waiting:
            if key not in self.held[m] and (key, m) not in self.outbox:
                self.outbox.append((key, m))
        gone: dict[Medium, list[int]] = {}
        for key, m in dropped:
            if self.held[m].pop(key, None) is not None:
                self.dropped[m] += 1
                gone.setdefault(m, []).append(key)
        for m, keys in gone.items():
            self.drop_descendants(m, keys)
        for m in self.media():
            if m in self.quotas:
                for ns in dict.fromkeys(b.namespace for b in stored):
                    held = self.held[m]
                    self._evict(m, self.quotas[m], lambda k, h=held, ns=ns: h[k][1] == ns)
        for m in self.media():
            self._evict(m, self.caps[m], lambda k: True)

    def _evict(self, m: Medium, limit: int, counts: Callable[[int], bool]) -> None:
        """While more than ``limit`` of ``m``'s blocks ``counts``, the oldest leaf of them
        goes (the oldest of them where none is a leaf)."""
        held = self.held[m]
        while sum(1 for k in held if counts(k)) > limit:
            own = [k for k in held if counts(k)]
            parents = {parent for parent, _, _ in held.values()}
            leaves = [k for k in own if k not in parents]
            victim = min(leaves or own, key=lambda k: held[k][2])
            del held[victim]
            self.dropped[m] += 1
            self.outbox.append((victim, m))
            self.drop_descendants(m, [victim])

    def drop_descendants(self, m: Medium, gone: list[int]) -> None:
        """Every block of ``m`` below ``gone`` goes, oldest first, to the outbox."""
        held = self.held[m]
        doomed: set[int] = set()
        frontier = set(gone)
        while frontier:
            frontier = {k for k, (p, _, _) in held.items() if p in frontier} - doomed
            doomed |= frontier
        for key in [k for k in self.lru(m) if k in doomed]:
            del held[key]
            self.dropped[m] += 1
            self.outbox.append((key, m))

    def drop(self, keys: list[int], medium: Medium | None) -> int:
        n = 0
        gone: dict[Medium, list[int]] = {}
        for key in keys:
            for m in [medium] if medium is not None else self.media():
                if self.held[m].pop(key, None) is not None:
                    self.dropped[m] += 1
                    n += 1
                    gone.setdefault(m, []).append(key)
        for m, g in gone.items():
            self.drop_descendants(m, g)
        return n

    def touch(self, keys: list[int]) -> None:
        for key in keys:
            for m in self.media():
                if key in self.held[m]:
                    parent, ns, _ = self.held[m][key]
                    self._stamp(m, key, parent, ns)

    def load(self, keys: list[int]) -> None:
        for key in keys:
            for m in self.media():
                if key in self.held[m]:
                    self.loaded[m] += 1
                    break
        self.touch(keys)

    def run(self, keys: list[int]) -> int:
        n = 0
        while n < len(keys) and any(keys[n] in self.held[m] for m in self.media()):
            n += 1
        return n

    def clear(self, m: Medium) -> int:
        gone = self.lru(m)
        self.outbox += [(k, m) for k in gone]
        self.dropped[m] += len(gone)
        self.held[m].clear()
        return len(gone)


def blocks(media: list[Medium]) -> st.SearchStrategy[list[TierBlock]]:
    def block(key: int, parent: int | None, ns: Namespace, medium: Medium) -> TierBlock:
        # Mostly a chain (the key before: its parent; key 0 first, its parent the namespace's
        # key); sometimes a first block (-1: the namespace's key), sometimes any key, itself
        # included.
        if parent is None:
            parent = key - 1
        if parent < 0:
            parent = namespace_key(ns)
        return TierBlock(key, parent, ns, medium)

    parents = st.one_of(st.none(), st.none(), st.just(-1), KEYS)
    one = st.builds(block, KEYS, parents, NAMESPACES, st.sampled_from(media))
    return st.lists(one, max_size=8)


class TierMachine(RuleBasedStateMachine):
    CAPACITIES: dict[Medium, int] = {Medium.HOST: 3, Medium.DISK: 6}
    QUOTAS: dict[Medium, int] = {}  # blocks one namespace may hold, per medium

    @initialize()
    def setup(self) -> None:
        self.real = TierIndex(self.CAPACITIES.items(), dict(self.QUOTAS))
        self.ref = RefTiers(dict(self.CAPACITIES), dict(self.QUOTAS))

    @rule(data=st.data())
    def update(self, data: st.DataObject) -> None:
        media = self.ref.media()
        stored = data.draw(blocks(media), label="stored")
        dropped = data.draw(
            st.lists(st.tuples(KEYS, st.sampled_from(media)), max_size=3), label="dropped"
        )
        self.real.update(stored, dropped)
        self.ref.update(stored, dropped)

    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        stored = data.draw(blocks(self.ref.media()), label="stored")
        self.real.store(stored)
        self.ref.update(stored, [])

    @rule(keys=st.lists(KEYS, max_size=4), data=st.data())
    def drop(self, keys: list[int], data: st.DataObject) -> None:
        medium = data.draw(st.sampled_from([None, *self.ref.media()]), label="medium")
        assert self.real.drop(keys, medium) == self.ref.drop(keys, medium)

    @rule(keys=st.lists(KEYS, max_size=6))
    def touch(self, keys: list[int]) -> None:
        self.real.touch(keys)
        self.ref.touch(keys)

    @rule(keys=st.lists(KEYS, max_size=6))
    def load(self, keys: list[int]) -> None:
        self.real.load(keys)
        self.ref.load(keys)

    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        medium = data.draw(st.sampled_from(self.ref.media()), label="medium")
        assert self.real.clear(medium) == self.ref.clear(medium)

    @rule(limit=st.integers(0, 6))
    def take_evicted(self, limit: int) -> None:
        taken = self.real.take_evicted(limit)
        assert taken == self.ref.outbox[:limit]
        del self.ref.outbox[:limit]

    @rule(keys=st.lists(KEYS, max_size=8))
    def run(self, keys: list[int]) -> None:
        assert self.real.run(keys) == self.ref.run(keys)

    @invariant()
    def agrees(self) -> None:
        real, ref = self.real, self.ref
        assert real.media == tuple(ref.media())
        for m in ref.media():
            assert real.keys(m) == ref.lru(m), m
            for key, (parent, ns, _) in ref.held[m].items():
                entry = real.entry(key, m)
                assert entry is not None and (entry.parent_key, entry.namespace) == (parent, ns)
            c = real.counters(m)
            assert (c.stored, c.loaded, c.dropped) == (ref.stored[m], ref.loaded[m], ref.dropped[m])
            assert real.count(m) == len(ref.held[m]) <= real.capacity(m)
            for ns in ("", "t1"):
                n = real.namespace_count(m, ns)
                assert n <= self.QUOTAS.get(m, n) and real.quota(m) == self.QUOTAS.get(m)
        assert real.pending_evictions == len(ref.outbox)
        assert bool(real) == any(ref.held[m] for m in ref.media())
        assert real.check_integrity() == []

    @invariant()
    def every_block_has_its_parent(self) -> None:
        """The tiers' rule itself, on the naive model (the real one agrees with it above):
        a block of no use without the blocks before it is never held without them."""
        for m in self.ref.media():
            held = self.ref.held[m]
            for parent, ns, _ in held.values():
                assert parent in held or parent == namespace_key(ns)


class DiskOnly(TierMachine):
    CAPACITIES = {Medium.DISK: 4}


class HostNone(TierMachine):
    """A host tier of no capacity: everything stored there is dropped at once."""

    CAPACITIES = {Medium.HOST: 0, Medium.DISK: 2}


class Quotas(TierMachine):
    """A namespace may hold 2 of the host tier's 3 blocks and 3 of the disk's 6: it drops its
    own, never the other's."""

    QUOTAS = {Medium.HOST: 2, Medium.DISK: 3}


class QuotaOnDiskOnly(TierMachine):
    CAPACITIES = {Medium.HOST: 4, Medium.DISK: 5}
    QUOTAS = {Medium.DISK: 1}


SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTiers = TierMachine.TestCase
TestTiers.settings = SETTINGS
TestDiskOnly = DiskOnly.TestCase
TestDiskOnly.settings = SETTINGS
TestHostNone = HostNone.TestCase
TestHostNone.settings = SETTINGS
TestQuotas = Quotas.TestCase
TestQuotas.settings = SETTINGS
TestQuotaOnDiskOnly = QuotaOnDiskOnly.TestCase
TestQuotaOnDiskOnly.settings = SETTINGS


def test_leaves_go_first_and_the_oldest_leaf_first() -> None:
    """A chain 1 <- 2 <- 3 stored root first (the root is the oldest entry) and a lone block
    9: over capacity, the oldest leaf goes (9, then 3), never a block with a child."""
    tiers = TierIndex([(Medium.DISK, 3)])
    ns = Namespace("")
    tiers.store([TierBlock(9, ROOT, ns, Medium.DISK)])
    tiers.store([TierBlock(k, k - 1 if k > 1 else ROOT, ns, Medium.DISK) for k in (1, 2, 3)])
    assert tiers.take_evicted(10) == [(9, Medium.DISK)]
    tiers.touch([3])  # the leaf is young again; its parents are older but not leaves
    tiers.store([TierBlock(20, ROOT, ns, Medium.DISK)])
    assert tiers.take_evicted(10) == [(3, Medium.DISK)]  # the only leaf but the new block
    assert tiers.keys(Medium.DISK) == [1, 2, 20]
    assert tiers.check_integrity() == []


def test_a_block_stored_again_is_not_deleted() -> None:
    tiers = TierIndex([(Medium.DISK, 1)])
    ns = Namespace("")
    tiers.store([TierBlock(1, ROOT, ns, Medium.DISK), TierBlock(2, ROOT, ns, Medium.DISK)])
    assert tiers.pending_evictions == 1  # 1, the older leaf
    tiers.store([TierBlock(1, ROOT, ns, Medium.DISK)])  # the worker spilled it again
    assert tiers.take_evicted(10) == [(2, Medium.DISK)]
    assert tiers.keys(Medium.DISK) == [1]


def chain(n: int, first: int = 1000, ns: str = "") -> list[tuple[int, int]]:
    """(key, parent key) of a chain of ``n`` blocks, first to last."""
    keys = list(range(first, first + n))
    return list(zip(keys, [namespace_key(ns), *keys[:-1]], strict=True))


@pytest.mark.parametrize("medium", TIER_MEDIA)
@pytest.mark.parametrize("batch", [1, 8, 62])
def test_a_tier_smaller_than_a_chain_keeps_its_first_blocks(batch: int, medium: Medium) -> None:
    """A 62-block chain stored in batches into 13 slots: the tier keeps blocks 0-12, the ones
    a load can use; the rest are refused or evicted, every one of them to the outbox (the
    worker deletes what it wrote). It kept 48-60 when a block whose parent had gone counted
    as a young leaf and pushed the prefix out."""
    tiers = TierIndex([(medium, 13)])
    blocks = [TierBlock(k, p, Namespace(""), medium) for k, p in chain(62)]
    for i in range(0, 62, batch):
        tiers.store(blocks[i : i + batch])
        assert tiers.check_integrity() == []
    assert tiers.keys(medium) == [b.key for b in blocks[:13]]
    assert tiers.run([b.key for b in blocks]) == 13
    assert sorted(k for k, _ in tiers.take_evicted(100)) == [b.key for b in blocks[13:]]


def test_a_block_without_its_parent_is_refused_and_deleted() -> None:
    """A block whose parent the tier does not hold is not stored, whatever room there is (the
    worker is told to delete it); a child named before its parent in the same call waits for
    it (a manifest's order); the host tier keeps to the same rule, on its own blocks."""
    ns = Namespace("")
    tiers = TierIndex([(Medium.HOST, 8), (Medium.DISK, 8)])
    (a, ra), (b, _), (c, _) = chain(3)
    tiers.store([TierBlock(c, b, ns, Medium.DISK)])
    assert tiers.keys(Medium.DISK) == [] and tiers.take_evicted(10) == [(c, Medium.DISK)]
    tiers.store([TierBlock(c, b, ns, Medium.DISK), TierBlock(b, a, ns, Medium.DISK)])
    tiers.store([TierBlock(a, ra, ns, Medium.DISK)])
    assert tiers.keys(Medium.DISK) == [a]  # a came in a later call: b and c were refused
    assert tiers.take_evicted(10) == [(b, Medium.DISK), (c, Medium.DISK)]
    manifest = [TierBlock(c, b, ns, Medium.DISK), TierBlock(b, a, ns, Medium.DISK)]
    tiers.store(manifest)
    assert tiers.keys(Medium.DISK) == [a, b, c] and tiers.pending_evictions == 0
    tiers.store([TierBlock(b, a, ns, Medium.HOST)])  # the disk holds a, the host does not
    assert tiers.count(Medium.HOST) == 0 and tiers.take_evicted(10) == [(b, Medium.HOST)]
    assert tiers.counters(Medium.DISK).stored == 3 and tiers.check_integrity() == []


def test_a_dropped_block_takes_its_descendants() -> None:
    """A block the worker reports gone (a corrupt file) leaves its descendants of no use: they
    go too, and the worker is told to delete them; another chain stays."""
    ns = Namespace("")
    tiers = TierIndex([(Medium.DISK, 16)])
    one, other = chain(4), chain(2, first=2000)
    tiers.store([TierBlock(k, p, ns, Medium.DISK) for k, p in one + other])
    tiers.update([], [(one[1][0], Medium.DISK)])
    assert tiers.keys(Medium.DISK) == [one[0][0]] + [k for k, _ in other]
    assert tiers.take_evicted(10) == [(one[2][0], Medium.DISK), (one[3][0], Medium.DISK)]
    assert tiers.drop([other[0][0]]) == 1  # the call's own; the descendant goes to the outbox
    assert tiers.take_evicted(10) == [(other[1][0], Medium.DISK)]
    assert tiers.counters(Medium.DISK).dropped == 5 and tiers.check_integrity() == []


def test_registration_checks() -> None:
    with pytest.raises(InvalidArgument, match="HOST or DISK"):
        TierIndex([(Medium.DEVICE, 4)])
    with pytest.raises(InvalidArgument, match="at most one a medium"):
        TierIndex([(Medium.DISK, 4), (Medium.DISK, 8)])
    with pytest.raises(InvalidArgument, match="negative"):
        TierIndex([(Medium.HOST, -1)])
    tiers = TierIndex([(Medium.DISK, 4)])
    with pytest.raises(InvalidArgument, match="no HOST tier"):
        tiers.update([TierBlock(1, 0, Namespace(""), Medium.DISK)], [(1, Medium.HOST)])
    assert len(tiers) == 0  # all or nothing
    assert not TierIndex() and TierIndex().media == ()
