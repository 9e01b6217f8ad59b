"""Container health checks: ``python -m kvserve_launch.healthcheck grpc HOST:PORT`` (the
standard gRPC health service, which the cache service and the workers serve) or ``http URL``
(the gateway's /health). Exit 0 when healthy, 1 otherwise; no curl or grpc_health_probe
binary is needed in the image. A TLS port: --tls-ca (an https:// URL for http); one that
requires client certificates: --tls-cert and --tls-key too (``kvserve_launch.tls``)."""

from __future__ import annotations

import argparse
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

from kvserve_launch.startup import StartupError
from kvserve_launch.tls import Dialer, client_ssl_context


def check_grpc(address: str, timeout_s: float, dialer: Dialer | None = None) -> str | None:
    """None when ``address`` reports SERVING, else what is wrong. ``dialer``: TLS; None:
    plaintext."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with (dialer or Dialer()).blocking(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError as e:
            return f"{address}: {e.code().name}"
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
    return None


def check_http(url: str, timeout_s: float, context: ssl.SSLContext | None = None) -> str | None:
    """None on a 2xx answer, else what is wrong. ``context``: for an https:// URL."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
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
    p.add_argument("--tls-ca", default="", help="PEM CA bundle: the port serves TLS, verify it")
    p.add_argument("--tls-server-name", default="", help="grpc: the name its certificate carries")
    p.add_argument("--tls-cert", default="", help="PEM client certificate, where one is required")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    a = p.parse_args(argv)
    if bool(a.tls_cert) != bool(a.tls_key) or (a.tls_cert and not a.tls_ca):
        p.error("--tls-cert and --tls-key go together, and with --tls-ca")
    try:
        if a.kind == "grpc":
            dialer = Dialer.from_files(a.tls_ca, a.tls_server_name, a.tls_cert, a.tls_key)
            problem = check_grpc(a.target, a.timeout_s, dialer)
        else:
            context = client_ssl_context(a.tls_ca, a.tls_cert, a.tls_key) if a.tls_ca else None
            problem = check_http(a.target, a.timeout_s, context)
    except StartupError as e:
        problem = e.message
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
