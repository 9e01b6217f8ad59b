"""Fuzzing the gateway: its gRPC ``worker.v1.Worker`` (messages from the descriptors, raw bytes)
and its HTTP API (requests generated from its own /openapi.json), against a real cache service
and scripted fake workers on loopback.

Each batch proves: no gRPC status outside EXPECTED (never UNKNOWN or INTERNAL), never an HTTP
5xx, every HTTP error in the OpenAI error shape, and afterwards the gateway still serves a good
request correctly and the cache service holds no block for a finished request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.server import running
from gateway.tokenizer import Tokenizer
from kvcache_service.config import ServiceConfig
from kvcache_service.server import running as running_cache
from kvserve_proto.kvcache.v1 import kvcache_pb2 as kv
from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.fuzz import (
    STRINGS,
    LoopThread,
    budget,
    fuzz_worker_bytes,
    fuzz_worker_messages,
    invoke,
    rpcs,
)
from tests.gateway.conftest import ADMIN_TOKEN, gateway_config
from tests.gateway.fake_worker import MODEL, OUTPUT, FakeWorker

EXPECTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
RPCS = rpcs(pb.DESCRIPTOR.services_by_name["Worker"])
ADMIN = [("authorization", f"Bearer {ADMIN_TOKEN}")]


@dataclass
class Target:
    grpc_channel: grpc.Channel
    http: httpx.Client
    cache: grpc.Channel
    grpc_seen: dict[str, set[grpc.StatusCode]] = field(default_factory=dict)
    http_seen: dict[str, set[int]] = field(default_factory=dict)
    calls: int = 0

    def call(self, name: str, request: Any) -> None:
        rpc = next(r for r in RPCS if r.name == name)
        code, _, details = invoke(self.grpc_channel, rpc, request, timeout=20)
        self.calls += 1
        self.grpc_seen.setdefault(name, set()).add(code)
        assert code in EXPECTED, (name, code, details, request)

    def post(self, method: str, path: str, **kw: Any) -> None:
        r = self.http.request(method, path, **kw)
        self.calls += 1
        self.http_seen.setdefault(path, set()).add(r.status_code)
        assert r.status_code < 500, (path, r.status_code, r.text[:500], kw)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert isinstance(err["message"], str) and isinstance(err["type"], str), err

    def settle(self) -> None:
        """A good request on each edge still gets the fake worker's answer, and the cache
        service holds no block and passes its integrity check."""
        rpc = next(r for r in RPCS if r.name == "Generate")
        req = pb.GenerateRequest(prompt_text="Hello", sampling=pb.SamplingParams(max_tokens=8))
        code, out, details = invoke(self.grpc_channel, rpc, req)
        assert code == grpc.StatusCode.OK, details
        assert "".join(m.text for m in out) == OUTPUT[:8]
        r = self.http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 8}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == OUTPUT[:8], r.text
        # A worker releases a request's lease after its last token, which may reach the
        # client first: idle within a few seconds, not at once.
        deadline = time.monotonic() + 10
        while True:
            stats = kv.StatsResponse.FromString(
                self.cache.unary_unary("/kvcache.v1.KVCacheAdmin/GetStats")(
                    kv.StatsRequest().SerializeToString(), metadata=ADMIN, timeout=10
                )
            )
            idle = all((p.referenced_blocks, p.live_leases) == (0, 0) for p in stats.pools)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert idle, stats
        check = kv.CheckIntegrityResponse.FromString(
            self.cache.unary_unary("/kvcache.v1.KVCacheAdmin/CheckIntegrity")(
                b"", metadata=ADMIN, timeout=10
            )
        )
        assert check.ok, list(check.problems)


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    loop = LoopThread()
    tokenizer = Tokenizer.load(MODEL)
    try:
        cache = loop.enter(
            running_cache(ServiceConfig(host="127.0.0.1", port=0, admin_token=ADMIN_TOKEN))
        )
        # Blocks for the longest prompt the model takes: the fake does not queue a request
        # its pool cannot hold (a real worker does), it fails it.
        for i in range(2):
            w = loop.run(FakeWorker(f"w{i}", cache.address, num_blocks=8192).start())
            loop.stack.push_async_callback(w.close)
        gw = loop.enter(running(gateway_config(cache.address), tokenizer))
        loop.run(gw.gateway.poller.poll_once())
        with (
            grpc.insecure_channel(gw.grpc_address) as channel,
            grpc.insecure_channel(cache.address) as cache_channel,
            httpx.Client(base_url=f"http://{gw.http_address}", timeout=30) as http,
        ):
            t = Target(channel, http, cache_channel)
            yield t
            print(f"gateway fuzz: {t.calls} calls; {t.grpc_seen}; {t.http_seen}")
    finally:
        loop.close()


# A JSON-schema-to-strategy for the subset FastAPI and pydantic emit, with hostile values
# mixed in at every level: each value is, some of the time, any JSON at all.
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | STRINGS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(STRINGS, inner, max_size=4),
    max_leaves=8,
)


def from_schema(schema: dict, doc: dict, depth: int = 0) -> st.SearchStrategy[Any]:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return from_schema(doc["components"]["schemas"][name], doc, depth)
    if depth > 4:
        return st.none()
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return st.one_of([from_schema(s, doc, depth) for s in schema[key]])
    t = schema.get("type")
    if t == "object":
        props = {k: from_schema(v, doc, depth + 1) for k, v in schema.get("properties", {}).items()}
        required = set(schema.get("required", []))

        @st.composite
        def obj(draw: st.DrawFn) -> dict:
            out = {}
            for k, s in props.items():
                if k in required or draw(st.booleans()):
                    out[k] = draw(s | ANY_JSON) if draw(st.integers(0, 9)) == 0 else draw(s)
            return out

        return obj()
    if t == "array":
        return st.lists(from_schema(schema.get("items", {}), doc, depth + 1), max_size=6)
    if t == "string":
        return STRINGS
    if t == "integer":
        edges = st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63, -(2**63) - 1, 10**30])
        return st.integers(-5, 300) | edges
    if t == "number":
        return st.floats(-2, 2) | st.sampled_from([0.0, -1e308, 1e308, 1e-320, 3.5])
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    return ANY_JSON


def body_of(doc: dict, path: str) -> dict:
    return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def fuzz_http(target: Target, doc: dict, n: int) -> None:
    posts = ["/v1/completions", "/v1/chat/completions"]
    bodies = {p: from_schema(body_of(doc, p), doc) for p in posts}
    known = {"model": st.just(MODEL), "max_tokens": st.integers(0, 8), "stream": st.booleans()}

    @budget(n)
    @given(st.data())
    def run(data: st.DataObject) -> None:
        kind = data.draw(st.integers(0, 19))
        if kind == 0:
            target.post("GET", data.draw(st.sampled_from(["/v1/models", f"/v1/models/{MODEL}"])))
            return
        path = data.draw(st.sampled_from(posts))
        if kind == 1:  # not JSON, or JSON that is not an object
            raw = data.draw(
                st.binary(max_size=200) | ANY_JSON.map(lambda v: json.dumps(v).encode())
            )
            target.post("POST", path, content=raw, headers={"content-type": "application/json"})
            return
        body = data.draw(bodies[path])
        for k, s in known.items():  # mostly a valid model, so the fuzz gets past that check
            if data.draw(st.integers(0, 3)) > 0:
                body[k] = data.draw(s)
        target.post("POST", path, content=json.dumps(body, allow_nan=True))

    run()
    target.settle()


def test_openapi_declares_bodies_and_errors(target: Target) -> None:
    doc = target.http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        assert body_of(doc, path)["$ref"].endswith("Request")
        assert op["responses"]["4XX"]["content"]["application/json"]["schema"]
    assert doc["paths"]["/v1/models"]["get"]["responses"]["4XX"]


def test_grpc_messages_from_the_descriptors(target: Target) -> None:
    fuzz_worker_messages(target, 1000)


def test_grpc_raw_bytes(target: Target) -> None:
    fuzz_worker_bytes(target, 300)


def test_http_from_the_openapi_schema(target: Target) -> None:
    fuzz_http(target, target.http.get("/openapi.json").json(), 1000)


@pytest.mark.long
@pytest.mark.timeout(3600)  # tens of thousands of inputs: past the default 300 s
def test_many_more(target: Target) -> None:
    fuzz_worker_messages(target, 10_000)
    fuzz_worker_bytes(target, 3_000)
    fuzz_http(target, target.http.get("/openapi.json").json(), 10_000)
