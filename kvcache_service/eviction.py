"""The eviction order: unreferenced, unpinned indexed blocks, least recently used first."""

from __future__ import annotations

from collections import OrderedDict

from kvcache_service.ids import BlockId, Namespace


class EvictionOrder:
    """Evictable blocks in LRU order, globally and per namespace.

    Invariant: every block comes before (is older than) its ancestors in the index, so the
    oldest block is always the last block of a leaf and popping from the front evicts leaves
    before parents without consulting the tree. It holds because a block only enters at the
    young end when its last reference or pin goes, and a lease or pin on a block also holds
    every ancestor of it: when a block enters, its descendants are already here, and blocks
    that enter together are pushed deepest first.

    An OrderedDict, not a heap: acquiring a cached block removes it from the middle in O(1).
    """

    def __init__(self) -> None:
        self._all: OrderedDict[BlockId, Namespace] = OrderedDict()
        self._by_ns: dict[Namespace, OrderedDict[BlockId, None]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, block: BlockId) -> bool:
        return block in self._all

    def __iter__(self):  # oldest first
        return iter(self._all)

    def count(self, ns: Namespace) -> int:
        order = self._by_ns.get(ns)
        return len(order) if order else 0

    def push(self, block: BlockId, ns: Namespace) -> None:
        assert block not in self._all, f"block {block} already evictable"
        self._all[block] = ns
        self._by_ns.setdefault(ns, OrderedDict())[block] = None

    def remove(self, block: BlockId) -> None:
        ns = self._all.pop(block)
        order = self._by_ns[ns]
        del order[block]
        if not order:
            del self._by_ns[ns]

    def oldest(self, ns: Namespace | None = None) -> BlockId:
        order = self._all if ns is None else self._by_ns[ns]
        return next(iter(order))
