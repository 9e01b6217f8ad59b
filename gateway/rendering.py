"""One request's chunks as OpenAI objects: one response, or Server-Sent Events. Written once
for both endpoints; ``chat`` and ``completions`` say only what differs (their object types, a
choice's message or delta versus its text, the shape of logprobs).

Non-streaming: every choice's chunks are collected into one object. Streaming: the first chunk
is awaited before the response starts (so routing and early worker errors still get a real
status code), then each chunk is an event, optionally followed by a usage event, then
``data: [DONE]``; an error after the first chunk is an error event before ``[DONE]``.
"""

from __future__ import annotations

import codecs
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel

from gateway.errors import (
    ContextLengthExceeded,
    GatewayError,
    RequestAborted,
    UpstreamError,
    error_body,
)
from gateway.generation import Chunk, Completion, FinishReason, TokenLogprob, Usage
from gateway.openai_serving import Served
from gateway.protocol import PromptLogprobsOut, PromptTokensDetails, SamplingRequest, UsageInfo
from gateway.streams import SSE_DONE, merge, sse
from kvserve_model.token_bytes import bytes_of

log = logging.getLogger(__name__)

Merged = AsyncGenerator[tuple[int, Chunk], None]


@dataclass(slots=True)
class UsageTotals:
    """Usage of a request from its sequences' usage: the prompt (and its cached part) counts
    once per prompt, generated tokens once per choice, as OpenAI counts ``n``."""

    n: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    seen: set[int] = field(default_factory=set)

    def add(self, choice: int, usage: Usage) -> None:
        if choice in self.seen:
            return
        self.seen.add(choice)
        if choice % self.n == 0:
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_tokens
        self.completion_tokens += usage.completion_tokens

    def info(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )


def check_finished(chunk: Chunk) -> None:
    """A sequence the worker aborted on its own (shutdown, lost lease) is an error: the
    client did not cancel it, or nobody would be reading."""
    if chunk.finish_reason is FinishReason.ABORT:
        raise RequestAborted("the worker aborted the request; retry it")


def finish(reason: FinishReason | None) -> str | None:
    return str(reason) if reason else None


def text_offsets(tokens: Sequence[str], start: int) -> list[int]:
    """Each token's offset in the text (characters), from ``start``: a token that ends
    within a character adds nothing, the one that completes it adds the character (as the
    text the client gets grows)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offsets = []
    for token in tokens:
        offsets.append(start)
        start += len(decoder.decode(bytes_of(token)))
    return offsets


def prompt_logprobs_out(lps: Sequence[TokenLogprob], top: int) -> PromptLogprobsOut:
    """vLLM's ``prompt_logprobs`` of a prompt whose tokens after the first have ``lps``: None
    for the first, then the token's own entry and its ``top`` alternatives by id."""
    out: PromptLogprobsOut = [None]
    for lp in lps:
        entry = {
            str(t.token_id): {"logprob": t.logprob, "rank": k, "decoded_token": t.token}
            for k, t in enumerate(lp.top[:top], start=1)
        }
        entry[str(lp.token_id)] = {
            "logprob": lp.logprob,
            "rank": lp.rank or None,
            "decoded_token": lp.token,
        }
        out.append(entry)
    return out


async def prime(merged: Merged) -> tuple[int, Chunk]:
    """The first chunk of a stream, awaited before the HTTP response starts: routing and
    worker errors that come before any token still get a proper status code."""
    try:
        first = await anext(merged, None)
    except BaseException:
        await merged.aclose()
        raise
    if first is None:
        raise UpstreamError("the worker ended the stream without output")
    return first


