"""gRPC client of the workers' ``Generate`` and ``GetInfo``, one channel per address.

Channels are cheap to keep and expensive to open (a TCP and HTTP/2 handshake per request
would add a round trip to every time-to-first-token), so :class:`WorkerClients` keeps one per
worker address for the gateway's lifetime and closes those of workers that went away.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from gateway import convert
from gateway.errors import from_rpc_error
from gateway.generation import Chunk, GenerationRequest
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

    def __init__(self, address: str, connect: Connect | None = None) -> None:
        self.address = address
        self.channel = (connect or plaintext)(address, CHANNEL_OPTIONS)
        self.stub = pb_grpc.WorkerStub(self.channel)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        """The worker's chunks for ``request``. Cancelling the consumer (or closing this
        generator) cancels the call, and with it the request on the worker."""
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
            # UNAVAILABLE becomes WorkerUnavailable (a health mark); a timeout does not.
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
        await self.channel.close()


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
