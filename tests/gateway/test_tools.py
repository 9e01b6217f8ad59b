"""Tool calling in the gateway (gateway/tools.py, gateway/chat.py): the model's tool-call format
from mlx-lm's own loader logic, its output read into calls whole and in pieces, the schemas that
constrain required and named choices, the 400s, and the template round trip.

The model here is the tiny test model with a Qwen2.5-style chat template (``write_tool_model``,
which the end-to-end tests serve too): ``<tool_call>`` JSON calls, mlx-lm's ``json_tools``.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from gateway.chat import ChatView, template_messages
from gateway.core import Gateway
from gateway.errors import InvalidRequest
from gateway.generation import Chunk, FinishReason, Usage
from gateway.http_app import create_app
from gateway.protocol import ChatCompletionRequest, ChatMessage
from gateway.tokenizer import Tokenizer
from gateway.tools import (
    NO_PARAMETERS,
    CallArray,
    MarkedCalls,
    NamedCall,
    Read,
    ToolChunk,
    ToolPlan,
    read_tool_calls,
    required_schema,
    tool_plan,
    whole_calls,
)
from kvserve_model.structured_output import StructuredOutput
from kvserve_model.tiny_model import ensure_tiny_model
from kvserve_model.tool_parsers import load_tool_parser
from tests.gateway.conftest import Stack, gateway_config
from tests.gateway.fake_worker import OUTPUT
from tests.gateway.test_http_errors import assert_error, closed_port

# A reduced Qwen2.5 template: tools in the system turn, an assistant's calls as <tool_call> JSON
# (``tool_call.name``: what mlx-lm recognises as json_tools), tool results as <tool_response>.
TOOL_TEMPLATE = """{{ bos_token }}
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Their signatures, within <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each call, return a JSON object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
PARIS = {"city": "Paris", "unit": "celsius"}
PLAIN = ToolPlan((WEATHER,), "auto")


def write_tool_model(directory: Path) -> Path:
    """The tiny test model with :data:`TOOL_TEMPLATE` as its chat template, in ``directory``."""
    if directory.exists():
        shutil.rmtree(directory)
    shutil.copytree(ensure_tiny_model(), directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}, indent=2))
    return directory


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tool_model(tmp_path_factory.mktemp("models") / "tiny-tools")


@pytest.fixture(scope="module")
def tool_tokenizer(tool_model: Path) -> Tokenizer:
    return Tokenizer.load(str(tool_model))


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
    return ChatCompletionRequest.model_validate(body)


# -- the format: mlx-lm's choice ---------------------------------------------------------------


def test_the_format_is_mlx_lms(tool_model: Path, tool_tokenizer: Tokenizer, tokenizer: Tokenizer):
    """The template names ``<tool_call>`` and ``tool_call.name``: json_tools, as mlx-lm's own
    loader picks it; the plain tiny model has no format; ``tool_parser_type`` overrides."""
    from mlx_lm.tokenizer_utils import load

    parser = tool_tokenizer.tool_parser
    assert parser is not None and parser.name == "json_tools"
    theirs = load(tool_model)
    assert (parser.start, parser.end) == (theirs.tool_call_start, theirs.tool_call_end)
    assert tokenizer.tool_parser is None

    config_file = tool_model.parent / "pythonic" / "tokenizer_config.json"
    shutil.copytree(tool_model, config_file.parent)
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "tool_parser_type": "pythonic"}))
    pythonic = Tokenizer.load(str(config_file.parent)).tool_parser
    theirs = load(config_file.parent)
    assert pythonic is not None and pythonic.name == "pythonic"
    assert (pythonic.start, pythonic.end) == (theirs.tool_call_start, theirs.tool_call_end)


def test_a_format_mlx_lm_lacks_is_a_load_error(tool_model: Path):
    from kvserve_model.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="lacks"):
        load_tool_parser("no_such_format")
    with pytest.raises(ModelLoadError):
        load_tool_parser("../server")


