"""KV events in vLLM's wire format, for the routers that read vLLM's (llm-d, Dynamo, the SGLang
and vLLM routers): the index's changes of every pool, published over ZeroMQ.

The event log (``events.py``) already records every change of every pool's index as batches;
:class:`VllmEventPublisher` watches it like any ``WatchEvents`` client, turns each batch into a
vLLM ``EventBatch`` (:class:`PoolTranslator`) and sends it on a PUB socket as vLLM's publisher
does: three frames, the pool's topic (llm-d's form by default, ``kv@<pool id>@<model>``), an
8-byte big-endian sequence number, the msgpack payload. An optional ROUTER socket replays the
last ``buffer_steps`` payloads to a late joiner that sends the sequence number to start from,
ending with sequence -1. Sending and replay run on a thread of their own (pyzmq sockets are
not shared between threads); the event loop only translates and queues.

What a pool's events say:

- ``BlockStored`` for full blocks only (a partial tail block is published when it fills), each
  with a stable 63-bit hash chained from its parent's (:func:`block_hash`: the same prefix in
  the same namespace hashes alike in every pool and after every restart), its ``token_ids``,
  ``block_size`` and ``medium``; the namespace (vLLM's cache salt) rides in the hash and, for
  a chain's first block, in ``extra_keys``, so salted blocks never match unsalted ones at a
  consumer that recomputes keys from tokens;
- ``BlockRemoved`` for blocks that leave the index (eviction, flush);
- ``AllBlocksCleared`` when a pool registers (a new incarnation starts empty) or is forgotten,
  and for every pool when the publisher starts over from a snapshot.

Payloads are maps (``{"type": "BlockStored", "block_hashes": ...}``: vLLM since mid-2026) or,
with ``"encoding": "array"``, the older positional arrays (``["BlockStored", [...], ...]``).
Configured like vLLM's ``--kv-events-config`` (:class:`KvEventsConfig`); off by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import queue
import threading
from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from kvcache_service.event_types import Batch, Cleared, Removed, Stored
from kvcache_service.events import FellBehind
from kvcache_service.ids import BlockId, PoolId
from kvcache_service.kv_events_config import KvEventsConfig

if TYPE_CHECKING:
    from kvcache_service.authority import CacheAuthority

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
READ_BATCHES = 256  # batches read from the log at once
HASH_PERSON = b"kvserve-kv-ev1"  # the hash's domain: another scheme gets another name


def block_hash(parent: int | None, token_ids: array[int] | list[int], namespace: str) -> int:
    """A block's hash: blake2b-64 over its parent's hash (or none), its namespace and its token
    ids (little-endian uint32), the top bit cleared so that consumers reading signed (Dynamo)
    and unsigned (llm-d) 64-bit integers read the same value."""
    h = hashlib.blake2b(digest_size=8, person=HASH_PERSON)
    h.update(b"\x00" * 9 if parent is None else b"\x01" + parent.to_bytes(8, "little"))
    ns = namespace.encode()
    h.update(len(ns).to_bytes(4, "little") + ns)
    tokens = array("I", token_ids)
    if tokens.itemsize != 4:
        raise RuntimeError("array('I') is not 32-bit here")
    h.update(tokens.tobytes() if array("I", [1]).tobytes()[0] == 1 else _le(tokens))
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def _le(tokens: array[int]) -> bytes:
    copy = array("I", tokens)
    copy.byteswap()
    return copy.tobytes()


class PoolTranslator:
    """One pool incarnation's log batches as vLLM events: the hash of every published block,
    so that a removal names it and a child names its parent."""

    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size = block_size
        self.medium = medium
        self.hashes: dict[BlockId, int] = {}
        self.skipped = 0  # runs whose parent was never published (should not happen)

    def events(self, batch: Batch) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in batch.events:
            if isinstance(event, Stored):
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            elif isinstance(event, Removed):
                gone = [self.hashes.pop(b) for b in event.blocks if b in self.hashes]
                if gone:
                    out.append(
                        {"type": "BlockRemoved", "block_hashes": gone, "medium": self.medium}
                    )
            elif isinstance(event, Cleared):
                self.hashes.clear()
                out.append({"type": "AllBlocksCleared"})
        return out

    def _stored(self, event: Stored) -> dict[str, Any] | None:
        bs = self.block_size
        parent = None if event.parent is None else self.hashes.get(event.parent)
        if event.parent is not None and parent is None:
            self.skipped += 1
            return None
        tokens = array("I")
        tokens.frombytes(event.tokens)  # the service's in-process (native) packing
        ns = str(event.namespace)
        hashes: list[int] = []
        prev = parent
        for i, block in enumerate(event.blocks):
            chunk = tokens[i * bs : (i + 1) * bs]
            if len(chunk) < bs:  # a tail: published once it is full
                break
            prev = block_hash(prev, chunk, ns)
            self.hashes[block] = prev
            hashes.append(prev)
        if not hashes:
            return None
        stored: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens[: len(hashes) * bs].tolist(),
            "block_size": bs,
            "lora_id": None,
            "medium": self.medium,
            "lora_name": None,
        }
        if ns and parent is None:  # the salt, where a consumer's chain starts (as vLLM's)
            stored["extra_keys"] = [[ns], *([None] * (len(hashes) - 1))]
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
    out)."""
    if encoding == "map":
        return msgpack.packb({"ts": ts, "events": events, "data_parallel_rank": rank})
    arrays = []
    for e in events:
        row = [e["type"], *(e.get(name) for name in _ORDER[e["type"]])]
        while len(row) > 1 + _required(e["type"]) and row[-1] is None:
            row.pop()  # omit_defaults: optional trailing fields that are unset
        arrays.append(row)
    return msgpack.packb([ts, arrays, rank])


def _required(kind: str) -> int:
    return {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}[kind]


class _Sender:
    """The PUB (and replay ROUTER) sockets and the thread that owns them."""

    def __init__(self, config: KvEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx: Any = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self.sent = 0
        self.dropped = 0
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    def put(self, topic: bytes, payload: bytes) -> None:
        try:
            self._queue.put_nowait((topic, payload))
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    break
                topic, payload = item
                seq = self._seq
                self._seq += 1
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.sent += 1
        except Exception:
            log.exception("KV events: the ZeroMQ sender stopped")
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


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
    publisher = VllmEventPublisher(authority, config)
    task = asyncio.create_task(publisher.run())
    log.info("KV events (vLLM format) on %s, topic %s", config.endpoint, config.topic)
    try:
        yield publisher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
