"""Where a GPU worker's time goes in the step shapes of a long-shared-prefix burst and of
decode-heavy load, measured on the worker's own ``ModelRunner`` in one process.

For each phase, the first forward of a shape (what a user request pays when the shape is new:
kernel compilation, cuBLAS/cuDNN plans) and the same shape again (steady state):

1. ``prefix``: one sequence prefills an ``--prefix``-token prompt in ``--chunk``-token steps
   (the first request of a burst), then a second prompt of the same length on other blocks;
2. ``suffix``: ``--followers`` sequences prefill their own 64 tokens over the committed
   prefix in one step (the deferred requests of the burst, admitted together), twice;
3. ``decode long``: those sequences plus the first decode one token each over the prefix,
   steady state and across a block boundary (a new key length);
4. ``decode short``: ``--batch`` sequences of 96-token prompts decoding, the paged forward
   against mlx-lm's dense ``KVCache`` forward of the same batch (issue 14's "decode tokens/s
   at batch 32 within 10% of the dense mlx-lm path", measured in process, no serving);
5. the host-side costs of a decode step: building the ``ForwardBatch`` (numpy) and a greedy
   argmax, which the engine adds to every step.

Usage (GPU machine): ``python3 bench/gpu/profile_steps.py``; on a CPU for a dry run:
``--layers 2 --hidden 128 --dtype float32 --prefix 512 --chunk 128``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import numpy as np
from bench_models import add_gpu_model_args, make_model  # type: ignore[import-not-found]

from worker.engine.executor import ModelExecutor
from worker.model.attention import gpu_decode
from worker.model.forward_batch import ForwardBatch, SeqInput
from worker.model.loader import load_model
from worker.model.runner import ModelRunner
from worker.warmup import warm_up

SUFFIX = 64
SHORT_PROMPT = 96


def timed(f: Callable[[], object]) -> float:
    start = time.perf_counter()
    out = f()
    if isinstance(out, mx.array):
        mx.eval(out)
    mx.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpu_model_args(ap)
    ap.add_argument("--prefix", type=int, default=8000)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--followers", type=int, default=31)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warm-up", action="store_true", help="run the worker's warm-up first")
    ap.add_argument("--decode-only", action="store_true", help="phases 4-5 only")
    ap.add_argument("--prefix-only", action="store_true", help="phase 1 only")
    ap.add_argument(
        "--pool-blocks", type=int, default=0, help="a pool of at least this many blocks"
    )
    ap.add_argument(
        "--offset",
        type=int,
        default=0,
        help="the prefix's chunks start this many tokens in (a cached head, untimed)",
    )
    ap.add_argument(
        "--shuffle", action="store_true", help="hand out the pool's blocks in random order"
    )
    args = ap.parse_args()

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path, params = make_model(Path(tmp) / "model", args.layers, args.hidden, args.dtype)
        loaded = load_model(str(path))
    model = loaded.model
    bs = 32
    prefix_blocks = -(-args.prefix // bs)
    own = -(-(SUFFIX + 64) // bs)
    short_blocks = -(-(SHORT_PROMPT + args.steps + 40) // bs)
    num_blocks = 2 * prefix_blocks + (args.followers + 1) * own + args.batch * short_blocks + 8
    num_blocks = max(num_blocks, args.pool_blocks)
    executor = ModelExecutor(
        lambda: ModelRunner.create(model, block_size=bs, num_blocks=num_blocks)
    )
    runner = executor.runner
    if args.warm_up:  # the worker's own warm-up at its GPU defaults, timed
        report = asyncio.run(
            warm_up(executor, loaded.tokenizer, max_batch_size=32, max_step_tokens=args.chunk,
                    max_context=2 * args.prefix)
        )  # fmt: skip
        print(report.describe(), flush=True)

    # The rest runs on the model thread: the runner's MLX streams belong to it.
    rows: list[tuple[str, str, float]] = []
    b = args.batch

    def body() -> tuple[float, float]:
        print(
            f"device {mx.default_device()}, model {params / 1e6:.0f}M {args.dtype}, "
            f"{args.layers} layers; {runner.describe()}; pool {num_blocks} blocks of {bs}; "
            f"{runner.attention.describe()}; load {time.perf_counter() - started:.1f} s"
        )
        rng = np.random.default_rng(0)
        order = np.arange(num_blocks)
        if args.shuffle:
            rng.shuffle(order)
        free = iter(order.tolist())

        def record(phase: str, what: str, seconds: float) -> None:
            rows.append((phase, what, seconds))
            print(f"  {phase:<14} {what:<44} {seconds * 1e3:9.1f} ms", flush=True)

        def take(n: int) -> list[int]:
            return [next(free) for _ in range(n)]

        def tokens(n: int) -> list[int]:
            return rng.integers(32, 127, size=n).tolist()

        heads, kv_heads, dim = args.hidden // 64, max(1, args.hidden // 256), 64
        dt = getattr(mx, args.dtype)
        if not args.decode_only:
            # 0. Does a new shape cost a compile? SDPA with an array mask (the paged prefill's call)
            # at the followers' shape, then at neighbouring key and query lengths.
            for n, keys in [
                (64, 8064),
                (64, 8064),
                (64, 8096),
                (60, 8096),
                (64, 4096),
                (128, 8064),
            ]:
                f = args.followers
                q = mx.random.normal((f, heads, n, dim)).astype(dt)
                k = mx.random.normal((f, kv_heads, keys, dim)).astype(dt)
                mask = mx.ones((f, 1, n, keys), dtype=mx.bool_)
                mx.eval(q, k, mask)
                t = timed(lambda q=q, k=k, m=mask: mx.fast.scaled_dot_product_attention(
                    q, k, k, scale=dim**-0.5, mask=m))  # fmt: skip
                record("sdpa", f"{f} x {n} queries over {keys} keys", t)

            # 1. The first request's prefix, in chunks; then another prefix on other blocks.
            tables = []
            prompt = tokens(args.prefix)
            for round_ in ("first", "again"):
                table = take(prefix_blocks)
                tables.append(table)
                if args.offset:
                    runner.forward([SeqInput(prompt[: args.offset], table, 0)])
                for start in range(args.offset, args.prefix, args.chunk):
                    chunk = prompt[start : start + args.chunk]
                    t = timed(
                        lambda c=chunk, s=start, tb=table: runner.forward([SeqInput(c, tb, s)])
                    )
                    record("prefix", f"{round_}: chunk {len(chunk)} at {start}", t)
                print(
                    f"  prefix {round_}: {sum(r[2] for r in rows if r[1].startswith(round_)):.3f} s"
                )
            table = tables[0]
            if args.prefix_only:
                return 0.0, 0.0

            # 2. The followers' own suffixes over the committed prefix, one step; then again.
            last_full = args.prefix // bs * bs  # they share full blocks; the partial one is copied
            followers = []
            for _ in range(args.followers):
                mine = take(own)
                followers.append((table[: last_full // bs] + mine, last_full))
            suffix = [
                SeqInput(tokens(args.prefix - last_full + SUFFIX), t, s) for t, s in followers
            ]
            for round_ in ("first", "again", "again"):
                record("suffix", f"{round_}: {len(suffix)} x {len(suffix[0].token_ids)} tokens",
                       timed(lambda: runner.forward(suffix)))  # fmt: skip

            # 3. Decode over the long prefix: every follower plus the first request.
            ends = [s.end for s in suffix]
            long_tables = [t for t, _ in followers]
            for round_ in ("first", "again", "again", "again"):
                step = [SeqInput([65], t, e) for t, e in zip(long_tables, ends, strict=True)]
                record("decode long", f"{round_}: batch {len(step)} at ~{ends[0]}",
                       timed(lambda st=step: runner.forward(st)))  # fmt: skip
            crossing = (ends[0] // bs + 1) * bs + 1  # one more key block than before
            step = [SeqInput([65], t, crossing) for t in long_tables]
            record(
                "decode long", f"new key length: at {crossing}", timed(lambda: runner.forward(step))
            )
            record("decode long", f"again at {crossing}", timed(lambda: runner.forward(step)))

        # 4. Decode-heavy: paged against mlx-lm's dense KVCache, same batch, same tokens.
        from mlx_lm.models.cache import make_prompt_cache

        prompts = [tokens(SHORT_PROMPT) for _ in range(b)]
        short_tables = [take(short_blocks) for _ in range(b)]
        runner.forward([SeqInput(p, t, 0) for p, t in zip(prompts, short_tables, strict=True)])
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(prompts), cache=cache))
        paged_times, dense_times = [], []
        step_in = mx.array([[65]] * b)
        for i in range(args.steps):
            pos = SHORT_PROMPT + i
            seqs = [SeqInput([65], t, pos) for t in short_tables]
            paged_times.append(timed(lambda s=seqs: runner.forward(s)))
            dense_times.append(timed(lambda: model(step_in, cache=cache)[:, -1, :]))
        warm = slice(4, None)
        paged = statistics.median(paged_times[warm])
        dense = statistics.median(dense_times[warm])
        record("decode short", f"paged batch {b}, first step", paged_times[0])
        record("decode short", f"paged batch {b}, median", paged)
        record("decode short", f"dense KVCache batch {b}, first step", dense_times[0])
        record("decode short", f"dense KVCache batch {b}, median", dense)

        # 4b. The same decode steps split into building the graph (host: Python and MLX op
        # construction) and evaluating it (launches and the GPU), and the paged forward once
        # more with the lazy gather its cache builds per layer left out (llama hands the
        # fetched K/V to attention untouched, so the kernel serves every layer without it).
        from worker.model.paged_cache import PagedLayerCache

        def split_paged(pos: int) -> tuple[float, float]:
            seqs = [SeqInput([65], t, pos) for t in short_tables]
            t0 = time.perf_counter()
            fb = ForwardBatch(seqs, bs, num_blocks, runner.spec.mask_rank)
            fb.stand_ins = runner.stand_ins
            caches = [
                PagedLayerCache(fb, runner.pool, layer, runner.attention)
                for layer in range(runner.pool.num_layers)
            ]  # fmt: skip
            out = model(fb.tokens, cache=caches)[:, -1, :]
            t1 = time.perf_counter()
            mx.eval(out, *runner.pool.arrays())
            return t1 - t0, time.perf_counter() - t1

        def split_dense() -> tuple[float, float]:
            t0 = time.perf_counter()
            out = model(step_in, cache=cache)[:, -1, :]
            t1 = time.perf_counter()
            mx.eval(out)
            return t1 - t0, time.perf_counter() - t1

        base = SHORT_PROMPT + args.steps
        variants: dict[str, list[tuple[float, float]]] = {"paged": [], "dense": []}
        for i in range(16):
            variants["paged"].append(split_paged(base + i))
            variants["dense"].append(split_dense())
        pool = runner.pool
        real_gather = pool.gather
        placeholder = {}

        def no_gather(layer: int, tables: mx.array) -> tuple[mx.array, mx.array]:
            if tables.shape not in placeholder:
                placeholder[tables.shape] = real_gather(layer, tables)
            return placeholder[tables.shape]

        pool.gather = no_gather  # type: ignore[method-assign]
        variants["paged, no gather"] = [split_paged(base + 16 + i) for i in range(16)]
        pool.gather = real_gather  # type: ignore[method-assign]
        for name, pairs in variants.items():
            build = statistics.median(p[0] for p in pairs[4:])
            run = statistics.median(p[1] for p in pairs[4:])
            record("decode split", f"{name}: build graph", build)
            record("decode split", f"{name}: evaluate", run)

        # 5. Host-side costs of a decode step.
        seqs = [SeqInput([65], t, SHORT_PROMPT + args.steps) for t in short_tables]
        if runner.attention.name == "cuda":  # one layer's decode attention: the kernel against SDPA
            fb = ForwardBatch(seqs, bs, num_blocks, runner.spec.mask_rank)
            tables_in, ends_in, qlens = fb.kernel_inputs()
            pool_k, pool_v = runner.pool.layer_arrays(0)
            q1 = mx.random.normal((b, heads, 1, dim)).astype(dt)
            ctx = SHORT_PROMPT + args.steps + 1
            kd = mx.random.normal((b, kv_heads, ctx, dim)).astype(dt)
            mx.eval(q1, kd)
            t_kernel = statistics.median(
                timed(lambda: gpu_decode.paged_decode_attention(
                    q1, pool_k, pool_v, tables_in, ends_in, dim**-0.5, None, qlens))
                for _ in range(30)
            )  # fmt: skip
            t_sdpa = statistics.median(
                timed(lambda: mx.fast.scaled_dot_product_attention(q1, kd, kd, scale=dim**-0.5))
                for _ in range(30)
            )
            record("attention", f"kernel, batch {b} x {ctx} keys, one layer", t_kernel)
            record("attention", f"dense SDPA, batch {b} x {ctx} keys, one layer", t_sdpa)

            # Host time to build (not run) one layer's pieces of a decode step: what the
            # model thread spends per layer before anything reaches the GPU.
            def lazy(f: Callable[[], object], n: int = 400) -> float:
                for _ in range(20):
                    f()
                start = time.perf_counter()
                for _ in range(n):
                    f()
                return (time.perf_counter() - start) / n

            k1 = mx.random.normal((b, kv_heads, 1, dim)).astype(dt)
            mx.eval(k1)
            kc = mx.zeros((b, kv_heads, ctx + 64, dim), dtype=dt)
            mx.eval(kc)
            host = {
                "pool write (K and V)": lambda: runner.pool.write(
                    0, fb.write_blocks, fb.write_slots, k1, k1),
                "kernel call": lambda: gpu_decode.paged_decode_attention(
                    q1, pool_k, pool_v, tables_in, ends_in, dim**-0.5, None, qlens),
                "dense slice update (K and V)": lambda: (
                    kc.__setitem__((Ellipsis, slice(ctx, ctx + 1), slice(None)), k1),
                    kc.__setitem__((Ellipsis, slice(ctx, ctx + 1), slice(None)), k1)),
                "dense SDPA call": lambda: mx.fast.scaled_dot_product_attention(
                    q1, kd, kd, scale=dim**-0.5),
            }  # fmt: skip
            for what, f in host.items():
                record("host per layer", f"build: {what}", lazy(f))
            mx.eval(runner.pool.arrays())
        t_batch = statistics.median(
            timed(lambda: ForwardBatch(seqs, bs, num_blocks, runner.spec.mask_rank))
            for _ in range(20)
        )
        logits = mx.random.normal((b, runner.spec.vocab_size))
        mx.eval(logits)
        t_argmax = statistics.median(
            timed(lambda: mx.argmax(logits, axis=-1).tolist()) for _ in range(20)
        )
        record("host", f"ForwardBatch of {b} decodes", t_batch)
        record("host", f"argmax of {b} rows + tolist", t_argmax)

        return paged, dense

    paged, dense = executor._thread.submit(body).result()
    executor.shutdown()
    print()
    print("| phase | what | ms |")
    print("|---|---|---|")
    for phase, what, s in rows:
        print(f"| {phase} | {what} | {s * 1e3:.3f} |")
    if dense:
        print(f"\npaged / dense decode step at batch {b}: {paged / dense:.2f}x the time "
              f"({dense / paged:.2f}x the tokens/s)")  # fmt: skip
    print(f"total {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
