"""The gateway's parts, built from one config and shared by the HTTP and gRPC edges."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.cache_client import CacheApi
from gateway.cache_status import CacheStatus
from gateway.chat import ChatServing
from gateway.completions import CompletionServing
from gateway.concurrency import ConcurrencyLimiter
from gateway.config import ENV_PREFIX, GatewayConfig
from gateway.dispatcher import Dispatcher
from gateway.event_index import EventFeeds
from gateway.metrics import GatewayMetrics
from gateway.openai_serving import OpenAIServing
from gateway.poller import WorkerPoller
from gateway.sharded_cache import ShardedCache, connect_cache
from gateway.tokenizer import Tokenizer
from gateway.worker_client import WorkerClients
from gateway.worker_directory import WorkerDirectory
from kvserve_launch.tls import Dialer


@dataclass
class Gateway:
    config: GatewayConfig
    tokenizer: Tokenizer
    # One cache service, or its shards behind one object (gateway.sharded_cache).
    cache: CacheApi
    clients: WorkerClients
    directory: WorkerDirectory
    metrics: GatewayMetrics
    dispatcher: Dispatcher
    poller: WorkerPoller
    serving: OpenAIServing
    completions: CompletionServing
    chat: ChatServing
    # Requests in flight per client and in all; both edges take a slot (gateway.concurrency).
    concurrency: ConcurrencyLimiter
    # --route-from-events: the KV events' copies of the pools' indexes, and their streams.
    events: EventFeeds | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(cls, config: GatewayConfig, tokenizer: Tokenizer | None = None) -> Gateway:
        """Wire the parts (no I/O but loading the tokenizer; call inside an event loop)."""
        tokenizer = tokenizer or Tokenizer.load(config.model, config.max_model_len)

        # Read once here: a bad PEM fails startup, not the first channel to a new worker.
        dialer = Dialer.from_files(
            config.tls_ca, config.tls_server_name, config.tls_cert, config.tls_key, ENV_PREFIX
        )
        clients = WorkerClients(dialer.aio)
        directory = WorkerDirectory(config.workers)
        metrics = GatewayMetrics(directory)
        cache = connect_cache(
            config.cache_services,
            config.cache_token,
            dialer.aio,
            on_shard_error=lambda shard, call: metrics.cache_shard_errors.labels(shard, call).inc(),
        )
        cache_status = CacheStatus(grace_s=config.cache_outage_grace_s)
        metrics.cache_up.set_function(lambda: float(cache_status.down_since is None))
        metrics.cache_down_seconds.set_function(cache_status.down_for)
        events = None
        if config.route_from_events:
            shards = cache.shards if isinstance(cache, ShardedCache) else [cache]
            events = EventFeeds(shards, config.cache_token or config.admin_token)
        dispatcher = Dispatcher(
            model=config.model,
            cache=cache,
            clients=clients,
            directory=directory,
            metrics=metrics,
            policy=config.routing,
            events=events.index if events else None,
            cache_status=cache_status,
        )
        poller = WorkerPoller(
            model=config.model,
            cache=cache,
            clients=clients,
            directory=directory,
            interval_s=config.poll_interval_s,
            admin_token=config.admin_token,
            cache_status=cache_status,
        )
        serving = OpenAIServing(config, tokenizer, dispatcher)
        return cls(
            config,
            tokenizer,
            cache,
            clients,
            directory,
            metrics,
            dispatcher,
            poller,
            serving,
            CompletionServing(serving),
            ChatServing(serving),
            ConcurrencyLimiter(config.max_concurrent_per_client, config.max_concurrent_requests),
            events,
        )

    @property
    def cache_status(self) -> CacheStatus:
        return self.dispatcher.cache_status

    def healthy_workers(self) -> int:
        return sum(1 for w in self.directory.views() if w.healthy)

    def start(self) -> None:
        """The background tasks: the poller, and the KV events' streams if asked for."""
        self.poller.start()
        if self.events is not None:
            self.events.start()

    async def close(self) -> None:
        if self.events is not None:
            await self.events.stop()
        await self.poller.stop()
        await self.clients.close()
        await self.cache.close()
        await self.serving.grammar_check.close()
