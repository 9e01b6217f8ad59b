"""A pool's integrity check, split so that its O(num_blocks) part can run off the event loop.

The check walks every block id. On a pool of 1M blocks that is ~0.7 s of Python (measured),
16M blocks took 7-16 s: run on the service's event loop in one piece it stalled every
Heartbeat long enough for healthy leases to expire. So ``PoolState.integrity_snapshot`` runs
on the loop and does only work proportional to what is indexed or leased (the tree, the
leases, the LRU order), plus C-speed copies of the per-block arrays (~3 ms per 1M blocks
each); the per-block pass over those copies (``IntegritySnapshot.steps``) touches nothing
shared and is a generator that stops every ``CHUNK`` blocks, so the servicer runs it on the
loop a slice at a time and Heartbeats and leases are served between slices.

Why slices on the loop and not a thread: a pure-Python pass on a thread holds the GIL in
5 ms turns, and every hand-over on the loop's side (each gRPC callback, each poll) waits for
one; on 2 busy cores a single Heartbeat took 0.54 s of a 1.2 s check that way. A slice
bounds the wait by its own size, whatever the machine's load.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass

from kvcache_service.ids import BlockId
from kvcache_service.tier_index import TierSnapshot

CHUNK = 2048  # blocks per slice: ~1.5 ms of Python on this CPU

Steps = Generator[None, None, list[str]]  # yields between slices, returns the problems


def drain(steps: Steps) -> list[str]:
    """Runs ``steps`` to the end in one go (tests, and callers that own their thread)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@dataclass(frozen=True, slots=True)
class BlockSnapshot:
    """Copies of a ``BlockPool``'s arrays, taken in one event-loop step: consistent."""

    free: list[BlockId]
    is_free: bytes
    refcount: list[int]
    pins: list[int]

    def steps(self, chunk: int = CHUNK) -> Steps:
        problems = []
        free, is_free, rc, pins = self.free, self.is_free, self.refcount, self.pins
        seen = bytearray(len(is_free))
        twice = False
        for start in range(0, len(free), chunk):
            for b in free[start : start + chunk]:
                twice = twice or bool(seen[b])
                seen[b] = 1
                if not is_free[b]:
                    problems.append(f"block {b} on the free list but not marked free")
                if rc[b] or pins[b]:
                    problems.append(f"free block {b} has refcount {rc[b]}")
            yield
        if twice:
            problems.append("free list holds a block twice")
        if is_free.count(1) != len(free):
            problems.append("free marks disagree with the free list")
        if min(rc, default=0) < 0:
            problems.append("negative refcount")
        return problems

    def problems(self) -> list[str]:
        return drain(self.steps())


@dataclass(frozen=True, slots=True)
class IntegritySnapshot:
    """One pool's state as its per-block invariants need it, and what the loop already found.

    Immutable and unshared: ``problems`` is safe on any thread.
    """

    label: str  # "pool 'w1'", prefixed to every problem
    blocks: BlockSnapshot
    found: list[str]  # problems found on the loop (index, leases, LRU order, namespaces)
    listed: Counter[BlockId]  # how many live leases list each block
    indexed: frozenset[BlockId]
    evictable: frozenset[BlockId]  # the LRU order's blocks
    charged: frozenset[BlockId]  # blocks charged to a namespace
    pin_counts: Counter[BlockId]  # pins implied by the pinned prefixes
    tiers: TierSnapshot  # the tier index, copied (its check is O(blocks the tiers hold))

    def problems(self) -> list[str]:
        """Every problem, in one go."""
        return drain(self.steps())

    def steps(self, chunk: int = CHUNK) -> Steps:
        """Every problem: those found on the loop, then the per-block pass (O(num_blocks)),
        stopping every ``chunk`` blocks so that a caller on the event loop can yield."""
        blk = self.blocks
        rc, pins, is_free = blk.refcount, blk.pins, blk.is_free
        n = len(rc)
        problems = list(self.found)
        problems += yield from blk.steps(chunk)
        problems += self.tiers.problems()
        referenced = n - rc.count(0)
        cached_unref = sum(1 for b in self.indexed if not rc[b])
        if len(blk.free) + cached_unref + referenced != n:
            problems.append(
                f"free {len(blk.free)} + cached {cached_unref} + referenced {referenced} != {n}"
            )
        pins_agree = True
        for start in range(0, n, chunk):
            for b in range(start, min(n, start + chunk)):
                if rc[b] != self.listed[BlockId(b)]:
                    listed = self.listed[BlockId(b)]
                    problems.append(f"block {b}: refcount {rc[b]} but {listed} leases list it")
                indexed = b in self.indexed
                evictable = indexed and not rc[b] and not pins[b]
                if evictable != (b in self.evictable):
                    problems.append(
                        f"block {b}: evictable={evictable} but in order={not evictable}"
                    )
                if pins[b] and not indexed:
                    problems.append(f"pinned block {b} is not indexed")
                if not is_free[b] and not indexed and not rc[b]:
                    problems.append(f"block {b} leaked: not free, not indexed, not referenced")
                if bool(is_free[b]) == (b in self.charged):
                    problems.append(f"block {b}: namespace charge disagrees with the free list")
                pins_agree = pins_agree and pins[b] == self.pin_counts[BlockId(b)]
            yield
        if not pins_agree:
            problems.append("pin counts disagree with the pinned prefixes")
        return [f"{self.label}: {m}" for m in problems]
