"""A soak of the real system: many clients of mixed traffic for a while, then the books.

Each client loops until the deadline over a seeded mix: streamed chats on one of a few shared
system prompts (prefix hits), unique completions, non-streamed chats, and a share of streams
the client hangs up on after a few chunks. Every answer must be a 200 that ends with a finish
reason (or the client's own hang-up); anything else is recorded as an error with its text.

The report has what operators ask of a soak: requests and tokens served, errors, each
process's RSS and open file descriptors after warm-up and at the end, and, once every lease is
released, the cache service's referenced blocks and its integrity check.

Used by ``tests/e2e/test_faults.py`` (a short soak in the default run, a longer one behind
``-m long``) and runnable on its own against a fresh system::

    .venv/bin/python -m tests.e2e.soak --seconds 600 --clients 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvserve_launch.system import System

MODEL = "kvserve-tiny-llama"
SYSTEM_PROMPTS = [
    f"You are assistant number {i} of the soak. Answer in plain words and keep it short; "
    "this sentence only makes the system prompt span several KV blocks of the cache."
    for i in range(4)
]


@dataclass
class ProcessSample:
    rss_kb: int
    fds: int


def sample(pid: int) -> ProcessSample:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return ProcessSample(rss, len(os.listdir(f"/proc/{pid}/fd")))


def sample_all(system: System) -> dict[str, ProcessSample]:
    return {c.name: sample(c.pid) for c in system.children() if c.running}


@dataclass
class SoakReport:
    seconds: float
    clients: int
    requests: int = 0
    completed: int = 0
    hung_up: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    start: dict[str, ProcessSample] = field(default_factory=dict)
    end: dict[str, ProcessSample] = field(default_factory=dict)
    after: Books | None = None  # the cache service's books once the clients are done

    def table(self) -> str:
        rows = [
            f"soak: {self.seconds:.0f} s, {self.clients} clients, {self.requests} requests "
            f"({self.completed} completed, {self.hung_up} hung up by the client), "
            f"{len(self.errors)} errors, statuses {dict(self.statuses)}",
            f"tokens: {self.prompt_tokens} prompt ({self.cached_tokens} cached), "
            f"{self.completion_tokens} generated",
            f"after: {self.after}",
            "| process | RSS start (MB) | RSS end (MB) | fds start | fds end |",
            "|---|---|---|---|---|",
        ]
        for name, s in self.start.items():
            e = self.end.get(name, ProcessSample(0, 0))
            rows.append(
                f"| {name} | {s.rss_kb / 1024:.0f} | {e.rss_kb / 1024:.0f} | {s.fds} | {e.fds} |"
            )
        return "\n".join(rows + [f"error: {e}" for e in self.errors[:10]])


class Client:
    """One soak client: a thread with its own HTTP connection and random stream."""

    def __init__(self, base_url: str, seed: int, report: SoakReport, lock: threading.Lock):
        self.http = httpx.Client(base_url=base_url, timeout=120)
        self.rng = random.Random(seed)
        self.report = report
        self.lock = lock
        self.seed = seed

    def record(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self.report, name, getattr(self.report, name) + n)

    def error(self, what: str) -> None:
        with self.lock:
            self.report.errors.append(f"client {self.seed}: {what}")

    def body(self, n: int) -> tuple[str, dict]:
        kind = self.rng.choice(["shared", "shared", "unique", "chat"])
        max_tokens = self.rng.randint(1, 48)
        user = f"client {self.seed} request {n}: " + "word " * self.rng.randint(1, 40)
        stream = kind == "shared" or (kind == "unique" and self.rng.random() < 0.5)
        body: dict = {"model": MODEL, "max_tokens": max_tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if kind == "unique":
            return "/v1/completions", {
                **body,
                "prompt": f"{self.seed}-{n} " * self.rng.randint(5, 60),
            }
        messages = [{"role": "user", "content": user}]
        if kind == "shared":
            messages.insert(0, {"role": "system", "content": self.rng.choice(SYSTEM_PROMPTS)})
        return "/v1/chat/completions", {
            **body,
            "messages": messages,
            "temperature": self.rng.choice([0.0, 0.7, 1.0]),
        }

    def run(self, deadline: float, hang_up_rate: float) -> None:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            path, body = self.body(n)
            hang_up = body.get("stream") and self.rng.random() < hang_up_rate
            self.record(requests=1)
            try:
                if body.get("stream"):
                    self.stream(path, body, hang_up_after=self.rng.randint(1, 4) if hang_up else 0)
                else:
                    self.unary(path, body)
            except (httpx.HTTPError, ValueError) as e:  # ValueError: an event not JSON
                self.error(f"{path}: {type(e).__name__}: {e}")
        self.http.close()

    def usage(self, usage: dict | None) -> None:
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            self.record(
                prompt_tokens=usage["prompt_tokens"],
                completion_tokens=usage["completion_tokens"],
                cached_tokens=details.get("cached_tokens") or 0,
            )

    def unary(self, path: str, body: dict) -> None:
        r = self.http.post(path, json=body)
        with self.lock:
            self.report.statuses[r.status_code] += 1
        if r.status_code != 200:
            self.error(f"{path}: {r.status_code} {r.text[:300]}")
            return
        data = r.json()
        if not all(c.get("finish_reason") for c in data["choices"]):
            self.error(f"{path}: no finish reason: {data}")
            return
        self.record(completed=1)
        self.usage(data.get("usage"))

    def stream(self, path: str, body: dict, hang_up_after: int) -> None:
        chunks, finished, usage = 0, False, None
        with self.http.stream("POST", path, json=body) as r:
            with self.lock:
                self.report.statuses[r.status_code] += 1
            if r.status_code != 200:
                self.error(f"{path}: {r.status_code} {r.read()[:300]!r}")
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.error(f"{path}: stream error {event['error']}")
                    return
                chunks += 1
                finished |= any(c.get("finish_reason") for c in event.get("choices", []))
                usage = event.get("usage") or usage
                if hang_up_after and chunks >= hang_up_after and not finished:
                    self.record(hung_up=1)
                    return  # closing the response hangs up mid-stream
        if not finished:
            self.error(f"{path}: the stream ended without a finish reason")
            return
        self.record(completed=1)
        self.usage(usage)


@dataclass(frozen=True)
class Books:
    live_leases: int
    referenced_blocks: int
    integrity_ok: bool


def books(http: httpx.Client, admin_token: str, wait_s: float = 30) -> Books:
    """Once every lease is released (hung-up streams end on the workers' next steps): the
    cache service's leases, referenced blocks and integrity check."""
    auth = {"Authorization": f"Bearer {admin_token}"}
    deadline = time.monotonic() + wait_s
    while True:
        pools = http.get("/admin/cache/stats", headers=auth).json()["pools"]
        live = sum(p["live_leases"] for p in pools)
        if live == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    referenced = sum(p["referenced_blocks"] for p in pools)
    return Books(live, referenced, http.get("/admin/cache/check", headers=auth).json()["ok"])


def soak(
    system: System, seconds: float, clients: int, seed: int = 0, hang_up_rate: float = 0.2
) -> SoakReport:
    """Warm up, sample every process, run ``clients`` for ``seconds``, settle the books and
    sample again."""
    base = f"http://{system.http_address}"
    report = SoakReport(seconds, clients)
    lock = threading.Lock()

    def run_all(duration: float, salt: int) -> None:
        threads = [
            threading.Thread(
                target=Client(base, seed * 1000 + salt + i, report, lock).run,
                args=(time.monotonic() + duration, hang_up_rate),
            )
            for i in range(clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # Warm-up (counted in the totals): first shapes, pool pages, allocator arenas.
    run_all(min(5.0, seconds / 4), salt=500)
    report.start = sample_all(system)
    run_all(seconds, salt=0)
    with httpx.Client(base_url=base, timeout=30) as http:
        report.after = books(http, system.config.admin_token)
    report.end = sample_all(system)
    return report


def main() -> None:
    from kvserve_launch.config import LaunchConfig
    from kvserve_launch.system import launch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    config = LaunchConfig(
        workers=a.workers,
        model="kvserve-tiny-llama",
        http_port=0,
        grpc_port=0,
        cache_port=0,
        log_level="WARNING",
    )
    system = launch(config, sink=lambda name, line: None)
    try:
        print(soak(system, a.seconds, a.clients, a.seed).table())
    finally:
        system.stop()


if __name__ == "__main__":
    main()
