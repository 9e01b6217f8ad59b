"""Continuous batching: which sequences run in the next forward, and what their tokens mean.

Pure Python, no MLX and no RPC, so its policy is tested in milliseconds. Only the engine
calls it, from the event loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from worker.engine.sampling_params import Accepted, Sampled
from worker.engine.sequence import Finish, Sequence, Status, StreamEvent
from worker.engine.step_budget import ForwardTime
from worker.errors import WorkerError

# Speculative decoding's brake: a sequence whose share of drafts kept (an average over its
# recent verifications, weight ACCEPTANCE_WEIGHT) falls below MIN_ACCEPTANCE drafts on one
# decode in PROBE_EVERY (to notice when the text turns predictable again). Measured: a draft
# model keeping 12% of its drafts ran 8 streams at 0.62x their speed without speculation.
MIN_ACCEPTANCE = 0.25
ACCEPTANCE_WEIGHT = 0.3
PROBE_EVERY = 8
# A draft model's drafts cost its own forwards, one per draft and sequence, which batching the
# target does not share: with 8 streams a draft model half the target's size ran them at 0.57x
# their speed without speculation, with one stream at 1.86x. So whether a step's draft-model
# requests draft is chosen by measurement, per batch size (powers of two): whichever way made
# more decode tokens a second lately (weight RATE_WEIGHT), an unmeasured way first, the other
# way on one such step in PROBE_EVERY (the costs move with contexts and the machine).
RATE_WEIGHT = 0.3


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One sequence's share of a forward: tokens[start:start+len(token_ids)]."""

    seq: Sequence
    start: int
    token_ids: list[int]
    block_table: tuple[int, ...]
    lease_id: int
    # Speculative decoding: prompt-lookup drafts, the tail of token_ids; or how many drafts
    # the draft model may add on the model thread (worker.model.draft). Both are verified in
    # the same forward, and only what the model agrees with is kept.
    drafts: tuple[int, ...] = ()
    draft_slots: int = 0

    @property
    def samples(self) -> bool:
        """Whether this forward computes through the last token, so it yields the next one."""
        return self.start + len(self.token_ids) - len(self.drafts) == self.seq.num_tokens

    @property
    def speculative(self) -> bool:
        return bool(self.drafts) or self.draft_slots > 0


@dataclass(frozen=True, slots=True)
class Step:
    items: list[Scheduled]
    copies: list[tuple[int, int]]  # copy-on-write pairs to apply before the forward
    # Expected to be followed by a step that decodes the same sequences, one token on (no
    # admission pending, none of them at its max_tokens): see ModelExecutor.lookahead.
    same_next: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(i.token_ids) for i in self.items)


