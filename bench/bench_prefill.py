"""Prefill on CPU against its limit: the worker's paged path, mlx-lm's dense path, and the
matmul rate this machine's BLAS sustains for this model's shapes (issue 13).

One prompt (4,096 tokens by default) is prefilled in chunks of each size given, from an empty
cache, on a random Llama made locally (`bench_models.make_model`; the serving suite's CPU model
at full size: 12 layers, hidden 768, fp32). Each chunk size is timed three ways, in one run:

  - **paged**: `ModelRunner.forward` on the worker's KV pool, as a worker's prefill steps run
    (each chunk attends to the pool blocks written by the chunks before it);
  - **dense**: mlx-lm's own model call with its `KVCache`, chunk after chunk (what
    `mlx_lm.generate` does with `prefill_step_size`);
  - **limit**: the prompt's FLOPs over the fp32 matmul rate measured here on this model's own
    weight shapes at this chunk size: the linear layers (2 x weights per token; the LM head
    for the last position only, as both paths compute it) plus causal attention (4 x head dim x
    heads x the positions each token attends to).

Reported per chunk size: seconds, prompt tokens/s, paged / dense, and the share of the limit
each path reaches. Run it under the BLAS the worker uses:

    .venv/bin/python -m kvserve_model.blas run -- .venv/bin/python bench/bench_prefill.py
    .venv/bin/python -m kvserve_model.blas run -- .venv/bin/python bench/bench_prefill.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_models import make_model  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load  # noqa: E402

from worker.model.forward_batch import SeqInput  # noqa: E402
from worker.model.runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 32


def linear_shapes(model) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """(in, out) of every linear layer of the transformer blocks, once per layer."""
    shapes = []
    for layer in model.model.layers:
        for _, module in layer.named_modules():
            w = getattr(module, "weight", None)
            if w is not None and w.ndim == 2 and type(module).__name__ == "Linear":
                shapes.append((w.shape[1], w.shape[0]))
    return shapes


def matmul_gflops(
    shapes: list[tuple[int, int]], rows: int, repeat: int = 3, dtype: mx.Dtype = mx.float32
) -> float:
    """GFLOPS of [rows, in] @ [in, out] over the distinct shapes, as the BLAS (or GPU) runs them."""
    distinct = sorted(set(shapes))
    xs = {k: mx.random.normal((rows, k)).astype(dtype) for k, _ in distinct}
    ws = {(k, n): mx.random.normal((k, n)).astype(dtype) for k, n in distinct}
    mx.eval(list(xs.values()), list(ws.values()))
    rates = []
    for _ in range(repeat):
        flops, t0 = 0, time.perf_counter()
        for k, n in distinct:
            mx.eval(xs[k] @ ws[(k, n)])
            flops += 2 * rows * k * n
        rates.append(flops / (time.perf_counter() - t0) / 1e9)
    return max(rates)


def prompt_flops(model, shapes: list[tuple[int, int]], n: int) -> float:  # type: ignore[no-untyped-def]
    args = model.args
    linear = 2 * n * sum(k * m for k, m in shapes)
    head = 2 * args.hidden_size * args.vocab_size  # the last position's logits
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    # Token i attends to i + 1 positions: QK^T and AV, 2 FLOPs a multiply-add each.
    attention = 4 * head_dim * args.num_attention_heads * len(model.model.layers)
    attention *= n * (n + 1) / 2
    return linear + head + attention


def time_paged(model, prompt: list[int], chunk: int) -> float:  # type: ignore[no-untyped-def]
    blocks = -(-len(prompt) // BLOCK_SIZE)
    runner = ModelRunner.create(model, block_size=BLOCK_SIZE, num_blocks=blocks + 1)
    table = list(range(blocks))
    runner.forward([SeqInput(prompt[:8], table, 0)])  # first-call costs out of the way
    t0 = time.perf_counter()
    for start in range(0, len(prompt), chunk):
        logits = runner.forward([SeqInput(prompt[start : start + chunk], table, start)])
        mx.eval(logits)
    return time.perf_counter() - t0


def time_dense(model, prompt: list[int], chunk: int) -> float:  # type: ignore[no-untyped-def]
    warm = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt[:8]]), cache=warm))
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    for start in range(0, len(prompt), chunk):
        out = model(mx.array([prompt[start : start + chunk]]), cache=cache)
        mx.eval(out[:, -1, :], [c.state for c in cache])
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 4-layer model, a 1,024-token prompt")
    p.add_argument("--tokens", type=int, default=0)
    p.add_argument("--chunks", default="", help="comma-separated chunk sizes")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--repeat", type=int, default=2, help="rounds (medians)")
    p.add_argument("--dtype", default="float32", help="the model's (float16 on a GPU)")
    a = p.parse_args()
    layers = a.layers or (4 if a.quick else 12)
    hidden = a.hidden or (256 if a.quick else 768)
    n = a.tokens or (1024 if a.quick else 4096)
    chunks = [int(c) for c in a.chunks.split(",")] if a.chunks else [256, 512, 1024, 2048]
    chunks = [c for c in chunks if c <= n]
    with tempfile.TemporaryDirectory() as tmp:
        path, params = make_model(Path(tmp) / "m", layers, hidden, a.dtype)
        model, _ = load(str(path))
    prompt = np.random.default_rng(0).integers(32, 127, n).tolist()
    shapes = linear_shapes(model)
    flops = prompt_flops(model, shapes, n)
    print(
        f"# a {n}-token prompt, {layers} layers, hidden {hidden} ({params / 1e6:.0f}M params), "
        f"{a.dtype}, block size {BLOCK_SIZE}, medians of {a.repeat}; {flops / n / 1e6:.0f} MFLOP "
        "a token\n"
    )
    print(
        "| chunk | matmul GFLOPS | limit s | paged s | paged tok/s | dense s | dense tok/s "
        "| paged / dense time | paged of limit | dense of limit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for chunk in chunks:
        gflops = matmul_gflops(shapes, chunk, dtype=getattr(mx, a.dtype))
        limit = flops / (gflops * 1e9)
        paged, dense = [], []
        if mx.default_device() == mx.gpu:
            # Each chunk's key length is a new attention shape: cuDNN builds a graph for it on
            # first use (tens of ms). Pay that once, untimed, for both paths.
            time_paged(model, prompt, chunk)
            time_dense(model, prompt, chunk)
        for _ in range(a.repeat):  # alternating, so drift on a shared machine hits both
            paged.append(time_paged(model, prompt, chunk))
            dense.append(time_dense(model, prompt, chunk))
        tp, td = statistics.median(paged), statistics.median(dense)
        print(
            f"| {chunk} | {gflops:.0f} | {limit:.2f} | {tp:.2f} | {n / tp:,.0f} | {td:.2f} | "
            f"{n / td:,.0f} | {tp / td:.2f} | {limit / tp:.0%} | {limit / td:.0%} |"
        )


if __name__ == "__main__":
    main()
