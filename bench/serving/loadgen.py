"""An async load generator for OpenAI-compatible servers: streaming ``/v1/chat/completions`` and
``/v1/completions`` over Server-Sent Events, measured from outside over real HTTP.

Per request: time to first token (TTFT), the gaps between streamed content events (inter-token
latency, ITL), the time per output token after the first (TPOT: what is left of E2E after
TTFT over the remaining tokens, blind to how the server groups its writes), end-to-end
latency (E2E), output tokens (the server's ``usage`` when it sends
one), prompt tokens and ``usage.prompt_tokens_details.cached_tokens`` when the server reports
them (``None`` when it does not: never guessed). Per workload: output tokens/s and requests/s
over the workload's wall time, p50/p95/p99 of TTFT, ITL, TPOT and E2E, failed requests, and the
server's peak RSS and CPU seconds summed over its whole process tree, sampled from ``/proc``
while the workload runs.

Arrival patterns: :func:`burst` (all at once), :func:`closed_loop` (clients that each send their
next request when the previous one is done), :func:`poisson` (exponential inter-arrival times at
a rate, seeded) and :func:`multi_turn` (chats that resend their growing history, each turn's
assistant text appended, as a chat client does).

A request fails when its status is not 200, the stream carries an error event, the stream ends
without ``data: [DONE]``, or the connection breaks; it is counted, never dropped. A connection
refused or reset before any response byte (a listen backlog overflowing) is retried a few times
with backoff, as the official OpenAI client does, the time counted in TTFT and the retries
reported.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import resource
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

CONNECT_RETRIES = 3  # the OpenAI client retries twice; one more for a backlog of 5
PERCENTILES = (50, 95, 99)
# What every request samples with: greedy unless the suite's --temperature / --top-p say.
SAMPLING: dict[str, float] = {"temperature": 0.0}


# -- one request ------------------------------------------------------------------------------


@dataclass
class Request:
    """One streamed request: ``messages`` for chat completions, else ``prompt``."""

    max_tokens: int
    prompt: str = ""
    messages: list[dict[str, str]] | None = None
    tag: str = ""  # groups results in the summary (e.g. a chat's turn)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            **SAMPLING,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.messages is not None:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        return body


@dataclass
class Result:
    ok: bool
    tag: str = ""
    error: str = ""
    start: float = 0.0  # perf_counter when first sent
    ttft: float | None = None  # None: no content arrived
    itl: list[float] = field(default_factory=list)  # gaps between content events
    e2e: float = 0.0
    output_tokens: int = 0
    tokens_from_usage: bool = False  # else counted as content events
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # None: the server did not report it
    text: str = ""
    retries: int = 0


class StreamError(Exception):
    """The server answered, but not with a complete stream."""


def sse_events(lines: Iterable[str]) -> list[str]:
    """The data of each Server-Sent Event in ``lines`` (no line endings): ``data`` fields
    joined with newlines, an event ending at a blank line or the end of the input; comments
    and other fields ignored."""
    events: list[str] = []
    parser = SSEParser()
    for line in lines:
        event = parser.line(line)
        if event is not None:
            events.append(event)
    if (event := parser.end()) is not None:
        events.append(event)
    return events


class SSEParser:
    """Incremental Server-Sent Events parsing, one line at a time (the WHATWG rules that
    OpenAI streams need: ``data:`` with or without one space, multi-line data, comments)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def line(self, line: str) -> str | None:
        """Feeds one line; returns an event's data when ``line`` ends one."""
        if line == "":
            return self.end()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def end(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def content_of(event: dict[str, Any]) -> str:
    """The text a chat or completion stream event carries ("" for none)."""
    text = []
    for choice in event.get("choices") or []:
        if "delta" in choice:
            text.append((choice["delta"] or {}).get("content") or "")
        else:
            text.append(choice.get("text") or "")
    return "".join(text)


async def send(
    client: httpx.AsyncClient, base: str, model: str, request: Request, retries: int = -1
) -> Result:
    """Streams ``request`` to the server at ``base``; every outcome is a :class:`Result`."""
    retries = CONNECT_RETRIES if retries < 0 else retries
    result = Result(ok=False, tag=request.tag, start=time.perf_counter())
    for attempt in range(retries + 1):
        try:
            await _stream(client, base + request.path, request.body(model), result)
            result.ok = True
            break
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError) as e:
            answered = getattr(e, "answered", False)
            if answered or attempt == retries:
                result.error = f"{type(e).__name__}: {e}"[:300]
                break
            result.retries += 1
            await asyncio.sleep(0.25 * 2**attempt)
        except Exception as e:  # any other outcome is a failed request, counted
            result.error = f"{type(e).__name__}: {e}"[:300]
            break
    result.e2e = time.perf_counter() - result.start
    return result


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], r: Result) -> None:
    parser = SSEParser()
    last: float | None = None
    done = False
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise StreamError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        try:
            async for line in response.aiter_lines():
                data = parser.line(line)
                if data is None:
                    continue
                now = time.perf_counter()
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    raise StreamError(f"error event: {json.dumps(event['error'])[:200]}")
                if text := content_of(event):
                    if last is None:
                        r.ttft = now - r.start
                    else:
                        r.itl.append(now - last)
                    last = now
                    r.text += text
                    if not r.tokens_from_usage:
                        r.output_tokens += 1
                if usage := event.get("usage"):
                    r.output_tokens = int(usage.get("completion_tokens") or 0)
                    r.tokens_from_usage = True
                    r.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        r.cached_tokens = int(details["cached_tokens"])
        except httpx.HTTPError as e:
            e.answered = True  # type: ignore[attr-defined]  # mid-stream: not retried
            raise
    if not done:
        raise StreamError("the stream ended without data: [DONE]")


