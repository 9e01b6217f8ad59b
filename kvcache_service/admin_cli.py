"""Admin CLI: `kvserve-admin stats|tree|lookup|evict|flush|pin|unpin|check|watch` (the
console script; also `python -m kvcache_service.admin_cli`).

Talks to a running cache service with the admin bearer token (--token or
KVCACHE_ADMIN_TOKEN) and prints readable tables (or --json). A TLS service: --tls-ca (and
--tls-server-name); one that requires client certificates (--tls-client-ca): --tls-cert and
--tls-key too, a pair its client CA signed. Each reads KVCACHE_TLS_*, as the token does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from kvcache_service.admin_view import safe, show_event_message, show_lookup, show_stats, show_tree
from kvcache_service.config import ENV_PREFIX
from kvserve_launch.startup import StartupError
from kvserve_launch.tls import Dialer
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc


def parse_tokens(text: str) -> list[int]:
    """'1,2,3' or '1 2 3' -> [1, 2, 3]."""
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids must be integers: {text!r}") from None


def parse_messages(text: str) -> list[dict[str, str]]:
    """Chat messages from JSON: a list of objects with a string ``role`` and ``content``."""
    try:
        messages = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--messages is not JSON: {e}") from None
    if not isinstance(messages, list) or not messages:
        raise argparse.ArgumentTypeError("--messages: a non-empty JSON list of messages")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise argparse.ArgumentTypeError(f"--messages: each needs a string role: {m!r}")
        if not isinstance(m.get("content", ""), str):
            raise argparse.ArgumentTypeError(f"--messages: content must be a string: {m!r}")
    return [{"role": m["role"], "content": m.get("content", "")} for m in messages]


class Text:
    """The pools' model's tokenizer, loaded on first use (``transformers`` takes a second or
    two to import): the gateway's rules, so a prefix given here is the one its requests send.
    Text is tokenized as a completion prompt is; messages are rendered with the chat template
    without a generation prompt, then tokenized without adding special tokens."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._tok: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tok is None:
            # transformers' import-time advice (no PyTorch: none is needed for a tokenizer)
            # is not for an operator's terminal.
            os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
            from kvserve_model.resolve import resolve_model
            from kvserve_model.tokenizer import load_tokenizer

            self._tok = load_tokenizer(resolve_model(self.model or None))
        return self._tok

    def ids(self, text: str | None, messages: list[dict[str, str]] | None) -> list[int]:
        tok = self.tokenizer
        if text is not None:
            ids = tok.encode(text)
        else:
            if not tok.has_chat_template:
                raise ValueError("the model has no chat template: give --text or token ids")
            rendered = tok.render_chat(messages, add_generation_prompt=False)
            ids = tok.encode(rendered, add_special_tokens=False)
        if not ids:
            raise ValueError("the prefix is empty")
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))


