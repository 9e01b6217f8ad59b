"""POST /v1/chat/completions: messages through the model's chat template, OpenAI
``chat.completion`` (or ``chat.completion.chunk`` events) out."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from gateway.errors import InvalidRequest
from gateway.generation import Chunk, Completion, FinishReason, TokenLogprob
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
    TopLogprobOut,
)
from gateway.rendering import Renderer, finish, prompt_logprobs_out
from gateway.structured import request_constraint
from gateway.tools import (
    CallDelta,
    ToolChunk,
    ToolPlan,
    read_tool_calls,
    template_tool_calls,
    tool_plan,
    whole_calls,
)
from kvserve_model.token_bytes import bytes_of


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: content as one string (text parts joined), an
    assistant's tool calls with their arguments as objects (``gateway.tools``); the other
    fields (a tool result's ``tool_call_id``, ``name``) as sent."""
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
        if msg.get("tool_calls") is not None:
            msg["tool_calls"] = template_tool_calls(msg["tool_calls"], f"messages.{k}.tool_calls")
        out.append(msg)
    return out


# What a chat template writes around each message besides its content (its role and markers:
# ChatML 26 characters, Llama 3's 50), counted into a conversation's length before it is
# rendered, so that many small messages do not pass for a short prompt: 125,000 empty ones (a
# 3.6 MB body) counted as 0 characters, were rendered on the event loop, and stalled every
# other stream and /health for seconds before the prompt was refused as too long.
MESSAGE_CHARS = 32


def conversation_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    """About how many characters ``messages`` (as :func:`template_messages` makes them) render
    to, before rendering: their contents and tool calls, and :data:`MESSAGE_CHARS` each. What
    the prompt-length limit checks and what decides whether rendering leaves the event loop."""
    chars = 0
    for m in messages:
        chars += len(m["content"]) + MESSAGE_CHARS
        if m.get("tool_calls"):
            chars += len(json.dumps(m["tool_calls"]))
    return chars


