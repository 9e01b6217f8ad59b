"""Decode attention that reads K/V blocks where they lie in the pool (CPU fast path).

The reference path gathers each sequence's blocks into a dense ``[B, heads, L, dim]`` copy and
runs SDPA on it; at decode that copy costs more than the attention itself (one query per
sequence reads each key once, the gather reads and writes it once more). ``mx.gather_mm``
multiplies against rows picked by index without materializing them, so scores and outputs are
computed block by block straight from the pool: the same memory traffic as dense SDPA.

mlx-lm attention layers call the module-level ``scaled_dot_product_attention`` imported from
``mlx_lm.models.base``; :func:`install` points that name, in the modules of one model's layers,
at :func:`paged_sdpa`, which serves :class:`PagedLayerCache` decodes and passes every other call
(dense caches, prefill, attention sinks, keys a model changed after fetching them) to the
original unchanged (or, where the runner measured it faster, to :func:`gathered_attention`),
except prefill chunks on the CPU, whose softmax runs in numpy
(``worker.model.cpu_attention``: MLX's CPU ``exp`` is ~15x slower than numpy's), and decodes
on the CPU where a compiled kernel measured faster at start (``worker.model.cpu_decode``). On an NVIDIA
GPU (MLX's CUDA backend) decodes go to a block-table kernel instead
(``worker.model.gpu_attention``), prefill chunks to :func:`exact_context_attention` where it
can stand for the batch's array mask (the fused causal kernel, 7-11x faster than SDPA under an
array mask there), and everything else to the original function.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base

from worker.model import cpu_attention, cpu_decode, cpu_math, gpu_attention, gpu_prefill
from worker.model.forward_batch import ForwardBatch
from worker.model.paged_cache import PagedLayerCache

_ORIGINAL_SDPA = base.scaled_dot_product_attention


# Query-key pairs per stream below which a split costs more in synchronization than it
# saves (measured on a 2-core x86 CPU: the crossover is near 8k).
MIN_SPLIT = 8192


def block_table_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    rows: mx.array,
    scale: float,
    row_mask: mx.array | None,
    streams: Sequence[mx.Stream] = (),
) -> mx.array:
    """Attention of ``queries`` ``[B, Hq, 1, D]`` over pool blocks picked by ``rows``.

    ``keys``/``values`` are one layer's pool ``[H, blocks, block_size, D]``; ``rows`` is
    ``[B * H, n]`` and ``row_mask`` None or ``[B * H, 1, n * block_size]`` (bool or additive),
    see ``ForwardBatch.block_rows`` and ``row_mask``. Query head ``h * rep + r`` reads KV head
    ``h``, as in SDPA.

    The ``B * H`` (sequence, head) rows are independent; with several ``streams`` they are split
    between them and run concurrently, one MLX CPU thread per stream. Decode attention reads
    every key and value once: it is bound by the memory bandwidth one core can draw, and two
    cores draw about twice as much (2.4x faster at batch 8, 1k context, on a 2-core x86).
    """
    b, hq, _, d = queries.shape
    h, blocks, bs, dv = values.shape
    rep, n = hq // h, rows.shape[1]
    q = (queries * scale).reshape(b * h, 1, rep, d)
    k_t = keys.reshape(h * blocks, bs, d).swapaxes(1, 2)
    v = values.reshape(h * blocks, bs, dv)
    parts = max(1, min(len(streams), b * h, b * hq * n * bs // MIN_SPLIT))
    bounds = [b * h * i // parts for i in range(parts + 1)]
    outs = []
    for i in range(parts):
        lo, hi = bounds[i], bounds[i + 1]
        part_mask = None if row_mask is None else row_mask[lo:hi]
        with mx.stream(streams[i] if streams else mx.default_stream(mx.default_device())):
            outs.append(_attend_rows(q[lo:hi], k_t, v, rows[lo:hi], part_mask))
    out = outs[0] if parts == 1 else mx.concatenate(outs, axis=0)
    return out.reshape(b, hq, 1, dv).astype(queries.dtype)


def _attend_rows(
    q: mx.array, k_t: mx.array, v: mx.array, rows: mx.array, mask: mx.array | None
) -> mx.array:
    """Rows ``[r, 1, rep, D]`` of queries over their blocks: ``[r, rep, Dv]``."""
    r, n, rep, bs = q.shape[0], rows.shape[1], q.shape[2], v.shape[1]
    scores = mx.gather_mm(q, k_t, rhs_indices=rows)  # [r, n, rep, bs]
    if rep > 1:
        scores = scores.transpose(0, 2, 1, 3)
    scores = scores.reshape(r, rep, n * bs)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    probs = cpu_math.softmax(scores).astype(v.dtype)  # MLX's CPU exp is ~5x slower
    probs = probs.reshape(r, rep, n, bs)
    probs = probs.transpose(0, 2, 1, 3) if rep > 1 else probs.reshape(r, n, 1, bs)
    return mx.gather_mm(probs, v, rhs_indices=rows).sum(axis=1)


# Bytes of K and V gathered at once by gathered_attention. A few sequences at a time: one layer
# of a batch of 32 at context 1,024 gathered whole took 95-128 ms, in chunks 31-66.
GATHER_CHUNK_BYTES = 8 << 20


def gathered_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    rows: mx.array,
    scale: float,
    mask: mx.array | str | None,
    streams: Sequence[mx.Stream] = (),
) -> mx.array:
    """Attention of a few queries a sequence, ``[B, Hq, N, D]`` (a decode, or a decode with its
    speculative drafts), over their blocks, gathered a few sequences at a time into contiguous
    K/V for SDPA; the chunks alternate between ``streams``.

    Same arguments as :func:`block_table_attention` but the mask, which is the batch's: None,
    ``"causal"`` or ``[B|1, 1, N, L]``. A few large operations instead of one GEMM per block, for a
    multithreaded BLAS, at the price of a copy of the context: ``ModelRunner.
    choose_decode_attention`` measures at start which path a worker takes."""
    b = queries.shape[0]
    h, blocks, bs, dk = keys.shape
    dv = values.shape[-1]
    n = rows.shape[1]
    k_rows, v_rows = keys.reshape(h * blocks, bs, dk), values.reshape(h * blocks, bs, dv)
    per_seq = h * n * bs * (dk + dv) * keys.dtype.size
    chunk = max(1, GATHER_CHUNK_BYTES // per_seq)
    outs = []
    for j, lo in enumerate(range(0, b, chunk)):
        hi = min(b, lo + chunk)
        with mx.stream(
            streams[j % len(streams)] if streams else mx.default_stream(mx.default_device())
        ):
            r = rows[lo * h : hi * h]
            k = k_rows[r].reshape(hi - lo, h, n * bs, dk)
            v = v_rows[r].reshape(hi - lo, h, n * bs, dv)
            m = mask if mask is None or isinstance(mask, str) or len(mask) == 1 else mask[lo:hi]
            outs.append(
                mx.fast.scaled_dot_product_attention(queries[lo:hi], k, v, scale=scale, mask=m)
            )
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


# Queries a sequence up to which attention reads the pool blocks like a decode (one query) does:
# a speculative decode verifies its last token and up to 16 drafts. Longer chunks are prefill.
# (Batch 8 of a 110M llama at context 400: 2 queries a sequence took 222 ms through the prefill
# path, which gathers every context whole and syncs each layer for numpy, against 103 ms for 1.)
FEW_QUERIES = 17


def _reads_pool(
    cache: PagedLayerCache, queries: mx.array, keys: Any, values: Any, mask: Any
) -> bool:
    """Whether this call is a decode, or a decode with drafts (at most FEW_QUERIES queries a
    sequence), over exactly the K/V its cache fetched, with a mask attention from the pool
    blocks can apply."""
    batch = cache.batch
    n = queries.shape[2]
    if not 1 <= n <= FEW_QUERIES or not _over_fetched(cache, queries, keys, values):
        return False
    if mask is None or isinstance(mask, str):
        return mask in (None, "causal")
    return (
        mask.ndim == 4 and mask.shape[1:] == (1, n, batch.key_len) and len(mask) in (1, batch.size)
    )


def _over_fetched(cache: PagedLayerCache, queries: mx.array, keys: Any, values: Any) -> bool:
    """Whether the call computes the batch's queries over exactly the K/V its cache fetched
    (else the model changed the keys after fetching them: attention must use what it passes)."""
    fetched = cache.fetched()
    return (
        fetched is not None
        and keys is fetched[0]
        and values is fetched[1]
        and cache.batch.query_len == queries.shape[2]
    )


def paged_sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """Drop-in for ``mlx_lm.models.base.scaled_dot_product_attention``."""
    if not isinstance(cache, PagedLayerCache) or sinks is not None or not cache.block_attention:
        return _ORIGINAL_SDPA(
            queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
        )
    if gpu_attention.active():
        return _gpu_sdpa(queries, keys, values, cache, scale, mask)
    if _reads_pool(cache, queries, keys, values, mask):
        pool_k, pool_v = cache.pool.layer_arrays(cache.layer)
        heads, batch = pool_k.shape[0], cache.batch
        if cache.decode_kernel and cpu_decode.supports(queries, pool_k, pool_v):
            known, window = _kernel_window(batch, mask, queries.shape[2])
            if known:
                return cpu_decode.paged_decode_attention(
                    queries,
                    pool_k,
                    pool_v,
                    batch.tables_np,
                    batch.ends,
                    scale,
                    window,
                    batch.query_lens,
                )
        rows = batch.block_rows(heads, pool_k.shape[1])
        decode = queries.shape[2] == 1
        if decode and isinstance(mask, str):
            mask = None  # one query attends to its whole context
        if decode and cache.block_decode:
            row_mask = None if mask is None else batch.row_mask(mask, heads)
            return block_table_attention(
                queries, pool_k, pool_v, rows, scale, row_mask, cache.attention_streams
            )
        return gathered_attention(
            queries, pool_k, pool_v, rows, scale, mask, cache.attention_streams
        )
    if cpu_attention.servable(queries, keys, mask):  # a prefill chunk on the CPU
        return cpu_attention.prefill_attention(queries, keys, values, scale, mask)
    return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _gpu_sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: PagedLayerCache,
    scale: float,
    mask: Any,
) -> mx.array:
    """On an NVIDIA GPU: decodes (and decodes with drafts) through the block-table kernel
    (``worker.model.gpu_attention``); every call it cannot serve, prefill included, takes
    mlx-lm's own path over the gathered K/V, as it did before the kernel existed."""
    if cache.block_decode and _reads_pool(cache, queries, keys, values, mask):
        batch = cache.batch
        known, window = _kernel_window(batch, mask, queries.shape[2])
        pool_k, pool_v = cache.pool.layer_arrays(cache.layer)
        if known and gpu_attention.supports(queries, pool_k, pool_v):
            tables, ends, query_lens = batch.kernel_inputs()
            cache.served = True
            return gpu_attention.paged_decode_attention(
                queries, pool_k, pool_v, tables, ends, scale, window, query_lens
            )
        if cache.stand_ins:  # the fetched K/V stand in for the context: gather it now
            keys, values = cache.gather()
            cache.served = True
    if queries.shape[2] > FEW_QUERIES:
        out = _gpu_prefill(queries, keys, values, cache, scale, mask)
        if out is not None:
            return out
        if _exact_contexts_express(cache.batch, queries, keys, mask):
            return exact_context_attention(queries, keys, values, cache.batch, scale)
    return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask)


