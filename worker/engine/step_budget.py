"""How many prefill tokens the next step may take, so that no step outlasts a fraction of the
lease TTL.

The pool stays alive only while some call reaches the cache service at least once per TTL, and
every call is made by the event loop. MLX releases the GIL while it computes (measured: the loop
stalled at most ~11 ms during a 9.5 s forward), so a long forward does not stop heartbeats by
itself; but a forward that holds the GIL (a C extension or a backend that keeps it) stops every
Python thread of the process, the loop and any heartbeat thread alike. A bounded step is the
one defence that covers both: the loop gets the GIL back within `TTL_FRACTION` of the TTL.

Pure arithmetic on measurements, so it is tested without a model. Owned by the engine, which
feeds it every step's forward times (`observe`) and asks it for the next step's prefill budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A step may take this share of the lease TTL. Heartbeats go every TTL/4 too, so the longest
# silence is about one interval plus one step: half the TTL, with room for an estimate 2x off.
TTL_FRACTION = 0.25
# Weight of the newest measurement. Prefill cost per token grows with the context (attention),
# and a shared machine changes speed: the estimate follows within a step or two.
ALPHA = 0.5


@dataclass(frozen=True, slots=True)
class ForwardTime:
    """Seconds the MLX thread spent on one step: its decode forward and its prefill forward
    (each with its sampling), and the prefill forward's padded tokens (chunks x longest)."""

    decode_s: float
    prefill_s: float
    prefill_tokens: int


@dataclass(slots=True)
class StepBudget:
    """Caps a step's padded prefill tokens so that its expected time stays under `target_s`.

    `max_tokens` (--max-step-tokens) stays the upper bound; `min_tokens` (one block) is the
    floor, so every step makes progress however slow the model is. Until the first prefill has
    been timed the cap is that floor: one block measures the speed without risking the TTL.
    """

    max_tokens: int
    min_tokens: int
    target_s: float = math.inf  # set from the lease TTL at registration
    s_per_token: float | None = None  # EWMA of prefill seconds per padded token
    decode_s: float = 0.0  # EWMA of the decode forward's seconds

    def set_ttl(self, lease_ttl_s: float) -> None:
        self.target_s = TTL_FRACTION * lease_ttl_s if lease_ttl_s > 0 else math.inf

    def prefill_tokens(self) -> int:
        floor = min(self.min_tokens, self.max_tokens)
        if math.isinf(self.target_s):
            return self.max_tokens
        if self.s_per_token is None:
            return floor
        fits = (self.target_s - self.decode_s) / max(self.s_per_token, 1e-9)
        if fits >= self.max_tokens:
            return self.max_tokens
        return max(floor, int(fits) // self.min_tokens * self.min_tokens)  # whole blocks

    def observe(self, took: ForwardTime) -> None:
        self.decode_s = _ewma(self.decode_s, took.decode_s)
        if took.prefill_tokens:
            per_token = took.prefill_s / took.prefill_tokens
            self.s_per_token = (
                per_token if self.s_per_token is None else _ewma(self.s_per_token, per_token)
            )


def _ewma(old: float, new: float) -> float:
    return ALPHA * new + (1 - ALPHA) * old
