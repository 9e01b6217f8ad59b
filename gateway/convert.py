"""Proto <-> domain conversions for the worker contract, each written once.

Only this module, the worker client and the gRPC servicer import ``worker_pb2``. Reading a
``SamplingParams`` message is ``kvserve_model.sampling_params``'s, shared with the workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.generation import (
    Chunk,
    FinishReason,
    GenerationRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from kvserve_model.sampling_params import SPECULATIVE_VALUES, SamplingParams
from kvserve_model.structured_output import StructuredOutput
from kvserve_proto.worker.v1 import worker_pb2 as pb

_FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}

# What a log-probability JSON cannot carry is sent as this, vLLM's choice: a token the grammar
# (or a -100 bias) rules out has -inf, and a top_logprobs list longer than the tokens a
# grammar allows holds some (JSON has no infinities: the response failed to serialize).
MIN_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    """``value`` within [MIN_LOGPROB, 0]: -inf and NaN (a model that produced NaN logits) are
    MIN_LOGPROB, a rounding above 0 is 0."""
    if not value >= MIN_LOGPROB:
        return MIN_LOGPROB
    return min(value, 0.0)


def sampling_to_pb(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        max_tokens=s.max_tokens,
        stop=s.stop,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        repetition_penalty=s.repetition_penalty,
        include_stop_str_in_output=s.include_stop_str_in_output,
        skip_special_tokens=s.skip_special_tokens,
        speculative=pb.Speculative.ValueType(SPECULATIVE_VALUES[s.speculative]),
        num_draft_tokens=s.num_draft_tokens,
        logit_bias=dict(s.logit_bias),
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
    )
    if s.seed is not None:
        msg.seed = s.seed
    if s.structured_output is not None:
        msg.structured_output.CopyFrom(structured_to_pb(s.structured_output))
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    return msg


def structured_to_pb(so: StructuredOutput) -> pb.StructuredOutput:
    if so.kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(values=so.choices))
    if so.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    msg = pb.StructuredOutput()
    setattr(msg, so.kind, so.spec)  # json_schema, regex or grammar: a string field each
    return msg


def request_to_pb(r: GenerationRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=r.request_id,
        prompt_token_ids=pb.TokenIds(ids=r.prompt_token_ids),
        sampling=sampling_to_pb(r.sampling),
        namespace=r.namespace,
    )


def chunk_from_pb(msg: pb.GenerateResponse) -> Chunk:
    # Once per token per stream: the common message (no logprobs, no usage) takes no
    # generator and no nested message reads.
    logprobs = msg.logprobs
    prompt_logprobs = msg.prompt_logprobs
    return Chunk(
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        logprobs=_logprobs_from_pb(logprobs) if logprobs else (),
        prompt_logprobs=_logprobs_from_pb(prompt_logprobs) if prompt_logprobs else (),
        finish_reason=_FINISH_FROM_PB.get(msg.finish_reason) if msg.finish_reason else None,
        usage=(
            Usage(msg.usage.prompt_tokens, msg.usage.cached_tokens, msg.usage.completion_tokens)
            if msg.HasField("usage")
            else None
        ),
        worker_id=msg.worker_id,
    )


def _logprobs_from_pb(lps: Any) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            lp.token_id,
            finite_logprob(lp.logprob),
            lp.token,
            tuple(TopLogprob(t.token_id, finite_logprob(t.logprob), t.token) for t in lp.top),
            lp.rank,
        )
        for lp in lps
    )


def _logprobs_to_pb(lps: Sequence[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            token=lp.token,
            top=[
                pb.TopLogprob(token_id=t.token_id, logprob=t.logprob, token=t.token) for t in lp.top
            ],
            rank=lp.rank,
        )
        for lp in lps
    ]


def chunk_to_pb(c: Chunk, request_id: str) -> pb.GenerateResponse:
    once_per_token = not c.logprobs and not c.prompt_logprobs
    if once_per_token and c.usage is None and c.finish_reason is None:
        return pb.GenerateResponse(
            request_id=request_id, token_ids=c.token_ids, text=c.text, worker_id=c.worker_id
        )
    msg = pb.GenerateResponse(
        request_id=request_id,
        token_ids=c.token_ids,
        text=c.text,
        logprobs=_logprobs_to_pb(c.logprobs),
        prompt_logprobs=_logprobs_to_pb(c.prompt_logprobs),
        finish_reason=_FINISH_TO_PB[c.finish_reason],
        worker_id=c.worker_id,
    )
    if c.usage is not None:
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=c.usage.prompt_tokens,
                cached_tokens=c.usage.cached_tokens,
                completion_tokens=c.usage.completion_tokens,
            )
        )
    return msg
