"""The CPU's fast exponentials (worker.model.cpu_math) against float64 numpy: exp over the whole
float32 range and its edges, softmax with masked keys, SwiGLU in every float dtype, and the
patch that routes a model's SwiGLU through it. The paged-versus-dense tests
(test_paged_parity.py) run whole models of several families with it installed."""

from __future__ import annotations

import math
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import activations

from tests.worker.helpers import tiny_model
from worker.model import cpu_math


def test_exp_within_an_ulp_over_the_float32_range() -> None:
    xs = np.linspace(-87.0, 88.0, 1_000_003, dtype=np.float32)
    got = np.array(cpu_math.exp(mx.array(xs))).astype(np.float64)
    want = np.exp(xs.astype(np.float64))
    rel = np.abs(got - want) / want
    assert rel.max() < 2 * np.finfo(np.float32).eps, rel.max()


def test_exp_edges() -> None:
    x = mx.array([-math.inf, -1e4, -87.5, 0.0, 1.0, 89.0, math.inf, math.nan])
    got = cpu_math.exp(x).tolist()
    assert got[:3] == [0.0, 0.0, 0.0]  # below float32's normal range: exactly 0
    assert got[3] == 1.0 and got[4] == pytest.approx(math.e, rel=1e-7)
    assert all(math.isfinite(v) and v > 1e38 for v in got[5:7])  # clamped, never inf
    assert math.isnan(got[7])


@pytest.mark.parametrize(
    "dtype, ulp", [(mx.float32, 2**-23), (mx.float16, 2**-10), (mx.bfloat16, 2**-7)]
)
def test_exp_keeps_the_dtype(dtype, ulp) -> None:
    x = mx.array(np.linspace(-10, 10, 101, dtype=np.float32)).astype(dtype)
    got = cpu_math.exp(x)
    assert got.dtype == dtype
    want = np.exp(np.array(x.astype(mx.float32)).astype(np.float64))
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=ulp, atol=0)


def test_softmax_against_float64_with_masked_keys() -> None:
    rng = np.random.default_rng(0)
    s = (rng.standard_normal((6, 3, 77)) * 8).astype(np.float32)
    s[:, :, 50:] = -np.inf  # padding keys
    s[0, 0, 10] = -np.inf
    got = np.array(cpu_math.softmax(mx.array(s)))
    d = s.astype(np.float64)
    e = np.exp(d - d.max(axis=-1, keepdims=True))
    want = e / e.sum(axis=-1, keepdims=True)
    assert got.dtype == np.float32
    assert (got[:, :, 50:] == 0).all() and got[0, 0, 10] == 0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "dtype, tol", [(mx.float32, 1e-6), (mx.float16, 2e-3), (mx.bfloat16, 1e-2)]
)
def test_swiglu_matches_mlx_lm(dtype, tol) -> None:
    rng = np.random.default_rng(1)
    gate, x = (mx.array(rng.standard_normal((3, 5, 64)).astype(np.float32) * 6) for _ in "gx")
    gate, x = gate.astype(dtype), x.astype(dtype)
    got = cpu_math.swiglu(gate, x)
    assert got.dtype == dtype and got.shape == gate.shape
    g = np.array(gate.astype(mx.float32)).astype(np.float64)
    want = g / (1 + np.exp(-g)) * np.array(x.astype(mx.float32))
    mine = np.array(got.astype(mx.float32))
    np.testing.assert_allclose(mine, want, rtol=tol, atol=tol)
    theirs = np.array(activations.swiglu(gate, x).astype(mx.float32))
    np.testing.assert_allclose(mine, theirs, rtol=2 * tol, atol=2 * tol)


@pytest.mark.parametrize("rows", [3, cpu_math.NUMPY_MIN // 64 + 5])  # compiled, then numpy
def test_swiglu_both_ways_against_float64(rows) -> None:
    rng = np.random.default_rng(2)
    g, u = (rng.standard_normal((1, rows, 64)).astype(np.float32) * 5 for _ in "gu")
    got = cpu_math.swiglu(mx.array(g), mx.array(u))
    assert got.shape == g.shape and got.dtype == mx.float32
    d = g.astype(np.float64)
    want = d / (1 + np.exp(-d)) * u
    np.testing.assert_allclose(np.array(got), want, rtol=1e-6, atol=1e-6)


def test_install_routes_a_models_swiglu() -> None:
    """The model's module calls the fast SwiGLU afterwards, and its logits barely move."""
    model = tiny_model("llama")
    module = sys.modules[type(model.layers[0].mlp).__module__]
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    saved = module.swiglu
    try:
        module.swiglu = activations.swiglu
        before = np.array(model(tokens))
        assert cpu_math.install(model) >= 1
        assert module.swiglu is cpu_math.swiglu
        assert cpu_math.install(model) == 0  # idempotent
        after = np.array(model(tokens))
    finally:
        module.swiglu = saved
    np.testing.assert_allclose(after, before, atol=1e-4)
