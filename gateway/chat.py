"""POST /v1/chat/completions: messages through the model's chat template, OpenAI
``chat.completion`` (or ``chat.completion.chunk`` events) out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from gateway.errors import InvalidRequest
from gateway.generation import Chunk, Completion, TokenLogprob
from gateway.openai_serving import OpenAIServing, Served
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
from gateway.rendering import Renderer, finish
from gateway.structured import request_constraint


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
        # Declared so that they are refused by name, not ignored: a client that sends them
        # expects their effect (the schema ignores unknown fields).
        if req.functions or req.function_call is not None:
            param = "functions" if req.functions else "function_call"
            raise InvalidRequest(
                f"{param} (the legacy form of tools) is not supported", param=param
            )
        if req.echo:
            raise InvalidRequest("echo is not supported for chat completions", param="echo")
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
        structured = request_constraint(req)
        sequences = self.s.sequences(
            request_id, req, [prompt], [budget], max(1, top) if req.logprobs else 0, structured
        )
        view = ChatView(request_id, model, self.s.created(), req.n, top if req.logprobs else None)
        return await view.serve(self.s.open(sequences, arrival), req)


class ChatView(Renderer):
    """Chat objects: a message per choice, deltas in a stream (the first says the role)."""

    response_type = ChatCompletionResponse
    event_type = ChatCompletionChunk

    def __init__(
        self, request_id: str, model: str, created: int, n: int, top_logprobs: int | None
    ) -> None:
        super().__init__(request_id, model, created, n)
        self.top_logprobs = top_logprobs

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

    def choice(self, index: int, done: Completion) -> ChatChoice:
        return ChatChoice(
            index=index,
            message=ChatMessageOut(content=done.text),
            logprobs=self._logprobs(done.logprobs),
            finish_reason=finish(done.finish_reason),
        )

    def opening(self) -> list[BaseModel]:
        role = DeltaMessage(role="assistant", content="")
        return [ChatChunkChoice(index=i, delta=role) for i in range(self.n)]

    def delta(self, index: int, chunk: Chunk) -> ChatChunkChoice:
        return ChatChunkChoice(
            index=index,
            delta=DeltaMessage(content=chunk.text) if chunk.text else DeltaMessage(),
            logprobs=self._logprobs(chunk.logprobs) if chunk.logprobs else None,
            finish_reason=finish(chunk.finish_reason),
        )

    def trim(self, event: dict[str, Any]) -> dict[str, Any]:
        for choice in event["choices"]:  # a delta carries only what changed: {} at the end
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return event
