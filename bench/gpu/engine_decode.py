"""Decode tokens/s of the worker at batch 32, against mlx-lm's dense ``batch_generate``: a real
cache service and worker on loopback gRPC in this process, 32 greedy requests of 96-token
prompts (the serving benchmark's decode-heavy shape, without the gateway and HTTP) sent over
one ``GenerateMany`` call by a client in another process (as the gateway sends them: its work
must not take the worker's interpreter lock), the worker's decode forwards uncompiled, compiled
(``worker.model.compiled_decode``), compiled with the decode lookahead on, and compiled with it
"auto" (``worker.engine.lookahead.Policy``, a fresh one a round: it decides as it measures, as
a worker that just started does), alternated, each
round with where its steps' time went (the thread's forward, the loop's postprocess and
scheduling); and ``batch_generate`` on the same prompts in this process, before and after the
worker. The process runs under the worker process's MLX settings
(``worker.device_defaults.MLX_ENV``; ``--mlx-defaults``: MLX's own).

The decode rate is tokens over the time after every stream had its first token (prefill
excluded, as ``batch_generate``'s ``generation_tps`` excludes it).

Usage (GPU machine): ``python3 bench/gpu/engine_decode.py``; a CPU dry run:
``--layers 2 --hidden 128 --dtype float32 --out 32``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import mlx.core as mx
import numpy as np
from bench_models import add_gpu_model_args, make_model  # type: ignore[import-not-found]

from kvcache_service.config import ServiceConfig
from kvcache_service.server import running as cache_running
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from worker.config import WorkerConfig
from worker.device_defaults import MLX_ENV, apply_mlx_env
from worker.engine.lookahead import Policy
from worker.model.loader import load_model
from worker.server import running as worker_running

PROMPT = 96
# mode: (compiled decode forwards, the decode lookahead's policy)
MODES = {
    "uncompiled": (False, "off"),
    "compiled": (True, "off"),
    "compiled+lookahead": (True, "on"),
    "compiled+auto": (True, "auto"),
}


class Phases:
    """Seconds spent in the engine's parts, summed per decode round: where a step's time goes
    around the forward (the thread's forward and sampling, the loop's postprocess and
    scheduling, and the wait between the thread finishing and the loop picking it up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.steps = 0

    def wrap(self, owner: object, name: str, key: str) -> None:
        real = getattr(owner, name)
        seconds = self.seconds

        if asyncio.iscoroutinefunction(real):

            async def timed_async(*a, **k):  # type: ignore[no-untyped-def]
                t = time.perf_counter()
                try:
                    return await real(*a, **k)
                finally:
                    seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t

            setattr(owner, name, timed_async)
        else:

            def timed(*a, **k):  # type: ignore[no-untyped-def]
                t = time.perf_counter()
                try:
                    return real(*a, **k)
                finally:
                    seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t

            setattr(owner, name, timed)

    def report(self, steps: int) -> str:
        order = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{k} {v / max(1, steps) * 1e3:.2f}" for k, v in order)


async def client_round(address: str, prompts: list[list[int]], out: int) -> tuple[float, int]:
    """Every prompt at once over one ``GenerateMany`` call, as the gateway sends a worker its
    requests; decode tokens/s after the last first token."""
    firsts: list[float] = []
    counts = [0] * len(prompts)
    done = asyncio.Event()

    async def requests():  # type: ignore[no-untyped-def]
        for i, p in enumerate(prompts):
            start = pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=p),
                sampling=pb.SamplingParams(max_tokens=out, ignore_eos=True),
            )
            yield pb.GenerateManyRequest(stream=i, start=start)
        await done.wait()  # closing the request side early ends the call once all finish

    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.WorkerStub(channel).GenerateMany(requests())
        finished = 0
        async for msg in call:
            now = time.perf_counter()
            for update in msg.updates:
                if update.HasField("error"):
                    raise RuntimeError(update.error.message)
                i = update.stream
                if counts[i] == 0:
                    firsts.append(now)
                counts[i] += len(update.response.token_ids)
                finished += bool(update.response.finish_reason)
            if finished == len(prompts):
                break
        done.set()
        call.cancel()
    end = time.perf_counter()
    decoded = sum(counts) - len(prompts)
    return decoded / (end - max(firsts)), sum(counts)


