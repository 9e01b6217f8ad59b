"""The two routers' consumers of vLLM's KV events, written from their published descriptions
(issue 33), not from kvserve's publisher: each keys blocks its own way, from the events'
``token_ids``, and must end up holding exactly the blocks of the authority's index.

- **llm-d** (its kv-cache manager's token processor): a block's key is FNV-64a over the
  canonical CBOR of ``[parent key, token ids, extra]``, chained from a seed's key, full blocks
  only; a ``parent_block_hash`` it does not know restarts the chain at the root. Hashes are
  read as uint64.
- **Dynamo** (its KV router): a block's own hash is xxh3-64 with seed 1337 over its token ids
  as little-endian uint32 (test vector: ``[1, 2, 3, 4]`` -> 14643705804678351452); the
  engine's hashes (read as signed int64) only link a block to its parent and name removals.

Random workloads (shared prefixes, two namespaces, evictions in a small pool, tails that fill,
flushes and a namespace's eviction, the pool registering again, the cache service restarting
with the routers keeping what they held), both encodings.
"""

from __future__ import annotations

import random
import struct

import msgpack
import pytest
import xxhash

from kvcache_service.authority import CacheAuthority
from kvcache_service.ids import Namespace, PoolId
from kvcache_service.pool import PoolSpec
from kvcache_service.vllm_events import PoolTranslator, encode
from tests.kvcache.test_events import _authority
from tests.kvcache.test_pool_model import TTL, real_index_view
from tests.kvcache.test_vllm_events import BS, _turn, decode

# -- llm-d ------------------------------------------------------------------------------------


def cbor(value: object) -> bytes:
    """Canonical CBOR of what llm-d hashes: unsigned ints, text, null and arrays."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _head(0, value)
    if isinstance(value, str):
        raw = value.encode()
        return _head(3, len(raw)) + raw
    assert isinstance(value, list | tuple)
    return _head(4, len(value)) + b"".join(cbor(v) for v in value)


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError(n)


def fnv64a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


SEED = fnv64a(cbor(""))  # llm-d's root: the hash seed's key (vLLM's PYTHONHASHSEED, unset)


def llmd_key(parent: int, tokens: tuple[int, ...], extra: object) -> int:
    return fnv64a(cbor([parent, list(tokens), extra]))


class LlmdIndex:
    """llm-d's view: its own keys, each mapped from the engine's hash."""

    def __init__(self) -> None:
        self.keys: dict[int, int] = {}  # engine hash -> llm-d key

    def apply(self, events: list[dict]) -> None:
        for e in events:
            if e["type"] == "AllBlocksCleared":
                self.keys.clear()
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    self.keys.pop(h, None)
            else:
                bs = e["block_size"]
                parent = self.keys.get(e["parent_block_hash"], SEED)  # unknown: at the root
                extras = e.get("extra_keys") or [None] * len(e["block_hashes"])
                for i, h in enumerate(e["block_hashes"]):
                    toks = tuple(e["token_ids"][i * bs : (i + 1) * bs])
                    parent = self.keys[h] = llmd_key(parent, toks, extras[i])

    def view(self) -> set[int]:
        return set(self.keys.values())


def llmd_expected(auth: CacheAuthority) -> set[int]:
    """The keys llm-d computes for every full block of the authority's index."""
    out = set()
    for ns, prefix in real_index_view(auth.pools[PoolId("a")]):
        if len(prefix) % BS:
            continue
        parent = SEED
        for i in range(0, len(prefix), BS):
            extra = [str(ns)] if ns and i == 0 else None
            parent = llmd_key(parent, tuple(prefix[i : i + BS]), extra)
        out.add(parent)
    return out


# -- Dynamo -----------------------------------------------------------------------------------


def dynamo_local_hash(tokens: tuple[int, ...]) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=1337)


def test_dynamo_s_test_vector() -> None:
    assert dynamo_local_hash((1, 2, 3, 4)) == 14643705804678351452


