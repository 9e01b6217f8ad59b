"""A JSON schema's numeric bounds beyond ±2^53 are refused by name: the grammar engine reads
them as doubles (and an integer's as int64), so it rounded or clamped them. A maximum of 1e20
let a strict schema's output be int64's largest, beyond it; two bounds near int64's smallest
crashed the engine. Within ±2^53 the engine holds the output to the exact bounds."""

from __future__ import annotations

import json
import math

import pytest

from kvserve_model.structured_output import (
    EXACT_LIMIT,
    StructuredOutput,
    StructuredOutputError,
)
from tests.model.test_structured_regex import _accepts

WIDE = [
    {"type": "integer", "minimum": -9223372036854775807, "maximum": -9223372036854775803},
    {"type": "integer", "minimum": 10**20, "maximum": 10**20 + 5},
    {"type": "integer", "minimum": 1e20, "maximum": 1e20},
    {"type": "number", "exclusiveMaximum": -(2**60)},
    {"type": "integer", "minimum": EXACT_LIMIT + 1},
    {"type": "object", "properties": {"n": {"anyOf": [{"type": "null"}, {"maximum": 1e300}]}}},
    {"type": "array", "items": [{"type": "integer"}, {"minimum": -(10**30)}]},
    {"$defs": {"big": {"type": "integer", "maximum": 2**63 - 1}}, "$ref": "#/$defs/big"},
]


@pytest.mark.parametrize("schema", WIDE)
def test_a_bound_beyond_2_53_is_refused_naming_it(schema: dict) -> None:
    so = StructuredOutput.json_schema(schema)
    with pytest.raises(StructuredOutputError, match=r"beyond ±2\^53") as e:
        so.check()
    assert "(at /" in str(e.value)


def test_the_wire_form_is_held_to_the_same_rule() -> None:
    """The worker builds constraints from the wire's schema text, never from a dict."""
    text = json.dumps({"properties": {"a/b": {"minimum": -(2**62)}}})
    with pytest.raises(StructuredOutputError, match=r"minimum .* \(at /properties/a~1b\)"):
        StructuredOutput("json_schema", text).grammar()


@pytest.mark.parametrize(
    "schema",
    [
        {"enum": [10**30, "x"]},  # data, not bounds
        {"const": {"maximum": 1e300}},
        {"type": "integer", "default": 2**63, "examples": [2**64]},
        {"type": "object", "properties": {"maximum": {"type": "integer"}}},  # a property's name
        {"type": "integer", "minimum": -EXACT_LIMIT, "maximum": EXACT_LIMIT},
        {"type": "number", "exclusiveMinimum": True, "minimum": 0},  # draft 4's boolean form
    ],
)
def test_data_names_and_bounds_within_2_53_pass(schema: dict) -> None:
    StructuredOutput.json_schema(schema).check()


@pytest.mark.parametrize("sign", [1, -1])
def test_integers_at_the_edge_of_2_53_are_held_to_their_exact_bounds(sign: int) -> None:
    lo, hi = sorted((sign * (EXACT_LIMIT - 3), sign * EXACT_LIMIT))
    grammar = StructuredOutput.json_schema(
        {"type": "integer", "minimum": lo, "maximum": hi}
    ).check()
    for n in range(lo, hi + 1):
        assert _accepts(grammar, str(n)), n
    for n in (lo - 1, hi + 1, lo - 10, hi + 10):
        assert not _accepts(grammar, str(n)), n


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_not_json(value: float) -> None:
    with pytest.raises(StructuredOutputError, match="not valid JSON"):
        StructuredOutput.json_schema({"type": "number", "maximum": value})


@pytest.mark.parametrize("depth", [200, 2000, 20000])
def test_a_schema_nested_too_deep_is_an_error_not_a_recursion(depth: int) -> None:
    text = '{"items":' * depth + "{}" + "}" * depth
    with pytest.raises(StructuredOutputError, match="nests deeper than"):
        StructuredOutput.json_schema(text).check()
    with pytest.raises(StructuredOutputError, match="nests deeper than"):
        StructuredOutput("json_schema", text).grammar()  # as the worker reads it
    nested: dict = {}
    for _ in range(depth):
        nested = {"items": nested}
    with pytest.raises(StructuredOutputError, match="nests deeper than"):
        StructuredOutput.json_schema(nested).check()
