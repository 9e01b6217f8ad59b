"""A pool's counters since its registration: what GetStats reports beyond the block states."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PoolCounters:
    """Plain counts. The lease book writes the lease fields (acquires to cached tokens, expired
    leases, tier hits); the budget writes `exhausted` and `evicted_blocks`. The tiers count their
    own blocks (tier_index.TierCounters)."""

    acquires: int = 0
    acquire_hits: int = 0  # acquires that reused at least one cached token
    deferrals: int = 0
    exhausted: int = 0  # acquires and extensions refused for lack of blocks
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evicted_blocks: int = 0
    expired_leases: int = 0
    tier_hit_tokens: int = 0  # prompt tokens acquires were granted to load from a tier
