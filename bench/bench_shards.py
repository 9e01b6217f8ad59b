"""The cache service sharded by pool id, simulated on loopback: 1 shard vs 2 (docs/sharding.md).

Every shard is `python -m kvcache_service` in its own process. `--pools` pools are registered,
spread evenly over the shards; each is driven, as its worker would drive it, by one of
`--clients` client processes (pool i by client i mod K, and every client has pools on every
shard it can): `--concurrency` loops per pool, each an AcquireLease of a `--prompt-tokens`
prompt (half of it one of 8 system prompts shared by the pool's prompts, half its own; a
256-token reserve) then a ReleaseLease with 64 more tokens, whose full blocks are committed
(`--wire compact`, the default: packed token ids and a release carrying only the new tokens,
as workers send them since wire revision 2; `readable`: repeated int32, the whole sequence). A
pool's prompts touch more blocks than it has (`--pool-blocks`), so eviction runs throughout.
Clients are kept cheap: every request is serialized once ahead (the pool ref and lease id are
appended as protobuf fields at call time), so the shards' CPU is what is measured.

Measured in one run, each ratio against the baseline of that run:
  1. lease pairs/s over all pools, 1 shard (the baseline, every pool on it) vs 2 shards
     (`--shards 1,2,4` for more; `--repeat` alternates the setups and reports medians); the
     CPU seconds per pair in the shards and in the clients, and the ceiling they put on this
     machine: cores / (shard + client CPU per pair);
  2. Route latency of a `--prompt-tokens` prompt from the gateway's own client, idle: one
     shard holding every pool (`CacheClient`), one of two shards alone, and the fan-out over
     both (`ShardedCache`), with the gateway's CPU per Route;
  3. under load on 2 shards, shard 1 SIGKILLed, then restarted on its port after `--down-s`:
     failed calls on shard 0's pools (must be none) and its pairs/s before, during and after;
     how long until Route (the gateway's `ShardedCache`, asked every 20 ms) drops shard 1's
     pools, until its pools re-register (their clients register again when a lease call says
     FAILED_PRECONDITION, as a worker does), and until Route lists them again (`--timeline`:
     each shard's pairs, second by second).

    .venv/bin/python bench/bench_shards.py --quick      # under a minute
    .venv/bin/python bench/bench_shards.py
    python bench/bench_shards.py --shards 1,2,4 --pools 8 --clients 4 --repeat 3  # more cores
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.cache_client import CacheClient  # noqa: E402
from gateway.sharded_cache import ShardedCache  # noqa: E402
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb  # noqa: E402

BS = 32
RESERVE = 256
GENERATED = 64
VOCAB = 32000
SYSTEMS = 8
PROMPTS_PER_POOL = 64
ADMIN = "bench"
MODEL = "bench-model"
TICK = 0.1  # seconds per bucket of a client's timeline
CLK_TCK = os.sysconf("SC_CLK_TCK")
# A client stands for a worker: reconnect to a restarted shard promptly.
CLIENT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 100),
]
SERVICE = "/kvcache.v1.KVCacheService/"


# -- shards ------------------------------------------------------------------------------------


@dataclass
class Shard:
    proc: subprocess.Popen[str]
    address: str

    @classmethod
    def start(cls, port: int = 0) -> Shard:
        argv = [
            sys.executable, "-m", "kvcache_service", "--port", str(port),
            "--admin-token", ADMIN, "--max-pool-blocks", str(1 << 20),
        ]  # fmt: skip
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "KVCACHE_LOG_LEVEL": "ERROR"},
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("KVCACHE_READY"):
            proc.kill()
            raise RuntimeError(f"cache service did not start: {line!r}")
        return cls(proc, line.split()[1])

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process so far (/proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()


# -- a client process: the workers of some pools --------------------------------------------


@dataclass
class ClientSpec:
    pools: list[tuple[str, str]]  # (pool id, shard address)
    concurrency: int
    prompt_tokens: int
    pool_blocks: int
    start_at: float  # wall clock: measuring starts (before it: warm-up)
    stop_at: float
    seed: int
    wire: str  # "compact" (packed tokens, only new ones on release) or "readable"


@dataclass
class PoolResult:
    pool_id: str
    shard: str
    pairs: int = 0  # within [start_at, stop_at)
    errors: Counter[str] = field(default_factory=Counter)
    # Wall-clock bucket (int(t / TICK)) -> pairs / failed calls, over the whole run.
    ok_ticks: Counter[int] = field(default_factory=Counter)
    error_ticks: Counter[int] = field(default_factory=Counter)
    registered_at: list[float] = field(default_factory=list)


def packed(tokens: list[int]) -> bytes:
    """The compact wire form of token ids: little-endian uint32."""
    return np.asarray(tokens, dtype="<u4").tobytes()


class PoolDriver:
    """One pool's worker: registers it, runs acquire+release loops, registers again when a
    lease call says the shard does not know the pool (it restarted)."""

    def __init__(self, spec: ClientSpec, pool_id: str, address: str, seed: int) -> None:
        self.spec = spec
        self.result = PoolResult(pool_id, address)
        self.channel = grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
        self.register_call = self.channel.unary_unary(
            SERVICE + "RegisterPool",
            request_serializer=pb.RegisterPoolRequest.SerializeToString,
            response_deserializer=pb.RegisterPoolResponse.FromString,
        )
        # Requests go as bytes: serialized once here, the pool ref and lease id appended.
        self.acquire_call = self.channel.unary_unary(
            SERVICE + "AcquireLease", response_deserializer=pb.AcquireLeaseResponse.FromString
        )
        self.release_call = self.channel.unary_unary(
            SERVICE + "ReleaseLease", response_deserializer=pb.ReleaseLeaseResponse.FromString
        )
        rng = np.random.default_rng(seed)
        half = spec.prompt_tokens // 2
        systems = [rng.integers(0, VOCAB, half).tolist() for _ in range(SYSTEMS)]
        self.work: list[tuple[bytes, bytes]] = []
        for i in range(PROMPTS_PER_POOL):
            prompt = (
                systems[i % SYSTEMS] + rng.integers(0, VOCAB, spec.prompt_tokens - half).tolist()
            )
            generated = rng.integers(0, VOCAB, GENERATED).tolist()
            if spec.wire == "compact":  # what workers send (wire revision 2)
                acquire = pb.AcquireLeaseRequest(
                    prompt_tokens=packed(prompt), reserve_tokens=RESERVE
                )
                update = pb.SequenceUpdate(
                    written_tokens=len(prompt) + GENERATED,
                    appended_from=len(prompt),
                    appended_tokens=packed(generated),
                )
                release = pb.ReleaseLeaseRequest(update=update)
            else:
                acquire = pb.AcquireLeaseRequest(prompt_token_ids=prompt, reserve_tokens=RESERVE)
                release = pb.ReleaseLeaseRequest(token_ids=prompt + generated)
            self.work.append((acquire.SerializeToString(), release.SerializeToString()))
        self.rng = random.Random(seed)
        self.ref = b""
        self._registering: asyncio.Lock = asyncio.Lock()
        self.incarnation = 0

    async def register(self, seen: int) -> None:
        """Registers the pool, unless another loop already did since incarnation ``seen``."""
        async with self._registering:
            if self.incarnation != seen:
                return
            while True:
                try:
                    resp = await self.register_call(
                        pb.RegisterPoolRequest(
                            pool_id=self.result.pool_id,
                            num_blocks=self.spec.pool_blocks,
                            block_size=BS,
                            worker_address=f"bench-{self.result.pool_id}:1",
                            model=MODEL,
                        ),
                        timeout=5,
                    )
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
            self.incarnation = resp.incarnation
            ref = pb.PoolRef(pool_id=self.result.pool_id, incarnation=resp.incarnation)
            self.ref = pb.AcquireLeaseRequest(pool=ref).SerializeToString()
            self.result.registered_at.append(time.time())

    async def loop(self) -> None:
        r = self.result
        while (now := time.time()) < self.spec.stop_at:
            acquire, release = self.work[self.rng.randrange(len(self.work))]
            seen = self.incarnation
            try:
                resp = await self.acquire_call(self.ref + acquire, timeout=5)
                if resp.WhichOneof("result") != "lease":
                    r.errors["deferred"] += 1
                    continue
                lease = pb.ReleaseLeaseRequest(lease_id=resp.lease.lease_id).SerializeToString()
                # Field 1 (pool) of both messages is the same bytes: the ref serves both.
                await self.release_call(self.ref + lease + release, timeout=5)
            except grpc.aio.AioRpcError as e:
                code = e.code()
                r.errors[code.name] += 1
                r.error_ticks[int(time.time() / TICK)] += 1
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    await self.register(seen)
                elif code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    await asyncio.sleep(0.02)
                continue
            end = time.time()
            r.ok_ticks[int(end / TICK)] += 1
            if self.spec.start_at <= now and end < self.spec.stop_at:
                r.pairs += 1


async def _client(spec: ClientSpec) -> tuple[list[PoolResult], float]:
    drivers = [PoolDriver(spec, p, a, spec.seed * 1000 + i) for i, (p, a) in enumerate(spec.pools)]
    for d in drivers:
        await d.register(0)
    cpu: list[float] = []

    async def mark() -> None:
        await asyncio.sleep(max(0.0, spec.start_at - time.time()))
        cpu.append(time.process_time())
        await asyncio.sleep(max(0.0, spec.stop_at - time.time()))
        cpu.append(time.process_time())

    loops = [d.loop() for d in drivers for _ in range(spec.concurrency)]
    await asyncio.gather(mark(), *loops)
    for d in drivers:
        await d.channel.close()
    return [d.result for d in drivers], cpu[1] - cpu[0]


def client_main(spec: ClientSpec, out: Any) -> None:
    out.put(asyncio.run(_client(spec)))


def run_clients(
    pools: list[tuple[str, str, int]], a: argparse.Namespace, start_at: float, stop_at: float
) -> tuple[list[Any], Any]:
    """Starts the client processes, each driving its pools (``pool_layout``)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = []
    for c in range(a.clients):
        mine = [(pool, address) for pool, address, client in pools if client == c]
        spec = ClientSpec(
            mine, a.concurrency, a.prompt_tokens, a.pool_blocks, start_at, stop_at, c, a.wire
        )
        proc = ctx.Process(target=client_main, args=(spec, out), daemon=True)
        proc.start()
        procs.append(proc)
    return procs, out