def test_no_mlx_is_loaded_to_find_a_format(tool_model: Path):
    from tests.test_import_rules import _loaded_after

    loaded = _loaded_after(
        "from gateway.tokenizer import Tokenizer\n"
        f"t = Tokenizer.load({str(tool_model)!r})\n"
        "assert t.tool_parser is not None and t.tool_parser.name == 'json_tools'\n"
        "from kvserve_model.tool_parsers import load_tool_parser\n"
        "load_tool_parser('laguna')  # relative imports: from .glm47 import ...\n"
    )
    assert not loaded & {"mlx", "mlx_lm"}


# -- reading auto calls ------------------------------------------------------------------------


def marked(parallel: bool = True, fmt: str = "json_tools") -> MarkedCalls:
    return MarkedCalls(load_tool_parser(fmt), [WEATHER, TIME], parallel)


def pieces(reader: MarkedCalls, text: str, cuts: list[int]) -> list[Read]:
    bounds = [0, *sorted(cuts), len(text)]
    reads = [reader.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    return [*reads, reader.finish()]


def total(reads: list[Read]) -> Read:
    out = Read()
    for r in reads:
        out += r
    return out


def test_text_without_calls_is_content_unchanged():
    for text in ["", "Hello", "a < b and <tool but not a call", "  spaces \n\n", "<tool_call"]:
        reader = marked()
        assert reader.read(text) == Read(text)
        assert not reader.called


def test_a_call_is_read_and_the_text_around_it_is_content():
    reader = marked()
    read = reader.read("Let me check.\n" + CALL + "\n")
    assert read.content == "Let me check."
    [call] = whole_calls(read.calls)
    assert call.name == "get_weather" and json.loads(call.arguments) == PARIS
    assert call.id.startswith("call_") and len(call.id) == 29
    assert reader.called


def test_calls_split_anywhere_read_the_same():
    """Every way of cutting the text into pieces (markers split, segments split over many
    pieces) reads as the whole does; no piece of content is ever part of a marker."""
    text = "Sure.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\nDone <tool"
    whole = marked().read(text)
    assert whole.content == "Sure.\nDone <tool"
    assert [json.loads(c.arguments)["city"] for c in whole_calls(whole.calls)] == ["Paris", "Rome"]
    rng = random.Random(7)
    for trial in range(300):
        cuts = (
            rng.sample(range(1, len(text)), rng.randint(1, 40))
            if trial
            else list(range(1, len(text)))
        )
        reads = pieces(marked(), text, cuts)
        assert total(reads).content == whole.content
        calls = whole_calls([c for r in reads for c in r.calls])
        assert [(c.name, c.arguments) for c in calls] == [
            (c.name, c.arguments) for c in whole_calls(whole.calls)
        ]
        for r in reads:
            assert "<tool_call" not in r.content and "tool_call>" not in r.content


def test_content_streams_before_the_call_and_a_marker_prefix_is_held():
    reader = marked()
    assert reader.feed("Hi there") == Read("Hi there")
    assert reader.feed(" <tool_") == Read("")  # could be a call's start: held
    assert reader.feed("x>") == Read(" <tool_x>")  # it was not
    assert reader.feed("\n\n") == Read("")  # whitespace waits: a call may follow
    read = reader.feed(CALL[:20])
    assert read == Read("")  # the whitespace before a call is dropped
    read = reader.feed(CALL[20:])
    assert read.content == "" and len(read.calls) == 1
    assert reader.finish() == Read("")


def test_a_call_that_does_not_parse_stays_content(caplog: pytest.LogCaptureFixture):
    bad = "<tool_call>\n{not json}\n</tool_call>"
    reader = marked()
    read = reader.read("A " + bad + " B")
    assert read.content == "A" + bad + " B"
    assert not read.calls and not reader.called
    assert "did not parse" in caplog.text
    # Valid JSON that is not a call ({"name": ...} missing) stays content too.
    assert marked().read('<tool_call>["x"]</tool_call>').content == '<tool_call>["x"]</tool_call>'


def test_a_call_cut_short_is_read_at_the_end_as_mlx_lm_does():
    reader = marked()
    read = reader.read(CALL.removesuffix("</tool_call>"))
    assert [c.name for c in whole_calls(read.calls)] == ["get_weather"]


def test_parallel_tool_calls_false_keeps_the_first_call():
    read = marked(parallel=False).read(CALL + CALL.replace("Paris", "Rome"))
    assert [json.loads(c.arguments)["city"] for c in whole_calls(read.calls)] == ["Paris"]


def test_formats_with_several_calls_in_one_segment():
    text = 'Ok <|tool_call_start|>[get_weather(city="Paris", unit="celsius"), get_time()]<|tool_call_end|>'
    read = marked(fmt="pythonic").read(text)
    assert read.content == "Ok"
    calls = whole_calls(read.calls)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", PARIS),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2


def test_a_format_without_an_end_marker_runs_to_the_end():
    text = 'x [TOOL_CALLS][{"name": "get_time", "arguments": {}}]'
    reads = pieces(marked(fmt="mistral"), text, list(range(1, len(text))))
    assert total(reads).content == "x"
    assert [c.name for c in whole_calls([c for r in reads for c in r.calls])] == ["get_time"]


def test_arguments_written_as_json_text_are_kept():
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    [call] = whole_calls(marked().read(text).calls)
    assert json.loads(call.arguments) == {"tz": "UTC"}


# -- reading constrained calls -----------------------------------------------------------------


def test_a_named_call_streams_its_arguments():
    reader = NamedCall("get_weather")
    first = reader.feed('{"city": ')
    later = reader.feed('"Paris"}')
    assert first.calls[0].id and first.calls[0].name == "get_weather"
    assert later.calls[0].id is None and later.calls[0].name is None
    assert reader.finish() == Read()
    [call] = whole_calls([*first.calls, *later.calls])
    assert call.arguments == '{"city": "Paris"}' and reader.called
    [empty] = whole_calls(NamedCall("get_time").read("").calls)
    assert empty.name == "get_time" and empty.arguments == ""


def test_required_calls_are_read_from_the_array():
    text = json.dumps(
        [{"name": "get_weather", "parameters": PARIS}, {"name": "get_time", "parameters": {}}],
        separators=(", ", ": "),
    )
    reader = CallArray(parallel=True)
    assert reader.feed(text[:10]) == Read()
    read = reader.feed(text[10:]) + reader.finish()
    calls = whole_calls(read.calls)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", PARIS),
        ("get_time", {}),
    ]
    assert read.content == "" and reader.called
    cut = CallArray(parallel=True).read(text[:30])  # max_tokens cut it short
    assert cut == Read(text[:30])


