"""Which Python gRPC server model costs the cache service least per call (issue 12).

The cache service's per-call cost that is not its domain is the gRPC server's: this measures
it apart from the domain, with a handler that answers at once, for the server models Python
offers, one after the other in one run, each in its own process:

  - `aio`: grpc.aio on the default asyncio loop (what the service runs);
  - `aio+interceptor`: the same with the service's MalformedRequests interceptor;
  - `uvloop`: grpc.aio on uvloop (only if `uvloop` is installed: it is not a dependency);
  - `sync-1`, `sync-4`: the synchronous server on a thread pool of 1 or 4 threads.

The request is what a worker's acquire sends (a pool ref and a 2,048-token prompt, packed:
8 KiB); the answer a lease (a 72-block table). For each model: calls/s and latency p50 with
1 and 8 calls in flight from a grpc.aio client in another process, and the server's CPU per
call (its /proc CPU time over the timed calls: what one server core sustains).

    .venv/bin/python bench/bench_grpc_models.py            # about a minute
    .venv/bin/python bench/bench_grpc_models.py --calls 8000 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb  # noqa: E402
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc  # noqa: E402

LEASE = pb.AcquireLeaseResponse(
    lease=pb.Lease(lease_id=1, block_table=list(range(72)), cached_tokens=1024)
)
REQUEST = pb.AcquireLeaseRequest(
    pool=pb.PoolRef(pool_id="w0", incarnation=1), prompt_tokens=bytes(4 * 2048)
)


def serve(model: str) -> None:
    """The server side (a child process): prints its port, serves until stdin closes."""

    class Servicer(pb_grpc.KVCacheServiceServicer):
        pass

    if model.startswith("sync"):
        Servicer.AcquireLease = lambda self, request, context: LEASE  # type: ignore[method-assign,assignment]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=int(model.split("-")[1])))
        pb_grpc.add_KVCacheServiceServicer_to_server(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        print(port, flush=True)
        sys.stdin.read()
        return

    async def acquire(self, request, context):  # type: ignore[no-untyped-def]
        return LEASE

    Servicer.AcquireLease = acquire  # type: ignore[method-assign]

    async def main() -> None:
        interceptors = []
        if model == "aio+interceptor":
            from kvserve_launch.malformed import MalformedRequests

            interceptors.append(MalformedRequests())
        server = grpc.aio.server(interceptors=interceptors)
        pb_grpc.add_KVCacheServiceServicer_to_server(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    if model == "uvloop":
        import uvloop

        uvloop.install()
    asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(port: int, pid: int, calls: int, in_flight: int) -> tuple[float, float, float]:
    """calls/s, p50 ms, server CPU us per call."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.KVCacheServiceStub(channel)
        for _ in range(200):  # warm: connection, first-call paths
            await stub.AcquireLease(REQUEST)
        latencies: list[float] = []

        async def client(k: int) -> None:
            for _ in range(k):
                t = time.perf_counter()
                await stub.AcquireLease(REQUEST)
                latencies.append(time.perf_counter() - t)

        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(client(calls // in_flight) for _ in range(in_flight)))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    n = len(latencies)
    return n / wall, statistics.median(latencies) * 1e3, cpu / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=4000, help="timed calls per model and load")
    p.add_argument("--repeat", type=int, default=2, help="rounds (models alternate)")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        serve(a.serve)
        return
    models = ["aio", "aio+interceptor", "sync-1", "sync-4"]
    if importlib.util.find_spec("uvloop") is not None:
        models.insert(2, "uvloop")
    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for _ in range(a.repeat):
        for model in models:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--serve", model],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert proc.stdout is not None and proc.stdin is not None
            port = int(proc.stdout.readline())
            try:
                for in_flight in (1, 8):
                    r = asyncio.run(drive(port, proc.pid, a.calls, in_flight))
                    results.setdefault((model, in_flight), []).append(r)
            finally:
                proc.stdin.close()
                proc.wait()
    print(
        f"# {a.calls} AcquireLease calls (8 KiB request) per model and load; medians of "
        f"{a.repeat} rounds\n"
    )
    print("| server model | in flight | calls/s | p50 ms | server CPU us/call | vs aio |")
    print("|---|---|---|---|---|---|")
    base = {k: statistics.median(r[2] for r in v) for k, v in results.items() if k[0] == "aio"}
    for (model, in_flight), rs in results.items():
        rate, p50, cpu = (statistics.median(r[i] for r in rs) for i in range(3))
        print(
            f"| {model} | {in_flight} | {rate:,.0f} | {p50:.3f} | {cpu:.0f} | "
            f"{cpu / base[('aio', in_flight)]:.2f} |"
        )


if __name__ == "__main__":
    main()
