"""Token ids as the domain carries them: packed, 4 bytes a token, checked once at the door.

Every acquire, commit and release hands the authority a whole sequence (2k tokens is common),
and the index compares and hashes block-sized runs of it. As a tuple of ints that cost a
tuple, a ``min`` and a ``max`` per call (for 2k tokens, measured alone: ~50 us from a list,
~100 us from a protobuf repeated field) and a tuple slice per block; packed into ``bytes`` it
is one C-speed pass (~8 us from either), slices compare with ``memcmp`` and hash once (bytes
cache their hash), and an indexed block costs 128 bytes instead of ~1 KB of tuple and ints.

The packing is native-endian uint32 (``array('I')``); it never leaves the process, so only
`unpack` (admin and tests) needs to know it. The wire's compact form (little-endian; its
fields are listed in ``kvserve_proto.packed_tokens``) is read and written through that
module's ``to_native`` and ``from_native``: the same bytes on a little-endian host.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence

from kvcache_service.errors import InvalidArgument
from kvcache_service.ids import Tokens
from kvserve_proto import packed_tokens
from kvserve_proto.packed_tokens import TOKEN_BYTES

MAX_TOKEN_ID = 2**31 - 1
# The byte holding each token's top bit: a packed token id is <= MAX_TOKEN_ID iff it is < 0x80.
_TOP = TOKEN_BYTES - 1 if sys.byteorder == "little" else 0


def pack(values: Sequence[int], what: str, allow_empty: bool = False) -> Tokens:
    """`values` checked (integers in [0, MAX_TOKEN_ID]) and packed, in one C-speed pass.

    Lists and tuples go through ``array('I').fromlist`` (C-speed; it refuses negatives,
    non-integers and ids past 2**32 - 1), then one look at every token's top byte
    (``isascii``) refuses ids past 2**31 - 1. Anything exposing ``__array__`` (a protobuf
    repeated field, where iterating costs ~30 ns a token) goes through numpy.
    """
    try:
        if hasattr(values, "__array__"):
            packed = _pack_numpy(values)
        else:
            a = array("I")
            # fromlist, not array("I", values): 8 us against 12 us for 2k tokens (measured).
            a.fromlist(values if type(values) is list else list(values))
            packed = a.tobytes()
    except (OverflowError, TypeError, ValueError):
        raise InvalidArgument(f"{what} holds a token id outside [0, {MAX_TOKEN_ID}]") from None
    if not packed and not allow_empty:
        raise InvalidArgument(f"{what} is empty")
    if not packed[_TOP::TOKEN_BYTES].isascii():
        raise InvalidArgument(f"{what} holds a token id outside [0, {MAX_TOKEN_ID}]")
    return Tokens(packed)


def from_wire(data: bytes, what: str, allow_empty: bool = False) -> Tokens:
    """The compact wire form (little-endian uint32, 4 bytes a token; kvcache.proto) checked
    and in the domain's packing: no per-token step, one look at every token's top byte."""
    if len(data) % TOKEN_BYTES:
        raise InvalidArgument(f"{what} is {len(data)} bytes, not a whole number of 4-byte ids")
    if not data and not allow_empty:
        raise InvalidArgument(f"{what} is empty")
    data = packed_tokens.to_native(data)
    if not data[_TOP::TOKEN_BYTES].isascii():
        raise InvalidArgument(f"{what} holds a token id outside [0, {MAX_TOKEN_ID}]")
    return Tokens(data)


def to_wire(tokens: Tokens) -> bytes:
    """The domain's packing in the wire's byte order (tests, benchmarks, the admin tools)."""
    return packed_tokens.from_native(tokens)


def _pack_numpy(values: Sequence[int]) -> bytes:
    # Imported here: numpy is 12 MiB of the cache service's ~40 at rest, and only a client
    # sending a repeated field rather than the compact bytes ever comes here.
    import numpy as np

    a = np.asarray(values)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise TypeError("token ids must be a flat sequence of integers")
    if a.size and (a.min() < 0 or a.max() > MAX_TOKEN_ID):
        raise ValueError("token id out of range")
    return a.astype(np.uint32).tobytes()


def count(tokens: Tokens) -> int:
    """How many tokens `tokens` holds."""
    return len(tokens) // TOKEN_BYTES


def unpack(tokens: bytes) -> tuple[int, ...]:
    """The token ids (for the admin tools and tests; the domain never needs them)."""
    a = array("I")
    a.frombytes(tokens)
    return tuple(a)


class TokenChunks:
    """A node's block-sized token runs as token ids, decoded only when one is read (the
    admin tree previews the first of each node: decoding a whole node would be O(node))."""

    __slots__ = ("_chunk", "_edge")

    def __init__(self, edge: bytes, chunk_bytes: int) -> None:
        self._edge = edge
        self._chunk = chunk_bytes

    def __len__(self) -> int:
        return len(self._edge) // self._chunk

    def __getitem__(self, j: int) -> tuple[int, ...]:
        if not 0 <= j < len(self):
            raise IndexError(j)
        return unpack(self._edge[j * self._chunk : (j + 1) * self._chunk])

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return (self[j] for j in range(len(self)))
