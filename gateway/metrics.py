"""Prometheus metrics of the gateway, one registry per gateway (no global state).

Request-level series (requests, latency, time to first token, inter-token latency, token
counts, routing decisions) are recorded as requests run. Worker-level series (KV blocks free /
cached / referenced, queue depth, running, preemptions, health) are read at scrape time from
the worker directory the poller keeps fresh, so a departed worker's series vanish with it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.generation import Usage
from gateway.worker_directory import WorkerDirectory

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self, directory: WorkerDirectory) -> None:
        """Declares every request-level series: long because it is the table of them (name,
        help, labels, buckets), one after the other, where a reader looks one up."""
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvserve_gateway_requests",
            "Requests answered, by endpoint and HTTP status (gRPC: status code name).",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_latency = Histogram(
            "kvserve_gateway_request_duration_seconds",
            "Time from request arrival to the end of the response.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvserve_gateway_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvserve_gateway_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a sequence.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvserve_gateway_prompt_tokens", "Prompt tokens, by worker.", ["worker"], registry=r
        )
        self.cached_tokens = Counter(
            "kvserve_gateway_cached_tokens",
            "Prompt tokens served from the prefix cache (not recomputed), by worker.",
            ["worker"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "kvserve_gateway_completion_tokens",
            "Generated tokens, by worker.",
            ["worker"],
            registry=r,
        )
        self.routed = Counter(
            "kvserve_gateway_routed",
            "Sequences dispatched, by worker and routing reason "
            "(prefix, least_loaded, overloaded, unhealthy, failover).",
            ["worker", "reason"],
            registry=r,
        )
        self.route_source = Counter(
            "kvserve_gateway_route_source",
            "Where the router's cached-prefix lengths came from, per request: events (the KV "
            "events' copy of the index, --route-from-events), route (a Route call), "
            "known_workers (Route failed: load only).",
            ["source"],
            registry=r,
        )
        self.failovers = Counter(
            "kvserve_gateway_failovers",
            "Dispatches that failed before the first token and moved to another worker.",
            ["worker", "error"],
            registry=r,
        )
        self.cache_shard_errors = Counter(
            "kvserve_gateway_cache_shard_errors",
            "Calls to one shard of a sharded cache service that failed or timed out (its "
            "pools were left out of that answer), by shard address and call.",
            ["shard", "call"],
            registry=r,
        )
        # Set from the cache status at scrape time (Gateway.build: set_function).
        self.cache_up = Gauge(
            "kvserve_gateway_cache_service_up",
            "1 when the cache service answered the gateway's last call, 0 during an outage.",
            registry=r,
        )
        self.cache_down_seconds = Gauge(
            "kvserve_gateway_cache_service_unreachable_seconds",
            "Seconds since the cache service stopped answering (0 while it answers).",
            registry=r,
        )
        self._totals = _TokenTotals()
        r.register(_WorkerCollector(directory, self._totals))

    def record_usage(self, worker: str, usage: Usage) -> None:
        self.prompt_tokens.labels(worker).inc(usage.prompt_tokens)
        self.cached_tokens.labels(worker).inc(usage.cached_tokens)
        self.completion_tokens.labels(worker).inc(usage.completion_tokens)
        self._totals.prompt += usage.prompt_tokens
        self._totals.cached += usage.cached_tokens

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _TokenTotals:
    """Running sums behind the gateway-wide hit rate gauge."""

    __slots__ = ("cached", "prompt")

    def __init__(self) -> None:
        self.prompt = 0
        self.cached = 0


class _WorkerCollector(Collector):
    """Per-worker series from the directory at scrape time."""

    def __init__(self, directory: WorkerDirectory, totals: _TokenTotals) -> None:
        self.directory = directory
        self.totals = totals

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        hit = GaugeMetricFamily(
            "kvserve_gateway_prefix_cache_hit_rate",
            "Cached / prompt tokens over every request since the gateway started.",
        )
        hit.add_metric([], self.totals.cached / self.totals.prompt if self.totals.prompt else 0.0)
        yield hit
        f = _WorkerFamilies()
        for w in self.directory.views():
            name = w.pool_id
            f.healthy.add_metric([name], 1.0 if w.healthy else 0.0)
            f.in_flight.add_metric([name], w.in_flight)
            if w.load is not None:
                f.queue.add_metric([name], w.load.waiting)
                f.running.add_metric([name], w.load.running)
                f.preemptions.add_metric([name], w.load.preemptions)
            if w.blocks is not None:
                b = w.blocks
                states = (b.free_blocks, b.cached_blocks, b.referenced_blocks)
                f.total.add_metric([name], b.num_blocks)
                f.pool_hit.add_metric([name], b.token_hit_rate)
            elif w.load is not None and w.route is not None:
                cached = w.route.evictable_blocks
                free = w.route.free_blocks
                states = (free, cached, max(0, w.load.num_blocks - free - cached))
                f.total.add_metric([name], w.load.num_blocks)
            else:
                continue
            for state, n in zip(("free", "cached", "referenced"), states, strict=True):
                f.blocks.add_metric([name, state], n)
        yield from f.all()


class _WorkerFamilies:
    """The per-worker series of one scrape, empty until the collector fills them."""

    def __init__(self) -> None:
        self.blocks = GaugeMetricFamily(
            "kvserve_worker_kv_blocks",
            "KV blocks of a worker's pool by state: free, cached (indexed, unreferenced), "
            "referenced (leased by running requests).",
            labels=["worker", "state"],
        )
        self.total = GaugeMetricFamily(
            "kvserve_worker_kv_blocks_total", "KV blocks in a worker's pool.", labels=["worker"]
        )
        self.pool_hit = GaugeMetricFamily(
            "kvserve_worker_prefix_cache_hit_rate",
            "Token hit rate of a worker's pool as the cache service counts it.",
            labels=["worker"],
        )
        self.queue = GaugeMetricFamily(
            "kvserve_worker_queue_depth", "Requests waiting on a worker.", labels=["worker"]
        )
        self.running = GaugeMetricFamily(
            "kvserve_worker_running", "Requests running on a worker.", labels=["worker"]
        )
        self.in_flight = GaugeMetricFamily(
            "kvserve_gateway_in_flight",
            "This gateway's open requests per worker.",
            labels=["worker"],
        )
        self.healthy = GaugeMetricFamily(
            "kvserve_worker_healthy",
            "1 when the worker is reachable and alive.",
            labels=["worker"],
        )
        self.preemptions = CounterMetricFamily(
            "kvserve_worker_preemptions",
            "Sequences a worker preempted for lack of KV blocks.",
            labels=["worker"],
        )

    def all(self) -> tuple[GaugeMetricFamily | CounterMetricFamily, ...]:
        """In the order a scrape lists them."""
        return (
            self.blocks,
            self.total,
            self.pool_hit,
            self.queue,
            self.running,
            self.in_flight,
            self.healthy,
            self.preemptions,
        )
