"""A fake worker for gateway tests: the real ``worker.v1.Worker`` contract without a model.

It registers a pool with a real cache service and leases, commits and releases blocks for
every prompt exactly as a worker would, so the cache service's ``Route`` answers are real and
the gateway's routing can be tested against them. It "generates" a fixed text, one byte token
per step (the default model's tokenizer is byte-level), optionally slowly, and can be told to
fail or be stopped to test fail-over.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from kvserve_proto.kvcache.v1 import kvcache_pb2 as kv
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as kv_grpc
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc

MODEL = "kvserve-tiny-llama"
BLOCK_SIZE = 4
# What every request "generates", one byte token a step, then a stop (an EOS).
OUTPUT = "Hello from the fake worker! It has no model, only this one sentence to say."


@dataclass
class Behaviour:
    """What the fake does on Generate; tests change it between requests."""

    delay_s: float = 0.0
    # Abort every Generate with this status, after `fail_after` tokens (0: before any output).
    fail_with: grpc.StatusCode | None = None
    fail_message: str = "fake failure"
    fail_after: int = 0
    # As a real worker's --max-pending-requests: a Generate beyond this many in flight is
    # refused RESOURCE_EXHAUSTED before it leases anything (0: no limit).
    max_pending: int = 0
    # Serve GenerateMany (the gateway's shared call); False: answer it UNIMPLEMENTED, as a
    # worker that predates it does, so the gateway falls back to one Generate per request.
    multiplex: bool = True
    # Hung: a stopped process's stand-in. The port still takes connections and calls, but no
    # Generate makes progress and GetInfo is not answered, until this is cleared.
    hang: bool = False


@dataclass
class Record:
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    many_calls: int = 0  # GenerateMany calls served (the gateway shares one per worker)


class FakeWorker(pb_grpc.WorkerServicer):
    def __init__(self, worker_id: str, cache_address: str, num_blocks: int = 256) -> None:
        self.worker_id = worker_id
        self.cache_address = cache_address
        self.num_blocks = num_blocks
        self.behaviour = Behaviour()
        self.record = Record()
        self.running = 0
        self.pending = 0  # Generate calls in flight, leased or not
        self.runner = "paged"
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.port = 0
        self._channel: grpc.aio.Channel | None = None
        self._pool: kv.PoolRef | None = None

    async def start(self, port: int = 0) -> FakeWorker:
        self.server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{self.port}"
        await self.server.start()
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.cache_address)
            await self.register()
        return self

    async def register(self) -> None:
        assert self._channel is not None
        resp = await kv_grpc.KVCacheServiceStub(self._channel).RegisterPool(
            kv.RegisterPoolRequest(
                pool_id=self.worker_id,
                model_fingerprint="fake",
                layout=kv.PoolLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32"),
                num_blocks=self.num_blocks,
                block_size=BLOCK_SIZE,
                worker_address=self.address,
                model=MODEL,
            )
        )
        self._pool = kv.PoolRef(pool_id=self.worker_id, incarnation=resp.incarnation)

    async def stop(self) -> None:
        """Stop serving (the pool stays registered, as when a worker process dies)."""
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None

    async def close(self) -> None:
        await self.stop()
        if self._channel is not None:
            await self._channel.close()

    async def _acquire(self, request: pb.GenerateRequest, prompt: list[int]) -> kv.Lease:
        stub = kv_grpc.KVCacheServiceStub(self._channel)
        while True:
            resp = await stub.AcquireLease(
                kv.AcquireLeaseRequest(
                    pool=self._pool,
                    namespace=request.namespace,
                    prompt_token_ids=prompt,
                    reserve_tokens=min(request.sampling.max_tokens, 2 * BLOCK_SIZE),
                    allow_defer=True,
                )
            )
            if resp.WhichOneof("result") == "lease":
                return resp.lease
            await asyncio.sleep(0.01)

    async def Generate(self, request, context):
        self.record.requests.append(request)
        b = self.behaviour
        if b.fail_with is not None and not b.fail_after:
            await context.abort(b.fail_with, b.fail_message)
        if b.max_pending and self.pending >= b.max_pending:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this worker holds {self.pending} requests (--max-pending-requests "
                f"{b.max_pending})",
            )
        self.pending += 1
        try:
            async with aclosing(self._generate(request, context)) as stream:
                async for msg in stream:
                    yield msg
        finally:
            self.pending -= 1

    async def GenerateMany(self, request_iterator, context):
        """The shared call over the same behaviour as Generate: each started request runs
        Generate as a task, its messages and its abort become this call's updates, a cancel
        cancels its task."""
        if not self.behaviour.multiplex:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        self.record.many_calls += 1
        await context.send_initial_metadata(())  # as the worker: the client writes after it
        out: asyncio.Queue = asyncio.Queue()
        tasks: dict[int, asyncio.Task] = {}

        async def run(stream: int, request: pb.GenerateRequest) -> None:
            try:
                async for msg in self.Generate(request, _ItemContext()):
                    out.put_nowait(pb.StreamUpdate(stream=stream, response=msg))
            except _Abort as a:
                error = pb.StreamError(code=a.code.value[0], message=a.details)
                out.put_nowait(pb.StreamUpdate(stream=stream, error=error))
            finally:
                tasks.pop(stream, None)
                out.put_nowait(None)

        async def read() -> None:
            async for msg in request_iterator:
                if msg.WhichOneof("action") == "start":
                    tasks[msg.stream] = asyncio.create_task(run(msg.stream, msg.start))
                elif (task := tasks.pop(msg.stream, None)) is not None:
                    task.cancel()
            out.put_nowait("eof")

        reader = asyncio.create_task(read())
        reading = True
        try:
            while reading or tasks or not out.empty():
                items = [await out.get()]
                while not out.empty():
                    items.append(out.get_nowait())
                reading = reading and "eof" not in items
                updates = [i for i in items if isinstance(i, pb.StreamUpdate)]
                if updates:
                    yield pb.GenerateManyResponse(updates=updates)
        finally:
            reader.cancel()
            for task in list(tasks.values()):
                task.cancel()

    async def _generate(self, request, context):
        b = self.behaviour
        while b.hang:
            await asyncio.sleep(0.05)
        prompt = list(request.prompt_token_ids.ids)
        lease = await self._acquire(request, prompt)
        stub = kv_grpc.KVCacheServiceStub(self._channel)
        out: list[int] = []
        self.running += 1
        released = False
        try:
            # 0: as many as fit; the fake's output ends (a stop) before any pool would.
            limit = request.sampling.max_tokens or len(OUTPUT) + 1
            n = min(limit, len(OUTPUT))
            for i in range(n):
                if b.fail_with is not None and i == b.fail_after:
                    await context.abort(b.fail_with, b.fail_message)
                if b.delay_s:
                    await asyncio.sleep(b.delay_s)
                token = ord(OUTPUT[i])
                out.append(token)
                last = i == n - 1
                msg = pb.GenerateResponse(
                    request_id=request.request_id,
                    token_ids=[token],
                    text=chr(token),
                    worker_id=self.worker_id,
                )
                if request.sampling.logprobs:
                    top = [
                        pb.TopLogprob(token_id=token + k, logprob=-0.5 - k, token=chr(token + k))
                        for k in range(request.sampling.logprobs)
                    ]
                    msg.logprobs.append(
                        pb.TokenLogprob(token_id=token, logprob=-0.5, token=chr(token), top=top)
                    )
                if last:
                    length = n == limit
                    msg.finish_reason = pb.FINISH_REASON_LENGTH if length else pb.FINISH_REASON_STOP
                    msg.usage.CopyFrom(
                        pb.Usage(
                            prompt_tokens=len(prompt),
                            cached_tokens=lease.cached_tokens,
                            completion_tokens=len(out),
                        )
                    )
                    # As a real worker does: the last message goes out once the release that
                    # indexes the prompt is answered (a follow-up finds it cached).
                    released = True
                    await self._release(stub, lease, prompt)
                yield msg
            self.record.finished.append(request.request_id)
        except asyncio.CancelledError:
            self.record.cancelled.append(request.request_id)
            raise
        finally:
            self.running -= 1
            if not released:
                await self._release(stub, lease, prompt)

    async def _release(self, stub, lease, prompt: list[int]) -> None:
        await stub.ReleaseLease(
            kv.ReleaseLeaseRequest(pool=self._pool, lease_id=lease.lease_id, token_ids=prompt)
        )

    async def GetInfo(self, request, context):
        while self.behaviour.hang:
            await asyncio.sleep(0.05)
        return pb.WorkerInfo(
            worker_id=self.worker_id,
            model=MODEL,
            max_context=4096,
            vocab_size=264,
            block_size=BLOCK_SIZE,
            num_blocks=self.num_blocks,
            free_blocks=self.num_blocks,
            running=self.running,
            waiting=self.pending - self.running,
            runner=self.runner,
            max_pending_requests=self.behaviour.max_pending,
        )


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _ItemContext:
    """The one ServicerContext method Generate uses, for a request inside GenerateMany."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Abort(code, details)
