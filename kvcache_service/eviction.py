"""The eviction order: unreferenced, unpinned indexed blocks, least recently used first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice, repeat

from kvcache_service.ids import BlockId, Namespace


class EvictionOrder:
    """Evictable blocks in LRU order, globally and (under a namespace quota) per namespace.

    Invariant: every block comes before (is older than) its ancestors in the index, so the
    oldest block is always the last block of a leaf and popping from the front evicts leaves
    before parents without consulting the tree. It holds because a block only enters at the
    young end when its last reference or pin goes, and a lease or pin on a block also holds
    every ancestor of it: when a block enters, its descendants are already here, and blocks
    that enter together are pushed deepest first.

    An OrderedDict, not a heap: acquiring a cached block removes it from the middle in O(1),
    and the oldest pops from the front in O(1). The per-namespace orders exist only where a
    quota needs them (`by_namespace`): every push, removal and eviction of a block otherwise
    paid for a second OrderedDict nobody read.
    """

    def __init__(self, by_namespace: bool = True) -> None:
        self._all: OrderedDict[BlockId, Namespace] = OrderedDict()
        self._by_ns: dict[Namespace, OrderedDict[BlockId, None]] | None = (
            {} if by_namespace else None
        )

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, block: BlockId) -> bool:
        return block in self._all

    def __iter__(self) -> Iterator[BlockId]:  # oldest first
        return iter(self._all)

    def among(self, blocks: Iterable[BlockId]) -> set[BlockId]:
        """Which of `blocks` are evictable (one C-speed pass)."""
        return self._all.keys() & blocks

    def count(self, ns: Namespace) -> int:
        assert self._by_ns is not None, "per-namespace counts need by_namespace"
        order = self._by_ns.get(ns)
        return len(order) if order else 0

    def push(self, block: BlockId, ns: Namespace) -> None:
        assert block not in self._all, f"block {block} already evictable"
        self._all[block] = ns
        if self._by_ns is not None:
            self._by_ns.setdefault(ns, OrderedDict())[block] = None

    def push_all(self, blocks: list[BlockId], namespace: Mapping[BlockId, Namespace]) -> None:
        """`push` of each block in turn, the youngest last; `namespace` has each one's."""
        assert self._all.keys().isdisjoint(blocks), "a block is already evictable"
        if self._by_ns is None:
            self._all.update(zip(blocks, map(namespace.__getitem__, blocks), strict=True))
            return
        for b in blocks:
            self.push(b, namespace[b])

    def remove(self, block: BlockId) -> None:
        ns = self._all.pop(block)
        if self._by_ns is not None:
            order = self._by_ns[ns]
            del order[block]
            if not order:
                del self._by_ns[ns]

    def discard_all(self, blocks: list[BlockId]) -> None:
        """`remove` of each of `blocks` that is here."""
        if self._by_ns is None:
            list(map(self._all.pop, blocks, repeat(None)))  # C-speed: no call per block
            return
        for b in blocks:
            if b in self._all:
                self.remove(b)

    def pop_oldest(self, n: int, ns: Namespace | None = None) -> list[BlockId]:
        """Removes and returns the `n` oldest evictable blocks (of namespace `ns`, if given),
        oldest first."""
        if self._by_ns is None:
            assert ns is None, "per-namespace eviction needs by_namespace"
            oldest = list(islice(self._all, n))  # two C-speed passes, no call per block
            assert len(oldest) == n, "evicting more blocks than are evictable"
            list(map(self._all.__delitem__, oldest))
            return oldest
        out = []
        for _ in range(n):
            block = next(iter(self._all if ns is None else self._by_ns[ns]))
            self.remove(block)
            out.append(block)
        return out

    def oldest(self, ns: Namespace | None = None) -> BlockId:
        if ns is None:
            return next(iter(self._all))
        assert self._by_ns is not None, "per-namespace eviction needs by_namespace"
        return next(iter(self._by_ns[ns]))
