"""Startup self-check: one small batch through the paged path against mlx-lm's own dense path.

The paged path runs unmodified mlx-lm models, so a family whose attention consumes the cache's
offsets or mask in a way the pool does not anticipate gives wrong logits, silently (gemma2 did,
before masks followed ``ModelSpec.mask_rank``). So before a worker serves a model it runs, on its
own pool, the situations a batch meets::

    step 1   A: prefix (one full block + 3 tokens)                       prefill from 0
    step 2   A: 4 more tokens after its prefix                          prefill continuing
             B: 6 tokens after A's first block, shared (read in place)  prefill on a reused prefix
             C: 20 tokens                                               prefill from 0
    step 3   A, B, C: one token each                                    decode, contexts differ

(C's 20 tokens are more than the 17 queries a sequence the decode kernels take, so step 2 runs
the batch through the prefill path that serves longer prompts) and compares every sequence's
last logits, at steps 2 and 3, with the same tokens run one
sequence at a time through ``make_prompt_cache(model)`` (the dense ``KVCache`` path). A
difference above the tolerance, or a forward that raises, refuses the model.

It writes pool blocks, so it must run before the pool is registered (no lease exists yet, as
for ``worker.warmup``) or on a runner of its own. The decode inputs are the dense path's greedy
tokens, so both paths see the same tokens even where half-precision rounding would flip a
near-tie.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from worker.errors import UnsupportedModelError
from worker.model import mlx_fixes
from worker.model.forward_batch import SeqInput
from worker.model.runner import ModelRunner

# fp32: batched and single-sequence attention differ only in summation order (measured on the
# tiny test models: <= 2e-5); a mask that lets padding through differs by whole units (5.5).
# Half precision rounds every layer's activations, so its tolerance is a fraction of the largest
# logit: a few units of rounding (fp16 2^-11, bf16 2^-8) grown over the layers. On CPU the
# tiny models' half-precision paths agreed exactly; a broken mask still differed by 1.8-5.2.
FP32_TOLERANCE = 1e-3
HALF_TOLERANCE = {mx.float16: 1e-2, mx.bfloat16: 5e-2}
STANDALONE_BLOCK_SIZE = 8  # several blocks per sequence, a shared one and a partial tail
PAGED_SCENARIO = "paged vs dense mlx-lm, 3 sequences (prefill, shared prefix, decode)"


@dataclass(frozen=True, slots=True)
class SelfCheckResult:
    """What :func:`check_paged_parity` found. ``ok`` unless the logits differed by more than
    ``tolerance`` or a forward raised (``error``, one line)."""

    max_diff: float
    tolerance: float
    seconds: float
    error: str = ""
    scenario: str = PAGED_SCENARIO  # what was compared, for the log
    path: str = "paged"  # the worker's path that was checked against mlx-lm's

    @property
    def ok(self) -> bool:
        return not self.error and self.max_diff <= self.tolerance

    @property
    def reason(self) -> str:
        """One line: why the model is refused (empty if it is not)."""
        if self.error:
            return f"the {self.path} self-check forward failed: {self.error}"
        if not self.ok:
            return (
                f"the {self.path} path's logits differ from mlx-lm's dense path by "
                f"{self.max_diff:.3g} (tolerance {self.tolerance:.3g}): {self.scenario}"
            )
        return ""

    def describe(self) -> str:
        verdict = "passed" if self.ok else "FAILED"
        detail = f"error: {self.error}" if self.error else f"max logit diff {self.max_diff:.3g}"
        return (
            f"self-check {verdict}: {self.scenario}, {detail} "
            f"(tolerance {self.tolerance:.3g}) in {self.seconds:.2f} s"
        )

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise UnsupportedModelError(self.reason)


def tf32_matmuls() -> bool:
    """Whether MLX runs this process's float32 matmuls (and attention) at TF32 precision: on
    a GPU unless ``MLX_ENABLE_TF32=0`` (MLX's default is on). TF32 keeps fp16's 10-bit
    mantissa, so paged and dense fp32 differ by as much as fp16 does (H100, the default model:
    0.0086, where the CPU's fp32 agrees to 2e-5)."""
    return mx.default_device() == mx.gpu and os.environ.get("MLX_ENABLE_TF32", "1") != "0"


def tolerance_for(dtype: mx.Dtype, logit_scale: float = 1.0) -> float:
    """Largest logit difference accepted: :data:`FP32_TOLERANCE` for fp32; for fp16 and bf16,
    and for fp32 run as TF32 (:func:`tf32_matmuls`), a fraction of the largest logit (at
    least 1)."""
    if dtype == mx.float32 and tf32_matmuls():
        dtype = mx.float16  # the same mantissa
    if dtype in HALF_TOLERANCE:
        return HALF_TOLERANCE[dtype] * max(1.0, logit_scale)
    return FP32_TOLERANCE


def check_paged_parity(
    model: nn.Module, *, runner: ModelRunner | None = None, tolerance: float | None = None
) -> SelfCheckResult:
    """Run the batch above through ``runner`` (default: a small pool of its own for ``model``,
    block size 8) and through mlx-lm's dense caches; compare the logits.

    ``runner`` must run ``model``, and its pool blocks are overwritten: pass the worker's runner
    only before its pool is registered (a pool too small for the batch is replaced by a small
    one of the same block size). ``tolerance`` defaults to :func:`tolerance_for` the model's
    dtype. Raises UnsupportedModelError only where building a runner does (layers a paged cache
    cannot hold, no mask layout that fits); anything a forward raises is in the result.
    """
    t0 = time.perf_counter()
    block_size = runner.block_size if runner is not None else STANDALONE_BLOCK_SIZE
    tables = _tables(block_size)
    blocks = 1 + max(max(t) for t in tables)
    if runner is None or runner.num_blocks < blocks:
        runner = ModelRunner.create(model, block_size=block_size, num_blocks=blocks)
    plan = _Plan.make(block_size, runner.spec.vocab_size, tables)
    # Recycled memory first: a kernel of this device that reads memory it did not write shows
    # (mlx-cuda's sorted gather_mm did, on the paged side's batched MoE rows only).
    mlx_fixes.dirty_buffer_cache()
    try:
        diffs, scale = plan.compare(model, runner)
    except Exception as e:  # whatever the model raises on the paged or the dense path
        message = str(e).splitlines()[0] if str(e) else ""
        error = f"{type(e).__name__}: {message}" if message else type(e).__name__
        return SelfCheckResult(float("inf"), tolerance or 0.0, time.perf_counter() - t0, error)
    finally:
        mx.clear_cache()
    tol = tolerance if tolerance is not None else tolerance_for(runner.spec.dtype, scale)
    return SelfCheckResult(max(diffs), tol, time.perf_counter() - t0)


_LENGTHS = (4, 6, 20)  # new tokens of A (after the prefix), B (after block 0), C


def reference_prompts(block_size: int, vocab: int) -> list[list[int]]:
    """The three prompts the check runs through mlx-lm's dense path for a pool of
    ``block_size`` (the kernel-precompile children run the same: ``worker.precompile``)."""
    return _Plan.make(block_size, vocab, _tables(block_size)).prompts


def _tables(bs: int) -> tuple[list[int], list[int], list[int]]:
    """Block tables for each prompt and one decoded token; B's first block is A's."""
    ends = (bs + 3 + _LENGTHS[0] + 1, bs + _LENGTHS[1] + 1, _LENGTHS[2] + 1)
    need = [-(-e // bs) for e in ends]
    ids = iter(range(sum(need)))
    a = [next(ids) for _ in range(need[0])]
    b = a[:1] + [next(ids) for _ in range(need[1] - 1)]
    c = [next(ids) for _ in range(need[2])]
    return a, b, c


@dataclass(frozen=True, slots=True)
class _Plan:
    """The three sequences' tokens and block tables (see the module docstring)."""

    block_size: int
    prefix: list[int]  # one block and 3 tokens
    tails: tuple[list[int], list[int], list[int]]
    tables: tuple[list[int], list[int], list[int]]

    @classmethod
    def make(cls, bs: int, vocab: int, tables: tuple[list[int], list[int], list[int]]) -> _Plan:
        rng = np.random.default_rng(0)
        prefix = rng.integers(0, vocab, bs + 3).tolist()
        tail_a, tail_b, prompt_c = (rng.integers(0, vocab, n).tolist() for n in _LENGTHS)
        return cls(bs, prefix, (tail_a, tail_b, prompt_c), tables)

    @property
    def starts(self) -> tuple[int, int, int]:
        return len(self.prefix), self.block_size, 0

    @property
    def prompts(self) -> list[list[int]]:
        heads: tuple[list[int], ...] = (self.prefix, self.prefix[: self.block_size], [])
        return [h + t for h, t in zip(heads, self.tails, strict=True)]

    def compare(self, model: nn.Module, runner: ModelRunner) -> tuple[list[float], float]:
        """Largest difference per compared row, and the largest dense logit (for the tolerance)."""
        runner.forward([SeqInput(self.prefix, self.tables[0], 0)])
        prefill = runner.forward(
            [
                SeqInput(tail, table, start)
                for tail, table, start in zip(self.tails, self.tables, self.starts, strict=True)
            ]
        )
        dense = [DenseSequence(model, p) for p in self.prompts]
        tokens = [int(mx.argmax(d.logits)) for d in dense]
        decode = runner.forward(
            [
                SeqInput([t], table, len(p))
                for t, table, p in zip(tokens, self.tables, self.prompts, strict=True)
            ]
        )
        reference = [d.logits for d in dense]
        reference += [d.step(t) for d, t in zip(dense, tokens, strict=True)]
        got = [*prefill, *decode]
        diffs = [float(mx.abs(g - r).max()) for g, r in zip(got, reference, strict=True)]
        return diffs, max(float(mx.abs(r).max()) for r in reference)


class DenseSequence:
    """One sequence on ``make_prompt_cache(model)``: the whole prompt in one call, then steps
    (the reference both self-checks compare against)."""

    def __init__(self, model: nn.Module, prompt: list[int]) -> None:
        self.model = model
        self.cache = make_prompt_cache(model)
        self.logits = self._run(prompt)

    def step(self, token: int) -> mx.array:
        self.logits = self._run([token])
        return self.logits

    def _run(self, tokens: list[int]) -> mx.array:
        out = self.model(mx.array([tokens]), cache=self.cache)[0, -1].astype(mx.float32)
        mx.eval(out)
        return out
