"""The worker contract's conversions: a chunk survives the gateway's gRPC re-emission, and
what JSON cannot carry (-inf, NaN logprobs) is clamped where it enters the gateway."""

from __future__ import annotations

import math

from gateway.convert import MIN_LOGPROB, chunk_from_pb, chunk_to_pb, finite_logprob
from gateway.generation import Chunk, FinishReason, TokenLogprob, TopLogprob, Usage


def test_a_chunk_round_trips_with_prompt_logprobs_and_ranks() -> None:
    top = (TopLogprob(5, -0.125, "a"), TopLogprob(6, -2.5, "b"))  # exact in float32
    chunk = Chunk(
        token_ids=(5,),
        text="a",
        logprobs=(TokenLogprob(5, -0.125, "a", top),),
        finish_reason=FinishReason.LENGTH,
        usage=Usage(3, 0, 1),
        worker_id="w0",
        prompt_logprobs=(TokenLogprob(7, -3.25, "c", top, rank=9), TokenLogprob(8, -1.0, "d")),
    )
    back = chunk_from_pb(chunk_to_pb(chunk, "r1"))
    assert back == chunk
    plain = Chunk(token_ids=(1,), text="x", worker_id="w0")
    assert chunk_from_pb(chunk_to_pb(plain, "r1")) == plain


def test_non_finite_logprobs_are_clamped() -> None:
    assert finite_logprob(-math.inf) == MIN_LOGPROB == -9999.0
    assert finite_logprob(math.nan) == MIN_LOGPROB
    assert finite_logprob(1e-7) == 0.0 and finite_logprob(-3.5) == -3.5
    top = (TopLogprob(5, -math.inf, "a"),)
    chunk = Chunk(
        token_ids=(5,),
        logprobs=(TokenLogprob(5, -0.5, "a", top),),
        prompt_logprobs=(TokenLogprob(6, math.nan, "b", top, rank=3),),
    )
    back = chunk_from_pb(chunk_to_pb(chunk, "r1"))
    assert back.logprobs[0].top[0].logprob == MIN_LOGPROB
    assert back.prompt_logprobs[0].logprob == MIN_LOGPROB
    assert back.prompt_logprobs[0].top[0].logprob == MIN_LOGPROB
