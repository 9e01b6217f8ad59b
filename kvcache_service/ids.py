"""Distinct id types, so that a block id is never confused with a lease id or a token."""

from typing import NewType

BlockId = NewType("BlockId", int)
LeaseId = NewType("LeaseId", int)
PoolId = NewType("PoolId", str)
Namespace = NewType("Namespace", str)

# A prompt or a sequence, as handed to the index: a tuple so that slices hash and compare in C.
Tokens = tuple[int, ...]
