"""GGUF files served: converted weights against llama.cpp's and MLX's own readings, the converted
model against the model it was written from, and kvserve's paged path against mlx-lm on it.

Each file is written by llama.cpp's ``gguf`` package from a tiny seeded mlx-lm model
(``tests/worker/helpers.tiny_model``): F32 files must reproduce the original's logits (names,
Q/K permutation, config, tied embeddings), quantized ones the weights llama.cpp's own
dequantizer reads back.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kvserve_model.gguf_convert import convert_tensor, ensure_converted
from kvserve_model.gguf_file import read_header
from tests.model.gguf_files import T, gguf_name, write_gguf
from tests.worker.helpers import CONFIGS, TOL, DenseSeq, PagedSeq, decode_together, tiny_model
from worker.model.loader import load_model
from worker.model.runner import ModelRunner
from worker.model.self_check import tolerance_for

ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
PROMPT = [3, 17, 99, 4, 58, 21, 7, 77, 12, 5, 64, 30, 2]


def _numpy_weights(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


VOCAB = 300  # room for the GGUF's byte-level tokenizer (256 bytes, merges, two specials)


def _model(family: str) -> nn.Module:
    return tiny_model(family, vocab_size=VOCAB)


def _config(family: str) -> dict:
    return {"rope_theta": 10000.0, **CONFIGS[family], "vocab_size": VOCAB}


@pytest.fixture
def models_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVSERVE_MODEL_DIR", str(tmp_path / "models"))
    return tmp_path / "models"


@pytest.mark.parametrize("family", sorted(ARCHS))
def test_f32_gguf_reproduces_the_model_it_was_written_from(family, tmp_path, models_dir):
    model = _model(family)
    path = write_gguf(
        tmp_path / f"{family}.gguf", ARCHS[family], _config(family), _numpy_weights(model)
    )
    converted, _ = mlx_lm.load(str(ensure_converted(path)))
    tokens = mx.array([PROMPT])
    want, got = model(tokens), converted(tokens)
    assert float(mx.abs(want - got).max()) <= 1e-5


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1, T.Q8_0, T.F16])
def test_quantized_weights_are_what_llama_cpp_reads_back(kind, tmp_path, models_dir):
    """Each weight, as mlx-lm loads it from the converted directory and dequantizes it, equals
    ``gguf.quants.dequantize`` of the file's bytes (Q and K rows permuted back)."""
    model = _model("llama")
    weights = _numpy_weights(model)
    path = write_gguf(tmp_path / "m.gguf", "llama", _config("llama"), weights, default_kind=kind)
    converted, _ = mlx_lm.load(str(ensure_converted(path)))
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    modules = dict(converted.named_modules())
    for name, original in weights.items():
        if original.ndim != 2:
            continue
        t = reader[gguf_name(name)]
        expect = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(original.shape)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = _config("llama")[
                "num_attention_heads" if "q_proj" in name else "num_key_value_heads"
            ]
            rows = expect.shape[0]
            expect = (
                expect.reshape(heads, rows // heads // 2, 2, -1)
                .swapaxes(1, 2)
                .reshape(expect.shape)
            )
        m = modules[name.rpartition(".")[0]]
        if hasattr(m, "scales"):
            got = mx.dequantize(
                m.weight,
                m.scales.astype(mx.float32),
                m.biases.astype(mx.float32),
                m.group_size,
                m.bits,
            )
        else:
            got = m.weight.astype(mx.float32)
        np.testing.assert_allclose(np.array(got), expect, rtol=0, atol=1e-6, err_msg=name)
        # and the quantized form is close to the original weights (the quantizer's error only)
        scale = np.abs(original).max()
        assert (
            np.abs(np.array(got) - original).max()
            <= (0.2 if kind in (T.Q4_0, T.Q4_1) else 0.02) * scale
        )


def test_conversion_packs_blocks_as_mlx_reads_gguf(tmp_path):
    """MLX reads Q4_0, Q4_1 and Q8_0 into its own affine layout too (``mx.load``): the
    converter's numpy repacking gives the same arrays, bit for bit."""
    weights = _numpy_weights(_model("qwen2"))  # no permutation: compare tensors as stored
    kinds = {k: (T.Q4_0, T.Q4_1, T.Q8_0)[i % 3] for i, k in enumerate(sorted(weights))}
    path = write_gguf(tmp_path / "m.gguf", "qwen2", _config("qwen2"), weights, kinds)
    mlx_arrays = mx.load(str(path))
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in read_header(path).tensors.items():
        base = name.rpartition(".")[0]
        for part, ours in convert_tensor(info, data).items():
            theirs = np.array(mlx_arrays[name if part == "weight" else f"{base}.{part}"])
            assert theirs.dtype == ours.dtype and theirs.shape == ours.shape, (name, part)
            assert np.array_equal(theirs, ours), (name, part)


@pytest.mark.parametrize("dequantize", ["never", "always"])
def test_a_gguf_model_serves_paged_as_mlx_lm_runs_it(dequantize, tmp_path, models_dir):
    """``load_model`` of a .gguf path (converted, checked, quantized or dequantized), then
    kvserve's paged path against mlx-lm's dense path on the loaded model: the same greedy
    tokens, logits within the suite's tolerance."""
    model = _model("llama")
    kinds = {"model.embed_tokens.weight": T.Q8_0}
    path = write_gguf(
        tmp_path / "m.gguf",
        "llama",
        _config("llama"),
        _numpy_weights(model),
        kinds,
        default_kind=T.Q4_0,
    )
    loaded = load_model(str(path), dequantize=dequantize)
    quantized = [m for _, m in loaded.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert bool(quantized) == (dequantize == "never")
    runner = ModelRunner.create(loaded.model, block_size=8, num_blocks=32)
    prompts = [PROMPT, PROMPT[:5] + [9, 9, 1, 40, 41, 42, 43, 44, 45, 46, 47, 48]]
    seqs = [PagedSeq.fresh(p, list(range(6 * i, 6 * i + 6))) for i, p in enumerate(prompts)]
    first = runner.forward([s.take() for s in seqs])
    dense = [DenseSeq(loaded.model, p) for p in prompts]
    # fp32 on a CPU; on a GPU the model computes in its half-precision dtype (fp16 scales),
    # held to the self-check's tolerance for that dtype.
    dtype = loaded.model.model.norm.weight.dtype
    scale = max(float(mx.abs(d.logits).max()) for d in dense)
    tol = TOL if dtype == mx.float32 else tolerance_for(dtype, scale)
    assert decode_together(runner, seqs, dense, 16, list(first)) <= tol
