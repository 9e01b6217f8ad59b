"""What the pool needs to know about a model: per-layer KV shapes, dtype, vocabulary size.

Read from the model itself rather than from its config: mlx-lm families name their fields
differently (``head_dim`` may be absent, MLA layers store latents whose key and value widths
differ), so :func:`probe` runs one lazy forward on recording caches. MLX evaluates lazily and the
probe only reads shapes, so nothing is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from worker.errors import UnsupportedModelError


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """The K and V shape one attention layer writes per token: ``[n_kv_heads, head_dim]``."""

    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shapes of a model that the pool and the runner are built from."""

    layers: tuple[LayerSpec, ...]
    dtype: mx.Dtype
    vocab_size: int


class _RecordingCache:
    """Answers the cache protocol for a one-token forward and records what each layer writes."""

    def __init__(self) -> None:
        self.offset = 0
        self.seen: tuple[mx.array, mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.seen = (keys, values)
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return mx.ones((1, 1, n, n), dtype=mx.bool_) if return_array else None


def probe(model: nn.Module) -> ModelSpec:
    """Read ``model``'s per-layer KV shapes; raise if its state is not a plain KV cache.

    Recurrent and SSM layers (``ArraysCache``) and chunked caches keep state that blocks of
    K/V cannot hold, so such models are rejected up front instead of producing wrong tokens.
    """
    dense = make_prompt_cache(model)
    unsupported = {type(c).__name__ for c in dense if type(c) not in (KVCache, RotatingKVCache)}
    if unsupported:
        raise UnsupportedModelError(f"layers with {sorted(unsupported)} cannot be paged")
    caches = [_RecordingCache() for _ in dense]
    logits = model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
    layers = []
    dtype: mx.Dtype | None = None
    for index, cache in enumerate(caches):
        if cache.seen is None:
            raise UnsupportedModelError(f"layer {index} never called update_and_fetch")
        keys, values = cache.seen
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[1] != values.shape[1]:
            raise UnsupportedModelError(f"layer {index} writes K/V of shapes {keys.shape}")
        layers.append(LayerSpec(keys.shape[1], keys.shape[3], values.shape[3]))
        dtype = dtype or keys.dtype
    if dtype is None:
        raise UnsupportedModelError("model has no attention layers")
    return ModelSpec(layers=tuple(layers), dtype=dtype, vocab_size=logits.shape[-1])
