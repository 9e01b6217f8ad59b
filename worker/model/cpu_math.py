"""Exponentials on MLX's CPU backend at the speed of its multiplies.

MLX's CPU ``exp`` (and ``sigmoid``, and so ``nn.silu``) evaluates one element at a time: ~0.08 G
elements/s on the development VM, where its multiply does ~7 G/s and numpy's SIMD ``exp``
~2 G/s. Every SwiGLU MLP (llama, qwen, mistral, phi3 and most mlx-lm families) takes one
exponential per intermediate activation: at a 512-token prefill chunk of a 77M llama that was
12-21 ms a layer, the size of the MLP's three matmuls; a decode's softmax takes one per key.

:func:`exp` computes ``e^x`` as ``2^n * p(r)`` (``n = round(x / ln 2)``, ``r = x - n ln 2``
split in two parts so it is exact, ``p`` Cephes' degree-7 polynomial for ``expf``; ``2^n`` built
in the float's exponent bits) with multiplies and adds only, compiled into one fused CPU kernel:
within a few float32 ulps of ``exp``, 4-5x faster. :func:`softmax` and :func:`swiglu` build on
it (a float32 SwiGLU of a prefill's size runs in numpy instead: its SIMD ``exp`` is faster
still); :func:`install` points the ``swiglu`` of a model's modules at this one on the CPU (as
``attention.seam.install`` does for attention). Inputs below the float32 range give exactly 0
(a softmax's masked keys), inputs above it the largest finite power instead of inf.

Compiled per input shape (the bit cast cannot be traced shapelessly): a new shape traces in
well under a millisecond; a process that sees thousands of shapes pays ~15 ns per cached shape
on each call's lookup.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import activations

_ORIGINAL_SWIGLU = activations.swiglu

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375  # ln 2 in two parts: n * _LN2_HI is exact for |n| < 2^9
_LN2_LO = -2.12194440e-4
_LOW, _HIGH = -87.0, 88.0  # 2^n stays a normal float32 exponent in between


def _exp_f32(x: mx.array) -> mx.array:
    c = mx.clip(x, _LOW, _HIGH)
    n = mx.floor(c * _LOG2E + 0.5)
    r = c - n * _LN2_HI - n * _LN2_LO
    p = r * 1.9875691500e-4 + 1.3981999507e-3
    p = p * r + 8.3334519073e-3
    p = p * r + 4.1665795894e-2
    p = p * r + 1.6666665459e-1
    p = p * r + 5.0000001201e-1
    p = p * r * r + r + 1.0
    two_n = mx.left_shift(n.astype(mx.int32) + 127, 23).view(mx.float32)
    return mx.where(x < _LOW, 0.0, p * two_n)  # NaN stays NaN


@mx.compile
def exp(x: mx.array) -> mx.array:
    """``e^x`` elementwise, computed in float32, in ``x``'s dtype."""
    return _exp_f32(x.astype(mx.float32)).astype(x.dtype)


@mx.compile
def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis, computed and returned in float32 (``precise=True``)."""
    x = x.astype(mx.float32)
    e = _exp_f32(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@mx.compile
def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    g = gate.astype(mx.float32)
    return (g / (1.0 + _exp_f32(-g)) * x.astype(mx.float32)).astype(gate.dtype)


# Elements from which a float32 SwiGLU goes through numpy: its SIMD exp is ~4.5x the compiled
# polynomial (512 x 2,112: 1.3 against 6.1 ms), worth evaluating the inputs for mid-forward (a
# prefill chunk); a decode's few rows stay lazy and compiled.
NUMPY_MIN = 1 << 18


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x`` as mlx-lm's ``activations.swiglu``, in float32 inside."""
    if gate.size < NUMPY_MIN or gate.dtype != mx.float32 or x.dtype != mx.float32:
        return _swiglu(gate, x)
    mx.eval(gate, x)
    g, u = (np.asarray(memoryview(a)) for a in (gate, x))  # type: ignore[arg-type]
    if g.shape != u.shape:
        return _swiglu(gate, x)
    out = np.negative(g)
    np.exp(out, out=out)
    out += 1.0
    np.divide(g, out, out=out)
    out *= u
    return mx.array(out)


def install(model: nn.Module) -> int:
    """Point the ``swiglu`` name of ``model``'s modules at :func:`swiglu`; returns modules
    patched. For the CPU only (a GPU's own ``exp`` is fast); idempotent."""
    patched = 0
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "swiglu", None) is _ORIGINAL_SWIGLU:
            module.swiglu = swiglu  # type: ignore[attr-defined]
            patched += 1
    return patched
