"""The one thread that owns the model, the KV pool and every MLX call.

The event loop hands it a Step and awaits the sampled tokens; MLX streams belong to the
thread that created them, so the runner is also built on this thread. The thread is one per
process and outlives a runner: MLX keeps per-thread stream state, and a second runner built on
a fresh thread after the first one's thread ended failed with "There is no Stream(cpu, 1) in
current thread" (tests start several workers in one process).

Two index spaces meet here, and each has its name: an *item* is a sequence's place in the step
(``Step.items``, the job's ``inputs``); a *row* is its place in one forward's logits (decodes
and prefill chunks run as two forwards, so item 5 may be row 0 of the second). A
:class:`SampleRow` names the item it samples; only ``_run`` turns items into rows, for the
sampler, and answers by item again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np

from worker.engine import lookahead
from worker.engine.sampling_params import Accepted, RowFailed, Sampled
from worker.engine.sequence import PromptEntry
from worker.engine.stall_watch import StallWatch
from worker.engine.step import Step
from worker.engine.step_budget import ForwardTime
from worker.model.draft import DraftModel
from worker.model.forward_batch import SeqInput
from worker.model.grammar import MaskPrefetch
from worker.model.sampling import RowSampler, adjust_logits, sample_rows, verify_rows
from worker.model.spec import ModelSpec

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What the executor, the engine and the server use of a runner: the paged
    ``worker.model.runner.ModelRunner``, or ``worker.model.dense_runner.DenseRunner`` for models with
    recurrent state."""

    kind: str  # "paged" or "dense"
    spec: ModelSpec

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def bytes_per_block(self) -> int: ...

    def describe(self) -> str: ...

    def forward(self, seqs: Sequence[SeqInput]) -> mx.array: ...

    def forward_all(self, seqs: Sequence[SeqInput]) -> list[mx.array]: ...

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None: ...

    def retain(self, keys: Collection[int]) -> None: ...


@dataclass(frozen=True, slots=True)
class SampleRow:
    """A step item whose forward computes through its last token, so it yields one."""

    item: int  # its index in the step's inputs
    sampler: RowSampler
    history: list[int]  # the tokens so far, for logits processors (empty: none needed)
    position: int  # which output token this is (keys a seeded request's draw)


