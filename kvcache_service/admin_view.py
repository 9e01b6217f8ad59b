"""What the admin CLI prints: the service's answers as tables, trees and lines of text.

Every name and token in them comes from workers and clients, not from the operator, so
everything printed goes through :func:`safe`. Token ids are shown as ids, or decoded with a
:class:`Decoder` (the CLI's ``Text``: the pools' tokenizer).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from kvserve_proto.packed_tokens import unpack


class Decoder(Protocol):
    """Token ids to text (the pools' tokenizer)."""

    def decode(self, ids: Sequence[int]) -> str: ...


def safe(text: str) -> str:
    """``text`` as it may reach a terminal: anything non-printable (newlines, escapes that
    would move the cursor or recolor it) escaped as Python writes it. Names come from workers
    and clients, not from the operator."""
    return text if text.isprintable() else repr(text)[1:-1]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[safe(str(h)) for h in headers]] + [[safe(str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def memory(n: int) -> str:
    """Bytes as MiB or GiB; '?' for 0 (a worker that did not report its block size in bytes)."""
    if not n:
        return "?"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


TIER_NAMES = {pb.MEDIUM_HOST: "host", pb.MEDIUM_DISK: "disk"}


def tiers_cell(p: pb.PoolStats) -> str:
    """A pool's tiers as `disk 120/4096` (blocks held of capacity), fastest first; `-`: none."""
    cells = [
        f"{TIER_NAMES.get(t.medium, str(t.medium))} {t.blocks}/{t.capacity_blocks}"
        for t in p.tiers
        if t.medium not in (pb.MEDIUM_UNSPECIFIED, pb.MEDIUM_DEVICE)
    ]
    return " ".join(cells) or "-"


def show_stats(resp: pb.StatsResponse) -> str:
    headers = ["pool", "alive", "blocks", "memory", "free", "cached", "referenced", "pinned"]
    headers += ["peak", "leases", "hit% tok", "hit% req", "evicted", "expired", "deferred"]
    headers += ["exhausted", "tiers", "tier hit tok"]
    rows = [
        [
            p.pool_id,
            "yes" if p.alive else "NO",
            p.num_blocks,
            memory(p.num_blocks * p.bytes_per_block),
            p.free_blocks,
            p.cached_blocks,
            p.referenced_blocks,
            p.pinned_blocks,
            p.peak_used_blocks,
            p.live_leases,
            f"{100 * p.token_hit_rate:.1f}",
            f"{100 * p.request_hit_rate:.1f}",
            p.evicted_blocks,
            p.expired_leases,
            p.deferrals,
            p.exhausted,
            tiers_cell(p),
            p.tier_hit_tokens,
        ]
        for p in resp.pools
    ]
    return table(headers, rows) if rows else "no pools registered"


def show_lookup(resp: pb.LookupResponse, tokens: Sequence[int], text: Decoder | None) -> str:
    """Each pool's dry-run match of ``tokens``; with ``text``, where the best one ends."""
    rows = [
        [
            x.pool_id,
            f"{x.cached_tokens} of {len(tokens)}",
            f"{x.cached_tokens - x.copied_tokens} in {len(x.matched_blocks)}",
            x.copied_tokens,
            x.tier_tokens,
            x.pending_tokens,
            x.blocks_needed,
        ]
        for x in resp.pools
    ]
    heads = ["pool", "cached tokens", "in shared blocks", "copied", "from tiers"]
    heads += ["pending tokens", "blocks needed"]
    out = table(heads, rows)
    if text is not None:
        best = max((x.cached_tokens for x in resp.pools), default=0)
        tail = text.decode(tokens[:best])[-60:]
        out += f"\ncached up to (best pool): ...{repr(tail)[1:-1]}"
    out += (
        "\n(the prompt's last token is always computed; tokens past the shared blocks are "
        "reused by copying a block that matches only in part; tokens from tiers are loaded "
        "from the worker's host memory or disk)"
    )
    return out


def show_tree(resp: pb.InspectTreeResponse, text: Decoder | None = None) -> str:
    if not resp.nodes:
        return "(empty index)"
    by_parent: dict[tuple[str, int], list[pb.TreeNode]] = {}
    for node in resp.nodes:
        by_parent.setdefault((node.namespace, node.parent_id), []).append(node)
    lines: list[str] = []
    now = time.time()

    def walk(ns: str, parent: int, indent: str) -> None:
        for node in sorted(by_parent.get((ns, parent), []), key=lambda n: n.node_id):
            if text is None:
                preview = " ".join(map(str, node.token_preview[:8])) + " ..."
            else:
                preview = repr(text.decode(node.token_preview)[:60])[1:-1] + " ..."
            refs = ",".join(map(str, node.refcounts))
            pin = " pinned" if node.pinned else ""
            age = f"{now - node.last_used_at:.0f}s ago" if node.last_used_at else "never"
            lines.append(
                f"{indent}[{node.node_id}] {node.num_tokens} tokens, blocks "
                f"{list(node.blocks)}, refs {refs}, used {age}{pin}: {preview}"
            )
            walk(ns, node.node_id, indent + "  ")

    for ns in sorted({n.namespace for n in resp.nodes}):
        lines.append(f"namespace {ns!r}:")
        walk(ns, 0, "  ")
    if resp.truncated:
        lines.append(
            f"(truncated at {len(resp.nodes)} nodes: narrow it with --namespace or --max-depth)"
        )
    return "\n".join(lines)


def show_event_message(m: pb.WatchEventsResponse, text: Decoder | None = None) -> str:
    """One WatchEvents message as a line or a few (docs/kv-events.md)."""
    kind = m.WhichOneof("message")
    if kind == "reset":
        reason = pb.EventsReset.Reason.Name(m.reset.reason).removeprefix("REASON_").lower()
        return f"reset ({reason}): a snapshot of the index as of batch {m.reset.cursor.seq}"
    if kind == "synced":
        return f"synced at batch {m.synced.seq} (log {m.synced.log_id}); live from here"
    b = m.batch
    lines = [f"batch {b.cursor.seq}  pool {safe(b.pool_id)} #{b.pool_seq}"]
    for e in b.events:
        which = e.WhichOneof("event")
        if which == "stored":
            s = e.stored
            ids = list(unpack(s.tokens))
            after = f"after {s.parent_block}" if s.HasField("parent_block") else "at the root"
            shown = repr(text.decode(ids))[1:-1] if text is not None else str(ids)
            ns = f" [{safe(s.namespace)}]" if s.namespace else ""
            lines.append(
                f"  stored{ns} {list(s.blocks)} {after}, {len(ids)} tokens: {safe(shown)[:120]}"
            )
        elif which == "removed":
            lines.append(f"  removed {list(e.removed.blocks)}")
        else:
            reason = pb.PoolCleared.Reason.Name(e.cleared.reason).removeprefix("REASON_").lower()
            lines.append(f"  cleared ({reason}, incarnation {b.incarnation})")
    return "\n".join(lines)
