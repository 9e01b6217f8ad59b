"""The worker engine end to end: a real cache service and real workers over gRPC, outputs
compared with mlx-lm's dense path, block accounting checked after every test."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from kvcache_service.leases import AcquireRequest, Reuse
from kvcache_service.tokens import pack
from kvserve_proto.kvcache.v1 import kvcache_pb2 as kpb
from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.worker.helpers import route_as_cuda
from tests.worker_engine.conftest import AUTH, BS, System, generate, request, started_system
from worker.engine import final_hold, lookahead
from worker.engine.executor import ModelExecutor, SampleRow, _Job
from worker.engine.sampling_params import SamplingParams
from worker.model.forward_batch import SeqInput
from worker.model.runner import ModelRunner
from worker.model.sampling import RowSampler
from worker.servicer import WorkerServicer

VOCAB = 256  # the byte range of the embedded model's vocabulary


@pytest.fixture(params=["plain", "lookahead", "compiled"])
async def system(model, request, monkeypatch) -> AsyncIterator[System]:
    """Every test here runs three times: as is; with the executor's decode lookahead (greedy
    decode steps start the next one's forward before streaming; off on a CPU by default); and
    with attention routed as on an NVIDIA GPU, the block-table kernel's computation standing
    in as lazy MLX ops, so that decodes run compiled (``worker.model.compiled_decode``:
    bucketed shapes, padding rows, the warm-up's traces), the lookahead as a GPU's default
    (auto: its steps measured, and on here once they are, the CPU's forward being all wait).
    None may change a token, a logprob or a block."""
    if request.param == "compiled":
        route_as_cuda(monkeypatch)
    async with started_system(model) as s:
        s.lookahead = {"plain": "off", "lookahead": "on", "compiled": "auto"}[request.param]
        yield s


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


async def test_greedy_output_equals_mlx_lm(system: System, reference) -> None:
    stub = await system.add_worker()
    runner = system.workers[0].engine.executor.runner
    compiled = runner.compiled_decode
    assert (compiled is not None) == (runner.attention.name == "cuda")  # the GPU routing compiles
    traced = compiled.traces if compiled is not None else 0
    for seed, n in [(1, 5), (2, 40), (3, 100)]:  # one block, unaligned, several chunks
        p = prompt(seed, n)
        got = await generate(stub, request(p, max_tokens=32, logprobs=1))
        want_tokens, want_logprobs = reference(p, 32)
        assert got["tokens"] == want_tokens
        assert got["logprobs"] == pytest.approx(want_logprobs, abs=1e-4)
        last = got["last"]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (n, 32)
    if compiled is not None:  # decodes ran compiled, in shapes the warm-up traced
        assert compiled.calls >= 3 * 31 and compiled.traces == traced


async def test_concurrent_requests_share_a_prefix(system: System, reference) -> None:
    stub = await system.add_worker()
    shared = prompt(10, 3 * BS)
    a, b = shared + prompt(11, 7), shared + prompt(12, 9)
    first_call = stub.Generate(request(a, max_tokens=24))
    first_tokens = list((await first_call.read()).token_ids)  # a is prefilled, now decoding
    second = await generate(stub, request(b, max_tokens=24))
    while (msg := await first_call.read()) is not grpc.aio.EOF:
        first_tokens += msg.token_ids
        if msg.finish_reason:
            assert msg.usage.cached_tokens == 0
    assert second["last"].usage.cached_tokens >= 3 * BS
    assert first_tokens == reference(a, 24)[0]
    assert second["tokens"] == reference(b, 24)[0]


async def test_multi_turn_follow_up_reuses_the_history(system: System, reference) -> None:
    stub = await system.add_worker()
    turn1 = prompt(20, 50)
    out1 = await generate(stub, request(turn1, max_tokens=20))
    history = turn1 + out1["tokens"]
    turn2 = history + prompt(21, 10)
    out2 = await generate(stub, request(turn2, max_tokens=16))
    # Everything turn 1 wrote is cached: prompt and output but the last sampled token, its
    # partial last block included (indexed as a tail, copied on write by turn 2).
    assert (len(history) - 1) % BS, "the test needs a history that ends inside a block"
    assert out2["last"].usage.cached_tokens == len(history) - 1
    assert out2["tokens"] == reference(turn2, 16)[0]


async def test_cancellation_releases_the_lease(system: System) -> None:
    stub = await system.add_worker()
    call = stub.Generate(request(prompt(30, 40), max_tokens=2000))
    async for _ in call:
        break  # got the first token: cancel mid-stream
    call.cancel()
    await system.wait_idle()
    # The worker keeps serving.
    assert len((await generate(stub, request(prompt(31, 8), max_tokens=4)))["tokens"]) == 4


async def test_a_burst_computes_a_shared_prefix_once(system: System, reference) -> None:
    stub = await system.add_worker(max_step_tokens=256)
    shared = prompt(40, 4 * BS)
    prompts = [shared + prompt(41 + i, 5 + i) for i in range(8)]
    outs = await asyncio.gather(*(generate(stub, request(p, max_tokens=8)) for p in prompts))
    info = await stub.GetInfo(pb.GetInfoRequest())
    suffixes = sum(len(p) - len(shared) for p in prompts)
    assert info.prefilled_tokens == len(shared) + suffixes
    for p, out in zip(prompts, outs, strict=True):
        assert out["tokens"] == reference(p, 8)[0]
    assert sum(o["last"].usage.cached_tokens for o in outs) == 7 * len(shared)


async def test_a_small_pool_queues_and_preempts(system: System, reference) -> None:
    # 12 blocks of 16 tokens for 6 requests that each grow to 5 blocks: at most two fit.
    stub = await system.add_worker(num_blocks=12, reserve_tokens=4, extend_ahead_tokens=2)
    prompts = [prompt(50 + i, 30 + 3 * i) for i in range(6)]
    outs = await asyncio.gather(*(generate(stub, request(p, max_tokens=40)) for p in prompts))
    for p, out in zip(prompts, outs, strict=True):
        assert out["tokens"] == reference(p, 40)[0]
    info = await stub.GetInfo(pb.GetInfoRequest())
    assert info.requests_finished == 6
    assert info.preemptions > 0  # decode outgrew the pool, not only admission queueing
    stats = await system.stats()
    assert stats.exhausted > 0 and stats.referenced_blocks == 0


async def test_sampling_is_reproducible_with_a_seed(system: System) -> None:
    stub = await system.add_worker()
    p = prompt(60, 20)
    req = request(p, max_tokens=24, temperature=1.5, top_k=50, top_p=0.95, seed=7)
    one, two = await asyncio.gather(generate(stub, req), generate(stub, req))
    assert one["tokens"] == two["tokens"]
    other = await generate(stub, request(p, max_tokens=24, temperature=1.5, seed=8))
    assert other["tokens"] != one["tokens"]


async def test_stop_strings_and_stop_tokens(system: System, reference) -> None:
    stub = await system.add_worker()
    p = prompt(70, 30)
    full = await generate(stub, request(p, max_tokens=24))
    stop_token = full["tokens"][5]
    first = full["tokens"].index(stop_token)
    cut = await generate(stub, request(p, max_tokens=24, stop_token_ids=[stop_token]))
    assert cut["tokens"] == full["tokens"][: first + 1]
    assert cut["last"].finish_reason == pb.FINISH_REASON_STOP
    # The stop token is in the tokens, its text is not, unless asked for (vLLM's reading).
    before = await generate(stub, request(p, max_tokens=first))
    upto = await generate(stub, request(p, max_tokens=first + 1))
    assert cut["text"] == before["text"]
    kept = request(p, max_tokens=24, stop_token_ids=[stop_token], include_stop_str_in_output=True)
    assert (await generate(stub, kept))["text"] == upto["text"]
    text = full["text"]
    if len(text.strip()) >= 4:
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        out = await generate(stub, request(p, max_tokens=24, stop=[stop]))
        assert out["text"] == text[: text.index(stop)]
        assert out["last"].finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4)), "no prompt"),
        (request([], max_tokens=4), "empty"),
        (request([1, 2, 999999]), "token ids"),
        (request([1, -5]), "token ids"),
        (request([1, 2], max_tokens=100_000), "context"),
        (request([1, 2], temperature=-1.0), "temperature"),
        (request([1, 2], top_p=1.5), "top_p"),
        (request([1, 2], logprobs=500), "logprobs"),
        (request([1, 2], stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
async def test_bad_input_is_invalid_argument(system: System, req, needle: str) -> None:
    stub = await system.add_worker(num_blocks=64)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (info.value.details() or "")
    stats = await system.stats()
    assert (stats.live_leases, stats.referenced_blocks, stats.acquires) == (0, 0, 0)


async def test_text_prompt_and_info(system: System) -> None:
    stub = await system.add_worker()
    req = pb.GenerateRequest(
        prompt_text="Hello, caché!", sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True)
    )
    out = await generate(stub, req)
    tokenizer = system.model.tokenizer
    assert out["last"].usage.prompt_tokens == len(tokenizer.encode("Hello, caché!"))
    special = system.workers[0].engine.intake.special_ids
    whole = tokenizer.decode([t for t in out["tokens"] if t not in special])
    # the whole decode, but for an unfinished UTF-8 character at the end (left out, as vLLM)
    assert out["text"] == whole or (whole.endswith("\ufffd") and out["text"] == whole[:-1])
    info = await stub.GetInfo(pb.GetInfoRequest())
    assert info.model == "kvserve-tiny-llama" and info.num_blocks == 256
    assert info.block_size == BS and info.generated_tokens == 6


async def test_a_failing_admission_or_heartbeat_recovers(model, reference) -> None:
    """An unexpected exception (a bug, not a cache service answer) in one admission pass or
    one heartbeat is logged and retried: neither loop may stop for good, silently."""
    async with started_system(model, lease_ttl_s=2.0) as system:  # heartbeats every 0.5 s
        stub = await system.add_worker(warmup=False)
        engine = system.workers[0].engine
        faults = {"acquire": 1, "heartbeat": 2}
        calls = {"heartbeat": 0}

        def failing(name: str):
            real = getattr(engine.leases.client, name)

            async def call(*args, **kwargs):
                calls[name] = calls.get(name, 0) + 1
                if faults[name]:
                    faults[name] -= 1
                    raise RuntimeError(f"injected {name} bug")
                return await real(*args, **kwargs)

            return call

        engine.leases.client.acquire = failing("acquire")  # type: ignore[method-assign]
        engine.leases.client.heartbeat = failing("heartbeat")  # type: ignore[method-assign]
        p = prompt(40, 50)
        got = await generate(stub, request(p, max_tokens=8))
        assert got["tokens"] == reference(p, 8)[0]
        assert faults["acquire"] == 0
        incarnation = engine.leases.client.incarnation
        while calls["heartbeat"] < 4:  # two failed beats, then two that went through
            await asyncio.sleep(0.1)
        assert engine.leases.client.incarnation == incarnation  # the pool never lapsed
        assert not any(t.done() for t in [engine._task, *engine.leases._tasks])
        await system.check()


async def test_a_lagging_stream_gets_its_tokens_coalesced(system: System, reference) -> None:
    """A reader slower than the engine gets every queued token in one message: the same
    tokens, text and logprobs, fewer messages. Driven through the servicer's own Generate with
    the worker's real engine, read only once the request has finished."""
    await system.add_worker()
    engine = system.workers[0].engine
    servicer = WorkerServicer(engine, "w0", "m")
    p = prompt(90, 20)
    stream = servicer.Generate(request(p, max_tokens=24, logprobs=1), None)  # type: ignore[arg-type]
    first = await anext(stream)  # the request is in; now let the engine run ahead of us
    for _ in range(200):  # finished, and its last event sent (after the release's answer)
        if engine.stats.requests_finished and not engine.final.held:
            break
        await asyncio.sleep(0.01)
    rest = [msg async for msg in stream]
    tokens = [*first.token_ids, *(t for m in rest for t in m.token_ids)]
    assert tokens == reference(p, 24)[0]
    assert len(rest) == 1 and rest[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(first.logprobs) + len(rest[0].logprobs) == 24
    assert rest[0].usage.completion_tokens == 24
    await system.wait_idle()


async def test_a_deferral_on_a_lease_the_worker_never_hears_end_is_retried(system: System) -> None:
    """A request deferred on another lease filling its prefix asks again once this worker
    publishes something. The lease here is none of the worker's (its end, like a release that
    failed and expired at the service, is never heard of): the request still starts, after
    DEFER_RETRY_S, and does not wait forever."""
    stub = await system.add_worker()
    worker = system.workers[0]
    p = prompt(95, 3 * BS)
    grant, _ = system.authority.acquire(
        AcquireRequest(
            "w0",
            worker.engine.leases.client.incarnation,
            "",
            pack(p[: 2 * BS], "prompt"),
            reuse=Reuse.SHARE,
        )
    )
    call = asyncio.create_task(generate(stub, request(p, max_tokens=4)))
    for _ in range(100):
        if any(s.deferred_at is not None for s in worker.engine.scheduler.waiting):
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the request was not deferred on the foreign lease")
    system.authority.release("w0", worker.engine.leases.client.incarnation, grant.lease_id)
    got = await asyncio.wait_for(call, timeout=10)
    assert len(got["tokens"]) == 4
    await system.wait_idle()


async def test_stream_interval_sends_fewer_larger_messages(system: System, reference) -> None:
    stub = await system.add_worker(stream_interval=4)
    p = prompt(96, 30)
    sizes, tokens = [], []
    async for msg in stub.Generate(request(p, max_tokens=23, logprobs=1)):
        sizes.append(len(msg.token_ids))
        tokens += msg.token_ids
        last = msg
    assert tokens == reference(p, 23)[0]
    assert sizes[0] == 1  # the first token at once
    assert all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 23 and len(sizes) <= 7
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and len(last.logprobs) == sizes[-1]
    await system.wait_idle()


def slowed_releases(system: System, delay_s: float) -> None:
    """The first worker's ReleaseLeases answered ``delay_s`` late (a busy cache service)."""
    client = system.workers[0].engine.leases.client
    real = client.release

    async def release(items):
        await asyncio.sleep(delay_s)
        return await real(items)

    client.release = release  # type: ignore[method-assign]


async def lookup(system: System, tokens: list[int]) -> int:
    resp = await system.admin.Lookup(
        kpb.LookupRequest(pool_id="w0", prompt_token_ids=tokens), metadata=AUTH
    )
    return resp.pools[0].cached_tokens


async def test_a_finished_request_is_cached_when_its_stream_ends(system: System) -> None:
    """Read-your-writes: the last message goes out once the cache service has indexed the
    request's KV, so a client's next turn sent the moment this one ends reuses all of it,
    even when the release is answered late."""
    stub = await system.add_worker()
    slowed_releases(system, 0.3)
    turn1 = prompt(60, 50)
    out = await generate(stub, request(turn1, max_tokens=20))
    history = turn1 + out["tokens"]
    assert await lookup(system, history) == len(history) - 1  # all but the last sampled token
    await system.wait_idle()


async def test_a_release_that_hangs_delays_the_last_message_boundedly(
    system: System, reference, monkeypatch
) -> None:
    """A cache service that does not answer the release holds no client for longer than
    FINAL_HOLD_MAX_S: the last message comes, complete, and the request ends."""
    monkeypatch.setattr(final_hold, "FINAL_HOLD_MAX_S", 0.2)
    stub = await system.add_worker()
    slowed_releases(system, 3.0)
    p = prompt(61, 40)
    started = time.monotonic()
    out = await generate(stub, request(p, max_tokens=8))
    took = time.monotonic() - started
    assert out["tokens"] == reference(p, 8)[0]
    assert out["last"].finish_reason == pb.FINISH_REASON_LENGTH
    assert took < 2.0  # the 0.2 s bound, not the 3 s release
    await system.wait_idle()  # the late release still lands


async def test_the_lookahead_is_used_and_changes_nothing(model, reference) -> None:
    """With the decode lookahead: greedy streams that end at different steps (by max_tokens,
    foreseen; by a stop token, not), alongside a sampled one (no lookahead while it runs),
    give mlx-lm's tokens, the lookahead's forwards are taken where the step repeats, and the
    pool's accounting holds."""
    async with started_system(model) as system:
        system.lookahead = "on"
        stub = await system.add_worker()
        executor = system.workers[0].engine.executor
        prompts = [prompt(80 + i, 20 + 7 * i) for i in range(4)]
        lengths = [12, 40, 25, 33]
        full = reference(prompts[3], 33)[0]
        stop = full[9]
        reqs = [request(p, max_tokens=n) for p, n in zip(prompts[:3], lengths, strict=False)]
        reqs.append(request(prompts[3], max_tokens=33, stop_token_ids=[stop]))
        outs = await asyncio.gather(*(generate(stub, r) for r in reqs))
        for p, n, out in zip(prompts[:3], lengths, outs, strict=False):
            assert out["tokens"] == reference(p, n)[0]
        assert outs[3]["tokens"] == full[: full.index(stop) + 1]
        assert executor.lookahead_hits > 10  # misses: timing decides; see the test below
        hits = executor.lookahead_hits
        sampled = request(prompt(90, 30), max_tokens=20, temperature=1.0, seed=3)
        greedy = prompt(91, 30)
        out, _ = await asyncio.gather(
            generate(stub, request(greedy, max_tokens=20)), generate(stub, sampled)
        )
        assert out["tokens"] == reference(greedy, 20)[0]
        assert executor.lookahead_hits - hits < 20  # only once the sampled one has ended
        await system.wait_idle()


async def test_the_pool_registers_the_bytes_a_block_holds(system: System) -> None:
    """GetStats (and so the CLI and the dashboard) can say the pool's size in bytes: the worker
    registers what one block of its pool holds."""
    await system.add_worker()
    runner = system.workers[0].engine.executor.runner
    stats = await system.stats()
    assert stats.bytes_per_block == runner.pool.bytes_per_block > 0


async def test_a_lookahead_for_another_step_is_discarded(model) -> None:
    """The executor on its own, step by step: a greedy decode step that expects to repeat
    starts the next one; when the next step is another (a sequence ended: a stop token the
    scheduler could not foresee) its logits are discarded and the step computed anew, and
    every token equals an executor's without the lookahead; when it is that step, it is
    taken."""
    ahead = ModelExecutor(lambda: ModelRunner.create(model.model, block_size=8, num_blocks=64))
    plain = ModelExecutor(lambda: ModelRunner.create(model.model, block_size=8, num_blocks=64))
    ahead.lookahead = lookahead.Policy("on")
    prompts = [prompt(100 + i, 9 + 4 * i) for i in range(3)]
    tables = [list(range(10 * i, 10 * i + 10)) for i in range(3)]
    greedy = RowSampler(SamplingParams())

    async def step(executor, inputs, same_next):
        samples = [SampleRow(i, greedy, [], 0) for i in range(len(inputs))]
        sampled, _ = await executor._submit(_Job(inputs, [], samples, same_next=same_next))
        return [s.token for s in sampled]

    def prefill(i):
        return SeqInput(prompts[i], tables[i], 0, i)

    last = {}
    for ex in (ahead, plain):
        last[ex] = await step(ex, [prefill(i) for i in range(3)], False)
    positions = [len(p) for p in prompts]
    live = [0, 1, 2]
    for n in range(6):
        if n == 2:
            live = [0, 2]  # sequence 1 ended after the step that expected it again
        got = {}
        for ex in (ahead, plain):
            inputs = [SeqInput([last[ex][i]], tables[i], positions[i], i) for i in live]
            tokens = await step(ex, inputs, True)
            got[ex] = dict(zip(live, tokens, strict=True))
        assert got[ahead] == got[plain]
        for i in live:
            positions[i] += 1
            for ex in (ahead, plain):
                last[ex][i] = got[ex][i]
    assert ahead.lookahead_misses == 1 and ahead.lookahead_hits == 4
    assert plain.lookahead_hits == plain.lookahead_misses == 0


async def test_the_debug_log_accounts_for_every_step(model, caplog) -> None:
    """``--log-level DEBUG``: one line a step (rows, prefill tokens, the forwards' time) and
    one an admission (how long after arrival, tokens cached), so where a first token's time
    went can be read off a running worker (the long-prompt prefill chunks that ended inside a
    block were found this way)."""
    caplog.set_level(logging.DEBUG, "worker.engine")
    async with started_system(model) as system:
        stub = await system.add_worker(max_step_tokens=16)
        p = prompt(90, 40)
        await generate(stub, request(p, max_tokens=3))
        await generate(stub, request(p, max_tokens=2))  # the same prompt: cached
    lines = [r.getMessage() for r in caplog.records]
    admitted = [m for m in lines if " admitted " in m]
    assert len(admitted) == 2
    assert re.search(
        r"admitted [\d.]+ ms after its arrival: lease \d+, 0 of 40 tokens", admitted[0]
    )
    assert not admitted[1].endswith(" 0 of 40 tokens cached")
    steps = [re.search(r"step \d+: (\d+) rows, \d+ prefilling (\d+) tokens.*forwards ([\d.]+) ms", m)
             for m in lines if re.match(r"step \d+:", m)]  # fmt: skip
    assert steps and all(steps)
    prefilled = sum(int(s.group(2)) for s in steps)  # type: ignore[union-attr]
    # 40 tokens in 16-token chunks, then the second request's uncached tail; the decodes
    assert prefilled > 40 and max(int(s.group(2)) for s in steps) <= 16  # type: ignore[union-attr]
    assert all(float(s.group(3)) > 0 for s in steps)  # type: ignore[union-attr]


@pytest.mark.parametrize("itl_ratio", [0.0, 1.01])
async def test_the_itl_ratio_bounds_prefill_beside_decodes(model, caplog, itl_ratio) -> None:
    """``--itl-ratio`` reaches the engine's step budget: while a request decodes, a long prompt
    that arrives prefills in chunks bounded by the decode step's time (here barely any time
    beside it: one block a step), where without it the chunks take the whole step budget. The
    output is the same either way."""
    caplog.set_level(logging.DEBUG, "worker.engine")
    async with started_system(model) as system:
        stub = await system.add_worker(max_step_tokens=64, itl_ratio=itl_ratio)
        decoding = asyncio.ensure_future(generate(stub, request(prompt(91, 8), max_tokens=160)))
        while not any("decoding" in r.getMessage() for r in caplog.records):
            await asyncio.sleep(0.01)  # the first request is decoding
        long = await generate(stub, request(prompt(92, 200), max_tokens=2))
        assert len((await decoding)["tokens"]) == 160 and len(long["tokens"]) == 2
        await system.wait_idle()
    step = re.compile(r"step \d+: \d+ rows, \d+ prefilling (\d+) tokens.*, [1-9]\d* decoding")
    mixed = [int(m.group(1)) for r in caplog.records if (m := step.match(r.getMessage()))]
    mixed = [n for n in mixed if n > 0]
    assert mixed, "the long prompt prefilled beside the decode"
    if itl_ratio:
        assert max(mixed) == BS  # one block a step: the floor
    else:
        assert max(mixed) > BS  # the whole budget (64 less the decode)
