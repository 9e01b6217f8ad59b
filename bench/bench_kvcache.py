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
    python bench/bench_kvcache.py --watch    # with a KV-event watcher reading everything
    python bench/bench_kvcache.py --kv-events  # publishing vLLM-format events, against not

With ``--kv-events`` the batched compact form runs twice on fresh services, in one run:
without and with ``--kv-events-config`` (ZeroMQ, a pyzmq subscriber reading every frame),
and the table ends with the ratio: what publishing costs the lease path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvcache_service.authority import AuthorityConfig, CacheAuthority  # noqa: E402
from kvcache_service.ids import Namespace, PoolId  # noqa: E402
from kvcache_service.leases import AcquireRequest, Grant, SequenceUpdate  # noqa: E402
from kvcache_service.pool import PoolSpec  # noqa: E402
from kvcache_service.tokens import pack  # noqa: E402
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


def bench_in_process(num_blocks: int, fill: int, n: int, watch: bool = False) -> dict[str, float]:
    auth = CacheAuthority(AuthorityConfig(lease_ttl_s=3600))
    inc = auth.register_pool(PoolSpec("w", num_blocks, BS)).incarnation  # type: ignore[arg-type]
    work = Workload.make()
    read = [0]  # with `watch`: the last batch the in-process watcher read
    if watch:
        auth.watch_events(lambda: None)

    def one() -> tuple[float, float, int]:
        _, prompt = work.next_prompt()
        t0 = time.perf_counter()
        req = AcquireRequest(PoolId("w"), inc, Namespace(""), pack(prompt, "p"), RESERVE)
        grant, _ = auth.acquire(req)
        t1 = time.perf_counter()
        assert isinstance(grant, Grant)
        answer = work.fresh(GENERATED)
        n = len(prompt)
        update = SequenceUpdate(n + len(answer), pack(answer, "a"), n)
        auth.release("w", inc, grant.lease_id, update)  # type: ignore[arg-type]
        if watch:  # the step's batches sealed and read, as a server's watcher would
            for batch in auth.events.after(read[0], 1 << 30):
                read[0] = batch.seq
        t2 = time.perf_counter()
        work.finished(prompt + answer)
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


def summary(acq, rel, wall, n, cached, indexed, evicted, prompts=None) -> dict[str, float]:
    a50, a99 = percentiles(acq)
    r50, r99 = percentiles(rel)
    return {
        "acquire p50 ms": a50,
        "acquire p99 ms": a99,
        "release p50 ms": r50,
        "release p99 ms": r99,
        "pairs/s": n / wall,
        "hit rate": cached / ((prompts or n) * PROMPT),
        "indexed blocks": indexed,
        "evicted blocks": evicted,
    }


def wire(tokens: list[int]) -> bytes:
    """The compact wire form (kvcache.proto): little-endian uint32."""
    return np.asarray(tokens, dtype="<u4").tobytes()


class Form:
    """How a client speaks to the service: the revision-1 readable form (one lease a call,
    whole sequences as ``repeated int32``), the compact form (packed prompts, a release that
    sends only the generated tokens), or the compact form batched (``batch`` leases a call,
    AcquireLeases + ReleaseLeases)."""

    def __init__(self, name: str, batch: int = 1) -> None:
        self.name, self.batch = name, batch

    async def acquire(self, kv, ref, prompts: list[list[int]]) -> list:  # type: ignore[no-untyped-def]
        if self.name == "readable":
            req = pb.AcquireLeaseRequest(
                pool=ref, prompt_token_ids=prompts[0], reserve_tokens=RESERVE
            )
            return [(await kv.AcquireLease(req)).lease]
        if self.batch == 1:
            req = pb.AcquireLeaseRequest(
                pool=ref, prompt_tokens=wire(prompts[0]), reserve_tokens=RESERVE
            )
            return [(await kv.AcquireLease(req)).lease]
        items = [pb.AcquireItem(prompt_tokens=wire(p), reserve_tokens=RESERVE) for p in prompts]
        resp = await kv.AcquireLeases(pb.AcquireLeasesRequest(pool=ref, items=items))
        assert all(r.HasField("lease") for r in resp.results), resp.results
        return [r.lease for r in resp.results]

    async def release(self, kv, ref, leases, prompts, answers) -> None:  # type: ignore[no-untyped-def]
        if self.name == "readable":
            final = prompts[0] + answers[0]
            req = pb.ReleaseLeaseRequest(pool=ref, lease_id=leases[0].lease_id, token_ids=final)
            await kv.ReleaseLease(req)
            return
        updates = [
            pb.SequenceUpdate(
                written_tokens=len(p) + len(a), appended_from=len(p), appended_tokens=wire(a)
            )
            for p, a in zip(prompts, answers, strict=True)
        ]
        if self.batch == 1:
            req = pb.ReleaseLeaseRequest(pool=ref, lease_id=leases[0].lease_id, update=updates[0])
            await kv.ReleaseLease(req)
            return
        items = [
            pb.ReleaseItem(lease_id=lease.lease_id, update=u)
            for lease, u in zip(leases, updates, strict=True)
        ]
        resp = await kv.ReleaseLeases(pb.ReleaseLeasesRequest(pool=ref, items=items))
        assert not any(r.HasField("error") for r in resp.results), resp.results


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def watch_events(address: str, seen: list[int]) -> None:
    """Reads every KV event the service sends (WatchEvents with the admin token)."""
    async with grpc.aio.insecure_channel(address) as channel:
        kv = pb_grpc.KVCacheServiceStub(channel)
        call = kv.WatchEvents(pb.WatchEventsRequest(), metadata=[("authorization", "Bearer bench")])
        async for m in call:
            seen[0] += 1
            seen[1] += len(m.batch.events)


