"""One pool's radix index as the gateway copies it from KV events (``--route-from-events``).

:class:`PoolCopy` holds the pool's blocks as (namespace, parent block) -> children by their
tokens, and answers how many leading tokens of a prompt the pool holds, walking it the way the
cache service's ``RadixIndex.match`` walks its tree: whole blocks, then the best partial match
among the children that share the next token. It also holds the keys of the blocks the pool's
worker keeps in its tiers (host memory, disk: docs/kv-tiers.md), and counts the run of them
that would follow the match and load instead of computing, as the service's ``Route`` does
(``PoolState.match_tokens``). ``gateway.event_index`` keeps one per pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

from kvserve_proto.block_keys import block_keys, namespace_key
from kvserve_proto.packed_tokens import TOKEN_BYTES

# Siblings a partial (sub-block) match compares, as the cache service's PARTIAL_SCAN_LIMIT.
PARTIAL_SCAN_LIMIT = 64

Parent = tuple[str, int | None]  # (namespace, parent block; None at the namespace's root)


def _common_tokens(a: bytes, b: bytes) -> int:
    """How many leading 4-byte tokens ``a`` and ``b`` share (a binary search of compares)."""
    lo, hi = 0, min(len(a), len(b)) // TOKEN_BYTES
    while lo < hi:
        mid = (lo + hi + 1) // 2
        k = mid * TOKEN_BYTES
        if a[:k] == b[:k]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Desync(Exception):
    """The stream says something this copy cannot apply: start over from a snapshot."""


class PoolCopy:
    """One pool's index as the events built it."""

    def __init__(self, incarnation: int, block_size: int) -> None:
        self.incarnation = incarnation
        self.block_size = block_size
        self.chunk_bytes = block_size * TOKEN_BYTES
        # Children of each block (and of each namespace's root) by their tokens, and again by
        # their first token (the partial match looks only at those).
        self._children: dict[Parent, dict[bytes, int]] = {}
        self._by_first: dict[tuple[Parent, bytes], dict[bytes, int]] = {}
        self._blocks: dict[int, tuple[Parent, bytes]] = {}
        self._tiers: dict[int, set[int]] = {}  # medium -> the keys its tier holds

    def __len__(self) -> int:
        return len(self._blocks)

    def store(self, ns: str, parent: int | None, blocks: Sequence[int], tokens: bytes) -> None:
        cb = self.chunk_bytes
        if parent is not None and parent not in self._blocks:
            raise Desync(f"block {blocks[0]} stored under block {parent}, which is not held")
        for i, b in enumerate(blocks):
            if b in self._blocks:
                raise Desync(f"block {b} stored twice")
            key = (ns, parent)
            toks = tokens[i * cb : (i + 1) * cb]
            self._blocks[b] = (key, toks)
            self._children.setdefault(key, {})[toks] = b
            self._by_first.setdefault((key, toks[:TOKEN_BYTES]), {})[toks] = b
            parent = b

    def remove(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            entry = self._blocks.pop(b, None)
            if entry is None:
                raise Desync(f"block {b} removed but not held")
            key, toks = entry
            _drop(self._children, key, toks)
            _drop(self._by_first, (key, toks[:TOKEN_BYTES]), toks)

    def tier_store(self, medium: int, keys: Iterable[int]) -> None:
        self._tiers.setdefault(medium, set()).update(keys)

    def tier_remove(self, medium: int, keys: Iterable[int]) -> None:
        held = self._tiers.get(medium)
        if held is not None:
            held.difference_update(keys)

    def cached_tokens(self, ns: str, prompt: bytes) -> int:
        """Leading tokens of ``prompt`` (packed) an acquire would reuse: what ``Route`` says
        (at least one prompt token is always computed)."""
        return self.route_tokens(ns, prompt)[0]

    def route_tokens(self, ns: str, prompt: bytes) -> tuple[int, int]:
        """(cached tokens, tier tokens) of ``prompt`` (packed), as ``Route`` answers them: the
        pool's match, then the run of blocks after its whole blocks that the tiers hold (a
        partial match into the first of them dropped: the whole block loads), stopping short
        of the prompt's last token."""
        cb = self.chunk_bytes
        parent: int | None = None
        pos = 0
        while True:
            kids = self._children.get((ns, parent))
            if not kids:
                break
            key = prompt[pos : pos + cb]
            child = kids.get(key) if len(key) == cb else None
            if child is not None:
                parent, pos = child, pos + cb
                continue
            group = self._by_first.get(((ns, parent), key[:TOKEN_BYTES])) if key else None
            if group:
                best = max(_common_tokens(key, t) for t in islice(group, PARTIAL_SCAN_LIMIT))
                pos += best * TOKEN_BYTES
            break
        n = len(prompt) // TOKEN_BYTES
        cached = max(0, min(pos // TOKEN_BYTES, n - 1))
        full = cached // self.block_size
        limit = (n - 1) // self.block_size - full
        held = [t for t in self._tiers.values() if t]
        if limit <= 0 or not held:
            return cached, 0
        # The tiers name blocks by their keys: the prompt's, as far as a tier block may reach
        # (hashed here, only for pools whose tiers hold something: ~0.3 us a block).
        run = 0
        for k in block_keys(namespace_key(ns), prompt, 0, cb, full + limit)[full:]:
            if not any(k in t for t in held):
                break
            run += 1
        return (full * self.block_size if run else cached), run * self.block_size


def _drop(groups: dict, key: object, toks: bytes) -> None:
    group = groups.get(key)
    if group is not None:
        group.pop(toks, None)
        if not group:
            del groups[key]
