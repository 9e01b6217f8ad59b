"""Mixture-of-experts gathers on a GPU: which are right, and what the workaround costs.

mlx-lm's MoE layers call ``mx.gather_mm`` / ``mx.gather_qmm`` with ``sorted_indices=True`` once
a forward has 64+ (token, expert) pairs. For each shape (experts E, rows, K, N; x laid out as
``switch_layers`` lays it: ``[rows, 1, K]`` after the sort, weights ``[E, N, K]`` transposed):

1. **Checks**: MLX's sorted call, its unsorted call and the call through
   ``worker.model.mlx_fixes`` (what the worker runs), each after
   ``mlx_fixes.dirty_buffer_cache()``, against the CPU's result; max error relative to the
   output's scale. The worker's path failing makes the script exit 1.
2. **Speed**: sorted and unsorted, milliseconds (medians), on the larger shapes.

    python3 bench/gpu/moe_gather.py        # on the GPU machine
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx
import numpy as np

from worker.model import mlx_fixes

TOL = {mx.float32: 1e-4, mx.float16: 5e-3, mx.bfloat16: 3e-2}

# (name, experts, top-k, tokens, K, N, dtype, quantized bits or 0)
CASES = [
    ("phixtral tiny fc2", 4, 2, 81, 256, 64, mx.float32, 0),
    ("phixtral tiny fc1", 4, 2, 81, 64, 256, mx.float32, 0),
    ("gpt_oss tiny down", 4, 2, 81, 128, 64, mx.float32, 0),
    ("8 experts, fp16", 8, 2, 300, 1024, 512, mx.float16, 0),
    ("64 experts, bf16", 64, 6, 512, 2048, 1408, mx.bfloat16, 0),
    ("128 experts, bf16 down", 128, 8, 256, 768, 2048, mx.bfloat16, 0),
    ("8 experts, 4-bit", 8, 2, 300, 1024, 512, mx.float16, 4),
    ("64 experts, 4-bit", 64, 6, 512, 2048, 1408, mx.bfloat16, 4),
]
SPEED = [c for c in CASES if c[4] >= 1024 or c[5] >= 1024]


def case_arrays(experts: int, top_k: int, tokens: int, k: int, n: int, dtype: mx.Dtype, seed: int):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, experts, (tokens, top_k)).astype(np.uint32).reshape(-1)
    order = np.argsort(idx, kind="stable")
    x = rng.standard_normal((tokens * top_k, 1, k)).astype(np.float32)
    w = (rng.standard_normal((experts, n, k)) / np.sqrt(k)).astype(np.float32)
    return mx.array(x).astype(dtype), mx.array(w).astype(dtype), mx.array(idx[order])


def call(op, x, w, q, idx, sort: bool):
    if q:
        wq, scales, biases = q
        return op(x, wq, scales, biases, rhs_indices=idx, transpose=True, sorted_indices=sort)
    return op(x, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sort)


def check(case) -> tuple[list[str], bool]:
    _, e, top_k, tokens, k, n, dtype, bits = case
    x, w, idx = case_arrays(e, top_k, tokens, k, n, dtype, 0)
    q = mx.quantize(w, group_size=64, bits=bits) if bits else None
    mlx_op = mx.gather_qmm if bits else mlx_fixes.original("gather_mm")
    base = mlx_fixes.original("gather_mm")
    with mx.stream(mx.cpu):  # the CPU's gather_mm is float32 only
        w_ref = mx.dequantize(*q, group_size=64, bits=bits) if q else w
        ref = call(base, x.astype(mx.float32), w_ref.astype(mx.float32), None, idx, False)
        mx.eval(ref)
    scale = float(mx.max(mx.abs(ref)))
    errs, ok = [], True
    for label, op, sort in (
        ("sorted", mlx_op, True),
        ("unsorted", mlx_op, False),
        ("worker", mx.gather_qmm if bits else mx.gather_mm, True),
    ):
        worst = 0.0
        try:
            for _ in range(3):
                mlx_fixes.dirty_buffer_cache()
                out = call(op, x, w, q, idx, sort)
                mx.eval(out)
                worst = max(worst, float(mx.max(mx.abs(out.astype(mx.float32) - ref))) / scale)
        except (RuntimeError, ValueError) as e:  # an op this backend lacks
            errs.append(f"error: {str(e)[:60]}")
            ok = ok and label != "worker"
            continue
        errs.append(f"{worst:.2e}")
        if label == "worker":
            ok = ok and worst <= TOL[dtype]
    return errs, ok


def speed(case, iters: int = 20) -> tuple[float, float]:
    _, e, top_k, tokens, k, n, dtype, bits = case
    x, w, idx = case_arrays(e, top_k, tokens, k, n, dtype, 1)
    q = mx.quantize(w, group_size=64, bits=bits) if bits else None
    op = mx.gather_qmm if bits else mlx_fixes.original("gather_mm")
    out = []
    for sort in (True, False):
        mx.eval(call(op, x, w, q, idx, sort))
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            mx.eval(call(op, x, w, q, idx, sort))
            times.append(time.perf_counter() - t0)
        out.append(float(np.median(times)) * 1e3)
    return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    installed = mlx_fixes.install()
    print(f"device {mx.default_device()}, workaround installed: {installed}")
    print("\n| case | E | rows | K | N | dtype | sorted | unsorted | worker | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    failed = False
    for case in CASES:
        name, e, top_k, tokens, k, n, dtype, bits = case
        if mx.default_device() == mx.cpu and dtype != mx.float32:
            continue  # MLX's CPU gather_mm is float32 only
        errs, ok = check(case)
        failed |= not ok
        kind = f"{dtype}".replace("mlx.core.", "") + (f" q{bits}" if bits else "")
        print(
            f"| {name} | {e} | {tokens * top_k} | {k} | {n} | {kind} | {' | '.join(errs)} | {'yes' if ok else 'NO'} |",
            flush=True,
        )
    print(
        "\n(max error over 3 runs after dirtying the buffer cache, relative to the output's scale;"
        " 'worker' is the call as the worker makes it, through worker.model.mlx_fixes)"
    )
    if not args.skip_speed and mx.default_device() != mx.cpu:
        print("\n| case | sorted ms | unsorted ms | unsorted / sorted |")
        print("|---|---|---|---|")
        for case in SPEED:
            try:
                s, u = speed(case)
            except (RuntimeError, ValueError) as e:
                print(f"| {case[0]} | error: {str(e)[:60]} | | |")
                continue
            print(f"| {case[0]} | {s:.3f} | {u:.3f} | {u / s:.2f} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
