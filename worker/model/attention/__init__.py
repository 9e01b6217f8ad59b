"""Attention over the paged KV pool: one backend a worker, chosen at start.

The walk of one attention call: the model's layer writes its new K/V through
``PagedLayerCache.update_and_fetch`` (``worker.model.paged_cache``: ``KVPool.write`` at the
forward's slots), then calls mlx-lm's ``scaled_dot_product_attention``, which ``seam.install``
pointed at ``seam.paged_sdpa``; that hands an ``AttentionCall`` to the cache's backend
(``backend.AttentionBackend.attend``), which serves it by decode or prefill, or declines it
with a reason and runs the reference path (gather-then-SDPA, ``backend.reference_attention``).

One file a device:

| backend | file | decodes | prefill chunks |
|---|---|---|---|
| reference | ``backend.py`` | gather-then-SDPA | gather-then-SDPA |
| cpu | ``cpu.py`` | blocks / gather / numba kernel, measured at start | numpy softmax |
| cuda | ``cuda.py`` | block-table kernel (``paged_decode.cu``) | kernel (``paged_prefill.cu``) or cuDNN |
| metal | ``metal.py`` (opt-in, untested) | block-table kernel (``paged_decode.metal``) | reference |

:func:`choose_backend` picks one from :class:`AttentionOptions` (the worker's flags) and the
device: ``"auto"`` is cpu on a CPU, cuda on an NVIDIA GPU, reference on an Apple GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from worker.errors import PoolConfigError
from worker.model.attention.backend import (
    FEW_QUERIES,
    AttentionBackend,
    AttentionCall,
    Declined,
    DecodeChoice,
)
from worker.model.attention.cpu import CpuBackend
from worker.model.attention.cuda import CudaBackend
from worker.model.attention.metal import MetalBackend
from worker.model.device import cuda_available

BACKENDS = ("auto", "reference", "cpu", "cuda", "metal")

__all__ = [
    "BACKENDS",
    "FEW_QUERIES",
    "AttentionBackend",
    "AttentionCall",
    "AttentionOptions",
    "Declined",
    "DecodeChoice",
    "choose_backend",
    "cuda_available",
]


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """The worker's attention flags, as plain values (``WorkerConfig.attention_options``)."""

    backend: str = "auto"  # one of BACKENDS
    streams: int = 0  # cpu: MLX streams decodes split over (0: one per core, at most 8)
    cpu_decode_kernel: bool = True  # cpu: the numba kernel may be measured and taken
    prefill_kernel: bool = True  # cuda: prefill chunks through the block-table kernel
    compile_decodes: bool = True  # cuda: decode forwards compiled (worker.model.compiled_decode)


def device_backend() -> str:
    """The backend ``"auto"`` means on this process's default device."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if cuda_available() else "reference"


def choose_backend(options: AttentionOptions | None = None) -> AttentionBackend:
    """The backend ``options`` name for the default device; raises ``PoolConfigError`` for one
    that cannot run on it."""
    options = options or AttentionOptions()
    name = device_backend() if options.backend == "auto" else options.backend
    on_gpu = mx.default_device() == mx.gpu
    if name == "reference":
        return AttentionBackend()
    if name == "cpu":
        if on_gpu:
            raise PoolConfigError("--attention cpu needs the CPU device")
        return CpuBackend(options.streams, options.cpu_decode_kernel)
    if name == "cuda":
        if not (on_gpu and cuda_available()):
            raise PoolConfigError("--attention cuda needs MLX's CUDA backend on an NVIDIA GPU")
        return CudaBackend(options.prefill_kernel, options.compile_decodes)
    if name == "metal":
        if not (on_gpu and mx.metal.is_available()):
            raise PoolConfigError("--attention metal needs an Apple GPU")
        return MetalBackend()
    raise PoolConfigError(f"--attention must be one of {', '.join(BACKENDS)}, got {name!r}")
