"""The block-table prefill kernel (``worker.model.gpu_prefill``) on a GPU: checked, then timed.

1. **Checks** against the float64 reference (``gpu_decode.reference_attention``) on random
   pools with shuffled block ids: batch 1-64, contexts 1-32k, head dims 64/128, GQA 1/4/8,
   block sizes 16/32, windows, ragged query counts, fp16 and bf16, one split and several.
   Prints each case's max error relative to the output's scale; any case over tolerance fails.
2. **Per layer, microseconds** (medians), the cases of ``prefill_attention.py``: the kernel,
   the path it replaces (gather with the copy kernel, then one cuDNN call per context group:
   ``cuda.exact_context_attention``) and dense cuDNN over contiguous K/V.
3. **First calls of new shapes**: a run of prefill chunks whose (queries, context) were not
   seen before, as serving makes them, through each path: the kernel compiles once per
   (dtype, head dim, block size, GQA) and takes shapes as arguments; cuDNN builds a graph for
   each shape.

    python3 bench/gpu/prefill_kernel.py        # on the GPU machine
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx
import numpy as np
from bench_models import gpu_name  # type: ignore[import-not-found]
from prefill_attention import BLOCK_SIZE, CASES, paged_case, timed  # type: ignore[import-not-found]

from worker.model import device as devices
from worker.model import mlx_fixes
from worker.model.attention import cuda, gpu_decode, gpu_prefill
from worker.model.forward_batch import ForwardBatch, SeqInput
from worker.model.kv_pool import KVPool
from worker.model.spec import LayerSpec

TOL = {mx.float16: 4e-3, mx.bfloat16: 2.5e-2}

# (name, starts, own queries, window, head dim, rep, block size, dtype, splits)
CHECKS = [
    ("one chunk at 0", [0], [100], None, 128, 4, 32, mx.float16, None),
    ("ragged batch", [0, 37, 500, 1023], [70, 1, 300, 18], None, 64, 4, 32, mx.float16, None),
    ("bf16, GQA 8", [129, 0, 64], [64, 200, 65], None, 128, 8, 32, mx.bfloat16, None),
    ("no GQA, block 16", [5, 900], [40, 33], None, 64, 1, 16, mx.float16, None),
    ("window 100", [0, 300, 1000], [250, 90, 20], 100, 128, 4, 32, mx.float16, None),
    ("window 4097, d64", [3000, 5000], [1500, 2], 4097, 64, 4, 32, mx.bfloat16, None),
    ("forced splits", [2000, 3], [20, 130], None, 128, 4, 32, mx.float16, 5),
    ("splits and window", [2500], [70], 700, 64, 8, 16, mx.float16, 3),
    ("short chunk over 32k", [32000], [24], None, 128, 4, 32, mx.float16, None),
    ("2k chunk over 8k", [8000], [2048], None, 64, 4, 32, mx.bfloat16, None),
    (
        "batch 64",
        [int(x) for x in np.arange(64) * 37],
        [20 + (i % 5) * 7 for i in range(64)],
        None,
        64,
        4,
        32,
        mx.float16,
        None,
    ),
    ("one query each", [10, 400, 33], [1, 1, 1], None, 128, 4, 32, mx.float16, None),
]


def random_case(rng, starts, own, d, rep, bs, dtype, kv_heads=2):
    ends = [s + n for s, n in zip(starts, own, strict=True)]
    per = [-(-e // bs) for e in ends]
    num_blocks = sum(per) + 3
    order = rng.permutation(num_blocks).tolist()
    tables, at = [], 0
    for p in per:
        tables.append(order[at : at + p])
        at += p
    seqs = [SeqInput([1] * n, t, s) for s, n, t in zip(starts, own, tables, strict=True)]
    batch = ForwardBatch(seqs, bs, num_blocks)
    shape = (kv_heads, num_blocks + 1, bs, d)
    pool_k = mx.array(rng.standard_normal(shape).astype(np.float32) * 0.7).astype(dtype)
    pool_v = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    q = rng.standard_normal((len(starts), kv_heads * rep, batch.query_len, d)).astype(np.float32)
    return batch, pool_k, pool_v, mx.array(q * 1.5).astype(dtype)


def check() -> bool:
    rng = np.random.default_rng(0)
    print(
        "| check | batch | queries (max) | context (max) | d | GQA | block | dtype | splits "
        "| max error / scale | ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for name, starts, own, window, d, rep, bs, dtype, splits in CHECKS:
        batch, pool_k, pool_v, q = random_case(rng, starts, own, d, rep, bs, dtype)
        tables, ends, q_lens = batch.kernel_inputs()
        scale = d**-0.5
        # An output the kernel leaves unwritten shows.
        mlx_fixes.dirty_buffer_cache(q, pool_k, pool_v, tables, ends, q_lens)
        got = gpu_prefill.paged_prefill_attention(
            q, pool_k, pool_v, tables, ends, scale, window, q_lens, splits=splits
        )
        f32 = [np.array(a.astype(mx.float32)) for a in (q, pool_k, pool_v)]
        want = gpu_decode.reference_attention(
            *f32, np.array(tables), np.array(ends), scale, window, np.array(q_lens)
        )
        err = float(np.abs(np.array(got.astype(mx.float32)) - want).max())
        rel = err / max(1.0, float(np.abs(want).max()))
        good = bool(np.isfinite(rel) and rel <= TOL[dtype])
        ok &= good
        print(
            f"| {name} | {len(starts)} | {max(own)} | {max(ends.tolist()):,} | {d} | {rep} | {bs} "
            f"| {str(dtype).rsplit('.', 1)[-1]} | {splits or 'auto'} | {rel:.2e} | "
            f"{'yes' if good else 'NO'} |",
            flush=True,
        )
    return ok


def bench(repeat: int) -> None:
    dtype = mx.float16
    print(
        "\n| case | batch x (prefix + own) | kernel us | exact us (gather + cuDNN) | dense us "
        "| kernel / exact | kernel / dense | kernel vs exact, max diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in CASES:
        bench_case(c, repeat, dtype)


def bench_case(c, repeat: int, dtype: mx.Dtype) -> None:  # type: ignore[no-untyped-def]
    ctx = c.prefix + c.own
    pool, batch = paged_case(c, dtype, np.random.default_rng(c.batch * 7 + c.prefix))
    k_pool, v_pool = pool.layer_arrays(0)
    q = (mx.random.normal((c.batch, c.heads, c.own, c.head_dim)) * 2.0).astype(dtype)
    kd = (mx.random.normal((c.batch, c.kv_heads, ctx, c.head_dim)) * 0.5).astype(dtype)
    vd = mx.random.normal((c.batch, c.kv_heads, ctx, c.head_dim)).astype(dtype)
    mx.eval(k_pool, v_pool, q, kd, vd)
    scale = c.head_dim**-0.5
    tab, ends, q_lens = batch.kernel_inputs()

    def kernel() -> mx.array:
        return gpu_prefill.paged_prefill_attention(
            q, k_pool, v_pool, tab, ends, scale, None, q_lens
        )

    def exact() -> mx.array:
        k, v = pool.gather(0, batch.tables)
        return cuda.exact_context_attention(q, k, v, batch, scale)

    def dense() -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, kd, vd, scale=scale, mask="causal")

    diff = float(mx.abs(kernel().astype(mx.float32) - exact().astype(mx.float32)).max())
    t_k, t_e, t_d = timed(kernel, repeat), timed(exact, repeat), timed(dense, repeat)
    print(
        f"| {c.name} | {c.batch} x ({c.prefix:,} + {c.own:,}) | {t_k:,.0f} | {t_e:,.0f} | "
        f"{t_d:,.0f} | {t_k / t_e:.2f} | {t_k / t_d:.2f} | {diff:.2e} |",
        flush=True,
    )


def first_calls() -> None:
    """Prefill chunks of shapes not seen before (a prompt over a cached 2-6k prefix, 100-900
    tokens of its own), one call each through each path."""
    dtype = mx.float16
    rng = np.random.default_rng(5)
    shapes = [(int(rng.integers(2000, 6000)), int(rng.integers(100, 900))) for _ in range(8)]
    rows: dict[str, list[float]] = {"kernel": [], "exact": []}
    for prefix, own in [(1000, 50), *shapes]:  # the first one warms both paths, not shown
        ctx = prefix + own
        blocks = -(-ctx // BLOCK_SIZE)
        pool = KVPool([LayerSpec(8, 64, 64)], blocks + 1, BLOCK_SIZE, dtype)
        k_pool, v_pool = pool.layer_arrays(0)
        batch = ForwardBatch(
            [SeqInput([1] * own, list(range(blocks)), prefix)], BLOCK_SIZE, blocks + 1
        )
        q = mx.random.normal((1, 32, own, 64)).astype(dtype)
        mx.eval(q, k_pool, v_pool)
        tab, ends, q_lens = batch.kernel_inputs()
        for name in rows:
            start = time.perf_counter()
            if name == "kernel":
                out = gpu_prefill.paged_prefill_attention(
                    q, k_pool, v_pool, tab, ends, 0.125, None, q_lens
                )
            else:
                k, v = pool.gather(0, batch.tables)
                out = cuda.exact_context_attention(q, k, v, batch, 0.125)
            mx.eval(out)
            if (prefix, own) != (1000, 50):
                rows[name].append((time.perf_counter() - start) * 1e3)
    print("\n| path | first call of each new shape, ms (prefix + own) |")
    print("|---|---|")
    labels = ", ".join(f"{p:,}+{o}" for p, o in shapes)
    print(f"| shapes | {labels} |")
    for name, times in rows.items():
        print(f"| {name} | " + ", ".join(f"{t:.1f}" for t in times) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    a = ap.parse_args()
    if not devices.cuda_available():
        sys.exit("needs MLX's CUDA backend: run it on the GPU machine")
    print(f"# {gpu_name()}, MLX {mx.__version__}\n")
    start = time.perf_counter()
    ok = True
    if not a.skip_check:
        # The first call compiles the kernel: time it apart from the checks.
        batch, pk, pv, q = random_case(np.random.default_rng(1), [10], [40], 64, 4, 32, mx.float16)
        t0 = time.perf_counter()
        tab, ends, ql = batch.kernel_inputs()
        mx.eval(gpu_prefill.paged_prefill_attention(q, pk, pv, tab, ends, 0.125, None, ql))
        print(f"first call (compiles one variant): {(time.perf_counter() - t0) * 1e3:.0f} ms\n")
        ok = check()
    if not a.skip_bench:
        first_calls()
        bench(a.repeat)
    print(f"\n{time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
