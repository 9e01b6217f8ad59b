"""Token ids as the domain carries them (kvcache_service/tokens.py), and the contracts that
moved with them: checked once at the door, whatever shape they come in; a commit that
disagrees with its lease changes nothing; the admin tree still shows token ids."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from kvcache_service import convert
from kvcache_service.authority import AuthorityConfig, CacheAuthority
from kvcache_service.errors import InvalidArgument
from kvcache_service.ids import Namespace, PoolId
from kvcache_service.leases import AcquireRequest, Grant, SequenceUpdate
from kvcache_service.pool import PoolSpec
from kvcache_service.tokens import MAX_TOKEN_ID, count, from_wire, pack, to_wire, unpack
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb

IDS = [0, 1, 7, 31_999, MAX_TOKEN_ID]


@pytest.mark.parametrize(
    "shape",
    [
        list,
        tuple,
        lambda ids: pb.CommitItem(token_ids=ids).token_ids,  # what the servicer hands over
        lambda ids: np.asarray(ids, dtype=np.int64),
        lambda ids: array("q", ids),  # any other sequence of ints
    ],
)
def test_every_shape_packs_to_the_same_ids(shape) -> None:
    packed = pack(shape(IDS), "prompt")
    assert unpack(packed) == tuple(IDS)
    assert count(packed) == len(IDS)


@pytest.mark.parametrize(
    "bad",
    [
        [1, -1],
        [MAX_TOKEN_ID + 1],
        [2**32],
        [2**64],
        [1.5],
        ["7"],
        np.asarray([1, -2]),
        np.asarray([2**31], dtype=np.int64),
        np.asarray([1.0, 2.0]),
        pb.CommitItem(token_ids=[3, -4]).token_ids,
    ],
)
def test_ids_outside_the_range_are_invalid(bad) -> None:
    with pytest.raises(InvalidArgument, match="outside"):
        pack(bad, "prompt")


def test_empty_is_invalid_unless_allowed() -> None:
    with pytest.raises(InvalidArgument, match="empty"):
        pack([], "prompt")
    assert pack([], "token_ids", allow_empty=True) == b""
    assert pack(pb.CommitItem().token_ids, "token_ids", allow_empty=True) == b""


@pytest.fixture
def auth() -> CacheAuthority:
    a = CacheAuthority(AuthorityConfig(lease_ttl_s=60), clock=lambda: 1000.0)
    a.register_pool(PoolSpec(PoolId("w"), 32, 4))
    return a


def whole(tokens: list[int]) -> SequenceUpdate:
    return SequenceUpdate.whole(pack(tokens, "t", allow_empty=True))


def acquire(auth: CacheAuthority, prompt: list[int]) -> Grant:
    inc = auth.pools[PoolId("w")].incarnation
    grant, _ = auth.acquire(AcquireRequest(PoolId("w"), inc, Namespace(""), pack(prompt, "p"), 8))
    assert isinstance(grant, Grant)
    return grant


@pytest.mark.parametrize(
    "commit",
    [
        [1, 2, 3, 9, 5, 6],  # longer than the lease's sequence, differs inside it
        [1, 2, 9],  # shorter, differs
        [1, 2, 3, 4, 5, 7, 8, 9],  # longer, differs in the last prompt token
    ],
)
def test_a_commit_that_disagrees_with_its_lease_changes_nothing(
    auth: CacheAuthority, commit: list[int]
) -> None:
    grant = acquire(auth, [1, 2, 3, 4, 5, 6])
    inc = auth.pools[PoolId("w")].incarnation
    with pytest.raises(InvalidArgument, match="disagree"):
        auth.commit("w", inc, [(grant.lease_id, whole(commit))])  # type: ignore[arg-type]
    assert len(auth.pools[PoolId("w")].index) == 0
    # The lease's own sequence, and one that extends it, still commit.
    assert auth.commit("w", inc, [(grant.lease_id, whole([1, 2, 3, 4]))]) == [4]  # type: ignore[arg-type]
    assert auth.release("w", inc, grant.lease_id, whole([1, 2, 3, 4, 5, 6, 7, 8])) == 8  # type: ignore[arg-type]
    assert auth.check_integrity() == []


def test_commits_in_steps_index_what_one_commit_would(auth: CacheAuthority) -> None:
    """A commit walks on from where the lease's last one ended: committing a sequence a block
    at a time leaves the index one whole-sequence commit leaves (one node, same blocks)."""
    inc = auth.pools[PoolId("w")].incarnation
    seq = list(range(100, 124))  # 6 blocks of 4
    grant = acquire(auth, seq[:3])
    auth.extend("w", inc, [(grant.lease_id, len(seq))])  # type: ignore[arg-type]
    for end in range(4, len(seq) + 1, 4):
        auth.commit("w", inc, [(grant.lease_id, whole(seq[:end]))])  # type: ignore[arg-type]
    pool = auth.pools[PoolId("w")]
    (node,) = pool.index.roots[Namespace("")].children.values()
    assert node.tokens == tuple(seq)
    lease = pool.leases.live[grant.lease_id]
    assert node.blocks == lease.table[:6]
    # A second lease on the same sequence shares it all but its last token's block.
    other = acquire(auth, seq)
    assert other.cached_tokens == len(seq) - 1
    assert list(other.block_table[:5]) == lease.table[:5]
    assert auth.check_integrity() == []


def test_the_admin_tree_shows_token_ids(auth: CacheAuthority) -> None:
    inc = auth.pools[PoolId("w")].incarnation
    prompt = list(range(40_000, 40_020))
    grant = acquire(auth, prompt)
    auth.release("w", inc, grant.lease_id, whole(prompt))  # type: ignore[arg-type]
    tree = convert.tree(auth.pools[PoolId("w")], None, None)
    (node,) = tree.nodes
    assert list(node.token_preview) == prompt  # its blocks, up to PREVIEW_TOKENS tokens
    assert node.num_tokens == 20
    long = list(range(41_000, 41_000 + convert.PREVIEW_TOKENS + 8))
    grant = acquire(auth, long)
    auth.release("w", inc, grant.lease_id, whole(long))  # type: ignore[arg-type]
    previews = [
        list(n.token_preview) for n in convert.tree(auth.pools[PoolId("w")], None, None).nodes
    ]
    assert long[: convert.PREVIEW_TOKENS] in previews


# -- the compact wire form (revision 2) ---------------------------------------------------------


def test_the_wire_form_is_little_endian_uint32_checked_like_the_readable_one() -> None:
    ids = [0, 1, 255, 256, 65_536, MAX_TOKEN_ID]
    wire = b"".join(i.to_bytes(4, "little") for i in ids)
    assert unpack(from_wire(wire, "t")) == tuple(ids)
    assert from_wire(wire, "t") == pack(ids, "t")
    assert to_wire(pack(ids, "t")) == wire
    with pytest.raises(InvalidArgument, match="outside"):
        from_wire((MAX_TOKEN_ID + 1).to_bytes(4, "little"), "t")
    with pytest.raises(InvalidArgument, match="whole number"):
        from_wire(wire[:-1], "t")
    with pytest.raises(InvalidArgument, match="empty"):
        from_wire(b"", "t")
    assert from_wire(b"", "t", allow_empty=True) == b""


def test_either_form_but_not_both() -> None:
    assert convert.tokens([5, 6], b"", "p") == convert.tokens([], to_wire(pack([5, 6], "p")), "p")
    with pytest.raises(InvalidArgument, match="not both"):
        convert.tokens([5, 6], to_wire(pack([5, 6], "p")), "p")
    item = pb.CommitItem(lease_id=1, token_ids=[1], update=pb.SequenceUpdate(written_tokens=1))
    with pytest.raises(InvalidArgument, match="not both"):
        convert.commit_items(pb.CommitLeasesRequest(items=[item]))


def update(written: int, appended: list[int], start: int) -> SequenceUpdate:
    return SequenceUpdate(written, pack(appended, "t", allow_empty=True), start)


def test_updates_carry_only_what_the_lease_does_not_know(auth: CacheAuthority) -> None:
    """A commit of prompt blocks needs no tokens; a release sends what was generated; a
    resend that overlaps what is known is fine. The index ends as whole sequences leave it."""
    inc = auth.pools[PoolId("w")].incarnation
    prompt = list(range(10, 19))  # 2 full blocks of 4 and one token
    grant = acquire(auth, prompt)
    assert auth.commit("w", inc, [(grant.lease_id, update(8, [], 0))]) == [8]  # type: ignore[arg-type]
    generated = [50, 51, 52, 53, 54]
    # Overlaps the prompt's last two tokens, then appends the generated ones.
    # 3 full blocks and a tail of 1 token.
    assert auth.release("w", inc, grant.lease_id, update(13, prompt[-2:] + generated, 7)) == 13  # type: ignore[arg-type]
    other = acquire(auth, prompt + generated[:3] + [99])
    assert other.cached_tokens == 12
    assert auth.check_integrity() == []


@pytest.mark.parametrize(
    "bad, match",
    [
        (update(4, [7], 10), "cannot append from 10"),  # past what the lease knows: a gap
        (update(6, [10, 11, 99], 0), "disagree"),  # disagrees with the prompt
        (update(7, [], 0), "written of 6 known"),  # more written than known
        (update(40, list(range(40)), 6), "covers"),  # past the lease's table
    ],
)
def test_a_refused_update_changes_nothing(
    auth: CacheAuthority, bad: SequenceUpdate, match: str
) -> None:
    inc = auth.pools[PoolId("w")].incarnation
    grant = acquire(auth, [10, 11, 12, 13, 14, 15])
    lease = auth.pools[PoolId("w")].leases.live[grant.lease_id]
    before = lease.tokens
    with pytest.raises(InvalidArgument, match=match):
        auth.commit("w", inc, [(grant.lease_id, bad)])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=match):
        auth.release("w", inc, grant.lease_id, bad)  # type: ignore[arg-type]
    assert lease.tokens == before and grant.lease_id in auth.pools[PoolId("w")].leases.live
    assert len(auth.pools[PoolId("w")].index) == 0
    assert auth.release("w", inc, grant.lease_id, update(6, [], 6)) == 6  # type: ignore[arg-type]
    assert auth.check_integrity() == []


# -- tails: a finished sequence's partial last block ---------------------------------------------


def test_a_chat_turn_reuses_its_whole_history_through_the_tail(auth: CacheAuthority) -> None:
    """The next turn of a chat resends the history: every token the last turn wrote is
    reused, its partial last block included (a tail), not only its full blocks. A tail that
    no lease holds is taken over by the turn that continues it (no copy, no stale twin)."""
    inc = auth.pools[PoolId("w")].incarnation
    pool = auth.pools[PoolId("w")]
    history = list(range(200, 210))  # 2 full blocks of 4 and a tail of 2
    first = acquire(auth, history[:7])
    assert auth.release("w", inc, first.lease_id, whole(history)) == 10  # type: ignore[arg-type]
    tail = first.block_table[2]
    assert tail in pool.index and tail in pool.order  # indexed, evictable
    free = pool.blocks.num_free
    turn = acquire(auth, [*history, 77, 78])
    assert turn.cached_tokens == 10 and turn.copy_on_write == ()
    assert list(turn.block_table[:3]) == list(first.block_table[:3])  # the tail is its own
    assert tail not in pool.index and tail not in pool.order
    assert pool.blocks.num_free == free - 2  # 12 + 8 reserve: 5 blocks, 2 shared, 1 taken, 2 fresh
    assert auth.check_integrity() == []
    # While it is taken, the same history shares the full blocks and computes the rest.
    again = acquire(auth, [*history, 99])
    assert again.cached_tokens == 8 and again.copy_on_write == ()
    assert auth.release("w", inc, turn.lease_id, whole([*history, 77, 78])) == 12  # type: ignore[arg-type]
    # Its next turn, written by the one that took the tail over, is all cached again.
    assert acquire(auth, [*history, 77, 78, 5]).cached_tokens == 12
    auth.release("w", inc, again.lease_id)  # type: ignore[arg-type]
    assert auth.check_integrity() == []


def test_a_chats_tail_outlives_older_blocks_on_a_full_pool(auth: CacheAuthority) -> None:
    """Tails rank by recency like any block. On a pool full of cached blocks (a server that
    has run a while), one chat's next turn needing room must evict the oldest blocks, not the
    tail another chat's turn just left: that chat's next turn would prefill it again. (Tails
    went to the old end of the order until 2026-12-04: the serving benchmark's multi-turn
    chats lost their tails every turn after an earlier workload had filled the pool.)"""
    inc = auth.pools[PoolId("w")].incarnation
    pool = auth.pools[PoolId("w")]
    for i in range(6):  # 24 blocks of older, unrelated history: cached, evictable
        seq = list(range(1000 + 16 * i, 1016 + 16 * i))
        auth.release("w", inc, acquire(auth, seq).lease_id, whole(seq))  # type: ignore[arg-type]
        assert auth.check_integrity() == []
    chats = {c: list(range(100 * c, 100 * c + 10)) for c in (1, 2)}  # 2 full blocks + a tail
    tails = {}
    for c, history in chats.items():
        first = acquire(auth, history[:7])
        assert auth.release("w", inc, first.lease_id, whole(history)) == 10  # type: ignore[arg-type]
        tails[c] = first.block_table[2]
        assert auth.check_integrity() == []
    assert pool.blocks.num_free == 2  # 30 of 32 blocks cached
    # Chat 1's next turn: 8 new tokens and the reserve need 4 blocks beyond its history's 3.
    turn = acquire(auth, [*chats[1], *range(500, 508)])
    assert turn.cached_tokens == 10
    assert auth.check_integrity() == []
    assert tails[2] in pool.index  # the two oldest unrelated blocks went instead
    assert acquire(auth, [*chats[2], 77]).cached_tokens == 10
    assert auth.check_integrity() == []


def test_a_tail_is_indexed_only_where_it_adds_something(auth: CacheAuthority) -> None:
    inc = auth.pools[PoolId("w")].incarnation
    seq = list(range(300, 306))  # a full block and a tail of 2
    a = acquire(auth, seq)
    auth.release("w", inc, a.lease_id, whole(seq))  # type: ignore[arg-type]
    pool = auth.pools[PoolId("w")]
    indexed = len(pool.index)
    # The same tail, or a shorter one, adds nothing: the block is freed, not indexed.
    for same in (seq, seq[:5]):
        b = acquire(auth, same)
        auth.release("w", inc, b.lease_id, whole(same))  # type: ignore[arg-type]
        assert len(pool.index) == indexed
    # A lease that takes the tail over and ends before writing gives it back.
    c = acquire(auth, [*seq, 1])
    assert c.cached_tokens == 6 and len(pool.index) == indexed - 1
    assert auth.release("w", inc, c.lease_id, whole(seq)) == 6  # type: ignore[arg-type]
    assert len(pool.index) == indexed
    # A lease that wrote nothing past what it copied indexes no tail (its copy-on-write
    # destination was never filled): a prompt ending inside a full block.
    d = acquire(auth, [*seq[:4], 7, 8, 9, 10])
    auth.release("w", inc, d.lease_id, whole([*seq[:4], 7, 8, 9, 10]))  # type: ignore[arg-type]
    e = acquire(auth, [*seq[:4], 7, 8, 0])
    assert e.cached_tokens == 6 and e.copy_on_write
    assert auth.release("w", inc, e.lease_id, whole([*seq[:4], 7, 8])) == 4  # type: ignore[arg-type]
    indexed = len(pool.index)
    # A tail after a block in the middle of a node splits it there.
    long = list(range(400, 412))  # 3 full blocks
    d = acquire(auth, long[:11])
    auth.release("w", inc, d.lease_id, whole(long))  # type: ignore[arg-type]
    f = acquire(auth, [*long[:4], 5, 6])
    assert f.cached_tokens == 4
    assert auth.release("w", inc, f.lease_id, whole([*long[:4], 5, 6])) == 6  # type: ignore[arg-type]
    assert acquire(auth, [*long[:4], 5, 6, 7]).cached_tokens == 6
    assert auth.check_integrity() == []
