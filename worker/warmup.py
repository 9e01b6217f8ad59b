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

So the warm-up runs, on the model thread and through the executor's own step path: a prefill
chunk of the step size, a batch of two prefill chunks (one continuing a context, an array
mask, a copy-on-write copy), decodes at batch sizes 1, 2, 4, ... up to the batch limit, and
sampling (greedy, temperature 1.0 -- the OpenAI default --, seeded with logprobs, top-k with a
repetition penalty), a step of two speculative decodes (greedy and temperature: the verify
forward and ``verify_rows``; with ``--draft-model``, the draft model's prefill and decodes, a
second model whose kernels and cuDNN graphs would otherwise compile on the first speculative
request), then, where decodes run compiled (``worker.model.compiled_decode``, an NVIDIA GPU),
traces their graph for every batch and table-width bucket up to the batch and context limits
(``ModelRunner.prepare_compiled_decodes``: a new shape's trace cost 30-70 ms on this 2-core
CPU for a 22-layer model), then tokenizes and detokenizes a little text.

It runs after the worker is ready (``worker.server``), so a worker serves within seconds of its
start and the first requests pay at most a compile of their own, never the whole warm-up (on
this CPU the default model's warm-up took 2 s, on an H100 a 1B model's 65 s). Each step runs
only while no request is held (``Engine.idle_step``), so a request that arrives waits for at
most the one step in progress. Its sequences write only *scratch* blocks: the pool holds
:func:`scratch_blocks` more blocks than it registers with the cache service, so no lease can
ever name them (block ids ``first_block`` on). Sequences of one forward get distinct blocks,
as leases would.

Where decode attention runs the block-table kernel (``worker.model.attention.gpu_decode``, an NVIDIA
GPU), the kernel is compiled once per variant -- rows per thread block (from the query heads
per KV head times the queries of a call: 1 for a decode, up to 17 for a speculative verify or
a short prefill chunk) and one-pass or split-then-merge (long contexts, few sequences) -- about
2 s each with NVRTC (H100, MLX 0.32.4). A long-prefix burst met the split kernels first in the
decode right after its first request's prefill, and the requests waiting on that prefix
waited those seconds too. So the warm-up also runs forwards of 1, 2, 3 and 5 queries over one
block and over many (:data:`KERNEL_QUERIES`): every variant a request can reach; and a
24-token prefill chunk over a short and a 512-token context, the block-table prefill kernel's
one-pass and split variants (``worker.model.attention.gpu_prefill``: about 3 s each to compile).

Not covered: mlx-lm's compiled samplers bake ``temperature``, ``top_p`` and ``min_p`` into the
kernel as constants, so each new value compiles one more small kernel on first use (CPU: about
0.5 s, once per machine). On a GPU, prefill chunks take the block-table prefill kernel, which
takes shapes as arguments; cuDNN builds a graph (40-85 ms on an H100) only for a prefill shape
seen before (``gpu_prefill.ShapeHistory``), or for one the kernel does not serve (fp32, head
dims other than 64 and 128).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from typing import Any

from worker.engine.executor import ModelExecutor, SampleRow, Speculation
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import TextStream
from worker.model.forward_batch import SeqInput
from worker.model.sampling import RowSampler

log = logging.getLogger(__name__)

MAX_DECODE_SIZES = 8
# Queries per call that select every rows-per-tile variant of the GPU kernel for any number of
# query heads per KV head (rows are rounded up to a power of two, at most 8:
# ``gpu_decode.rows_per_tile``); each runs over a short and a long context (one pass, split).
KERNEL_QUERIES = (1, 2, 3, 5)
KERNEL_LONG_BLOCKS = 16  # a context this long splits (``gpu_decode.choose_splits``)
# A prefill chunk past the decode kernel's 17 queries, over one short and one long context:
# the block-table prefill kernel's one-pass and split variants (``attention.gpu_prefill``).
PREFILL_KERNEL_QUERIES = 24
PREFILL_LONG_TOKENS = 512  # eight key tiles of 64: a single sequence's chunk splits
WARMUP_TEXT = "Warm-up: the quick brown fox jumps over the lazy dog. 0123456789"


