"""worker.v1.Worker over gRPC: Generate (server streaming) and GetInfo.

Bad input is answered INVALID_ARGUMENT before the request holds any block. A client that
goes away (cancellation, disconnect) aborts the request and releases its lease. Every other
way a request ends early is a typed error (worker.errors) that STATUS_OF turns into a code.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from worker.engine.loop import Engine
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Finish, Sequence, StreamEvent
from worker.errors import (
    CacheOutage,
    CacheRejected,
    Cancelled,
    InvalidRequest,
    NotAdmitted,
    Overloaded,
    ShuttingDown,
    StepFailed,
    WorkerError,
)

log = logging.getLogger(__name__)

# How a request that does not finish ends, as the status code its caller acts on. The gateway
# fails over on UNAVAILABLE (and marks the worker unhealthy) and on RESOURCE_EXHAUSTED; anything
# else ends the request there. So one request's failure must never read UNAVAILABLE: a step
# that raised is INTERNAL, and the worker keeps serving. A request the pool cannot hold yet
# waits in the queue (admission control); only a worker that already holds its
# --max-pending-requests refuses one, RESOURCE_EXHAUSTED, before it holds anything.
STATUS_OF: dict[type[WorkerError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotAdmitted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CacheOutage: grpc.StatusCode.ABORTED,
    Cancelled: grpc.StatusCode.CANCELLED,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    StepFailed: grpc.StatusCode.INTERNAL,
    CacheRejected: grpc.StatusCode.INTERNAL,
}


# What ``_sequence`` may refuse a request with, before it holds anything: answered for that
# request alone (a GenerateMany call carries on; an uncaught one ended the whole call).
REFUSALS = (Overloaded, InvalidRequest, CacheOutage)


def status_of(err: WorkerError) -> grpc.StatusCode:
    """The table's code for ``err`` (its most specific class); INTERNAL for anything else."""
    for cls in type(err).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL


FINISH_REASON = {
    Finish.STOP: pb.FINISH_REASON_STOP,
    Finish.LENGTH: pb.FINISH_REASON_LENGTH,
    Finish.ABORT: pb.FINISH_REASON_ABORT,
}


