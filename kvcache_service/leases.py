"""Leases: one request's grant on one pool, the request for one, and the values handed back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvcache_service.ids import BlockId, LeaseId, Namespace, PoolId, Tokens
from kvcache_service.tokens import TOKEN_BYTES


class Reuse(enum.Enum):
    """What an acquire may do with blocks the pool already holds for the prompt."""

    NONE = "none"  # match nothing, compute the whole prompt; it still commits (benchmarks)
    SHARE = "share"  # share the longest indexed prefix
    # Share it, or answer Deferral while another live lease is still filling more of it, so
    # that a burst with one prefix computes it once.
    SHARE_OR_DEFER = "share_or_defer"


@dataclass(frozen=True, slots=True)
class AcquireRequest:
    """One acquire, built once at the edge (convert.py), its token ids already checked and
    packed there. The authority checks the namespace before anything uses it."""

    pool_id: PoolId
    incarnation: int
    namespace: Namespace
    prompt: Tokens  # checked and packed at the edge (tokens.pack, tokens.from_wire)
    reserve_tokens: int = 0  # token slots beyond the prompt (the first decode steps)
    reuse: Reuse = Reuse.SHARE


NO_TOKENS = Tokens(b"")


@dataclass(frozen=True, slots=True)
class SequenceUpdate:
    """What a commit or release says of a lease's sequence (kvcache.proto's SequenceUpdate).

    ``appended`` (packed) continues the sequence the service knows (the prompt, and what
    earlier updates appended) from token ``appended_from``: never past its end, and where it
    overlaps what is known it must agree. Then the first ``written`` tokens are those whose
    K/V is written; their full blocks are committed. The readable wire form, a whole sequence,
    is ``whole(tokens)``.
    """

    written: int
    appended: Tokens = NO_TOKENS
    appended_from: int = 0

    @classmethod
    def whole(cls, tokens: Tokens) -> SequenceUpdate:
        return cls(len(tokens) // TOKEN_BYTES, tokens, 0)


@dataclass(slots=True, eq=False)
class Lease:
    """A live grant. Owned by its pool's LeaseBook; callers only see Grant values.

    A sequence's token regions, by block position in `table`:

        | shared (matched, read-only) | cow dst? | own blocks to write ............ | reserve |
        0                  cached_tokens//bs                      len(tokens)//bs
        |<------ indexed_blocks ------>|   (grows as the worker commits full blocks)
                                      ^ last_indexed: the canonical block before it, where
                                        the next commit's walk of the index starts

    `refs` maps every block this lease references to its position in the sequence: the
    table, the copy-on-write source, and canonical blocks adopted when a commit found the
    same prefix already indexed under another block. Each block's refcount counts the live
    leases whose `refs` list it, once each.

    `chain[i]` is the chain hash of block `shared_blocks + i` (inflight.chain_hashes),
    `chain_base` the one before it: hashed once, at acquire for the prompt's blocks and at
    commit for the later ones.
    """

    lease_id: LeaseId
    namespace: Namespace
    tokens: Tokens
    table: list[BlockId]
    cached_tokens: int
    cow: tuple[BlockId, BlockId] | None
    shared_blocks: int
    refs: dict[BlockId, int] = field(default_factory=dict)
    indexed_blocks: int = 0
    last_indexed: BlockId | None = None
    chain_base: int = 0
    chain: list[int] = field(default_factory=list)
    # Its first own block is a tail it took over (lease_book._adoptable), not a fresh one.
    adopted: bool = False


@dataclass(frozen=True, slots=True)
class Grant:
    lease_id: LeaseId
    block_table: tuple[BlockId, ...]
    cached_tokens: int
    copy_on_write: tuple[tuple[BlockId, BlockId], ...]
    expires_at: float
    # Blocks after the cached ones (table positions cached_tokens // block_size on, all of
    # them the lease's own) whose KV the pool's tiers hold: the worker loads them.
    tier_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Deferral:
    """The prompt would reuse blocks another live lease is still filling: retry after it
    commits or ends, instead of computing the same prefix twice."""

    waiting_on: LeaseId
    cached_tokens: int
    pending_tokens: int