@dataclass(frozen=True, slots=True)
class WarmupForward:
    """One warm-up step: its sequences, copy-on-write pairs, and each row's sampling."""

    inputs: tuple[SeqInput, ...]
    copies: tuple[tuple[int, int], ...]
    samplers: tuple[SamplingParams, ...]  # one per input: every row samples
    kernel: bool = False  # there for a GPU kernel variant
    # Speculative decodes (every input a decode): the drafts each row's verify forward checks,
    # given (as n-gram speculation gives them), or ``draft_slots`` from the draft model.
    drafts: tuple[tuple[int, ...], ...] = ()
    draft_slots: int = 0
    histories: tuple[tuple[int, ...], ...] = ()  # each row's tokens so far (the draft's input)

    @property
    def is_decode(self) -> bool:
        return all(len(s.token_ids) == 1 for s in self.inputs)

    @property
    def speculative(self) -> bool:
        return bool(self.drafts or self.draft_slots)

    def verify_inputs(self) -> list[SeqInput]:
        """The verify forward a speculative step runs: each row's token, then its drafts
        (placeholders for the draft model's), from the same position."""
        out = []
        for i, s in enumerate(self.inputs):
            drafts = self.drafts[i] if self.drafts else (0,) * self.draft_slots
            out.append(SeqInput([*s.token_ids, *drafts], s.block_table, s.start, s.seq_key))
        return out


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


def samplers(vocab_size: int) -> tuple[SamplingParams, ...]:
    """The sampling paths a request can take: batched greedy, temperature (the OpenAI default
    1.0), seeded with logprobs, top-k with a repetition penalty (logits processors)."""
    top_k = min(50, vocab_size - 1)
    return (
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, seed=0, logprobs=5),
        SamplingParams(temperature=1.0, top_k=top_k, repetition_penalty=1.1)
        if top_k > 0
        else SamplingParams(temperature=1.0, repetition_penalty=1.1),
    )


def decode_sizes(max_batch_size: int, num_blocks: int, most: int = MAX_DECODE_SIZES) -> list[int]:
    """1, 2, 4, ... and the limit itself: at most ``most`` sizes, each sequence a block of its
    own (a pool of n blocks never runs more than n sequences)."""
    cap = max(1, min(max_batch_size, num_blocks))
    sizes = [1 << k for k in range(cap.bit_length()) if 1 << k < cap] + [cap]
    if len(sizes) > most:
        # Keep the smallest and the largest; thin out the middle evenly.
        picks = {round(i * (len(sizes) - 1) / (most - 1)) for i in range(most)}
        sizes = [s for i, s in enumerate(sizes) if i in picks]
    return sizes


