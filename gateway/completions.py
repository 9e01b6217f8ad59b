"""POST /v1/completions: text (or token) prompts in, OpenAI ``text_completion`` out."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from typing import cast

from gateway.errors import GatewayError, InvalidRequest, error_body
from gateway.generation import Chunk, Completion, TokenLogprob
from gateway.openai_serving import OpenAIServing, Served, UsageTotals, check_finished, prime
from gateway.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from gateway.streams import SSE_DONE, merge, sse

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


class CompletionServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.s = serving

    @staticmethod
    def items(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
        """The prompts of a request: a string, strings, token ids, or lists of token ids."""
        items: list[str | list[int]]
        if isinstance(prompt, str):
            items = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [cast(list[int], prompt)]
        else:
            items = list(cast(list[str] | list[list[int]], prompt))
        if not items:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        return items

    async def prompts(self, items: list[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt; sizes are checked before any tokenizing."""
        tokenizer = self.s.tokenizer
        for item in items:
            if isinstance(item, str):
                self.s.limits.check_prompt_chars(len(item))
            elif len(item) >= tokenizer.max_context:
                tokenizer.completion_budget(len(item), None)  # raises: it cannot fit
        out = []
        for item in items:
            ids = await tokenizer.encode_async(item) if isinstance(item, str) else list(item)
            if not ids:
                raise InvalidRequest("prompt must not be empty", param="prompt")
            tokenizer.check_token_ids(ids)
            out.append(ids)
        return out

    async def prompt_texts(
        self, prompt: str | list[str] | list[int] | list[list[int]], ids: list[list[int]]
    ) -> list[str]:
        """The prompts as text, for ``echo``: as sent, or decoded from token ids."""
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], str):
            return [str(p) for p in prompt]
        return [await self.s.tokenizer.decode_async(p) for p in ids]

    async def create(self, req: CompletionRequest, arrival: float) -> Served:
        model = self.s.check_model(req.model)
        if req.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequest("best_of must equal n when set", param="best_of")
        if req.echo and req.logprobs is not None:
            raise InvalidRequest(
                "echo with logprobs needs prompt logprobs, which are not supported",
                param="echo",
            )
        items = self.items(req.prompt)
        self.s.check_common(req, len(items) * req.n)
        prompts = await self.prompts(items)
        budgets = [
            self.s.tokenizer.completion_budget(len(p), req.max_tokens, DEFAULT_MAX_TOKENS)
            for p in prompts
        ]
        logprobs = req.logprobs
        request_id = self.s.new_id("cmpl")
        sequences = self.s.sequences(
            request_id, req, prompts, budgets, 0 if logprobs is None else max(1, logprobs)
        )
        echoes = None
        if req.echo:
            texts = await self.prompt_texts(req.prompt, prompts)
            echoes = [texts[k // req.n] for k in range(len(sequences))]
        merged = merge(self.s.open(sequences, arrival))
        headers = {"x-request-id": request_id}
        view = _View(request_id, model, self.s.created(), logprobs, req.n)
        if not req.stream:
            body, workers = await view.collect(merged, echoes)
            headers["x-kvserve-worker"] = ",".join(workers)
            return Served(headers, body=body)
        first = await prime(merged)
        headers["x-kvserve-worker"] = first[1].worker_id
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Served(headers, events=view.events(first, merged, echoes, include_usage))


class _View:
    """Renders one request's chunks as OpenAI completion objects."""

    def __init__(
        self, request_id: str, model: str, created: int, logprobs: int | None, n: int
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.logprobs = logprobs
        self.n = n

    def _logprobs(self, lps: Sequence[TokenLogprob], offset: int) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        offsets = []
        for lp in lps:
            offsets.append(offset)
            offset += len(lp.token)
        return CompletionLogprobs(
            tokens=[lp.token for lp in lps],
            token_logprobs=[lp.logprob for lp in lps],
            top_logprobs=[{t.token: t.logprob for t in lp.top[: self.logprobs]} for lp in lps],
            text_offset=offsets,
        )

    def response(
        self, choices: list[CompletionChoice], usage: UsageTotals | None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage.info() if usage else None,
        )

    async def collect(
        self, merged: AsyncGenerator[tuple[int, Chunk], None], echoes: list[str] | None
    ) -> tuple[CompletionResponse, list[str]]:
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
            prefix = echoes[i] if echoes else ""
            choices.append(
                CompletionChoice(
                    index=i,
                    text=prefix + done.text,
                    logprobs=self._logprobs(done.logprobs, len(prefix)),
                    finish_reason=str(done.finish_reason) if done.finish_reason else None,
                )
            )
        return self.response(choices, usage), [results[i].worker_id for i in sorted(results)]

    async def events(
        self,
        first: tuple[int, Chunk],
        merged: AsyncGenerator[tuple[int, Chunk], None],
        echoes: list[str] | None,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        usage = UsageTotals(self.n)
        offsets: dict[int, int] = {}
        try:
            async with aclosing(merged):
                if echoes:
                    for i, text in enumerate(echoes):
                        offsets[i] = len(text)
                        yield self._event([CompletionChoice(index=i, text=text)])
                item: tuple[int, Chunk] | None = first
                while item is not None:
                    i, chunk = item
                    check_finished(chunk)
                    offset = offsets.get(i, 0)
                    offsets[i] = offset + len(chunk.text)
                    if chunk.usage is not None:
                        usage.add(i, chunk.usage)
                    choice = CompletionChoice(
                        index=i,
                        text=chunk.text,
                        logprobs=self._logprobs(chunk.logprobs, offset),
                        finish_reason=str(chunk.finish_reason) if chunk.finish_reason else None,
                    )
                    if chunk.text or chunk.logprobs or chunk.finish_reason:
                        # (a token whose bytes end mid-character has no text yet: no event)
                        yield self._event([choice])
                    item = await anext(merged, None)
            if include_usage:
                yield sse(self.response([], usage).model_dump(mode="json"))
        except GatewayError as e:
            yield sse(error_body(e)[1])
        except Exception as e:
            log.exception("stream %s failed", self.request_id)
            yield sse(error_body(e)[1])
        yield SSE_DONE

    def _event(self, choices: list[CompletionChoice]) -> str:
        body = self.response(choices, None).model_dump(mode="json")
        body.pop("usage")
        return sse(body)
