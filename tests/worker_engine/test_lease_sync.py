"""The lease sync against the real cache-service domain, in process: no gRPC, no model.

The worker's real lease client calls the real servicer in this process (``InProcessStub``):
messages go through bytes both ways, errors through the service's and the client's status
tables, so only the transport is left out. A seeded random
walk then drives the worker's side (requests arriving, admission, steps that grow and publish,
finishes, client aborts, missed heartbeats that expire every lease, a cache service that
restarts and forgets the pool) and after every operation checks, once the calls in flight
have landed:

- the authority's own integrity check passes;
- every running sequence's lease is live at the authority with the block table the worker
  holds, and no live lease belongs to nobody (a leak);
- at the end, with every request ended, no block is referenced.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import grpc
import pytest

from kvcache_service.authority import AuthorityConfig, CacheAuthority
from kvcache_service.ids import PoolId
from kvcache_service.servicer import KVCacheServicer
from worker.engine.lease import (
    Fenced,
    Lease,
    LeaseAsk,
    LeaseLost,
    NoRoom,
    PoolRegistration,
    Rejected,
    Written,
)
from worker.engine.lease_sync import LeasePolicy, LeaseSync
from worker.engine.sampling_params import Sampled, SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, TextStream
from worker.errors import WorkerError
from worker.lease_client import LeaseClient

BS = 4
TTL = 10.0
POOL = PoolId("w0")
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25], [40, 41]]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _RpcError(grpc.aio.AioRpcError):
    """What a call's status becomes at the client, as the transport would raise it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Context:
    """The servicer's view of a call: no metadata (the test service has no token)."""

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _RpcError(code, details)


class InProcessStub:
    """``KVCacheServiceStub``'s calls answered by the real servicer in this process. The
    messages go through bytes both ways, so the worker's lease client, both sides' protos and
    the service's conversions all run: only the transport is left out."""

    def __init__(self, servicer: KVCacheServicer) -> None:
        self.servicer = servicer

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        handler = getattr(self.servicer, name)

        async def call(request, timeout=None, metadata=None):  # type: ignore[no-untyped-def]
            await asyncio.sleep(0)  # a real call yields to the loop: let others interleave
            wire = type(request).FromString(request.SerializeToString())
            response = await handler(wire, _Context())
            return type(response).FromString(response.SerializeToString())

        return call


