"""Benchmark the paged KV path against mlx-lm's dense caches on a random llama (fp32).

Prints a markdown table with ratios, all measured in one run on one machine:

- decode step time at batch 1/4/8 and context 256/1024/2048: paged (``ModelRunner``) vs
  mlx-lm ``BatchKVCache`` (one batched dense rectangle) vs dense ``KVCache`` one sequence at a
  time;
- prefill of 512 tokens from empty: paged vs dense;
- 8 requests sharing a 1024-token prefix plus 64 tokens of their own: paged (the prefix computed
  once, its blocks shared) vs 8 full dense prefills; time and KV bytes.

Decode caches are filled with random K/V instead of a real prefill: step time does not depend on
the values, and it keeps the run short. Paged block tables are random permutations of the pool,
as they are after a while of serving.

Usage: ``python bench/bench_paged_attention.py [--quick]`` (re-executes itself on OpenBLAS).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvserve_model.blas import describe, ensure_fast_blas, measure_gflops

# Before mlx is imported, so the restarted process maps OpenBLAS first.
BLAS = ensure_fast_blas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache  # noqa: E402

from worker.model.attention import AttentionBackend  # noqa: E402
from worker.model.forward_batch import SeqInput  # noqa: E402
from worker.model.runner import ModelRunner  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    steps: int
    prefill: int
    prefix: int
    suffix: int
    requests: int


FULL = Sizes(768, 12, 12, 12, 2048, 32000, (1, 4, 8), (256, 1024, 2048), 8, 512, 1024, 64, 8)
QUICK = Sizes(384, 6, 6, 6, 1024, 8000, (1, 8), (256, 1024), 4, 256, 512, 32, 8)


def build_model(s: Sizes) -> nn.Module:
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        intermediate_size=s.intermediate,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=s.vocab,
        tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def params(model: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(model.parameters()))


def interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, warmup: bool = True
) -> dict[str, float]:
    """Median seconds per call of each ``fn`` (each evaluates its own outputs).

    The functions take turns, round after round (the first round is a warm-up), so load from
    other processes on a shared machine slows all of them alike and the ratios stay fair.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds + warmup):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if r or not warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def random_kv(shape: tuple[int, ...]) -> mx.array:
    return mx.random.normal(shape) * 0.5