async def coalesce(
    event: StreamEvent, queue: asyncio.Queue[StreamEvent], at_least: int = 1
) -> tuple[StreamEvent, StreamEvent | None]:
    """``event`` and the events behind it, as one message: every event already queued, and
    more until it holds ``at_least`` tokens (``--stream-interval``) or the request ends. Also
    the next event to send on its own (an error, which must end the stream after the tokens
    before it), if any.

    A stream whose reader lags (a gateway or client slower than the engine, or an event loop
    busy with other streams) then sends one message for all it has, not one per token: on a
    small model a gRPC message costs more than the forward that made its token."""
    while event.finish is None and (not queue.empty() or len(event.token_ids) < at_least):
        nxt = queue.get_nowait() if not queue.empty() else await queue.get()
        if nxt.error is not None:
            return event, nxt
        event = _joined(event, nxt)
    return event, None


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(
        self,
        engine: Engine,
        worker_id: str,
        model_name: str,
        runner: str = "paged",
        stream_interval: int = 1,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.model_name = model_name
        self.runner = runner  # "paged", or "dense" for models with recurrent state
        # Tokens a stream message carries at least, after the first (--stream-interval).
        self.stream_interval = stream_interval

    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        if which == "prompt_text":
            return self.engine.intake.tokenize(request.prompt_text)
        raise InvalidRequest("the request has no prompt (prompt_token_ids or prompt_text)")

    def _sequence(self, request: pb.GenerateRequest) -> Sequence:
        """The request checked against the worker's limits; raises Overloaded, CacheOutage or
        InvalidRequest (all :data:`REFUSALS`) before it holds anything. The caller submits it with no ``await`` in between, or
        another request could take the room ``check_room`` saw."""
        intake = self.engine.intake
        intake.check_room(self.engine.held_requests)  # before tokenizing: refuse at once
        self.engine.leases.check_reachable()
        return intake.sequence(
            request.request_id or uuid.uuid4().hex,
            self._prompt(request),
            SamplingParams.from_wire(request.sampling),
            request.namespace,
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            seq = self._sequence(request)
        except REFUSALS as err:
            await context.abort(status_of(err), str(err))
            return
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        seq.out = queue
        request_id = seq.request_id
        self.engine.submit(seq)  # no await since check_room: the room is still there
        done = False
        held: StreamEvent | None = None
        interval = 1  # the first token goes out alone, at once: time to first token
        try:
            while not done:
                event = held or await queue.get()
                event, held = await coalesce(event, queue, interval)
                interval = self.stream_interval
                if event.error is not None:
                    await context.abort(status_of(event.error), str(event.error))
                done = event.finish is not None
                yield self._response(seq, event)
        finally:
            if not done:
                log.info("request %s cancelled by the client", request_id)
                self.engine.abort(seq)

    async def GenerateMany(
        self, request_iterator: AsyncIterator[pb.GenerateManyRequest], context: Any
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        """Many requests over one call (the gateway's way to this worker): every event the
        session's requests have when the call can write goes out as one message, so a step's
        tokens for N requests cost one gRPC message instead of N. Ends when the client has
        closed its side and every request it started has ended; the call's end (the client
        gone) aborts what is still running."""
        await context.send_initial_metadata(())  # the client writes once the call is up
        session = _Session(self)
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            while not session.over:
                msg = session.drain(await session.events.get())
                if msg.updates:
                    yield msg
                if session.violation:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, session.violation)
        finally:
            reader.cancel()
            session.abort_all()

    def _response(
        self, seq: Sequence, event: StreamEvent, resp: pb.GenerateResponse | None = None
    ) -> pb.GenerateResponse:
        """``event`` as a GenerateResponse, filled into ``resp`` when given (a GenerateMany
        update's own field: no copy of the message per token)."""
        resp = pb.GenerateResponse() if resp is None else resp
        resp.request_id = seq.request_id
        resp.token_ids.extend(event.token_ids)
        resp.text = event.text
        resp.worker_id = self.worker_id
        if seq.params.logprobs:
            resp.logprobs.extend(self._logprob(s) for s in event.logprobs)
        if event.finish is not None:
            resp.finish_reason = FINISH_REASON[event.finish]
            usage = resp.usage
            usage.prompt_tokens = len(seq.prompt)
            usage.cached_tokens = seq.cached_tokens or 0
            usage.completion_tokens = len(seq.output)
        return resp

    def _logprob(self, s) -> pb.TokenLogprob:
        decode = self.engine.tokenizer.decode
        return pb.TokenLogprob(
            token_id=s.token,
            logprob=s.logprob,
            token=decode([s.token]),
            top=[pb.TopLogprob(token_id=t, logprob=lp, token=decode([t])) for t, lp in s.top],
        )

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.WorkerInfo:
        e = self.engine
        running, waiting = e.load
        return pb.WorkerInfo(
            worker_id=self.worker_id,
            model=self.model_name,
            model_fingerprint=e.registration.model_fingerprint,
            max_context=e.limits.max_context,
            vocab_size=e.limits.vocab_size,
            block_size=e.block_size,
            num_blocks=e.registration.num_blocks,
            free_blocks=max(0, e.registration.num_blocks - e.held_blocks),
            running=running,
            waiting=waiting,
            prefilled_tokens=e.stats.prefilled_tokens,
            generated_tokens=e.stats.generated_tokens,
            preemptions=e.leases.preemptions,
            requests_finished=e.stats.requests_finished,
            runner=self.runner,
            max_pending_requests=e.limits.max_pending_requests,
            draft_tokens=e.stats.draft_tokens,
            accepted_draft_tokens=e.stats.accepted_draft_tokens,
            draft_model=e.limits.draft_model,
        )


class _SessionSink:
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


class _Session:
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
                try:
                    seq = self.servicer._sequence(msg.start)
                except REFUSALS as err:  # this request's answer; the call goes on
                    self.events.put_nowait((stream, err))
                    continue
                seq.out = _SessionSink(self.events, stream)
                self.live[stream] = seq
                engine.submit(seq)  # no await since check_room
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
            merged[stream] = (seq, event if before is None else _joined(before, event))
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
            self.servicer._response(seq, event, out.updates.add(stream=stream).response)
        for stream, err in errors.items():
            code = status_of(err).value[0]
            out.updates.add(stream=stream, error=pb.StreamError(code=code, message=str(err)))
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
    requests: AsyncIterator[pb.GenerateManyRequest], session: _Session
) -> AsyncIterator[pb.GenerateManyRequest]:
    """The call's messages until one does not parse (grpc.aio raises the protobuf error while
    iterating a request stream): that ends the call INVALID_ARGUMENT, as ``kvserve_launch.
    malformed`` answers a unary request's unparsable bytes, not UNKNOWN."""
    try:
        async for msg in requests:
            yield msg
    except DecodeError as e:
        session.violation = f"a message that does not parse as GenerateManyRequest: {e}"


def _joined(a: StreamEvent, b: StreamEvent) -> StreamEvent:
    """``a`` then ``b`` as one event (``b``'s end, if any)."""
    return StreamEvent(
        [*a.token_ids, *b.token_ids], a.text + b.text, [*a.logprobs, *b.logprobs], b.finish
    )
