"""The blocks a pool's tiers hold: a worker's host memory and disk beside its device pool.

The worker moves the bytes (it spills every committed full block to its tiers and loads the
blocks a grant names); this index is the service's record of which blocks each tier holds,
named by their stable keys (kvserve_proto.block_keys: the chain hashes the radix index keeps
and a lease's chain are the same keys), and the decisions taken on them: which blocks an
acquire loads instead of computing (LeaseBook.acquire) and which a full tier drops (here).
Pure domain: no clocks, no gRPC.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from itertools import islice, pairwise
from typing import NamedTuple, Protocol

from kvcache_service.errors import InvalidArgument
from kvcache_service.ids import Namespace
from kvserve_proto.block_keys import namespace_key


class Medium(enum.IntEnum):
    """Where a block's KV is kept (kvcache.proto's Medium, converted at the edge). An IntEnum
    for its C-speed hash: every block a tier stores or drops is looked up by its medium
    (a plain Enum's hash is Python code: a fifth of a manifest's cost)."""

    DEVICE = 1  # the pool itself: not a tier, named in the stats only
    HOST = 2
    DISK = 3


# The media a tier may be on, fastest first: a block several hold is loaded from the first.
TIER_MEDIA = (Medium.HOST, Medium.DISK)


class TierBlock(NamedTuple):
    """A block a tier holds (a NamedTuple: a manifest brings 65,536 of them a call)."""

    key: int
    parent_key: int  # the key of the block before it; the namespace's for a first block
    namespace: Namespace
    medium: Medium


class TierEntry(NamedTuple):
    """What a tier records of a block it holds. Immutable: a touch replaces it, so a copy of
    the entries is a consistent snapshot."""

    parent_key: int
    namespace: Namespace
    stamp: int  # last use, on the index's logical clock: larger is younger


@dataclass(slots=True)
class TierCounters:
    """Since the pool registered: blocks that entered the tier (a key already there is a
    touch, not counted), blocks granted to be loaded from it (each from the fastest medium
    holding it), and blocks that left it (evicted, flushed, or reported gone by the worker)."""

    stored: int = 0
    loaded: int = 0
    dropped: int = 0


@dataclass(slots=True)
class _Tier:
    """One medium's blocks.

    ``entries`` is the LRU order (oldest first). ``children`` counts, for each key, the
    entries here whose parent it is (keys with none are absent): a key held here, or a
    namespace's key (the parent of its chains' first blocks; never held). ``leaves`` is a heap of
    (stamp, key), lazily cleaned: an item is current while its key is here with that stamp
    and no child; every entry without a child has a current item, so the least recently used
    leaf is the first current item popped.
    """

    capacity: int
    medium: Medium = Medium.DISK
    entries: OrderedDict[int, TierEntry] = field(default_factory=OrderedDict)
    children: dict[int, int] = field(default_factory=dict)
    leaves: list[tuple[int, int]] = field(default_factory=list)
    counters: TierCounters = field(default_factory=TierCounters)
    # Under a namespace quota (None: none): each namespace's block count, and its own heap of
    # (stamp, key) leaves, lazily cleaned like ``leaves``.
    quota: int | None = None
    per_ns: Counter[Namespace] = field(default_factory=Counter)
    ns_leaves: dict[Namespace, list[tuple[int, int]]] = field(default_factory=dict)


def tier_quota(namespace_quota: int | None, pool_blocks: int, capacity: int) -> int | None:
    """A namespace's quota in a tier: the share of the tier it may hold of the pool
    (``namespace_quota`` of ``pool_blocks``), rounded up; None without a pool quota."""
    if namespace_quota is None:
        return None
    if pool_blocks <= 0:
        return capacity
    return -(-namespace_quota * capacity // pool_blocks)


def tier_capacities(specs: Iterable[tuple[Medium, int]]) -> dict[Medium, int]:
    """A registration's tiers, checked: HOST or DISK, one each at most, capacities >= 0."""
    out: dict[Medium, int] = {}
    for medium, capacity in specs:
        if medium not in TIER_MEDIA:
            raise InvalidArgument(f"a tier is on HOST or DISK, not {medium.name}")
        if medium in out:
            raise InvalidArgument(f"two tiers on {medium.name}: at most one a medium")
        if capacity < 0:
            raise InvalidArgument(f"the {medium.name} tier's capacity is negative")
        out[medium] = capacity
    return out


