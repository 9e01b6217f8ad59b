"""Batched paged forwards of a tiny model against dense per-sequence mlx-lm, recorded, not asserted.

Each scenario drives :class:`worker.model.runner.ModelRunner` the way the engine does (block size
8, so prompts span several blocks; decode attention from the pool blocks, the CPU default) and
every sequence alone on mlx-lm's own caches (``tests.worker.helpers.DenseSeq``). A forward's
logits are compared at every position it computes; greedy decoding feeds the dense path's token to
both sides, so one mismatch is recorded and the scenario still runs to its end.

:data:`FAST` is one composite scenario that covers 1, 2 and 3 sequences of different lengths in
one step, prefill chunks mixed with decodes and a copy-on-write shared prefix; :data:`FULL` adds
each case on its own, an aligned shared prefix, a longer chunked prefill and preempt-and-resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tests.worker.helpers import (
    TOL,
    DenseSeq,
    PagedSeq,
    max_diff,
    prompts,
    reference_kernel,
    traceable_kernel,
)
from worker.model import mlx_fixes
from worker.model.attention import gpu_decode, gpu_prefill
from worker.model.attention.cuda import CudaBackend
from worker.model.runner import ModelRunner

BS = 8
NUM_BLOCKS = 64


@dataclass
class Check:
    """The worst logit difference and the greedy-token mismatches seen so far, and the decode
    path the scenario's runner takes ("blocks", or "kernel": ``worker.model.cpu_decode``;
    ``ModelRunner.choose_decode_attention`` picks one at start; or "gpu": the NVIDIA GPU's
    attention routing, the block-table kernel's float64 reference standing in for it)."""

    decode: str = "blocks"
    worst: float = 0.0
    mismatches: list[str] = field(default_factory=list)

    def logits(self, paged: mx.array, dense: mx.array) -> None:
        self.worst = max(self.worst, max_diff(paged, dense))

    def tokens(self, where: str, paged: mx.array, dense: mx.array) -> int:
        """Compare greedy tokens at one position; return the dense one (both sides go on)."""
        want = int(mx.argmax(dense))
        got = int(mx.argmax(paged))
        if got != want:
            self.mismatches.append(f"{where}: {got} != {want}")
        return want


class _Scene:
    """A runner and the paged and dense state of named sequences."""

    def __init__(self, model: nn.Module, check: Check) -> None:
        self.model = model
        self.check = check
        attention = CudaBackend() if check.decode == "gpu" else None
        self.runner = ModelRunner.create(
            model, block_size=BS, num_blocks=NUM_BLOCKS, attention=attention
        )
        if check.decode == "kernel":
            self.runner.attention.decode_path = "kernel"
        self.paged: dict[str, PagedSeq] = {}
        self.dense: dict[str, DenseSeq] = {}
        self.pos: dict[str, int] = {}  # prompt positions the paged side has computed

    def add(self, name: str, prompt: list[int], table: Sequence[int], cached: int = 0) -> None:
        self.paged[name] = PagedSeq.cached(prompt, table, cached)
        self.dense[name] = DenseSeq(self.model, prompt)
        self.pos[name] = cached

    def forward(self, plan: dict[str, int | None], label: str) -> None:
        """One batched forward: ``plan`` maps a sequence to the prompt tokens it computes now
        (``None``: all left), or to 0 for a decode step; every position is compared."""
        inputs = []
        for name, n in plan.items():
            seq = self.paged[name]
            if n == 0:  # decode: the dense side picks the token
                token = int(mx.argmax(self.dense[name].logits))
                seq.push(token)
                inputs.append(seq.take())
            else:
                inputs.append(seq.take(n))
        outputs = self.runner.forward_all(inputs)
        for (name, n), out, given in zip(plan.items(), outputs, inputs, strict=True):
            dense = self.dense[name]
            if n == 0:
                want = dense.step(given.token_ids[0])
                self.check.logits(out[0], want)
                self.check.tokens(f"{label}/{name}", out[0], want)
            else:
                start = self.pos[name]
                ref = dense.logits_all[start : start + out.shape[0]]
                self.pos[name] = start + out.shape[0]
                self.check.logits(out, ref)
                if self.pos[name] == len(dense.logits_all):  # prompt done: its next token
                    self.check.tokens(f"{label}/{name}", out[-1], ref[-1])

    def decode(self, names: Sequence[str], steps: int, label: str) -> None:
        for step in range(steps):
            self.forward(dict.fromkeys(names, 0), f"{label}{step}")


