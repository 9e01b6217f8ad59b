"""Token masks: the bits llguidance fills select exactly the tokens whose logits survive, on
either unpacking path, for the rows given and no other; and they reach the device intact."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from worker.model import cuda_copy
from worker.model.grammar import MaskUpload, apply_masks


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


def _random_masks(rows: int, words: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)


def test_mask_upload_gives_the_masks_bytes_on_any_device() -> None:
    """Each call's device rows are that call's masks, bit for bit (on a CUDA GPU through the
    pinned buffer, rewritten each call and grown for a wider batch; elsewhere mx.array)."""
    upload = MaskUpload()
    for seed, rows in enumerate([3, 32, 5, 70, 70]):
        masks = _random_masks(rows, 1536, seed)
        got = upload(masks)
        assert got.dtype == mx.int32 and got.shape == masks.shape
        assert np.array_equal(np.asarray(got), masks)
    other = _random_masks(4, 2, 9)  # another vocabulary: another buffer
    assert np.array_equal(np.asarray(upload(other)), other)


def test_masks_applied_through_an_upload_match_the_plain_path() -> None:
    vocab, batch, rows = 49152 + 7, 6, [1, 4]
    masks = _random_masks(len(rows), -(-vocab // 32), 3)
    logits = mx.array(np.random.default_rng(4).normal(size=(batch, vocab)).astype(np.float32))
    plain = np.asarray(apply_masks(logits, rows, masks, on_device=True))
    upload = MaskUpload()
    for _ in range(2):  # the second call rewrites the same device rows
        got = np.asarray(apply_masks(logits, rows, masks, on_device=True, upload=upload))
        assert np.array_equal(got, plain)


@pytest.mark.skipif(not cuda_copy.on_cuda(), reason="needs an NVIDIA GPU (MLX's CUDA backend)")
def test_on_cuda_masks_take_the_driver_copy() -> None:
    upload = MaskUpload()
    upload(_random_masks(2, 8, 0))
    assert upload._staging is not None  # the pinned buffer, not MLX's managed-memory path


@pytest.fixture(scope="module")
def grammars():
    import json

    from kvserve_model.tiny_model import ensure_tiny_model
    from kvserve_model.tokenizer import load_tokenizer
    from worker.model.grammar import Grammars

    path = ensure_tiny_model()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    tok = load_tokenizer(path)
    return Grammars(tok.hf, vocab, [tok.hf.eos_token_id])


def _allowed(masks: np.ndarray, row: int) -> list[int]:
    bits = np.unpackbits(masks[row].view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


def test_a_fill_after_the_tokens_is_kept_only_for_those_tokens(grammars) -> None:
    """``MaskPrefetch.start_after`` (a lookahead step, its tokens just known) fills each
    matcher's mask of the state after its token and leaves the matcher as it was; the loop's
    ``start`` keeps that fill when every matcher then consumed exactly that token, and fills
    anew otherwise; either way ``take`` gives what a direct fill of the state now gives."""
    from kvserve_model.structured_output import StructuredOutput
    from worker.model.grammar import MaskPrefetch, fill_masks

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}
    vocab = grammars.vocab_size
    matchers = [grammars.matcher(StructuredOutput.json_schema(schema)) for _ in range(3)]
    rng = np.random.default_rng(0)
    for step in range(8):
        now = fill_masks(matchers, vocab)
        picks = [int(rng.choice(_allowed(now, i))) for i in range(len(matchers))]
        prefetch = MaskPrefetch()
        prefetch.start_after(list(zip(matchers, picks, strict=True)), vocab)
        prefetch.wait()
        assert np.array_equal(fill_masks(matchers, vocab), now)  # the matchers as they were
        differ = step % 3 == 2  # the loop consumed another token for matcher 0
        consumed = list(picks)
        if differ:
            others = [t for t in _allowed(now, 0) if t != picks[0]]
            if not others:
                continue
            consumed[0] = others[0]
        for m, t in zip(matchers, consumed, strict=True):
            assert m.consume_token(t)
        prefetch.start(matchers, vocab, consumed)
        order = [2, 0, 1] if step % 2 else [0, 1, 2]
        got = prefetch.take([matchers[i] for i in order], vocab)
        assert got is not None
        assert np.array_equal(got, fill_masks([matchers[i] for i in order], vocab))
        assert prefetch.early == (0 if differ else 1) and prefetch.used == 1
        if any(m.is_stopped() for m in matchers):
            break


def test_a_refused_token_leaves_its_matcher_as_it_was(grammars) -> None:
    """A token the grammar refuses (never drawn through its mask, but a fill must not depend
    on that): the early fill leaves every matcher usable, and the others' masks are those of
    the state after their tokens."""
    from kvserve_model.structured_output import StructuredOutput
    from worker.model.grammar import MaskPrefetch, fill_masks

    vocab = grammars.vocab_size
    so = StructuredOutput.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    matchers = [grammars.matcher(so) for _ in range(3)]
    now = fill_masks(matchers, vocab)
    refused = next(t for t in range(vocab) if t not in set(_allowed(now, 0)))
    picks = [refused, _allowed(now, 1)[0], _allowed(now, 2)[-1]]
    prefetch = MaskPrefetch()
    prefetch.start_after(list(zip(matchers, picks, strict=True)), vocab)
    prefetch.wait()
    assert not any(m.is_error() for m in matchers)
    assert np.array_equal(fill_masks(matchers, vocab), now)
    for m, t in zip(matchers[1:], picks[1:], strict=True):
        assert m.consume_token(t)
    got = prefetch.take(matchers[1:], vocab)
    assert got is not None and np.array_equal(got, fill_masks(matchers[1:], vocab))
