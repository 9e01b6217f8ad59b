"""Speculative decoding's drafting side that needs no model: prompt lookup (n-gram).

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

Pure Python: the scheduler calls it on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_MAX_N = 4
DEFAULT_MIN_N = 2


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
