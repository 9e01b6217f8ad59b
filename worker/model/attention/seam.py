"""Where an unmodified mlx-lm model's attention meets the paged pool.

mlx-lm attention layers call the module-level ``scaled_dot_product_attention`` imported from
``mlx_lm.models.base``; :func:`install` points that name, in the modules of one model's layers,
at :func:`paged_sdpa`. A call whose cache is a :class:`PagedLayerCache` goes to the backend that
cache carries (``AttentionBackend.attend``); any other call (a dense cache in the same process)
goes to mlx-lm's function unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from worker.model.attention.backend import ORIGINAL_SDPA, AttentionCall
from worker.model.paged_cache import PagedLayerCache


def paged_sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """Drop-in for ``mlx_lm.models.base.scaled_dot_product_attention``."""
    if not isinstance(cache, PagedLayerCache):
        return ORIGINAL_SDPA(
            queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
        )
    return cache.backend.attend(AttentionCall(queries, keys, values, cache, scale, mask, sinks))


def install(model: nn.Module) -> int:
    """Route ``model``'s attention through :func:`paged_sdpa`; returns modules patched.

    Idempotent, and harmless for other caches in the process: :func:`paged_sdpa` forwards
    anything that is not a paged call to the original function.
    """
    patched = 0
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "scaled_dot_product_attention", None) is (
            ORIGINAL_SDPA
        ):
            module.scaled_dot_product_attention = paged_sdpa  # type: ignore[attr-defined]
            patched += 1
    return patched
