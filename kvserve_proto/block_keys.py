"""Block keys: one stable 64-bit hash per full block, of its whole prefix and namespace.

The cache service and the workers compute the same keys from the same tokens, in every
process and after every restart: the service indexes blocks with them (its in-flight map,
the chain hash each indexed block keeps, and the tier index of blocks a worker holds outside
its pool), and a worker names the blocks it spills to its tiers by them
(``worker/tier``), so the manifest a restarted worker sends the service means the same
blocks the service would hash for a prompt.

A key is xxh3-64 of the block's tokens (the compact form: little-endian uint32, 4 bytes a
token), seeded with the key of the block before it; the first block's seed is the key of
its namespace. One C call per block, ~65 ns (Python's ``hash`` of a tuple took ~120 ns and
changes with every process's hash seed).

A key is a name, not a proof: the worker that loads a spilled block checks the file's own
record of its tokens and a 128-bit digest of its whole prefix before it trusts the bytes.

Standard library and xxhash only: the gateway, the workers and the cache service import it.
"""

from __future__ import annotations

import xxhash

_SEED = 0x6B76736572766B76  # "kvservkv"
_xxh3 = xxhash.xxh3_64_intdigest


def namespace_key(namespace: str) -> int:
    """The seed of a sequence's first block: its namespace's key."""
    return _xxh3(namespace.encode(), seed=_SEED)


def block_keys(
    seed: int, tokens: bytes, first: int, chunk_bytes: int, stop: int | None = None
) -> list[int]:
    """The key of each full block of ``tokens`` (packed, little-endian uint32) from block
    ``first`` on (before block ``stop``, if given); ``seed`` is the key of block
    ``first - 1``, or :func:`namespace_key` for block 0."""
    h = seed
    out = []
    end = len(tokens) if stop is None else min(len(tokens), stop * chunk_bytes)
    for pos in range(first * chunk_bytes, end - chunk_bytes + 1, chunk_bytes):
        h = _xxh3(tokens[pos : pos + chunk_bytes], seed=h)
        out.append(h)
    return out
