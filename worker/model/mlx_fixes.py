"""Workarounds for MLX kernels that compute wrong results on a device, installed by every runner.

**Sorted expert gathers on NVIDIA GPUs.** mlx-lm's mixture-of-experts layers
(``switch_layers.SwitchGLU`` / ``SwitchMLP``) sort their rows by expert once a forward has 64
or more (token, expert) pairs and call ``mx.gather_mm(..., sorted_indices=True)`` (quantized
experts: ``mx.gather_qmm``). On MLX's CUDA backend (mlx-cuda 0.32.4, a CUTLASS grouped GEMM)
the sorted ``gather_mm`` reads memory it did not write: once earlier work had left MLX's buffer
cache holding recycled buffers, phixtral's second expert projection (162 rows, K 256, N 64)
came out 8.0 off on outputs of scale 6, while the same call unsorted, or on the CPU, was exact.
It hit any prefill of 32+ tokens on a top-2 MoE model, dense mlx-lm included: the family sweep
failed gpt_oss or phixtral inside every full run on an H100 and never alone. A standalone call
on fresh inputs (``bench/gpu/moe_gather.py``) was right: the wrong read needs state earlier
calls leave, and its cause inside MLX is not pinned down (docs/gpu-attention.md).

:func:`install` wraps ``mx.gather_mm`` and ``mx.gather_qmm`` so that a call bound for a CUDA
GPU runs unsorted (the kernels every decode already takes; the sort is a speed hint, the
result is the same). The sorted ``gather_qmm`` was not caught wrong, but it may share the
fault and its unsorted kernel measured as fast (3.71 against 3.73 ms, 64 experts, 3,072 rows,
4-bit). Calls on the CPU, or on Metal, are left as they are. ``--cuda-sorted-gather`` keeps the
sorted kernels (for an MLX that has fixed them: :func:`keep_sorted_gathers`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from worker.model import device as devices

_WRAPPED = "_kvserve_unsorted_on_cuda"


_kept_sorted = False  # keep_sorted_gathers() was called: install() does nothing


def keep_sorted_gathers() -> None:
    """Keep MLX's sorted gather kernels in this process (``--cuda-sorted-gather``): call
    before the first runner is built."""
    global _kept_sorted
    _kept_sorted = True
    uninstall()


def _on_cuda(stream: Any) -> bool:
    """Whether a call with this ``stream`` argument runs on a CUDA GPU."""
    if stream is None:
        device = mx.default_device()
    elif isinstance(stream, mx.Stream):
        device = stream.device
    else:
        device = stream
    return device == mx.gpu and devices.cuda_available()


def unsorted_on_cuda(op: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """``op`` (``mx.gather_mm`` or ``mx.gather_qmm``) with ``sorted_indices`` dropped on a CUDA GPU:
    sorted indices are a speed hint, so the result is the same, computed by the unsorted
    kernel."""

    @functools.wraps(op)
    def call(*args: Any, sorted_indices: bool = False, stream: Any = None, **kw: Any) -> mx.array:
        if sorted_indices and _on_cuda(stream):
            sorted_indices = False
        return op(*args, sorted_indices=sorted_indices, stream=stream, **kw)

    setattr(call, _WRAPPED, op)
    return call


_OPS = ("gather_mm", "gather_qmm")


def install() -> bool:
    """Route the sorted calls of ``mx.gather_mm`` and ``mx.gather_qmm`` on a CUDA GPU to the
    unsorted kernels, once per process (every caller looks them up on ``mx`` at call time,
    mlx-lm's included). Returns whether the wrappers are in place. No-op without CUDA or with
    the sorted kernels kept."""
    if not devices.cuda_available() or _kept_sorted:
        return installed()
    for name in _OPS:
        op = getattr(mx, name)
        if not hasattr(op, _WRAPPED):
            setattr(mx, name, unsorted_on_cuda(op))
    return True


def installed() -> bool:
    return all(hasattr(getattr(mx, name), _WRAPPED) for name in _OPS)


def original(name: str) -> Callable[..., mx.array]:
    """MLX's own ``mx.<name>``, wrapped or not (benchmarks call the sorted kernel itself)."""
    op = getattr(mx, name)
    return getattr(op, _WRAPPED, op)


def uninstall() -> None:
    """Put MLX's own gathers back (tests)."""
    for name in _OPS:
        setattr(mx, name, original(name))


def dirty_buffer_cache(
    *inputs: mx.array, value: float = 1e30, max_bytes: int | None = None
) -> None:
    """Leave MLX's buffer cache full of freed buffers holding ``value``, sizes 16 B to
    ``max_bytes`` (default 64 MiB on a GPU, 4 MiB on the CPU, where filling is slower): a
    kernel that reads memory it never wrote then shows it, where fresh memory (often zeros)
    can hide such a read. ``inputs`` (a checked call's) are evaluated first, so that they do
    not take the dirtied buffers. The start-up self-checks and the tests' parity runs call it
    first; ``mx.clear_cache()`` gives the memory back."""
    mx.eval(*inputs)
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
