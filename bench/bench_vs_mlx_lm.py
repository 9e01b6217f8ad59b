"""kvserve (the whole system, its default settings) against mlx_lm.server, same model, same
requests, one run.

    python bench/bench_vs_mlx_lm.py                       # GPU: a ~1.1B Llama, fp16
    python bench/bench_vs_mlx_lm.py --quick               # CPU: a small model, small workloads

The model is a random Llama made locally (no download) with the default model's byte-level
tokenizer; its LM head gives the special tokens a zero logit, so greedy decoding never emits
EOS and every request generates its full ``max_tokens`` on both servers. Each server is
started, sent one cold request (its first-request latency is reported: compilation and
allocation show there), then three workloads over streaming ``/v1/completions``:

- **shared-prefix burst**: N requests at once sharing a long prompt, each with its own tail;
- **unique prompts**: N requests at once with distinct prompts;
- **decode clients**: many short prompts, long outputs (decode-bound).

Reported per workload: output tokens/s over the burst, TTFT p50 and p95, and kvserve's ratio
to mlx_lm.server. kvserve runs with no tuning flags: what it measures is the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_models import save_model  # noqa: E402

from kvserve_model.blas import fast_blas_env  # noqa: E402
from kvserve_model.default_model import SPECIAL_TOKENS, ensure_default_model  # noqa: E402

MODEL_NAME = "bench-llama"


def make_model(directory: Path, layers: int, hidden: int, dtype: str) -> Path:
    """A random Llama (untied head, special tokens' logits zero) with the byte tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models.llama import Model, ModelArgs

    base = ensure_default_model()
    config = json.loads((base / "config.json").read_text())
    config.update(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p.astype(getattr(mx, dtype)), model.parameters()))
    specials = len(SPECIAL_TOKENS)
    head = model.lm_head.weight
    model.lm_head.weight = mx.concatenate([head[:-specials], mx.zeros_like(head[-specials:])])
    params = save_model(directory, model, config, base)
    print(f"# model: llama, {layers} layers, hidden {hidden}, {params / 1e6:.0f}M params, {dtype}")
    return directory


@dataclass
class Workload:
    name: str
    prompts: list[str]
    max_tokens: int


def workloads(quick: bool) -> list[Workload]:
    def text(seed: int, n: int) -> str:  # n bytes = n tokens of the byte-level tokenizer
        letters = "abcdefghijklmnopqrstuvwxyz     "
        return "".join(letters[(seed * 7919 + i * 104729 + i * i) % len(letters)] for i in range(n))

    scale = 4 if quick else 1
    shared = text(1, 1024 // scale)
    return [
        Workload(
            "shared-prefix burst",
            [shared + text(100 + i, 32) for i in range(16 // scale)],
            64 // scale,
        ),
        Workload("unique prompts", [text(200 + i, 512 // scale) for i in range(16 // scale)], 64),
        Workload("decode clients", [text(300 + i, 32) for i in range(32 // scale)], 256 // scale),
    ]


@dataclass
class Result:
    tokens_per_s: float
    ttft_p50: float
    ttft_p95: float
    tokens: int


async def one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> tuple[float, int]:
    """TTFT and output tokens of one streamed completion. A connection refused or reset before
    any response (mlx_lm.server's listen backlog is 5) is retried, its time counted in TTFT."""
    body = {
        "model": model,  # both servers take the path they were started with
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    for attempt in range(20):
        try:
            return await _stream(client, url, body, start)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError) as e:
            if getattr(e, "started", False) or attempt == 19:
                raise
            await asyncio.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict, start: float
) -> tuple[float, int]:
    ttft: float | None = None
    tokens = 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:300]!r}")
        try:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as e:
            e.started = True  # type: ignore[attr-defined]  # mid-stream: not retried
            raise
    return (ttft if ttft is not None else time.perf_counter() - start), tokens


async def burst(base: str, model: str, w: Workload) -> Result:
    async with httpx.AsyncClient(timeout=1800) as client:
        start = time.perf_counter()
        out = await asyncio.gather(
            *(one(client, f"{base}/v1/completions", model, p, w.max_tokens) for p in w.prompts)
        )
        wall = time.perf_counter() - start
    ttfts = sorted(t for t, _ in out)
    tokens = sum(n for _, n in out)
    p95 = ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))]
    return Result(tokens / wall, statistics.median(ttfts), p95, tokens)


def start_server(cmd: list[str], ready: str, port: int, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready}", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{cmd[:3]} not ready")


def stop(proc: subprocess.Popen) -> None:
    with_group = os.getpgid(proc.pid)
    os.killpg(with_group, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(with_group, signal.SIGKILL)
        proc.wait()


def run_server(name: str, model: Path, ws: list[Workload]) -> tuple[float, dict[str, Result]]:
    env = fast_blas_env()  # on CPU both servers get the same BLAS; a no-op on a GPU
    if name == "mlx_lm.server":
        port = 18090
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(port)]
        cmd += ["--log-level", "WARNING"]
        ready = "/health"
    else:
        port = 18000
        cmd = [sys.executable, "-m", "kvserve_launch", "--model", str(model)]
        cmd += ["--http-port", str(port), "--grpc-port", "18050", "--cache-port", "18051"]
        cmd += ["--log-level", "WARNING", "--startup-timeout-s", "900"]
        ready = "/health"
    proc = start_server(cmd, ready, port, env)
    try:
        base = f"http://127.0.0.1:{port}"
        cold = time.perf_counter()
        asyncio.run(burst(base, str(model), Workload("cold", [ws[0].prompts[0]], 8)))
        first = time.perf_counter() - cold
        results = {w.name: asyncio.run(burst(base, str(model), w)) for w in ws}
    finally:
        stop(proc)
    return first, results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model and workloads (CPU)")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--dtype", default="")
    args = p.parse_args()
    import mlx.core as mx

    gpu = mx.default_device().type == mx.gpu
    layers = args.layers or (4 if args.quick else 22)
    hidden = args.hidden or (256 if args.quick else 2048)
    dtype = args.dtype or ("float16" if gpu else "float32")
    ws = workloads(args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / MODEL_NAME, layers, hidden, dtype)
        print(f"# device: {mx.default_device()}")
        runs = {name: run_server(name, model, ws) for name in ("mlx_lm.server", "kvserve")}
    (m_first, m), (k_first, k) = runs["mlx_lm.server"], runs["kvserve"]
    print(
        f"\nfirst request (cold, 8 tokens): mlx_lm.server {m_first:.2f} s, kvserve {k_first:.2f} s\n"
    )
    print(
        "| workload | requests x out | mlx_lm.server tok/s | kvserve tok/s | ratio | TTFT p50 mlx_lm / kvserve | TTFT p95 mlx_lm / kvserve |"
    )
    print("|---|---|---|---|---|---|---|")
    for w in ws:
        a, b = m[w.name], k[w.name]
        print(
            f"| {w.name} | {len(w.prompts)} x {w.max_tokens} | {a.tokens_per_s:.0f} | "
            f"{b.tokens_per_s:.0f} | {b.tokens_per_s / a.tokens_per_s:.2f}x | "
            f"{a.ttft_p50:.2f} / {b.ttft_p50:.2f} s | {a.ttft_p95:.2f} / {b.ttft_p95:.2f} s |"
        )
        if a.tokens != b.tokens:
            print(f"  (token counts differ: mlx_lm {a.tokens}, kvserve {b.tokens})")


if __name__ == "__main__":
    main()
