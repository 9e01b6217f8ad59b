"""Token masks: the bits llguidance fills select exactly the tokens whose logits survive, on
either unpacking path, for the rows given and no other."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from worker.model.grammar import apply_masks


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("vocab", [40, 64, 49152 + 7])
def test_masks_keep_exactly_the_allowed_tokens(on_device: bool, vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    batch, rows = 5, [0, 2, 3]
    words = -(-vocab // 32)
    masks = rng.integers(-(2**31), 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    logits = mx.array(rng.normal(size=(batch, vocab)).astype(np.float32))
    out = np.asarray(apply_masks(logits, rows, masks, on_device=on_device))
    bits = (masks.view(np.uint32)[:, np.arange(vocab) // 32] >> (np.arange(vocab) % 32)) & 1
    for k, row in enumerate(rows):
        allowed = bits[k].astype(bool)
        assert np.array_equal(np.isfinite(out[row]), allowed)
        assert np.array_equal(out[row][allowed], np.asarray(logits)[row][allowed])
    for row in set(range(batch)) - set(rows):  # unconstrained rows: untouched
        assert np.array_equal(out[row], np.asarray(logits)[row])
