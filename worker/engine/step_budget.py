"""How many prefill tokens the next step may take: so that no step outlasts a fraction of the
lease TTL, and, while sequences decode, so that their tokens keep coming at the decode pace.

The pool stays alive only while some call reaches the cache service at least once per TTL, and
every call is made by the event loop. MLX releases the GIL while it computes (measured: the loop
stalled at most ~11 ms during a 9.5 s forward), so a long forward does not stop heartbeats by
itself; but a forward that holds the GIL (a C extension or a backend that keeps it) stops every
Python thread of the process, the loop and any heartbeat thread alike. A bounded step is the
one defence that covers both: the loop gets the GIL back within `TTL_FRACTION` of the TTL.

The second cap is latency. A step runs its decodes and its prefill chunks as two forwards
(worker.engine.executor), so every decoding sequence waits for the prefill forward before its
next token: with 256-token chunks on a CPU that is several decode steps' worth (a 77M model:
~85 ms a batch-32 decode, ~650 ms a 256-token chunk), and the inter-token latency of every
stream jumps whenever a prompt arrives. vLLM and SGLang bound it with a token budget per step
(decodes first, prefill chunked into what is left); here the budget is chosen by measured
time instead of a fixed count, because the same count costs 10x more on one device than on
another: beside decodes, the prefill forward may take at most ``itl_ratio - 1`` times the
decode forward, so a decoding sequence's step takes at most ``itl_ratio`` times a decode-only
step (one block a step at least, so a prompt always progresses). Without decodes the prefill
gets the whole budget. The prefill forward's time is modelled as fixed + per-token cost
(fitted on recent forwards): a forward of few tokens still reads every weight once, and a
per-token average taken from long chunks would promise short ones for free.

It is off unless asked for (``--itl-ratio``): bounding the inter-token latency costs time to
first token, and on a CPU a lot of it. There a prefill forward costs ~60 ms however short (it
reads every weight; a 77M llama, OpenBLAS, 2 cores) against ~2.5 ms a token, so a prompt cut
into one-block chunks computes at about half the rate, and the first sequences to decode make
every later prompt go a block a step. Measured (docs/worker-engine.md, "A latency-bounded
step"): with ``--itl-ratio 2`` the inter-token latency p95 fell 4x on 8 clients sending
1,500-token prompts, but their TTFT p50 rose 4x (8 -> 33 s); a burst of 32 short prompts got
3x the TTFT and 0.84x the tokens/s. Weighing the bound by how many prompts wait (a longer
prefill forward when more sequences wait for their prompt than decode) recovered only part
(TTFT 22 s). An operator with an inter-token latency target sets it; the default serves TTFT
and throughput, as vLLM's and SGLang's fixed token budgets do.

Pure arithmetic on measurements, so it is tested without a model. Owned by the engine, which
feeds it every step's forward times (`observe`) and asks it for the next step's prefill budget.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# A step may take this share of the lease TTL. Heartbeats go every TTL/4 too, so the longest
# silence is about one interval plus one step: half the TTL, with room for an estimate 2x off.
TTL_FRACTION = 0.25
# Weight of the newest measurement. Prefill cost per token grows with the context (attention),
# and a shared machine changes speed: the estimate follows within a step or two.
ALPHA = 0.5
# Prefill forwards the latency cap's cost fit looks back on: a few seconds of steps, so it
# follows a context that grows and a machine whose speed changes.
FIT_WINDOW = 32


@dataclass(frozen=True, slots=True)
class ForwardTime:
    """Seconds the MLX thread spent on one step: its decode forward and its prefill forward
    (each with its sampling), and the prefill forward's padded tokens (chunks x longest)."""

    decode_s: float
    prefill_s: float
    prefill_tokens: int