def collect(procs: list[Any], out: Any) -> tuple[list[PoolResult], float]:
    results: list[PoolResult] = []
    cpu = 0.0
    for _ in procs:
        pools, c = out.get(timeout=120)
        results += pools
        cpu += c
    for p in procs:
        p.join(10)
    return results, cpu


def pool_layout(n_pools: int, n_clients: int, shards: list[Shard]) -> list[tuple[str, str, int]]:
    """(pool id, shard address, client) of every pool: pool i to client i mod K, and to the
    shards in turn, shifted by one each round of clients, so that every client has pools on
    every shard it can and each shard as many pools as the others."""
    return [
        (f"pool-{i}", shards[(i + i // n_clients) % len(shards)].address, i % n_clients)
        for i in range(n_pools)
    ]


# -- 1. throughput -------------------------------------------------------------------------------


def throughput(n_shards: int, a: argparse.Namespace) -> dict[str, float]:
    shards = [Shard.start() for _ in range(n_shards)]
    try:
        pools = pool_layout(a.pools, a.clients, shards)
        # Client processes take ~1 s to start; then warm up (fill the index, evict).
        start_at = time.time() + 1.5 + a.warmup_s
        stop_at = start_at + a.measure_s
        procs, out = run_clients(pools, a, start_at, stop_at)
        time.sleep(max(0.0, start_at - time.time()))
        cpu0 = [s.cpu_s() for s in shards]
        time.sleep(max(0.0, stop_at - time.time()))
        shard_cpu = sum(s.cpu_s() - c for s, c in zip(shards, cpu0, strict=True))
        results, client_cpu = collect(procs, out)
    finally:
        for s in shards:
            s.stop()
    pairs = sum(r.pairs for r in results)
    errors = sum(sum(r.errors.values()) for r in results)
    per_pair = (shard_cpu + client_cpu) / max(pairs, 1)
    return {
        "pairs/s": pairs / a.measure_s,
        "shard CPU ms/pair": 1000 * shard_cpu / max(pairs, 1),
        "client CPU ms/pair": 1000 * client_cpu / max(pairs, 1),
        "shard CPU use": shard_cpu / a.measure_s / n_shards,
        "ceiling pairs/s": (os.cpu_count() or 1) / per_pair,
        "errors": errors,
    }


# -- 2. Route latency ------------------------------------------------------------------------------


async def route_latency(
    n_shards: int, a: argparse.Namespace, alone: bool = False
) -> dict[str, float]:
    """``alone``: ask only the first of the shards (how long one shard of the fan-out takes)."""
    shards = [Shard.start() for _ in range(n_shards)]
    try:
        for pool_id, address, _ in pool_layout(a.pools, a.clients, shards):
            clients = CacheClient(address)
            await clients.stub.RegisterPool(
                pb.RegisterPoolRequest(
                    pool_id=pool_id,
                    num_blocks=a.pool_blocks,
                    block_size=BS,
                    model=MODEL,
                    worker_address=f"bench-{pool_id}:1",
                )
            )
            await clients.close()
        cache: CacheClient | ShardedCache
        if n_shards == 1 or alone:
            cache = CacheClient(shards[0].address)
        else:
            cache = ShardedCache([CacheClient(s.address) for s in shards])
        prompt = np.random.default_rng(7).integers(0, VOCAB, a.prompt_tokens).tolist()
        for _ in range(20):
            await cache.route("", prompt, MODEL)
        times = []
        cpu = time.process_time()
        for _ in range(a.routes):
            t0 = time.perf_counter()
            routes = await cache.route("", prompt, MODEL)
            times.append(time.perf_counter() - t0)
            assert len(routes) == (a.pools // n_shards if alone else a.pools)
        cpu = time.process_time() - cpu
        await cache.close()
    finally:
        for s in shards:
            s.stop()
    ms = np.asarray(times) * 1000
    return {
        "p50 ms": float(np.percentile(ms, 50)),
        "p99 ms": float(np.percentile(ms, 99)),
        "gateway CPU ms/Route": 1000 * cpu / a.routes,
    }


# -- 3. a shard killed and restarted under load ---------------------------------------------------


async def watch_routes(
    cache: ShardedCache, victims: set[str], until: float, seen: list[tuple[float, bool]]
) -> None:
    """Route every 20 ms: (time, whether every pool of the victim shard is listed)."""
    prompt = list(range(1, 65))
    while time.time() < until:
        try:
            pools = {r.pool_id for r in await cache.route("", prompt, MODEL)}
            seen.append((time.time(), victims <= pools))
        except Exception:  # every shard failed: not expected here, recorded as absent
            seen.append((time.time(), False))
        await asyncio.sleep(0.02)


async def restart(a: argparse.Namespace) -> tuple[dict[str, Any], list[tuple[int, int, int]]]:
    shards = [Shard.start() for _ in range(2)]
    victim = shards[1]
    try:
        pools = pool_layout(a.pools, a.clients, shards)
        victims = {p for p, addr, _ in pools if addr == victim.address}
        start_at = time.time() + 1.5 + a.warmup_s
        kill_at = start_at + a.measure_s / 2
        stop_at = kill_at + a.down_s + a.measure_s
        procs, out = run_clients(pools, a, start_at, stop_at)
        cache = ShardedCache([CacheClient(s.address) for s in shards])
        seen: list[tuple[float, bool]] = []
        watcher = asyncio.create_task(watch_routes(cache, victims, stop_at, seen))
        await asyncio.sleep(max(0.0, kill_at - time.time()))
        killed = time.time()
        # Off the loop, so that the Route watcher runs on meanwhile.
        await asyncio.to_thread(victim.kill)
        await asyncio.sleep(a.down_s)
        port = victim.port
        shards[1] = victim = await asyncio.to_thread(Shard.start, port)  # at its ready line
        ready = time.time()
        await watcher
        await cache.close()
        results, _ = collect(procs, out)
    finally:
        for s in shards:
            s.stop()
    survivors = [r for r in results if r.pool_id not in victims]
    lost = [r for r in results if r.pool_id in victims]
    timeline = []
    for t in range(int(stop_at - start_at)):
        ticks = range(int((start_at + t) / TICK), int((start_at + t + 1) / TICK))
        n0, n1 = (sum(r.ok_ticks[k] for r in rs for k in ticks) for rs in (survivors, lost))
        timeline.append((t, n0, n1))

    def rate(rs: list[PoolResult], t0: float, t1: float) -> float:
        ticks = range(int(t0 / TICK) + 1, int(t1 / TICK))
        return sum(r.ok_ticks[t] for r in rs for t in ticks) / max(len(ticks) * TICK, TICK)

    dropped = next((t for t, ok in seen if t >= killed and not ok), None)
    back = next((t for t, ok in seen if t >= ready and ok), None)
    again = [min((t for t in r.registered_at if t >= ready), default=stop_at) for r in lost]
    reregistered = max(again)
    return {
        "failed calls on shard 0's pools": sum(sum(r.errors.values()) for r in survivors),
        "shard 0 pairs/s before the kill": rate(survivors, start_at, killed),
        "shard 0 pairs/s while shard 1 is down": rate(survivors, killed, ready),
        "shard 0 pairs/s after the restart": rate(survivors, ready, stop_at),
        "shard 1 pairs/s after the restart": rate(lost, reregistered, stop_at),
        "failed calls on shard 1's pools": dict(sum((r.errors for r in lost), Counter())),
        "Route drops shard 1's pools after the kill (ms)": fmt_ms(dropped, killed),
        "shard 1 down (kill to ready line, s)": ready - killed,
        "shard 1's pools re-registered after its ready line (ms)": 1000 * (reregistered - ready),
        "Route lists them again after the ready line (ms)": fmt_ms(back, ready),
    }, timeline


def fmt_ms(t: float | None, since: float) -> float | str:
    return "never" if t is None else 1000 * (t - since)


# -- report ----------------------------------------------------------------------------------------


def table(rows: dict[str, dict[str, float]], base: str) -> None:
    cols = list(next(iter(rows.values())))
    print("| | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, r in rows.items():
        cells = [f"{r[c]:,.0f}" if abs(r[c]) >= 100 else f"{r[c]:.3g}" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    first = next(iter(rows))
    for name, r in rows.items():
        if name != first:
            print(f"\n{name} / {first}, {base}: {r[base] / rows[first][base]:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short phases (under a minute)")
    p.add_argument("--pools", type=int, default=4)
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--concurrency", type=int, default=4, help="loops in flight per pool")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--pool-blocks", type=int, default=1024)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--measure-s", type=float, default=15.0)
    p.add_argument("--routes", type=int, default=1000, help="Route calls timed per setup")
    p.add_argument("--down-s", type=float, default=2.0, help="shard 1 down this long")
    p.add_argument("--phases", default="123", help="which of the three to run")
    p.add_argument("--timeline", action="store_true", help="phase 3's pairs, second by second")
    p.add_argument(
        "--shards",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 2],
        help="shard counts of phase 1 (the first is the baseline)",
    )
    p.add_argument("--repeat", type=int, default=1, help="phase 1 runs per shard count")
    p.add_argument(
        "--wire",
        choices=("compact", "readable"),
        default="compact",
        help="lease calls' token form: packed, release with the new tokens only (the workers' "
        "since wire revision 2), or repeated int32 with the whole sequence",
    )
    a = p.parse_args()
    # Phase 3's shard failures are expected: the gateway's warnings would cut the table.
    logging.getLogger("gateway.sharded_cache").setLevel(logging.ERROR)
    if a.quick:
        a.warmup_s, a.measure_s, a.routes = 1.5, 5.0, 300
    print(
        f"# {a.pools} pools of {a.pool_blocks} blocks, {a.prompt_tokens}-token prompts, "
        f"{a.clients} client processes x {a.concurrency} loops per pool, {a.wire} wire form; "
        f"{os.cpu_count()} cores\n"
    )
    if "1" in a.phases:
        print("## 1. acquire+release pairs/s\n")
        runs: dict[int, list[dict[str, float]]] = {n: [] for n in a.shards}
        for _ in range(a.repeat):  # alternating, so that the machine's moods hit every setup
            for n in a.shards:
                runs[n].append(throughput(n, a))
        rows = {
            f"{n} shard{'s' if n > 1 else ''}": {
                c: float(np.median([r[c] for r in rs])) for c in rs[0]
            }
            for n, rs in runs.items()
        }
        table(rows, "pairs/s")
        print(
            "\nceiling: cores / (shard + client CPU per pair), the most this machine could do"
            + (f"; medians of {a.repeat} runs" if a.repeat > 1 else "")
        )
    if "2" in a.phases:
        print("\n## 2. Route latency (idle), the gateway's client\n")
        lat = {
            "1 shard, every pool (CacheClient)": asyncio.run(route_latency(1, a)),
            "2 shards, one of them (CacheClient)": asyncio.run(route_latency(2, a, alone=True)),
            "2 shards, fan-out (ShardedCache)": asyncio.run(route_latency(2, a)),
        }
        table(lat, "p50 ms")
    if "3" in a.phases:
        print(f"\n## 3. shard 1 SIGKILLed under load, restarted after {a.down_s:g} s\n")
        print("| | |\n|---|---|")
        found, timeline = asyncio.run(restart(a))
        for k, v in found.items():
            shown = f"{v:,.0f}" if isinstance(v, float) and abs(v) >= 100 else v
            shown = f"{v:.3g}" if isinstance(v, float) and abs(v) < 100 else shown
            print(f"| {k} | {shown} |")
        if a.timeline:
            print("\n| second | shard 0 pairs | shard 1 pairs |\n|---|---|---|")
            for t, n0, n1 in timeline:
                print(f"| {t} | {n0} | {n1} |")


if __name__ == "__main__":
    main()
