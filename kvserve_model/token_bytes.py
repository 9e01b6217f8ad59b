"""A logprob token's text, as worker and gateway write and read it: the token's bytes as UTF-8,
or, where they are only part of a character, OpenAI's ``bytes:\\xNN...`` form (the worker writes
it: ``worker.engine.token_text``; the gateway reads the bytes back for chat's ``bytes`` and a
completion's ``text_offset``)."""

from __future__ import annotations

import re

_BYTES = re.compile(r"bytes:((?:\\x[0-9a-f]{2})+)")


def text_of(raw: bytes) -> str:
    """``raw`` as text, or OpenAI's ``bytes:\\xNN...`` form where it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def bytes_of(token: str) -> bytes:
    """A token's bytes: its UTF-8, or those its ``bytes:\\xNN...`` form holds."""
    m = _BYTES.fullmatch(token)
    if m is None:
        return token.encode()
    return bytes.fromhex(m.group(1).replace("\\x", ""))
