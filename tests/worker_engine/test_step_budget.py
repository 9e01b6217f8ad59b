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
