"""Continuous batching: which sequences run in the next forward, and what their tokens mean.

Pure Python, no MLX and no RPC, so its policy is tested in milliseconds. Only the engine
calls it, from the event loop. Of a sequence's state it writes the progress (status, output,
computed tokens, speculation counts; ``Sequence``'s sections say who writes what); when to
speculate is ``worker.engine.speculation``'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from worker.engine.sampling_params import Accepted, Sampled
from worker.engine.sequence import Finish, Sequence, Status, StreamEvent
from worker.engine.speculation import (
    ACCEPTANCE_WEIGHT,
    MIN_ACCEPTANCE,
    PROBE_EVERY,
    DraftModelRates,
)
from worker.engine.step import Scheduled, Step
from worker.engine.step_budget import ForwardTime
from worker.errors import WorkerError


class Scheduler:
    """Decodes first, then prefill chunks under a per-step token budget.

    A long prompt is cut into chunks, so it never stalls running decodes for more than one
    chunk. A sequence whose lease does not cover its next token waits for an extension.
    The executor runs a step's decodes and its prefill chunks as two forwards: the batch is
    padded to its longest query, and a decode padded to a 512-token chunk costs 512 tokens.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_step_tokens: int,
        max_context: int,
        final: Callable[[Sequence, StreamEvent], None] | None = None,
    ) -> None:
        """``final``: where a request's finishing event goes (the engine's
        ``worker.engine.final_hold.FinalHold``, which may hold it until the request's KV is
        indexed); None: to the sequence's own sink, like every other event."""
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens
        self.max_context = max_context
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._final = final
        self._draft_rates = DraftModelRates()
        self._decode_tokens = 0  # tokens the last postprocess gave decodes

    def observe(self, took: ForwardTime) -> None:
        """The step's timings (``ModelExecutor``), after its postprocess: the decode tokens
        a second of a step that had draft-model requests (``DraftModelRates``)."""
        self._draft_rates.observe(self._decode_tokens, took.decode_s)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admitted(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.running.append(seq)

    def schedule(
        self, prefill_tokens: int | None = None, beside_decodes: int | None = None
    ) -> Step | None:
        """The next step: decodes first (one token each, with its drafts if it speculates),
        then prefill chunks, oldest request first. `prefill_tokens` caps its padded prefill
        tokens below the step budget, and `beside_decodes` where the step decodes too (the
        engine's ``worker.engine.step_budget``: no step may outlast a fraction of the lease
        TTL, and, with ``--itl-ratio``, decoding sequences wait for at most one bounded
        prefill forward)."""
        items: list[Scheduled] = []
        budget = self._schedule_decodes(items, self.max_step_tokens)
        if prefill_tokens is not None:
            budget = min(budget, prefill_tokens)
        if items and beside_decodes is not None:
            budget = min(budget, beside_decodes)
        self._schedule_prefill_chunks(items, budget)
        if not items:
            return None
        # Copy-on-write pairs a lease asks for, applied before the forward's first write.
        copies = [pair for item in items for pair in item.seq.pending_cow]
        for item in items:
            item.seq.pending_cow = ()
        return Step(items, copies, self._same_next(items))

    def _schedule_decodes(self, items: list[Scheduled], budget: int) -> int:
        """Every running sequence with one token to compute and a slot to write it, within the
        batch and ``budget``; returns the budget left."""
        decoding = [s for s in self.running if s.to_compute == 1][: self.max_batch_size]
        draft_model = self._draft_rates.choose(
            len(decoding), any(s.params.speculative == "draft_model" for s in decoding)
        )
        for seq in self.running:
            if len(items) == self.max_batch_size or budget == 0:
                break
            if seq.to_compute == 1 and seq.capacity > seq.num_computed and seq.loading is None:
                room = min(self.draft_room(seq), budget - 1)
                if room > 0 and seq.drafter is not None:
                    drafter = seq.drafter
                    drafter.extend(seq.token_slice(drafter.seen, seq.num_tokens - drafter.seen))
                    drafts = tuple(drafter.propose(room))
                    items.append(self._take(seq, 1, drafts))
                    budget -= 1 + len(drafts)
                elif room > 0 and seq.params.speculative == "draft_model" and draft_model:
                    items.append(self._take(seq, 1, draft_slots=room))
                    budget -= 1 + room
                else:
                    items.append(self._take(seq, 1))
                    budget -= 1
        return budget

    def _schedule_prefill_chunks(self, items: list[Scheduled], budget: int) -> None:
        """Prefill chunks, oldest request first, within the batch and ``budget``. They run as
        one forward padded to the longest chunk, so the budget counts padded tokens: chunks x
        longest chunk."""
        chunks, longest = 0, 0
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if len(items) == self.max_batch_size:
                break
            if seq.to_compute > 1 and seq.loading is None:
                n = min(seq.to_compute, seq.capacity - seq.num_computed, budget // (chunks + 1))
                if n < 1 or (chunks + 1) * max(longest, n) > budget:
                    break
                items.append(self._take(seq, n))
                chunks, longest = chunks + 1, max(longest, n)

    @staticmethod
    def _take(
        seq: Sequence, n: int, drafts: tuple[int, ...] = (), draft_slots: int = 0
    ) -> Scheduled:
        """``seq``'s next ``n`` tokens, then ``drafts``, as one item of the step."""
        assert seq.lease is not None
        start = seq.num_computed
        tokens = seq.token_slice(start, n) + list(drafts)
        block_table = tuple(seq.block_table)
        return Scheduled(seq, start, tokens, block_table, seq.lease.lease_id, drafts, draft_slots)

    def _same_next(self, items: list[Scheduled]) -> bool:
        """Whether the step after a decode step of ``items`` is likely the same sequences:
        each runs every step (all running sequences are in it), none speculates, none can end
        by max_tokens or the context after it, and nothing waits to be admitted. A stop token
        or string still ends one unforeseen."""
        return (
            len(items) == len(self.running)
            and not self.waiting
            and all(
                len(i.token_ids) == 1
                and not i.speculative
                and len(i.seq.output) + 2 < i.seq.max_tokens
                and i.seq.num_tokens + 2 < self.max_context
                for i in items
            )
        )

    def draft_room(self, seq: Sequence) -> int:
        """How many drafts ``seq`` may verify in its next decode: its request's number, within
        the lease's slots (every draft's K/V is written), its max_tokens and the context (no
        draft is verified that could not be kept). A sequence whose drafts are rarely kept
        (``acceptance`` below MIN_ACCEPTANCE) drafts on one decode in PROBE_EVERY only: each
        verified draft costs a token of compute, and a draft model costs its own steps."""
        if not seq.num_draft:
            return 0
        if seq.acceptance < MIN_ACCEPTANCE and len(seq.output) % PROBE_EVERY:
            return 0
        return max(
            0,
            min(
                seq.num_draft,
                seq.capacity - seq.num_computed - 1,
                seq.max_tokens - len(seq.output) - 1,
                self.max_context - seq.num_tokens - 1,
            ),
        )

    def postprocess(self, step: Step, sampled: list[Sampled | Accepted | None]) -> list[Sequence]:
        """Advances every scheduled sequence; streams new tokens; returns the finished.

        A speculative row's tokens are taken one by one, as if decoded one per step: the first
        that finishes the request (eos, a stop, max_tokens) is its last. Its K/V holds the last
        token and the kept drafts; what the rejected drafts wrote past them is never published
        and the next forward overwrites it."""
        finished = []
        self._decode_tokens = 0
        for item, s in zip(step.items, sampled, strict=True):
            seq = item.seq
            if seq.lease is None or seq.lease.lease_id != item.lease_id or seq.aborted:
                if seq.sampler is not None:
                    seq.sampler.discard_ahead()  # its grammar took the token early: undone
                continue  # lost its lease or was cancelled while the forward ran
            if isinstance(s, Accepted):
                seq.num_computed = item.start + 1 + s.accepted
                seq.draft_tokens += s.drafts
                seq.accepted_drafts += s.accepted
                if s.drafts:
                    seq.acceptance += ACCEPTANCE_WEIGHT * (s.accepted / s.drafts - seq.acceptance)
                new = s.tokens
            else:
                seq.num_computed = item.start + len(item.token_ids)
                if s is None:
                    continue
                new = (s,)
            finish, text, kept = None, "", 0
            for t in new:
                seq.output.append(t.token)
                if seq.sampler is not None and seq.sampler.adjusts:  # penalties, grammar
                    seq.sampler.accept(t.token)
                kept += 1
                finish = self._finish_reason(seq, t.token)
                # A stop token's own text (EOS, stop_token_ids) is left out unless asked for,
                # as vLLM does: with special tokens kept it was "<|im_end|>" in the content.
                if finish is Finish.STOP and not seq.params.include_stop_str_in_output:
                    piece, hit_stop = "", False
                else:
                    piece, hit_stop = seq.text.add(t.token)
                text += piece
                if hit_stop:
                    finish = Finish.STOP
                if finish is not None:
                    text += "" if hit_stop else seq.text.finish()
                    break
            seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)
            if finish is not None:
                seq.status = Status.FINISHED
                finished.append(seq)
            out = new[:kept]
            if len(item.token_ids) - len(item.drafts) == 1:
                self._decode_tokens += kept
            event = StreamEvent([t.token for t in out], text, list(out), finish)
            if finish is not None and self._final is not None:
                self._final(seq, event)  # the engine's FinalHold: sent once the KV is indexed
            else:
                seq.out.put_nowait(event)
        if finished:
            self.running = [s for s in self.running if s.status is Status.RUNNING]
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> Finish | None:
        p = seq.params
        if (token in seq.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return Finish.STOP
        if len(seq.output) >= seq.max_tokens or seq.num_tokens >= self.max_context:
            return Finish.LENGTH
        return None

    def roll_back(self, step: Step) -> None:
        """``step`` failed after it ran: each of its sequences still on the lease the step ran
        it on goes back to the tokens computed before the step, so its release publishes only
        what earlier steps wrote (``Engine._fail_step``)."""
        for item in step.items:
            seq = item.seq
            if seq.lease is not None and seq.lease.lease_id == item.lease_id:
                seq.num_computed = min(seq.num_computed, item.start)

    def youngest(self) -> Sequence | None:
        """The preemption victim: the most recently arrived running sequence."""
        return max(self.running, key=lambda s: s.arrival, default=None)

    def requeue(self, seq: Sequence) -> None:
        """A running sequence lost its lease (expired or fenced): recompute it later."""
        if seq in self.running:
            self.running.remove(seq)
        seq.drop_lease()
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def end(self, seq: Sequence, error: WorkerError) -> None:
        """Ends a request that did not finish: out of the queues, no further step of it is
        used, and its stream gets the typed reason (once). Its lease is the caller's to
        release."""
        seq.aborted = True
        self.remove(seq)
        if seq.status is not Status.FINISHED:
            seq.status = Status.FINISHED
            seq.out.put_nowait(StreamEvent([], "", [], Finish.ABORT, error))