class DynamoTree:
    """Dynamo's view: a tree of local block hashes; engine hashes (signed int64) find nodes."""

    def __init__(self) -> None:
        self.nodes: dict[int, tuple[int | None, int]] = {}  # engine hash -> (parent, local)

    def apply(self, payload: bytes) -> None:
        for e in decode(payload)[1]:
            if e["type"] == "AllBlocksCleared":
                self.nodes.clear()
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    del self.nodes[_i64(h)]
            else:
                bs = e["block_size"]
                parent = e["parent_block_hash"]
                parent = None if parent is None else _i64(parent)
                assert parent is None or parent in self.nodes
                for i, h in enumerate(e["block_hashes"]):
                    local = dynamo_local_hash(tuple(e["token_ids"][i * bs : (i + 1) * bs]))
                    self.nodes[_i64(h)] = (parent, local)
                    parent = _i64(h)

    def view(self) -> set[tuple[int, ...]]:
        """Each block's path of local hashes from the root. (Dynamo keys by tokens alone:
        kvserve's namespaces are told apart by the engine hashes, which differ.)"""
        out = set()
        for h in self.nodes:
            path, node = [], h
            while node is not None:
                parent, local = self.nodes[node]
                path.append(local)
                node = parent
            out.add(tuple(reversed(path)))
        return out


def _i64(h: int) -> int:
    """A hash as Dynamo reads it: a signed 64-bit integer (msgpack int64)."""
    value = struct.unpack("<q", struct.pack("<Q", h & 0xFFFFFFFFFFFFFFFF))[0]
    assert value >= 0, "kvserve's hashes fit int64 as they are"
    return value


def dynamo_expected(auth: CacheAuthority) -> set[tuple[int, ...]]:
    out = set()
    for _, prefix in real_index_view(auth.pools[PoolId("a")]):
        if len(prefix) % BS == 0:
            out.add(
                tuple(
                    dynamo_local_hash(tuple(prefix[i : i + BS])) for i in range(0, len(prefix), BS)
                )
            )
    return out


# -- the workload -----------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("seed", range(3))
def test_both_routers_rebuild_the_index(encoding: str, seed: int) -> None:
    rng = random.Random(100 + seed)
    auth, now = _authority()
    auth.register_pool(PoolSpec(PoolId("a"), 24, BS, model="m"))
    auth.watch_events(lambda: None)
    translators: dict[int, PoolTranslator] = {}
    llmd, dynamo, pos = LlmdIndex(), DynamoTree(), auth.events.cursor().seq
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(2, 14))] for _ in range(5)]
    for step in range(100):
        roll = rng.random()
        if roll < 0.03:  # a restarted worker, once its pool's TTL lapsed
            now[0] += TTL + 1
            auth.register_pool(PoolSpec(PoolId("a"), 24, BS, model="m"))
        elif roll < 0.05:  # the cache service restarted: a new log, the worker registers again
            auth, now = _authority()
            auth.watch_events(lambda: None)  # the publisher watches from the service's start
            auth.register_pool(PoolSpec(PoolId("a"), 24, BS, model="m"))
            translators, pos = {}, 0  # a new publisher; the routers keep what they hold
        elif roll < 0.08:  # an operator's flush, or one namespace's eviction
            admin = auth.pools[PoolId("a")].admin
            admin.flush() if rng.random() < 0.5 else admin.evict_namespace(Namespace("tenant-b"))
        else:
            auth.heartbeat(PoolId("a"), auth.pools[PoolId("a")].incarnation)
            tail = [rng.randrange(1, 50) for _ in range(rng.randrange(0, 9))]
            _turn(auth, rng.choice(stems) + tail, rng.choice(["", "", "tenant-b"]))
        auth.events.seal()
        for batch in auth.events.after(pos, 1 << 30):
            t = translators.setdefault(batch.pool.incarnation, PoolTranslator(BS, "GPU"))
            events = t.events(batch)
            if events:
                payload = encode(batch.timestamp, events, 0, encoding)
                llmd.apply(decode(payload)[1])
                dynamo.apply(payload)
                assert isinstance(msgpack.unpackb(payload), dict if encoding == "map" else list)
            pos = batch.seq
        assert llmd.view() == llmd_expected(auth), f"llm-d, step {step}"
        assert dynamo.view() == dynamo_expected(auth), f"Dynamo, step {step}"
