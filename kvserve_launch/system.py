"""The whole system as child processes: cache service, N workers, gateway.

Start: the cache service first (its address is what the others are given; it is up in about a
second), then the workers and the gateway all at once. A worker takes seconds to load its model;
the gateway meanwhile serves, answering 503 with Retry-After (and /health "starting") until the
first worker registers, which it then learns of within a quarter second (``gateway.poller``).
The system is ready, and the launcher says so, once every worker is and the gateway's /health
says ok. Stop order is the reverse, so no process outlives what it talks to and in-flight
requests drain through the gateway first.

With ``--cache-shards N`` the cache service is N processes that share nothing: worker i
registers with shard i mod N, and the gateway is given every shard (docs/sharding.md).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvserve_launch.config import ENV_PREFIX, LaunchConfig
from kvserve_launch.process import Child, Sink, print_sink
from kvserve_launch.startup import setting
from kvserve_model.blas import fast_blas_env
from kvserve_model.default_model import DEFAULT_MODEL_NAME
from kvserve_model.resolve import resolve_model
from kvserve_model.tiny_model import TINY_MODEL_NAME


@dataclass
class System:
    config: LaunchConfig
    cache: Child
    workers: list[Child]
    gateway: Child
    cache_address: str
    worker_addresses: list[str]
    http_address: str
    grpc_address: str
    # Cache shards 1..N-1 (--cache-shards N) and their addresses; ``cache`` is shard 0.
    extra_caches: list[Child] = field(default_factory=list)
    extra_cache_addresses: list[str] = field(default_factory=list)

    @property
    def caches(self) -> list[Child]:
        return [self.cache, *self.extra_caches]

    @property
    def cache_addresses(self) -> list[str]:
        return [self.cache_address, *self.extra_cache_addresses]

    def children(self) -> list[Child]:
        return [self.gateway, *self.workers, *self.caches]

    def stop(self, grace_s: float = 10.0) -> None:
        stop_all([self.gateway], grace_s)
        stop_all(self.workers, grace_s)
        stop_all(self.caches, grace_s)


def stop_all(children: list[Child], grace_s: float) -> None:
    """Stop several children at once (SIGTERM to all, then wait for each)."""
    for child in children:
        child.signal(signal.SIGTERM)
    for child in children:
        child.stop(grace_s)


def tls_flags(cfg: LaunchConfig, serves: bool = True, dials: bool = True) -> list[str]:
    """The launcher's TLS settings as a child's flags (paths, not secrets: flags are fine).
    Every child serves with the one pair and presents it when it dials; ``serves``: the child
    has internal ports, which require client certificates under --tls-client-ca; ``dials``:
    it dials the others, verifying them against the CA. No TLS: no flags, so a child's own
    KV*_TLS_* variables still apply."""
    if not cfg.tls:
        return []
    argv = ["--tls-cert", cfg.tls_cert, "--tls-key", cfg.tls_key]
    if dials:
        argv += ["--tls-ca", cfg.tls_ca]
        if cfg.tls_server_name:
            argv += ["--tls-server-name", cfg.tls_server_name]
    if serves and cfg.tls_client_ca:
        argv += ["--tls-client-ca", cfg.tls_client_ca]
    return argv


def cache_command(cfg: LaunchConfig, python: str = sys.executable, shard: int = 0) -> list[str]:
    events = ["--kv-events-config", kv_events_for_shard(cfg.kv_events_config, shard)]
    return [
        python, "-m", "kvcache_service",
        "--host", cfg.internal_host,
        "--port", str(cfg.cache_port + shard if cfg.cache_port else 0),
        "--log-level", cfg.log_level,
        *tls_flags(cfg, dials=False),
        *(events if cfg.kv_events_config else []),
    ]  # fmt: skip


def kv_events_for_shard(text: str, shard: int) -> str:
    """``--kv-events-config`` for cache-service shard ``shard``: its tcp endpoints' ports moved
    up by ``shard`` and its ``data_parallel_rank`` set to it, as vLLM does per data-parallel
    rank (each shard publishes its own pools). The cache service checks the rest."""
    if shard == 0 or not text.strip():
        return text
    raw = json.loads(text)
    for key in ("endpoint", "replay_endpoint"):
        value = raw.get(key, "tcp://*:5557" if key == "endpoint" else None)
        if (
            isinstance(value, str)
            and value.startswith("tcp://")
            and value.rsplit(":", 1)[-1].isdigit()
        ):
            base, port = value.rsplit(":", 1)
            raw[key] = f"{base}:{int(port) + shard}"
    raw["data_parallel_rank"] = int(raw.get("data_parallel_rank", 0)) + shard
    return json.dumps(raw)


def worker_command(
    cfg: LaunchConfig, index: int, cache_address: str, python: str = sys.executable
) -> list[str]:
    port = cfg.worker_base_port + index if cfg.worker_base_port else 0
    argv = [
        python, "-m", "worker",
        "--cache-service", cache_address,
        "--host", cfg.internal_host,
        "--port", str(port),
        "--worker-id", f"worker-{index}",
        "--model", cfg.model,
        "--log-level", cfg.log_level,
    ]  # fmt: skip
    if cfg.num_blocks:
        argv += ["--num-blocks", str(cfg.num_blocks)]
    if cfg.block_size:
        argv += ["--block-size", str(cfg.block_size)]
    if cfg.offload_dir:
        # One directory per worker: a tier's files are its worker's alone.
        argv += ["--offload-dir", os.path.join(cfg.offload_dir, f"worker-{index}")]
        if cfg.offload_gb:
            argv += ["--offload-gb", f"{cfg.offload_gb:g}"]
    if cfg.host_offload_gb:
        argv += ["--host-offload-gb", f"{cfg.host_offload_gb:g}"]
    if cfg.tensor_parallel > 1:
        argv += ["--tensor-parallel", str(cfg.tensor_parallel)]
    return argv + tls_flags(cfg)


def gateway_command(
    cfg: LaunchConfig, cache_address: str, python: str = sys.executable
) -> list[str]:
    """``cache_address``: the cache service's, or its shards' separated by commas."""
    return [
        python, "-m", "gateway",
        "--cache-service", cache_address,
        "--host", cfg.host,
        "--http-port", str(cfg.http_port),
        "--grpc-port", str(cfg.grpc_port),
        "--model", cfg.model,
        "--log-level", cfg.log_level,
        # Its ports are the public edge: they serve TLS, but require client certificates only
        # where KVGATEWAY_TLS_CLIENT_CA says so (inherited from the launcher's environment).
        *tls_flags(cfg, serves=False),
    ]  # fmt: skip


def secret_env(cfg: LaunchConfig) -> dict[str, str]:
    """The admin and service tokens travel in the environment, not on command lines that `ps`
    shows to every user of the machine."""
    return {
        **os.environ,
        "KVCACHE_ADMIN_TOKEN": cfg.admin_token,
        "KVGATEWAY_ADMIN_TOKEN": cfg.admin_token,
        "KVCACHE_SERVICE_TOKEN": cfg.service_token,
        "KVGATEWAY_CACHE_TOKEN": cfg.service_token,
    }


def worker_env(cfg: LaunchConfig) -> dict[str, str]:
    """The environment workers start in: with the fast BLAS preloaded where one exists (the
    worker would re-execute itself to get it; starting with it saves that restart), and the
    cache service's service token."""
    return {**fast_blas_env(), "KVWORKER_CACHE_TOKEN": cfg.service_token}


