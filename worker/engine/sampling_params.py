"""What a request asks of sampling, and what sampling gives back: plain values.

``SamplingParams`` is the gateway's too (``kvserve_model.sampling_params``, one definition for
both); ``Sampled``, ``Accepted`` and ``RowFailed`` are the model path's (``worker.model.sampled``,
which the sampler makes; the engine only reads them). Pure Python (no MLX), so the sequence and
the scheduler can hold them without loading MLX; ``worker.model.sampling`` does the sampling
itself.
"""

from __future__ import annotations

from kvserve_model.sampling_limits import SamplingLimitError, check_sampling
from kvserve_model.sampling_params import SamplingParams
from worker.errors import InvalidRequest
from worker.model.sampled import Accepted, RowFailed, Sampled

__all__ = ["Accepted", "RowFailed", "Sampled", "SamplingParams", "validate"]


def validate(params: SamplingParams, vocab_size: int) -> None:
    """The limits of ``kvserve_model.sampling_limits``, the ones the gateway checks too."""
    try:
        check_sampling(params, vocab_size)
    except SamplingLimitError as e:
        raise InvalidRequest(e.message) from None
