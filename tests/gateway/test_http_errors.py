"""Bad input gets a 4xx with an OpenAI error body, and the gateway keeps serving.

No worker is needed: the app runs on httpx's ASGI transport and the cache service address
points at a closed port, so everything here is answered by the gateway itself.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.core import Gateway
from gateway.http_app import create_app
from gateway.limits import CHARS_PER_CONTEXT_TOKEN
from gateway.tokenizer import Tokenizer
from kvcache_service.server import RunningService
from tests.gateway.conftest import ADMIN_TOKEN, gateway_config
from tests.gateway.fake_worker import FakeWorker


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def client(tokenizer: Tokenizer) -> AsyncIterator[httpx.AsyncClient]:
    config = gateway_config(f"127.0.0.1:{closed_port()}", max_body_bytes=64 * 1024)
    gw = Gateway.build(config, tokenizer)
    transport = httpx.ASGITransport(app=create_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c
    await gw.close()


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == (
        "invalid_request_error" if status < 500 and status != 401 else err["type"]
    )
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_malformed_json(client):
    err = assert_error(await client.post("/v1/completions", content=b'{"prompt": "x",'), 400)
    assert "JSON" in err["message"]


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"", b"null"])
async def test_body_must_be_an_object(client, body):
    assert_error(await client.post("/v1/chat/completions", content=body), 400)


@pytest.mark.parametrize(
    ("path", "patch", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": "abc"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "temperature": -0.1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": 123}, "prompt"),
        ("/v1/completions", {"prompt": [1, -5]}, "prompt.1"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, None),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "stop_token_ids": ["a"]}, "stop_token_ids.0"),
        ("/v1/chat/completions", {**CHAT, "seed": 2**70}, "seed"),
    ],
)
async def test_schema_violations(client, path, patch, param):
    assert_error(await client.post(path, json=patch), 400, param=param)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"one": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "(x"}, "guided_regex"),
        ("/v1/completions", {"prompt": "x", "guided_json": {"type": "nope"}}, "guided_json"),
        ("/v1/completions", {"prompt": "x", "guided_choice": []}, "guided_choice"),
        (
            "/v1/completions",
            {"prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}},
            "structured_outputs",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
        ),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
        ("/v1/completions", {"prompt": "x", "stop": ""}, "stop"),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 9}, "n"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, None),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        # Refused by name, never ignored: a client that sends them expects their effect.
        ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),
        # 1e-300 made every logit infinite: the request got garbage, not an error.
        ("/v1/chat/completions", {**CHAT, "repetition_penalty": 1e-300}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0.05}, "repetition_penalty"),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "yaml"}},
            "response_format.type",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
        ),
    ],
)
async def test_unsupported_or_empty(client, path, body, param):
    assert_error(await client.post(path, json=body), 400, param=param)


async def test_unknown_model_is_404(client):
    err = assert_error(
        await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-17"}),
        404,
        param="model",
        code="model_not_found",
    )
    assert "gpt-17" in err["message"]
    assert_error(await client.get("/v1/models/gpt-17"), 404, code="model_not_found")


async def test_prompt_beyond_the_context(client, tokenizer):
    long_prompt = "a" * (tokenizer.max_context + 10)
    assert_error(
        await client.post("/v1/completions", json={"prompt": long_prompt}),
        400,
        param="prompt",
        code="context_length_exceeded",
    )
    err = assert_error(
        await client.post(
            "/v1/completions", json={"prompt": "abc", "max_tokens": tokenizer.max_context}
        ),
        400,
        param="max_tokens",
        code="context_length_exceeded",
    )
    assert str(tokenizer.max_context) in err["message"]
    assert_error(
        await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": long_prompt}]},
        ),
        400,
        param="messages",
        code="context_length_exceeded",
    )


@pytest.fixture
async def roomy_client(tokenizer: Tokenizer) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway of ``client``, taking bodies of up to 1 MiB."""
    config = gateway_config(f"127.0.0.1:{closed_port()}", max_body_bytes=1 << 20)
    gw = Gateway.build(config, tokenizer)
    transport = httpx.ASGITransport(app=create_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c
    await gw.close()


async def test_many_small_messages_count_toward_the_prompt_limit(roomy_client, tokenizer):
    """Each message counts what a template writes around it (``MESSAGE_CHARS``), not only its
    content: a conversation of empty messages past the prompt-length limit is refused before it
    is rendered (125,000 of them once counted as 0 characters, rendered on the event loop, and
    stalled every other stream for seconds), on the chat endpoint and the admin routes."""
    from gateway.chat import MESSAGE_CHARS

    n = CHARS_PER_CONTEXT_TOKEN * tokenizer.max_context // MESSAGE_CHARS + 1
    messages = [{"role": "user", "content": ""}] * n
    err = assert_error(
        await roomy_client.post("/v1/chat/completions", json={"messages": messages}),
        400,
        param="messages",
        code="context_length_exceeded",
    )
    assert "characters" in err["message"]
    for path in ("/admin/cache/lookup", "/admin/cache/pin"):
        err = assert_error(
            await roomy_client.post(path, json={"pool": "w0", "messages": messages}),
            400,
            param="messages",
            code="context_length_exceeded",
        )
        assert "characters" in err["message"]
    long_prompt = "a" * (CHARS_PER_CONTEXT_TOKEN * tokenizer.max_context + 1)
    assert_error(
        await roomy_client.post("/admin/cache/lookup", json={"prompt": long_prompt}),
        400,
        param="prompt",
        code="context_length_exceeded",
    )


async def test_a_long_conversation_renders_off_the_event_loop(tokenizer):
    """A conversation whose messages are many but short is rendered on another thread (as a
    long one is), on the chat endpoint and the admin routes: the event loop keeps serving."""
    threads: list[str] = []

    class Recording(Tokenizer):
        def apply_chat_template(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return super().apply_chat_template(*args, **kwargs)

    fields = {f.name: getattr(tokenizer, f.name) for f in dataclasses.fields(tokenizer)}
    config = gateway_config(f"127.0.0.1:{closed_port()}", max_body_bytes=1 << 20)
    gw = Gateway.build(config, Recording(**fields))
    try:
        transport = httpx.ASGITransport(app=create_app(gw))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            few = [{"role": "user", "content": "hi"}]
            many = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}] * 80
            for messages in (few, many):
                await c.post("/v1/chat/completions", json={"messages": messages})
                await c.post(
                    "/admin/cache/lookup",
                    json={"messages": messages},
                    headers={"Authorization": f"bearer {ADMIN_TOKEN}"},
                )
    finally:
        await gw.close()
    loop = threading.current_thread().name
    assert threads[:2] == [loop, loop]  # a short one: rendered in place
    assert len(threads) == 4 and loop not in threads[2:]