def test_required_schema_compiles_and_says_what_calls_are():
    params = {
        "get_weather": WEATHER["function"]["parameters"],
        "lookup": {
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}},
            "required": ["item"],
            "$defs": {"Item": {"type": "string", "enum": ["a", "b"]}},
        },
        "get_time": None,
    }
    schema = required_schema(params, parallel=True)
    StructuredOutput.json_schema(schema).check()
    # Each tool's parameters whole in the root's $defs, its own $defs inside them.
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"$ref": "#/$defs/lookup"}
    assert schema["$defs"]["lookup"]["properties"]["item"] == {"$ref": "#/$defs/lookup/$defs/Item"}
    good = [
        {"name": "get_weather", "parameters": PARIS},
        {"name": "lookup", "parameters": {"item": "a"}},
        {"name": "get_time", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"city": "Paris"}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "lookup", "parameters": {"item": "c"}}],
        [{"name": "get_time", "parameters": {}, "description": "no other keys"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = required_schema(params, parallel=False)
    StructuredOutput.json_schema(one).check()
    jsonschema.validate(good[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)
    assert params["lookup"] is not None and "$defs" in params["lookup"]  # not changed


# Parameters whose local references point elsewhere than #/$defs: each must still point inside
# its tool's parameters once they are nested in required's array (the wrapper's root is not
# theirs). (tool's parameters, a call's arguments they take, arguments they refuse)
RELOCATED = {
    "definitions": (
        {
            "type": "object",
            "properties": {"v": {"$ref": "#/definitions/Item"}},
            "required": ["v"],
            "definitions": {"Item": {"type": "integer"}},
        },
        {"v": 7},
        {"v": "7"},
    ),
    "sibling": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
            "required": ["a", "b"],
        },
        {"a": 1, "b": 2},
        {"a": 1, "b": "2"},
    ),
    "recursive": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#"}},
            },
            "required": ["name"],
            "additionalProperties": False,
        },
        {"name": "a", "children": [{"name": "b"}]},
        {"name": "a", "children": [{"name": "b", "x": 1}]},
    ),
    # A property called "$ref" is data, not a reference; a reference to it is one.
    "ref_named": (
        {
            "type": "object",
            "properties": {"$ref": {"type": "string"}, "copy": {"$ref": "#/properties/$ref"}},
            "required": ["$ref", "copy"],
            "additionalProperties": False,
        },
        {"$ref": "#", "copy": "x"},
        {"$ref": "#", "copy": 1},
    ),
    # References inside the tool's definitions, and the same definition name in another tool.
    "in_defs": (
        {
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}},
            "required": ["item"],
            "$defs": {
                "Item": {"type": "array", "items": {"$ref": "#/$defs/Leaf"}},
                "Leaf": {"type": "boolean"},
            },
        },
        {"item": [True]},
        {"item": ["a"]},
    ),
}


