"""The step-time budget in pure Python: prefill tokens per step from measured forward times."""

from __future__ import annotations

import pytest

from worker.engine.step_budget import ForwardTime, StepBudget


def test_no_ttl_means_no_cap() -> None:
    budget = StepBudget(max_tokens=256, min_tokens=32)
    assert budget.prefill_tokens() == 256
    budget.observe(ForwardTime(0.0, 100.0, 256))
    assert budget.prefill_tokens() == 256


def test_one_block_until_measured_then_a_quarter_of_the_ttl_in_whole_blocks() -> None:
    budget = StepBudget(max_tokens=1024, min_tokens=32)
    budget.set_ttl(8.0)  # a step may take 2 s
    assert budget.prefill_tokens() == 32
    budget.observe(ForwardTime(0.0, 0.32, 32))  # 10 ms a token: 200 fit, 192 in whole blocks
    assert budget.prefill_tokens() == 192
    budget.observe(ForwardTime(0.0, 0.32, 64))  # faster: the average follows (7.5 ms)
    assert budget.prefill_tokens() == 256
    for _ in range(20):
        budget.observe(ForwardTime(0.0, 0.001, 1000))
    assert budget.prefill_tokens() == 1024


def test_decode_time_comes_off_the_budget_and_progress_never_stops() -> None:
    budget = StepBudget(max_tokens=512, min_tokens=16)
    budget.set_ttl(4.0)  # 1 s a step
    budget.observe(ForwardTime(0.0, 1.0, 100))  # 10 ms a token
    assert budget.prefill_tokens() == 96
    budget.observe(ForwardTime(1.0, 0.0, 0))  # decodes now take 0.5 s (average)
    assert budget.prefill_tokens() == 48
    budget.observe(ForwardTime(0.0, 100.0, 10))  # hopelessly slow: one block a step still
    assert budget.prefill_tokens() == 16


@pytest.mark.parametrize(("max_tokens", "min_tokens"), [(8, 32), (40, 32)])
def test_max_step_tokens_stays_the_upper_bound(max_tokens: int, min_tokens: int) -> None:
    budget = StepBudget(max_tokens, min_tokens)
    budget.set_ttl(30.0)
    assert budget.prefill_tokens() <= max_tokens
    budget.observe(ForwardTime(0.0, 0.001, 8))
    assert budget.prefill_tokens() == max_tokens


def test_beside_decodes_the_prefill_forward_fits_the_itl_ratio() -> None:
    # A decode forward takes 80 ms; a prefill forward 30 ms + 2.5 ms a token (fitted).
    budget = StepBudget(max_tokens=256, min_tokens=32, itl_ratio=2.0)
    assert budget.prefill_tokens_beside_decodes() == 256  # nothing decodes yet: no cap
    budget.observe(ForwardTime(0.08, 0.0, 0))
    assert budget.prefill_tokens_beside_decodes() == 32  # no prefill timed: one block
    for n in (32, 256, 64, 256, 32):
        budget.observe(ForwardTime(0.08, 0.030 + 0.0025 * n, n))
    fixed, per_token = budget.prefill_cost() or (0.0, 0.0)
    assert fixed == pytest.approx(0.030) and per_token == pytest.approx(0.0025)
    # (2 - 1) * 80 ms = 30 ms + 2.5 ms x 20 tokens: one block (the floor) a step.
    assert budget.prefill_tokens_beside_decodes() == 32
    assert budget.prefill_tokens() == 256  # without decodes the whole budget
    budget.itl_ratio = 4.0  # 240 ms: 84 tokens, 64 in whole blocks
    assert budget.prefill_tokens_beside_decodes() == 64
    budget.itl_ratio = 0.0  # no cap
    assert budget.prefill_tokens_beside_decodes() == 256


def test_the_latency_cap_never_exceeds_the_ttl_cap_and_follows_slower_decodes() -> None:
    budget = StepBudget(max_tokens=1024, min_tokens=16, itl_ratio=3.0)
    budget.set_ttl(4.0)  # 1 s a step
    budget.observe(ForwardTime(0.5, 1.0, 100))  # 10 ms a token, decodes 0.5 s
    # Latency: (3 - 1) * 0.5 s = 1 s of prefill = 100 tokens; TTL: 1 s less the decode EWMA
    # (0.25 s, from 0) = 75 tokens, 64 in whole blocks: the smaller wins.
    assert budget.prefill_tokens() == 64
    assert budget.prefill_tokens_beside_decodes() == 64
    budget.set_ttl(0.0)  # no TTL cap: the latency cap alone, in whole blocks
    assert budget.prefill_tokens_beside_decodes() == 96
    budget.observe(ForwardTime(1.5, 0.0, 0))  # decodes slower (EWMA 1.0 s): more room
    assert budget.prefill_tokens_beside_decodes() == 192


def test_the_cost_fit_takes_noise_without_promising_free_tokens() -> None:
    budget = StepBudget(max_tokens=256, min_tokens=32, itl_ratio=2.0)
    budget.observe(ForwardTime(0.1, 0.5, 200))  # one size only: all of it per token
    assert budget.prefill_cost() == (0.0, pytest.approx(0.0025))
    budget.observe(ForwardTime(0.1, 0.2, 32))  # a shorter forward cost more a token
    fixed, per_token = budget.prefill_cost() or (0.0, 0.0)
    assert fixed > 0 and per_token > 0
    budget.prefills.clear()
    budget.observe(ForwardTime(0.1, 0.5, 32))  # longer forwards cheaper: noise, no line fits
    budget.observe(ForwardTime(0.1, 0.1, 64))
    fixed, per_token = budget.prefill_cost() or (0.0, 0.0)
    assert fixed == 0.0 and per_token == pytest.approx(0.6 / 96)
    # However the fit turns out, a prompt always progresses by a block a step.
    budget.observe(ForwardTime(100.0, 0.0, 0))
    budget.itl_ratio = 1.01
    budget.observe(ForwardTime(0.001, 0.0, 0))
    assert budget.prefill_tokens_beside_decodes() >= 32


def test_the_worker_flag_takes_a_ratio_above_one_or_zero() -> None:
    from worker.config import WorkerConfig, check

    assert WorkerConfig.from_args([]).itl_ratio == 0.0  # off unless asked for
    assert WorkerConfig.from_args(["--itl-ratio", "2.5"]).itl_ratio == 2.5
    assert check(WorkerConfig(itl_ratio=0.0)) is None
    for bad in (0.5, 1.0, -2.0):
        assert "--itl-ratio must be above 1" in (check(WorkerConfig(itl_ratio=bad)) or "")
