"""``echo`` with ``logprobs`` on /v1/completions, as an evaluation harness scores text
(lm-evaluation-harness's loglikelihood requests: the prompt echoed with its tokens' logprobs,
``max_tokens`` 1): on the real processes, with the official ``openai`` client, streamed and
not. The values themselves are checked against the dense mlx-lm forward in
tests/worker_engine/test_prompt_logprobs.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from kvserve_launch.process import KeptLines as LogSink
from kvserve_launch.system import System
from kvserve_model.tiny_model import TINY_MODEL_NAME
from kvserve_model.token_bytes import bytes_of
from tests.e2e.conftest import started_system

MODEL = TINY_MODEL_NAME
# ~280 byte tokens (2+ chunks), some of them parts of characters.
TEXT = "The quick brown fox jumps over the lazy dog. " * 6 + "Café, 😀, 世界. "


@pytest.fixture(scope="module")
def system(logs: LogSink) -> Iterator[System]:
    yield from started_system(logs, workers=1)


@pytest.fixture(scope="module")
def client(system: System) -> OpenAI:
    return OpenAI(base_url=f"http://{system.http_address}/v1", api_key="unused", timeout=120)


def test_the_prompt_is_scored(client: OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=1, temperature=0, echo=True, logprobs=3
    )
    choice = r.choices[0]
    lp = choice.logprobs
    assert r.usage is not None and lp is not None and lp.token_logprobs and lp.top_logprobs
    n = r.usage.prompt_tokens + r.usage.completion_tokens
    assert len(lp.tokens or ()) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    # The text is the tokens' bytes, but for an unfinished UTF-8 character at its very end (a
    # byte token of the random model), which the text leaves out (as vLLM) and a token shows.
    # A token that is part of a character is written as OpenAI writes it (bytes:\xNN).
    raw = [bytes_of(t) for t in lp.tokens or ()]
    joined = b"".join(raw).decode("utf-8", "replace")
    assert choice.text.startswith(TEXT)
    assert joined == choice.text or joined.rstrip("\ufffd") == choice.text != joined
    assert "bytes:\\xc3" in (lp.tokens or ())  # the é of the prompt, byte by byte
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and -9999.0 < v <= 0.0 for v in lp.token_logprobs[1:])
    assert all(t is not None and 1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    # Alternatives that are parts of characters are told apart (they all read U+FFFD once).
    assert not any("\ufffd" in k for t in lp.top_logprobs[1:] if t for k in t)
    # Each offset counts the whole characters before the token (the prompt is valid UTF-8).
    assert lp.text_offset == [len(b"".join(raw[:i]).decode("utf-8", "ignore")) for i in range(n)]
    # The same request again, its prefix now cached: the same numbers (no cached prefix is
    # used for it, every position's logits are computed).
    again = client.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=1, temperature=0, echo=True, logprobs=3
    )
    assert again.choices[0].logprobs is not None
    assert again.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs_bytes_are_the_tokens_own(client: OpenAI) -> None:
    """OpenAI's ``bytes``: a token's own bytes, which for part of a character are not its
    text's (they were U+FFFD's, the same for every such token)."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "é😀"}], max_tokens=24,
        temperature=1.0, seed=11, logprobs=True, top_logprobs=5,
    )  # fmt: skip
    entries = r.choices[0].logprobs.content if r.choices[0].logprobs else None
    assert entries
    for e in [*entries, *(t for x in entries for t in x.top_logprobs)]:
        assert e.bytes == list(bytes_of(e.token))
        if e.token.startswith("bytes:"):
            assert len(e.bytes) == 1 and e.bytes[0] >= 0x80  # one byte token, not U+FFFD's 3
    whole = b"".join(bytes(e.bytes or ()) for e in entries).decode("utf-8", "replace")
    assert whole.startswith(r.choices[0].message.content or "")


def test_streamed_as_returned_whole(client: OpenAI, system: System) -> None:
    body = dict(model=MODEL, prompt=["ab ab ab ab", TEXT], max_tokens=4, temperature=0,
                echo=True, logprobs=2, n=2)  # fmt: skip
    whole = client.completions.create(**body)  # type: ignore[call-overload]
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    values: dict[int, list[float | None]] = {}
    with httpx.stream(
        "POST", f"http://{system.http_address}/v1/completions", json={**body, "stream": True},
        timeout=120,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                i = c["index"]
                texts[i] = texts.get(i, "") + c["text"]
                if c["logprobs"]:
                    tokens.setdefault(i, []).extend(c["logprobs"]["tokens"])
                    values.setdefault(i, []).extend(c["logprobs"]["token_logprobs"])
    assert len(whole.choices) == 4
    for choice in whole.choices:
        i = choice.index
        assert choice.logprobs is not None
        assert texts[i] == choice.text and tokens[i] == choice.logprobs.tokens
        assert values[i][0] is None
        assert values[i][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)


def test_prompt_logprobs_out_of_range_is_400(system: System) -> None:
    r = httpx.post(
        f"http://{system.http_address}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1, "echo": True, "logprobs": 21},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_vllm_prompt_logprobs(system: System, client: OpenAI) -> None:
    """vLLM's ``prompt_logprobs``: in each choice (completions) or the response (chat), None
    for the first token, then the prompt token's own entry (its rank in the vocabulary) and
    the top alternatives; the same values echo's logprobs give; absent where not asked."""
    url = f"http://{system.http_address}/v1"
    body = {"model": MODEL, "prompt": TEXT, "max_tokens": 1, "temperature": 0}
    plain = httpx.post(f"{url}/completions", json=body, timeout=120).json()
    assert "prompt_logprobs" not in plain["choices"][0] and "prompt_logprobs" not in plain
    r = httpx.post(f"{url}/completions", json={**body, "prompt_logprobs": 2}, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    echo = (
        client.completions.create(
            model=MODEL, prompt=TEXT, max_tokens=1, temperature=0, echo=True, logprobs=2
        )
        .choices[0]
        .logprobs
    )
    assert echo is not None and echo.token_logprobs is not None
    n = r.json()["usage"]["prompt_tokens"]
    assert len(got) == n and got[0] is None
    for entry, want in zip(got[1:], echo.token_logprobs[1:n], strict=True):
        assert 2 <= len(entry) <= 3  # the token itself, and the top 2 (it may be one of them)
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] or ranks[0] == 1
        own = [e for e in entry.values() if e["logprob"] == pytest.approx(want, abs=1e-5)]
        assert own and all(e["rank"] >= 1 for e in own)
    chat = httpx.post(
        f"{url}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
              "prompt_logprobs": 0, "n": 2},
        timeout=120,
    ).json()  # fmt: skip
    prompt = chat["prompt_logprobs"]
    assert len(prompt) == chat["usage"]["prompt_tokens"] and prompt[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in prompt[1:])
    stream = httpx.post(
        f"{url}/completions", json={**body, "prompt_logprobs": 1, "stream": True}, timeout=120
    )
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "prompt_logprobs"
