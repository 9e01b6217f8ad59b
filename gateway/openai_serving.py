"""What the two OpenAI endpoints share: model and parameter checks, sampling parameters,
fanning a request out into sequences (prompts x n), and usage accounting.

An OpenAI request may ask for several choices (``n``, or a list of prompts on
/v1/completions). Each choice is one sequence, dispatched and routed on its own: the cache
service's in-flight prefix sharing makes the n samples of one prompt compute it once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from gateway.config import GatewayConfig
from gateway.dispatcher import Dispatcher
from gateway.errors import InvalidRequest, ModelNotFound, RequestAborted, UpstreamError
from gateway.generation import (
    Chunk,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    Usage,
    check_sampling,
)
from gateway.limits import RequestLimits
from gateway.protocol import PromptTokensDetails, SamplingRequest, UsageInfo
from gateway.tokenizer import Tokenizer

INT64_MOD = 2**64


@dataclass(slots=True)
class Served:
    """What an endpoint produced: a JSON body, or SSE events to stream."""

    headers: dict[str, str]
    body: BaseModel | None = None
    events: AsyncIterator[str] | None = None


@dataclass(slots=True)
class UsageTotals:
    """Usage of a request from its sequences' usage: the prompt (and its cached part) counts
    once per prompt, generated tokens once per choice, as OpenAI counts ``n``."""

    n: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    seen: set[int] = field(default_factory=set)

    def add(self, choice: int, usage: Usage) -> None:
        if choice in self.seen:
            return
        self.seen.add(choice)
        if choice % self.n == 0:
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_tokens
        self.completion_tokens += usage.completion_tokens

    def info(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )


def check_finished(chunk: Chunk) -> None:
    """A sequence the worker aborted on its own (shutdown, lost lease) is an error: the
    client did not cancel it, or nobody would be reading."""
    if chunk.finish_reason is FinishReason.ABORT:
        raise RequestAborted("the worker aborted the request; retry it")


async def prime(merged: AsyncGenerator[tuple[int, Chunk], None]) -> tuple[int, Chunk]:
    """The first chunk of a stream, awaited before the HTTP response starts: routing and
    worker errors that come before any token still get a proper status code."""
    try:
        first = await anext(merged, None)
    except BaseException:
        await merged.aclose()
        raise
    if first is None:
        raise UpstreamError("the worker ended the stream without output")
    return first


class OpenAIServing:
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer, dispatcher: Dispatcher):
        self.config = config
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.limits = RequestLimits.of(
            config.max_prompt_chars, config.max_namespace_chars, tokenizer.max_context
        )

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def check_model(self, model: str | None) -> str:
        """The served name; a request without ``model`` gets the one model served."""
        if model is None or model == self.config.model_name:
            return self.config.model_name
        raise ModelNotFound(model)

    def check_common(self, req: SamplingRequest, choices: int) -> None:
        """Refuse, by name, what is accepted by the schema but not implemented."""
        if req.presence_penalty or req.frequency_penalty:
            raise InvalidRequest(
                "presence_penalty and frequency_penalty are not supported; use repetition_penalty",
                param="presence_penalty" if req.presence_penalty else "frequency_penalty",
            )
        if req.logit_bias:
            raise InvalidRequest("logit_bias is not supported", param="logit_bias")
        if req.stream_options is not None and not req.stream:
            raise InvalidRequest(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        if choices > self.config.max_choices:
            raise InvalidRequest(
                f"at most {self.config.max_choices} choices per request "
                f"(prompts x n); this one asks for {choices}",
                param="n",
            )
        if req.stop_token_ids:
            self.tokenizer.check_token_ids(req.stop_token_ids, "stop_token_ids")
        if req.cache_salt:
            self.limits.check_namespace(req.cache_salt)

    def sampling(
        self, req: SamplingRequest, max_tokens: int, logprobs: int, sample: int
    ) -> SamplingParams:
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if any(not s for s in stop):
            raise InvalidRequest("stop strings must not be empty", param="stop")
        seed = None if req.seed is None else (req.seed + sample) % INT64_MOD
        if seed is not None and seed >= 2**63:
            seed -= INT64_MOD
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            min_p=req.min_p or 0.0,
            seed=seed,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            repetition_penalty=req.repetition_penalty or 1.0,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
        )
        check_sampling(params, self.tokenizer.vocab_size)
        return params

    def sequences(
        self,
        request_id: str,
        req: SamplingRequest,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        logprobs: int,
    ) -> list[GenerationRequest]:
        """One sequence per choice; choice ``p * n + j`` is sample ``j`` of prompt ``p``."""
        return [
            GenerationRequest(
                request_id=f"{request_id}-{p * req.n + j}",
                prompt_token_ids=tuple(prompt),
                sampling=self.sampling(req, max_tokens[p], logprobs, j),
                namespace=req.cache_salt or "",
            )
            for p, prompt in enumerate(prompts)
            for j in range(req.n)
        ]

    def open(
        self, sequences: Sequence[GenerationRequest], arrival: float
    ) -> list[AsyncGenerator[Chunk, None]]:
        return [self.dispatcher.generate(s, arrival) for s in sequences]

    @staticmethod
    def created() -> int:
        return int(time.time())
