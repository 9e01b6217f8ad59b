"""End to end: tool calling with the official ``openai`` client against the real system.

The model is the tiny random one with a Qwen2.5-style chat template
(``tests.gateway.test_tools.write_tool_model``), so mlx-lm's ``json_tools`` format reads its calls.
A random model calls no tool on its own: the named and required choices constrain its output to
the tools' schemas (the worker masks its sampler), and the ``auto`` test forces a call with a
regex (structured output beside ``tool_choice`` auto is allowed; only required and named, which
are constraints themselves, conflict with one).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from gateway.chat import template_messages
from gateway.protocol import ChatMessage
from gateway.tokenizer import Tokenizer
from kvserve_launch.system import System
from tests.e2e.conftest import LogSink, started_system
from tests.gateway.test_tools import PARIS, TIME, WEATHER, write_tool_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# The call the auto test forces, as a regex (llguidance's syntax: braces escaped).
FORCED = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "Paris", "unit": "celsius"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tool_model(tmp_path_factory.mktemp("models") / "tiny-tools")


@pytest.fixture(scope="module")
def system(logs: LogSink, tool_model: Path) -> Iterator[System]:
    yield from started_system(logs, model=str(tool_model), workers=1)


@pytest.fixture(scope="module")
def client(system: System) -> OpenAI:
    return OpenAI(base_url=f"http://{system.http_address}/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def create(client: OpenAI, model: str, **fields: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=fields.pop("messages", QUESTION), temperature=0, **fields
    )


def test_named_choice_returns_a_call_whose_arguments_match_the_schema(client: OpenAI, model: str):
    r = create(client, model, tools=[WEATHER, TIME], tool_choice=NAMED, max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])

    stream = create(
        client, model, tools=[WEATHER, TIME], tool_choice=NAMED, max_tokens=100, stream=True
    )
    chunks = list(stream)
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert {p.index for p in pieces} == {0}
    # Greedy: the same arguments, streamed as they are written.
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_choice_returns_calls_of_the_tools(client: OpenAI, model: str):
    r = create(
        client,
        model,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls  # parallel_tool_calls false: exactly one
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    schema = tool["function"].get("parameters", {"type": "object"})
    jsonschema.validate(json.loads(call.function.arguments), schema)


# Local references that are not #/$defs/...: nested in required's array, each must still point
# into the tool's own parameters. Enums keep the random model's arguments short.
PICK = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {
                "v": {"$ref": "#/definitions/Item"},
                "w": {"$ref": "#/properties/v"},
            },
            "required": ["v", "w"],
            "additionalProperties": False,
            "definitions": {"Item": {"enum": ["a", "b"]}},
        },
    },
}


def test_required_choice_with_references_outside_defs(client: OpenAI, model: str):
    r = create(
        client,
        model,
        tools=[PICK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "pick"
    jsonschema.validate(json.loads(call.function.arguments), PICK["function"]["parameters"])


def test_auto_reads_the_models_call(client: OpenAI, model: str):
    forced = {"guided_regex": FORCED}
    r = create(client, model, tools=[WEATHER], max_tokens=120, extra_body=forced)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == PARIS

    stream = create(client, model, tools=[WEATHER], max_tokens=120, extra_body=forced, stream=True)
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""  # the markers never leak as content
    [piece] = [t for d in deltas for t in d.tool_calls or []]
    assert piece.index == 0 and piece.id and piece.function.name == "get_weather"
    assert json.loads(piece.function.arguments) == PARIS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_without_a_call_is_text(client: OpenAI, model: str):
    r = create(
        client, model, tools=[WEATHER], max_tokens=8, extra_body={"guided_regex": "[a-z]{8}"}
    )
    choice = r.choices[0]
    assert choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and len(choice.message.content) == 8
    assert choice.finish_reason in ("stop", "length")


def test_the_call_and_its_result_go_back_through_the_template(
    client: OpenAI, model: str, tool_model: Path
):
    """A client's next turn: the assistant's call and the tool's result, sent back. The
    prompt is the template's rendering of both (its token count is the gateway tokenizer's for
    that rendering, which holds the call as JSON and the result)."""
    r = create(client, model, tools=[WEATHER], max_tokens=120, extra_body={"guided_regex": FORCED})
    message = r.choices[0].message
    history = [
        *QUESTION,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C, sunny"},
    ]
    follow = create(client, model, messages=history, tools=[WEATHER], max_tokens=4)
    assert follow.choices[0].message.role == "assistant"

    tokenizer = Tokenizer.load(str(tool_model))
    rendered = template_messages([ChatMessage.model_validate(m) for m in history])
    ids = tokenizer.apply_chat_template(rendered, tools=[WEATHER])
    text = tokenizer.decode(ids)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert follow.usage is not None and follow.usage.prompt_tokens == len(ids)


def test_a_named_choice_of_no_tool_is_a_400(client: OpenAI, model: str):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        create(
            client,
            model,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert "not in tools" in str(e.value)