async def one_round(address: str, batch: int, out: int, prompt: int) -> tuple[float, int]:
    """One round driven from another process, as a gateway drives a worker: the client's
    work must not take the worker's interpreter lock."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--client",
        address,
        "--batch",
        str(batch),
        "--prompt",
        str(prompt),
        "--out",
        str(out),
        stdout=asyncio.subprocess.PIPE,
    )
    stdout, _ = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"client exited with {proc.returncode}")
    answer = json.loads(stdout.decode().strip().splitlines()[-1])
    return answer["rate"], answer["tokens"]


def make_prompts(batch: int, length: int = PROMPT) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(32, 127, size=length).tolist() for _ in range(batch)]


async def serve_and_measure(loaded, args) -> dict[str, list[float]]:
    modes = {m: MODES[m] for m in args.modes}
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    config = ServiceConfig(port=0, lease_ttl_s=60)
    async with contextlib.AsyncExitStack() as stack:
        svc = await stack.enter_async_context(cache_running(config))
        wc = WorkerConfig(cache_service=svc.address, port=0, worker_id="w0", self_check=False)
        w = await stack.enter_async_context(worker_running(wc, loaded))
        engine = w.engine
        executor = engine.executor
        phases = Phases()
        phases.wrap(engine, "_run_step", "step (loop)")
        phases.wrap(executor, "_run", "executor thread")
        phases.wrap(executor.runner, "forward", "forward")
        phases.wrap(executor.runner, "forward_async", "forward (lazy)")
        phases.wrap(executor.runner, "_last_logits", "graph build")
        phases.wrap(engine.scheduler, "postprocess", "postprocess")
        phases.wrap(engine.scheduler, "schedule", "schedule")
        await one_round(w.address, args.batch, 8, args.prompt)  # first shapes
        for r in range(args.rounds):
            for mode, (compiled, lookahead) in modes.items():
                executor.runner.compile_decodes = compiled  # type: ignore[attr-defined]
                executor.lookahead = policy = Policy(lookahead)
                hits = executor.lookahead_hits
                steps = engine.stats.steps
                phases.seconds.clear()
                rate, n = await one_round(w.address, args.batch, args.out, args.prompt)
                rates[mode].append(rate)
                steps = engine.stats.steps - steps
                compiled_forward = executor.runner.compiled_decode  # type: ignore[attr-defined]
                traces = compiled_forward.traces if compiled_forward is not None else 0
                print(
                    f"round {r} {mode}: {rate:,.0f} decode tok/s "
                    f"({n} tokens, {steps} steps, {executor.lookahead_hits - hits} lookahead "
                    f"hits, {traces} compiled traces so far{decided(policy)}); "
                    f"ms a step: {phases.report(steps)}",
                    flush=True,
                )
    return rates


def decided(policy: Policy) -> str:
    """What an auto policy measured and decided, for the round's line."""
    if not policy.measuring:
        return ""
    return (
        f"; auto: {'on' if policy.active else 'off'} after {policy.samples} measured steps, "
        f"{policy.switches} switches, saving {1e3 * policy.saved_s:.2f} of "
        f"{1e3 * policy.period_s:.2f} ms"
    )


def dense(model, tokenizer, prompts: list[list[int]], out: int) -> float:
    from mlx_lm.generate import batch_generate

    batch_generate(model, tokenizer, prompts, max_tokens=8)
    return max(
        batch_generate(model, tokenizer, prompts, max_tokens=out).stats.generation_tps
        for _ in range(2)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpu_model_args(ap)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=PROMPT, help="tokens a prompt")
    ap.add_argument("--no-dense", action="store_true", help="no batch_generate reference")
    ap.add_argument(
        "--modes",
        type=lambda v: [m.strip() for m in v.split(",")],
        default=list(MODES),
        help=f"the worker's modes, comma-separated (default: all of {', '.join(MODES)})",
    )
    ap.add_argument(
        "--mlx-defaults",
        action="store_true",
        help="MLX's own settings, not the worker process's (worker.device_defaults.MLX_ENV)",
    )
    ap.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)  # one round's load
    args = ap.parse_args()
    if unknown := [m for m in args.modes if m not in MODES]:
        ap.error(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    # The worker process's MLX settings, as `python -m worker` sets them (batch_generate runs
    # under them too), before anything runs on the GPU.
    if not args.mlx_defaults:
        apply_mlx_env()
    if args.client:
        rate, tokens = asyncio.run(
            client_round(args.client, make_prompts(args.batch, args.prompt), args.out)
        )
        print(json.dumps({"rate": rate, "tokens": tokens}))
        return
    # The directory lives as long as the run: the worker reads the model's tokenizer files.
    tmp = tempfile.mkdtemp(prefix="engine-decode-")
    path, params = make_model(Path(tmp) / "model", args.layers, args.hidden, args.dtype)
    loaded = load_model(str(path))
    prompts = make_prompts(args.batch, args.prompt)
    named = " ".join(f"{k}={os.environ.get(k, '(MLX default)')}" for k in MLX_ENV)
    print(f"device {mx.default_device()}, {params / 1e6:.0f}M {args.dtype}; {named}", flush=True)
    # batch_generate before and after the worker (which holds its pool while it runs): the
    # better of the two is the reference
    ref = 0.0
    if not args.no_dense:
        before = dense(loaded.model, loaded.tokenizer, prompts, args.out)
    rates = asyncio.run(serve_and_measure(loaded, args))
    if not args.no_dense:
        after = dense(loaded.model, loaded.tokenizer, prompts, args.out)
        print(f"batch_generate: {before:,.0f} tok/s before the worker, {after:,.0f} after")
        ref = max(before, after)
    print()
    print(f"| path | decode tok/s at batch {args.batch} | / dense mlx-lm |")
    print("|---|---|---|")
    if ref:
        print(f"| mlx-lm `batch_generate` | {ref:,.0f} | 1.00 |")
    for mode, got in rates.items():
        rate = statistics.median(got)
        print(f"| worker, {mode} | {rate:,.0f} | {f'{rate / ref:.2f}' if ref else '-'} |")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
    # MLX 0.32 aborts in its C++ teardown after a model ran on another thread (status 134, as
    # the worker does: kvserve_launch.run's exit_hard); a command chained after this one runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
