"""When granted tier blocks load rather than compute (``TierSync.observe`` and the store's
``load_worth``): a prefill token's cost at the margin, the forward's fixed cost taken off, so
that a device whose short prefills are mostly fixed cost (a GPU) does not load what computes
faster. Pure: a real TierSync and TierStore, no model or service."""

from __future__ import annotations

import asyncio

from worker.engine.step_budget import ForwardTime
from worker.engine.tier_sync import TierSync
from worker.tier.host import HostTier
from worker.tier.store import BlockFormat, TierStore

BS = 32
PAYLOAD = 4 << 20  # an 8B llama's block: 4 MiB


def tiers(read_rate: float) -> TierSync:
    store = TierStore(BS, BlockFormat("m", "l", PAYLOAD), host=HostTier(capacity_blocks=8))
    store.read_rate = read_rate
    return TierSync(
        store, None, None, lambda *a: None, step_lock=asyncio.Lock(), wake_steps=lambda: None
    )  # no client or pool: only the decision is exercised


def loads(sync: TierSync) -> bool:
    return sync.store.load_worth(sync._s_per_token)


def test_a_forwards_fixed_cost_is_not_counted_as_what_a_load_saves() -> None:
    """The H200's 8B case: a 1,040-token prefill in 25 ms, a decode forward in 12 ms. On
    average a block costs 0.77 ms to compute, at the margin 0.40 ms; it loads in 0.65 ms
    (6.5 GB/s): the average said load, the margin says compute."""
    prefill = ForwardTime(0.0, 0.025, 1040)
    average = tiers(6.5e9)
    average.observe(prefill)  # a size's first forward compiles: not counted
    average.observe(prefill)
    assert loads(average)  # no decode seen yet: the average is all there is
    margin = tiers(6.5e9)
    margin.observe(ForwardTime(0.050, 0.0, 0))  # the first decode (compiling): the least is kept
    margin.observe(prefill)
    margin.observe(ForwardTime(0.012, 0.0, 0))
    margin.observe(prefill)
    assert margin._s_per_token is not None
    assert abs(margin._s_per_token * 1040 - 0.013) < 1e-9
    assert not loads(margin)


def test_where_prefill_is_slow_loading_still_wins() -> None:
    """A CPU's case: the fixed cost is a small part of a chunk (the default model: a 256-token
    chunk in ~0.5 s, a decode forward in ~20 ms), so blocks still load."""
    sync = tiers(1e9)
    for took in (ForwardTime(0.02, 0.0, 0), ForwardTime(0.0, 0.5, 256), ForwardTime(0.0, 0.5, 256)):
        sync.observe(took)
    assert loads(sync)


def test_a_decode_slower_than_the_chunk_leaves_the_matmul_bound() -> None:
    """Timings that would make a token free (a decode forward at a large batch costing more than
    a short chunk) fall back on the start's floor, never below it."""
    sync = tiers(1e9)
    sync._floor = 1e-5
    for took in (ForwardTime(0.3, 0.0, 0), ForwardTime(0.0, 0.2, 128), ForwardTime(0.0, 0.2, 128)):
        sync.observe(took)
    assert sync._s_per_token == 1e-5
