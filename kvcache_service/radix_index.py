"""The radix index: token prefixes (per namespace) to the ids of blocks holding their KV.

Over 400 lines on purpose: one data structure whose invariants (the tree stays compressed,
sibling keys are distinct first chunks, grouped again by first token, the block-to-node map
agrees with the tree, a chain hash per block) every mutation maintains and
``check_integrity`` checks. Split across files, the code that must
keep an invariant would sit away from the code that checks it.
"""

from __future__ import annotations

from collections.abc import Iterator, KeysView
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

from kvcache_service.ids import BlockId, Namespace, Tokens
from kvcache_service.tokens import TOKEN_BYTES, TokenChunks, count, unpack

# How many sibling blocks a partial (sub-block) match compares at one node. A partial match
# saves less than one block of prefill, so it must not cost a scan of a root with thousands
# of children.
PARTIAL_SCAN_LIMIT = 64


@dataclass(slots=True, eq=False)
class Node:
    """A run of full blocks along one path; the edge label is their tokens. Or a **tail**: one
    block holding fewer tokens than a block's, a finished sequence's last partial block (see
    ``RadixIndex.insert_tail``), always a leaf.

    `edge` holds the packed tokens of `blocks`, block after block: a whole edge compares with
    a prompt in one memcmp, and splitting, merging or dropping the tail block slices it (C
    speed, where one tuple per block meant a Python step per block).
    Children are keyed by their first block's tokens, which differ between siblings by
    construction, and grouped again by their first token (`by_first`, in the same order), so
    that a partial match looks only at the siblings sharing that token: the scan of every
    child it replaces took ~5 us an acquire at a root of a few hundred children.
    """

    node_id: int
    parent: Node | None
    namespace: Namespace
    edge: bytes
    blocks: list[BlockId]
    hashes: list[int]  # the chain hash of each block (inflight.chain_hashes)
    children: dict[bytes, Node] = field(default_factory=dict)
    by_first: dict[bytes, dict[bytes, Node]] = field(default_factory=dict)
    last_used: float = 0.0

    @property
    def chunks(self) -> TokenChunks:
        """The token ids of each block (decoded when read; for the admin tools and tests)."""
        return TokenChunks(self.edge, len(self.edge) // max(1, len(self.blocks)))

    @property
    def tokens(self) -> tuple[int, ...]:
        return unpack(self.edge)

    @property
    def num_tokens(self) -> int:
        return len(self.edge) // TOKEN_BYTES


@dataclass(frozen=True, slots=True)
class Match:
    """The longest indexed prefix of a prompt.

    `blocks` are fully matching blocks, root first. `partial_block`, when set, is the next
    indexed block whose first `partial_tokens` tokens also match: a lease may share it by
    copying it into a fresh block before writing the rest.
    """

    blocks: tuple[BlockId, ...] = ()
    partial_block: BlockId | None = None
    partial_tokens: int = 0

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size + self.partial_tokens


def common_units(a: bytes, a_pos: int, b: bytes, b_pos: int, limit: int, unit: int) -> int:
    """How many `unit`-byte units (at most `limit`) `b` repeats of `a`, from `b_pos` and
    `a_pos`. Matching is prefix-closed, so a binary search of memcmps finds it: ~7 for a
    64-block edge where a loop over its blocks took 64 slices and compares. Views, not
    slices: an edge can hold 32 KB."""
    view = memoryview(a)
    if b.startswith(view[a_pos : a_pos + limit * unit], b_pos):
        return limit
    lo, hi = 0, limit - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(view[a_pos : a_pos + mid * unit], b_pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class IndexListener(Protocol):
    """Told of every block that enters or leaves the index (events.PoolRecorder)."""

    def stored(
        self, ns: Namespace, parent: BlockId | None, blocks: list[BlockId], tokens: bytes
    ) -> None:
        """``blocks`` entered along one path after ``parent`` (None: at the root), holding
        ``tokens`` (block after block; the last may be a tail's fewer)."""

    def removed(self, blocks: list[BlockId]) -> None:
        """``blocks`` left, in turn, each a leaf when it went."""


class RadixIndex:
    """A compressed radix tree per namespace over block-sized token chunks.

    It stores block ids, never KV: committed full blocks, with each block's chain hash
    (inflight.chain_hashes: a hash of the whole prefix through it), computed once when the
    block is indexed, so that an acquire hashes only the blocks it did not match; and tails,
    the partial last blocks of finished sequences (a chat's next turn reuses all of its
    history, copying the tail on write). Only the lease book (insert on commit, insert_tail on
    release) and the budget (remove on eviction) mutate it; it does not know about
    refcounts, so callers decide what may be removed.

    ``listener``, when set, hears of every block that enters (insert, insert_tail) or leaves
    (remove_leaves): the only three places a block's membership changes, so the KV events
    (events.py) cannot miss one. Splits and merges only regroup blocks into nodes.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.chunk_bytes = block_size * TOKEN_BYTES
        self.roots: dict[Namespace, Node] = {}
        self._where: dict[BlockId, Node] = {}
        self._next_node_id = 1
        self.listener: IndexListener | None = None

    def __contains__(self, block: BlockId) -> bool:
        return block in self._where

    def __len__(self) -> int:
        return len(self._where)

    @property
    def indexed(self) -> KeysView[BlockId]:
        """The indexed blocks, a live view (`in` at C speed, where `in self` is a call)."""
        return self._where.keys()

    # -- lookups ------------------------------------------------------------------------------

    def match(self, ns: Namespace, tokens: Tokens) -> Match:
        root = self.roots.get(ns)
        if root is None:
            return Match()
        cb = self.chunk_bytes
        matched: list[BlockId] = []
        node, pos = root, 0
        while True:
            key = tokens[pos : pos + cb]
            child = node.children.get(key) if len(key) == cb else None
            if child is None:
                return self._with_partial(matched, tokens, pos, self._candidates(node, key))
            if tokens.startswith(child.edge, pos):  # the whole edge: the common case
                matched += child.blocks
                pos += len(child.edge)
                node = child
                continue
            # The prompt leaves this edge (or ends) after j whole blocks; its first matched.
            j = 1 + common_units(child.edge, cb, tokens, pos + cb, len(child.blocks) - 1, cb)
            matched += child.blocks[:j]
            return self._with_partial(matched, tokens, pos + j * cb, [(child, j)])

    def _candidates(self, node: Node, key: bytes) -> list[tuple[Node, int]]:
        siblings = node.by_first.get(key[:TOKEN_BYTES]) if key else None
        if not siblings:
            return []
        return [(child, 0) for child in islice(siblings.values(), PARTIAL_SCAN_LIMIT)]

    def _with_partial(
        self, matched: list[BlockId], tokens: Tokens, pos: int, candidates: list[tuple[Node, int]]
    ) -> Match:
        seg = tokens[pos : pos + self.chunk_bytes]
        limit = len(seg) // TOKEN_BYTES
        best, best_len = None, 0
        for node, j in candidates:
            n = common_units(seg, 0, node.edge, j * self.chunk_bytes, limit, TOKEN_BYTES)
            if n > best_len:
                best, best_len = node.blocks[j], n
        return Match(tuple(matched), best, best_len)

    def block_path(self, block: BlockId) -> tuple[Node, int]:
        node = self._where[block]
        return node, node.blocks.index(block)

    def parent_block(self, block: BlockId) -> BlockId | None:
        node, j = self.block_path(block)
        if j > 0:
            return node.blocks[j - 1]
        parent = node.parent
        return parent.blocks[-1] if parent is not None and parent.blocks else None

    def chain_hash(self, block: BlockId) -> int:
        """The chain hash of an indexed block: of its whole prefix, namespace included."""
        node = self._where[block]
        blocks = node.blocks
        return node.hashes[len(blocks) - 1 if blocks[-1] == block else blocks.index(block)]

    def touch(self, block: BlockId, now: float) -> None:
        """Marks the nodes from `block`'s up to the root used at `now`: every node holding a
        block of the path to `block`, one step per node rather than one per block."""
        node = self._where.get(block)
        while node is not None and node.parent is not None:
            node.last_used = now
            node = node.parent

    # -- mutations ----------------------------------------------------------------------------

    def insert(
        self,
        ns: Namespace,
        tokens: Tokens,
        start: int,
        after: BlockId | None,
        blocks: list[BlockId],
        hashes: list[int],
    ) -> list[BlockId]:
        """Indexes `blocks`, the full blocks of `tokens` from position `start` on (`hashes`:
        their chain hashes); returns the canonical block at each of their positions.

        `after` is the canonical block at `start - 1` (None when `start` is 0), which the
        caller holds referenced, so it is indexed and its path spells `tokens` up to it: a
        lease's commit walks only what it adds, never from the root again. Where a prefix is
        already indexed under another block (two leases computed the same prefix), the
        existing block stays canonical and the caller's block is not indexed.
        """
        cb = self.chunk_bytes
        assert (after is None) == (start == 0), "`after` is the block before `start`"
        node, j = self._walk_from(ns, after)  # j: blocks of `node` the walk has passed
        pos = start * cb  # where the walk is in `tokens`
        end = pos + len(blocks) * cb
        assert end <= len(tokens), "insert takes whole blocks"
        out: list[BlockId] = []
        i, n = 0, len(blocks)
        while i < n:
            if j < len(node.blocks):
                k = common_units(
                    node.edge, j * cb, tokens, pos, min(n - i, len(node.blocks) - j), cb
                )
                out += node.blocks[j : j + k]
                i, j, pos = i + k, j + k, pos + k * cb
                if i == n:
                    break
                if j < len(node.blocks):
                    node = self._split(node, j)
            key = tokens[pos : pos + cb]
            child = node.children.get(key)
            if child is None:
                rest = blocks[i:]
                if self.listener is not None:
                    # `out` holds the canonical block of each position walked so far.
                    parent = out[-1] if out else after
                    self.listener.stored(ns, parent, rest, tokens[pos:end])
                if node.parent is not None and not node.children:
                    # Extend a leaf in place: a sequence committed a block at a time stays one
                    # node instead of a chain of one-block nodes.
                    node.edge += tokens[pos:end]
                    node.blocks += rest
                    node.hashes += hashes[i:]
                    self._where.update(dict.fromkeys(rest, node))
                else:
                    self._link(node, key, self._node(node, tokens[pos:end], rest, hashes[i:]))
                return out + rest
            node, j = child, 0
        return out

    def _walk_from(self, ns: Namespace, after: BlockId | None) -> tuple[Node, int]:
        """Where a walk resumes just past indexed block ``after`` (at ``ns``'s root when
        None): the node, and how many of its blocks are behind."""
        if after is None:
            return self.roots.get(ns) or self._root(ns), 0
        node = self._where[after]
        return node, len(node.blocks) if node.blocks[-1] == after else node.blocks.index(after) + 1

    def insert_tail(
        self, ns: Namespace, tokens: Tokens, start: int, after: BlockId | None, block: BlockId
    ) -> bool:
        """Indexes ``block`` as a tail: it holds ``tokens`` past block ``start`` (fewer than a
        block's worth), after ``after``, the canonical block at ``start - 1`` (None at the
        start). A partial match reuses it like the head of any indexed block: copied on write.

        A tail hangs where a node ends, so ``after`` inside a node splits it there. Nothing is
        indexed (False) when a block there already holds these tokens: the same tail, a
        longer one, or a full block. Tails are leaves: nothing is ever indexed below one.
        """
        cb = self.chunk_bytes
        part = tokens[start * cb :]
        assert 0 < len(part) < cb, "a tail holds part of a block"
        assert (after is None) == (start == 0), "`after` is the block before `start`"
        node, j = self._walk_from(ns, after)
        if j < len(node.blocks):
            if node.edge.startswith(part, j * cb):
                return False  # the node's next block holds them
            node = self._split(node, j)
        for child in node.by_first.get(part[:TOKEN_BYTES], {}).values():
            if child.edge.startswith(part):
                return False
        self._link(node, part, self._node(node, part, [block], [0]))
        if self.listener is not None:
            self.listener.stored(ns, after, [block], part)
        return True

    def _root(self, ns: Namespace) -> Node:
        root = self.roots[ns] = Node(self._next_node_id, None, ns, b"", [], [])
        self._next_node_id += 1
        return root

    def _node(self, parent: Node, edge: bytes, blocks: list[BlockId], hashes: list[int]) -> Node:
        node = Node(self._next_node_id, parent, parent.namespace, edge, blocks, hashes)
        self._next_node_id += 1
        self._where.update(dict.fromkeys(blocks, node))
        return node

    def _split(self, node: Node, j: int) -> Node:
        """Cuts `node` before its j-th block; returns the new upper part."""
        parent = node.parent
        assert parent is not None and 0 < j < len(node.blocks)
        cut = j * self.chunk_bytes
        upper = self._node(parent, node.edge[:cut], node.blocks[:j], node.hashes[:j])
        upper.last_used = node.last_used
        self._link(parent, node.edge[: self.chunk_bytes], upper)  # in place of `node`
        node.edge = node.edge[cut:]
        del node.blocks[:j], node.hashes[:j]
        node.parent = upper
        self._link(upper, node.edge[: self.chunk_bytes], node)
        return upper

    @staticmethod
    def _link(parent: Node, key: bytes, child: Node) -> None:
        """`child` under `parent` at `key` (a new key, or in place of the node there)."""
        parent.children[key] = child
        parent.by_first.setdefault(key[:TOKEN_BYTES], {})[key] = child

    @staticmethod
    def _unlink(parent: Node, key: bytes) -> None:
        del parent.children[key]
        siblings = parent.by_first[key[:TOKEN_BYTES]]
        del siblings[key]
        if not siblings:
            del parent.by_first[key[:TOKEN_BYTES]]

    def remove_leaf_block(self, block: BlockId) -> None:
        """Drops the last block of a leaf node (the caller checked it is unreferenced)."""
        self.remove_leaves([block])

    def remove_leaves(self, blocks: list[BlockId]) -> None:
        """Drops `blocks` in turn, each the last block of a leaf when its turn comes (the
        eviction order's invariant; the caller checked they are unreferenced).

        A run of them that is one node's tail (what the LRU order yields: a sequence's blocks
        enter it deepest first) is cut in one step, so a block costs one dict deletion.
        """
        if self.listener is not None:
            self.listener.removed(blocks)
        where, cb = self._where, self.chunk_bytes
        i, n = 0, len(blocks)
        while i < n:
            node = where[blocks[i]]
            nb = node.blocks
            top = len(nb) - 1
            assert nb[top] == blocks[i] and not node.children, f"block {blocks[i]} is no leaf"
            k = min(n - i, len(nb))
            if blocks[i : i + k] != nb[len(nb) - k :][::-1]:
                k = 1  # the run ends inside this node: find where
                while i + k < n and k <= top and blocks[i + k] == nb[top - k]:
                    k += 1
            for b in blocks[i : i + k]:
                del where[b]
            i += k
            cut = len(nb) - k
            del nb[cut:], node.hashes[cut:]
            if nb:
                node.edge = node.edge[: len(nb) * cb]
                continue
            parent = node.parent
            assert parent is not None
            self._unlink(parent, node.edge[:cb])
            if parent.parent is None:
                if not parent.children:
                    del self.roots[parent.namespace]
            elif len(parent.children) == 1 and not self.is_tail(
                next(iter(parent.children.values()))
            ):
                self._merge_only_child(parent)

    def is_tail(self, node: Node) -> bool:
        return len(node.edge) < self.chunk_bytes

    def holds_tail(self, block: BlockId) -> bool:
        """Whether ``block`` is indexed as a tail (see insert_tail)."""
        node = self._where.get(block)
        return node is not None and self.is_tail(node)

    def _merge_only_child(self, node: Node) -> None:
        """Keeps the tree compressed: a non-root node with one child absorbs it (not a tail:
        a tail hangs where its parent ends)."""
        (child,) = node.children.values()
        node.edge += child.edge
        node.blocks += child.blocks
        node.hashes += child.hashes
        node.last_used = max(node.last_used, child.last_used)
        self._where.update(dict.fromkeys(child.blocks, node))
        node.children, node.by_first = child.children, child.by_first
        for grandchild in node.children.values():
            grandchild.parent = node

    # -- walks --------------------------------------------------------------------------------

    def nodes(self, ns: Namespace | None = None) -> Iterator[tuple[Namespace, Node, int]]:
        """Every non-root node with its namespace and depth (1 under the root), parents first."""
        for name, root in list(self.roots.items()):
            if ns is not None and name != ns:
                continue
            stack = [(c, 1) for c in root.children.values()]
            while stack:
                node, depth = stack.pop()
                yield name, node, depth
                stack.extend((c, depth + 1) for c in node.children.values())

    def runs(self) -> Iterator[tuple[Namespace, BlockId | None, list[BlockId], bytes]]:
        """Every node as a run (namespace, parent block, blocks, tokens), parents first: the
        whole index as the events that would build it (a KV-event snapshot)."""
        for ns, node, _depth in self.nodes():
            parent = node.parent
            yield (
                ns,
                parent.blocks[-1] if parent and parent.blocks else None,
                node.blocks,
                node.edge,
            )

    def blocks_leaves_first(self, start: Node, first: int = 0) -> list[BlockId]:
        """Blocks of `start` from index `first`, and of all its descendants, deepest first."""
        out: list[BlockId] = []
        stack: list[tuple[Node, int, bool]] = [(start, first, False)]
        while stack:
            node, j, expanded = stack.pop()
            if expanded:
                out.extend(reversed(node.blocks[j:]))
                continue
            stack.append((node, j, True))
            stack.extend((c, 0, False) for c in node.children.values())
        return out

    def subtrees_under(self, ns: Namespace, prefix: Tokens) -> list[tuple[Node, int]]:
        """Starting points (node, block index) of every indexed sequence extending `prefix`.

        Blocks that end strictly inside the prefix are shared ancestors and are not included:
        evicting a prefix must not take the sequences that merely share its first blocks.
        """
        root = self.roots.get(ns)
        if root is None or not prefix:
            return []
        cb = self.chunk_bytes
        k = (count(prefix) - 1) // self.block_size  # the block holding the prefix's last token
        node, j, pos = root, 0, 0  # position: block j of node (j == len(blocks): its children)
        for _ in range(k):
            seg = prefix[pos : pos + cb]
            if j < len(node.blocks):
                if node.edge[j * cb : (j + 1) * cb] != seg:
                    return []
                j += 1
            else:
                child = node.children.get(seg)
                if child is None:
                    return []
                node, j = child, 1
            pos += cb
        tail = prefix[pos:]
        at_boundary = j == len(node.blocks)
        cands = [(c, 0) for c in node.children.values()] if at_boundary else [(node, j)]
        return [(n, i) for n, i in cands if n.edge.startswith(tail, i * cb)]

    def check_integrity(self) -> list[str]:
        cb = self.chunk_bytes
        problems = []
        seen: dict[BlockId, Node] = {}
        for ns, root in self.roots.items():
            if root.blocks or root.edge:
                problems.append(f"namespace {ns!r}: root holds blocks")
            if root.namespace != ns:
                problems.append(f"namespace {ns!r}: root names another namespace")
            if not _grouped_alike(root):
                problems.append(f"namespace {ns!r}: root's children grouped by first token differ")
            for _, node, _depth in self.nodes(ns):
                if not _grouped_alike(node):
                    problems.append(f"node {node.node_id}: children grouped by first token differ")
                if not node.blocks:
                    problems.append(f"node {node.node_id} is empty")
                if self.is_tail(node):
                    if len(node.blocks) != 1 or not node.edge or node.children:
                        problems.append(f"tail {node.node_id} is not one partial block, a leaf")
                elif len(node.edge) != len(node.blocks) * cb:
                    problems.append(f"node {node.node_id}: its edge does not fill its blocks")
                if len(node.hashes) != len(node.blocks):
                    problems.append(f"node {node.node_id}: a chain hash per block is missing")
                parent = node.parent
                if parent is None or parent.children.get(node.edge[:cb]) is not node:
                    problems.append(f"node {node.node_id} is not under its parent's key")
                if (
                    parent is not None
                    and parent.parent is not None
                    and len(parent.children) == 1
                    and not self.is_tail(node)
                ):
                    problems.append(f"node {node.node_id} is an only child (not compressed)")
                if node.namespace != ns:
                    problems.append(f"node {node.node_id} names another namespace")
                for b in node.blocks:
                    if b in seen:
                        problems.append(f"block {b} indexed twice")
                    seen[b] = node
        if seen.keys() != self._where.keys():
            problems.append("block-to-node map disagrees with the tree")
        elif any(self._where[b] is not n for b, n in seen.items()):
            problems.append("block-to-node map points at the wrong node")
        return problems


def _grouped_alike(node: Node) -> bool:
    """Whether `node.by_first` groups exactly its children, each group in their order."""
    expected: dict[bytes, dict[bytes, Node]] = {}
    for key, child in node.children.items():
        expected.setdefault(key[:TOKEN_BYTES], {})[key] = child

    def items(groups: dict[bytes, dict[bytes, Node]]) -> dict[bytes, list[tuple[bytes, Node]]]:
        return {first: list(group.items()) for first, group in groups.items()}

    return items(node.by_first) == items(expected)