class Renderer(ABC):
    """Renders one request's chunks (``n`` samples per prompt) as one endpoint's objects."""

    # The whole response, and each event of a stream: built from id, created, model,
    # choices and usage.
    response_type: ClassVar[type[BaseModel]]
    event_type: ClassVar[type[BaseModel]]
    # The request's field the prompt came in, for an error about its length from a worker.
    prompt_param: ClassVar[str] = "prompt"

    def __init__(self, request_id: str, model: str, created: int, n: int) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.n = n
        self._envelope_dump: dict[str, Any] | None = None  # see _envelope

    @abstractmethod
    def choice(self, index: int, done: Completion) -> BaseModel:
        """Choice ``index`` of the whole response, from all its chunks."""

    @abstractmethod
    def delta(self, index: int, chunk: Chunk) -> BaseModel:
        """One chunk of choice ``index``, as a stream event's choice."""

    def opening(self) -> list[BaseModel]:
        """Choices sent before the first chunk, an event each."""
        return []

    def trim(self, event: dict[str, Any]) -> dict[str, Any]:
        """A stream event's JSON, as sent."""
        return event

    async def serve(
        self, streams: Sequence[AsyncGenerator[Chunk, None]], req: SamplingRequest
    ) -> Served:
        """The response to ``req`` from its choices' ``streams``: one object once every
        choice is done, or the events of a stream once its first chunk is in."""
        merged = merge(streams)
        headers = {"x-request-id": self.request_id}
        try:
            if not req.stream:
                body, workers = await self.collect(merged)
                headers["x-kvserve-worker"] = ",".join(workers)
                return Served(headers, body=body)
            first = await prime(merged)
        except ContextLengthExceeded as e:
            # Every worker refused it as longer than its KV pool holds (the dispatcher's,
            # which does not know the endpoint): name the field, as the gateway's own check.
            e.param = e.param or self.prompt_param
            raise
        headers["x-kvserve-worker"] = first[1].worker_id
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Served(headers, events=self.events(first, merged, include_usage))

    async def collect(self, merged: Merged) -> tuple[BaseModel, list[str]]:
        """The whole response, and the worker of each choice."""
        results: dict[int, Completion] = {}
        async with aclosing(merged):
            async for i, chunk in merged:
                check_finished(chunk)
                results.setdefault(i, Completion()).add(chunk)
        usage = UsageTotals(self.n)
        choices = []
        for i in sorted(results):
            done = results[i]
            if done.usage is not None:
                usage.add(i, done.usage)
            choices.append(self.choice(i, done))
        body = self._object(self.response_type, choices, usage.info(), **self.extras(results))
        return body, [results[i].worker_id for i in sorted(results)]

    def extras(self, results: dict[int, Completion]) -> dict[str, Any]:
        """Top-level fields of the whole response beyond OpenAI's, from its choices."""
        return {}

    async def events(
        self, first: tuple[int, Chunk], merged: Merged, include_usage: bool
    ) -> AsyncIterator[str]:
        usage = UsageTotals(self.n)
        try:
            async with aclosing(merged):
                for choice in self.opening():
                    yield self._event([choice])
                item: tuple[int, Chunk] | None = first
                while item is not None:
                    i, chunk = item
                    check_finished(chunk)
                    if chunk.usage is not None:
                        usage.add(i, chunk.usage)
                    choice = self.delta(i, chunk)
                    if chunk.text or chunk.logprobs or chunk.finish_reason:
                        # (a token whose bytes end mid-character has no text yet: no event)
                        yield self._event([choice])
                    item = await anext(merged, None)
            if include_usage:
                yield self._event([], usage)
        except GatewayError as e:
            yield sse(error_body(e)[1])
        except Exception as e:
            log.exception("stream %s failed", self.request_id)
            yield sse(error_body(e)[1])
        yield SSE_DONE

    def _object(
        self,
        kind: type[BaseModel],
        choices: list[BaseModel],
        usage: UsageInfo | None,
        **extras: Any,
    ) -> BaseModel:
        return kind(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            **extras,
        )

    def _event(self, choices: list[BaseModel], usage: UsageTotals | None = None) -> str:
        if usage is None:  # an event per token: only its choices are dumped each time
            body = {**self._envelope(), "choices": [c.model_dump(mode="json") for c in choices]}
            return sse(self.trim(body))
        event = self._object(self.event_type, choices, usage.info())
        return sse(self.trim(event.model_dump(mode="json")))

    def _envelope(self) -> dict[str, Any]:
        """A stream event's fields but its choices (which stay in their place), dumped once
        a request; without ``usage``: only the usage event carries the field."""
        envelope = self._envelope_dump
        if envelope is None:
            envelope = self._object(self.event_type, [], None).model_dump(mode="json")
            envelope.pop("usage")
            self._envelope_dump = envelope
        return envelope
