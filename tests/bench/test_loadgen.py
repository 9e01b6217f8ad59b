"""bench/serving/loadgen.py against a real HTTP server in the test: a small asyncio server that
streams OpenAI-style Server-Sent Events on a known schedule, fails in the ways servers fail
(an error status, an error event, a stream cut before ``[DONE]``, a connection closed before
any answer), and records what it was sent. Checks the per-request timings, the percentile and
rate arithmetic, the arrival patterns and that every failure is counted."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

PATH = Path(__file__).resolve().parents[2] / "bench" / "serving" / "loadgen.py"
_spec = importlib.util.spec_from_file_location("bench_serving_loadgen", PATH)
assert _spec and _spec.loader
loadgen = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = loadgen  # dataclasses look their module up
_spec.loader.exec_module(loadgen)

FIRST_S = 0.1  # the server's delay before the first content event
GAP_S = 0.05  # between content events
PIECES = ["Hel", "lo", " wor", "ld"]


@dataclass
class SSEServer:
    """What the server saw: request bodies, and the most requests it had in flight at once."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    connections: int = 0
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.decode().split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            body = json.loads(await reader.readexactly(length))
            self.bodies.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await self.respond(body, writer)
            finally:
                self.in_flight -= 1
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def respond(self, body: dict[str, Any], w: asyncio.StreamWriter) -> None:
        chat = "messages" in body
        mode = (body["messages"][-1]["content"] if chat else body["prompt"]).split(":")[0]
        if mode == "refuse" or (mode == "flaky" and self.connections == 1):
            return  # closed before any answer: retried by the client
        if mode == "http-500":
            msg = b'{"error": {"message": "boom"}}'
            w.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n" % len(msg))
            w.write(msg)
            return
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        w.write(b": a comment line, ignored\n\n")
        await w.drain()
        if chat:  # the role-only opening delta has no content: not a token
            await self.event(w, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(FIRST_S)
        for i, piece in enumerate(PIECES):
            if i:
                await asyncio.sleep(GAP_S)
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"text": piece}
            await self.event(w, {"choices": [choice]})
            if mode == "error-event":
                await self.event(w, {"error": {"message": "the worker aborted the request"}})
                break
            if mode == "cut":
                return
        if mode == "ok":
            usage = {
                "prompt_tokens": 40,
                "completion_tokens": 7,  # more tokens than events: usage wins
                "prompt_tokens_details": {"cached_tokens": 32},
            }
            await self.event(w, {"choices": [], "usage": usage})
        w.write(b"data: [DONE]\n\n")
        await w.drain()

    @staticmethod
    async def event(w: asyncio.StreamWriter, data: dict[str, Any]) -> None:
        w.write(f"data: {json.dumps(data)}\n\n".encode())
        await w.drain()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
async def server() -> AsyncIterator[SSEServer]:
    state = SSEServer()
    srv = await asyncio.start_server(state.handle, "127.0.0.1", 0)
    state.port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield state


def completion(prompt: str, tag: str = "") -> Any:
    return loadgen.Request(16, prompt=prompt, tag=tag)


# -- pure arithmetic --------------------------------------------------------------------------


