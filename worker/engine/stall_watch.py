"""Ends the process when one job of the model thread runs past a bound: a worker group's
guard against a rank that stopped answering (docs/tensor-parallel.md).

In a group every forward is a chain of collectives (``worker.model.group``); a follower that
hangs (a stopped process, a wedged device, a peer machine gone without closing its socket)
leaves rank 0 waiting inside one of them forever, holding its leases alive through the
heartbeats while no request moves. A follower that *exits* is seen at once
(``worker.group_launch.Followers``); a hung one is seen only by time. So rank 0's model thread
runs each job through :meth:`StallWatch.run`, and a watcher thread that finds one running
longer than ``timeout_s`` logs what ran and how long, and exits the process with status 1: its
leases expire, its followers exit when their leader is gone, and the launcher or Kubernetes
starts the group again, as after any rank's death (NCCL's collective timeout does the same).

The bound is for one job (a step, a warm-up call), not a request: jobs are a prefill chunk or
a decode step, seconds at most; start-up (loading, the self-check) is not watched.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def _exit(message: str) -> None:
    log.critical("%s", message)
    logging.shutdown()
    os._exit(1)


class StallWatch:
    """Times each job run through :meth:`run`; ``on_stall`` (default: log and exit 1) is
    called once, from a watcher thread, with a message, if one runs longer than
    ``timeout_s``."""

    def __init__(
        self, timeout_s: float, what: str, on_stall: Callable[[str], None] = _exit
    ) -> None:
        self.timeout_s = timeout_s
        self.what = what
        self._on_stall = on_stall
        self._job: tuple[float, str] | None = None  # (started, name) of the job running
        self._stop = threading.Event()
        self._fired = False
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, timed (on the model thread)."""
        self._job = (time.monotonic(), getattr(fn, "__name__", type(fn).__name__))
        try:
            return fn(*args)
        finally:
            self._job = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        tick = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(tick):
            job = self._job
            if job is None or self._fired:
                continue
            took = time.monotonic() - job[0]
            if took > self.timeout_s:
                self._fired = True
                self._on_stall(
                    f"{self.what}: the model thread's {job[1]} has run {took:.0f} s, past "
                    f"{self.timeout_s:g} s: a rank stopped answering; exiting so the group "
                    "restarts"
                )


def ping_interval(timeout_s: float) -> float:
    """How often rank 0 pings its followers under ``--group-timeout-s timeout_s``."""
    return min(10.0, timeout_s / 4)


def pings(
    submit: Callable[[Callable[[], None]], Future[Any]],
    ping: Callable[[], None],
    every_s: float,
    on_failure: Callable[[str], None] = _exit,
) -> None:
    """A daemon thread that submits ``ping`` to the model thread every ``every_s`` seconds
    (rank 0 of a group: a job between the others, so the followers hear from it even while
    no request runs; ``worker.group_launch.watch_messages`` is their side). A ping that fails
    (a follower's socket closed: a rank on another machine exited) ends the process, as a
    local follower's exit does (``group_launch.Followers``). Stops when the model thread takes
    no more work."""

    def failed(done: Future[Any]) -> None:
        error = None if done.cancelled() else done.exception()
        if error is not None:
            on_failure(
                f"worker group: a ping to the other ranks failed ({error}): a rank is gone; "
                "exiting so the group restarts"
            )

    def loop() -> None:
        while True:
            time.sleep(every_s)
            try:
                submit(ping).add_done_callback(failed)
            except RuntimeError:  # the model thread was shut down
                return

    threading.Thread(target=loop, name="group-ping", daemon=True).start()
