"""A request's structured output, read from the fields clients send it in.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with its ``schema`` and
``strict``), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and
their newer ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``). At most one of them: two would be two constraints on one output. The result is
checked to compile here (``Constraint.checked``, in a child process:
``kvserve_model.grammar_check``), so a schema the engine cannot take is a 400 naming the problem
before any worker sees the request, and one that crashes the engine is a 400 too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest
from gateway.protocol import SamplingRequest
from kvserve_model.grammar_check import GrammarChecker
from kvserve_model.structured_output import StructuredOutput, StructuredOutputError

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's constraint before its compile is checked: ``param`` is the parameter an
    error names, ``where`` starts its message."""

    so: StructuredOutput
    param: str
    where: str

    async def checked(self, checker: GrammarChecker) -> StructuredOutput:
        """The constraint once it compiles; InvalidRequest naming the problem otherwise."""
        try:
            await checker.check(self.so)
        except StructuredOutputError as e:
            raise InvalidRequest(f"{self.where}: {e}", param=self.param) from None
        return self.so


def request_constraint(req: SamplingRequest) -> Constraint | None:
    """The request's constraint (not yet checked to compile), or None; InvalidRequest naming
    the field."""
    # (the field, the constraint, the parameter a compile error names)
    found: list[tuple[str, StructuredOutput, str]] = []
    if req.response_format is not None:
        so = _response_format(req.response_format)
        if so is not None:
            kind = req.response_format.get("type")
            param = (
                "response_format.json_schema.schema" if kind == "json_schema" else "response_format"
            )
            found.append(("response_format", so, param))
    for name in GUIDED:
        value = getattr(req, name)
        if value is not None:
            found.append((name, _guided(name, value), name))
    if req.structured_outputs is not None:
        so = _structured_outputs(req.structured_outputs)
        key = next(k for k in STRUCTURED_KEYS if req.structured_outputs.get(k) not in (None, False))
        found.append(("structured_outputs", so, f"structured_outputs.{key}"))
    if len(found) > 1:
        raise InvalidRequest(
            f"{found[0][0]} and {found[1][0]} both constrain the output; send one",
            param=found[1][0],
        )
    if not found:
        return None
    _, so, param = found[0]
    return Constraint(so, param, param)


def _schema(value: Any, param: str) -> StructuredOutput:
    try:
        return StructuredOutput.json_schema(value)
    except StructuredOutputError as e:
        raise InvalidRequest(f"{param}: {e}", param=param) from None


def _response_format(rf: dict[str, Any]) -> StructuredOutput | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest(
                "response_format json_schema needs a json_schema object "
                '({"name": ..., "schema": {...}})',
                param="response_format.json_schema",
            )
        schema = spec.get("schema", {"type": "object"})  # OpenAI's default: any object
        return _schema(schema, "response_format.json_schema.schema")
    raise InvalidRequest(
        f"response_format type {kind!r} is not one of text, json_object, json_schema",
        param="response_format.type",
    )


def _guided(name: str, value: Any) -> StructuredOutput:
    if name == "guided_json":
        return _schema(value, name)
    if name == "guided_choice":
        if not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"{name} needs a non-empty list of strings", param=name)
        return StructuredOutput("choice", choices=tuple(value))
    if not value:
        raise InvalidRequest(f"{name} must not be empty", param=name)
    return StructuredOutput("regex" if name == "guided_regex" else "grammar", value)


def _structured_outputs(so: dict[str, Any]) -> StructuredOutput:
    given = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest(
            f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KEYS)}",
            param="structured_outputs",
        )
    key = given[0]
    value = so[key]
    param = f"structured_outputs.{key}"
    if key == "json":
        return _schema(value, param)
    if key == "json_object":
        return StructuredOutput("json_object")
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"{param} needs a non-empty list of strings", param=param)
        return StructuredOutput("choice", choices=tuple(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param} must be a non-empty string", param=param)
    return StructuredOutput("regex" if key == "regex" else "grammar", value)
