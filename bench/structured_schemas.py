"""The JSON Schema suite that structured output is measured and tested on (issue 32).

Twenty schemas, from a flat object to arrays of objects, ``anyOf``/``oneOf``, ``$ref``,
``const``, enums, nulls, optional properties, numeric ranges, patterns and formats. Each carries
one valid instance (``example``) and two instances that must fail validation (``invalid``), so an
engine's correctness is measured on both sides: the example is accepted token by token, every
invalid instance is refused somewhere (``bench/bench_grammar.py``).

Every schema is **bounded**: even a random model constrained to it stops within about 200
tokens (one byte per token), so a test or a benchmark that samples under a schema always ends.
That is why every object has ``"additionalProperties": false``, every string a ``maxLength``
(at most 24) or a bounded enum, const, pattern or format, every array a ``maxItems`` (at most 4),
and every number a ``minimum`` and a ``maximum``. llguidance 1.9 turns ``minimum``/``maximum``
into an exact digit grammar for integers (``1001`` and ``007`` are refused under 0..1000), but
for a ``number`` it bounds only the integer part: the fraction takes any number of digits. So
every ``number`` here also has a ``multipleOf`` (0.5, 0.25), which llguidance compiles into a
bounded fraction; those are exact binary fractions because ``jsonschema`` checks a float
``multipleOf`` by division (``19.99 / 0.01`` is not an integer in floating point).
``tests/model/test_structured_schemas.py`` checks the bound with random walks under llguidance.

Properties appear in the examples in the schema's order: the engines generate them in that
order, and an invalid instance must be invalid by the schema, not merely reordered.

No imports beyond ``jsonschema`` (for :func:`check`): the gateway's tests may use the suite.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Schema:
    """One schema of the suite: ``example`` validates, each of ``invalid`` does not."""

    name: str
    schema: dict[str, Any]
    example: Any
    invalid: list[Any]


def obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """A closed object schema: ``required`` defaults to every property."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


