"""The launcher's one config object: flags, with KVSERVE_* environment defaults.

Children inherit the launcher's environment, so a service's own variables configure it too:
``KVWORKER_MAX_BATCH_SIZE=32 make run``. The launcher passes only the flags it must (where
each process listens and finds the others), plus those set here explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvserve_launch.common_flags import ServerClientFlags, tls_help
from kvserve_launch.settings import Flag, Settings, new_token
from kvserve_model.default_model import DEFAULT_MODEL_NAME

ENV_PREFIX = "KVSERVE_"


@dataclass(frozen=True, slots=True)
class LaunchConfig(ServerClientFlags):
    workers: int = 1
    model: str = DEFAULT_MODEL_NAME
    # Where the gateway listens (0.0.0.0 to serve other machines or a container's host).
    host: str = "127.0.0.1"
    # Where the cache service and the workers listen: only the gateway and the admin CLI
    # talk to them, so loopback unless the system spans machines.
    internal_host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50050
    cache_port: int = 50051
    # The cache service as this many shards, each its own process (shard i on cache_port + i;
    # worker i registers with shard i mod N; the gateway fans out: docs/sharding.md).
    cache_shards: int = 1
    # Worker i listens on worker_base_port + i; 0: ephemeral ports (the gateway discovers
    # workers through the cache service, so nobody needs to know them in advance).
    worker_base_port: int = 0
    # Empty: a random one, printed at startup.
    admin_token: str = ""
    # The data-plane token the children share; not a flag: always a fresh random one.
    service_token: str = ""
    # Per-worker KV pool; 0: the worker's own default (a memory budget, KVWORKER_*).
    num_blocks: int = 0
    block_size: int = 0
    # The workers' disk tier (docs/kv-tiers.md): worker i keeps its blocks under
    # <offload_dir>/worker-<i>, up to offload_gb GB each (0: half the free space). Empty: none.
    offload_dir: str = ""
    offload_gb: float = 0.0
    # A host-memory tier per worker (GB; GPUs with memory of their own). 0: none.
    host_offload_gb: float = 0.0
    # Each worker a group of this many ranks, the model sharded over them (docs/tensor-parallel.md);
    # 1: one process a worker.
    tensor_parallel: int = 1
    startup_timeout_s: float = 300.0
    # A child that dies is restarted after this, doubling each time up to 30 s
    # (kvserve_launch.supervisor); more than max_restarts deaths of one child within
    # restart_window_s stop everything.
    restart_backoff_s: float = 1.0
    max_restarts: int = 4
    restart_window_s: float = 300.0
    # KV events in vLLM's format from the cache service (vLLM's --kv-events-config JSON,
    # passed on; shard i's tcp ports moved up by i, as vLLM moves them per data-parallel rank).
    kv_events_config: str = ""
    # log_level and TLS (ServerClientFlags) are every child's: one certificate and key that
    # every child serves with and presents when it dials; the CA bundle every child verifies the
    # others with; the name the certificate carries when not the internal host. Paths only, so
    # they travel as flags. tls_client_ca: the cache service and the workers require a client
    # certificate it signed (mutual TLS on every internal channel).

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> LaunchConfig:
        return SETTINGS.parse(argv, check)

    def with_admin_token(self) -> LaunchConfig:
        """This config, with a random admin token if none was configured."""
        return self if self.admin_token else replace(self, admin_token=new_token(18))

    def with_service_token(self) -> LaunchConfig:
        """This config, with a random service token for the children if none was set."""
        if self.service_token:
            return self
        return replace(self, service_token=new_token(18))


def check(c: LaunchConfig) -> str | None:
    """What is wrong across the fields of ``c``; None if nothing."""
    if c.workers < 1:
        return "--workers must be at least 1"
    if c.cache_shards < 1:
        return "--cache-shards must be at least 1"
    if c.tensor_parallel < 1:
        return "--tensor-parallel must be at least 1"
    if c.num_blocks < 0 or c.block_size < 0:
        return "--num-blocks and --block-size must not be negative"
    if c.host_offload_gb < 0 or c.offload_gb < 0 or (c.offload_gb and not c.offload_dir):
        return "--offload-gb and --host-offload-gb must be >= 0; --offload-gb needs --offload-dir"
    if c.restart_backoff_s <= 0 or c.max_restarts < 0 or c.restart_window_s <= 0:
        return "--restart-backoff-s and --restart-window-s must be positive, --max-restarts >= 0"
    return check_tls(c.tls_cert, c.tls_key, c.tls_ca, c.tls_server_name, c.tls_client_ca)


def check_tls(cert: str, key: str, ca: str, server_name: str, client_ca: str) -> str | None:
    """What is wrong with the launcher's TLS settings; None if fine. Every child both serves
    and dials, so the pair and the CA go together: a pair without the CA would leave the
    children unable to verify each other, a CA without the pair dials ports that serve
    plaintext."""
    # Imported here: the grpc that kvserve_launch.tls imports would add 0.1 s to every import
    # of this module (diagnosis and the launcher's tests read it without checking TLS).
    from kvserve_launch.tls import check_server

    if problem := check_server(cert, key, client_ca):
        return problem
    if cert and not ca:
        return "--tls-cert needs --tls-ca: the CA bundle the children verify each other with"
    if (ca or server_name) and not cert:
        return (
            "--tls-ca and --tls-server-name need --tls-cert and --tls-key (what the children serve)"
        )
    return None


SETTINGS = Settings(
    LaunchConfig,
    ENV_PREFIX,
    prog="python -m kvserve_launch",
    description="Start the cache service, N workers and the gateway on one machine; "
    "Ctrl-C stops them all. Every flag also reads KVSERVE_<FLAG> (e.g. KVSERVE_WORKERS=2).",
    # Not service_token: always a fresh random one (with_service_token).
    flags={
        "workers": "number of workers",
        "model": "model name, directory or Hugging Face id",
        "host": "the gateway's listen address (0.0.0.0: every interface)",
        "internal_host": "the cache service's and the workers' listen address",
        "http_port": "the gateway's HTTP port (0: any free port)",
        "grpc_port": "the gateway's gRPC port (0: any free port)",
        "cache_port": "the cache service's port (0: any free port); shard i: this + i",
        "cache_shards": "cache service shards, one process each (workers spread round-robin)",
        "worker_base_port": "worker i listens on this + i (0: any free ports)",
        "admin_token": Flag("admin bearer token (default: a random one, printed)", secret=True),
        "num_blocks": "KV blocks per worker (0: the worker's default)",
        "block_size": "tokens per KV block (0: the worker's default)",
        "offload_dir": "the workers' disk tier: worker i keeps every committed KV block under "
        "DIR/worker-i, so evicted prefixes and those from before a restart load back",
        "offload_gb": "each worker's disk tier size in GB (0: half the free disk space)",
        "host_offload_gb": "each worker's host-memory tier in GB, in front of the disk (GPUs)",
        "tensor_parallel": "each worker a group of this many ranks (processes; one GPU each), "
        "the model sharded over them, one pool",
        "startup_timeout_s": "how long each process may take to get ready",
        "restart_backoff_s": "a child that dies restarts after this, doubling up to 30 s",
        "max_restarts": "restarts of one child within --restart-window-s before giving up",
        "restart_window_s": "the window --max-restarts counts in",
        "kv_events_config": "KV events in vLLM's format from the cache service: vLLM's JSON "
        "(docs/kv-events.md); empty: off",
        "log_level": "DEBUG, INFO, WARNING or ERROR, for every process",
        **tls_help(
            cert="PEM certificate every child serves TLS with and presents when it dials",
            ca="PEM CA bundle the children verify each other's certificates with",
            server_name="the name in --tls-cert, when not --internal-host",
            client_ca="PEM CA bundle: the cache service and workers require client certs",
        ),
    },
)
