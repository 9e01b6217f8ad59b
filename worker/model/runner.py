"""Runs one batched forward of an mlx-lm model on the paged pool.

The engine calls :meth:`ModelRunner.forward` once per step with every scheduled sequence
(prefill chunks and decodes mixed) and samples from the last-position logits it returns. The
runner builds the batch metadata once on the host, hands every layer a cache view over it, and
evaluates the pool together with the logits so the writes land in place and no graph survives
the step. All calls come from the one thread that owns the model.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from worker.errors import BatchError, PoolConfigError
from worker.model import block_attention as block_attention_hook
from worker.model import compiled_decode, cpu_decode, cpu_math, gpu_attention, mlx_fixes
from worker.model.compiled_decode import CompiledDecode
from worker.model.forward_batch import ForwardBatch, SeqInput
from worker.model.kv_pool import DEFAULT_BLOCK_SIZE, KVPool
from worker.model.paged_cache import PagedLayerCache
from worker.model.spec import ModelSpec, probe

log = logging.getLogger(__name__)


class ModelRunner:
    """An mlx-lm model and its KV pool, one forward at a time.

    ``block_attention`` (default: on the CPU device, and on an NVIDIA GPU unless
    ``KVSERVE_CUDA_ATTENTION=0``) serves decode attention straight from the pool blocks
    (``worker.model.block_attention``), on the CPU split over ``attention_streams`` MLX CPU
    streams (default: one per available core, at most 8), on the GPU with a block-table kernel
    (``worker.model.gpu_attention``); off, every forward gathers K/V and runs SDPA (the
    reference path). All match mlx-lm's dense ``KVCache`` path.

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
            block_attention = mx.default_device() == mx.cpu or gpu_attention.active()
        self.block_attention = block_attention
        self.block_decode = block_attention
        """Whether decodes read blocks where they lie (else gather, then SDPA); see
        :meth:`choose_decode_attention`."""
        self.decode_kernel = False
        """On the CPU: whether decodes go to the compiled kernel (``worker.model.cpu_decode``),
        which reads blocks where they lie; set by :meth:`choose_decode_attention`."""
        self._streams: tuple[mx.Stream, ...] = ()
        # Kernel-served forwards skip building the per-layer gather (PagedLayerCache.stand_ins)
        # until a model shows it needs it.
        self._stand_ins = True
        self.compile_decodes = compiled_decode.enabled() and not self.spec.int_offsets
        """Whether decodes the GPU kernel serves run compiled (``worker.model.
        compiled_decode``); off for good once a model shows it cannot be traced."""
        self._compiled: CompiledDecode | None = None
        if mx.default_device() == mx.cpu:
            cpu_math.install(model)  # MLX's CPU exp is ~5x slower than its multiplies
        mlx_fixes.install()  # kernels a device computes wrong (CUDA: sorted gather_mm)
        if block_attention:
            block_attention_hook.install(model)
            if not gpu_attention.active():  # the CPU path splits attention over streams
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

    kind = "paged"

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def bytes_per_block(self) -> int:
        """Memory one pool block holds: K and V of every layer."""
        return self.pool.bytes_per_block

    def describe(self) -> str:
        return "runner: paged"

    def retain(self, keys: Collection[int]) -> None:
        """Nothing to drop: a sequence's K/V lives in leased blocks, which the cache service
        frees, not in the runner."""

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Apply copy-on-write pairs ``(src, dst)`` of new leases, before their first forward."""
        self.pool.copy_blocks(pairs)

    def forward(self, seqs: Sequence[SeqInput]) -> mx.array:
        """Run ``seqs`` as one batch; return evaluated fp32 logits ``[B, vocab]`` at each
        sequence's last new token."""
        groups = self._groups(seqs)
        if len(groups) > 1:
            parts = [self.forward([seqs[i] for i in g]) for g in groups]
            order = [i for g in groups for i in g]
            inverse = sorted(range(len(order)), key=order.__getitem__)
            return mx.concatenate(parts)[mx.array(inverse)]
        last = self._last_logits(seqs)
        mx.eval(last, *self.pool.arrays())
        return last

    def forward_async(self, seqs: Sequence[SeqInput], tokens: mx.array | None = None) -> mx.array:
        """Like :meth:`forward`, but the evaluation is started, not awaited: the logits come
        back lazy, computing. ``tokens`` (``[B]``, lazy ids: one decode token a sequence)
        replace the ``token_ids`` of ``seqs`` (then placeholders, unchecked): a forward built
        on a step's sampled tokens before they are known (``ModelExecutor``'s lookahead)."""
        if len(self._groups(seqs)) > 1:
            if tokens is not None:
                raise BatchError("a forward on lazy tokens runs as one group")
            return self.forward(seqs)
        last = self._last_logits(seqs, tokens)
        mx.async_eval(last, *self.pool.arrays())
        return last

    def _last_logits(self, seqs: Sequence[SeqInput], tokens: mx.array | None = None) -> mx.array:
        """One group's forward, lazy: fp32 logits at each sequence's last new token."""
        if self._compiles(seqs):
            logits = self._run_compiled(seqs, tokens)
            if logits is not None:
                return logits
        batch, logits = self._run(seqs, tokens)
        return logits[mx.arange(batch.size), batch.last_index].astype(mx.float32)

    @property
    def compiled_decode(self) -> CompiledDecode | None:
        """The compiled decode forward, once a decode took it (None: none has yet, or the
        model cannot be traced)."""
        return self._compiled if self.compile_decodes else None

    def _decodes_compile(self) -> bool:
        """Whether decodes run compiled: every layer's attention served by the GPU
        block-table kernel (``worker.model.compiled_decode``), the model traceable so far."""
        return (
            self.compile_decodes
            and self._stand_ins
            and self.block_decode
            and gpu_attention.active()
        )

    def _compiles(self, seqs: Sequence[SeqInput]) -> bool:
        """Whether this forward runs compiled: decodes only, where decodes compile."""
        return all(len(s.token_ids) == 1 for s in seqs) and self._decodes_compile()

    def _run_compiled(self, seqs: Sequence[SeqInput], tokens: mx.array | None) -> mx.array | None:
        """The decode forward through the compiled graph; None where the model cannot be
        traced (then every later forward runs uncompiled)."""
        if tokens is None:
            self._check_tokens(seqs)
        pool = self.pool
        blocks = max(-(-s.end // pool.block_size) for s in seqs)
        batch = ForwardBatch(
            seqs,
            pool.block_size,
            pool.num_blocks,
            self.spec.mask_rank,
            key_blocks=compiled_decode.bucket_blocks(blocks),
            rows=compiled_decode.bucket_rows(len(seqs)),
        )
        if tokens is not None:  # sampled from this model's logits: in its vocabulary
            if tokens.shape != (len(seqs),):
                raise BatchError("lazy tokens stand for one decode token a sequence")
            pad = mx.zeros((batch.size - len(seqs),), dtype=mx.int32)
            batch.tokens = mx.concatenate([tokens.astype(mx.int32), pad]).reshape(-1, 1)
        try:
            return self._compiled_forward()(batch)
        except Exception as err:  # raised while tracing: nothing was evaluated or written
            self._no_compiling(err)
            return None

    def _no_compiling(self, err: Exception) -> None:
        log.warning(
            "this model's decode forward cannot be compiled (%s: %s): it decodes uncompiled",
            type(err).__name__,
            err,
        )
        self.compile_decodes = False

    def _compiled_forward(self) -> CompiledDecode:
        if self._compiled is None:
            self._compiled = CompiledDecode(
                self.model,
                self.pool,
                lambda b: self._layer_caches(b, stand_ins=True),
                self.spec.mask_rank,
            )
        return self._compiled

    def prepare_compiled_decodes(self, max_batch_size: int, max_context: int, most: int = 0) -> int:
        """Trace the compiled decode (``worker.model.compiled_decode``) of every batch bucket
        up to ``max_batch_size`` over every table-width bucket up to ``max_context`` tokens,
        narrowest first, at most ``most`` shapes (0: :data:`MAX_PREPARED_SHAPES`): at start,
        not on the first request of each shape. Builds graphs only (no forward runs).
        Returns the shapes traced; 0 where decodes do not run compiled."""
        shapes = self.compiled_decode_shapes(max_batch_size, max_context, most)
        for shape in shapes:
            if not self.prepare_compiled_decode(shape):
                return 0
        return len(shapes)

    def compiled_decode_shapes(
        self, max_batch_size: int, max_context: int, most: int = 0
    ) -> list[tuple[int, int]]:
        """The (rows, table width) buckets :meth:`prepare_compiled_decodes` traces, narrowest
        first; [] where decodes do not run compiled. The background warm-up traces them one
        call each, so a request waits for at most one trace."""
        if not self._decodes_compile():
            return []
        rows = compiled_decode.buckets(max_batch_size, compiled_decode.bucket_rows)
        widths = compiled_decode.buckets(
            -(-max_context // self.pool.block_size), compiled_decode.bucket_blocks
        )
        return [(r, w) for w in widths for r in rows][: most or MAX_PREPARED_SHAPES]

    def prepare_compiled_decode(self, shape: tuple[int, int]) -> bool:
        """Trace one bucket's compiled decode; False (decodes run uncompiled from now on) for a
        model that cannot be traced."""
        if not self._decodes_compile():
            return False
        try:
            self._compiled_forward().prepare(*shape)
        except Exception as err:  # the model cannot be traced: it decodes uncompiled
            self._no_compiling(err)
            return False
        return True

    def forward_all(self, seqs: Sequence[SeqInput]) -> list[mx.array]:
        """Like :meth:`forward`, but fp32 logits ``[len(token_ids), vocab]`` at every position."""
        groups = self._groups(seqs)
        if len(groups) > 1:
            out: list[mx.array] = [mx.array(0)] * len(seqs)
            for g in groups:
                for i, logits in zip(g, self.forward_all([seqs[i] for i in g]), strict=True):
                    out[i] = logits
            return out
        if self._compiles(seqs):  # decodes only: one position each
            last = self._run_compiled(seqs, None)
            if last is not None:
                mx.eval(last, *self.pool.arrays())
                return [last[i : i + 1] for i in range(len(seqs))]
        batch, all_logits = self._run(seqs)
        all_logits = all_logits.astype(mx.float32)
        mx.eval(all_logits, *self.pool.arrays())
        return [all_logits[i, : int(n)] for i, n in enumerate(batch.query_lens)]

    def choose_decode_attention(
        self, batch: int = 32, context: int = 1024, repeats: int = 7
    ) -> DecodeChoice:
        """Times one layer's decode attention every way on this machine and keeps the fastest.

        Block-table attention (``mx.gather_mm``) is one small GEMM per (sequence, head, block):
        with a single-threaded BLAS it matches a dense cache, but a multithreaded one (BLIS
        ``-mt``, which the BLAS choice takes on AMD CPUs) pays a thread hand-off per GEMM, and
        there gathering the blocks a few sequences at a time and running SDPA on them
        (``block_attention.gathered_attention``) was faster. The BLAS is chosen at
        start by measurement (``kvserve_model.blas``); so is this, at a decode shape of
        ``batch`` sequences of ``context`` tokens with the model's heads (fewer where the pool
        is smaller), and gathers only where that is more than 10% faster. The compiled kernel
        (``worker.model.cpu_decode``, where numba imports and the pool is fp32) reads blocks
        in place without either cost, and is taken where it is more than 10% faster than the
        better of the two (batch 32 x 1,024 below: 366 ms a step). Off the CPU path
        (``block_attention`` off) decodes always gather; on an NVIDIA GPU they take the
        block-table kernel (``worker.model.gpu_attention``), unmeasured.

        Measured at the CPU's default batch, where decode throughput is decided (2-core AMD
        EPYC, AOCL-BLIS-mt, 110M llama, context 1,024, whole decode steps, glibc keeping freed
        memory: ``kvserve_model.blas.MALLOC_TUNABLES``): batch 32 601 ms gathered against 841 by
        blocks; batch 8 193 against 261."""
        if not self.block_attention:
            return DecodeChoice("gather", 0.0, 0.0)
        if gpu_attention.active():
            return DecodeChoice("block-table kernel (CUDA)", 0.0, 0.0)
        k, v = self.pool.layer_arrays(0)
        heads, per_head, bs, dim = k.shape
        n = max(1, min(context // bs, (per_head - 1) // batch))
        batch = max(1, min(batch, (per_head - 1) // n))
        rep = max(
            1, getattr(getattr(self.model, "args", None), "num_attention_heads", heads) // heads
        )
        q = mx.random.normal((batch, heads * rep, 1, dim), key=mx.random.key(0)).astype(k.dtype)
        order = np.random.default_rng(0).permutation(per_head - 1)[: batch * n].tolist()
        decodes = [SeqInput([0], order[i * n : (i + 1) * n], n * bs - 1) for i in range(batch)]
        rows = ForwardBatch(decodes, bs, self.pool.num_blocks).block_rows(heads, per_head)
        scale = dim**-0.5

        def blocks() -> mx.array:
            return block_attention_hook.block_table_attention(
                q, k, v, rows, scale, None, self._streams
            )

        def gather() -> mx.array:
            return block_attention_hook.gathered_attention(
                q, k, v, rows, scale, None, self._streams
            )

        tables = np.array([d.block_table for d in decodes], dtype=np.int32)
        ends = np.full(batch, n * bs, dtype=np.int64)

        def kernel() -> mx.array:
            return cpu_decode.paged_decode_attention(q, k, v, tables, ends, scale)

        ways = {"blocks": blocks, "gather": gather}
        if cpu_decode.available() and cpu_decode.supports(q, k, v):
            try:  # compiles it (or loads it from the cache): a failure only leaves it out
                mx.eval(kernel())
                ways["kernel"] = kernel
            except Exception:
                log.warning("the compiled CPU decode kernel failed: not used", exc_info=True)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(repeats + 1):  # the first round warms them up (and compiles the kernel)
            for name, f in ways.items():
                start = time.perf_counter()
                mx.eval(f())
                times[name].append(time.perf_counter() - start)
        took = {name: statistics.median(t[1:]) for name, t in times.items()}
        # Block-table attention is the measured default; another path must be clearly faster.
        self.block_decode = took["gather"] > GATHER_MARGIN * took["blocks"]
        best = took["blocks"] if self.block_decode else took["gather"]
        self.decode_kernel = "kernel" in took and took["kernel"] < GATHER_MARGIN * best
        path = "kernel" if self.decode_kernel else "blocks" if self.block_decode else "gather"
        return DecodeChoice(path, took["blocks"], took["gather"], took.get("kernel", 0.0))

    def _groups(self, seqs: Sequence[SeqInput]) -> list[list[int]]:
        """The forwards ``seqs`` run in: one, unless the model needs an int offset
        (``ModelSpec.int_offsets``) and the sequences start at different positions; then one
        per starting position (correct, and as slow as unbatched decoding)."""
        if not self.spec.int_offsets or len({s.start for s in seqs}) <= 1:
            return [list(range(len(seqs)))]
        by_start: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            by_start.setdefault(s.start, []).append(i)
        return list(by_start.values())

    def _run(
        self, seqs: Sequence[SeqInput], tokens: mx.array | None = None
    ) -> tuple[ForwardBatch, mx.array]:
        if tokens is None:
            self._check_tokens(seqs)
        batch = ForwardBatch(seqs, self.pool.block_size, self.pool.num_blocks, self.spec.mask_rank)
        if tokens is not None:  # sampled from this model's logits: in its vocabulary
            if batch.query_len != 1 or tokens.shape != (batch.size,):
                raise BatchError("lazy tokens stand for one decode token a sequence")
            batch.tokens = tokens.reshape(batch.size, 1).astype(mx.int32)
        stand_ins = (
            self._stand_ins
            and self.block_decode
            and batch.query_len <= block_attention_hook.FEW_QUERIES
            and gpu_attention.active()
        )
        caches = self._layer_caches(batch, stand_ins)
        if not stand_ins:
            return batch, self.model(batch.tokens, cache=caches)
        try:
            logits = self.model(batch.tokens, cache=caches)
            served = all(c.served for c in caches if c.fetched() is not None)
        except Exception:  # shapes that do not line up with the stand-ins, raised eagerly
            served = False
        if not served:
            # Some layer attended over the stand-ins itself (its attention changes the fetched
            # K/V, or is not mlx-lm's): nothing is evaluated yet, so build the forward again,
            # gathering, and for good. Its writes land once more on the same slots, last.
            log.warning(
                "this model's attention does not hand the fetched K/V to attention unchanged: "
                "its GPU decodes build the gathered context too"
            )
            self._stand_ins = False
            return self._run(seqs, tokens)
        return batch, logits

    def _layer_caches(self, batch: ForwardBatch, stand_ins: bool) -> list[PagedLayerCache]:
        """Every layer's cache view of ``batch`` for one forward."""
        return [
            PagedLayerCache(
                batch,
                self.pool,
                layer,
                self.block_attention,
                self._streams,
                self.block_decode,
                stand_ins,
                self.decode_kernel,
            )
            for layer in range(self.pool.num_layers)
        ]

    def _check_tokens(self, seqs: Sequence[SeqInput]) -> None:
        vocab = self.spec.vocab_size
        for i, s in enumerate(seqs):
            if min(s.token_ids) < 0 or max(s.token_ids) >= vocab:
                raise BatchError(f"sequence {i}: token ids outside 0..{vocab - 1}")


GATHER_MARGIN = 0.9

# Compiled decode shapes the warm-up traces at most (each ~one uncompiled forward's host time).
MAX_PREPARED_SHAPES = 128


@dataclass(frozen=True, slots=True)
class DecodeChoice:
    """What :meth:`ModelRunner.choose_decode_attention` measured and chose."""

    path: str  # "blocks", "gather" or "kernel"
    blocks_s: float
    gather_s: float
    kernel_s: float = 0.0  # 0: the compiled kernel was not a candidate

    def describe(self) -> str:
        if not self.blocks_s:
            return f"decode attention: {self.path}"
        kernel = f", compiled kernel {self.kernel_s * 1e3:.1f} ms" if self.kernel_s else ""
        return (
            f"decode attention: {self.path} (one layer at a batch-32 decode: blocks "
            f"{self.blocks_s * 1e3:.1f} ms, gather + SDPA {self.gather_s * 1e3:.1f} ms{kernel})"
        )


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
