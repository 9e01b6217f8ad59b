"""kvserve against mlx_lm.server, side by side: the same model, the same BLAS, the same
requests, in one run (issue 13's benchmark suite).

    .venv/bin/python bench/serving/run.py --quick    # CPU, a 3M-parameter model: ~4 minutes
    .venv/bin/python bench/serving/run.py            # full size: a 77M model on CPU, ~1B on GPU
    python3 bench/serving/run.py --gpu               # issue 14's GPU suite (docs/gpu-serving-benchmark.md)

Three servers, each started fresh, sent one cold request (reported apart), then every workload,
then stopped:

- **kvserve**: ``python -m kvserve_launch`` (launcher, cache service, one worker, gateway) with
  no tuning flags: its defaults are what is measured;
- **kvserve-no-cache**: the same with prefix caching off (``KVWORKER_PREFIX_CACHING=0``);
- **mlx_lm.server**: ``python -m mlx_lm server`` with its defaults;
- **mlx_lm.server-p1** (only when named in ``--servers``; the shared-prefix workloads only): the
  same with ``--prompt-concurrency 1``, a baseline that ran out of GPU memory later than the
  defaults on the GPU suite's long shared prefixes; **mlx_lm.server-p1-d8** (the same way)
  also with ``--decode-concurrency 8``.

A server that no longer answers a short request after a workload with failures (mlx_lm.server's
generation thread dies on running out of GPU memory, the process stays up) is restarted for
the workloads that follow.

The model is a random Llama made locally (``bench_models.make_model``: the default model's
byte-level tokenizer, so one character is one token; no download) whose LM head lets greedy
decoding pick only printable ASCII and newline: it never stops early (every request generates
all its tokens) and every token is a whole character (one streamed event each). On CPU both
servers start under the BLAS the worker would choose (``fast_blas_env``).

Workloads, streamed, temperature 0 unless ``--temperature`` (and ``--top-p``) set another for
every request (``--quick`` keeps every shape and sends fewer requests
where a number is in parentheses; its speed comes from the 3M-parameter model):

- shared-prefix x8 and x32: chat, a 1,500-token system prompt shared by all, a 32-token user
  turn each, 32 out, all at once;
- unique prompts: completions, 8 (4) closed-loop clients x 2 requests of 1,500 own tokens,
  32 out;
- poisson: 32 (16) completions of 1,500 own tokens, 32 out, arriving at ``--poisson-rate``, by
  default 0.9 x the requests/s the first server (mlx_lm.server) sustained on the unique
  prompts, the same shape (so near its saturation; the same seeded arrivals for every server);
- multi-turn: 4 chats x 4 turns, a shared 1,000-token system prompt, 32-token user turns, 32
  out, each turn resending the whole history with the assistant's replies;
- 4k prompts: completions, 2 (1) closed-loop clients x 2 requests of 4,096 own tokens, 32 out;
- decode-heavy: 32 completions at once, 96-token own prompts, 256 out.

On a GPU (``--gpu``, or by itself when MLX's default device is a GPU and ``--quick`` is not
given) the GPU suite runs instead, where a prefix costs enough to show what sharing buys
(issue 14; the sizes are in ``GPU_WORKLOADS``): 64 chats at once sharing an 8,000-token
system prompt and 8 sharing a 32,000-token one (+32 own, 64 out), 8 chats x 4 turns over a
4,000-token system prompt, a unique-prompt control (32 closed-loop clients x 2 completions of
2,000 own tokens, 64 out) and decode-heavy (32 at once, 96 own, 256 out). Before the servers
it measures mlx-lm's own dense batched decode (``batch_generate``) on the decode-heavy shape,
the reference for kvserve's decode rate at batch 32. ``--gpu-scale`` shrinks every prompt
and client count of that suite (a dry run on a CPU), ``--deadline-min`` skips what would
start after a deadline, and the figures are rewritten to the JSON after every workload, so a
run cut short still leaves what it measured (``--render`` draws it).

Writes the figures between the generated-section markers of ``--out`` (default
docs/serving-benchmark.md; text outside them is kept), a PNG plot beside it (``--plot``,
matplotlib from the ``bench`` extra: ``pip install -e '.[bench]'``), the figures as JSON
(``--json``) and, with ``--raw``, every request's timings.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(ROOT)]

import loadgen  # noqa: E402
from bench_models import gpu_name, make_model  # noqa: E402
from loadgen import Chat, Request, Result, Send, Summary  # noqa: E402

from kvserve_model.blas import fast_blas_env, select_blas  # noqa: E402

# mlx_lm.server variants with fewer prompts prefilled together (--prompt-concurrency 1) and
# fewer requests decoding together (--decode-concurrency 8), else its defaults: on an H100 its
# default of 8 long prompts prefilled together ran out of GPU memory on the GPU suite's
# shared-prefix bursts, and with one at a time it still ran out later, in decode (32 at once),
# so these are the baselines that may serve them. They run only those workloads.
BASELINE_VARIANTS: dict[str, tuple[str, ...]] = {
    "mlx_lm.server-p1": ("--prompt-concurrency", "1"),
    "mlx_lm.server-p1-d8": ("--prompt-concurrency", "1", "--decode-concurrency", "8"),
}
SERVERS = ("mlx_lm.server", *BASELINE_VARIANTS, "kvserve", "kvserve-no-cache")
DEFAULT_SERVERS = ("mlx_lm.server", "kvserve", "kvserve-no-cache")
VARIANT_WORKLOADS = ("shared-prefix",)
BEGIN, END = "<!-- generated: bench/serving/run.py -->", "<!-- end generated -->"


# -- workloads --------------------------------------------------------------------------------


def text(seed: int, n: int) -> str:
    """``n`` characters (``n`` tokens of the byte-level tokenizer) of seeded lowercase words."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz      ") for _ in range(n))


