"""Decode attention over the paged KV pool on the CPU, reading blocks where they lie.

MLX has no custom CPU kernels, and its two ways to attend over pool blocks both pay for the
paging: ``mx.gather_mm`` (``attention.cpu.block_table_attention``) is one BLAS call per
(sequence, head, block), thousands a layer, each too small to use a multithreaded BLAS well;
gathering the blocks into a contiguous copy for SDPA (``attention.cpu.gathered_attention``)
moves every key and value twice. At a batch-32 decode of a 110M llama (context 256, 2-core
EPYC) one layer's attention took ~15 ms either way, against ~5 ms for SDPA on a dense cache.

This module's kernel is C (``paged_decode_cpu.c``), built once per machine with the system's
compiler and loaded with ctypes (``attention.c_kernel``); where no compiler builds it, the same
algorithm compiled by numba (LLVM, at first use; cached on disk), which keeps LLVM in the
worker (159 MiB of resident memory). Either reads the pool's memory in place through MLX's
buffer protocol: one task per
(sequence, KV head), spread over the cores; each walks the sequence's blocks through its block
table and keeps a running max, sum and output per query head of the group (online softmax, fp32,
as SDPA accumulates), so grouped-query heads read each K/V vector once. The layer's graph is
evaluated up to the attention first (its queries and the pool write), so a layer costs one
synchronization; nothing is copied but the queries and the output.

Served: up to 17 queries a sequence (a decode, or a decode with its speculative drafts, whose
verify forward is then as cheap in memory traffic as a decode), fp32 pools (the CPU runs
models in fp32), an optional sliding window. Anything else (prefill chunks) takes the MLX
paths. The CPU backend (``attention.cpu.CpuBackend.choose_decode``) measures it against them
at start; ``--no-cpu-decode-kernel`` keeps a worker off it (nothing is built or imported
then). ``KVSERVE_CPU_DECODE_KERNEL=c|numba`` forces one build of it (tests, measurements).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvserve_model.blas import THREADS_ENV

log = logging.getLogger(__name__)

MAX_QUERIES = 17  # a decode and up to 16 speculative drafts; longer calls are prefill
_lock = threading.Lock()  # numba's workqueue threading layer takes one caller at a time
SOURCE = Path(__file__).with_name("paged_decode_cpu.c")
KERNEL_ENV = "KVSERVE_CPU_DECODE_KERNEL"  # "c" or "numba": that build only (default: c first)
C_MAX_THREADS = 64  # the C kernel's own bound (MAX_THREADS there)


def _thread_count(pool: int) -> int:
    """Threads for the kernel by default: the cores this process may run on (a cpuset or
    ``taskset`` leaves fewer than the machine has, and numba counts the machine's), within
    numba's pool, capped like the BLAS by ``KVSERVE_BLAS_THREADS`` where an operator set it."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    cap = os.environ.get(THREADS_ENV, "")
    if cap.isdigit() and int(cap) > 0:
        cores = min(cores, int(cap))
    return max(1, min(pool, cores))


@functools.cache
def _compiled() -> Any:
    """The kernel as a call ``run(q, pool_k, pool_v, tables, ends, q_lens, window, scale, out,
    threads=0)``: the C build where a compiler makes one, else numba's, else None."""
    which = os.environ.get(KERNEL_ENV, "")
    if which != "numba":
        kernel = _c_compiled()
        if kernel is not None or which == "c":
            return kernel
    return _numba_compiled()


def implementation() -> str:
    """``"c"``, ``"numba"``, or ``""`` where neither runs here."""
    kernel = _compiled()
    return "" if kernel is None else kernel.implementation


@functools.cache
def _c_compiled() -> Any:
    """The C build of the kernel (``attention.c_kernel``), None where it cannot be had."""
    from worker.model.attention import c_kernel

    lib = c_kernel.load(SOURCE)
    if lib is None:
        return None
    fn = lib.paged_decode
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr] * 7 + [i64] * 9 + [ctypes.c_float, i64]
    fn.restype = ctypes.c_int
    most = _thread_count(C_MAX_THREADS)

    def run(q, pool_k, pool_v, tables, ends, q_lens, window, scale, out, threads: int = 0) -> None:
        # Plain pointers: every array is C-contiguous (the caller makes them so).
        batch, hq, nq, dim = q.shape
        heads, blocks, bs, _ = pool_k.shape
        status = fn(
            q.ctypes.data,
            pool_k.ctypes.data,
            pool_v.ctypes.data,
            tables.ctypes.data,
            ends.ctypes.data,
            q_lens.ctypes.data,
            out.ctypes.data,
            batch,
            hq,
            nq,
            dim,
            heads,
            blocks,
            bs,
            tables.shape[1],
            window,
            scale,
            min(threads, most) if threads > 0 else most,
        )
        if status != 0:
            raise MemoryError("the CPU decode kernel could not allocate its scratch or threads")

    run.implementation = "c"  # type: ignore[attr-defined]
    run.most = most  # type: ignore[attr-defined]
    return run


