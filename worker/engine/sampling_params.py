"""What a request asks of sampling, and what sampling gives back: plain values.

Pure Python (no MLX), so the sequence and the scheduler can hold them without loading MLX;
``worker.model.sampling`` does the sampling itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve_model.sampling_limits import SamplingLimitError, check_sampling
from worker.errors import InvalidRequest


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
        """The limits of ``kvserve_model.sampling_limits``, the ones the gateway checks too."""
        try:
            check_sampling(self, vocab_size)
        except SamplingLimitError as e:
            raise InvalidRequest(e.message) from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RowFailed:
    """A row whose sampling raised: its request ends (INTERNAL), the batch goes on."""

    error: Exception
