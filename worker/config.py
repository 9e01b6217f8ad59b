"""The worker's one config object: flags, with KVWORKER_* environment defaults."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve_launch.tls import check_server
from kvserve_model.default_model import DEFAULT_MODEL_NAME

ENV_PREFIX = "KVWORKER_"
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    cache_service: str = "127.0.0.1:50051"
    # The cache service's service token (sent as a bearer token); empty: its auth is off.
    cache_token: str = ""
    host: str = "127.0.0.1"
    port: int = 50061
    # Address the gateway should dial; empty: host:port as bound.
    advertise_address: str = ""
    # Pool id at the cache service; empty: "<hostname>-<port>".
    worker_id: str = ""
    model: str = DEFAULT_MODEL_NAME
    block_size: int = 32
    # Pool size, the first one set of: a block count, a memory budget, a fraction of the device
    # memory free after the weights load. 0 everywhere: the device's default
    # (worker.device_defaults: 256 MiB on CPU, half the free memory on a GPU).
    num_blocks: int = 0
    kv_memory_mb: int = 0
    kv_memory_fraction: float = 0.0
    # Continuous batching: sequences per step, and tokens per step (decodes + prefill chunks).
    # 0: the device's default (CPU 16 and 256, GPU 32 and 2048).
    max_batch_size: int = 0
    max_step_tokens: int = 0
    # Most requests held at once, running + waiting; beyond it Generate is RESOURCE_EXHAUSTED
    # and the gateway tries another worker. None: PENDING_PER_BATCH_SLOT x max_batch_size
    # (worker.device_defaults); 0: no limit.
    max_pending_requests: int | None = None
    # Token slots leased beyond the prompt at admission, and how far ahead of need a running
    # sequence asks for its next block.
    reserve_tokens: int = 32
    extend_ahead_tokens: int = 8
    # Off: every request computes its whole prompt (benchmarks, debugging).
    prefix_caching: bool = True
    # Run the engine's shapes once before registering, so no request pays for first-use
    # kernel compilation and allocation (worker.warmup).
    warmup: bool = True
    # Check the paged path against mlx-lm's dense path on a small batch at startup and refuse a
    # model whose logits differ (worker.model.self_check).
    self_check: bool = True
    # TLS (kvserve_launch.tls). The gRPC port: PEM certificate and key, both or neither; the
    # same pair is the worker's client certificate when it dials the cache service over TLS.
    tls_cert: str = ""
    tls_key: str = ""
    # The cache service: a CA bundle to verify it with (set: TLS), and the name its
    # certificate must carry when not the host dialed.
    tls_ca: str = ""
    tls_server_name: str = ""
    # A CA bundle: set, callers of the gRPC port must present a certificate it signed.
    tls_client_ca: str = ""
    log_level: str = "INFO"

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> WorkerConfig:
        d = cls()

        def env(name: str, default: object) -> str:
            return os.environ.get(ENV_PREFIX + name, str(default))

        def env_on(name: str, default: bool) -> bool:
            value = os.environ.get(ENV_PREFIX + name)
            return default if value is None else value.lower() not in _OFF

        p = argparse.ArgumentParser(
            prog="python -m worker",
            description="An MLX compute worker (gRPC). Every flag also reads KVWORKER_<FLAG>.",
        )
        p.add_argument("--cache-service", default=env("CACHE_SERVICE", d.cache_service))
        p.add_argument("--cache-token", default=env("CACHE_TOKEN", d.cache_token))
        p.add_argument("--host", default=env("HOST", d.host))
        p.add_argument("--port", type=int, default=int(env("PORT", d.port)))
        p.add_argument("--advertise-address", default=env("ADVERTISE_ADDRESS", ""))
        p.add_argument("--worker-id", default=env("WORKER_ID", ""))
        p.add_argument("--model", default=env("MODEL", d.model))
        p.add_argument("--block-size", type=int, default=int(env("BLOCK_SIZE", d.block_size)))
        p.add_argument("--num-blocks", type=int, default=int(env("NUM_BLOCKS", d.num_blocks)))
        p.add_argument("--kv-memory-mb", type=int, default=int(env("KV_MEMORY_MB", d.kv_memory_mb)))
        p.add_argument(
            "--kv-memory-fraction",
            type=float,
            default=float(env("KV_MEMORY_FRACTION", d.kv_memory_fraction)),
        )
        p.add_argument(
            "--max-batch-size", type=int, default=int(env("MAX_BATCH_SIZE", d.max_batch_size))
        )
        p.add_argument(
            "--max-step-tokens", type=int, default=int(env("MAX_STEP_TOKENS", d.max_step_tokens))
        )
        pending = os.environ.get(ENV_PREFIX + "MAX_PENDING_REQUESTS", "")
        p.add_argument(
            "--max-pending-requests", type=int, default=int(pending) if pending else None
        )
        p.add_argument(
            "--reserve-tokens", type=int, default=int(env("RESERVE_TOKENS", d.reserve_tokens))
        )
        p.add_argument(
            "--extend-ahead-tokens",
            type=int,
            default=int(env("EXTEND_AHEAD_TOKENS", d.extend_ahead_tokens)),
        )
        p.add_argument(
            "--no-prefix-caching",
            action="store_true",
            default=env("PREFIX_CACHING", "1").lower() in _OFF,
        )
        p.add_argument(
            "--warmup", action=argparse.BooleanOptionalAction, default=env_on("WARMUP", d.warmup)
        )
        p.add_argument(
            "--self-check",
            action=argparse.BooleanOptionalAction,
            default=env_on("SELF_CHECK", d.self_check),
        )
        p.add_argument("--tls-cert", default=env("TLS_CERT", d.tls_cert))
        p.add_argument("--tls-key", default=env("TLS_KEY", d.tls_key))
        p.add_argument("--tls-ca", default=env("TLS_CA", d.tls_ca))
        p.add_argument("--tls-server-name", default=env("TLS_SERVER_NAME", d.tls_server_name))
        p.add_argument("--tls-client-ca", default=env("TLS_CLIENT_CA", d.tls_client_ca))
        p.add_argument("--log-level", default=env("LOG_LEVEL", d.log_level))
        a = p.parse_args(argv)
        if problem := check_server(a.tls_cert, a.tls_key, a.tls_client_ca):
            p.error(problem)
        if a.block_size < 1:
            p.error("--block-size must be positive")
        for name in ("num_blocks", "kv_memory_mb", "max_batch_size", "max_step_tokens"):
            if getattr(a, name) < 0:
                p.error(f"--{name.replace('_', '-')} must be >= 0 (0: the device's default)")
        if a.max_pending_requests is not None and a.max_pending_requests < 0:
            p.error("--max-pending-requests must be >= 0 (0: no limit)")
        if not 0.0 <= a.kv_memory_fraction <= 1.0:
            p.error("--kv-memory-fraction must be in [0, 1] (0: the device's default)")
        return cls(
            cache_service=a.cache_service,
            cache_token=a.cache_token,
            host=a.host,
            port=a.port,
            advertise_address=a.advertise_address,
            worker_id=a.worker_id,
            model=a.model,
            block_size=a.block_size,
            num_blocks=a.num_blocks,
            kv_memory_mb=a.kv_memory_mb,
            kv_memory_fraction=a.kv_memory_fraction,
            max_batch_size=a.max_batch_size,
            max_step_tokens=a.max_step_tokens,
            max_pending_requests=a.max_pending_requests,
            reserve_tokens=a.reserve_tokens,
            extend_ahead_tokens=a.extend_ahead_tokens,
            prefix_caching=not a.no_prefix_caching,
            warmup=a.warmup,
            self_check=a.self_check,
            tls_cert=a.tls_cert,
            tls_key=a.tls_key,
            tls_ca=a.tls_ca,
            tls_server_name=a.tls_server_name,
            tls_client_ca=a.tls_client_ca,
            log_level=a.log_level,
        )

    def pool_id(self, bound_port: int) -> str:
        return self.worker_id or f"{socket.gethostname()}-{bound_port}"

    def address(self, bound_port: int) -> str:
        return self.advertise_address or f"{self.host}:{bound_port}"