@dataclass
class Workload:
    name: str
    shape: str
    pattern: str  # burst | closed-loop | poisson | multi-turn
    requests: list[Request] = field(default_factory=list)
    clients: list[list[Request]] = field(default_factory=list)
    chats: list[Chat] = field(default_factory=list)
    rate: float = 0.0  # Poisson arrivals per second; 0: derived in the run
    rate_from: str = ""  # the workload whose requests/s x 0.9 sets the rate

    def runner(self) -> Callable[[Send], Awaitable[list[Result]]]:
        if self.pattern == "burst":
            return lambda send: loadgen.burst(send, self.requests)
        if self.pattern == "closed-loop":
            return lambda send: loadgen.closed_loop(send, self.clients)
        if self.pattern == "poisson":
            return lambda send: loadgen.poisson(send, self.requests, self.rate, seed=13)
        return lambda send: loadgen.multi_turn(send, self.chats)


def workloads(quick: bool) -> list[Workload]:
    def size(full: int, small: int) -> int:
        return small if quick else full

    out = 32
    prompt_len = 1500  # shared prefixes, unique and Poisson prompts
    system_len = 1000

    def shared_burst(n: int, seed: int) -> Workload:
        system = text(seed, prompt_len)
        requests = [
            Request(out, messages=[system_msg(system), user_msg(text(seed * 1000 + i, 32))])
            for i in range(n)
        ]
        return Workload(
            f"shared-prefix x{n}",
            f"{n} at once, {prompt_len:,} shared + 32 own, {out} out (chat)",
            "burst",
            requests=requests,
        )

    n_clients = size(8, 4)
    unique = Workload(
        "unique prompts",
        f"{n_clients} clients x 2, {prompt_len:,} own, {out} out",
        "closed-loop",
        clients=[
            [Request(out, prompt=text(3000 + 2 * c + k, prompt_len)) for k in range(2)]
            for c in range(n_clients)
        ],
    )
    n_poisson = size(32, 16)
    poisson = Workload(
        "poisson",
        f"{n_poisson} arrivals, {prompt_len:,} own, {out} out",
        "poisson",
        requests=[Request(out, prompt=text(5000 + i, prompt_len)) for i in range(n_poisson)],
        rate_from=unique.name,
    )
    chats = [
        Chat(
            system=text(6000, system_len),
            user_turns=[text(6100 + 10 * c + t, 32) for t in range(4)],
            max_tokens=out,
        )
        for c in range(4)
    ]
    multi = Workload(
        "multi-turn",
        f"4 chats x 4 turns, {system_len:,} shared system + 32 a turn, {out} out",
        "multi-turn",
        chats=chats,
    )
    long_clients, long_out = size(2, 1), out
    long = Workload(
        "4k prompts",
        f"{long_clients} client{'s' if long_clients > 1 else ''} x 2, 4,096 own, {long_out} out",
        "closed-loop",
        clients=[
            [Request(long_out, prompt=text(7000 + 2 * c + k, 4096)) for k in range(2)]
            for c in range(long_clients)
        ],
    )
    decode_out = 256
    decode = Workload(
        "decode-heavy",
        f"32 at once, 96 own, {decode_out} out",
        "burst",
        requests=[Request(decode_out, prompt=text(8000 + i, 96)) for i in range(32)],
    )
    return [
        shared_burst(8, 1),
        shared_burst(32, 2),
        unique,
        poisson,
        multi,
        long,
        decode,
    ]


@dataclass(frozen=True)
class GpuShape:
    """One workload of the GPU suite: ``clients`` chats (or completion clients) at once, each
    with ``shared`` tokens of system prompt common to all (0: none), ``own`` tokens of its own
    and ``out`` tokens out, ``turns`` turns a chat or requests a closed-loop client."""

    name: str
    pattern: str  # burst | closed-loop | multi-turn
    clients: int
    shared: int
    own: int
    out: int
    turns: int = 1


# Issue 14's GPU suite: where a prefix costs enough for sharing to matter, a unique-prompt
# control and decode-heavy load. Every size of the suite is here.
GPU_WORKLOADS = [
    GpuShape("shared-prefix 8k x64", "burst", clients=64, shared=8000, own=32, out=64),
    GpuShape("shared-prefix 32k x8", "burst", clients=8, shared=32000, own=32, out=64),
    GpuShape("multi-turn 4k", "multi-turn", clients=8, shared=4000, own=32, out=64, turns=4),
    GpuShape("unique prompts 2k", "closed-loop", clients=32, shared=0, own=2000, out=64, turns=2),
    GpuShape("decode-heavy", "burst", clients=32, shared=0, own=96, out=256),
]
GPU_CONTEXT = 40960  # the GPU suite's model declares this context (32k prompts + chat + out)


def gpu_workloads(scale: float = 1.0) -> list[Workload]:
    """The GPU suite; ``scale`` below 1 shrinks every prompt and client count (outputs and
    turns stay), for a dry run on a CPU."""
    out: list[Workload] = []
    for i, g in enumerate(GPU_WORKLOADS):
        seed = 20000 + 1000 * i
        clients = max(2, round(g.clients * scale)) if scale < 1 else g.clients
        shared = round(g.shared * scale) if scale < 1 else g.shared
        own = max(8, round(g.own * scale)) if scale < 1 and g.own > 96 else g.own
        system = text(seed, shared)
        if g.pattern == "multi-turn":
            chats = [
                Chat(
                    system=system,
                    user_turns=[text(seed + 10 * c + t + 1, own) for t in range(g.turns)],
                    max_tokens=g.out,
                )
                for c in range(clients)
            ]
            shape = (
                f"{clients} chats x {g.turns} turns, {shared:,} shared system + {own} a turn, "
                f"{g.out} out, the whole history resent each turn"
            )
            out.append(Workload(g.name, shape, g.pattern, chats=chats))
        elif g.pattern == "closed-loop":
            clients_ = [
                [
                    Request(g.out, prompt=text(seed + g.turns * c + k + 1, own))
                    for k in range(g.turns)
                ]
                for c in range(clients)
            ]
            shape = f"{clients} clients x {g.turns}, {own:,} own, {g.out} out"
            out.append(Workload(g.name, shape, g.pattern, clients=clients_))
        elif shared:
            requests = [
                Request(g.out, messages=[system_msg(system), user_msg(text(seed + c + 1, own))])
                for c in range(clients)
            ]
            shape = f"{clients} at once, {shared:,} shared + {own} own, {g.out} out (chat)"
            out.append(Workload(g.name, shape, g.pattern, requests=requests))
        else:
            requests = [Request(g.out, prompt=text(seed + c + 1, own)) for c in range(clients)]
            shape = f"{clients} at once, {own:,} own, {g.out} out"
            out.append(Workload(g.name, shape, g.pattern, requests=requests))
    return out


