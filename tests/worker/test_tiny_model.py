"""The tiny test model: deterministic files, loadable by mlx-lm offline, a byte-level
tokenizer with a chat template, a stable fingerprint, and paged parity on it too."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from kvserve_model.errors import ModelLoadError
from kvserve_model.model_cache import MODEL_DIR_ENV
from kvserve_model.resolve import resolve_model
from kvserve_model.tiny_model import (
    EOS,
    IM_END,
    TINY_MODEL_NAME,
    ensure_tiny_model,
    write_tiny_model,
)
from tests.worker.helpers import TOL, DenseSeq, PagedSeq, decode_together
from worker.model.loader import load_model, model_fingerprint
from worker.model.runner import ModelRunner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / TINY_MODEL_NAME, log=print)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return mlx_lm.load(str(model_dir))


def _digests(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


def test_files_are_byte_for_byte_deterministic(model_dir, tmp_path):
    write_tiny_model(tmp_path / "again")
    assert _digests(tmp_path / "again") == _digests(model_dir)


def test_created_once_with_one_progress_line(tmp_path, monkeypatch):
    lines: list[str] = []
    monkeypatch.setenv(MODEL_DIR_ENV, str(tmp_path / "here"))
    path = resolve_model(TINY_MODEL_NAME)
    assert path == tmp_path / "here" / TINY_MODEL_NAME
    assert ensure_tiny_model(log=lines.append) == path
    assert lines == []  # already there: no second creation
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp dir left


def test_progress_line(tmp_path):
    lines: list[str] = []
    ensure_tiny_model(tmp_path / "m", log=lines.append)
    assert len(lines) == 1 and TINY_MODEL_NAME in lines[0]


def test_loads_as_a_small_fp32_llama(loaded):
    model, tokenizer = loaded
    params = sum(p.size for _, p in tree_flatten(model.parameters()))
    assert 2_000_000 < params < 10_000_000
    assert model.model_type == "llama"
    assert model.model.embed_tokens.weight.dtype == mx.float32
    assert set(tokenizer.eos_token_ids) == {IM_END, EOS}


def test_chat_template_and_byte_tokens(loaded):
    _, tokenizer = loaded
    messages = [{"role": "user", "content": "Héllo 👋"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = tokenizer.decode(ids)
    assert text.startswith("<|begin_of_text|><|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode("Héllo 👋") == list("Héllo 👋".encode())


def test_streaming_detokenizer_waits_for_whole_characters(loaded):
    _, tokenizer = loaded
    detok = tokenizer.detokenizer
    detok.reset()
    seen = []
    for byte in "añ👋z".encode():
        detok.add_token(byte)
        seen.append(detok.text)
    detok.finalize()
    assert detok.text == "añ👋z"
    assert all("\ufffd" not in s for s in seen)  # never a half character
    detok.reset()
    for byte in b"\xff\xfeok":  # not UTF-8 at all: still decodes
        detok.add_token(byte)
    detok.finalize()
    assert detok.text.endswith("ok")


def test_fingerprint_is_stable_and_tracks_config(model_dir, tmp_path):
    fingerprint = model_fingerprint(model_dir)
    assert fingerprint.startswith("sha256:")
    write_tiny_model(tmp_path / "copy")
    assert model_fingerprint(tmp_path / "copy") == fingerprint
    config = json.loads((tmp_path / "copy" / "config.json").read_text())
    config["rope_theta"] = 500000.0
    (tmp_path / "copy" / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(tmp_path / "copy") != fingerprint


def test_load_model_resolves_paths_and_reports_bad_ones(model_dir, tmp_path):
    loaded = load_model(str(model_dir))
    assert loaded.path == model_dir and loaded.fingerprint == model_fingerprint(model_dir)
    with pytest.raises(ModelLoadError):
        resolve_model(str(tmp_path))  # exists, but no config.json


def test_paged_parity_on_the_default_model(loaded):
    model, _ = loaded
    runner = ModelRunner.create(model, num_blocks=16)  # default block size 32
    prompts = [list(b"The quick brown fox"), list(b"jumps over the lazy dog, twice over: ") * 2]
    seqs = [PagedSeq.fresh(p, list(range(8 * i, 8 * i + 8))) for i, p in enumerate(prompts)]
    first = runner.forward([s.take() for s in seqs])
    dense = [DenseSeq(model, p) for p in prompts]
    assert decode_together(runner, seqs, dense, 32, list(first)) <= TOL
