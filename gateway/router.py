"""The routing policy: which worker serves a request. One pure function, :func:`choose_worker`.

The cache service answers, per worker pool, how many leading tokens of the prompt it already
holds (``Route``); the gateway adds what it knows about load and health. Sending a request to
the worker with the longest cached prefix saves exactly that much prefill compute and KV
memory, so it wins, with three exceptions:

- *The match is too short to matter.* Every chat request shares the chat template's first
  tokens with every other; following such crumbs would pile all traffic, and all cached
  prefixes, into one pool while the others sit empty. A match counts only from
  ``max(min_match_tokens, min_match_ratio * prompt_tokens)`` tokens on.
- *The holder is full.* A worker at its request limit (``--max-pending-requests``, from its
  ``GetInfo``) would refuse the request: it is tried only after every other.
- *The holder is overloaded.* A worker whose load is well above the least loaded one's is
  skipped, and the request goes to the best of the others. "Well above" is
  ``load > min_load + max(overload_slack, overload_ratio * min_load)``: an absolute slack
  for a lightly loaded system (a few more sequences in a continuous batch cost little, a
  re-prefill costs a lot) and a relative one under heavy load.

Without a counting match, the least loaded worker wins, ties going to the one with the most
free blocks, so new prefixes spread over the pools instead of filling the first one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker as the router sees it for one request."""

    pool_id: str
    address: str
    # Leading prompt tokens already in this worker's pool (from the cache service).
    cached_tokens: int
    # Requests running or queued there: max of what the cache service and this gateway see.
    load: int
    free_blocks: int = 0
    # False once a call failed to reach it, until it answers again (or the cache service
    # stopped hearing its heartbeats).
    healthy: bool = True
    # Most requests it holds (its --max-pending-requests, from its last GetInfo); 0: no limit
    # or not known yet. At that load it refuses new ones (RESOURCE_EXHAUSTED).
    capacity: int = 0

    @property
    def full(self) -> bool:
        return 0 < self.capacity <= self.load


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """Knobs of :func:`choose_worker` (the gateway's ``--min-match-*``, ``--overload-*``)."""

    min_match_tokens: int = 32
    min_match_ratio: float = 0.2
    overload_slack: int = 8
    overload_ratio: float = 0.5

    def counts(self, cached_tokens: int, prompt_tokens: int) -> bool:
        """Is a cached prefix of this length worth routing for?"""
        need = max(self.min_match_tokens, self.min_match_ratio * prompt_tokens)
        return cached_tokens > 0 and cached_tokens >= need

    def overloaded(self, load: int, min_load: int) -> bool:
        return load > min_load + max(self.overload_slack, self.overload_ratio * min_load)


class RouteReason(StrEnum):
    PREFIX = "prefix"  # the longest cached prefix
    LEAST_LOADED = "least_loaded"  # no prefix worth following: the least loaded worker
    OVERLOADED = "overloaded"  # the best prefix holder was overloaded; the next best instead
    UNHEALTHY = "unhealthy"  # every worker is marked unhealthy: try them anyway
    FULL = "full"  # every healthy worker is at its request limit: try them anyway


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where to send the request (``order[0]``) and where to fail over to, in order."""

    order: tuple[Candidate, ...]
    reason: RouteReason

    @property
    def chosen(self) -> Candidate:
        return self.order[0]


def choose_worker(
    candidates: Sequence[Candidate],
    prompt_tokens: int,
    policy: RoutingPolicy = RoutingPolicy(),
) -> RouteDecision | None:
    """Rank the candidates for one request of ``prompt_tokens``; None when there are none.

    1. Only healthy candidates compete. If none is healthy, all of them do (a marked worker
       may be back; trying costs one failed connect, refusing costs the request).
    2. Among those, drop the full ones (at their request limit), then the overloaded ones
       (see the module docstring).
    3. Rank the rest by cached prefix (only a match that counts; shorter ones rank as 0),
       then lowest load, then most free blocks, then pool id (deterministic).
    4. The fail-over order continues with the overloaded, the full (their load may have
       dropped since it was seen), then the unhealthy candidates, each ranked by load.
    """
    if not candidates:
        return None
    healthy = [c for c in candidates if c.healthy]
    pool = healthy or list(candidates)
    room = [c for c in pool if not c.full]
    full = sorted((c for c in pool if c.full), key=_by_load)
    unhealthy = sorted((c for c in candidates if not c.healthy), key=_by_load) if healthy else []
    if not room:
        return RouteDecision(
            (*full, *unhealthy), RouteReason.FULL if healthy else RouteReason.UNHEALTHY
        )
    min_load = min(c.load for c in room)
    fit = [c for c in room if not policy.overloaded(c.load, min_load)]
    hot = [c for c in room if policy.overloaded(c.load, min_load)]

    def useful(c: Candidate) -> int:
        return c.cached_tokens if policy.counts(c.cached_tokens, prompt_tokens) else 0

    fit.sort(key=lambda c: (-useful(c), c.load, -c.free_blocks, c.pool_id))
    order = (*fit, *sorted(hot, key=_by_load), *full, *unhealthy)
    if not healthy:
        reason = RouteReason.UNHEALTHY
    elif useful(fit[0]) < max(useful(c) for c in pool):
        reason = RouteReason.OVERLOADED
    elif useful(fit[0]) > 0:
        reason = RouteReason.PREFIX
    else:
        reason = RouteReason.LEAST_LOADED
    return RouteDecision(order, reason)


def _by_load(c: Candidate) -> tuple[int, int, str]:
    return (c.load, -c.cached_tokens, c.pool_id)