def system_msg(content: str) -> dict[str, str]:
    return {"role": "system", "content": content}


def user_msg(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


# -- servers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    base: str
    log: Path
    ready_s: float


def start_server(name: str, model: Path, logs: Path) -> Server:
    env = fast_blas_env()  # on CPU both servers get the same BLAS; a no-op on a GPU
    port = free_port()
    if name.startswith("mlx_lm.server"):
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model)]
        cmd += ["--port", str(port), "--log-level", "WARNING"]
        cmd += BASELINE_VARIANTS.get(name, ())
    else:
        cmd = [sys.executable, "-m", "kvserve_launch", "--model", str(model)]
        cmd += ["--http-port", str(port), "--grpc-port", str(free_port())]
        # KVSERVE_LOG_LEVEL=DEBUG: the worker's one line a step and each admission in --logs
        level = os.environ.get("KVSERVE_LOG_LEVEL", "WARNING")
        cmd += ["--cache-port", str(free_port()), "--log-level", level]
        cmd += ["--startup-timeout-s", "900"]
        if name == "kvserve-no-cache":
            env["KVWORKER_PREFIX_CACHING"] = "0"
    log = logs / f"{name}.log"
    start = time.perf_counter()
    with log.open("ab") as f:  # a server restarted after a crash appends
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail(log)}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return Server(name, proc, base, log, time.perf_counter() - start)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{name} not ready after 900 s:\n{tail(log)}")


def tail(log: Path, lines: int = 30) -> str:
    """The last lines of a server's log, the admin token the launcher prints masked."""
    text = "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return re.sub(r"(Bearer |--token )\S+", r"\1***", text)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the server's process group (the launcher stops its children on it), then
    SIGKILL after 60 s."""
    group = os.getpgid(proc.pid)
    os.killpg(group, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(group, signal.SIGKILL)
        proc.wait()


def run_server(
    name: str,
    model: Path,
    ws: list[Workload],
    logs: Path,
    rates: dict[str, float],
    saved: Callable[[dict[str, Any]], None] = lambda out: None,
    deadline: float = float("inf"),
) -> dict[str, Any]:
    """Starts ``name``, runs the cold request and every workload, stops it. ``saved`` is
    given the figures so far after each workload; a workload that would start after
    ``deadline`` (``time.time()``) is skipped, and listed as such."""
    print(f"\n## {name}", flush=True)
    server = start_server(name, model, logs)
    print(f"ready in {server.ready_s:.1f} s", flush=True)
    out: dict[str, Any] = {"ready_s": server.ready_s, "workloads": {}, "raw": {}}
    out["load_before"] = os.getloadavg()[0]
    saved(out)
    try:
        cold = Workload("cold", "", "burst", requests=[Request(8, prompt=text(1, 64))])
        summary, _ = asyncio.run(
            loadgen.measure(cold.runner(), server.base, str(model), server.proc.pid)
        )
        out["cold"] = summary.as_dict()
        print(f"cold request: TTFT {fmt_s(summary.ttft['p50'])}, E2E {fmt_s(summary.e2e['p50'])}")
        calibrations = {w.rate_from for w in ws if w.rate_from}
        for w in ws:
            if name in BASELINE_VARIANTS and not w.name.startswith(VARIANT_WORKLOADS):
                continue
            if time.time() > deadline:
                out.setdefault("skipped", []).append(w.name)
                print(f"{w.name}: skipped (past --deadline-min)", flush=True)
                continue
            if w.pattern == "poisson" and not w.rate:
                w.rate = rates.get(w.rate_from, 0.0)
                if not w.rate:
                    raise RuntimeError(f"{w.name}: no rate (run {w.rate_from!r} first)")
            summary, results = asyncio.run(
                loadgen.measure(w.runner(), server.base, str(model), server.proc.pid)
            )
            out["raw"][w.name] = [raw(r) for r in results]
            if w.name in calibrations and w.name not in rates and summary.requests_s:
                rates[w.name] = 0.9 * summary.requests_s
            out["workloads"][w.name] = summary.as_dict()
            out["workloads"][w.name]["rate"] = w.rate or None
            if w.pattern == "burst":
                out["workloads"][w.name]["first_vs_rest"] = first_vs_rest(results)
            print(progress(w, summary), flush=True)
            saved(out)
            if summary.failed and not answers(server, model):
                # e.g. mlx_lm.server's generation thread dies on running out of GPU memory and
                # the process answers 404 to everything after: restart it for what follows
                print(f"{name} no longer answers after {w.name}: restarting it", flush=True)
                out.setdefault("restarted_after", []).append(w.name)
                stop(server.proc)
                server = start_server(name, model, logs)
            if server.proc.poll() is not None:
                raise RuntimeError(f"{name} died during {w.name}:\n{tail(server.log)}")
    except Exception as e:  # recorded and reported: the other servers still run
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"{name}: {out['error']}", flush=True)
    finally:
        stop(server.proc)
        saved(out)
    return out


def answers(server: Server, model: Path) -> bool:
    """Whether ``server`` still serves a short request."""
    probe = Workload("probe", "", "burst", requests=[Request(4, prompt=text(2, 16))])
    try:
        summary, _ = asyncio.run(
            loadgen.measure(probe.runner(), server.base, str(model), timeout_s=120)
        )
    except Exception:
        return False
    return summary.failed == 0 and server.proc.poll() is None


def first_vs_rest(results: list[Result], batch: int = 32) -> dict[str, Any]:
    """In a burst, the first request to get a token against the others: the lowest TTFT, and
    the others' TTFT p50/p95/max, all of them and those ranked 2 to ``batch`` by TTFT (the
    ones a batch of that size could have started with the first). Issue 14: requests deferred
    on a prefix another request is computing should start the moment its blocks are
    committed."""
    ttfts = sorted(r.ttft for r in results if r.ok and r.ttft is not None)
    if not ttfts:
        return {}
    rest, batch_rest = ttfts[1:], ttfts[1:batch]
    return {
        "first": ttfts[0],
        "rest": {**loadgen.spread(rest), "max": rest[-1] if rest else None, "n": len(rest)},
        "batch_rest": {
            "p50": loadgen.percentile(batch_rest, 50),
            "max": batch_rest[-1] if batch_rest else None,
            "n": len(batch_rest),
        },
        "batch": batch,
    }


def raw(r: Result) -> dict[str, Any]:
    """One request's figures (no text), for ``--raw``."""
    keep = (
        "ok",
        "tag",
        "error",
        "ttft",
        "e2e",
        "output_tokens",
        "prompt_tokens",
        "cached_tokens",
        "retries",
    )
    return {k: getattr(r, k) for k in (*keep, "itl")}


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def progress(w: Workload, s: Summary) -> str:
    line = (
        f"{w.name:20} {s.requests:3} req, {s.failed} failed, {s.output_tok_s:7.1f} out tok/s, "
        f"{s.requests_s:5.2f} req/s, TTFT p50 {fmt_s(s.ttft['p50'])} p99 {fmt_s(s.ttft['p99'])}, "
        f"wall {s.wall_s:.1f} s, RSS {s.server_peak_rss_mb or 0:.0f} MiB, "
        f"CPU {s.server_cpu_s or 0:.1f} s"
    )
    if s.cached_fraction is not None:
        line += f", cached {s.cached_fraction:.2f}"
    if s.errors:
        line += f"\n    errors: {s.errors}"
    return line


