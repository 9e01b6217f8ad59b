"""The warm-up plan: the shapes it covers, and every step valid for the pool it runs on."""

from __future__ import annotations

import pytest

from worker.model.attention import gpu_decode, gpu_prefill
from worker.model.forward_batch import ForwardBatch
from worker.warmup_plan import decode_sizes, plan


def test_decode_sizes_double_up_to_the_batch_limit() -> None:
    assert decode_sizes(16, 2048) == [1, 2, 4, 8, 16]
    assert decode_sizes(12, 2048) == [1, 2, 4, 8, 12]
    assert decode_sizes(1, 2048) == [1]
    assert decode_sizes(32, 5) == [1, 2, 4, 5]  # never more sequences than blocks
    many = decode_sizes(1024, 1 << 20)
    assert len(many) == 8 and many[0] == 1 and many[-1] == 1024


LIMITS = [
    # block_size, num_blocks, max_batch_size, max_step_tokens, max_context
    (32, 2048, 16, 256, 4096),  # the CPU defaults
    (32, 90000, 32, 2048, 131072),  # the GPU defaults
    (16, 256, 16, 64, 4096),  # the engine tests' workers
    (16, 12, 16, 64, 4096),  # a pool smaller than a batch of two-block contexts
    (8, 3, 4, 100, 4096),  # a pool smaller than a step
    (1, 1, 1, 1, 2),  # everything at its minimum
    (32, 64, 8, 512, 48),  # a context shorter than a step
    (16, 256, 1, 256, 4096),  # one sequence at a time
]


@pytest.mark.parametrize(("draft_tokens", "draft_model"), [(0, False), (4, False), (16, True)])
@pytest.mark.parametrize("kernel_variants", [False, True])
@pytest.mark.parametrize(("bs", "blocks", "batch", "step", "context"), LIMITS)
def test_every_step_fits_the_pool_and_the_limits(
    bs, blocks, batch, step, context, kernel_variants, draft_tokens, draft_model
) -> None:
    steps = plan(
        block_size=bs,
        num_blocks=blocks,
        max_batch_size=batch,
        max_step_tokens=step,
        max_context=context,
        vocab_size=100,
        kernel_variants=kernel_variants,
        draft_tokens=draft_tokens,
        draft_model=draft_model,
    )
    for s in steps:
        if s.speculative:  # its verify forward: each row's token and drafts, from one position
            verify = s.verify_inputs()
            ForwardBatch(verify, bs, blocks)
            assert sum(len(i.token_ids) for i in verify) <= step
            assert all(i.end <= context for i in verify)
            assert all(len(i.token_ids) == draft_tokens + 1 for i in verify)
            assert all(0 <= t < 100 for h in s.histories for t in h)
            assert [h[-1] for h in s.histories] == [i.token_ids[0] for i in s.inputs]
            assert bool(s.draft_slots) == draft_model and bool(s.drafts) != draft_model
            assert len(s.inputs) <= batch
    assert not steps[0].is_decode or step == 1
    assert any(s.is_decode for s in steps)
    for s in steps:
        # ForwardBatch checks block tables against the pool and that no two sequences of one
        # step write the same slot; the engine's own steps pass the same checks.
        ForwardBatch(list(s.inputs), bs, blocks)
        assert len(s.inputs) <= max(1, min(batch, blocks)) or not s.is_decode
        assert sum(len(i.token_ids) for i in s.inputs) <= step
        assert all(i.end <= context for i in s.inputs)
        assert all(0 <= t < 100 for i in s.inputs for t in i.token_ids)
        assert len(s.samplers) == len(s.inputs)
        for src, dst in s.copies:
            assert src != dst and 0 <= src < blocks and 0 <= dst < blocks


def test_the_plan_has_a_speculative_step_where_one_fits() -> None:
    kw = {"num_blocks": 2048, "max_batch_size": 16, "max_context": 4096, "vocab_size": 100}
    for draft_model in (False, True):
        steps = plan(
            block_size=32, max_step_tokens=256, draft_tokens=4, draft_model=draft_model, **kw
        )
        assert sum(s.speculative for s in steps) == 1
    assert not any(s.speculative for s in plan(block_size=32, max_step_tokens=256, **kw))
    # 2 rows of 17 tokens do not fit a step of 16 tokens: no speculative step, no error
    assert not any(
        s.speculative for s in plan(block_size=32, max_step_tokens=16, draft_tokens=16, **kw)
    )


