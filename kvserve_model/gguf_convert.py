"""A GGUF file to an mlx-lm model directory, with numpy alone.

LM Studio and Ollama users hold GGUF files; mlx-lm loads directories in the Hugging Face layout.
:func:`ensure_converted` turns one into the other once, into the user's cache, and every later
start finds it there:

- ``config.json`` from the GGUF metadata (``{arch}.block_count``, ``.embedding_length``, ...),
  with a ``quantization`` entry (mlx-lm's: default bits and group size, and one entry per
  module that differs, e.g. an 8-bit embedding beside 4-bit layers);
- ``model.safetensors``: the tensors under mlx-lm's names. Q4_0, Q4_1 and Q8_0 blocks become
  MLX affine quantization (group 32) without dequantizing: a block of 32 weights with scale
  ``d`` (and minimum ``m`` for Q4_1) is exactly MLX's group with scale ``d`` and bias ``-8d``
  (Q4_0), ``m`` (Q4_1) or ``-128d`` (Q8_0, its int8 values shifted to uint8). F32, F16 and BF16
  tensors are copied. llama.cpp stores Llama's Q and K projections with their rows permuted
  for its rotary embedding; they are permuted back, so the directory is what mlx-lm's own
  converter would write from the Hugging Face checkpoint, and rope is mlx-lm's default;
- ``tokenizer.json`` and ``tokenizer_config.json`` (:mod:`kvserve_model.gguf_tokenizer`), the
  chat template included.

Anything else (another architecture, a K-quant or IQ tensor, Llama 3.1's ``rope_freqs``, a
SentencePiece vocabulary) is refused with one line naming it, before anything is written.

The output is written to a temporary sibling and renamed into place: a crash mid-way leaves no
half-written model, and the next start converts again. The directory's name carries the
source's identity (a digest of every byte, cached per user by the file's identity), so a
changed file converts anew. Numpy reads the GGUF through a memory map; the conversion needs no
MLX, so the launcher and the gateway can run it.

One file (about 400 lines) on purpose: one conversion, read top to bottom in the order it
runs: the plan (names, types, refusals), config.json, the tensors; the GGUF reading and the
tokenizer are files of their own (gguf_file.py, gguf_tokenizer.py).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve_model.errors import ModelLoadError
from kvserve_model.fingerprint import file_digest
from kvserve_model.gguf_file import GGMLType, GGUFHeader, TensorInfo, read_header, type_name
from kvserve_model.gguf_tokenizer import tokenizer_files
from kvserve_model.model_cache import build_once, models_dir
from kvserve_model.safetensors_file import Raw, write_safetensors

if TYPE_CHECKING:
    import numpy as np

CONVERTER_VERSION = 1  # bump whenever any converted byte changes
MARKER = "kvserve-gguf.json"
CHECK_QUESTION = "What is the capital of France?"
GROUP = 32  # every ggml block type converted here holds 32 weights

# Bytes per block of 32 weights, for the quantized types converted here.
BLOCK_BYTES = {GGMLType.Q4_0: 18, GGMLType.Q4_1: 20, GGMLType.Q8_0: 34}
CONVERTIBLE = frozenset((GGMLType.F32, GGMLType.F16, GGMLType.BF16, *BLOCK_BYTES))

# GGUF tensor names to mlx-lm's, per layer (blk.N.<key>) and for the whole model.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True, slots=True)
class Arch:
    """How one GGUF architecture maps onto an mlx-lm model type."""

    model_type: str
    hf_class: str
    permute_qk: bool  # llama.cpp's converter permuted Q and K rows for its rope
    allowed: frozenset[str]  # which per-layer tensors (key.suffix) it may have


_BASE = frozenset(f"{k}.weight" for k in LAYER_NAMES if not k.endswith(("q_norm", "k_norm")))
_QKV_BIAS = frozenset(f"attn_{x}.bias" for x in "qkv")
ARCHS = {
    "llama": Arch("llama", "LlamaForCausalLM", True, _BASE | _QKV_BIAS),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", False, _BASE | _QKV_BIAS),
    "qwen3": Arch(
        "qwen3", "Qwen3ForCausalLM", False, _BASE | {"attn_q_norm.weight", "attn_k_norm.weight"}
    ),
}


def ensure_converted(
    gguf: Path,
    *,
    name: str | None = None,
    root: Path | None = None,
    log: Callable[[str], None] | None = None,
    check: Mapping[str, str] | None = None,
) -> Path:
    """The mlx-lm directory converted from ``gguf``, converting it first if it is not there
    yet. ``name``: the directory's name before the source's identity (default: the file's
    stem). ``check``: the question (and the word its greedy answer must contain) that the
    first worker to load the directory asks it through mlx-lm (``worker/model/loader.py``);
    by default :data:`CHECK_QUESTION`, with no word expected, only a finite answer. Raises
    ModelLoadError for a file that cannot be converted."""
    gguf = gguf.expanduser().resolve()
    identity = source_identity(gguf)
    target = (root or models_dir()) / f"{name or gguf.stem}-{identity[:12]}"
    if is_converted(target):
        return target
    header = read_header(gguf)
    plan = plan_conversion(header)  # refuses before anything is written
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    say(f"kvserve: converting {gguf.name} into {target} (once; no download)")
    marker = {
        "source": str(gguf),
        "identity": identity,
        "check": dict(check or {"question": CHECK_QUESTION}),
        "checked": False,
    }
    return build_once(target, lambda tmp: write_model(header, plan, tmp, marker), is_converted)


def is_converted(directory: Path) -> bool:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("converter_version") == CONVERTER_VERSION


def pending_check(directory: Path) -> dict[str, Any] | None:
    """The check a converted directory still waits for (``{"question": ..., "expect": ...}``),
    or None: checked already, or not a converted model."""
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("checked", True):
        return None
    check = marker.get("check")
    return dict(check) if isinstance(check, dict) else None


def mark_checked(directory: Path, answer: str) -> None:
    """Record that ``directory`` passed its check (atomically: the marker is replaced whole)."""
    marker = json.loads((directory / MARKER).read_text())
    marker.update(checked=True, answer=answer)
    tmp = directory / f".{MARKER}.tmp-{os.getpid()}"
    _write_json(tmp, marker)
    os.replace(tmp, directory / MARKER)


def source_identity(path: Path) -> str:
    """sha256 of every byte of the file, and the converter's version. The digest is the one
    the fingerprint takes of a weights file (:func:`kvserve_model.fingerprint.file_digest`),
    cached per user by the file's path, size, times, inode and device: a start after the
    first reads no byte of the file for it. It once hashed the size and the first and last
    MiB only, so a file rewritten in place (same size and header, a tensor's bytes changed)
    kept serving its earlier conversion."""
    try:
        digest = file_digest(path)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    h = hashlib.sha256(digest)
    h.update(f"gguf-source-v2:{CONVERTER_VERSION}".encode())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Plan:
    """What will be written: the config, and each GGUF tensor's mlx-lm name."""

    arch: Arch
    config: dict[str, Any]
    names: dict[str, str]  # GGUF tensor name -> mlx-lm parameter path (with .weight/.bias)


def plan_conversion(header: GGUFHeader) -> Plan:
    """Check everything and build the config; raises ModelLoadError naming the first thing
    that cannot be converted."""
    where = header.path.name
    arch = ARCHS.get(header.architecture)
    if arch is None:
        raise ModelLoadError(
            f"{where}: architecture {header.architecture!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHS))})"
        )
    names = {}
    for info in header.tensors.values():
        if info.ggml_type not in CONVERTIBLE:
            kinds = ", ".join(t.name for t in sorted(CONVERTIBLE))
            raise ModelLoadError(
                f"{where}: tensor {info.name} is {type_name(info.ggml_type)}, "
                f"which is not supported ({kinds} are)"
            )
        names[info.name] = _mlx_name(arch, info.name, where)
    quantized = [t for t in header.tensors.values() if t.ggml_type in BLOCK_BYTES]
    if any(t.shape[-1] % GROUP for t in quantized):
        raise ModelLoadError(f"{where}: a quantized tensor's rows are not whole blocks")
    return Plan(arch, model_config(header, arch), names)


def _mlx_name(arch: Arch, gguf_name: str, where: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in MODEL_NAMES and suffix == "weight":
        return f"{MODEL_NAMES[base]}.weight"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        key = f"{parts[2]}.{suffix}"
        if key in arch.allowed:
            return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    if base == "rope_freqs":
        raise ModelLoadError(f"{where}: Llama 3.1-style rope scaling (rope_freqs) is not supported")
    raise ModelLoadError(f"{where}: tensor {gguf_name} has no place in mlx-lm's {arch.model_type}")


def model_config(header: GGUFHeader, arch: Arch) -> dict[str, Any]:
    """``config.json`` from the metadata (llama.cpp's key names: gguf.md)."""
    where = header.path.name

    def need(key: str) -> Any:
        value = header.get("{arch}." + key)
        if value is None:
            raise ModelLoadError(f"{where}: metadata {header.architecture}.{key} is missing")
        if isinstance(value, list):
            raise ModelLoadError(f"{where}: per-layer {header.architecture}.{key} is not supported")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    kv_heads = header.get("{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ModelLoadError(f"{where}: per-layer attention.head_count_kv is not supported")
    tokens = header.metadata.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(header.get("{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(header.get("{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": int(header.get("{arch}.vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "torch_dtype": _compute_dtype(header),
    }
    if arch.model_type == "qwen2":
        config["attention_bias"] = True
    if (kind := header.get("{arch}.rope.scaling.type")) not in (None, "none"):
        if kind != "linear":
            raise ModelLoadError(f"{where}: rope scaling {kind!r} is not supported (linear is)")
        config["rope_scaling"] = {"type": "linear", "factor": _f32(need("rope.scaling.factor"))}
    for role in ("bos", "eos", "pad"):
        token_id = header.metadata.get(f"tokenizer.ggml.{role}_token_id")
        if isinstance(token_id, int):
            config[f"{role}_token_id"] = token_id
    eot = header.metadata.get("tokenizer.ggml.eot_token_id")
    if isinstance(eot, int) and eot != config.get("eos_token_id"):
        config["eos_token_id"] = [i for i in (config.get("eos_token_id"), eot) if i is not None]
    if quantization := _quantization(header, arch):
        config["quantization"] = config["quantization_config"] = quantization
    return config


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that is that float32 (1e-05, not
    9.999999747378752e-06)."""
    import numpy as np

    return float(str(np.float32(value)))


def _compute_dtype(header: GGUFHeader) -> str:
    """What the model computes in where the device has a choice: bfloat16 if any tensor is,
    else float16 if any tensor or quantization scale is, else float32."""
    kinds = {t.ggml_type for t in header.tensors.values()}
    if GGMLType.BF16 in kinds:
        return "bfloat16"
    return "float32" if kinds <= {GGMLType.F32} else "float16"


def _quantization(header: GGUFHeader, arch: Arch) -> dict[str, Any] | None:
    """mlx-lm's ``quantization``: the most common bit width as the default, an entry for each
    quantized module with another."""
    bits = {
        _module(arch, t.name): 8 if t.ggml_type == GGMLType.Q8_0 else 4
        for t in header.tensors.values()
        if t.ggml_type in BLOCK_BYTES
    }
    if not bits:
        return None
    default = collections.Counter(bits.values()).most_common(1)[0][0]
    entry: dict[str, Any] = {"group_size": GROUP, "bits": default, "mode": "affine"}
    for module, b in sorted(bits.items()):
        if b != default:
            entry[module] = {"group_size": GROUP, "bits": b, "mode": "affine"}
    return entry


def _module(arch: Arch, gguf_name: str) -> str:
    return _mlx_name(arch, gguf_name, "").rpartition(".")[0]


def write_model(header: GGUFHeader, plan: Plan, directory: Path, marker: dict[str, Any]) -> None:
    """Write the converted model into ``directory`` (created)."""
    import numpy as np

    directory.mkdir(parents=True)
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    tensors: dict[str, np.ndarray | Raw] = {}
    heads = {
        "attn_q": plan.config["num_attention_heads"],
        "attn_k": plan.config["num_key_value_heads"],
    }
    for info in header.tensors.values():
        arrays = convert_tensor(info, data)
        kind = info.name.split(".")[-2] if info.name.startswith("blk.") else ""
        if plan.arch.permute_qk and kind in heads and info.name.endswith(".weight"):
            arrays = {k: unpermute_rows(v, heads[kind]) for k, v in arrays.items()}
        path = plan.names[info.name].rpartition(".")[0]
        suffix = plan.names[info.name].rpartition(".")[2]
        for part, array in arrays.items():
            tensors[f"{path}.{part if part != 'weight' else suffix}"] = array
    write_safetensors(directory / "model.safetensors", tensors)
    _write_json(directory / "config.json", plan.config)
    for filename, content in tokenizer_files(
        header, plan.config["max_position_embeddings"]
    ).items():
        _write_json(directory / filename, content)
    _write_json(directory / MARKER, {"converter_version": CONVERTER_VERSION, **marker})


def convert_tensor(info: TensorInfo, data: np.ndarray) -> dict[str, Any]:
    """One GGUF tensor as mlx-lm arrays: ``{"weight": ...}``, plus ``scales`` and ``biases``
    for a quantized one (see the module docstring)."""
    import numpy as np

    kind = GGMLType(info.ggml_type)
    rows, cols = (int(np.prod(info.shape[:-1])), info.shape[-1]) if info.shape else (1, 1)
    if kind in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        item = 4 if kind == GGMLType.F32 else 2
        raw = data[info.offset : info.offset + info.count * item]
        if kind == GGMLType.BF16:
            return {"weight": Raw(raw.view("<u2").reshape(info.shape), "BF16")}
        return {"weight": raw.view("<f4" if item == 4 else "<f2").reshape(info.shape)}
    size = BLOCK_BYTES[kind]
    n_blocks = info.count // GROUP
    blocks = data[info.offset : info.offset + n_blocks * size].reshape(n_blocks, size)
    d = blocks[:, 0:2].copy().view("<f2")[:, 0]
    if kind == GGMLType.Q8_0:
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        weight = q.view("<u4")  # four 8-bit values a word, the first in the low byte
        biases = d * np.float16(-128)
    else:
        qs = blocks[:, 4:] if kind == GGMLType.Q4_1 else blocks[:, 2:]
        # ggml: low nibbles are weights 0-15 of the block, high nibbles 16-31.
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.uint32)
        shifts = np.arange(8, dtype=np.uint32) * 4  # MLX: eight a word, the first lowest
        weight = (q.reshape(n_blocks, 4, 8) << shifts).sum(axis=2, dtype=np.uint32)
        if kind == GGMLType.Q4_1:
            biases = blocks[:, 2:4].copy().view("<f2")[:, 0]
        else:
            biases = d * np.float16(-8)
    per_row = cols // GROUP
    return {
        "weight": weight.reshape(rows, -1),
        "scales": d.reshape(rows, per_row),
        "biases": biases.reshape(rows, per_row),
    }


def unpermute_rows(array: Any, n_heads: int) -> Any:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py``'s ``permute``: each
    head's rows reordered from rotate-half pairs to interleaved ones)."""
    raw = array.array if isinstance(array, Raw) else array
    rows = raw.shape[0]
    out = raw.reshape(n_heads, rows // n_heads // 2, 2, *raw.shape[1:]).swapaxes(1, 2)
    out = out.reshape(raw.shape)
    return Raw(out, array.dtype) if isinstance(array, Raw) else out


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