@pytest.mark.parametrize(
    "key", [" 12", "12 ", "+12", "-12", "1_2", "\u0661\u0662", "\uff11\uff12", "", "0x1"]
)
async def test_logit_bias_keys_are_ascii_digits(client, key):
    """Python's int() takes " 12", "+12", "1_2" and other scripts' digits (Arabic-Indic, fullwidth) as 12:
    each biased token 12 for a key that is not "12"."""
    body = {"prompt": "x", "max_tokens": 1, "logit_bias": {key: 5}}
    err = assert_error(await client.post("/v1/completions", json=body), 400, param="logit_bias")
    assert repr(key) in err["message"]


async def test_a_logit_bias_value_that_is_not_a_number_names_its_key(client):
    """A dict's key in an error's location is not a union's branch ("expected one of 1")."""
    body = {"prompt": "x", "max_tokens": 1, "logit_bias": {"7": 1, "12": "abc"}}
    err = assert_error(await client.post("/v1/completions", json=body), 400, param="logit_bias")
    assert err["message"] == "logit_bias.12: Input should be a valid number"


async def test_logit_bias_digit_keys_pass(client):
    for key in ("12", "0012"):  # (no worker here: past the checks it is a 503)
        body = {"prompt": "x", "max_tokens": 1, "logit_bias": {key: 5}}
        assert (await client.post("/v1/completions", json=body)).status_code == 503


@pytest.mark.parametrize(
    "key", ["messages", "conversation", "chat_template", "tokenize", "return_dict", "padding"]
)
async def test_chat_template_kwargs_cannot_set_the_renderings_own_arguments(client, key):
    """A kwarg that is an argument of the rendering call, not a template variable: a 400 naming
    it (it was Python's "got multiple values for keyword argument" in the message)."""
    body = {**CHAT, "chat_template_kwargs": {key: True}}
    err = assert_error(
        await client.post("/v1/chat/completions", json=body), 400, f"chat_template_kwargs.{key}"
    )
    assert repr(key) in err["message"] and "keyword argument" not in err["message"]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"add_generation_prompt": "x"}, "chat_template_kwargs.add_generation_prompt"),
        ({"continue_final_message": 1}, "chat_template_kwargs.continue_final_message"),
        ({"tools": "all"}, "chat_template_kwargs.tools"),
        # It sets the request's flag: the final message must be the assistant's, as for it.
        ({"continue_final_message": True}, "messages"),
    ],
)
async def test_chat_template_kwargs_that_set_request_fields_are_checked_as_them(
    client, kwargs, param
):
    body = {**CHAT, "chat_template_kwargs": kwargs}
    err = assert_error(await client.post("/v1/chat/completions", json=body), 400, param)
    assert "keyword argument" not in err["message"]


