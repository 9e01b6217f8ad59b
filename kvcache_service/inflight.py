"""Prompt blocks that live leases are still filling, so that a burst computes a prefix once."""

from __future__ import annotations

from bisect import bisect_left
from itertools import compress, pairwise, repeat
from operator import eq

from kvcache_service.ids import LeaseId, Namespace, Tokens
from kvserve_proto.block_keys import block_keys, namespace_key


def chain_seed(ns: Namespace) -> int:
    """The chain hash before a sequence's first block: its namespace's."""
    return namespace_key(ns)


def chain_hashes(
    seed: int, tokens: Tokens, first: int, chunk_bytes: int, stop: int | None = None
) -> list[int]:
    """One hash per full block of `tokens` from block `first` on (before block `stop`, if
    given), each covering the whole prefix up to that block; `seed` is the chain hash of
    block `first - 1` (the index keeps it for every indexed block) or `chain_seed` for block
    0. So a block is hashed once, by the lease that fills it, not by every acquire over the
    whole prompt.

    The shared, stable block keys (``kvserve_proto.block_keys``): the tier index and the
    workers' spilled blocks use the same ones. Within this service a hint, not an identity:
    a collision only makes a request wait for a commit that then does not match, and it
    computes the block itself on its retry.
    """
    return block_keys(seed, tokens, first, chunk_bytes, stop)


class InFlight:
    """Chain hash of a prompt block -> the live lease allocated to fill it.

    Entries go when the lease commits that block (it is then in the index) or ends. Each
    lease's own entries are kept as two lists in block order (positions, hashes), so that
    registering, committing and ending are C-speed passes over them: a loop over a lease's
    ~40 blocks with a test and a tuple each cost ~10 us an acquire-commit pair.
    """

    def __init__(self) -> None:
        self._filler: dict[int, LeaseId] = {}
        self._keys: dict[LeaseId, tuple[list[int], list[int]]] = {}

    def __len__(self) -> int:
        return len(self._filler)

    def pending_run(self, hashes: list[int]) -> tuple[int, LeaseId | None]:
        """How many consecutive blocks from `hashes[0]` on are being filled, and by whom."""
        end = 0
        while end < len(hashes) and hashes[end] in self._filler:
            end += 1
        return end, self._filler[hashes[0]] if end else None

    def register(self, lease: LeaseId, hashes: list[int], start: int) -> None:
        """Records `lease` as the filler of its prompt blocks `start`.. (`hashes`) that no
        other live lease is filling (the first to register a block keeps it)."""
        owners = map(self._filler.setdefault, hashes, repeat(lease))
        mine = list(map(eq, owners, repeat(lease)))
        positions = list(compress(range(start, start + len(hashes)), mine))
        self._keys[lease] = (positions, list(compress(hashes, mine)))

    def committed(self, lease: LeaseId, indexed_blocks: int) -> None:
        """`lease` indexed its blocks before position `indexed_blocks`."""
        keys = self._keys.get(lease)
        if keys is None:
            return
        positions, hashes = keys
        k = bisect_left(positions, indexed_blocks)
        # pop(h, None): a hash that repeats inside one prompt (a collision) is listed twice.
        list(map(self._filler.pop, hashes[:k], repeat(None)))
        del positions[:k], hashes[:k]

    def ended(self, lease: LeaseId) -> None:
        _, hashes = self._keys.pop(lease, ((), ()))
        list(map(self._filler.pop, hashes, repeat(None)))

    def check_integrity(self, live: set[LeaseId]) -> list[str]:
        problems = []
        registered = {h: lease for lease, (_, hashes) in self._keys.items() for h in hashes}
        for h, lease in self._filler.items():
            if lease not in live:
                problems.append(f"in-flight block of ended lease {lease}")
            elif registered.get(h) != lease:
                problems.append(f"in-flight entry of lease {lease} not in its key list")
        if registered.keys() != self._filler.keys():
            problems.append("in-flight key lists disagree with the filler map")
        for lease, (positions, hashes) in self._keys.items():
            if len(positions) != len(hashes) or any(a >= b for a, b in pairwise(positions)):
                problems.append(f"in-flight keys of lease {lease} are out of block order")
        return problems
