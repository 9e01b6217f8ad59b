"""The gateway against a real cache service and fake workers (no model): OpenAI shapes,
streaming, routing by cached prefix, fail-over, cancellation, metrics, admin, gRPC."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc
import httpx
import pytest
from openai import AsyncOpenAI

from gateway.router import RoutingPolicy
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from tests.gateway.conftest import AUTH, Stack, released, wait_for, worker_of
from tests.gateway.fake_worker import MODEL, OUTPUT
from tests.gateway.test_http_errors import assert_error

SYSTEM_A = "You are the assistant of team A. " * 6
SYSTEM_B = "Team B writes haiku only, never prose, and counts syllables. " * 4


def chat(system: str, user: str = "hi", **kw) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **kw}


def openai(stack: Stack) -> AsyncOpenAI:
    return stack.openai()


async def test_openai_client_completions_and_chat(stack: Stack):
    client = openai(stack)
    c = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=5)
    assert c.object == "text_completion"
    assert c.choices[0].text == OUTPUT[:5]
    assert c.choices[0].finish_reason == "length"
    assert c.usage is not None
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (5, 5)
    assert c.usage.total_tokens == 10
    assert c.usage.prompt_tokens_details is not None
    assert c.usage.prompt_tokens_details.cached_tokens == 0

    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == OUTPUT[:3]
    assert r.id.startswith("chatcmpl-")


async def test_null_for_an_optional_field_is_its_default(stack: Stack):
    """Clients send unset fields as null (the ``openai`` client's ``n=None``, ``stream=None``);
    OpenAI and vLLM read null as the default. Every field with a default takes it."""
    client = openai(stack)
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        extra_body={"n": None, "stream": None, "logprobs": None, "echo": None,
                    "ignore_eos": None, "skip_special_tokens": None,
                    "include_stop_str_in_output": None, "add_generation_prompt": None,
                    "continue_final_message": None, "stream_options": None},
    )  # fmt: skip
    assert [c.message.content for c in chat.choices] == [OUTPUT[:3]]
    assert chat.choices[0].logprobs is None
    text = await client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, extra_body={"n": None, "echo": None}
    )
    assert [c.text for c in text.choices] == [OUTPUT[:4]]
    streamed = await client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=2, stream=True,
        extra_body={"stream_options": {"include_usage": None}},
    )  # fmt: skip
    chunks = [c async for c in streamed]
    assert all(c.usage is None for c in chunks)  # include_usage null: false
    async with httpx.AsyncClient(base_url=stack.base_url) as http:  # null is not a value
        resp = await http.post("/v1/chat/completions", json={"messages": None})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


async def test_streamed_chat_with_usage(stack: Stack):
    client = openai(stack)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == OUTPUT[:6]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


async def test_streamed_completion_is_well_formed_sse(stack: Stack):
    body = {"prompt": "Hello", "max_tokens": 3, "stream": True}
    async with stack.http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = "".join([part async for part in resp.aiter_text()])
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(p["choices"][0]["text"] for p in payloads) == OUTPUT[:3]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert all("usage" not in p for p in payloads)  # only with include_usage


async def test_choices_for_prompt_lists_and_n(stack: Stack):
    body = {"prompt": ["Hello", "Bye"], "n": 2, "max_tokens": 2, "seed": 7}
    resp = (await stack.http.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == OUTPUT[:2] for c in resp["choices"])
    usage = resp["usage"]
    assert usage["prompt_tokens"] == 5 + 3  # each prompt once, not once per sample
    assert usage["completion_tokens"] == 8
    seeds = sorted(r.sampling.seed for w in stack.workers for r in w.record.requests)
    assert seeds == [7, 7, 8, 8]  # sample j of a prompt gets seed + j


async def test_logprobs_and_echo(stack: Stack):
    body = {"prompt": "Hi", "max_tokens": 2, "logprobs": 2}
    choice = (await stack.http.post("/v1/completions", json=body)).json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == list(OUTPUT[:2])
    assert lp["token_logprobs"] == [-0.5, -0.5]
    assert [len(t) for t in lp["top_logprobs"]] == [2, 2]
    assert lp["text_offset"] == [0, 1]

    body = {**chat(SYSTEM_A), "logprobs": True, "top_logprobs": 1, "max_tokens": 2}
    content = (await stack.http.post("/v1/chat/completions", json=body)).json()
    entries = content["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == list(OUTPUT[:2])
    assert all(len(e["top_logprobs"]) == 1 and e["bytes"] for e in entries)

    body = {"prompt": "Hi", "max_tokens": 2, "echo": True}
    choice = (await stack.http.post("/v1/completions", json=body)).json()["choices"][0]
    assert choice["text"] == "Hi" + OUTPUT[:2]


async def test_repeated_system_prompt_is_cached(stack: Stack):
    first = (await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A, "one"))).json()
    await released(stack)
    second = (await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A, "two"))).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(SYSTEM_A) - 4  # the whole system prompt, to a block


async def test_shared_prefixes_go_to_the_worker_that_holds_them(stack: Stack):
    a = await worker_of(stack, chat(SYSTEM_A, "first"))
    await released(stack)
    await stack.poll()  # the pool that served A has fewer free blocks now
    b = await worker_of(stack, chat(SYSTEM_B, "first"))
    assert a != b  # a new prefix goes to the emptier pool, not to the chat template's crumbs
    await released(stack)
    for i in range(3):
        assert await worker_of(stack, chat(SYSTEM_A, f"again {i}")) == a
        assert await worker_of(stack, chat(SYSTEM_B, f"again {i}")) == b
    by_worker = {w.worker_id: len(w.record.requests) for w in stack.workers}
    assert by_worker == {a: 4, b: 4}
    metrics = (await stack.http.get("/metrics")).text
    assert f'kvserve_gateway_routed_total{{reason="prefix",worker="{a}"}} 3.0' in metrics


async def test_an_overloaded_holder_sheds_load(stack: Stack):
    stack.gateway.gateway.dispatcher.policy = RoutingPolicy(min_match_tokens=4, overload_slack=1)
    first = await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A, "warm"))
    holder = first.headers["x-kvserve-worker"]
    for w in stack.workers:
        w.behaviour.delay_s = 0.05
    bodies = [chat(SYSTEM_A, f"q{i}", max_tokens=10) for i in range(4)]
    tasks = []
    for body in bodies:  # one at a time, so each sees the others in flight
        tasks.append(asyncio.create_task(stack.http.post("/v1/chat/completions", json=body)))
        await asyncio.sleep(0.03)
    served = [r.headers["x-kvserve-worker"] for r in await asyncio.gather(*tasks)]
    other = next(w.worker_id for w in stack.workers if w.worker_id != holder)
    # Holder loads 0 and 1 are within the slack of one over the idle worker; 2 is not, so
    # the third goes elsewhere; then the minimum is 1 and the holder's 2 is fine again.
    assert served == [holder, holder, other, holder]


async def test_fail_over_to_another_worker_and_recover(stack: Stack):
    first = await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A, "warm"))
    holder = next(w for w in stack.workers if w.worker_id == first.headers["x-kvserve-worker"])
    other = next(w for w in stack.workers if w is not holder)
    port = holder.port
    await holder.stop()  # the process is gone; its pool is still registered as alive

    resp = await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A, "again"))
    assert resp.status_code == 200
    assert resp.headers["x-kvserve-worker"] == other.worker_id
    health = (await stack.http.get("/health")).json()
    marks = {w["worker"]: w["healthy"] for w in health["workers"]}
    assert marks == {holder.worker_id: False, other.worker_id: True}
    # Marked unhealthy: the next request goes straight to the other worker.
    n_failovers = (await stack.http.get("/metrics")).text.count("kvserve_gateway_failovers_total{")
    assert n_failovers == 1
    resp = await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A, "third"))
    assert resp.headers["x-kvserve-worker"] == other.worker_id

    await holder.start(port)  # back on the same address: the poller clears the mark
    await stack.poll()
    assert all(w["healthy"] for w in (await stack.http.get("/health")).json()["workers"])


async def test_a_hung_worker_is_marked_and_a_request_waiting_there_fails_over(stack: Stack):
    """A stopped or stalled worker still takes connections: requests routed to it waited (its
    lease TTL, 30 s, was the first thing to notice). Its unanswered health polls mark it
    unhealthy within a few poll intervals (0.2 s here), and a request waiting there for its
    first token goes to the other worker."""
    first = await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A, "warm"))
    holder = next(w for w in stack.workers if w.worker_id == first.headers["x-kvserve-worker"])
    other = next(w for w in stack.workers if w is not holder)
    await released(stack)
    holder.behaviour.hang = True
    started = time.monotonic()
    resp = await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A, "again"))
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvserve-worker"] == other.worker_id
    assert time.monotonic() - started < 5.0
    assert len(holder.record.requests) == 2  # it was sent there first (the prefix is there)
    health = (await stack.http.get("/health")).json()
    mark = next(w for w in health["workers"] if w["worker"] == holder.worker_id)
    assert not mark["healthy"] and "did not answer GetInfo" in mark["reason"], mark
    resp = await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A, "third"))
    assert resp.headers["x-kvserve-worker"] == other.worker_id
    assert len(holder.record.requests) == 2  # marked: not tried first any more
    holder.behaviour.hang = False  # it resumes: the poller clears the mark

    async def healthy() -> bool:
        return all(w["healthy"] for w in (await stack.http.get("/health")).json()["workers"])

    for _ in range(50):
        if await healthy():
            break
        await asyncio.sleep(0.1)
    assert await healthy()


async def test_all_workers_down_is_503_then_service_resumes(stack: Stack):
    ports = [w.port for w in stack.workers]
    for w in stack.workers:
        await w.stop()
    resp = await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A))
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "service_unavailable"
    assert resp.headers["retry-after"] == "2"  # a supervisor restarts a worker in seconds
    assert (await stack.http.get("/health")).status_code == 503
    for w, port in zip(stack.workers, ports, strict=True):
        await w.start(port)
    await stack.poll()
    assert (await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A))).status_code == 200


async def test_worker_errors_map_to_http(stack: Stack):
    for w in stack.workers:
        w.behaviour.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
    resp = await stack.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status_code == 429
    assert resp.json()["error"]["type"] == "rate_limit_error"
    assert sum(len(w.record.requests) for w in stack.workers) == 2  # tried both

    stack.workers[0].behaviour.fail_with = None  # one has room: it serves
    resp = await stack.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status_code == 200

    for w in stack.workers:
        w.behaviour.fail_with = grpc.StatusCode.INVALID_ARGUMENT
        w.behaviour.fail_message = "the prompt does not fit this pool"
    resp = await stack.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "the prompt does not fit this pool"


async def test_the_context_is_what_the_largest_pool_holds(stack: Stack):
    """A worker's KV pool may hold fewer tokens than the model's context (the fakes': 256
    blocks of 4, 1024 tokens, against 4096): /v1/models advertises what a request can use, the
    largest pool's, and a request longer than that gets OpenAI's context_length_exceeded,
    naming its field, the limit and its tokens, before any worker is asked."""
    assert stack.gateway.gateway.tokenizer.max_context == 4096
    await stack.poll()
    assert (await stack.http.get("/v1/models")).json()["data"][0]["max_model_len"] == 1024
    stack.workers[1].num_blocks = 300  # the largest pool counts: a request may go there
    await stack.poll()
    assert (await stack.http.get("/v1/models")).json()["data"][0]["max_model_len"] == 1200
    stack.workers[1].num_blocks = 256
    await stack.poll()

    prompt = [72] * 1100
    for body in ({"prompt": prompt}, {"prompt": prompt, "stream": True}):
        err = assert_error(
            await stack.http.post("/v1/completions", json=body),
            400,
            param="prompt",
            code="context_length_exceeded",
        )
        assert "maximum context length is 1024 tokens" in err["message"]
        assert "1100 tokens" in err["message"]
    err = assert_error(
        await stack.http.post("/v1/completions", json={"prompt": [72] * 1000, "max_tokens": 30}),
        400,
        param="max_tokens",
        code="context_length_exceeded",
    )
    assert "1024" in err["message"] and "1030" in err["message"]
    messages = [{"role": "user", "content": "hi " * 1100}]
    err = assert_error(
        await stack.http.post("/v1/chat/completions", json={"messages": messages}),
        400,
        param="messages",
        code="context_length_exceeded",
    )
    assert "maximum context length is 1024 tokens" in err["message"]
    assert not any(w.record.requests for w in stack.workers)
    # What fits is served: 1000 prompt tokens and the rest of the pool.
    ok = await stack.http.post("/v1/completions", json={"prompt": [72] * 1000, "max_tokens": 24})
    assert ok.status_code == 200, ok.text


async def test_a_pool_too_small_is_failed_over_then_context_length_exceeded(stack: Stack):
    """A worker that refuses a request as longer than its pool holds (one smaller than the
    largest, or a view not polled yet): the next worker is tried; when every one refuses, the
    client gets context_length_exceeded naming the field and the limit, not a bare 400."""
    await stack.poll()
    small, other = stack.workers
    small.behaviour.fail_with = grpc.StatusCode.INVALID_ARGUMENT
    small.behaviour.fail_message = "the request needs 300 KV blocks; this worker's pool has 256"
    for _ in range(3):
        resp = await stack.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert resp.status_code == 200 and resp.headers["x-kvserve-worker"] == other.worker_id
    assert not stack.gateway.gateway.directory.unhealthy

    other.behaviour = small.behaviour
    for path, body, param in (
        ("/v1/completions", {"prompt": [72] * 5, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}, "prompt"),
        ("/v1/chat/completions", chat(SYSTEM_A), "messages"),
        ("/v1/chat/completions", chat(SYSTEM_A, stream=True), "messages"),
    ):
        asked = sum(len(w.record.requests) for w in stack.workers)
        err = assert_error(
            await stack.http.post(path, json=body), 400, param, "context_length_exceeded"
        )
        assert "maximum context length is 1024 tokens" in err["message"], err
        assert sum(len(w.record.requests) for w in stack.workers) == asked + 2  # tried both
    err = assert_error(
        await stack.http.post("/v1/completions", json={"prompt": [72] * 5, "max_tokens": 2}), 400
    )
    assert "7 tokens (5 in the prompt, 2 for the completion)" in err["message"]


@pytest.mark.parametrize(
    "said",
    [
        "the request needs 30 KV blocks; this pool can give at most 18 of its 40 (22 are pinned)",
        "the request needs 30 KV blocks in namespace 'tenant-a', over its quota of 20 (4 of them "
        "pinned or shared and kept)",
    ],
)
async def test_a_pool_held_back_by_pins_or_a_quota_is_failed_over(stack: Stack, said: str):
    """The cache service's refusal of a lease no eviction could grant in one pool (its pinned
    blocks, or the namespace's quota there), passed on by the worker: another pool may hold the
    request, so it is tried; once every pool refused, a 400 context_length_exceeded that says
    why (the workers' words), not a bare invalid_request_error from the first pool tried."""
    await stack.poll()
    held, other = stack.workers
    held.behaviour.fail_with = grpc.StatusCode.INVALID_ARGUMENT
    held.behaviour.fail_message = said
    for _ in range(3):
        resp = await stack.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert resp.status_code == 200 and resp.headers["x-kvserve-worker"] == other.worker_id
    assert not stack.gateway.gateway.directory.unhealthy

    other.behaviour = held.behaviour
    asked = sum(len(w.record.requests) for w in stack.workers)
    err = assert_error(
        await stack.http.post("/v1/completions", json={"prompt": [72] * 5, "max_tokens": 2}),
        400,
        "prompt",
        "context_length_exceeded",
    )
    assert sum(len(w.record.requests) for w in stack.workers) == asked + 2  # tried both
    assert "can hold this request now" in err["message"] and said in err["message"], err
    assert "7 tokens (5 in the prompt, 2 for the completion)" in err["message"]


async def test_chat_template_kwargs_override_the_requests_template_parameters(stack: Stack):
    """vLLM's rule: a chat_template_kwargs key named as one of the request's own template
    parameters sets it, so a request written for vLLM renders the same prompt here."""

    async def prompt(**fields) -> list[int]:
        body = {**chat(SYSTEM_A), **fields}
        resp = await stack.http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        [sent] = [r for w in stack.workers for r in w.record.requests][-1:]
        return list(sent.prompt_token_ids.ids)

    default = await prompt()
    without = await prompt(add_generation_prompt=False)
    assert without != default
    assert await prompt(chat_template_kwargs={"add_generation_prompt": False}) == without
    both = {"add_generation_prompt": True, "chat_template_kwargs": {"add_generation_prompt": False}}
    assert await prompt(**both) == without  # the kwarg wins, as in vLLM
    assert await prompt(chat_template_kwargs={"some_variable": 1}) == default


async def test_requests_share_one_call_per_worker(stack: Stack):
    """The gateway's requests to a worker go over one GenerateMany call, concurrent ones too."""
    bodies = [{"prompt": f"p{i}", "max_tokens": 4} for i in range(6)]
    resps = await asyncio.gather(*(stack.http.post("/v1/completions", json=b) for b in bodies))
    assert [r.json()["choices"][0]["text"] for r in resps] == [OUTPUT[:4]] * 6
    served = [w for w in stack.workers if w.record.requests]
    assert served and all(w.record.many_calls == 1 for w in served)


async def test_a_worker_without_generate_many_is_served_one_call_a_request(stack: Stack):
    """A worker that answers GenerateMany UNIMPLEMENTED (older than it) gets Generate calls;
    its errors still map as before."""
    for w in stack.workers:
        w.behaviour.multiplex = False
    bodies = [{"prompt": f"q{i}", "max_tokens": 3} for i in range(3)]
    resps = await asyncio.gather(*(stack.http.post("/v1/completions", json=b) for b in bodies))
    assert [r.json()["choices"][0]["text"] for r in resps] == [OUTPUT[:3]] * 3
    assert all(w.record.many_calls == 0 for w in stack.workers)
    for w in stack.workers:
        w.behaviour.fail_with = grpc.StatusCode.INVALID_ARGUMENT
        w.behaviour.fail_message = "no room for that prompt"
    resp = await stack.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "no room for that prompt"


async def test_an_internal_error_is_500_and_the_worker_stays_in_rotation(stack: Stack):
    """A worker that answers INTERNAL (a bug hit one request) is up: the request fails with an
    OpenAI-shaped 500, without fail-over, and the worker is not marked unhealthy."""
    for w in stack.workers:
        w.behaviour.fail_with = grpc.StatusCode.INTERNAL
        w.behaviour.fail_message = "internal error in a model step: RuntimeError: boom"
    resp = await stack.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status_code == 500
    error = resp.json()["error"]
    assert error["type"] == "server_error" and "boom" not in error["message"]
    assert sum(len(w.record.requests) for w in stack.workers) == 1  # no fail-over
    assert not stack.gateway.gateway.directory.unhealthy
    health = (await stack.http.get("/health")).json()
    assert all(w["healthy"] for w in health["workers"])

    # Mid-stream (a step failed while decoding): the stream ends with an error event; the
    # worker still is not marked.
    for w in stack.workers:
        w.behaviour.fail_after = 2
    body = {"prompt": "x", "max_tokens": 8, "stream": True}
    async with stack.http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = [
            json.loads(line[6:])
            for line in [ln async for ln in resp.aiter_lines()]
            if line.startswith("data: {")
        ]
    assert events[-1]["error"]["type"] == "server_error"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == OUTPUT[:2]
    assert not stack.gateway.gateway.directory.unhealthy

    for w in stack.workers:
        w.behaviour.fail_with = None
    resp = await stack.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status_code == 200

    # A gRPC client of the gateway gets INTERNAL too.
    for w in stack.workers:
        w.behaviour.fail_with, w.behaviour.fail_after = grpc.StatusCode.INTERNAL, 0
    async with grpc.aio.insecure_channel(stack.gateway.grpc_address) as channel:
        req = pb.GenerateRequest(prompt_text="x", sampling=pb.SamplingParams(max_tokens=2))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in pb_grpc.WorkerStub(channel).Generate(req):
                pass
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert not stack.gateway.gateway.directory.unhealthy


async def test_stream_disconnect_cancels_the_worker_request(stack: Stack):
    for w in stack.workers:
        w.behaviour.delay_s = 0.05
    body = {"prompt": "Hello", "max_tokens": 500, "stream": True}
    async with stack.http.stream("POST", "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                break  # one token arrived; now hang up
    await wait_for(lambda: any(w.record.cancelled for w in stack.workers))
    assert not any(w.record.finished for w in stack.workers)
    await wait_for(lambda: all(w.running == 0 for w in stack.workers))


async def test_non_streaming_disconnect_cancels_the_worker_request(stack: Stack):
    for w in stack.workers:
        w.behaviour.delay_s = 0.05
    body = {"prompt": "Hello", "max_tokens": 500}
    with pytest.raises(httpx.ReadTimeout):
        await stack.http.post("/v1/completions", json=body, timeout=0.5)
    await wait_for(lambda: any(w.record.cancelled for w in stack.workers))
    assert not any(w.record.finished for w in stack.workers)


async def test_a_client_gone_while_sending_its_body_is_499_not_an_error(
    stack: Stack, caplog: pytest.LogCaptureFixture
):
    """A client that closes the connection with its body half sent (Content-Length 1000, a
    few bytes, close) went away, as one that leaves mid-response: 499 in the metrics, no
    ERROR and no traceback in the log (Starlette's ClientDisconnect was a 500, logged as an
    unhandled error)."""
    caplog.set_level(logging.INFO)
    host, port = stack.gateway.http_address.rsplit(":", 1)
    paths = {"/v1/completions": "/v1/completions", "/v1/chat/completions": "/v1/chat/completions"}
    paths["/admin/cache/evict"] = "/admin"
    for path in paths:
        _, writer = await asyncio.open_connection(host, int(port))
        head = f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Length: 1000\r\n"
        writer.write(f"{head}Content-Type: application/json\r\n\r\n".encode() + b'{"prompt": "')
        await writer.drain()
        await asyncio.sleep(0.1)  # the route is waiting for the rest of the body
        writer.close()
        await writer.wait_closed()

    def closed(metrics: str, endpoint: str) -> bool:
        return (
            f'kvserve_gateway_requests_total{{endpoint="{endpoint}",status="499"}} 1.0' in metrics
        )

    for _ in range(100):
        metrics = (await stack.http.get("/metrics")).text
        if all(closed(metrics, e) for e in paths.values()):
            break
        await asyncio.sleep(0.02)
    assert all(closed(metrics, e) for e in paths.values()), metrics
    assert 'status="500"' not in metrics
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert "client disconnected while sending its request body" in caplog.text
    assert not any(w.record.requests for w in stack.workers)
    assert (await stack.http.post("/v1/completions", json={"prompt": "x"})).status_code == 200


async def test_metrics(stack: Stack):
    await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A, "one"))
    await released(stack)
    await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A, "two", stream=True))
    await stack.poll()
    text = (await stack.http.get("/metrics")).text
    for series in [
        'kvserve_gateway_requests_total{endpoint="/v1/chat/completions",status="200"} 2.0',
        "kvserve_gateway_time_to_first_token_seconds_count 2.0",
        "kvserve_gateway_inter_token_latency_seconds_count 6.0",
        "kvserve_gateway_prefix_cache_hit_rate",
        'kvserve_worker_kv_blocks{state="free",worker="w0"}',
        'kvserve_worker_kv_blocks{state="cached",worker="w1"}',
        'kvserve_worker_kv_blocks{state="referenced",worker="w0"}',
        'kvserve_worker_queue_depth{worker="w0"}',
        'kvserve_worker_preemptions_total{worker="w1"}',
        'kvserve_worker_healthy{worker="w0"} 1.0',
    ]:
        assert series in text, series
    cached = [line for line in text.splitlines() if line.startswith("kvserve_gateway_cached_")]
    assert sum(float(line.split()[-1]) for line in cached if "_total" in line) > 0


