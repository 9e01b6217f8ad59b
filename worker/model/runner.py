"""Runs one batched forward of an mlx-lm model on the paged pool.

The engine calls :meth:`ModelRunner.forward` once per step with every scheduled sequence
(prefill chunks and decodes mixed) and samples from the last-position logits it returns. The
runner builds the batch metadata once on the host, hands every layer a cache view over it, and
evaluates the pool together with the logits so the writes land in place and no graph survives
the step. All calls come from the one thread that owns the model.

Attention is the backend's (``worker.model.attention``), chosen when the runner is built. One
file: the runner's three ways to run the same forward (as one batch, split by starting position
for models that need an int offset, compiled for decodes) share its state and checks.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import mlx.core as mx
import mlx.nn as nn

from worker.errors import BatchError, PoolConfigError
from worker.model import compiled_decode, cpu_math, mlx_fixes
from worker.model.attention import (
    FEW_QUERIES,
    AttentionBackend,
    AttentionCall,
    AttentionOptions,
    DecodeChoice,
    choose_backend,
)
from worker.model.attention.seam import install as install_attention
from worker.model.compiled_decode import CompiledDecode
from worker.model.forward_batch import ForwardBatch, SeqInput
from worker.model.kv_pool import DEFAULT_BLOCK_SIZE, KVPool
from worker.model.paged_cache import PagedLayerCache
from worker.model.spec import ModelSpec, probe

log = logging.getLogger(__name__)


class ModelRunner:
    """An mlx-lm model and its KV pool, one forward at a time.

    Attention runs on one backend (``worker.model.attention``), chosen at start from
    ``attention`` (a backend, or the options to choose one by; default: the device's own):
    on the CPU decodes read the pool blocks where they lie, split over MLX CPU streams, and
    prefill chunks take numpy's softmax; on an NVIDIA GPU both take block-table kernels; the
    reference backend gathers K/V and runs SDPA for every call. All match mlx-lm's dense
    ``KVCache`` path.

    MLX streams belong to the thread that creates them: build the runner on the thread that
    will call :meth:`forward`.
    """

    def __init__(
        self,
        model: nn.Module,
        pool: KVPool,
        spec: ModelSpec | None = None,
        *,
        attention: AttentionBackend | AttentionOptions | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.spec = spec or probe(model)
        if len(self.spec.layers) != pool.num_layers:
            raise PoolConfigError(
                f"pool has {pool.num_layers} layers, model {len(self.spec.layers)}"
            )
        if not isinstance(attention, AttentionBackend):
            attention = choose_backend(attention)
        self.attention = attention
        if mx.default_device() == mx.cpu:
            cpu_math.install(model)  # MLX's CPU exp is ~5x slower than its multiplies
        mlx_fixes.install()  # kernels a device computes wrong (CUDA: sorted gather_mm)
        install_attention(model)
        attention.prepare(model, pool)
        self.stand_ins = attention.stand_ins and self._attends_over_fetched()
        """Whether decode forwards skip the per-layer gather (``ForwardBatch.stand_ins``):
        where the backend reads the pool by block table and this model hands the K/V its
        cache fetched to attention unchanged (checked once, here)."""
        self.compile_decodes = (
            attention.compiles_decodes and self.stand_ins and not self.spec.int_offsets
        )
        """Whether decodes run compiled (``worker.model.compiled_decode``); off for good once
        a model shows it cannot be traced."""
        self._compiled: CompiledDecode | None = None

    @classmethod
    def create(
        cls,
        model: nn.Module,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        attention: AttentionBackend | AttentionOptions | None = None,
    ) -> ModelRunner:
        """Probe ``model`` and build its pool by block count or memory budget."""
        spec = probe(model)
        pool = KVPool.for_model(
            spec, block_size=block_size, num_blocks=num_blocks, memory_bytes=memory_bytes
        )
        return cls(model, pool, spec, attention=attention)

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

    def forward_async(
        self, seqs: Sequence[SeqInput], tokens: mx.array | None = None, launch: bool = True
    ) -> mx.array:
        """Like :meth:`forward`, but the evaluation is started, not awaited: the logits come
        back lazy, computing. ``tokens`` (``[B]``, lazy ids: one decode token a sequence)
        replace the ``token_ids`` of ``seqs`` (then placeholders, unchecked): a forward built
        on a step's sampled tokens before they are known (``ModelExecutor``'s lookahead).
        ``launch`` False: built only; :meth:`launch` starts it (once the forward before it has
        finished: launched while that one still holds the pool's buffers, its writes copy the
        whole pool instead of writing in place)."""
        if len(self._groups(seqs)) > 1:
            if tokens is not None:
                raise BatchError("a forward on lazy tokens runs as one group")
            return self.forward(seqs)
        last = self._last_logits(seqs, tokens)
        if launch:
            self.launch(last)
        return last

    def launch(self, logits: mx.array) -> None:
        """Starts evaluating a forward :meth:`forward_async` built with ``launch=False``."""
        mx.async_eval(logits, *self.pool.arrays())

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
        """Whether decodes run compiled (``worker.model.compiled_decode``): the backend's
        decodes traceable, the model so far too."""
        return self.compile_decodes

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
                self.model, self.pool, self._layer_caches, self.spec.mask_rank
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

    def choose_decode_attention(self, **shape: int) -> DecodeChoice:
        """Let the backend measure which decode path is fastest on this machine, and keep it
        (the CPU's; other backends have one path). ``shape``: ``batch``, ``context``,
        ``repeats`` of the measurement (``CpuBackend.choose_decode``)."""
        return self.attention.choose_decode(self.model, self.pool, **shape)

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
        batch.stand_ins = self.stand_ins and batch.query_len <= FEW_QUERIES
        return batch, self.model(batch.tokens, cache=self._layer_caches(batch))

    def _layer_caches(self, batch: ForwardBatch) -> list[PagedLayerCache]:
        """Every layer's cache view of ``batch`` for one forward."""
        return [
            PagedLayerCache(batch, self.pool, layer, self.attention)
            for layer in range(self.pool.num_layers)
        ]

    def _attends_over_fetched(self) -> bool:
        """Whether every layer of this model hands the K/V its cache fetched to attention
        unchanged, so that a decode forward may fetch stand-ins for the context: one decode's
        graph is built on stand-ins (never evaluated; the pool is put back as it was) and each
        layer's attention call is checked. A model that transforms the fetched keys, or whose
        attention is not mlx-lm's function, gathers the context in every forward instead."""
        pool = self.pool
        batch = ForwardBatch([SeqInput([0], [0], 0)], pool.block_size, pool.num_blocks)
        batch.stand_ins = True
        probe = _FetchProbe(self.attention)
        caches = [PagedLayerCache(batch, pool, layer, probe) for layer in range(pool.num_layers)]
        saved = pool.arrays()
        try:
            self.model(batch.tokens, cache=caches)
            ok = all(c.layer in probe.layers for c in caches if c.fetched() is not None)
        except Exception:  # shapes that do not line up with the stand-ins, raised eagerly
            ok = False
        finally:
            pool.replace(saved)
        if not ok:
            log.warning(
                "this model's attention does not take the fetched K/V unchanged: its decodes "
                "gather the context in every forward"
            )
        return ok

    def _check_tokens(self, seqs: Sequence[SeqInput]) -> None:
        vocab = self.spec.vocab_size
        for i, s in enumerate(seqs):
            if min(s.token_ids) < 0 or max(s.token_ids) >= vocab:
                raise BatchError(f"sequence {i}: token ids outside 0..{vocab - 1}")


# Compiled decode shapes the warm-up traces at most (each ~one uncompiled forward's host time).
MAX_PREPARED_SHAPES = 128


class _FetchProbe(AttentionBackend):
    """Wraps a backend for :meth:`ModelRunner._attends_over_fetched`: notes each layer whose
    attention call came with the K/V its cache fetched."""

    def __init__(self, inner: AttentionBackend) -> None:
        super().__init__()
        self.inner = inner
        self.layers: set[int] = set()

    def attend(self, call: AttentionCall) -> mx.array:
        if call.over_fetched():
            self.layers.add(call.cache.layer)
        return self.inner.attend(call)

    def gather(self, pool: KVPool, layer: int, tables: mx.array) -> tuple[mx.array, mx.array]:
        return self.inner.gather(pool, layer, tables)
