"""gRPC client of the workers' ``Generate`` and ``GetInfo``, one channel per address.

Channels are cheap to keep and expensive to open (a TCP and HTTP/2 handshake per request
would add a round trip to every time-to-first-token), so :class:`WorkerClients` keeps one per
worker address for the gateway's lifetime and closes those of workers that went away.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from gateway import convert
from gateway.errors import WorkerSilent, WorkerUnavailable, from_rpc_error, from_status
from gateway.generation import Chunk, GenerationRequest
from kvserve_launch.grpc_status import status_code
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # A dead worker should fail the next call fast, not after a long reconnect backoff.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 30_000),
]


# Builds the channel to an address with these options: plaintext, or TLS (gateway.core).
Connect = Callable[[str, Sequence[tuple[str, Any]]], grpc.aio.Channel]


def plaintext(address: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=list(options))


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's ``GetInfo``, the fields the gateway uses."""

    worker_id: str
    model: str
    max_context: int
    vocab_size: int
    block_size: int
    num_blocks: int
    free_blocks: int
    running: int
    waiting: int
    preemptions: int
    requests_finished: int
    runner: str = ""  # "paged" or "dense" (recurrent state); "" from a worker that predates it
    # Most requests it holds, running + waiting (--max-pending-requests); 0: no limit (or a
    # worker that predates it).
    max_pending: int = 0


class WorkerClient:
    """One worker's ``Generate`` stream and ``GetInfo`` over a shared channel."""

    def __init__(
        self, address: str, connect: Connect | None = None, multiplex: bool = True
    ) -> None:
        self.address = address
        self.channel = (connect or plaintext)(address, CHANNEL_OPTIONS)
        self.stub = pb_grpc.WorkerStub(self.channel)
        # Requests share one GenerateMany call until the worker says it has none.
        self.multiplex = multiplex
        self._session: _Session | None = None

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        """The worker's chunks for ``request``, over the call this client shares with the
        other requests it sends the worker (``GenerateMany``), or its own ``Generate`` call
        where the worker does not offer that. Cancelling the consumer (or closing this
        generator) cancels the request on the worker."""
        if self.multiplex:
            if self._session is None or self._session.ended:
                self._session = _Session(self.stub, self.address)
            stream = self._session.start(convert.request_to_pb(request))
            try:
                async for chunk in stream:
                    yield chunk
                return
            except _Unimplemented:
                log.info("worker %s has no GenerateMany: one call per request", self.address)
                self.multiplex = False
        async for chunk in self._generate_alone(request):
            yield chunk

    async def _generate_alone(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        call = self.stub.Generate(convert.request_to_pb(request))
        try:
            async for msg in call:
                yield convert.chunk_from_pb(msg)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"worker {self.address}") from e
        finally:
            if not call.done():
                call.cancel()

    async def get_info(self, timeout_s: float, wait_for_ready: bool = False) -> WorkerLoad:
        """The worker's load. ``wait_for_ready`` waits (up to the timeout) for the channel to
        reconnect instead of failing at once while it backs off from an earlier failure: how
        a worker marked unhealthy is probed, so a restarted one is noticed promptly."""
        try:
            info = await self.stub.GetInfo(
                pb.GetInfoRequest(), timeout=timeout_s, wait_for_ready=wait_for_ready
            )
        except grpc.aio.AioRpcError as e:
            # UNAVAILABLE becomes WorkerUnavailable (a health mark); a timeout WorkerSilent.
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not wait_for_ready:
                raise WorkerSilent(
                    f"worker {self.address} did not answer GetInfo within {timeout_s:g} s"
                ) from e
            raise from_rpc_error(e, f"worker {self.address}") from e
        return WorkerLoad(
            worker_id=info.worker_id,
            model=info.model,
            max_context=info.max_context,
            vocab_size=info.vocab_size,
            block_size=info.block_size,
            num_blocks=info.num_blocks,
            free_blocks=info.free_blocks,
            running=info.running,
            waiting=info.waiting,
            preemptions=info.preemptions,
            requests_finished=info.requests_finished,
            runner=info.runner,
            max_pending=info.max_pending_requests,
        )

    async def close(self) -> None:
        if self._session is not None:
            self._session.close()
        await self.channel.close()


class _Unimplemented(Exception):
    """The worker has no GenerateMany (one that predates it, or a gateway's Worker service)."""


