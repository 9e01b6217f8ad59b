"""Structured output, logit bias and penalties through the gateway, with the official
``openai`` client, on the real processes and the tiny random model (whose output is valid only
when the constraint holds)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field

from kvserve_launch.process import KeptLines as LogSink
from kvserve_launch.system import System
from kvserve_model.tiny_model import TINY_MODEL_NAME
from tests.e2e.conftest import started_system

MODEL = TINY_MODEL_NAME
ASK = [{"role": "user", "content": "Describe a city as JSON."}]
CRASHED_LLGUIDANCE = (
    '{"type":"integer","minimum":-9223372036854775807,"maximum":-9223372036854775803}'
)
# The tiny model's byte tokens for '"' and '}', pushed up.
CLOSING = {str(ord('"')): 6.0, str(ord("}")): 6.0}


@pytest.fixture(scope="module")
def system(logs: LogSink) -> Iterator[System]:
    yield from started_system(logs, workers=1)


@pytest.fixture(scope="module")
def client(system: System) -> OpenAI:
    return OpenAI(base_url=f"http://{system.http_address}/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def http(system: System) -> httpx.Client:
    return httpx.Client(base_url=f"http://{system.http_address}", timeout=120)


class City(BaseModel):
    name: str = Field(max_length=16)
    country: Literal["FR", "DE", "JP"]
    population: int = Field(ge=0, le=10_000)
    coastal: bool


def test_parse_returns_the_pydantic_model(client: OpenAI) -> None:
    for temperature in (0.0, 1.0):
        r = client.beta.chat.completions.parse(
            model=MODEL, messages=ASK, response_format=City, max_tokens=200,
            temperature=temperature, seed=3,
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City)


def test_json_object_and_schema_streamed(client: OpenAI) -> None:
    schema = City.model_json_schema()
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=200, stream=True, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema, "strict": True}},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)
    # Any object: a random model would write one forever; a bias towards closing strings
    # and objects ends it (the constraint alone decides what is valid).
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=300, temperature=1.0, seed=5, n=3,
        response_format={"type": "json_object"}, logit_bias=CLOSING,
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content or ""), dict)


def test_vllm_guided_fields_on_completions(client: OpenAI) -> None:
    cases = [
        ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ({"guided_choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
        ({"guided_grammar": 'root ::= "a" "b"* "c"'}, lambda t: re.fullmatch("ab*c", t)),
        ({"structured_outputs": {"choice": ["x", "y"]}}, lambda t: t in ("x", "y")),
        ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
         lambda t: isinstance(json.loads(t), list)),
    ]  # fmt: skip
    for body, valid in cases:
        r = client.completions.create(
            model=MODEL, prompt="The answer:", max_tokens=64, temperature=1.0, seed=1,
            n=2, extra_body=body,
        )  # fmt: skip
        for choice in r.choices:
            assert valid(choice.text), (body, choice.text)


def test_bad_constraints_are_a_400_naming_the_field(client: OpenAI, http: httpx.Client) -> None:
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
         "response_format.json_schema.schema"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 250}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        # Bounds beyond ±2^53 (which the engine rounds; these two crashed it), and a Lark
        # grammar embedding them, which reaches the engine: checked in a child process.
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": json.loads(CRASHED_LLGUIDANCE)}}}, "response_format.json_schema.schema"),
        ({"guided_json": {"type": "integer", "minimum": 1e20}}, "guided_json"),
        ({"guided_grammar": f"start: %json{CRASHED_LLGUIDANCE}"}, "guided_grammar"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters":
          {"type": "object", "properties": {"n": json.loads(CRASHED_LLGUIDANCE)}}}}],
          "tool_choice": "required"}, "tools"),
    ]  # fmt: skip
    for body, param in bad:
        resp = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": ASK, "max_tokens": 8, **body},
        )
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == param, (body, resp.text)
    with pytest.raises(BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=ASK, extra_body={"guided_regex": "[a-"}
        )
    r = client.chat.completions.create(  # and the system serves on
        model=MODEL, messages=ASK, max_tokens=40, extra_body={"guided_choice": ["ok"]}
    )
    assert r.choices[0].message.content == "ok"


def test_logprobs_of_constrained_tokens_are_json(http: httpx.Client) -> None:
    """A grammar leaves fewer tokens than top_logprobs asks for: the rest have -inf, which JSON
    cannot carry (the response failed to serialize: a 500, and the connection dropped). They
    come as -9999.0, vLLM's value, on both APIs, streamed and not; chosen tokens stay finite."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    chat = {"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 0,
            "logprobs": True, "top_logprobs": 20, "response_format": fmt}  # fmt: skip
    completion = {"model": MODEL, "prompt": "x", "max_tokens": 24, "logprobs": 20,
                  "guided_json": schema}  # fmt: skip

    def entries(path: str, body: dict) -> list[tuple[float, list[float]]]:
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if path.endswith("chat/completions"):
            content = choice["logprobs"]["content"]
            return [(e["logprob"], [t["logprob"] for t in e["top_logprobs"]]) for e in content]
        lp = choice["logprobs"]
        tops = [list(t.values()) for t in lp["top_logprobs"]]  # by text: equal texts merge
        return list(zip(lp["token_logprobs"], tops, strict=True))

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} in a streamed event")

    def streamed(path: str, body: dict) -> int:
        events = 0
        with http.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    json.loads(line[6:], parse_constant=no_constants)
                    events += 1
        return events

    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        got = entries(path, body)
        assert got and all(-9999.0 < chosen <= 0.0 for chosen, _ in got), got
        wanted = 20 if "messages" in body else 1
        assert all(len(top) >= wanted and all(-9999.0 <= v <= 0.0 for v in top) for _, top in got)
        assert any(-9999.0 in top for _, top in got), "the grammar ruled nothing out"
        assert streamed(path, body) > 1
    assert http.get("/health").status_code == 200  # on the same connection


def test_speculation_is_switched_off_and_said(http: httpx.Client) -> None:
    resp = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 16, "speculative": "ngram",
              "guided_regex": "[ab]{4}"},
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvserve-speculative"] == "off (structured output)"
    assert re.fullmatch("[ab]{4}", resp.json()["choices"][0]["text"])


def test_logit_bias_and_penalties(client: OpenAI, http: httpx.Client) -> None:
    resp = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
              "ignore_eos": True, "logit_bias": {"65": 100}, "return_token_ids": True},
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "A" * 8  # the tiny model's token 65 is "A"
    # Penalties change a greedy output that repeats itself.
    plain = (
        client.completions.create(
            model=MODEL,
            prompt="aaaa",
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    penalized = client.completions.create(
        model=MODEL, prompt="aaaa", max_tokens=24, temperature=0, frequency_penalty=2.0,
        presence_penalty=2.0, extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    assert len(set(penalized)) >= len(set(plain))
    assert max(penalized.count(c) for c in set(penalized)) <= max(
        plain.count(c) for c in set(plain)
    )