def prepare_model(model: str, say: Callable[[str], None]) -> None:
    """Make or convert a local model once (the default, the tiny model, a GGUF file), before N
    workers and the gateway would race to; a directory or a hub id is theirs to find."""
    if model in (DEFAULT_MODEL_NAME, TINY_MODEL_NAME) or Path(model).expanduser().is_file():
        resolve_model(model, log=say)


def launch(cfg: LaunchConfig, sink: Sink = print_sink, python: str = sys.executable) -> System:
    """Start everything and wait until each process is ready; on failure stop what started."""
    cfg = cfg.with_admin_token().with_service_token()
    prepare_model(cfg.model, lambda line: sink("launch", line + "\n"))
    started: list[Child] = []
    timeout = cfg.startup_timeout_s
    try:
        caches = _start_caches(cfg, python, sink)
        started.extend(caches)
        cache_addresses = [c.wait_ready(timeout) for c in caches]
        workers = _start_workers(cfg, cache_addresses, python, sink)
        started.extend(workers)
        gateway = _start_gateway(cfg, cache_addresses, python, sink)
        started.append(gateway)
        fields = dict(part.split("=", 1) for part in gateway.wait_ready(timeout).split())
        worker_addresses = [w.wait_ready(timeout) for w in workers]
        wait_for_health(cfg, fields["http"], gateway, len(workers))
        _pin_ports(caches + workers, cache_addresses + worker_addresses, gateway, fields)
    except BaseException:
        stop_all(list(reversed(started)), 5.0)
        raise
    return System(
        cfg,
        caches[0],
        workers,
        gateway,
        cache_addresses[0],
        worker_addresses,
        fields["http"],
        fields["grpc"],
        caches[1:],
        cache_addresses[1:],
    )


