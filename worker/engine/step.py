"""One step of the engine: the sequences of the next forward and what each computes.

The scheduler makes a :class:`Step` (``Scheduler.schedule``), the executor runs it on the model
thread (``ModelExecutor.run``), the scheduler advances its sequences (``postprocess``) and the
lease sync publishes the blocks it wrote (``LeaseSync.publish``). Plain values: no MLX, no RPC.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.sequence import Sequence


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
    # admission pending, none of them at its max_tokens): see worker.engine.lookahead.
    same_next: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(i.token_ids) for i in self.items)
