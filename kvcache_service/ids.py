"""Distinct id types, so that a block id is never confused with a lease id or a token."""

from typing import NewType

BlockId = NewType("BlockId", int)
LeaseId = NewType("LeaseId", int)
PoolId = NewType("PoolId", str)
Namespace = NewType("Namespace", str)

# A prompt or a sequence as the domain carries it: token ids packed 4 bytes each, checked once
# where they come in (tokens.pack), so that slices hash and compare at C speed.
Tokens = NewType("Tokens", bytes)
