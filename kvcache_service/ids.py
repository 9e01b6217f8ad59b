"""Distinct id types, so a block id is never confused with a token id or a lease id."""

from typing import NewType

BlockId = NewType("BlockId", int)
LeaseId = NewType("LeaseId", int)
PoolId = NewType("PoolId", str)
TokenId = NewType("TokenId", int)
Namespace = NewType("Namespace", str)

# A prompt or a sequence, as handed to the index: a tuple so that slices hash and compare in C.
Tokens = tuple[int, ...]
