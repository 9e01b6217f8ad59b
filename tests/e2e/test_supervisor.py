"""The launcher keeps the system up (``kvserve_launch.supervisor``), as real processes:
``kill -9`` of the cache service or the gateway is a restart on the same port, said in one line,
and the system serves again; a child that keeps dying stops everything with the reason."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvserve_model.tiny_model import TINY_MODEL_NAME, ensure_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True}


@dataclass
class Launched:
    proc: subprocess.Popen[str]
    lines: queue.Queue[str]
    seen: list[str]
    base: str
    pids: dict[str, int]

    def wait_line(self, pattern: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        for line in self.seen:
            if re.search(pattern, line):
                return line
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                line = self.lines.get(timeout=0.5)
                self.seen.append(line)
                if re.search(pattern, line):
                    return line
        raise AssertionError(f"no line {pattern!r}:\n" + "".join(self.seen[-40:]))

    def serves(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                resp = httpx.post(f"{self.base}/v1/chat/completions", json=CHAT, timeout=30)
                if resp.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "".join(self.seen[-40:])
            time.sleep(0.3)


@contextlib.contextmanager
def launched(tmp_path: Path, *flags: str) -> Iterator[Launched]:
    ensure_tiny_model()
    argv = [
        sys.executable, "-m", "kvserve_launch", "--workers", "1", "--model", TINY_MODEL_NAME,
        "--http-port", "0", "--grpc-port", "0", "--cache-port", "0", "--num-blocks", "64",
        "--restart-backoff-s", "0.5", *flags,
    ]  # fmt: skip
    # One stream for the children's lines and the launcher's own: the order they happened in.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    run = Launched(proc, lines, [], "", {})
    try:
        ready = run.wait_line(r"^KVSERVE_READY", 240)
        fields = dict(part.split("=", 1) for part in ready.split()[1:])
        run.base = f"http://{fields['http']}"
        gateway, worker, cache = (int(p) for p in fields["pids"].split(","))
        run.pids = {"gateway": gateway, "worker-0": worker, "cache": cache}
        yield run
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_a_killed_cache_service_and_gateway_come_back_and_the_system_serves(tmp_path):
    with launched(tmp_path) as run:
        run.serves(60)
        os.kill(run.pids["cache"], signal.SIGKILL)
        line = run.wait_line(r"kvserve: cache killed by SIGKILL.*restarting it in", 30)
        assert "stopping" not in line
        run.wait_line(r"^cache +\| .*listening on", 60)  # the same port: the others find it
        run.serves(120)  # the worker re-registered with the new cache service
        os.kill(run.pids["gateway"], signal.SIGKILL)
        run.wait_line(r"kvserve: gateway killed by SIGKILL.*restarting it in", 30)
        run.serves(120)  # on the port it had
        assert run.proc.poll() is None  # the launcher never stopped
        os.kill(run.pids["worker-0"], 0)  # the worker was never restarted: it survived both
        run.proc.send_signal(signal.SIGINT)
        assert run.proc.wait(60) == 0


def test_a_child_that_keeps_dying_stops_everything_with_the_reason(tmp_path):
    with launched(tmp_path, "--max-restarts", "1") as run:
        os.kill(run.pids["cache"], signal.SIGKILL)
        run.wait_line(r"kvserve: cache killed by SIGKILL.*restarting it in", 30)
        pid = int(run.wait_line(r"kvserve: cache restarted \(pid \d+\)", 30).split("pid ")[1][:-2])
        run.wait_line(r"^cache +\| .*listening on", 60)
        os.kill(pid, signal.SIGKILL)
        run.wait_line(r"kvserve: cache killed by SIGKILL.*died 2 times within 300 s: stopping", 30)
        assert run.proc.wait(60) == 1
        for name in ("gateway", "worker-0"):  # everything stopped
            with pytest.raises(ProcessLookupError):
                os.kill(run.pids[name], 0)
