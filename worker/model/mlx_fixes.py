"""Workarounds for MLX kernels that compute wrong results on a device, installed by every runner.

**Sorted ``gather_mm`` on NVIDIA GPUs.** mlx-lm's mixture-of-experts layers
(``switch_layers.SwitchGLU`` / ``SwitchMLP``) sort their rows by expert once a forward has 64
or more (token, expert) pairs and call ``mx.gather_mm(..., sorted_indices=True)``. On MLX's CUDA
backend (mlx-cuda 0.32.4, a CUTLASS grouped GEMM) that call reads memory it did not write: with
MLX's buffer cache holding recycled buffers its result is wrong, 8.0 in an output of scale 6
for phixtral's second expert projection (162 rows, K 256, N 64), while the same call unsorted,
or on the CPU, is exact (``bench/gpu/moe_gather.py`` reproduces it). It hit any prefill of 32+
tokens on a top-2 MoE model, dense mlx-lm included, and only after earlier work had left the
cache dirty: the family sweep failed gpt_oss or phixtral inside a full run and never alone.

:func:`install` wraps ``mx.gather_mm`` so that a call bound for a CUDA GPU runs unsorted (the
path every decode already takes); calls on the CPU, or on Metal, are left as they are.
``KVSERVE_CUDA_SORTED_GATHER=1`` keeps the sorted kernel (for an MLX that has fixed it: run
``bench/gpu/moe_gather.py`` first). ``gather_qmm`` (quantized experts) is left alone:
``bench/gpu/moe_gather.py`` checks it too.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from worker.model import gpu_attention

_WRAPPED = "_kvserve_unsorted_on_cuda"


def sorted_gather_allowed() -> bool:
    """Whether ``KVSERVE_CUDA_SORTED_GATHER=1`` keeps MLX's sorted kernel on CUDA."""
    return os.environ.get("KVSERVE_CUDA_SORTED_GATHER", "0") == "1"


def _on_cuda(stream: Any) -> bool:
    """Whether a call with this ``stream`` argument runs on a CUDA GPU."""
    if stream is None:
        device = mx.default_device()
    elif isinstance(stream, mx.Stream):
        device = stream.device
    else:
        device = stream
    return device == mx.gpu and gpu_attention.cuda_available()


def unsorted_on_cuda(op: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """``op`` (``mx.gather_mm``'s signature) with ``sorted_indices`` dropped on a CUDA GPU:
    sorted indices are a speed hint, so the result is the same, computed by the unsorted
    kernel."""

    @functools.wraps(op)
    def call(*args: Any, sorted_indices: bool = False, stream: Any = None, **kw: Any) -> mx.array:
        if sorted_indices and _on_cuda(stream):
            sorted_indices = False
        return op(*args, sorted_indices=sorted_indices, stream=stream, **kw)

    setattr(call, _WRAPPED, op)
    return call


def install() -> bool:
    """Route ``mx.gather_mm``'s sorted calls on a CUDA GPU to the unsorted kernel, once per
    process (every caller looks ``mx.gather_mm`` up at call time, mlx-lm's included). Returns
    whether the wrapper is in place. No-op without CUDA or with the sorted kernel kept."""
    if not gpu_attention.cuda_available() or sorted_gather_allowed():
        return installed()
    if not installed():
        mx.gather_mm = unsorted_on_cuda(mx.gather_mm)
    return True


def installed() -> bool:
    return hasattr(mx.gather_mm, _WRAPPED)


def uninstall() -> None:
    """Put MLX's own ``gather_mm`` back (tests)."""
    if installed():
        mx.gather_mm = getattr(mx.gather_mm, _WRAPPED)


def dirty_buffer_cache(value: float = 1e30, max_bytes: int | None = None) -> None:
    """Leave MLX's buffer cache full of freed buffers holding ``value``, sizes 16 B to
    ``max_bytes`` (default 64 MiB on a GPU, 4 MiB on the CPU, where filling is slower): a
    kernel that reads memory it never wrote then shows it, where fresh memory (often zeros)
    can hide such a read. The start-up self-checks and the tests' parity runs call it first;
    ``mx.clear_cache()`` gives the memory back."""
    if max_bytes is None:
        max_bytes = 1 << (26 if mx.default_device() == mx.gpu else 22)
    keep = []
    size = 16
    while size <= max_bytes:
        for mult in (4, 5, 6, 7):  # sizes between the powers of two, as requests fall
            n = max(1, size * mult // 16)
            for _ in range(2):
                a = mx.full((n,), value, dtype=mx.float32)
                mx.eval(a)
                keep.append(a)
        size *= 2
    del keep