@functools.cache
def _numba_compiled() -> Any:
    """The kernel compiled by numba on first use, as a call that runs it on
    :func:`_thread_count` threads (None where numba cannot be imported). One long function on
    purpose: the kernel
    is defined inside it so that numba is imported only here, and a numba kernel is one
    function (each call out of it is a call numba must compile and cannot inline freely)."""
    try:
        import numba
        from numba import njit, prange
    except Exception:  # not installed, or no wheel for this platform
        log.info("numba is unavailable: CPU decodes take MLX's paths", exc_info=True)
        return None

    most = _thread_count(int(getattr(numba.config, "NUMBA_NUM_THREADS", 1)))

    @njit(parallel=True, nogil=True, cache=True, fastmath={"reassoc", "contract"})
    def kernel(q, pool_k, pool_v, tables, ends, q_lens, window, scale, out):
        # q [B, Hq, NQ, D] fp32; pool_k/pool_v [H, blocks, BS, D]; tables [B, W] int32;
        # ends/q_lens [B]: query i of sequence b sits at ends[b] - q_lens[b] + min(i,
        # q_lens[b] - 1) and sees keys up to it (the last ``window`` only, when window > 0);
        # out [B, Hq, NQ, D].
        batch, hq, nq, dim = q.shape
        heads, _, bs, _ = pool_k.shape
        rep = hq // heads
        rows = rep * nq
        for task in prange(batch * heads):
            b = task // heads
            h = task - b * heads
            last = ends[b] - 1
            first_pos = ends[b] - q_lens[b]
            his = np.empty(rows, dtype=np.int64)  # each row sees keys lo <= p < hi
            los = np.zeros(rows, dtype=np.int64)
            qs = np.empty((rows, dim), dtype=np.float32)
            for r in range(rows):
                rr = r // nq
                i = r - rr * nq
                pos = min(first_pos + i, last)
                his[r] = pos + 1
                if window > 0:
                    los[r] = max(pos + 1 - window, 0)
                for d in range(dim):
                    qs[r, d] = q[b, h * rep + rr, i, d] * scale
            top = np.full(rows, -np.inf, dtype=np.float32)
            total = np.zeros(rows, dtype=np.float32)
            acc = np.zeros((rows, dim), dtype=np.float32)
            scores = np.empty(bs, dtype=np.float32)
            for j in range(los.min() // bs, (ends[b] + bs - 1) // bs):
                block = tables[b, j]
                keys = pool_k[h, block]
                values = pool_v[h, block]
                for r in range(rows):
                    t0 = max(los[r] - j * bs, 0)
                    t1 = min(his[r] - j * bs, bs)
                    if t0 >= t1:
                        continue
                    best = top[r]
                    for t in range(t0, t1):
                        s = np.float32(0.0)
                        for d in range(dim):
                            s += qs[r, d] * keys[t, d]
                        scores[t] = s
                        if s > best:
                            best = s
                    shrink = np.exp(top[r] - best)
                    total[r] *= shrink
                    for d in range(dim):
                        acc[r, d] *= shrink
                    top[r] = best
                    for t in range(t0, t1):
                        w = np.exp(scores[t] - best)
                        total[r] += w
                        for d in range(dim):
                            acc[r, d] += w * values[t, d]
            for r in range(rows):
                rr = r // nq
                i = r - rr * nq
                for d in range(dim):
                    out[b, h * rep + rr, i, d] = acc[r, d] / total[r]

    def run(*args: Any, threads: int = 0) -> None:
        want = min(threads, most) if threads > 0 else most
        if numba.get_num_threads() != want:  # numba's count is per calling thread
            numba.set_num_threads(want)
        kernel(*args)

    run.implementation = "numba"  # type: ignore[attr-defined]
    run.most = most  # type: ignore[attr-defined]
    return run


def available() -> bool:
    """Whether this process can take the kernel: built from C, or numba imports."""
    return _compiled() is not None


def max_threads() -> int:
    """The most threads the kernel runs on here (its default); 0 where it is unavailable."""
    kernel = _compiled()
    return 0 if kernel is None else int(kernel.most)


def supports(queries: mx.array, pool_k: mx.array, pool_v: mx.array) -> bool:
    """Whether :func:`paged_decode_attention` serves these shapes and dtypes."""
    if queries.ndim != 4 or pool_k.ndim != 4 or pool_v.ndim != 4:
        return False
    _, hq, nq, d = queries.shape
    h = pool_k.shape[0]
    return (
        1 <= nq <= MAX_QUERIES
        and pool_k.shape == pool_v.shape
        and pool_k.shape[-1] == d
        and hq % h == 0
        and pool_k.dtype == pool_v.dtype == mx.float32
        and queries.dtype in (mx.float32, mx.float16, mx.bfloat16)
    )


def paged_decode_attention(
    queries: mx.array,
    pool_k: mx.array,
    pool_v: mx.array,
    tables: np.ndarray,
    ends: np.ndarray,
    scale: float,
    window: int | None = None,
    query_lens: np.ndarray | None = None,
    threads: int = 0,
) -> mx.array:
    """Attention of a few queries a sequence, ``queries`` ``[B, Hq, Nq, D]`` (a decode, or a
    decode with its speculative drafts), over its pool blocks.

    ``pool_k``/``pool_v``: one layer's pool ``[H, blocks, block_size, D]`` fp32 (query head
    ``h * rep + r`` reads KV head ``h``); ``tables`` ``[B, >= blocks used]`` block ids;
    ``ends`` ``[B]``: tokens in the pool for each sequence, this forward's included. Query
    ``i`` sits at ``ends[b] - Nq + i`` (causal), or with ``query_lens`` ``[B]`` at ``ends[b] -
    query_lens[b] + min(i, query_lens[b] - 1)`` (rows past a sequence's queries repeat its
    last, as ``ForwardBatch.mask`` pads them), and sees every key up to its position, or with
    ``window`` the last ``window``. Evaluates the queries and the pool (the layer's graph up to
    here) and returns ``[B, Hq, Nq, D]`` in the queries' dtype. Block ids are not checked: they
    must index the pool (``ForwardBatch`` checks them). ``threads``: how many threads the
    kernel runs on (0: :func:`max_threads`; ``CpuBackend.choose_decode`` measures which)."""
    kernel = _compiled()
    if kernel is None:
        raise RuntimeError("the CPU decode kernel needs a C compiler or numba")
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    b, hq, nq, d = queries.shape
    q32 = queries.astype(mx.float32)
    mx.eval(q32, pool_k, pool_v)
    ends = np.ascontiguousarray(ends, dtype=np.int64)
    q_lens = (
        np.full(b, nq, dtype=np.int64)
        if query_lens is None
        else np.ascontiguousarray(query_lens, dtype=np.int64)
    )
    out = np.empty((b, hq, nq, d), dtype=np.float32)
    # Views of MLX's buffers, not copies; dropped before anything writes the pool again.
    k_view = np.ascontiguousarray(np.asarray(pool_k))  # as they are: the pool is contiguous
    v_view = np.ascontiguousarray(np.asarray(pool_v))
    with _lock:
        kernel(
            np.ascontiguousarray(np.asarray(q32)),
            k_view,
            v_view,
            np.ascontiguousarray(tables, dtype=np.int32),
            ends,
            q_lens,
            window or 0,
            np.float32(scale),
            out,
            threads=threads,
        )
    del k_view, v_view
    return mx.array(out).astype(queries.dtype)