def test_percentiles_interpolate_like_numpy():
    assert loadgen.percentile([], 50) is None
    assert loadgen.percentile([3.0], 99) == 3.0
    assert loadgen.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert loadgen.percentile([float(x) for x in range(1, 101)], 95) == pytest.approx(95.05)
    values = list(np.random.default_rng(0).exponential(size=37))
    for q in (0, 50, 95, 99, 100):
        assert loadgen.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_summary_counts_failures_and_rates():
    Result = loadgen.Result
    results = [
        Result(
            True,
            ttft=0.1,
            itl=[0.01, 0.03],
            e2e=0.2,
            output_tokens=3,
            prompt_tokens=10,
            cached_tokens=8,
        ),
        Result(
            True, ttft=0.3, itl=[0.02], e2e=0.4, output_tokens=2, prompt_tokens=30, cached_tokens=0
        ),
        Result(True, ttft=0.5, itl=[], e2e=0.6, output_tokens=1, prompt_tokens=5),
        Result(False, error="HTTP 429"),
        Result(False, error="HTTP 429"),
        Result(False, error="error event"),
    ]
    s = loadgen.summarize(results, wall_s=2.0)
    assert (s.requests, s.failed) == (6, 3)
    assert s.errors == ["HTTP 429", "error event"]
    assert s.output_tokens == 6 and s.output_tok_s == 3.0
    assert s.content_events == 6
    assert s.requests_s == 1.5  # successful requests over the wall time
    assert s.ttft == {"p50": 0.3, "p95": pytest.approx(0.48), "p99": pytest.approx(0.496)}
    assert s.itl["p50"] == pytest.approx(0.02)
    assert s.e2e["p50"] == 0.4
    # TPOT of the two requests with more than one token: 0.1 / 2 and 0.1 / 1.
    assert s.tpot["p50"] == pytest.approx(0.075)
    assert s.prompt_tokens == 45
    # Only where it was reported: 8 of the 40 prompt tokens of the two requests that said.
    assert s.cached_tokens == 8 and s.cached_fraction == pytest.approx(0.2)
    unreported = loadgen.summarize([Result(True, ttft=0.1, e2e=0.2, output_tokens=1)], 1.0)
    assert unreported.cached_tokens is None and unreported.cached_fraction is None


def test_sse_parsing_rules():
    lines = [": comment", "data: a", "data:b", "", "event: x", "data: {}", "", "", "data: tail"]
    assert loadgen.sse_events(lines) == ["a\nb", "{}", "tail"]


def test_poisson_offsets_are_seeded_exponential():
    a = loadgen.poisson_offsets(2000, rate=4.0, seed=3)
    assert a == loadgen.poisson_offsets(2000, rate=4.0, seed=3)
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate


# -- against the server -----------------------------------------------------------------------


async def test_streamed_timings_usage_and_cached_tokens(server):
    async with httpx.AsyncClient() as client:
        r = await loadgen.send(client, server.base, "m", completion("ok"))
        chat = await loadgen.send(
            client,
            server.base,
            "m",
            loadgen.Request(16, messages=[{"role": "user", "content": "ok"}]),
        )
    for result in (r, chat):
        assert result.ok, result.error
        assert result.text == "".join(PIECES)
        assert FIRST_S <= result.ttft < FIRST_S + 0.3
        assert len(result.itl) == len(PIECES) - 1
        assert all(GAP_S * 0.5 < gap < GAP_S + 0.3 for gap in result.itl)
        assert result.e2e >= result.ttft + sum(result.itl)
        assert (result.output_tokens, result.tokens_from_usage) == (7, True)
        assert (result.prompt_tokens, result.cached_tokens) == (40, 32)
    assert server.bodies[0]["stream"] and server.bodies[0]["stream_options"]["include_usage"]
    assert server.bodies[0]["prompt"] == "ok" and "messages" in server.bodies[1]


async def test_failures_are_counted_never_dropped(server):
    async with httpx.AsyncClient() as client:
        no_usage, http_500, error_event, cut, refused = await asyncio.gather(
            loadgen.send(client, server.base, "m", completion("no-usage")),
            loadgen.send(client, server.base, "m", completion("http-500")),
            loadgen.send(client, server.base, "m", completion("error-event")),
            loadgen.send(client, server.base, "m", completion("cut")),
            loadgen.send(client, server.base, "m", completion("refuse"), retries=1),
        )
    # A server that reports no usage: tokens counted as content events, cached unknown.
    assert no_usage.ok and (no_usage.output_tokens, no_usage.tokens_from_usage) == (4, False)
    assert no_usage.cached_tokens is None and no_usage.prompt_tokens is None
    assert not http_500.ok and "HTTP 500" in http_500.error
    assert not error_event.ok and "aborted" in error_event.error
    assert not cut.ok and "[DONE]" in cut.error
    assert not refused.ok and refused.retries == 1  # retried once, then failed
    s = loadgen.summarize([no_usage, http_500, error_event, cut, refused], 1.0)
    assert (s.requests, s.failed, s.retries) == (5, 4, 1)
    assert s.ttft["p50"] == no_usage.ttft  # latencies only of what succeeded


