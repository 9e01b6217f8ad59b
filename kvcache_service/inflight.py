"""Prompt blocks that live leases are still filling, so that a burst computes a prefix once."""

from __future__ import annotations

from kvcache_service.ids import LeaseId, Namespace, Tokens


def chain_hashes(ns: Namespace, tokens: Tokens, block_size: int) -> list[int]:
    """One hash per full block of `tokens`, each covering the whole prefix up to that block.

    A hint, not an identity: a collision only makes a request wait for a commit that then
    does not match, and it computes the block itself on its retry.
    """
    h = hash(ns)
    out = []
    for pos in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tokens[pos : pos + block_size]))
        out.append(h)
    return out


class InFlight:
    """Chain hash of a prompt block -> the live lease allocated to fill it.

    Entries go when the lease commits that block (it is then in the index) or ends.
    """

    def __init__(self) -> None:
        self._filler: dict[int, LeaseId] = {}
        self._keys: dict[LeaseId, list[int]] = {}

    def __len__(self) -> int:
        return len(self._filler)

    def pending_run(self, hashes: list[int], start: int) -> tuple[int, LeaseId | None]:
        """From block `start`, how many consecutive blocks are being filled, and by whom."""
        end = start
        while end < len(hashes) and hashes[end] in self._filler:
            end += 1
        first = self._filler[hashes[start]] if end > start else None
        return end - start, first

    def register(self, lease: LeaseId, hashes: list[int], start: int) -> None:
        keys = self._keys.setdefault(lease, [])
        for i in range(start, len(hashes)):
            if hashes[i] not in self._filler:
                self._filler[hashes[i]] = lease
                keys.append(hashes[i])

    def committed(self, lease: LeaseId, hashes_done: set[int]) -> None:
        keys = self._keys.get(lease)
        if not keys:
            return
        keep = []
        for h in keys:
            if h in hashes_done:
                del self._filler[h]
            else:
                keep.append(h)
        self._keys[lease] = keep

    def ended(self, lease: LeaseId) -> None:
        for h in self._keys.pop(lease, ()):
            del self._filler[h]

    def check_integrity(self, live: set[LeaseId]) -> list[str]:
        problems = []
        for h, lease in self._filler.items():
            if lease not in live:
                problems.append(f"in-flight block of ended lease {lease}")
            elif h not in self._keys.get(lease, ()):
                problems.append(f"in-flight entry of lease {lease} not in its key list")
        if sum(len(k) for k in self._keys.values()) != len(self._filler):
            problems.append("in-flight key lists disagree with the filler map")
        return problems
