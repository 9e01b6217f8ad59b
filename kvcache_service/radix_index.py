"""The radix index: token prefixes (per namespace) to the ids of blocks holding their KV.

Over 300 lines on purpose: one data structure whose invariants (the tree stays compressed,
sibling keys are distinct first chunks, the block-to-node map agrees with the tree) every
mutation maintains and ``check_integrity`` checks. Split across files, the code that must
keep an invariant would sit away from the code that checks it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvcache_service.ids import BlockId, Namespace, Tokens

# How many sibling blocks a partial (sub-block) match compares at one node. A partial match
# saves less than one block of prefill, so it must not cost a scan of a root with thousands
# of children.
PARTIAL_SCAN_LIMIT = 64


@dataclass(slots=True, eq=False)
class Node:
    """A run of full blocks along one path; the edge label is their tokens.

    `chunks[j]` holds the tokens of `blocks[j]`, one tuple per block, so that evicting a
    tail block, splitting or merging moves references instead of copying token runs.
    Children are keyed by their first chunk, which differs between siblings by construction.
    """

    node_id: int
    parent: Node | None
    chunks: list[Tokens]
    blocks: list[BlockId]
    children: dict[Tokens, Node] = field(default_factory=dict)
    last_used: float = 0.0

    @property
    def tokens(self) -> Tokens:
        return tuple(t for chunk in self.chunks for t in chunk)


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


def common_prefix_len(a: Tokens, b: Tokens) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixIndex:
    """A compressed radix tree per namespace over block-sized token chunks.

    It stores block ids, never KV, and only committed full blocks. Only the lease book (insert
    on commit) and the budget (remove on eviction) mutate it; it does not know about
    refcounts, so callers decide what may be removed.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.roots: dict[Namespace, Node] = {}
        self._where: dict[BlockId, Node] = {}
        self._next_node_id = 1

    def __contains__(self, block: BlockId) -> bool:
        return block in self._where

    def __len__(self) -> int:
        return len(self._where)

    def namespace_of_root(self, node: Node) -> Namespace | None:
        for ns, root in self.roots.items():
            if root is node:
                return ns
        return None

    # -- lookups ------------------------------------------------------------------------------

    def match(self, ns: Namespace, tokens: Tokens) -> Match:
        root = self.roots.get(ns)
        if root is None:
            return Match()
        bs = self.block_size
        matched: list[BlockId] = []
        node, pos = root, 0
        while True:
            key = tokens[pos : pos + bs]
            child = node.children.get(key) if len(key) == bs else None
            if child is None:
                return self._with_partial(matched, tokens, pos, self._candidates(node, key))
            j = 0
            while j < len(child.blocks):
                if tokens[pos : pos + bs] != child.chunks[j]:
                    return self._with_partial(matched, tokens, pos, [(child, j)])
                matched.append(child.blocks[j])
                pos += bs
                j += 1
            node = child

    def _candidates(self, node: Node, key: Tokens) -> list[tuple[Node, int]]:
        if not key:
            return []
        out = []
        for child in node.children.values():
            if child.chunks[0][0] == key[0]:
                out.append((child, 0))
                if len(out) == PARTIAL_SCAN_LIMIT:
                    break
        return out

    def _with_partial(
        self, matched: list[BlockId], tokens: Tokens, pos: int, candidates: list[tuple[Node, int]]
    ) -> Match:
        bs = self.block_size
        seg = tokens[pos : pos + bs]
        best, best_len = None, 0
        for node, j in candidates:
            n = common_prefix_len(seg, node.chunks[j])
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

    def touch(self, blocks: list[BlockId], now: float) -> None:
        seen: set[int] = set()
        for b in blocks:
            node = self._where.get(b)
            if node is not None and node.node_id not in seen:
                seen.add(node.node_id)
                node.last_used = now

    # -- mutations ----------------------------------------------------------------------------

    def insert(self, ns: Namespace, tokens: Tokens, blocks: list[BlockId]) -> list[BlockId]:
        """Indexes full blocks of `tokens`; returns the canonical block at every position.

        Where a prefix is already indexed under another block (two leases computed the same
        prefix), the existing block stays canonical and the caller's block is not indexed.
        """
        bs = self.block_size
        assert len(tokens) == len(blocks) * bs, "insert takes whole blocks"
        root = self.roots.get(ns)
        if root is None:
            root = self.roots[ns] = self._node(None, [], [])
        out: list[BlockId] = []
        node, pos, i = root, 0, 0
        while i < len(blocks):
            key = tokens[pos : pos + bs]
            child = node.children.get(key)
            if child is None:
                rest = blocks[i:]
                chunks = [tokens[p : p + bs] for p in range(pos, len(tokens), bs)]
                if node is not root and not node.children:
                    # Extend a leaf in place: a sequence committed a block at a time stays one
                    # node instead of a chain of one-block nodes.
                    node.chunks.extend(chunks)
                    node.blocks.extend(rest)
                    for b in rest:
                        self._where[b] = node
                else:
                    node.children[key] = self._node(node, chunks, list(rest))
                return out + rest
            j = 0
            while j < len(child.blocks) and i < len(blocks):
                if tokens[pos : pos + bs] != child.chunks[j]:
                    break
                out.append(child.blocks[j])
                i, j, pos = i + 1, j + 1, pos + bs
            if i < len(blocks) and j < len(child.blocks):
                child = self._split(child, j)
            node = child
        return out

    def _node(self, parent: Node | None, chunks: list[Tokens], blocks: list[BlockId]) -> Node:
        node = Node(self._next_node_id, parent, chunks, blocks)
        self._next_node_id += 1
        for b in blocks:
            self._where[b] = node
        return node

    def _split(self, node: Node, j: int) -> Node:
        """Cuts `node` before its j-th block; returns the new upper part."""
        parent = node.parent
        assert parent is not None and 0 < j < len(node.blocks)
        upper = self._node(parent, node.chunks[:j], node.blocks[:j])
        upper.last_used = node.last_used
        parent.children[node.chunks[0]] = upper
        node.chunks = node.chunks[j:]
        node.blocks = node.blocks[j:]
        node.parent = upper
        upper.children[node.chunks[0]] = node
        return upper

    def remove_leaf_block(self, block: BlockId) -> None:
        """Drops the last block of a leaf node (the caller checked it is unreferenced)."""
        node = self._where.pop(block)
        assert node.blocks[-1] == block and not node.children, f"block {block} is not a leaf"
        key = node.chunks[0]
        node.blocks.pop()
        node.chunks.pop()
        if node.blocks:
            return
        parent = node.parent
        assert parent is not None
        del parent.children[key]
        if parent.parent is None:
            if not parent.children:
                ns = self.namespace_of_root(parent)
                if ns is not None:
                    del self.roots[ns]
        elif len(parent.children) == 1:
            self._merge_only_child(parent)

    def _merge_only_child(self, node: Node) -> None:
        """Keeps the tree compressed: a non-root node with one child absorbs it."""
        (child,) = node.children.values()
        node.chunks.extend(child.chunks)
        node.blocks.extend(child.blocks)
        node.last_used = max(node.last_used, child.last_used)
        for b in child.blocks:
            self._where[b] = node
        node.children = child.children
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
        bs = self.block_size
        k = (len(prefix) - 1) // bs  # index of the block holding the prefix's last token
        node, j, pos = root, 0, 0  # position: block j of node (j == len(blocks): its children)
        for _ in range(k):
            seg = prefix[pos : pos + bs]
            if j < len(node.blocks):
                if node.chunks[j] != seg:
                    return []
                j += 1
            else:
                child = node.children.get(seg)
                if child is None:
                    return []
                node, j = child, 1
            pos += bs
        tail = prefix[pos:]
        at_boundary = j == len(node.blocks)
        cands = [(c, 0) for c in node.children.values()] if at_boundary else [(node, j)]
        return [(n, i) for n, i in cands if n.chunks[i][: len(tail)] == tail]

    def check_integrity(self) -> list[str]:
        bs = self.block_size
        problems = []
        seen: dict[BlockId, Node] = {}
        for ns, root in self.roots.items():
            if root.blocks or root.chunks:
                problems.append(f"namespace {ns!r}: root holds blocks")
            for _, node, _depth in self.nodes(ns):
                if not node.blocks:
                    problems.append(f"node {node.node_id} is empty")
                if len(node.chunks) != len(node.blocks) or any(len(c) != bs for c in node.chunks):
                    problems.append(f"node {node.node_id}: chunks do not fill its blocks")
                parent = node.parent
                if parent is None or parent.children.get(node.chunks[0]) is not node:
                    problems.append(f"node {node.node_id} is not under its parent's key")
                if parent is not None and parent.parent is not None and len(parent.children) == 1:
                    problems.append(f"node {node.node_id} is an only child (not compressed)")
                for b in node.blocks:
                    if b in seen:
                        problems.append(f"block {b} indexed twice")
                    seen[b] = node
        if seen.keys() != self._where.keys():
            problems.append("block-to-node map disagrees with the tree")
        elif any(self._where[b] is not n for b, n in seen.items()):
            problems.append("block-to-node map points at the wrong node")
        return problems