# -- report -----------------------------------------------------------------------------------


def source_tree() -> str:
    """The commit measured, and the top-level paths with uncommitted changes (read-only git)."""
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    dirty = sorted({line[3:].split("/")[0] for line in status.splitlines() if line.strip()})
    return head + (f" with uncommitted changes in {', '.join(dirty)}" if dirty else "")


def machine() -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm

    cpu = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = mx.default_device().type == mx.gpu
    chosen = None if gpu else select_blas().chosen  # the servers get no BLAS on a GPU
    return {
        "gpu": gpu_name() if gpu else "",
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "device": mx.default_device().type.name,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "blas": "n/a (GPU)" if gpu else chosen.name if chosen else "MLX's reference BLAS",
        "python": platform.python_version(),
        "load_before": os.getloadavg()[0],
        "tree": source_tree(),
    }


def n(v: float | None, digits: int = 2) -> str:
    return "" if v is None else f"{v:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "" if not a or not b else f"{a / b:.2f}"


ROWS: list[tuple[str, Callable[[dict[str, Any]], float | None], int]] = [
    ("out tok/s", lambda s: s["output_tok_s"], 1),
    ("req/s", lambda s: s["requests_s"], 2),
    ("TTFT p50 s", lambda s: s["ttft"]["p50"], 2),
    ("TTFT p95 s", lambda s: s["ttft"]["p95"], 2),
    ("TTFT p99 s", lambda s: s["ttft"]["p99"], 2),
    ("ITL p50 ms", lambda s: ms(s["itl"]["p50"]), 1),
    ("ITL p95 ms", lambda s: ms(s["itl"]["p95"]), 1),
    ("ITL p99 ms", lambda s: ms(s["itl"]["p99"]), 1),
    ("TPOT p50 ms", lambda s: ms((s.get("tpot") or {}).get("p50")), 1),
    ("E2E p50 s", lambda s: s["e2e"]["p50"], 2),
    ("E2E p95 s", lambda s: s["e2e"]["p95"], 2),
    ("E2E p99 s", lambda s: s["e2e"]["p99"], 2),
    ("cached", lambda s: s["cached_fraction"], 2),
    ("peak RSS MiB", lambda s: s["server_peak_rss_mb"], 0),
    ("peak PSS MiB", lambda s: s.get("server_peak_pss_mb"), 0),
    ("CPU s", lambda s: s["server_cpu_s"], 1),
]
RATIO_ROWS = [
    "out tok/s",
    "TTFT p50 s",
    "TTFT p95 s",
    "TPOT p50 ms",
    "E2E p50 s",
    "E2E p95 s",
    "peak RSS MiB",
    "peak PSS MiB",
    "CPU s",
]


def ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


# Issue 13's targets against mlx_lm.server: (workload, target, row, kvserve better when the
# row is "higher" or "lower", by at least this factor).
TARGETS = [
    ("shared-prefix x8", "TTFT p50 at least 10x lower", "TTFT p50 s", "lower", 10.0),
    ("shared-prefix x8", "output tok/s at least 6x", "out tok/s", "higher", 6.0),
    ("shared-prefix x8", "peak memory at most half", "peak RSS MiB", "lower", 2.0),
    ("unique prompts", "output tok/s at least 1.5x", "out tok/s", "higher", 1.5),
    ("unique prompts", "TTFT p50 at least 1.5x lower", "TTFT p50 s", "lower", 1.5),
    ("multi-turn", "TTFT p50 at least 3x lower", "TTFT p50 s", "lower", 3.0),
    ("decode-heavy", "output tok/s at least 1.5x", "out tok/s", "higher", 1.5),
    ("decode-heavy", "TTFT p50 no worse", "TTFT p50 s", "lower", 1.0),
]


