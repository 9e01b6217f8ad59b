"""The CPU's attention backend: decodes from the pool blocks where they lie, prefill chunks
with their softmax in numpy.

Decodes take one of three paths, measured at start (:meth:`CpuBackend.choose_decode`) because
which is fastest depends on the BLAS the worker runs on (``kvserve_model.blas``):

- ``"blocks"``: :func:`block_table_attention`, ``mx.gather_mm`` against the rows a block table
  picks, without materializing them: the same memory traffic as dense SDPA, split over MLX CPU
  streams (one per core);
- ``"gather"``: :func:`gathered_attention`, the blocks gathered a few sequences at a time into
  contiguous K/V for SDPA (a multithreaded BLAS pays a hand-off per small GEMM of the first);
- ``"kernel"``: a compiled kernel (C, or numba's build of it) that walks the block tables in
  place (``attention.cpu_decode``).

Prefill chunks go to ``attention.cpu_prefill`` (MLX's CPU ``exp`` is ~15x slower than numpy's);
what neither serves takes the reference path. One file: the backend and the two MLX decode
paths it measures against each other at start.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from worker.model import cpu_math
from worker.model.attention import cpu_decode, cpu_prefill
from worker.model.attention.backend import AttentionBackend, AttentionCall, Declined, DecodeChoice
from worker.model.forward_batch import ForwardBatch, SeqInput

if TYPE_CHECKING:
    import mlx.nn as nn

    from worker.model.kv_pool import KVPool

log = logging.getLogger(__name__)

DECODE_PATHS = ("blocks", "gather", "kernel")
# Another decode path is taken only where it measured this much faster (see choose_decode).
GATHER_MARGIN = 0.9


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
    multithreaded BLAS, at the price of a copy of the context: :meth:`CpuBackend.choose_decode`
    measures at start which path a worker takes."""
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


def decide_decode(took: dict[str, float], most_threads: int) -> DecodeChoice:
    """The decode path from one layer's measured seconds each way (``blocks``, ``gather``,
    ``kernel`` on ``most_threads``, ``kernel-1`` on one; the kernel's where measured): block-
    table attention unless gathering is more than 10% faster; the kernel where it is more than
    10% faster than the better of the two, on one thread where that is more than 10% faster
    than on every core. The margins keep a near tie choosing the same from one start to the
    next."""
    blocks, gather = took["blocks"], took["gather"]
    pool_path = _pool_path(blocks, gather)
    best = blocks if pool_path == "blocks" else gather
    if "kernel" not in took:
        return DecodeChoice(pool_path, blocks, gather, pool_path=pool_path)
    kernel_s, threads, other_s = took["kernel"], most_threads, took.get("kernel-1", 0.0)
    if other_s and other_s < GATHER_MARGIN * kernel_s:
        kernel_s, threads, other_s = other_s, 1, kernel_s
    path = "kernel" if kernel_s < GATHER_MARGIN * best else pool_path
    return DecodeChoice(path, blocks, gather, kernel_s, threads, other_s, pool_path)


def _pool_path(blocks_s: float, gather_s: float) -> str:
    """Of the MLX paths, block-table attention unless gathering is more than 10% faster."""
    return "blocks" if gather_s > GATHER_MARGIN * blocks_s else "gather"


