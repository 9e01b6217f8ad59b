"""Tiny seeded models of each family and the dense reference the paged path is held to.

The reference is mlx-lm's own path: ``make_prompt_cache(model)`` (``KVCache`` per layer,
``RotatingKVCache`` for gemma3's sliding layers), one sequence at a time, the whole prompt in
one call. The paged path must give the same greedy tokens and fp32 logits within ``TOL``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes

from worker.model.attention import AttentionOptions, device_backend, gpu_decode
from worker.model.attention.cuda import CudaBackend
from worker.model.forward_batch import SeqInput
from worker.model.runner import ModelRunner

TOL = 1e-4
EMB_STD = 0.3  # embeddings small enough that the context, not the last token, drives decoding

VOCAB = 128

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "model_type": "llama", "tie_word_embeddings": False},
    "qwen2": {**_COMMON, "model_type": "qwen2", "tie_word_embeddings": True, "rope_theta": 1e6},
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "head_dim": 32,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
    },
    "mistral": {
        **_COMMON,
        "model_type": "mistral",
        "num_key_value_heads": 1,
        "tie_word_embeddings": False,
        "sliding_window": None,
    },
    "gemma3": {
        **_COMMON,
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 16,
        "sliding_window_pattern": 2,  # layers 0 and 2 local (window 16), 1 and 3 global
        "rope_local_base_freq": 10000.0,
        "rope_theta": 1e6,
    },
    # Grouped-query attention on 5-D scores [B, kv_heads, rep, N, L] (mask rank 5), softcapped.
    "gemma2": {
        **_COMMON,
        "model_type": "gemma2",
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma2_kv1": {
        **_COMMON,
        "model_type": "gemma2",
        "num_key_value_heads": 1,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
}
FAMILIES = tuple(CONFIGS)
# Quantized as the mlx-community checkpoints most users run ship: affine, group 32, 4 or 8
# bits, the embedding included (``family:bits``).
QUANTIZED = ("llama:4bit", "qwen3:8bit", "gemma3:4bit")


def tiny_model(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """An fp32 model of ``family`` with seeded weights, scaled so greedy decoding wanders
    over the vocabulary instead of settling into a two-token loop; ``overrides`` change its
    config (wider heads, say). ``family:4bit`` (or ``:8bit``): that model, quantized afterwards
    (``nn.quantize``, group 32), as a quantized checkpoint loads."""
    if ":" in family:
        base, bits = family.split(":")
        model = tiny_model(base, seed, **overrides)
        nn.quantize(model, group_size=32, bits=int(bits.removesuffix("bit")))
        mx.eval(model.parameters())
        return model
    config = {**CONFIGS[family], **overrides}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    params = []
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            # gemma norms scale by 1 + weight
            new = np.zeros(value.shape) if family.startswith("gemma") else np.ones(value.shape)
        elif "embed_tokens" in name:
            new = rng.standard_normal(value.shape) * EMB_STD
        else:
            new = rng.standard_normal(value.shape) * (1.5 / np.sqrt(value.shape[-1]))
        params.append((name, mx.array(new.astype(np.float32))))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def max_diff(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


class DenseSeq:
    """One sequence on mlx-lm's dense caches: the reference."""

    def __init__(self, model: nn.Module, prompt: Sequence[int]) -> None:
        self.model = model
        self.cache = make_prompt_cache(model)
        self.tokens = list(prompt)
        self.logits_all = model(mx.array([self.tokens]), cache=self.cache)[0].astype(mx.float32)
        mx.eval(self.logits_all)
        self.logits = self.logits_all[-1]

    def step(self, token: int) -> mx.array:
        self.tokens.append(token)
        self.logits = self.model(mx.array([[token]]), cache=self.cache)[0, -1].astype(mx.float32)
        mx.eval(self.logits)
        return self.logits


@dataclass
class PagedSeq:
    """Host-side state of one sequence on the paged path: its tokens and block table."""

    tokens: list[int]
    table: list[int]
    in_pool: int = 0  # tokens whose K/V are in the pool
    pending: list[int] = field(default_factory=list)  # tokens to run next forward

    @classmethod
    def fresh(cls, prompt: Sequence[int], table: Sequence[int]) -> PagedSeq:
        return cls.cached(prompt, table, 0)

    @classmethod
    def cached(cls, tokens: Sequence[int], table: Sequence[int], in_pool: int) -> PagedSeq:
        """A sequence whose first ``in_pool`` tokens are already in the pool's blocks."""
        return cls(list(tokens), list(table), in_pool, pending=list(tokens[in_pool:]))

    def take(self, n: int | None = None) -> SeqInput:
        """The next forward's input: up to ``n`` pending tokens (all by default)."""
        n = len(self.pending) if n is None else n
        chunk, self.pending = self.pending[:n], self.pending[n:]
        seq = SeqInput(chunk, self.table, self.in_pool)
        self.in_pool += len(chunk)
        return seq

    def push(self, token: int) -> None:
        self.tokens.append(token)
        self.pending.append(token)