def _start_caches(cfg: LaunchConfig, python: str, sink: Sink) -> list[Child]:
    """The cache service, or its shards, started (not yet ready)."""
    n = cfg.cache_shards
    return [
        Child(
            "cache" if n == 1 else f"cache-{i}",
            cache_command(cfg, python, shard=i),
            ready_prefix="KVCACHE_READY",
            env=secret_env(cfg),
            sink=sink,
            port_setting=setting(ENV_PREFIX, "cache_port"),
        ).start()
        for i in range(n)
    ]


def _start_workers(
    cfg: LaunchConfig, cache_addresses: list[str], python: str, sink: Sink
) -> list[Child]:
    """The workers started (not yet ready), worker i registering with shard i mod N."""
    env = worker_env(cfg)
    n = len(cache_addresses)
    return [
        Child(
            f"worker-{i}",
            worker_command(cfg, i, cache_addresses[i % n], python),
            ready_prefix="WORKER_READY",
            env=env,
            sink=sink,
            port_setting=setting(ENV_PREFIX, "worker_base_port"),
        ).start()
        for i in range(cfg.workers)
    ]


def _start_gateway(cfg: LaunchConfig, cache_addresses: list[str], python: str, sink: Sink) -> Child:
    return Child(
        "gateway",
        gateway_command(cfg, ",".join(cache_addresses), python),
        ready_prefix="GATEWAY_READY",
        env=secret_env(cfg),
        sink=sink,
        port_setting=f"{setting(ENV_PREFIX, 'http_port')} / {setting(ENV_PREFIX, 'grpc_port')}",
    ).start()


def _pin_ports(
    children: list[Child], addresses: list[str], gateway: Child, gateway_fields: dict[str, str]
) -> None:
    """A restart binds the ports the child has now: the others know it by them."""
    for child, address in zip(children, addresses, strict=True):
        child.restart_argv = pinned(child.argv, {"--port": port_of(address)})
    gateway.restart_argv = pinned(
        gateway.argv,
        {
            "--http-port": port_of(gateway_fields["http"]),
            "--grpc-port": port_of(gateway_fields["grpc"]),
        },
    )


def wait_for_health(
    cfg: LaunchConfig, http: str, gateway: Child, workers: int, limit_s: float = 10.0
) -> None:
    """Until the gateway's /health lists ``workers`` healthy workers (it learns of each a
    quarter second after it registers, while it knows none: ``gateway.poller``), at most
    ``limit_s``: past that the system is up and /health says what is missing, which is no
    reason to refuse the start."""
    from kvserve_launch.tls import client_ssl_context

    host = http.replace("0.0.0.0", "127.0.0.1").replace("[::]", "[::1]")
    url = f"{'https' if cfg.tls else 'http'}://{host}/health"
    context = client_ssl_context(cfg.tls_ca, cfg.tls_cert, cfg.tls_key) if cfg.tls else None
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and gateway.running:
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                body = json.load(resp)
            if sum(bool(w.get("healthy")) for w in body.get("workers", [])) >= workers:
                return
        except (OSError, ValueError):  # 503 (HTTPError is an OSError) or not up yet
            pass
        time.sleep(0.05)


def port_of(address: str) -> str:
    """The port of ``host:port`` (``[v6]:port`` too)."""
    return address.rsplit(":", 1)[1]


def pinned(argv: list[str], values: dict[str, str]) -> list[str]:
    """``argv`` with the value after each flag of ``values`` replaced."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg in values:
            out[i + 1] = values[arg]
    return out
