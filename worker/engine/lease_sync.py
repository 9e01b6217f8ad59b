"""Everything the worker says to the cache service, as one object beside the step loop.

The engine steps the model; ``LeaseSync`` keeps the leases its sequences need in step with the
cache service, on its own tasks so the service is never on the per-token path:

- **registration** at start, and again after the service forgot or fenced the pool (restart):
  every running request is requeued (its output kept) and no block of a void lease is written
  after that, because the step lock is held throughout;
- **the heartbeat**, on a fixed cadence (a fraction of the TTL the service announced), never
  behind a step; it reports leases that expired, whose sequences are requeued;
- **admission**: leases for waiting requests, oldest first. A request the pool cannot hold yet
  lets the ones behind it pass for :data:`OVERTAKE_S`, then blocks them (so a long prompt is
  not starved) until it is admitted or has waited ``admission_timeout_s`` (then it ends with
  RESOURCE_EXHAUSTED: nothing waits forever); one the pool could never hold (pinned blocks, a
  namespace quota) is refused at once; one the service deferred (its prefix is being computed
  by another lease) waits until something is committed; running requests that must grow come
  first;
- **extend-ahead**: one batched ExtendLeases per step for every sequence about to outgrow its
  blocks, overlapping the forward; when the pool has no block left, the youngest running
  sequence is preempted (released, its committed prefix stays cached, requeued);
- **publishing**: full prompt blocks are committed as soon as a step writes them (so deferred
  requests can share them at once), and a finished or ended request's lease is released with
  the tokens whose K/V it wrote.

Calls that fail are typed (``worker.engine.lease``): no room waits or preempts, a lost lease asks for a
heartbeat, a fenced pool re-registers, an unreachable service backs admission off
(``worker.engine.outage``). The interface to the engine is narrow: ``start``/``stop``,
``wake_admission``, ``extend_ahead``, ``publish``, ``release``. It talks to the service only
through ``worker.engine.lease.LeaseService`` (the engine is handed the gRPC client).

What splits off cleanly is apart: admission's order (``worker.engine.admission``, pure policy)
and the coalescing of releases (``worker.engine.release_queue``). The rest is longer than 300
lines on purpose: these five conversations share one state (the publish count deferrals wait
on, growth blocked by preemption, recovery in progress) and split across files they would need
it passed around again, as the engine's eight attributes were.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from worker.engine.admission import DEFER_RETRY_S, admission_batch, overdue
from worker.engine.lease import (
    CacheUnavailable,
    Deferred,
    Fenced,
    Lease,
    LeaseAsk,
    LeaseError,
    LeaseLost,
    LeaseService,
    NeverFits,
    NoRoom,
    PoolRegistration,
    Rejected,
    Written,
)
from worker.engine.outage import Outage
from worker.engine.release_queue import ReleaseQueue
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, Status
from worker.engine.step import Step
from worker.engine.step_budget import StepBudget
from worker.engine.tier_sync import TierSync
from worker.errors import CacheOutage, CacheRejected, InvalidRequest, NotAdmitted, WorkerError

log = logging.getLogger(__name__)

RETRY_S = 0.1  # admission retry tick (deferrals on dead leases, unreachable service)


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    max_batch_size: int
    reserve_tokens: int
    """Token slots leased beyond the prompt at admission."""
    extend_ahead_tokens: int
    """How far ahead of need a running sequence asks for its next block."""
    prefix_caching: bool
    publish_blocks: bool = True
    """Commit written blocks to the cache service's index. Off for the dense runner
    (``worker.model.dense_runner``): its leased blocks hold no K/V, so an index entry would offer
    another request a prefix that is not there."""
    admission_timeout_s: float = 0.0
    """The longest a request waits for blocks the pool has no room for; 0: no limit."""
    cache_outage_timeout_s: float = 0.0
    """The cache service unreachable this long: requests waiting for a lease, or for a block
    to grow into, end, and new ones are refused (``CacheOutage``); 0: they wait it out."""


def _written(seq: Sequence) -> Written:
    """What a commit or release tells the service of ``seq``'s lease: its computed tokens are
    written, and it knows those the lease was acquired for (only later ones travel)."""
    count = seq.num_computed
    start = min(seq.admitted_tokens, count)
    return Written(count, start, seq.token_slice(start, count - start))


class LeaseSync:
    def __init__(
        self,
        client: LeaseService,
        registration: PoolRegistration,
        policy: LeasePolicy,
        scheduler: Scheduler,
        *,
        step_lock: asyncio.Lock,
        wake_steps: Callable[[], None],
        end: Callable[[Sequence, WorkerError], None],
        budget: StepBudget | None = None,
        tiers: TierSync | None = None,
    ) -> None:
        """``step_lock``: held by the step loop around each step (recovery takes it, so no step
        runs on void leases). ``wake_steps``: a sequence can step (admitted, grown, requeued).
        ``end``: ends a sequence with a typed error (the engine's). ``budget``: told the TTL."""
        self.client = client
        self.registration = registration
        self.policy = policy
        self.scheduler = scheduler
        self.block_size = registration.block_size
        self._step_lock = step_lock
        self._wake_steps = wake_steps
        self._end = end
        self._budget = budget
        self.tiers = tiers
        self.preemptions = 0
        self._admit = asyncio.Event()
        self._probe: asyncio.Task | None = None  # check_reachable's heartbeat, in flight
        self._outage = Outage(base_s=RETRY_S)
        # Bumped by every commit and release that came back: a deferred request is retried only
        # once something was published since the service deferred it.
        self._published = 0
        self._recovering = False
        self._growth_blocked = False
        self._freed_at = float("-inf")  # when a lease was last released (``overdue``)
        self._extension: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._releases = ReleaseQueue(client, self._spawn, self._published_something)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Registers the pool (retrying until the service answers), then admits and beats."""
        await self._register()
        if self.tiers is not None:
            self.tiers.start()
        self._tasks += [
            asyncio.create_task(self._admit_loop()),
            asyncio.create_task(self._heartbeat_loop()),
        ]

    async def stop(self) -> None:
        """Stops admitting and beating; lets the releases already sent finish; closes."""
        for task in self._tasks:
            task.cancel()
        if self._extension is not None:
            self._extension.cancel()
        await asyncio.gather(*self._tasks, *self._background, return_exceptions=True)
        if self.tiers is not None:
            await self.tiers.stop()
        await self.client.close()

    @property
    def max_namespace_chars(self) -> int:
        return self.client.max_namespace_chars

    async def _register(self) -> None:
        delay = 0.1
        while True:
            try:
                inc = await self.client.register(self.registration)
            except LeaseError as err:
                log.warning("cannot register with the cache service (%s); retrying", err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            log.info(
                "registered pool %r, incarnation %d (lease TTL %.1fs, heartbeat every %.2fs)",
                self.registration.pool_id,
                inc,
                self.client.lease_ttl_s,
                self.client.heartbeat_interval_s,
            )
            if self._budget is not None:
                self._budget.set_ttl(self.client.lease_ttl_s)
            if self.tiers is not None:
                try:
                    await self.tiers.after_register()
                except LeaseError as err:  # the tier's content is a hint: serve without it
                    log.warning("cannot send the disk tier's manifest: %s", err)
            self._outage.recovered()
            return

    # -- what the engine calls ----------------------------------------------------------------

    def wake_admission(self) -> None:
        """A request is waiting (submitted, requeued) or blocks may have come back."""
        self._admit.set()

    def extend_ahead(self) -> None:
        """One batched ExtendLeases, in the background, for every sequence about to outgrow
        its blocks. It runs while the model steps: a sequence only stalls if its extension has
        not come back in time."""
        if self._extension is not None and not self._extension.done():
            return
        # A speculating sequence may write its drafts' K/V and keep them all in one step. One
        # whose blocks already hold every token it can ever have asks for nothing: a request
        # sized to the whole pool was refused a block it would never use, and preempted,
        # again and again.
        ahead = self.policy.extend_ahead_tokens
        items = [
            (s.lease.lease_id, (len(s.block_table) + 1) * self.block_size)
            for s in self.scheduler.running
            if s.lease is not None
            and s.capacity - s.num_tokens < ahead + s.num_draft
            and s.capacity < len(s.prompt) + s.max_tokens + s.num_draft
        ]
        if items:
            self._extension = asyncio.create_task(self._extend(items))
        elif self._growth_blocked:
            self._growth_blocked = False  # nobody is waiting to grow any more
            self._admit.set()

    def publish(self, step: Step) -> None:
        """Commits the full prompt blocks ``step`` wrote, so concurrent requests with the same
        prefix (deferred by the cache service) can share them at once. Call it only once
        nothing of the step can fail any more."""
        if not self.policy.publish_blocks:
            return
        items = []
        for item in step.items:
            seq = item.seq
            if seq.lease is None or item.start >= seq.admitted_tokens:
                continue
            full = seq.num_computed // self.block_size * self.block_size
            if full > seq.committed_tokens:
                seq.committed_tokens = full
                if self.tiers is not None:  # queued before the commit goes out
                    self.tiers.spill(seq, full // self.block_size)
                written = _written(seq)
                items.append((seq.lease.lease_id, written))
        if items:
            self._spawn(self._commit(items))

    def release(self, seq: Sequence, then: Callable[[], None] | None = None) -> None:
        """Releases ``seq``'s lease, if it holds one, with the tokens whose K/V it wrote (the
        service commits their full blocks to the index). ``then`` runs once the service has
        answered the release (or it failed), at once where there is no lease."""
        lease = seq.lease
        if lease is None:
            if then is not None:
                then()
            return
        written = None
        if self.policy.publish_blocks:
            written = _written(seq)
            if self.tiers is not None:  # queued before the release goes out
                self.tiers.spill(seq, written.count // self.block_size)
        seq.lease = None
        self._freed_at = time.monotonic()  # the admission timeout counts from here (overdue)
        self._releases.add(lease.lease_id, written, then)

    # -- lease traffic ------------------------------------------------------------------------

    async def _extend(self, items: list[tuple[int, int]]) -> None:
        try:
            grown = await self.client.extend(items)
        except NoRoom:
            self._growth_blocked = True  # running sequences get blocks before new ones
            victim = self.scheduler.youngest()
            if victim is not None:
                # Its committed prefix stays cached, so resuming it recomputes little.
                log.info("preempted %s: no block to grow into", victim.request_id)
                self.preemptions += 1
                victim.preemptions += 1
                self.release(victim)
                self.scheduler.requeue(victim)
            self._wake_steps()
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
        self._wake_steps()
        self._admit.set()

    async def _commit(self, items: list[tuple[int, Written]]) -> None:
        try:
            await self.client.commit(items)
        except LeaseError as err:
            log.debug("commit failed: %s", err)
        self._published_something()

    def _published_something(self) -> None:
        """A commit or release came back (or failed): requests deferred on a prefix may go on,
        and blocks may be free again."""
        self._published += 1
        self._admit.set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- admission ----------------------------------------------------------------------------

    async def _admit_loop(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # lands as its timeout fires, and this loop would outlive stop().
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(RETRY_S, self._outage.retry_in())):
                    await self._admit.wait()
            self._admit.clear()
            self._end_stranded()
            if not self._recovering and self._outage.retry_in() == 0:
                try:
                    await self._admit_pass()
                except Exception:  # a bug must not stop admission silently for good
                    log.exception("admission pass failed; retrying")

    async def _admit_pass(self) -> None:
        """Leases for waiting requests in one AcquireLeases, in admission's order
        (``worker.engine.admission``): the service tries them in order and the first the pool
        cannot hold yet ends the batch, so it blocks those behind it (no starvation of long
        prompts); a deferred one does not."""
        if self._recovering or (self._growth_blocked and self.scheduler.running):
            return  # blocks go to running sequences that must grow first
        room = self.policy.max_batch_size - len(self.scheduler.running)
        now = time.monotonic()
        self._end_overdue(now)
        batch = admission_batch(self.scheduler.waiting, self._published, now, room)
        if not batch:
            return
        asks = [
            LeaseAsk(
                seq.tokens,
                seq.namespace,
                min(self.policy.reserve_tokens, seq.max_tokens - len(seq.output)),
                # Prompt logprobs need every prompt position's logits: no cached prefix.
                not self.policy.prefix_caching or seq.params.prompt_logprobs is not None,
            )
            for seq in batch
        ]
        # Taken before the call: a commit that lands while it is in flight must wake us.
        published = self._published
        try:
            results, expired = await self.client.acquire(asks)
        except LeaseError as err:
            self._on_lease_error(err)
            return
        self._outage.recovered()
        self._drop_expired(expired)
        for seq, result in zip(batch, results, strict=True):
            self._admission_answer(seq, result, now, published)

    def _admission_answer(
        self, seq: Sequence, result: Lease | Deferred | LeaseError, now: float, published: int
    ) -> None:
        """The service's answer for ``seq`` in an admission pass begun at ``now``, when the
        publish count was ``published``: admitted, deferred, no room yet, or refused."""
        if isinstance(result, Rejected):
            self._end(seq, CacheRejected(f"the cache service rejected the lease: {result}"))
        elif isinstance(result, NeverFits):
            self._end(seq, InvalidRequest(str(result)))
        elif isinstance(result, LeaseError):
            if isinstance(result, NoRoom):  # no room: wait for blocks to come back
                if seq.no_room_since is None:
                    seq.no_room_since = now
            else:
                log.warning("cache service error for %s: %s", seq.request_id, result)
        elif isinstance(result, Deferred):
            log.debug(
                "%s waits for lease %d (%d tokens pending)",
                seq.request_id,
                result.waiting_on,
                result.pending_tokens,
            )
            seq.deferred_at = published
            seq.deferred_until = time.monotonic() + DEFER_RETRY_S
        elif seq.status is Status.FINISHED or seq not in self.scheduler.waiting:
            self._releases.add(result.lease_id, None)  # aborted meanwhile
        else:
            log.debug(
                "%s admitted %.1f ms after its arrival: lease %d, %d of %d tokens cached",
                seq.request_id,
                (time.monotonic() - seq.arrival) * 1e3,
                result.lease_id,
                result.cached_tokens,
                seq.num_tokens,
            )
            seq.admit(result)
            if self.tiers is not None:
                self.tiers.load(seq, result)
            self.scheduler.admitted(seq)
            self._wake_steps()

    def check_reachable(self) -> None:
        """Raises CacheOutage while the cache service has been unreachable past the limit:
        a new request would only wait for it. A refusal asks the service again (a heartbeat,
        no sooner than the outage's backoff allows), so the first request after it is back
        finds out and the next ones are served."""
        limit = self.policy.cache_outage_timeout_s
        if limit and self._outage.down_for() >= limit:
            if self._outage.retry_in() == 0 and (self._probe is None or self._probe.done()):
                self._probe = self._spawn(self._heartbeat_once())
            raise CacheOutage(self._outage_message())

    def _outage_message(self) -> str:
        return (
            f"the KV cache service has been unreachable for {self._outage.down_for():.0f} s "
            f"({self._outage.last_error}): no block can be leased until it is back; retry later"
        )

    def _end_stranded(self) -> None:
        """Past ``cache_outage_timeout_s`` of outage: every waiting request, and every running
        one with no slot left to write its next token into (it needs a block only the service
        can grant), ends with CacheOutage. Running ones with room go on."""
        limit = self.policy.cache_outage_timeout_s
        if not limit or self._outage.down_for() < limit:
            return
        stranded = list(self.scheduler.waiting) + [
            s for s in self.scheduler.running if s.capacity <= s.num_tokens
        ]
        if stranded:
            log.warning("ending %d requests: %s", len(stranded), self._outage_message())
        for seq in stranded:
            self._end(seq, CacheOutage(self._outage_message()))

    def _end_overdue(self, now: float) -> None:
        """Ends every request that has waited ``admission_timeout_s`` for room."""
        limit = self.policy.admission_timeout_s
        for seq, waited in overdue(self.scheduler.waiting, now, limit, self._freed_at):
            log.warning(
                "%s not admitted after %.0f s waiting for %d KV blocks",
                seq.request_id,
                waited,
                -(-seq.num_tokens // self.block_size),
            )
            self._end(
                seq,
                NotAdmitted(
                    f"not admitted within {limit:g} s: the worker's KV pool had no room for "
                    f"its {seq.num_tokens} tokens, and none came back meanwhile (held by "
                    "running requests, pinned prefixes or a namespace quota); retry later"
                ),
            )

    # -- liveness -----------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """Renews the pool's liveness on a fixed cadence, never behind the step lock or a step:
        only a blocked event loop delays it, and a beat that comes more than an interval late
        says so in the log."""
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
        self._published += 1  # their blocks are back: a request deferred on one may go on
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
            self._wake_steps()
