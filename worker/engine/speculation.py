"""Speculative decoding's drafting side that needs no model: prompt lookup (n-gram), and the
brakes that decide when drafting is worth it.

A speculating sequence's decode step computes its last token and up to k draft tokens in one
forward; the sampler keeps the longest prefix of the drafts the model agrees with, plus one
token of its own (``worker.model.sampling.verify_row``). The drafts' K/V written past the
accepted ones is left in the lease's own blocks, beyond ``num_computed``: the next forward
overwrites it and nothing publishes it (commits cover computed tokens only), so rejecting a
draft costs no pool operation. A draft model's drafts come from ``worker.model.draft`` on the
model thread; the scheduler only says how many it may propose.

Prompt lookup proposes what followed the most recent earlier occurrence of the sequence's
last n tokens (n from ``max_n`` down to ``min_n``), as vLLM's ``ngram`` method and
transformers' ``prompt_lookup_num_tokens`` do. It pays where the output quotes its context:
code edits, summaries that copy, repetitive text. The index is incremental: each token added
costs ``max_n - min_n + 1`` dictionary writes, each proposal as many lookups, whatever the
context length.

Drafting costs compute whatever is kept, so two brakes stop it where it does not pay: a sequence
whose drafts are rarely kept (:data:`MIN_ACCEPTANCE`, applied by ``Scheduler.draft_room``), and
draft-model drafting at batch sizes where it measured slower than plain decoding
(:class:`DraftModelRates`).

Pure Python: the scheduler calls it on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_MAX_N = 4
DEFAULT_MIN_N = 2
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


class NgramDrafter:
    """One sequence's tokens and an index of their n-grams: for each, the position after its
    latest occurrence that has a continuation. Fed the tokens as they come (:meth:`extend`),
    so a step costs what its new tokens cost, not the context's length."""

    __slots__ = ("_index", "_tokens", "max_n", "min_n")

    def __init__(self, max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._index: dict[tuple[int, ...], int] = {}
        self._tokens: list[int] = []

    @property
    def seen(self) -> int:
        """Tokens fed so far."""
        return len(self._tokens)

    def extend(self, new: Sequence[int]) -> None:
        """Appends the sequence's next tokens and indexes every n-gram that now has a
        continuation: the one ending at position i - 1 maps to i. Later occurrences overwrite
        earlier ones (the latest context is the likeliest to repeat)."""
        tokens = self._tokens
        first = len(tokens)
        tokens.extend(new)
        for i in range(max(first, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._index[tuple(tokens[i - n : i])] = i

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` drafts to follow the tokens fed so far."""
        tokens = self._tokens
        end = len(tokens)
        if k <= 0 or end < self.min_n + 1:
            return []
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            at = self._index.get(tuple(tokens[end - n :]))
            if at is not None:
                return tokens[at : min(at + k, end)]
        return []


class DraftModelRates:
    """Whether a step's draft-model requests draft (see :data:`RATE_WEIGHT`): per batch-size
    bucket, the recent decode tokens a second of steps whose draft-model requests drafted and
    of steps where they did not. The scheduler asks at each step (:meth:`choose`) and reports
    the step's decode rate after it ran (:meth:`observe`)."""

    def __init__(self) -> None:
        # Per bucket: [drafting, plain] decode tokens a second (None: not measured yet).
        self._rates: dict[int, list[float | None]] = {}
        self._steps = 0
        self._step: tuple[int, bool] | None = None  # this step's (bucket, drafted)

    def choose(self, decodes: int, wanted: bool) -> bool:
        """Whether this step's draft-model requests draft, the step having ``decodes`` decodes;
        ``wanted``: whether any of them asks for the draft model (else nothing is measured)."""
        self._step = None
        if not wanted:
            return False
        bucket = decodes.bit_length()  # 1, 2-3, 4-7, 8-15, ...
        drafting, plain = self._rates.setdefault(bucket, [None, None])
        if drafting is None:
            choice = True
        elif plain is None:
            choice = False
        else:
            self._steps += 1
            choice = (drafting >= plain) != (self._steps % PROBE_EVERY == 0)
        self._step = (bucket, choice)
        return choice

    def observe(self, decode_tokens: int, decode_s: float) -> None:
        """The step's decode tokens and the seconds its decode forward took."""
        if self._step is None or decode_s <= 0:
            return
        bucket, drafted = self._step
        rates = self._rates[bucket]
        rate = decode_tokens / decode_s
        old = rates[0 if drafted else 1]
        rates[0 if drafted else 1] = rate if old is None else old + RATE_WEIGHT * (rate - old)
