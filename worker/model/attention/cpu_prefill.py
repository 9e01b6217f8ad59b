"""Prefill attention on the CPU with its softmax in numpy.

On MLX's CPU backend the matmuls of attention go through the BLAS, but its elementwise
transcendental functions do not: ``mx.exp`` runs at ~0.07 G elements/s on the development
VM, where numpy's (SIMD) ``exp`` does ~1.1 G/s on the same array. Prefill attention computes
one exponential per (query, key) pair, so at a few thousand tokens of context the softmax, not
the matmuls, is where a prefill's time goes (``bench/bench_prefill.py``: attention was ~90%
of a 4k-token prompt's prefill; ``mx.softmax`` ~75% of attention).

:func:`prefill_attention` computes the scores with MLX (``Q K^T``, grouped-query heads folded
without repeating K), evaluates them, applies the mask and the exponentials in numpy in place
on the buffer MLX evaluated them into (no copy either way; MLX's own path materializes the
scores too), multiplies by V with MLX again and normalizes the output: the same result as ``mx.fast.scaled_dot_product_attention``
to float32 rounding, 2-3x faster for a prefill chunk here. It serves the paged path's prefill
calls on the CPU (``attention.cpu.CpuBackend``); decode and the GPU keep their paths.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx
import numpy as np

# Score elements from which the exponentials are split over threads: numpy releases the GIL and
# MLX's threads wait meanwhile (512 x 4,096 scores x 12 heads: 28.6 ms on one core, 17.7 on two).
PARALLEL_MIN = 1 << 20
_THREADS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
_pool: ThreadPoolExecutor | None = None


def _exp_rows(s: np.ndarray) -> np.ndarray:
    """``s`` ``[rows, N]`` minus each row's max, exponentiated in place; the rows' sums."""
    global _pool
    sums = np.empty(len(s), dtype=np.float32)

    def part(lo: int, hi: int) -> None:
        rows = s[lo:hi]
        rows -= rows.max(axis=-1, keepdims=True)
        np.exp(rows, out=rows)
        rows.sum(axis=-1, out=sums[lo:hi])

    parts = min(_THREADS, len(s)) if s.size >= PARALLEL_MIN else 1
    if parts < 2:
        part(0, len(s))
        return sums
    if _pool is None:
        _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="softmax")
    bounds = [len(s) * i // parts for i in range(parts + 1)]
    for f in [_pool.submit(part, bounds[i], bounds[i + 1]) for i in range(parts)]:
        f.result()
    return sums


def servable(queries: mx.array, keys: mx.array, mask: Any) -> bool:
    """Whether :func:`prefill_attention` computes this call exactly as SDPA would: a prefill
    (more than one query), grouped-query heads, and a mask that is absent, causal or an array
    that broadcasts to the scores."""
    b, hq, n_q, _ = queries.shape
    hk, n_k = keys.shape[1], keys.shape[2]
    if n_q < 2 or keys.ndim != 4 or hq % hk or n_q > n_k:
        return False
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return True
    if not isinstance(mask, mx.array) or mask.ndim != 4:
        return False
    mb, mh, mq, mk = mask.shape
    return mb in (1, b) and mh in (1, hq) and mq in (1, n_q) and mk == n_k


def prefill_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """``softmax(Q K^T * scale + mask) V`` for ``queries`` ``[B, Hq, L, D]`` over ``keys``
    and ``values`` ``[B, Hk, N, D]`` (``Hq`` a multiple of ``Hk``; query head ``h * rep + r``
    reads key head ``h``). ``mask``: None, ``"causal"`` (the L queries are the last L of the N
    positions, as in SDPA) or an array broadcasting to ``[B, Hq, L, N]`` (bool: keep;
    otherwise additive)."""
    b, hq, n_q, d = queries.shape
    hk, n_k, dv = keys.shape[1], keys.shape[2], values.shape[3]
    rep = hq // hk
    q = (queries * scale).reshape(b, hk, rep * n_q, d)
    scores = (q @ keys.swapaxes(-1, -2)).astype(mx.float32)  # [B, Hk, rep * L, N]
    mx.eval(scores)
    view = np.asarray(memoryview(scores))  # type: ignore[arg-type]  # MLX's own buffer
    # The softmax runs in place on the buffer MLX evaluated the scores into, which P V then
    # reads: no copy into numpy and none back (a copy each way cost ~34 ms of a 108 ms layer at
    # a 256-token chunk 4k deep). Only a fresh, row-contiguous, writable result qualifies.
    in_place = view.flags.c_contiguous and view.flags.writeable
    s = (view if in_place else np.array(view)).reshape(b, hk, rep, n_q, n_k)
    if isinstance(mask, str):
        # Key j <= query i + (N - L): only the last L keys have any masked out.
        hidden = ~np.tri(n_q, n_q, 0, dtype=bool)
        np.copyto(s[..., n_k - n_q :], np.float32(-np.inf), where=hidden)
    elif mask is not None:
        m = np.array(memoryview(mask if mask.dtype == mx.bool_ else mask.astype(mx.float32)))
        mb, mh, mq, mk = m.shape
        m = m.reshape(mb, hk, rep, mq, mk) if mh == hq else m.reshape(mb, 1, 1, mq, mk)
        if m.dtype == np.bool_:
            np.copyto(s, np.float32(-np.inf), where=~m)
        else:
            s += m
    # Normalized after P V, on the [L, Dv] output rather than the [L, N] probabilities (a pass
    # over the scores fewer); in float32, so the unnormalized sums cannot overflow a half type.
    sums = mx.array(_exp_rows(s.reshape(-1, n_k)).reshape(b, hk, rep * n_q, 1))
    probs = scores if in_place else mx.array(s.reshape(b, hk, rep * n_q, n_k))
    del s, view
    out = (probs @ values.astype(mx.float32)) / sums  # [B, Hk, rep * L, Dv]
    return out.reshape(b, hq, n_q, dv).astype(queries.dtype)
