"""Prompt logprobs (vLLM's ``prompt_logprobs``, what ``echo`` with ``logprobs`` returns): each
prompt token's log-probability given the tokens before it, against the dense mlx-lm forward of
the whole prompt, across prefill chunks, with the prompt's prefix already cached, and batched
with other requests."""

from __future__ import annotations

import asyncio
import random

import grpc
import mlx.core as mx
import numpy as np
import pytest

from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.worker_engine.conftest import System, generate, request
from worker.model.loader import LoadedModel

VOCAB = 256


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def dense_logprobs(model: LoadedModel, tokens: list[int]) -> np.ndarray:
    """log-softmax of the dense mlx-lm forward over the whole prompt: row p predicts p + 1."""
    logits = model.model(mx.array(tokens)[None]).astype(mx.float32)[0]
    return np.asarray(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


async def prompt_logprobs(
    stub, p: list[int], top: int, **sampling
) -> tuple[list, pb.GenerateResponse]:
    """The first message's prompt logprobs (no later message has any) and the last message."""
    messages = [m async for m in stub.Generate(request(p, 4, prompt_logprobs=top, **sampling))]
    assert all(not m.prompt_logprobs for m in messages[1:])
    return list(messages[0].prompt_logprobs), messages[-1]


def check(entries: list, p: list[int], want: np.ndarray, top: int) -> None:
    assert [e.token_id for e in entries] == p[1:]
    for pos, e in enumerate(entries, start=1):
        row = want[pos - 1]
        assert e.logprob == pytest.approx(float(row[p[pos]]), abs=1e-4), pos
        ranks = {int((row > row[p[pos]] + 1e-4).sum()) + 1, int((row >= row[p[pos]] - 1e-4).sum())}
        assert min(ranks) <= e.rank <= max(ranks), pos  # ties within float noise either way
        assert len(e.top) == top
        if top:
            assert e.top[0].logprob == pytest.approx(float(row.max()), abs=1e-4)
            assert [t.logprob for t in e.top] == sorted((t.logprob for t in e.top), reverse=True)
            assert {t.token_id for t in e.top} <= set(np.argsort(-row)[: top + 2].tolist())


async def test_prompt_logprobs_equal_the_dense_forward(system: System) -> None:
    stub = await system.add_worker()  # max_step_tokens 64: a 150-token prompt is 3 chunks
    model = system.model
    for seed, n, top in [(1, 150, 3), (2, 17, 0), (3, 2, 1), (6, 65, 20)]:
        p = prompt(seed, n)
        entries, _ = await prompt_logprobs(stub, p, top)
        check(entries, p, dense_logprobs(model, p), top)
    await system.wait_idle()


async def test_a_cached_prefix_is_computed_again(system: System) -> None:
    """The prompt's first blocks are in the pool (an earlier request): a request with prompt
    logprobs still has every position's, and the one without them still hits."""
    stub = await system.add_worker()
    p = prompt(4, 100)
    await generate(stub, request(p, max_tokens=2))
    entries, last = await prompt_logprobs(stub, p, 2)
    check(entries, p, dense_logprobs(system.model, p), 2)
    assert last.usage.cached_tokens == 0
    plain = await generate(stub, request(p, max_tokens=2))
    assert plain["last"].usage.cached_tokens > 0
    await system.wait_idle()


async def test_batched_with_other_requests_and_sampled(system: System) -> None:
    """Alongside decoding requests, with sampling, bias and a grammar on the generated tokens:
    prompt logprobs are the raw model's, and the others' outputs are unchanged."""
    stub = await system.add_worker()
    p = prompt(5, 90)
    others = [prompt(10 + i, 30) for i in range(3)]
    alone = [await generate(stub, request(o, max_tokens=16)) for o in others]
    runs = [generate(stub, request(o, max_tokens=16)) for o in others]
    asked = prompt_logprobs(
        stub, p, 2, temperature=1.0, seed=3, logit_bias={7: 50.0}, ignore_eos=False,
        structured_output=pb.StructuredOutput(regex="[ab]+"),
    )  # fmt: skip
    results = await asyncio.gather(asked, *runs)
    (entries, _), together = results[0], results[1:]
    check(entries, p, dense_logprobs(system.model, p), 2)
    assert [t["tokens"] for t in together] == [a["tokens"] for a in alone]
    await system.wait_idle()


async def test_out_of_range_is_invalid_argument(system: System) -> None:
    stub = await system.add_worker()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, request([1, 2, 3], prompt_logprobs=21))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in (e.value.details() or "")