# -- arrival patterns -------------------------------------------------------------------------

Send = Callable[[Request], Awaitable[Result]]


async def burst(send_one: Send, requests: Sequence[Request]) -> list[Result]:
    """Every request at once."""
    return list(await asyncio.gather(*(send_one(r) for r in requests)))


async def closed_loop(send_one: Send, clients: Sequence[Sequence[Request]]) -> list[Result]:
    """Each client sends its requests one after another; the clients run concurrently."""

    async def client(requests: Sequence[Request]) -> list[Result]:
        return [await send_one(r) for r in requests]

    per_client = await asyncio.gather(*(client(c) for c in clients))
    return [r for results in per_client for r in results]


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of ``n`` Poisson arrivals at ``rate`` per second: the
    first at 0, then exponential gaps from a seeded generator (the same for every server)."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


async def poisson(
    send_one: Send, requests: Sequence[Request], rate: float, seed: int = 0
) -> list[Result]:
    """Requests sent at Poisson arrival times (``rate`` per second), open loop: a slow
    server does not slow the arrivals."""
    start = time.perf_counter()

    async def at(offset: float, request: Request) -> Result:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        return await send_one(request)

    offsets = poisson_offsets(len(requests), rate, seed)
    return list(await asyncio.gather(*(at(o, r) for o, r in zip(offsets, requests, strict=True))))


@dataclass
class Chat:
    system: str
    user_turns: list[str]
    max_tokens: int


async def multi_turn(send_one: Send, chats: Sequence[Chat]) -> list[Result]:
    """Chats run concurrently; each turn resends the whole history (system prompt, every
    earlier user turn and assistant reply) plus its user turn, tagged ``turn <i>``. A failed
    turn ends its chat: the turns it could not send are failed results, not dropped."""

    async def chat(c: Chat) -> list[Result]:
        history = [{"role": "system", "content": c.system}]
        results: list[Result] = []
        for i, user in enumerate(c.user_turns):
            history.append({"role": "user", "content": user})
            result = await send_one(Request(c.max_tokens, messages=list(history), tag=f"turn {i}"))
            results.append(result)
            if not result.ok:
                results += [
                    Result(ok=False, tag=f"turn {j}", error="not sent: an earlier turn failed")
                    for j in range(i + 1, len(c.user_turns))
                ]
                break
            history.append({"role": "assistant", "content": result.text})
        return results

    per_chat = await asyncio.gather(*(chat(c) for c in chats))
    return [r for results in per_chat for r in results]


# -- the server's process tree ----------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat(pid: int) -> tuple[int, float, int] | None:
    """(parent pid, CPU seconds user + system, RSS bytes) of ``pid``; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    ppid, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
    return ppid, (utime + stime) / CLK_TCK, rss_pages * PAGE


def process_tree(root: int) -> dict[int, tuple[float, int]]:
    """{pid: (CPU seconds, RSS bytes)} of ``root`` and all its descendants."""
    parents: dict[int, int] = {}
    stats: dict[int, tuple[float, int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (s := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = s[0]
            stats[int(entry.name)] = (s[1], s[2])
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            tree[pid] = stats[pid]
            todo += children.get(pid, [])
    return tree


def pss_bytes(pid: int) -> int:
    """Proportional set size of ``pid`` (bytes; 0 if unreadable): its RSS with each page it
    shares with other processes counted as its share. Summed over a server's processes it
    counts a library they all map once, where summed RSS counts it in each of them."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def process_label(pid: int) -> str:
    """A short name for ``pid``: the module of ``python -m module``, else the program."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return str(pid)
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return Path(argv[0]).name or str(pid)


class TreeSampler:
    """Samples a process tree from a thread while a workload runs: the peaks of its summed RSS
    and summed PSS, and the CPU seconds its processes used between :meth:`start` and :meth:`stop` (a process
    that appears meanwhile counts from zero; one that exits counts up to its last sample)."""

    def __init__(self, root: int, interval_s: float = 0.1) -> None:
        self.root = root
        self.interval_s = interval_s
        self.peak_rss = 0
        self.peak_pss = 0
        self.peak_rss_by_pid: dict[int, int] = {}
        self.labels: dict[int, str] = {}
        self.samples = 0
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TreeSampler:
        self._first = {pid: cpu for pid, (cpu, _) in process_tree(self.root).items()}
        self._last = dict(self._first)
        self._thread.start()
        return self

    def _sample(self) -> None:
        tree = process_tree(self.root)
        self.samples += 1
        self.peak_rss = max(self.peak_rss, sum(rss for _, rss in tree.values()))
        self.peak_pss = max(self.peak_pss, sum(pss_bytes(pid) for pid in tree))
        for pid, (_, rss) in tree.items():
            self.peak_rss_by_pid[pid] = max(rss, self.peak_rss_by_pid.get(pid, 0))
            if pid not in self.labels:
                self.labels[pid] = process_label(pid)
        self._last.update({pid: cpu for pid, (cpu, _) in tree.items()})

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def peak_rss_by_label(self) -> dict[str, int]:
        """Each process's own peak RSS (bytes), summed per label."""
        out: dict[str, int] = {}
        for pid, rss in self.peak_rss_by_pid.items():
            label = self.labels.get(pid, str(pid))
            out[label] = out.get(label, 0) + rss
        return out

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu_s_by_label().values())

    def cpu_s_by_label(self) -> dict[str, float]:
        """CPU seconds each label's processes used while sampled (where a server's cores go:
        the model, or the processes around it)."""
        out: dict[str, float] = {}
        for pid, cpu in self._last.items():
            label = self.labels.get(pid, str(pid))
            out[label] = out.get(label, 0.0) + cpu - self._first.get(pid, 0.0)
        return out


