"""Cache-service benchmark: AcquireLease + ReleaseLease latency and throughput.

2,048-token prompts against an index holding ~100k blocks, with a hit mix:
  40% a shared 1,024-token system prompt (one of 16) + a unique question  (~50% cached)
  30% a follow-up turn of an earlier conversation                         (~95% cached)
  30% a cold prompt                                                       (0% cached)
Every request acquires (with a 256-token decode reserve) then releases with 64 generated
tokens, which commits its blocks: the index stays full and every acquire that misses
evicts. Measured twice, in one run: the domain in-process (CacheAuthority called directly)
and over loopback gRPC against `python -m kvcache_service` in its own process.

    python bench/bench_kvcache.py            # full (about 2 minutes here)
    python bench/bench_kvcache.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvcache_service.authority import AuthorityConfig, CacheAuthority  # noqa: E402
from kvcache_service.ids import Namespace, PoolId  # noqa: E402
from kvcache_service.leases import AcquireRequest, Grant  # noqa: E402
from kvcache_service.pool import PoolSpec  # noqa: E402
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb  # noqa: E402
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc  # noqa: E402

BS = 32
PROMPT = 2048
RESERVE = 256
GENERATED = 64
VOCAB = 32000


@dataclass
class Workload:
    """Deterministic prompts; conversations grow as their turns are released."""

    rng: random.Random
    np_rng: np.random.Generator
    systems: list[list[int]]
    conversations: list[list[int]]

    @classmethod
    def make(cls, seed: int = 0) -> Workload:
        np_rng = np.random.default_rng(seed)
        systems = [np_rng.integers(0, VOCAB, PROMPT // 2).tolist() for _ in range(16)]
        return cls(random.Random(seed), np_rng, systems, [])

    def fresh(self, n: int) -> list[int]:
        return self.np_rng.integers(0, VOCAB, n).tolist()

    def next_prompt(self) -> tuple[str, list[int]]:
        r = self.rng.random()
        if r < 0.3 and self.conversations:
            past = self.rng.choice(self.conversations)
            return "follow-up", past[-(PROMPT - 100) :] + self.fresh(100)
        if r < 0.7:
            return "system", self.rng.choice(self.systems) + self.fresh(PROMPT // 2)
        return "cold", self.fresh(PROMPT)

    def finished(self, tokens: list[int]) -> None:
        self.conversations.append(tokens)
        if len(self.conversations) > 512:
            self.conversations.pop(self.rng.randrange(len(self.conversations)))


def percentiles(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs) * 1000
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def bench_in_process(num_blocks: int, fill: int, n: int) -> dict[str, float]:
    auth = CacheAuthority(AuthorityConfig(lease_ttl_s=3600))
    inc = auth.register_pool(PoolSpec("w", num_blocks, BS)).incarnation  # type: ignore[arg-type]
    work = Workload.make()

    def one() -> tuple[float, float, int]:
        _, prompt = work.next_prompt()
        t0 = time.perf_counter()
        req = AcquireRequest(PoolId("w"), inc, Namespace(""), tuple(prompt), RESERVE)
        grant, _ = auth.acquire(req)
        t1 = time.perf_counter()
        assert isinstance(grant, Grant)
        final = prompt + work.fresh(GENERATED)
        auth.release("w", inc, grant.lease_id, final)  # type: ignore[arg-type]
        t2 = time.perf_counter()
        work.finished(final)
        return t1 - t0, t2 - t1, grant.cached_tokens

    while len(auth.pools["w"].index) < fill:  # type: ignore[index]
        one()
    acq, rel, cached = [], [], 0
    start = time.perf_counter()
    for _ in range(n):
        a, r, c = one()
        acq.append(a)
        rel.append(r)
        cached += c
    wall = time.perf_counter() - start
    pool = auth.pools["w"]  # type: ignore[index]
    assert not pool.check_integrity()
    return summary(acq, rel, wall, n, cached, len(pool.index), pool.counters.evicted_blocks)


def summary(acq, rel, wall, n, cached, indexed, evicted) -> dict[str, float]:
    a50, a99 = percentiles(acq)
    r50, r99 = percentiles(rel)
    return {
        "acquire p50 ms": a50,
        "acquire p99 ms": a99,
        "release p50 ms": r50,
        "release p99 ms": r99,
        "pairs/s": n / wall,
        "hit rate": cached / (n * PROMPT),
        "indexed blocks": indexed,
        "evicted blocks": evicted,
    }


async def bench_grpc(address: str, num_blocks: int, fill: int, n: int, concurrency: int):
    async with grpc.aio.insecure_channel(address) as channel:
        kv = pb_grpc.KVCacheServiceStub(channel)
        admin = pb_grpc.KVCacheAdminStub(channel)
        auth = [("authorization", "Bearer bench")]
        reg = await kv.RegisterPool(
            pb.RegisterPoolRequest(pool_id="w", num_blocks=num_blocks, block_size=BS)
        )
        ref = pb.PoolRef(pool_id="w", incarnation=reg.incarnation)
        work = Workload.make()

        async def one() -> tuple[float, float, int]:
            _, prompt = work.next_prompt()
            t0 = time.perf_counter()
            resp = await kv.AcquireLease(
                pb.AcquireLeaseRequest(pool=ref, prompt_token_ids=prompt, reserve_tokens=RESERVE)
            )
            t1 = time.perf_counter()
            final = prompt + work.fresh(GENERATED)
            await kv.ReleaseLease(
                pb.ReleaseLeaseRequest(pool=ref, lease_id=resp.lease.lease_id, token_ids=final)
            )
            t2 = time.perf_counter()
            work.finished(final)
            return t1 - t0, t2 - t1, resp.lease.cached_tokens

        async def indexed() -> int:
            stats = await admin.GetStats(pb.StatsRequest(pool_id="w"), metadata=auth)
            return stats.pools[0].indexed_blocks

        while await indexed() < fill:
            for _ in range(200):
                await one()
        # Sequential: latency without queueing.
        seq = [await one() for _ in range(n)]
        # Concurrent: throughput with `concurrency` requests in flight.
        results: list[tuple[float, float, int]] = []

        async def client(k: int) -> None:
            for _ in range(k):
                results.append(await one())

        start = time.perf_counter()
        await asyncio.gather(*(client(n // concurrency) for _ in range(concurrency)))
        wall = time.perf_counter() - start
        stats = (await admin.GetStats(pb.StatsRequest(pool_id="w"), metadata=auth)).pools[0]
        check = await admin.CheckIntegrity(pb.CheckIntegrityRequest(), metadata=auth)
        assert check.ok, check.problems
        s = summary(
            [x[0] for x in seq],
            [x[1] for x in seq],
            wall,
            len(results),
            sum(x[2] for x in seq),
            stats.indexed_blocks,
            stats.evicted_blocks,
        )
        s["pairs/s"] = len(results) / wall
        return s


def start_service() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcache_service", "--port", "0", "--admin-token", "bench"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "KVCACHE_LOG_LEVEL": "WARNING"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("KVCACHE_READY"):
        proc.kill()
        raise RuntimeError(f"cache service did not start: {line!r}")
    return proc, line.split()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10k indexed blocks, fewer requests")
    p.add_argument("--fill", type=int, default=100_000, help="indexed blocks before measuring")
    p.add_argument("-n", type=int, default=2000, help="measured acquire+release pairs")
    p.add_argument("--concurrency", type=int, default=8)
    a = p.parse_args()
    if a.quick:
        a.fill, a.n = 10_000, 400
    num_blocks = a.fill + a.fill // 10
    print(f"# {a.n} acquire+release pairs, 2048-token prompts, {a.fill} blocks indexed\n")
    rows = {"in-process (domain)": bench_in_process(num_blocks, a.fill, a.n)}
    proc, address = start_service()
    try:
        rows[f"loopback gRPC (x{a.concurrency} for pairs/s)"] = asyncio.run(
            bench_grpc(address, num_blocks, a.fill, a.n, a.concurrency)
        )
    finally:
        proc.terminate()
        proc.wait()
    cols = list(next(iter(rows.values())))
    print("| path | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, r in rows.items():
        cells = [f"{r[c]:.3f}" if "ms" in c or c == "hit rate" else f"{r[c]:,.0f}" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    base, rpc = rows["in-process (domain)"], list(rows.values())[1]
    print(f"\ngRPC / in-process acquire p50: {rpc['acquire p50 ms'] / base['acquire p50 ms']:.1f}x")


if __name__ == "__main__":
    main()
