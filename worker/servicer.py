"""worker.v1.Worker over gRPC: GenerateMany (bidirectional streaming), Generate (server
streaming) and GetInfo.

Bad input is answered INVALID_ARGUMENT before the request holds any block. A client that
goes away (cancellation, disconnect) aborts the request and releases its lease. Every other
way a request ends early is a typed error (worker.errors) that STATUS_OF turns into a code.

``GenerateMany`` is how the gateway reaches a worker: one call carries many requests, and a
step's tokens for all of them cost one message (its call's state: ``worker.generate_many``).
``Generate``, one request a call, stays beside it on purpose: it is the contract's simple form
for gRPC clients that talk to a worker directly (tests, ``bench/bench_generate.py``,
``bench/bench_speculative.py``, ``tests/e2e``), and the gateway's fallback for a worker or a
gateway's Worker service that answers GenerateMany UNIMPLEMENTED (``gateway/worker_client.py``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc

from kvserve_model.structured_output import StructuredOutput
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from worker.engine.loop import Engine
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Finish, Sequence, StreamEvent
from worker.engine.token_text import TokenTexts
from worker.errors import (
    CacheOutage,
    CacheRejected,
    Cancelled,
    ConstraintFailed,
    InvalidRequest,
    NotAdmitted,
    Overloaded,
    ShuttingDown,
    StepFailed,
    WorkerError,
)
from worker.generate_many import Session

log = logging.getLogger(__name__)

# How a request that does not finish ends, as the status code its caller acts on. The gateway
# fails over on UNAVAILABLE (and marks the worker unhealthy) and on RESOURCE_EXHAUSTED; anything
# else ends the request there. So one request's failure must never read UNAVAILABLE: a step
# that raised is INTERNAL, and the worker keeps serving. A request the pool cannot hold yet
# waits in the queue (admission control); only a worker that already holds its
# --max-pending-requests refuses one, RESOURCE_EXHAUSTED, before it holds anything.
STATUS_OF: dict[type[WorkerError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ConstraintFailed: grpc.StatusCode.INVALID_ARGUMENT,
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
        event = event.then(nxt)
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
        self.token_texts = TokenTexts(engine.tokenizer)  # logprobs' token texts

    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        if which == "prompt_text":
            return self.engine.intake.tokenize(request.prompt_text)
        raise InvalidRequest("the request has no prompt (prompt_token_ids or prompt_text)")

    async def _grammar(self, request: pb.GenerateRequest) -> Any:
        """The request's structured output, compiled off the event loop (cached); None when
        it has none. Raises InvalidRequest."""
        if not request.sampling.HasField("structured_output"):
            return None
        return await self.engine.intake.grammar(
            StructuredOutput.from_wire(request.sampling.structured_output)
        )

    def _sequence(self, request: pb.GenerateRequest, grammar: Any = None) -> Sequence:
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
            grammar,
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            seq = self._sequence(request, await self._grammar(request))
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
                yield self.response(seq, event)
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
        session = Session(self)
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

    async def admit(self, request: pb.GenerateRequest) -> Sequence | WorkerError:
        """A GenerateMany request as a sequence (:meth:`_sequence`), or the refusal that is its
        answer (one of :data:`REFUSALS`): the call carries on. Awaits only a structured
        output's compilation (cached ones are not awaited), before the room check: the caller
        submits the sequence with no ``await`` after this returns."""
        try:
            grammar = await self._grammar(request)
            return self._sequence(request, grammar)
        except REFUSALS as err:
            return err

    @staticmethod
    def stream_error(err: WorkerError) -> pb.StreamError:
        """How a GenerateMany call tells one of its requests' end by ``err``."""
        return pb.StreamError(code=status_of(err).value[0], message=str(err))

    def response(
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
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            self._prompt_logprobs(seq, resp)
        if event.finish is not None:
            resp.finish_reason = FINISH_REASON[event.finish]
            usage = resp.usage
            usage.prompt_tokens = len(seq.prompt)
            usage.cached_tokens = seq.cached_tokens or 0
            usage.completion_tokens = len(seq.output)
        return resp

    def _prompt_logprobs(self, seq: Sequence, resp: pb.GenerateResponse) -> None:
        """The prompt's logprobs, on the first message once every position has them (a request
        that ends before its prompt is computed, aborted, sends none)."""
        got = seq.prompt_logprobs
        if len(got) < len(seq.prompt) - 1:
            return
        for p in range(1, len(seq.prompt)):
            logprob, rank, top = got[p]
            resp.prompt_logprobs.append(self._token_logprob(seq.prompt[p], logprob, top, rank))
        seq.prompt_logprobs_sent = True

    def _logprob(self, s) -> pb.TokenLogprob:
        return self._token_logprob(s.token, s.logprob, s.top)

    def _token_logprob(
        self, token: int, logprob: float, top: Iterable[tuple[int, float]], rank: int = 0
    ) -> pb.TokenLogprob:
        text = self.token_texts
        return pb.TokenLogprob(
            token_id=token,
            logprob=logprob,
            token=text(token),
            top=[pb.TopLogprob(token_id=t, logprob=lp, token=text(t)) for t, lp in top],
            rank=rank,
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
            tier=self._tier_info(),
            decode_lookahead=e.executor.lookahead.mode,
            decode_lookahead_active=e.executor.lookahead.active,
            lookahead_steps=e.executor.lookahead_hits,
        )

    def _tier_info(self) -> pb.TierInfo | None:
        tiers = self.engine.tiers
        if tiers is None:
            return None
        store, disk, c = tiers.store, tiers.store.disk, tiers.store.counters
        info = pb.TierInfo(
            spilled_blocks=c.spilled_blocks,
            skipped_blocks=c.skipped_blocks,
            loaded_tokens=tiers.loaded_tokens,
            load_failures=c.load_failures,
            read_mb_s=round(store.read_rate / 1e6, 1),
        )
        if disk is not None:
            info.dir = str(disk.dir)
            info.blocks = len(disk)
            info.capacity_blocks = disk.capacity_blocks
            info.write_failures = disk.write_failures
        return info
