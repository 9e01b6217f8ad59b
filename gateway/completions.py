"""POST /v1/completions: text (or token) prompts in, OpenAI ``text_completion`` out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from pydantic import BaseModel

from gateway.errors import InvalidRequest
from gateway.generation import Chunk, Completion, TokenLogprob
from gateway.openai_serving import OpenAIServing, Served
from gateway.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from gateway.rendering import Renderer, finish
from gateway.structured import request_constraint

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
        structured = request_constraint(req)
        sequences = self.s.sequences(
            request_id,
            req,
            prompts,
            budgets,
            0 if logprobs is None else max(1, logprobs),
            structured,
        )
        echoes = None
        if req.echo:
            texts = await self.prompt_texts(req.prompt, prompts)
            echoes = [texts[k // req.n] for k in range(len(sequences))]
        view = CompletionView(request_id, model, self.s.created(), req.n, logprobs, echoes)
        served = await view.serve(self.s.open(sequences, arrival), req)
        return self.s.noted(served, req, structured)


class CompletionView(Renderer):
    """Completion objects: text per choice (after its prompt, with ``echo``), and logprobs
    whose text offsets run on across a stream's events."""

    response_type = CompletionResponse
    event_type = CompletionResponse

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        n: int,
        logprobs: int | None,
        echoes: list[str] | None,
    ) -> None:
        super().__init__(request_id, model, created, n)
        self.logprobs = logprobs
        self.echoes = echoes
        # Streaming: the length of each choice's text so far, its next token's text_offset.
        self.offsets = {i: len(text) for i, text in enumerate(echoes or ())}

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

    def choice(self, index: int, done: Completion) -> CompletionChoice:
        prefix = self.echoes[index] if self.echoes else ""
        return CompletionChoice(
            index=index,
            text=prefix + done.text,
            logprobs=self._logprobs(done.logprobs, len(prefix)),
            finish_reason=finish(done.finish_reason),
        )

    def opening(self) -> list[BaseModel]:
        return [CompletionChoice(index=i, text=text) for i, text in enumerate(self.echoes or ())]

    def delta(self, index: int, chunk: Chunk) -> CompletionChoice:
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(chunk.text)
        return CompletionChoice(
            index=index,
            text=chunk.text,
            logprobs=self._logprobs(chunk.logprobs, offset),
            finish_reason=finish(chunk.finish_reason),
        )
