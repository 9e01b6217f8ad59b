"""Physical block ids of one worker pool: the free list, refcounts and pin counts."""

from __future__ import annotations

from kvcache_service.errors import OutOfBlocks
from kvcache_service.ids import BlockId
from kvcache_service.integrity import BlockSnapshot


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockPool:
    """Which blocks are free, and how many live leases reference each one.

    The pool knows nothing about the index: a block that is neither free nor referenced is
    cached (indexed, evictable). Only the Budget calls these methods; it keeps refcounts equal
    to the number of live leases listing a block, which the pool's check_integrity verifies.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # A stack: allocate pops from the end, so low ids are handed out first.
        self._free: list[BlockId] = [BlockId(b) for b in range(num_blocks - 1, -1, -1)]
        self._is_free = bytearray(b"\x01") * num_blocks
        self.refcount = [0] * num_blocks
        self.pins = [0] * num_blocks
        self.any_pinned = False  # set by the first pin: until then nothing checks `pins`
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[BlockId]:
        """Takes n free blocks, all or nothing, each referenced once (by the lease that gets
        it)."""
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} free blocks, have {len(self._free)}")
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        is_free, refcount = self._is_free, self.refcount
        for b in taken:
            is_free[b] = 0
            refcount[b] = 1
        self.peak_used = max(self.peak_used, self.num_blocks - len(self._free))
        return taken

    def free(self, blocks: list[BlockId]) -> None:
        """Returns `blocks` to the free list, in order (the last one is handed out first)."""
        is_free, rc, pins = self._is_free, self.refcount, self.pins
        for b in blocks:
            assert not (is_free[b] or rc[b] or pins[b]), f"block {b}: double free, or live"
            is_free[b] = 1
        self._free += blocks

    def snapshot(self) -> BlockSnapshot:
        """Copies of the arrays (C-speed: ~3 ms per 1M blocks each) for an off-loop check."""
        return BlockSnapshot(
            list(self._free), bytes(self._is_free), list(self.refcount), list(self.pins)
        )
