"""The engine: continuous batching on leased blocks.

The step loop is schedule -> run -> postprocess, on the event loop; the model runs on its own
thread (ModelExecutor). Everything said to the cache service (registration, heartbeat,
admission, extend-ahead, commits and releases) is the lease sync's (worker.engine.lease_sync), on its
own tasks; every check a request passes before it is queued is the intake's (worker.engine.intake).

Liveness never waits for a step: the heartbeat has its own timer, and MLX releases the GIL
while it computes, so the loop runs during a forward. What a forward can still do is hold the
GIL (then no Python thread runs at all), so every step is also kept short: the step budget
(worker/engine/step_budget.py) caps its prefill tokens to a quarter of the lease TTL's worth of time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from worker.engine.executor import ModelExecutor
from worker.engine.final_hold import FinalHold
from worker.engine.intake import Intake, RequestLimits
from worker.engine.lease import LeaseService, PoolRegistration
from worker.engine.lease_sync import LeasePolicy, LeaseSync
from worker.engine.sampling_params import Accepted, RowFailed, Sampled
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, Status
from worker.engine.step import Step
from worker.engine.step_budget import ForwardTime, StepBudget
from worker.engine.tier_sync import TierSync
from worker.errors import Cancelled, ConstraintFailed, ShuttingDown, StepFailed, WorkerError

if TYPE_CHECKING:  # built by the assembly (worker.server): it names blocks with kvserve_proto
    from worker.tier.store import TierStore

# How often background work waiting for an idle engine looks again.
IDLE_POLL_S = 0.05

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    requests_finished: int = 0
    steps: int = 0
    draft_tokens: int = 0  # speculative decoding: drafts verified
    accepted_draft_tokens: int = 0  # and kept


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """The worker's settings the engine, its intake and its lease sync run under."""

    max_batch_size: int
    max_step_tokens: int
    max_context: int
    vocab_size: int
    reserve_tokens: int
    extend_ahead_tokens: int
    prefix_caching: bool
    publish_blocks: bool = True  # off for the dense runner: see LeasePolicy
    max_pending_requests: int = 0
    """Most requests held at once, running + waiting (``--max-pending-requests``); 0: no
    limit. The intake refuses the next one."""
    num_draft_tokens: int = 4
    """Speculative decoding: drafts per step when a request names none."""
    speculation: bool = True
    """Whether the runner can speculate (the dense runner cannot roll rejected drafts back)."""
    draft_model: str = ""
    """The ``--draft-model`` loaded; empty: none (``draft_model`` speculation is refused)."""
    admission_timeout_s: float = 0.0
    """The longest a request waits for room in the pool; 0: no limit (``LeasePolicy``)."""
    cache_outage_timeout_s: float = 0.0
    """How long requests wait out an unreachable cache service (``LeasePolicy``)."""
    itl_ratio: float = 0.0
    """Beside decodes, a step takes at most this many decode-only steps' time
    (``worker.engine.step_budget``); 0: prefill chunks up to ``max_step_tokens`` regardless."""


def _prefill_estimate(executor: ModelExecutor) -> float | None:
    """A prefill token's cost before any is timed (worker.tier.speed), on the model thread."""
    from worker.tier.speed import matmul_flops, prefill_parameters, prefill_s_per_token

    runner = cast(Any, executor.runner)
    params, quantized = prefill_parameters(runner.model)
    return prefill_s_per_token(params, matmul_flops(runner.pool.dtype, quantized=quantized))


