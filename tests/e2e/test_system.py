"""End to end: real cache service, two real workers (embedded tiny model), real gateway.

The tests share one system (module scope) and run in file order; the last one kills a worker.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import httpx
import pytest
from openai import OpenAI

from kvserve_launch.system import System
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from tests.e2e.conftest import ADMIN_TOKEN, LogSink

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "kvserve-tiny-llama"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# Long enough to fill several 32-token blocks of the byte-level tokenizer.
SYSTEM_PROMPT = (
    "You are kvserve's test assistant. Answer briefly, in plain words, and never repeat "
    "the question. This sentence only makes the system prompt span a few KV blocks."
)
OTHER_SYSTEM_PROMPT = (
    "A different system prompt, sharing nothing with the first one but the chat template: "
    "routing must not follow the template's first few tokens to a busy worker."
)


@pytest.fixture(scope="module")
def client(system: System) -> OpenAI:
    return OpenAI(base_url=f"http://{system.http_address}/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def http(system: System) -> httpx.Client:
    return httpx.Client(base_url=f"http://{system.http_address}", timeout=120)


def messages(system_prompt: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]


def pool_stats(http: httpx.Client) -> dict[str, dict]:
    resp = http.get("/admin/cache/stats", headers=AUTH)
    assert resp.status_code == 200, resp.text
    return {p["pool_id"]: p for p in resp.json()["pools"]}


def test_both_workers_registered(system: System, http: httpx.Client, logs: LogSink):
    assert sorted(pool_stats(http)) == ["worker-0", "worker-1"]
    health = http.get("/health").json()
    assert health["status"] == "ok"
    assert sorted(w["worker"] for w in health["workers"] if w["healthy"]) == [
        "worker-0",
        "worker-1",
    ]
    assert [
        m.id for m in OpenAI(base_url=f"http://{system.http_address}/v1", api_key="x").models.list()
    ] == [MODEL]
    assert http.get("/v1/models").json()["data"][0]["runners"] == ["paged"]


def test_completions(client: OpenAI):
    c = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert c.object == "text_completion"
    assert len(c.choices) == 1 and isinstance(c.choices[0].text, str)
    assert c.choices[0].finish_reason == "length"
    assert c.usage is not None
    assert c.usage.prompt_tokens == len(b"Once upon a time")
    assert c.usage.completion_tokens == 6

    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert streamed == c.choices[0].text  # greedy: the same text either way


def test_speculative_decoding_gives_the_same_greedy_text(client: OpenAI):
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    texts = []
    for extra in ({}, {"speculative": "ngram"}, {"speculative": "ngram", "num_draft_tokens": 8}):
        c = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )  # fmt: skip
        assert c.usage is not None and c.usage.completion_tokens == 40
        texts.append(c.choices[0].text)
    assert texts[1] == texts[0] and texts[2] == texts[0]


def test_chat(client: OpenAI):
    r = client.chat.completions.create(
        model=MODEL, messages=messages(SYSTEM_PROMPT, "Hello!"), max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.completion_tokens == 5

    stream = client.chat.completions.create(
        model=MODEL, messages=messages(SYSTEM_PROMPT, "Hello!"), max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 5
    # The same prompt a second time: its full blocks are cached now.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_repeated_system_prompt_hits_the_cache(client: OpenAI):
    def cached(user: str) -> tuple[int, int]:
        r = client.chat.completions.create(
            model=MODEL, messages=messages(OTHER_SYSTEM_PROMPT, user), max_tokens=2
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0, r.usage.prompt_tokens

    first, _ = cached("What is a KV cache?")
    second, prompt_tokens = cached("And what is a radix tree?")
    assert first == 0
    # Everything up to the last full block of the shared system prompt (and template).
    assert second >= len(OTHER_SYSTEM_PROMPT) // 32 * 32 - 32
    assert second < prompt_tokens


def test_shared_prefix_goes_to_the_worker_that_holds_it(client: OpenAI, http: httpx.Client):
    prefix = "Routing test. " * 12
    before = pool_stats(http)
    r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(prefix, "first"), max_tokens=2
    )
    holder = r.headers["x-kvserve-worker"]
    for i in range(3):
        client.chat.completions.create(
            model=MODEL, messages=messages(prefix, f"follow-up {i}"), max_tokens=2
        )
    after = pool_stats(http)
    acquires = {p: int(after[p]["acquires"]) - int(before[p]["acquires"]) for p in after}
    hits = {p: int(after[p]["acquire_hits"]) - int(before[p].get("acquire_hits", 0)) for p in after}
    assert acquires[holder] == 4, acquires  # all four went to the holder ...
    assert sum(acquires.values()) == 4, acquires  # ... and none elsewhere
    assert hits[holder] >= 3, hits  # the follow-ups reused its blocks


def test_grpc_generate_through_the_gateway(system: System):
    with grpc.insecure_channel(system.grpc_address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        request = pb.GenerateRequest(
            prompt_text="Hello", sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True)
        )
        responses = list(stub.Generate(request, timeout=120))
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == 4
        assert sum(len(r.token_ids) for r in responses) == 4
        assert responses[-1].worker_id in ("worker-0", "worker-1")
        info = stub.GetInfo(pb.GetInfoRequest(), timeout=10)
        assert info.model == MODEL and info.max_context > 0


def test_admin_cli_and_http_admin(system: System, http: httpx.Client):
    out = subprocess.run(
        [sys.executable, "-m", "kvcache_service.admin_cli", "--address", system.cache_address,
         "--token", ADMIN_TOKEN, "stats"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "worker-0" in out.stdout and "worker-1" in out.stdout
    check = http.get("/admin/cache/check", headers=AUTH).json()
    assert check["ok"] is True and check["pools_checked"] == 2
    assert http.get("/admin/cache/stats").status_code == 401


def test_metrics(http: httpx.Client):
    text = http.get("/metrics").text
    for name in [
        "kvserve_gateway_requests_total",
        "kvserve_gateway_time_to_first_token_seconds_bucket",
        "kvserve_gateway_inter_token_latency_seconds_bucket",
        "kvserve_gateway_prompt_tokens_total",
        "kvserve_gateway_cached_tokens_total",
        "kvserve_gateway_completion_tokens_total",
        "kvserve_gateway_prefix_cache_hit_rate",
        'kvserve_worker_kv_blocks{state="free",worker="worker-0"}',
        'kvserve_worker_kv_blocks{state="referenced",worker="worker-1"}',
        "kvserve_worker_queue_depth",
        "kvserve_worker_preemptions_total",
    ]:
        assert name in text, name


def test_bad_input_is_a_4xx_and_the_system_keeps_serving(http: httpx.Client, client: OpenAI):
    assert http.post("/v1/completions", content=b"{nope").status_code == 400
    resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": -2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    resp = http.post("/v1/completions", json={"prompt": "x" * 5000})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    assert http.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    r = client.completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert r.choices


def test_client_disconnect_cancels_the_request_on_the_worker(http: httpx.Client):
    def live_leases() -> int:
        return sum(p["live_leases"] for p in pool_stats(http).values())

    body = {
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if '"content"' in line and '"content":""' not in line:
                # Generating, on a worker that holds a lease for it: now hang up.
                assert live_leases() == 1
                break
    deadline = time.monotonic() + 15
    while live_leases() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_leases() == 0  # released long before 3000 tokens


def test_killing_a_worker_leaves_the_system_serving(
    system: System, client: OpenAI, http: httpx.Client
):
    prefix = "Fail-over test. " * 10
    r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(prefix, "warm up"), max_tokens=2
    )
    holder = r.headers["x-kvserve-worker"]
    victim = next(w for w in system.workers if w.name == holder)
    survivor = next(w.name for w in system.workers if w is not victim)
    victim.kill()  # SIGKILL: no goodbye to the cache service, its pool still looks alive

    for i in range(3):  # the first of these fails over, the rest avoid the dead worker
        r = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages(prefix, f"after the crash {i}"), max_tokens=2
        )
        assert r.headers["x-kvserve-worker"] == survivor
        assert r.parse().choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model=MODEL, messages=messages("A new prompt", "hi"), max_tokens=2, stream=True
    )
    assert any(c.choices and c.choices[0].finish_reason for c in stream)

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        workers = {w["worker"]: w["healthy"] for w in http.get("/health").json()["workers"]}
        if workers.get(holder) is False:
            break
        time.sleep(0.2)
    assert workers == {holder: False, survivor: True}
