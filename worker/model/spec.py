"""What the pool needs to know about a model: per-layer KV shapes, dtype, vocabulary size,
and the layout its attention applies a batched mask in.

Read from the model itself rather than from its config: mlx-lm families name their fields
differently (``head_dim`` may be absent, MLA layers store latents whose key and value widths
differ), so :func:`probe` runs lazy forwards on recording caches. MLX evaluates lazily and the
probe only reads shapes, so nothing is computed.

The mask layout. A batch of different-length sequences needs a per-sequence mask, and one mask
array is shared by every layer of a forward. Most attention layers (SDPA, and the hand-written
ones of olmo, gear, ...) apply it to scores ``[B, heads, N, L]``, so it must be ``[B, 1, N, L]``.
gemma2 (and phi3small's block-sparse layers) reshape queries to ``[B, kv_heads, rep, N, L]`` for
grouped-query attention, where ``[B, 1, N, L]`` lines the batch axis up against the kv-head axis:
with as many sequences as kv heads it broadcasts and silently mixes sequences, otherwise it
fails. Those need ``[B, 1, 1, N, L]``, which in turn breaks 4-D scores. mlx-lm's own
``BatchKVCache`` hands out ``[B, 1, N, L]`` and is wrong for gemma2 too (measured: logits off by
7-14 with two left-padded sequences), so no layout fits every family; the probe finds the rank
that fits this model (:func:`mask_rank`) and refuses a model none fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from worker.errors import RecurrentStateError, UnsupportedModelError


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
    mask_rank: int = 4
    """Rank of the attention scores the model applies a batched mask to: 4 (``[B, heads, N,
    L]``) or 5 (``[B, kv_heads, rep, N, L]``); the batch's mask is ``[B, 1, ..., 1, N, L]``."""
    int_offsets: bool = False
    """The model needs ``cache.offset`` as one int (gpt_bigcode builds positions with
    ``np.arange(offset, ...)``): sequences at different positions run as separate forwards."""


MASK_RANKS = (4, 5)
# The batched probe's shape: a batch size (prime, above any kv-head count the probe saw) and a
# query length and context that differ from it and each other, so that a mask in the wrong
# layout cannot line up with some head axis by coincidence and broadcast silently.
_PROBE_QUERIES, _PROBE_CONTEXT = 3, 5


class _RecordingCache:
    """Answers the cache protocol like a paged batch whose ``context - N`` earlier positions are
    zeros, with an array mask of ``mask_rank`` dims, and records what each layer writes."""

    def __init__(self, batch: int = 1, context: int = 0, mask_rank: int | None = None) -> None:
        self.batch = batch
        self.context = context
        self.mask_rank = mask_rank
        self.offset = 0
        self.seen: tuple[mx.array, mx.array] | None = None
        self.windows: set[int] = set()  # sliding windows the model asked this cache's mask for

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.seen = (keys, values)
        before = self.context - keys.shape[2]
        if before > 0:
            pad = (keys.shape[0], keys.shape[1], before)
            keys = mx.concatenate([mx.zeros((*pad, keys.shape[3]), keys.dtype), keys], axis=2)
            values = mx.concatenate(
                [mx.zeros((*pad, values.shape[3]), values.dtype), values], axis=2
            )
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if window_size is not None:
            self.windows.add(window_size)
        if self.mask_rank is None:
            return mx.ones((1, 1, n, n), dtype=mx.bool_) if return_array else None
        # An array whatever the model asked for: a padded batch always gets one.
        shape = (self.batch, *(1,) * (self.mask_rank - 3), n, self.context)
        return mx.ones(shape, dtype=mx.bool_)


def probe(model: nn.Module) -> ModelSpec:
    """Read ``model``'s per-layer KV shapes; raise if its state is not a plain KV cache.

    Recurrent and SSM layers (``ArraysCache``) and chunked caches keep state that blocks of
    K/V cannot hold, so such models are rejected up front instead of producing wrong tokens:
    with RecurrentStateError where every cache is K/V or recurrent state (the dense
    per-sequence runner serves those), UnsupportedModelError for anything else.
    """
    dense = make_prompt_cache(model)
    unsupported = {type(c).__name__ for c in dense if type(c) not in (KVCache, RotatingKVCache)}
    if unsupported:
        message = f"layers with {sorted(unsupported)} cannot be paged"
        if is_recurrent(dense):
            raise RecurrentStateError(f"{message}; caches {describe_caches(dense)}")
        raise UnsupportedModelError(message)
    caches = [_RecordingCache() for _ in dense]
    try:
        logits = model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
    except Exception as e:  # a model that needs more of a cache than the protocol (afm7)
        first = str(e).splitlines()[0] if str(e) else ""
        raise UnsupportedModelError(
            f"its forward fails on a paged cache: {type(e).__name__}: {first}".rstrip(": ")
        ) from e
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
    _check_windows(caches, dense)
    vocab_size = logits.shape[-1]
    heads = max(s.n_kv_heads for s in layers)
    rank = mask_rank(model, len(caches), vocab_size, heads)
    return ModelSpec(
        layers=tuple(layers),
        dtype=dtype,
        vocab_size=vocab_size,
        mask_rank=rank,
        int_offsets=not _takes_offset_arrays(model, len(caches), heads, rank),
    )