@pytest.mark.parametrize("name", RELOCATED)
def test_required_keeps_references_inside_their_tool(name: str):
    import llguidance

    from kvserve_model.tiny_model import IM_END

    schema, good, bad = RELOCATED[name]
    other = {"type": "object", "$defs": {"Item": {"type": "string"}}, "properties": {}}
    tools = [
        {"type": "function", "function": {"name": name, "parameters": schema}},
        {"type": "function", "function": {"name": "other", "parameters": other}},
    ]
    plan = tool_plan(chat(tools=tools, tool_choice="required"), None)
    assert plan is not None and plan.constraint is not None
    grammar = plan.constraint.so.check()
    wrapper = json.loads(plan.constraint.so.spec)
    call = [{"name": name, "parameters": good}]
    jsonschema.validate(call, wrapper)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": name, "parameters": bad}], wrapper)
    tokenizer_json = (ensure_tiny_model() / "tokenizer.json").read_text()
    tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=IM_END)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    text = json.dumps(call, separators=(", ", ": "))
    assert matcher.consume_tokens(tokenizer.tokenize_str(text)), matcher.get_error()
    assert matcher.is_accepting()
    refused = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    bad_text = json.dumps([{"name": name, "parameters": bad}], separators=(", ", ": "))
    assert not refused.consume_tokens(tokenizer.tokenize_str(bad_text))


def test_a_schema_that_is_only_a_reference_to_itself_stays_one():
    """``{"$ref": "#"}``: nested, "#" would be the wrapper (an array of calls); it is the tool's
    parameters again, as with the tool named (where the schema is used alone)."""
    schema = required_schema({"f": {"$ref": "#"}}, parallel=True)
    assert schema["$defs"]["f"] == {"$ref": "#/$defs/f"}
    StructuredOutput.json_schema(schema).check()


def test_relocated_references_escape_the_key_and_keep_what_is_not_theirs():
    params = {
        "a/b~c d": {
            "type": "object",
            "properties": {
                "x": {"$ref": "#/properties/y"},
                "y": {"enum": [{"$ref": "#"}], "default": {"$ref": "#"}},
                "z": {"$ref": "#Anchor"},
                "w": {"$ref": "other.json#/x"},
                "r": {"$id": "https://example.com/r", "items": {"$ref": "#/$defs/R"}},
            },
        }
    }
    schema = required_schema(params, parallel=True)
    key = "a~1b~0c%20d"
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == {"$ref": f"#/$defs/{key}"}
    moved = schema["$defs"]["a/b~c d"]["properties"]
    assert moved["x"] == {"$ref": f"#/$defs/{key}/properties/y"}
    assert moved["y"] == params["a/b~c d"]["properties"]["y"]  # data: enum and default
    assert moved["z"] == {"$ref": "#Anchor"} and moved["w"] == {"$ref": "other.json#/x"}
    assert moved["r"] == params["a/b~c d"]["properties"]["r"]  # its own resource: its own "#"
    arguments = {"x": {"$ref": "#"}, "y": {"$ref": "#"}}
    jsonschema.validate([{"name": "a/b~c d", "parameters": arguments}], schema)
    with pytest.raises(jsonschema.ValidationError):  # x is y's enum, wherever it now lies
        jsonschema.validate([{"name": "a/b~c d", "parameters": {"x": 1}}], schema)


