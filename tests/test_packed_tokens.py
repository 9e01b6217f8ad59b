"""kvserve_proto.packed_tokens: the compact token form is little-endian uint32 on any host."""

from __future__ import annotations

import struct

import pytest

from kvserve_proto import packed_tokens

IDS = [0, 1, 255, 256, 65_536, 2**31 - 1, 2**32 - 1]


def test_pack_is_little_endian_uint32() -> None:
    wire = struct.pack(f"<{len(IDS)}I", *IDS)
    assert packed_tokens.pack(IDS) == wire
    assert packed_tokens.pack(tuple(IDS)) == wire
    assert packed_tokens.unpack(wire) == tuple(IDS)
    assert packed_tokens.pack([]) == b""


def test_native_order_round_trip() -> None:
    native = struct.pack(f"={len(IDS)}I", *IDS)
    wire = packed_tokens.from_native(native)
    assert wire == packed_tokens.pack(IDS)
    assert packed_tokens.to_native(wire) == native


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5]])
def test_pack_refuses_what_uint32_cannot_hold(bad: list) -> None:
    with pytest.raises((OverflowError, TypeError)):
        packed_tokens.pack(bad)