def decode_together(
    runner: ModelRunner,
    paged: Sequence[PagedSeq],
    dense: Sequence[DenseSeq],
    steps: int,
    first_logits: Sequence[mx.array] | None = None,
) -> float:
    """Greedy-decode ``paged`` as one batch and each ``dense`` alone; assert equal tokens and
    return the largest logit difference seen (prefill logits included if given)."""
    worst = 0.0
    if first_logits is not None:
        for p, d in zip(first_logits, dense, strict=True):
            worst = max(worst, max_diff(p, d.logits))
    current = [d.logits for d in dense]
    for _ in range(steps):
        tokens = [int(mx.argmax(c)) for c in current]
        for p, t in zip(paged, tokens, strict=True):
            p.push(t)
        logits = runner.forward([p.take() for p in paged])
        current = [d.step(t) for d, t in zip(dense, tokens, strict=True)]
        for i, d in enumerate(current):
            assert int(mx.argmax(logits[i])) == int(mx.argmax(d)), "greedy tokens diverged"
            worst = max(worst, max_diff(logits[i], d))
    return worst


def prompts(rng: np.random.Generator, *lengths: int) -> list[list[int]]:
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def reference_kernel(
    queries: mx.array,
    pool_k: mx.array,
    pool_v: mx.array,
    tables: mx.array,
    context_lens: mx.array,
    scale: float,
    window: int | None = None,
    q_lens: mx.array | None = None,
    *,
    backend: str = "cuda",  # the kernel's own argument; the stand-in serves either
) -> mx.array:
    """The GPU block-table kernel's float64 reference (``gpu_decode.reference_attention``)
    with the kernel's signature: stands in for it off an NVIDIA GPU."""
    out = gpu_decode.reference_attention(
        np.array(queries.astype(mx.float32)),
        np.array(pool_k.astype(mx.float32)),
        np.array(pool_v.astype(mx.float32)),
        np.array(tables),
        np.array(context_lens),
        scale,
        window,
        None if q_lens is None else np.array(q_lens),
    )
    return mx.array(out.astype(np.float32)).astype(queries.dtype)


def traceable_kernel(
    queries: mx.array,
    pool_k: mx.array,
    pool_v: mx.array,
    tables: mx.array,
    context_lens: mx.array,
    scale: float,
    window: int | None = None,
    q_lens: mx.array | None = None,
    *,
    backend: str = "cuda",  # the kernel's own argument; the stand-in serves either
) -> mx.array:
    """The GPU block-table kernel's computation in lazy MLX ops (fp32), with its signature:
    stands in for it off an NVIDIA GPU where the forward is compiled (``mx.compile`` traces
    it, so nothing here may evaluate; :func:`reference_kernel` converts to numpy)."""
    b, _, nq, d = queries.shape
    h, _, bs, dv = pool_v.shape
    width = tables.shape[1] * bs
    k = pool_k[:, tables].transpose(1, 0, 2, 3, 4).reshape(b, h, width, d)
    v = pool_v[:, tables].transpose(1, 0, 2, 3, 4).reshape(b, h, width, dv)
    ends = context_lens.astype(mx.int32)[:, None]
    real = ends * 0 + nq if q_lens is None else q_lens.astype(mx.int32)[:, None]
    rows = mx.minimum(mx.arange(nq, dtype=mx.int32)[None, :], real - 1)
    at = (ends - real + rows)[:, :, None]  # [B, Nq, 1]: each query's position
    keys = mx.arange(width, dtype=mx.int32)[None, None, :]
    seen = keys <= at
    if window is not None:
        seen = mx.logical_and(seen, keys > at - window)
    out = mx.fast.scaled_dot_product_attention(
        queries.astype(mx.float32),
        k.astype(mx.float32),
        v.astype(mx.float32),
        scale=scale,
        mask=seen[:, None],
    )
    return out.astype(queries.dtype)


def route_as_cuda(monkeypatch: Any, kernel: Any = None) -> None:
    """Runners built from now on take the CUDA backend, as on an NVIDIA GPU (its options as
    given; ``attention.cuda``), ``kernel`` (default :func:`traceable_kernel`) standing in for
    the decode kernel: the GPU's routing, the compiled decodes included, on any device."""
    from worker.model import runner as runner_module

    def choose(options: AttentionOptions | None = None) -> CudaBackend:
        options = options or AttentionOptions()
        return CudaBackend(options.prefill_kernel, options.compile_decodes)

    monkeypatch.setattr(gpu_decode, "paged_decode_attention", kernel or traceable_kernel)
    monkeypatch.setattr(runner_module, "choose_backend", choose)


def runs_cuda_attention() -> bool:
    """Whether this machine's runners take the CUDA backend by themselves."""
    return device_backend() == "cuda"