async def test_admin_pass_through(stack: Stack):
    http = stack.http
    assert (await http.get("/admin/cache/stats")).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    resp = await http.get("/admin/cache/stats", headers=wrong)
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"

    served = await http.post("/v1/chat/completions", json=chat(SYSTEM_A))
    pool = served.headers["x-kvserve-worker"]
    stats = (await http.get("/admin/cache/stats", headers=AUTH)).json()
    assert sorted(p["pool_id"] for p in stats["pools"]) == ["w0", "w1"]

    system = {"messages": [{"role": "system", "content": SYSTEM_A}]}
    found = (await http.post("/admin/cache/lookup", json=system, headers=AUTH)).json()
    cached = {p["pool_id"]: p["cached_tokens"] for p in found["pools"]}
    assert cached[pool] > 0 and found["prompt_tokens"] > cached[pool] - 4

    pin = await http.post("/admin/cache/pin", json={"pool": pool, **system}, headers=AUTH)
    assert pin.status_code == 200 and pin.json()["blocks"] > 0
    flush = await http.post("/admin/cache/flush", json={"pool": pool}, headers=AUTH)
    assert flush.status_code == 200
    still = (await http.post("/admin/cache/lookup", json=system, headers=AUTH)).json()
    assert {p["pool_id"]: p["cached_tokens"] for p in still["pools"]}[pool] > 0
    unpin = await http.post("/admin/cache/unpin", json={"pool": pool, **system}, headers=AUTH)
    assert unpin.json()["blocks"] == pin.json()["blocks"]

    tree = (await http.get(f"/admin/cache/tree?pool={pool}", headers=AUTH)).json()
    assert tree["nodes"]
    evict = await http.post("/admin/cache/evict", json={"pool": pool, "blocks": 1}, headers=AUTH)
    assert evict.json()["evicted_blocks"] == 1
    evict = await http.post(
        "/admin/cache/evict", json={"pool": pool, "namespace": ""}, headers=AUTH
    )
    assert evict.status_code == 200
    check = (await http.get("/admin/cache/check", headers=AUTH)).json()
    assert check["ok"] is True and check["pools_checked"] == 2
    # A tier flush of a pool with no tier: the cache service's 400 passes through.
    tier = await http.post("/admin/cache/flush", json={"pool": pool, "tier": "disk"}, headers=AUTH)
    assert tier.status_code == 400 and "tier" in tier.text
    bad = await http.post("/admin/cache/flush", json={"pool": pool, "tier": "tape"}, headers=AUTH)
    assert bad.status_code == 400
    missing = await http.get("/admin/cache/tree?pool=nope", headers=AUTH)
    assert missing.status_code in (400, 404)


