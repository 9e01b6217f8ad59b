"""The warm-up's speculative step, run through a real executor: the verify forward and, with a
draft model, the draft model's prefill and decodes, so a worker's first speculative request
does not pay their first-use compiles (NVRTC and cuDNN on a GPU, fused kernels on the CPU)."""

from __future__ import annotations

import pytest

from worker.engine.executor import ModelExecutor
from worker.model.draft import DraftModel
from worker.model.runner import ModelRunner
from worker.warmup import warm_up
from worker.warmup_plan import WARMUP_SEQ_KEYS

LIMITS = {"max_batch_size": 4, "max_step_tokens": 64, "max_context": 256}


def _executor(model, draft: DraftModel | None) -> ModelExecutor:
    def build() -> ModelRunner:
        return ModelRunner.create(model.model, block_size=8, num_blocks=64)

    return ModelExecutor(build, (lambda runner: draft) if draft is not None else None)


async def test_the_warm_up_drafts_with_the_draft_model_and_forgets_its_sequences(model) -> None:
    draft = DraftModel(model.model, "itself", model.model.args.vocab_size)
    calls = []
    real = draft.propose

    def propose(key, tokens, k):
        calls.append((key, len(tokens), k))
        return real(key, tokens, k)

    draft.propose = propose  # type: ignore[method-assign]
    executor = _executor(model, draft)
    try:
        report = await warm_up(executor, model.tokenizer, **LIMITS, draft_tokens=3)
    finally:
        executor.shutdown()
    assert report.speculative_forwards == 1
    assert "1 speculative" in report.describe()
    assert [(key, k) for key, _, k in calls] == [(key, 3) for key in WARMUP_SEQ_KEYS]
    assert all(n > 8 for _, n, _ in calls)  # a context of more than a block: a real prefill
    assert not draft._states  # nothing of the warm-up's sequences is left for a lease


@pytest.mark.parametrize("draft_tokens", [0, 4])
async def test_the_warm_up_verifies_given_drafts_without_a_draft_model(model, draft_tokens) -> None:
    """n-gram speculation gives its drafts; the verify forward (each row's token and its
    drafts) and ``verify_rows`` run."""
    executor = _executor(model, None)
    shapes = []
    real = executor.runner.forward_all

    def forward_all(seqs):
        shapes.append(tuple(len(s.token_ids) for s in seqs))
        return real(seqs)

    executor.runner.forward_all = forward_all  # type: ignore[method-assign]
    try:
        report = await warm_up(executor, model.tokenizer, **LIMITS, draft_tokens=draft_tokens)
    finally:
        executor.shutdown()
    assert report.speculative_forwards == (1 if draft_tokens else 0)
    if draft_tokens:
        assert shapes.count((draft_tokens + 1,) * 2) == 1
