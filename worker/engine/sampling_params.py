"""What a request asks of sampling, and what sampling gives back: plain values.

``SamplingParams`` is the gateway's too (``kvserve_model.sampling_params``, one definition for
both). Pure Python (no MLX), so the sequence and the scheduler can hold them without loading
MLX; ``worker.model.sampling`` does the sampling itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve_model.sampling_limits import SamplingLimitError, check_sampling
from kvserve_model.sampling_params import SamplingParams
from worker.errors import InvalidRequest

__all__ = ["Accepted", "RowFailed", "Sampled", "SamplingParams", "validate"]


def validate(params: SamplingParams, vocab_size: int) -> None:
    """The limits of ``kvserve_model.sampling_limits``, the ones the gateway checks too."""
    try:
        check_sampling(params, vocab_size)
    except SamplingLimitError as e:
        raise InvalidRequest(e.message) from None


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
