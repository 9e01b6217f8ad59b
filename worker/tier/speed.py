"""Whether loading a block back beats computing it: the disk's read rate, measured here.

A block loads in ``bytes_per_block / load rate`` (the disk, then the copy into the pool) and
computes in ``block_size x`` the prefill seconds per token the engine measures on chunks of
at least ``MIN_CHUNK_BLOCKS`` blocks (``worker.engine.tier_sync``; a short chunk costs more a
token, and would make loading look better than it is). On a CPU a block of the default model computes in ~50 ms and
loads in ~1 ms; on a GPU prefill is fast enough that a slow disk can lose, so it is measured,
not assumed: at start (a file written, synced, dropped from the page cache and read back;
the pool's write path timed on its trash block) and then from every load, files to pool.
On an H100 a random 1B model prefilled 7,000 tokens in 136 ms (0.6 ms a 1 MB block) while
its blocks loaded at 0.6-1 GB/s: there the tier computes.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, cast

PROBE_BYTES = 16 << 20
CHUNK = 1 << 20


def measure_read_rate(directory: Path, nbytes: int = PROBE_BYTES) -> float:
    """Bytes a second read back from a file of ``nbytes`` in ``directory``, out of the page
    cache where the kernel lets it go (``posix_fadvise(DONTNEED)`` after a sync); 0.0 when it
    cannot be measured (a full or read-only disk)."""
    path = directory / f".read-probe-{os.getpid()}"
    try:
        with open(path, "wb") as f:
            block = os.urandom(CHUNK)
            for _ in range(max(1, nbytes // CHUNK)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        total = 0
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                total += len(chunk)
        took = time.perf_counter() - start
        return total / took if took > 0 else 0.0
    except OSError:
        return 0.0
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def load_beats_compute(
    bytes_per_block: int, read_rate: float, block_size: int, s_per_token: float | None
) -> bool:
    """Whether a block loads faster than it computes. Unknown prefill speed: load (the first
    prefill has not been timed yet); unknown read rate: compute."""
    if read_rate <= 0:
        return False
    if s_per_token is None:
        return True
    return bytes_per_block / read_rate < s_per_token * block_size


Quantization = tuple[int, int, str]
"""(group size, bits, mode) of a model's quantized layers."""


def matmul_flops(
    dtype: object, n: int = 0, repeats: int = 0, quantized: Quantization | None = None
) -> float:
    """Floating-point operations a second this device's matmuls reach, in ``dtype``: timed on
    ``repeats`` products of ``n x n`` matrices after one untimed (on the model thread),
    evaluated together. A GPU gets larger products (n 4,096, 8 of them) and one wait: one
    2,048 product a wait measured an H200 at about a third of what an 8B llama's prefill
    reaches, its launch and sync counted as compute, and the "lower bound" of a prefill
    token's cost below came out 2.5x the real cost: the disk tier loaded what computed
    faster. (0: the device's default.) ``quantized``: the products are the model's own kind,
    ``mx.quantized_matmul`` on weights quantized as its layers are (a GPU's quantized kernels
    run at their own rate, not the floating-point products')."""
    import mlx.core as mx

    gpu = mx.default_device() != mx.cpu
    n = n or (4096 if gpu else 2048)
    repeats = repeats or (8 if gpu else 4)
    a = mx.random.normal((n, n)).astype(dtype)  # type: ignore[arg-type]
    if quantized is None:

        def product() -> mx.array:
            return a @ a
    else:
        group_size, bits, mode = quantized
        packed = mx.quantize(a, group_size=group_size, bits=bits, mode=mode)
        w, scales = packed[0], packed[1]
        biases = packed[2] if len(packed) > 2 else None
        mx.eval(w, scales, *([biases] if biases is not None else []))

        def product() -> mx.array:
            return mx.quantized_matmul(
                a, w, scales, biases, transpose=True, group_size=group_size, bits=bits, mode=mode
            )

    mx.eval(product())
    start = time.perf_counter()
    mx.eval(*[product() for _ in range(repeats)])
    took = time.perf_counter() - start
    return repeats * 2 * n**3 / took if took > 0 else 0.0


def prefill_parameters(model: Any) -> tuple[int, Quantization | None]:
    """The parameters a prefill token multiplies through, and how the model's layers are
    quantized (None: not). Counted over the decoder layers (``model.layers``, as mlx-lm's
    caches count them), so the embedding table, a lookup, and the output head, which a prefill
    runs on its last token only, are left out. A quantized layer counts its logical weights
    (packed words x 32 / bits), not its words, scales and biases: an 8B llama in 4 bits is
    8B parameters of compute, not 1.2B. An expert layer (weights of ``(experts, out, in)``)
    counts the share a token is routed to (``num_experts_per_tok`` of the model's arguments;
    one expert where the model does not say). A lower bound either way: what a token costs
    at the margin is never less."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    layers = getattr(model, "layers", None) or [model]
    args = getattr(model, "args", None)
    routed = getattr(args, "num_experts_per_tok", None) if args is not None else None
    total = 0
    quantized: Quantization | None = None
    for layer in layers:
        leaves = tree_flatten(layer.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module))
        for _, module in cast(list[tuple[str, Any]], leaves):
            params = dict(tree_flatten(module.parameters()))
            weight = params.get("weight")
            if weight is None:
                total += sum(v.size for v in params.values())
                continue
            bits = getattr(module, "bits", None)
            if bits and "uint" in str(weight.dtype):
                n = weight.size * 32 // bits
                quantized = quantized or (
                    int(getattr(module, "group_size", 64)),
                    int(bits),
                    str(getattr(module, "mode", "affine")),
                )
            else:
                n = weight.size
            if weight.ndim == 3:  # experts: a token runs num_experts_per_tok of them
                n = n * min(int(routed or 1), weight.shape[0]) // weight.shape[0]
            total += n + sum(v.size for k, v in params.items() if k == "bias")
    return total, quantized


def prefill_s_per_token(parameters: int, flops: float) -> float | None:
    """A lower bound of a prefill token's cost before any prefill has been timed: 2 FLOPs a
    parameter a token at the device's measured matmul rate (attention and everything else
    only add to it, so it errs toward computing: on a CPU a block still computes ~30x slower
    than it loads; on an H100 a 1B model's block computes in ~0.2 ms, a disk load takes
    ~1.3 ms)."""
    if parameters <= 0 or flops <= 0:
        return None
    return 2 * parameters / flops
