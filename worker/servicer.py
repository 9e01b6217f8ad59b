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

import grpc

from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from worker.engine.loop import Engine
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Finish, Sequence, StreamEvent
from worker.errors import (
    CacheRejected,
    Cancelled,
    InvalidRequest,
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
    Cancelled: grpc.StatusCode.CANCELLED,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    StepFailed: grpc.StatusCode.INTERNAL,
    CacheRejected: grpc.StatusCode.INTERNAL,
}


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
        event = StreamEvent(
            [*event.token_ids, *nxt.token_ids],
            event.text + nxt.text,
            [*event.logprobs, *nxt.logprobs],
            nxt.finish,
        )
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

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        try:
            intake = self.engine.intake
            intake.check_room(self.engine.held_requests)  # before tokenizing: refuse at once
            seq = intake.sequence(
                request_id,
                self._prompt(request),
                SamplingParams.from_wire(request.sampling),
                request.namespace,
            )
        except (Overloaded, InvalidRequest) as err:
            await context.abort(status_of(err), str(err))
            return
        self.engine.submit(seq)  # no await since check_room: the room is still there
        done = False
        held: StreamEvent | None = None
        interval = 1  # the first token goes out alone, at once: time to first token
        try:
            while not done:
                event = held or await seq.out.get()
                event, held = await coalesce(event, seq.out, interval)
                interval = self.stream_interval
                if event.error is not None:
                    await context.abort(status_of(event.error), str(event.error))
                done = event.finish is not None
                yield self._response(seq, event)
        finally:
            if not done:
                log.info("request %s cancelled by the client", request_id)
                self.engine.abort(seq)

    def _response(self, seq: Sequence, event: StreamEvent) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(
            request_id=seq.request_id,
            token_ids=event.token_ids,
            text=event.text,
            worker_id=self.worker_id,
            logprobs=[self._logprob(s) for s in event.logprobs if seq.params.logprobs],
        )
        if event.finish is not None:
            resp.finish_reason = FINISH_REASON[event.finish]
            resp.usage.CopyFrom(
                pb.Usage(
                    prompt_tokens=len(seq.prompt),
                    cached_tokens=seq.cached_tokens or 0,
                    completion_tokens=len(seq.output),
                )
            )
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
