"""Typed ids, so a block id is never passed where a position or a count is expected."""

from typing import NewType

BlockId = NewType("BlockId", int)
"""A physical block of one worker's pool, 0..num_blocks-1, assigned by the cache service."""
