"""Tiny GGUF files written with llama.cpp's own Python package (``gguf``), for the converter's
tests: an implementation of the format and of its quantizers independent of the one under test.

:func:`write_gguf` takes weights under mlx-lm's names (numpy float32) and writes them the way
llama.cpp's ``convert_hf_to_gguf.py`` does: GGUF names, Llama's Q and K rows permuted for its
rope (:func:`llama_cpp_permute`, that script's ``permute``), each 2-D weight in the type asked
for, norms and biases as F32; metadata under the architecture's keys; a small byte-level BPE
tokenizer (256 byte tokens, a few merges, two control tokens and a ChatML template).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

T = gguf.GGMLQuantizationType

# mlx-lm's names to GGUF's (the mapping llama.cpp's converter applies, spelled out here).
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_MODEL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

SPECIALS = ("<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return [chr(chars[b]) for b in range(256)]


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE of ``vocab_size`` tokens: bytes, merges of common English pairs, the
    two control tokens last, padded with unused merges' results."""
    alphabet = byte_alphabet()
    space = alphabet[ord(" ")]
    merges = [f"{space} t", "h e", f"{space}t he", "i n", f"{space} a", "e r", "o n", "r e"]
    tokens = list(alphabet)
    for m in merges:
        tokens.append(m.replace(" ", ""))
    n_plain = vocab_size - len(SPECIALS)
    if len(tokens) > n_plain:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the byte alphabet")
    while len(tokens) < n_plain:
        tokens.append(f"<unused{len(tokens)}>")
    types = [1] * len(tokens) + [3] * len(SPECIALS)
    return [*tokens, *SPECIALS], types, merges


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``convert_hf_to_gguf.py``'s ``LlamaModel.permute``: rotate-half pairs to interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(mlx_name: str) -> str:
    module, _, suffix = mlx_name.rpartition(".")
    if module in _MODEL:
        return f"{_MODEL[module]}.{suffix}"
    parts = module.split(".")
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:])]}.{suffix}"


def write_gguf(
    path: Path,
    arch: str,
    config: Mapping[str, Any],
    weights: Mapping[str, np.ndarray],
    kinds: Mapping[str, T] | None = None,
    default_kind: T = T.F32,
    pre: str = "smollm",
    metadata: Mapping[str, Any] | None = None,
    tokenizer_model: str = "gpt2",
    raw: Mapping[str, tuple[np.ndarray, T | None]] | None = None,
) -> Path:
    """Write ``weights`` (mlx-lm names) as a GGUF of ``arch``; 2-D weights in ``kinds[name]``
    or ``default_kind``, everything else F32. ``metadata``: extra keys, as (value, type) or a
    plain value. ``raw``: more tensors by GGUF name, as bytes of a type (None: as the array
    is), for types the writer cannot quantize to."""
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if head_dim != config["hidden_size"] // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(config["vocab_size"])
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    tokens, types, merges = tiny_vocab(config["vocab_size"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for key, value in (metadata or {}).items():
        if isinstance(value, tuple):
            w.add_key_value(key, value[0], value[1])
        else:
            w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, value)
    for name, value in sorted(weights.items()):
        array = np.asarray(value, dtype=np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = llama_cpp_permute(array, heads if "q_proj" in name else kv_heads)
        kind = (kinds or {}).get(name, default_kind) if array.ndim == 2 else T.F32
        if kind == T.F32:
            w.add_tensor(gguf_name(name), array)
        elif kind == T.F16:
            w.add_tensor(gguf_name(name), array.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(array, kind), raw_dtype=kind)
    for name, (array, kind) in (raw or {}).items():
        w.add_tensor(name, array, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
