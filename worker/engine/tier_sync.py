"""The engine's side of the tiers: what it spills, what it loads, what it tells the service.

``LeaseSync`` calls it at four points: after every registration (``after_register``: the
disk tier's manifest, in chunks), when a sequence's full blocks are committed or its lease is
released (``spill``: write-through of blocks the tier does not hold), when a lease is granted
with ``tier_blocks`` (``load``), and at stop. The bytes move on other threads: a block is
copied out of the pool on the model thread (queued there before the commit or release that
lets the service hand the block to another lease, so the copy is what this lease wrote) and
written by the store's writer; a load reads and checks files on the store's load threads while
the engine steps other sequences, then writes the blocks into the pool on the model thread
under the step lock, and only then lets the sequence step (``Sequence.loading``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from worker.engine.lease import Lease, LeaseError, LeaseService, TierEntry
from worker.engine.sequence import Sequence, Status
from worker.engine.step_budget import ForwardTime
from worker.tier.block_file import BlockMeta, Payload

if TYPE_CHECKING:  # built by the assembly (worker.server): it names blocks with kvserve_proto
    from worker.tier.store import LoadArena, TierStore

log = logging.getLogger(__name__)

# Reports go when the writer catches up, and at least this often (evictions a heartbeat
# brought back are deleted then).
REPORT_EVERY_S = 1.0
# Prefill chunks at least this many blocks long say what a block costs to compute.
MIN_CHUNK_BLOCKS = 4
MANIFEST_CHUNK = 8192


class PoolIO(Protocol):
    def read_blocks(self, blocks: list[int]) -> list[Payload]: ...

    def write_blocks(self, blocks: list[int], payloads: list[Payload]) -> None: ...

    def measure_write_rate(self) -> float: ...


def _entry(meta: BlockMeta, medium: str) -> TierEntry:
    return TierEntry(meta.key, meta.parent_key, meta.namespace, medium)


class TierSync:
    def __init__(
        self,
        store: TierStore,
        client: LeaseService,
        pool: PoolIO,
        on_model_thread: Callable[..., Future[Any]],
        *,
        step_lock: asyncio.Lock,
        wake_steps: Callable[[], None],
        estimate_prefill: Callable[[], float | None] = lambda: None,
        policy: str = "auto",
    ) -> None:
        """``estimate_prefill``: run on the model thread at start, a prefill token's cost
        before any prefill is timed (worker.tier.speed.prefill_s_per_token). ``policy``: when
        granted blocks load: "auto" (measured faster than computing), "always", "never"."""
        self.store = store
        self.client = client
        self.pool = pool
        self.block_size = store.block_size
        self._on_model = on_model_thread
        self._step_lock = step_lock
        self._wake_steps = wake_steps
        self._s_per_token: float | None = None  # prefill, on chunks of MIN_CHUNK_BLOCKS+
        self._estimate_prefill = estimate_prefill
        self.policy = policy
        self._timed = False  # _s_per_token is a timed prefill's, not the start's estimate
        self._floor = 0.0  # the start's estimate: a prefill token costs at least this
        self._shapes: set[int] = set()  # prefill chunk sizes seen (their first compiles)
        self._fixed_s: float | None = None  # the least decode forward seen (observe)
        self._task: asyncio.Task | None = None
        self._loads: set[asyncio.Task] = set()
        self._written = asyncio.Event()  # the store's writer caught up: report now
        self.loaded_tokens = 0

    def observe(self, took: ForwardTime) -> None:
        """A step's timings: prefill seconds a token, from chunks long enough to say it, and
        not from a chunk size's first forward, which compiles its kernels (on an H100 a first
        1,024-token prefill said a block costs several times what it does, and 218 blocks
        were loaded in 460-795 ms that computed in 132 ms). The least seen, not an average;
        never below the matmul-rate bound.

        What a token costs at the margin: a forward's fixed cost (its graph, its launches, the
        weights read once: the least decode forward seen, one token a row) is taken off the
        chunk's time first, since a sequence whose blocks load still runs a forward for the
        rest of its prompt. On a GPU that fixed cost is most of a short prefill's (an H200,
        an 8B llama: a 1,040-token prompt answered in 43 ms computed and 30 ms all cached,
        and the disk tier, judged by the average, loaded at 70 ms)."""
        if took.decode_s > 0:
            self._fixed_s = min(self._fixed_s or took.decode_s, took.decode_s)
        if took.prefill_tokens >= MIN_CHUNK_BLOCKS * self.block_size:
            if took.prefill_tokens not in self._shapes:
                self._shapes.add(took.prefill_tokens)
                return
            per = max(took.prefill_s - (self._fixed_s or 0.0), 0.0) / took.prefill_tokens
            if self._timed and self._s_per_token is not None:
                per = min(per, self._s_per_token)
            self._s_per_token = max(per, self._floor)
            self._timed = True

    def start(self) -> None:
        self._measure = asyncio.ensure_future(
            asyncio.wrap_future(self._on_model(self._measure_speeds))
        )
        self._measure.add_done_callback(self._measured)
        loop = asyncio.get_running_loop()

        def written() -> None:
            loop.call_soon_threadsafe(self._written.set)

        self.store.on_written = written
        self._task = asyncio.create_task(self._report_loop())

    def _measure_speeds(self) -> tuple[float, float | None]:
        return self.pool.measure_write_rate(), self._estimate_prefill()

    def _measured(self, done: asyncio.Future) -> None:
        if done.cancelled() or done.exception() is not None:
            log.warning("could not measure the tiers' speeds: %s", done)
            return
        write_rate, per_token = done.result()
        self.store.set_pool_write_rate(write_rate)
        if per_token is not None:
            self._floor = per_token
            self._s_per_token = max(self._s_per_token or 0.0, per_token)
            log.info(
                "a block computes in at least %.2f ms here (matmul rate), loads in %.2f ms",
                per_token * self.block_size * 1e3,
                self.store.fmt.payload_len / max(self.store.read_rate, 1.0) * 1e3,
            )

    async def stop(self) -> None:
        self.store.on_written = None
        for task in [self._task, *self._loads]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._loads] if t), return_exceptions=True)
        await asyncio.to_thread(self.store.flush)
        with contextlib.suppress(LeaseError):
            await self._report_once()

    # -- the service --------------------------------------------------------------------------

    async def after_register(self) -> None:
        """The tier's whole content (the manifest), after a registration: the service starts
        every incarnation with an empty tier index."""
        metas = self.store.manifest()
        for i in range(0, len(metas), MANIFEST_CHUNK):
            chunk = [_entry(m, medium) for m, medium in metas[i : i + MANIFEST_CHUNK]]
            evict = await self.client.update_tiers(chunk, [])
            if evict:
                await asyncio.to_thread(self.store.evict, evict)
        if metas:
            log.info("told the cache service of %d blocks in the tiers", len(metas))

    async def _report_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REPORT_EVERY_S):
                    await self._written.wait()
            self._written.clear()
            try:
                await self._report_once()
            except LeaseError as err:  # the lease sync handles outages and fences
                log.debug("tier report failed: %s", err)
            except Exception:
                log.exception("tier report failed")

    async def _report_once(self) -> None:
        evict = self.client.take_tier_evictions()
        stored, dropped = self.store.take_reports()
        # In chunks: the service refuses a call past 65,536 blocks.
        while stored or dropped:
            s, d = stored[:MANIFEST_CHUNK], dropped[:MANIFEST_CHUNK]
            try:
                evict += await self.client.update_tiers([_entry(m, md) for m, md in s], d)
            except LeaseError:
                self.store.give_back(stored, dropped)
                raise
            stored, dropped = stored[len(s) :], dropped[len(d) :]
        if evict:
            await asyncio.to_thread(self.store.evict, evict)

    # -- spilling -----------------------------------------------------------------------------

    def spill(self, seq: Sequence, upto: int) -> None:
        """Spills ``seq``'s full blocks before position ``upto`` that were not spilled yet and
        that the tier does not hold. Queued on the model thread now: before the commit or
        release the caller sends next, so before any other lease can write these blocks."""
        first = seq.spilled_blocks
        upto = min(upto, len(seq.block_table))
        if upto <= first:
            return
        seq.spilled_blocks = upto
        metas = self.store.to_spill(
            self.store.metas(seq.namespace, seq.token_slice(0, upto * self.block_size), first, upto)
        )
        if not metas:
            return
        blocks = [seq.block_table[m.position] for m in metas]
        self._on_model(self._copy_out, blocks, metas)

    def _copy_out(self, blocks: list[int], metas: list[BlockMeta]) -> None:
        try:
            self.store.enqueue(metas, self.pool.read_blocks(blocks))
        except Exception:
            log.exception("copying %d blocks out for the disk tier failed", len(blocks))

    # -- loading ------------------------------------------------------------------------------

    def load(self, seq: Sequence, lease: Lease) -> None:
        """Loads ``lease``'s tier blocks for ``seq`` (just admitted with it) in the background;
        the sequence does not step until they are in its blocks, or found missing."""
        if not lease.tier_blocks or self.policy == "never":
            return
        if self.policy == "auto" and not self.store.load_worth(self._s_per_token):
            return
        seq.loading = lease
        task = asyncio.create_task(self._load(seq, lease))
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    async def _load(self, seq: Sequence, lease: Lease) -> None:
        """Reads the blocks a chunk at a time (``store.load_chunk``) into reused memory
        (``LoadArena``), and the next chunk while this one is written into the pool on the
        model thread: the files and the copy overlap, and no fresh memory is faulted in."""
        bs = self.block_size
        first = lease.cached_tokens // bs
        stop = first + lease.tier_blocks
        loaded = 0  # blocks written into the pool
        reading: asyncio.Future[tuple[LoadArena, list[Payload]]] | None = None
        try:
            expected = self.store.metas(seq.namespace, seq.token_slice(0, stop * bs), first, stop)
            n = self.store.load_chunk
            chunks = [expected[i : i + n] for i in range(0, len(expected), n)]
            start = time.perf_counter()
            waited = 0.0  # for the step lock: not the load's time
            reading = self._read(chunks[0])
            for i, chunk in enumerate(chunks):
                assert reading is not None  # read ahead for every chunk after a whole one
                arena, payloads = await reading
                reading = None
                try:
                    if len(payloads) == len(chunk) and i + 1 < len(chunks):
                        reading = self._read(chunks[i + 1])  # while this one is written
                    written, wait = await self._write(seq, lease, first + loaded, payloads)
                    waited += wait
                finally:
                    self.store.give_arena(arena)
                loaded += written
                if written < len(chunk):
                    break
            if loaded:
                took = time.perf_counter() - start - waited
                self.store.observe_load(loaded * self.store.fmt.payload_len, took)
            if loaded < lease.tier_blocks:
                log.info(
                    "%s: loaded %d of %d tier blocks; computing the rest",
                    seq.request_id,
                    loaded,
                    lease.tier_blocks,
                )
        except Exception:
            log.exception("%s: loading tier blocks failed; computing them", seq.request_id)
        finally:
            if reading is not None:  # read ahead, not used: its arena goes back once read
                reading.add_done_callback(self._abandoned)
            if seq.loading is lease:
                seq.loading = None
            self._wake_steps()

    def _read(self, chunk: list[BlockMeta]) -> asyncio.Future[tuple[LoadArena, list[Payload]]]:
        arena = self.store.take_arena()
        return asyncio.ensure_future(
            asyncio.to_thread(lambda: (arena, self.store.load(chunk, arena)))
        )

    def _abandoned(self, reading: asyncio.Future[tuple[LoadArena, list[Payload]]]) -> None:
        if not reading.cancelled() and reading.exception() is None:
            self.store.give_arena(reading.result()[0])

    async def _write(
        self, seq: Sequence, lease: Lease, at: int, payloads: list[Payload]
    ) -> tuple[int, float]:
        """Writes ``payloads`` into ``seq``'s blocks from block ``at`` on, under the step lock,
        if the sequence is still as the load found it: how many blocks were written, and the
        seconds spent waiting for the lock."""
        if not payloads:
            return 0, 0.0
        bs = self.block_size
        asked = time.perf_counter()
        async with self._step_lock:
            waited = time.perf_counter() - asked
            if not self._still_mine(seq, lease, at * bs):
                return 0, waited
            blocks = [seq.block_table[p] for p in range(at, at + len(payloads))]
            await asyncio.wrap_future(self._on_model(self.pool.write_blocks, blocks, payloads))
            if not self._still_mine(seq, lease, at * bs):
                return 0, waited
            n = len(payloads) * bs
            seq.num_computed += n
            seq.spilled_blocks = max(seq.spilled_blocks, at + len(payloads))
            # Usage counts loaded tokens as cached while nothing but this load added to them.
            so_far = lease.cached_tokens + (at - lease.cached_tokens // bs) * bs
            if seq.cached_tokens == so_far and not seq.output:
                seq.cached_tokens += n
            self.loaded_tokens += n
            return len(payloads), waited

    @staticmethod
    def _still_mine(seq: Sequence, lease: Lease, computed: int) -> bool:
        """The sequence still holds ``lease``, runs, and has computed nothing since."""
        return (
            seq.lease is lease
            and seq.status is Status.RUNNING
            and not seq.aborted
            and seq.num_computed == computed
        )