class _Outbox:
    """A ``GenerateMany`` call's request stream: messages go out in order once the worker has
    answered the call (``open``), and the stream ends at ``end``.

    An iterator object, not an async generator, and ended with its call: gRPC consumes it in a
    task of its own, and when a call ended (a worker killed) while that task waited for the
    next message, the task was never finished. Once the session was dropped (the worker
    restarted on its address, a new call opened) the gateway logged "Task was destroyed but it
    is pending" for it, and the generator's finalizer "aclose(): asynchronous generator is
    already running"."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[pb.GenerateManyRequest | None] = asyncio.Queue()
        self._open = asyncio.Event()

    def __aiter__(self) -> _Outbox:
        return self

    async def __anext__(self) -> pb.GenerateManyRequest:
        await self._open.wait()
        msg = await self._queue.get()
        if msg is None:
            self._queue.put_nowait(None)  # ended for good: any later read ends too
            raise StopAsyncIteration
        return msg

    def put(self, msg: pb.GenerateManyRequest) -> None:
        self._queue.put_nowait(msg)

    def open(self) -> None:
        self._open.set()

    def end(self) -> None:
        self._queue.put_nowait(None)
        self._open.set()


class _Session:
    """One ``GenerateMany`` call, shared by the requests this gateway sends one worker.

    Requests are numbered in the call; a reader task hands each update to its request's
    queue. A request's own failure arrives as a ``StreamError`` and ends that request only;
    the call's failure (the worker gone, the connection lost) ends every request on it with
    the call's status, and the next request opens a new call."""

    def __init__(self, stub: pb_grpc.WorkerStub, address: str) -> None:
        self.address = address
        self._outbox = _Outbox()  # opened once the worker answered the call
        self._call = stub.GenerateMany(self._outbox)
        self._queues: dict[int, asyncio.Queue[pb.StreamUpdate | BaseException]] = {}
        self._next = 0
        self.ended = False
        self._error: BaseException = WorkerUnavailable(f"worker {address}: call ended")
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        err: BaseException
        try:
            # Nothing is written before the worker has answered the call: a worker without
            # GenerateMany ends it at once (UNIMPLEMENTED), and a write racing that end would
            # turn the status into another one, losing the fallback.
            await self._call.initial_metadata()
            if not self._call.done():
                self._outbox.open()
            async for msg in self._call:
                for update in msg.updates:
                    queue = self._queues.get(update.stream)
                    if queue is not None:
                        queue.put_nowait(update)
            err = WorkerUnavailable(f"worker {self.address}: its GenerateMany call ended")
        except grpc.aio.AioRpcError as e:
            err = (
                _Unimplemented()
                if e.code() == grpc.StatusCode.UNIMPLEMENTED
                else from_rpc_error(e, f"worker {self.address}")
            )
        except asyncio.CancelledError:
            err = WorkerUnavailable(f"worker {self.address}: the gateway closed the call")
        finally:
            self._outbox.end()  # gRPC's task reading it finishes with the call
        self.ended = True
        self._error = err
        for queue in self._queues.values():
            queue.put_nowait(copy.copy(err))

    async def start(self, request: pb.GenerateRequest) -> AsyncIterator[Chunk]:
        """The request's chunks; raises its error, the call's, or _Unimplemented."""
        if self.ended:
            raise copy.copy(self._error)
        stream = self._next = self._next + 1
        queue: asyncio.Queue[pb.StreamUpdate | BaseException] = asyncio.Queue()
        self._queues[stream] = queue
        self._outbox.put(pb.GenerateManyRequest(stream=stream, start=request))
        done = False
        try:
            while not done:
                update = await queue.get()
                if isinstance(update, BaseException):
                    done = True  # nothing to cancel: the call is over
                    raise update
                if update.WhichOneof("kind") == "error":
                    done = True
                    code = status_code(update.error.code) or grpc.StatusCode.UNKNOWN
                    raise from_status(code, update.error.message, f"worker {self.address}")
                chunk = convert.chunk_from_pb(update.response)
                done = chunk.finish_reason is not None
                yield chunk
        finally:
            del self._queues[stream]
            if not done and not self.ended:
                self._outbox.put(pb.GenerateManyRequest(stream=stream, cancel=True))

    def close(self) -> None:
        self._outbox.end()
        self._reader.cancel()


class WorkerClients:
    """The client of every worker address in use. Only the event loop thread touches it."""

    def __init__(self, connect: Connect | None = None) -> None:
        self._clients: dict[str, WorkerClient] = {}
        self._connect = connect

    def get(self, address: str) -> WorkerClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = WorkerClient(address, self._connect)
        return client

    async def retain(self, addresses: Iterable[str]) -> None:
        """Close the channels of addresses no longer in use."""
        keep = set(addresses)
        for address in [a for a in self._clients if a not in keep]:
            log.info("closing channel to departed worker %s", address)
            await self._clients.pop(address).close()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