class Engine:
    def __init__(
        self,
        executor: ModelExecutor,
        client: LeaseService,
        registration: PoolRegistration,
        limits: EngineLimits,
        tokenizer: Any,
        tiers: TierStore | None = None,
        tier_load: str = "auto",
    ) -> None:
        """``tiers``: the worker's disk tier (``--offload-dir``), started (scanned); None:
        none."""
        self.executor = executor
        self.registration = registration
        self.limits = limits
        self.tokenizer = tokenizer
        self.block_size = registration.block_size
        # Read-your-writes for prefix caching: a request's last event goes out once the
        # service has indexed its KV, so a follow-up sent the moment it ends is a cache hit.
        self.final = FinalHold(limits.publish_blocks and limits.prefix_caching)
        self.scheduler = Scheduler(
            limits.max_batch_size, limits.max_step_tokens, limits.max_context, self.final.keep
        )
        self.budget = StepBudget(
            limits.max_step_tokens, min_tokens=self.block_size, itl_ratio=limits.itl_ratio
        )
        self.stats = EngineStats()
        self._work = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self.tiers = None
        if tiers is not None:
            self.tiers = TierSync(
                tiers,
                client,
                cast(Any, executor.runner).pool,
                executor.submit,
                step_lock=self._step_lock,
                wake_steps=self._work.set,
                estimate_prefill=lambda: _prefill_estimate(executor),
                policy=tier_load,
            )
        self.leases = LeaseSync(
            client,
            registration,
            LeasePolicy(
                limits.max_batch_size,
                limits.reserve_tokens,
                limits.extend_ahead_tokens,
                limits.prefix_caching,
                limits.publish_blocks,
                limits.admission_timeout_s,
                limits.cache_outage_timeout_s,
            ),
            self.scheduler,
            step_lock=self._step_lock,
            wake_steps=self._work.set,
            end=self._end,
            budget=self.budget,
            tiers=self.tiers,
        )
        self.intake = Intake(
            RequestLimits(
                limits.max_context,
                limits.vocab_size,
                self.block_size,
                registration.num_blocks,
                limits.max_pending_requests,
                limits.num_draft_tokens,
                limits.speculation,
                bool(limits.draft_model),
            ),
            tokenizer,
            lambda: self.leases.max_namespace_chars,
        )

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.leases.start()
        self._task = asyncio.create_task(self._step_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self._end(seq, ShuttingDown("the worker is shutting down"))
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        await self.leases.stop()  # after the endings above: their releases go out first
        self.final.send_all()
        await self.intake.close()

    # -- requests -----------------------------------------------------------------------------

    @property
    def held_requests(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    @contextlib.asynccontextmanager
    async def idle_step(self) -> AsyncIterator[None]:
        """Holds the step loop while no request is held: background work on the model thread
        (the warm-up) runs between requests, never while one waits for a step. A request that
        arrives meanwhile waits for the one forward in progress."""
        while True:
            while self.held_requests:
                await asyncio.sleep(IDLE_POLL_S)
            async with self._step_lock:
                if not self.held_requests:
                    yield
                    return

    def submit(self, seq: Sequence) -> None:
        """Queues a request the intake made; admission leases it."""
        self.scheduler.add(seq)
        self.leases.wake_admission()

    def abort(self, seq: Sequence) -> None:
        """Client went away: drop the request, release what it holds."""
        if seq.status is not Status.FINISHED:
            self._end(seq, Cancelled("cancelled by the client"))

    def _end(self, seq: Sequence, error: WorkerError) -> None:
        """Ends a request that did not finish: releases its lease (publishing the tokens whose
        KV it wrote, seq.num_computed) and streams the typed reason."""
        self.scheduler.end(seq, error)
        self.leases.release(seq)

    # -- the step loop ------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        while True:
            async with self._step_lock:
                self.leases.extend_ahead()
                step = self.scheduler.schedule(
                    self.budget.prefill_tokens(), self.budget.prefill_tokens_beside_decodes()
                )
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
        started = time.perf_counter()
        live = frozenset(s.lease.lease_id for s in self.scheduler.running if s.lease is not None)
        results, took = await self.executor.run(step, live)
        self.budget.observe(took)
        if self.tiers is not None:
            self.tiers.observe(took)
        if log.isEnabledFor(logging.DEBUG):
            self._log_step(step, took, time.perf_counter() - started)
        sampled = self._end_failed_rows(step, results)
        before = sum(len(item.seq.output) for item in step.items)  # a sequence once a step
        if any(
            i.seq.sampler is not None
            and i.seq.sampler.grammar is not None
            and not i.seq.sampler.consumed_early
            for i in step.items
        ):
            # postprocess consumes their tokens: no fill may hold a matcher meanwhile. A step
            # that looked ahead had its grammar rows consume theirs with the next masks' fill
            # (``MaskPrefetch.start_after``), and the loop goes on while that fill runs.
            self.executor.masks.wait()
        finished = self.scheduler.postprocess(step, sampled)
        self._prefetch_masks()
        self.scheduler.observe(took)  # after postprocess: it counts the step's decode tokens
        self._account(step, sampled, sum(len(item.seq.output) for item in step.items) - before)
        # Publishing comes last, once nothing of the step can raise any more: a step that
        # fails before this line has sent no commit, and _fail_step releases without its KV.
        self.leases.publish(step)
        for seq in finished:
            self.stats.requests_finished += 1
            # Its finishing event, if held, goes out once this release is answered.
            self.leases.release(seq, then=self.final.when_released(seq))

    def _prefetch_masks(self) -> None:
        """The running sequences' grammar masks for the next step, filled from now on (their
        tokens are consumed): off the step's critical path (``worker.model.grammar``); kept
        where a step that looked ahead began them after the very tokens consumed."""
        constrained = [
            s
            for s in self.scheduler.running
            if s.sampler is not None and s.sampler.grammar is not None
        ]
        if constrained:
            self.executor.masks.start(
                [s.sampler.grammar for s in constrained],
                self.intake.limits.vocab_size,
                [s.output[-1] if s.output else -1 for s in constrained],
            )

    def _log_step(self, step: Step, took: ForwardTime, seconds: float) -> None:
        """One line a step (``--log-level DEBUG``): where a request's time goes between its
        arrival and its tokens, seen from the loop: the step's rows, its forwards' seconds on
        the model thread, and the rest of the executor call (the hand-off, sampling's
        transfer), so a slow first token can be told apart from a slow model."""
        prefill = [i for i in step.items if i.start < i.seq.admitted_tokens]  # prompt chunks
        log.debug(
            "step %d: %d rows, %d prefilling %d tokens (longest context %d), %d decoding; "
            "forwards %.1f ms (prefill %.1f, decode %.1f), executor call %.1f ms; %d waiting",
            self.stats.steps + 1,
            len(step.items),
            len(prefill),
            sum(len(i.token_ids) for i in prefill),
            max((i.start + len(i.token_ids) for i in prefill), default=0),
            len(step.items) - len(prefill),
            (took.prefill_s + took.decode_s) * 1e3,
            took.prefill_s * 1e3,
            took.decode_s * 1e3,
            seconds * 1e3,
            len(self.scheduler.waiting),
        )

    def _end_failed_rows(
        self, step: Step, sampled: list[Sampled | Accepted | RowFailed | None]
    ) -> list[Sampled | Accepted | None]:
        """Ends the requests whose sampling failed (INTERNAL; a failed structured output
        INVALID_ARGUMENT, and its compiled constraint is dropped: ``Grammars.forget``); the
        rest of the step goes on. Their forward wrote sound K/V, but postprocess has not
        advanced them yet, so the release publishes only what earlier steps computed."""
        out: list[Sampled | Accepted | None] = []
        for item, s in zip(step.items, sampled, strict=True):
            if isinstance(s, RowFailed):
                err = s.error
                if isinstance(err, ConstraintFailed):
                    if item.seq.params.structured_output is not None:
                        self.intake.grammars.forget(item.seq.params.structured_output)
                    self._end(item.seq, err)
                else:
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
        self.scheduler.roll_back(step)
        for item in step.items:
            self._end(item.seq, error)

    def _account(self, step: Step, sampled: list, generated: int) -> None:
        """``generated``: tokens the step added to outputs (a verdict's tokens after a stop
        are not)."""
        self.stats.steps += 1
        self.stats.generated_tokens += generated
        for item in step.items:
            end = item.start + len(item.token_ids)
            self.stats.prefilled_tokens += max(0, min(end, item.seq.admitted_tokens) - item.start)
        for s in sampled:
            if isinstance(s, Accepted):
                self.stats.draft_tokens += s.drafts
                self.stats.accepted_draft_tokens += s.accepted

    # -- info ---------------------------------------------------------------------------------

    @property
    def held_blocks(self) -> int:
        """Blocks leased by running requests (the rest is free or cached, evictable)."""
        return sum(len(s.block_table) for s in self.scheduler.running)

    @property
    def load(self) -> tuple[int, int]:
        return len(self.scheduler.running), len(self.scheduler.waiting)