async def test_cache_salt_isolates_prefixes(stack: Stack):
    await stack.http.post("/v1/chat/completions", json=chat(SYSTEM_A, cache_salt="tenant-1"))
    other = await stack.http.post(
        "/v1/chat/completions", json=chat(SYSTEM_A, cache_salt="tenant-2")
    )
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    same = await stack.http.post(
        "/v1/chat/completions", json=chat(SYSTEM_A, "x", cache_salt="tenant-1")
    )
    assert same.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert {r.namespace for w in stack.workers for r in w.record.requests} == {
        "tenant-1",
        "tenant-2",
    }


async def test_speculative_decoding_is_asked_per_request(stack: Stack):
    await stack.http.post(
        "/v1/completions",
        json={"prompt": "def f(x):", "max_tokens": 4, "speculative": "ngram"},
    )
    await stack.http.post(
        "/v1/chat/completions", json=chat(SYSTEM_B, speculative="draft_model", num_draft_tokens=6)
    )
    await stack.http.post("/v1/completions", json={"prompt": "plain", "max_tokens": 4})
    sent = sorted(
        (r.sampling.speculative, r.sampling.num_draft_tokens)
        for w in stack.workers
        for r in w.record.requests
    )
    assert sent == [
        (pb.SPECULATIVE_OFF, 0),
        (pb.SPECULATIVE_NGRAM, 0),
        (pb.SPECULATIVE_DRAFT_MODEL, 6),
    ]
    asked = sum(len(w.record.requests) for w in stack.workers)
    for body, param in [
        ({"speculative": "medusa"}, "speculative"),
        ({"speculative": "ngram", "num_draft_tokens": 17}, "num_draft_tokens"),
        ({"num_draft_tokens": 3}, "num_draft_tokens"),
        ({"speculative": "ngram", "num_draft_tokens": -1}, "num_draft_tokens"),
    ]:
        resp = await stack.http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 4, **body}
        )
        assert resp.status_code == 400, body
        assert resp.json()["error"]["param"] == param
    assert sum(len(w.record.requests) for w in stack.workers) == asked  # none dispatched


