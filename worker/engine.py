"""The engine: continuous batching on leased blocks.

Everything here runs on the event loop; the model runs on its own thread (ModelExecutor).
The step loop is schedule -> run -> postprocess. Around it, three small tasks talk to the
cache service so it is never on the per-token path: admission (leases for waiting
requests), the heartbeat (liveness, expired leases, re-registration), and per-step batched
lease extensions issued ahead of need, whose RPC overlaps the forward.

Liveness never waits for a step: the heartbeat has its own timer, and MLX releases the GIL
while it computes, so the loop runs during a forward. What a forward can still do is hold the
GIL (then no Python thread runs at all), so every step is also kept short: the step budget
(worker/step_budget.py) caps its prefill tokens to a quarter of the lease TTL's worth of time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from worker.errors import (
    CacheRejected,
    Cancelled,
    InvalidRequest,
    Overloaded,
    ShuttingDown,
    StepFailed,
    WorkerError,
)
from worker.executor import ModelExecutor
from worker.lease_client import (
    CacheUnavailable,
    Deferred,
    Fenced,
    LeaseClient,
    LeaseError,
    LeaseLost,
    NoRoom,
    PoolRegistration,
    Rejected,
)
from worker.outage import Outage
from worker.sampling import RowFailed, RowSampler, Sampled, SamplingParams
from worker.scheduler import Scheduler, Step
from worker.sequence import Finish, Sequence, Status, StreamEvent, TextStream
from worker.step_budget import StepBudget

log = logging.getLogger(__name__)

RETRY_S = 0.1  # admission retry tick (deferrals on dead leases, unreachable service)


@dataclass(slots=True)
class EngineStats:
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    steps: int = 0


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_batch_size: int
    max_step_tokens: int
    max_context: int
    vocab_size: int
    reserve_tokens: int
    extend_ahead_tokens: int
    prefix_caching: bool
    publish_blocks: bool = True
    """Commit written blocks to the cache service's index. Off for the dense runner
    (``worker.dense_runner``): its leased blocks hold no K/V, so an index entry would offer
    another request a prefix that is not there."""
    max_pending_requests: int = 0
    """Most requests held at once, running + waiting (``--max-pending-requests``); 0: no
    limit. ``check_room`` refuses the next one."""


class Engine:
    def __init__(
        self,
        executor: ModelExecutor,
        client: LeaseClient,
        registration: PoolRegistration,
        limits: EngineLimits,
        tokenizer: Any,
    ) -> None:
        self.executor = executor
        self.client = client
        self.registration = registration
        self.limits = limits
        self.tokenizer = tokenizer
        self.block_size = registration.block_size
        self.scheduler = Scheduler(
            limits.max_batch_size, limits.max_step_tokens, limits.max_context
        )
        self.budget = StepBudget(limits.max_step_tokens, min_tokens=self.block_size)
        self.stats = EngineStats()
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ())) | self.eos_ids
        self._work = asyncio.Event()
        self._admit = asyncio.Event()
        self._outage = Outage(base_s=RETRY_S)
        self._step_lock = asyncio.Lock()
        self._commit_generation = 0
        self._recovering = False
        self._growth_blocked = False
        self._extension: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self._register()
        for coro in (self._step_loop(), self._admit_loop(), self._heartbeat_loop()):
            self._tasks.append(asyncio.create_task(coro))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self._end(seq, ShuttingDown("the worker is shutting down"))
        if self._extension is not None:
            self._extension.cancel()
        await asyncio.gather(*self._tasks, *self._background, return_exceptions=True)
        await self.client.close()

    async def _register(self) -> None:
        delay = 0.1
        while True:
            try:
                inc = await self.client.register(self.registration)
                log.info(
                    "registered pool %r, incarnation %d (lease TTL %.1fs, heartbeat every %.2fs)",
                    self.registration.pool_id,
                    inc,
                    self.client.lease_ttl_s,
                    self.client.heartbeat_interval_s,
                )
                self.budget.set_ttl(self.client.lease_ttl_s)
                return
            except LeaseError as err:
                log.warning("cannot register with the cache service (%s); retrying", err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    # -- requests -----------------------------------------------------------------------------

    def new_sequence(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        namespace: str,
    ) -> Sequence:
        """Validates a request; raises InvalidRequest before anything is held."""
        lim = self.limits
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= lim.vocab_size:
            raise InvalidRequest(f"prompt token ids must be in [0, {lim.vocab_size})")
        params.validate(lim.vocab_size)
        # The cache service's rule for what it stores (and its admin tools print).
        if len(namespace) > self.client.max_namespace_chars:
            raise InvalidRequest(
                f"namespace is longer than {self.client.max_namespace_chars} characters"
            )
        if not namespace.isprintable():
            raise InvalidRequest("namespace holds non-printable characters")
        room = lim.max_context - len(prompt)
        if room <= 0:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens; the model's context is {lim.max_context}"
            )
        max_tokens = params.max_tokens or room
        if max_tokens > room:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"the model's context of {lim.max_context} tokens"
            )
        need = -(-(len(prompt) + max_tokens) // self.block_size)
        if need > self.registration.num_blocks:
            raise InvalidRequest(
                f"the request needs {need} KV blocks; this worker's pool has "
                f"{self.registration.num_blocks}"
            )
        detok = self.tokenizer.detokenizer
        return Sequence(
            request_id=request_id,
            prompt=list(prompt),
            params=params,
            namespace=namespace,
            max_tokens=max_tokens,
            arrival=time.monotonic(),
            sampler=RowSampler(params),
            text=TextStream(
                detok,
                params.stop,
                params.include_stop_str_in_output,
                self.special_ids if params.skip_special_tokens else frozenset(),
            ),
            eos_ids=self.eos_ids,
        )

    def check_room(self) -> None:
        """Raises Overloaded when the worker already holds ``max_pending_requests`` requests.
        Called before the request is tokenized, validated or queued, so a full worker refuses
        in microseconds, holding nothing; ``submit`` must follow with no ``await`` between, or
        another request could take the room."""
        limit = self.limits.max_pending_requests
        held = len(self.scheduler.running) + len(self.scheduler.waiting)
        if limit and held >= limit:
            raise Overloaded(
                f"this worker holds {held} requests (running + waiting), its limit "
                f"(--max-pending-requests {limit}); retry on another worker or later"
            )

    def submit(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self._admit.set()

    def abort(self, seq: Sequence) -> None:
        """Client went away: drop the request, release what it holds."""
        if seq.status is not Status.FINISHED:
            self._end(seq, Cancelled("cancelled by the client"))

    def _end(self, seq: Sequence, error: WorkerError) -> None:
        """Ends a request that did not finish: releases its lease (publishing the tokens whose
        KV it wrote, seq.num_computed) and streams the typed reason."""
        seq.aborted = True
        was_running = seq.lease is not None
        self.scheduler.remove(seq)
        if was_running:
            self._release(seq)
        if seq.status is not Status.FINISHED:
            seq.status = Status.FINISHED
            seq.out.put_nowait(StreamEvent([], "", [], Finish.ABORT, error))

    # -- the step loop ------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        while True:
            async with self._step_lock:
                self._maybe_extend()
                step = self.scheduler.schedule(self.budget.prefill_tokens())
                if step is not None:
                    try:
                        await self._run_step(step)
                    except Exception as err:  # a bug must not wedge every other request
                        log.exception("step failed; ending its %d requests", len(step.items))
                        self._fail_step(step, err)
                    continue
            self._work.clear()
            await self._work.wait()

    async def _run_step(self, step: Step) -> None:
        live = frozenset(s.lease.lease_id for s in self.scheduler.running if s.lease is not None)
        results, took = await self.executor.run(step, live)
        self.budget.observe(took)
        sampled = self._end_failed_rows(step, results)
        finished = self.scheduler.postprocess(step, sampled)
        self._account(step, sampled)
        # Publishing comes last, once nothing of the step can raise any more: a step that
        # fails before this line has sent no commit, and _fail_step releases without its KV.
        self._commit_prefill(step)
        for seq in finished:
            self.stats.requests_finished += 1
            self._release(seq)

    def _end_failed_rows(
        self, step: Step, sampled: list[Sampled | RowFailed | None]
    ) -> list[Sampled | None]:
        """Ends the requests whose sampling failed (INTERNAL); the rest of the step goes on.
        Their forward wrote sound K/V, but postprocess has not advanced them yet, so the
        release publishes only what earlier steps computed."""
        out: list[Sampled | None] = []
        for item, s in zip(step.items, sampled, strict=True):
            if isinstance(s, RowFailed):
                err = s.error
                self._end(item.seq, StepFailed(f"sampling failed: {type(err).__name__}: {err}"))
                s = None
            out.append(s)
        return out

    def _fail_step(self, step: Step, err: Exception) -> None:
        """A step raised (a model bug, bad logits, a bookkeeping bug): its requests end with
        INTERNAL, every other request and the worker go on. Whatever the step wrote to the
        pool (all, some, or wrong K/V) is never published: each sequence is rolled back to
        the tokens computed before the step, so its release commits only blocks earlier steps
        wrote, and the step's blocks go back to the free list unindexed. Without the rollback,
        a failure after postprocess (which advances num_computed) made the release commit the
        failed step's blocks, and later requests reused them."""
        error = StepFailed(f"internal error in a model step: {type(err).__name__}: {err}")
        for item in step.items:
            seq = item.seq
            if seq.lease is not None and seq.lease.lease_id == item.lease_id:
                seq.num_computed = min(seq.num_computed, item.start)
            self._end(seq, error)

    def _account(self, step: Step, sampled: list) -> None:
        self.stats.steps += 1
        for item in step.items:
            end = item.start + len(item.token_ids)
            self.stats.prefilled_tokens += max(0, min(end, item.seq.admitted_tokens) - item.start)
        self.stats.generated_tokens += sum(1 for s in sampled if s is not None)

    # -- leases -------------------------------------------------------------------------------

    def _maybe_extend(self) -> None:
        """One batched ExtendLeases, in the background, for every sequence about to outgrow
        its blocks. It runs while the model steps: the cache service is not on the per-token
        path, and a sequence only stalls if its extension has not come back in time."""
        if self._extension is not None and not self._extension.done():
            return
        ahead = self.limits.extend_ahead_tokens
        items = [
            (s.lease.lease_id, (len(s.block_table) + 1) * self.block_size)
            for s in self.scheduler.running
            if s.lease is not None and s.capacity - s.num_tokens < ahead
        ]
        if items:
            self._extension = asyncio.create_task(self._extend(items))
        elif self._growth_blocked:
            self._growth_blocked = False  # nobody is waiting to grow any more
            self._admit.set()

    async def _extend(self, items: list[tuple[int, int]]) -> None:
        try:
            grown = await self.client.extend(items)
        except NoRoom:
            self._growth_blocked = True  # running sequences get blocks before new ones
            victim = self.scheduler.youngest()
            if victim is not None:
                # Its committed prefix stays cached, so resuming it recomputes little.
                log.info("preempted %s: no block to grow into", victim.request_id)
                self.stats.preemptions += 1
                victim.preemptions += 1
                self._release(victim)
                self.scheduler.requeue(victim)
            self._work.set()
            return
        except LeaseLost:
            await self._heartbeat_once()
            return
        except LeaseError as err:
            self._on_lease_error(err)
            return
        self._growth_blocked = False
        by_lease = {s.lease.lease_id: s for s in self.scheduler.running if s.lease is not None}
        for lease_id, blocks in grown.items():
            if lease_id in by_lease:
                by_lease[lease_id].block_table.extend(blocks)
        self._work.set()
        self._admit.set()

    def _commit_prefill(self, step: Step) -> None:
        """Publishes full prompt blocks as soon as they are written, so concurrent requests
        with the same prefix (deferred by the cache service) can share them at once."""
        if not self.limits.publish_blocks:
            return
        items = []
        for item in step.items:
            seq = item.seq
            if seq.lease is None or item.start >= seq.admitted_tokens:
                continue
            full = seq.num_computed // self.block_size * self.block_size
            if full > seq.committed_tokens:
                seq.committed_tokens = full
                items.append((seq.lease.lease_id, seq.tokens[: seq.num_computed]))
        if items:
            self._spawn(self._commit(items))

    async def _commit(self, items: list[tuple[int, list[int]]]) -> None:
        try:
            await self.client.commit(items)
        except LeaseError as err:
            log.debug("commit failed: %s", err)
        self._commit_generation += 1
        self._admit.set()

    def _release(self, seq: Sequence) -> None:
        lease = seq.lease
        if lease is None:
            return
        # Released with its tokens, the lease commits their full blocks to the index.
        tokens = seq.tokens[: seq.num_computed] if self.limits.publish_blocks else []
        seq.lease = None
        self._release_tokens(lease.lease_id, tokens)

    def _release_tokens(self, lease_id: int, tokens: list[int]) -> None:
        self._spawn(self._release_rpc(lease_id, tokens))

    async def _release_rpc(self, lease_id: int, tokens: list[int]) -> None:
        try:
            await self.client.release(lease_id, tokens)
        except LeaseError as err:
            log.debug("release of lease %d failed: %s", lease_id, err)
        self._commit_generation += 1
        self._admit.set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- admission ----------------------------------------------------------------------------

    async def _admit_loop(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # lands as its timeout fires, and this loop would outlive stop().
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(RETRY_S, self._outage.retry_in())):
                    await self._admit.wait()
            self._admit.clear()
            if not self._recovering and self._outage.retry_in() == 0:
                try:
                    await self._admit_pass()
                except Exception:  # a bug must not stop admission silently for good
                    log.exception("admission pass failed; retrying")

    async def _admit_pass(self) -> None:
        """Leases for waiting requests, oldest first. A request the pool cannot hold yet
        blocks those behind it (no starvation of long prompts); a deferred one does not."""
        for seq in list(self.scheduler.waiting):
            if len(self.scheduler.running) >= self.limits.max_batch_size or self._recovering:
                return
            if self._growth_blocked and self.scheduler.running:
                return  # blocks go to running sequences that must grow first
            if seq.deferred_generation == self._commit_generation:
                continue  # nothing committed since the cache service told it to wait
            remaining = seq.max_tokens - len(seq.output)
            reserve = min(self.limits.reserve_tokens, remaining)
            # Taken before the call: a commit that lands while it is in flight must wake us.
            generation = self._commit_generation
            try:
                result, expired = await self.client.acquire(
                    seq.tokens, seq.namespace, reserve, not self.limits.prefix_caching
                )
            except NoRoom:
                return
            except Rejected as err:
                self._end(seq, CacheRejected(f"the cache service rejected the lease: {err}"))
                continue
            except LeaseError as err:
                self._on_lease_error(err)
                return
            self._outage.recovered()
            self._drop_expired(expired)
            if isinstance(result, Deferred):
                log.debug(
                    "%s waits for lease %d (%d tokens pending)",
                    seq.request_id,
                    result.waiting_on,
                    result.pending_tokens,
                )
                seq.deferred_generation = generation
                continue
            if seq.status is Status.FINISHED or seq not in self.scheduler.waiting:
                self._release_tokens(result.lease_id, [])  # aborted meanwhile
                continue
            log.debug(
                "%s admitted: lease %d, %d cached tokens",
                seq.request_id,
                result.lease_id,
                result.cached_tokens,
            )
            seq.admit(result, self.block_size)
            self.scheduler.admitted(seq)
            self._work.set()

    # -- liveness -----------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """Renews the pool's liveness on a fixed cadence (a fraction of the TTL the cache service
        announced), never behind the step lock or a step: only a blocked event loop delays it,
        and a beat that comes more than an interval late says so in the log."""
        due = time.monotonic()
        while True:
            interval = self.client.heartbeat_interval_s
            due += interval
            await asyncio.sleep(due - time.monotonic())
            late = time.monotonic() - due
            if late > interval:
                log.warning(
                    "heartbeat %.2fs late (lease TTL %.1fs): the event loop was blocked",
                    late,
                    self.client.lease_ttl_s,
                )
                due = time.monotonic()
            try:
                await self._heartbeat_once()
            except Exception:  # a bug here would let the pool's liveness lapse: keep beating
                log.exception("heartbeat failed; retrying at the next beat")

    async def _heartbeat_once(self) -> None:
        try:
            self._drop_expired(await self.client.heartbeat())
            self._outage.recovered()
        except LeaseError as err:
            self._on_lease_error(err)

    def _drop_expired(self, lease_ids: list[int]) -> None:
        """Leases the cache service expired: stop using their blocks before any newer lease's
        blocks are written (this runs before the caller uses a new lease)."""
        if not lease_ids:
            return
        expired = set(lease_ids)
        for seq in list(self.scheduler.running):
            if seq.lease is not None and seq.lease.lease_id in expired:
                log.warning("lease of %s expired; recomputing it", seq.request_id)
                self.scheduler.requeue(seq)
        self._admit.set()

    def _on_lease_error(self, err: LeaseError) -> None:
        if isinstance(err, Fenced):
            if err.incarnation != self.client.incarnation:
                # Sent before the latest registration: registering again would fence off the
                # new incarnation's calls in flight, and their answers would do it again.
                log.debug("stale answer for incarnation %d: %s", err.incarnation, err)
            elif not self._recovering:
                self._spawn(self._recover(str(err)))
        elif isinstance(err, CacheUnavailable):
            self._outage.failed(err)  # backs admission off; logs at most every 10 s
        else:
            log.warning("cache service error: %s", err)

    async def _recover(self, why: str) -> None:
        """The cache service forgot us (restart) or fenced us: every lease is void. Stop
        stepping, requeue every running request (its output so far is kept), register a new
        incarnation, and resume. No block of a void lease is written after this."""
        self._recovering = True
        log.warning("re-registering with the cache service: %s", why)
        try:
            async with self._step_lock:
                for seq in list(self.scheduler.running):
                    self.scheduler.requeue(seq)
                await self._register()
        finally:
            self._recovering = False
            self._admit.set()
            self._work.set()

    # -- info ---------------------------------------------------------------------------------

    @property
    def held_blocks(self) -> int:
        """Blocks leased by running requests (the rest is free or cached, evictable)."""
        return sum(len(s.block_table) for s in self.scheduler.running)

    @property
    def load(self) -> tuple[int, int]:
        return len(self.scheduler.running), len(self.scheduler.waiting)
