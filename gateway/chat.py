"""POST /v1/chat/completions: messages through the model's chat template, OpenAI
``chat.completion`` (or ``chat.completion.chunk`` events) out."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from gateway.errors import GatewayError, InvalidRequest, error_body
from gateway.generation import Chunk, Completion, TokenLogprob
from gateway.openai_serving import OpenAIServing, Served, UsageTotals, check_finished, prime
from gateway.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprobOut,
)
from gateway.streams import SSE_DONE, merge, sse

log = logging.getLogger(__name__)

Merged = AsyncGenerator[tuple[int, Chunk], None]


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: content as one string (text parts joined)."""
    out = []
    for k, m in enumerate(messages):
        msg = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(
                        "only text content parts are supported", param=f"messages.{k}.content"
                    )
                texts.append(part["text"])
            msg["content"] = "\n".join(texts)
        elif m.content is None:
            msg["content"] = ""
        out.append(msg)
    return out


class ChatServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.s = serving

    def check(self, req: ChatCompletionRequest) -> None:
        if req.tools and req.tool_choice != "none":
            raise InvalidRequest("tool calling is not supported", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise InvalidRequest(
                "only the text response_format is supported", param="response_format"
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        if req.continue_final_message and req.messages[-1].role != "assistant":
            raise InvalidRequest(
                "continue_final_message needs a final assistant message", param="messages"
            )

    async def create(self, req: ChatCompletionRequest, arrival: float) -> Served:
        model = self.s.check_model(req.model)
        self.check(req)
        self.s.check_common(req, req.n)
        messages = template_messages(req.messages)
        chars = sum(len(m["content"]) for m in messages)
        self.s.limits.check_prompt_chars(chars, param="messages")
        prompt = await self.s.tokenizer.apply_chat_template_async(
            messages,
            chars,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=req.chat_template_kwargs,
        )
        max_tokens = req.max_completion_tokens or req.max_tokens
        budget = self.s.tokenizer.completion_budget(
            len(prompt), max_tokens, prompt_param="messages"
        )
        top = req.top_logprobs or 0
        request_id = self.s.new_id("chatcmpl")
        sequences = self.s.sequences(
            request_id, req, [prompt], [budget], max(1, top) if req.logprobs else 0
        )
        merged = merge(self.s.open(sequences, arrival))
        headers = {"x-request-id": request_id}
        view = _View(request_id, model, self.s.created(), top if req.logprobs else None, req.n)
        if not req.stream:
            body, workers = await view.collect(merged)
            headers["x-kvserve-worker"] = ",".join(workers)
            return Served(headers, body=body)
        first = await prime(merged)
        headers["x-kvserve-worker"] = first[1].worker_id
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Served(headers, events=view.events(first, merged, include_usage))


class _View:
    """Renders one request's chunks as OpenAI chat objects."""

    def __init__(
        self, request_id: str, model: str, created: int, top_logprobs: int | None, n: int
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.top_logprobs = top_logprobs
        self.n = n

    def _logprobs(self, lps: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    token=lp.token,
                    logprob=lp.logprob,
                    bytes=list(lp.token.encode()),
                    top_logprobs=[
                        TopLogprobOut(
                            token=t.token, logprob=t.logprob, bytes=list(t.token.encode())
                        )
                        for t in lp.top[: self.top_logprobs]
                    ],
                )
                for lp in lps
            ]
        )

    async def collect(self, merged: Merged) -> tuple[ChatCompletionResponse, list[str]]:
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
            choices.append(
                ChatChoice(
                    index=i,
                    message=ChatMessageOut(content=done.text),
                    logprobs=self._logprobs(done.logprobs),
                    finish_reason=str(done.finish_reason) if done.finish_reason else None,
                )
            )
        body = ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage.info(),
        )
        return body, [results[i].worker_id for i in sorted(results)]

    def _event(self, choices: list[ChatChunkChoice], usage: UsageTotals | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage.info() if usage else None,
        )
        body = chunk.model_dump(mode="json")
        if usage is None:
            body.pop("usage")
        for choice in body["choices"]:  # a delta carries only what changed: {} at the end
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return sse(body)

    async def events(
        self, first: tuple[int, Chunk], merged: Merged, include_usage: bool
    ) -> AsyncIterator[str]:
        usage = UsageTotals(self.n)
        try:
            async with aclosing(merged):
                for i in range(self.n):
                    role = DeltaMessage(role="assistant", content="")
                    yield self._event([ChatChunkChoice(index=i, delta=role)])
                item: tuple[int, Chunk] | None = first
                while item is not None:
                    i, chunk = item
                    check_finished(chunk)
                    if chunk.usage is not None:
                        usage.add(i, chunk.usage)
                    choice = ChatChunkChoice(
                        index=i,
                        delta=DeltaMessage(content=chunk.text) if chunk.text else DeltaMessage(),
                        logprobs=self._logprobs(chunk.logprobs) if chunk.logprobs else None,
                        finish_reason=str(chunk.finish_reason) if chunk.finish_reason else None,
                    )
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
