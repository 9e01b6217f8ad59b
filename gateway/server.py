"""Runs the gateway: the HTTP app on uvicorn and the gRPC server, side by side on one loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.config import ENV_PREFIX, GatewayConfig
from gateway.core import Gateway
from gateway.grpc_servicer import GatewayWorkerServicer
from gateway.http_app import create_app
from gateway.tokenizer import Tokenizer
from kvserve_launch.malformed import MalformedRequests
from kvserve_launch.startup import EXCLUSIVE_PORT, add_port, listen_error
from kvserve_launch.tls import server_credentials
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name
SHUTDOWN_GRACE_S = 5.0


@dataclass
class RunningGateway:
    gateway: Gateway
    http_address: str
    grpc_address: str


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the process's main decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on connections whose
    # socket says so, and accepted ones inherit the listener's. With Nagle on, each SSE event
    # after the first waited for the client's delayed ACK of the last (up to ~40 ms), and
    # events went out in bunches (bench/bench_gateway_overhead.py; docs/serving-benchmark.md).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise listen_error(host, port, e, ENV_PREFIX, "http_port") from e
    sock.setblocking(False)
    return sock


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@contextlib.asynccontextmanager
async def running(
    config: GatewayConfig, tokenizer: Tokenizer | None = None
) -> AsyncIterator[RunningGateway]:
    """Starts both servers (port 0 picks a free one) and stops them on exit. Raises
    StartupError (``kvserve_launch.startup``) when a port cannot be bound, which it tries
    before it starts anything else."""
    grpc_server = grpc.aio.server(
        interceptors=[MalformedRequests()],
        options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            EXCLUSIVE_PORT,
        ],
    )
    tls = server_credentials(config.tls_cert, config.tls_key, ENV_PREFIX, config.tls_client_ca)
    grpc_port = add_port(grpc_server, config.host, config.grpc_port, ENV_PREFIX, "grpc_port", tls)
    sock = _listen(config.host, config.http_port)

    gw = Gateway.build(config, tokenizer)
    await gw.poller.poll_once()  # know the workers before the first request
    gw.start()
    health_servicer = _add_grpc_services(grpc_server, gw)
    http = _http_server(config, gw)
    http_task: asyncio.Task[None] | None = None
    try:
        await grpc_server.start()
        for name in ("", WORKER_SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        http_task = await _serve_http(http, sock)
        yield RunningGateway(
            gw,
            _address(config.host, sock.getsockname()[1]),
            _address(config.host, grpc_port),
        )
    finally:
        await health_servicer.enter_graceful_shutdown()
        if http_task is not None:
            http.should_exit = True
            await asyncio.gather(http_task, return_exceptions=True)
        sock.close()
        await grpc_server.stop(grace=SHUTDOWN_GRACE_S)
        await gw.close()


def _add_grpc_services(server: grpc.aio.Server, gw: Gateway) -> health.aio.HealthServicer:
    """Worker (the gateway's Generate), health and reflection on ``server``; the health
    servicer, set SERVING once the server starts."""
    pb_grpc.add_WorkerServicer_to_server(GatewayWorkerServicer(gw), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (WORKER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return health_servicer


def _http_server(config: GatewayConfig, gw: Gateway) -> _Uvicorn:
    return _Uvicorn(
        uvicorn.Config(
            create_app(gw),
            log_config=None,
            access_log=False,
            lifespan="off",
            # The peer is the TCP peer: uvicorn would take it from X-Forwarded-For when the
            # connection comes from 127.0.0.1, and any local client could then pick a fresh
            # identity per request past --max-concurrent-per-client (gateway.concurrency).
            proxy_headers=False,
            timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
            # HTTPS with the gRPC port's pair and client CA (read by server_credentials
            # before, so a bad file failed startup there).
            ssl_certfile=config.tls_cert or None,
            ssl_keyfile=config.tls_key or None,
            ssl_ca_certs=config.tls_client_ca or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if config.tls_client_ca else ssl.CERT_NONE,
        )
    )


async def _serve_http(http: _Uvicorn, sock: socket.socket) -> asyncio.Task[None]:
    """``http`` serving on ``sock`` in a task, once it has started (what stopped it, if it
    stopped first, is raised; if this is cancelled, the server is stopped)."""
    task = asyncio.create_task(http.serve(sockets=[sock]))
    try:
        while not http.started:
            if task.done():
                task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)
    except BaseException:
        http.should_exit = True
        await asyncio.gather(task, return_exceptions=True)
        raise
    return task
