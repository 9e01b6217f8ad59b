"""The whole system started with vLLM's ``--kv-events-config``: a subscriber with pyzmq alone,
knowing only vLLM's format, sees a chat's prompt (and a token prompt's) arrive as
``BlockStored`` events on its pool's topic, whose ``token_ids`` are the prompt's full blocks."""

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
from kvserve_model.resolve import resolve_model
from kvserve_model.tiny_model import TINY_MODEL_NAME
from kvserve_model.tokenizer import load_tokenizer
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


def _stored_chains(sub: zmq.Socket, prompt: list[int]) -> tuple[set[str], list[list[int]], int]:
    """BlockStored events until some chain of them starts with ``prompt``'s full blocks (or 20
    s pass): (topics, the token ids from the root through each stored block, block size)."""
    stored: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, its tokens)
    topics, bs, chains = set(), 0, []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not sub.poll(200):
            continue
        topic, seq, payload = sub.recv_multipart()
        assert len(seq) == 8
        topics.add(topic.decode())
        for e in msgpack.unpackb(payload)["events"]:
            if e["type"] == "BlockStored":
                bs = e["block_size"]
                parent = e["parent_block_hash"]
                for i, h in enumerate(e["block_hashes"]):
                    stored[h] = (parent, e["token_ids"][i * bs : (i + 1) * bs])
                    parent = h
        chains = [_chain(stored, h) for h in stored]
        full = len(prompt) // bs * bs if bs else 0
        if full and any(c[:full] == prompt[:full] for c in chains):
            break
    return topics, chains, bs


def _chain(stored: dict[int, tuple[int | None, list[int]]], h: int) -> list[int]:
    """The token ids from the root through block ``h``, following parents."""
    toks: list[int] = []
    node: int | None = h
    while node is not None:
        parent, block = stored[node]
        toks = block + toks
        node = parent
    return toks


def _subscriber(system: System) -> zmq.Socket:
    """A subscriber whose subscription has reached the publisher (a SUB sees only what is sent
    after that, and nothing says when it is): requests with a full block of their own go until
    one's events arrive; then everything is drained."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"tcp://127.0.0.1:{PORT}")
    url = f"http://{system.http_address}/v1/completions"
    for i in range(30):
        probe = [(i * 41 + j * 13) % 200 + 10 for j in range(40)]  # its own, in the vocabulary
        body = {"model": TINY_MODEL_NAME, "prompt": probe, "max_tokens": 1}
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        if sub.poll(1000):
            break
    else:
        raise AssertionError("the subscription never reached the publisher")
    while sub.poll(300):
        sub.recv_multipart()
    return sub


@pytest.mark.parametrize("kind", ["chat", "tokens"])
def test_a_prompt_arrives_as_block_stored_events(system: System, kind: str) -> None:
    sub = _subscriber(system)
    url = f"http://{system.http_address}/v1"
    if kind == "chat":
        messages = [
            {"role": "system", "content": "You answer in one word. " * 8},
            {"role": "user", "content": "Which colour is the sky on a clear day?"},
        ]
        tok = load_tokenizer(resolve_model(TINY_MODEL_NAME))
        text = tok.render_chat(messages, add_generation_prompt=True)
        prompt = tok.encode(text, add_special_tokens=False)
        body: dict = {"model": TINY_MODEL_NAME, "messages": messages, "max_tokens": 2}
        r = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
    else:
        prompt = [(7 * i + 3) % 200 + 10 for i in range(100)]
        body = {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        r = httpx.post(f"{url}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)
    topics, chains, bs = _stored_chains(sub, prompt)
    sub.close(linger=0)
    assert len(topics) == 1 and next(iter(topics)).startswith("kv@worker-0@"), topics
    assert bs, "no BlockStored arrived"
    full = len(prompt) // bs * bs
    assert full >= bs
    assert any(c[:full] == prompt[:full] for c in chains), (bs, prompt, chains)
