"""Container health checks: ``python -m kvserve_launch.healthcheck grpc HOST:PORT`` (the
standard gRPC health service, which the cache service and the workers serve) or ``http URL``
(the gateway's /health). Exit 0 when healthy, 1 otherwise; no curl or grpc_health_probe
binary is needed in the image."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence


def check_grpc(address: str, timeout_s: float) -> str | None:
    """None when ``address`` reports SERVING, else what is wrong."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError as e:
            return f"{address}: {e.code().name}"
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
    return None


def check_http(url: str, timeout_s: float) -> str | None:
    """None on a 2xx answer, else what is wrong."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return None if 200 <= resp.status < 300 else f"{url}: HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"{url}: HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return f"{url}: {e}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve_launch.healthcheck", description=__doc__)
    p.add_argument("kind", choices=["grpc", "http"])
    p.add_argument("target", help="HOST:PORT for grpc, a URL for http")
    p.add_argument("--timeout-s", type=float, default=3.0)
    a = p.parse_args(argv)
    check = check_grpc if a.kind == "grpc" else check_http
    problem = check(a.target, a.timeout_s)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
