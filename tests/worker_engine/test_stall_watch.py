"""The model thread's stall watch (worker/engine/stall_watch.py): a job past the bound is
reported once, with its name; jobs within it, and time between jobs, are not."""

from __future__ import annotations

import threading
import time

from worker.engine.stall_watch import StallWatch


def test_a_job_past_the_bound_is_reported_once() -> None:
    fired: list[str] = []
    done = threading.Event()

    def on_stall(message: str) -> None:
        fired.append(message)
        done.set()

    watch = StallWatch(0.2, "worker group", on_stall)
    try:
        assert watch.run(lambda x: x + 1, 1) == 2  # a quick job: nothing
        time.sleep(0.5)  # idle between jobs: nothing
        assert fired == []

        def forward() -> str:
            done.wait(5)
            time.sleep(0.3)  # still running after the report: reported once
            return "late"

        assert watch.run(forward) == "late"
        assert len(fired) == 1
        assert "worker group" in fired[0] and "forward" in fired[0] and "0.2 s" in fired[0]
    finally:
        watch.stop()


def test_jobs_within_the_bound_are_never_reported() -> None:
    fired: list[str] = []
    watch = StallWatch(2.0, "worker group", fired.append)  # far past each job, on any machine
    try:
        for _ in range(8):
            watch.run(time.sleep, 0.05)
        time.sleep(0.6)  # idle: several of the watcher's ticks
        assert fired == []
    finally:
        watch.stop()
