"""The draft model of speculative decoding (``--draft-model``): a small mlx-lm model with the
target's tokenizer proposes greedy drafts, which the target verifies in one forward
(``worker.model.sampling.verify_rows``), as mlx_lm.server's ``--draft-model`` does.

Each speculating sequence keeps its own dense mlx-lm cache here, keyed as the runner's
sequences are (the lease id), and the tokens it has fed. A proposal trims the cache back to
what it shares with the sequence now (the drafts the target rejected), feeds what is new (the
prompt at first, in chunks; then the tokens kept since), and decodes k tokens greedily. A
preempted sequence comes back under a new lease and starts again; sequences that left are
dropped at the next step (``retain``).

The draft model runs one sequence at a time: its caches have different lengths, and k steps
of a small model cost less than batching them would save here. All calls come from the model
thread.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from worker.errors import UnsupportedModelError

PREFILL_CHUNK = 512


@dataclass(slots=True)
class _State:
    cache: list[Any]
    fed: list[int] = field(default_factory=list)  # tokens whose K/V the cache holds
    # Leading tokens of fed known to be the sequence's: those it had at the last proposal (a
    # sequence only grows), so only the drafts after them are compared, not the context.
    confirmed: int = 0


class DraftModel:
    def __init__(self, model: nn.Module, name: str, vocab_size: int) -> None:
        """``vocab_size``: the target's; the draft's logits must cover the same ids."""
        self.model = model
        self.name = name
        probe = make_prompt_cache(model)
        if not can_trim_prompt_cache(probe):
            raise UnsupportedModelError(
                f"draft model {name}: its cache cannot be trimmed (recurrent layers), so "
                "rejected drafts could not be rolled back"
            )
        out = model(mx.array([[0]]), cache=probe).shape[-1]
        if out != vocab_size:
            raise UnsupportedModelError(
                f"draft model {name} has {out} output logits; the served model {vocab_size}: "
                "a draft model must share the served model's tokenizer"
            )
        self._states: dict[int, _State] = {}

    def retain(self, keys: Collection[int]) -> None:
        for key in [k for k in self._states if k not in keys]:
            del self._states[key]

    def forget(self, keys: Collection[int]) -> None:
        """Drop the state of ``keys`` (the warm-up's own sequences), keeping every other."""
        for key in keys:
            self._states.pop(key, None)

    def propose(self, key: int, tokens: Sequence[int], k: int) -> list[int]:
        """``k`` greedy drafts to follow ``tokens``."""
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _State(make_prompt_cache(self.model))
        common = state.confirmed + _common_prefix(
            state.fed[state.confirmed :], tokens[state.confirmed :]
        )
        common = min(common, len(tokens) - 1)  # the last token is fed again for its logits
        if len(state.fed) > common:
            trim_prompt_cache(state.cache, len(state.fed) - common)
            del state.fed[common:]
        new = list(tokens[common:])
        for at in range(0, len(new) - 1, PREFILL_CHUNK):
            chunk = new[at : min(at + PREFILL_CHUNK, len(new) - 1)]
            self.model(mx.array([chunk]), cache=state.cache)
            mx.eval([c.state for c in state.cache])
        drafts: list[int] = []
        last = new[-1]
        for _ in range(k):
            logits = self.model(mx.array([[last]]), cache=state.cache)
            last = int(np.asarray(mx.argmax(logits[0, -1])))  # .item() would hold the GIL
            drafts.append(last)
        # The cache now holds tokens and every draft but the last.
        state.fed = [*tokens, *drafts[:-1]]
        state.confirmed = len(tokens)
        return drafts


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