async def test_oversized_body_is_413(client):
    big = json.dumps({"prompt": "x" * 100_000}).encode()
    assert_error(await client.post("/v1/completions", content=big), 413, code="request_too_large")

    async def chunks():  # no Content-Length: counted as it arrives
        for _ in range(100):
            yield b" " * 1024

    assert_error(await client.post("/v1/completions", content=chunks()), 413)


@pytest.mark.parametrize("origins", ["*", "https://app.example", ""])
async def test_browser_pages_may_call_the_api_by_allowed_origins(tokenizer, origins):
    """CORS, as vLLM's --allowed-origins (default "*"): a browser's preflight of a chat call is
    answered with the origin allowed, and the call's response (an error's too) carries it; an
    origin not listed gets no grant, and an empty list turns CORS off (the preflight is the
    405 of a route that takes no OPTIONS)."""
    config = gateway_config(f"127.0.0.1:{closed_port()}", allowed_origins=origins)
    gw = Gateway.build(config, tokenizer)
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    try:
        transport = httpx.ASGITransport(app=create_app(gw))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            pre = await c.options("/v1/chat/completions", headers=preflight)
            call = await c.post(
                "/v1/chat/completions",
                json={"messages": []},
                headers={"Origin": "https://app.example"},
            )
            other = await c.options(
                "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
            )
    finally:
        await gw.close()
    assert call.status_code == 400  # no messages: the gateway's own error
    if not origins:
        assert pre.status_code == 405
        assert "access-control-allow-origin" not in call.headers
        return
    assert pre.status_code == 200, pre.text
    allowed = "*" if origins == "*" else "https://app.example"
    assert pre.headers["access-control-allow-origin"] == allowed
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    assert call.headers["access-control-allow-origin"] == allowed
    if origins == "*":
        assert other.status_code == 200
    else:
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers


async def test_unknown_path_and_method(client):
    assert_error(await client.get("/v1/nothing"), 404)
    assert_error(await client.get("/v1/completions"), 405)


async def test_no_worker_is_503_and_the_gateway_keeps_serving(client):
    """No worker has registered (the system is starting): 503 with Retry-After, /health says
    "starting", everything else answers."""
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "2"
    assert resp.json()["error"]["type"] == "service_unavailable"
    assert "ready yet" in resp.json()["error"]["message"]
    stream = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert stream.status_code == 503  # routing fails before the first event: a real status
    health = await client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "starting"
    assert health.headers["retry-after"] == "2"
    assert (await client.get("/v1/models")).status_code == 200
    assert (await client.get("/metrics")).status_code == 200


async def test_json_without_content_type_is_accepted(client):
    # curl -d sends application/x-www-form-urlencoded; the body is still JSON.
    resp = await client.post(
        "/v1/completions",
        content=b'{"prompt": "x", "max_tokens": -1}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert_error(resp, 400, param="max_tokens")


async def test_models(client, tokenizer):
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["kvserve-tiny-llama"]
    assert body["data"][0]["max_model_len"] == tokenizer.max_context
    assert (await client.get("/v1/models/kvserve-tiny-llama")).json()["id"] == "kvserve-tiny-llama"


async def test_api_key(tokenizer):
    config = gateway_config(f"127.0.0.1:{closed_port()}", api_key="sk-test")
    gw = Gateway.build(config, tokenizer)
    transport = httpx.ASGITransport(app=create_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        err = assert_error(await c.get("/v1/models"), 401, code="invalid_api_key")
        assert err["type"] == "authentication_error"
        ok = await c.get("/v1/models", headers={"Authorization": "Bearer sk-test"})
        assert ok.status_code == 200
        assert (await c.get("/health")).status_code == 503  # health needs no key
    await gw.close()


async def test_admin_needs_a_pool_and_a_prefix(client):
    assert_error(await client.post("/admin/cache/pin", json={"token_ids": [1, 2]}), 400)
    assert_error(await client.post("/admin/cache/pin", json={"pool": "w0"}), 400)
    assert_error(
        await client.post("/admin/cache/lookup", json={"token_ids": [1], "prompt": "x"}), 400
    )
    assert_error(await client.post("/admin/cache/evict", json={"pool": "w0"}), 400)
    assert_error(await client.post("/admin/cache/evict", json={"pool": "w0", "bogus": 1}), 400)
    assert_error(await client.get("/admin/cache/tree"), 400, param="pool")
    # Query numbers past their proto field's range: a 400, not a 500 from building the message.
    for depth in (-1, 2**32, 2**64, "deep"):
        resp = await client.get(f"/admin/cache/tree?pool=w0&max_depth={depth}")
        assert_error(resp, 400, param="max_depth")
    for nodes in (0, 2**64):
        resp = await client.get(f"/admin/dashboard/tree?pool=w0&max_nodes={nodes}")
        assert_error(resp, 400, param="max_nodes")
    # Body numbers too: blocks is EvictRequest.num_blocks, a uint32.
    for blocks, bound in ((0, "1"), (-1, "1"), (2**32, str(2**32 - 1)), (2**64, str(2**32 - 1))):
        resp = await client.post("/admin/cache/evict", json={"pool": "w0", "blocks": blocks})
        err = assert_error(resp, 400, param="blocks")
        assert err["message"].startswith("blocks") and bound in err["message"], err
    # The largest is built and sent (here to no cache service: 503, not 400 or 500).
    resp = await client.post("/admin/cache/evict", json={"pool": "w0", "blocks": 2**32 - 1})
    assert resp.status_code == 503, resp.text
    # Token ids are int32 on the wire: one past it is a 400 naming it, on every prefix route.
    for path in ("/admin/cache/evict", "/admin/cache/pin", "/admin/cache/lookup"):
        body = {"pool": "w0", "token_ids": [1, 2**31]}
        assert_error(await client.post(path, json=body), 400, param="token_ids.1")


@pytest.mark.parametrize("top_k", ["vocab + 1", 2**31 - 1, 2**31, 2**63, 2**64])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_top_k_beyond_the_vocabulary_or_the_wire_is_400(client, tokenizer, path, top_k):
    if top_k == "vocab + 1":
        top_k = tokenizer.vocab_size + 1
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT["messages"]}
    resp = await client.post(path, json={**body, "max_tokens": 4, "top_k": top_k})
    err = assert_error(resp, 400, param="top_k")
    assert "top_k" in err["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("repetition_penalty", 1e30), ("seed", 2**64), ("stop", ["x" * 5000])],
)
async def test_sampling_values_past_the_limits_are_400(client, field, value):
    resp = await client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 4, field: value}
    )
    assert_error(resp, 400, param=field)