# chat_template_kwargs that are no template variable but an argument of the rendering call
# itself (transformers' ``apply_chat_template``): what it renders ("conversation" is its name
# for the messages), which template (a client's own Jinja: vLLM refuses "chat_template" from a
# request unless --trust-request-chat-template), and what it returns (text: the gateway
# encodes it itself). Passed on, each was Python's TypeError ("got multiple values for
# keyword argument") in a 400, or a prompt that was not the template's text.
RENDER_ARGUMENTS = frozenset(
    {
        "messages",
        "conversation",
        "chat_template",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)
# The request's own template parameters that a kwarg of the same name sets instead.
REQUEST_FLAGS = ("add_generation_prompt", "continue_final_message")


def template_kwargs(
    req: ChatCompletionRequest, tools: list[dict[str, Any]] | None
) -> tuple[ChatCompletionRequest, list[dict[str, Any]] | None, dict[str, Any]]:
    """The request's ``chat_template_kwargs`` checked: (the request with the flags they set,
    the tools the template renders, the other kwargs).

    vLLM's rule, so that a request written for vLLM renders the same prompt here: a kwarg named
    as one of the request's own template parameters overrides it (vLLM updates its
    ``add_generation_prompt``, ``continue_final_message``, ``tools``, ``documents`` with the
    kwargs). The two flags the gateway reads itself must be booleans, as the fields are; a
    ``tools`` kwarg is what the template shows (the calls read back stay the request's
    ``tools``', as vLLM's parsers read those). A kwarg naming an argument of the rendering
    itself (:data:`RENDER_ARGUMENTS`) is a 400 naming it."""
    kwargs = dict(req.chat_template_kwargs or {})
    for key in kwargs:
        if key in RENDER_ARGUMENTS:
            raise InvalidRequest(
                f"chat_template_kwargs: {key!r} is an argument of the chat template's rendering, "
                "not a variable of the template; it cannot be set",
                param=f"chat_template_kwargs.{key}",
            )
    flags = {}
    for key in REQUEST_FLAGS:
        if key in kwargs:
            value = kwargs.pop(key)
            if not isinstance(value, bool):
                raise InvalidRequest(
                    f"chat_template_kwargs: {key!r} sets the request's {key}, a boolean; "
                    f"got {value!r}",
                    param=f"chat_template_kwargs.{key}",
                )
            flags[key] = value
    if "tools" in kwargs:
        tools = kwargs.pop("tools")
        if tools is not None and not isinstance(tools, list):
            raise InvalidRequest(
                "chat_template_kwargs: 'tools' (the tools the template shows) must be a list",
                param="chat_template_kwargs.tools",
            )
    return (req.model_copy(update=flags) if flags else req), tools, kwargs


class ChatServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.s = serving

    def check(self, req: ChatCompletionRequest) -> None:
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
        req, shown_tools, kwargs = template_kwargs(req, req.tools or None)
        self.check(req)
        self.s.check_common(req, req.n)
        tools = tool_plan(req, self.s.tokenizer.tool_parser, self.s.tokenizer.special_tokens)
        if tools is not None and tools.special:  # the markers are special tokens: keep them
            req = req.model_copy(update={"skip_special_tokens": False})
        constraint = request_constraint(req)
        if tools is not None and tools.constraint is not None:
            if constraint is not None:
                raise InvalidRequest(
                    f"tool_choice {tools.choice} constrains the output to tool calls; it cannot "
                    "be combined with response_format or guided_* (two constraints)",
                    param="tool_choice",
                )
            constraint = tools.constraint
        structured = await self.s.checked(constraint)
        messages = template_messages(req.messages)
        chars = conversation_chars(messages)
        if shown_tools:  # the template writes the tools' schemas into the prompt
            chars += len(json.dumps(shown_tools))
        self.s.limits.check_prompt_chars(chars, param="messages")
        prompt = await self.s.tokenizer.apply_chat_template_async(
            messages,
            chars,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=shown_tools,
            template_kwargs=kwargs,
        )
        max_tokens = req.max_completion_tokens or req.max_tokens
        budget = self.s.completion_budget(len(prompt), max_tokens, prompt_param="messages")
        top = req.top_logprobs or 0
        request_id = self.s.new_id("chatcmpl")
        # Without max_tokens: as many as fit, which the worker decides (0 on the wire): its
        # pool may hold fewer tokens than the context this budget allows.
        sequences = self.s.sequences(
            request_id,
            req,
            [prompt],
            [0 if max_tokens is None else budget],
            max(1, top) if req.logprobs else 0,
            structured,
        )
        view = ChatView(
            request_id,
            model,
            self.s.created(),
            req.n,
            top if req.logprobs else None,
            tools,
            req.prompt_logprobs,
        )
        streams = self.s.open(sequences, arrival)
        if req.stream and tools is not None:
            readers = [tools.reader() for _ in streams]
            streams = [
                s if r is None else read_tool_calls(s, r, tools)
                for s, r in zip(streams, readers, strict=True)
            ]
        return self.s.noted(await view.serve(streams, req), req, structured)


class ChatView(Renderer):
    """Chat objects: a message per choice, deltas in a stream (the first says the role). With
    tools, a choice's text is read into content and tool calls (``gateway.tools``): whole here
    (non-streaming), or by ``read_tool_calls`` before its chunks get here (``ToolChunk``)."""

    response_type = ChatCompletionResponse
    event_type = ChatCompletionChunk
    prompt_param = "messages"

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        n: int,
        top_logprobs: int | None,
        tools: ToolPlan | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        super().__init__(request_id, model, created, n)
        self.top_logprobs = top_logprobs
        self.tools = tools
        self.prompt_logprobs = prompt_logprobs

    def extras(self, results: dict[int, Completion]) -> dict[str, Any]:
        """vLLM's ``prompt_logprobs``, where asked for: one prompt, so the response's."""
        if self.prompt_logprobs is None or not results:
            return {}
        first = results[min(results)]
        return {"prompt_logprobs": prompt_logprobs_out(first.prompt_logprobs, self.prompt_logprobs)}

    def _logprobs(self, lps: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    token=lp.token,
                    logprob=lp.logprob,
                    bytes=list(bytes_of(lp.token)),
                    top_logprobs=[
                        TopLogprobOut(
                            token=t.token, logprob=t.logprob, bytes=list(bytes_of(t.token))
                        )
                        for t in lp.top[: self.top_logprobs]
                    ],
                )
                for lp in lps
            ]
        )

    def choice(self, index: int, done: Completion) -> ChatChoice:
        tools = self.tools
        reader = tools.reader() if tools is not None else None
        if tools is None or reader is None:
            message = ChatMessageOut(content=done.text)
            called = False
        else:
            read = reader.read(tools.final_text(done.text, done.token_ids))
            calls = [
                ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                for c in whole_calls(read.calls)
            ]
            # OpenAI's message with calls has null content, unless the model wrote some.
            message = ChatMessageOut(
                content=read.content or (None if calls else ""), tool_calls=calls or None
            )
            called = reader.called
        return ChatChoice(
            index=index,
            message=message,
            logprobs=self._logprobs(done.logprobs),
            finish_reason=_finish(done.finish_reason, called),
        )

    def opening(self) -> list[BaseModel]:
        role = DeltaMessage(role="assistant", content="")
        return [ChatChunkChoice(index=i, delta=role) for i in range(self.n)]

    def delta(self, index: int, chunk: Chunk) -> ChatChunkChoice:
        if isinstance(chunk, ToolChunk):
            delta = DeltaMessage(
                content=chunk.content or None,
                tool_calls=[_delta_call(c) for c in chunk.calls] or None,
            )
            reason = _finish(chunk.finish_reason, chunk.called)
        else:
            delta = DeltaMessage(content=chunk.text) if chunk.text else DeltaMessage()
            reason = finish(chunk.finish_reason)
        return ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=self._logprobs(chunk.logprobs) if chunk.logprobs else None,
            finish_reason=reason,
        )

    def trim(self, event: dict[str, Any]) -> dict[str, Any]:
        for choice in event["choices"]:  # a delta carries only what changed: {} at the end
            delta = {k: v for k, v in choice["delta"].items() if v is not None}
            for call in delta.get("tool_calls", ()):  # a call's later pieces: arguments only
                for key in [k for k, v in call.items() if v is None]:
                    del call[key]
                call["function"] = {k: v for k, v in call["function"].items() if v is not None}
            choice["delta"] = delta
        return event


def _delta_call(c: CallDelta) -> DeltaToolCall:
    return DeltaToolCall(
        index=c.index,
        id=c.id,
        type="function" if c.id is not None else None,
        function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
    )


def _finish(reason: FinishReason | None, called: bool) -> str | None:
    """A choice that made tool calls and stopped finished with ``tool_calls``; one cut short
    stays ``length``."""
    if called and reason is FinishReason.STOP:
        return "tool_calls"
    return finish(reason)
