"""Decode lookahead: the next decode step's forward, started before it is asked for.

After a greedy decode-only step that the engine expects to repeat with the same sequences
(``Step.same_next``), the executor starts the next step's forward on the just-sampled tokens
(lazy) before handing them back, so the device computes it while the event loop streams and
schedules; the next step takes its logits if it is that step (:meth:`Ahead.matches`), and
discards them otherwise. What it hides is the device's time past the host's launches: the
next forward may launch only once this one has finished (:func:`start`), so where the device
keeps up with the launches (short contexts) there is nothing to hide and its own work is a
loss; where the device's time runs past them (long contexts) it overlaps that time with the
event loop's work and the next graph's building. :class:`Policy` decides by measuring that
(the worker's ``--decode-lookahead``: auto, on or off).

Runs on the model thread, inside ``ModelExecutor._run``, which keeps the one pending
:class:`Ahead` between two steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np

from worker.model.forward_batch import SeqInput

if TYPE_CHECKING:
    from worker.engine.executor import Runner
    from worker.model.sampling import Row

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")  # the worker's --decode-lookahead (worker.config checks it too)


@dataclass(frozen=True, slots=True)
class Ahead:
    """A decode forward started before its step was asked for: the sequences it decodes and the
    tokens it decodes them on, and its logits, computing."""

    inputs: tuple[SeqInput, ...]  # token_ids are placeholders; ``tokens`` holds the real ones
    tokens: tuple[int, ...]
    logits: mx.array

    def matches(self, inputs: Sequence[SeqInput], block_size: int) -> bool:
        """Whether ``inputs`` are exactly the decodes it computed: the same sequences in the
        same order, each at the same position, on the sampled token, over the same blocks.

        A lease's block table only grows (extensions append; copy-on-write happens before its
        first forward; a new lease is a new ``seq_key``), so the same key has the same blocks
        wherever both tables reach: checking the last block read is enough, and keeps this
        per-step check O(batch), not O(context)."""
        if len(inputs) != len(self.inputs):
            return False
        for got, want, token in zip(inputs, self.inputs, self.tokens, strict=True):
            last = want.start // block_size  # the block the forward wrote and read last
            if (
                got.seq_key != want.seq_key
                or got.start != want.start
                or len(got.token_ids) != 1
                or got.token_ids[0] != token
                or len(got.block_table) <= last
                or got.block_table[last] != want.block_table[last]
            ):
                return False
        return True


def fits(runner: Runner, inputs: Sequence[SeqInput], rows: Sequence[Row]) -> bool:
    """Whether a decode forward of ``inputs`` may start the next one: the paged runner, every
    row sampled greedily (its token is known without a draw: the argmax of its logits, after
    the bias, penalties and grammar mask that the state known now decides), and every
    sequence's lease covering its next token."""
    bs = runner.block_size
    return (
        len(rows) == len(inputs)
        and runner.kind == "paged"
        and all(r[1].batch_greedy for r in rows)
        and all(s.start + 2 <= len(s.block_table) * bs for s in inputs)
    )


