"""The one place a finished request's last event waits: until its KV is indexed.

Why it is held: read-your-writes for prefix caching. A client that sends its next turn the
moment it sees this one end (a chat, an agent loop) must find this turn's prefix indexed by the
cache service, or the next turn recomputes all of it. The release that indexes a finished
request's KV (``LeaseSync.release``) goes out in the background, after the step; so the
finishing event goes out once the service has answered that release (or it failed), or after
:data:`FINAL_HOLD_MAX_S`, whichever comes first: a slow cache service delays no client for
longer. Only the finishing event of a request that finished is held: the tokens before it
stream at once, and a request that ends early (an error, a cancel) is told at once.

Who does what: the scheduler hands :class:`FinalHold` each finishing event
(``Scheduler.postprocess``), the engine asks it for the callback to run once each finished
sequence's release is answered (:meth:`FinalHold.when_released`), and nothing else holds an
event. With prefix caching off, or blocks not published (the dense runner), nothing is indexed
and nothing is held.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from worker.engine.sequence import Sequence, StreamEvent

# The longest a finished request's last event waits for its release to be answered.
FINAL_HOLD_MAX_S = 1.0


class FinalHold:
    def __init__(self, enabled: bool) -> None:
        """``enabled``: a finished request's KV is indexed at its release (prefix caching on and
        blocks published); otherwise every finishing event goes out at once."""
        self.enabled = enabled
        self._events: dict[Sequence, StreamEvent] = {}

    @property
    def held(self) -> int:
        """Finishing events waiting for their release's answer."""
        return len(self._events)

    def keep(self, seq: Sequence, event: StreamEvent) -> None:
        """``seq``'s finishing event (from the scheduler): held until :meth:`send`, or sent now
        when nothing is held."""
        if self.enabled:
            self._events[seq] = event
        else:
            seq.out.put_nowait(event)

    def when_released(self, seq: Sequence) -> Callable[[], None] | None:
        """What the release of ``seq``'s lease runs once the service has answered it: sends its
        held event. The event also goes out after FINAL_HOLD_MAX_S, answered or not. None when
        nothing of ``seq`` is held."""
        if seq not in self._events:
            return None
        asyncio.get_running_loop().call_later(FINAL_HOLD_MAX_S, self.send, seq)
        return functools.partial(self.send, seq)

    def send(self, seq: Sequence) -> None:
        """Sends ``seq``'s held event, if it is still held (the first of the release's answer
        and the deadline sends it)."""
        event = self._events.pop(seq, None)
        if event is not None:
            seq.out.put_nowait(event)

    def send_all(self) -> None:
        """At shutdown, once every release has gone out: nothing waits any more."""
        for seq in list(self._events):
            self.send(seq)
