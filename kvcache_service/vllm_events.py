"""KV events in vLLM's wire format, for the routers that read vLLM's (llm-d, Dynamo, the SGLang
and vLLM routers): the index's changes of every pool, published over ZeroMQ.

The event log (``events.py``) already records every change of every pool's index as batches;
:class:`VllmEventPublisher` watches it like any ``WatchEvents`` client, turns each batch into a
vLLM ``EventBatch`` (:class:`PoolTranslator`) and sends it on a PUB socket as vLLM's publisher
does: three frames, the pool's topic (llm-d's form by default, ``kv@<pool id>@<model>``), an
8-byte big-endian sequence number, the msgpack payload. An optional ROUTER socket replays the
last ``buffer_steps`` payloads to a late joiner that sends the sequence number to start from,
ending with sequence -1. The event loop translates, encodes and sends (a PUB send never
blocks); the replay socket has a thread of its own.

What a pool's events say:

- ``BlockStored`` for full blocks only (a partial tail block is published when it fills), each
  with its ``token_ids``, ``block_size`` and ``medium`` and a 63-bit hash: the block's key
  (``kvserve_proto.block_keys``: xxh3-64 chained from its parent's key, seeded by the
  namespace's) with the top bit cleared, so the same prefix in the same namespace hashes alike
  in every pool, after every restart, and in every tier; the namespace (vLLM's cache salt)
  also rides, for a chain's first block, in ``extra_keys``, so salted blocks never match
  unsalted ones at a consumer that recomputes keys from tokens;
- ``BlockRemoved`` for blocks that leave the index (eviction, flush);
- for the pool's tiers, as vLLM's offloading connector sends them: ``BlockStored`` with
  ``medium`` ``"CPU"`` (host memory) or ``"DISK"``, the blocks' hashes (the same a block had
  or will have in the pool), no ``token_ids`` and no parent (the service keeps no tokens of
  tier blocks; a router resolves the hashes it saw stored in the pool, as llm-d does for
  location-only events), and ``BlockRemoved`` with the tier's medium when they leave it;
- ``AllBlocksCleared`` when a pool registers (a new incarnation starts empty, tiers too) or
  is forgotten, and for every pool when the publisher starts over from a snapshot.

Payloads are maps (``{"type": "BlockStored", "block_hashes": ...}``: vLLM since mid-2026) or,
with ``"encoding": "array"``, the older positional arrays (``["BlockStored", [...], ...]``).
Configured like vLLM's ``--kv-events-config`` (:class:`KvEventsConfig`); off by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import zmq

from kvcache_service.event_types import Batch, Cleared, Removed, Stored, TierRemoved, TierStored
from kvcache_service.events import FellBehind
from kvcache_service.ids import BlockId, PoolId
from kvcache_service.kv_events_config import KvEventsConfig
from kvcache_service.tier_index import Medium
from kvserve_launch.startup import StartupError
from kvserve_proto.block_keys import block_keys, namespace_key

if TYPE_CHECKING:
    from kvcache_service.authority import CacheAuthority

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
READ_BATCHES = 256  # batches read from the log at once
HASH_MASK = (1 << 63) - 1  # signed (Dynamo) and unsigned (llm-d) 64-bit readers agree
# vLLM's names of the tiers beside the engine's own (its offloading connector says "CPU").
TIER_MEDIA = {int(Medium.HOST): "CPU", int(Medium.DISK): "DISK"}


def block_hash(parent_key: int | None, token_ids: Iterable[int], namespace: str) -> int:
    """A block's published hash: its key (``kvserve_proto.block_keys``: xxh3-64 of its token
    ids as little-endian uint32, seeded by the key of the block before it, or by the
    namespace's key for a chain's first block) with the top bit cleared. ``parent_key`` is
    the parent's full key (:func:`block_key`), not its published hash."""
    return block_key(parent_key, token_ids, namespace) & HASH_MASK


def block_key(parent_key: int | None, token_ids: Iterable[int], namespace: str) -> int:
    """A block's full 64-bit key, as the service, the workers and their tiers name it."""
    seed = namespace_key(namespace) if parent_key is None else parent_key
    tokens = _le_bytes(array("I", token_ids).tobytes())
    (key,) = block_keys(seed, tokens, 0, len(tokens))
    return key


def _le_bytes(native: bytes) -> bytes:
    """Native-endian uint32 tokens (the service's packing) as little-endian."""
    if sys.byteorder == "little":
        return native
    a = array("I")
    a.frombytes(native)
    a.byteswap()
    return a.tobytes()


