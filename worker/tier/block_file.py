"""One spilled KV block as a file: what it claims to hold, and the proof that it does.

    MAGIC (8 bytes) | header length (uint32, little-endian) | header (JSON) | payload

The header names the block (its key, its parent's key, its position in the sequence, its
namespace and its tokens), the model and the pool layout it was written for, a 128-bit digest
of its whole prefix (namespace and every token through the block), and the payload's length
and xxh3-128 checksum. A reader trusts a file only if every one of them is what it expects:
the key is a 64-bit name, the digest and the tokens are the identity. Nothing wrong is served
from a file that is truncated, corrupt, or written for another model, layout or prefix.

A file is written to a temporary name and renamed into place, so a crash mid-write leaves
either no file or a temporary one (removed at the next scan), never a partial block under a
block's name; a torn write that survived anyway fails the payload checksum.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVSBLK1\n"
_LEN = struct.Struct("<I")
PREAMBLE = len(MAGIC) + _LEN.size
MAX_HEADER = 1 << 20  # a block's tokens and names; anything longer is not ours


# A block's bytes: ``bytes`` read from a file, or a view of the array the pool copied them to.
Payload = bytes | memoryview


class BadBlockFile(Exception):
    """The file is not a block this worker may use; the message says why."""


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a block file says it holds."""

    key: int
    parent_key: int
    position: int  # the block's index in its sequence
    namespace: str
    tokens: tuple[int, ...]
    prefix_digest: str  # prefix_digests(): namespace and every token through this block
    fingerprint: str  # the model's (worker.model.loader)
    layout: str  # the pool's (TierLayout.describe)
    payload_len: int
    checksum: str  # xxh3-128 of the payload, hex


def mismatch(meta: BlockMeta, expect: BlockMeta) -> str | None:
    """The first field that says ``meta`` is not the block ``expect`` names (None: it is):
    the key is a 64-bit name, the position, namespace, tokens and prefix digest its identity."""
    for field in ("key", "position", "namespace", "tokens", "prefix_digest"):
        if getattr(meta, field) != getattr(expect, field):
            return field
    return None


def prefix_digests(
    namespace: str, tokens: bytes, first: int, stop: int, block_bytes: int
) -> list[str]:
    """The prefix digest of blocks ``first`` .. ``stop - 1`` of ``tokens`` (packed, 4 bytes a
    token): blake2b-128 of the namespace and every token through the block."""
    h = hashlib.blake2b(namespace.encode() + b"\0", digest_size=16)
    h.update(tokens[: first * block_bytes])
    out = []
    for pos in range(first * block_bytes, stop * block_bytes, block_bytes):
        h.update(tokens[pos : pos + block_bytes])
        out.append(h.copy().hexdigest())
    return out


def checksum(payload: Payload) -> str:
    return xxhash.xxh3_128_hexdigest(payload)


def encode_header(meta: BlockMeta) -> bytes:
    """The file up to its payload (which follows as it is, unjoined: no copy of it)."""
    header = json.dumps(
        {
            "key": meta.key,
            "parent_key": meta.parent_key,
            "position": meta.position,
            "namespace": meta.namespace,
            "tokens": list(meta.tokens),
            "prefix_digest": meta.prefix_digest,
            "fingerprint": meta.fingerprint,
            "layout": meta.layout,
            "payload_len": meta.payload_len,
            "checksum": meta.checksum,
        },
        separators=(",", ":"),
    ).encode()
    return b"".join((MAGIC, _LEN.pack(len(header)), header))


def decode_header(head: Payload) -> tuple[BlockMeta, int]:
    """The meta of a file starting with ``head`` (at least its preamble and header), and where
    its payload starts. Raises BadBlockFile."""
    if bytes(head[: len(MAGIC)]) != MAGIC:
        raise BadBlockFile("not a kvserve block file")
    if len(head) < PREAMBLE:
        raise BadBlockFile("truncated header")
    (n,) = _LEN.unpack_from(head, len(MAGIC))
    if n > MAX_HEADER:
        raise BadBlockFile(f"header of {n} bytes")
    if len(head) < PREAMBLE + n:
        raise BadBlockFile("truncated header")
    try:
        h = json.loads(bytes(head[PREAMBLE : PREAMBLE + n]))
        meta = BlockMeta(
            key=int(h["key"]),
            parent_key=int(h["parent_key"]),
            position=int(h["position"]),
            namespace=str(h["namespace"]),
            tokens=tuple(int(t) for t in h["tokens"]),
            prefix_digest=str(h["prefix_digest"]),
            fingerprint=str(h["fingerprint"]),
            layout=str(h["layout"]),
            payload_len=int(h["payload_len"]),
            checksum=str(h["checksum"]),
        )
    except (ValueError, KeyError, TypeError) as err:
        raise BadBlockFile(f"unreadable header: {err}") from None
    return meta, PREAMBLE + n