# -- statistics -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile with linear interpolation between closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def spread(values: Sequence[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in PERCENTILES}


@dataclass
class Summary:
    requests: int
    failed: int
    retries: int
    wall_s: float
    output_tokens: int
    content_events: int  # streamed events with text: output_tokens when each token is one
    output_tok_s: float
    requests_s: float
    ttft: dict[str, float | None]
    itl: dict[str, float | None]
    tpot: dict[str, float | None]  # per request: (E2E - TTFT) / (output tokens - 1)
    e2e: dict[str, float | None]
    prompt_tokens: int | None  # None: the server reported it for no request
    cached_tokens: int | None  # None: the server reported it for no request
    cached_fraction: float | None
    ttft_p50_by_tag: dict[str, float | None]
    errors: list[str]
    server_peak_rss_mb: float | None = None
    server_peak_rss_mb_by_process: dict[str, float] | None = None
    server_peak_pss_mb: float | None = None  # None: not measured (a run from before it was)
    server_cpu_s: float | None = None
    server_cpu_s_by_process: dict[str, float] | None = None
    client_cpu_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: Sequence[Result], wall_s: float) -> Summary:
    """Workload figures from its requests' results; rates over ``wall_s``. Latency spreads are
    over successful requests; failures are counted, their first distinct errors kept."""
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    with_prompt = [r for r in ok if r.prompt_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in with_prompt) if with_prompt else None
    cached = sum(r.cached_tokens or 0 for r in reported) if reported else None
    cached_prompt = sum(r.prompt_tokens or 0 for r in reported)
    tags = sorted({r.tag for r in ok if r.tag})
    errors: list[str] = []
    for r in results:
        if not r.ok and r.error not in errors:
            errors.append(r.error)
    return Summary(
        requests=len(results),
        failed=len(results) - len(ok),
        retries=sum(r.retries for r in results),
        wall_s=wall_s,
        output_tokens=tokens,
        content_events=sum(len(r.itl) + 1 for r in ok if r.ttft is not None),
        output_tok_s=tokens / wall_s if wall_s > 0 else 0.0,
        requests_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        ttft=spread([r.ttft for r in ok if r.ttft is not None]),
        itl=spread([gap for r in ok for gap in r.itl]),
        tpot=spread(
            [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft and r.output_tokens > 1]
        ),
        e2e=spread([r.e2e for r in ok]),
        prompt_tokens=prompt,
        cached_tokens=cached,
        cached_fraction=cached / cached_prompt if cached is not None and cached_prompt else None,
        ttft_p50_by_tag={
            t: percentile([r.ttft for r in ok if r.tag == t and r.ttft is not None], 50)
            for t in tags
        },
        errors=errors[:5],
    )


async def measure(
    run: Callable[[Send], Awaitable[list[Result]]],
    base: str,
    model: str,
    server_pid: int | None = None,
    timeout_s: float = 1800.0,
) -> tuple[Summary, list[Result]]:
    """Runs one workload (``run`` given the function that sends a request) against the server
    at ``base``, sampling the process tree of ``server_pid`` meanwhile."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def send_one(request: Request) -> Result:
            return await send(client, base, model, request)

        sampler = TreeSampler(server_pid).start() if server_pid else None
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        try:
            results = await run(send_one)
        finally:
            wall = time.perf_counter() - start
            if sampler:
                sampler.stop()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    summary = summarize(results, wall)
    summary.client_cpu_s = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    if sampler:
        summary.server_peak_rss_mb = sampler.peak_rss / 2**20
        summary.server_peak_pss_mb = sampler.peak_pss / 2**20 or None
        summary.server_peak_rss_mb_by_process = {
            k: v / 2**20 for k, v in sampler.peak_rss_by_label().items()
        }
        summary.server_cpu_s = sampler.cpu_s
        summary.server_cpu_s_by_process = sampler.cpu_s_by_label()
    return summary, results
