"""One forward's inputs and the host-side metadata every layer's cache view shares.

A sequence's token regions in a forward::

    position  0                 start                     end = start + len(token_ids)
              |  already in pool  |  token_ids: computed and written now  |
              '--- read only -----'------------ written ------------------'
    block     block_table[p // block_size], slot p % block_size, for every position p < end

Prefill chunks (any length) and decodes (one token) mix freely in one batch. The batch is
padded to the longest query (N) and to whole key blocks (L = blocks * block_size): padded query
rows write to the trash block and copy the mask of their sequence's last real row (so their
softmax stays finite and no NaN reaches a real row), padded key columns read the trash block and
are masked. Everything here is built once with numpy and shared by every layer.

One file, one object: the tables, write slots, offsets, masks, context groups and kernel inputs
of a forward are views of the same padded batch, each built at most once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from worker.errors import BatchError


@dataclass(frozen=True, slots=True)
class SeqInput:
    """One sequence's share of a forward.

    ``block_table`` must cover positions ``0..end-1``; ``start`` tokens are already in the pool
    (reused prefix or earlier chunks); ``token_ids`` are computed now. Copy-on-write pairs of the
    lease are applied by the caller (``ModelRunner.copy_blocks``) before the first forward.
    ``seq_key`` names the sequence across forwards (the engine passes its lease id): the paged
    path ignores it, the dense runner (``worker.model.dense_runner``) keeps its cache under it.
    """

    token_ids: Sequence[int]
    block_table: Sequence[int]
    start: int
    seq_key: int | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) < 1:
            raise BatchError("a sequence needs at least one new token per forward")
        if self.start < 0:
            raise BatchError(f"start must be >= 0, got {self.start}")

    @property
    def end(self) -> int:
        """Tokens in the pool for this sequence after the forward."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class ContextGroup:
    """Sequences of a batch that compute ``queries`` queries over ``end`` tokens of context;
    ``members`` their rows (None: every row of the batch, in order)."""

    queries: int
    end: int
    members: mx.array | None


@dataclass(frozen=True, slots=True)
class ContextGroups:
    """:meth:`ForwardBatch.context_groups`: the groups, and the permutation that puts their
    rows, concatenated in group order, back in batch order (None: already in order)."""

    groups: tuple[ContextGroup, ...]
    inverse: mx.array | None


