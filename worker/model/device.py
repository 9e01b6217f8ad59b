"""Which device MLX runs on, asked without loading mlx-lm (the worker's entry point and the
precompile child ask before they load anything else)."""

from __future__ import annotations

import functools

import mlx.core as mx


@functools.cache
def cuda_available() -> bool:
    """Whether this MLX build runs on an NVIDIA GPU (the CUDA backend)."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())
