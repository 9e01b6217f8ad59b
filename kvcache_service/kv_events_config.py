"""``--kv-events-config``: KV events in vLLM's format (``vllm_events.py``), configured with
vLLM's own keys, plus kvserve's topic template and encoding. No ZeroMQ here: the service's
config check reads it before anything is bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """``--kv-events-config``: vLLM's keys, and kvserve's ``topic`` template and ``encoding``."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" publishes; "null" (vLLM's default) does not
    endpoint: str = "tcp://*:5557"  # bound where it has a wildcard (or ipc/inproc), else dialed
    replay_endpoint: str | None = None  # a ROUTER for late joiners (bound)
    buffer_steps: int = 10_000  # payloads kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # vLLM's key, accepted: kvserve sends from its event loop
    topic: str = "kv@{pool}@{model}"  # {pool}: the pool id (llm-d's pod), {model}: its model
    encoding: str = "map"  # "map" or "array"
    medium: str = "GPU"  # the tier a pool's blocks are in, as vLLM names its device tier
    data_parallel_rank: int = 0

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig:
        """From the flag's JSON; raises ValueError naming what is wrong."""
        if not text.strip():
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--kv-events-config is not JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {', '.join(unknown)}")
        config = cls(**raw)
        if problem := config.problem():
            raise ValueError(f"--kv-events-config: {problem}")
        return config

    def problem(self) -> str | None:
        if self.publisher not in ("zmq", "null"):
            return f'publisher must be "zmq" or "null", got {self.publisher!r}'
        if self.encoding not in ("map", "array"):
            return f'encoding must be "map" or "array", got {self.encoding!r}'
        if min(self.buffer_steps, self.hwm, self.max_queue_size) < 1:
            return "buffer_steps, hwm and max_queue_size must be positive"
        try:
            self.topic.format(pool="p", model="m")
        except (KeyError, IndexError, ValueError) as err:
            return f"topic may name only {{pool}} and {{model}}: {err}"
        return None

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"
