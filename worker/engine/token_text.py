"""Each token's own text, for logprobs.

``decode([token])`` alone misreads two kinds of token. One that holds part of a UTF-8 character
(byte-level BPE splits emoji and CJK into several) decodes to U+FFFD: every such token read
the same, so a completion's ``top_logprobs`` (a map by text) lost all but one of them, and a
chat logprob's ``bytes`` were U+FFFD's, not the token's. And SentencePiece's decode drops the
space a word-initial piece opens with, so the logprobs' texts did not add up to the output.

Here a token's text is its bytes (the vocabulary's own, as the streaming detokenizer reads
them) decoded as UTF-8; where they are not whole characters it is written as OpenAI writes
such a token, ``bytes:`` and the bytes escaped (``bytes:\\xe2\\x80``), from which the gateway
reads them back (``kvserve_model.token_bytes``). Added tokens (special ones, a template's markers)
are decoded by the tokenizer, as their text is not in byte-level form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve_model.token_bytes import text_of

SPM_SPACE = "\u2581".encode()


class TokenTexts:
    """``texts(token)``: the token's text (see the module's text), built at first use from the
    tokenizer's streaming detokenizer (mlx-lm's ``TokenizerWrapper``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._raw: Callable[[int], bytes | None] | None = None
        added = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "added_tokens_decoder", None)
        self._added = frozenset(int(i) for i in (added or {}))

    def __call__(self, token: int) -> str:
        raw = self.raw(token)
        return str(self._tokenizer.decode([token])) if raw is None else text_of(raw)

    def raw(self, token: int) -> bytes | None:
        """The token's bytes, None where the vocabulary does not say (added tokens)."""
        if token in self._added:
            return None
        if self._raw is None:
            self._raw = _raw_reader(self._tokenizer)
        return self._raw(token)


def _raw_reader(tokenizer: Any) -> Callable[[int], bytes | None]:
    detok = getattr(tokenizer, "detokenizer", None)
    kind = type(detok).__name__  # by name, as sequence.keep_first_space does
    tokenmap = getattr(detok, "tokenmap", None)
    if kind == "BPEStreamingDetokenizer" and tokenmap is not None:
        from mlx_lm.tokenizer_utils import _byte_decoder

        decoder = _byte_decoder()

        def bpe(token: int) -> bytes | None:
            if not 0 <= token < len(tokenmap):
                return None
            try:
                return bytes(decoder[c] for c in tokenmap[token])
            except KeyError:  # not byte-level text
                return None

        return bpe
    if kind == "SPMStreamingDetokenizer" and tokenmap is not None:

        def spm(token: int) -> bytes | None:
            if not 0 <= token < len(tokenmap):
                return None
            return bytes(tokenmap[token]).replace(SPM_SPACE, b" ")

        return spm
    return lambda token: None  # decoded by the tokenizer
