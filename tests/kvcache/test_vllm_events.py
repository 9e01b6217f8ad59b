"""KV events in vLLM's wire format (kvcache_service/vllm_events.py).

A consumer written from vLLM's published format (nothing of the publisher's code): it decodes
each msgpack payload (maps, or the older arrays), keeps every stored block as (parent hash,
its token ids, its chain's salt), checks the stream's rules as it goes (a parent must be held,
a hash stored once, a removal held, full blocks only) and reads back (namespace, prefix) for
every block. After random workloads (shared prefixes, two namespaces, evictions of a small
pool, tails that fill, pools registering again) that view must equal the authority's index,
full blocks only. Then the real thing: a subscriber with pyzmq alone on a running service, and
a late joiner through the replay socket.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
from array import array
from dataclasses import dataclass, field

import msgpack
import pytest
import zmq

from kvcache_service.authority import CacheAuthority
from kvcache_service.config import ServiceConfig
from kvcache_service.ids import Namespace, PoolId
from kvcache_service.kv_events_config import KvEventsConfig
from kvcache_service.leases import AcquireRequest, Grant, SequenceUpdate
from kvcache_service.pool import PoolSpec
from kvcache_service.server import running
from kvcache_service.tier_index import Medium, TierBlock
from kvcache_service.tokens import pack
from kvcache_service.vllm_events import PoolTranslator, block_hash, block_key, encode
from kvserve_launch.startup import StartupError
from kvserve_proto.block_keys import block_keys, namespace_key
from tests.kvcache.test_events import _authority
from tests.kvcache.test_pool_model import TTL, real_index_view

BS = 4

# -- the consumer ------------------------------------------------------------------------------

_FIELDS = {
    "BlockStored": [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}


def decode(payload: bytes) -> tuple[float, list[dict], int]:
    """An EventBatch, either form, as (ts, events as maps, data_parallel_rank)."""
    raw = msgpack.unpackb(payload)
    if isinstance(raw, dict):
        return raw["ts"], raw["events"], raw.get("data_parallel_rank", 0)
    ts, events, rank = raw
    maps = []
    for row in events:
        kind, values = row[0], row[1:]
        names = _FIELDS[kind]
        assert len(values) <= len(names), row
        maps.append({"type": kind, **dict(zip(names, values, strict=False))})
    return ts, maps, rank


@dataclass
class Consumer:
    block_size: int
    # hash -> (parent hash, the block's token ids, the chain's salt)
    blocks: dict[int, tuple[int | None, tuple[int, ...], str]] = field(default_factory=dict)
    # (medium, hash) of blocks in the tiers ("CPU", "DISK"): location only, as vLLM's
    # offloading connector sends them
    tiers: set[tuple[str, int]] = field(default_factory=set)

    def apply(self, events: list[dict]) -> None:
        for e in events:
            kind = e["type"]
            if kind == "AllBlocksCleared":
                self.blocks.clear()
                self.tiers.clear()
            elif kind == "BlockRemoved" and e.get("medium", "GPU") != "GPU":
                for h in e["block_hashes"]:
                    assert (e["medium"], h) in self.tiers, f"removed {h}, never in the tier"
                    self.tiers.remove((e["medium"], h))
            elif kind == "BlockRemoved":
                for h in e["block_hashes"]:
                    assert h in self.blocks, f"removed {h}, never stored"
                    del self.blocks[h]
            elif e.get("medium", "GPU") != "GPU":
                assert kind == "BlockStored" and e["medium"] in ("CPU", "DISK"), e
                assert not e["token_ids"] and e["parent_block_hash"] is None, "location only"
                assert e["block_size"] == self.block_size
                for h in e["block_hashes"]:
                    assert 0 <= h < 1 << 63 and (e["medium"], h) not in self.tiers
                    self.tiers.add((e["medium"], h))
            else:
                assert kind == "BlockStored", kind
                self._store(e)

    def _store(self, e: dict) -> None:
        bs = e["block_size"]
        assert bs == self.block_size
        hashes, toks = e["block_hashes"], e["token_ids"]
        assert len(toks) == bs * len(hashes), "full blocks only"
        extra = e.get("extra_keys") or [None] * len(hashes)
        parent = e["parent_block_hash"]
        salt = ""
        if parent is not None:
            assert parent in self.blocks, "a parent must be stored first"
            salt = self.blocks[parent][2]
        elif extra[0]:
            (salt,) = extra[0]
        for i, h in enumerate(hashes):
            assert 0 <= h < 1 << 63, "fits a signed and an unsigned 64-bit integer"
            assert h not in self.blocks, "stored twice"
            self.blocks[h] = (parent, tuple(toks[i * bs : (i + 1) * bs]), salt)
            parent = h

    def view(self) -> set[tuple[str, tuple[int, ...]]]:
        out = set()
        for h in self.blocks:
            parts, salt, node = [], self.blocks[h][2], h
            while node is not None:
                parent, toks, _ = self.blocks[node]
                parts.append(toks)
                node = parent
            out.add((salt, tuple(t for p in reversed(parts) for t in p)))
        return out


def full_blocks(auth: CacheAuthority, pool: str) -> set[tuple[str, tuple[int, ...]]]:
    view = real_index_view(auth.pools[PoolId(pool)])
    return {(str(ns), prefix) for ns, prefix in view if len(prefix) % BS == 0}


# -- translation, pure -------------------------------------------------------------------------


def hashes_of(salt: str, prefix: tuple[int, ...]) -> list[int]:
    """The published hashes of a prefix's blocks, from kvserve's block keys alone."""
    packed = array("I", prefix).tobytes()  # (little-endian machines: the keys' byte order)
    return [k & ((1 << 63) - 1) for k in block_keys(namespace_key(salt), packed, 0, 4 * BS)]


def test_hashes_chain_by_parent_and_namespace() -> None:
    a = block_hash(None, [1, 2, 3, 4], "")
    assert a == block_hash(None, [1, 2, 3, 4], "")  # stable: across pools and restarts
    assert a != block_hash(None, [1, 2, 3, 4], "tenant")  # salted
    ka = block_key(None, [1, 2, 3, 4], "")
    assert block_hash(ka, [5, 6, 7, 8], "") != block_hash(None, [5, 6, 7, 8], "")
    assert all(0 <= h < 1 << 63 for h in (a, block_hash(ka, [9] * 4, "x")))
    # One name per block: the hash is the block key the service and the tiers use.
    assert [a, block_hash(ka, [5, 6, 7, 8], "")] == hashes_of("", (1, 2, 3, 4, 5, 6, 7, 8))
    # The translator's (inlined) hashing is this function's.
    auth, _ = _authority()
    auth.register_pool(PoolSpec(PoolId("a"), 16, BS))
    auth.watch_events(lambda: None)
    _turn(auth, [1, 2, 3, 4, 5, 6, 7, 8, 9], "tenant")
    t = PoolTranslator(BS, "GPU")
    stored = [
        e for b in auth.events.after(0, 99) for e in t.events(b) if e["type"] == "BlockStored"
    ]
    first = block_key(None, [1, 2, 3, 4], "tenant")
    expected = [first & ((1 << 63) - 1), block_hash(first, [5, 6, 7, 8], "tenant")]
    assert stored[0]["block_hashes"] == expected


def _turn(auth: CacheAuthority, prompt: list[int], ns: str, pool: str = "a") -> None:
    inc = auth.pools[PoolId(pool)].incarnation
    req = AcquireRequest(PoolId(pool), inc, Namespace(ns), pack(prompt, "p"), 0)
    grant, _ = auth.acquire(req)
    if isinstance(grant, Grant):  # a full pool defers: the turn is skipped
        auth.release(PoolId(pool), inc, grant.lease_id, SequenceUpdate.whole(pack(prompt, "p")))
    auth.events.seal()


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("seed", range(4))
def test_a_consumer_rebuilds_the_index_from_the_events(encoding: str, seed: int) -> None:
    rng = random.Random(seed)
    auth, now = _authority()
    auth.register_pool(PoolSpec(PoolId("a"), 24, BS, model="m"))
    auth.watch_events(lambda: None)
    translators: dict[int, PoolTranslator] = {}
    consumer, pos = Consumer(BS), auth.events.cursor().seq
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(2, 14))] for _ in range(5)]
    for step in range(120):
        roll = rng.random()
        if roll < 0.03:  # a restarted worker, once its pool's TTL lapsed
            now[0] += TTL + 1
            auth.register_pool(PoolSpec(PoolId("a"), 24, BS, model="m"))
            auth.events.seal()
        else:
            auth.heartbeat(PoolId("a"), auth.pools[PoolId("a")].incarnation)
            stem = rng.choice(stems)
            tail = [rng.randrange(1, 50) for _ in range(rng.randrange(0, 9))]
            _turn(auth, stem + tail, rng.choice(["", "", "tenant-b"]))
        for batch in auth.events.after(pos, 1 << 30):
            t = translators.setdefault(batch.pool.incarnation, PoolTranslator(BS, "GPU"))
            events = t.events(batch)
            if events:
                _, decoded, rank = decode(encode(batch.timestamp, events, 0, encoding))
                assert rank == 0
                consumer.apply(decoded)
            pos = batch.seq
        assert consumer.view() == full_blocks(auth, "a"), f"step {step}"
        assert not any(t.skipped for t in translators.values())


def _spill(auth: CacheAuthority, prompt: list[int], ns: str, medium: Medium) -> None:
    """What a worker's write-through reports: the prompt's full blocks, by key, in a tier."""
    inc = auth.pools[PoolId("a")].incarnation
    packed = array("I", prompt).tobytes()
    keys = block_keys(namespace_key(ns), packed, 0, 4 * BS)
    parents = [namespace_key(ns), *keys][: len(keys)]
    stored = [TierBlock(k, p, Namespace(ns), medium) for k, p in zip(keys, parents, strict=True)]
    auth.update_tiers(PoolId("a"), inc, stored, [])
    auth.events.seal()


@pytest.mark.skipif(sys.byteorder != "little", reason="the test packs tokens natively")
@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("seed", range(3))
def test_tier_blocks_are_published_under_the_hashes_they_have_in_the_pool(
    encoding: str, seed: int
) -> None:
    """Random turns spilled to a host and a disk tier (small: they evict), tier drops, a tier
    flush and re-registrations: the consumer's tier view is the authority's, by hash and
    medium, and every block's hash, in the pool or a tier, is its kvserve block key's."""
    rng = random.Random(seed)
    auth, now = _authority()
    spec = PoolSpec(PoolId("a"), 24, BS, model="m", tiers=((Medium.HOST, 6), (Medium.DISK, 14)))
    auth.register_pool(spec)
    auth.watch_events(lambda: None)
    translators: dict[int, PoolTranslator] = {}
    consumer, pos = Consumer(BS), auth.events.cursor().seq
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(2, 14))] for _ in range(5)]
    media = {Medium.HOST: "CPU", Medium.DISK: "DISK"}
    both = 0
    for step in range(150):
        roll = rng.random()
        pool = auth.pools[PoolId("a")]
        if roll < 0.03:
            now[0] += TTL + 1
            auth.register_pool(spec)
            auth.events.seal()
        elif roll < 0.08:
            auth.flush("a", rng.choice([Medium.HOST, Medium.DISK]))
            auth.events.seal()
        elif roll < 0.15 and pool.tiers.keys(Medium.DISK):
            gone = rng.choice(list(pool.tiers.keys(Medium.DISK)))
            auth.update_tiers(PoolId("a"), pool.incarnation, [], [(gone, Medium.DISK)])
            auth.events.seal()
        else:
            auth.heartbeat(PoolId("a"), pool.incarnation)
            prompt = rng.choice(stems) + [rng.randrange(1, 50) for _ in range(rng.randrange(9))]
            ns = rng.choice(["", "", "tenant-b"])
            _turn(auth, prompt, ns)
            _spill(auth, prompt, ns, rng.choice([Medium.HOST, Medium.DISK]))
        for batch in auth.events.after(pos, 1 << 30):
            t = translators.setdefault(batch.pool.incarnation, PoolTranslator(BS, "GPU"))
            events = t.events(batch)
            if events:
                _, decoded, _ = decode(encode(batch.timestamp, events, 0, encoding))
                consumer.apply(decoded)
            pos = batch.seq
        tiers = auth.pools[PoolId("a")].tiers
        held = {(media[m], k & ((1 << 63) - 1)) for m in media for k in tiers.keys(m)}
        assert consumer.tiers == held, f"step {step}"
        assert consumer.view() == full_blocks(auth, "a"), f"step {step}"
        # the pool's hashes are the blocks' keys (recomputed here from the tokens alone) ...
        for salt, prefix in consumer.view():
            assert hashes_of(salt, prefix)[-1] in consumer.blocks
        # ... so a block in the pool and a tier has one name in both
        both += bool({h for _, h in consumer.tiers} & set(consumer.blocks))
    assert both > 10, "the workload never held a block in the pool and a tier at once"


def test_config_reads_vllm_s_keys_and_refuses_others() -> None:
    c = KvEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq"}')
    assert c.enabled and c.endpoint == "tcp://*:5557" and c.encoding == "map"
    assert not KvEventsConfig.parse("").enabled
    assert not KvEventsConfig.parse('{"enable_kv_cache_events": true}').enabled  # null publisher
    for bad in ('{"endpont": "x"}', "[1]", '{"encoding": "cbor"}', '{"topic": "{pod}"}', "{"):
        with pytest.raises(ValueError, match="kv-events-config"):
            KvEventsConfig.parse(bad)
    assert ServiceConfig.from_args([]).kv_events_config == ""


# -- the real thing: a running service, pyzmq subscribers --------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _frames(sock: zmq.Socket, count: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(out) < count and loop.time() < deadline:
        if sock.poll(0):
            out.append(sock.recv_multipart())
        else:
            await asyncio.sleep(0.01)
    return out


async def _joined(sub: zmq.Socket, auth: CacheAuthority) -> None:
    """Until the subscriber's subscription has reached the publisher (a SUB sees only what is
    sent after that, and nothing says when it is): probe pools register, one at a time, until
    one's AllBlocksCleared arrives; then every probe frame is drained."""
    for i in range(100):
        auth.register_pool(PoolSpec(PoolId(f"probe-{i}"), 4, BS))
        auth.events.seal()
        if await _frames(sub, 1, timeout_s=0.1):
            break
    else:
        raise AssertionError("the subscription never reached the publisher")
    while await _frames(sub, 1, timeout_s=0.2):
        pass