def _blocks(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def composite(model: nn.Module, steps: int, check: Check) -> None:
    """Five forwards that cover most of the sweep at once::

    1: a (20: a 12-token prefix and its own 8)            one sequence
    2: a decode | b (prefix, copy-on-write) | c chunk 1   three, mixed prefill and decode
    3: b decode | c chunk 2                               two, a chunk beside a decode
    4+: a, b, c decode together
    """
    rng = np.random.default_rng(10)
    prefix, tail_a, tail_b, c = prompts(rng, 12, 8, 5, 23)
    scene = _Scene(model, check)
    scene.add("a", prefix + tail_a, _blocks(0, 6))
    scene.forward({"a": None}, "prefill")
    # b shares block 0 whole; block 1 holds 4 prefix tokens and a's own after them: copied.
    scene.runner.copy_blocks([(1, 20)])
    scene.add("b", prefix + tail_b, [0, 20, *_blocks(21, 4)], cached=len(prefix))
    scene.add("c", c, _blocks(30, 6))
    scene.forward({"a": 0, "b": None, "c": 9}, "mixed")
    scene.forward({"b": 0, "c": None}, "chunk")
    scene.decode(["a", "b", "c"], steps, "decode")


def one(model: nn.Module, steps: int, check: Check) -> None:
    (p,) = prompts(np.random.default_rng(11), 13)
    scene = _Scene(model, check)
    scene.add("a", p, [9, 3, 40, 17, 22, 5])  # scattered on purpose
    scene.forward({"a": None}, "prefill")
    scene.decode(["a"], steps, "decode")


def _batch(lengths: Sequence[int], seed: int) -> Callable[[nn.Module, int, Check], None]:
    def run(model: nn.Module, steps: int, check: Check) -> None:
        ps = prompts(np.random.default_rng(seed), *lengths)
        scene = _Scene(model, check)
        names = [f"s{i}" for i in range(len(ps))]
        for i, (name, p) in enumerate(zip(names, ps, strict=True)):
            scene.add(name, p, _blocks(10 * i, 9))
        scene.forward(dict.fromkeys(names), "prefill")
        scene.decode(names, steps, "decode")

    return run


def mixed(model: nn.Module, steps: int, check: Check) -> None:
    """A decoding sequence joined by two prefills in one forward."""
    pa, pb, pc = prompts(np.random.default_rng(12), 14, 9, 27)
    scene = _Scene(model, check)
    scene.add("a", pa, _blocks(0, 8))
    scene.forward({"a": None}, "prefill")
    scene.decode(["a"], 2, "solo")
    scene.add("b", pb, _blocks(10, 8))
    scene.add("c", pc, _blocks(20, 8))
    scene.forward({"a": 0, "b": None, "c": None}, "join")
    scene.decode(["a", "b", "c"], steps, "decode")


def _shared_prefix(prefix_len: int, seed: int) -> Callable[[nn.Module, int, Check], None]:
    def run(model: nn.Module, steps: int, check: Check) -> None:
        prefix, tail_a, tail_b = prompts(np.random.default_rng(seed), prefix_len, 6, 9)
        scene = _Scene(model, check)
        scene.add("a", prefix + tail_a, _blocks(0, 8))
        scene.forward({"a": None}, "prefill")
        scene.decode(["a"], 2, "solo")
        full, part = divmod(prefix_len, BS)
        table = _blocks(0, full)
        if part:  # the partial block holds a's tokens after the prefix: copy on write
            scene.runner.copy_blocks([(full, 30)])
            table.append(30)
        scene.add("b", prefix + tail_b, table + _blocks(31, 8 - len(table)), cached=prefix_len)
        scene.forward({"a": 0, "b": None}, "shared")
        scene.decode(["a", "b"], steps, "decode")

    return run


def chunked(model: nn.Module, steps: int, check: Check) -> None:
    """A 41-token prompt in chunks whose edges fall inside blocks, beside a decoding sequence."""
    pa, pc = prompts(np.random.default_rng(13), 7, 41)
    scene = _Scene(model, check)
    scene.add("a", pa, _blocks(0, 8))
    scene.add("c", pc, _blocks(10, 8))
    scene.forward({"a": None, "c": 13}, "chunk0")
    for i, size in enumerate((1, 20, 7)):
        scene.forward({"a": 0, "c": size}, f"chunk{i + 1}")
    scene.decode(["a", "c"], steps, "decode")


def preempt_resume(model: nn.Module, steps: int, check: Check) -> None:
    """Preempt and resume, as the engine does: ``a`` prefills and decodes, is preempted (its
    full blocks stay cached, the partial tail is dropped), then resumes as a new sequence whose
    prompt is everything it had, reusing its full blocks and recomputing the tail, in a batch
    with a decoding ``b``; it must continue as dense mlx-lm does on the whole text."""
    pa, pb = prompts(np.random.default_rng(18), 12, 9)  # a: 15 tokens, a partial tail
    scene = _Scene(model, check)
    scene.add("a", pa, _blocks(0, 8))
    scene.add("b", pb, _blocks(10, 6))
    scene.forward({"a": None, "b": None}, "prefill")
    scene.decode(["a", "b"], max(2, steps // 2), "before")
    text = list(scene.paged["a"].tokens)
    token = int(mx.argmax(scene.dense["a"].logits))  # what the preempted step would have sampled
    cached = len(text) // BS * BS
    scene.add("a2", [*text, token], _blocks(0, 8), cached=cached)
    scene.forward({"a2": None, "b": 0}, "resume")
    scene.decode(["a2", "b"], steps, "after")


Scenario = Callable[[nn.Module, int, Check], None]

FAST: dict[str, Scenario] = {"composite": composite}
FULL: dict[str, Scenario] = {
    "one": one,
    "two": _batch((5, 19), 14),
    "three": _batch((3, 11, 26), 15),
    "mixed": mixed,
    "prefix_aligned": _shared_prefix(2 * BS, 16),
    "prefix_cow": _shared_prefix(2 * BS + 3, 17),
    "chunked": chunked,
    "preempt_resume": preempt_resume,
    "composite": composite,
}


@dataclass(frozen=True, slots=True)
class Parity:
    """One family's result over a set of scenarios."""

    max_diff: float
    mismatches: tuple[str, ...]  # greedy tokens that differed, "scenario/step/seq: got != want"
    error: str  # the first exception a scenario raised, "" if none

    @property
    def tokens_identical(self) -> bool:
        return not self.mismatches and not self.error

    @property
    def passed(self) -> bool:
        return self.tokens_identical and self.max_diff <= TOL


def run_parity(
    model: nn.Module, scenarios: dict[str, Scenario], steps: int, decode: str = "blocks"
) -> Parity:
    """Every scenario on ``model``, decodes by ``decode`` ("blocks", "kernel" or "gpu"), each
    on recycled memory (``mlx_fixes.dirty_buffer_cache``: a kernel reading memory it did not
    write shows, as mlx-cuda's sorted ``gather_mm`` did only deep into a full sweep)."""
    worst = 0.0
    mismatches: list[str] = []
    with _gpu_routing(decode == "gpu"):
        for name, scenario in scenarios.items():
            check = Check(decode)
            mlx_fixes.dirty_buffer_cache(
                max_bytes=None if mx.default_device() == mx.gpu else 1 << 20
            )
            try:
                scenario(model, steps, check)
            except Exception as e:  # recorded: the family fails, the sweep goes on
                return Parity(max(worst, check.worst), tuple(mismatches), f"{name}: {e!r}")
            worst = max(worst, check.worst)
            mismatches += [f"{name}/{m}" for m in check.mismatches]
    return Parity(worst, tuple(mismatches), "")


@contextlib.contextmanager
def _gpu_routing(on: bool) -> Iterator[None]:
    """With ``on`` (the scenes' runners then take the CUDA backend, ``attention.cuda``: decodes
    to the block-table kernel, prefill chunks to the block-table prefill kernel, or to the
    exact-context path once their shapes recur), references standing in for both
    kernels (the decode kernel's in lazy MLX ops, so that decodes run compiled as on a GPU:
    ``worker.model.compiled_decode``; the prefill kernel's in float64), the prefill kernel's
    dtype and head-dim limits opened to the tiny fp32 models."""
    if not on:
        yield
        return
    with (
        mock.patch.object(gpu_decode, "paged_decode_attention", traceable_kernel),
        mock.patch.object(gpu_prefill, "paged_prefill_attention", reference_kernel),
        mock.patch.object(gpu_prefill, "DTYPES", (*gpu_prefill.DTYPES, mx.float32)),
        mock.patch.object(gpu_prefill, "HEAD_DIMS", tuple(range(8, 257, 8))),
    ):
        yield


def context_sensitive(model: nn.Module, steps: int = 6) -> bool:
    """Whether greedy decoding follows the prompt: three prompts give three different
    continuations, and not all of one token (a model that collapses would pass any parity)."""
    outs = []
    for p in prompts(np.random.default_rng(20), 9, 9, 9):
        dense = DenseSeq(model, p)
        out = []
        for _ in range(steps):
            out.append(int(mx.argmax(dense.logits)))
            dense.step(out[-1])
        outs.append(tuple(out))
    return len(set(outs)) == len(outs) and all(len(set(o)) > 1 for o in outs)
