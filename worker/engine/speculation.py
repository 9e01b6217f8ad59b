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
    """An index of one sequence's n-grams: for each, the position after its latest
    occurrence that has a continuation."""

    __slots__ = ("_index", "_seen", "max_n", "min_n")

    def __init__(self, max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._index: dict[tuple[int, ...], int] = {}
        self._seen = 0  # tokens indexed: every n-gram ending before position _seen - 1

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` drafts to follow ``tokens`` (the sequence so far, which only grows
        between calls, or is the same list rolled back to a shorter one)."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        self._update(tokens)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            at = self._index.get(tuple(tokens[end - n :]))
            if at is not None:
                return list(tokens[at : min(at + k, end)])
        return []

    def _update(self, tokens: Sequence[int]) -> None:
        """Indexes every n-gram that has a continuation: the one ending at position i - 1 maps
        to i, for i < len(tokens). Later occurrences overwrite earlier ones (the latest
        context is the likeliest to repeat)."""
        end = len(tokens)
        if end < self._seen:  # rolled back (a preemption recomputes; tokens are kept, but
            self._index.clear()  # be safe if a caller ever shortens them)
            self._seen = 0
        for i in range(max(self._seen, self.min_n), end):
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._index[tuple(tokens[i - n : i])] = i
        self._seen = end