def markdown(data: dict[str, Any]) -> str:
    runs, ws = data["servers"], data["workloads"]
    names = [s for s in SERVERS if s in runs]
    m = data["machine"]
    where = (
        f"an {m['gpu']} with {m['cores']} cores of an {m['cpu']} ({m['memory_gib']} GiB), "
        f"MLX on its {m['device']}, MLX {m['mlx']}, mlx-lm {m['mlx_lm']}"
        if m.get("gpu")
        else f"{m['cores']} cores of an {m['cpu']} ({m['memory_gib']} GiB, {m['device']}), "
        f"MLX {m['mlx']}, mlx-lm {m['mlx_lm']}, BLAS {m['blas']} for every server"
    )
    lines = [
        BEGIN,
        "",
        f"Measured {data['date']} on {where}, "
        f"Python {m['python']}; source {m.get('tree', 'unknown')}; load average {m['load_before']:.2f} at the start. Model: "
        f"{data['model']}. {data['wall_min']:.1f} minutes in all. Command:",
        "",
        f"    {data['command']}",
        "",
        *(
            [
                "Statistics added since (TPOT), from that run's per-request records:",
                "",
                f"    {data['rendered']}",
                "",
            ]
            if data.get("rendered")
            else []
        ),
        "Figures per workload and server (latencies of successful requests; ITL: gaps between "
        "streamed content events; TPOT: per request, (E2E - TTFT) / (output tokens - 1); cached: the fraction of prompt tokens the server reported as "
        "cached, blank where it reported none; peak RSS, PSS and CPU: the server's whole "
        "process tree, sampled every 0.1 s; PSS counts a page that processes share once, "
        "RSS once in each):",
        "",
    ]
    head = ["workload", "server", "requests", "failed", *(r[0] for r in ROWS)]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in ws:
        for name in names:
            s = runs[name]["workloads"].get(w["name"])
            if s is None:
                continue
            failed = f"{s['failed']}" + (f" ({s['retries']} retried)" if s["retries"] else "")
            cells = [w["name"], name, str(s["requests"]), failed]
            cells += [n(get(s), d) for _, get, d in ROWS]
            lines.append("| " + " | ".join(cells) + " |")
    events = {
        name: (
            sum(s.get("content_events", 0) for s in runs[name]["workloads"].values()),
            sum(s["output_tokens"] for s in runs[name]["workloads"].values()),
        )
        for name in names
    }
    lines += [
        "",
        "Streamed content events / output tokens (equal: every ITL gap is one token): "
        + ", ".join(f"{name} {e:,} / {t:,}" for name, (e, t) in events.items())
        + ".",
    ]
    lines += ["", "Workloads:", ""]
    for w in ws:
        rate = next(
            (
                runs[x]["workloads"][w["name"]]["rate"]
                for x in names
                if w["name"] in runs[x]["workloads"]
            ),
            None,
        )
        extra = ""
        if rate:
            extra = f"; {rate:.3f} requests/s"
            if w["name"] in data.get("derived_rates", ()):
                extra += f" (0.9 x {data['rate_server']}'s requests/s on unique prompts)"
        lines.append(f"- **{w['name']}** ({w['pattern']}): {w['shape']}{extra}")
    for other in ("mlx_lm.server", *BASELINE_VARIANTS, "kvserve-no-cache"):
        if "kvserve" not in names or other not in names:
            continue
        lines += [
            "",
            f"kvserve / {other} (above 1 is better for tokens/s, below 1 for latency, memory "
            "and CPU):",
            "",
        ]
        lines += [
            "| workload | " + " | ".join(RATIO_ROWS) + " |",
            "|" + "---|" * (len(RATIO_ROWS) + 1),
        ]
        for w in ws:
            a = runs["kvserve"]["workloads"].get(w["name"])
            b = runs[other]["workloads"].get(w["name"])
            if a is None or b is None:
                continue
            cells = [ratio(row(r)(a), row(r)(b)) for r in RATIO_ROWS]
            lines.append(f"| {w['name']} | " + " | ".join(cells) + " |")
    for w in ws:
        if w["pattern"] != "multi-turn":
            continue
        tags = sorted(
            {
                t
                for name in names
                for t in runs[name]["workloads"].get(w["name"], {}).get("ttft_p50_by_tag", {})
            },
            key=lambda t: int(t.split()[-1]) if t.split()[-1].isdigit() else 0,
        )
        lines += ["", f"{w['name'].capitalize()}, TTFT p50 s by turn:", ""]
        lines += ["| server | " + " | ".join(tags) + " |", "|---|" + "---|" * len(tags)]
        for name in names:
            by = runs[name]["workloads"].get(w["name"], {}).get("ttft_p50_by_tag", {})
            lines.append(f"| {name} | " + " | ".join(n(by.get(t)) for t in tags) + " |")
    if data.get("suite") == "gpu":
        lines += gpu_sections(data, names)
    lines += ["", "Peak RSS MiB of each process of a server (its highest over the workloads):", ""]
    for name in names:
        peaks: dict[str, float] = {}
        for s in runs[name]["workloads"].values():
            for label, mb in (s.get("server_peak_rss_mb_by_process") or {}).items():
                peaks[label] = max(mb, peaks.get(label, 0.0))
        lines.append(
            f"- {name}: " + ", ".join(f"{label} {mb:.0f}" for label, mb in sorted(peaks.items()))
        )
    lines += ["", "CPU seconds of each process of a server, per workload:", ""]
    for name in names:
        for wname, s in runs[name]["workloads"].items():
            by = s.get("server_cpu_s_by_process") or {}
            if by:
                cells = ", ".join(f"{label} {cpu:.1f}" for label, cpu in sorted(by.items()))
                lines.append(f"- {name}, {wname}: {cells}")
    lines += ["", "Cold first request (8 tokens out) and time to ready:", ""]
    lines += ["| server | ready s | TTFT s | E2E s | load average at its start |"]
    lines += ["|---|---|---|---|---|"]
    for name in names:
        c = runs[name].get("cold", {})
        lines.append(
            f"| {name} | {n(runs[name]['ready_s'], 1)} | {n(c.get('ttft', {}).get('p50'))} | "
            f"{n(c.get('e2e', {}).get('p50'))} | {n(runs[name].get('load_before'))} |"
        )
    if "kvserve" in names and "mlx_lm.server" in names and data.get("suite") != "gpu":
        lines += ["", "Issue 13's targets against mlx_lm.server, in this run:", ""]
        lines += ["| workload | target | kvserve | |", "|---|---|---|---|"]
        for wname, what, rname, better, factor in TARGETS:
            a = runs["kvserve"]["workloads"].get(wname)
            b = runs["mlx_lm.server"]["workloads"].get(wname)
            ka, mb = (row(rname)(a), row(rname)(b)) if a and b else (None, None)
            if not ka or not mb:
                continue
            gain = ka / mb if better == "higher" else mb / ka
            got = f"{gain:.2f}x"
            if better == "lower":
                got = f"{gain:.2f}x lower" if gain >= 1 else f"{1 / gain:.2f}x higher"
            lines.append(f"| {wname} | {what} | {got} | {'met' if gain >= factor else 'missed'} |")
    errors = [
        f"- {name}, {w}: " + "; ".join(s["errors"])
        for name in names
        for w, s in runs[name]["workloads"].items()
        if s["errors"]
    ]
    if errors:
        lines += ["", "Errors of failed requests (first distinct ones):", "", *errors]
    aborted = [
        f"- {name}: {runs[name]['error'][:500]}" for name in names if runs[name].get("error")
    ]
    if aborted:
        lines += ["", "Servers whose run stopped early:", "", *aborted]
    skipped = [
        f"- {name}: " + ", ".join(runs[name]["skipped"])
        for name in names
        if runs[name].get("skipped")
    ]
    if skipped:
        lines += ["", "Workloads not run (past `--deadline-min`):", "", *skipped]
    lines += ["", f"![serving benchmark]({data['plot']})", "", END]
    return "\n".join(lines) + "\n"


