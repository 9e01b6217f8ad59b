"""The model thread's stall watch (worker/engine/stall_watch.py): a job past the bound is
reported once, with its name; jobs within it, and time between jobs, are not."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from worker.engine.stall_watch import StallWatch

ROOT = Path(__file__).resolve().parents[2]


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


def test_rank_0_pings_its_model_thread_until_it_is_shut_down() -> None:
    """``pings`` submits a ping to the model thread every interval (rank 0 of a group, idle or
    not), and stops once the thread takes no more work."""
    from concurrent.futures import ThreadPoolExecutor

    from worker.engine.stall_watch import ping_interval, pings

    model_thread = ThreadPoolExecutor(1)
    done: list[float] = []
    pings(model_thread.submit, lambda: done.append(time.monotonic()), 0.05)
    time.sleep(0.6)
    model_thread.shutdown()
    count = len(done)
    assert count >= 3
    time.sleep(0.2)
    assert len(done) == count  # nothing after the shutdown
    assert ping_interval(300) == 10.0 and ping_interval(2) == 0.5


def test_a_ping_that_fails_ends_rank_0() -> None:
    """A follower's socket closed (a rank on another machine exited): the next ping raises,
    and rank 0 reports it, to exit for the group to restart."""
    from concurrent.futures import ThreadPoolExecutor

    from worker.engine.stall_watch import pings

    def ping() -> None:
        raise RuntimeError("[ring] connection to a peer was lost")

    failures: list[str] = []
    reported = threading.Event()
    model_thread = ThreadPoolExecutor(1)
    pings(model_thread.submit, ping, 0.05, lambda m: (failures.append(m), reported.set()))
    assert reported.wait(5)
    model_thread.shutdown()
    assert "a rank is gone" in failures[0] and "connection to a peer was lost" in failures[0]


def _follower_that_hears(every_s: float | None) -> subprocess.CompletedProcess[str]:
    """A process whose channel hears a message every ``every_s`` (None: never), watched by
    ``watch_messages`` with a 2 s bound, for 5 s."""
    code = f"""
import logging, threading, time
logging.basicConfig(level="INFO")
from worker.group_launch import watch_messages
class Channel:
    received_at = time.monotonic()
channel = Channel()
watch_messages(channel, 2.0)
every = {every_s!r}
end = time.monotonic() + 5
while time.monotonic() < end:
    time.sleep(every or 0.05)
    if every:
        channel.received_at = time.monotonic()
"""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_a_follower_that_hears_nothing_from_rank_0_exits() -> None:
    """Rank 0 gone without closing its sockets (its machine lost, its process stopped): past
    the bound with no message, the follower exits 1 and says why; one that hears from rank 0
    (a ping or a call) more often than the bound runs on."""
    silent = _follower_that_hears(None)
    assert silent.returncode == 1, silent.stderr
    assert "nothing from rank 0" in silent.stderr
    heard = _follower_that_hears(0.2)
    assert heard.returncode == 0, heard.stderr