def parser() -> argparse.ArgumentParser:
    """The command line: the service and how to reach it, then one subcommand."""
    p = argparse.ArgumentParser(prog="kvserve-admin", description=__doc__)
    p.add_argument("--address", default=os.environ.get("KVCACHE_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--token", default=os.environ.get("KVCACHE_ADMIN_TOKEN", ""))
    p.add_argument("--json", action="store_true", help="print the raw response as JSON")
    p.add_argument(
        "--model",
        default=os.environ.get("KVSERVE_MODEL", ""),
        help="the pools' model (a directory, a Hugging Face id in the local cache, or the "
        "embedded default model when unset; KVSERVE_MODEL): its tokenizer turns --text and "
        "--messages into token ids and token ids back into text",
    )
    tls = p.add_argument_group("TLS (kvserve_launch.tls; unset: plaintext)")
    for flag, help in (
        ("tls_ca", "PEM CA bundle: reach the service over TLS, its certificate verified"),
        ("tls_server_name", "the name its certificate must carry (default: the host dialed)"),
        ("tls_cert", "PEM client certificate, for a service that requires one"),
        ("tls_key", "PEM private key of --tls-cert"),
    ):
        env = ENV_PREFIX + flag.upper()
        tls.add_argument(
            "--" + flag.replace("_", "-"), default=os.environ.get(env, ""), help=f"{help} ({env})"
        )
    _add_commands(p.add_subparsers(dest="cmd", required=True))
    return p


def _add_commands(sub: Any) -> None:
    """The subcommands (``sub``: the parser's subparsers) and their arguments."""

    def with_pool(name: str, help: str, required: bool = False) -> argparse.ArgumentParser:
        sp: argparse.ArgumentParser = sub.add_parser(name, help=help)
        sp.add_argument("--pool", default="", required=required, help="pool id (worker name)")
        return sp

    with_pool("stats", "blocks, hit rates, evictions and leases per pool")
    sp = with_pool("tree", "the radix index as a tree", required=True)
    sp.add_argument("--namespace", default="")
    sp.add_argument("--max-depth", type=int, default=0)
    sp.add_argument("--ids", action="store_true", help="token ids, not their decoded text")
    for name, help in [
        ("lookup", "dry-run match of a prompt on every pool"),
        ("pin", "protect a prefix from eviction"),
        ("unpin", "undo a pin"),
    ]:
        sp = with_pool(name, help, required=name != "lookup")
        sp.add_argument("--namespace", default="")
        given = sp.add_mutually_exclusive_group(required=True)
        given.add_argument("tokens", nargs="?", type=parse_tokens, help="token ids: '1,2,3'")
        given.add_argument("--text", help="the prefix as text, tokenized with --model")
        given.add_argument(
            "--messages",
            type=parse_messages,
            help='the prefix as chat messages (JSON: [{"role": ..., "content": ...}]), '
            "rendered with --model's chat template, no generation prompt: a system prompt "
            "pinned this way is the prefix of every chat that starts with it",
        )
    sp = with_pool("evict", "evict N blocks, a namespace, or a prefix", required=True)
    target = sp.add_mutually_exclusive_group(required=True)
    target.add_argument("--blocks", type=int)
    target.add_argument("--namespace")
    target.add_argument("--prefix", type=parse_tokens, help="token ids: '1,2,3'")
    target.add_argument("--prefix-text", help="the prefix as text, tokenized with --model")
    target.add_argument(
        "--prefix-messages", type=parse_messages, help="the prefix as chat messages (JSON)"
    )
    sp.add_argument("--prefix-namespace", default="")
    sp = with_pool("flush", "evict every unreferenced, unpinned block")
    sp.add_argument(
        "--tier",
        choices=["host", "disk"],
        help="clear the pools' tier on this medium instead (their workers delete the blocks)",
    )
    sub.add_parser("check", help="verify the block accounting invariants")
    sp = with_pool("watch", "follow the KV events: every block stored in or removed from the index")
    sp.add_argument("--count", type=int, default=0, help="stop after N messages (0: Ctrl-C)")
    sp.add_argument("--ids", action="store_true", help="token ids, not their decoded text")


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if bool(a.tls_cert) != bool(a.tls_key):
        p.error("--tls-cert and --tls-key go together")
    if a.tls_cert and not a.tls_ca:
        p.error("--tls-cert is a client certificate for a TLS service: set --tls-ca too")
    try:
        dialer = Dialer.from_files(a.tls_ca, a.tls_server_name, a.tls_cert, a.tls_key, ENV_PREFIX)
    except StartupError as e:
        print(f"error: {e.message} ({e.hint})", file=sys.stderr)
        return 1

    if not a.token:
        print(
            "error: no admin token: pass --token or set KVCACHE_ADMIN_TOKEN "
            "(`make run` prints it; a service started by hand has its --admin-token)",
            file=sys.stderr,
        )
        return 1
    words = Text(a.model)
    try:
        _tokenize_prefix(a, words)
    except Exception as e:  # a model that cannot load, a template that fails, an empty prefix
        print(f"error: {safe(str(e))}", file=sys.stderr)
        return 1
    with dialer.blocking(a.address) as channel:
        stub = pb_grpc.KVCacheAdminStub(channel)
        md = [("authorization", f"Bearer {a.token}")]
        try:
            if a.cmd == "watch":
                return watch(pb_grpc.KVCacheServiceStub(channel), a, md, words)
            resp, text = call(stub, a, md, words)
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {safe(str(err.details()))}", file=sys.stderr)
            return 1
    print(json.dumps(MessageToDict(resp), indent=2) if a.json else text)
    if isinstance(resp, pb.CheckIntegrityResponse) and not resp.ok:
        return 2
    return 0


def _tokenize_prefix(a: argparse.Namespace, words: Text) -> None:
    """A prefix given as text or messages, as token ids (``a.tokens``, or ``a.prefix``)."""
    if getattr(a, "tokens", None) is None and a.cmd in ("lookup", "pin", "unpin"):
        a.tokens = words.ids(a.text, a.messages)
    if a.cmd == "evict" and (a.prefix_text is not None or a.prefix_messages is not None):
        a.prefix = words.ids(a.prefix_text, a.prefix_messages)


def watch(stub: pb_grpc.KVCacheServiceStub, a: argparse.Namespace, md: list, words: Text) -> int:
    """Prints WatchEvents messages as they come (--count: that many, then stops)."""
    call = stub.WatchEvents(pb.WatchEventsRequest(pool_id=a.pool), metadata=md)
    text = None if a.ids or a.json else words
    try:
        for n, m in enumerate(call, 1):
            out = json.dumps(MessageToDict(m)) if a.json else show_event_message(m, text)
            print(out, flush=True)
            if n == a.count:
                break
    except KeyboardInterrupt:
        pass
    finally:
        call.cancel()
    return 0


def call(
    stub: pb_grpc.KVCacheAdminStub, a: argparse.Namespace, md: list, words: Text
) -> tuple[object, str]:
    if a.cmd == "stats":
        r = stub.GetStats(pb.StatsRequest(pool_id=a.pool), metadata=md)
        return r, show_stats(r)
    if a.cmd == "tree":
        req = pb.InspectTreeRequest(pool_id=a.pool, namespace=a.namespace, max_depth=a.max_depth)
        r = stub.InspectTree(req, metadata=md)
        return r, show_tree(r, None if a.ids or a.json else words)
    if a.cmd == "lookup":
        req = pb.LookupRequest(pool_id=a.pool, namespace=a.namespace, prompt_token_ids=a.tokens)
        r = stub.Lookup(req, metadata=md)
        given_as_text = a.text is not None or a.messages is not None
        return r, show_lookup(r, a.tokens, words if given_as_text else None)
    if a.cmd in ("pin", "unpin"):
        req = pb.PinRequest(
            pool_id=a.pool, prefix=pb.PrefixRef(namespace=a.namespace, token_ids=a.tokens)
        )
        r = (stub.Pin if a.cmd == "pin" else stub.Unpin)(req, metadata=md)
        return r, f"{a.cmd}ned {r.blocks} blocks"
    if a.cmd == "evict":
        if a.blocks is not None:
            req = pb.EvictRequest(pool_id=a.pool, num_blocks=a.blocks)
        elif a.namespace is not None:
            req = pb.EvictRequest(pool_id=a.pool, namespace=a.namespace)
        else:
            prefix = pb.PrefixRef(namespace=a.prefix_namespace, token_ids=a.prefix)
            req = pb.EvictRequest(pool_id=a.pool, prefix=prefix)
        r = stub.Evict(req, metadata=md)
        return r, f"evicted {r.evicted_blocks} blocks"
    if a.cmd == "flush":
        media = {"host": pb.MEDIUM_HOST, "disk": pb.MEDIUM_DISK}
        medium = media[a.tier] if a.tier else pb.MEDIUM_UNSPECIFIED
        r = stub.Flush(pb.FlushRequest(pool_id=a.pool, medium=medium), metadata=md)
        where = f" from the {a.tier} tier" if a.tier else ""
        return r, f"flushed {r.evicted_blocks} blocks{where}"
    r = stub.CheckIntegrity(pb.CheckIntegrityRequest(), metadata=md)
    problems = [safe(p) for p in r.problems]
    text = f"ok: {r.pools_checked} pools checked" if r.ok else "\n".join(["FAILED:", *problems])
    return r, text


if __name__ == "__main__":
    sys.exit(main())
