"""KV tiers: a working set 4x the pool, a long prompt after a full restart, load-back speed.

Three measurements, each in one run (docs/kv-tiers.md records them):

1. **Trace**: a RAG/multi-turn trace whose working set is 4x the worker's pool: ``--docs``
   documents of ``--doc-tokens`` tokens each, asked ``--rounds`` rounds of questions (each
   request: a document, then a question of its own), one request at a time. The same trace
   against three workers in turn: the pool alone ("no tier"), the pool with a disk tier
   ("disk tier"), and a pool large enough for everything ("unbounded"). Reported: the token
   hit rate (cached or loaded prompt tokens over prompt tokens, every round) and TTFT p50 of
   the rounds after the first.
2. **Restart**: a ``--long-tokens`` prompt, cold; then the cache service and the worker both
   stopped and started again on the same disk tier, and the same prompt: TTFT before / after.
3. **Load-back**: ``--load-blocks`` blocks of the model's size written to a disk tier, dropped
   from the page cache, and loaded back (files -> checked payloads -> the pool), against the
   disk's sequential read of one file of the same size, also out of the page cache.

    python bench/bench_tiers.py             # the default model; about 6 minutes here
    python bench/bench_tiers.py --quick     # the tiny model, small sizes
    python bench/bench_tiers.py --model DIR --random --layers 16 --hidden 2048 --only restart
                                            # a GPU: a random 1B model of DIR's tokenizer
    python bench/bench_tiers.py --model DIR --random --like llama-8b --bits 4 --only restart
                                            # an 8B llama's shape in 4 bits (mlx-lm's usual)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench_generate import start  # noqa: E402
from bench_structured import LIKE, model_path, random_like  # noqa: E402

from kvserve_proto.kvcache.v1 import kvcache_pb2 as kpb  # noqa: E402
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as kpb_grpc  # noqa: E402
from kvserve_proto.worker.v1 import worker_pb2 as pb  # noqa: E402
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402

TOKEN = "bench"


class System:
    """A cache service and one worker, started together, stopped together (gracefully)."""

    def __init__(
        self, model: str, num_blocks: int, offload_dir: str = "", host_gb: float = 0.0
    ) -> None:
        self.procs: list[subprocess.Popen] = []
        kv, self.kv_addr = start(
            [sys.executable, "-m", "kvcache_service", "--port", "0", "--admin-token", TOKEN],
            "KVCACHE_READY",
        )
        self.procs.append(kv)
        flags = ["--offload-dir", offload_dir] if offload_dir else []
        flags += ["--host-offload-gb", str(host_gb)] if host_gb else []
        worker, self.address = start(
            [
                sys.executable, "-m", "worker", "--cache-service", self.kv_addr, "--port", "0",
                "--worker-id", "bench", "--model", model, "--num-blocks", str(num_blocks),
                "--no-warmup", "--no-self-check", *flags,
            ],
            "WORKER_READY",
        )  # fmt: skip
        self.procs.append(worker)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            proc.wait()

    def integrity_ok(self) -> bool:
        with grpc.insecure_channel(self.kv_addr) as channel:
            admin = kpb_grpc.KVCacheAdminStub(channel)
            md = [("authorization", f"Bearer {TOKEN}")]
            return admin.CheckIntegrity(kpb.CheckIntegrityRequest(), metadata=md).ok


async def ask(address: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """One request: (TTFT in s, prompt tokens cached or loaded)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        start_t = time.perf_counter()
        first, cached = 0.0, 0
        req = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        async for msg in stub.Generate(req):
            if msg.token_ids and not first:
                first = time.perf_counter() - start_t
            if msg.finish_reason:
                cached = msg.usage.cached_tokens
        return first, cached


async def info(address: str) -> pb.WorkerInfo:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.WorkerStub(channel).GetInfo(pb.GetInfoRequest())


