"""A naive consumer of the KV events: replays them into flat dictionaries, checking the
stream's contract as it goes, and reads the result as the domain tests read the real index.

Deliberately nothing like the radix tree: each block is (namespace, parent, its own tokens),
and a block's whole prefix is found by walking its parents. Strict: a stored block must not
be held already, its parent must be; a removed block must be held and have no held child; a
batch's numbers must follow the last ones (seq across the stream, pool_seq per pool).
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field

from kvcache_service.event_types import (
    Batch,
    Cleared,
    ClearReason,
    Removed,
    Stored,
    TierRemoved,
    TierStored,
)
from kvcache_service.tokens import unpack
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb


@dataclass
class ReplicaPool:
    incarnation: int
    block_size: int
    # block -> (namespace, parent block or None, its own token ids)
    blocks: dict[int, tuple[str, int | None, tuple[int, ...]]] = field(default_factory=dict)
    children: Counter[int] = field(default_factory=Counter)
    # medium -> tier key -> (namespace, parent key)
    tiers: dict[int, dict[int, tuple[str, int]]] = field(default_factory=dict)

    def store(self, ns: str, parent: int | None, blocks: list[int], tokens: tuple[int, ...]):
        bs = self.block_size
        assert len(tokens) > (len(blocks) - 1) * bs and len(tokens) <= len(blocks) * bs
        for i, b in enumerate(blocks):
            assert b not in self.blocks, f"block {b} stored twice"
            if parent is not None:
                assert parent in self.blocks, f"block {b}'s parent {parent} is not held"
                pns, _, ptoks = self.blocks[parent]
                assert pns == ns and len(ptoks) == bs, f"block {b} hangs under a tail or elsewhere"
            self.blocks[b] = (ns, parent, tokens[i * bs : (i + 1) * bs])
            if parent is not None:
                self.children[parent] += 1
            parent = b

    def remove(self, blocks: list[int]) -> None:
        for b in blocks:
            assert b in self.blocks, f"block {b} removed but not held"
            assert not self.children[b], f"block {b} removed before its children"
            parent = self.blocks.pop(b)[1]
            if parent is not None:
                self.children[parent] -= 1

    def prefix(self, b: int) -> tuple[str, tuple[int, ...]]:
        ns, parent, toks = self.blocks[b]
        parts = [toks]
        while parent is not None:
            _, parent, toks = self.blocks[parent]
            parts.append(toks)
        return ns, tuple(t for part in reversed(parts) for t in part)

    def view(self) -> dict[tuple[str, tuple[int, ...]], int]:
        """(namespace, prefix through the block) -> block: tests.kvcache.test_pool_model's
        real_index_view of the same index."""
        return {self.prefix(b): b for b in self.blocks}


@dataclass
class Replica:
    pools: dict[str, ReplicaPool] = field(default_factory=dict)
    seq: int = 0  # the last batch applied (the cursor)
    pool_seq: dict[str, int] = field(default_factory=dict)

    def reset(self, seq: int, pool_id: str | None = None) -> None:
        """Drops what it holds (of one pool, or all) before a snapshot at ``seq``."""
        for p in [p for p in self.pools if pool_id is None or p == pool_id]:
            del self.pools[p]
        for p in [p for p in self.pool_seq if pool_id is None or p == pool_id]:
            del self.pool_seq[p]
        self.seq = seq

    def begin(self, pool_id: str, incarnation: int, block_size: int) -> ReplicaPool:
        pool = self.pools.get(pool_id)
        if pool is None or pool.incarnation != incarnation:
            assert pool is None or not pool.blocks, f"pool {pool_id}: new incarnation, not cleared"
            pool = self.pools[pool_id] = ReplicaPool(incarnation, block_size)
        return pool

    def check_numbers(self, seq: int, pool_id: str, pool_seq: int, snapshot: bool, dense: bool):
        if snapshot:
            assert seq == self.seq, "a snapshot batch is at the snapshot's position"
        else:
            assert seq > self.seq and (not dense or seq == self.seq + 1), (self.seq, seq)
            if pool_id in self.pool_seq:
                assert pool_seq == self.pool_seq[pool_id] + 1, (pool_id, pool_seq)
            self.seq = seq
        self.pool_seq[pool_id] = pool_seq

    # -- the domain's batches (pure tests) ----------------------------------------------------

    def apply(self, b: Batch, snapshot: bool = False, dense: bool = True) -> None:
        key = b.pool
        self.check_numbers(b.seq, key.pool_id, b.pool_seq, snapshot, dense)
        if snapshot:
            self.begin(key.pool_id, key.incarnation, key.block_size)
        for e in b.events:
            if isinstance(e, Cleared):
                assert not snapshot
                self.pools.pop(key.pool_id, None)
                if e.reason is ClearReason.REGISTERED:
                    self.begin(key.pool_id, key.incarnation, key.block_size)
                continue
            pool = self.pools.get(key.pool_id)
            assert pool is not None and pool.incarnation == key.incarnation, "an unknown pool"
            if isinstance(e, Stored):
                pool.store(e.namespace, e.parent, list(e.blocks), unpack(e.tokens))
            elif isinstance(e, TierStored):
                held = pool.tiers.setdefault(e.medium, {})
                assert len(e.keys) == len(e.parents)
                for k, parent in zip(e.keys, e.parents, strict=True):
                    assert k not in held, f"tier block {k} stored twice"
                    held[k] = (e.namespace, parent)
            elif isinstance(e, TierRemoved):
                assert not snapshot
                held = pool.tiers.get(e.medium, {})
                for k in e.keys:
                    assert held.pop(k, None) is not None, f"tier block {k} was not held"
            else:
                assert isinstance(e, Removed) and not snapshot
                pool.remove(list(e.blocks))

    # -- the wire's (servicer tests) ----------------------------------------------------------

    def apply_message(self, m: pb.WatchEventsResponse, state: dict[str, object]) -> None:
        """One message of a WatchEvents stream; ``state`` tracks the stream's phase:
        "snapshot" between a reset and `synced`, and the pool filter."""
        kind = m.WhichOneof("message")
        if kind == "reset":
            assert state.get("phase") in (None, "resuming"), "a reset comes first or not at all"
            self.reset(m.reset.cursor.seq, state.get("pool_id") or None)  # type: ignore[arg-type]
            state["phase"] = "snapshot"
        elif kind == "synced":
            assert state.get("phase") in ("snapshot", "resuming")
            assert m.synced.seq >= self.seq
            self.seq = m.synced.seq
            state["phase"] = "live"
        else:
            assert state.get("phase") in ("snapshot", "resuming", "live")
            self.apply_wire(m.batch, state["phase"] == "snapshot", not state.get("pool_id"))

    def apply_wire(self, b: pb.KVEventBatch, snapshot: bool, dense: bool) -> None:
        self.check_numbers(b.cursor.seq, b.pool_id, b.pool_seq, snapshot, dense)
        if snapshot:
            self.begin(b.pool_id, b.incarnation, b.block_size)
        for e in b.events:
            kind = e.WhichOneof("event")
            if kind == "cleared":
                assert not snapshot
                self.pools.pop(b.pool_id, None)
                if e.cleared.reason == pb.PoolCleared.REASON_REGISTERED:
                    self.begin(b.pool_id, b.incarnation, b.block_size)
                else:
                    assert e.cleared.reason == pb.PoolCleared.REASON_FORGOTTEN
                continue
            pool = self.pools.get(b.pool_id)
            assert pool is not None and pool.incarnation == b.incarnation, "an unknown pool"
            if kind == "stored":
                s = e.stored
                parent = s.parent_block if s.HasField("parent_block") else None
                tokens = array("I")
                tokens.frombytes(s.tokens)  # little-endian on the machines tests run on
                pool.store(s.namespace, parent, list(s.blocks), tuple(tokens))
            elif kind == "tier_stored":
                t = e.tier_stored
                held = pool.tiers.setdefault(t.medium, {})
                for k, parent_key in zip(t.keys, t.parent_keys, strict=True):
                    assert k not in held, f"tier block {k} stored twice"
                    held[k] = (t.namespace, parent_key)
            elif kind == "tier_removed":
                assert not snapshot
                held = pool.tiers.get(e.tier_removed.medium, {})
                for k in e.tier_removed.keys:
                    assert held.pop(k, None) is not None, f"tier block {k} was not held"
            else:
                assert kind == "removed" and not snapshot
                pool.remove(list(e.removed.blocks))
