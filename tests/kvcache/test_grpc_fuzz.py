"""Fuzzing the cache service over real gRPC: every data-plane and admin RPC, with no token, a
wrong one, the service token and the admin token, with messages generated from the protos'
descriptors (tests/fuzz.py) and with raw bytes that are not a message at all.

Each batch proves: no status outside EXPECTED (never UNKNOWN or INTERNAL: an unmapped
exception), the service still answers a good request correctly, and once the leases the fuzz
was granted are released no block is left referenced and ``CheckIntegrity`` passes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import given
from hypothesis import strategies as st

from kvcache_service.config import ServiceConfig
from kvcache_service.server import running
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from tests.fuzz import LoopThread, Rpc, budget, invoke, messages, mutated, rpcs

SERVICE_TOKEN = "fuzz-service-token"
ADMIN_TOKEN = "fuzz-admin-token"
SERVICE = [("authorization", f"Bearer {SERVICE_TOKEN}")]
ADMIN = [("authorization", f"Bearer {ADMIN_TOKEN}")]
CREDENTIALS = st.sampled_from(
    [
        [],
        SERVICE,
        ADMIN,
        [("authorization", "Bearer wrong")],
        [("authorization", f"Basic {SERVICE_TOKEN}")],
        [("authorization", f"bearer {ADMIN_TOKEN}  ")],
        [("authorization", "Bearer " + "x" * 4000)],
    ]
)
EXPECTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
}
# What one item of a batch may answer (its call answered OK).
CODES = {c.value[0]: c for c in grpc.StatusCode}
ITEM_CODES = {
    "AcquireLeases": {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
    },
    "ReleaseLeases": {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND},
}
RPCS = rpcs(pb.DESCRIPTOR.services_by_name["KVCacheService"]) + rpcs(
    pb.DESCRIPTOR.services_by_name["KVCacheAdmin"]
)
BS = 4
LAYOUT = pb.PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")


@dataclass
class Target:
    address: str
    channel: grpc.Channel
    pool: pb.PoolRef
    granted: list[tuple[pb.PoolRef, int]] = field(default_factory=list)
    seen: dict[str, set[grpc.StatusCode]] = field(default_factory=dict)
    calls: int = 0

    def call(self, rpc: Rpc, request: Message | bytes, metadata) -> None:
        # A stream (WatchEvents) never ends by itself: its first message is the answer.
        code, out, details = invoke(
            self.channel, rpc, request, metadata, max_responses=1 if rpc.streaming else 0
        )
        self.calls += 1
        self.seen.setdefault(rpc.name, set()).add(code)
        assert code in EXPECTED, (rpc.name, code, details, request)
        if isinstance(request, bytes) and code == grpc.StatusCode.OK:
            # Mutated bytes the service accepted: read them (and its answers) as it did, so
            # what it granted is released in settle() and its item errors are checked too.
            request = rpc.request.FromString(request)
            out = [rpc.response.FromString(o) if isinstance(o, bytes) else o for o in out]
        if code == grpc.StatusCode.OK and rpc.name == "AcquireLease":
            assert isinstance(request, pb.AcquireLeaseRequest)
            if out[0].WhichOneof("result") == "lease":
                self.granted.append((request.pool, out[0].lease.lease_id))
        if code == grpc.StatusCode.OK and rpc.name == "AcquireLeases":
            assert isinstance(request, pb.AcquireLeasesRequest)
            assert len(out[0].results) == len(request.items)
            for r in out[0].results:
                if r.WhichOneof("result") == "lease":
                    self.granted.append((request.pool, r.lease.lease_id))
                elif r.WhichOneof("result") == "error":
                    assert CODES[r.error.code] in ITEM_CODES["AcquireLeases"], r.error
        if code == grpc.StatusCode.OK and rpc.name == "ReleaseLeases":
            for r in out[0].results:
                if r.HasField("error"):
                    assert CODES[r.error.code] in ITEM_CODES["ReleaseLeases"], r.error

    def settle(self) -> None:
        """Releases what the fuzz was granted; then the service must hold no reference, pass
        its integrity check, and serve a good lease cycle as if nothing had happened."""
        kv = {r.name: r for r in RPCS}
        for ref, lease_id in self.granted:
            invoke(
                self.channel,
                kv["ReleaseLease"],
                pb.ReleaseLeaseRequest(pool=ref, lease_id=lease_id),
                SERVICE,
            )
        self.granted.clear()
        code, out, details = invoke(self.channel, kv["GetStats"], pb.StatsRequest(), ADMIN)
        assert code == grpc.StatusCode.OK, details
        stats = out
        held = {p.pool_id: (p.referenced_blocks, p.live_leases) for p in out[0].pools}
        assert all(v == (0, 0) for v in held.values()), held
        code, out, details = invoke(
            self.channel, kv["CheckIntegrity"], pb.CheckIntegrityRequest(), ADMIN
        )
        assert code == grpc.StatusCode.OK and out[0].ok, (details, list(out[0].problems))

        # A good request after the storm: register (again: the fuzz may have re-registered
        # the pool), lease, commit, and find the committed prefix from another request.
        live = {p.pool_id: p.incarnation for p in stats[0].pools}  # the GetStats above
        reg = register(self.channel, live.get("w1", 0))
        prompt = list(range(1, 10))
        code, out, details = invoke(
            self.channel,
            kv["AcquireLease"],
            pb.AcquireLeaseRequest(pool=reg, namespace="check", prompt_token_ids=prompt),
            SERVICE,
        )
        assert code == grpc.StatusCode.OK, details
        lease = out[0].lease
        code, out, details = invoke(
            self.channel,
            kv["ReleaseLease"],
            pb.ReleaseLeaseRequest(pool=reg, lease_id=lease.lease_id, token_ids=prompt),
            SERVICE,
        )
        # Two full blocks and the last token's (a tail: a longer prompt would reuse it).
        assert code == grpc.StatusCode.OK and out[0].indexed_tokens == 9, details
        code, out, details = invoke(
            self.channel,
            kv["Lookup"],
            pb.LookupRequest(pool_id="w1", namespace="check", prompt_token_ids=prompt),
            ADMIN,
        )
        assert code == grpc.StatusCode.OK and out[0].pools[0].cached_tokens == 8, details
        self.pool = reg


def register(channel: grpc.Channel, incarnation: int = 0) -> pb.PoolRef:
    """Registers pool w1; a live pool only by its worker, which names its incarnation."""
    rpc = next(r for r in RPCS if r.name == "RegisterPool")
    code, out, details = invoke(
        channel,
        rpc,
        pb.RegisterPoolRequest(
            pool_id="w1",
            model_fingerprint="fp",
            layout=LAYOUT,
            num_blocks=64,
            block_size=BS,
            worker_address="127.0.0.1:1",
            model="tiny",
            incarnation=incarnation,
        ),
        SERVICE,
    )
    assert code == grpc.StatusCode.OK, details
    return pb.PoolRef(pool_id="w1", incarnation=out[0].incarnation)


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    config = ServiceConfig(
        host="127.0.0.1",
        port=0,
        admin_token=ADMIN_TOKEN,
        service_token=SERVICE_TOKEN,
        lease_ttl_s=30,
        sweep_interval_s=0.05,
        max_pool_blocks=4096,
        max_pools=8,
    )
    loop = LoopThread()
    try:
        svc = loop.enter(running(config))
        with grpc.insecure_channel(svc.address) as channel:
            t = Target(svc.address, channel, register(channel))
            yield t
            print(f"cache service fuzz: {t.calls} calls; statuses per RPC: {t.seen}")
    finally:
        loop.close()


def hints(t: Target) -> dict[str, st.SearchStrategy]:
    """Values that pass the first checks, so the fuzz gets behind them."""
    tokens = st.integers(0, 1000)
    packed = st.lists(tokens, max_size=64).map(
        lambda ids: b"".join(i.to_bytes(4, "little") for i in ids)
    )
    return {
        "prompt_tokens": packed,
        "appended_tokens": packed,
        "appended_from": st.integers(0, 64),
        "written_tokens": st.integers(0, 64),
        "pool": st.just(t.pool),
        "pool_id": st.sampled_from(["w1", "w2", ""]),
        "incarnation": st.just(t.pool.incarnation),
        "lease_id": st.integers(1, 64),
        "namespace": st.sampled_from(["", "a", "tenant-1"]),
        "prompt_token_ids": tokens,
        "token_ids": tokens,
        "num_blocks": st.integers(0, 64),
        "block_size": st.sampled_from([BS, 0, 3, 16]),
        "reserve_tokens": st.integers(0, 64),
        "num_tokens": st.integers(0, 64),
        "model": st.just("tiny"),
        "layout": st.just(LAYOUT),
    }


def fuzz_messages(target: Target, n: int) -> None:
    strategies = {r.name: messages(r.request, hints(target)) for r in RPCS}

    @budget(n)
    @given(st.data())
    def run(data: st.DataObject) -> None:
        rpc = data.draw(st.sampled_from(RPCS), label="rpc")
        target.call(rpc, data.draw(strategies[rpc.name]), data.draw(CREDENTIALS))

    run()
    target.settle()


def fuzz_bytes(target: Target, n: int) -> None:
    @budget(n)
    @given(st.data())
    def run(data: st.DataObject) -> None:
        rpc = data.draw(st.sampled_from(RPCS), label="rpc")
        good = data.draw(messages(rpc.request, hints(target))).SerializeToString()
        target.call(rpc, data.draw(mutated(good)), data.draw(CREDENTIALS))

    run()
    target.settle()


def test_messages_from_the_descriptors(target: Target) -> None:
    fuzz_messages(target, 1000)


def test_raw_bytes(target: Target) -> None:
    fuzz_bytes(target, 500)


def test_messages_at_the_size_limit(target: Target) -> None:
    """The largest messages: just under the 64 MiB receive limit, and just over it."""
    acquire = next(r for r in RPCS if r.name == "AcquireLease")
    for n in (16 * 1024 * 1024 - 16, 17 * 1024 * 1024):  # int32s of 4 bytes packed
        target.call(
            acquire,
            pb.AcquireLeaseRequest(pool=target.pool, prompt_token_ids=[2**30] * n),
            SERVICE,
        )
    target.call(
        acquire, pb.AcquireLeaseRequest(pool=target.pool, namespace="n" * 60_000_000), SERVICE
    )
    target.settle()


@pytest.mark.long
@pytest.mark.timeout(3600)  # tens of thousands of inputs: past the default 300 s
def test_many_more_messages(target: Target) -> None:
    fuzz_messages(target, 20_000)
    fuzz_bytes(target, 10_000)