def paged_decoders(model: nn.Module, s: Sizes, batch: int, ctx: int) -> dict[str, Callable]:
    """Decode steps on one pool: as the worker runs them (its decode attention chosen by
    measurement, ``ModelRunner.choose_decode_attention``), block-table attention, and the
    reference gather + SDPA."""
    bs = BLOCK_SIZE[0]
    # Each of the three decoders below advances the shared position once a round (warm-up too).
    per_seq = -(-(ctx + 3 * (s.steps + 1) + 4) // bs)
    runner = ModelRunner.create(model, block_size=bs, num_blocks=batch * per_seq)
    gather = ModelRunner(model, runner.pool, runner.spec, attention=AttentionBackend())
    blocks = ModelRunner(model, runner.pool, runner.spec)
    for layer in range(runner.pool.num_layers):  # fill with noise: realistic magnitudes
        k, v = runner.pool.layer_arrays(layer)
        k[...] = random_kv(k.shape)
        v[...] = random_kv(v.shape)
        mx.eval(k, v)
    order = np.random.default_rng(batch * 10_000 + ctx).permutation(runner.num_blocks)
    tables = [order[i * per_seq : (i + 1) * per_seq].tolist() for i in range(batch)]
    pos = [ctx]

    def step(r: ModelRunner) -> None:
        r.forward([SeqInput([1], tables[i], pos[0]) for i in range(batch)])
        pos[0] += 1

    CHOICE[0] = runner.choose_decode_attention().path
    return {
        "paged": lambda: step(runner),
        "blocks": lambda: step(blocks),
        "gather": lambda: step(gather),
    }


CHOICE = [""]  # the decode attention the last cell's runner chose
BLOCK_SIZE = [32]  # the decode pools' tokens per block (--block-size)


def _dense_kv(batch: int, ctx: int, s: Sizes) -> tuple[mx.array, mx.array]:
    cap = -(-(ctx + s.steps + 2) // KVCache.step) * KVCache.step
    d = s.hidden // s.heads
    kv = random_kv((batch, s.kv_heads, cap, d)), random_kv((batch, s.kv_heads, cap, d))
    mx.eval(kv)
    return kv


def batch_kv_decoder(model: nn.Module, s: Sizes, batch: int, ctx: int) -> Callable[[], None]:
    caches = []
    for _ in range(s.layers):
        c = BatchKVCache(left_padding=[0] * batch)
        c.keys, c.values = _dense_kv(batch, ctx, s)
        c._idx = ctx
        c.offset = mx.array([ctx] * batch)
        caches.append(c)
    tokens = mx.ones((batch, 1), dtype=mx.int32)

    def step() -> None:
        logits = model(tokens, cache=caches)[:, -1]
        mx.eval(logits, [(c.keys, c.values) for c in caches])

    return step


def serial_decoder(model: nn.Module, s: Sizes, batch: int, ctx: int) -> Callable[[], None]:
    per_seq = []
    for _ in range(batch):
        caches = make_prompt_cache(model)
        for c in caches:
            c.keys, c.values = _dense_kv(1, ctx, s)
            c.offset = ctx
        per_seq.append(caches)
    token = mx.ones((1, 1), dtype=mx.int32)

    def step() -> None:
        for caches in per_seq:
            logits = model(token, cache=caches)[:, -1]
            mx.eval(logits, [(c.keys, c.values) for c in caches])

    return step


def decode_cell(model: nn.Module, s: Sizes, batch: int, ctx: int) -> dict[str, float]:
    fns = paged_decoders(model, s, batch, ctx)
    fns["batch_kv"] = batch_kv_decoder(model, s, batch, ctx)
    fns["serial"] = serial_decoder(model, s, batch, ctx)
    return interleaved(fns, s.steps)


def prefill_times(model: nn.Module, s: Sizes) -> tuple[float, float]:
    tokens = np.random.default_rng(1).integers(0, s.vocab, s.prefill).tolist()
    runner = ModelRunner.create(model, block_size=32, num_blocks=-(-s.prefill // 32) + 1)
    table = list(range(runner.num_blocks))

    def paged() -> None:
        runner.forward([SeqInput(tokens, table, 0)])

    def dense() -> None:
        caches = make_prompt_cache(model)
        logits = model(mx.array([tokens]), cache=caches)[:, -1]
        mx.eval(logits, [(c.keys, c.values) for c in caches])

    t = interleaved({"paged": paged, "dense": dense}, 3)
    return t["paged"], t["dense"]


def shared_prefix(model: nn.Module, s: Sizes) -> tuple[float, float, int, int]:
    """Seconds and KV bytes for ``requests`` prompts of prefix + own suffix."""
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, s.vocab, s.prefix).tolist()
    suffixes = [rng.integers(0, s.vocab, s.suffix).tolist() for _ in range(s.requests)]
    bs = 32
    prefix_blocks = s.prefix // bs  # block-aligned prefix: shared whole
    own_blocks = -(-s.suffix // bs)
    total_blocks = prefix_blocks + s.requests * own_blocks
    runner = ModelRunner.create(model, block_size=bs, num_blocks=total_blocks)
    shared = list(range(prefix_blocks))

    def paged() -> None:
        chunk = 512
        for start in range(0, s.prefix, chunk):
            runner.forward([SeqInput(prefix[start : start + chunk], shared, start)])
        seqs = []
        for i, suffix in enumerate(suffixes):
            own = list(range(prefix_blocks + i * own_blocks, prefix_blocks + (i + 1) * own_blocks))
            seqs.append(SeqInput(suffix, shared + own, s.prefix))
        runner.forward(seqs)

    dense_bytes = [0]

    def dense() -> None:
        dense_bytes[0] = 0
        for suffix in suffixes:
            caches = make_prompt_cache(model)
            logits = model(mx.array([prefix + suffix]), cache=caches)[:, -1]
            mx.eval(logits, [(c.keys, c.values) for c in caches])
            dense_bytes[0] += sum(c.nbytes for c in caches)

    t = interleaved({"paged": paged, "dense": dense}, 1, warmup=False)
    return t["paged"], t["dense"], total_blocks * runner.pool.bytes_per_block, dense_bytes[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model and sizes (< 2 min)")
    parser.add_argument("--batches", type=int, nargs="*", help="decode batch sizes")
    parser.add_argument("--contexts", type=int, nargs="*", help="decode context lengths")
    parser.add_argument("--steps", type=int, help="timed decode steps per cell")
    parser.add_argument("--kv-heads", type=int, help="KV heads (default: as many as heads)")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--block-size", type=int, default=32, help="decode pools' block size")
    args = parser.parse_args()
    s = QUICK if args.quick else FULL
    BLOCK_SIZE[0] = args.block_size
    if args.batches:
        s = replace(s, batches=tuple(args.batches))
    if args.contexts:
        s = replace(s, contexts=tuple(args.contexts))
    if args.steps:
        s = replace(s, steps=args.steps)
    if args.kv_heads:
        s = replace(s, kv_heads=args.kv_heads)
    mx.set_default_device(mx.cpu)
    model = build_model(s)
    print(f"# paged attention benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(f"- command: `python {' '.join(sys.argv)}`")
    print(f"- machine: {platform.machine()}, {platform.processor() or platform.system()}")
    print(f"- {describe(BLAS, measure_gflops())}")
    print(
        f"- model: random llama, {params(model) / 1e6:.0f}M parameters, fp32, hidden {s.hidden}, "
        f"{s.layers} layers, {s.heads} heads / {s.kv_heads} KV heads, vocab {s.vocab}"
    )
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default (all cores)")
    print(f"- cores: {os.cpu_count()}, OPENBLAS_NUM_THREADS={threads}")
    print(
        f"- decode: median of {s.steps} steps after one warm-up, the methods taking turns step "
        f"by step; block size {BLOCK_SIZE[0]}; all sequences at the same context; KV filled "
        "with noise; "
        "random block tables\n"
    )
    print(
        "| batch | context | paged ms (its choice) | block-table ms | gather+SDPA ms "
        "| BatchKVCache ms | dense serial ms | paged vs BatchKVCache | paged vs serial |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ctx in s.contexts:
        for batch in s.batches:
            t = decode_cell(model, s, batch, ctx)
            p, k, g, b, d = t["paged"], t["blocks"], t["gather"], t["batch_kv"], t["serial"]
            print(
                f"| {batch} | {ctx} | {p * 1e3:.1f} ({CHOICE[0]}) | {k * 1e3:.1f} | {g * 1e3:.1f} "
                f"| {b * 1e3:.1f} | {d * 1e3:.1f} | {b / p:.2f}x | {d / p:.2f}x |",
                flush=True,
            )
    if args.skip_prefill:
        return
    print("\n(ratios: > 1 means paged is faster)\n")
    p, d = prefill_times(model, s)
    print(f"| prefill {s.prefill} tokens | paged s | dense s | paged vs dense |")
    print("|---|---:|---:|---:|")
    print(f"| one sequence from empty | {p:.3f} | {d:.3f} | {d / p:.2f}x |\n", flush=True)
    ps, ds, pb, db = shared_prefix(model, s)
    print(
        f"| {s.requests} requests, {s.prefix}-token shared prefix + {s.suffix} own "
        "| paged (shared blocks) | dense (one cache each) | ratio |"
    )
    print("|---|---:|---:|---:|")
    print(f"| time, s | {ps:.2f} | {ds:.2f} | {ds / ps:.2f}x faster |")
    print(f"| KV bytes, MB | {pb / 1e6:.0f} | {db / 1e6:.0f} | {db / pb:.2f}x smaller |")


if __name__ == "__main__":
    main()
