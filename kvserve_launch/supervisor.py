"""Keeps the system up: a child that dies is restarted, with backoff, until it keeps dying.

Every part is built to survive a restart of any other (workers re-register their pools with a
restarted cache service, the gateway re-discovers workers and reconnects, streams finish), so
one dead process is no reason to stop the rest: ``kill -9`` of the cache service used to take
the gateway and the workers down with it. The supervisor says each death and restart in one
line; a child restarts on the ports it had (:attr:`Child.restart_argv`), after 1 s, then 2, 4,
... up to :attr:`Supervisor.max_backoff_s`. It gives up, stopping everything with the reason,
only when one child has died :attr:`Supervisor.give_up_after` times within
:attr:`Supervisor.window_s` (a crash loop: a taken port, a broken model, a machine out of
memory), since restarting it then only hides the fault. An out-of-memory hint goes with a
SIGKILL only where the kernel says so (``diagnosis.oom_killed``).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve_launch.diagnosis import describe_exit, hint, oom_killed, oom_kills
from kvserve_launch.process import Child
from kvserve_launch.system import System


def say_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class _Watch:
    deaths: collections.deque[float] = field(default_factory=collections.deque)
    restart_at: float | None = None


@dataclass
class Supervisor:
    system: System
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    give_up_after: int = 5
    window_s: float = 300.0
    say: Callable[[str], None] = say_stderr
    oom_baseline: int | None = field(default_factory=oom_kills)

    def run(self, stop: threading.Event, poll_s: float = 0.2) -> int:
        """Until ``stop`` is set (0) or a child keeps dying (1)."""
        watches = {child.name: _Watch() for child in self.system.children()}
        while not stop.wait(poll_s):
            now = time.monotonic()
            for child in self.system.children():
                watch = watches[child.name]
                if child.running:
                    continue
                if watch.restart_at is None:
                    if not self._schedule(child, watch, now):
                        return 1
                elif now >= watch.restart_at:
                    watch.restart_at = None
                    child.restart()
                    self.say(f"kvserve: {child.name} restarted (pid {child.pid})")
        return 0

    def _schedule(self, child: Child, watch: _Watch, now: float) -> bool:
        """Record ``child``'s death and when it restarts; False: it keeps dying, give up."""
        watch.deaths.append(now)
        while watch.deaths and watch.deaths[0] < now - self.window_s:
            watch.deaths.popleft()
        what = self.died(child)
        n = len(watch.deaths)
        if n >= self.give_up_after:
            self.say(
                f"kvserve: {what}; it died {n} times within {self.window_s:.0f} s: "
                "stopping everything"
            )
            return False
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (n - 1))
        self.say(f"kvserve: {what}; restarting it in {delay:g} s")
        watch.restart_at = now + delay
        return True

    def died(self, child: Child) -> str:
        """``cache killed by SIGKILL (killed unconditionally) (hint: ...)``."""
        code = child.returncode
        assert code is not None, "still running"
        oom = code < 0 and oom_killed(child.pid, self.oom_baseline)
        advice = hint(code, child.port_setting, oom=oom)
        return f"{child.name} {describe_exit(code)}" + (f" (hint: {advice})" if advice else "")
