"""Fuzzing a real MLX worker's gRPC edge (``worker.v1.Worker``): messages generated from the
proto's descriptors (tests/fuzz.py) and raw bytes, against the tiny model on loopback with a
real cache service behind it.

Each accepted request really runs the model, so a stream is read for at most a few responses
and then cancelled, as a client that goes away does: that path is fuzzed too. Each batch
proves: no status outside EXPECTED (never UNKNOWN or INTERNAL), and afterwards the worker is
idle, no lease or referenced block is left at the cache service, ``CheckIntegrity`` passes, and
a greedy request gives exactly the tokens it gave before the fuzz (nothing was poisoned).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from kvcache_service.config import ServiceConfig
from kvcache_service.server import running as running_cache
from kvserve_model.tiny_model import TINY_MODEL_NAME
from kvserve_proto.kvcache.v1 import kvcache_pb2 as kv
from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.fuzz import (
    LoopThread,
    fuzz_worker_bytes,
    fuzz_worker_messages,
    fuzz_worker_sessions,
    invoke,
    rpcs,
)
from worker.config import WorkerConfig
from worker.model.loader import load_model
from worker.server import running as running_worker

SERVICE_TOKEN = "fuzz-service-token"
ADMIN_TOKEN = "fuzz-admin-token"
ADMIN = [("authorization", f"Bearer {ADMIN_TOKEN}")]
EXPECTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
RPCS = {r.name: r for r in rpcs(pb.DESCRIPTOR.services_by_name["Worker"])}
GOOD = pb.GenerateRequest(
    prompt_token_ids=pb.TokenIds(ids=[5, 17, 99, 3, 250, 42, 7, 8]),
    sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True),
)


@dataclass
class Target:
    worker: grpc.Channel
    cache: grpc.Channel
    greedy: list[int]
    seen: dict[str, set[grpc.StatusCode]] = field(default_factory=dict)
    calls: int = 0
    many_tokens: int = 0  # tokens GenerateMany calls streamed back

    def call(self, name: str, request: Any) -> None:
        code, _, details = invoke(self.worker, RPCS[name], request, timeout=60, max_responses=3)
        self.calls += 1
        self.seen.setdefault(name, set()).add(code)
        assert code in EXPECTED, (name, code, details, request)

    def call_many(self, msgs: Any) -> None:
        """One GenerateMany call: every message sent, then a few responses read and the call
        cancelled (a gateway that goes away), or read to its end."""
        call = self.worker.stream_stream(
            RPCS["GenerateMany"].path,
            request_serializer=pb.GenerateManyRequest.SerializeToString,
            response_deserializer=pb.GenerateManyResponse.FromString,
        )(iter(msgs), timeout=60)
        self.calls += 1
        codes = set()
        try:
            for i, response in enumerate(call):
                self.many_tokens += sum(len(u.response.token_ids) for u in response.updates)
                codes |= {
                    grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == u.error.code))
                    for u in response.updates
                    if u.WhichOneof("kind") == "error"
                }
                if i == 3:
                    call.cancel()
                    break
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        self.seen.setdefault("GenerateMany", set()).add(code)
        assert code in EXPECTED | {grpc.StatusCode.CANCELLED}, (code, msgs)
        assert codes <= EXPECTED, (codes, msgs)  # never INTERNAL or UNKNOWN for a request

    def admin(self, method: str, request: Any, response: Any) -> Any:
        call = self.cache.unary_unary(f"/kvcache.v1.KVCacheAdmin/{method}")
        return response.FromString(call(request.SerializeToString(), metadata=ADMIN, timeout=10))

    def settle(self) -> None:
        """The worker is idle with nothing held at the cache service, and still gives the
        greedy tokens it gave before the fuzz."""
        deadline = time.monotonic() + 30
        while True:  # cancelled streams end on the worker's next step; releases follow
            _, (info,), _ = invoke(self.worker, RPCS["GetInfo"], pb.GetInfoRequest())
            stats = self.admin("GetStats", kv.StatsRequest(), kv.StatsResponse)
            idle = (info.running, info.waiting) == (0, 0) and all(
                (p.live_leases, p.referenced_blocks) == (0, 0) for p in stats.pools
            )
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert idle, (info, stats)
        check = self.admin("CheckIntegrity", kv.CheckIntegrityRequest(), kv.CheckIntegrityResponse)
        assert check.ok, list(check.problems)
        assert greedy(self.worker) == self.greedy


def greedy(channel: grpc.Channel) -> list[int]:
    code, out, details = invoke(channel, RPCS["Generate"], GOOD, timeout=60)
    assert code == grpc.StatusCode.OK, details
    return [t for m in out for t in m.token_ids]


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    loop = LoopThread()
    try:
        cache = loop.enter(
            running_cache(
                ServiceConfig(
                    port=0, admin_token=ADMIN_TOKEN, service_token=SERVICE_TOKEN, lease_ttl_s=30
                )
            )
        )
        config = WorkerConfig(
            cache_service=cache.address,
            cache_token=SERVICE_TOKEN,
            port=0,
            worker_id="w0",
            block_size=16,
            num_blocks=256,
            max_step_tokens=128,
        )
        worker = loop.enter(running_worker(config, load_model(TINY_MODEL_NAME)))
        with (
            grpc.insecure_channel(worker.address) as channel,
            grpc.insecure_channel(cache.address) as cache_channel,
        ):
            t = Target(channel, cache_channel, greedy(channel))
            yield t
            print(f"worker fuzz: {t.calls} calls; {t.seen}")
    finally:
        loop.close()


def test_messages_from_the_descriptors(target: Target) -> None:
    fuzz_worker_messages(target, 1_000)
    # Some of the fuzz must get past the edge's checks, or it only proves the checks refuse.
    assert grpc.StatusCode.OK in target.seen["Generate"]


@pytest.mark.parametrize("namespace", ["\ud7a4", "a\nb", "\x1b[2J", "n" * 257])
def test_namespaces_the_cache_service_would_refuse(target: Target, namespace: str) -> None:
    """Found by this fuzz: the worker queued a namespace the cache service refuses, and its
    lease's rejection ended the request INTERNAL. The worker checks the service's own rule
    (announced at registration) at its edge."""
    request = pb.GenerateRequest()
    request.CopyFrom(GOOD)
    request.namespace = namespace
    code, _, details = invoke(target.worker, RPCS["Generate"], request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in details, details
    target.settle()


def test_generate_many_sessions(target: Target) -> None:
    fuzz_worker_sessions(target, 200)
    assert grpc.StatusCode.OK in target.seen["GenerateMany"]
    assert grpc.StatusCode.INVALID_ARGUMENT in target.seen["GenerateMany"]  # collisions
    assert target.many_tokens > 0  # some requests got past the edge and ran the model


def test_raw_bytes(target: Target) -> None:
    fuzz_worker_bytes(target, 300)


@pytest.mark.long
@pytest.mark.timeout(3600)  # tens of thousands of inputs: past the default 300 s
def test_many_messages(target: Target) -> None:
    fuzz_worker_messages(target, 10_000)
    fuzz_worker_bytes(target, 3_000)