@dataclass(slots=True)
class StepBudget:
    """Caps a step's padded prefill tokens so that its expected time stays under `target_s`,
    and, beside decodes, under `itl_ratio` times a decode-only step.

    `max_tokens` (--max-step-tokens) stays the upper bound; `min_tokens` (one block) is the
    floor, so every step makes progress however slow the model is. Until the first prefill has
    been timed the cap is that floor: one block measures the speed without risking the TTL.
    """

    max_tokens: int
    min_tokens: int
    target_s: float = math.inf  # set from the lease TTL at registration
    s_per_token: float | None = None  # EWMA of prefill seconds per padded token
    decode_s: float = 0.0  # EWMA of the decode forward's seconds
    itl_ratio: float = 0.0
    """Beside decodes, a step may take this many times a decode-only step (``--itl-ratio``);
    0: no latency cap."""
    decoding_s: float | None = None
    """EWMA of the decode forward's seconds over steps that had decodes."""
    prefills: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=FIT_WINDOW))
    """Recent prefill forwards: (padded tokens, seconds)."""

    def set_ttl(self, lease_ttl_s: float) -> None:
        self.target_s = TTL_FRACTION * lease_ttl_s if lease_ttl_s > 0 else math.inf

    def prefill_tokens(self) -> int:
        """The cap for a step without decodes: the TTL's."""
        floor = min(self.min_tokens, self.max_tokens)
        if math.isinf(self.target_s):
            return self.max_tokens
        if self.s_per_token is None:
            return floor
        fits = (self.target_s - self.decode_s) / max(self.s_per_token, 1e-9)
        if fits >= self.max_tokens:
            return self.max_tokens
        return self._whole_blocks(fits)

    def prefill_tokens_beside_decodes(self) -> int:
        """The cap for a step that decodes too: the TTL's, and the prefill forward at most
        ``itl_ratio - 1`` decode forwards long (see the module docstring)."""
        cap = self.prefill_tokens()
        if self.itl_ratio <= 0 or self.decoding_s is None:
            return cap
        cost = self.prefill_cost()
        if cost is None:  # no prefill timed yet: one block measures it
            return min(cap, self.min_tokens)
        fixed, per_token = cost
        allowed = (self.itl_ratio - 1) * self.decoding_s
        return min(cap, self._whole_blocks((allowed - fixed) / max(per_token, 1e-9)))

    def prefill_cost(self) -> tuple[float, float] | None:
        """A prefill forward's seconds as ``fixed + per_token * tokens``, fitted by least
        squares on the recent forwards (None before any). Where they all had one size, or the
        fit says a forward costs less the longer it is (noise), all of it is per token."""
        if not self.prefills:
            return None
        n = len(self.prefills)
        mean_x = sum(x for x, _ in self.prefills) / n
        mean_y = sum(y for _, y in self.prefills) / n
        var = sum((x - mean_x) ** 2 for x, _ in self.prefills)
        if var > 0:
            slope = sum((x - mean_x) * (y - mean_y) for x, y in self.prefills) / var
            fixed = mean_y - slope * mean_x
            if slope > 0 and fixed >= 0:
                return fixed, slope
            if slope > 0:  # negative fixed cost: a line through the origin
                return 0.0, sum(y for _, y in self.prefills) / sum(x for x, _ in self.prefills)
        return 0.0, mean_y / max(mean_x, 1e-9)

    def observe(self, took: ForwardTime) -> None:
        self.decode_s = _ewma(self.decode_s, took.decode_s)
        if took.decode_s > 0:
            self.decoding_s = (
                took.decode_s if self.decoding_s is None else _ewma(self.decoding_s, took.decode_s)
            )
        if took.prefill_tokens:
            per_token = took.prefill_s / took.prefill_tokens
            self.s_per_token = (
                per_token if self.s_per_token is None else _ewma(self.s_per_token, per_token)
            )
            self.prefills.append((took.prefill_tokens, took.prefill_s))

    def _whole_blocks(self, tokens: float) -> int:
        """``tokens`` down to whole blocks, within [one block, max_tokens]."""
        floor = min(self.min_tokens, self.max_tokens)
        if tokens >= self.max_tokens:
            return self.max_tokens
        return max(floor, int(max(tokens, 0)) // self.min_tokens * self.min_tokens)


def _ewma(old: float, new: float) -> float:
    return ALPHA * new + (1 - ALPHA) * old