async def test_grpc_generate_through_the_gateway(stack: Stack):
    async with grpc.aio.insecure_channel(stack.gateway.grpc_address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        req = pb.GenerateRequest(
            request_id="g-1",
            prompt_text="Hello",
            sampling=pb.SamplingParams(max_tokens=3),
        )
        msgs = [m async for m in stub.Generate(req)]
        assert "".join(m.text for m in msgs) == OUTPUT[:3]
        assert {m.request_id for m in msgs} == {"g-1"}
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert msgs[-1].usage.prompt_tokens == 5
        assert msgs[-1].worker_id in ("w0", "w1")

        ids = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=[72, 105]), sampling=pb.SamplingParams()
        )
        msgs = [m async for m in stub.Generate(ids)]
        # max_tokens 0 means "as many as fit": the worker decides (its pool may hold fewer
        # tokens than the context), so it is sent as 0.
        sent = [r for w in stack.workers for r in w.record.requests][-1]
        assert sent.sampling.max_tokens == 0
        assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
        assert "".join(m.text for m in msgs) == OUTPUT

        for bad in [
            pb.GenerateRequest(),
            pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[99999])),
            pb.GenerateRequest(prompt_text="x" * 5000),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [m async for m in stub.Generate(bad)]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        info = await stub.GetInfo(pb.GetInfoRequest())
        # What a request can use: the fakes' pools (256 blocks of 4) hold less than the 4096
        # of the model's context.
        assert info.model == MODEL and info.max_context == 256 * 4
        assert info.num_blocks == sum(w.num_blocks for w in stack.workers)


