"""What a request's output must match (structured output), and its grammar.

One value for the gateway and the worker, as ``SamplingParams`` is: the gateway builds it from
an OpenAI request (``response_format``, vLLM's ``guided_*`` and ``structured_outputs``, a tool
call's parameter schema) and checks that it compiles, so a bad schema is a 400 naming the
problem before any dispatch; the worker compiles it with its tokenizer
(``worker.model.grammar``) and masks the sampler with it. The wire form is
``worker.v1.StructuredOutput`` (engine-neutral); the grammar engine is llguidance (chosen by
measurement: docs/structured-output.md), whose grammars this module writes.

Pure Python beside llguidance's wheel (no MLX, no tokenizer): the gateway imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024
MAX_DEPTH = 128  # the grammar engine's own limit on a schema's nesting

# JSON is written compactly (", " and ": ", no other whitespace): what models write when they
# write JSON in one line, and a bound on the output where flexible whitespace would let a model
# (a random one certainly) pad forever.
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled; the message names the problem."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """``kind`` is one of :data:`KINDS`; ``spec`` the schema's JSON text, the regex or the
    grammar; ``choices`` the strings of a ``choice``."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutput:
        """A JSON Schema (a dict, or its JSON text)."""
        try:
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict | bool):
                raise StructuredOutputError("a JSON schema must be an object")
            # Keys in the order given: the properties' order is the order the output writes
            # them in (as OpenAI's strict mode does), so sorting them would reorder the
            # document. NaN and Infinity are not JSON.
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except RecursionError:
            raise StructuredOutputError(_TOO_DEEP) from None
        except ValueError as e:
            raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
        return cls("json_schema", text)

    @classmethod
    def from_wire(cls, msg: Any) -> StructuredOutput | None:
        """A ``worker.v1.StructuredOutput`` (typed ``Any``: no generated code here); None when
        unset."""
        which = msg.WhichOneof("kind")
        if which is None:
            return None
        if which == "choice":
            return cls("choice", choices=tuple(msg.choice.values))
        if which == "json_object":
            return cls("json_object")
        return cls(which, getattr(msg, which))

    def grammar(self) -> str:
        """The llguidance grammar (its JSON text). Raises StructuredOutputError for what cannot
        be one; whether it compiles is :func:`check`'s (or the matcher's)."""
        import llguidance

        if len(self.spec) > MAX_SPEC_CHARS:
            raise StructuredOutputError(
                f"the {self.kind} is {len(self.spec)} characters; at most {MAX_SPEC_CHARS}"
            )
        m = llguidance.LLMatcher
        if self.kind == "json_schema":
            check_bounds(self.spec)
            try:
                return m.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
            except ValueError as e:
                raise StructuredOutputError(f"the JSON schema is not valid: {e}") from None
        if self.kind == "json_object":
            return m.grammar_from_json_schema('{"type":"object"}', defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "regex":
            return m.grammar_from_regex(ascii_classes(self.spec))
        if self.kind == "choice":
            if not self.choices:
                raise StructuredOutputError("a choice needs at least one string")
            if len(self.choices) > MAX_CHOICES:
                raise StructuredOutputError(f"at most {MAX_CHOICES} choices")
            # Lark's string literals take JSON's escapes: any string is one literal.
            alternatives = " | ".join(json.dumps(c) for c in self.choices)
            return m.grammar_from_lark(f"start: {alternatives}\n")
        if self.kind == "grammar":
            return m.grammar_from_lark(_lark(self.spec))
        raise StructuredOutputError(f"unknown structured output kind {self.kind!r}")

    def check(self) -> str:
        """The grammar, checked to compile (without a tokenizer: what any model can take).
        Raises StructuredOutputError naming the problem."""
        import llguidance

        grammar = self.grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise StructuredOutputError(f"the {self.name} does not compile: {error}")
        return grammar

    @property
    def name(self) -> str:
        """What it is, in words, for messages."""
        return _NAMES.get(self.kind, self.kind)


_TOO_DEEP = f"the JSON schema nests deeper than {MAX_DEPTH} levels"

# Numbers whose every integer a double holds: the grammar engine reads a schema's bounds as
# doubles (and an integer's as int64 after that), so a bound beyond them is rounded or clamped
# and the output could break the schema it was held to (a maximum of 1e20 became int64's
# largest, which was written; two bounds that both rounded to int64's smallest crashed the
# engine). A bound is refused there rather than silently changed.
EXACT_LIMIT = 2**53
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Keywords whose value is data, never a schema: a "maximum" inside an enum's object is a value.
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required", "dependentRequired"})


def check_bounds(spec: str) -> None:
    """Raises StructuredOutputError for a bound (``minimum``, ``maximum`` and their exclusive
    forms) anywhere in the schema ``spec`` (its JSON text) beyond ±2^53; the message names the
    bound and where it is (a JSON pointer)."""
    try:
        schema = json.loads(spec)
        where = _wide_bound(schema, "", 0)
    except RecursionError:
        raise StructuredOutputError(_TOO_DEEP) from None
    except ValueError as e:
        raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
    if where is not None:
        pointer, key, value = where
        raise StructuredOutputError(
            f"the JSON schema's {key} {value} (at {pointer or '/'}) is beyond ±2^53 "
            f"({EXACT_LIMIT}): the grammar engine reads bounds as doubles and would round "
            "it, so the output could break the schema; use a bound within ±2^53 or leave it out"
        )


def _wide_bound(node: Any, pointer: str, depth: int) -> tuple[str, str, Any] | None:
    if depth > MAX_DEPTH:
        raise RecursionError
    if isinstance(node, list):
        for k, item in enumerate(node):
            found = _wide_bound(item, f"{pointer}/{k}", depth + 1)
            if found is not None:
                return found
        return None
    if not isinstance(node, dict):
        return None
    for key, value in node.items():
        if key in DATA_KEYWORDS:
            continue
        if key in BOUNDS and isinstance(value, int | float) and not isinstance(value, bool):
            if not abs(value) <= EXACT_LIMIT:  # NaN too
                return pointer, key, value
            continue
        token = key.replace("~", "~0").replace("/", "~1")
        found = _wide_bound(value, f"{pointer}/{token}", depth + 1)
        if found is not None:
            return found
    return None


_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


# \d and \w as ASCII classes, outside a bracket class and inside one. llguidance reads a regex
# as Rust's regex crate does, where \d is any Unicode digit: a phone number regex \d{3}-\d{4}
# came back with segmented digits (U+1FBF8). A JSON schema's "pattern" there is already
# ECMA-262's (\d and \w ASCII; \s Unicode whitespace, so \s is left as it is), as xgrammar
# reads vLLM's guided_regex: the same regex now means the same text in a pattern and in
# guided_regex.
_ASCII = {
    "d": ("[0-9]", "0-9"),
    "D": ("[^0-9]", None),
    "w": ("[0-9A-Za-z_]", "0-9A-Za-z_"),
    "W": ("[^0-9A-Za-z_]", None),
}


def ascii_classes(regex: str) -> str:
    """``regex`` with ``\\d`` and ``\\w`` (and their negations outside bracket classes)
    spelled as ASCII classes; everything else as written. A negated shorthand inside
    a bracket class (``[^\\D]``) stays as it is: it has no ASCII spelling there."""
    out: list[str] = []
    depth = 0  # bracket classes nest in Rust's syntax ([a-z&&[^aeiou]])
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\" and i + 1 < n:
            nxt = regex[i + 1]
            spelled = _ASCII.get(nxt, (None, None))[1 if depth else 0]
            out.append(spelled if spelled is not None else c + nxt)
            i += 2
            continue
        if c == "[":
            depth += 1
            out.append(c)
            i += 1
            if i < n and regex[i] == "^":
                out.append("^")
                i += 1
            if i < n and regex[i] == "]":  # a ']' first in a class is itself
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


def _lark(text: str) -> str:
    """A grammar as Lark: GBNF (llama.cpp's, what vLLM's ``guided_grammar`` takes besides
    Lark) converted by llguidance's own converter; Lark as given."""
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return str(gbnf_to_lark(text))
    except Exception as e:  # the converter raises its own parse errors
        raise StructuredOutputError(f"the GBNF grammar does not parse: {e}") from None