class Scheduler:
    """Decodes first, then prefill chunks under a per-step token budget.

    A long prompt is cut into chunks, so it never stalls running decodes for more than one
    chunk. A sequence whose lease does not cover its next token waits for an extension.
    The executor runs a step's decodes and its prefill chunks as two forwards: the batch is
    padded to its longest query, and a decode padded to a 512-token chunk costs 512 tokens.
    """

    def __init__(self, max_batch_size: int, max_step_tokens: int, max_context: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens
        self.max_context = max_context
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Per batch-size bucket: recent decode tokens a second of steps whose draft-model
        # requests drafted, and of steps where they did not (None: not measured yet).
        self._draft_rates: dict[int, list[float | None]] = {}
        self._draft_steps = 0
        self._step_drafting: tuple[int, bool] | None = None  # this step's (bucket, drafted)
        self._decode_tokens = 0  # tokens the last postprocess gave decodes
        # Hold each request's finishing event on the sequence (Sequence.held_final) for the
        # engine to send after the release; False: postprocess sends it at once.
        self.hold_finish = False

    def observe(self, took: ForwardTime) -> None:
        """The step's timings (``ModelExecutor``), after its postprocess: the decode tokens
        a second of a step that had draft-model requests, for :meth:`_draft_model_drafts`."""
        if self._step_drafting is None or took.decode_s <= 0:
            return
        bucket, drafted = self._step_drafting
        rates = self._draft_rates[bucket]
        rate = self._decode_tokens / took.decode_s
        old = rates[0 if drafted else 1]
        rates[0 if drafted else 1] = rate if old is None else old + RATE_WEIGHT * (rate - old)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admitted(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.running.append(seq)

    def _draft_model_drafts(self, decodes: int) -> bool:
        """Whether this step's draft-model requests draft (see RATE_WEIGHT)."""
        bucket = decodes.bit_length()  # 1, 2-3, 4-7, 8-15, ...
        drafting, plain = self._draft_rates.setdefault(bucket, [None, None])
        if drafting is None:
            choice = True
        elif plain is None:
            choice = False
        else:
            self._draft_steps += 1
            choice = (drafting >= plain) != (self._draft_steps % PROBE_EVERY == 0)
        self._step_drafting = (bucket, choice)
        return choice

    def schedule(self, prefill_tokens: int | None = None) -> Step | None:
        """The next step. `prefill_tokens` caps its padded prefill tokens below the step
        budget (the engine's step-time budget: no step may outlast a fraction of the lease TTL)."""
        budget = self.max_step_tokens
        items: list[Scheduled] = []
        copies: list[tuple[int, int]] = []

        def take(seq: Sequence, n: int, drafts: tuple[int, ...] = (), draft_slots: int = 0) -> None:
            start = seq.num_computed
            assert seq.lease is not None
            tokens = seq.token_slice(start, n) + list(drafts)
            items.append(
                Scheduled(
                    seq,
                    start,
                    tokens,
                    tuple(seq.block_table),
                    seq.lease.lease_id,
                    drafts,
                    draft_slots,
                )
            )
            copies.extend(seq.pending_cow)
            seq.pending_cow = ()

        # Decodes first (one token each, with its drafts if it speculates), then prefill
        # chunks, oldest request first.
        self._step_drafting = None
        decoding = [s for s in self.running if s.to_compute == 1][: self.max_batch_size]
        draft_model = any(s.params.speculative == "draft_model" for s in decoding) and (
            self._draft_model_drafts(len(decoding))
        )
        for seq in self.running:
            if len(items) == self.max_batch_size or budget == 0:
                break
            if seq.to_compute == 1 and seq.capacity > seq.num_computed:
                room = min(self.draft_room(seq), budget - 1)
                if room > 0 and seq.drafter is not None:
                    drafter = seq.drafter
                    drafter.extend(seq.token_slice(drafter.seen, seq.num_tokens - drafter.seen))
                    drafts = tuple(drafter.propose(room))
                    take(seq, 1, drafts)
                    budget -= 1 + len(drafts)
                elif room > 0 and seq.params.speculative == "draft_model" and draft_model:
                    take(seq, 1, draft_slots=room)
                    budget -= 1 + room
                else:
                    take(seq, 1)
                    budget -= 1
        # Prefill chunks run as one forward padded to the longest chunk, so the budget
        # counts padded tokens: chunks x longest chunk.
        if prefill_tokens is not None:
            budget = min(budget, prefill_tokens)
        chunks, longest = 0, 0
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if len(items) == self.max_batch_size:
                break
            if seq.to_compute > 1:
                n = min(seq.to_compute, seq.capacity - seq.num_computed, budget // (chunks + 1))
                if n < 1 or (chunks + 1) * max(longest, n) > budget:
                    break
                take(seq, n)
                chunks, longest = chunks + 1, max(longest, n)
        if not items:
            return None
        return Step(items, copies, self._same_next(items))

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
                kept += 1
                finish = self._finish_reason(seq, t.token)
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
            if finish is not None and self.hold_finish:
                seq.held_final = event  # the engine sends it once the release is answered
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