def _gpu_prefill(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: PagedLayerCache,
    scale: float,
    mask: Any,
) -> mx.array | None:
    """A prefill chunk through the block-table prefill kernel (``worker.model.gpu_prefill``),
    or None to leave it to cuDNN over the gathered context: where the kernel does not serve
    the call (its dtypes and head dims; keys the model changed after fetching them; a mask it
    cannot rebuild), or, for a windowless layer, where every cuDNN call the forward would make
    has a shape that recurred (``gpu_prefill.ShapeHistory``), decided once per forward at its
    first windowless layer. Sliding-window layers always take the kernel: cuDNN would need
    the array mask there (7-11x its causal kernel)."""
    batch = cache.batch
    if not gpu_prefill.active() or not _over_fetched(cache, queries, keys, values):
        return None
    known, window = _kernel_window(batch, mask, queries.shape[2])
    pool_k, pool_v = cache.pool.layer_arrays(cache.layer)
    if not known or not gpu_prefill.supports(queries, pool_k, pool_v):
        return None
    if window is None:  # (a windowed layer has no cuDNN path without an array mask)
        if batch.prefill_kernel is None:
            cudnn = isinstance(mask, str) or _exact_contexts_express(batch, queries, keys, mask)
            batch.prefill_kernel = not (
                cudnn and gpu_prefill.HISTORY.recurring(cudnn_shapes(batch, queries, keys, mask))
            )
        if not batch.prefill_kernel:
            return None
    tables, ends, query_lens = batch.kernel_inputs()
    return gpu_prefill.paged_prefill_attention(
        queries, pool_k, pool_v, tables, ends, scale, window, query_lens
    )


