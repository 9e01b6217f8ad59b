"""What the gateway costs: the same decode-heavy burst straight at a worker and through the
gateway, in one run (issue 13: "through the gateway, tokens/s at least 0.95x the worker driven
directly").

    .venv/bin/python bench/bench_gateway_overhead.py --quick   # ~1 minute
    .venv/bin/python bench/bench_gateway_overhead.py           # 2-3.5 minutes

Starts the real system with the launcher's own code (``kvserve_launch.system.launch``, as
``make run`` and the e2e tests do): cache service, one worker, gateway, on the embedded
default model, the worker under the fast BLAS the launcher gives it. Then sends one burst of
``--streams`` concurrent requests (short unique prompts, ``--max-tokens`` out, greedy,
``ignore_eos``) in each of three modes:

- **direct**: the worker's gRPC ``worker.v1.Worker/Generate``, as the gateway itself calls it
  (plaintext; the worker's port takes no token: only the cache service's data plane does);
- **gateway gRPC**: the gateway's own ``Generate`` (the same service, routed);
- **gateway HTTP**: the gateway's ``/v1/completions``, streamed as Server-Sent Events
  (``bench/serving/loadgen.py``'s client).

Every repeat runs all three modes, each repeat in a rotated order (direct, gRPC, HTTP; then
gRPC, HTTP, direct; ...), so machine noise and any drift hit every mode alike; one unmeasured
warm-up burst per mode comes first. Every prompt is unique across modes and repeats, so no
burst finds another's prefix in the cache. Reported per mode: output tokens/s of a burst
(output tokens over its wall time; median and range over the repeats), TTFT p50 and ITL p50
over every request of every repeat, and the CPU seconds each process used per 1,000 output
tokens (from /proc), then the ratios gateway / direct: of the medians, and per repeat (each
gateway burst against the direct burst of the same repeat, which cancels noise that lasts a
repeat; the target is judged on their median). The client is a separate process on the same
machine; its CPU is listed too.

TTFT and ITL are measured the same way in every mode: to and between the messages (SSE
events) that carry text. The default model's random weights often pick a byte that starts or
continues a multi-byte UTF-8 character, which has no text until the character completes: the
gateway sends no SSE event for it, and in the gRPC modes such a message is not counted either
("events / token" is the fraction of tokens that made one).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import os
import platform
import random
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench" / "serving"), str(ROOT)]

import loadgen  # noqa: E402
from loadgen import Request, Result  # noqa: E402
from run import source_tree  # noqa: E402  (bench/serving/run.py)

from kvserve_launch.config import LaunchConfig  # noqa: E402
from kvserve_launch.process import KeptLines  # noqa: E402
from kvserve_launch.system import System, launch  # noqa: E402
from kvserve_model.tiny_model import TINY_MODEL_NAME  # noqa: E402
from kvserve_proto.worker.v1 import worker_pb2 as pb  # noqa: E402
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402

MODES = ("direct", "gateway gRPC", "gateway HTTP")
BASELINE = "direct"
TARGET = 0.95  # issue 13: through the gateway, at least this fraction of direct tokens/s
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]


# -- workload ---------------------------------------------------------------------------------


def prompt(seed: int, n: int) -> str:
    """``n`` characters of seeded lowercase words, unique per seed from the first character
    (the default model's tokenizer is byte-level: about one token a character)."""
    rng = random.Random(seed)
    head = f"{seed:x} "
    return head + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz    ") for _ in range(n))


class DecodeRequest(Request):
    """loadgen's streamed completion, with ``ignore_eos`` so that every request generates all
    its tokens (as the gRPC modes ask)."""

    def body(self, model: str) -> dict[str, Any]:
        return super().body(model) | {"ignore_eos": True}


def generate_request(text: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_text=text,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


async def grpc_one(stub: pb_grpc.WorkerStub, text: str, max_tokens: int) -> Result:
    """One streamed ``Generate``; its timings as loadgen measures an SSE stream, where only
    tokens with text make an event: TTFT to the first message with text, ITL the gaps
    between such messages (a token that ends mid-character has none yet)."""
    result = Result(ok=False, start=time.perf_counter())
    last: float | None = None
    try:
        async for msg in stub.Generate(generate_request(text, max_tokens)):
            if msg.text:
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - result.start
                else:
                    result.itl.append(now - last)
                last = now
            if msg.HasField("usage"):
                result.output_tokens = msg.usage.completion_tokens
                result.prompt_tokens = msg.usage.prompt_tokens
                result.cached_tokens = msg.usage.cached_tokens
                result.tokens_from_usage = True
        result.ok = result.output_tokens == max_tokens
        if not result.ok:
            result.error = f"{result.output_tokens} tokens out of {max_tokens}"
    except grpc.aio.AioRpcError as e:
        result.error = f"{e.code().name}: {e.details()}"[:300]
    result.e2e = time.perf_counter() - result.start
    return result


# -- measuring --------------------------------------------------------------------------------


@dataclass
class Burst:
    """One mode's burst in one repeat."""

    mode: str
    repeat: int
    wall_s: float
    results: list[Result]
    cpu_s: dict[str, float]  # per process: direct's "gateway" is what it used while idle

    @property
    def tokens(self) -> int:
        return sum(r.output_tokens for r in self.results if r.ok)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.results)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / loadgen.CLK_TCK


class Client:
    """The three modes' senders over channels opened once (as the gateway keeps its own)."""

    def __init__(self, system: System, model: str) -> None:
        self.worker = grpc.aio.insecure_channel(system.worker_addresses[0], CHANNEL_OPTIONS)
        self.gateway = grpc.aio.insecure_channel(system.grpc_address, CHANNEL_OPTIONS)
        self.base = f"http://{system.http_address}"
        self.model = model
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(timeout=600, limits=limits)

    def sender(self, mode: str, max_tokens: int) -> Callable[[str], Awaitable[Result]]:
        if mode == "gateway HTTP":

            async def http(text: str) -> Result:
                return await loadgen.send(
                    self.http, self.base, self.model, DecodeRequest(max_tokens, prompt=text)
                )

            return http
        stub = pb_grpc.WorkerStub(self.worker if mode == "direct" else self.gateway)
        return lambda text: grpc_one(stub, text, max_tokens)

    async def close(self) -> None:
        await self.http.aclose()
        await self.worker.close()
        await self.gateway.close()


async def burst(
    client: Client, mode: str, texts: Sequence[str], max_tokens: int, pids: dict[str, int]
) -> tuple[float, list[Result], dict[str, float]]:
    send = client.sender(mode, max_tokens)
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    start = time.perf_counter()
    results = list(await asyncio.gather(*(send(t) for t in texts)))
    wall = time.perf_counter() - start
    cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    return wall, results, cpu


def order(repeat: int, modes: Sequence[str] = MODES) -> list[str]:
    """The modes of repeat ``repeat``, rotated by one each repeat."""
    k = repeat % len(modes)
    return [*modes[k:], *modes[:k]]


async def measure(
    system: System, model: str, modes: Sequence[str], streams: int, max_tokens: int,
    prompt_len: int, repeats: int,
) -> list[Burst]:  # fmt: skip
    pids = {"worker": system.workers[0].pid, "gateway": system.gateway.pid}
    client = Client(system, model)
    bursts: list[Burst] = []
    seed = 0

    def texts() -> list[str]:
        nonlocal seed
        seed += streams
        return [prompt(seed + i, prompt_len) for i in range(streams)]

    try:
        for mode in modes:  # warm-up: channels, connections, the worker's first shapes
            _, results, _ = await burst(client, mode, texts(), max_tokens, pids)
            errors = {r.error for r in results if not r.ok}
            if errors:
                raise RuntimeError(f"{mode}: warm-up failed: {sorted(errors)[:3]}")
        for repeat in range(repeats):
            for mode in order(repeat, modes):
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                wall, results, cpu = await burst(client, mode, texts(), max_tokens, pids)
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                cpu["client"] = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
                b = Burst(mode, repeat, wall, results, cpu)
                bursts.append(b)
                print(
                    f"repeat {repeat} {mode:13} {b.tok_s:7.1f} tok/s, wall {wall:5.2f} s, "
                    f"{b.failed} failed, CPU s: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()),
                    flush=True,
                )
    finally:
        await client.close()
    return bursts


# -- report -----------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float | None:
    return loadgen.percentile(values, 50)


@dataclass
class ModeFigures:
    mode: str
    bursts: int
    failed: int
    tok_s: float | None  # median over the bursts
    tok_s_min: float | None
    tok_s_max: float | None
    ttft_p50: float | None  # s, over every request of every burst
    itl_p50: float | None  # s, over every gap of every request
    events_per_token: float | None  # messages (SSE events) with tokens / output tokens
    cpu_per_ktok: dict[str, float] = field(default_factory=dict)  # CPU s / 1,000 tokens


def figures(bursts: Sequence[Burst], modes: Sequence[str] = MODES) -> list[ModeFigures]:
    """Each mode's figures over its bursts (modes without a burst are left out)."""
    out = []
    for mode in modes:
        mine = [b for b in bursts if b.mode == mode]
        if not mine:
            continue
        rates = [b.tok_s for b in mine]
        ok = [r for b in mine for r in b.results if r.ok]
        tokens = sum(b.tokens for b in mine)
        events = sum(len(r.itl) + 1 for r in ok if r.ttft is not None)
        cpu: dict[str, float] = collections.defaultdict(float)
        for b in mine:
            for name, s in b.cpu_s.items():
                cpu[name] += s
        out.append(
            ModeFigures(
                mode=mode,
                bursts=len(mine),
                failed=sum(b.failed for b in mine),
                tok_s=median(rates),
                tok_s_min=min(rates),
                tok_s_max=max(rates),
                ttft_p50=median([r.ttft for r in ok if r.ttft is not None]),
                itl_p50=median([gap for r in ok for gap in r.itl]),
                events_per_token=events / tokens if tokens else None,
                cpu_per_ktok={k: 1000 * v / tokens for k, v in cpu.items()} if tokens else {},
            )
        )
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def fmt(v: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "" if v is None else f"{v * scale:,.{digits}f}"


def pair_ratios(bursts: Sequence[Burst], mode: str, baseline: str = BASELINE) -> list[float]:
    """tokens/s of ``mode`` over ``baseline`` within each repeat (the same minute of noise)."""
    by = {(b.mode, b.repeat): b for b in bursts}
    return [
        by[mode, r].tok_s / by[baseline, r].tok_s
        for r in sorted({b.repeat for b in bursts})
        if (mode, r) in by and (baseline, r) in by and by[baseline, r].tok_s
    ]


def markdown(rows: Sequence[ModeFigures], bursts: Sequence[Burst]) -> str:
    """The figures table, and the ratios of each gateway mode to direct."""
    procs = sorted({k for r in rows for k in r.cpu_per_ktok})
    head = [
        "mode", "bursts", "failed", "out tok/s (median)", "min-max", "TTFT p50 ms",
        "ITL p50 ms", "events / token", *(f"{p} CPU s / 1k tok" for p in procs),
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r.mode, str(r.bursts), str(r.failed), fmt(r.tok_s, 1),
            f"{fmt(r.tok_s_min, 0)}-{fmt(r.tok_s_max, 0)}", fmt(r.ttft_p50, 1, 1000),
            fmt(r.itl_p50, 1, 1000), fmt(r.events_per_token),
            *(fmt(r.cpu_per_ktok.get(p)) for p in procs),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    base = next((r for r in rows if r.mode == BASELINE), None)
    if base is None:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"Gateway / {BASELINE} (tokens/s: at least {TARGET} is the target, judged on the median "
        "of the per-repeat ratios, each a gateway burst against the direct burst of its repeat; "
        "latency: below 1 is better):",
        "",
        "| mode | out tok/s, medians | out tok/s, per repeat | median per repeat | TTFT p50 | "
        "ITL p50 | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.mode == BASELINE:
            continue
        pairs = pair_ratios(bursts, r.mode)
        paired = median(pairs)
        judged = paired if paired is not None else ratio(r.tok_s, base.tok_s)
        verdict = "" if judged is None else "met" if judged >= TARGET else "missed"
        lines.append(
            f"| {r.mode} | {fmt(ratio(r.tok_s, base.tok_s))} | "
            f"{', '.join(f'{x:.2f}' for x in pairs)} | {fmt(paired, 3)} | "
            f"{fmt(ratio(r.ttft_p50, base.ttft_p50))} | {fmt(ratio(r.itl_p50, base.itl_p50))} | "
            f"{verdict} |"
        )
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- main -------------------------------------------------------------------------------------

SETTING_PREFIXES = ("KVSERVE_", "KVWORKER_", "KVGATEWAY_", "KVCACHE_")
THREAD_VARS = ("BLIS_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")


def settings(env: dict[str, str] | None = None) -> list[str]:
    """The environment's settings that the processes read (``KVWORKER_MAX_BATCH_SIZE=64``,
    ``KVSERVE_BLAS_THREADS=1``), as ``NAME=value`` for the command line shown; tokens left
    out."""
    env = dict(os.environ if env is None else env)
    return [
        f"{k}={v}"
        for k, v in sorted(env.items())
        if (k.startswith(SETTING_PREFIXES) or k in THREAD_VARS) and "TOKEN" not in k
    ]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="16 streams, 5 repeats (about a minute)")
    p.add_argument("--streams", type=int, default=0, help="concurrent requests (32; quick 16)")
    p.add_argument("--max-tokens", type=int, default=0, help="output tokens each")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt characters (~tokens)")
    p.add_argument("--repeats", type=int, default=0, help="bursts per mode (9; quick 5)")
    p.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES)
    )
    p.add_argument("--model", default=TINY_MODEL_NAME)
    p.add_argument(
        "--pids-file", type=Path, default=None, help="write the processes' pids here (for py-spy)"
    )
    args = p.parse_args()
    streams = args.streams or (16 if args.quick else 32)
    max_tokens = args.max_tokens or 128
    repeats = args.repeats or (5 if args.quick else 9)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")

    logs = KeptLines(200)
    config = LaunchConfig(
        workers=1, model=args.model, http_port=0, grpc_port=0, cache_port=0,
        log_level="WARNING", startup_timeout_s=600.0,
    )  # fmt: skip
    started = time.perf_counter()
    load = os.getloadavg()[0]
    try:
        system = launch(config, sink=logs)
    except Exception as e:
        sys.exit(f"the system did not start: {e}\n{logs.dump()}")
    ready_s = time.perf_counter() - started
    pids = {c.name: c.pid for c in system.children()}
    print(
        f"ready in {ready_s:.1f} s; pids " + ", ".join(f"{k} {v}" for k, v in pids.items()),
        flush=True,
    )
    if args.pids_file:
        args.pids_file.write_text("".join(f"{k} {v}\n" for k, v in pids.items()))
    try:
        bursts = asyncio.run(
            measure(system, args.model, modes, streams, max_tokens, args.prompt_len, repeats)
        )
    except Exception:
        print(logs.dump(), file=sys.stderr)
        raise
    finally:
        system.stop(grace_s=10.0)
    rows = figures(bursts, modes)
    command = " ".join(shlex.quote(a) for a in [*settings(), ".venv/bin/python", *sys.argv])
    print(
        f"\nMeasured {datetime.date.today().isoformat()} on {os.cpu_count()} cores "
        f"of {cpu_model()}, Python {platform.python_version()}; model {args.model}; "
        f"{streams} streams x {max_tokens} tokens out, {args.prompt_len}-character prompts, "
        f"{repeats} repeats; source {source_tree()}; load average {load:.2f} at the start; "
        f"{(time.perf_counter() - started) / 60:.1f} minutes. Command:\n\n    {command}\n"
    )
    print(markdown(rows, bursts))


if __name__ == "__main__":
    main()
