"""Models with recurrent state (mamba, hybrids) served by the dense per-sequence runner through a
real worker and a real cache service: greedy tokens equal mlx-lm's own dense greedy decoding."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from kvserve_model.tiny_model import TINY_MODEL_NAME
from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.worker import families
from tests.worker_engine.conftest import BS, System, generate, request, started_system
from worker.errors import BatchError, RecurrentStateError
from worker.model.dense_runner import DenseRunner
from worker.model.forward_batch import SeqInput
from worker.model.loader import LoadedModel, load_model
from worker.model.spec import probe

# mamba: every layer recurrent. jamba: recurrent layers and attention layers (KVCache).
FAMILIES = ("mamba", "jamba", "falcon_h1", "recurrent_gemma")
Reference = Callable[[list[int], int], tuple[list[int], list[float]]]


def _loaded(family: str) -> LoadedModel:
    """A tiny seeded ``family`` model with the default model's byte tokenizer (its ids 0..127
    are the tiny vocabulary)."""
    base = load_model(TINY_MODEL_NAME)
    config = {"model_type": family, "max_position_embeddings": 1024}
    return dataclasses.replace(
        base, model=families.build(family), fingerprint=f"test:{family}", config=config
    )


def _reference(family: str) -> Reference:
    """mlx-lm's dense greedy decoding on its own copy of the same seeded model."""
    model = families.build(family)

    def run(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        tokens, logprobs = [], []
        for tok, lp in generate_step(
            mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
        ):
            tokens.append(int(tok))
            logprobs.append(float(lp[int(tok)].item()))
        return tokens, logprobs

    return run


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, families.VOCAB, n).tolist()


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
async def system(family: str) -> AsyncIterator[System]:
    async with started_system(_loaded(family)) as s:
        yield s


async def _idle(system: System) -> None:
    stats = await system.wait_idle()
    # No block is published: the dense runner's blocks hold no K/V.
    assert (stats.indexed_blocks, stats.cached_blocks, stats.cached_tokens) == (0, 0, 0)


def _runner(system: System) -> DenseRunner:
    runner = system.workers[0].engine.executor.runner
    assert isinstance(runner, DenseRunner)
    return runner


def test_probe_tells_recurrent_state_apart(family: str) -> None:
    with pytest.raises(RecurrentStateError, match="ArraysCache"):
        probe(families.build(family))


async def test_concurrent_requests_match_mlx_lm(system: System, family: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="worker.model_setup")
    stub = await system.add_worker(max_step_tokens=64)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("runner: dense per-sequence (recurrent state") for m in messages)
    assert any(m.startswith("self-check passed: dense per-sequence") for m in messages)
    info = await stub.GetInfo(pb.GetInfoRequest())
    assert info.runner == "dense"
    reference = _reference(family)
    # Different lengths, one a long prompt prefilled in several 64-token steps.
    prompts = [prompt(1, 3), prompt(2, 17), prompt(3, 40), prompt(4, 150)]
    lengths = [12, 9, 16, 6]
    outs = await asyncio.gather(
        *(
            generate(stub, request(p, max_tokens=n, logprobs=1))
            for p, n in zip(prompts, lengths, strict=True)
        )
    )
    for p, n, out in zip(prompts, lengths, outs, strict=True):
        tokens, logprobs = reference(p, n)
        assert out["tokens"] == tokens
        assert np.allclose(out["logprobs"], logprobs, atol=1e-4)
        assert out["last"].usage.cached_tokens == 0
    await _idle(system)
    assert system.workers[0].engine.stats.steps > sum(lengths) // 4  # several steps in flight


async def test_cancellation_mid_way_drops_the_sequence(system: System, family: str) -> None:
    stub = await system.add_worker()
    call = stub.Generate(request(prompt(5, 30), max_tokens=500))
    seen = 0
    async for msg in call:
        seen += len(msg.token_ids)
        if seen >= 3:
            break  # cancel mid-stream
    call.cancel()
    await _idle(system)
    # The worker keeps serving, right, and forgets the cancelled sequence's cache.
    p = prompt(6, 21)
    out = await generate(stub, request(p, max_tokens=8))
    assert out["tokens"] == _reference(family)(p, 8)[0]
    await _idle(system)
    assert _runner(system).live_sequences <= 1  # at most the last one, until the next step


async def test_the_same_prompt_twice_recomputes(system: System, family: str) -> None:
    """Prefix caching is off: a repeated prompt is computed again and gives the same tokens."""
    stub = await system.add_worker()
    p = prompt(7, 2 * BS + 5)
    first = await generate(stub, request(p, max_tokens=6))
    second = await generate(stub, request(p, max_tokens=6))
    assert first["tokens"] == second["tokens"] == _reference(family)(p, 6)[0]
    assert second["last"].usage.cached_tokens == 0
    await _idle(system)


async def test_a_small_pool_preempts_and_resumes_from_scratch(system: System, family: str) -> None:
    """Requests that outgrow a small pool are preempted; a resumed one starts a fresh cache
    (prefix reuse is off) from its prompt and output so far, and still ends as mlx-lm does."""
    stub = await system.add_worker(num_blocks=12, reserve_tokens=4, extend_ahead_tokens=2)
    prompts = [prompt(50 + i, 30 + 3 * i) for i in range(6)]
    outs = await asyncio.gather(*(generate(stub, request(p, max_tokens=40)) for p in prompts))
    reference = _reference(family)
    for p, out in zip(prompts, outs, strict=True):
        assert out["tokens"] == reference(p, 40)[0]
    info = await stub.GetInfo(pb.GetInfoRequest())
    assert info.requests_finished == 6
    assert info.preemptions > 0  # decode outgrew the pool, not only admission queueing
    await _idle(system)


def test_a_continuation_the_runner_does_not_hold_is_refused() -> None:
    from worker.model.dense_runner import estimate_state

    model = families.build("mamba")
    runner = DenseRunner(model, estimate_state(model), block_size=BS, num_blocks=8)
    runner.forward([SeqInput([1, 2, 3], [0], 0, 7)])
    with pytest.raises(BatchError, match="has a cache of 3 tokens"):
        runner.forward([SeqInput([4], [0], 5, 7)])
    with pytest.raises(BatchError, match="has no cache"):
        runner.forward([SeqInput([4], [0], 3, 8)])
    # The failed forward dropped key 7's cache: a restart from 0 is fine.
    runner.forward([SeqInput([1, 2, 3], [0], 0, 7)])
    runner.retain({8})
    assert runner.live_sequences == 0


async def test_prompt_logprobs_equal_mlx_lms(system: System, family: str) -> None:
    """Prompt logprobs from the dense runner (every position of each prefill chunk) against
    mlx-lm's forward of the whole prompt on its own copy of the model."""
    stub = await system.add_worker(max_step_tokens=32)  # a 70-token prompt in 3 chunks
    p = prompt(9, 70)
    messages = [m async for m in stub.Generate(request(p, max_tokens=2, prompt_logprobs=1))]
    entries = messages[0].prompt_logprobs
    logits = families.build(family)(mx.array(p)[None]).astype(mx.float32)[0]
    want = np.asarray(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert [e.token_id for e in entries] == p[1:]
    got = [e.logprob for e in entries]
    assert got == pytest.approx([float(want[i - 1, p[i]]) for i in range(1, len(p))], abs=1e-4)
    assert all(len(e.top) == 1 and e.rank >= 1 for e in entries)
    await _idle(system)
