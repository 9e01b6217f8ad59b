"""Logprobs' token texts (``worker.engine.token_text``): each token's own bytes, as UTF-8 where
they are whole characters and as OpenAI's ``bytes:\\xNN`` where they are part of one; the
gateway reads the bytes back (``kvserve_model.token_bytes``), and they add up to the text.
Both embedded models' tokenizers (byte-level BPE)."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm.tokenizer_utils import load

from gateway.rendering import text_offsets
from kvserve_model.default_model import DEFAULT_MODEL_NAME
from kvserve_model.resolve import resolve_model
from kvserve_model.tiny_model import TINY_MODEL_NAME
from kvserve_model.token_bytes import bytes_of, text_of
from worker.engine.token_text import TokenTexts

PIECES = [" ", "  ", "a", "The", " cat", "\n", "é", "€", "😀", "世界", ".", "ß", "👍🏽", "\t"]


@pytest.fixture(scope="module", params=[TINY_MODEL_NAME, DEFAULT_MODEL_NAME])
def tokenizer(request: pytest.FixtureRequest):
    return load(resolve_model(request.param))


@pytest.mark.parametrize("seed", range(10))
def test_token_texts_add_up_to_the_text(tokenizer, seed: int) -> None:
    rng = np.random.default_rng(seed)
    text = "".join(rng.choice(PIECES) for _ in range(int(rng.integers(1, 30))))
    ids = tokenizer.encode(text, add_special_tokens=False)
    texts = TokenTexts(tokenizer)
    pieces = [texts(t) for t in ids]
    assert b"".join(bytes_of(p) for p in pieces) == text.encode()
    for token, piece in zip(ids, pieces, strict=True):
        assert "\ufffd" not in piece
        whole = tokenizer.decode([token])
        assert piece == whole or (piece.startswith("bytes:") and "\ufffd" in whole)
    offsets = text_offsets(pieces, 5)
    raw = [bytes_of(p) for p in pieces]
    assert offsets == [
        5 + len(b"".join(raw[:i]).decode("utf-8", "ignore")) for i in range(len(ids))
    ]


def test_parts_of_characters_are_told_apart(tokenizer) -> None:
    texts = TokenTexts(tokenizer)
    vocab = len(tokenizer.get_vocab())
    partial = {t: texts(t) for t in range(vocab) if texts(t).startswith("bytes:")}
    assert len(partial) >= 64  # every byte-level vocabulary has its 128 high bytes, at least
    assert len(set(partial.values())) == len(partial)  # each its own bytes (none repeat)


def test_added_tokens_are_the_tokenizers_text(tokenizer) -> None:
    texts = TokenTexts(tokenizer)
    (im_end,) = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert texts(im_end) == "<|im_end|>"


def test_the_bytes_form_round_trips() -> None:
    for raw in (b"\xe2\x80", b" \xf0\x9f\x98", b"\x80", b"ok", "é".encode()):
        assert bytes_of(text_of(raw)) == raw
    assert text_of(b"\xe2\x80") == "bytes:\\xe2\\x80"
    assert bytes_of("bytes:") == b"bytes:"  # not the form: its own text
    assert bytes_of("bytes:\\x4") == b"bytes:\\x4"