def test_the_grammar_takes_the_calls_it_should():
    """llguidance, on the tiny model's byte-level tokenizer, takes a compact array of calls and
    may end there; it refuses a name that is no tool's."""
    import llguidance

    from kvserve_model.tiny_model import IM_END

    tokenizer_json = (ensure_tiny_model() / "tokenizer.json").read_text()
    tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=IM_END)
    plan = tool_plan(chat(tools=[WEATHER, TIME], tool_choice="required"), None)
    assert plan is not None and plan.constraint is not None
    grammar = plan.constraint.so.check()
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]'
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert matcher.consume_tokens(tokenizer.tokenize_str(text)), matcher.get_error()
    assert matcher.is_accepting()
    bad = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not bad.consume_tokens(tokenizer.tokenize_str('[{"name": "other"'))


def test_the_plans():
    parser = load_tool_parser("json_tools")
    assert tool_plan(chat(), parser) is None
    assert tool_plan(chat(tool_choice="none"), None) is None
    auto = tool_plan(chat(tools=[WEATHER]), parser)
    assert auto is not None and auto.choice == "auto" and auto.constraint is None
    assert isinstance(auto.reader(), MarkedCalls)
    none = tool_plan(chat(tools=[WEATHER], tool_choice="none"), None)
    assert none is not None and none.reader() is None and none.constraint is None
    named = tool_plan(
        chat(
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        ),
        None,
    )
    assert named is not None and named.function == "get_time" and named.constraint is not None
    assert json.loads(named.constraint.so.spec) == NO_PARAMETERS  # no parameters: arguments {}
    one = tool_plan(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), None)
    assert one is not None and one.constraint is not None
    assert json.loads(one.constraint.so.spec)["maxItems"] == 1


# -- streaming and rendering -------------------------------------------------------------------


async def worker_stream(
    text: str, reason: FinishReason = FinishReason.STOP
) -> AsyncGenerator[Chunk, None]:
    """A worker's chunks of ``text``: one character a chunk, the last with the finish."""
    for i, ch in enumerate(text):
        last = i == len(text) - 1
        yield Chunk(
            token_ids=(ord(ch),),
            text=ch,
            finish_reason=reason if last else None,
            usage=Usage(3, 0, len(text)) if last else None,
            worker_id="w0",
        )


async def test_held_chunks_are_merged_into_the_next_that_reads_as_something():
    text = "Hi\n" + CALL
    out = [c async for c in read_tool_calls(worker_stream(text), marked(), PLAIN)]
    assert all(isinstance(c, ToolChunk) for c in out)
    assert "".join(c.text for c in out) == text
    assert [t for c in out for t in c.token_ids] == [ord(ch) for ch in text]
    assert "".join(c.content for c in out) == "Hi"  # type: ignore[attr-defined]
    last = out[-1]
    assert isinstance(last, ToolChunk) and last.called and len(last.calls) == 1
    assert last.finish_reason is FinishReason.STOP and last.usage == Usage(3, 0, len(text))
    assert len(out) == 3  # "H", "i", then everything else at once


def view(
    plan_fields: dict[str, Any], parser_name: str | None = "json_tools"
) -> tuple[ChatView, Any]:
    parser = load_tool_parser(parser_name) if parser_name else None
    plan = tool_plan(chat(**plan_fields), parser)
    return ChatView("chatcmpl-1", "m", 0, 1, None, plan), plan


