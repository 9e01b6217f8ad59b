"""A model is loaded on one thread and runs on another (the worker loads on its start-up
thread, runs on its model thread): whatever arrays it holds must be evaluated at load, not
only its parameters. RoPE variants keep their frequencies in private attributes built in
``__init__`` (``Llama3RoPE._freqs``, YaRN's, Phi-3's longrope): left as graphs on the loading
thread's stream, the first forward on the model thread failed ("There is no Stream(cpu, 0) in
current thread"), and Llama 3.x, YaRN and longrope models, gemma4 and deepseek_v2 could not
start. Also: an MLA family (values narrower than keys) through the CPU's start-up decode
choice, which assumed the two widths equal."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from kvserve_model.tiny_model import ensure_tiny_model
from tests.worker import families
from worker.model.forward_batch import SeqInput
from worker.model.loader import load_model, model_arrays
from worker.model.runner import ModelRunner

LLAMA3_ROPE = {
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 128,
    }
}
YARN = {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}
CASES = [
    ("llama", LLAMA3_ROPE),
    ("qwen2", YARN),
    ("gemma4_text", {}),
    ("deepseek_v2", {}),
    ("deepseek_v3", {}),  # MLA: the CPU's decode choice with values narrower than keys
]
PROMPT = [5, 9, 33, 100, 120, 7, 8, 9, 10, 11, 12]  # ids below families.VOCAB (128)


def write_model(family: str, extra: dict[str, Any], directory: Path) -> Path:
    """``family``'s tiny seeded model with ``extra`` config as a model directory (the tiny
    model's tokenizer beside it)."""
    if family not in families.families():
        pytest.skip(f"this mlx-lm has no {family}")
    cfg = families.config(family)
    cfg.update(extra)
    cfg["text_config"].update(extra)
    original = dict(families.OVERRIDES.get(family, {}))
    families.OVERRIDES[family] = {**original, **extra}
    try:
        model = families.build(family)
    finally:
        families.OVERRIDES[family] = original
    directory.mkdir(parents=True)
    mx.save_safetensors(
        str(directory / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    cfg.update(torch_dtype="float32", eos_token_id=[257], bos_token_id=256)
    (directory / "config.json").write_text(json.dumps(cfg))
    for f in ensure_tiny_model().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, directory / f.name)
    return directory


# transformers reading a tiny config's rope_scaling (the tokenizer's load) warns of its rename.
@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")
@pytest.mark.parametrize(("family", "extra"), CASES, ids=[c[0] for c in CASES])
def test_a_model_loaded_on_one_thread_runs_on_another(family, extra, tmp_path) -> None:
    loaded = load_model(str(write_model(family, extra, tmp_path / family)))
    dense = loaded.model(mx.array([PROMPT]))[0, -1]  # mlx-lm's own forward, where it loaded
    mx.eval(dense)
    out: dict[str, Any] = {}

    def model_thread() -> None:  # a fresh thread, as the worker's model thread is
        try:
            runner = ModelRunner.create(loaded.model, block_size=8, num_blocks=16)
            runner.choose_decode_attention()
            logits = runner.forward([SeqInput(PROMPT, [0, 1], 0)])[0]
            mx.eval(logits)
            out["logits"] = logits
        except Exception as e:  # reported on the test's thread
            out["error"] = e

    t = threading.Thread(target=model_thread)
    t.start()
    t.join()
    assert "error" not in out, repr(out.get("error"))
    assert mx.abs(out["logits"] - dense.astype(mx.float32)).max().item() < 1e-4


def test_model_arrays_includes_what_modules_keep_outside_their_parameters(tmp_path) -> None:
    loaded = load_model(str(write_model("llama", LLAMA3_ROPE, tmp_path / "llama")))
    rope = loaded.model.model.layers[0].self_attn.rope
    held = {id(a) for a in model_arrays(loaded.model)}
    assert id(rope._freqs) in held
    assert {id(p) for _, p in tree_flatten(loaded.model.parameters())} <= held
