"""Speculative decoding: decode tokens/s with and without drafts, in one run, one worker.

Requests decode from repetitive prompts (a phrase repeated, as code and quoted text repeat)
with greedy sampling and ignore_eos; each mode runs the same requests against the same worker
process (the mode is per request), in turns (ABAB) so that machine noise hits every mode
alike. Decode tokens/s counts from each request's first token to its last (prefill is the
same in every mode). Modes: no speculation; prompt lookup with 4 and 8 drafts; a draft model
(a 2-layer random model with the same tokenizer, so it rarely agrees: its row is the cost of
drafting that does not pay). Every mode's tokens are checked to equal the plain run's.

Random weights fall into runs of repeated tokens under greedy decoding, so prompt lookup is
accepted often here; the acceptance column says how often, and the speed-up is for that rate.

    python bench/bench_speculative.py            # ~110M-parameter model, about 5 minutes here
    python bench/bench_speculative.py --quick    # a 4-layer model, about 1 minute
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_generate import make_model, start  # noqa: E402

from kvserve_proto.worker.v1 import worker_pb2 as pb  # noqa: E402
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402

MODES: dict[str, dict] = {
    "off": {},
    "ngram k=4": {"speculative": pb.SPECULATIVE_NGRAM, "num_draft_tokens": 4},
    "ngram k=8": {"speculative": pb.SPECULATIVE_NGRAM, "num_draft_tokens": 8},
    "draft model k=4": {"speculative": pb.SPECULATIVE_DRAFT_MODEL, "num_draft_tokens": 4},
}


def repetitive_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        phrase = rng.integers(0, 256, int(rng.integers(5, 17))).tolist()
        out.append((phrase * (length // len(phrase) + 1))[:length])
    return out


async def run_mode(
    stub: pb_grpc.WorkerStub, prompts: list[list[int]], max_tokens: int, extra: dict
) -> tuple[float, list[list[int]], int, int]:
    """Decode tokens/s of the concurrent requests, their tokens, drafts and accepted drafts."""
    before = await stub.GetInfo(pb.GetInfoRequest())

    async def one(p: list[int]) -> tuple[float, float, list[int]]:
        req = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=p),
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra),
        )
        first = last = 0.0
        tokens: list[int] = []
        async for msg in stub.Generate(req):
            if msg.token_ids:
                last = time.perf_counter()
                first = first or last
                tokens += msg.token_ids
        return first, last, tokens

    results = await asyncio.gather(*(one(p) for p in prompts))
    after = await stub.GetInfo(pb.GetInfoRequest())
    decoded = sum(len(r[2]) - 1 for r in results)
    span = max(r[1] for r in results) - min(r[0] for r in results)
    return (
        decoded / span,
        [r[2] for r in results],
        after.draft_tokens - before.draft_tokens,
        after.accepted_draft_tokens - before.accepted_draft_tokens,
    )


async def bench(address: str, batches: list[int], length: int, out: int, repeats: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        await run_mode(stub, repetitive_prompts(1, length, 99), 8, {})  # warm
        print("| concurrent | mode | decode tok/s | vs off | drafts accepted | tokens = off |")
        print("|---|---|---|---|---|---|")
        for batch in batches:
            prompts = repetitive_prompts(batch, length, seed=batch)
            rates: dict[str, list[float]] = {m: [] for m in MODES}
            drafts = {m: [0, 0] for m in MODES}
            same = {m: True for m in MODES}
            reference: list[list[int]] | None = None
            for _ in range(repeats):
                for mode, extra in MODES.items():
                    rate, tokens, d, a = await run_mode(stub, prompts, out, extra)
                    reference = reference or tokens
                    same[mode] &= tokens == reference
                    rates[mode].append(rate)
                    drafts[mode][0] += d
                    drafts[mode][1] += a
            base = float(np.median(rates["off"]))
            for mode in MODES:
                rate = float(np.median(rates[mode]))
                d, a = drafts[mode]
                accepted = f"{a / d:.0%} of {d}" if d else "-"
                print(
                    f"| {batch} | {mode} | {rate:.1f} | {rate / base:.2f}x | {accepted} | "
                    f"{'yes' if same[mode] else 'NO'} |"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=0, help="turns per mode (default 3, quick 2)")
    a = p.parse_args()
    layers, hidden, length, out = (4, 256, 200, 64) if a.quick else (12, 768, 400, 128)
    repeats = a.repeats or (2 if a.quick else 3)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model", layers, hidden)
        draft_dir = make_model(Path(tmp) / "draft", 2, 256)
        kv, kv_addr = start(
            [sys.executable, "-m", "kvcache_service", "--port", "0", "--admin-token", "bench"],
            "KVCACHE_READY",
        )
        worker, address = start(
            [
                sys.executable, "-m", "worker", "--cache-service", kv_addr, "--port", "0",
                "--worker-id", "bench", "--model", str(model_dir), "--kv-memory-mb", "1024",
                "--draft-model", str(draft_dir),
            ],
            "WORKER_READY",
        )  # fmt: skip
        try:
            print(f"# prompts: a 5-16 token phrase repeated to {length} tokens; {out} generated\n")
            asyncio.run(bench(address, [1, 8], length, out, repeats))
        finally:
            for proc in (worker, kv):
                proc.terminate()
                proc.wait()


if __name__ == "__main__":
    main()