def string(max_length: int = 24, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


def integer(minimum: int = 0, maximum: int = 1000) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def number(minimum: float, maximum: float, multiple_of: float) -> dict[str, Any]:
    return {"type": "number", "minimum": minimum, "maximum": maximum, "multipleOf": multiple_of}


def array(items: dict[str, Any], max_items: int = 4, **extra: Any) -> dict[str, Any]:
    return {"type": "array", "items": items, "maxItems": max_items, **extra}


BOOL = {"type": "boolean"}
NULL = {"type": "null"}

SCHEMAS: list[Schema] = [
    Schema(
        "flat_object",
        obj({"name": string(), "age": integer(0, 150), "active": BOOL}),
        {"name": "Ada Lovelace", "age": 36, "active": True},
        [{"name": "Ada", "age": 200, "active": True}, {"name": "Ada", "age": 36}],
    ),
    Schema(
        "enum_status",
        obj(
            {"status": {"enum": ["queued", "running", "done", "failed"]}, "retries": integer(0, 5)}
        ),
        {"status": "running", "retries": 2},
        [{"status": "paused", "retries": 2}, {"status": "done", "retries": -1}],
    ),
    Schema(
        "const_envelope",
        obj({"version": {"const": "v1"}, "kind": {"const": "event"}, "id": integer()}),
        {"version": "v1", "kind": "event", "id": 417},
        [
            {"version": "v2", "kind": "event", "id": 1},
            {"version": "v1", "kind": "event", "id": 1001},
        ],
    ),
    Schema(
        "string_lengths",
        obj({"code": string(4, minLength=2), "label": string()}),
        {"code": "FR", "label": "France"},
        [{"code": "F", "label": "France"}, {"code": "FR", "label": "x" * 25}],
    ),
    Schema(
        "pattern_sku",
        obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": integer(1, 99)}),
        {"sku": "ABC-1234", "qty": 3},
        [{"sku": "ab-1234", "qty": 3}, {"sku": "ABC-1234", "qty": 0}],
    ),
    Schema(
        "formats",
        obj(
            {
                "day": {"type": "string", "format": "date"},
                "ip": {"type": "string", "format": "ipv4"},
                "id": {"type": "string", "format": "uuid"},
            }
        ),
        {"day": "2024-02-29", "ip": "10.0.0.1", "id": "123e4567-e89b-12d3-a456-426614174000"},
        [
            {"day": "2024-13-01", "ip": "10.0.0.1", "id": "123e4567-e89b-12d3-a456-426614174000"},
            {"day": "2024-02-29", "ip": "256.0.0.1", "id": "123e4567-e89b-12d3-a456-426614174000"},
        ],
    ),
    Schema(
        "number_ranges",
        obj({"rating": number(0, 5, 0.5), "weight_kg": number(0, 1000, 0.25)}),
        {"rating": 4.5, "weight_kg": 12.25},
        [{"rating": 5.5, "weight_kg": 12.25}, {"rating": 4.5, "weight_kg": 0.3}],
    ),
    Schema(
        "nullable_fields",
        obj(
            {
                "nickname": {"anyOf": [string(16), NULL]},
                "score": {"type": ["integer", "null"], "minimum": 0, "maximum": 100},
            }
        ),
        {"nickname": None, "score": 87},
        [{"nickname": 5, "score": 87}, {"nickname": "ada", "score": 101}],
    ),
    Schema(
        "optional_props",
        obj({"id": integer(), "note": string(), "urgent": BOOL}, required=["id"]),
        {"id": 7, "urgent": True},
        [{"note": "call back", "urgent": True}, {"id": 7, "note": 12}],
    ),
    Schema(
        "nested_object",
        obj(
            {
                "user": obj({"first": string(12), "last": string(12)}),
                "address": obj(
                    {"city": string(16), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
                ),
            }
        ),
        {
            "user": {"first": "Grace", "last": "Hopper"},
            "address": {"city": "Arlington", "zip": "22201"},
        },
        [
            {"user": {"first": "Grace"}, "address": {"city": "Arlington", "zip": "22201"}},
            {"user": {"first": "Grace", "last": "Hopper"}, "address": {"city": "X", "zip": "2220"}},
        ],
    ),
    Schema(
        "array_of_ints",
        obj({"values": array(integer(0, 100), minItems=1)}),
        {"values": [3, 14, 15, 92]},
        [{"values": []}, {"values": [1, 2, 3, 4, 5]}],
    ),
    Schema(
        "array_of_objects",
        obj(
            {
                "lines": array(
                    obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                            "qty": integer(1, 9),
                        }
                    ),
                    max_items=3,
                )
            }
        ),
        {"lines": [{"sku": "AB12", "qty": 2}, {"sku": "CD34", "qty": 1}]},
        [{"lines": [{"sku": "AB12", "qty": 10}]}, {"lines": [{"sku": "AB12", "qty": 2, "x": 1}]}],
    ),
    Schema(
        "nested_arrays",
        array(array(integer(0, 9), max_items=3), max_items=3),
        [[1, 2, 3], [4, 5], [6]],
        [[[1, 2, 10]], [[1, 2, 3, 4]]],
    ),
    Schema(
        "tuple_prefix_items",
        obj(
            {
                "point": {
                    "type": "array",
                    "prefixItems": [number(-100, 100, 0.5), number(-100, 100, 0.5)],
                    "items": False,
                    "minItems": 2,
                }
            }
        ),
        {"point": [-12.5, 40]},
        [{"point": [1, 2, 3]}, {"point": [1, "2"]}],
    ),
    Schema(
        "any_of_shapes",
        obj(
            {
                "shape": {
                    "anyOf": [
                        obj({"kind": {"const": "circle"}, "r": integer(1, 100)}),
                        obj(
                            {"kind": {"const": "rect"}, "w": integer(1, 100), "h": integer(1, 100)}
                        ),
                    ]
                }
            }
        ),
        {"shape": {"kind": "rect", "w": 3, "h": 4}},
        [{"shape": {"kind": "circle", "w": 3}}, {"shape": {"kind": "triangle", "r": 3}}],
    ),
    Schema(
        "mixed_enums",
        obj({"level": {"enum": [1, 2, 3]}, "unit": {"enum": ["cm", "in", None]}, "flag": BOOL}),
        {"level": 2, "unit": None, "flag": False},
        [{"level": 4, "unit": "cm", "flag": False}, {"level": 1, "unit": "mm", "flag": False}],
    ),
    Schema(
        "flags_and_null",
        obj({"read": BOOL, "write": BOOL, "execute": BOOL, "owner": NULL}),
        {"read": True, "write": False, "execute": True, "owner": None},
        [
            {"read": "yes", "write": False, "execute": True, "owner": None},
            {"read": True, "write": False, "execute": True, "owner": 0},
        ],
    ),
    Schema(
        "ref_defs",
        {
            "$defs": {"person": obj({"name": string(16), "age": integer(0, 120)})},
            **obj({"author": {"$ref": "#/$defs/person"}, "editor": {"$ref": "#/$defs/person"}}),
        },
        {"author": {"name": "Knuth", "age": 86}, "editor": {"name": "Lamport", "age": 83}},
        [
            {"author": {"name": "Knuth", "age": 86}, "editor": {"name": "Lamport", "age": -1}},
            {"author": {"name": "Knuth", "age": 86, "x": 1}, "editor": {"name": "L", "age": 8}},
        ],
    ),
    Schema(
        "tool_call",
        obj(
            {
                "name": {"enum": ["get_weather", "get_time"]},
                "arguments": obj(
                    {"city": string(), "unit": {"enum": ["celsius", "fahrenheit"]}},
                    required=["city"],
                ),
            }
        ),
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
        [
            {"name": "search", "arguments": {"city": "Paris"}},
            {"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}},
        ],
    ),
    Schema(
        "one_of_payment",
        obj(
            {
                "payment": {
                    "oneOf": [
                        obj({"card": {"type": "string", "pattern": "^[0-9]{4}( [0-9]{4}){3}$"}}),
                        obj(
                            {
                                "iban": {
                                    "type": "string",
                                    "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{8,16}$",
                                }
                            }
                        ),
                    ]
                },
                "amount": integer(1, 1000),
            }
        ),
        {"payment": {"iban": "DE44500105175407"}, "amount": 120},
        [
            {"payment": {"card": "4111 1111 1111"}, "amount": 120},
            {"payment": {"iban": "DE44500105175407"}, "amount": 0},
        ],
    ),
]


def check(schema: dict[str, Any], text: str) -> bool:
    """Whether ``text`` is JSON that validates against ``schema`` (Draft 2020-12, formats
    checked: without a format checker ``jsonschema`` treats ``format`` as an annotation)."""
    from jsonschema import Draft202012Validator

    try:
        instance = json.loads(text)
    except json.JSONDecodeError:
        return False
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    return validator.is_valid(instance)
