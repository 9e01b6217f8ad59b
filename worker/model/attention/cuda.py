"""The NVIDIA GPU's attention backend (MLX's CUDA backend): block-table kernels that read the
pool where it lies.

- Decodes (and decodes with drafts) go to the split-K decode kernel (``attention.gpu_decode``,
  source ``paged_decode.cu``).
- Prefill chunks go to the tensor-core prefill kernel (``attention.gpu_prefill``, source
  ``paged_prefill.cu``), or, where every cuDNN call the forward would make has a shape seen
  before (:class:`~worker.model.attention.gpu_prefill.ShapeHistory`), to cuDNN's fused causal
  attention over the gathered context without an array mask (:func:`exact_context_attention`,
  7-11x faster than SDPA under an array mask there); sliding-window layers always take the
  kernel (cuDNN would need the array mask).
- What neither serves (dtypes and head dims the kernels do not take, keys a model changed after
  fetching them, masks they cannot rebuild) takes the reference path.

Decode forwards use stand-ins (``AttentionBackend.stand_ins``) and may run compiled
(``worker.model.compiled_decode``). Measurements: ``docs/gpu-attention.md``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from worker.model.attention import gpu_decode, gpu_gather, gpu_prefill
from worker.model.attention.backend import AttentionBackend, AttentionCall, Declined
from worker.model.attention.gpu_prefill import ShapeHistory
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_pool import KVPool


class CudaBackend(AttentionBackend):
    """The block-table kernels; ``prefill_kernel`` off keeps prefill on gather-then-cuDNN,
    ``compile_decodes`` off runs decode forwards uncompiled."""

    name = "cuda"
    stand_ins = True

    def __init__(self, prefill_kernel: bool = True, compile_decodes: bool = True) -> None:
        super().__init__()
        self.prefill_kernel = prefill_kernel
        self.compiles_decodes = compile_decodes
        self.history = ShapeHistory()
        """The cuDNN call shapes seen (per model thread, as MLX's graph cache is)."""

    def decode(self, call: AttentionCall) -> mx.array | Declined:
        return gpu_decode.serve(call)

    def prefill(self, call: AttentionCall) -> mx.array | Declined:
        out = self._prefill_kernel(call)
        if out is not None:
            return out
        batch, queries, keys = call.batch, call.queries, call.keys
        if _exact_contexts_express(batch, queries, keys, call.mask):
            return exact_context_attention(queries, keys, call.values, batch, call.scale)
        return Declined("a mask that is not the batch's own")

    def _prefill_kernel(self, call: AttentionCall) -> mx.array | None:
        """A prefill chunk through the block-table prefill kernel, or None to leave it to cuDNN
        over the gathered context: where the kernel does not serve the call (its dtypes and
        head dims; keys the model changed after fetching them; a mask it cannot rebuild), or,
        for a windowless layer, where every cuDNN call the forward would make has a shape that
        recurred (:attr:`history`), decided once per forward at its first windowless layer.
        Sliding-window layers always take the kernel: cuDNN would need the array mask there
        (7-11x its causal kernel)."""
        batch, queries, keys, mask = call.batch, call.queries, call.keys, call.mask
        if not self.prefill_kernel or not call.over_fetched():
            return None
        known, window = call.kernel_window()
        pool_k, pool_v = call.pool_arrays()
        if not known or not gpu_prefill.supports(queries, pool_k, pool_v):
            return None
        if window is None:  # (a windowed layer has no cuDNN path without an array mask)
            if batch.prefill_kernel is None:
                cudnn = isinstance(mask, str) or _exact_contexts_express(batch, queries, keys, mask)
                batch.prefill_kernel = not (
                    cudnn and self.history.recurring(cudnn_shapes(batch, queries, keys, mask))
                )
            if not batch.prefill_kernel:
                return None
        tables, ends, query_lens = batch.kernel_inputs()
        return gpu_prefill.paged_prefill_attention(
            queries, pool_k, pool_v, tables, ends, call.scale, window, query_lens
        )

    def gather(self, pool: KVPool, layer: int, tables: mx.array) -> tuple[mx.array, mx.array]:
        """The context through the block gather kernel where it copies this pool (16-byte rows
        on a CUDA GPU), else MLX's gather."""
        keys, values = pool.layer_arrays(layer)
        if not (gpu_gather.supported(keys) and gpu_gather.supported(values)):
            return pool.gather(layer, tables)
        flat = tables.reshape(tables.shape[0], tables.shape[2])
        return gpu_gather.gather_blocks(keys, flat), gpu_gather.gather_blocks(values, flat)

    def describe(self) -> str:
        prefill = "kernel or cuDNN" if self.prefill_kernel else "cuDNN"
        compiled = ", compiled decodes" if self.compiles_decodes else ""
        return f"attention: cuda (decodes: block-table kernel, prefill: {prefill}{compiled})"


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