# Issue 14's end-to-end targets against mlx_lm.server on a GPU: (workload, target, row,
# better "higher" or "lower", factor). Every workload's out tok/s at least 1.0x is checked too.
GPU_TARGETS = [
    ("shared-prefix 8k x64", "TTFT p50 at least 10x lower", "TTFT p50 s", "lower", 10.0),
    ("shared-prefix 8k x64", "output tok/s at least 3x", "out tok/s", "higher", 3.0),
    ("shared-prefix 32k x8", "TTFT p50 at least 10x lower", "TTFT p50 s", "lower", 10.0),
    ("shared-prefix 32k x8", "output tok/s at least 3x", "out tok/s", "higher", 3.0),
]


def gain_cell(a: float | None, b: float | None, better: str, factor: float) -> list[str]:
    """[kvserve's gain over the baseline, met/missed] for one target row."""
    if not a or not b:
        return ["", "not measured"]
    gain = a / b if better == "higher" else b / a
    got = f"{gain:.2f}x"
    if better == "lower":
        got = f"{gain:.2f}x lower" if gain >= 1 else f"{1 / gain:.2f}x higher"
    return [got, "met" if gain >= factor else "missed"]


def decode_rate(s: dict[str, Any] | None) -> float | None:
    """A burst's decode tokens/s per the whole batch: requests / TPOT p50 (every request of
    the burst decoding together, as in decode-heavy at batch 32)."""
    tpot = ((s or {}).get("tpot") or {}).get("p50")
    return s["requests"] / tpot if s and tpot else None