class Uint32Array(bytes):
    """Token ids, packed little-endian uint32, that :func:`encode` writes as a msgpack array
    of uint32 straight from the bytes (0xce and the big-endian value each: valid msgpack
    every decoder reads, ~10x faster than building Python ints for a 2,048-token prompt)."""


class PoolTranslator:
    """One pool incarnation's log batches as vLLM events: the key of every published block, so
    that a removal names it and a child chains from it."""

    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size = block_size
        self.medium = medium
        self.keys: dict[BlockId, int] = {}  # full 64-bit keys: a child's seed
        self.skipped = 0  # runs whose parent was never published (should not happen)

    def events(self, batch: Batch) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in batch.events:
            if isinstance(event, Stored):
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            elif isinstance(event, Removed):
                gone = [self.keys.pop(b) & HASH_MASK for b in event.blocks if b in self.keys]
                if gone:
                    out.append(
                        {"type": "BlockRemoved", "block_hashes": gone, "medium": self.medium}
                    )
            elif isinstance(event, Cleared):
                self.keys.clear()
                out.append({"type": "AllBlocksCleared"})
            elif isinstance(event, TierStored):
                out.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": [k & HASH_MASK for k in event.keys],
                        "parent_block_hash": None,
                        "token_ids": [],
                        "block_size": self.block_size,
                        "lora_id": None,
                        "medium": TIER_MEDIA[event.medium],
                        "lora_name": None,
                    }
                )
            elif isinstance(event, TierRemoved):
                out.append(
                    {
                        "type": "BlockRemoved",
                        "block_hashes": [k & HASH_MASK for k in event.keys],
                        "medium": TIER_MEDIA[event.medium],
                    }
                )
        return out

    def _stored(self, event: Stored) -> dict[str, Any] | None:
        bs = self.block_size
        ns = str(event.namespace)
        if event.parent is None:
            seed = namespace_key(ns)
        elif (held := self.keys.get(event.parent)) is not None:
            seed = held
        else:
            self.skipped += 1
            return None
        tokens = _le_bytes(event.tokens)  # the service's in-process (native) packing
        width = 4 * bs
        full = min(len(event.blocks), len(tokens) // width)  # a tail waits until it is full
        keys = block_keys(seed, tokens, 0, width, stop=full)
        if not keys:
            return None
        self.keys.update(zip(event.blocks[:full], keys, strict=True))
        stored: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [k & HASH_MASK for k in keys],
            "parent_block_hash": None if event.parent is None else seed & HASH_MASK,
            "token_ids": Uint32Array(tokens[: len(keys) * width]),
            "block_size": bs,
            "lora_id": None,
            "medium": self.medium,
            "lora_name": None,
        }
        if ns and event.parent is None:  # the salt, where a consumer's chain starts (as vLLM's)
            stored["extra_keys"] = [[ns], *([None] * (len(keys) - 1))]
        return stored


# The fields of each event type in vLLM's order: the array form's positions.
_ORDER = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def encode(ts: float, events: list[dict[str, Any]], rank: int, encoding: str) -> bytes:
    """One ``EventBatch`` as msgpack: maps (fields by name, the type under ``"type"``) or
    vLLM's older arrays (the type first, then the fields in order, trailing defaults left
    out). Token ids (:class:`Uint32Array`) are written from their bytes."""
    packer = msgpack.Packer()
    parts: list[bytes] = []
    if encoding == "map":
        parts += [
            packer.pack_map_header(3),
            packer.pack("ts"),
            packer.pack(ts),
            packer.pack("events"),
        ]
    else:
        parts += [packer.pack_array_header(3), packer.pack(ts)]
    parts.append(packer.pack_array_header(len(events)))
    for e in events:
        if encoding == "map":
            parts.append(packer.pack_map_header(len(e)))
            for name, value in e.items():
                parts.append(packer.pack(name))
                parts.append(_value(packer, value))
            continue
        row = [e["type"], *(e.get(name) for name in _ORDER[e["type"]])]
        while len(row) > 1 + _required(e["type"]) and row[-1] is None:
            row.pop()  # omit_defaults: optional trailing fields that are unset
        parts.append(packer.pack_array_header(len(row)))
        parts += [_value(packer, v) for v in row]
    if encoding == "map":
        parts += [packer.pack("data_parallel_rank"), packer.pack(rank)]
    else:
        parts.append(packer.pack(rank))
    return b"".join(parts)


def _value(packer: msgpack.Packer, value: Any) -> bytes:
    if not isinstance(value, Uint32Array):
        return bytes(packer.pack(value))
    n = len(value) // 4
    out = np.empty(n, dtype=[("tag", "u1"), ("value", ">u4")])
    out["tag"] = 0xCE
    out["value"] = np.frombuffer(value, dtype="<u4")
    return bytes(packer.pack_array_header(n)) + out.tobytes()


