"""Writing a random benchmark model as an mlx-lm model directory (shared by the benchmarks)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any


def save_model(directory: Path, model: Any, config: dict, tokenizer_from: Path) -> int:
    """Writes ``model``'s weights and ``config`` to ``directory`` with the tokenizer files of
    the model directory ``tokenizer_from``; returns the parameter count."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    directory.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps(config))
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, directory / f.name)
    return sum(v.size for v in weights.values())


def make_model(directory: Path, layers: int, hidden: int, dtype: str) -> tuple[Path, int]:
    """A random Llama (untied head) with the byte tokenizer of the embedded default model,
    written to ``directory``: made locally, never downloaded. Its LM head gives every token but
    printable ASCII and newline a zero logit (the others' are random, a few of them always
    positive), so greedy decoding never emits EOS (every request generates its full
    ``max_tokens`` on any server) and every token is a whole character (a streaming server
    sends one event per token, none held back for an incomplete UTF-8 sequence).
    Returns the directory and the parameter count.
    """
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models.llama import Model, ModelArgs

    from kvserve_model.tiny_model import ensure_tiny_model

    base = ensure_tiny_model()
    config = json.loads((base / "config.json").read_text())
    config.update(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p.astype(getattr(mx, dtype)), model.parameters()))
    vocab = config["vocab_size"]  # token id = byte value below 256, then the specials
    allowed = [i == 10 or 32 <= i < 127 for i in range(vocab)]
    mask = mx.array(allowed)[:, None]
    head = model.lm_head.weight
    model.lm_head.weight = mx.where(mask, head, mx.zeros_like(head))
    params = save_model(directory, model, config, base)
    print(f"# model: llama, {layers} layers, hidden {hidden}, {params / 1e6:.1f}M params, {dtype}")
    return directory, params


def add_gpu_model_args(parser: Any) -> None:
    """``--layers``, ``--hidden``, ``--dtype`` of the GPU benchmarks' model (``make_model``): by
    default the ~1B fp16 Llama of issue 14 (22 layers, hidden 2048); a CPU dry run shrinks it
    (``--layers 2 --hidden 128 --dtype float32``)."""
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", default="float16")


def gpu_name() -> str:
    """The GPU's name and memory, from nvidia-smi where there is one, else MLX's device info."""
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.splitlines()
        if line:
            name, memory, driver = (x.strip() for x in line[0].split(","))
            return f"{name} ({memory}, driver {driver})"
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    import mlx.core as mx

    try:
        info = mx.device_info()
        return str(info.get("device_name") or info.get("architecture") or "GPU")
    except Exception:  # an MLX without device_info
        return "GPU"
