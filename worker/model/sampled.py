"""What sampling gives back, as plain values: a token (:class:`Sampled`), a speculative row's
verdict (:class:`Accepted`), or a row whose sampling raised (:class:`RowFailed`).

Pure Python (no MLX): the sampler (``worker.model.sampling``) makes them on the model thread,
and the engine's scheduler and sequences, which load no MLX, read them
(``worker.engine.sampling_params`` hands them on). They live here, below the engine, so that the
model path imports nothing from ``worker.engine`` (tests/test_import_rules.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Accepted:
    """A speculative row's verdict: the drafts the model agreed with, then one token of its
    own (a correction, or the token after the last draft), in order."""

    tokens: tuple[Sampled, ...]
    drafts: int  # drafts verified; len(tokens) - 1 of them were accepted

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


@dataclass(frozen=True, slots=True)
class RowFailed:
    """A row whose sampling raised: its request ends (INTERNAL), the batch goes on."""

    error: Exception