async def test_grpc_cancel_cancels_the_worker_request(stack: Stack):
    for w in stack.workers:
        w.behaviour.delay_s = 0.05
    async with grpc.aio.insecure_channel(stack.gateway.grpc_address) as channel:
        call = pb_grpc.WorkerStub(channel).Generate(
            pb.GenerateRequest(prompt_text="Hello", sampling=pb.SamplingParams(max_tokens=500))
        )
        await call.read()
        call.cancel()
    await wait_for(lambda: any(w.record.cancelled for w in stack.workers))


async def test_grpc_without_workers_is_unavailable(stack: Stack):
    for w in stack.workers:
        await w.stop()
    async with grpc.aio.insecure_channel(stack.gateway.grpc_address) as channel:
        call = pb_grpc.WorkerStub(channel).Generate(pb.GenerateRequest(prompt_text="x"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_models_say_which_runner_serves_them(stack: Stack):
    """/v1/models tells a paged model from one on the dense per-sequence runner (recurrent
    state: no prefix reuse), as the workers report it."""
    stack.workers[1].runner = "dense"
    await stack.poll()
    card = (await stack.http.get("/v1/models")).json()["data"][0]
    assert card["runners"] == ["dense", "paged"]


async def test_grpc_top_k_beyond_the_vocabulary_is_invalid_argument(stack: Stack):
    vocab = stack.gateway.gateway.tokenizer.vocab_size
    async with grpc.aio.insecure_channel(stack.gateway.grpc_address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        for top_k in (vocab + 1, 2**31 - 1):
            req = pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=[72, 105]),
                sampling=pb.SamplingParams(temperature=1.0, top_k=top_k, max_tokens=4),
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [m async for m in stub.Generate(req)]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "top_k" in (e.value.details() or "")
    assert not any(w.record.requests for w in stack.workers)  # refused before dispatch


async def test_http_top_k_past_the_wire_is_400_not_500(stack: Stack):
    for top_k in (2**31, 2**63):
        body = {"prompt": "hi", "max_tokens": 4, "top_k": top_k}
        resp = await stack.http.post("/v1/completions", json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "top_k"
    assert not any(w.record.requests for w in stack.workers)


def test_http_connections_turn_nagle_off():
    """asyncio sets TCP_NODELAY only on sockets whose protocol says TCP; accepted connections
    inherit the listener's. With Nagle on, SSE events waited for the client's delayed ACK."""
    import socket

    from gateway.server import _listen

    sock = _listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()
