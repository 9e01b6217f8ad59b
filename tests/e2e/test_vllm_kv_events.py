"""The whole system started with vLLM's ``--kv-events-config``: a subscriber with pyzmq alone,
knowing only vLLM's format, sees a request's prompt arrive as ``BlockStored`` events on its
pool's topic, whose ``token_ids`` are the prompt's full blocks."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import msgpack
import pytest
import zmq

from kvserve_launch.system import System
from kvserve_model.tiny_model import TINY_MODEL_NAME
from tests.e2e.conftest import LogSink, started_system


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PORT = _free_port()


@pytest.fixture(scope="module")
def system(logs: LogSink) -> Iterator[System]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{PORT}"}
    yield from started_system(logs, workers=1, kv_events_config=json.dumps(config))


def test_a_prompt_arrives_as_block_stored_events(system: System) -> None:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"tcp://127.0.0.1:{PORT}")
    time.sleep(0.5)  # a SUB sees only what is sent after it joined
    prompt = [(7 * i + 3) % 200 + 10 for i in range(100)]
    r = httpx.post(
        f"http://{system.http_address}/v1/completions",
        json={"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    stored: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, its tokens)
    topics, bs = set(), 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not sub.poll(200):
            if stored:
                break
            continue
        topic, seq, payload = sub.recv_multipart()
        assert len(seq) == 8
        topics.add(topic.decode())
        batch = msgpack.unpackb(payload)
        for e in batch["events"]:
            if e["type"] == "BlockStored":
                bs = e["block_size"]
                parent = e["parent_block_hash"]
                for i, h in enumerate(e["block_hashes"]):
                    stored[h] = (parent, e["token_ids"][i * bs : (i + 1) * bs])
                    parent = h
    sub.close(linger=0)
    assert len(topics) == 1 and next(iter(topics)).startswith("kv@worker-0@"), topics
    # The chain from the root through every stored block: the prompt's full blocks first.
    chains = []
    for h in stored:
        toks, node = [], h
        while node is not None:
            parent, block = stored[node]
            toks = block + toks
            node = parent
        chains.append(toks)
    full = len(prompt) // bs * bs
    assert any(c[:full] == prompt[:full] for c in chains), (bs, chains)