def plan(
    *,
    block_size: int,
    num_blocks: int,
    max_batch_size: int,
    max_step_tokens: int,
    max_context: int,
    vocab_size: int,
    kernel_variants: bool = False,
    draft_tokens: int = 0,
    draft_model: bool = False,
) -> list[WarmupForward]:
    """The warm-up steps for these limits; every block table stays inside the pool, and no two
    sequences of one step write the same block. ``kernel_variants``: also the GPU attention
    kernel's variants (``KERNEL_QUERIES`` over a short and a long context). ``draft_tokens``:
    also a step of speculative decodes verifying that many drafts, a greedy row and a
    temperature row, drafted by the draft model with ``draft_model`` (its prefill and decodes
    run too), else given as n-gram speculation gives them."""
    bs = block_size
    sampling = samplers(vocab_size)

    def tokens(n: int, salt: int) -> list[int]:
        return [(salt + 7 * i) % vocab_size for i in range(n)]

    def rows(n: int) -> tuple[SamplingParams, ...]:
        return tuple(sampling[i % len(sampling)] for i in range(n))

    def blocks(n_tokens: int) -> int:
        return max(1, -(-n_tokens // bs))

    steps: list[WarmupForward] = []
    # A prefill chunk of the step size, from an empty context.
    chunk = max(1, min(max_step_tokens, max_context - 1, num_blocks * bs))
    steps.append(
        WarmupForward((SeqInput(tokens(chunk, 1), list(range(blocks(chunk))), 0),), (), rows(1))
    )
    # Two prefill chunks in one padded batch: one continues a one-block context (an array
    # mask, keys read from the pool), after a copy-on-write copy into its first block.
    la, lb = max(2, chunk // 2 - 1), max(2, chunk // 4 + 1)
    need_a, need_b = blocks(bs + la), blocks(lb)
    if la + lb <= max_step_tokens and bs + la < max_context and need_a + need_b <= num_blocks:
        table_a = list(range(need_a))
        table_b = list(range(need_a, need_a + need_b))
        steps.append(
            WarmupForward(
                (SeqInput(tokens(la, 2), table_a, bs), SeqInput(tokens(lb, 3), table_b, 0)),
                ((table_b[-1], table_a[0]),),
                rows(2),
            )
        )
    # Decodes at growing batch sizes, contexts of different lengths (array masks).
    for size in decode_sizes(max_batch_size, num_blocks):
        per_seq = 2 if 2 * size <= num_blocks and max_context > 2 * bs else 1
        span = per_seq * bs - 1  # context lengths 0..span-1 fit per_seq blocks with the new token
        seqs = []
        for i in range(size):
            start = min((1 + 5 * i) % max(1, span), max_context - 1)
            table = list(range(i * per_seq, i * per_seq + blocks(start + 1)))
            seqs.append(SeqInput(tokens(1, 4 + i), table, start))
        steps.append(WarmupForward(tuple(seqs), (), rows(size)))
    if draft_tokens > 0:
        spec = _speculative_step(
            bs,
            num_blocks,
            max_batch_size,
            max_context,
            draft_tokens,
            draft_model,
            sampling,
            vocab_size,
        )
        if spec is not None and sum(len(i.token_ids) for i in spec.verify_inputs()) <= (
            max_step_tokens
        ):
            steps.append(spec)
    if kernel_variants:
        # The first chunk once more: a prefill shape seen before goes to cuDNN
        # (``gpu_prefill.ShapeHistory``), so this loads cuDNN and builds the graph of the most
        # common chunk. Without it the first long prompt after start paid both: the 8k-prefix
        # burst's first token came at 2.2 s instead of 0.5 (H100).
        steps.append(replace(steps[0], kernel=True))
        most = min(num_blocks, (max_context - 1) // bs)  # blocks a context may span here
        long = min(KERNEL_LONG_BLOCKS, most)
        prefill_long = min(most, blocks(PREFILL_LONG_TOKENS))
        variants = [(n, (1, long)) for n in KERNEL_QUERIES]
        variants.append((PREFILL_KERNEL_QUERIES, (1, prefill_long)))
        for n, spans in variants:
            for span in sorted({max(span, blocks(n + 1)) for span in spans}):
                end = span * bs
                if n <= max_step_tokens and span <= most:  # its n queries end the context
                    seq = SeqInput(tokens(n, 5 + n + span), list(range(span)), end - n)
                    steps.append(WarmupForward((seq,), (), rows(1), kernel=True))
    return steps


WARMUP_SEQ_KEYS = (-1, -2)  # the speculative step's sequences: never a lease id (those are >= 0)
# The scratch blocks a pool keeps beyond what it registers: as many as the warm-up's plan uses,
# at most an eighth of the pool (but at least MIN_SCRATCH): a small CPU pool warms smaller
# batches rather than give up a large share of its blocks (its compiled kernels do not depend
# on the batch; a GPU's pool is large enough for every shape).
MIN_SCRATCH = 8
PLAN_LIMIT = 1 << 20  # "unlimited" blocks, to measure what a plan uses


def scratch_blocks(
    *,
    block_size: int,
    num_blocks: int,
    max_batch_size: int,
    max_step_tokens: int,
    max_context: int,
    draft_tokens: int = 0,
) -> int:
    """How many blocks past the leasable ``num_blocks`` the warm-up gets (see
    :data:`MIN_SCRATCH`): what its whole plan would use, the GPU kernel variants included."""
    steps = plan(
        block_size=block_size,
        num_blocks=PLAN_LIMIT,
        max_batch_size=max_batch_size,
        max_step_tokens=max_step_tokens,
        max_context=max_context,
        vocab_size=2,
        kernel_variants=True,
        draft_tokens=draft_tokens,
    )
    used = 1 + max(
        max((b for s in step.inputs for b in s.block_table), default=0) for step in steps
    )
    return min(used, max(MIN_SCRATCH, num_blocks // 8))


def shifted(step: WarmupForward, first_block: int) -> WarmupForward:
    """``step`` on blocks ``first_block`` on (the scratch blocks) instead of from 0."""
    if not first_block:
        return step
    inputs = tuple(
        SeqInput(s.token_ids, [b + first_block for b in s.block_table], s.start, s.seq_key)
        for s in step.inputs
    )
    copies = tuple((a + first_block, b + first_block) for a, b in step.copies)
    return replace(step, inputs=inputs, copies=copies)


def _speculative_step(
    bs: int,
    num_blocks: int,
    max_batch_size: int,
    max_context: int,
    k: int,
    draft_model: bool,
    sampling: tuple[SamplingParams, ...],
    vocab_size: int,
) -> WarmupForward | None:
    """Two speculative decodes (one at a batch limit of one), greedy and temperature 1.0
    (``verify_rows`` takes a different path for each), over contexts of a block and a few
    tokens; None where they do not fit."""
    inputs, histories, used = [], [], 0
    keys = WARMUP_SEQ_KEYS[: max(1, max_batch_size)]
    for i, key in enumerate(keys):
        start = min(bs + 3 + i, max_context - k - 1)
        if start < 1:
            return None
        need = -(-(start + k + 1) // bs)
        if used + need > num_blocks:
            return None
        history = tuple((11 + 3 * i + 5 * j) % vocab_size for j in range(start + 1))
        inputs.append(SeqInput([history[-1]], list(range(used, used + need)), start, key))
        histories.append(history)
        used += need
    drafts = (
        ()
        if draft_model
        else tuple(tuple((h[-1] + 1 + j) % vocab_size for j in range(k)) for h in histories)
    )
    return WarmupForward(
        tuple(inputs),
        (),
        (sampling[0], sampling[1])[: len(inputs)],  # greedy, temperature 1.0
        drafts=drafts,
        draft_slots=k if draft_model else 0,
        histories=tuple(histories),
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
    """Run :func:`plan` through the executor's step path, then the tokenizer and a streaming
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
        async with gate() if gate is not None else contextlib.nullcontext():
            await executor.run_batch(list(step.inputs), list(step.copies), samples, speculations)
        log.debug(
            "warm-up step: %d sequences x %d tokens in %.2f s",
            len(step.inputs),
            max(len(s.token_ids) for s in step.inputs),
            time.perf_counter() - t,
        )
    # The draft model's state of the warm-up's sequences (the engine's next step would drop
    # it too: they are not among its leases).
    async with gate() if gate is not None else contextlib.nullcontext():
        await executor.drop(frozenset(WARMUP_SEQ_KEYS))
    # The compiled decode's shapes (an NVIDIA GPU): traced now, not on a request's step.
    # One call a shape: a request that arrives waits for one trace, not all of them.
    paged: Any = runner  # the paged runner's; the dense runner does not compile decodes
    shapes: list[tuple[int, int]] = []
    if runner.kind == "paged":
        shapes = paged.compiled_decode_shapes(max_batch_size, max_context)
    compiled = 0
    for shape in shapes:
        async with gate() if gate is not None else contextlib.nullcontext():
            if not await executor.call(paged.prepare_compiled_decode, shape):
                break
        compiled += 1
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
