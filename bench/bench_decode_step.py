"""Whole decode steps: the worker's paged runner against mlx-lm's dense ``BatchKVCache``, in
one process, taking turns step by step, on the serving benchmark's model (a random llama with
the default model's byte tokenizer, bench_models.make_model).

The runner is built as the worker builds it and makes its own start-up decode choice
(``ModelRunner.choose_decode_attention``), printed; ``--path`` forces one afterwards
(blocks, gather, kernel) and ``--kernel-threads`` the kernel's threads. Run it under the BLAS to
compare (``KVSERVE_BLAS_LIB=...``): the issue-35 gap was the BLAS's threads, not the model.

    python -m kvserve_model.blas run -- python bench/bench_decode_step.py
    KVSERVE_BLAS_LIB=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so \\
        python -m kvserve_model.blas run -- python bench/bench_decode_step.py --cells 4x1000 32x160
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from bench_models import make_model  # noqa: E402
from mlx_lm.models.cache import BatchKVCache  # noqa: E402

from kvserve_model.blas import blas_provider  # noqa: E402
from worker.model.forward_batch import SeqInput  # noqa: E402
from worker.model.loader import load_model  # noqa: E402
from worker.model.runner import ModelRunner  # noqa: E402


def cell(model, batch: int, context: int, args: argparse.Namespace) -> tuple[str, float, float]:
    bs = 32
    per_seq = -(-(context + 2 * args.steps + 8) // bs)
    runner = ModelRunner.create(model, block_size=bs, num_blocks=batch * per_seq + 1)
    choice = runner.choose_decode_attention()
    if args.path:
        runner.attention.decode_path = args.path
    if args.kernel_threads:
        runner.attention.kernel_threads = args.kernel_threads
    order = np.random.default_rng(batch * 7919 + context).permutation(runner.num_blocks)
    tables = [order[i * per_seq : (i + 1) * per_seq].tolist() for i in range(batch)]
    pos = [context]

    def paged() -> None:
        runner.forward([SeqInput([65], tables[i], pos[0]) for i in range(batch)])
        pos[0] += 1

    a = model.args
    dim = a.hidden_size // a.num_attention_heads
    caches = []
    for _ in range(a.num_hidden_layers):
        c = BatchKVCache(left_padding=[0] * batch)
        shape = (batch, a.num_key_value_heads, context + 2 * args.steps + 8, dim)
        c.keys, c.values = mx.random.normal(shape) * 0.5, mx.random.normal(shape) * 0.5
        c._idx, c.offset = context, mx.array([context] * batch)
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    tokens = mx.full((batch, 1), 65, dtype=mx.int32)

    def dense() -> None:
        logits = model(tokens, cache=caches)[:, -1]
        mx.eval(logits, [(c.keys, c.values) for c in caches])

    times: dict[str, list[float]] = {"paged": [], "dense": []}
    for step in range(args.steps + 2):
        for name, f in (("paged", paged), ("dense", dense)):
            start = time.perf_counter()
            f()
            if step >= 2:  # two warm-up rounds
                times[name].append(time.perf_counter() - start)
    path = runner.attention.describe().split("decodes: ")[-1].split(",")[0]
    del choice
    return path, statistics.median(times["paged"]), statistics.median(times["dense"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", nargs="*", default=["4x1000", "8x256", "32x160", "32x1000"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--path", choices=["blocks", "gather", "kernel"], default="")
    p.add_argument("--kernel-threads", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory, _ = make_model(Path(tmp) / "model", args.layers, args.hidden, "float32")
        model = load_model(str(directory)).model
        print(f"# BLAS: {blas_provider() or 'MLX reference'}")
        print("| batch x context | paged path | paged ms | dense ms | paged tokens/s vs dense |")
        print("|---|---|---:|---:|---:|")
        for c in args.cells:
            batch, context = (int(x) for x in c.split("x"))
            path, paged, dense = cell(model, batch, context, args)
            print(
                f"| {batch} x {context} | {path} | {paged * 1e3:.1f} | {dense * 1e3:.1f} "
                f"| {dense / paged:.2f}x |"
            )


if __name__ == "__main__":
    main()
