"""The warm-up traces the compiled decode's shapes (``worker.model.compiled_decode``) where
decodes run compiled, on this CPU with the GPU's attention routing and the kernel's computation
in lazy MLX ops standing in: every batch and table-width bucket up to the limits, so no request
pays a trace."""

from __future__ import annotations

from tests.worker.helpers import route_as_cuda, runs_cuda_attention
from worker.engine.executor import ModelExecutor
from worker.model.runner import ModelRunner
from worker.warmup import warm_up

LIMITS = {"max_batch_size": 4, "max_step_tokens": 64, "max_context": 256}


async def test_the_warm_up_traces_every_decode_bucket(model, monkeypatch) -> None:
    route_as_cuda(monkeypatch)
    executor = ModelExecutor(lambda: ModelRunner.create(model.model, block_size=8, num_blocks=64))
    try:
        report = await warm_up(executor, model.tokenizer, **LIMITS, kernel_variants=False)
    finally:
        executor.shutdown()
    compiled = executor.runner.compiled_decode  # type: ignore[attr-defined]
    # batches 1, 2, 4 by widths 1, 2, ..., 32 blocks (256 tokens of 8): 18 shapes, each
    # traced once (the warm-up's own decode steps met some of them first)
    assert report.compiled_shapes == 18 and "18 compiled decode shapes" in report.describe()
    assert compiled is not None and compiled.traces == 18 and compiled.calls >= 3


async def test_no_shapes_on_this_cpu_s_own_path(model) -> None:
    executor = ModelExecutor(lambda: ModelRunner.create(model.model, block_size=8, num_blocks=64))
    try:
        report = await warm_up(executor, model.tokenizer, **LIMITS)
    finally:
        executor.shutdown()
    if not runs_cuda_attention():
        assert report.compiled_shapes == 0 and "compiled" not in report.describe()
