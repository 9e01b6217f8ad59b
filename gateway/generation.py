"""The domain values of one generation, as the gateway sees it: what it asks a worker for and
the chunks that come back. Plain frozen dataclasses: only ``convert`` knows the proto types.
``SamplingParams`` is the workers' own (``kvserve_model.sampling_params``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from gateway.errors import InvalidRequest
from kvserve_model import sampling_limits
from kvserve_model.sampling_params import SamplingParams


class FinishReason(StrEnum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled, or the worker lost the request's lease


def check_sampling(s: SamplingParams, vocab_size: int) -> None:
    """The workers' own limits (``kvserve_model.sampling_limits``, one definition for both), checked
    here so that a value no worker takes is a 400 / INVALID_ARGUMENT naming it, not a failed
    batch on a worker or a proto conversion error (a 500) before dispatch."""
    try:
        sampling_limits.check_sampling(s, vocab_size)
    except sampling_limits.SamplingLimitError as e:
        raise InvalidRequest(e.message, param=e.param) from None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One sequence to generate on one worker (an OpenAI request with n > 1 is several)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    # The cache salt: prefixes never match across namespaces.
    namespace: str = ""


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: str


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    token: str
    top: tuple[TopLogprob, ...] = ()
    rank: int = 0  # in the vocabulary, 1: the most likely; 0: not computed


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Chunk:
    """One step's output for one sequence; the last chunk has ``finish_reason`` and ``usage``."""

    token_ids: tuple[int, ...] = ()
    # Text delta; never splits a UTF-8 character (the worker detokenizes).
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    worker_id: str = ""
    # On a sequence's first chunk, when its sampling asked for prompt_logprobs: each prompt
    # token's after the first.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True)
class Completion:
    """A whole sequence, accumulated from its chunks (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    worker_id: str = ""
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        self.worker_id = chunk.worker_id or self.worker_id
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            self.usage = chunk.usage