async def served(view_: ChatView, plan: Any, text: str, stream: bool, reason=FinishReason.STOP):
    req = chat(stream=stream)
    streams: list[AsyncGenerator[Chunk, None]] = [worker_stream(text, reason)]
    if stream:
        streams = [read_tool_calls(streams[0], plan.reader(), plan)]
    out = await view_.serve(streams, req)
    if not stream:
        assert out.body is not None
        return out.body.model_dump(mode="json")
    assert out.events is not None
    events = [e async for e in out.events]
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


async def test_an_auto_call_rendered_whole_and_streamed():
    v, plan = view({"tools": [WEATHER]})
    body = await served(v, plan, "Checking.\n" + CALL, stream=False)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == PARIS

    v, plan = view({"tools": [WEATHER]})
    events = await served(v, plan, "Checking.\n" + CALL + CALL, stream=True)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [c["index"] for c in calls] == [0, 1]
    for c in calls:
        assert set(c) == {"index", "id", "type", "function"}
        assert c["function"]["name"] == "get_weather"
        assert json.loads(c["function"]["arguments"]) == PARIS
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(d for d in deltas[:-1])  # no empty event before the last


async def test_no_call_is_plain_content_and_a_cut_call_is_length():
    v, plan = view({"tools": [WEATHER]})
    body = await served(v, plan, "Just text.", stream=False)
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Just text."}
    assert body["choices"][0]["finish_reason"] == "stop"
    v, plan = view({"tools": [WEATHER]})
    body = await served(v, plan, CALL[:30], stream=False, reason=FinishReason.LENGTH)
    assert body["choices"][0]["finish_reason"] == "length"


async def test_a_named_call_rendered_whole_and_streamed():
    named = {
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    args = json.dumps(PARIS, separators=(", ", ": "))
    v, plan = view(named, None)
    body = await served(v, plan, args, stream=False)
    message = body["choices"][0]["message"]
    assert message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": args}
    ]
    assert body["choices"][0]["finish_reason"] == "tool_calls"

    v, plan = view(named, None)
    events = await served(v, plan, args, stream=True)
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", ())]
    assert len(calls) == len(args)  # a piece a token
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert all(
        set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:]
    )
    assert "".join(c["function"]["arguments"] for c in calls) == args
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_required_calls_rendered_streamed():
    v, plan = view({"tools": [WEATHER, TIME], "tool_choice": "required"}, None)
    text = json.dumps([{"name": "get_time", "parameters": {}}] * 2)
    events = await served(v, plan, text, stream=True)
    assert len(events) == 2  # the role, then the calls with the finish
    calls = events[1]["choices"][0]["delta"]["tool_calls"]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "get_time", "{}"),
        (1, "get_time", "{}"),
    ]
    assert events[1]["choices"][0]["finish_reason"] == "tool_calls"


# -- the round trip through the template -------------------------------------------------------


def test_calls_and_results_go_back_through_the_template(tool_tokenizer: Tokenizer):
    messages = [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(PARIS)},
                    }
                ],
            }
        ),
        ChatMessage.model_validate({"role": "tool", "tool_call_id": "call_1", "content": "18 C"}),
    ]
    rendered = template_messages(messages)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == PARIS  # an object now
    assert rendered[1]["content"] == "" and rendered[2]["tool_call_id"] == "call_1"
    ids = tool_tokenizer.apply_chat_template(rendered, tools=[WEATHER])
    text = tool_tokenizer.decode(ids)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        in text
    )
    assert "<tool_response>\n18 C\n</tool_response>" in text
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # the tools, in the system turn
    with pytest.raises(InvalidRequest) as e:
        template_messages(
            [
                ChatMessage.model_validate(
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                    }
                )
            ]
        )
    assert e.value.param == "messages.0.tool_calls.0"


# -- over HTTP ---------------------------------------------------------------------------------