def gpu_sections(data: dict[str, Any], names: list[str]) -> list[str]:
    """The GPU suite's own tables: the first request of each burst against the others,
    decode against mlx-lm's dense batched decode, and issue 14's targets."""
    runs, ws = data["servers"], data["workloads"]
    lines = [
        "",
        "Shared-prefix bursts, the first request to get a token against the others (TTFT s; "
        "ranks 2-32: the others a batch of 32 could have started with the first):",
        "",
        "| workload | server | first | others p50 | others p95 | others max | ranks 2-32 p50 "
        "| ranks 2-32 max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w in ws:
        if not w["name"].startswith("shared-prefix"):
            continue
        for name in names:
            f = runs[name]["workloads"].get(w["name"], {}).get("first_vs_rest")
            if not f:
                continue
            r, b = f["rest"], f["batch_rest"]
            cells = [f["first"], r["p50"], r["p95"], r["max"], b["p50"], b["max"]]
            lines.append(f"| {w['name']} | {name} | " + " | ".join(n(c) for c in cells) + " |")
    dense = data.get("dense_decode") or {}
    decode = {name: runs[name]["workloads"].get("decode-heavy") for name in names}
    if dense.get("generation_tps") or any(decode.values()):
        lines += [
            "",
            "Decode at batch 32 (decode-heavy: 32 at once, 256 out): the servers' rate is 32 / "
            "TPOT p50 (tokens/s of the batch while it decodes), mlx-lm's dense path is "
            "`batch_generate` in one process on the same prompts (generated tokens over the "
            "time not spent on prompts; best of "
            f"{len(dense.get('runs', []))}: "
            + ", ".join(f"{r['generation_tps']:,.0f}" for r in dense.get("runs", []))
            + " tok/s):",
            "",
            "| path | decode tok/s at batch 32 | / dense mlx-lm |",
            "|---|---|---|",
        ]
        ref = dense.get("generation_tps")
        if ref:
            lines.append(f"| mlx-lm dense (`batch_generate`) | {n(ref, 0)} | 1.00 |")
        for name in names:
            rate = decode_rate(decode[name])
            if rate:
                lines.append(f"| {name} | {n(rate, 0)} | {ratio(rate, ref)} |")
    baselines = [b for b in ("mlx_lm.server", *BASELINE_VARIANTS) if b in names]
    if "kvserve" not in names or not baselines:
        return lines
    lines += ["", "Issue 14's end-to-end targets, in this run:", ""]
    lines += ["| workload | target | against | kvserve | |", "|---|---|---|---|---|"]
    wnames = {w["name"] for w in ws}
    rows = [t for t in GPU_TARGETS if t[0] in wnames]
    rows += [(w["name"], "no workload below 1.0x", "out tok/s", "higher", 1.0) for w in ws]
    for wname, what, rname, better, factor in rows:
        for base in baselines:
            a = runs["kvserve"]["workloads"].get(wname)
            b = runs[base]["workloads"].get(wname)
            if b is None:
                continue
            if b["requests"] and b["failed"] == b["requests"]:
                cells = ["-", f"not measurable: {base} failed all {b['requests']} requests"]
            else:
                cells = gain_cell(row(rname)(a) if a else None, row(rname)(b), better, factor)
            label = what if rname != "out tok/s" or factor != 1.0 else f"{what} (output tok/s)"
            lines.append(f"| {wname} | {label} | {base} | " + " | ".join(cells) + " |")
    if dense.get("generation_tps"):
        rate = decode_rate(decode.get("kvserve"))
        cells = gain_cell(rate, dense["generation_tps"], "higher", 0.9)
        lines.append(
            "| decode-heavy | decode tok/s at batch 32 within 10% of dense mlx-lm "
            "| `batch_generate` | " + " | ".join(cells) + " |"
        )
    return lines


def resummarize(data: dict[str, Any], raws: dict[str, Any]) -> None:
    """Adds to each workload in ``data`` the request statistics it lacks (those of a newer
    loadgen), computed from its per-request records (``--raw`` of the same run) over the wall
    time the run measured. Figures already there are kept as the run wrote them."""
    fields = set(Result.__dataclass_fields__)
    for name, per_workload in raws.items():
        for wname, records in per_workload.items():
            old = data["servers"][name]["workloads"][wname]
            results = [Result(**{k: v for k, v in r.items() if k in fields}) for r in records]
            new = loadgen.summarize(results, old["wall_s"]).as_dict()
            old.update({k: v for k, v in new.items() if k not in old})


def row(name: str) -> Callable[[dict[str, Any]], float | None]:
    return next(get for label, get, _ in ROWS if label == name)


def write_markdown(path: Path, section: str) -> None:
    """Replaces the generated section of ``path`` (text outside it is kept)."""
    old = (
        path.read_text() if path.exists() else "# Serving benchmark\n\n" + BEGIN + "\n" + END + "\n"
    )
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + section.rstrip("\n") + rest.split(END, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + section
    path.write_text(new)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    runs, ws = data["servers"], [w["name"] for w in data["workloads"]]
    names = [s for s in SERVERS if s in runs]
    panels = [
        ("output tokens/s (log)", "out tok/s", True, 0),
        ("TTFT p50 (s, log)", "TTFT p50 s", True, 2),
        ("E2E p95 (s, log)", "E2E p95 s", True, 2),
        ("server peak RSS (MiB)", "peak RSS MiB", False, 0),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    width = 0.8 / max(1, len(names))
    for ax, (title, rname, log, digits) in zip(axes.flat, panels, strict=True):
        for i, name in enumerate(names):
            values = [
                row(rname)(runs[name]["workloads"][w]) if w in runs[name]["workloads"] else None
                for w in ws
            ]
            xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(ws))]
            bars = ax.bar(xs, [v or 0 for v in values], width, label=name)
            ax.bar_label(bars, [n(v, digits) for v in values], fontsize=6, rotation=90, padding=2)
        ax.set_title(title)
        ax.set_xticks(range(len(ws)))
        ax.set_xticklabels(ws, rotation=30, ha="right", fontsize=8)
        if log:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.margins(y=0.25)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    m = data["machine"]
    where = m.get("gpu") or f"{m['cores']} cores {m['cpu']}"
    fig.suptitle(
        f"kvserve vs mlx_lm.server, {data['model']}; {where}, {data['date']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a small model and workloads (minutes)")
    p.add_argument(
        "--suite",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="auto: the GPU suite where MLX's default device is a GPU (unless --quick)",
    )
    p.add_argument("--gpu", dest="suite", action="store_const", const="gpu", help="--suite gpu")
    p.add_argument(
        "--gpu-scale",
        type=float,
        default=1.0,
        help="below 1: every prompt and client count of the GPU suite scaled (a CPU dry run)",
    )
    p.add_argument(
        "--deadline-min",
        type=float,
        default=0.0,
        help="start no server or workload this many minutes after the start (0: no deadline)",
    )
    p.add_argument(
        "--skip-dense-decode",
        action="store_true",
        help="GPU suite: do not measure mlx-lm's dense batched decode first",
    )
    p.add_argument("--logs", type=Path, default=None, help="keep each server's log here")
    p.add_argument("--dense-decode", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--dtype", default="")
    p.add_argument(
        "--servers",
        default=",".join(DEFAULT_SERVERS),
        help=f"comma-separated, run in order, of {', '.join(SERVERS)}",
    )
    p.add_argument("--workloads", default="", help="comma-separated names (default: all)")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's temperature (default 0: greedy, so both servers make the same "
        "tokens); OpenAI clients send 1 when they set none",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top_p")
    p.add_argument(
        "--poisson-rate",
        type=float,
        default=0.0,
        help="0: 0.9 x the first server's requests/s on unique prompts",
    )
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "serving-benchmark.md")
    p.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    p.add_argument("--json", type=Path, default=None, help="default: --out with .json")
    p.add_argument(
        "--raw",
        type=Path,
        default=None,
        help="every request's figures, as JSON "
        "(with --render: read, to add the statistics the JSON lacks)",
    )
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        help="only rewrite --out and the plot from this JSON of an earlier run",
    )
    args = p.parse_args()
    loadgen.SAMPLING.update(temperature=args.temperature)
    if args.top_p != 1.0:
        loadgen.SAMPLING["top_p"] = args.top_p
    out_png = args.plot or args.out.with_suffix(".png")
    if args.render:
        data = json.loads(args.render.read_text())
        data["plot"] = os.path.relpath(out_png, args.out.parent)
        if args.raw:  # recompute the request statistics from the run's per-request records
            resummarize(data, json.loads(args.raw.read_text()))
            data["rendered"] = " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv])
            (args.json or args.out.with_suffix(".json")).write_text(
                json.dumps(data, indent=1) + "\n"
            )
        write_markdown(args.out, markdown(data))
        plot(data, out_png)
        print(f"wrote {args.out}, {out_png}")
        return
    if args.dense_decode:
        model_dir, prompts_file, out_tokens = args.dense_decode
        print(json.dumps(dense_decode(Path(model_dir), Path(prompts_file), int(out_tokens))))
        return
    import mlx.core as mx

    gpu = mx.default_device().type == mx.gpu
    suite = args.suite if args.suite != "auto" else "gpu" if gpu and not args.quick else "cpu"
    layers = args.layers or (4 if args.quick else 22 if gpu else 12)
    hidden = args.hidden or (256 if args.quick else 2048 if gpu else 768)
    dtype = args.dtype or ("float16" if gpu else "float32")
    ws = gpu_workloads(args.gpu_scale) if suite == "gpu" else workloads(args.quick)
    if args.workloads:
        wanted = args.workloads.split(",")
        unknown_ws = set(wanted) - {w.name for w in ws}
        if unknown_ws:
            p.error(f"unknown workloads {sorted(unknown_ws)}; known: {[w.name for w in ws]}")
        ws = [
            w
            for w in ws
            if w.name in wanted or any(x.rate_from == w.name for x in ws if x.name in wanted)
        ]
    rates: dict[str, float] = {}
    if args.poisson_rate:
        for w in ws:
            w.rate = args.poisson_rate if w.pattern == "poisson" else w.rate
    servers = [s for s in args.servers.split(",") if s]
    unknown = set(servers) - set(SERVERS)
    if unknown:
        p.error(f"unknown servers {sorted(unknown)}; known: {', '.join(SERVERS)}")
    info = machine()
    started = time.perf_counter()
    deadline = time.time() + args.deadline_min * 60 if args.deadline_min else float("inf")
    runs: dict[str, Any] = {}
    python = (
        ".venv/bin/python" if Path(sys.executable).parent.parent == ROOT / ".venv" else "python3"
    )
    data: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(shlex.quote(a) for a in [python, *sys.argv]),
        "suite": suite,
        "machine": info,
        "model": "",
        "wall_min": 0.0,
        "plot": os.path.relpath(out_png, args.out.parent),
        "workloads": [{"name": w.name, "shape": w.shape, "pattern": w.pattern} for w in ws],
        "rates": rates,
        "derived_rates": [w.name for w in ws if w.rate_from and not args.poisson_rate],
        "rate_server": servers[0],
        "servers": runs,
    }
    out_json = args.json or args.out.with_suffix(".json")

    def save() -> None:
        """The figures so far, to the JSON (and ``--raw``): a run cut short keeps them."""
        data["wall_min"] = (time.perf_counter() - started) / 60
        figures = {name: {k: v for k, v in run.items() if k != "raw"} for name, run in runs.items()}
        out_json.write_text(json.dumps({**data, "servers": figures}, indent=1) + "\n")
        if args.raw:
            args.raw.write_text(json.dumps({n: r.get("raw", {}) for n, r in runs.items()}) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        model, params = make_model(Path(tmp) / "bench-llama", layers, hidden, dtype)
        if suite == "gpu":  # the 32k prompts need a longer declared context than make_model's
            config = json.loads((model / "config.json").read_text())
            config["max_position_embeddings"] = max(
                GPU_CONTEXT, config.get("max_position_embeddings", 0)
            )
            (model / "config.json").write_text(json.dumps(config))
        if hasattr(mx, "clear_cache"):
            mx.clear_cache()  # the weights made here: give the memory back before the servers
        data["model"] = (
            f"random llama, {layers} layers, hidden {hidden}, {params / 1e6:.1f}M params, {dtype}"
        )
        decode = next((w for w in ws if w.name == "decode-heavy"), None)
        if suite == "gpu" and decode is not None and not args.skip_dense_decode:
            data["dense_decode"] = dense_decode_reference(model, decode, Path(tmp))
            save()
        for name in servers:
            if time.time() > deadline:
                print(f"{name}: skipped (past --deadline-min)", flush=True)
                runs[name] = {"ready_s": None, "workloads": {}, "skipped": [w.name for w in ws]}
                continue

            def saved(out: dict[str, Any], name: str = name) -> None:
                runs[name] = out
                save()

            try:
                logs = args.logs or Path(tmp)
                logs.mkdir(parents=True, exist_ok=True)
                runs[name] = run_server(name, model, ws, logs, rates, saved, deadline)
            except RuntimeError as e:  # did not start
                print(f"{name}: {e}", flush=True)
                runs[name] = {"ready_s": None, "workloads": {}, "raw": {}, "error": str(e)}
            save()
    save()
    for run in runs.values():
        run.pop("raw", None)
    write_markdown(args.out, markdown(data))
    try:
        plot(data, out_png)
    except Exception as e:  # the figures are written; a plot is optional
        print(f"no plot: {type(e).__name__}: {e}")
    print(f"\nwrote {args.out}, {out_png}, {out_json}")


def dense_decode_reference(model: Path, w: Workload, tmp: Path) -> dict[str, Any]:
    """mlx-lm's own batched decode (``batch_generate``, dense ``BatchKVCache``) on the
    prompts of the burst ``w``, in a child process (its GPU memory goes back when it ends)."""
    prompts = tmp / "dense-decode-prompts.json"
    prompts.write_text(json.dumps([r.prompt for r in w.requests]))
    out_tokens = w.requests[0].max_tokens
    cmd = [sys.executable, __file__, "--dense-decode", str(model), str(prompts), str(out_tokens)]
    print(f"\n## dense mlx-lm decode ({len(w.requests)} x {out_tokens} out)", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-2000:], flush=True)
        return {"error": proc.stderr[-500:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(result), flush=True)
    return result


def dense_decode(model_dir: Path, prompts_file: Path, out_tokens: int) -> dict[str, Any]:
    """Decode tokens/s of mlx-lm's ``batch_generate`` (decode batch 32 by default, the same
    dense batched path as mlx_lm.server) on these prompts: generated tokens over the time
    not spent on prompts; a short first call compiles, then two timed calls."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import batch_generate

    model, tokenizer = load(str(model_dir))
    prompts = [tokenizer.encode(p) for p in json.loads(prompts_file.read_text())]
    batch_generate(model, tokenizer, prompts, max_tokens=8)
    runs = []
    for _ in range(2):
        stats = batch_generate(model, tokenizer, prompts, max_tokens=out_tokens).stats
        runs.append(
            {
                "generation_tps": stats.generation_tps,
                "generation_tokens": stats.generation_tokens,
                "generation_time": stats.generation_time,
                "prompt_tokens": stats.prompt_tokens,
                "prompt_time": stats.prompt_time,
                "peak_memory_gb": stats.peak_memory,
            }
        )
    return {
        "batch": len(prompts),
        "prompt_tokens_each": len(prompts[0]),
        "out_tokens": out_tokens,
        "device": str(mx.default_device()),
        "runs": runs,
        "generation_tps": max(r["generation_tps"] for r in runs),
    }


if __name__ == "__main__":
    main()
