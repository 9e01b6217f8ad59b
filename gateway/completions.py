"""POST /v1/completions: text (or token) prompts in, OpenAI ``text_completion`` out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
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
from gateway.rendering import Renderer, finish, prompt_logprobs_out, text_offsets
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
        max_context = self.s.max_context
        for item in items:
            if isinstance(item, str):
                self.s.limits.check_prompt_chars(len(item))
            elif len(item) >= max_context:
                self.s.completion_budget(len(item), None)  # raises: it cannot fit
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
        items = self.items(req.prompt)
        self.s.check_common(req, len(items) * req.n)
        prompts = await self.prompts(items)
        budgets = [
            self.s.completion_budget(len(p), req.max_tokens, DEFAULT_MAX_TOKENS) for p in prompts
        ]
        logprobs = req.logprobs
        request_id = self.s.new_id("cmpl")
        structured = await self.s.checked(request_constraint(req))
        sequences = self.s.sequences(
            request_id,
            req,
            prompts,
            budgets,
            0 if logprobs is None else max(1, logprobs),
            structured,
        )
        echoes = firsts = None
        if req.echo:
            texts = await self.prompt_texts(req.prompt, prompts)
            echoes = [texts[k // req.n] for k in range(len(sequences))]
        if req.echo and logprobs is not None:
            # The prompt's tokens get logprobs too (the worker's prompt_logprobs, which
            # computes the whole prompt: no cached prefix), the first one none (OpenAI's).
            top = max(logprobs, req.prompt_logprobs or 0)
            sequences = [
                replace(s, sampling=replace(s.sampling, prompt_logprobs=top)) for s in sequences
            ]
            decode = self.s.tokenizer.decode
            firsts = [decode(prompts[k // req.n][:1]) for k in range(len(sequences))]
        view = CompletionView(
            request_id,
            model,
            self.s.created(),
            req.n,
            logprobs,
            echoes,
            firsts,
            req.prompt_logprobs,
        )
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
        firsts: list[str] | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        """``firsts``: with ``echo`` and ``logprobs``, each choice's first prompt token as
        text; the prompt's tokens then come first in its logprobs (the first with none).
        ``prompt_logprobs``: vLLM's, in each choice, with this many alternatives."""
        super().__init__(request_id, model, created, n)
        self.logprobs = logprobs
        self.echoes = echoes
        self.firsts = firsts
        self.prompt_logprobs = prompt_logprobs
        # Streaming: the length of each choice's text so far, its next token's text_offset.
        # With the prompt's logprobs the echo goes with the first chunk, which brings them.
        self.offsets = {} if firsts else {i: len(text) for i, text in enumerate(echoes or ())}

    def _logprobs(
        self, lps: Sequence[TokenLogprob], offset: int, first: str | None = None
    ) -> CompletionLogprobs | None:
        """``first``: the prompt's first token, which ``lps`` (the prompt's tokens after it,
        then generated ones) follow, with no logprob of its own."""
        if self.logprobs is None:
            return None
        tokens = [*([] if first is None else [first]), *(lp.token for lp in lps)]
        tops = [{t.token: t.logprob for t in lp.top[: self.logprobs]} for lp in lps]
        head = [None] * (len(tokens) - len(lps))
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[*head, *(lp.logprob for lp in lps)],
            top_logprobs=[*head, *tops],
            text_offset=text_offsets(tokens, offset),
        )

    def choice(self, index: int, done: Completion) -> CompletionChoice:
        prefix = self.echoes[index] if self.echoes else ""
        if self.firsts:
            lps = [*done.prompt_logprobs, *done.logprobs]
            logprobs = self._logprobs(lps, 0, self.firsts[index])
        else:
            logprobs = self._logprobs(done.logprobs, len(prefix))
        extra = {}
        if self.prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs_out(
                done.prompt_logprobs, self.prompt_logprobs
            )
        return CompletionChoice(
            index=index,
            text=prefix + done.text,
            logprobs=logprobs,
            finish_reason=finish(done.finish_reason),
            **extra,
        )

    def opening(self) -> list[BaseModel]:
        if self.firsts:
            return []
        return [CompletionChoice(index=i, text=text) for i, text in enumerate(self.echoes or ())]

    def delta(self, index: int, chunk: Chunk) -> CompletionChoice:
        if self.firsts and self.echoes and index not in self.offsets:  # its first chunk
            text = self.echoes[index] + chunk.text
            lps = [*chunk.prompt_logprobs, *chunk.logprobs]
            logprobs = self._logprobs(lps, 0, self.firsts[index])
            self.offsets[index] = len(text)
        else:
            offset = self.offsets.get(index, 0)
            text = chunk.text
            logprobs = self._logprobs(chunk.logprobs, offset)
            self.offsets[index] = offset + len(text)
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=finish(chunk.finish_reason)
        )
