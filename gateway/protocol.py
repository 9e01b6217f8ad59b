"""OpenAI request and response types (with the vLLM extensions clients expect).

Requests are validated strictly: a wrong type is a 400, not a silent coercion of "5" to 5.
Unknown fields are ignored (as vLLM does), so newer clients that send optional parameters
this server does not know still work; known but unsupported ones are refused explicitly by
the serving code with a message that names them.
"""

from __future__ import annotations

import functools
import re
import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from gateway.errors import InvalidRequest

INT64_MAX = 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
M = TypeVar("M", bound=BaseModel)


def parse_json(raw: bytes, model: type[M]) -> M:
    """A JSON body as ``model``; any problem is an InvalidRequest naming the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise invalid_request(e) from None


def invalid_request(e: ValidationError) -> InvalidRequest:
    """The first validation error as an OpenAI-style message with ``param`` set.

    A union field (``prompt``: text, texts, token ids or lists of them) fails once per
    branch; the branch that got deepest says what is wrong (``prompt.1``: a negative token
    id), and when none got past the type, the message lists the accepted types.
    """
    errors = e.errors(include_url=False)
    err = errors[0]
    if err["type"] == "json_invalid":
        return InvalidRequest(f"The request body is not valid JSON: {err['msg']}")
    if err["type"] == "model_type" or not err["loc"]:
        return InvalidRequest("The request body must be a JSON object")
    head = _fields(err["loc"])
    n = len(head)
    after = err["loc"][n] if n < len(err["loc"]) else None
    if isinstance(after, str) and not _UNION_TAG.fullmatch(after):  # a key of a dict field
        where = ".".join(str(p) for p in err["loc"])
        return InvalidRequest(f"{where}: {err['msg']}", param=".".join(head))
    if after is not None and not isinstance(after, int):  # a union's branch tag
        branches: dict[str, list[Any]] = {}
        for x in errors:
            if len(x["loc"]) > n and _fields(x["loc"][:n]) == head:
                tag = str(x["loc"][n]).replace("constrained-", "")
                branches.setdefault(tag, []).append(x)
        # The branch that got past the type check with the fewest complaints is closest.
        closest = min(branches.values(), key=lambda xs: (len(_fields(xs[0]["loc"])) <= n, len(xs)))
        if len(_fields(closest[0]["loc"])) > n:
            err = closest[0]
        else:
            param = ".".join(head)
            return InvalidRequest(
                f"{param}: invalid value; expected one of {', '.join(branches)}", param=param
            )
    param = ".".join(_fields(err["loc"]))
    return InvalidRequest(f"{param}: {err['msg']}", param=param)


# How pydantic names a union's branch in an error's location (str, list[constrained-int],
# dict[str,any]); anything else there is a key of a dict field (logit_bias's "1").
_UNION_TAG = re.compile(r"[a-z][a-z0-9_-]*(\[.*\])?")


def _fields(loc: tuple[int | str, ...]) -> list[str]:
    """The field names and list indices of an error location, without union type tags."""
    return [str(p) for p in loc if isinstance(p, int) or _is_field_name(str(p))]


def _is_field_name(part: str) -> bool:
    return part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict")


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """``null`` for a field with a default is that default, as OpenAI's API and vLLM read
        it: clients send unset optional fields as null (the ``openai`` client's ``n=None``)."""
        if isinstance(data, dict):
            defaults = _non_null_defaults(cls)
            if any(data.get(k, 0) is None for k in defaults):
                return {k: v for k, v in data.items() if v is not None or k not in defaults}
        return data


@functools.cache
def _non_null_defaults(cls: type[BaseModel]) -> frozenset[str]:
    """The fields of ``cls`` whose default is a value, not None, by name and by alias."""
    names = set()
    for name, f in cls.model_fields.items():
        if not f.is_required() and f.get_default(call_default_factory=True) is not None:
            names.add(name)
            if f.alias:
                names.add(f.alias)
    return frozenset(names)


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """Fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Prefixes are shared only between requests with the same salt (tenant isolation).
    cache_salt: str | None = None  # bounded by --max-namespace-chars (limits.py)
    # Speculative decoding, per request: prompt lookup ("ngram") or the workers'
    # --draft-model ("draft_model"); num_draft_tokens is mlx_lm.server's name (checked
    # against kvserve_model.sampling_limits, like every sampling field).
    speculative: Literal["ngram", "draft_model"] | None = None
    num_draft_tokens: int | None = None
    # Structured output (gateway/structured.py): OpenAI's response_format, and vLLM's guided_*
    # fields and their newer structured_outputs object; at most one of them.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: each prompt token's logprob (given the tokens before it) and this many top
    # alternatives, in the choices (completions) or the response (chat); not with stream.
    prompt_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class ChatMessage(BaseModel):
    """Extra fields (tool_calls, tool_call_id, name, ...) are kept: templates may use them."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Tool calling (gateway/tools.py checks them: OpenAI's shapes, with its error messages).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Legacy and vLLM fields that are refused by name (gateway/chat.py), not ignored.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    echo: bool = False
    # vLLM extensions.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


# -- responses --------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs; with ``echo`` the prompt's tokens come first, the very first
    with None (nothing predicts it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


# vLLM's prompt_logprobs, where asked for (an extra field: absent otherwise): per prompt
# token, None for the first, then {token id: {"logprob", "rank", "decoded_token"}} for the
# prompt's own token and the top alternatives.
PromptLogprobsOut = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")  # prompt_logprobs, where asked for

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprobOut):
    top_logprobs: list[TopLogprobOut] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str  # call_<hex>
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``tool_calls`` only when there are calls (OpenAI leaves the key out otherwise)."""
        out: dict[str, Any] = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    model_config = ConfigDict(extra="allow")  # prompt_logprobs, where asked for

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of call ``index``: the first has ``id``, ``type`` and the function's ``name``;
    each some of its ``arguments`` (``None`` fields are left out of the event)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    root: str
    max_model_len: int
    # How the workers serving it run it: "paged" (KV blocks in the shared prefix cache) or
    # "dense" (per-sequence recurrent state, no prefix reuse); empty until a worker answered.
    runners: list[str] = []


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