class TierListener(Protocol):
    """Hears of every block that enters or leaves a tier (``_store``, ``_remove``, ``clear``:
    the only places an entry comes or goes)."""

    def tier_stored(self, medium: int, ns: Namespace, key: int, parent: int) -> None: ...

    def tier_removed(self, medium: int, keys: list[int]) -> None: ...


class TierIndex:
    """Per medium a capacity in blocks and the blocks held: key -> (parent key, namespace,
    last use). A key may be held by several media at once.

    Chains: a tier holds a block only with its parent (or as the first block of its
    namespace's chain, its parent key that namespace's key): a load stops at the first block
    missing, so a block without the blocks before it is of no use, and counted as a leaf it
    would push out the prefix that makes it useful (a 62-block chain stored 8 at a time into
    13 slots kept its blocks 48-60, none loadable). A stored block whose parent the tier
    does not hold, nor an earlier block of the same call, is refused: not stored, and put in
    the outbox so the worker deletes what it wrote. A block that goes for any other reason
    than leaves-first eviction (the worker dropped it; the no-leaf fallback) takes its
    descendants in that tier with it, to the outbox. So after every call every block a tier
    holds has its parent held there too, or is a chain's first block.

    Capacity: after every update, a tier over its capacity drops its least recently used
    blocks, leaves first (a block with a child in the same tier is not dropped before the
    child: the child is of no use without it). The keys it drops go to the ``outbox``, which
    the pool's UpdateTiers and Heartbeat answers drain (``take_evicted``): the worker deletes
    them. A block stored again before the outbox is drained leaves it (the worker keeps it).

    Namespace quotas (``quotas``: per medium, the blocks one namespace may hold): before the
    capacity is enforced, a namespace that stored past its quota drops its own least recently
    used blocks, leaves first, never another namespace's, as the pool's budget does.
    """

    def __init__(
        self,
        tiers: Iterable[tuple[Medium, int]] = (),
        quotas: dict[Medium, int | None] | None = None,
    ) -> None:
        """``tiers``: (medium, capacity in blocks), checked (``tier_capacities``);
        ``quotas``: a namespace's quota per medium (none where missing or None)."""
        quotas = quotas or {}
        self._tiers: dict[Medium, _Tier] = {
            m: _Tier(c, m, quota=quotas.get(m)) for m, c in tier_capacities(tiers).items()
        }
        # Fastest first: the order loads and run() look in.
        self._fastest = [self._tiers[m] for m in TIER_MEDIA if m in self._tiers]
        self._clock = 0
        # (key, medium) dropped by the service, oldest first, not yet told to the worker.
        self._outbox: OrderedDict[tuple[int, Medium], None] = OrderedDict()
        # Namespaces as stored: one string each, not one per entry.
        self._names: dict[str, Namespace] = {}
        # Each namespace's key: the parent key of its chains' first blocks.
        self._roots: dict[str, int] = {}
        # Told of every block that enters or leaves a tier (events.PoolRecorder: KV events).
        self.listener: TierListener | None = None

    # -- what it holds ------------------------------------------------------------------------

    @property
    def media(self) -> tuple[Medium, ...]:
        """The pool's tiers, fastest first."""
        return tuple(m for m in TIER_MEDIA if m in self._tiers)

    def __bool__(self) -> bool:
        """Whether any tier holds any block: an acquire looks only then."""
        return any(t.entries for t in self._fastest)

    def __len__(self) -> int:
        return sum(len(t.entries) for t in self._fastest)

    def count(self, medium: Medium) -> int:
        return len(self._tier(medium).entries)

    def capacity(self, medium: Medium) -> int:
        return self._tier(medium).capacity

    def counters(self, medium: Medium) -> TierCounters:
        return self._tier(medium).counters

    def holds(self, key: int, medium: Medium) -> bool:
        return key in self._tier(medium).entries

    def entry(self, key: int, medium: Medium) -> TierEntry | None:
        return self._tier(medium).entries.get(key)

    def keys(self, medium: Medium) -> list[int]:
        """The keys ``medium`` holds, least recently used first."""
        return list(self._tier(medium).entries)

    def _tier(self, medium: Medium) -> _Tier:
        tier = self._tiers.get(medium)
        if tier is None:
            raise InvalidArgument(f"this pool registered no {medium.name} tier")
        return tier

    def run(self, keys: Sequence[int]) -> int:
        """How many leading keys of ``keys`` some tier holds (not necessarily the same one)."""
        held = [t.entries for t in self._fastest]
        n = 0
        for key in keys:
            if not any(key in entries for entries in held):
                break
            n += 1
        return n

    # -- changes ------------------------------------------------------------------------------

    def update(self, stored: Sequence[TierBlock], dropped: Sequence[tuple[int, Medium]]) -> None:
        """What a worker reports: ``stored`` (in turn, each the most recently used of its
        tier; one whose parent the tier does not hold is refused, see the class docstring),
        then ``dropped`` (key, medium) (a key in both ends dropped: the worker may not have
        it; its descendants in that tier go with it), then each tier over its capacity
        evicts. Every medium is checked first: a call naming a tier the pool lacks changes
        nothing."""
        for block in stored:
            self._tier(block.medium)
        for _, medium in dropped:
            self._tier(medium)
        self._admit(stored)
        orphaned: dict[Medium, list[int]] = {}
        for key, medium in dropped:
            tier = self._tiers[medium]
            if key in tier.entries:
                self._remove(tier, key)
                tier.counters.dropped += 1
                if key in tier.children:
                    orphaned.setdefault(medium, []).append(key)
        for medium, keys in orphaned.items():
            self._drop_descendants(self._tiers[medium], keys)
        if stored and any(t.quota is not None for t in self._fastest):
            self._evict_over_quota(dict.fromkeys(b.namespace for b in stored))
        self._evict_over_capacity()

    def store(self, blocks: Sequence[TierBlock]) -> None:
        """Blocks a tier holds now: new, or touched (the most recently used either way)."""
        self.update(blocks, ())

    def drop(self, keys: Iterable[int], medium: Medium | None = None) -> int:
        """Blocks ``medium`` (None: every tier) no longer holds, as the worker reports them
        (it knows: they are not sent back to it). Returns how many entries went; their
        descendants in the same tier go too, to the outbox (not counted here)."""
        tiers = [self._tier(medium)] if medium is not None else self._fastest
        n = 0
        orphaned: dict[Medium, list[int]] = {}
        for key in keys:
            for tier in tiers:
                if key in tier.entries:
                    self._remove(tier, key)
                    tier.counters.dropped += 1
                    n += 1
                    if key in tier.children:
                        orphaned.setdefault(tier.medium, []).append(key)
        for m, gone in orphaned.items():
            self._drop_descendants(self._tiers[m], gone)
        return n

    def touch(self, keys: Iterable[int]) -> None:
        """Each key, in turn, becomes the most recently used of every tier holding it."""
        for key in keys:
            for tier in self._fastest:
                entry = tier.entries.get(key)
                if entry is not None:
                    self._stamp(tier, key, entry.parent_key, entry.namespace)

    def load(self, keys: Sequence[int]) -> None:
        """``keys``, which an acquire grants to be loaded: touched, and counted as loaded
        from the fastest tier holding each."""
        for key in keys:
            for tier in self._fastest:
                if key in tier.entries:
                    tier.counters.loaded += 1
                    break
        self.touch(keys)

    def clear(self, medium: Medium) -> int:
        """Drops every block of ``medium`` (a flush): all of them to the outbox, oldest first.
        Returns how many."""
        tier = self._tier(medium)
        n = len(tier.entries)
        if self.listener is not None and n:
            self.listener.tier_removed(medium, list(tier.entries))
        self._outbox.update(dict.fromkeys(zip(tier.entries, [medium] * n, strict=True)))
        tier.counters.dropped += n
        tier.entries.clear()
        tier.children.clear()
        tier.leaves.clear()
        tier.per_ns.clear()
        tier.ns_leaves.clear()
        return n

    def namespace_count(self, medium: Medium, ns: str) -> int:
        """Blocks ``ns`` holds in ``medium``'s tier."""
        return sum(1 for e in self._tier(medium).entries.values() if e.namespace == ns)

    def quota(self, medium: Medium) -> int | None:
        return self._tier(medium).quota

    def entries_for_events(self) -> list[tuple[int, Namespace, int, int]]:
        """Every block held, as (medium, namespace, key, parent key), grouped by medium and
        namespace: a KV-event snapshot's tier part."""
        out = []
        for medium, tier in self._tiers.items():
            rows = [(int(medium), e.namespace, k, e.parent_key) for k, e in tier.entries.items()]
            rows.sort(key=lambda r: r[1])
            out += rows
        return out

    def take_evicted(self, limit: int) -> list[tuple[int, Medium]]:
        """Up to ``limit`` of the blocks the service dropped, oldest first, taken out of the
        outbox: the worker is told once."""
        taken = list(islice(self._outbox, limit))
        for item in taken:
            del self._outbox[item]
        return taken

    @property
    def pending_evictions(self) -> int:
        return len(self._outbox)

    # -- internals ----------------------------------------------------------------------------

    def _root(self, ns: Namespace) -> int:
        """``ns``'s key: the parent key a chain's first block names."""
        root = self._roots.get(ns)
        if root is None:
            root = self._roots[ns] = namespace_key(ns)
        return root

    def _admit(self, stored: Sequence[TierBlock]) -> None:
        """Stores each of ``stored`` in turn whose parent its tier holds (or that is a
        chain's first block). One whose parent comes later in the same call (a manifest may
        name a child before its parent) waits for it and is stored right after it; any other
        is refused: not stored, and sent to the outbox (unless the tier holds that key
        already: a collision; the entry stays as it is). The blocks waiting for a refused
        block, and those still waiting at the end, are refused too."""
        names = self._names
        # (medium, key) -> how many of the blocks not yet taken name it: built only when
        # a parent is missing (a worker's spills and manifests name parents first).
        ahead: Counter[tuple[Medium, int]] | None = None
        waiting: dict[tuple[Medium, int], list[TierBlock]] = {}
        refused: list[TierBlock] = []
        for i, block in enumerate(stored):
            if ahead is not None:
                ahead[(block.medium, block.key)] -= 1
            todo = [block]
            while todo:
                b = todo.pop()
                key, parent, ns, medium = b
                tier = self._tiers[medium]
                name = names.get(ns)
                if name is None:
                    name = names[ns] = ns
                if parent in tier.entries or parent == self._root(name):
                    self._store(tier, medium, key, parent, name)
                    todo.extend(reversed(waiting.pop((medium, key), ())))
                    continue
                if ahead is None:
                    ahead = Counter((s.medium, s.key) for s in islice(stored, i + 1, None))
                if ahead[(medium, parent)] > 0:
                    waiting.setdefault((medium, parent), []).append(b)
                else:
                    refused.append(b)
                    todo.extend(reversed(waiting.pop((medium, key), ())))
        refused += [b for blocks in waiting.values() for b in blocks]
        for key, _, _, medium in refused:
            if key not in self._tiers[medium].entries:
                self._outbox[(key, medium)] = None

    def _drop_descendants(self, tier: _Tier, gone: Iterable[int]) -> None:
        """Drops every block of ``tier`` below the blocks ``gone`` from it (held no more:
        their descendants cannot be loaded), oldest first, to the outbox. O(blocks held):
        only a block that goes with children held (a worker's drop, the no-leaf fallback)
        costs it, never leaves-first eviction."""
        kids: dict[int, list[int]] = {}
        for k, e in tier.entries.items():
            kids.setdefault(e.parent_key, []).append(k)
        doomed: set[int] = set()
        stack = list(gone)
        while stack:
            for child in kids.get(stack.pop(), ()):
                if child not in doomed:
                    doomed.add(child)
                    stack.append(child)
        for key in [k for k in tier.entries if k in doomed]:
            self._remove(tier, key)
            tier.counters.dropped += 1
            self._outbox[(key, tier.medium)] = None

    def _store(self, tier: _Tier, medium: Medium, key: int, parent: int, ns: Namespace) -> None:
        old = tier.entries.get(key)
        if old is None:
            tier.counters.stored += 1
            if tier.quota is not None:
                tier.per_ns[ns] += 1
            if self.listener is not None:
                self.listener.tier_stored(medium, ns, key, parent)
            if self._outbox:
                self._outbox.pop((key, medium), None)  # stored again: the worker keeps it
            children = tier.children
            children[parent] = children.get(parent, 0) + 1
        else:
            if old.parent_key != parent:  # a key is a hash of its whole prefix: a collision
                self._remove_child(tier, old.parent_key)
                self._add_child(tier, parent)
            if tier.quota is not None and old.namespace != ns:  # (a collision, again)
                self._uncount(tier, old.namespace)
                tier.per_ns[ns] += 1
        self._stamp(tier, key, parent, ns)

    def _stamp(self, tier: _Tier, key: int, parent: int, ns: Namespace) -> None:
        """``key`` becomes the youngest of ``tier``."""
        self._clock += 1
        stamp = self._clock
        entries = tier.entries
        entries[key] = TierEntry(parent, ns, stamp)
        entries.move_to_end(key)
        if key not in tier.children:
            self._push_leaf(tier, stamp, key, ns)

    def _push_leaf(self, tier: _Tier, stamp: int, key: int, ns: Namespace) -> None:
        leaves = tier.leaves
        heappush(leaves, (stamp, key))
        if len(leaves) > 2 * len(tier.entries) + 64:  # mostly stale items: rebuild
            children = tier.children
            tier.leaves = [(e.stamp, k) for k, e in tier.entries.items() if k not in children]
            heapify(tier.leaves)
        if tier.quota is None:
            return
        own = tier.ns_leaves.get(ns)
        if own is None:
            own = tier.ns_leaves[ns] = []
        heappush(own, (stamp, key))
        if len(own) > 2 * tier.per_ns[ns] + 64:  # mostly stale: keep the current ones
            own[:] = [(s, k) for s, k in own if self._is_leaf(tier, s, k, ns)]
            heapify(own)

    @staticmethod
    def _is_leaf(tier: _Tier, stamp: int, key: int, ns: Namespace) -> bool:
        """Whether a heap item is current: its key held with that stamp (and namespace),
        with no child in the tier."""
        entry = tier.entries.get(key)
        return (
            entry is not None
            and entry.stamp == stamp
            and entry.namespace == ns
            and key not in tier.children
        )

    def _uncount(self, tier: _Tier, ns: Namespace) -> None:
        left = tier.per_ns[ns] - 1
        if left:
            tier.per_ns[ns] = left
        else:
            del tier.per_ns[ns]
            tier.ns_leaves.pop(ns, None)

    def _add_child(self, tier: _Tier, parent: int) -> None:
        children = tier.children
        children[parent] = children.get(parent, 0) + 1

    def _remove_child(self, tier: _Tier, parent: int) -> None:
        children = tier.children
        left = children[parent] - 1
        if left:
            children[parent] = left
            return
        del children[parent]
        entry = tier.entries.get(parent)
        if entry is not None:  # a leaf now
            self._push_leaf(tier, entry.stamp, parent, entry.namespace)

    def _remove(self, tier: _Tier, key: int) -> None:
        entry = tier.entries.pop(key)
        if tier.quota is not None:
            self._uncount(tier, entry.namespace)
        if self.listener is not None:
            self.listener.tier_removed(tier.medium, [key])
        self._remove_child(tier, entry.parent_key)

    def _evict_over_quota(self, namespaces: Iterable[Namespace]) -> None:
        """Each of ``namespaces`` (those an update stored, in order) that holds more of a
        tier than its quota drops its own least recently used leaves (its oldest block where
        none of its blocks is a leaf: a cycle) until it is within it."""
        namespaces = list(namespaces)
        for medium in TIER_MEDIA:
            tier = self._tiers.get(medium)
            if tier is None or tier.quota is None:
                continue
            for ns in namespaces:
                while tier.per_ns.get(ns, 0) > tier.quota:
                    victim = None
                    own = tier.ns_leaves.get(ns, [])
                    while own:
                        stamp, key = heappop(own)
                        if self._is_leaf(tier, stamp, key, ns):
                            victim = key
                            break
                    if victim is None:
                        victim = next(k for k, e in tier.entries.items() if e.namespace == ns)
                    self._remove(tier, victim)
                    tier.counters.dropped += 1
                    self._outbox[(victim, medium)] = None
                    if victim in tier.children:  # the fallback: its descendants go too
                        self._drop_descendants(tier, [victim])

    def _evict_over_capacity(self) -> None:
        for medium in TIER_MEDIA:
            tier = self._tiers.get(medium)
            if tier is None:
                continue
            entries, children = tier.entries, tier.children
            while len(entries) > tier.capacity:
                victim = None
                while tier.leaves:
                    stamp, key = heappop(tier.leaves)
                    entry = entries.get(key)
                    if entry is not None and entry.stamp == stamp and key not in children:
                        victim = key
                        break
                if victim is None:
                    # No leaf: every block is some block's parent (keys in a cycle, from
                    # collisions or a confused worker). The oldest goes, and with it
                    # its descendants.
                    victim = next(iter(entries))
                self._remove(tier, victim)
                tier.counters.dropped += 1
                self._outbox[(victim, medium)] = None
                if victim in children:
                    self._drop_descendants(tier, [victim])

    # -- integrity ----------------------------------------------------------------------------

    def snapshot(self) -> TierSnapshot:
        """Copies of the state ``TierSnapshot.problems`` checks (C-speed copies, taken in one
        step of the caller); the check, O(blocks held), can then run on any thread."""
        return TierSnapshot(
            tiers={
                m: (t.capacity, dict(t.entries), dict(t.children), list(t.leaves))
                for m, t in self._tiers.items()
            },
            outbox=list(self._outbox),
            quotas={
                m: (t.quota, dict(t.per_ns), {n: list(h) for n, h in t.ns_leaves.items()})
                for m, t in self._tiers.items()
                if t.quota is not None
            },
        )

    def check_integrity(self) -> list[str]:
        return self.snapshot().problems()


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    """A TierIndex's state, copied: per medium (capacity, entries in LRU order, child counts,
    the leaf heap), and the outbox."""

    tiers: dict[Medium, tuple[int, dict[int, TierEntry], dict[int, int], list[tuple[int, int]]]]
    outbox: list[tuple[int, Medium]]
    # Per medium under a namespace quota: (quota, count per namespace, leaf heap per namespace).
    quotas: dict[
        Medium, tuple[int, dict[Namespace, int], dict[Namespace, list[tuple[int, int]]]]
    ] = field(default_factory=dict)

    def problems(self) -> list[str]:
        """Each tier within its capacity; every block it holds with its parent, or a chain's
        first block; its LRU order by last use; its child counts a recount of its entries'
        parents; every leaf findable in its heap; nothing both held and waiting in the outbox
        to be deleted."""
        found = []
        roots: dict[str, int] = {}
        for medium, (capacity, entries, children, leaves) in self.tiers.items():
            name = medium.name
            if len(entries) > capacity:
                found.append(f"{name} tier holds {len(entries)} blocks, over {capacity}")
            orphans = 0
            for e in entries.values():
                if e.parent_key not in entries:
                    root = roots.get(e.namespace)
                    if root is None:
                        root = roots[e.namespace] = namespace_key(e.namespace)
                    orphans += e.parent_key != root
            if orphans:
                found.append(f"{name} tier: {orphans} blocks held without their parent")
            stamps = [e.stamp for e in entries.values()]
            if any(a >= b for a, b in pairwise(stamps)):
                found.append(f"{name} tier's LRU order is not by last use")
            recount = Counter(e.parent_key for e in entries.values())
            if recount != Counter(children) or any(c <= 0 for c in children.values()):
                found.append(f"{name} tier's child counts disagree with its entries")
            current = {(s, k) for s, k in leaves}
            lost = [
                k for k, e in entries.items() if k not in children and (e.stamp, k) not in current
            ]
            if lost:
                found.append(f"{name} tier: {len(lost)} leaves missing from the eviction heap")
        for medium, (quota, per_ns, ns_leaves) in self.quotas.items():
            name = medium.name
            _, entries, children, _ = self.tiers[medium]
            by_ns = Counter(e.namespace for e in entries.values())
            if by_ns != Counter(per_ns):
                found.append(f"{name} tier's namespace counts disagree with its entries")
            over = sorted(ns for ns, n in by_ns.items() if n > quota)
            if over:
                found.append(f"{name} tier: namespaces {over} over their quota of {quota}")
            current = {(s, k) for heap in ns_leaves.values() for s, k in heap}
            lost = [
                k for k, e in entries.items() if k not in children and (e.stamp, k) not in current
            ]
            if lost:
                found.append(f"{name} tier: {len(lost)} leaves missing from their namespace's heap")
        held = [(k, m) for k, m in self.outbox if m in self.tiers and k in self.tiers[m][1]]
        if held:
            found.append(f"{len(held)} blocks held and waiting to be deleted")
        if len(set(self.outbox)) != len(self.outbox):
            found.append("the outbox holds a block twice")
        return found
