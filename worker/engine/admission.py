"""Admission's order: which waiting requests ask for a lease in the next pass, in which order,
and which have waited too long. Pure policy over the queue and the clock; the lease sync
(``LeaseSync._admit_pass``) runs the passes and acts on the cache service's answers.

The service tries a batch in order and stops at the first request it has no room for, which so
blocks every one behind it: that is what keeps a long prompt from being starved by short ones.
But a request the pool has no room for yet lets the ones behind it pass for :data:`OVERTAKE_S`
(it goes last in the batch), so small requests run beside a big one; past that it goes first,
and those behind it wait for it. A request the service deferred (another lease is computing its
prefix) asks again once something was published since, or after :data:`DEFER_RETRY_S`.
"""

from __future__ import annotations

from collections.abc import Iterable

from worker.engine.sequence import Sequence

# A deferred request asks again once this worker published something, or after this long:
# the lease it waits on may end without this worker hearing of it (its release failed and it
# expired at the service, or it belongs to a lease this worker lost track of).
DEFER_RETRY_S = 1.0
# Items per AcquireLeases call (the service takes up to 1,024).
ACQUIRE_BATCH = 64
# How long a request the pool has no room for lets later ones pass it (they go first in the
# batch; the service stops at the first item without room). Past this it goes first, and the
# ones behind it wait for it: passing is what lets small requests run beside a big one, the
# limit is what keeps the big one from being passed for ever.
OVERTAKE_S = 5.0


def admission_batch(
    waiting: Iterable[Sequence], published: int, now: float, room: int
) -> list[Sequence]:
    """The requests of ``waiting`` (oldest first) that ask in this pass, in the order the
    service is to try them: at most ``room`` (the batch's free places) and ACQUIRE_BATCH.
    ``published``: the lease sync's publish count now (a deferred request waits for it to
    move, or for DEFER_RETRY_S)."""
    ready = [s for s in waiting if s.deferred_at != published or now >= s.deferred_until]
    # One the pool had no room for goes last while it may be passed, first after that.
    passable = [
        s for s in ready if s.no_room_since is not None and now - s.no_room_since < OVERTAKE_S
    ]
    batch = [s for s in ready if s not in passable] + passable
    return batch[: max(0, min(room, ACQUIRE_BATCH))]


def overdue(
    waiting: Iterable[Sequence], now: float, limit: float, freed_at: float = float("-inf")
) -> list[tuple[Sequence, float]]:
    """The requests of ``waiting`` the pool has had no room for ``limit`` seconds or more
    (``--admission-timeout-s``; 0: none) while no blocks came back, with how long each
    waited. ``freed_at``: when this worker last released a lease (a request finished, ended
    or was preempted). A pool whose leases keep coming back is a queue that moves, and its
    requests get their turn: one request with n=16 choices of a long prompt, three of which
    fit at a time, had its later choices end after 120 s while the first ones were still
    finishing. The limit is for room that does not come back (a lease that never ends,
    pinned prefixes, a namespace quota)."""
    if not limit:
        return []
    waited = [(s, now - s.no_room_since) for s in waiting if s.no_room_since is not None]
    return [(s, w) for s, w in waited if min(w, now - freed_at) >= limit]