async def bench_grpc(
    address: str,
    pid: int,
    form: Form,
    num_blocks: int,
    fill: int,
    n: int,
    concurrency: int,
    watch: bool = False,
) -> dict[str, float]:
    """One pool on a fresh service: fill the index, then ``n`` sequential pairs (latency of
    each call, no queueing) and ``n`` more with ``concurrency`` calls in flight (pairs/s,
    and the service's CPU per pair: what one server core sustains)."""
    async with grpc.aio.insecure_channel(address) as channel:
        kv = pb_grpc.KVCacheServiceStub(channel)
        admin = pb_grpc.KVCacheAdminStub(channel)
        auth = [("authorization", "Bearer bench")]
        pool_id = f"w-{form.name}-{form.batch}"
        reg = await kv.RegisterPool(
            pb.RegisterPoolRequest(pool_id=pool_id, num_blocks=num_blocks, block_size=BS)
        )
        ref = pb.PoolRef(pool_id=pool_id, incarnation=reg.incarnation)
        work = Workload.make()

        async def one() -> tuple[float, float, int]:
            prompts = [work.next_prompt()[1] for _ in range(form.batch)]
            t0 = time.perf_counter()
            leases = await form.acquire(kv, ref, prompts)
            t1 = time.perf_counter()
            answers = [work.fresh(GENERATED) for _ in prompts]
            await form.release(kv, ref, leases, prompts, answers)
            t2 = time.perf_counter()
            for p, a in zip(prompts, answers, strict=True):
                work.finished(p + a)
            return t1 - t0, t2 - t1, sum(lease.cached_tokens for lease in leases)

        async def indexed() -> int:
            stats = await admin.GetStats(pb.StatsRequest(pool_id=pool_id), metadata=auth)
            return stats.pools[0].indexed_blocks

        seen = [0, 0]  # messages, events
        watcher = asyncio.create_task(watch_events(address, seen)) if watch else None
        while await indexed() < fill:
            for _ in range(max(1, 200 // form.batch)):
                await one()
        calls = max(1, n // form.batch)
        # Sequential: latency without queueing.
        seq = [await one() for _ in range(calls)]
        # Concurrent: throughput with `concurrency` calls in flight.
        results: list[tuple[float, float, int]] = []

        async def client(k: int) -> None:
            for _ in range(k):
                results.append(await one())

        cpu0, start = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(client(calls // concurrency) for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu0
        stats = (await admin.GetStats(pb.StatsRequest(pool_id=pool_id), metadata=auth)).pools[0]
        check = await admin.CheckIntegrity(pb.CheckIntegrityRequest(), metadata=auth)
        assert check.ok, check.problems
        pairs = len(results) * form.batch
        s = summary(
            [x[0] for x in seq],
            [x[1] for x in seq],
            wall,
            pairs,
            sum(x[2] for x in seq),
            stats.indexed_blocks,
            stats.evicted_blocks,
            len(seq) * form.batch,
        )
        s["server CPU us/pair"] = cpu / pairs * 1e6
        s["pairs/s per server core"] = pairs / cpu if cpu else float("nan")
        if watcher is not None:
            watcher.cancel()
            assert seen[1] > 0, "the watcher saw no event"
        return s


def start_service(kv_events: str = "") -> tuple[subprocess.Popen, str]:
    extra = ["--kv-events-config", kv_events] if kv_events else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcache_service", "--port", "0", "--admin-token", "bench", *extra],
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
    p.add_argument("--concurrency", type=int, default=8, help="calls in flight for pairs/s")
    p.add_argument("--batch", type=int, default=8, help="leases per batched call")
    p.add_argument("--watch", action="store_true", help="a KV-event watcher reads everything")
    p.add_argument("--in-process-only", action="store_true", help="skip the loopback runs")
    p.add_argument(
        "--kv-events", action="store_true", help="the batched form without and with publishing"
    )
    p.add_argument("--rounds", type=int, default=3, help="--kv-events: off/on pairs (medians)")
    a = p.parse_args()
    if a.quick:
        a.fill, a.n = 10_000, 400
    num_blocks = a.fill + a.fill // 10
    print(f"# {a.n} acquire+release pairs, 2048-token prompts, {a.fill} blocks indexed\n")
    if a.kv_events:
        kv_events_cost(num_blocks, a)
        return
    rows = {"in-process (domain)": bench_in_process(num_blocks, a.fill, a.n, a.watch)}
    if a.in_process_only:
        r = rows["in-process (domain)"]
        print(" ".join(f"{k}={v:.3f}" for k, v in r.items()))
        return
    forms = [
        ("readable, 1 lease a call (revision 1)", Form("readable"), a.concurrency),
        ("compact, 1 lease a call", Form("compact"), a.concurrency),
        (
            f"compact, {a.batch} leases a call",
            Form("compact", a.batch),
            max(1, a.concurrency // a.batch),
        ),
    ]
    for name, form, concurrency in forms:
        proc, address = start_service()  # a fresh one each: its CPU is this form's alone
        try:
            row = asyncio.run(
                bench_grpc(address, proc.pid, form, num_blocks, a.fill, a.n, concurrency, a.watch)
            )
            rows[f"loopback: {name}, {concurrency} in flight"] = row
        finally:
            proc.terminate()
            proc.wait()
    cols = list(rows[next(r for r in rows if r.startswith("loopback"))])
    print("| path | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, r in rows.items():
        cells = [
            "" if c not in r else f"{r[c]:.3f}" if "ms" in c or c == "hit rate" else f"{r[c]:,.0f}"
            for c in cols
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    loop = [r for name, r in rows.items() if name.startswith("loopback")]
    base = loop[0]
    print("\nagainst the readable form (revision 1), same run:")
    for name, r in list(rows.items())[2:]:
        print(
            f"  {name}: acquire p50 {r['acquire p50 ms'] / base['acquire p50 ms']:.2f}x, "
            f"release p50 {r['release p50 ms'] / base['release p50 ms']:.2f}x, "
            f"server CPU per pair {r['server CPU us/pair'] / base['server CPU us/pair']:.2f}x, "
            f"pairs/s {r['pairs/s'] / base['pairs/s']:.2f}x"
        )
    print("(acquire and release latencies are per call: a batched call carries its batch)")


def kv_events_cost(num_blocks: int, a: argparse.Namespace) -> None:
    """The batched compact form on a fresh service without, then with, vLLM-format KV events
    published (and read by a subscriber), alternating ``--rounds`` times; the ratios of the
    medians."""
    import zmq

    port = free_port()
    config = json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    )
    form, concurrency = Form("compact", a.batch), max(1, a.concurrency // a.batch)
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(a.rounds):
        for side in ("off", "on"):
            proc, address = start_service(config if side == "on" else "")
            sub = zmq.Context.instance().socket(zmq.SUB)
            frames = [0]
            stop = threading.Event()
            if side == "on":
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(f"tcp://127.0.0.1:{port}")

                threading.Thread(target=_drain, args=(sub, stop, frames), daemon=True).start()
            try:
                row = asyncio.run(
                    bench_grpc(address, proc.pid, form, num_blocks, a.fill, a.n, concurrency)
                )
                runs[side].append(row)
            finally:
                stop.set()
                proc.terminate()
                proc.wait()
                sub.close(linger=0)
            if side == "on":
                assert frames[0] > 0, "the subscriber saw no event"
                print(f"  (published: {frames[0]:,} frames read by the subscriber)")
    cols = ["acquire p50 ms", "release p50 ms", "pairs/s", "server CPU us/pair"]
    print(f"| kv events ({form.name}, {form.batch} leases a call) | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    med = {
        side: {c: statistics.median(r[c] for r in rows) for c in cols}
        for side, rows in runs.items()
    }
    for side in ("off", "on"):
        print(f"| {side} | " + " | ".join(f"{med[side][c]:,.3f}" for c in cols) + " |")
    print(
        "\npublishing / not, same run: "
        + ", ".join(f"{c} {med['on'][c] / med['off'][c]:.2f}x" for c in cols)
    )


def _drain(sub: Any, stop: threading.Event, frames: list[int]) -> None:
    """Reads every frame the subscriber gets until ``stop``."""
    while not stop.is_set():
        if sub.poll(50):
            sub.recv_multipart()
            frames[0] += 1


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
