"""One child process of the system: started, watched for its ready line, stopped.

Each service prints one line on stdout when it serves (``KVCACHE_READY host:port``,
``WORKER_READY host:port``, ``GATEWAY_READY http=... grpc=...``); that line, not a sleep, is
what "started" means. Everything else a child prints is forwarded line by line with the
child's name in front, so the logs of five processes stay readable in one terminal.

Children run in their own session: a Ctrl-C in the terminal reaches only the launcher, which
then stops them in order (gateway, workers, cache service), each with SIGTERM and, after a
grace period, SIGKILL. Reader threads, not asyncio, so tests can use this from plain code.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from kvserve_launch.diagnosis import describe_exit, hint, oom_killed
from kvserve_launch.run import PARENT_ENV

Sink = Callable[[str, str], None]


TAIL_LINES = 20  # of a failed child's output, in its error
LINE_CHARS = 300  # a longer line is cut: one JSON blob must not bury the rest


class ChildFailed(RuntimeError):
    """A child exited, or did not get ready in time, during startup: what happened (``killed
    by SIGILL (illegal instruction)``), its last lines of output and, where one is known,
    what to try."""

    def __init__(self, name: str, what: str, tail: Sequence[str], hint: str | None = None):
        self.name = name
        self.what = what
        self.tail = [line.rstrip() for line in tail if line.strip()][-TAIL_LINES:]
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        if not self.tail:
            lines = [f"{self.name} {self.what}, and printed nothing."]
        else:
            lines = [f"{self.name} {self.what}. Its last output:"]
            lines += [
                f"    {x[:LINE_CHARS]}" + (" ..." if len(x) > LINE_CHARS else "") for x in self.tail
            ]
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


def print_sink(name: str, line: str) -> None:
    sys.stderr.write(f"{name:<9}| {line}")
    sys.stderr.flush()


class KeptLines:
    """A sink that keeps the children's last ``limit`` lines (thread-safe) instead of printing
    them, for a report when something fails (tests, benchmarks)."""

    def __init__(self, limit: int = 400) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=limit)
        self.lock = threading.Lock()

    def __call__(self, name: str, line: str) -> None:
        with self.lock:
            self.lines.append(f"{name:<9}| {line.rstrip()}")

    def dump(self) -> str:
        with self.lock:
            return "\n".join(self.lines)


class Child:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        ready_prefix: str,
        env: Mapping[str, str] | None = None,
        sink: Sink = print_sink,
        port_setting: str = "",
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.ready_prefix = ready_prefix
        self.env = dict(os.environ if env is None else env)
        self.sink = sink
        # The flags that set this child's port(s), for the hint when it is taken.
        self.port_setting = port_setting
        self.ready_line: str | None = None
        # The command a restart runs (``kvserve_launch.supervisor``): ``argv`` with the ports
        # it bound, so the others find it where it was.
        self.restart_argv: list[str] | None = None
        self._ready = threading.Event()
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        self._threads: list[threading.Thread] = []
        self.process: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def start(self) -> Child:
        self.process = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            errors="replace",
            # Its own session (a Ctrl-C of the terminal reaches the launcher, which stops the
            # children in order), so it watches the launcher instead (``run.watch_launcher``).
            env={**self.env, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())},
            start_new_session=True,
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        for stream, watch in ((self.process.stdout, True), (self.process.stderr, False)):
            t = threading.Thread(
                target=self._pump, args=(stream, watch), name=f"{self.name}-log", daemon=True
            )
            t.start()
            self._threads.append(t)
        return self

    def _pump(self, stream: IO[str], watch_ready: bool) -> None:
        for line in stream:
            if watch_ready and self.ready_line is None and line.startswith(self.ready_prefix):
                self.ready_line = line.strip()
                self._ready.set()
                continue
            self._tail.append(line)
            self.sink(self.name, line)

    def restart(self) -> Child:
        """Start the exited child again, with :attr:`restart_argv` where set."""
        assert not self.running, "still running"
        if self.restart_argv is not None:
            self.argv = list(self.restart_argv)
        self.ready_line = None
        self._ready.clear()
        self._threads = []
        return self.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def wait_ready(self, timeout_s: float) -> str:
        """The ready line's payload (after the prefix); raises ChildFailed on exit/timeout."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            code = self.returncode
            if code is not None:
                for t in self._threads:  # let the last lines of output arrive
                    t.join(1.0)
                what = f"failed before it was ready: {describe_exit(code)}"
                oom = code == -signal.SIGKILL and oom_killed(self.pid)
                advice = hint(code, self.port_setting, oom=oom)
                raise ChildFailed(self.name, what, list(self._tail), advice)
            if time.monotonic() > deadline:
                what = f"was not ready after {timeout_s:.0f}s"
                raise ChildFailed(self.name, what, list(self._tail))
        assert self.ready_line is not None
        return self.ready_line[len(self.ready_prefix) :].strip()

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``; returns the exit code."""
        if self.process is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            print_sink(self.name, f"did not stop in {grace_s:.0f}s; killing it\n")
            self.process.kill()
            self.process.wait(5.0)
        for t in self._threads:
            t.join(1.0)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL, no grace: what a crash looks like to the rest of the system."""
        if self.running:
            assert self.process is not None
            self.process.kill()
            self.process.wait(5.0)
