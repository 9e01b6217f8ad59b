"""Whole pool blocks gathered into a contiguous copy on an NVIDIA GPU: the reference path's
context (``CudaBackend.gather``) for prefill chunks over a cached prefix, as a copy kernel
(source: ``gather_blocks.cu``) that moves 16 bytes a thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from worker.model import device as devices
from worker.model.attention.kernel_source import sections

# One thread copies one 16-byte vector of the output [B, H, MB * BS, D]: the sequence, head,
# table slot and vector follow from its index, the block from the table. MLX's own gather
# (``pool[heads, tables]``) moved 528 MB at ~130 GB/s on an H100 (4.1 ms: 32 sequences over
# an 8k prefix, one layer), most of that prefill step's attention time.
_GATHER_BODY = sections("gather_blocks.cu")["gather"]
GATHER_THREADS = 256


@functools.cache
def _gather_kernel() -> Callable[..., list[mx.array]]:
    return mx.fast.cuda_kernel(  # type: ignore[return-value]
        name="kvserve_gather_blocks",
        input_names=["pool", "tables"],
        output_names=["out"],
        source=_GATHER_BODY,
    )


def supported(pool: mx.array) -> bool:
    """Whether :func:`gather_blocks` copies this pool: a CUDA GPU, 16-byte rows."""
    return (
        devices.cuda_available()
        and mx.default_device() == mx.gpu
        and pool.ndim == 4
        and (pool.shape[-1] * pool.dtype.size) % 16 == 0
    )


def gather_blocks(pool: mx.array, tables: mx.array) -> mx.array:
    """Whole blocks ``tables`` ``[B, n]`` (int32) of one layer's pool ``[H, blocks, bs, D]``,
    as a contiguous ``[B, H, n * bs, D]``: what ``pool[heads, tables]`` then a reshape gives,
    as a copy kernel that moves 16 bytes a thread (:func:`supported`)."""
    h, _, bs, d = pool.shape
    b, n = tables.shape
    total = b * h * n * bs * (d * pool.dtype.size // 16)
    (out,) = _gather_kernel()(
        inputs=[pool, tables.astype(mx.int32)],
        template=[("T", pool.dtype)],
        grid=(-(-total // GATHER_THREADS) * GATHER_THREADS, 1, 1),
        threadgroup=(GATHER_THREADS, 1, 1),
        output_shapes=[(b, h, n * bs, d)],
        output_dtypes=[pool.dtype],
    )
    return out
