"""Runs one batched forward of an mlx-lm model on the paged pool.

The engine calls :meth:`ModelRunner.forward` once per step with every scheduled sequence
(prefill chunks and decodes mixed) and samples from the last-position logits it returns. The
runner builds the batch metadata once on the host, hands every layer a cache view over it, and
evaluates the pool together with the logits so the writes land in place and no graph survives
the step. All calls come from the one thread that owns the model.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from worker import block_attention as block_attention_hook
from worker.errors import BatchError, PoolConfigError
from worker.forward_batch import ForwardBatch, SeqInput
from worker.kv_pool import DEFAULT_BLOCK_SIZE, KVPool
from worker.model_spec import ModelSpec, probe
from worker.paged_cache import PagedLayerCache


class ModelRunner:
    """An mlx-lm model and its KV pool, one forward at a time.

    ``block_attention`` (default: on the CPU device) serves decode attention straight from the
    pool blocks (``worker.block_attention``), split over ``attention_streams`` MLX CPU streams
    (default: one per available core, at most 8); off, every forward gathers K/V and runs SDPA
    (the reference path). Both match mlx-lm's dense ``KVCache`` path.

    MLX streams belong to the thread that creates them: build the runner on the thread that
    will call :meth:`forward`.
    """

    def __init__(
        self,
        model: nn.Module,
        pool: KVPool,
        spec: ModelSpec | None = None,
        *,
        block_attention: bool | None = None,
        attention_streams: int | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.spec = spec or probe(model)
        if len(self.spec.layers) != pool.num_layers:
            raise PoolConfigError(
                f"pool has {pool.num_layers} layers, model {len(self.spec.layers)}"
            )
        if block_attention is None:
            block_attention = mx.default_device() == mx.cpu
        self.block_attention = block_attention
        self._streams: tuple[mx.Stream, ...] = ()
        if block_attention:
            block_attention_hook.install(model)
            self._streams = _streams(attention_streams or min(8, _cores()))

    @classmethod
    def create(
        cls,
        model: nn.Module,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        block_attention: bool | None = None,
        attention_streams: int | None = None,
    ) -> ModelRunner:
        """Probe ``model`` and build its pool by block count or memory budget."""
        spec = probe(model)
        pool = KVPool.for_model(
            spec, block_size=block_size, num_blocks=num_blocks, memory_bytes=memory_bytes
        )
        return cls(
            model,
            pool,
            spec,
            block_attention=block_attention,
            attention_streams=attention_streams,
        )

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Apply copy-on-write pairs ``(src, dst)`` of new leases, before their first forward."""
        self.pool.copy_blocks(pairs)

    def forward(self, seqs: Sequence[SeqInput]) -> mx.array:
        """Run ``seqs`` as one batch; return evaluated fp32 logits ``[B, vocab]`` at each
        sequence's last new token."""
        batch, logits = self._run(seqs)
        rows = mx.arange(batch.size)
        last = logits[rows, batch.last_index].astype(mx.float32)
        mx.eval(last, *self.pool.arrays())
        return last

    def forward_all(self, seqs: Sequence[SeqInput]) -> list[mx.array]:
        """Like :meth:`forward`, but fp32 logits ``[len(token_ids), vocab]`` at every position."""
        batch, logits = self._run(seqs)
        logits = logits.astype(mx.float32)
        mx.eval(logits, *self.pool.arrays())
        return [logits[i, : int(n)] for i, n in enumerate(batch.query_lens)]

    def _run(self, seqs: Sequence[SeqInput]) -> tuple[ForwardBatch, mx.array]:
        self._check_tokens(seqs)
        batch = ForwardBatch(seqs, self.pool.block_size, self.pool.num_blocks, self.spec.mask_rank)
        caches = [
            PagedLayerCache(batch, self.pool, layer, self.block_attention, self._streams)
            for layer in range(self.pool.num_layers)
        ]
        return batch, self.model(batch.tokens, cache=caches)

    def _check_tokens(self, seqs: Sequence[SeqInput]) -> None:
        vocab = self.spec.vocab_size
        for i, s in enumerate(seqs):
            if min(s.token_ids) < 0 or max(s.token_ids) >= vocab:
                raise BatchError(f"sequence {i}: token ids outside 0..{vocab - 1}")


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; macOS has only cpu_count
    return len(affinity(0)) if affinity else os.cpu_count() or 1


@functools.cache
def _streams_of_thread(thread: int, count: int) -> tuple[mx.Stream, ...]:
    del thread  # part of the cache key only
    device = mx.default_device()
    extra = [mx.new_stream(device) for _ in range(count - 1)]
    return (mx.default_stream(device), *extra)


def _streams(count: int) -> tuple[mx.Stream, ...]:
    """``count`` streams of the default device for this thread (the first is its default one).

    Each MLX stream owns a thread and belongs to the thread that made it, so they are made once
    per calling thread and count, however many runners a process (or a test session) builds.
    """
    return _streams_of_thread(threading.get_ident(), count) if count > 1 else ()
