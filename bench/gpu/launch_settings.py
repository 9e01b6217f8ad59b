"""Where a batch-32 decode step's time goes on an NVIDIA GPU, under MLX's CUDA-graph settings.

MLX's CUDA backend records every kernel of an evaluation into a CUDA graph and launches it
every ``MLX_MAX_OPS_PER_BUFFER`` kernels (default 20); an executable graph is kept per
topology, and the whole cache is dropped once it holds more than
``MLX_CUDA_GRAPH_CACHE_SIZE`` (default 100); ``MLX_USE_CUDA_GRAPHS=0`` launches kernels one by
one instead. A decode step of a ~1B model is a few hundred kernels, so these settings decide
how much host time the launch takes. Each setting runs in a child process (MLX reads them
once), on the same generated model: the worker's decode forward (compiled and uncompiled) and
mlx-lm's dense ``KVCache`` forward, each step split into building the graph (Python and MLX
op construction), launching it (``mx.async_eval`` returning) and waiting for the device.

Usage (GPU machine): ``python3 bench/gpu/launch_settings.py``; a CPU dry run:
``--layers 2 --hidden 128 --dtype float32 --steps 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_models import add_gpu_model_args, make_model  # type: ignore[import-not-found]

PROMPT = 96
WARM = 4  # steps of each mode not counted (first shapes, traces)

# name: MLX environment
SETTINGS: dict[str, dict[str, str]] = {
    "MLX defaults (20 ops a graph, 100 cached)": {},
    "60 ops a graph": {"MLX_MAX_OPS_PER_BUFFER": "60"},
    "200 ops a graph": {"MLX_MAX_OPS_PER_BUFFER": "200"},
    "1,000 graphs cached": {"MLX_CUDA_GRAPH_CACHE_SIZE": "1000"},
    "no CUDA graphs (the worker's default)": {"MLX_USE_CUDA_GRAPHS": "0"},
}
MODES = ("worker, compiled", "worker, uncompiled", "mlx-lm dense")


def child(path: str, batch: int, steps: int) -> dict[str, dict[str, float]]:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from worker.model.forward_batch import SeqInput
    from worker.model.loader import load_model
    from worker.model.runner import ModelRunner

    model = load_model(path).model
    bs = 32
    per_seq = -(-(PROMPT + 2 * steps + 8) // bs)
    runner = ModelRunner.create(model, block_size=bs, num_blocks=batch * per_seq + 1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(32, 127, size=PROMPT).tolist() for _ in range(batch)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    runner.forward([SeqInput(p, t, 0) for p, t in zip(prompts, tables, strict=True)])
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompts), cache=cache))
    step_in = mx.array([[65]] * batch)
    pos = PROMPT

    def paged(compiled: bool):  # type: ignore[no-untyped-def]
        nonlocal pos
        runner.compile_decodes = compiled
        seqs = [SeqInput([65], t, pos) for t in tables]
        pos += 1
        return runner._last_logits(seqs), runner.pool.arrays()

    def dense():  # type: ignore[no-untyped-def]
        return model(step_in, cache=cache)[:, -1, :], []

    builds = {
        "worker, compiled": lambda: paged(True),
        "worker, uncompiled": lambda: paged(False),
        "mlx-lm dense": dense,
    }
    out: dict[str, dict[str, float]] = {}
    for mode, build in builds.items():
        parts: dict[str, list[float]] = {"build": [], "launch": [], "wait": [], "step": []}
        for i in range(steps):
            t0 = time.perf_counter()
            logits, pool = build()
            t1 = time.perf_counter()
            mx.async_eval(logits, *pool)
            t2 = time.perf_counter()
            mx.eval(logits, *pool)
            mx.synchronize()
            t3 = time.perf_counter()
            if i >= WARM:
                parts["build"].append(t1 - t0)
                parts["launch"].append(t2 - t1)
                parts["wait"].append(t3 - t2)
                parts["step"].append(t3 - t0)
        out[mode] = {k: statistics.median(v) for k, v in parts.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpu_model_args(ap)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--only", help="comma-separated setting numbers (1-based) to run")
    ap.add_argument(
        "--repeats", type=int, default=2, help="rounds over the settings (the median is kept)"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.steps)))
        return

    chosen = list(SETTINGS.items())
    if args.only:
        chosen = [chosen[int(i) - 1] for i in args.only.split(",")]
    runs: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name, _ in chosen}
    # Each child gets exactly its setting: none of the variables leaks in from this shell.
    named = {k for env in SETTINGS.values() for k in env}
    base_env = {k: v for k, v in os.environ.items() if k not in named}
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = make_model(Path(tmp) / "model", args.layers, args.hidden, args.dtype)
        for round_ in range(args.repeats):  # interleaved: a host's drift hits every setting
            for name, env in chosen:
                started = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", str(path), "--batch", str(args.batch),
                     "--steps", str(args.steps)],
                    env={**base_env, **env}, capture_output=True, text=True, check=False,
                )  # fmt: skip
                if proc.returncode:
                    print(f"{name}: child exited {proc.returncode}\n{proc.stderr[-2000:]}")
                    continue
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                runs[name].append(result)
                steps = ", ".join(f"{m} {result[m]['step'] * 1e3:.2f}" for m in MODES)
                took = time.perf_counter() - started
                print(f"round {round_} {name}: ms a step: {steps} [{took:.0f} s]", flush=True)
    rows = []
    for name, results in runs.items():
        for mode in MODES if results else ():
            parts = ("step", "build", "launch", "wait")
            rows.append((name, mode, {k: statistics.median(r[mode][k] for r in results)
                                      for k in parts}))  # fmt: skip
    base = {mode: r["step"] for name, mode, r in rows if name == chosen[0][0]}
    print(f"\nbatch {args.batch}, {args.layers} layers, hidden {args.hidden}, {args.dtype}; "
          f"medians of {args.steps - WARM} steps, then of {args.repeats} rounds, ms\n")  # fmt: skip
    print("| setting | forward | step | build | launch | wait | step / first setting's |")
    print("|---|---|---|---|---|---|---|")
    for name, mode, r in rows:
        ratio = r["step"] / base[mode] if mode in base else float("nan")
        print(
            f"| {name} | {mode} | {r['step'] * 1e3:.2f} | {r['build'] * 1e3:.2f} | "
            f"{r['launch'] * 1e3:.2f} | {r['wait'] * 1e3:.2f} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