async def test_a_subscriber_sees_a_prompt_s_full_blocks_and_a_late_one_replays() -> None:
    pub, replay = _free_port(), _free_port()
    raw = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    config = ServiceConfig(port=0, kv_events_config=json.dumps(raw))
    async with running(config) as service:
        assert service.kv_events is not None
        sub.connect(f"tcp://127.0.0.1:{pub}")
        auth = service.authority
        await _joined(sub, auth)
        auth.register_pool(PoolSpec(PoolId("w0"), 64, BS, model="smollm"))
        prompt = list(range(100, 111))  # two full blocks and a tail of three
        _turn(auth, prompt, "", pool="w0")
        frames = await _frames(sub, 1)  # the registration and the turn: one step, one batch
        assert [f[0] for f in frames] == [b"kv@w0@smollm"]
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        events = [e for f in frames for e in decode(f[2])[1]]
        assert [e["type"] for e in events] == ["AllBlocksCleared", "BlockStored"]
        assert events[1]["token_ids"] == prompt[:8] and events[1]["block_size"] == BS
        assert events[1]["parent_block_hash"] is None and len(events[1]["block_hashes"]) == 2
        await asyncio.sleep(0)
        _turn(auth, [*prompt[:8], 7, 7, 7, 7], "", pool="w0")  # a third block under the two
        more = await _frames(sub, 1)
        (stored,) = decode(more[0][2])[1]
        assert stored["parent_block_hash"] == events[1]["block_hashes"][-1]
        assert stored["token_ids"] == [7, 7, 7, 7]
        frames += more
        seqs.append(int.from_bytes(more[0][1], "big"))
        assert seqs == [seqs[0], seqs[0] + 1]

        late = ctx.socket(zmq.DEALER)
        late.connect(f"tcp://127.0.0.1:{replay}")
        late.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replies = await _frames(late, 3)
        assert [int.from_bytes(r[1], "big", signed=True) for r in replies] == [*seqs, -1]
        assert [r[2] for r in replies[:2]] == [f[2] for f in frames]  # the same payloads
        late.close(linger=0)
    sub.close(linger=0)


async def test_an_endpoint_in_use_is_a_startup_error() -> None:
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        raw = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
        with pytest.raises(StartupError, match="KV events: cannot open"):
            async with running(ServiceConfig(port=0, kv_events_config=json.dumps(raw))):
                pass
