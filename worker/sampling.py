"""Sampling parameters, their validation, and the per-step sampler (mlx-lm's samplers).

Seeded requests draw each token from a key derived from (seed, position), not from a stream
of draws, so a request gives the same tokens alone, in any batch, and after a preemption.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from worker.errors import InvalidRequest

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 0  # 0: up to the context
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def validate(self, vocab_size: int) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(msg)

        if not 0.0 <= self.temperature <= 100.0:
            raise bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise bad(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 0:
            raise bad(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 0.0 <= self.repetition_penalty <= 10.0:
            raise bad(f"repetition_penalty must be in [0, 10], got {self.repetition_penalty}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise bad(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        if any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be in [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class RowSampler:
    """One sequence's sampler, built once at admission; called on the model thread."""

    params: SamplingParams
    sampler: Callable[[mx.array], mx.array] = field(init=False)
    processors: list = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.sampler = make_sampler(p.temperature, p.top_p, p.min_p, 1, p.top_k)
        penalty = p.repetition_penalty if p.repetition_penalty not in (0.0, 1.0) else None
        self.processors = make_logits_processors(repetition_penalty=penalty)

    @property
    def plain_greedy(self) -> bool:
        return self.params.greedy and not self.processors and not self.params.logprobs


def sample_rows(
    logits: mx.array, rows: Sequence[tuple[int, RowSampler, Sequence[int], int]]
) -> list[Sampled]:
    """Samples one token for each (row index, sampler, tokens so far, position) of `logits`.

    Plain greedy rows are one batched argmax; the rest go row by row (processors need the
    row's history, seeded rows their own key).
    """
    out: dict[int, Sampled] = {}
    greedy = [r for r in rows if r[1].plain_greedy]
    if greedy:
        idx = mx.array([r[0] for r in greedy])
        tokens = np.asarray(mx.argmax(logits[idx], axis=-1)).tolist()
        for (row, *_), tok in zip(greedy, tokens, strict=True):
            out[row] = Sampled(int(tok))
    for row, rs, history, position in rows:
        if rs.plain_greedy:
            continue
        x = logits[row : row + 1]
        if rs.processors:
            hist = mx.array(list(history), dtype=mx.int32)
            for proc in rs.processors:
                x = proc(hist, x)
        logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if rs.params.seed is not None:
            mx.random.seed((rs.params.seed * 1_000_003 + position) & 0xFFFFFFFF)
        token = int(np.asarray(rs.sampler(logprobs)).reshape(-1)[0])
        if rs.params.seed is not None:
            mx.random.seed(int.from_bytes(os.urandom(4), "little"))
        top: tuple[tuple[int, float], ...] = ()
        lp = np.asarray(logprobs[0])
        if rs.params.logprobs:
            ids = np.argsort(-lp, kind="stable")[: rs.params.logprobs]
            top = tuple((int(i), float(lp[i])) for i in ids)
        out[row] = Sampled(token, float(lp[token]), top)
    return [out[r[0]] for r in rows]
