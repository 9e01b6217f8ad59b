"""What the engine talks to about tiers: spill written blocks, load granted ones, report both.

- **Spill, write-through**: every full block a sequence commits is copied out of the pool on
  the model thread (``KVPool.read_blocks``, queued before the commit or release that lets the
  cache service reuse the block, so the copy is of what the lease wrote) and written by one
  writer thread, off the step path. A block a tier already holds, or one queued, is not copied
  again. While the writer is behind by more than ``max_backlog_bytes``, new blocks are not
  spilled (they stay in the pool and are written if committed again later): memory stays
  bounded and no step waits for the disk.
- **Load**: a grant's ``tier_blocks`` are read and checked on load threads (the file must be
  the block expected: model, layout, key, position, namespace, tokens, prefix digest and
  payload checksum), in parallel; the run stops at the first block that fails, which is
  dropped and reported, and the sequence computes from there. A block still queued for
  writing is loaded from the queue.
- **Reports**: blocks written (``stored``) and found bad or missing (``dropped``) are
  collected for the next ``UpdateTiers``; the service answers the blocks it evicts, which are
  deleted (``evict``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from operator import attrgetter

from kvserve_proto.block_keys import block_keys, namespace_key
from kvserve_proto.packed_tokens import pack
from worker.tier.block_file import BlockMeta, Payload, checksum, mismatch, prefix_digests
from worker.tier.disk import DiskTier
from worker.tier.host import HostTier
from worker.tier.speed import load_beats_compute, measure_read_rate

log = logging.getLogger(__name__)

DEFAULT_BACKLOG_BYTES = 256 << 20
LOAD_THREADS = 4
# A load reads its files a chunk at a time into reused memory (LoadArena), at most this many
# blocks or bytes a chunk, and the next chunk is read while this one is written to the pool.
LOAD_CHUNK_BLOCKS = 64
LOAD_CHUNK_BYTES = 32 << 20
KEEP_ARENAS = 2  # kept for the next loads (at most 64 MiB); more are made while loads overlap
SLOT_SLACK = 64 << 10  # a file's bytes beyond its payload (its header): at most this to fit


class LoadArena:
    """Memory a load reads block files into, reused from load to load: fresh memory costs its
    page faults on first touch (4 MiB files out of the page cache, on this 2-core EPYC:
    ``f.read()`` 1.5 GB/s on one thread and 3.3-4.0 on 2-4, ``readinto`` reused memory 5.1
    and 8.9-9.2). A payload read into it is a view of its slot, valid until the arena is
    handed back (``TierStore.give_arena``): the pool copies it before that."""

    def __init__(self, blocks: int, slot: int) -> None:
        self.slot = slot
        self.blocks = blocks
        self._view = memoryview(bytearray(blocks * slot))

    def __getitem__(self, i: int) -> memoryview:
        return self._view[i * self.slot : (i + 1) * self.slot]


def own(payload: Payload) -> Payload:
    """``payload`` as a buffer of its own: as it is when it is one (the pool's copies on a
    GPU), else a copy (a view would keep the whole array the pool gathered its blocks in
    alive for as long as any one of them is held)."""
    if isinstance(payload, bytes):
        return payload
    whole = payload.obj  # what the view is of: its own memory unless it has a base (numpy)
    if getattr(whole, "base", None) is None and memoryview(whole).nbytes == payload.nbytes:
        return payload
    return bytes(payload)


@dataclass(slots=True)
class TierCounters:
    spilled_blocks: int = 0  # queued for writing
    skipped_blocks: int = 0  # not spilled: the writer was too far behind
    loaded_blocks: int = 0
    load_failures: int = 0  # granted blocks that could not be loaded (then computed)


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """What every spilled block of this worker is: the model, the pool layout, its bytes."""

    fingerprint: str
    layout: str
    payload_len: int


class TierStore:
    """The worker's tiers (host memory, disk: either or both) behind one interface."""

    def __init__(
        self,
        block_size: int,
        fmt: BlockFormat,
        *,
        disk: DiskTier | None = None,
        host: HostTier | None = None,
        max_backlog_bytes: int = DEFAULT_BACKLOG_BYTES,
    ) -> None:
        assert disk is not None or host is not None, "a store of no tier"
        self.disk = disk
        self.host = host
        self.fmt = fmt
        self.block_size = block_size
        self.block_bytes = block_size * 4  # packed tokens of one block
        self.max_backlog_bytes = max_backlog_bytes
        self.counters = TierCounters()
        # Bytes a second the tier reads back (worker.tier.speed: probed at start, then an
        # average over the loads themselves).
        self.read_rate = 0.0
        self._observed = False  # a real load has been timed (the rate is then its own)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[BlockMeta, Payload]] = {}
        self._backlog = 0
        self._queue: queue.SimpleQueue[tuple[BlockMeta, Payload] | None] = queue.SimpleQueue()
        # Reports for the cache service: (block, medium).
        self._stored: list[tuple[BlockMeta, str]] = []
        self._dropped: list[tuple[int, str]] = []
        self._writer: threading.Thread | None = None
        self._readers = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kv-tier-load")
        self.load_chunk = max(1, min(LOAD_CHUNK_BLOCKS, LOAD_CHUNK_BYTES // fmt.payload_len))
        self._arenas: list[LoadArena] = []  # free ones, at most KEEP_ARENAS
        # Called (on the writer thread) when the writer has caught up after writing blocks:
        # the reports are worth sending now, not at the next tick.
        self.on_written: Callable[[], None] | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> list[BlockMeta]:
        """Scans the disk tier and starts the writer; returns what the tier holds (the
        manifest the cache service hears after every registration)."""
        if self.disk is None:
            self.read_rate = float("inf")  # host memory: loading always beats computing
            return []
        metas = self.disk.scan()
        self.read_rate = measure_read_rate(self.disk.dir)
        log.info("disk tier reads back at %.0f MB/s", self.read_rate / 1e6)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-write", daemon=True)
        self._writer.start()
        return metas

    def close(self) -> None:
        """Writes what is queued, then stops the writer."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        self._readers.shutdown(wait=True)

    def manifest(self) -> list[tuple[BlockMeta, str]]:
        """Every block the tiers hold now, with its medium (what a registration is followed
        by), each medium's by position: a parent before its children, whatever chunk of the
        manifest they go in (the service refuses a block whose parent its tier does not
        hold)."""
        by_position = attrgetter("position")
        out = []
        if self.disk is not None:
            out = [(m, "disk") for m in sorted(self.disk.metas(), key=by_position)]
        if self.host is not None:
            out += [(m, "host") for m in sorted(self.host.metas(), key=by_position)]
        return out

    # -- naming blocks ------------------------------------------------------------------------

    def metas(self, namespace: str, tokens: list[int], first: int, stop: int) -> list[BlockMeta]:
        """What blocks ``first`` .. ``stop - 1`` of a sequence of ``tokens`` are (no payload
        yet): keys, parents, tokens, prefix digests."""
        bs = self.block_size
        packed = pack(tokens[: stop * bs])
        keys = block_keys(namespace_key(namespace), packed, 0, self.block_bytes, stop)
        digests = prefix_digests(namespace, packed, first, stop, self.block_bytes)
        out = []
        for pos in range(first, stop):
            out.append(
                BlockMeta(
                    key=keys[pos],
                    parent_key=keys[pos - 1] if pos else namespace_key(namespace),
                    position=pos,
                    namespace=namespace,
                    tokens=tuple(tokens[pos * bs : (pos + 1) * bs]),
                    prefix_digest=digests[pos - first],
                    fingerprint=self.fmt.fingerprint,
                    layout=self.fmt.layout,
                    payload_len=self.fmt.payload_len,
                    checksum="",
                )
            )
        return out

    # -- spilling -----------------------------------------------------------------------------

    def to_spill(self, metas: list[BlockMeta]) -> list[BlockMeta]:
        """Those of ``metas`` the tiers neither hold nor have queued; none while the writer
        is too far behind (counted as skipped)."""
        with self._lock:
            new = [m for m in metas if not self._holds(m.key)]
            if new and self._backlog >= self.max_backlog_bytes:
                self.counters.skipped_blocks += len(new)
                return []
            return new

    def _holds(self, key: int) -> bool:
        return (
            key in self._pending
            or (self.disk is not None and key in self.disk)
            or (self.host is not None and key in self.host)
        )

    def enqueue(self, metas: list[BlockMeta], payloads: list[Payload]) -> None:
        """Keeps blocks copied out of the pool: in host memory at once, and queued for the
        disk writer (the model thread calls it)."""
        with self._lock:
            for meta, payload in zip(metas, payloads, strict=True):
                if self.host is not None:
                    self._report_stored(meta, "host")
                    self._dropped += [(k, "host") for k in self.host.put(meta, own(payload))]
                if self.disk is None or meta.key in self._pending:
                    continue
                self._pending[meta.key] = (meta, payload)
                self._backlog += len(payload)
                self._queue.put((meta, payload))
            self.counters.spilled_blocks += len(metas)

    def _write_loop(self) -> None:
        assert self.disk is not None
        while (item := self._queue.get()) is not None:
            meta, payload = item
            try:
                written = self.disk.write(replace(meta, checksum=checksum(payload)), payload)
            except Exception:  # a bug must not stop spilling for good
                log.exception("disk tier: writing block %016x failed", meta.key)
                written = False
            with self._lock:
                self._pending.pop(meta.key, None)
                self._backlog -= len(payload)
                if written:
                    self._report_stored(meta, "disk")
                caught_up = written and not self._pending
            if caught_up and self.on_written is not None:
                self.on_written()

    def _report_stored(self, meta: BlockMeta, medium: str) -> None:
        """Reports ``meta`` stored in ``medium`` (under the lock). A drop of it still to be
        reported is withdrawn: the service applies a call's stored blocks before its dropped
        ones, so a block dropped (a failed load) and written again (its recompute spilled)
        between two reports ended dropped there while this worker held it, and the blocks
        after it were refused for good ("parent not held")."""
        if self._dropped:
            self._dropped = [d for d in self._dropped if d != (meta.key, medium)]
        self._stored.append((meta, medium))

    def flush(self) -> None:
        """Waits until everything queued so far is written (tests, shutdown)."""
        with self._lock:
            keys = set(self._pending)
        while keys:
            time.sleep(0.01)
            with self._lock:
                keys &= self._pending.keys()

    # -- loading ------------------------------------------------------------------------------

    def take_arena(self) -> LoadArena:
        """Memory for one chunk's files (``load(..., arena)``): a kept one, else a new one."""
        with self._lock:
            if self._arenas:
                return self._arenas.pop()
        return LoadArena(self.load_chunk, self.fmt.payload_len + SLOT_SLACK)

    def give_arena(self, arena: LoadArena) -> None:
        """Hands ``arena`` back once what was read into it has been copied out."""
        with self._lock:
            if len(self._arenas) < KEEP_ARENAS:
                self._arenas.append(arena)

    def load(self, expected: list[BlockMeta], arena: LoadArena | None = None) -> list[Payload]:
        """The payloads of the leading blocks of ``expected`` that load and check out, in
        order; blocking (call it off the event loop). The first that fails ends the run: it
        is dropped (and reported), and what comes after it is not used. ``arena``: files are
        read into its slots (at most ``arena.blocks`` of ``expected``), and what is read is
        valid until it is given back."""
        if not expected:
            return []
        assert arena is None or len(expected) <= arena.blocks, "more blocks than the arena"
        slots = [arena[i] if arena is not None else None for i in range(len(expected))]
        found: list[Payload | None] = list(self._readers.map(self._load_one, expected, slots))
        out: list[Payload] = []
        for meta, payload in zip(expected, found, strict=True):
            if payload is None:
                self.counters.load_failures += len(expected) - len(out)
                with self._lock:
                    self._dropped += [(meta.key, m) for m in self.media]
                break
            out.append(payload)
        self.counters.loaded_blocks += len(out)
        return out

    def set_pool_write_rate(self, rate: float) -> None:
        """Folds the pool's measured write rate (KVPool.measure_write_rate) into the start-up
        estimate: a load reads the disk, then writes the pool."""
        if rate > 0 and self.read_rate > 0 and not self._observed:
            self.read_rate = 1 / (1 / self.read_rate + 1 / rate)
            log.info("tier loads estimated at %.0f MB/s, files to pool", self.read_rate / 1e6)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        """A load's whole path, files to pool (the engine times it): averaged into the rate
        that decides whether the next grant loads or computes."""
        if nbytes >= 4 * self.fmt.payload_len and seconds > 0:
            rate = nbytes / seconds
            self.read_rate = rate if not self._observed else 0.5 * (self.read_rate + rate)
            self._observed = True

    def load_worth(self, s_per_token: float | None) -> bool:
        """Whether granted blocks are loaded rather than computed, at the engine's measured
        prefill seconds per token (worker.tier.speed)."""
        return load_beats_compute(
            self.fmt.payload_len, self.read_rate, self.block_size, s_per_token
        )

    @property
    def media(self) -> tuple[str, ...]:
        return (("host",) if self.host is not None else ()) + (
            ("disk",) if self.disk is not None else ()
        )

    def _load_one(self, expect: BlockMeta, into: memoryview | None = None) -> Payload | None:
        with self._lock:
            queued = self._pending.get(expect.key)
        if queued is not None:
            meta, payload = queued
            return payload if mismatch(meta, expect) is None else None
        if self.host is not None and (held := self.host.get(expect)) is not None:
            return held
        return self.disk.read(expect, into) if self.disk is not None else None

    # -- the cache service --------------------------------------------------------------------

    def take_reports(self) -> tuple[list[tuple[BlockMeta, str]], list[tuple[int, str]]]:
        """Blocks written and blocks dropped since the last call."""
        with self._lock:
            stored, self._stored = self._stored, []
            dropped, self._dropped = self._dropped, []
        return stored, dropped

    def give_back(
        self, stored: list[tuple[BlockMeta, str]], dropped: list[tuple[int, str]]
    ) -> None:
        """Reports that did not reach the service, for the next call."""
        with self._lock:
            self._stored[:0] = stored
            self._dropped[:0] = dropped

    def evict(self, blocks: list[tuple[int, str]]) -> None:
        """Deletes blocks the service dropped from a tier: (key, medium)."""
        for medium, tier in (("host", self.host), ("disk", self.disk)):
            keys = [k for k, m in blocks if m == medium]
            if keys and tier is not None:
                tier.delete(keys)
