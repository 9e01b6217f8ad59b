"""Sampling a decode step's tokens: the worker's batched host draw against drawing each row
through MLX (what it did before; speculative verification still does).

The logits are real: the default model (or ``--model``) run over a text, one row per position,
so each row is a next-token distribution the model gives (peaked, as in serving), ``--batch``
rows at a time. For each sampling setting a client sends (the OpenAI default temperature 1,
0.7 with top_p 0.9, top_k 40, min_p 0.05, greedy with 5 logprobs), the time of
``sampling.sample_rows`` over the batch against ``sampling.sample_row`` row by row, in one
process, medians of ``--repeats``. Also a decode step of the same batch (mlx-lm's dense
batched forward after a 64-token prompt), so the share sampling takes of a step shows.

    .venv/bin/python -m kvserve_model.blas run -- .venv/bin/python bench/bench_sampling.py
    ... bench/bench_sampling.py --batch 32 --model tiny

(under ``kvserve_model.blas run`` the decode step runs on the BLAS a worker would pick; the
sampling itself uses none).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from kvserve_model.blas import blas_provider
from kvserve_model.sampling_params import SamplingParams
from worker.model.loader import load_model
from worker.model.sampling import Row, RowSampler, sample_row, sample_rows

MLX_VERSION = getattr(mx, "__version__", "?")
TEXT = (
    "The history of the city begins with a small settlement on the river, where traders "
    "stopped to rest their animals and exchange goods. Over the centuries the market grew, "
    "walls were built, and a cathedral rose above the rooftops. Today visitors come to see "
    "the old bridges, the museums and the gardens that line the water. "
) * 8

SETTINGS = {
    "temperature 1 (OpenAI's default)": dict(temperature=1.0),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 0.8, top_k 40": dict(temperature=0.8, top_k=40),
    "temperature 1, min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "temperature 0.7, repetition_penalty 1.1": dict(temperature=0.7, repetition_penalty=1.1),
    "greedy, logprobs 5": dict(temperature=0.0, logprobs=5),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--synthetic",
        type=int,
        metavar="VOCAB",
        help="no model: peaked random logits of this vocabulary (a GPU host without the model)",
    )
    args = ap.parse_args()

    def timed(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    if args.synthetic:
        rng = np.random.default_rng(0)
        v = args.synthetic
        made = [
            -2.0 * np.log(rng.permutation(v) + 1.0) + rng.normal(0, 0.5, v)
            for _ in range(args.batch)
        ]
        logits = mx.array(np.stack(made).astype(np.float32) * 1.5)
        mx.eval(logits)
        print(f"synthetic peaked logits, vocab {v}, batch {args.batch}, mlx {MLX_VERSION}, "
              f"{mx.default_device()}")  # fmt: skip
    else:
        loaded = load_model(args.model)
        model, tokenizer = loaded.model, loaded.tokenizer
        ids = tokenizer.encode(TEXT)[: max(args.batch, 64)]
        logits = model(mx.array([ids]))[0, : args.batch].astype(mx.float32)
        mx.eval(logits)
        print(f"model {loaded.path.name}, vocab {logits.shape[-1]}, batch {args.batch}, "
              f"mlx {MLX_VERSION}, BLAS {blas_provider() or 'MLX reference'}")  # fmt: skip
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([ids[:64]] * args.batch), cache=cache))
        step = mx.array([[ids[0]]] * args.batch)
        forward = timed(lambda: mx.eval(model(step, cache=cache)))
        print(f"a decode step of batch {args.batch} (dense mlx-lm forward): {forward * 1e3:.1f} ms")

    print("\n| setting | host draw, batch (ms a step) | MLX row by row (ms a step) | ratio |")
    print("|---|---:|---:|---:|")
    for name, kw in SETTINGS.items():
        rows: list[Row] = [
            (
                i,
                RowSampler(SamplingParams(max_tokens=16, seed=i, **kw)),  # type: ignore[arg-type]
                list(range(i, 40 + i)),
                40 + i,
            )
            for i in range(args.batch)
        ]
        new = timed(functools.partial(sample_rows, logits, rows))
        old = timed(functools.partial(_row_by_row, logits, rows))
        print(f"| {name} | {new * 1e3:.2f} | {old * 1e3:.2f} | {old / new:.1f}x |", flush=True)
    return 0


def _row_by_row(logits: mx.array, rows: list[Row]) -> list[object]:
    return [sample_row(logits, *r) for r in rows]


if __name__ == "__main__":
    sys.exit(main())
