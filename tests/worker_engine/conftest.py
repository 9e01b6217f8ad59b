"""Fixtures: a real cache service and real workers (in-process gRPC servers on 127.0.0.1:0),
and the dense mlx-lm reference on a separate copy of the same model."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kvcache_service.authority import CacheAuthority
from kvcache_service.config import ServiceConfig
from kvcache_service.server import running as cache_running
from kvserve_launch.tls import Dialer
from kvserve_model.tiny_model import TINY_MODEL_NAME
from kvserve_proto.kvcache.v1 import kvcache_pb2 as kpb
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as kpb_grpc
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from worker.config import WorkerConfig
from worker.engine import lookahead
from worker.model.loader import LoadedModel, load_model
from worker.server import RunningWorker
from worker.server import running as worker_running

TOKEN = "engine-test-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]
BS = 16


@pytest.fixture
def model() -> LoadedModel:
    """The embedded default model for this test's workers. Not shared between tests: a
    worker's model thread owns the MLX state the model builds up (streams are per thread)."""
    return load_model(TINY_MODEL_NAME)


@pytest.fixture(scope="session")
def reference() -> Callable[[list[int], int], tuple[list[int], list[float]]]:
    """Dense mlx-lm greedy decoding (its own model copy): tokens and their logprobs."""
    ref = load_model(TINY_MODEL_NAME)

    def run(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        tokens, logprobs = [], []
        for tok, lp in generate_step(
            mx.array(prompt), ref.model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
        ):
            tokens.append(int(tok))
            logprobs.append(float(lp[int(tok)].item()))
        return tokens, logprobs

    return run


@dataclasses.dataclass
class System:
    cache_address: str
    channel: grpc.aio.Channel
    admin: kpb_grpc.KVCacheAdminStub
    workers: list[RunningWorker]
    stubs: list[pb_grpc.WorkerStub]
    stack: contextlib.AsyncExitStack
    model: LoadedModel
    authority: CacheAuthority  # the in-process cache service's state, for tests that watch it
    # Builds the test's own channels to the cache service and to workers serving TLS.
    dialer: Dialer = dataclasses.field(default_factory=Dialer)
    # The decode lookahead of workers added (``worker.engine.lookahead.Policy``'s mode);
    # "default": the worker's own (auto: off on a CPU).
    lookahead: str = "default"

    async def add_worker(self, warmed: bool = True, **overrides) -> pb_grpc.WorkerStub:
        """A worker on the system's cache service; ``warmed``: its background warm-up has
        finished when this returns (as a worker some seconds after its start), so a test's
        forwards are its own."""
        config = dataclasses.replace(
            WorkerConfig(
                model=TINY_MODEL_NAME,
                cache_service=self.cache_address,
                port=0,
                worker_id=f"w{len(self.workers)}",
                block_size=BS,
                num_blocks=256,
                max_step_tokens=64,
            ),
            **overrides,
        )
        w = await self.stack.enter_async_context(worker_running(config, self.model))
        if warmed and w.warming is not None:
            await w.warming
        if self.lookahead != "default":
            w.engine.executor.lookahead = lookahead.Policy(self.lookahead)
        plaintext = not config.tls_cert
        channel = await self.stack.enter_async_context(
            grpc.aio.insecure_channel(w.address) if plaintext else self.dialer.aio(w.address)
        )
        self.workers.append(w)
        self.stubs.append(pb_grpc.WorkerStub(channel))
        return self.stubs[-1]

    async def stats(self, pool: str = "w0") -> kpb.PoolStats:
        resp = await self.admin.GetStats(kpb.StatsRequest(pool_id=pool), metadata=AUTH)
        return resp.pools[0]

    async def wait_idle(self, pool: str = "w0") -> kpb.PoolStats:
        """Waits (up to 5 s) until the pool holds no lease (releases are sent in the
        background), asserts nothing stays referenced, checks integrity; the last stats."""
        for _ in range(100):
            stats = await self.stats(pool)
            if stats.live_leases == 0:
                break
            await asyncio.sleep(0.05)
        assert (stats.live_leases, stats.referenced_blocks) == (0, 0)
        await self.check()
        return stats

    async def check(self) -> None:
        resp = await self.admin.CheckIntegrity(kpb.CheckIntegrityRequest(), metadata=AUTH)
        assert resp.ok, list(resp.problems)


@contextlib.asynccontextmanager
async def started_system(
    model: LoadedModel, tls_ca: str = "", dialer: Dialer | None = None, **service: Any
) -> AsyncIterator[System]:
    """A cache service (`service`: ServiceConfig overrides) and no worker yet. ``tls_ca``: the
    test's own channel to a TLS service verifies it with this CA bundle; ``dialer``: the test's
    channels are built by it instead (a client certificate for mutual TLS)."""
    config = dataclasses.replace(
        ServiceConfig(port=0, admin_token=TOKEN, lease_ttl_s=30), **service
    )
    dialer = dialer or Dialer.from_files(tls_ca)
    async with contextlib.AsyncExitStack() as stack:
        svc = await stack.enter_async_context(cache_running(config))
        channel = await stack.enter_async_context(dialer.aio(svc.address))
        admin = kpb_grpc.KVCacheAdminStub(channel)
        s = System(svc.address, channel, admin, [], [], stack, model, svc.authority, dialer)
        yield s
        await s.check()  # every test ends with the block accounting intact


@pytest.fixture
async def system(model: LoadedModel) -> AsyncIterator[System]:
    async with started_system(model) as s:
        yield s


def request(
    prompt: list[int], max_tokens: int = 32, namespace: str = "", **sampling
) -> pb.GenerateRequest:
    sampling.setdefault("ignore_eos", True)
    return pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling),
        namespace=namespace,
    )


async def generate(stub: pb_grpc.WorkerStub, req: pb.GenerateRequest) -> dict:
    """Runs one request to the end; returns tokens, text, logprobs and the last message."""
    tokens, text, logprobs, last = [], "", [], None
    async for msg in stub.Generate(req):
        tokens += list(msg.token_ids)
        text += msg.text
        logprobs += [lp.logprob for lp in msg.logprobs]
        last = msg
    assert last is not None
    return {"tokens": tokens, "text": text, "logprobs": logprobs, "last": last}
