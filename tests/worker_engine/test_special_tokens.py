"""``skip_special_tokens`` leaves every token the tokenizer flags special out of the text: the
named ones (BOS, EOS, pad) and the rest of its added special tokens (a chat template's
``<|im_start|>``, reserved tokens), which Hugging Face's ``all_special_ids`` does not list. The
embedded default model has both kinds; its random weights do generate reserved tokens."""

from __future__ import annotations

import pytest

from kvserve_model.tiny_model import SPECIAL_TOKENS, TINY_MODEL_NAME
from worker.engine.intake import Intake, RequestLimits, special_token_ids
from worker.engine.sampling_params import SamplingParams
from worker.model.loader import load_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_model(TINY_MODEL_NAME).tokenizer


def _intake(tokenizer) -> Intake:
    limits = RequestLimits(max_context=512, vocab_size=264, block_size=16, num_blocks=64)
    return Intake(limits, tokenizer, lambda: 256)


def test_every_flagged_special_token_counts(tokenizer) -> None:
    ids = special_token_ids(tokenizer)
    assert ids == frozenset(range(256, 256 + len(SPECIAL_TOKENS)))
    assert not set(tokenizer.all_special_ids) >= ids  # the case this is about
    assert special_token_ids(object()) == frozenset()  # a tokenizer with neither attribute


@pytest.mark.parametrize("skip", [True, False])
def test_text_leaves_them_out_only_when_asked(tokenizer, skip: bool) -> None:
    reserved, im_start = 256 + SPECIAL_TOKENS.index("<|reserved_2|>"), 258
    seq = _intake(tokenizer).sequence(
        "r", [72, 105], SamplingParams(max_tokens=8, skip_special_tokens=skip), ""
    )
    text = "".join(seq.text.add(t)[0] for t in [65, reserved, 66, im_start, 67]) + seq.text.finish()
    assert text == ("ABC" if skip else "A<|reserved_2|>B<|im_start|>C")
