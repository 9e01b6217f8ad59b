"""Speculative decoding end to end: a real cache service and real workers over gRPC.

Greedy output with drafts (prompt lookup, a draft model that always agrees, one that rarely
does) must be the dense mlx-lm path's, token for token, whatever is accepted; the block
accounting is checked after every test (the system fixture).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import mlx.core as mx
import pytest

from kvserve_model.tiny_model import ensure_tiny_model
from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.worker_engine.conftest import System, generate, request
from tests.worker_engine.test_engine import prompt

NGRAM = pb.SPECULATIVE_NGRAM
DRAFT = pb.SPECULATIVE_DRAFT_MODEL


def repetitive(seed: int, period: int, n: int) -> list[int]:
    """A prompt that repeats a random phrase: prompt lookup has something to find."""
    phrase = prompt(seed, period)
    return (phrase * (n // period + 1))[:n]


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> Path:
    """The default model's tokenizer with other weights: a draft model that rarely agrees."""
    src = ensure_tiny_model()
    dst = tmp_path_factory.mktemp("draft") / "other-tiny-llama"
    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    shaken = {
        name: w + 0.5 * mx.random.normal(w.shape, key=mx.random.key(7 + i)).astype(w.dtype)
        for i, (name, w) in enumerate(sorted(weights.items()))
    }
    mx.save_safetensors(str(dst / "model.safetensors"), shaken)
    return dst


async def info(stub) -> pb.WorkerInfo:
    return await stub.GetInfo(pb.GetInfoRequest())


async def test_prompt_lookup_gives_the_greedy_tokens(system: System, reference) -> None:
    stub = await system.add_worker()
    cases = [repetitive(1, 7, 60), repetitive(2, 13, 45), prompt(3, 30)]
    for p in cases:
        for k in (1, 4, 16):
            got = await generate(
                stub,
                request(p, max_tokens=40, logprobs=1, speculative=NGRAM, num_draft_tokens=k),
            )
            want_tokens, want_logprobs = reference(p, 40)
            assert got["tokens"] == want_tokens, (len(p), k)
            assert got["logprobs"] == pytest.approx(want_logprobs, abs=1e-4)
            assert got["last"].usage.completion_tokens == 40
    stats = await info(stub)
    assert stats.draft_tokens > 0  # the repeated phrases were drafted from
    assert 0 <= stats.accepted_draft_tokens <= stats.draft_tokens
    assert stats.generated_tokens == 40 * len(cases) * 3
    await system.wait_idle()


async def test_a_draft_model_that_always_agrees(system: System, reference) -> None:
    """The served model as its own draft: every draft is accepted, so each step keeps k + 1
    tokens and stops and limits land inside a verified run of drafts."""
    stub = await system.add_worker(draft_model=str(ensure_tiny_model()))
    assert (await info(stub)).draft_model
    p = prompt(4, 37)
    want = reference(p, 45)[0]
    got = await generate(stub, request(p, max_tokens=45, speculative=DRAFT, num_draft_tokens=4))
    assert got["tokens"] == want
    stats = await info(stub)
    assert stats.draft_tokens > 0 and stats.accepted_draft_tokens == stats.draft_tokens
    # max_tokens inside a run of drafts: exactly max_tokens, nothing verified past it.
    got = await generate(stub, request(p, max_tokens=7, speculative=DRAFT, num_draft_tokens=5))
    assert got["tokens"] == want[:7]
    # A stop token that the drafts carry: the output ends at it.
    stop = want[10]
    end = want.index(stop)
    before = (await info(stub)).generated_tokens
    got = await generate(
        stub,
        request(p, max_tokens=45, speculative=DRAFT, num_draft_tokens=8, stop_token_ids=[stop]),
    )
    assert got["tokens"] == want[: end + 1]
    assert got["last"].finish_reason == pb.FINISH_REASON_STOP
    # Verified tokens after the stop are not counted as generated.
    assert (await info(stub)).generated_tokens - before == end + 1
    await system.wait_idle()


async def test_a_draft_model_that_disagrees(system: System, reference, other_model) -> None:
    stub = await system.add_worker(draft_model=str(other_model))
    for seed in (5, 6):
        p = prompt(seed, 50)
        got = await generate(stub, request(p, max_tokens=30, speculative=DRAFT))
        assert got["tokens"] == reference(p, 30)[0]
    stats = await info(stub)
    assert stats.accepted_draft_tokens < stats.draft_tokens
    await system.wait_idle()


async def test_mixed_batch_under_preemption(system: System, reference, other_model) -> None:
    """Speculating and plain requests in one batch, in a pool small enough to preempt: all
    give the greedy tokens, and every block comes back. Each request grows by several blocks
    after its admission (prompt + 32 reserved tokens): the running ones outgrow the pool."""
    stub = await system.add_worker(num_blocks=24, draft_model=str(other_model))
    kinds = [{}, {"speculative": NGRAM}, {"speculative": DRAFT, "num_draft_tokens": 3}]
    prompts = [repetitive(10 + i, 5 + i, 40 + 3 * i) for i in range(6)]
    results = await asyncio.gather(
        *(generate(stub, request(p, max_tokens=96, **kinds[i % 3])) for i, p in enumerate(prompts))
    )
    for p, got in zip(prompts, results, strict=True):
        assert got["tokens"] == reference(p, 96)[0]
    assert (await info(stub)).preemptions > 0
    await system.wait_idle()


async def test_penalties_logprobs_and_seeds(system: System) -> None:
    """Processors see the drafts as history: a repetition penalty gives the same greedy tokens
    and logprobs with and without speculation. Seeded sampling repeats itself."""
    stub = await system.add_worker()
    p = repetitive(20, 6, 48)
    plain = await generate(stub, request(p, max_tokens=32, repetition_penalty=1.3, logprobs=2))
    spec = await generate(
        stub,
        request(p, max_tokens=32, repetition_penalty=1.3, logprobs=2, speculative=NGRAM),
    )
    assert spec["tokens"] == plain["tokens"]
    assert spec["logprobs"] == pytest.approx(plain["logprobs"], abs=1e-4)
    sampled = [
        await generate(stub, request(p, max_tokens=24, temperature=0.8, seed=11, speculative=NGRAM))
        for _ in range(2)
    ]
    assert sampled[0]["tokens"] == sampled[1]["tokens"]
    assert len(sampled[0]["tokens"]) == 24
    await system.wait_idle()


@pytest.mark.parametrize(
    ("sampling", "needle"),
    [
        ({"speculative": DRAFT}, "no draft model"),
        ({"speculative": NGRAM, "num_draft_tokens": 17}, "num_draft_tokens"),
        ({"num_draft_tokens": 4}, "needs speculative"),
        ({"speculative": 9}, "speculative"),
    ],
)
async def test_bad_speculation_is_invalid_argument(system: System, sampling, needle) -> None:
    stub = await system.add_worker()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, request(prompt(30, 10), max_tokens=4, **sampling))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (e.value.details() or "")
    # Nothing was held, and the worker serves on.
    assert len((await generate(stub, request(prompt(31, 8), max_tokens=4)))["tokens"]) == 4
    await system.wait_idle()
