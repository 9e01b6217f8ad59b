"""Batch metadata: validation of the engine's input, masks against a brute-force reference."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.helpers import tiny_model
from worker.errors import BatchError
from worker.model.forward_batch import ForwardBatch, SeqInput
from worker.model.runner import ModelRunner
from worker.model.spec import probe

BS = 4
NUM_BLOCKS = 16


@pytest.mark.parametrize(
    ("seqs", "message"),
    [
        ([], "at least one sequence"),
        ([SeqInput([1, 2, 3, 4, 5], [0], 0)], "cannot hold 5 tokens"),
        ([SeqInput([1], [0, NUM_BLOCKS], 4)], "outside"),
        ([SeqInput([1], [-1], 0)], "outside"),
        ([SeqInput([1], [0], 0), SeqInput([1], [NUM_BLOCKS], 0)], "sequence 1: block ids outside"),
        ([SeqInput([1], [3], 2), SeqInput([1, 2], [3], 1)], "same block slot"),
    ],
)
def test_bad_batches_are_rejected(seqs, message):
    with pytest.raises(BatchError, match=message):
        ForwardBatch(seqs, BS, NUM_BLOCKS)


def test_bad_sequences_are_rejected():
    with pytest.raises(BatchError):
        SeqInput([], [0], 0)
    with pytest.raises(BatchError):
        SeqInput([1], [0], -1)


def test_unused_table_entries_are_not_checked():
    ForwardBatch([SeqInput([1], [2, 999], 0)], BS, NUM_BLOCKS)  # block 999 not needed yet


def test_runner_rejects_token_ids_outside_the_vocabulary():
    runner = ModelRunner.create(tiny_model("llama"), block_size=BS, num_blocks=4)
    with pytest.raises(BatchError, match="token ids"):
        runner.forward([SeqInput([128], [0], 0)])


def test_offsets_are_an_int_when_sequences_agree():
    same = ForwardBatch([SeqInput([1], [0, 1], 5), SeqInput([1], [2, 3], 5)], BS, NUM_BLOCKS)
    assert same.offset == 5
    mixed = ForwardBatch([SeqInput([1], [0, 1], 5), SeqInput([1], [2], 2)], BS, NUM_BLOCKS)
    assert mixed.offset.tolist() == [5, 2]


def test_masks_skip_work_only_without_padding():
    full = ForwardBatch([SeqInput([1], [0, 1], 7), SeqInput([1], [2, 3], 7)], BS, NUM_BLOCKS)
    assert full.mask() is None
    assert full.mask(return_array=True).shape == (2, 1, 1, 8)
    assert full.mask(window_size=4) is not None
    prefill = ForwardBatch([SeqInput([1] * 8, [0, 1], 0)], BS, NUM_BLOCKS)
    assert prefill.mask() == "causal"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=4),
    st.one_of(st.none(), st.integers(1, 12)),
)
def test_mask_matches_brute_force(shape, window):
    seqs, first = [], 0
    for start, n in shape:
        blocks = -(-(start + n) // BS)
        seqs.append(SeqInput([1] * n, list(range(first, first + blocks)), start))
        first += blocks
    batch = ForwardBatch(seqs, BS, first)
    mask = np.array(batch.mask(window, return_array=True))
    assert mask.shape == (len(seqs), 1, batch.query_len, batch.key_len)
    for i, s in enumerate(seqs):
        for j in range(batch.query_len):
            q = s.start + min(j, len(s.token_ids) - 1)  # padded rows repeat the last real row
            for k in range(batch.key_len):
                allowed = k <= q and (window is None or k > q - window)
                assert mask[i, 0, j, k] == allowed


def test_an_array_mask_holds_no_host_copy_of_its_booleans():
    """A prefill chunk that ends inside a block gets an array mask, which the GPU kernels and
    the exact-context path never read (they rebuild it from positions). Built in numpy it cost
    each such forward its [B, N, L] booleans on the host: a 2,048-token chunk over a 30k
    prefix took twice as long as one ending on a block boundary (H100). It is built lazily in
    MLX from the positions alone: host memory O(B * N + L), here under 1 MB for 134M keys."""
    n, start = 2048, 63_001  # ends inside a block
    blocks = -(-(start + n) // BS)
    batch = ForwardBatch([SeqInput([1] * n, list(range(blocks)), start)], BS, blocks)
    tracemalloc.start()
    try:
        mask = batch.mask()
        mask_windowed = batch.mask(window_size=1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert mask.shape == (1, 1, n, batch.key_len) == mask_windowed.shape
    assert peak < 1 << 20, f"{peak} bytes traced building the mask"
    # and it is still the mask: the last rows see through their own position, not beyond
    row = np.array(mask[0, 0, -1])
    assert row[: start + n].all() and not row[start + n :].any()


def test_a_rank_5_mask_puts_the_batch_first_for_grouped_query_scores():
    """gemma2 applies the mask to ``[B, kv_heads, rep, N, L]``: a 4-D ``[B, 1, N, L]`` would
    line the batch up with the kv heads."""
    seqs = [SeqInput([1, 2, 3], [0, 1], 2), SeqInput([1], [2], 0)]
    four = ForwardBatch(seqs, BS, NUM_BLOCKS)
    five = ForwardBatch(seqs, BS, NUM_BLOCKS, mask_rank=5)
    assert five.mask().shape == (2, 1, 1, 3, 8)
    assert np.array_equal(np.array(five.mask())[:, 0], np.array(four.mask()))


@pytest.mark.parametrize(("family", "rank"), [("llama", 4), ("gemma3", 4), ("gemma2", 5)])
def test_the_probe_finds_the_mask_layout(family, rank):
    assert probe(tiny_model(family)).mask_rank == rank
