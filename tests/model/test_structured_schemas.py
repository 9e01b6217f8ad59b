"""The structured-output schema suite (bench/structured_schemas.py) is what it claims: each
example validates, each invalid instance does not, and a random model constrained to a schema
stops within about 200 tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.structured_schemas import SCHEMAS, Schema, check

# A random byte-level model must stop within this many tokens under every schema.
MAX_WALK_TOKENS = 200


def compact(instance: object) -> str:
    return json.dumps(instance, separators=(", ", ": "))


def test_suite_shape() -> None:
    assert len(SCHEMAS) == 20
    assert len({s.name for s in SCHEMAS}) == len(SCHEMAS)
    assert all(len(s.invalid) == 2 for s in SCHEMAS)


@pytest.mark.parametrize("case", SCHEMAS, ids=lambda s: s.name)
def test_example_validates_and_invalid_do_not(case: Schema) -> None:
    assert check(case.schema, compact(case.example))
    for instance in case.invalid:
        assert not check(case.schema, compact(instance)), instance


def test_check_refuses_text_that_is_not_json() -> None:
    assert not check({"type": "object"}, '{"a": ')


def byte_tokenizer_json() -> str:
    """A Hugging Face tokenizer of 256 byte tokens (GPT-2's byte alphabet, no merges) and an
    end-of-sequence token, 256: one byte per token, the slowest a model can write."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(others)})
    vocab = {c: b for b, c in chars.items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    return str(tokenizer.to_str())


def test_random_walks_stop_within_the_bound() -> None:
    """Sample uniformly among the tokens llguidance allows (with the compact separators and no
    free whitespace, as the engine is configured) until the end token: every walk of every
    schema stops within MAX_WALK_TOKENS, and what it wrote validates."""
    llguidance = pytest.importorskip("llguidance")
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    tokenizer = llguidance.LLTokenizer(byte_tokenizer_json(), eos_token=256)
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    rng = np.random.default_rng(0)
    bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)
    for case in SCHEMAS:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(case.schema, overrides=options)
        for _ in range(10):
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            written: list[int] = []
            while not matcher.is_stopped():
                assert len(written) <= MAX_WALK_TOKENS, (case.name, bytes(written))
                fill_next_token_bitmask(matcher, bitmask)
                allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
                token = int(rng.choice(allowed[allowed < tokenizer.vocab_size]))
                assert matcher.consume_token(token), matcher.get_error()
                if token == tokenizer.eos_token:
                    break
                written.append(token)
            text = bytes(written).decode()
            assert check(case.schema, text), (case.name, text)