async def test_a_connection_closed_before_answering_is_retried(server):
    async with httpx.AsyncClient() as client:
        r = await loadgen.send(client, server.base, "m", completion("flaky"))
    assert r.ok and r.retries == 1 and server.connections == 2
    assert r.ttft >= FIRST_S + 0.25  # the backoff counts in TTFT


async def test_arrival_patterns_and_measure(server):
    async def run(send):
        burst = await loadgen.burst(send, [completion("ok") for _ in range(4)])
        assert server.max_in_flight == 4
        server.max_in_flight = 0
        loop = await loadgen.closed_loop(send, [[completion("ok")] * 2, [completion("ok")] * 2])
        assert server.max_in_flight == 2 and len(loop) == 4
        start = time.perf_counter()
        arrivals = await loadgen.poisson(send, [completion("ok")] * 3, rate=50.0, seed=1)
        gaps = loadgen.poisson_offsets(3, 50.0, 1)
        assert time.perf_counter() - start >= gaps[-1] + FIRST_S
        return burst + loop + arrivals

    summary, results = await loadgen.measure(run, server.base, "m", server_pid=os.getpid())
    assert summary.requests == 11 and summary.failed == 0 and len(results) == 11
    assert summary.output_tokens == 77
    assert summary.output_tok_s == pytest.approx(77 / summary.wall_s)
    assert summary.server_peak_rss_mb > 10 and summary.server_cpu_s >= 0
    assert summary.client_cpu_s is not None


async def test_multi_turn_resends_history_and_counts_unsent_turns(server):
    chats = [
        loadgen.Chat(system="sys", user_turns=["ok: a", "ok: b", "ok: c"], max_tokens=8),
        loadgen.Chat(system="sys", user_turns=["ok: d", "http-500", "ok: f"], max_tokens=8),
    ]

    async def run(send):
        return await loadgen.multi_turn(send, chats)

    summary, _ = await loadgen.measure(run, server.base, "m")
    assert summary.requests == 6 and summary.failed == 2
    assert "not sent: an earlier turn failed" in summary.errors
    assert set(summary.ttft_p50_by_tag) == {"turn 0", "turn 1", "turn 2"}
    third = next(b for b in server.bodies if b["messages"][-1]["content"] == "ok: c")
    assert [m["role"] for m in third["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert third["messages"][2]["content"] == "".join(PIECES)
    assert not any(b["messages"][-1]["content"] == "ok: f" for b in server.bodies)


def test_tree_sampler_sums_a_process_tree():
    """A parent whose child holds 64 MiB and burns 0.3 s of CPU: both count in the tree's
    figures (RSS and PSS) (the child's CPU up to its last sample, taken while it sleeps before exiting)."""
    child = (
        "import time; b = bytearray(64 << 20); t = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\n"
        "time.sleep(0.2)"
    )
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", parent])
    sampler = loadgen.TreeSampler(proc.pid, interval_s=0.05).start()
    proc.wait(30)
    sampler.stop()
    assert sampler.peak_rss >= 64 << 20
    # The child's 64 MiB is its own: PSS counts it whole; shared pages only in part.
    assert 64 << 20 <= sampler.peak_pss <= sampler.peak_rss
    assert sampler.cpu_s >= 0.3
    assert sampler.samples >= 5
    by_label = sampler.peak_rss_by_label()
    assert sum(by_label.values()) >= sampler.peak_rss
    assert set(by_label) == {Path(sys.executable).name}
    cpu_by_label = sampler.cpu_s_by_label()  # the busy child's 0.3 s, under its label
    assert set(cpu_by_label) == set(by_label) and cpu_by_label[Path(sys.executable).name] >= 0.3
