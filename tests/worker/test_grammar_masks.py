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


def test_a_lookahead_fill_consumes_the_tokens_and_the_engine_does_not_again(grammars) -> None:
    """``MaskPrefetch.start_after`` (a lookahead step, its tokens just known) makes each
    matcher consume its token and fills the mask of the state after it; the engine's accept of
    that token does not consume it again (nor wait for the fill), and the loop's ``start``
    keeps the fill. A row whose token the engine drops (``discard_ahead``: lost its lease) or
    replaces (not expected) gets it back, and the fill is made anew. Either way ``take`` gives
    exactly a direct fill of the state now, whose sequence of consumed tokens is the output's."""
    from kvserve_model.sampling_params import SamplingParams
    from kvserve_model.structured_output import StructuredOutput
    from worker.model.grammar import MaskPrefetch, fill_masks
    from worker.model.sampling import RowSampler

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}
    vocab = grammars.vocab_size
    so = StructuredOutput.json_schema(schema)
    samplers = [RowSampler(SamplingParams(max_tokens=64), grammars.matcher(so)) for _ in range(3)]
    outputs: list[list[int]] = [[] for _ in samplers]
    rng = np.random.default_rng(0)
    prefetch = MaskPrefetch()
    for step in range(12):
        matchers = [s.grammar for s in samplers]
        now = fill_masks(matchers, vocab)
        picks = [int(rng.choice(_allowed(now, i))) for i in range(len(samplers))]
        for s, t in zip(samplers, picks, strict=True):
            s.consumed_ahead(t, prefetch.wait)
        prefetch.start_after(list(zip(matchers, picks, strict=True)), vocab)
        case = step % 4  # 0, 1: the usual step; 2: row 0 dropped; 3: row 0 got another token
        for i, (s, t) in enumerate(zip(samplers, picks, strict=True)):
            if i == 0 and case == 2:
                s.discard_ahead()
                continue
            if i == 0 and case == 3:
                others = [x for x in _allowed(now, 0) if x != t]
                t = others[0] if others else t
            s.accept(t)
            outputs[i].append(t)
        assert not any(s.consumed_early for s in samplers)
        prefetch.start(matchers, vocab, [o[-1] if o else -1 for o in outputs])
        order = [2, 0, 1] if step % 2 else [0, 1, 2]
        got = prefetch.take([matchers[i] for i in order], vocab)
        assert got is not None
        assert np.array_equal(got, fill_masks([matchers[i] for i in order], vocab))
        assert prefetch.early == step + 1 - sum(1 for k in range(step + 1) if k % 4 in (2, 3))
        # the matchers hold exactly the output: a fresh one fed it agrees
        for s, out in zip(samplers, outputs, strict=True):
            fresh = grammars.matcher(so)
            assert all(fresh.consume_token(t) for t in out)
            assert np.array_equal(fill_masks([fresh], vocab), fill_masks([s.grammar], vocab))
        if any(m.is_stopped() for m in matchers):
            break


def test_a_refused_token_fails_its_row_alone(grammars) -> None:
    """A token the grammar refuses (never drawn through its mask, but the fill must not depend
    on that): its matcher ends in an error state, as the engine's own consume would leave it,
    and the next sampling fails that row alone; the others' masks are those after their
    tokens."""
    from kvserve_model.sampling_params import SamplingParams
    from kvserve_model.structured_output import StructuredOutput
    from worker.errors import ConstraintFailed
    from worker.model.grammar import MaskPrefetch, fill_masks
    from worker.model.sampling import RowSampler, adjust_logits

    vocab = grammars.vocab_size
    so = StructuredOutput.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    samplers = [RowSampler(SamplingParams(max_tokens=8), grammars.matcher(so)) for _ in range(3)]
    matchers = [s.grammar for s in samplers]
    now = fill_masks(matchers, vocab)
    refused = next(t for t in range(vocab) if t not in set(_allowed(now, 0)))
    picks = [refused, _allowed(now, 1)[0], _allowed(now, 2)[-1]]
    prefetch = MaskPrefetch()
    for s, t in zip(samplers, picks, strict=True):
        s.consumed_ahead(t, prefetch.wait)
    prefetch.start_after(list(zip(matchers, picks, strict=True)), vocab)
    for s, t in zip(samplers, picks, strict=True):
        s.accept(t)
    prefetch.start(matchers, vocab, picks)
    rows = [(i, s, [], 0) for i, s in enumerate(samplers)]
    _, failed = adjust_logits(mx.zeros((3, vocab)), rows, prefetch)
    assert list(failed) == [0] and isinstance(failed[0].error, ConstraintFailed)
    assert not matchers[1].is_error() and not matchers[2].is_error()