class CpuBackend(AttentionBackend):
    """Decodes by ``decode_path`` (``"blocks"`` until :meth:`choose_decode` measures), split
    over ``streams`` MLX CPU streams (0: one per available core, at most 8); prefill chunks
    with numpy's softmax. ``kernel_allowed``: whether the compiled kernel may be a candidate."""

    name = "cpu"

    def __init__(self, streams: int = 0, kernel_allowed: bool = True) -> None:
        super().__init__()
        self.stream_count = streams or min(8, _cores())
        self.kernel_allowed = kernel_allowed
        self.decode_path = "blocks"
        """``"blocks"``, ``"gather"`` or ``"kernel"`` (see the module docstring)."""
        self.pool_path = "blocks"
        """The faster of ``"blocks"`` and ``"gather"``: what a decode the kernel does not
        serve takes."""
        self.kernel_threads = 0
        """Threads the kernel runs on (0: every core it may use, ``cpu_decode.max_threads``);
        measured by :meth:`choose_decode`."""
        self.streams: tuple[mx.Stream, ...] = ()

    def prepare(self, model: nn.Module, pool: KVPool) -> None:
        """Make the attention streams on the thread that runs the forwards (MLX streams belong
        to the thread that made them)."""
        self.streams = _streams(self.stream_count)

    def decode(self, call: AttentionCall) -> mx.array | Declined:
        if not call.reads_pool():
            return self.prefill(call)  # keys the model changed: attend over what it passed
        queries, mask, batch = call.queries, call.mask, call.batch
        pool_k, pool_v = call.pool_arrays()
        path = self.pool_path if self.decode_path == "kernel" else self.decode_path
        if self.decode_path == "kernel" and cpu_decode.supports(queries, pool_k, pool_v):
            known, window = call.kernel_window()
            if known:
                return cpu_decode.paged_decode_attention(
                    queries,
                    pool_k,
                    pool_v,
                    batch.tables_np,
                    batch.ends,
                    call.scale,
                    window,
                    batch.query_lens,
                    threads=self.kernel_threads,
                )
        heads = pool_k.shape[0]
        rows = batch.block_rows(heads, pool_k.shape[1])
        decode = queries.shape[2] == 1
        if decode and isinstance(mask, str):
            mask = None  # one query attends to its whole context
        if decode and path == "blocks":
            row_mask = None if mask is None else batch.row_mask(mask, heads)
            return block_table_attention(
                queries, pool_k, pool_v, rows, call.scale, row_mask, self.streams
            )
        return gathered_attention(queries, pool_k, pool_v, rows, call.scale, mask, self.streams)

    def prefill(self, call: AttentionCall) -> mx.array | Declined:
        if not cpu_prefill.servable(call.queries, call.keys, call.mask):
            return Declined("a mask or shape numpy's softmax path does not take")
        return cpu_prefill.prefill_attention(
            call.queries, call.keys, call.values, call.scale, call.mask
        )

    def choose_decode(
        self, model: nn.Module, pool: KVPool, batch: int = 32, context: int = 1024, repeats: int = 7
    ) -> DecodeChoice:
        """Times one layer's decode every way on this machine and keeps the fastest.

        Block-table attention (``mx.gather_mm``) is one small GEMM per (sequence, head, block):
        with a single-threaded BLAS it matches a dense cache, but a multithreaded one (BLIS
        ``-mt``, which the BLAS choice takes on AMD CPUs) pays a thread hand-off per GEMM, and
        there gathering the blocks a few sequences at a time and running SDPA on them
        (:func:`gathered_attention`) was faster. The compiled kernel
        (``attention.cpu_decode``, where a C compiler or numba builds it and the pool is fp32) reads blocks in
        place without either cost, on every core or on one.

        Each way is timed between the layer's projections, as a decode runs it (queries from
        a GEMM, the output into one), not alone: a BLAS's threads keep their cores after a
        product, and what runs next competes with them. OpenBLAS's pthreads spin there: the
        kernel on two threads after a GEMM took 3.9 ms where each alone took 0.5 and 0.8
        (2-core Xeon, OpenBLAS 0.3.21), and whole decode steps ran 1.5x slower than mlx-lm's
        dense path; on one thread the kernel matched it. AOCL-BLIS leaves its cores free.

        The BLAS is chosen at start by measurement (``kvserve_model.blas``); so is this, at a
        decode shape of ``batch`` sequences of ``context`` tokens with the model's heads (fewer
        where the pool is smaller). Block-table attention is the default; gathering is taken
        only where it is more than 10% faster, the kernel only where it is more than 10% faster
        than the better of the two, and on one thread only where that is more than 10% faster
        than on every core: a near tie keeps the same choice from one start to the next.

        Measured at the CPU's default batch, where decode throughput is decided (2-core AMD
        EPYC, AOCL-BLIS-mt, 110M llama, context 1,024, whole decode steps, glibc keeping freed
        memory: ``kvserve_model.blas.MALLOC_TUNABLES``): batch 32 601 ms gathered against 841 by
        blocks; batch 8 193 against 261."""
        ways = self._decode_ways(model, pool, batch, context)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(repeats + 1):  # the first round warms them up (and compiles the kernel)
            for name, f in ways.items():
                start = time.perf_counter()
                mx.eval(f())
                times[name].append(time.perf_counter() - start)
        took = {name: statistics.median(t[1:]) for name, t in times.items()}
        choice = decide_decode(took, cpu_decode.max_threads())
        self.decode_path = choice.path
        self.pool_path = choice.pool_path
        self.kernel_threads = choice.kernel_threads if choice.path == "kernel" else 0
        return choice

    def _decode_ways(
        self, model: nn.Module, pool: KVPool, batch: int, context: int
    ) -> dict[str, Callable[[], mx.array]]:
        """One layer's decode at the measuring shape, each way its attention can run here:
        the queries projected from the hidden state by a GEMM, the attention's output
        projected back by another (see :meth:`choose_decode`)."""
        k, v = pool.layer_arrays(0)
        heads, per_head, bs, dim = k.shape
        v_dim = v.shape[-1]  # the key's but for MLA (deepseek_v2/v3: values narrower than keys)
        n = max(1, min(context // bs, (per_head - 1) // batch))
        batch = max(1, min(batch, (per_head - 1) // n))
        args = getattr(model, "args", None)
        hq = heads * max(1, getattr(args, "num_attention_heads", heads) // heads)
        hidden = getattr(args, "hidden_size", hq * dim)
        keys = mx.random.split(mx.random.key(0), 3)
        x = mx.random.normal((batch, hidden), key=keys[0]).astype(k.dtype)
        w_in = (mx.random.normal((hidden, hq * dim), key=keys[1]) * hidden**-0.5).astype(k.dtype)
        w_out = (mx.random.normal((hq * v_dim, hidden), key=keys[2]) * hidden**-0.5).astype(k.dtype)
        mx.eval(x, w_in, w_out)
        order = np.random.default_rng(0).permutation(per_head - 1)[: batch * n].tolist()
        decodes = [SeqInput([0], order[i * n : (i + 1) * n], n * bs - 1) for i in range(batch)]
        rows = ForwardBatch(decodes, bs, pool.num_blocks).block_rows(heads, per_head)
        scale = dim**-0.5
        tables = np.array([d.block_table for d in decodes], dtype=np.int32)
        ends = np.full(batch, n * bs, dtype=np.int64)

        def layer(attend: Callable[[mx.array], mx.array]) -> Callable[[], mx.array]:
            def run() -> mx.array:
                q = (x @ w_in).reshape(batch, hq, 1, dim)
                return attend(q).reshape(batch, hq * v_dim) @ w_out

            return run

        ways: dict[str, Callable[[], mx.array]] = {
            "blocks": layer(
                lambda q: block_table_attention(q, k, v, rows, scale, None, self.streams)
            ),
            "gather": layer(lambda q: gathered_attention(q, k, v, rows, scale, None, self.streams)),
        }

        def kernel(threads: int) -> Callable[[], mx.array]:
            return layer(
                lambda q: cpu_decode.paged_decode_attention(
                    q, k, v, tables, ends, scale, threads=threads
                )
            )

        if (
            self.kernel_allowed
            and cpu_decode.available()
            and cpu_decode.supports(mx.zeros((1, hq, 1, dim), k.dtype), k, v)
        ):
            try:  # compiles it (or loads it from the cache): a failure only leaves it out
                mx.eval(kernel(0)())
                ways["kernel"] = kernel(0)
                if cpu_decode.max_threads() > 1:
                    ways["kernel-1"] = kernel(1)
            except Exception:
                log.warning("the compiled CPU decode kernel failed: not used", exc_info=True)
        return ways

    def describe(self) -> str:
        path = self.decode_path
        if path == "kernel" and self.kernel_threads:
            path += f" on {self.kernel_threads} thread" + ("s" if self.kernel_threads > 1 else "")
        return f"attention: cpu (decodes: {path}, {len(self.streams) or 1} streams)"


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; macOS has only cpu_count
    return len(affinity(0)) if affinity else os.cpu_count() or 1


_THREAD_STREAMS = threading.local()


def _streams(count: int) -> tuple[mx.Stream, ...]:
    """``count`` streams of the default device for this thread (the first is its default one).

    Each MLX stream owns a thread and belongs to the thread that made it, so they are made once
    per calling thread and count, however many runners a process (or a test session) builds.
    Kept in thread-local storage, not by thread id: a new thread may get the id of one that
    ended, and its streams ("There is no Stream(cpu, 3) in current thread").
    """
    if count <= 1:
        return ()
    made: dict[int, tuple[mx.Stream, ...]] = _THREAD_STREAMS.__dict__.setdefault("by_count", {})
    if count not in made:
        device = mx.default_device()
        extra = [mx.new_stream(device) for _ in range(count - 1)]
        made[count] = (mx.default_stream(device), *extra)
    return made[count]