def token_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def trace(args: argparse.Namespace, model: str, vocab: int) -> None:
    rng = random.Random(0)
    docs = [token_ids(rng, args.doc_tokens, vocab) for _ in range(args.docs)]
    requests = [
        (r, docs[d] + token_ids(rng, 16, vocab))
        for r in range(args.rounds)
        for d in range(args.docs)
    ]
    working_blocks = args.docs * -(-args.doc_tokens // 32)
    pool = working_blocks // 4
    print(
        f"\n## trace: {args.docs} documents x {args.doc_tokens} tokens, {args.rounds} rounds, "
        f"pool {pool} blocks (working set {working_blocks} blocks = 4x)"
    )
    rows = {}
    variants = [("no tier", pool, "")]
    variants += [("host tier", pool, "host")] if args.host_tier else []
    variants += [("disk tier", pool, "disk"), ("unbounded", working_blocks * 2, "")]
    for name, blocks, tier in variants:
        tier_dir = tempfile.mkdtemp(prefix="kv-tier-") if tier == "disk" else ""
        system = System(model, blocks, tier_dir, args.host_gb if tier == "host" else 0.0)
        try:
            ttft, cached, total = [], 0, 0
            for round_, prompt in requests:
                t, c = asyncio.run(ask(system.address, prompt, 4))
                if round_ > 0:
                    ttft.append(t)
                cached += c
                total += len(prompt)
            got = asyncio.run(info(system.address))
            assert system.integrity_ok()
        finally:
            system.stop()
            if tier_dir:
                shutil.rmtree(tier_dir, ignore_errors=True)
        rows[name] = (cached / total, statistics.median(ttft), got.prefilled_tokens)
    print("| pool | hit rate | TTFT p50 (rounds 2+) | prefilled tokens |")
    print("|---|---|---|---|")
    for name, (hit, p50, pre) in rows.items():
        print(f"| {name} | {hit:.3f} | {p50 * 1e3:.0f} ms | {pre:,} |")
    t0, h2 = rows["no tier"][1], rows["unbounded"][0]
    for tier in ("host tier", "disk tier"):
        if tier in rows:
            h1, t1, _ = rows[tier]
            print(
                f"\nhit rate, {tier} / unbounded: {h1 / h2:.2f} (target >= 0.9); "
                f"TTFT p50, no tier / {tier}: {t0 / t1:.1f}x (target >= 3x)"
            )


def restart(args: argparse.Namespace, model: str, vocab: int) -> None:
    rng = random.Random(1)
    prompt = token_ids(rng, args.long_tokens, vocab)
    # A prompt of its own first in each start, computed, so that neither measurement pays
    # for first-use kernels (--no-warmup), and the worker has timed a prefill.
    warm_ups = [token_ids(rng, 1024, vocab) for _ in range(2)]
    blocks = -(-(args.long_tokens + 64) // 32) + 48
    tier_dir = tempfile.mkdtemp(prefix="kv-tier-")
    print(f"\n## restart: a {args.long_tokens}-token prompt, pool {blocks} blocks")
    try:
        system = System(model, blocks, tier_dir)
        try:
            asyncio.run(ask(system.address, warm_ups[0], 4))
            cold, _ = asyncio.run(ask(system.address, prompt, 4))
        finally:
            system.stop()  # both processes: a full restart
        system = System(model, blocks, tier_dir)
        try:
            asyncio.run(ask(system.address, warm_ups[1], 4))
            before = asyncio.run(info(system.address)).prefilled_tokens
            warm, cached = asyncio.run(ask(system.address, prompt, 4))
            got = asyncio.run(info(system.address))
            assert system.integrity_ok()
        finally:
            system.stop()
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
    print("| run | TTFT | prompt tokens loaded | computed |")
    print("|---|---|---|---|")
    print(f"| cold | {cold * 1e3:.0f} ms | 0 | {args.long_tokens:,} |")
    print(
        f"| after a full restart | {warm * 1e3:.0f} ms | {cached:,} | "
        f"{got.prefilled_tokens - before:,} |"
    )
    print(f"\nTTFT cold / after restart: {cold / warm:.1f}x (target >= 10x)")


def drop_cached(path: Path) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def load_back(args: argparse.Namespace, model: str) -> None:
    """Files -> payloads -> pool, against one sequential read; both out of the page cache."""
    from worker.model.kv_pool import KVPool
    from worker.model.loader import load_model
    from worker.model.spec import probe
    from worker.tier.disk import DiskTier
    from worker.tier.store import BlockFormat, TierStore

    spec = probe(load_model(model).model)
    n = args.load_blocks
    pool = KVPool.for_model(spec, num_blocks=n)
    per = pool.bytes_per_block
    root = Path(tempfile.mkdtemp(prefix="kv-tier-"))
    try:
        disk = DiskTier(root, "bench", pool.describe_layout(), per, n)
        fmt = BlockFormat("bench", pool.describe_layout(), per)
        store = TierStore(32, fmt, disk=disk)
        store.start()
        rng = random.Random(2)
        tokens = token_ids(rng, n * 32, 32000)
        metas = store.metas("", tokens, 0, n)
        payloads = [os.urandom(64) * (per // 64) for _ in range(n)]
        store.enqueue(metas, payloads)
        store.flush()
        os.sync()
        big = root / "sequential"
        with open(big, "wb") as f:
            for p in payloads:
                f.write(p)
            f.flush()
            os.fsync(f.fileno())
        # Alternating, three times each, medians: the disk of a shared machine drifts.
        t_seq, t_files, t_pool = [], [], []
        for _ in range(3):
            drop_cached(big)
            t0 = time.perf_counter()
            with open(big, "rb", buffering=0) as f:
                while f.read(1 << 20):
                    pass
            t_seq.append(time.perf_counter() - t0)
            for m in metas:
                drop_cached(store.disk.path(m.key))
            t0 = time.perf_counter()
            got = store.load(metas)
            t_files.append(time.perf_counter() - t0)
            pool.write_blocks(list(range(n)), got)
            t_pool.append(time.perf_counter() - t0)
            assert got == payloads
        # In the page cache (a restart's files, just written): read into fresh memory, as
        # loads were, against the engine's way, a chunk at a time into a reused arena.
        t_fresh, t_arena = [], []
        chunks = [metas[i : i + store.load_chunk] for i in range(0, n, store.load_chunk)]
        arena = store.take_arena()
        for _ in range(3):
            t0 = time.perf_counter()
            pool.write_blocks(list(range(n)), store.load(metas))
            t_fresh.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            at = 0
            for chunk in chunks:
                got = store.load(chunk, arena)
                pool.write_blocks(list(range(at, at + len(got))), got)
                at += len(got)
            t_arena.append(time.perf_counter() - t0)
            assert got == payloads[-len(got) :]
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = n * per / 1e6
    t_seq, t_files, t_pool = map(statistics.median, (t_seq, t_files, t_pool))
    t_fresh, t_arena = map(statistics.median, (t_fresh, t_arena))
    print(
        f"\n## load-back: {n} blocks of {per:,} bytes ({total:.0f} MB), out of the page cache, medians of 3"
    )
    print("| path | MB/s | / sequential read |")
    print("|---|---|---|")
    print(f"| sequential read of one file | {total / t_seq:.0f} | 1.00 |")
    print(f"| tier files, checked | {total / t_files:.0f} | {t_seq / t_files:.2f} |")
    print(f"| tier files, checked, into the pool | {total / t_pool:.0f} | {t_seq / t_pool:.2f} |")
    print("\ntarget: load-back >= 0.5 of the sequential read")
    print(f"\n## the same files in the page cache, checked, into the pool ({total:.0f} MB)")
    print("| path | MB/s |")
    print("|---|---|")
    print(f"| read into fresh memory, then written | {total / t_fresh:.0f} |")
    print(f"| {store.load_chunk} blocks at a time into a reused arena | {total / t_arena:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="default", help="default, tiny, or a path")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--long-tokens", type=int, default=7000)
    p.add_argument("--load-blocks", type=int, default=256)
    p.add_argument("--only", choices=("trace", "restart", "load"), default=None)
    p.add_argument(
        "--host-tier",
        action="store_true",
        help="trace: also a pool with a host-memory tier (CUDA only: elsewhere none)",
    )
    p.add_argument("--host-gb", type=float, default=4.0, help="the host tier's size")
    p.add_argument(
        "--random",
        action="store_true",
        help="random fp16 weights with the model's tokenizer and shape (GPUs: made there)",
    )
    p.add_argument("--layers", type=int, default=0, help="with --random: layers")
    p.add_argument("--hidden", type=int, default=0, help="with --random: hidden size")
    p.add_argument("--like", choices=sorted(LIKE), default="", help="with --random: a shape")
    p.add_argument("--bits", type=int, default=0, help="with --random: quantized (group 64)")
    p.add_argument(
        "--random-dir", default="", help="with --random: made here, or reused if made before"
    )
    args = p.parse_args()
    if args.quick:
        args.model = "tiny" if args.model == "default" else args.model
        args.docs, args.doc_tokens, args.rounds = 8, 128, 2
        args.long_tokens, args.load_blocks = 1000, 64
    model = model_path(args.model)
    if args.random:
        made = Path(args.random_dir or tempfile.mkdtemp(prefix="kv-model-"))
        if (made / "model.safetensors").exists():
            model = str(made)
        else:
            model = random_like(
                model, made, args.layers, args.hidden, like=args.like, bits=args.bits
            )
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    print(f"# model {args.model}: {model}")
    if args.only in (None, "load"):
        load_back(args, model)
    if args.only in (None, "trace"):
        trace(args, model, vocab)
    if args.only in (None, "restart"):
        restart(args, model, vocab)


if __name__ == "__main__":
    main()