def _required(kind: str) -> int:
    return {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}[kind]


class _Sender:
    """The PUB socket, used on the event loop's thread (a send never blocks: past the
    high-water mark ZeroMQ drops, as vLLM's publisher does, and a slow subscriber catches up
    through the replay), and the replay ROUTER on a thread of its own (a socket belongs to one
    thread); the replay buffer between them."""

    def __init__(self, config: KvEventsConfig) -> None:
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx: Any = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.sent = 0
        self.dropped = 0
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if config.replay_endpoint:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.bind(config.replay_endpoint)
            self._thread = threading.Thread(
                target=self._replay, args=(replay,), name="kv-events-replay", daemon=True
            )
            self._thread.start()

    def put(self, topic: bytes, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._pub.close(linger=0)

    def _replay(self, sock: Any) -> None:
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    self._serve_replay(sock)
        except Exception:
            log.exception("KV events: the replay socket stopped")
        finally:
            sock.close(linger=0)

    def _serve_replay(self, sock: Any) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):  # (a copy: the loop's thread appends)
            if seq >= first:
                sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        sock.send_multipart((client, b"", END_SEQ, b""))


class VllmEventPublisher:
    """Watches the authority's event log and publishes every batch in vLLM's format."""

    def __init__(self, authority: CacheAuthority, config: KvEventsConfig) -> None:
        self.auth = authority
        self.config = config
        self._sender = _Sender(config)
        self._pools: dict[PoolId, tuple[int, PoolTranslator]] = {}  # incarnation, translator
        self._models: dict[PoolId, str] = {}
        self._wake = asyncio.Event()
        self._pos = 0

    @property
    def sent(self) -> int:
        return self._sender.sent

    async def run(self) -> None:
        """Publishes until cancelled: a snapshot of every pool first, then each batch as the
        log seals it; a snapshot again if it ever falls behind the log's buffer."""
        waker: Callable[[], None] = self._wake.set
        self.auth.watch_events(waker)
        try:
            self._restart()
            while True:
                self._wake.clear()
                try:
                    batches = self.auth.events.after(self._pos, READ_BATCHES)
                except FellBehind:
                    self._restart()
                    continue
                if not batches:
                    await self._wake.wait()
                    continue
                for batch in batches:
                    self._publish(batch)
                    self._pos = batch.seq
        finally:
            self.auth.unwatch_events(waker)
            self._sender.close()

    def _restart(self) -> None:
        """Every known pool cleared, then the index as a snapshot."""
        at, snapshot = self.auth.events_snapshot(None)
        for pool_id in list(self._pools):
            self._send(pool_id, [{"type": "AllBlocksCleared"}], self.auth.events.clock())
        self._pools.clear()
        for batch in snapshot:
            self._publish(batch)
        self._pos = at.seq

    def _publish(self, batch: Batch) -> None:
        key = batch.pool
        held = self._pools.get(key.pool_id)
        if held is None or held[0] != key.incarnation:
            held = (key.incarnation, PoolTranslator(key.block_size, self.config.medium))
            self._pools[key.pool_id] = held
        events = held[1].events(batch)
        if events:
            self._send(key.pool_id, events, batch.timestamp)

    def _send(self, pool_id: PoolId, events: list[dict[str, Any]], ts: float) -> None:
        payload = encode(ts, events, self.config.data_parallel_rank, self.config.encoding)
        self._sender.put(self.topic(pool_id), payload)

    def topic(self, pool_id: PoolId) -> bytes:
        pool = self.auth.pools.get(pool_id)
        if pool is not None:
            self._models[pool_id] = pool.spec.model
        model = self._models.get(pool_id, "")
        return self.config.topic.format(pool=pool_id, model=model).encode()


@contextlib.asynccontextmanager
async def publishing(
    authority: CacheAuthority, config: KvEventsConfig
) -> AsyncIterator[VllmEventPublisher | None]:
    """Runs a publisher for the service's life, where ``config`` enables one."""
    if not config.enabled:
        yield None
        return
    try:
        publisher = VllmEventPublisher(authority, config)
    except zmq.ZMQError as err:  # a port in use, an endpoint ZeroMQ does not take
        where = " or ".join(e for e in (config.endpoint, config.replay_endpoint) if e)
        raise StartupError(
            f"KV events: cannot open {where}: {err}",
            hint="choose other endpoints in --kv-events-config",
        ) from None
    task = asyncio.create_task(publisher.run())
    log.info("KV events (vLLM format) on %s, topic %s", config.endpoint, config.topic)
    try:
        yield publisher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