@dataclass(frozen=True, slots=True)
class Speculation:
    """A speculative item's drafts: those the scheduler proposed (already the tail of its
    input's tokens), and how many the draft model may add to them."""

    item: int
    drafts: tuple[int, ...]
    draft_slots: int
    tokens: list[int]  # the sequence so far (the draft model's input); empty: no draft model


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A prefill item whose prompt tokens' log-probabilities are asked for: ``targets[j]`` is
    the prompt token that the chunk's position j predicts (-1: none, past the prompt), with
    ``top`` alternatives each."""

    item: int
    targets: list[int]
    top: int


@dataclass(frozen=True, slots=True)
class _Job:
    inputs: list[SeqInput]
    copies: list[tuple[int, int]]
    samples: list[SampleRow]
    live: frozenset[int] | None = None  # seq keys still running; None: keep every sequence
    speculations: tuple[Speculation, ...] = ()
    # The engine expects the next step to decode the same sequences: the executor may start
    # that forward now (``worker.engine.lookahead``).
    same_next: bool = False
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    # Filled by the run: by item, an entry per chunk position (None where it has no target).
    prompt_out: dict[int, list[PromptEntry | None]] | None = None


def _prompt_logprobs(step: Step) -> Iterator[PromptLogprobs]:
    """The step's prefill items whose sequence asked for prompt logprobs: each chunk position
    p predicts prompt token p + 1."""
    for i, item in enumerate(step.items):
        seq = item.seq
        top = seq.params.prompt_logprobs
        if top is None or item.speculative or item.start >= len(seq.prompt) - 1:
            continue
        n = len(seq.prompt)
        targets = [
            seq.prompt[p + 1] if p + 1 < n else -1
            for p in range(item.start, item.start + len(item.token_ids))
        ]
        yield PromptLogprobs(i, targets, top)


def prompt_entries(logits: mx.array, want: PromptLogprobs) -> list[PromptEntry | None]:
    """Each chunk position's target log-probability, rank and top alternatives, from its fp32
    logits ``[positions, vocab]`` (the raw model's: before bias, penalties or a grammar, which
    apply to generated tokens; vLLM's prompt logprobs are the raw ones too). Computed for the
    whole chunk at once in MLX; only ``[positions, top]`` values come back to the host."""
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = mx.array([max(t, 0) for t in want.targets])[:, None]
    chosen = mx.take_along_axis(lp, targets, axis=-1)
    ranks = (lp > chosen).sum(axis=-1) + 1
    parts = [chosen[:, 0], ranks]
    if want.top:
        ids = mx.argpartition(-lp, kth=want.top - 1, axis=-1)[:, : want.top]
        parts += [ids, mx.take_along_axis(lp, ids, axis=-1)]
    mx.eval(*parts)
    values, rank = np.asarray(parts[0]).tolist(), np.asarray(parts[1]).tolist()
    if want.top:
        top_ids, top_lp = np.asarray(parts[2]), np.asarray(parts[3])
        order = np.argsort(-top_lp, axis=-1, kind="stable")
        top_ids = np.take_along_axis(top_ids, order, axis=-1).tolist()
        top_lp = np.take_along_axis(top_lp, order, axis=-1).tolist()
    out: list[PromptEntry | None] = []
    for j, target in enumerate(want.targets):
        if target < 0:
            out.append(None)
            continue
        top: tuple[tuple[int, float], ...] = ()
        if want.top:
            top = tuple(zip(top_ids[j], top_lp[j], strict=True))
        out.append((values[j], rank[j], top))
    return out


@cache
def mlx_thread() -> ThreadPoolExecutor:
    """The process's MLX thread."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")


class ModelExecutor:
    def __init__(
        self,
        build: Callable[[], Runner],
        build_draft: Callable[[Runner], DraftModel] | None = None,
    ) -> None:
        """``build`` makes the runner, ``build_draft`` the draft model for it (speculative
        decoding's ``--draft-model``), both on the model thread."""
        self._thread = mlx_thread()
        self.runner: Runner = self._thread.submit(build).result()
        self.draft: DraftModel | None = None
        if build_draft is not None:
            self.draft = self._thread.submit(build_draft, self.runner).result()
        self.lookahead = lookahead.Policy("off")
        """Decode lookahead (``worker.engine.lookahead``): after a greedy decode-only step
        that the engine expects to repeat, start the next step's forward before answering,
        where this policy says so (the worker's ``--decode-lookahead``)."""
        self._ahead: lookahead.Ahead | None = None
        # The previous job's start and end on this thread, and whether it was a step that may
        # look ahead (the policy's measurements compare two such steps in a row).
        self._job_start = 0.0
        self._job_end = 0.0
        self._may_look = False
        # The next step's grammar masks, filled between steps (the engine starts them).
        self.masks = MaskPrefetch()
        self.lookahead_hits = 0
        self.lookahead_misses = 0
        self.watch: StallWatch | None = None
        """Times every job from here on (a worker group's ``--group-timeout-s``)."""

    async def run(
        self, step: Step, live: frozenset[int] | None = None
    ) -> tuple[list[Sampled | Accepted | RowFailed | None], ForwardTime]:
        """The step's sampled tokens (None for rows that yield none) and how long its forwards
        took on this thread (the engine's step-time budget learns from it). Each sequence is
        keyed by its lease id; ``live`` (the running leases) lets the runner drop the state of
        every other sequence (``Runner.retain``)."""
        samples = []
        speculations = []
        for i, item in enumerate(step.items):
            if item.samples:
                seq = item.seq
                history = seq.tokens if seq.sampler.processors else []
                samples.append(SampleRow(i, seq.sampler, history, len(seq.output)))
            if item.speculative:
                tokens = item.seq.tokens if item.draft_slots else []
                speculations.append(Speculation(i, item.drafts, item.draft_slots, tokens))
        inputs = [SeqInput(i.token_ids, i.block_table, i.start, i.lease_id) for i in step.items]
        prompt_lps = tuple(_prompt_logprobs(step))
        job = _Job(
            inputs,
            step.copies,
            samples,
            live,
            tuple(speculations),
            step.same_next,
            prompt_lps,
            {} if prompt_lps else None,
        )
        sampled, took = await self._submit(job)
        out: list[Sampled | Accepted | RowFailed | None] = [None] * len(step.items)
        for row, s in zip(samples, sampled, strict=True):
            out[row.item] = s
        for index, entries in (job.prompt_out or {}).items():
            chunk = step.items[index]
            for j, entry in enumerate(entries):
                if entry is not None:
                    chunk.seq.prompt_logprobs[chunk.start + j + 1] = entry
        return out, took

    async def run_batch(
        self,
        inputs: list[SeqInput],
        copies: list[tuple[int, int]],
        samples: list[SampleRow],
        speculations: Sequence[Speculation] = (),
    ) -> list[Sampled | Accepted | RowFailed]:
        """One step as plain inputs (the warm-up drives it too): applies ``copies``, runs
        ``inputs`` (``speculations``: those items are speculative decodes), and samples
        ``samples``, answering in their order."""
        job = _Job(inputs, copies, samples, speculations=tuple(speculations))
        return (await self._submit(job))[0]

    async def retain(self, live: frozenset[int]) -> None:
        """Drop the per-sequence state (the runner's, the draft model's) of every sequence
        not in ``live``, on the model thread."""

        def drop() -> None:
            self.runner.retain(live)
            if self.draft is not None:
                self.draft.retain(live)

        await self.call(drop)

    async def drop(self, keys: frozenset[int]) -> None:
        """Drop the draft model's state of ``keys`` (sequences that were no lease's: the
        warm-up's), keeping every running sequence's."""
        if self.draft is not None:
            await self.call(self.draft.forget, keys)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Queues ``fn(*args)`` on the model thread now (not when awaited): work that must
        run before any step queued after it (a tier's copy of blocks about to be released)."""
        return self._thread.submit(self._watched(fn), *args)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the model thread (what touches the runner or MLX streams)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._watched(fn), *args)

    def _watched(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, timed by the stall watch where there is one."""
        return fn if self.watch is None else functools.partial(self.watch.run, fn)

    async def _submit(self, job: _Job) -> tuple[list[Sampled | Accepted | RowFailed], ForwardTime]:
        return await self.call(self._run, job)

    def _run(self, job: _Job) -> tuple[list[Sampled | Accepted | RowFailed], ForwardTime]:
        """Decodes, speculative decodes and prefill chunks as up to three forwards (each is
        padded to its longest query), then samples the rows that finished their tokens. Each
        forward is timed with its sampling (drafting too): wall time on this thread is what
        the step costs, waits for the GIL included; speculative decodes count as decode."""
        began = time.perf_counter()
        idle, period = began - self._job_end, began - self._job_start
        self._job_start = began
        try:
            return self._run_job(job, idle, period)
        finally:
            self._job_end = time.perf_counter()

    def _run_job(
        self, job: _Job, idle: float, period: float
    ) -> tuple[list[Sampled | Accepted | RowFailed], ForwardTime]:
        """:meth:`_run` of a job that began ``idle`` seconds after the previous one ended and
        ``period`` seconds after it began."""
        if job.live is not None:
            self.runner.retain(job.live)
            if self.draft is not None:
                self.draft.retain(job.live)
        if job.copies:
            self.runner.copy_blocks(job.copies)
        by_item = {r.item: r for r in job.samples}
        out: dict[int, Sampled | Accepted | RowFailed] = {}  # by item
        speculative = {sp.item for sp in job.speculations}
        # A prefill chunk whose prompt logprobs are asked for runs with the prefills (whose
        # forward can return every position's logits) even if it is one token long.
        whole = {p.item: p for p in job.prompt_logprobs}
        prefills = [
            i
            for i, s in enumerate(job.inputs)
            if (len(s.token_ids) > 1 or i in whole) and i not in speculative
        ]
        decodes = [i for i in range(len(job.inputs)) if i not in speculative and i not in prefills]
        seconds = [0.0, 0.0]
        ahead, self._ahead = self._ahead, None
        followed, self._may_look = self._may_look, False
        if job.speculations:
            start = time.perf_counter()
            out.update(self._verify(job, by_item))
            seconds[0] += time.perf_counter() - start
        for g, items in enumerate((decodes, prefills)):
            if not items:
                continue
            start = time.perf_counter()
            inputs = [job.inputs[i] for i in items]
            # The forward's row k is item items[k].
            rows = [
                (k, r.sampler, r.history, r.position)
                for k, i in enumerate(items)
                if (r := by_item.get(i)) is not None
            ]
            may_look = g == 0 and self._may_look_ahead(job, inputs, rows)
            if g == 0:
                self._may_look = may_look
            look = may_look and self.lookahead.wants()
            if g == 0 and ahead is not None and ahead.matches(inputs, self.runner.block_size):
                logits = ahead.logits
                self.lookahead_hits += 1
            else:
                if g == 0 and ahead is not None:
                    self.lookahead_misses += 1
                paged = cast(Any, self.runner)  # forward_async: the paged runner's
                # A row with a grammar: its mask is filled while the forward computes.
                overlap = look or (
                    hasattr(paged, "forward_async") and any(r[1].grammar is not None for r in rows)
                )
                asked = [(k, whole[i]) for k, i in enumerate(items) if i in whole]
                if asked:
                    every = self.runner.forward_all(inputs)
                    logits = mx.stack([x[-1] for x in every])
                    assert job.prompt_out is not None
                    for k, want in asked:
                        job.prompt_out[want.item] = prompt_entries(every[k], want)
                elif may_look and followed and ahead is None and self.lookahead.measuring:
                    logits = self._measured_forward(inputs, idle, period)
                elif overlap:
                    logits = paged.forward_async(inputs)
                else:
                    logits = self.runner.forward(inputs)
            failed: dict[int, RowFailed] = {}
            if look and any(r[1].adjusts for r in rows):
                # Bias, penalties and masks come from what is known now (every token before
                # this step's is consumed): the next forward is built on the adjusted argmax.
                adjusted, failed = adjust_logits(logits, rows, self.masks)
            else:
                adjusted = logits
            if look and not failed:  # every row greedy: the next forward runs on its samples
                ids, self._ahead = lookahead.start(
                    self.runner, inputs, adjusted, self._masks_after(rows, logits.shape[-1])
                )
                sampled: list[Sampled | RowFailed] = [Sampled(t) for t in ids]
            else:
                sampled = sample_rows(logits, rows, self.masks) if rows else []
            for (k, *_), s in zip(rows, sampled, strict=True):
                out[items[k]] = s
            seconds[g] += time.perf_counter() - start
        padded = len(prefills) * max((len(job.inputs[i].token_ids) for i in prefills), default=0)
        return [out[r.item] for r in job.samples], ForwardTime(seconds[0], seconds[1], padded)

    def _masks_after(self, rows: list, vocab_size: int) -> Callable[[list[int]], None] | None:
        """For a step that looks ahead with grammar rows: what starts the next step's masks
        once this step's tokens are known (``MaskPrefetch.start_after``), so that their fill
        runs while the next forward launches and the loop streams, not in the next step."""
        constrained = [(k, r[1]) for k, r in enumerate(rows) if r[1].grammar is not None]
        if not constrained:
            return None

        def fill(ids: list[int]) -> None:
            for k, sampler in constrained:
                sampler.consumed_ahead(ids[k], self.masks.wait)
            self.masks.start_after([(s.grammar, ids[k]) for k, s in constrained], vocab_size)

        return fill

    def _measured_forward(self, inputs: list[SeqInput], idle: float, period: float) -> mx.array:
        """The decode forward of a step that may look ahead but runs its own forward, timed
        in parts for the lookahead's policy (``lookahead.Policy.measured``): built, launched,
        then waited for. Returns the logits, evaluated."""
        paged = cast(Any, self.runner)  # the paged runner's (``lookahead.fits``)
        t0 = time.perf_counter()
        logits = paged.forward_async(inputs, launch=False)
        t1 = time.perf_counter()
        paged.launch(logits)
        t2 = time.perf_counter()
        mx.eval(logits)
        self.lookahead.measured(idle, t1 - t0, time.perf_counter() - t2, period)
        return logits

    def _may_look_ahead(self, job: _Job, inputs: list[SeqInput], rows: list) -> bool:
        """A decode-only, greedy step the engine expects to repeat (``lookahead.fits``), on a
        worker whose policy may look ahead at all."""
        return (
            self.lookahead.enabled
            and job.same_next
            and not job.speculations
            and len(inputs) == len(job.inputs)
            and lookahead.fits(self.runner, inputs, rows)
        )

    def _verify(self, job: _Job, by_item: dict[int, SampleRow]) -> dict[int, Accepted | RowFailed]:
        """The speculative items: the draft model's drafts added, then one forward over every
        item's last token and drafts, and each row's verdict (``verify_rows``)."""
        inputs = []
        drafted = []
        for sp in job.speculations:
            seq = job.inputs[sp.item]
            drafts = sp.drafts
            if sp.draft_slots:
                if self.draft is None:
                    raise RuntimeError("a draft_model speculation reached a worker without one")
                assert seq.seq_key is not None
                drafts += tuple(self.draft.propose(seq.seq_key, sp.tokens, sp.draft_slots))
            drafted.append(drafts)
            # A decode: its last token, then every draft.
            inputs.append(
                SeqInput([seq.token_ids[0], *drafts], seq.block_table, seq.start, seq.seq_key)
            )
        logits = self.runner.forward_all(inputs)
        rows = []
        for sp, row_logits, drafts in zip(job.speculations, logits, drafted, strict=True):
            r = by_item[sp.item]
            rows.append((row_logits, r.sampler, r.history, r.position, drafts))
        verdicts = verify_rows(rows)
        return {sp.item: v for sp, v in zip(job.speculations, verdicts, strict=True)}

    def shutdown(self) -> None:
        """Waits for work in flight; the thread stays for the next runner of this process."""
        self._thread.submit(lambda: None).result()
