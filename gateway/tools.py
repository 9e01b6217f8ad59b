"""Tool calling: what a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask
of its output, and the model's output read back as OpenAI tool calls.

The tools always go to the chat template (``tools=``), which renders them as the model was
trained to see them. What comes back depends on ``tool_choice`` (docs/tool-calling.md):

- ``none``: the output is content, as without tools.
- ``auto`` (the default with tools): the model decides, writing calls in its own format between
  markers; the format and its parser are mlx-lm's (``kvserve_model.tool_parsers``), so a model
  without one is refused here (a 400) rather than served calls nobody could read. Text outside
  the markers is content; each marked segment is parsed into calls; a segment that does not
  parse stays content.
- a named function: the output is constrained (structured output) to that function's
  ``parameters`` schema and is the arguments of one call of it, streamed as they are written.
- ``required``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects,
  one schema per tool (vLLM's construction), read into calls once it is complete.

These two work with any model, whatever its template knows of tools. ``parallel_tool_calls``
false keeps one call: ``required``'s array holds exactly one, ``auto`` keeps the first.

A reader turns one choice's text into content and call deltas; ``read_tool_calls`` runs one over
a choice's chunk stream (streaming), ``ChatView`` over its whole text (non-streaming).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from gateway.errors import InvalidRequest
from gateway.generation import Chunk
from gateway.protocol import ChatCompletionRequest
from gateway.structured import Constraint
from kvserve_model.structured_output import DATA_KEYWORDS, StructuredOutput, StructuredOutputError
from kvserve_model.tool_parsers import ToolParser

log = logging.getLogger(__name__)

# OpenAI's rules for a function's name, and its limit on tools a request.
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
# A function without ``parameters`` has an empty parameter list (OpenAI's definition): its
# arguments are ``{}``. (vLLM lets them be any object, which a model may pad without end.)
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
CHOICES = ("none", "auto", "required")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A piece of tool call ``index`` (numbered per choice from 0): its first piece carries
    ``id`` and ``name``, every piece some of the ``arguments`` (JSON text). A call read whole is
    one piece."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Read:
    """What a piece of output turned out to be: content, and pieces of tool calls."""

    content: str = ""
    calls: tuple[CallDelta, ...] = ()

    def __add__(self, other: Read) -> Read:
        return Read(self.content + other.content, self.calls + other.calls)


def whole_calls(deltas: Sequence[CallDelta]) -> list[ToolCall]:
    """Calls from their pieces, in index order."""
    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for d in deltas:
        ids[d.index] = d.id or ids.get(d.index, "")
        names[d.index] = d.name or names.get(d.index, "")
        arguments.setdefault(d.index, []).append(d.arguments)
    return [ToolCall(ids[i], names[i], "".join(arguments[i])) for i in sorted(arguments)]


class Reader(ABC):
    """One choice's output read as content and tool calls, piece by piece: ``feed`` each piece
    of text as it comes, then ``finish`` once."""

    @abstractmethod
    def feed(self, text: str) -> Read: ...

    @abstractmethod
    def finish(self) -> Read: ...

    @property
    @abstractmethod
    def called(self) -> bool:
        """Whether a tool call has been read (finish_reason ``tool_calls`` at a stop)."""

    def read(self, text: str) -> Read:
        """A whole output at once."""
        return self.feed(text) + self.finish()


class MarkedCalls(Reader):
    """``tool_choice`` auto: calls between the model's markers, parsed by mlx-lm's parser.

    Content streams as it comes but for what could still be the start of a marker, and
    whitespace before it (dropped before a call: a model writes a newline before its call);
    a segment is parsed once its end marker arrives (or at the end of the output, for formats
    whose calls have no end marker, and for one cut short, as mlx-lm does)."""

    def __init__(self, parser: ToolParser, tools: Sequence[dict[str, Any]], parallel: bool):
        self.parser = parser
        self.tools = list(tools)
        self.parallel = parallel
        self._buf = ""  # held content, or the current segment's text
        self._inside = False
        self._searched = 0  # characters of the segment already searched for the end marker
        self._calls = 0

    @property
    def called(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> Read:
        self._buf += text
        start, end = self.parser.start, self.parser.end
        out = Read()
        while True:
            if not self._inside:
                i = self._buf.find(start)
                if i < 0:
                    keep = _held(self._buf, start)
                    out += Read(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out += Read(self._buf[:i].rstrip())
                self._buf = self._buf[i + len(start) :]
                self._inside, self._searched = True, 0
                continue
            if not end:
                return out
            j = self._buf.find(end, max(0, self._searched - len(end) + 1))
            if j < 0:
                self._searched = len(self._buf)
                return out
            segment = self._buf[:j]
            self._buf = self._buf[j + len(end) :]
            self._inside = False
            out += self._segment(segment, end)

    def finish(self) -> Read:
        buf, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            return self._segment(buf, "")
        return Read("" if self.called and not buf.strip() else buf)

    def _segment(self, text: str, end: str) -> Read:
        try:
            found = _calls(self.parser.parse(text, self.tools))
        except Exception as e:  # mlx-lm's parsers raise what their parsing raises
            log.warning(
                "a tool call in %s's format did not parse (%s: %s); it stays content",
                self.parser.name,
                type(e).__name__,
                e,
            )
            return Read(self.parser.start + text + end)
        calls = []
        for call_id, name, arguments in found:
            if self._calls and not self.parallel:
                break  # parallel_tool_calls false: the first call only
            calls.append(CallDelta(self._calls, arguments, call_id or new_call_id(), name))
            self._calls += 1
        return Read(calls=tuple(calls))


class NamedCall(Reader):
    """A named ``tool_choice``: the whole output is the arguments of one call of ``name``
    (constrained to its parameters' schema), streamed as it is written."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._id: str | None = None

    @property
    def called(self) -> bool:
        return self._id is not None

    def feed(self, text: str) -> Read:
        if not text:
            return Read()
        if self._id is None:
            self._id = new_call_id()
            return Read(calls=(CallDelta(0, text, self._id, self.name),))
        return Read(calls=(CallDelta(0, text),))

    def finish(self) -> Read:
        if self._id is None:  # nothing was written (max_tokens reached at once): still a call
            self._id = new_call_id()
            return Read(calls=(CallDelta(0, "", self._id, self.name),))
        return Read()


class CallArray(Reader):
    """``tool_choice`` required: the output is a JSON array of ``{"name", "parameters"}``
    (constrained), read into calls when it is complete. Output that is not such an array (cut
    short by max_tokens) stays content."""

    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel
        self._buf = ""
        self._calls = 0

    @property
    def called(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> Read:
        self._buf += text
        return Read()

    def finish(self) -> Read:
        text, self._buf = self._buf, ""
        try:
            items = json.loads(text)
            if not isinstance(items, list) or not items:
                raise ValueError("not a non-empty array")
            found = _calls(
                [{"name": i.get("name"), "arguments": i.get("parameters", {})} for i in items]
            )
        except (ValueError, AttributeError, RecursionError) as e:
            log.info("the required tool calls did not parse (%s); they stay content", e)
            return Read(text)
        found = found if self.parallel else found[:1]
        self._calls = len(found)
        calls = tuple(
            CallDelta(i, args, new_call_id(), name) for i, (_, name, args) in enumerate(found)
        )
        return Read(calls=calls)


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` to hold back: the longest suffix that is a
    proper prefix of ``marker`` (it may yet become the marker), and the whitespace before it."""
    overlap = next(
        (k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])),
        0,
    )
    before = text[: len(text) - overlap]
    return len(text) - len(before.rstrip())


def _calls(parsed: Any) -> list[tuple[str | None, str, str]]:
    """(id or None, name, arguments as JSON text) of each call a parser returned (a dict, or a
    list of them); ValueError for anything else. Arguments that are already JSON text are kept
    (some models write them as a string); anything else is written as JSON, as mlx-lm does."""
    out = []
    for item in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ValueError(f"not a call: {item!r:.80}")
        arguments = item.get("arguments", {})
        if not (isinstance(arguments, str) and _is_json(arguments)):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call_id = item.get("id")
        out.append(
            (call_id if isinstance(call_id, str) and call_id else None, item["name"], arguments)
        )
    return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# -- the request -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A request's tools, checked: ``choice`` is none, auto, required or named (``function``
    names it); ``constraint`` the output's structured output (required and named), its compile
    not yet checked.

    ``special``: set where the model's call markers are special tokens, which a worker leaves
    out of the text under ``skip_special_tokens`` (the default): the request is then sent with
    special tokens kept (vLLM's tool parsers do the same), and the final one (the end of
    sequence) is cut from the text here by its id (``final_text``)."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    function: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None
    constraint: Constraint | None = None
    special: Mapping[int, str] = field(default_factory=dict)

    def final_text(self, text: str, token_ids: Sequence[int]) -> str:
        """``text`` without the special token that ends it, where special tokens are kept."""
        last = self.special.get(token_ids[-1]) if self.special and token_ids else None
        return text[: -len(last)] if last and text.endswith(last) else text

    def reader(self) -> Reader | None:
        """A new reader for one choice's output (None: the output is content)."""
        if self.choice == "auto" and self.parser is not None:
            return MarkedCalls(self.parser, self.tools, self.parallel)
        if self.choice == "named" and self.function is not None:
            return NamedCall(self.function)
        if self.choice == "required":
            return CallArray(self.parallel)
        return None


def tool_plan(
    req: ChatCompletionRequest,
    parser: ToolParser | None,
    special: Mapping[int, str] | None = None,
) -> ToolPlan | None:
    """The request's tools, checked (InvalidRequest naming the field); None without tools.
    ``parser``: the model's tool-call format (``kvserve_model.tool_parsers``), or None;
    ``special``: the model's special tokens' texts by id (``Tokenizer.special_tokens``)."""
    tools = req.tools or []
    params = _check_tools(tools)
    choice, function = _check_choice(req.tool_choice, params)
    if not tools:
        return None
    parallel = req.parallel_tool_calls is not False
    if choice == "auto" and parser is None:
        raise InvalidRequest(
            "this model's chat template has no tool-call format; use tool_choice required or "
            "a named function",
            param="tools",
        )
    constraint = None
    if choice == "named":
        assert function is not None
        where = f"tools[{list(params).index(function)}].function.parameters"
        constraint = _constraint(params[function] or NO_PARAMETERS, where)
    elif choice == "required":
        constraint = _constraint(required_schema(params, parallel), "tools")
    kept: Mapping[int, str] = {}
    if choice == "auto" and parser is not None and special and req.skip_special_tokens:
        texts = set(special.values())
        kept = special if parser.start in texts or parser.end in texts else {}
    return ToolPlan(tuple(tools), choice, function, parallel, parser, constraint, kept)


def required_schema(params: dict[str, dict[str, Any] | None], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice`` required: an array of 1 or more (exactly 1 without
    parallel calls) objects, each a tool's name and its parameters. Unlike vLLM's, an item has no
    other keys: SmolLM2 wrote a "description" after the parameters, at length, into vLLM's.

    Each tool's parameters go whole into the root's ``$defs``, under the tool's name, and its
    item refers to them there. Nested in the wrapper, a tool's local references (``#``,
    ``#/definitions/Item``, ``#/properties/a``) would point into the wrapper instead, so each is
    rewritten to point where it did (``_relocated``); the tools' own ``$defs`` stay inside their
    parameters, so two tools may define the same name differently."""
    defs: dict[str, Any] = {}
    variants = []
    for name, schema in params.items():
        where = "/$defs/" + _pointer_token(name)
        defs[name] = _relocated(schema or NO_PARAMETERS, where)
        variants.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": {"$ref": "#" + where},
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    out: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": variants},
    }
    if not parallel:
        out["maxItems"] = 1
    out["$defs"] = defs
    return out


# Keywords whose value maps names to schemas: a key there is a name (a property called "$ref"
# is data, not a reference), its value a schema.
_NAMED_SCHEMAS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)


def _relocated(schema: Any, where: str) -> Any:
    """A copy of ``schema`` whose local references (``#`` and ``#/...``) point where they did
    once the schema is moved to the JSON pointer ``where`` of another document. Anything not
    known to be data is walked as schemas (a reference may point into an unknown keyword, and
    the references there are followed too); a subschema with its own ``$id`` is a resource of its
    own, whose ``#`` is itself (llguidance's reading and the ``jsonschema`` package's), so it is
    kept as it is, as are anchors (``#name``) and references to other documents."""
    if isinstance(schema, list):
        return [_relocated(s, where) for s in schema]
    if not isinstance(schema, dict):
        return schema
    resource = schema.get("$id")
    if isinstance(resource, str) and not resource.startswith("#"):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value[:2] == "#/"):
            out[key] = "#" + where + value[1:]
        elif key in DATA_KEYWORDS:  # a "$ref" in an enum's object is a value
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _relocated(s, where) for name, s in value.items()}
        else:
            out[key] = _relocated(value, where)
    return out


def _pointer_token(key: str) -> str:
    """``key`` as one token of a JSON pointer in a URI fragment: ``~`` and ``/`` escaped (RFC
    6901), then percent-encoded where a fragment needs it (RFC 3986)."""
    return quote(key.replace("~", "~0").replace("/", "~1"), safe="~!$&'()*+,;=:@")


def _constraint(schema: dict[str, Any], where: str) -> Constraint:
    """The constraint to ``schema`` (its compile checked by the caller: ``Constraint.checked``)."""
    try:
        so = StructuredOutput.json_schema(schema)
    except StructuredOutputError as e:
        raise InvalidRequest(f"{where}: {e}", param="tools") from None
    return Constraint(so, "tools", where)


def _check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """Each tool's name to its parameters' schema (None when it has none)."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(
            f"at most {MAX_TOOLS} tools; this request has {len(tools)}", param="tools"
        )
    params: dict[str, dict[str, Any] | None] = {}
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if tool.get("type") != "function":
            raise InvalidRequest(f'{where}.type must be "function"', param="tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"{where}.function must be an object", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidRequest(
                f"{where}.function.name must be 1 to 64 letters, digits, _ or -", param="tools"
            )
        if name in params:
            raise InvalidRequest(f"{where}: two tools are named {name!r}", param="tools")
        schema = function.get("parameters")
        if schema is not None and not isinstance(schema, dict):
            raise InvalidRequest(
                f"{where}.function.parameters must be a JSON schema object", param="tools"
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequest(f"{where}.function.description must be a string", param="tools")
        params[name] = schema
    return params


def _check_choice(
    choice: str | dict[str, Any] | None, params: dict[str, dict[str, Any] | None]
) -> tuple[str, str | None]:
    """(none | auto | required | named, the named function)."""
    if choice is None:
        return ("auto" if params else "none"), None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise InvalidRequest(
                f"tool_choice {choice!r} is not one of none, auto, required or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if choice != "none" and not params:
            raise InvalidRequest(f"tool_choice {choice} needs tools", param="tool_choice")
        return choice, None
    if not params:
        raise InvalidRequest("a named tool_choice needs tools", param="tool_choice")
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequest(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in params:
        raise InvalidRequest(
            f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    return "named", name


def template_tool_calls(tool_calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates expect them: each function's
    ``arguments`` as an object, not OpenAI's JSON text (what mlx_lm.server does)."""
    if not isinstance(tool_calls, list):
        raise InvalidRequest(f"{param} must be a list", param=param)
    out = []
    for k, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{param}.{k}.function needs a name", param=f"{param}.{k}")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise InvalidRequest(
                    f"{param}.{k}.function.arguments is not JSON", param=f"{param}.{k}"
                ) from None
        out.append({**call, "function": {**function, "arguments": arguments or {}}})
    return out


# -- streaming ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolChunk(Chunk):
    """A chunk read by a choice's reader: ``text`` stays the model's text (one or more of the
    worker's chunks, merged while they read as nothing), ``content`` and ``calls`` what it
    reads as; ``called``: whether the choice has made a call by now."""

    content: str = ""
    calls: tuple[CallDelta, ...] = ()
    called: bool = False


async def read_tool_calls(
    stream: AsyncGenerator[Chunk, None], reader: Reader, plan: ToolPlan
) -> AsyncGenerator[Chunk, None]:
    """``stream``'s chunks read by ``reader``. A chunk that reads as nothing yet (a marker in
    the making, a call being written) is held and merged into the next that reads as
    something, so no empty event is sent; its token ids and logprobs come with that one."""
    held: list[Chunk] = []
    async with aclosing(stream):
        async for chunk in stream:
            if chunk.finish_reason is not None:
                read = reader.feed(plan.final_text(chunk.text, chunk.token_ids))
                read += reader.finish()
            else:
                read = reader.feed(chunk.text)
            held.append(chunk)
            if read.content or read.calls or chunk.finish_reason is not None:
                yield _merged(held, read, reader.called)
                held = []


def _merged(chunks: list[Chunk], read: Read, called: bool) -> ToolChunk:
    last = chunks[-1]
    return ToolChunk(
        token_ids=tuple(t for c in chunks for t in c.token_ids),
        text="".join(c.text for c in chunks),
        logprobs=tuple(lp for c in chunks for lp in c.logprobs),
        finish_reason=last.finish_reason,
        usage=last.usage,
        worker_id=last.worker_id,
        content=read.content,
        calls=read.calls,
        called=called,
    )