@pytest.fixture
async def client(tokenizer: Tokenizer) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway (plain tiny model: no tool-call format) with no cache service behind it."""
    gw = Gateway.build(gateway_config(f"127.0.0.1:{closed_port()}"), tokenizer)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(gw)), base_url="http://gw"
    ) as c:
        yield c
    await gw.close()


NAMED = {"type": "function", "function": {"name": "get_weather"}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [WEATHER]}, "tools", "no tool-call format"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools", "64"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "two tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools",
            "parameters",
        ),
        ({"tools": [TIME] * 129}, "tools", "128"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "not one of"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": NAMED}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", ""),
        (
            {"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "tool_choice",
            "two constraints",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"},
            "tool_choice",
            "two constraints",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
                ],
                "tool_choice": "required",
            },
            "tools",
            "schema",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "legacy"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
                ]
            },
            "messages.1.tool_calls.0",
            "name",
        ),
    ],
)
async def test_bad_tools_are_400s(client: httpx.AsyncClient, body: dict, param: str, words: str):
    err = assert_error(await client.post("/v1/chat/completions", json={**CHAT, **body}), 400, param)
    assert words in err["message"]


async def test_a_named_call_through_the_gateway_with_any_model(stack: Stack):
    """The plain tiny model has no tool template: a named choice works all the same. The worker
    gets the parameters' schema as the constraint; its output (the fake's sentence) comes back
    as the call's arguments."""
    client = stack.openai()
    r = await client.chat.completions.create(
        model="kvserve-tiny-llama",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice=NAMED,  # type: ignore[arg-type]
        max_tokens=200,
    )
    sent = [w.record.requests[-1] for w in stack.workers if w.record.requests][-1]
    assert sent.sampling.structured_output.WhichOneof("kind") == "json_schema"
    assert (
        json.loads(sent.sampling.structured_output.json_schema) == WEATHER["function"]["parameters"]
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.function.arguments == OUTPUT

    stream = await client.chat.completions.create(
        model="kvserve-tiny-llama",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice=NAMED,  # type: ignore[arg-type]
        max_tokens=200,
        stream=True,
    )
    chunks = [c async for c in stream]
    pieces_ = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert pieces_[0].id and pieces_[0].function and pieces_[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in pieces_ if p.function) == OUTPUT
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_tool_choice_none_is_served_as_text(stack: Stack):
    resp = await stack.http.post(
        "/v1/chat/completions",
        json={**CHAT, "max_tokens": 200, "tools": [WEATHER], "tool_choice": "none"},
    )
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": OUTPUT}


# -- markers that are special tokens -----------------------------------------------------------


@pytest.fixture(scope="module")
def special_marker_tokenizer(tool_model: Path) -> Tokenizer:
    """The tool model with ``<tool_call>`` and ``</tool_call>`` as special tokens (its reserved
    ids 261 and 262 renamed), as Mistral's ``[TOOL_CALLS]`` or LFM2's markers are."""
    model = tool_model.parent / "special-markers"
    shutil.copytree(tool_model, model)
    renames = {"<|reserved_0|>": "<tool_call>", "<|reserved_1|>": "</tool_call>"}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (model / name).read_text()
        for old, new in renames.items():
            text = text.replace(old, new)
        (model / name).write_text(text)
    return Tokenizer.load(str(model))


def test_special_markers_are_kept_and_the_final_special_token_cut(
    special_marker_tokenizer: Tokenizer, tool_tokenizer: Tokenizer
):
    t = special_marker_tokenizer
    assert t.special_tokens[261] == "<tool_call>" and t.special_tokens[259] == "<|im_end|>"
    assert t.tool_parser is not None and t.tool_parser.name == "json_tools"
    plan = tool_plan(chat(tools=[WEATHER]), t.tool_parser, t.special_tokens)
    assert plan is not None and plan.special  # special tokens are asked for
    assert plan.final_text("x<|im_end|>", [120, 259]) == "x"
    assert plan.final_text("x<|im_end|>", [259, 120]) == "x<|im_end|>"
    # Not where the markers are plain text, nor where the client keeps special tokens itself.
    plain = tool_plan(
        chat(tools=[WEATHER]), tool_tokenizer.tool_parser, tool_tokenizer.special_tokens
    )
    assert plain is not None and not plain.special
    kept = tool_plan(
        chat(tools=[WEATHER], skip_special_tokens=False), t.tool_parser, t.special_tokens
    )
    assert kept is not None and not kept.special
    assert kept.final_text("x<|im_end|>", [120, 259]) == "x<|im_end|>"


async def test_a_call_between_special_markers_streamed_and_whole(
    special_marker_tokenizer: Tokenizer,
):
    t = special_marker_tokenizer
    args = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    pieces_ = [("Ok", (79, 107)), ("<tool_call>", (261,))]
    pieces_ += [(ch, (ord(ch),)) for ch in args]
    pieces_ += [("</tool_call>", (262,)), ("<|im_end|>", (259,))]

    async def stream() -> AsyncGenerator[Chunk, None]:
        for k, (text, ids) in enumerate(pieces_):
            last = k == len(pieces_) - 1
            yield Chunk(ids, text, finish_reason=FinishReason.STOP if last else None)

    for streamed in (True, False):
        plan = tool_plan(chat(tools=[WEATHER]), t.tool_parser, t.special_tokens)
        assert plan is not None
        view_ = ChatView("chatcmpl-1", "m", 0, 1, None, plan)
        reader = plan.reader()
        assert reader is not None
        streams = [read_tool_calls(stream(), reader, plan) if streamed else stream()]
        out = await view_.serve(streams, chat(stream=streamed))
        if streamed:
            assert out.events is not None
            events = [json.loads(e[6:]) for e in [e async for e in out.events][:-1]]
            deltas = [e["choices"][0]["delta"] for e in events]
            content = "".join(d.get("content", "") for d in deltas)
            calls = [c for d in deltas for c in d.get("tool_calls", ())]
            reason = events[-1]["choices"][0]["finish_reason"]
        else:
            assert out.body is not None
            body = out.body.model_dump(mode="json")
            content = body["choices"][0]["message"]["content"]
            calls = body["choices"][0]["message"]["tool_calls"]
            reason = body["choices"][0]["finish_reason"]
        assert content == "Ok" and reason == "tool_calls"
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [PARIS]


@pytest.mark.parametrize(
    ("tokenizer_fixture", "skip"),
    [("special_marker_tokenizer", False), ("tool_tokenizer", True)],
)
async def test_the_worker_is_asked_for_special_tokens_only_where_markers_are_special(
    cache, request: pytest.FixtureRequest, tokenizer_fixture: str, skip: bool
):
    from tests.gateway.conftest import started_stack

    async with started_stack(cache, request.getfixturevalue(tokenizer_fixture)) as s:
        resp = await s.http.post(
            "/v1/chat/completions", json={**CHAT, "max_tokens": 200, "tools": [WEATHER]}
        )
        assert resp.status_code == 200, resp.text
        # The fake's sentence has no call: content, as sent.
        assert resp.json()["choices"][0]["message"] == {"role": "assistant", "content": OUTPUT}
        sent = [w.record.requests[-1] for w in s.workers if w.record.requests][-1]
        assert sent.sampling.skip_special_tokens is skip


async def test_each_choice_has_its_own_reader():
    """n = 2, streamed: one choice calls, the other writes text; calls are numbered per choice."""
    plan = tool_plan(chat(tools=[WEATHER], n=2), load_tool_parser("json_tools"))
    assert plan is not None
    streams = []
    for text in (CALL, "Plain text."):
        reader = plan.reader()
        assert reader is not None
        streams.append(read_tool_calls(worker_stream(text), reader, plan))
    out = await ChatView("chatcmpl-1", "m", 0, 2, None, plan).serve(streams, chat(stream=True, n=2))
    assert out.events is not None
    events = [json.loads(e[6:]) for e in [e async for e in out.events][:-1]]
    by_choice: dict[int, list[dict]] = {0: [], 1: []}
    for e in events:
        for c in e["choices"]:
            by_choice[c["index"]].append(c)
    calls = [t for c in by_choice[0] for t in c["delta"].get("tool_calls", ())]
    assert [(t["index"], t["function"]["name"]) for t in calls] == [(0, "get_weather")]
    assert by_choice[0][-1]["finish_reason"] == "tool_calls"
    assert "".join(c["delta"].get("content", "") for c in by_choice[1]) == "Plain text."
    assert by_choice[1][-1]["finish_reason"] == "stop"
    assert not any(c["delta"].get("tool_calls") for c in by_choice[1])