async def test_no_query_parameter_value_is_a_500(cache: RunningService, tokenizer: Tokenizer):
    """Every GET route's query parameters (from the OpenAPI document, so a new route is covered
    too), given values past any range a proto field or a handler takes, against a real cache
    service with a registered pool: a 4xx (or a 200), never a 500."""
    worker = await FakeWorker("w0", cache.address).start()
    gw = Gateway.build(gateway_config(cache.address), tokenizer)
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    transport = httpx.ASGITransport(app=create_app(gw))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            spec = (await c.get("/openapi.json")).json()
            tried = 0
            for path, ops in spec["paths"].items():
                params = ops.get("get", {}).get("parameters", [])
                query = [p for p in params if p["in"] == "query"]
                if not query or "{" in path:
                    continue
                base = {p["name"]: "w0" for p in query if p.get("required")}
                for p in query:
                    for value in (-1, -(2**63), 2**32, 2**64, 1e308, "x" * 5000, "\x00"):
                        params = {**base, p["name"]: value}
                        resp = await c.get(path, params=params, headers=headers)
                        assert resp.status_code < 500, (path, p["name"], value, resp.text)
                        tried += 1
            assert tried >= 20  # the admin tree and the dashboard's, at least
    finally:
        await gw.close()
        await worker.close()


CRASHED_LLGUIDANCE = {
    "type": "integer",
    "minimum": -9223372036854775807,
    "maximum": -9223372036854775803,
}


async def test_constraints_that_crashed_the_grammar_engine_are_a_400(client):
    """This schema crashed llguidance 1.9.1 in the gateway's process (SIGSEGV: every request it
    served died, and the launcher stopped the system after a few). Its bounds are refused by
    name; a Lark grammar embedding it reaches the engine in a child process, and the gateway
    answers on."""
    schema = {"type": "object", "properties": {"n": CRASHED_LLGUIDANCE}}
    cases = [
        ({**CHAT, "guided_json": schema}, "guided_json", "beyond ±2^53"),
        ({**CHAT, "guided_json": {"type": "integer", "maximum": 1e20}}, "guided_json", "1e+20"),
        (
            {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
             "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tools",
            "tools[0].function.parameters: the JSON schema's minimum",
        ),
        ({**CHAT, "guided_grammar": f"start: %json{json.dumps(CRASHED_LLGUIDANCE)}"},
         "guided_grammar", "guided_grammar: "),
    ]  # fmt: skip
    for _ in range(2):  # the second time from the gateway's cache of checks
        for body, param, says in cases:
            err = assert_error(await client.post("/v1/chat/completions", json=body), 400, param)
            assert says in err["message"], err["message"]
    assert_error(  # and what compiles is dispatched (no worker listens here: 503)
        await client.post("/v1/chat/completions", json={**CHAT, "guided_regex": "[a-z]+"}), 503
    )
