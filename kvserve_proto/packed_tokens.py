"""Token ids in the contracts' compact form: little-endian uint32, 4 bytes a token.

Hand-written (the one module here that ``make proto`` does not generate; scripts/protogen.py
names it in ``HAND_WRITTEN``), beside the messages whose ``bytes`` fields carry the form
(kvcache.proto, wire revision 2): ``AcquireLeaseRequest.prompt_tokens``,
``AcquireItem.prompt_tokens``, ``RouteRequest.prompt_tokens``,
``SequenceUpdate.appended_tokens`` and ``BlocksStored.tokens`` (KV events). Each of them has
a readable twin (``repeated int32 ..._token_ids``); a message gives one or the other.

Standard library only: the gateway, the workers and the cache service all pack or read tokens.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

TOKEN_BYTES = 4
assert array("I").itemsize == TOKEN_BYTES
_LITTLE = sys.byteorder == "little"


def pack(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` in the compact form, in one C-speed pass (``array.fromlist``). Raises
    OverflowError for an id outside [0, 2**32 - 1] and TypeError for a non-integer; the
    contracts' own bound (2**31 - 1) is the reader's to check."""
    a = array("I")
    a.fromlist(token_ids if type(token_ids) is list else list(token_ids))
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack(data: bytes) -> tuple[int, ...]:
    """The ids of ``data`` in the compact form (ValueError if not a whole number of ids)."""
    a = array("I")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return tuple(a)


def to_native(data: bytes) -> bytes:
    """``data`` in the compact form as this host's uint32s (``array('I')`` reads them): the
    same bytes on a little-endian host, each id's swapped on a big-endian one."""
    return bytes(data) if _LITTLE else _swapped(data)


def from_native(data: bytes) -> bytes:
    """This host's packed uint32s (``array('I').tobytes()``) in the compact form."""
    return bytes(data) if _LITTLE else _swapped(data)


def _swapped(data: bytes) -> bytes:
    a = array("I")
    a.frombytes(data)
    a.byteswap()
    return a.tobytes()
