"""The warm-up's plan: which steps it runs, as plain inputs, sized to the pool and the limits
(``worker.warmup`` runs them, and says why).

The steps: a prefill chunk of the step size, two prefill chunks in one batch (one continuing a
context, an array mask, a copy-on-write copy), decodes at batch sizes 1, 2, 4, ... up to the
limit, every sampling path (:func:`samplers`), two speculative decodes (greedy, temperature).
They write only *scratch* blocks: the pool holds :func:`scratch_blocks` more blocks than it
registers, so no lease can name them (:func:`shifted` moves a step onto them). Sequences of one
forward get distinct blocks, as leases would.

Where decode attention runs the block-table kernel (``worker.model.attention.gpu_decode``, an
NVIDIA GPU), the kernel is compiled once per variant -- rows per thread block (from the query
heads per KV head times the queries of a call: 1 for a decode, up to 17 for a speculative verify
or a short prefill chunk) and one-pass or split-then-merge (long contexts, few sequences) --
about 2 s each with NVRTC (H100, MLX 0.32.4). A long-prefix burst met the split kernels first in
the decode right after its first request's prefill, and the requests waiting on that prefix
waited those seconds too. So the plan also has forwards of 1, 2, 3 and 5 queries over one block
and over many (:data:`KERNEL_QUERIES`): every variant a request can reach; and a 24-token
prefill chunk over a short and a 512-token context, the block-table prefill kernel's one-pass
and split variants (``worker.model.attention.gpu_prefill``: about 3 s each to compile).

Pure arithmetic on the limits: every plan is checked against its pool without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve_model.sampling_params import SamplingParams
from worker.model.forward_batch import SeqInput

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
    pool = _Pool(block_size, num_blocks, max_context, vocab_size, samplers(vocab_size))
    steps = _prefill_steps(pool, max_step_tokens)
    steps += _decode_steps(pool, max_batch_size)
    if draft_tokens > 0:
        spec = _speculative_step(pool, max_batch_size, max_step_tokens, draft_tokens, draft_model)
        steps += [spec] if spec is not None else []
    if kernel_variants:
        steps += _kernel_steps(pool, steps[0], max_step_tokens)
    return steps


@dataclass(frozen=True, slots=True)
class _Pool:
    """What every planned step is sized by: the pool, the context, the vocabulary, and the
    sampling paths rows cycle through."""

    block_size: int
    num_blocks: int
    max_context: int
    vocab_size: int
    sampling: tuple[SamplingParams, ...]

    def tokens(self, n: int, salt: int) -> list[int]:
        return [(salt + 7 * i) % self.vocab_size for i in range(n)]

    def rows(self, n: int) -> tuple[SamplingParams, ...]:
        return tuple(self.sampling[i % len(self.sampling)] for i in range(n))

    def blocks(self, n_tokens: int) -> int:
        return max(1, -(-n_tokens // self.block_size))


def _prefill_steps(pool: _Pool, max_step_tokens: int) -> list[WarmupForward]:
    """A prefill chunk of the step size, from an empty context; then two prefill chunks in one
    padded batch, one continuing a one-block context (an array mask, keys read from the pool)
    after a copy-on-write copy into its first block, where they fit."""
    bs, num_blocks = pool.block_size, pool.num_blocks
    chunk = max(1, min(max_step_tokens, pool.max_context - 1, num_blocks * bs))
    first = SeqInput(pool.tokens(chunk, 1), list(range(pool.blocks(chunk))), 0)
    steps = [WarmupForward((first,), (), pool.rows(1))]
    la, lb = max(2, chunk // 2 - 1), max(2, chunk // 4 + 1)
    need_a, need_b = pool.blocks(bs + la), pool.blocks(lb)
    if la + lb <= max_step_tokens and bs + la < pool.max_context and need_a + need_b <= num_blocks:
        table_a = list(range(need_a))
        table_b = list(range(need_a, need_a + need_b))
        steps.append(
            WarmupForward(
                (
                    SeqInput(pool.tokens(la, 2), table_a, bs),
                    SeqInput(pool.tokens(lb, 3), table_b, 0),
                ),
                ((table_b[-1], table_a[0]),),
                pool.rows(2),
            )
        )
    return steps


def _decode_steps(pool: _Pool, max_batch_size: int) -> list[WarmupForward]:
    """Decodes at growing batch sizes, contexts of different lengths (array masks)."""
    bs, num_blocks = pool.block_size, pool.num_blocks
    steps = []
    for size in decode_sizes(max_batch_size, num_blocks):
        per_seq = 2 if 2 * size <= num_blocks and pool.max_context > 2 * bs else 1
        span = per_seq * bs - 1  # context lengths 0..span-1 fit per_seq blocks with the new token
        seqs = []
        for i in range(size):
            start = min((1 + 5 * i) % max(1, span), pool.max_context - 1)
            table = list(range(i * per_seq, i * per_seq + pool.blocks(start + 1)))
            seqs.append(SeqInput(pool.tokens(1, 4 + i), table, start))
        steps.append(WarmupForward(tuple(seqs), (), pool.rows(size)))
    return steps


def _kernel_steps(pool: _Pool, first: WarmupForward, max_step_tokens: int) -> list[WarmupForward]:
    """The GPU kernels' variants: ``first`` (the first chunk) once more, then forwards of
    KERNEL_QUERIES queries over a short and a long context, and a prefill chunk over a short
    and a long one."""
    bs = pool.block_size
    # The first chunk once more: a prefill shape seen before goes to cuDNN
    # (``gpu_prefill.ShapeHistory``), so this loads cuDNN and builds the graph of the most
    # common chunk. Without it the first long prompt after start paid both: the 8k-prefix
    # burst's first token came at 2.2 s instead of 0.5 (H100).
    steps = [replace(first, kernel=True)]
    most = min(pool.num_blocks, (pool.max_context - 1) // bs)  # blocks a context may span here
    long = min(KERNEL_LONG_BLOCKS, most)
    prefill_long = min(most, pool.blocks(PREFILL_LONG_TOKENS))
    variants = [(n, (1, long)) for n in KERNEL_QUERIES]
    variants.append((PREFILL_KERNEL_QUERIES, (1, prefill_long)))
    for n, spans in variants:
        for span in sorted({max(span, pool.blocks(n + 1)) for span in spans}):
            end = span * bs
            if n <= max_step_tokens and span <= most:  # its n queries end the context
                seq = SeqInput(pool.tokens(n, 5 + n + span), list(range(span)), end - n)
                steps.append(WarmupForward((seq,), (), pool.rows(1), kernel=True))
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
    pool: _Pool, max_batch_size: int, max_step_tokens: int, k: int, draft_model: bool
) -> WarmupForward | None:
    """Two speculative decodes (one at a batch limit of one), greedy and temperature 1.0
    (``verify_rows`` takes a different path for each), over contexts of a block and a few
    tokens; None where they do not fit the pool, the context or (verified) the step."""
    bs = pool.block_size
    inputs, histories, used = [], [], 0
    keys = WARMUP_SEQ_KEYS[: max(1, max_batch_size)]
    for i, key in enumerate(keys):
        start = min(bs + 3 + i, pool.max_context - k - 1)
        if start < 1:
            return None
        need = -(-(start + k + 1) // bs)
        if used + need > pool.num_blocks:
            return None
        history = tuple((11 + 3 * i + 5 * j) % pool.vocab_size for j in range(start + 1))
        inputs.append(SeqInput([history[-1]], list(range(used, used + need)), start, key))
        histories.append(history)
        used += need
    drafts = (
        ()
        if draft_model
        else tuple(tuple((h[-1] + 1 + j) % pool.vocab_size for j in range(k)) for h in histories)
    )
    step = WarmupForward(
        tuple(inputs),
        (),
        (pool.sampling[0], pool.sampling[1])[: len(inputs)],  # greedy, temperature 1.0
        drafts=drafts,
        draft_slots=k if draft_model else 0,
        histories=tuple(histories),
    )
    return step if sum(len(i.token_ids) for i in step.verify_inputs()) <= max_step_tokens else None