def _takes_offset_arrays(model: nn.Module, num_layers: int, max_kv_heads: int, rank: int) -> bool:
    """Whether a lazy forward accepts per-sequence offsets (an ``mx.array`` of shape ``[B]``)
    where it accepts one int: ``mx.fast.rope`` does; a model that turns the offset into Python
    numbers does not. A forward that fails either way says nothing about offsets (True)."""
    b, n, context = _batch_size(max_kv_heads), _PROBE_QUERIES, _PROBE_CONTEXT

    def runs(offset: int | mx.array) -> bool:
        caches = [_RecordingCache(b, context, rank) for _ in range(num_layers)]
        for c in caches:
            c.offset = offset  # type: ignore[assignment]
        try:
            model(mx.zeros((b, n), dtype=mx.int32), cache=caches)
        except Exception:  # whatever the model raises on an offset it cannot take
            return False
        return True

    return runs(mx.array([(context - n) * (i % 2) for i in range(b)])) or not runs(context - n)


def cache_leaves(cache: Any) -> list[Any]:
    """The caches inside ``cache``: itself, or the members of a ``CacheList``, recursively."""
    if isinstance(cache, CacheList):
        return [leaf for member in cache.caches for leaf in cache_leaves(member)]
    return [cache]


def is_recurrent(caches: list[Any]) -> bool:
    """Whether ``caches`` (one per layer) hold recurrent state (``ArraysCache`` and its
    subclasses) and otherwise only plain K/V caches: what the dense runner serves."""
    leaves = [leaf for c in caches for leaf in cache_leaves(c)]
    return any(isinstance(leaf, ArraysCache) for leaf in leaves) and all(
        isinstance(leaf, ArraysCache) or type(leaf) in (KVCache, RotatingKVCache) for leaf in leaves
    )


def describe_caches(caches: list[Any]) -> str:
    """The distinct cache types of a model, in layer order: ``ArraysCache, KVCache``."""
    names: dict[str, None] = {}
    for c in caches:
        if isinstance(c, CacheList):
            names[f"CacheList({','.join(type(m).__name__ for m in cache_leaves(c))})"] = None
        else:
            names[type(c).__name__] = None
    return ", ".join(names)


def _check_windows(caches: list[_RecordingCache], dense: list[Any]) -> None:
    """Refuse a model whose sliding-window mask lets a query see more keys than its own dense
    cache keeps. The paged pool keeps every key and applies the mask; mlx-lm's rotating cache
    keeps ``max_size`` and drops the rest, so the two agree only when the mask's window is at
    most ``max_size``. Where it is wider (plamo3 asks for ``window_size + 1`` with a cache of
    ``window_size``), mlx-lm's own output depends on how the prompt was chunked (a decode sees
    ``max_size`` keys, a later query of a prefill chunk one more), so no paged result can match
    it: serving such a model would be silently different, so it is refused."""
    for index, (cache, reference) in enumerate(zip(caches, dense, strict=True)):
        if not isinstance(reference, RotatingKVCache):
            continue
        wider = sorted(w for w in cache.windows if w > reference.max_size)
        if wider:
            raise UnsupportedModelError(
                f"layer {index} masks a sliding window of {wider[-1]} keys but its mlx-lm cache "
                f"keeps {reference.max_size}: mlx-lm's output then depends on prompt chunking"
            )


def _batch_size(above: int) -> int:
    b = max(above + 1, 7)
    while any(b % d == 0 for d in range(2, int(b**0.5) + 1)):
        b += 1
    return b


def mask_rank(model: nn.Module, num_layers: int, vocab_size: int, max_kv_heads: int) -> int:
    """The first of :data:`MASK_RANKS` whose batched mask ``[B, 1, ..., N, L]`` every layer
    accepts: a lazy forward of a padded batch with a context must give logits ``[B, N,
    vocab]``. A mask in the wrong layout fails there, in a broadcast or a later reshape, since
    ``B`` matches no head axis. Raises UnsupportedModelError if no layout fits (layers that
    disagree, as phi3small's dense and block-sparse ones do)."""
    b, n, context = _batch_size(max_kv_heads), _PROBE_QUERIES, _PROBE_CONTEXT
    tokens = mx.zeros((b, n), dtype=mx.int32)
    errors = []
    for rank in MASK_RANKS:
        caches = [_RecordingCache(b, context, rank) for _ in range(num_layers)]
        for c in caches:
            c.offset = context - n
        try:
            shape = tuple(model(tokens, cache=caches).shape)
        except Exception as e:  # a shape error from inside the model, of any type
            errors.append(f"{rank}-D: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            continue
        if shape == (b, n, vocab_size):
            return rank
        errors.append(f"{rank}-D: logits of shape {shape}")
    raise UnsupportedModelError(
        "no batched attention mask fits every layer (" + "; ".join(errors) + ")"
    )
