"""A naive reference model of one pool: flat dictionaries, no tree, no clever ordering.

It keys every indexed block by its whole prefix (namespace, tokens from the start through
the block), keeps refcounts as sets of lease ids, and orders evictable blocks by the logical
time they became evictable. The domain tests drive it and the real PoolState with the same
operations and compare them after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Prefix = tuple[str, tuple[int, ...]]


@dataclass
class RefLease:
    ns: str
    tokens: tuple[int, ...]
    table: list[int]
    cached: int
    refs: dict[int, int]  # block -> position
    indexed: int
    inflight: list[Prefix] = field(default_factory=list)
    adopted: bool = False  # its first own block is a tail it took over
    tail: int | None = None  # the block it indexed as a tail at its release


class RefPool:
    def __init__(self, num_blocks: int, block_size: int, quota: int = 0) -> None:
        self.n = num_blocks
        self.bs = block_size
        self.quota = quota
        self.content: dict[int, Prefix] = {}
        self.by_content: dict[Prefix, int] = {}
        self.leases: dict[int, RefLease] = {}
        self.pins: dict[Prefix, list[int]] = {}
        self.stamp: dict[int, int] = {}
        self.clock = 0
        self.allocated: dict[int, str] = {}  # non-free blocks -> namespace charged
        self.inflight: dict[Prefix, int] = {}

    # -- queries ------------------------------------------------------------------------------

    def refcount(self, b: int) -> int:
        return sum(1 for lease in self.leases.values() if b in lease.refs)

    def pinned(self, b: int) -> bool:
        return any(b in blocks for blocks in self.pins.values())

    def evictable(self) -> list[int]:
        return sorted(self.stamp, key=self.stamp.__getitem__)

    def num_free(self) -> int:
        return self.n - len(self.allocated)

    def full_match(self, ns: str, tokens: tuple[int, ...]) -> list[int]:
        out = []
        for k in range(1, len(tokens) // self.bs + 1):
            b = self.by_content.get((ns, tokens[: k * self.bs]))
            if b is None:
                break
            out.append(b)
        return out

    def partial_len(self, ns: str, tokens: tuple[int, ...], full: int) -> int:
        """Longest common prefix of the next block of `tokens` with any indexed block there,
        a full one or a tail (a finished sequence's partial last block)."""
        head = tokens[: full * self.bs]
        seg = tokens[full * self.bs : (full + 1) * self.bs]
        best = 0
        for (cns, ctoks), _b in self.by_content.items():
            if cns != ns or not self._at(ctoks, full) or ctoks[: full * self.bs] != head:
                continue
            n = 0
            while (
                n < len(seg)
                and full * self.bs + n < len(ctoks)
                and seg[n] == ctoks[full * self.bs + n]
            ):
                n += 1
            best = max(best, n)
        return best

    def _at(self, ctoks: tuple[int, ...], pos: int) -> bool:
        """Whether an indexed block keyed by ``ctoks`` is at block position ``pos``."""
        return pos * self.bs < len(ctoks) <= (pos + 1) * self.bs

    def expected_cached(self, ns: str, tokens: tuple[int, ...]) -> tuple[int, list[int]]:
        full = self.full_match(ns, tokens)
        total = len(full) * self.bs + self.partial_len(ns, tokens, len(full))
        return min(total, len(tokens) - 1), full

    def pending(self, ns: str, tokens: tuple[int, ...], cached: int) -> int:
        k = cached // self.bs
        end = k
        while (end + 1) * self.bs <= len(tokens) and (
            ns,
            tokens[: (end + 1) * self.bs],
        ) in self.inflight:
            end += 1
        return max(0, min(end * self.bs, len(tokens) - 1) - cached)

    def indexed_view(self) -> dict[Prefix, int]:
        return dict(self.by_content)

    # -- mutations mirrored from the real pool -----------------------------------------------

    def ref(self, lease: RefLease, b: int, pos: int) -> None:
        if b in lease.refs:
            return
        lease.refs[b] = pos
        self.stamp.pop(b, None)

    def make_evictable(self, b: int) -> None:
        self.stamp[b] = self.clock
        self.clock += 1

    def evict(self, b: int) -> None:
        assert b in self.stamp, f"evicting non-evictable block {b}"
        prefix = self.content.pop(b)
        # A tail (a partial last block) has no descendants: other tails it is a prefix of are
        # its siblings.
        assert len(prefix[1]) % self.bs or not any(
            c[0] == prefix[0] and len(c[1]) > len(prefix[1]) and c[1][: len(prefix[1])] == prefix[1]
            for c in self.by_content
            if c != prefix
        ), f"evicting block {b} that still has indexed descendants"
        del self.by_content[prefix]
        del self.stamp[b]
        del self.allocated[b]

    def add_lease(self, lease_id: int, lease: RefLease) -> None:
        self.leases[lease_id] = lease
        bs = self.bs
        for k in range(lease.cached // bs, len(lease.tokens) // bs):
            key = (lease.ns, lease.tokens[: (k + 1) * bs])
            if key not in self.inflight:
                self.inflight[key] = lease_id
                lease.inflight.append(key)

    def commit(self, lease_id: int, tokens: tuple[int, ...]) -> int:
        lease = self.leases[lease_id]
        if len(tokens) > len(lease.tokens):
            lease.tokens = tokens
        nfull = len(tokens) // self.bs
        for pos in range(lease.indexed, nfull):
            key = (lease.ns, tokens[: (pos + 1) * self.bs])
            canon = self.by_content.get(key)
            if canon is None:
                own = lease.table[pos]
                self.content[own] = key
                self.by_content[key] = own
            elif canon != lease.table[pos]:
                self.ref(lease, canon, pos)
            if self.inflight.get(key) == lease_id:
                del self.inflight[key]
                lease.inflight.remove(key)
        lease.indexed = max(lease.indexed, nfull)
        return lease.indexed * self.bs

    def index_tail(self, lease_id: int, written: tuple[int, ...]) -> None:
        """At release: the partial block the lease wrote last is indexed (a tail), unless it
        reused it, or wrote nothing past what it reused, or a block there already holds its
        tokens (the same tail, a longer one, a full block)."""
        lease = self.leases[lease_id]
        nfull, part = divmod(len(written), self.bs)
        if not part or lease.indexed != nfull:
            return
        if len(written) <= lease.cached and not lease.adopted:
            return
        if nfull >= len(lease.table) or nfull < lease.cached // self.bs:
            return
        b = lease.table[nfull]
        if b in self.content:
            return
        for cns, ctoks in self.by_content:
            if cns == lease.ns and self._at(ctoks, nfull) and ctoks[: len(written)] == written:
                return
        self.content[b] = (lease.ns, written)
        self.by_content[(lease.ns, written)] = b
        lease.tail = b

    def end(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id)
        for key in lease.inflight:
            del self.inflight[key]
        for b, _pos in sorted(lease.refs.items(), key=lambda kv: -kv[1]):
            if self.refcount(b):
                continue
            if b in self.content:
                if not self.pinned(b):
                    self.make_evictable(b)
            else:
                del self.allocated[b]

    def pin(self, key: Prefix, blocks: list[int]) -> None:
        self.pins[key] = blocks
        for b in blocks:
            self.stamp.pop(b, None)

    def unpin(self, key: Prefix) -> None:
        blocks = self.pins.pop(key)
        for b in reversed(blocks):
            if not self.pinned(b) and not self.refcount(b):
                self.make_evictable(b)