def start(
    runner: Runner,
    inputs: Sequence[SeqInput],
    logits: mx.array,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> tuple[list[int], Ahead | None]:
    """Starts the forward of the step after this one: the same sequences, one position on, each
    on its greedy token of ``logits``. Its graph is built now, on the lazy tokens, while the
    device still computes this step (the host time it hides), and launched once this step's
    tokens are in: launched at once, it found the pool's buffers still held by this step and
    every pool write copied its layer's whole pool (an H200, 1B model, 32 x 8k: +28.9 GB peak,
    11.8 ms a step against 9.3 launched after; docs/gpu-decode-parts.md). Its K/V writes land
    in each sequence's own leased slot past its computed tokens; if the next step is another,
    they are garbage no one reads, overwritten by later writes (MLX orders every write to the
    pool after the ones before it). ``on_tokens`` is called with this step's tokens as soon
    as they are known, before the launch (the next step's grammar masks start filling then:
    ``MaskPrefetch.start_after``). Returns the greedy tokens, row by row (this step's
    samples), and the forward started (None if it could not be built now)."""
    tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    nxt = tuple(SeqInput([0], s.block_table, s.start + 1, s.seq_key) for s in inputs)
    paged = cast(Any, runner)  # the paged runner's
    try:
        ahead = paged.forward_async(nxt, tokens, launch=False)
    except Exception:  # a forward it cannot build now: the next step builds its own
        log.debug("lookahead forward not started", exc_info=True)
        ahead = None
    ids: list[int] = np.asarray(tokens).tolist()  # this step, done
    if on_tokens is not None:
        on_tokens(ids)
    if ahead is None:
        return ids, None
    paged.launch(ahead)
    return ids, Ahead(nxt, tuple(ids), ahead)


@dataclass(slots=True)
class Policy:
    """Whether a step that may look ahead (:func:`fits`, ``Step.same_next``) does: always
    ("on"), never ("off"), or while measured to pay ("auto", on GPUs; on a CPU the device is
    the host's own cores and there is no host time beside the forward to overlap: off).

    "auto" measures the steps that run their own forward (not one started ahead): the
    executor builds it, launches it and waits for it in three timed parts, and reports the
    step's period (from the previous step's start) and the model thread's idle time before
    it (the event loop's streaming and scheduling). Looking ahead would have saved that
    step ``min(wait, idle + build)``: the device's time past the launches, up to the host
    work it can overlap with (the launches themselves cannot: the next forward launches once
    this one finished). It turns on when the saving's moving average reaches ``on_share`` of
    the period's, off below ``off_share``; while on, every ``probe_every``-th step does not
    look ahead so that the next one runs and measures its own forward again (a probe costs
    that one step's overlap). Measured on H200s (docs/worker-engine.md "Decode lookahead"), a
    1B model at batch 32: at 96-token prompts the saving measured 0.01 ms of a 7-8 ms step,
    and the lookahead gained nothing or lost up to 7%; at 8k-token contexts it measured
    0.4-1.85 ms of 9.5-11 ms (2.9 of 13.5 on a slower host), and the lookahead gained more
    than that (1.04-1.29x: it also saves the step's second wait, for its sampled tokens), so the
    shares are low: what separates the two is whether the device outlasts the launches at
    all."""

    mode: str = "off"
    on_share: float = 0.03
    off_share: float = 0.015
    probe_every: int = 64
    min_samples: int = 8
    alpha: float = 0.2  # the moving averages' weight of a new sample
    active: bool = field(init=False, default=False)
    samples: int = field(init=False, default=0)
    saved_s: float = field(init=False, default=0.0)  # moving averages
    period_s: float = field(init=False, default=0.0)
    switches: int = field(init=False, default=0)  # auto's turns on and off (tests, stats)
    _since_probe: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"decode lookahead must be one of {', '.join(MODES)}")
        self.active = self.mode == "on"

    @classmethod
    def for_device(cls, mode: str, gpu: bool) -> Policy:
        """The worker's policy: "auto" measures on a GPU and is off elsewhere."""
        return cls("off" if mode == "auto" and not gpu else mode)

    @property
    def enabled(self) -> bool:
        """Whether any step may look ahead ("on", or "auto" whenever measured to pay)."""
        return self.mode != "off"

    @property
    def measuring(self) -> bool:
        """Whether steps that run their own forward time its parts for :meth:`measured`."""
        return self.mode == "auto"

    def wants(self) -> bool:
        """Called once for each step that may look ahead: whether it does."""
        if not self.active:
            return False
        if self.mode == "auto":
            self._since_probe += 1
            if self._since_probe >= self.probe_every:
                self._since_probe = 0
                return False
        return True

    def measured(self, idle_s: float, build_s: float, wait_s: float, period_s: float) -> None:
        """One step that may look ahead, run on its own forward: the model thread's idle time
        before it, its graph's build, its wait for the device after the launch, and the time
        from the previous step's start to its own."""
        if not self.measuring or period_s <= 0:
            return
        saved = min(wait_s, idle_s + build_s)
        a = self.alpha if self.samples else 1.0
        self.saved_s += a * (saved - self.saved_s)
        self.period_s += a * (period_s - self.period_s)
        self.samples += 1
        if self.samples < self.min_samples:
            return
        share = self.saved_s / self.period_s
        turn = share >= self.on_share if not self.active else share < self.off_share
        if turn:
            self.active = not self.active
            self.switches += 1
            self._since_probe = 0
            log.info(
                "decode lookahead %s: a step's device time past its launches would save "
                "%.2f ms of %.2f ms (%.0f%%)",
                "on" if self.active else "off",
                1e3 * self.saved_s,
                1e3 * self.period_s,
                100 * share,
            )
