"""Startup benchmark: time to ready and first-request latency, warm-up off vs on.

Starts the real processes, a cache service and then one worker (``python -m worker``), and
measures the time from spawning the worker to its ``WORKER_READY`` line. Then it sends
Generate requests one after another on a channel that is already connected (a gateway keeps
its channels open): the first request's latency and the median of the next ones. Each request
is what the gateway sends for a chat completion with the OpenAI defaults: a text prompt of its
own (no prefix shared with another request), temperature 1.0, 32 tokens.

MLX's CPU backend keeps the kernels it compiles in ``$TMPDIR/mlx/<version>/cpu``. So each
warm-up setting starts twice: with an empty kernel cache (a new machine, or a container with a
fresh /tmp, which is every container start) and again with what the first start left (a
restart on the same machine).

    python bench/bench_startup.py                  # the embedded model, 3 rounds
    python bench/bench_startup.py --model DIR      # any mlx-lm model directory
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve_model.blas import fast_blas_env  # noqa: E402
from kvserve_proto.worker.v1 import worker_pb2 as pb  # noqa: E402
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402

WORDS = ("the", "a", "system", "prompt", "cache", "block", "token", "model", "request", "answer")


def start(
    cmd: list[str], ready: str, env: dict[str, str], log: Path
) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(ready):
            return proc, line.split()[1]
    raise RuntimeError(f"{cmd[2]} exited before it was ready; see {log}")


def prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


async def requests(address: str, texts: list[str], max_tokens: int) -> list[tuple[float, float]]:
    """(time to first token, total) in seconds, one request after another."""
    out = []
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = pb_grpc.WorkerStub(channel)
        for text in texts:
            req = pb.GenerateRequest(
                prompt_text=text,
                sampling=pb.SamplingParams(
                    max_tokens=max_tokens, temperature=1.0, top_p=1.0, ignore_eos=True
                ),
            )
            t0 = time.perf_counter()
            first = 0.0
            async for msg in stub.Generate(req):
                if msg.token_ids and not first:
                    first = time.perf_counter() - t0
            out.append((first, time.perf_counter() - t0))
    return out


def run_one(
    model: str, warmup: bool, tmpdir: Path, texts: list[str], max_tokens: int, logs: Path
) -> dict[str, float]:
    env = fast_blas_env()
    env["TMPDIR"] = str(tmpdir)  # MLX's kernel cache lives under it
    tag = f"{'on' if warmup else 'off'}-{tmpdir.name}-{time.monotonic_ns()}"
    kv, kv_addr = start(
        [sys.executable, "-m", "kvcache_service", "--port", "0", "--admin-token", "bench"],
        "KVCACHE_READY",
        env,
        logs / f"cache-{tag}.log",
    )
    worker_log = logs / f"worker-{tag}.log"
    t0 = time.perf_counter()
    worker, address = start(
        [
            sys.executable, "-m", "worker", "--cache-service", kv_addr, "--port", "0",
            "--worker-id", "bench", "--model", model,
            "--warmup" if warmup else "--no-warmup",
        ],
        "WORKER_READY",
        env,
        worker_log,
    )  # fmt: skip
    ready = time.perf_counter() - t0
    try:
        times = asyncio.run(requests(address, texts, max_tokens))
    finally:
        for proc in (worker, kv):
            proc.terminate()
            proc.wait()
    found = re.search(r"warm-up: .* in ([0-9.]+) s", worker_log.read_text())
    rest = times[1:]
    return {
        "ready s": ready,
        "warm-up s": float(found.group(1)) if found else 0.0,
        "first TTFT ms": times[0][0] * 1000,
        "first total ms": times[0][1] * 1000,
        "next TTFT ms": statistics.median(t[0] for t in rest) * 1000,
        "next total ms": statistics.median(t[1] for t in rest) * 1000,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="kvserve-tiny-llama")
    p.add_argument("--rounds", type=int, default=3, help="medians over this many rounds")
    p.add_argument("--requests", type=int, default=6, help="the first one and the next ones")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--logs", type=Path, help="keep the processes' logs here")
    a = p.parse_args()
    rows: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = a.logs or Path(tmp) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for r in range(a.rounds):
            texts = prompts(a.requests, 24, seed=r)
            for warmup in (False, True):
                kernels = Path(tmp) / f"tmp-{r}-{warmup}"
                kernels.mkdir()
                for cache in ("empty", "kept"):
                    row = run_one(a.model, warmup, kernels, texts, a.max_tokens, logs)
                    name = f"| {'on' if warmup else 'off'} | {cache} |"
                    rows.setdefault(name, []).append(row)
                    print(f"# round {r + 1}: warm-up {name} {row}", file=sys.stderr)
    print(
        f"# {a.model}: {a.requests} requests one after another (temperature 1.0, "
        f"{a.max_tokens} tokens), median of {a.rounds} rounds\n"
    )
    cols = list(next(iter(rows.values()))[0])
    print("| warm-up | MLX kernel cache | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for name, runs in rows.items():
        cells = [statistics.median(run[c] for run in runs) for c in cols]
        print(name + " " + " | ".join(f"{v:.2f}" if v < 10 else f"{v:.0f}" for v in cells) + " |")


if __name__ == "__main__":
    main()