class _NoChannel:
    """Enough of a channel to build the client; its stub is replaced by InProcessStub."""

    def unary_unary(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        return None

    def unary_stream(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        return None  # WatchEvents: the stub builds it; the lease client never calls it

    async def close(self) -> None:
        pass


def in_process_client(servicer: KVCacheServicer) -> LeaseClient:
    client = LeaseClient("in-process", channel=_NoChannel())  # type: ignore[arg-type]
    client._stub = InProcessStub(servicer)  # type: ignore[assignment]
    return client


class _Detokenizer:
    """Text for the sequences' streams: one character per token."""

    def __init__(self) -> None:
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = chr(65 + token % 26)

    def finalize(self) -> None:
        self.last_segment = ""


@dataclass
class Walk:
    rng: random.Random
    clock: FakeClock = field(default_factory=FakeClock)
    ended: list[Sequence] = field(default_factory=list)
    arrivals: int = 0

    def __post_init__(self) -> None:
        self.authority = self.new_authority()
        self.servicer = KVCacheServicer(self.authority)
        self.client = in_process_client(self.servicer)
        self.scheduler = Scheduler(max_batch_size=4, max_step_tokens=16, max_context=256)
        self.sync = LeaseSync(
            self.client,  # type: ignore[arg-type]
            PoolRegistration("w0", 12, BS, "m", "fp", "127.0.0.1:1", 1, 1, 4, "float32"),
            LeasePolicy(
                max_batch_size=4, reserve_tokens=4, extend_ahead_tokens=2, prefix_caching=True
            ),
            self.scheduler,
            step_lock=asyncio.Lock(),
            wake_steps=lambda: None,
            end=self.end,
        )

    def new_authority(self) -> CacheAuthority:
        return CacheAuthority(AuthorityConfig(lease_ttl_s=TTL), clock=self.clock)

    def end(self, seq: Sequence, error: WorkerError) -> None:
        """What the engine does to end a request."""
        self.scheduler.end(seq, error)
        self.sync.release(seq)
        self.ended.append(seq)

    # -- operations ---------------------------------------------------------------------------

    def submit(self) -> None:
        self.arrivals += 1
        prompt = list(self.rng.choice(PREFIXES)) + [
            self.rng.randrange(100, 120) for _ in range(self.rng.randint(0, 9))
        ]
        params = SamplingParams(max_tokens=self.rng.randint(1, 24))
        self.scheduler.add(
            Sequence(
                request_id=f"r{self.arrivals}",
                prompt=prompt,
                params=params,
                namespace=self.rng.choice(["", "", "t"]),
                max_tokens=params.max_tokens,
                arrival=float(self.arrivals),
                sampler=None,  # type: ignore[arg-type]  # the walk samples itself
                text=TextStream(_Detokenizer(), (), False),
                eos_ids=frozenset(),
                block_size=BS,
            )
        )
        self.sync.wake_admission()

    async def admit(self) -> None:
        await self.sync._admit_pass()

    async def step(self) -> None:
        self.sync.extend_ahead()
        await self.settle()
        step = self.scheduler.schedule()
        if step is None:
            return
        sampled = [
            Sampled(self.rng.randrange(100, 200)) if item.samples else None for item in step.items
        ]
        finished = self.scheduler.postprocess(step, sampled)
        self.sync.publish(step)
        for seq in finished:
            self.sync.release(seq)
            self.ended.append(seq)

    def abort(self) -> None:
        live = [*self.scheduler.running, *self.scheduler.waiting]
        if live:
            self.end(self.rng.choice(live), WorkerError("cancelled"))

    async def heartbeat(self) -> None:
        await self.sync._heartbeat_once()

    async def lapse(self) -> None:
        """The worker went silent for more than a TTL: every lease of the pool expires."""
        self.clock.now += TTL * 1.5
        await self.sync._heartbeat_once()

    async def restart_service(self) -> None:
        """The cache service restarted: a new authority that never heard of the pool."""
        self.authority = self.servicer.auth = self.new_authority()
        await self.sync._heartbeat_once()

    # -- checks -------------------------------------------------------------------------------

    async def settle(self) -> None:
        """Lets every call in flight land (releases, commits, an extension, a recovery)."""
        for _ in range(200):
            ext = self.sync._extension
            if not self.sync._background and (ext is None or ext.done()):
                assert not self.sync._releases.pending, "releases queued with nobody sending them"
                return
            await asyncio.sleep(0)
        raise AssertionError("calls in flight never landed")

    def check(self) -> None:
        assert self.authority.check_integrity() == []
        pool = self.authority.pools.get(POOL)
        live = dict(pool.leases.live) if pool is not None else {}
        for seq in self.scheduler.running:
            assert seq.lease is not None, seq.request_id
            held = live.pop(seq.lease.lease_id, None)
            assert held is not None, f"{seq.request_id} runs on a lease the service lost"
            assert list(held.table) == seq.block_table, seq.request_id
        assert not live, f"leases nobody holds: {sorted(live)}"


async def walk(seed: int, steps: int = 300) -> Walk:
    w = Walk(random.Random(seed))
    await w.sync._register()
    ops = [
        (w.submit, 5),
        (w.admit, 5),
        (w.step, 12),
        (w.abort, 1),
        (w.heartbeat, 2),
        (w.lapse, 0.3),
        (w.restart_service, 0.3),
    ]
    fns, weights = zip(*ops, strict=True)
    for _ in range(steps):
        result = w.rng.choices(fns, weights)[0]()
        if asyncio.iscoroutine(result):
            await result
        await w.settle()
        w.check()
    for seq in [*w.scheduler.running, *w.scheduler.waiting]:
        w.end(seq, WorkerError("the walk is over"))
    await w.settle()
    w.check()
    assert w.authority.pools[POOL].referenced_blocks == 0
    return w


async def test_random_walks_keep_the_books() -> None:
    walks = [await walk(seed) for seed in range(12)]
    # What the walks went through, or they prove little: requests finished by length within
    # their max_tokens, preemptions, expiries and recoveries all happened.
    finished = [s for w in walks for s in w.ended if not s.aborted]
    assert finished and all(len(s.output) <= s.max_tokens for s in finished)
    assert sum(w.sync.preemptions for w in walks) > 0


async def test_a_lease_error_is_typed_by_the_real_tables() -> None:
    """Statuses go through the service's table and the client's, for whole calls and for
    one item of a batch alike."""
    walk = Walk(random.Random(0))
    await walk.sync._register()
    (unknown,) = await walk.client.release([(12345, None)])
    assert isinstance(unknown, LeaseLost)
    asks = [LeaseAsk([1, 2, 3], "", 0, False), LeaseAsk([4] * 999, "", 0, False)]
    (granted, no_room), _ = await walk.client.acquire(asks)
    assert isinstance(granted, Lease) and isinstance(no_room, NoRoom)
    (refused,) = await walk.client.release([(granted.lease_id, Written(9, 5, [5]))])
    assert isinstance(refused, Rejected)  # appends past what the lease knows: kept live
    (released,) = await walk.client.release([(granted.lease_id, None)])
    assert released is None
    (bad,), _ = await walk.client.acquire([LeaseAsk([1], "\x00", 0, False)])
    assert isinstance(bad, Rejected)
    walk.client.incarnation += 1
    with pytest.raises(Fenced):
        await walk.client.heartbeat()