class ForwardBatch:
    """Padded token ids, write slots, block tables, offsets and masks for one forward."""

    __slots__ = (
        "_context_groups",
        "_kernel_inputs",
        "_masks",
        "_row_masks",
        "_rows",
        "_traced_ends",
        "block_size",
        "ends",
        "key_blocks",
        "last_index",
        "mask_rank",
        "offset",
        "prefill_kernel",
        "query_len",
        "query_lens",
        "real_size",
        "size",
        "stand_ins",
        "starts",
        "tables",
        "tables_np",
        "tokens",
        "trash_block",
        "write_blocks",
        "write_slots",
    )

    def __init__(
        self,
        seqs: Sequence[SeqInput],
        block_size: int,
        num_blocks: int,
        mask_rank: int = 4,
        key_blocks: int = 0,
        rows: int = 0,
    ) -> None:
        """A compiled decode (``worker.model.compiled_decode``) buckets its shapes, so that a
        growing context or batch does not make a new one every step: ``key_blocks`` pads the
        tables (and the keys, L) to at least this many blocks with the trash block; ``rows``
        pads a decode batch to at least this many rows, each writing and reading only the
        trash block's first slot (a context of one token; their logits are not used)."""
        if not seqs:
            raise BatchError("a forward needs at least one sequence")
        self.mask_rank = mask_rank
        """Dims of an array mask: 4 ``[B, 1, N, L]``, 5 ``[B, 1, 1, N, L]`` for models that
        apply it to grouped-query scores ``[B, kv_heads, rep, N, L]`` (``ModelSpec.mask_rank``)."""
        self.block_size = bs = block_size
        self.trash_block = num_blocks
        self.real_size = len(seqs)
        """The rows that are sequences; those after them pad the batch (``rows``)."""
        pad = max(0, rows - len(seqs))
        if pad and any(len(s.token_ids) != 1 for s in seqs):
            raise BatchError("only a decode batch is padded with rows")
        self.size = len(seqs) + pad
        self.starts = np.array([s.start for s in seqs] + [0] * pad, dtype=np.int64)
        self.query_lens = np.array([len(s.token_ids) for s in seqs] + [1] * pad, dtype=np.int64)
        self.ends = self.starts + self.query_lens
        self.query_len = int(self.query_lens.max())
        self.key_blocks = max(key_blocks, int(-(-self.ends.max() // bs)))
        self.tables_np = self._tables(seqs, num_blocks)
        if pad:
            trash = np.full((pad, self.key_blocks), num_blocks, dtype=np.int32)
            self.tables_np = np.concatenate([self.tables_np, trash])

        self.tokens = mx.array(self._token_ids(seqs, pad))
        blocks, slots = self._write_positions(num_blocks)
        self.write_blocks = mx.array(blocks[:, None, :].astype(np.int32))
        self.write_slots = mx.array(slots[:, None, :].astype(np.int32))
        self.tables = mx.array(self.tables_np[:, None, :])
        self.last_index = mx.array((self.query_lens - 1).astype(np.int32))
        uniform = bool((self.starts == self.starts[0]).all())
        # An int offset when all sequences agree keeps RoPE variants that need ints working.
        self.offset: int | mx.array = (
            int(self.starts[0]) if uniform else mx.array(self.starts.astype(np.int32))
        )
        self._masks: dict[tuple[int | None, bool], Any] = {}
        self._kernel_inputs: tuple[mx.array, mx.array, mx.array] | None = None
        self._context_groups: ContextGroups | None = None
        self._rows: dict[int, mx.array] = {}
        self._row_masks: dict[tuple[int, int], tuple[mx.array, mx.array]] = {}
        self._traced_ends: mx.array | None = None
        self.prefill_kernel: bool | None = None
        """Whether this forward's prefill attention takes the block-table prefill kernel
        (``attention.gpu_prefill``) in its windowless layers; decided by the CUDA backend at
        the first of them, so that they all agree (None: not decided yet)."""
        self.stand_ins = False
        """Whether each layer's cache hands back the new K/V in place of its gathered context
        (``PagedLayerCache.update_and_fetch``): set by the runner for a forward whose
        attention reads the pool by block table (``AttentionBackend.stand_ins``)."""

    def _token_ids(self, seqs: Sequence[SeqInput], pad: int) -> np.ndarray:
        """``[B, N]`` token ids, each row padded with zeros past its queries."""
        n = self.query_len
        if n == 1:  # a decode step: one token each
            return np.array([s.token_ids[0] for s in seqs] + [0] * pad, dtype=np.int32)[:, None]
        tokens = np.zeros((self.size, n), dtype=np.int32)
        for i, s in enumerate(seqs):
            tokens[i, : len(s.token_ids)] = s.token_ids
        return tokens

    def _write_positions(self, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
        """The block and slot ``[B, N]`` each new token's K/V is written to: its position's,
        or for a padded query row the trash block (``num_blocks``); raises if two sequences
        would write one slot."""
        bs, n = self.block_size, self.query_len
        j = np.arange(n)
        real = j[None, :] < self.query_lens[:, None]
        pos = self.starts[:, None] + j[None, :]
        blocks = np.where(
            real,
            np.take_along_axis(self.tables_np, np.minimum(pos // bs, self.key_blocks - 1), 1),
            num_blocks,
        )
        slots = np.where(real, pos % bs, j[None, :] % bs)
        seqs_only = slice(0, self.real_size)  # padding rows all write the trash block
        flat = (blocks * bs + slots)[seqs_only][real[seqs_only]]
        if self.real_size > 1 and len(np.unique(flat)) != len(flat):
            raise BatchError("two sequences of one batch write the same block slot")
        return blocks, slots

    def _tables(self, seqs: Sequence[SeqInput], num_blocks: int) -> np.ndarray:
        """Each sequence's blocks up to its end, padded with the trash block; one numpy
        conversion for the batch (a decode step builds this for every sequence)."""
        bs, width = self.block_size, self.key_blocks
        rows = []
        for i, s in enumerate(seqs):
            need = -(-s.end // bs)
            if len(s.block_table) < need:
                raise BatchError(
                    f"sequence {i}: block table of {len(s.block_table)} blocks cannot hold "
                    f"{s.end} tokens at block size {self.block_size}"
                )
            rows.append([*s.block_table[:need], *[num_blocks] * (width - need)])
        tables = np.array(rows, dtype=np.int64).reshape(len(seqs), width)
        needs = -(-self.ends[: len(seqs)] // bs)
        used = np.arange(width)[None, :] < needs[:, None]
        bad = used & ((tables < 0) | (tables >= num_blocks))
        if bad.any():
            i = int(bad.any(axis=1).argmax())
            raise BatchError(f"sequence {i}: block ids outside 0..{num_blocks - 1}")
        return tables.astype(np.int32)

    @property
    def key_len(self) -> int:
        """Keys returned per sequence: whole blocks up to the longest sequence."""
        return self.key_blocks * self.block_size

    @property
    def is_decode(self) -> bool:
        return self.query_len == 1

    def mask(self, window_size: int | None = None, return_array: bool = False) -> Any:
        """The attention mask for mlx-lm: None, "causal" or bool ``[B, 1, N, L]`` (``[B, 1, 1,
        N, L]`` at ``mask_rank`` 5).

        A sliding window (gemma3's local layers) is applied here: its blocks stay in the pool
        and are gathered, the mask hides what is outside the window.
        """
        key = (window_size, return_array)
        if key not in self._masks:
            self._masks[key] = self._build_mask(window_size, return_array)
        return self._masks[key]

    def bind(
        self,
        tokens: mx.array,
        offset: mx.array,
        write_blocks: mx.array,
        write_slots: mx.array,
        tables: mx.array,
        ends: mx.array,
        query_lens: mx.array,
    ) -> None:
        """Replace every array a decode forward reads with ``mx.compile``'s inputs (the same
        values, as placeholders): a value the trace took from here otherwise would be baked
        into the compiled graph and reused, stale, by every later step of the same shapes.
        ``tables`` ``[B, key_blocks]``, ``ends``/``query_lens`` ``[B]`` int32. From now on
        masks are computed from ``ends`` (:meth:`traced`)."""
        if not self.is_decode:
            raise BatchError("only a decode forward is traced")
        self.tokens = tokens
        self.offset = offset
        self.write_blocks = write_blocks
        self.write_slots = write_slots
        self.tables = tables[:, None, :]
        self._kernel_inputs = (tables, ends, query_lens)
        self._traced_ends = ends
        self._masks = {}
        self._rows = {}
        self._row_masks = {}

    @property
    def traced(self) -> bool:
        """Whether this batch is being traced by ``mx.compile`` (:meth:`bind`): its numpy
        fields hold the traced step's values, which later steps do not share."""
        return self._traced_ends is not None

    def _build_mask(self, window_size: int | None, return_array: bool) -> Any:
        if self._traced_ends is not None:  # one query a sequence, at its last position
            return self._position_mask((self._traced_ends - 1)[:, None], window_size)
        full = bool((self.ends == self.key_len).all() and (self.query_lens == self.query_len).all())
        windowless = window_size is None or window_size >= self.key_len
        if full and windowless and not return_array:
            # Keys are exactly each sequence's context: no padding to hide.
            return None if self.query_len == 1 else "causal"
        # Built from positions in MLX, lazily: attention that rebuilds the mask from positions
        # (the GPU kernels, ``exact_context_attention``) never evaluates it. Built in numpy it
        # cost every such forward its [B, N, L] booleans on the host: a 2,048-token chunk over
        # a 30k prefix, 63M of them, about 70 ms a forward (H100 host), half the step.
        starts = self.offset if isinstance(self.offset, int) else self.offset[:, None]
        rows = mx.arange(self.query_len, dtype=mx.int32)[None, :]  # padded rows repeat the last
        return self._position_mask(starts + mx.minimum(rows, self.last_index[:, None]), window_size)

    def _position_mask(self, q_pos: mx.array, window_size: int | None) -> mx.array:
        """Bool ``[B, 1, N, L]`` (rank ``mask_rank``): key ``k`` is seen by the query at
        position ``q_pos[b, n]`` when ``k <= q_pos`` (and within ``window_size`` of it)."""
        at = q_pos[:, :, None]
        keys = mx.arange(self.key_len, dtype=mx.int32)[None, None, :]
        seen = keys <= at
        if window_size is not None:
            seen = mx.logical_and(seen, keys > at - window_size)
        n = q_pos.shape[1]
        return seen.reshape(self.size, *(1,) * (self.mask_rank - 3), n, self.key_len)

    def mask_window(self, mask: Any) -> tuple[bool, int | None]:
        """Whether ``mask`` is an array :meth:`mask` built for this batch, and for which
        window: attention that computes the mask from positions (``attention.gpu_decode``)
        serves only masks it can rebuild."""
        for (window, _), built in self._masks.items():
            if built is mask and isinstance(built, mx.array):
                return True, window
        return False, None

    def kernel_inputs(self) -> tuple[mx.array, mx.array, mx.array]:
        """Block tables ``[B, key_blocks]``, ``ends`` and ``query_lens`` ``[B]`` (int32) for
        attention kernels that read the pool by block table; built once per forward."""
        if self._kernel_inputs is None:
            self._kernel_inputs = (
                self.tables.reshape(self.size, self.key_blocks),
                mx.array(self.ends.astype(np.int32)),
                mx.array(self.query_lens.astype(np.int32)),
            )
        return self._kernel_inputs

    def context_groups(self) -> ContextGroups:
        """The batch's sequences grouped by (queries, context length), for attention that
        runs one exact-length, causal call per group instead of one call under an array mask
        (``attention.cuda.exact_context_attention``); built once per forward."""
        if self._context_groups is None:
            by_shape: dict[tuple[int, int], list[int]] = {}
            shapes = zip(self.query_lens.tolist(), self.ends.tolist(), strict=True)
            for i, key in enumerate(shapes):
                by_shape.setdefault(key, []).append(i)
            groups = []
            for (n, end), members in by_shape.items():
                whole = len(members) == self.size
                picked = None if whole else mx.array(np.array(members, dtype=np.int32))
                groups.append(ContextGroup(n, end, picked))
            order = [i for members in by_shape.values() for i in members]
            inverse = None
            if order != sorted(order):
                inverse = mx.array(np.argsort(np.array(order)).astype(np.int32))
            self._context_groups = ContextGroups(tuple(groups), inverse)
        return self._context_groups

    def block_rows(self, n_kv_heads: int, blocks_per_head: int) -> mx.array:
        """Row ids ``[B * heads, key_blocks]`` into a pool viewed as ``[heads * blocks_per_head,
        block_size, dim]``, for attention that reads blocks where they lie."""
        if n_kv_heads not in self._rows:
            heads = np.arange(n_kv_heads)[None, :, None] * blocks_per_head
            rows = heads + self.tables_np[:, None, :]
            self._rows[n_kv_heads] = mx.array(
                rows.reshape(self.size * n_kv_heads, self.key_blocks).astype(np.uint32)
            )
        return self._rows[n_kv_heads]

    def row_mask(self, mask: mx.array, n_kv_heads: int) -> mx.array:
        """A decode mask ``[B|1, 1, 1, L]`` repeated per KV head: ``[B * heads, 1, L]``,
        built once per forward and shared by all layers."""
        key = (id(mask), n_kv_heads)
        cached = self._row_masks.get(key)
        if cached is None or cached[0] is not mask:
            rows = mx.broadcast_to(
                mask.reshape(mask.shape[0], 1, 1, mask.shape[-1]),
                (self.size, n_kv_heads, 1, mask.shape[-1]),
            ).reshape(self.size * n_kv_heads, 1, mask.shape[-1])
            cached = (mask, rows)
            self._row_masks[key] = cached
        return cached[1]
