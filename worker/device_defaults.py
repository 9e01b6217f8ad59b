"""Device-aware defaults: the KV pool size and batch limits a worker uses when flags leave them unset.

The CPU defaults are sized for a few cores: a 256 MiB pool, 256 tokens per step (a longer
step only stalls running decodes for longer) and 32 sequences per step, chosen by measurement
(docs/serving-benchmark.md, "The batch limit"): against 16, 32 clients decoding at once got
their first token 6x sooner (p50 2.87 -> 0.46 s) at 1.19x the tokens/s, as mlx_lm.server's
decode batch of 32 does, and 64 measured the same as 32 for them. On a GPU they left the device
idle: on an H200 (1.1B llama, fp16) batch 32, 2,048-token steps and a pool of a few GB beat
mlx_lm.server on every workload tried. So on a GPU the pool takes a fraction of the device
memory that is free once the weights are loaded (the rest is left for activations: prefill
scores, gathered K/V) and the step limits are raised.

:func:`choose_limits` is the whole policy, a pure function of the device kind, the free memory
and the bytes of one block, so it is tested without a GPU (:func:`dense_limits` is its form for
the dense runner). :func:`device_kind` and
:func:`free_memory` read the machine; every MLX memory call is optional (the API differs between
MLX versions and backends), and a missing one means "unknown", never a failure.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import mlx.core as mx

from worker.config import WorkerConfig

log = logging.getLogger(__name__)

Device = Literal["cpu", "gpu"]

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True, slots=True)
class DeviceDefaults:
    """What a flag left at 0 becomes on one kind of device."""

    kv_memory_mb: int  # pool budget when free memory is unknown (CPU: always)
    kv_memory_fraction: float  # of free memory, when known; 0: use kv_memory_mb
    max_batch_size: int
    max_step_tokens: int


DEFAULTS: dict[Device, DeviceDefaults] = {
    "cpu": DeviceDefaults(
        kv_memory_mb=256, kv_memory_fraction=0.0, max_batch_size=32, max_step_tokens=256
    ),
    "gpu": DeviceDefaults(
        kv_memory_mb=256, kv_memory_fraction=0.5, max_batch_size=32, max_step_tokens=2048
    ),
}


# With --max-pending-requests unset: this many requests per batch slot, running + waiting. The
# queue keeps the batch full as sequences finish; beyond a few batches' worth a request waits
# longer than a retry elsewhere would, so the worker refuses it (RESOURCE_EXHAUSTED) and the
# gateway tries another worker. 256 with the default batch of 32 (CPU and GPU alike).
PENDING_PER_BATCH_SLOT = 8


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    """The pool size and step limits a worker runs with, and where the pool size came from."""

    device: Device
    num_blocks: int
    max_batch_size: int
    max_step_tokens: int
    pool_source: str  # for the log: which flag or rule sized the pool
    max_pending_requests: int = 0  # running + waiting; 0: no limit
    # Blocks the pool holds beyond num_blocks, never registered: the background warm-up's
    # (worker.warmup.scratch_blocks).
    scratch_blocks: int = 0

    def describe(self, block_size: int, bytes_per_block: int) -> str:
        size = self.num_blocks * bytes_per_block
        n = self.max_pending_requests
        scratch = f" + {self.scratch_blocks} for the warm-up" if self.scratch_blocks else ""
        return (
            f"device {self.device}: KV pool {self.num_blocks} blocks x {block_size} = "
            f"{self.num_blocks * block_size} tokens ({size / MIB:.0f} MiB, {self.pool_source})"
            f"{scratch}, "
            f"batch {self.max_batch_size} sequences, step {self.max_step_tokens} tokens, "
            f"{f'up to {n} requests' if n else 'no request limit'} (running + waiting)"
        )


def choose_limits(
    device: Device, free_bytes: int | None, bytes_per_block: int, config: WorkerConfig
) -> WorkerLimits:
    """The worker's limits: every value set in ``config`` wins; 0 means the device's default
    (``max_pending_requests``: None means ``PENDING_PER_BATCH_SLOT`` x the batch, 0 no limit).

    The pool is sized by the first of: ``num_blocks``; ``kv_memory_mb``; ``kv_memory_fraction``
    (or the device's default fraction) of ``free_bytes``, when known; the device's default
    budget in MiB. It holds at least one block.
    """
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    d = DEFAULTS[device]
    fraction = config.kv_memory_fraction or d.kv_memory_fraction
    if config.num_blocks:
        num_blocks, source = config.num_blocks, "--num-blocks"
    elif config.kv_memory_mb:
        num_blocks = config.kv_memory_mb * MIB // bytes_per_block
        source = f"--kv-memory-mb {config.kv_memory_mb}"
    elif fraction and free_bytes is not None and free_bytes > 0:
        num_blocks = int(free_bytes * fraction) // bytes_per_block
        source = f"{fraction:g} of {free_bytes / GIB:.1f} GiB free"
    else:
        num_blocks = d.kv_memory_mb * MIB // bytes_per_block
        source = f"{d.kv_memory_mb} MiB default"
        if fraction:
            source += ": free memory unknown"
    batch = config.max_batch_size or d.max_batch_size
    pending = config.max_pending_requests
    return WorkerLimits(
        device=device,
        num_blocks=max(1, num_blocks),
        max_batch_size=batch,
        max_step_tokens=config.max_step_tokens or d.max_step_tokens,
        pool_source=source,
        max_pending_requests=PENDING_PER_BATCH_SLOT * batch if pending is None else pending,
    )


def dense_limits(
    bytes_per_token: int,
    device: Device,
    free_bytes: int | None,
    config: WorkerConfig,
    max_context: int,
) -> WorkerLimits:
    """Limits for the dense runner (``worker.model.dense_runner``), whose cache costs
    ``bytes_per_token`` per token (``StateEstimate.bytes_per_token``). The leased blocks hold
    nothing there; they count tokens, and the cache service bounds the tokens in flight by them
    as it does for a paged pool:

    - hybrid (attention layers): the block count comes from the KV budget exactly as for the
      paged path (:func:`choose_limits`), a block being ``block_size`` tokens of the attention
      layers' K/V, which the dense caches hold per token too;
    - pure SSM (no per-token state): ``max_batch_size`` sequences of the whole context (unless
      ``--num-blocks`` says otherwise): tokens cost no memory, so blocks need not bound them.

    The recurrent state (``bytes_per_sequence``) is outside that budget, bounded by
    ``max_batch_size`` (the engine runs no more sequences at once): it is logged at startup.
    """
    per_block = config.block_size * bytes_per_token
    limits = choose_limits(device, free_bytes, max(1, per_block), config)
    if per_block == 0 and not config.num_blocks:
        blocks = limits.max_batch_size * -(-max_context // config.block_size)
        source = f"{limits.max_batch_size} sequences x {max_context} tokens: no per-token state"
        limits = replace(limits, num_blocks=blocks, pool_source=source)
    return limits


# MLX settings the worker process runs with unless the operator set them (``apply_mlx_env``).
# MLX_USE_CUDA_GRAPHS=0: MLX's CUDA backend records kernels into CUDA graphs of 20 and
# instantiates or updates one per 20 kernels; a decode step of a ~1B model is a few hundred
# small kernels and is bound by the host's time to launch them, which graphs made longer. On one
# H100, back to back (1B llama fp16, batch 32, bench/gpu/engine_decode.py with and without
# --mlx-defaults), the worker's compiled decode went from 2,254 to 3,654 tokens/s (0.60x ->
# 1.14x of batch_generate in the same process) and the uncompiled one from 2,157 to 2,284
# (docs/gpu-attention.md, "Launching a step").
# MLX reads these once, at its first GPU evaluation; other backends ignore them.
MLX_ENV: dict[str, str] = {"MLX_USE_CUDA_GRAPHS": "0"}


def apply_mlx_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Sets each of :data:`MLX_ENV` that ``environ`` (default: this process's environment)
    does not already set, and returns those it set. Call it before the process's first GPU
    evaluation: MLX reads them once."""
    env = os.environ if environ is None else environ
    added = {k: v for k, v in MLX_ENV.items() if k not in env}
    env.update(added)
    return added


def device_kind() -> Device:
    """``"gpu"`` when MLX's default device is a GPU (Metal or CUDA), else ``"cpu"``."""
    return "gpu" if mx.default_device().type == mx.gpu else "cpu"


def free_memory(device: Device) -> int | None:
    """Bytes a KV pool could take now, or None when the machine does not say.

    GPU: the device's free memory (CUDA reports it fresh, through NVML or cudaMemGetInfo) plus
    what MLX's buffer cache holds (free to MLX, but used to the driver); without that (Metal),
    the recommended working set or total memory less what MLX holds. Either is capped by MLX's
    memory limit less what MLX holds. CPU: the RAM the kernel reports available.
    """
    if device == "cpu":
        return _available_ram()
    info = _device_info()
    active = _memory_call("get_active_memory") or 0
    free = _int(info.get("free_memory"))
    if free is not None:
        free += _memory_call("get_cache_memory") or 0
    else:
        total = next(
            (
                v
                for k in ("max_recommended_working_set_size", "total_memory", "memory_size")
                if (v := _int(info.get(k)))
            ),
            None,
        )
        free = None if total is None else total - active
    limit = _memory_call("get_memory_limit")
    if limit:
        free = limit - active if free is None else min(free, limit - active)
    return None if free is None else max(0, free)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and value > 0 else None


def _device_info() -> dict[str, Any]:
    """``mx.device_info()`` (MLX >= 0.30), else the older ``mx.metal.device_info()``."""
    candidates: list[Callable[[], Any]] = []
    if hasattr(mx, "device_info"):
        candidates.append(mx.device_info)
    metal = getattr(mx, "metal", None)
    if metal is not None and hasattr(metal, "device_info") and metal.is_available():
        candidates.append(metal.device_info)
    for call in candidates:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                info = call()
        except Exception as err:  # an older or partial backend: treat as unknown
            log.debug("device_info failed: %s", err)
            continue
        if isinstance(info, dict) and info:
            return info
    return {}


def _memory_call(name: str) -> int | None:
    """``mx.<name>()``, else ``mx.metal.<name>()`` (MLX before 0.26); None if neither works."""
    for owner in (mx, getattr(mx, "metal", None)):
        call = getattr(owner, name, None) if owner is not None else None
        if call is None:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                value = call()
        except Exception as err:
            log.debug("%s failed: %s", name, err)
            continue
        if isinstance(value, int):
            return value
    return None


def total_memory(device: Device) -> int | None:
    """All the memory a pool on ``device`` could ever hold, or None when the machine does not
    say: the device's own (a GPU's total), else the host's RAM."""
    if device != "cpu":
        info = _device_info()
        for key in ("memory_size", "total_memory", "max_recommended_working_set_size"):
            if total := _int(info.get(key)):
                return total
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _available_ram() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else free pages from sysconf."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
