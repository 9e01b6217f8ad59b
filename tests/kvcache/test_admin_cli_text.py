"""The admin CLI speaks text: prefixes given as text or chat messages are tokenized with the
pools' model (here the embedded default model) exactly as the gateway tokenizes requests, and
``tree`` and ``lookup`` show text, against a real cache service on loopback."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvcache_service import admin_cli
from kvserve_model.resolve import resolve_model
from kvserve_model.tokenizer import load_tokenizer
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from tests.kvcache.test_servicer import AUTH, BS, TOKEN, Client
from tests.kvcache.test_servicer import client as client  # the fixture

SYSTEM = [{"role": "system", "content": "You are a terse assistant who answers in French."}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(None))


async def cli(client: Client, *args: str) -> int:
    base = ["--address", client.svc.address, "--token", TOKEN]
    return await asyncio.to_thread(admin_cli.main, [*base, *args])


async def serve(client: Client, pool: pb.PoolRef, ids: list[int]) -> None:
    """One request for ``ids`` that commits and releases them, as a worker would."""
    lease = (await client.acquire(pool, ids)).lease
    await client.kv.ReleaseLease(
        pb.ReleaseLeaseRequest(pool=pool, lease_id=lease.lease_id, token_ids=ids)
    )


async def test_a_system_prompt_pinned_as_messages_is_the_chats_prefix(client, tok, capsys):
    """The prefix --messages names is what the gateway sends for a chat that starts with them:
    the chat template without a generation prompt, a prefix of the full chat's tokens."""
    pool = await client.register()
    chat = [*SYSTEM, {"role": "user", "content": "Bonjour?"}]
    full = tok.encode(tok.render_chat(chat, add_generation_prompt=True), add_special_tokens=False)
    prefix = tok.encode(
        tok.render_chat(SYSTEM, add_generation_prompt=False), add_special_tokens=False
    )
    assert full[: len(prefix)] == prefix and len(prefix) > 2 * BS
    await serve(client, pool, full)
    assert await cli(client, "pin", "--pool", "w1", "--messages", json.dumps(SYSTEM)) == 0
    assert f"pinned {len(prefix) // BS} blocks" in capsys.readouterr().out
    assert await cli(client, "lookup", "--messages", json.dumps(SYSTEM)) == 0
    out = capsys.readouterr().out
    cached = len(prefix) - 1  # the last prompt token is always computed
    full_blocks = cached // BS
    assert f"{cached} of {len(prefix)}" in out
    assert f"{full_blocks * BS} in {full_blocks}" in out  # shared blocks, then the copied rest
    assert "cached up to" in out and "French" in out
    await client.check()


async def test_text_prefixes_and_a_tree_in_text(client, tok, capsys):
    pool = await client.register()
    text = "The quick brown fox jumps over the lazy dog, twice: the quick brown fox."
    ids = tok.encode(text)
    await serve(client, pool, ids)
    assert await cli(client, "lookup", "--text", text) == 0
    assert f"{len(ids) - 1} of {len(ids)}" in capsys.readouterr().out
    assert await cli(client, "tree", "--pool", "w1") == 0
    out = capsys.readouterr().out
    assert "The quick" in out  # decoded
    assert await cli(client, "tree", "--pool", "w1", "--ids") == 0
    assert str(ids[1]) in capsys.readouterr().out and "The quick" not in capsys.readouterr().out


async def test_evict_a_prefix_given_as_text(client, tok, capsys):
    pool = await client.register()
    text = "A system prompt that changed, so its cached blocks should go now."
    ids = tok.encode(text)
    await serve(client, pool, ids)
    before = await client.admin.Lookup(pb.LookupRequest(prompt_token_ids=ids), metadata=AUTH)
    # The blocks of what extends the prefix go (from the block the prefix ends in).
    assert await cli(client, "evict", "--pool", "w1", "--prefix-text", text[:20]) == 0
    evicted = int(capsys.readouterr().out.split()[1])
    after = await client.admin.Lookup(pb.LookupRequest(prompt_token_ids=ids), metadata=AUTH)
    assert evicted >= 1
    assert after.pools[0].cached_tokens < before.pools[0].cached_tokens
    assert after.pools[0].cached_tokens < 20
    await client.check()


@pytest.mark.parametrize(
    "args, says",
    [
        (["lookup", "--messages", "not json"], "not JSON"),
        (["lookup", "--messages", '[{"content": "x"}]'], "string role"),
        (["lookup", "--text", ""], "empty"),
        (["lookup", "--text", "x", "1,2"], "not allowed with"),
    ],
)
async def test_bad_prefixes_are_refused_with_a_message(client, capsys, args, says) -> None:
    try:
        code = await cli(client, *args)
    except SystemExit as e:  # argparse's own refusals exit 2
        code = e.code
    assert code != 0
    assert says in capsys.readouterr().err