def test_the_default_plan_covers_prefill_decode_and_sampling() -> None:
    steps = plan(
        block_size=32,
        num_blocks=2048,
        max_batch_size=16,
        max_step_tokens=256,
        max_context=4096,
        vocab_size=264,
    )
    prefills = [s for s in steps if not s.is_decode]
    assert len(prefills[0].inputs[0].token_ids) == 256  # a chunk of the step size
    assert any(i.start > 0 for s in prefills for i in s.inputs)  # a chunk after a context
    assert any(s.copies for s in steps)
    assert [len(s.inputs) for s in steps if s.is_decode] == [1, 2, 4, 8, 16]
    params = {p for s in steps for p in s.samplers}
    assert any(p.greedy for p in params)
    assert any(p.temperature == 1.0 and p.seed is None and not p.top_k for p in params)
    assert any(p.seed is not None and p.logprobs for p in params)
    assert any(p.top_k and p.repetition_penalty != 1.0 for p in params)


def kernel_variant(step, heads: int, rep: int, bs: int, tc: bool) -> tuple[int, bool]:
    """The GPU kernel variant a forward of ``step`` launches: rows per tile, split or not
    (``tc``: the tensor-core variant, whose tiles are always 16 rows)."""
    nq = max(len(i.token_ids) for i in step.inputs)
    rt = gpu_decode.TC_ROWS if tc else gpu_decode.rows_per_tile(rep, nq)
    tiles = -(-(rep * nq) // rt)
    key_blocks = max(-(-i.end // bs) for i in step.inputs)
    warps = gpu_decode.tc_pipeline(64)[0] if tc else gpu_decode.WARPS
    splits = gpu_decode.choose_splits(len(step.inputs) * heads * tiles, key_blocks, warps)
    return rt, splits > 1


@pytest.mark.parametrize("tc", [False, True])
@pytest.mark.parametrize("heads", [1, 8, 32])
@pytest.mark.parametrize("rep", [1, 2, 3, 4, 8])
def test_the_gpu_plan_compiles_every_kernel_variant_a_request_can_reach(heads, rep, tc) -> None:
    """Every (rows per tile, one pass or split) that a decode, a verify of up to 16 drafts or
    a short prefill chunk can launch is launched by the warm-up, not by a user's request: on
    CUDA cores (rows per tile by the call's rows) and on tensor cores (16 rows a tile)."""
    bs = 32
    steps = plan(
        block_size=bs,
        num_blocks=90000,
        max_batch_size=32,
        max_step_tokens=2048,
        max_context=131072,
        vocab_size=100,
        kernel_variants=True,
    )
    covered = {
        kernel_variant(s, heads, rep, bs, tc)
        for s in steps
        if max(len(i.token_ids) for i in s.inputs) <= gpu_decode.MAX_QUERIES
    }
    reachable = {
        (gpu_decode.TC_ROWS if tc else gpu_decode.rows_per_tile(rep, nq), split)
        for nq in range(1, gpu_decode.MAX_QUERIES + 1)
        for split in (False, True)
    }
    assert reachable <= covered
    assert not any(s.kernel for s in plan(
        block_size=bs, num_blocks=90000, max_batch_size=32, max_step_tokens=2048,
        max_context=131072, vocab_size=100,
    ))  # fmt: skip


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize(("heads", "rep"), [(1, 1), (8, 4), (8, 8), (32, 1)])
def test_the_gpu_plan_compiles_the_prefill_kernel_s_variants(bs, heads, rep) -> None:
    """The block-table prefill kernel's one-pass and split variants are each launched by a
    warm-up forward of more queries than the decode kernel takes."""
    steps = plan(
        block_size=bs,
        num_blocks=90000,
        max_batch_size=32,
        max_step_tokens=2048,
        max_context=131072,
        vocab_size=100,
        kernel_variants=True,
    )
    splits = set()
    for s in steps:
        nq = max(len(i.token_ids) for i in s.inputs)
        if s.kernel and nq > gpu_decode.MAX_QUERIES:
            width = max(-(-i.end // bs) for i in s.inputs)
            n = gpu_prefill.choose_splits(len(s.inputs), heads, rep, nq, width * bs, None)
            splits.add(n > 1)
    assert splits == {False, True}


def test_the_gpu_plan_runs_its_first_chunk_twice() -> None:
    """On a GPU the second sighting of a prefill shape goes to cuDNN: the warm-up's step-size
    chunk runs twice there, so cuDNN is loaded before the first request (once elsewhere)."""
    limits = dict(
        block_size=32,
        num_blocks=4096,
        max_batch_size=32,
        max_step_tokens=2048,
        max_context=40960,
        vocab_size=100,
    )
    for kernel_variants, times in ((True, 2), (False, 1)):
        steps = plan(**limits, kernel_variants=kernel_variants)
        assert sum(s.inputs == steps[0].inputs for s in steps) == times
