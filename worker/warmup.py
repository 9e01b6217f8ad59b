"""Warm start: run the shapes the engine will meet once, in the background after the worker is
ready, between requests.

What a cold worker's first request paid for, measured on CPU (2-core x86, MLX 0.32.4): MLX's
CPU backend compiles every fused graph of an ``mx.compile``'d function to C++ and builds it
with the system compiler, 0.5-1 s a kernel: mlx-lm's ``swiglu`` in every Llama-style MLP, and
the sampler chain (temperature scaling, random bits, uniform, categorical) for any request with
a temperature. The shared objects are cached in ``$TMPDIR/mlx/<version>/cpu``, so a machine
pays once per kernel, and a container with a fresh ``/tmp`` pays at every start: 3-4.6 s for
the first chat completion after ``make run``, under 0.1 s for the next ones. The model forward itself,
the tokenizer, the detokenizer and the cache-service channel cost milliseconds the first time.
On an H200 (mlx-cuda, a 1B fp16 llama) the first request took 31 s against 0.4 s later:
NVRTC compiles each kernel on first use (cached in ``$TMPDIR/mlx/<version>/ptx``), and
cuDNN builds an attention graph for each new prefill shape (in memory only, 50-100 ms each).

So the warm-up runs, on the model thread and through the executor's own step path, the steps
of its plan (``worker.warmup_plan``: prefill chunks, decodes at growing batch sizes, every
sampling path, speculative decodes, and on an NVIDIA GPU every attention kernel variant); with
``--draft-model``, the draft model's prefill and decodes too, a second model whose kernels and
cuDNN graphs would otherwise compile on the first speculative request; then, where decodes run
compiled (``worker.model.compiled_decode``, an NVIDIA GPU), traces their graph for every batch
and table-width bucket up to the batch and context limits
(``ModelRunner.prepare_compiled_decodes``: a new shape's trace cost 30-70 ms on this 2-core CPU
for a 22-layer model); then tokenizes and detokenizes a little text.

It runs after the worker is ready (``worker.server``), so a worker serves within seconds of its
start and the first requests pay at most a compile of their own, never the whole warm-up (on
this CPU the default model's warm-up took 2 s, on an H100 a 1B model's 65 s). Each step runs
only while no request is held (``Engine.idle_step``), so a request that arrives waits for at
most the one step in progress. Its sequences write only *scratch* blocks, which no lease can
ever name (``worker.warmup_plan.scratch_blocks``; block ids ``first_block`` on).

Not covered: mlx-lm's compiled samplers bake ``temperature``, ``top_p`` and ``min_p`` into the
kernel as constants, so each new value compiles one more small kernel on first use (CPU: about
0.5 s, once per machine). On a GPU, prefill chunks take the block-table prefill kernel, which
takes shapes as arguments; cuDNN builds a graph (40-85 ms on an H100) only for a prefill shape
seen before (``gpu_prefill.ShapeHistory``), or for one the kernel does not serve (fp32, head
dims other than 64 and 128).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from worker.device_defaults import WorkerLimits
from worker.engine.executor import ModelExecutor, SampleRow, Speculation
from worker.engine.loop import Engine
from worker.engine.sequence import TextStream
from worker.model.sampling import RowSampler
from worker.warmup_plan import WARMUP_SEQ_KEYS, WarmupForward, plan, shifted

log = logging.getLogger(__name__)

WARMUP_TEXT = "Warm-up: the quick brown fox jumps over the lazy dog. 0123456789"


@dataclass(frozen=True, slots=True)
class WarmupReport:
    seconds: float
    prefill_tokens: int
    decode_sizes: tuple[int, ...]
    forwards: int
    kernel_forwards: int = 0  # of them, for the GPU kernel's variants
    speculative_forwards: int = 0  # of them, verifying drafts (n-gram or the draft model's)
    compiled_shapes: int = 0  # compiled decode shapes traced (worker.model.compiled_decode)

    def describe(self) -> str:
        sizes = ",".join(map(str, self.decode_sizes)) or "none"
        return (
            f"warm-up: {self.forwards} steps (prefill chunk of {self.prefill_tokens} tokens, "
            f"decode batches {sizes}, "
            + (f"{self.kernel_forwards} for kernel variants, " if self.kernel_forwards else "")
            + (f"{self.speculative_forwards} speculative, " if self.speculative_forwards else "")
            + (f"{self.compiled_shapes} compiled decode shapes, " if self.compiled_shapes else "")
            + f"sampling, detokenizer) in {self.seconds:.2f} s"
        )


Gate = Callable[[], AbstractAsyncContextManager[None]]


async def warm_up(
    executor: ModelExecutor,
    tokenizer: Any,
    *,
    max_batch_size: int,
    max_step_tokens: int,
    max_context: int,
    kernel_variants: bool | None = None,
    draft_tokens: int = 0,
    first_block: int = 0,
    num_blocks: int | None = None,
    gate: Gate | None = None,
) -> WarmupReport:
    """Run the plan (``worker.warmup_plan.plan``) through the executor's step path, then the tokenizer and a streaming
    detokenizer, on blocks ``first_block`` to ``first_block + num_blocks - 1`` (default: the
    whole pool, for a runner no lease uses yet); each forward inside ``gate()`` where given
    (``Engine.idle_step``: between requests). ``draft_tokens`` (the worker's drafts per step):
    a speculative step too, on the paged runner, drafted by the executor's draft model if it
    has one. Raises whatever a forward raises."""
    runner = executor.runner
    if kernel_variants is None:  # the paged runner's decodes on the GPU kernel
        attention = getattr(runner, "attention", None)
        kernel_variants = attention is not None and attention.name == "cuda"
    t0 = time.perf_counter()
    steps = plan(
        block_size=runner.block_size,
        num_blocks=runner.num_blocks if num_blocks is None else num_blocks,
        max_batch_size=max_batch_size,
        max_step_tokens=max_step_tokens,
        max_context=max_context,
        vocab_size=runner.spec.vocab_size,
        kernel_variants=kernel_variants,
        draft_tokens=draft_tokens if runner.kind == "paged" else 0,
        draft_model=executor.draft is not None,
    )
    for step in (shifted(s, first_block) for s in steps):
        await _run_step(executor, step, gate)
    # The draft model's state of the warm-up's sequences (the engine's next step would drop
    # it too: they are not among its leases).
    async with _gated(gate):
        await executor.drop(frozenset(WARMUP_SEQ_KEYS))
    compiled = await _trace_compiled_decodes(executor, max_batch_size, max_context, gate)
    _warm_tokenizer(tokenizer)
    return WarmupReport(
        seconds=time.perf_counter() - t0,
        prefill_tokens=len(steps[0].inputs[0].token_ids),
        decode_sizes=tuple(len(s.inputs) for s in steps if s.is_decode and not s.speculative),
        forwards=len(steps),
        kernel_forwards=sum(s.kernel for s in steps),
        speculative_forwards=sum(s.speculative for s in steps),
        compiled_shapes=compiled,
    )


def _gated(gate: Gate | None) -> AbstractAsyncContextManager[None]:
    return gate() if gate is not None else contextlib.nullcontext()


async def _run_step(executor: ModelExecutor, step: WarmupForward, gate: Gate | None) -> None:
    """One planned step through the executor's step path: every row sampled, the speculative
    ones verified."""
    samples = [
        SampleRow(i, RowSampler(p), list(s.token_ids), s.end)
        for i, (s, p) in enumerate(zip(step.inputs, step.samplers, strict=True))
    ]
    speculations = [
        Speculation(
            i,
            step.drafts[i] if step.drafts else (),
            step.draft_slots,
            list(step.histories[i]) if step.draft_slots else [],
        )
        for i in range(len(step.inputs) if step.speculative else 0)
    ]
    t = time.perf_counter()
    async with _gated(gate):
        await executor.run_batch(list(step.inputs), list(step.copies), samples, speculations)
    log.debug(
        "warm-up step: %d sequences x %d tokens in %.2f s",
        len(step.inputs),
        max(len(s.token_ids) for s in step.inputs),
        time.perf_counter() - t,
    )


async def _trace_compiled_decodes(
    executor: ModelExecutor, max_batch_size: int, max_context: int, gate: Gate | None
) -> int:
    """The compiled decode's shapes (an NVIDIA GPU): traced now, not on a request's step. One
    call a shape: a request that arrives waits for one trace, not all of them. Returns how many
    were traced."""
    runner = executor.runner
    paged: Any = runner  # the paged runner's; the dense runner does not compile decodes
    shapes: list[tuple[int, int]] = []
    if runner.kind == "paged":
        shapes = paged.compiled_decode_shapes(max_batch_size, max_context)
    compiled = 0
    for shape in shapes:
        async with _gated(gate):
            if not await executor.call(paged.prepare_compiled_decode, shape):
                break
        compiled += 1
    return compiled


async def warm_up_between_requests(
    engine: Engine, limits: WorkerLimits, max_context: int, draft_tokens: int
) -> None:
    """The warm-up on the pool's scratch blocks, between requests (``Engine.idle_step``), in the
    background of a serving worker (``worker.server``). A failure is logged, not raised: the
    self-check has shown the model serves; a shape the warm-up could not run costs its first
    request a compile, nothing more."""
    try:
        report = await warm_up(
            engine.executor,
            engine.tokenizer,
            max_batch_size=limits.max_batch_size,
            max_step_tokens=limits.max_step_tokens,
            max_context=max_context,
            draft_tokens=draft_tokens,
            first_block=limits.num_blocks,
            num_blocks=limits.scratch_blocks,
            gate=engine.idle_step,
        )
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("warm-up failed; requests will compile what it did not reach")
        return
    log.info("%s", report.describe())


def _warm_tokenizer(tokenizer: Any) -> None:
    """What the servicer and the engine call per request: encode (text prompts), streaming
    detokenization (every token), decode (logprob tokens). Only ids the tokenizer made itself:
    a model's vocabulary may be padded past the tokenizer's."""
    ids = [int(t) for t in tokenizer.encode(WARMUP_TEXT)]
    stream = TextStream(tokenizer.detokenizer, ("\n\n",), False)
    for token in ids:
        stream.add(token)
    stream.finish()
    tokenizer.decode(ids[:8])