def cudnn_shapes(
    batch: ForwardBatch, queries: mx.array, keys: mx.array, mask: Any
) -> list[tuple[int | str, ...]]:
    """The (batch, query heads, queries, KV heads, keys, keys allocated, head dim, dtype) of
    each SDPA call that the gather-then-cuDNN path makes for this forward: one over the whole
    gathered context under a string mask, else one per context group of
    :func:`exact_context_attention` (cuDNN keys its graphs on shapes and strides)."""
    _, hq, n, d = queries.shape
    hk, whole = keys.shape[1], keys.shape[2]
    tag = (hq, hk, d, str(queries.dtype))
    if isinstance(mask, str):
        return [(batch.size, n, whole, whole, *tag)]
    return [(size, q, end, whole, *tag) for size, q, end in _exact_calls(batch, whole)]


def _exact_calls(batch: ForwardBatch, whole_keys: int) -> list[tuple[int, int, int]]:
    """(sequences, queries, keys) of each call :func:`exact_context_attention` makes, group by
    group: a first chunk's queries and keys run to the end of its last block."""
    calls = []
    for g in batch.context_groups().groups:
        size = batch.size if g.members is None else g.members.shape[0]
        end = g.end
        if 1 < g.queries == g.end:
            end = min(-(-g.end // batch.block_size) * batch.block_size, whole_keys)
        calls.append((size, g.queries + end - g.end, end))
    return calls


def _exact_contexts_express(batch: ForwardBatch, queries: mx.array, keys: Any, mask: Any) -> bool:
    """Whether ``mask`` is the batch's own windowless array mask over the gathered context
    ``keys`` ``[B, heads, key_len, dim]``, so :func:`exact_context_attention` computes the
    same attention without it."""
    if not isinstance(mask, mx.array) or mask.ndim != 4 or queries.ndim != 4:
        return False
    known, window = batch.mask_window(mask)
    return (
        known
        and window is None
        and queries.shape[0] == keys.shape[0] == batch.size
        and queries.shape[2] == batch.query_len
        and keys.shape[2] == batch.key_len
    )


def exact_context_attention(
    queries: mx.array, keys: mx.array, values: mx.array, batch: ForwardBatch, scale: float
) -> mx.array:
    """Attention of a batch's queries over its gathered context without an array mask: one
    ``"causal"`` (bottom-right) SDPA per group of sequences with the same number of queries
    and context length, over exactly that context (``ForwardBatch.context_groups``).

    ``ForwardBatch.mask`` needs an array wherever a context ends inside a block or sequences
    differ, and on an NVIDIA GPU MLX's SDPA under an array mask took 7-11x the fused causal
    kernel (H100, fp16: a 2,048-token chunk over a 30k prefix 11.6 ms a layer against 1.3;
    ``bench/gpu/prefill_attention.py``). Real rows get what SDPA under the mask gives; rows
    past a sequence's queries (padding, whose K/V go to the trash block and which nothing
    reads) get its last real row's output, finite as under the mask.

    A prompt's first chunk (several queries from position 0) attends over its whole last
    block, with as many zero queries appended as the block has slots past its context:
    bottom-right alignment puts the real queries at their own positions, so they never see
    those slots, and the appended ones are dropped. Its shape is then one per block count,
    not one per prompt length, and cuDNN builds a graph per shape on first use (~60 ms on an
    H100). Later chunks keep their exact length: their shape depends on where they start
    anyway, and padding every group so cost up to a third more a layer on the H100 (32
    requests' 40 tokens over a shared 8k prefix: 1.25 against 1.0 ms; the padded rows break
    the kernel's query tiles)."""
    n = queries.shape[2]
    whole_keys = keys.shape[2]
    plan = batch.context_groups()
    outs = []
    for g, (_, _, end) in zip(plan.groups, _exact_calls(batch, whole_keys), strict=True):
        q, k, v = queries, keys, values
        if g.members is not None:
            q, k, v = q[g.members], k[g.members], v[g.members]
        q = q[:, :, : g.queries]
        if end > g.end:  # a first chunk (one query: MLX's vector kernel, no graph)
            q = mx.pad(q, [(0, 0), (0, 0), (0, end - g.end), (0, 0)])
        if end < whole_keys:
            k, v = k[:, :, :end], v[:, :, :end]
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        if end > g.end:
            out = out[:, :, : g.queries]
        if g.queries < n:
            last = out[:, :, g.queries - 1 : g.queries]
            pad = mx.broadcast_to(last, (*last.shape[:2], n - g.queries, last.shape[3]))
            out = mx.concatenate([out, pad], axis=2)
        outs.append(out)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return out if plan.inverse is None else out[plan.inverse]


def _kernel_window(batch: ForwardBatch, mask: Any, n: int) -> tuple[bool, int | None]:
    """Whether a kernel that computes masks from positions reproduces ``mask`` exactly, and
    with which sliding window: no mask for one query, ``"causal"`` (the batch's keys are each
    sequence's context), or an array this batch built (``ForwardBatch.mask``)."""
    if mask is None:
        return n == 1, None
    if isinstance(mask, str):
        return mask == "causal", None
    return batch.mask_window(mask)


def install(model: nn.Module) -> int:
    """Route ``model``'s attention through :func:`paged_sdpa`; returns modules patched.

    Idempotent, and harmless for other caches in the process: :func:`paged_sdpa` forwards
    anything that is not a paged decode to the original function.
    """
    patched = 0
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "scaled_dot_product_attention", None) is (
            _ORIGINAL_SDPA
        ):
            module.scaled_dot_product_attention = paged_sdpa  # type: ignore[attr-defined]
            patched += 1
    return patched
