"""The routing policy, as a pure function."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.router import Candidate, RouteReason, RoutingPolicy, choose_worker

POLICY = RoutingPolicy(min_match_tokens=32, min_match_ratio=0.2, overload_slack=4)


def cand(
    name: str,
    cached: int = 0,
    load: int = 0,
    free: int = 100,
    healthy: bool = True,
    capacity: int = 0,
):
    return Candidate(name, f"{name}:1", cached, load, free, healthy, capacity)


def test_no_candidates_means_no_decision():
    assert choose_worker([], 100, POLICY) is None


def test_longest_cached_prefix_wins():
    d = choose_worker([cand("a", 64), cand("b", 256), cand("c", 128)], 300, POLICY)
    assert d is not None
    assert d.chosen.pool_id == "b"
    assert d.reason is RouteReason.PREFIX
    assert [c.pool_id for c in d.order] == ["b", "c", "a"]


def test_prefix_beats_a_slightly_lower_load():
    d = choose_worker([cand("a", 0, load=0), cand("b", 256, load=3)], 300, POLICY)
    assert d is not None and d.chosen.pool_id == "b"


def test_overloaded_prefix_holder_is_skipped_for_the_next_best():
    # b holds the most, but load 10 > 0 + max(4, 0): overloaded; c holds less but is idle.
    d = choose_worker([cand("a", 0), cand("b", 256, load=10), cand("c", 64)], 300, POLICY)
    assert d is not None
    assert d.chosen.pool_id == "c"
    assert d.reason is RouteReason.OVERLOADED
    assert d.order[-1].pool_id == "b"  # still a fail-over target, last


def test_overload_is_relative_under_heavy_load():
    # min load 100: slack is max(4, 0.5 * 100) = 50, so 140 is not overloaded, 151 is.
    two = [cand("a", 0, load=100), cand("b", 256, load=140)]
    d = choose_worker(two, 300, POLICY)
    assert d is not None and d.chosen.pool_id == "b"
    two = [cand("a", 0, load=100), cand("b", 256, load=151)]
    d = choose_worker(two, 300, POLICY)
    assert d is not None and d.chosen.pool_id == "a"


def test_short_matches_do_not_count():
    # 20 cached tokens: below min_match_tokens (32); the less loaded worker wins.
    d = choose_worker([cand("a", 20, load=1), cand("b", 0, load=0)], 100, POLICY)
    assert d is not None
    assert d.chosen.pool_id == "b"
    assert d.reason is RouteReason.LEAST_LOADED
    # 40 of 1000 prompt tokens: above 32 but below 20% of the prompt.
    d = choose_worker([cand("a", 40, load=1), cand("b", 0, load=0)], 1000, POLICY)
    assert d is not None and d.chosen.pool_id == "b"


def test_without_a_prefix_the_least_loaded_then_emptiest_wins():
    d = choose_worker([cand("a", load=2), cand("b", load=1), cand("c", load=1, free=200)], 50)
    assert d is not None
    assert [c.pool_id for c in d.order] == ["c", "b", "a"]
    assert d.reason is RouteReason.LEAST_LOADED


def test_ties_break_by_pool_id():
    d = choose_worker([cand("b"), cand("a")], 10)
    assert d is not None and d.chosen.pool_id == "a"


def test_unhealthy_workers_are_last_resort():
    d = choose_worker([cand("a", 256, healthy=False), cand("b", 0, load=5)], 300, POLICY)
    assert d is not None
    assert [c.pool_id for c in d.order] == ["b", "a"]
    assert d.reason is RouteReason.LEAST_LOADED


def test_all_unhealthy_still_tries_them():
    d = choose_worker([cand("a", 256, healthy=False), cand("b", healthy=False)], 300, POLICY)
    assert d is not None
    assert d.reason is RouteReason.UNHEALTHY
    assert d.chosen.pool_id == "a"  # the prefix still ranks first among the unhealthy


def test_full_workers_are_tried_after_every_other():
    """A worker at its request limit (--max-pending-requests) would refuse: the prefix holder
    is passed over for it, even for an overloaded worker, and tried after."""
    a, b = cand("a", 256, load=4, capacity=4), cand("b", 0, load=20)
    c = cand("c", 0, load=0, healthy=False)
    d = choose_worker([a, b, c], 300, POLICY)
    assert d is not None
    assert [x.pool_id for x in d.order] == ["b", "a", "c"]
    assert d.reason is RouteReason.OVERLOADED
    # Below its limit it competes as before; 0 is no limit.
    d = choose_worker([cand("a", 256, load=3, capacity=4), b], 300, POLICY)
    assert d is not None and d.chosen.pool_id == "a"
    d = choose_worker([cand("a", 256, load=3, capacity=0), b], 300, POLICY)
    assert d is not None and d.chosen.pool_id == "a"


def test_all_full_still_tries_them_least_loaded_first():
    full = [cand("a", 256, load=9, capacity=8), cand("b", load=4, capacity=4)]
    d = choose_worker([*full, cand("c", healthy=False)], 300, POLICY)
    assert d is not None
    assert d.reason is RouteReason.FULL
    assert [x.pool_id for x in d.order] == ["b", "a", "c"]


candidates = st.lists(
    st.builds(
        Candidate,
        pool_id=st.sampled_from("abcdefgh"),
        address=st.just("x:1"),
        cached_tokens=st.integers(0, 512),
        load=st.integers(0, 64),
        free_blocks=st.integers(0, 64),
        healthy=st.booleans(),
        capacity=st.sampled_from([0, 1, 8, 64]),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda c: c.pool_id,
)


@given(candidates, st.integers(1, 600))
def test_decision_properties(cs: list[Candidate], prompt_tokens: int):
    d = choose_worker(cs, prompt_tokens, POLICY)
    assert d is not None
    # Every candidate appears exactly once: all are fail-over targets.
    assert sorted(c.pool_id for c in d.order) == sorted(c.pool_id for c in cs)
    healthy = [c for c in cs if c.healthy]
    room = [c for c in healthy if not c.full]
    if healthy and not room:
        assert d.reason is RouteReason.FULL
    if room:
        assert d.chosen.healthy and not d.chosen.full
        min_load = min(c.load for c in room)
        assert not POLICY.overloaded(d.chosen.load, min_load)
        # Nothing healthy, not overloaded, and with a longer counting match was passed over.
        for c in room:
            if not POLICY.overloaded(c.load, min_load) and POLICY.counts(
                c.cached_tokens, prompt_tokens
            ):
                assert c.cached_tokens <= max(d.chosen.cached_tokens, 0)
    if not healthy:
        assert d.reason is RouteReason.UNHEALTHY
