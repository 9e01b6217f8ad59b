"""What the two OpenAI endpoints share: model and parameter checks, sampling parameters,
fanning a request out into sequences (prompts x n). Rendering the responses is
``gateway.rendering``'s.

An OpenAI request may ask for several choices (``n``, or a list of prompts on
/v1/completions). Each choice is one sequence, dispatched and routed on its own: the cache
service's in-flight prefix sharing makes the n samples of one prompt compute it once.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from gateway.config import GatewayConfig
from gateway.dispatcher import Dispatcher
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.generation import Chunk, GenerationRequest, check_sampling
from gateway.limits import RequestLimits
from gateway.protocol import SamplingRequest
from gateway.structured import Constraint
from gateway.tokenizer import Tokenizer
from kvserve_model.grammar_check import GrammarChecker
from kvserve_model.sampling_params import SamplingParams
from kvserve_model.structured_output import StructuredOutput

INT64_MOD = 2**64


@dataclass(slots=True)
class Served:
    """What an endpoint produced: a JSON body, or SSE events to stream."""

    headers: dict[str, str]
    body: BaseModel | None = None
    events: AsyncIterator[str] | None = None


class OpenAIServing:
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer, dispatcher: Dispatcher):
        self.config = config
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.limits = RequestLimits.of(
            config.max_prompt_chars, config.max_namespace_chars, tokenizer.max_context
        )
        self.grammar_check = GrammarChecker()

    async def checked(self, constraint: Constraint | None) -> StructuredOutput | None:
        """A request's constraint once it compiles (checked in a child process, cached);
        InvalidRequest naming the problem otherwise."""
        return None if constraint is None else await constraint.checked(self.grammar_check)

    @property
    def max_context(self) -> int:
        """The most tokens one request can use, prompt and completion: the model's context,
        or less where the largest KV pool among the workers holds fewer
        (``WorkerDirectory.request_tokens``; a worker refuses what its pool could never hold).
        /v1/models advertises it as ``max_model_len``; every request is checked against it
        before dispatch, so a client gets ``context_length_exceeded`` naming the limit."""
        pool = self.dispatcher.directory.request_tokens()
        return min(self.tokenizer.max_context, pool) if pool else self.tokenizer.max_context

    def completion_budget(
        self,
        prompt_tokens: int,
        max_tokens: int | None,
        default: int | None = None,
        prompt_param: str = "prompt",
    ) -> int:
        """``Tokenizer.completion_budget`` against :attr:`max_context`."""
        return self.tokenizer.completion_budget(
            prompt_tokens, max_tokens, default, prompt_param, max_context=self.max_context
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
        if req.prompt_logprobs is not None and req.stream:
            raise InvalidRequest(
                "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
            )

    def sampling(
        self,
        req: SamplingRequest,
        max_tokens: int,
        logprobs: int,
        sample: int,
        structured: StructuredOutput | None = None,
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
            speculative=req.speculative or "",
            num_draft_tokens=req.num_draft_tokens or 0,
            logit_bias=logit_bias(req.logit_bias),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            structured_output=structured,
            prompt_logprobs=req.prompt_logprobs,
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
        structured: StructuredOutput | None = None,
    ) -> list[GenerationRequest]:
        """One sequence per choice; choice ``p * n + j`` is sample ``j`` of prompt ``p``.
        ``structured``: the output's constraint (``gateway.structured``), already checked."""
        return [
            GenerationRequest(
                request_id=f"{request_id}-{p * req.n + j}",
                prompt_token_ids=tuple(prompt),
                sampling=self.sampling(req, max_tokens[p], logprobs, j, structured),
                namespace=req.cache_salt or "",
            )
            for p, prompt in enumerate(prompts)
            for j in range(req.n)
        ]

    @staticmethod
    def noted(served: Served, req: SamplingRequest, structured: StructuredOutput | None) -> Served:
        """``served`` with what the request asked for and did not get said in a header: a
        constrained request does not speculate (its drafts would need the grammar's
        verdict too), so ``x-kvserve-speculative: off (structured output)``."""
        if structured is not None and req.speculative:
            served.headers["x-kvserve-speculative"] = "off (structured output)"
        return served

    def open(
        self, sequences: Sequence[GenerationRequest], arrival: float
    ) -> list[AsyncGenerator[Chunk, None]]:
        return [self.dispatcher.generate(s, arrival) for s in sequences]

    @staticmethod
    def created() -> int:
        return int(time.time())


# A token id as a ``logit_bias`` key: ASCII decimal digits only. ``int`` takes more (" 12",
# "+12", "1_2", other scripts' digits such as "١٢"), each of which would have biased token 12
# for a key that is not "12"; an id is never negative.
TOKEN_ID_KEY = re.compile(r"[0-9]+")


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) as sorted (id, bias) pairs; the
    ids' range and the biases' are ``check_sampling``'s."""
    out = []
    for key, value in (bias or {}).items():
        try:
            if not TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(key)
            token = int(key)
        except ValueError:  # (int's too: past its limit on digits)
            raise InvalidRequest(
                f"logit_bias: key {key!r} is not a token id (decimal digits 0-9)",
                param="logit_bias",
            ) from None
        out.append((token, float(value)))
    return tuple(sorted(out))
