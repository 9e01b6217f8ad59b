"""Decode forwards on an NVIDIA GPU, compiled with ``mx.compile``: the model's graph is built
in Python once per shape, then replayed.

A batch-32 decode step of a ~1B model on an H100 is bound by host time, not by the device:
building the graph in Python (22 layers of mlx-lm modules, the pool writes, the kernel calls)
took 1.8-3.3 ms of a 6-10 ms forward. A compiled function replays the traced graph from C++
on every later call of the same input shapes, and fuses its elementwise operations.

What a trace may not keep is anything that changes between steps of one shape: the tokens,
positions, write slots, block tables and context lengths all enter as inputs
(:meth:`ForwardBatch.bind`), masks are computed from the context lengths, and the pool's K/V
arrays come in and go out (the writes stay in place: nothing else holds the old arrays when
the graph runs). A model whose forward needs a value on the host (an int offset: ``ModelSpec.
int_offsets``; ``cache.size()``; evaluating an array) cannot be traced: the first trace raises,
the runner logs it and decodes uncompiled from then on.

Shapes are bucketed: the block tables' width to the next power of two (padded with the trash
block; the kernel reads each sequence only up to its length), so a growing context makes a new
trace at 1, 2, 4, ... blocks, not every block; the batch to 1, 2, 4, 8, then multiples of 8
(padding rows decode one token over the trash block's first slot, and their logits are
dropped). Each trace costs about one uncompiled forward's host time plus MLX's compile pass
(33-67 ms for a 22-layer model on a 2-core CPU); the worker's warm-up traces every bucket up to
its batch and context limits (``ModelRunner.prepare_compiled_decodes``).

Only where the attention backend's decodes are traceable (``AttentionBackend.compiles_decodes``:
the CUDA block-table kernel, ``worker.model.attention.cuda``): the CPU's decode attention
(stream splits, numba) is not, and its steps are bound by compute. ``--no-compile-decodes``
turns it off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from worker.model.forward_batch import ForwardBatch, SeqInput
from worker.model.kv_pool import KVPool
from worker.model.paged_cache import PagedLayerCache


def bucket_blocks(blocks: int) -> int:
    """The block tables' width a compiled decode pads ``blocks`` to: the next power of two."""
    return 1 << max(0, blocks - 1).bit_length()


def bucket_rows(rows: int) -> int:
    """The batch a compiled decode pads ``rows`` sequences to: 1, 2, 4, 8, then multiples of
    8 (on a GPU a decode's extra rows cost little device time; a new shape costs a trace)."""
    return 1 << max(0, rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8


def buckets(largest: int, bucket: Callable[[int], int]) -> list[int]:
    """Every bucket from 1 up to the one holding ``largest``."""
    out = [bucket(1)]
    while out[-1] < bucket(largest):
        out.append(bucket(out[-1] + 1))
    return out


class NotTraceable(RuntimeError):
    """The model's decode forward cannot be compiled (see the module docstring)."""


class CompiledDecode:
    """One model's compiled decode forward over one pool."""

    def __init__(
        self,
        model: nn.Module,
        pool: KVPool,
        caches: Callable[[ForwardBatch], Sequence[PagedLayerCache]],
        mask_rank: int = 4,
    ) -> None:
        """``caches`` makes a forward's per-layer cache views (the runner's settings);
        ``mask_rank``: the model's (``ModelSpec.mask_rank``)."""
        self._model = model
        self._pool = pool
        self._caches = caches
        self._mask_rank = mask_rank
        self._compiled = mx.compile(self._trace)
        self._batch: ForwardBatch | None = None  # the batch of the call being traced
        self.traces = 0
        self.calls = 0

    def __call__(self, batch: ForwardBatch) -> mx.array:
        """The decode forward of ``batch`` (one token a sequence; padding rows after its
        sequences, ``ForwardBatch.real_size``), lazy: fp32 logits ``[sequences, vocab]``; the
        pool's arrays are replaced by the written ones. Raises :class:`NotTraceable` (or what
        the trace raised) where the model cannot be traced; the pool is then as it was."""
        inputs = self._inputs(batch)
        self._batch = batch
        try:
            logits, arrays = self._compiled(self._pool.arrays(), *inputs)
        finally:
            self._batch = None
        self._pool.replace(arrays)
        self.calls += 1
        return logits if batch.real_size == batch.size else logits[: batch.real_size]

    def prepare(self, rows: int, key_blocks: int) -> None:
        """Trace the decode of ``rows`` sequences over ``key_blocks`` blocks now, so that the
        first step of that shape replays it: the graph is built, nothing is evaluated (one
        placeholder sequence on block 0, the other rows padding; the outputs are dropped and
        the pool is left as it is)."""
        pool = self._pool
        batch = ForwardBatch(
            [SeqInput([0], [0], 0)],
            pool.block_size,
            pool.num_blocks,
            self._mask_rank,
            key_blocks=key_blocks,
            rows=rows,
        )
        self._batch = batch
        try:
            self._compiled(pool.arrays(), *self._inputs(batch))
        finally:
            self._batch = None

    @staticmethod
    def _inputs(batch: ForwardBatch) -> tuple[mx.array, ...]:
        """What :meth:`ForwardBatch.bind` takes: every array of the batch a decode reads (the
        offset always as an array: an int would be baked into the trace)."""
        offset = mx.array(batch.starts.astype(np.int32))
        return (batch.tokens, offset, batch.write_blocks, batch.write_slots, *batch.kernel_inputs())

    def _trace(self, pool: list[mx.array], *inputs: mx.array) -> tuple[mx.array, list[mx.array]]:
        """What ``mx.compile`` traces: the forward on placeholders for ``pool`` and the
        batch's arrays. Runs once per shape."""
        self.traces += 1
        batch = self._batch
        if batch is None:
            raise NotTraceable("a compiled decode was called outside CompiledDecode.__call__")
        batch.bind(*inputs)
        real = self._pool.arrays()
        self._pool.replace(pool)
        try:
            batch.stand_ins = True  # the runner compiles only where the model takes them
            logits = self._model(batch.tokens, cache=self._caches(batch))
            return logits[:, -1, :].astype(mx.float32), self._pool.arrays()
        finally:
            self._pool.replace(real)
