"""guided_regex reads \\d and \\w as ASCII, as a JSON schema's "pattern" does (ECMA-262) and as
xgrammar reads vLLM's guided_regex: llguidance alone reads a regex as Rust's regex crate does,
where \\d is any Unicode digit (a phone-number regex came back with
segmented digits, U+1FBF8)."""

from __future__ import annotations

import json

import pytest

from kvserve_model.structured_output import StructuredOutput, ascii_classes

CASES = [
    (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
    (r"[\d.]+", "[0-9.]+"),
    (r"[^\d]", "[^0-9]"),
    (r"\D\W", "[^0-9][^0-9A-Za-z_]"),
    (r"[\w-]", "[0-9A-Za-z_-]"),
    (r"[]\d]", "[]0-9]"),  # a ']' first in a class is itself
    (r"[^]\d]", "[^]0-9]"),
    (r"[a-z&&[^\d]]\w", "[a-z&&[^0-9]][0-9A-Za-z_]"),  # nested classes
    (r"\\d", r"\\d"),  # an escaped backslash, then a literal d
    (r"\p{L}\s\S\.", r"\p{L}\s\S\."),  # the rest as written (\s: Unicode, as in ECMA-262)
    (r"[\D]", r"[\D]"),  # a negated shorthand inside a class has no ASCII spelling
    ("a\\", "a\\"),  # a trailing backslash: left for the engine to refuse
]


@pytest.mark.parametrize(("regex", "spelled"), CASES)
def test_shorthands_are_spelled_as_ascii(regex: str, spelled: str) -> None:
    assert ascii_classes(regex) == spelled


def _accepts(grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text``, fed byte by byte (llguidance's byte tokenizer)."""
    import llguidance

    tok = llguidance.LLTokenizer("byte")
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    ids = tok.tokenize_str(text)
    return m.validate_tokens(ids) == len(ids) and not m.is_error()


@pytest.mark.parametrize(
    ("regex", "text", "takes"),
    [
        (r"\d{3}-\d{4}", "555-1234", True),
        (r"\d{3}-\d{4}", "١٢٣-1234", False),  # Arabic-Indic digits
        (r"\d{3}", "\U0001fbf8" * 3, False),  # segmented digits
        (r"\w+", "abc_9", True),
        (r"\w+", "ééé", False),
        (r"[\d.]+", "3.14", True),
    ],
)
def test_a_regex_constraint_takes_only_ascii_digits(regex: str, text: str, takes: bool) -> None:
    grammar = StructuredOutput("regex", regex).grammar()
    assert _accepts(grammar, text) is takes
    # The same as a JSON schema's pattern, inside the string's quotes.
    pattern = StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": regex}))
    assert _accepts(pattern.grammar(), json.dumps(text, ensure_ascii=False)) is takes
