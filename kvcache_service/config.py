"""The cache service's one config object: flags, with KVCACHE_* environment defaults."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvcache_service.kv_events_config import KvEventsConfig
from kvserve_launch.common_flags import LOG_LEVEL_HELP, ServerFlags, tls_help
from kvserve_launch.settings import Flag, Settings, new_token
from kvserve_launch.tls import check_server

ENV_PREFIX = "KVCACHE_"


@dataclass(frozen=True, slots=True)
class ServiceConfig(ServerFlags):
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
    # KV events (WatchEvents, docs/kv-events.md): the replay buffer a watcher resumes from, in
    # MiB; how long recording goes on after the last watcher left (one that comes back within
    # it resumes where it was); how many watchers at once.
    events_buffer_mb: int = 64
    events_retain_s: float = 600.0
    events_max_watchers: int = 64
    # KV events in vLLM's format over ZeroMQ, for external routers (kvcache_service/
    # vllm_events.py): vLLM's --kv-events-config JSON; empty: off.
    kv_events_config: str = ""
    # TLS on the port, and log_level: ServerFlags (the service dials nothing).

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> ServiceConfig:
        return SETTINGS.parse(argv, check)

    def with_admin_token(self) -> ServiceConfig:
        """This config, with a random admin token if none was configured."""
        if self.admin_token:
            return self
        return replace(self, admin_token=new_token(24))


def check(c: ServiceConfig) -> str | None:
    """What is wrong across the fields of ``c``; None if nothing."""
    if problem := check_server(c.tls_cert, c.tls_key, c.tls_client_ca):
        return problem
    if c.lease_ttl_s <= 0:
        return "--lease-ttl-s must be positive"
    if c.max_pool_blocks < 1 or c.max_pools < 1:
        return "--max-pool-blocks and --max-pools must be positive"
    if c.events_buffer_mb < 1 or c.events_max_watchers < 1 or c.events_retain_s < 0:
        return "--events-buffer-mb and --events-max-watchers must be positive"
    try:
        KvEventsConfig.parse(c.kv_events_config)
    except ValueError as err:
        return str(err)
    return None


SETTINGS = Settings(
    ServiceConfig,
    ENV_PREFIX,
    prog="python -m kvcache_service",
    description="The KV-cache authority (gRPC). Every flag also reads KVCACHE_<FLAG>.",
    flags={
        "host": "listen address",
        "port": "gRPC port (0: any free port; the ready line says which)",
        "lease_ttl_s": "a pool silent this long is dead: its leases expire",
        "admin_token": Flag("admin bearer token (default: a random one, saved 0600)", secret=True),
        "service_token": Flag(
            "bearer token every data-plane call must carry (default: none, no auth)", secret=True
        ),
        "max_pool_blocks": "most blocks one pool may register",
        "max_pools": "most pools registered at once",
        "max_namespace_chars": "longest namespace (a request's cache_salt)",
        "block_size": Flag("require this block size of every pool (0: pools choose)", none_as=0),
        "namespace_quota_blocks": Flag(
            "most blocks one namespace may hold in a pool (0: no quota)", none_as=0
        ),
        "sweep_interval_s": "how often leases of silent pools are expired without calls",
        "events_buffer_mb": "KV events: the replay buffer watchers resume from (MiB)",
        "events_retain_s": "KV events: keep recording this long after the last watcher left",
        "events_max_watchers": "KV events: most WatchEvents streams at once",
        "kv_events_config": "KV events in vLLM's format over ZeroMQ, as vLLM's JSON "
        '(e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq"}\'); empty: off',
        **tls_help(
            cert="PEM certificate: with --tls-key, the port serves TLS",
            client_ca="PEM CA bundle: every client must present a certificate it signed",
        ),
        "log_level": LOG_LEVEL_HELP,
    },
)
