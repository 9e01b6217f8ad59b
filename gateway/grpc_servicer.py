"""The gRPC edge: the workers' own ``worker.v1.Worker`` service, served by the gateway.

gRPC clients can use the gateway as their single address: ``Generate`` is routed (and
failed over) exactly like the OpenAI endpoints, and ``GetInfo`` describes the whole fleet
(blocks and load summed over the workers the gateway knows). A text prompt is tokenized here,
since routing needs token ids.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

import grpc

from gateway import convert
from gateway.concurrency import client_of_peer
from gateway.core import Gateway
from gateway.errors import GatewayError, InvalidRequest, mapping_of
from gateway.generation import GenerationRequest, check_sampling
from kvserve_model.sampling_params import SamplingParams
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc

GATEWAY_ID = "gateway"


class GatewayWorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def generation_request(self, request: pb.GenerateRequest) -> GenerationRequest:
        """The request checked as the HTTP edge checks it, sizes before any tokenizing."""
        tokenizer = self.gw.tokenizer
        limits = self.gw.serving.limits
        limits.check_namespace(request.namespace, param="namespace")
        which = request.WhichOneof("prompt")
        if which == "prompt_text":
            limits.check_prompt_chars(len(request.prompt_text))
            ids = await tokenizer.encode_async(request.prompt_text)
        elif which == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            if len(ids) >= self.gw.serving.max_context:
                self.gw.serving.completion_budget(len(ids), None)  # raises: it cannot fit
            tokenizer.check_token_ids(ids, "prompt_token_ids")
        else:
            raise InvalidRequest("the request has no prompt", param="prompt")
        sampling = SamplingParams.from_wire(request.sampling)
        check_sampling(sampling, tokenizer.vocab_size)
        budget = self.gw.serving.completion_budget(len(ids), sampling.max_tokens or None)
        return GenerationRequest(
            request_id=request.request_id or f"grpc-{uuid.uuid4().hex}",
            prompt_token_ids=tuple(ids),
            # Unset stays 0: as many as fit, which the worker decides (its pool may hold
            # fewer tokens than the context).
            sampling=replace(sampling, max_tokens=budget if sampling.max_tokens else 0),
            namespace=request.namespace,
        )

    async def GenerateMany(self, request_iterator, context):
        """Workers' call for a gateway (many requests over one stream); the gateway serves
        Generate. UNIMPLEMENTED, which tells a client to fall back to Generate."""
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "GenerateMany is served by workers; call Generate on the gateway",
        )
        yield  # an async generator, as the streaming handler must be

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.perf_counter()
        status = "OK"
        try:
            # The slot is held to the end of the stream, whichever way it ends: a cancelled
            # call is cancelled where it waits, or closed where it yielded.
            with self.gw.concurrency.held(client_of_peer(context.peer())):
                gen = await self.generation_request(request)
                async with aclosing(self.gw.dispatcher.generate(gen, arrival)) as stream:
                    async for chunk in stream:
                        yield convert.chunk_to_pb(chunk, gen.request_id)
        except GatewayError as e:
            code = mapping_of(e).grpc_code
            status = code.name
            await context.abort(code, e.message)
        except asyncio.CancelledError:  # the client went away: the worker call is cancelled
            status = "CANCELLED"
            raise
        finally:
            self.gw.metrics.requests.labels("grpc Generate", status).inc()
            self.gw.metrics.request_latency.labels("grpc Generate").observe(
                time.perf_counter() - arrival
            )

    async def GetInfo(
        self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.WorkerInfo:
        info = pb.WorkerInfo(
            worker_id=GATEWAY_ID,
            model=self.gw.config.model_name,
            max_context=self.gw.serving.max_context,  # what a request can use
            vocab_size=self.gw.tokenizer.vocab_size,
        )
        limits: list[int] = []
        for w in self.gw.directory.views():
            if not w.healthy or w.load is None:
                continue
            load = w.load
            info.block_size = info.block_size or load.block_size
            info.num_blocks += load.num_blocks
            info.free_blocks += load.free_blocks
            info.running += load.running
            info.waiting += load.waiting
            info.preemptions += load.preemptions
            info.requests_finished += load.requests_finished
            limits.append(load.max_pending)
        # The fleet's limit is the sum of the workers'; one without a limit makes it unlimited.
        info.max_pending_requests = 0 if 0 in limits else sum(limits)
        return info
