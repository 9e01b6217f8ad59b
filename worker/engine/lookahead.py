"""Decode lookahead: the next decode step's forward, started before it is asked for.

After a greedy decode-only step that the engine expects to repeat with the same sequences
(``Step.same_next``), the executor starts the next step's forward on the just-sampled tokens
(lazy) before handing them back, so the device computes it while the event loop streams and
schedules; the next step takes its logits if it is that step (:meth:`Ahead.matches`), and
discards them otherwise. Host time per step is what it hides: on a GPU, where a small model's
decode step is bound by building and launching its graph. Off unless the worker's
``--decode-lookahead`` sets it (``ModelExecutor.lookahead``).

Runs on the model thread, inside ``ModelExecutor._run``, which keeps the one pending
:class:`Ahead` between two steps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np

from worker.model.forward_batch import SeqInput

if TYPE_CHECKING:
    from worker.engine.executor import Runner
    from worker.model.sampling import Row

log = logging.getLogger(__name__)


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
    runner: Runner, inputs: Sequence[SeqInput], logits: mx.array
) -> tuple[list[int], Ahead | None]:
    """Starts the forward of the step after this one: the same sequences, one position on, each
    on its greedy token of ``logits``. Its graph is built now, on the lazy tokens, while the
    device still computes this step (the host time it hides), and launched once this step's
    tokens are in: launched at once, it found the pool's buffers still held by this step and
    every pool write copied its layer's whole pool (an H200, 1B model, 32 x 8k: +28.9 GB peak,
    11.8 ms a step against 9.3 launched after; docs/gpu-decode-parts.md). Its K/V writes land
    in each sequence's own leased slot past its computed tokens; if the next step is another,
    they are garbage no one reads, overwritten by later writes (MLX orders every write to the
    pool after the ones before it). Returns the greedy tokens, row by row (this step's
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
    if ahead is None:
        return ids, None
    paged.launch(ahead)
    return ids, Ahead(nxt, tuple(ids), ahead)
