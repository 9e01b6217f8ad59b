"""The host-memory tier: spilled blocks kept in this process's memory, for a device with memory
of its own (CUDA). On a CPU or Apple silicon the pool already is host memory: no such tier.

A payload is the bytes ``KVPool.read_blocks`` copied out, kept as they are (they are also what
the disk tier writes). Bounded by the capacity the cache service enforces (it evicts, and the
worker deletes what it says); never past ``capacity_blocks`` plus a margin for the service's
answers in flight, dropping its own least recently used then (reported). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from worker.tier.block_file import BlockMeta, Payload, mismatch

MARGIN_BLOCKS = 64


class HostTier:
    medium = "host"

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._lock = threading.Lock()
        self._blocks: OrderedDict[int, tuple[BlockMeta, Payload]] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, meta: BlockMeta, payload: Payload) -> list[int]:
        """Keeps a block (the most recently used); returns the keys it had to drop itself."""
        with self._lock:
            self._blocks[meta.key] = (meta, payload)
            self._blocks.move_to_end(meta.key)
            dropped = []
            while len(self._blocks) > self.capacity_blocks + MARGIN_BLOCKS:
                dropped.append(self._blocks.popitem(last=False)[0])
            return dropped

    def get(self, expect: BlockMeta) -> Payload | None:
        """The payload of ``expect``'s block if held and it is that block (see disk.read)."""
        with self._lock:
            held = self._blocks.get(expect.key)
            if held is not None:
                self._blocks.move_to_end(expect.key)
        if held is None:
            return None
        meta, payload = held
        return payload if mismatch(meta, expect) is None else None

    def metas(self) -> list[BlockMeta]:
        with self._lock:
            return [meta for meta, _ in self._blocks.values()]

    def delete(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                self._blocks.pop(key, None)
