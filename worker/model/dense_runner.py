"""The fallback for models whose layers keep recurrent state: one dense mlx-lm cache per sequence.

Recurrent and SSM layers (mamba, rwkv7, the linear-attention layers of qwen3_next, ...) keep a
fixed-size state per sequence (``ArraysCache``) that blocks of per-token K/V cannot hold, and
hybrids mix them with attention layers (``KVCache``, ``RotatingKVCache``, some inside a
``CacheList``). mlx-lm serves them with ``make_prompt_cache(model)``; so does this runner, one
cache per running sequence, fed exactly the tokens the engine schedules. It speaks the
executor's runner interface (``forward``, ``copy_blocks``, ``retain``, ``block_size``,
``num_blocks``, ``spec``), so the engine, its continuous batching, chunked prefill, leases and
cancellation are the paged path's.

A sequence's cache, by the lease that runs it (``SeqInput.seq_key``)::

    forward(start=0)       a fresh cache (a new lease: admission, or re-admission after a
                           preemption or an expiry; nothing is ever cached across leases)
    forward(start=n)       continues the cache only if it holds exactly n tokens; anything
                           else is a bookkeeping bug and the step fails (BatchError)
    retain(live lease ids) drops every other cache: finished, cancelled, preempted

What is not there, compared with the paged path: no prefix is shared or reused (the worker runs
with prefix caching off and publishes no block to the cache service's index: an index entry
would point at blocks holding nothing), and each sequence runs its own forward (mlx-lm's batched
caches left-pad, which changes recurrent state; one forward per sequence is exactly mlx-lm's
``generate_step``). The leases still bound how many tokens are in flight; the caller chooses
the block count (``worker.device_defaults.dense_limits``) and hands the runner plain values.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from worker.errors import BatchError
from worker.model import mlx_fixes
from worker.model.forward_batch import SeqInput
from worker.model.self_check import FP32_TOLERANCE, DenseSequence, SelfCheckResult, tolerance_for
from worker.model.spec import LayerSpec, ModelSpec, cache_leaves, describe_caches


@dataclass(frozen=True, slots=True)
class StateEstimate:
    """What one sequence's dense cache costs, read from the shapes of a one-token lazy forward
    (nothing is computed).

    ``bytes_per_token``: K and V of the attention layers, per token (a ``RotatingKVCache`` is
    counted as if it kept every token: an overestimate past its window). ``bytes_per_sequence``:
    the recurrent state, fixed whatever the length. Not counted: mlx-lm's ``KVCache`` grows in
    steps of 256 tokens, so a sequence may hold up to 255 tokens of slack per attention layer.
    """

    spec: ModelSpec  # the attention layers' K/V shapes (none for a pure SSM), dtype, vocabulary
    bytes_per_token: int
    bytes_per_sequence: int
    caches: str  # the cache types, for the log: "ArraysCache, KVCache"

    def describe(self) -> str:
        return (
            f"recurrent state: caches {self.caches}; {self.bytes_per_sequence / 2**20:.2f} MiB "
            f"per sequence + {self.bytes_per_token} bytes per token"
        )


def estimate_state(model: nn.Module) -> StateEstimate:
    cache = make_prompt_cache(model)
    logits = model(mx.zeros((1, 1), dtype=mx.int32), cache=cache)
    layers, per_token, per_seq = [], 0, 0
    dtype: mx.Dtype | None = None
    for leaf in (leaf for c in cache for leaf in cache_leaves(c)):
        if isinstance(leaf, ArraysCache):
            cells: list[Any] = list(leaf.cache)  # None where a state is not set yet
            arrays = [a for a in cells if isinstance(a, mx.array)]
            per_seq += sum(a.nbytes for a in arrays)
            dtype = dtype or next((a.dtype for a in arrays), None)
        elif getattr(leaf, "keys", None) is not None:
            k, v = leaf.keys, leaf.values
            layers.append(LayerSpec(k.shape[1], k.shape[3], v.shape[3]))
            per_token += k.shape[1] * (k.shape[3] * k.itemsize + v.shape[3] * v.itemsize)
            dtype = k.dtype
    spec = ModelSpec(tuple(layers), dtype or logits.dtype, logits.shape[-1])
    return StateEstimate(spec, per_token, per_seq, describe_caches(cache))


@dataclass(slots=True)
class _SeqCache:
    cache: list[Any]  # make_prompt_cache(model)
    tokens: int  # tokens the cache holds


class DenseRunner:
    """The runner of a model with recurrent state: one ``make_prompt_cache`` per sequence (see
    the module docstring). Like ModelRunner, all calls come from the model thread."""

    kind = "dense"

    def __init__(
        self, model: nn.Module, estimate: StateEstimate, *, block_size: int, num_blocks: int
    ) -> None:
        self.model = model
        self.estimate = estimate
        self.spec = estimate.spec
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._caches: dict[int, _SeqCache] = {}
        mlx_fixes.install()  # kernels a device computes wrong (CUDA: sorted gather_mm)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def bytes_per_block(self) -> int:
        """The KV budget a block stands for (its tokens' K and V; recurrent state is apart)."""
        return self._block_size * self.estimate.bytes_per_token

    @property
    def live_sequences(self) -> int:
        return len(self._caches)

    def describe(self) -> str:
        return f"runner: dense per-sequence ({self.estimate.describe()})"

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Nothing to copy: leases taken without prefix matching carry no copy-on-write pairs,
        and the warm-up's pairs are about the pool's contents, which do not exist here."""

    def retain(self, keys: Collection[int]) -> None:
        """Drop the caches of every sequence not in ``keys`` (the running leases)."""
        for key in [k for k in self._caches if k not in keys]:
            del self._caches[key]

    def forward(self, seqs: Sequence[SeqInput]) -> mx.array:
        """Run each sequence on its own cache; fp32 logits ``[B, vocab]`` at each last token."""
        if not seqs:
            raise BatchError("a forward needs at least one sequence")
        return mx.stack([self._forward_one(i, s) for i, s in enumerate(seqs)])

    def forward_all(self, seqs: Sequence[SeqInput]) -> list[mx.array]:
        """fp32 logits ``[len(token_ids), vocab]`` at every position of each sequence: what
        prompt logprobs read. (Speculative decoding, the paged runner's other caller, is
        refused on this runner: a recurrent state cannot roll rejected drafts back.)"""
        if not seqs:
            raise BatchError("a forward needs at least one sequence")
        return [self._forward_one(i, s, every=True) for i, s in enumerate(seqs)]

    def _forward_one(self, i: int, s: SeqInput, every: bool = False) -> mx.array:
        vocab = self.spec.vocab_size
        if min(s.token_ids) < 0 or max(s.token_ids) >= vocab:
            raise BatchError(f"sequence {i}: token ids outside 0..{vocab - 1}")
        if s.seq_key is None:
            entry = self._scratch(s.start)
        else:
            # Out of the dict while it runs: a forward that raises leaves no half-fed cache.
            found = self._caches.pop(s.seq_key, None)
            if s.start == 0:
                entry = _SeqCache(make_prompt_cache(self.model), 0)
            elif found is None or found.tokens != s.start:
                held = "no cache" if found is None else f"a cache of {found.tokens} tokens"
                raise BatchError(
                    f"sequence {i} (key {s.seq_key}) continues at token {s.start} but has {held}"
                )
            else:
                entry = found
        logits = self._step(entry, list(s.token_ids), every)
        if s.seq_key is not None:
            self._caches[s.seq_key] = entry
        return logits

    def _scratch(self, start: int) -> _SeqCache:
        """A throwaway cache of ``start`` zero tokens, for a keyless input (the warm-up, which
        exercises shapes: its contexts' contents do not matter, as for a pool's blocks)."""
        entry = _SeqCache(make_prompt_cache(self.model), 0)
        if start:
            self._step(entry, [0] * start)
        return entry

    def _step(self, entry: _SeqCache, tokens: list[int], every: bool = False) -> mx.array:
        """The last token's logits (``every``: each token's)."""
        logits = self.model(mx.array([tokens]), cache=entry.cache)[0]
        out = (logits if every else logits[-1]).astype(mx.float32)
        # Evaluated with the state, as mlx-lm's generate_step does: no graph outlives the step.
        mx.eval(out, [c.state for c in entry.cache])
        entry.tokens += len(tokens)
        return out


# -- startup self-check -------------------------------------------------------------------------

_CHUNKS = (5, 8, 3)  # A's prompt, fed as three prefill chunks
_PROMPT_B = 9
_CHECK_KEYS = (-1, -2)  # never a lease id


def check_dense_parity(model: nn.Module, runner: DenseRunner) -> SelfCheckResult:
    """The runner's chunked prefill and decode against one-shot mlx-lm on the same model::

        forward 1   A: 5 tokens from 0            B: 9 tokens from 0
        forward 2   A: 8 more                     B: 1 decode
        forward 3   A: 3 more                     (B idle: its cache must survive)
        forward 4   A: 1 decode                   B: 1 decode

    Catches a layer whose state does not continue across calls (chunked prefill) and caches
    that leak between sequences of one forward. Leaves no cache behind."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    vocab = runner.spec.vocab_size
    prompt_a = rng.integers(0, vocab, sum(_CHUNKS)).tolist()
    prompt_b = rng.integers(0, vocab, _PROMPT_B).tolist()
    ka, kb = _CHECK_KEYS
    scenario = "dense per-sequence vs one-shot mlx-lm, 2 sequences (chunked prefill, decode)"
    mlx_fixes.dirty_buffer_cache()  # a kernel reading memory it did not write shows
    try:
        ref_a, ref_b = DenseSequence(model, prompt_a), DenseSequence(model, prompt_b)
        tok_a, tok_b = int(mx.argmax(ref_a.logits)), int(mx.argmax(ref_b.logits))
        b0 = ref_b.logits
        b1 = ref_b.step(tok_b)
        next_b = int(mx.argmax(b1))
        got, want = [], []
        c1, c2 = _CHUNKS[0], _CHUNKS[0] + _CHUNKS[1]
        out = runner.forward([SeqInput(prompt_a[:c1], [0], 0, ka), SeqInput(prompt_b, [1], 0, kb)])
        got.append(out[1])
        want.append(b0)
        out = runner.forward(
            [SeqInput(prompt_a[c1:c2], [0], c1, ka), SeqInput([tok_b], [1], _PROMPT_B, kb)]
        )
        got.append(out[1])
        want.append(b1)
        out = runner.forward([SeqInput(prompt_a[c2:], [0], c2, ka)])
        got.append(out[0])
        want.append(ref_a.logits)
        out = runner.forward(
            [
                SeqInput([tok_a], [0], len(prompt_a), ka),
                SeqInput([next_b], [1], _PROMPT_B + 1, kb),
            ]
        )
        got += [out[0], out[1]]
        want += [ref_a.step(tok_a), ref_b.step(next_b)]
        diffs = [float(mx.abs(g - w).max()) for g, w in zip(got, want, strict=True)]
        scale = max(float(mx.abs(w).max()) for w in want)
    except Exception as e:  # whatever the model raises
        message = str(e).splitlines()[0] if str(e) else ""
        error = f"{type(e).__name__}: {message}" if message else type(e).__name__
        seconds = time.perf_counter() - t0
        return SelfCheckResult(float("inf"), FP32_TOLERANCE, seconds, error, scenario, "dense")
    finally:
        runner.retain(())
        mx.clear_cache()
    tol = tolerance_for(runner.spec.dtype, scale)
    return SelfCheckResult(max(diffs), tol, time.perf_counter() - t0, "", scenario, "dense")
