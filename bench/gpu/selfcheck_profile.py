"""Where a cold self-check's time goes on a GPU: each forward of the worker's start-up self-check
(``worker.model.self_check``) timed on its own, with the kernel modules MLX compiled during it
(``MLX_PTX_CACHE_DIR``'s ``.ptx`` files, counted and named), then the same forwards again in the
same process (compiled and cached: what they cost once nothing is built).

Run it with an empty ``MLX_PTX_CACHE_DIR`` and ``CUDA_CACHE_PATH`` for a new machine's start, or
with them kept for a restart's:

    python3 bench/gpu/selfcheck_profile.py MODEL_DIR [--block-size 32]

It prints one line a forward (seconds, new modules, their names) and a total; on a CPU it runs
too (nothing is compiled by NVRTC there, so it measures the forwards only).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from worker.model import mlx_lm_light  # noqa: E402

mlx_lm_light.register_package()


def modules(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*.ptx")} if cache.is_dir() else set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--block-size", type=int, default=32)
    a = p.parse_args()
    t_start = time.perf_counter()
    import mlx.core as mx

    from worker.model.forward_batch import SeqInput
    from worker.model.loader import load_model
    from worker.model.runner import ModelRunner
    from worker.model.self_check import DenseSequence, _Plan, _tables
    from worker.precompile import ptx_cache_dir

    cache = ptx_cache_dir()
    print(f"PTX cache {cache} ({len(modules(cache))} modules), CUDA_CACHE_PATH "
          f"{os.environ.get('CUDA_CACHE_PATH', '~/.nv')}, device {mx.default_device()}")  # fmt: skip
    t0 = time.perf_counter()
    loaded = load_model(str(a.model), tokenizer=False)
    model = loaded.model
    t1 = time.perf_counter()
    runner = ModelRunner.create(model, block_size=a.block_size, num_blocks=64)
    choice = runner.choose_decode_attention()
    t2 = time.perf_counter()
    print(f"imports {t0 - t_start:.2f} s, load {t1 - t0:.2f} s, runner {t2 - t1:.2f} s ({choice})")
    tables = _tables(a.block_size)
    plan = _Plan.make(a.block_size, runner.spec.vocab_size, tables)

    def steps() -> list[tuple[str, object]]:
        dense: list[DenseSequence] = []
        tokens: list[int] = []

        def dense_prompt(i: int) -> None:
            d = DenseSequence(model, plan.prompts[i])
            dense.append(d)
            tokens.append(int(mx.argmax(d.logits)))

        def paged_decode() -> None:
            out = runner.forward(
                [
                    SeqInput([t], table, len(p))
                    for t, table, p in zip(tokens, plan.tables, plan.prompts, strict=True)
                ]
            )
            mx.eval(out)

        def paged_prefill() -> None:
            out = runner.forward(
                [
                    SeqInput(tail, table, start)
                    for tail, table, start in zip(plan.tails, plan.tables, plan.starts, strict=True)
                ]
            )
            mx.eval(out)

        return [
            ("paged prefix (1 seq)", lambda: mx.eval(runner.forward([SeqInput(plan.prefix, plan.tables[0], 0)]))),
            ("paged prefill (3 seqs)", paged_prefill),
            *[(f"dense prompt {i} ({len(plan.prompts[i])} tokens)", lambda i=i: dense_prompt(i)) for i in range(3)],
            ("paged decode (3 seqs)", paged_decode),
            *[(f"dense step {i}", lambda i=i: mx.eval(dense[i].step(tokens[i]))) for i in range(3)],
        ]  # fmt: skip

    for attempt in ("cold", "again"):
        total = 0.0
        before = modules(cache)
        for name, fn in steps():
            seen = modules(cache)
            t = time.perf_counter()
            fn()  # type: ignore[operator]
            dt = time.perf_counter() - t
            total += dt
            new = sorted(modules(cache) - seen)
            names = ", ".join(n.rsplit("/", 1)[-1][:48] for n in new)
            print(f"  {attempt:5s} {name:32s} {dt:7.2f} s  {len(new):3d} new modules  {names}")
        print(f"{attempt}: {total:.2f} s, {len(modules(cache) - before)} modules compiled")
    print(f"process total {time.perf_counter() - t_start:.2f} s")


if __name__ == "__main__":
    if not os.environ.get("MLX_PTX_CACHE_DIR"):
        os.environ["MLX_PTX_CACHE_DIR"] = tempfile.mkdtemp(prefix="selfcheck-ptx-")
    main()
