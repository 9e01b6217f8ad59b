"""The cache service's one config object: flags, with KVCACHE_* environment defaults."""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve_launch.tls import check_server

ENV_PREFIX = "KVCACHE_"


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    lease_ttl_s: float = 30.0
    # Bearer token for the admin service. Empty: one is generated at startup and logged.
    admin_token: str = ""
    # Bearer token every data-plane call (workers, gateways) must carry. Empty: auth off (dev).
    service_token: str = ""
    # Registration bounds (RESOURCE_EXHAUSTED beyond): blocks per pool, and pools.
    max_pool_blocks: int = 1 << 22
    max_pools: int = 64
    # Namespaces (cache salts) longer than this, or unprintable: INVALID_ARGUMENT.
    max_namespace_chars: int = 256
    # None (flag: 0): pools choose their block size; otherwise registration must match it.
    block_size: int | None = None
    # Blocks one namespace may hold in a pool; None (flag: 0): no quota.
    namespace_quota_blocks: int | None = None
    # How often leases of silent pools are expired when no call comes in.
    sweep_interval_s: float = 1.0
    # PEM paths: both set, the port serves TLS (kvserve_launch.tls); neither, plaintext.
    tls_cert: str = ""
    tls_key: str = ""
    # A CA bundle: set, every client must present a certificate it signed (mutual TLS).
    tls_client_ca: str = ""
    log_level: str = "INFO"

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> ServiceConfig:
        d = cls()

        def env(name: str, default: object) -> str:
            return os.environ.get(ENV_PREFIX + name, str(default))

        p = argparse.ArgumentParser(
            prog="python -m kvcache_service",
            description="The KV-cache authority (gRPC). Every flag also reads KVCACHE_<FLAG>.",
        )
        p.add_argument("--host", default=env("HOST", d.host))
        p.add_argument("--port", type=int, default=int(env("PORT", d.port)))
        p.add_argument(
            "--lease-ttl-s", type=float, default=float(env("LEASE_TTL_S", d.lease_ttl_s))
        )
        p.add_argument("--admin-token", default=env("ADMIN_TOKEN", d.admin_token))
        p.add_argument("--service-token", default=env("SERVICE_TOKEN", d.service_token))
        p.add_argument(
            "--max-pool-blocks", type=int, default=int(env("MAX_POOL_BLOCKS", d.max_pool_blocks))
        )
        p.add_argument("--max-pools", type=int, default=int(env("MAX_POOLS", d.max_pools)))
        p.add_argument(
            "--max-namespace-chars",
            type=int,
            default=int(env("MAX_NAMESPACE_CHARS", d.max_namespace_chars)),
        )
        p.add_argument("--block-size", type=int, default=int(env("BLOCK_SIZE", 0)))
        p.add_argument(
            "--namespace-quota-blocks", type=int, default=int(env("NAMESPACE_QUOTA_BLOCKS", 0))
        )
        p.add_argument(
            "--sweep-interval-s",
            type=float,
            default=float(env("SWEEP_INTERVAL_S", d.sweep_interval_s)),
        )
        p.add_argument("--tls-cert", default=env("TLS_CERT", d.tls_cert))
        p.add_argument("--tls-key", default=env("TLS_KEY", d.tls_key))
        p.add_argument("--tls-client-ca", default=env("TLS_CLIENT_CA", d.tls_client_ca))
        p.add_argument("--log-level", default=env("LOG_LEVEL", d.log_level))
        a = p.parse_args(argv)
        if problem := check_server(a.tls_cert, a.tls_key, a.tls_client_ca):
            p.error(problem)
        if a.lease_ttl_s <= 0:
            p.error("--lease-ttl-s must be positive")
        if a.max_pool_blocks < 1 or a.max_pools < 1:
            p.error("--max-pool-blocks and --max-pools must be positive")
        return cls(
            host=a.host,
            port=a.port,
            lease_ttl_s=a.lease_ttl_s,
            admin_token=a.admin_token,
            service_token=a.service_token,
            max_pool_blocks=a.max_pool_blocks,
            max_pools=a.max_pools,
            max_namespace_chars=a.max_namespace_chars,
            block_size=a.block_size or None,
            namespace_quota_blocks=a.namespace_quota_blocks or None,
            sweep_interval_s=a.sweep_interval_s,
            tls_cert=a.tls_cert,
            tls_key=a.tls_key,
            tls_client_ca=a.tls_client_ca,
            log_level=a.log_level,
        )

    def with_admin_token(self) -> ServiceConfig:
        """This config, with a random admin token if none was configured."""
        if self.admin_token:
            return self
        from dataclasses import replace

        return replace(self, admin_token=secrets.token_urlsafe(24))
