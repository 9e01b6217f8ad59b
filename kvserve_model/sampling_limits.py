"""The limits of a request's sampling parameters, defined once and checked at every edge.

The gateway (its HTTP and gRPC edges) and the worker (its intake) both call
:func:`check_sampling`, so a value is refused with the same message wherever it comes in, and
before it reaches a batch: a value the sampler cannot take (``top_k`` above the vocabulary)
used to fail inside the batched step and end every request batched with it. The bounds of the
proto's integer fields are here too: a value that does not fit the wire is a bad request, not
a conversion error in the gateway (an HTTP 500).

Pure Python, no MLX: the gateway imports it.
"""

from __future__ import annotations

from kvserve_model.sampling_params import SPECULATIVE_VALUES, SamplingParams

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

MAX_TEMPERATURE = 100.0
# 0 is off on the wire (1.0); a penalty divides a positive logit (and multiplies a negative
# one): 1e-300 turned every logit infinite and the request's output into garbage. Below 0.1
# no model samples anything sensible.
MIN_REPETITION_PENALTY = 0.1
MAX_REPETITION_PENALTY = 10.0
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_DRAFT_TOKENS = 16
# OpenAI's bounds.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_PENALTY = 2.0


class SamplingLimitError(ValueError):
    """A sampling parameter outside its limits; ``param`` names it as on the wire."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = f"{param}: {message}"


def _in(param: str, value: float, lo: float, hi: float) -> None:
    # True for NaN and the infinities too: every bound here is finite.
    if not lo <= value <= hi:
        raise SamplingLimitError(param, f"must be in [{lo}, {hi}], got {value}")


def check_sampling(p: SamplingParams, vocab_size: int) -> None:
    """Raises SamplingLimitError for the first parameter out of its limits.

    ``top_k`` may be at most the vocabulary (``top_k == vocab_size`` keeps every token: off);
    0 means off for ``top_k`` and ``min_p``, as on the wire. ``max_tokens`` 0 means "up to the
    context"; whether prompt plus completion fit the context is checked where the prompt is
    known (the gateway's tokenizer, the worker's engine), with a message that says so.
    """
    _in("temperature", p.temperature, 0.0, MAX_TEMPERATURE)
    _in("top_p", p.top_p, 0.0, 1.0)
    _in("top_k", p.top_k, 0, min(vocab_size, INT32_MAX))
    _in("min_p", p.min_p, 0.0, 1.0)
    _in("repetition_penalty", p.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
    _in("logprobs", p.logprobs, 0, MAX_LOGPROBS)
    if p.prompt_logprobs is not None:
        _in("prompt_logprobs", p.prompt_logprobs, 0, MAX_LOGPROBS)
    _in("max_tokens", p.max_tokens, 0, UINT32_MAX)
    if p.seed is not None:
        _in("seed", p.seed, INT64_MIN, INT64_MAX)
    if len(p.stop) > MAX_STOP_STRINGS:
        raise SamplingLimitError("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(p.stop)}")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in p.stop):
        raise SamplingLimitError(
            "stop", f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters"
        )
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise SamplingLimitError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
    if any(not 0 <= t < vocab_size for t in p.stop_token_ids):
        raise SamplingLimitError("stop_token_ids", f"each id must be in [0, {vocab_size})")
    if p.speculative not in SPECULATIVE_VALUES:
        raise SamplingLimitError(
            "speculative", f"must be one of ngram, draft_model or unset, got {p.speculative!r}"
        )
    _in("num_draft_tokens", p.num_draft_tokens, 0, MAX_DRAFT_TOKENS)
    if p.num_draft_tokens and not p.speculates:
        raise SamplingLimitError("num_draft_tokens", "needs speculative (ngram or draft_model)")
    if p.structured_output is not None and p.ignore_eos:
        raise SamplingLimitError(
            "ignore_eos",
            "cannot be set with structured output: the output ends (eos) when "
            "the constraint is complete",
        )
    _in("presence_penalty", p.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
    _in("frequency_penalty", p.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
    if len(p.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise SamplingLimitError(
            "logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(p.logit_bias)}"
        )
    for token, bias in p.logit_bias:
        if not 0 <= token < vocab_size:
            raise SamplingLimitError(
                "logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size})"
            )
        _in("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
