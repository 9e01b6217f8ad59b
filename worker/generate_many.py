"""One GenerateMany call's state: the client's stream numbers to the sequences they started,
the events those produced, and the tokens held back for ``--stream-interval``.

A call carries many requests (the gateway's way to a worker): every event its requests have when
the call can write goes out as one message, so a step's tokens for N requests cost one gRPC
message instead of N. The servicer (``worker.servicer.WorkerServicer.GenerateMany``) runs the
call; this module keeps its books. A request refused at intake is that request's answer (the
call carries on); a message no client may send ends the call INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from kvserve_proto.worker.v1 import worker_pb2 as pb
from worker.engine.sequence import Sequence, StreamEvent
from worker.errors import WorkerError

if TYPE_CHECKING:
    from worker.servicer import WorkerServicer

log = logging.getLogger(__name__)


class SessionSink:
    """A request's event sink inside a GenerateMany call: the call's one queue, tagged with
    the client's stream number."""

    __slots__ = ("_events", "_stream")

    def __init__(
        self, events: asyncio.Queue[tuple[int, StreamEvent | WorkerError | None]], stream: int
    ) -> None:
        self._events = events
        self._stream = stream

    def put_nowait(self, item: StreamEvent, /) -> None:
        self._events.put_nowait((self._stream, item))


class Session:
    """One GenerateMany call's requests: the client's stream numbers to sequences, the events
    they produced, and the tokens held back for ``--stream-interval``."""

    def __init__(self, servicer: WorkerServicer) -> None:
        self.servicer = servicer
        # (stream, event); a WorkerError: the request was refused; None: the client is done.
        self.events: asyncio.Queue[tuple[int, StreamEvent | WorkerError | None]] = asyncio.Queue()
        self.live: dict[int, Sequence] = {}
        self.sent: set[int] = set()  # streams whose first message went out
        self.held: dict[int, StreamEvent] = {}  # tokens waiting for --stream-interval
        self.reading = True
        # A message no client may send (the call ends INVALID_ARGUMENT, its requests aborted).
        self.violation = ""

    @property
    def over(self) -> bool:
        return not self.reading and not self.live

    async def read(self, requests: AsyncIterator[pb.GenerateManyRequest]) -> None:
        engine = self.servicer.engine
        try:
            async for msg in _parsed(requests, self):
                stream = msg.stream
                if msg.WhichOneof("action") == "cancel":
                    seq = self.live.pop(stream, None)
                    self.held.pop(stream, None)
                    self.sent.discard(stream)
                    if seq is not None:
                        log.info("request %s cancelled by the client", seq.request_id)
                        engine.abort(seq)
                    continue
                if msg.WhichOneof("action") != "start":
                    self.violation = f"stream {stream}: a message with neither start nor cancel"
                    return
                if stream in self.live:
                    self.violation = f"stream {stream} is already in use by a live request"
                    return
                started = await self.servicer.admit(msg.start)
                if isinstance(started, WorkerError):  # refused: this request's answer
                    self.events.put_nowait((stream, started))
                    continue
                started.out = SessionSink(self.events, stream)
                self.live[stream] = started
                engine.submit(started)  # no await since check_room
        finally:
            self.events.put_nowait((0, None))

    def drain(self, first: tuple[int, StreamEvent | WorkerError | None]) -> pb.GenerateManyResponse:
        """``first`` and every event queued behind it, as one message: each request's events
        merged into one response (tokens held back for ``--stream-interval`` included), an
        error after the tokens before it."""
        items = [first]
        while not self.events.empty():
            items.append(self.events.get_nowait())
        merged: dict[int, tuple[Sequence, StreamEvent]] = {}
        errors: dict[int, WorkerError] = {}
        for stream, event in items:
            if event is None:
                self.reading = False
                continue
            if isinstance(event, WorkerError):
                errors[stream] = event  # refused at admission: it was never live
                continue
            seq = self.live.get(stream)
            if seq is None:
                continue  # cancelled by the client: nothing more is sent for it
            if event.error is not None:
                errors[stream] = event.error
                del self.live[stream]
                if stream not in merged and stream in self.held:
                    merged[stream] = (seq, self.held.pop(stream))
                continue
            before = merged[stream][1] if stream in merged else self.held.pop(stream, None)
            merged[stream] = (seq, event if before is None else before.then(event))
            if event.finish is not None:
                del self.live[stream]
        out = pb.GenerateManyResponse()
        interval = self.servicer.stream_interval
        for stream, (seq, event) in merged.items():
            ends = event.finish is not None or stream in errors
            if not ends and stream in self.sent and len(event.token_ids) < interval:
                self.held[stream] = event
                continue
            self.sent.add(stream)
            self.servicer.response(seq, event, out.updates.add(stream=stream).response)
        for stream, err in errors.items():
            out.updates.add(stream=stream, error=self.servicer.stream_error(err))
        for stream in [*errors, *(s for s, (_, e) in merged.items() if e.finish is not None)]:
            self.sent.discard(stream)
            self.held.pop(stream, None)
        return out

    def abort_all(self) -> None:
        for seq in self.live.values():
            log.info("request %s cancelled: its GenerateMany call ended", seq.request_id)
            self.servicer.engine.abort(seq)
        self.live.clear()


async def _parsed(
    requests: AsyncIterator[pb.GenerateManyRequest], session: Session
) -> AsyncIterator[pb.GenerateManyRequest]:
    """The call's messages until one does not parse (grpc.aio raises the protobuf error while
    iterating a request stream): that ends the call INVALID_ARGUMENT, as ``kvserve_launch.
    malformed`` answers a unary request's unparsable bytes, not UNKNOWN."""
    try:
        async for msg in requests:
            yield msg
    except DecodeError as e:
        session.violation = f"a message that does not parse as GenerateManyRequest: {e}"
