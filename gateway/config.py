"""The gateway's one config object: flags, with KVGATEWAY_* environment defaults."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.router import RoutingPolicy
from kvserve_launch.common_flags import LOG_LEVEL_HELP, ServerClientFlags, tls_help
from kvserve_launch.settings import Flag, Settings, comma_separated
from kvserve_launch.tls import check_server
from kvserve_model.default_model import DEFAULT_MODEL_NAME

ENV_PREFIX = "KVGATEWAY_"


@dataclass(frozen=True, slots=True)
class GatewayConfig(ServerClientFlags):
    # The cache service (Route, and admin pass-through): one address, or several separated by
    # commas when it is sharded by pool id (gateway.sharded_cache, docs/sharding.md). A string,
    # as one address always was; `cache_services` reads it.
    cache_service: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50050
    # What the workers serve; the tokenizer and chat template come from it.
    model: str = DEFAULT_MODEL_NAME
    # The name clients put in "model"; empty: the model name itself.
    served_model_name: str = ""
    # Optional: lets the gateway read the cache service's per-pool stats for /metrics.
    # The admin pass-through never uses it: it forwards the caller's own bearer token.
    admin_token: str = ""
    # The cache service's service token, sent on Route; empty: the service's auth is off.
    cache_token: str = ""
    # Optional: require `Authorization: Bearer <key>` on /v1/*.
    api_key: str = ""
    # Worker addresses to use besides those registered with the cache service.
    workers: tuple[str, ...] = ()
    # 0: the model's context length (kvserve_model.context, the workers' rule).
    max_model_len: int = 0
    max_body_bytes: int = 4 * 1024 * 1024
    # Origins whose browser pages may call the HTTP API (CORS), comma-separated; "*": any (as
    # vLLM's --allowed-origins by default); empty: no CORS headers, preflights refused.
    allowed_origins: str = "*"
    # Checked before tokenizing; 0: 32 characters per token of context (limits.py).
    max_prompt_chars: int = 0
    # cache_salt (HTTP) and namespace (gRPC): stored by the cache service, printed by admin.
    max_namespace_chars: int = 256
    # Most choices per request (prompts x n).
    max_choices: int = 16
    # Requests in flight, from accept to the end of the response (a stream: its last event or
    # its client's disconnect), per client (its peer address: gateway.concurrency) and in all;
    # beyond either, 429 / RESOURCE_EXHAUSTED. 0: no limit.
    max_concurrent_per_client: int = 256
    max_concurrent_requests: int = 0
    # How often workers are polled for load and health (and unhealthy ones re-probed).
    poll_interval_s: float = 2.0
    # The cache service unreachable this long: new requests get 503 with Retry-After at once
    # and /health says so (gateway.cache_status); shorter blips only cost routing affinity.
    cache_outage_grace_s: float = 2.0
    # Route from a copy of the pools' indexes fed by the cache service's KV events
    # (gateway.event_index, docs/kv-events.md) instead of a Route call per request.
    route_from_events: bool = False
    min_match_tokens: int = RoutingPolicy().min_match_tokens
    min_match_ratio: float = RoutingPolicy().min_match_ratio
    overload_slack: int = RoutingPolicy().overload_slack
    overload_ratio: float = RoutingPolicy().overload_ratio
    # TLS and log_level: ServerClientFlags. The gateway serves TLS on both ports, gRPC and
    # HTTP, and dials the cache service and the workers.

    @property
    def cache_services(self) -> tuple[str, ...]:
        """The cache service's address, or its shards' addresses."""
        return comma_separated(self.cache_service)

    @property
    def cors_origins(self) -> tuple[str, ...]:
        """--allowed-origins, one origin each ("*": any)."""
        return comma_separated(self.allowed_origins)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def routing(self) -> RoutingPolicy:
        return RoutingPolicy(
            self.min_match_tokens, self.min_match_ratio, self.overload_slack, self.overload_ratio
        )

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> GatewayConfig:
        return SETTINGS.parse(argv, check)


def check(c: GatewayConfig) -> str | None:
    """What is wrong across the fields of ``c``; None if nothing."""
    for name in ("max_body_bytes", "max_choices", "poll_interval_s", "max_namespace_chars"):
        if getattr(c, name) <= 0:
            return f"--{name.replace('_', '-')} must be positive"
    if c.cache_outage_grace_s < 0:
        return "--cache-outage-grace-s must be >= 0"
    if problem := check_server(c.tls_cert, c.tls_key, c.tls_client_ca):
        return problem
    if not c.cache_services:
        return "--cache-service needs an address"
    if len(set(c.cache_services)) != len(c.cache_services):
        return "--cache-service lists a shard twice"
    if c.max_prompt_chars < 0:
        return "--max-prompt-chars must not be negative"
    if min(c.max_concurrent_per_client, c.max_concurrent_requests) < 0:
        return "--max-concurrent-* must not be negative (0: no limit)"
    if min(c.overload_slack, c.overload_ratio, c.min_match_tokens, c.min_match_ratio) < 0:
        return "--overload-* and --min-match-* must not be negative"
    if c.route_from_events and not (c.cache_token or c.admin_token):
        return "--route-from-events needs --cache-token or --admin-token (WatchEvents takes one)"
    return None


SETTINGS = Settings(
    GatewayConfig,
    ENV_PREFIX,
    prog="python -m gateway",
    description="The kvserve gateway: OpenAI-compatible HTTP and gRPC Generate. "
    "Every flag also reads KVGATEWAY_<FLAG> (e.g. KVGATEWAY_HTTP_PORT).",
    flags={
        "cache_service": "the cache service's address (Route, admin pass-through); "
        "comma-separated: its shards' addresses (docs/sharding.md)",
        "host": "address to listen on (0.0.0.0: every interface)",
        "http_port": "OpenAI-compatible HTTP API port (0: any free port)",
        "grpc_port": "gRPC Generate port (0: any free port)",
        "model": "the workers' model: name, directory or Hugging Face id (tokenizer source)",
        "served_model_name": "the name clients put in `model` (default: --model)",
        "admin_token": Flag("cache admin token, only to read pool stats for /metrics", secret=True),
        "cache_token": Flag("the cache service's service token (sent on Route)", secret=True),
        "api_key": Flag("require `Authorization: Bearer <key>` on /v1/*", secret=True),
        "workers": "comma-separated worker addresses besides the registered ones",
        "max_model_len": "context length (0: the model config's)",
        "max_body_bytes": "largest accepted request body",
        "allowed_origins": "origins whose browser pages may call the HTTP API (CORS), "
        "comma-separated; *: any; empty: none",
        "max_prompt_chars": "longest prompt in characters, before tokenizing (0: 32 x context)",
        "max_namespace_chars": "longest cache_salt / namespace",
        "max_choices": "most choices (prompts x n) per request",
        "max_concurrent_per_client": "requests in flight per client address (0: no limit)",
        "max_concurrent_requests": "requests in flight in all (0: no limit)",
        "poll_interval_s": "how often workers are polled for load and health",
        "cache_outage_grace_s": "the cache service unreachable this long: new requests get 503",
        "route_from_events": "route from the cache service's KV events, not a Route per request",
        "min_match_tokens": "shortest cached prefix worth routing for",
        "min_match_ratio": "... and at least this fraction of the prompt",
        "overload_slack": "a worker is overloaded above min load + max(slack, ratio*min)",
        "overload_ratio": "see --overload-slack",
        **tls_help(
            cert="PEM certificate: with --tls-key, serve TLS on the HTTP and gRPC ports",
            ca="PEM CA bundle: reach the cache service and workers over TLS, verified",
            server_name="the name their certificates must carry (default: the host)",
            client_ca="PEM CA bundle: both ports require client certificates it signed",
        ),
        "log_level": LOG_LEVEL_HELP,
    },
)
