"""Prefill attention with its softmax in numpy (worker.model.cpu_attention) against MLX's own
``scaled_dot_product_attention``: every mask form, grouped-query heads, a chunk deeper in the
context than its length, half precision. The paged-versus-dense tests (test_paged_parity.py)
cover it inside real models of several families."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from worker.model.attention import cpu_prefill


def qkv(b: int, hq: int, hk: int, n_q: int, n_k: int, d: int, seed: int, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (
        mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        for shape in ((b, hq, n_q, d), (b, hk, n_k, d), (b, hk, n_k, d))
    )
    return q, k, v


@pytest.mark.parametrize(
    "b, hq, hk, n_q, n_k, d",
    [
        (1, 4, 4, 7, 7, 16),  # no grouping, a whole prompt
        (2, 8, 2, 5, 19, 32),  # grouped 4:1, a chunk deep in its context
        (1, 6, 1, 16, 16, 8),  # one key head
        (3, 4, 2, 33, 64, 64),
    ],
)
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive", "per-head"])
def test_matches_mlx_sdpa(b, hq, hk, n_q, n_k, d, mask_kind) -> None:
    q, k, v = qkv(b, hq, hk, n_q, n_k, d, seed=n_q * 7 + d)
    rng = np.random.default_rng(3)
    if mask_kind == "none":
        mask = None
    elif mask_kind == "causal":
        mask = "causal"
    elif mask_kind == "bool":  # a sliding window over the causal mask, one per sequence
        i = np.arange(n_q)[:, None] + (n_k - n_q)
        j = np.arange(n_k)[None, :]
        keep = (j <= i) & (j > i - 5)
        mask = mx.array(np.broadcast_to(keep, (b, 1, n_q, n_k)).copy())
    elif mask_kind == "additive":
        mask = mx.array(rng.standard_normal((1, 1, n_q, n_k)).astype(np.float32))
    else:
        mask = mx.array(rng.standard_normal((b, hq, n_q, n_k)).astype(np.float32))
    assert cpu_prefill.servable(q, k, mask)
    got = cpu_prefill.prefill_attention(q, k, v, 0.3, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    assert got.shape == want.shape and got.dtype == want.dtype
    # Float32 rounding apart (the two sides may run on different BLAS libraries).
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-4)


def test_half_precision_in_and_out() -> None:
    q, k, v = qkv(1, 8, 2, 9, 20, 32, seed=1, dtype=mx.float16)
    got = cpu_prefill.prefill_attention(q, k, v, 0.2, "causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    assert got.dtype == mx.float16
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=2e-3
    )


def test_what_it_leaves_to_mlx() -> None:
    q, k, _ = qkv(1, 4, 2, 1, 9, 8, seed=2)
    assert not cpu_prefill.servable(q, k, None)  # a decode: the block-table path's
    q, k, _ = qkv(1, 6, 4, 3, 9, 8, seed=2)
    assert not cpu_prefill.servable(q, k, None)  # heads that do not group
    q, k, _ = qkv(1, 4, 2, 3, 9, 8, seed=2)
    assert not cpu_prefill.servable(q, k, "sliding")  # a mask form it does not know
    assert not cpu_prefill.servable(q, k, mx.zeros((1, 1, 3, 8)))  # keys it cannot align


def test_softmax_in_place_writes_only_its_own_scores() -> None:
    """The softmax runs in place on the buffer MLX evaluated the scores into: the inputs, and an
    earlier call's output, must come out untouched, and a second call must agree."""
    q, k, v = qkv(2, 8, 2, 6, 24, 16, seed=5)
    before = [np.array(a) for a in (q, k, v)]
    first = cpu_prefill.prefill_attention(q, k, v, 0.25, "causal")
    mx.eval(first)
    kept = np.array(first)
    second = cpu_prefill.prefill_attention(q, k, v, 0.25, "causal")
    for a, b in zip((q, k, v), before, strict=True):
        np.testing.assert_array_equal(np.array(a), b)
    np.testing.assert_array_equal(np.array(first), kept)
    np.testing.assert_array_equal(np.array(second), kept)


def test_scores_large_enough_to_split_over_threads() -> None:
    """Past PARALLEL_MIN the exponentials run on several threads, by rows: same result."""
    b, hq, hk, n_q, n_k = 1, 4, 2, 300, 1024
    assert b * hq * n_q * n_k >= cpu_prefill.PARALLEL_MIN
    q, k, v = qkv(b, hq, hk, n_q, n_k, 32, seed=9)
    got = cpu_prefill.prefill_attention(q, k, v, 0.2, "causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-4)
