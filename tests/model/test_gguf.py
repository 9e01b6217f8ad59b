"""The GGUF converter without MLX: its header reader, its tokenizer, its refusals, atomicity.

Files are written with llama.cpp's own ``gguf`` package (``tests/model/gguf_files.py``). The
tokenizer built from the default model's GGUF is held to a plain reference BPE written here
(llama.cpp's algorithm: split by its expressions, then merge the lowest-ranked pair until none
is left) on text that exercises every expression: digits, contractions, whitespace runs,
newlines, punctuation, non-Latin scripts, emoji, and the control tokens.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import regex
from tokenizers import Tokenizer as HFTokenizer

from kvserve_model import gguf_convert
from kvserve_model.default_model import default_gguf
from kvserve_model.errors import ModelLoadError
from kvserve_model.gguf_convert import ensure_converted, is_converted, plan_conversion
from kvserve_model.gguf_file import GGMLType, read_header
from kvserve_model.gguf_tokenizer import PRE_TOKENIZERS, tokenizer_files
from tests.model.gguf_files import T, byte_alphabet, write_gguf

CONFIG = {
    "num_hidden_layers": 2,
    "max_position_embeddings": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 300,
}

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "It's 2026; they'll say we've 12,345.67 apples & 89 pears!!",
    "  leading spaces,\ttabs\tand\n\nnewlines\r\n  trailing   ",
    "naïve café Ünïcödé — “quotes” … and ß",
    "日本語のテキスト、中文\uff0c한국어 and Ελληνικά",
    "emoji 🎉🚀 and ZWJ 👩‍💻 sequences",
    "code: def f(x):\n    return x**2  # square",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "",
    "a",
    "   ",
    "1234567890",
]


def weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    out = {
        "model.embed_tokens.weight": rng.standard_normal((config["vocab_size"], h)),
        "model.norm.weight": np.ones(h),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": np.ones(h),
            p + "post_attention_layernorm.weight": np.ones(h),
            p + "self_attn.q_proj.weight": rng.standard_normal((q, h)),
            p + "self_attn.k_proj.weight": rng.standard_normal((kv, h)),
            p + "self_attn.v_proj.weight": rng.standard_normal((kv, h)),
            p + "self_attn.o_proj.weight": rng.standard_normal((h, q)),
            p + "mlp.gate_proj.weight": rng.standard_normal((inter, h)),
            p + "mlp.up_proj.weight": rng.standard_normal((inter, h)),
            p + "mlp.down_proj.weight": rng.standard_normal((h, inter)),
        }
    return {k: v.astype(np.float32) for k, v in out.items()}


@pytest.fixture
def models_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVSERVE_MODEL_DIR", str(tmp_path / "models"))
    return tmp_path / "models"


def test_header_reads_what_llama_cpp_wrote(tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf",
        "llama",
        CONFIG,
        weights(CONFIG),
        kinds={"model.embed_tokens.weight": T.Q8_0, "model.layers.0.mlp.up_proj.weight": T.F16},
        default_kind=T.Q4_1,
        metadata={
            "test.floats": ([0.5, -2.0], gguf.GGUFValueType.ARRAY),
            "test.flag": (True, gguf.GGUFValueType.BOOL),
        },
    )
    header = read_header(path)
    assert header.architecture == "llama" and header.version == 3
    assert header.get("{arch}.block_count") == 2
    assert header.get("{arch}.attention.head_count_kv") == 2
    assert header.metadata["test.floats"] == [0.5, -2.0]
    assert header.metadata["test.flag"] is True
    assert header.metadata["tokenizer.ggml.tokens"][:3] == byte_alphabet()[:3]
    t = header.tensors
    assert t["token_embd.weight"].shape == (300, 64)
    assert t["token_embd.weight"].ggml_type == GGMLType.Q8_0
    assert t["blk.0.ffn_up.weight"].ggml_type == GGMLType.F16
    assert t["blk.1.attn_q.weight"].ggml_type == GGMLType.Q4_1
    assert t["output_norm.weight"].ggml_type == GGMLType.F32
    # Offsets point at the data: the llama.cpp reader agrees on every tensor.
    theirs = {x.name: x.data_offset for x in gguf.GGUFReader(path).tensors}
    assert {n: i.offset for n, i in t.items()} == theirs


def test_not_gguf_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_header(bad)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(
        write_gguf(tmp_path / "ok.gguf", "llama", CONFIG, weights(CONFIG)).read_bytes()[:300]
    )
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        read_header(truncated)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(arch="phi3"), "architecture 'phi3' is not supported"),
        (dict(pre="deepseek-llm"), "pre-tokenizer 'deepseek-llm' is not supported"),
        (dict(tokenizer_model="llama"), "tokenizer model 'llama' is not supported"),
        (dict(raw={"rope_freqs.weight": (np.ones(8, np.float32), None)}), "rope_freqs"),
        # 64 rows of one 256-weight Q4_K super-block (144 bytes) each: gguf cannot make them.
        (
            dict(raw={"blk.0.attn_q.weight": (np.zeros((64, 144), np.uint8), T.Q4_K)}),
            "tensor blk.0.attn_q.weight is Q4_K, which is not supported",
        ),
        (dict(metadata={"llama.rope.scaling.type": "yarn"}), "rope scaling 'yarn'"),
    ],
)
def test_what_cannot_be_converted_is_refused_by_name(tmp_path, models_dir, change, message):
    w = weights(CONFIG)
    if "blk.0.attn_q.weight" in change.get("raw", {}):
        del w["model.layers.0.self_attn.q_proj.weight"]
        w = {
            k: np.pad(v, ((0, 0), (0, 192))) if k.endswith("q_proj.weight") else v
            for k, v in w.items()
        }
    path = write_gguf(
        tmp_path / "m.gguf",
        change.get("arch", "llama"),
        CONFIG,
        w,
        pre=change.get("pre", "smollm"),
        metadata=change.get("metadata"),
        tokenizer_model=change.get("tokenizer_model", "gpt2"),
        raw=change.get("raw"),
    )
    with pytest.raises(ModelLoadError, match=message) as e:
        ensure_converted(path)
    assert "\n" not in str(e.value)
    assert not models_dir.exists() or not list(models_dir.iterdir())  # nothing written


def test_conversion_is_atomic_and_keyed_by_the_file(tmp_path, models_dir, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "llama", CONFIG, weights(CONFIG), default_kind=T.Q4_0)

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(gguf_convert, "write_safetensors", crash)
    with pytest.raises(OSError, match="disk full"):
        ensure_converted(path)
    assert not models_dir.exists() or not list(models_dir.iterdir())  # no half-written model
    monkeypatch.undo()
    monkeypatch.setenv("KVSERVE_MODEL_DIR", str(models_dir))
    lines: list[str] = []
    first = ensure_converted(path, log=lines.append)
    assert is_converted(first) and len(lines) == 1 and "converting m.gguf" in lines[0]
    assert ensure_converted(path, log=lines.append) == first and len(lines) == 1  # once
    assert [p.name for p in models_dir.iterdir()] == [first.name]  # no temporary left
    # Another file (other weights) is another model.
    write_gguf(path, "llama", CONFIG, weights(CONFIG, seed=1), default_kind=T.Q4_0)
    second = ensure_converted(path, log=lines.append)
    assert second != first and len(lines) == 2


def test_a_file_rewritten_in_place_converts_anew(tmp_path, models_dir, monkeypatch):
    """The conversion is named by every byte of its source: one weight changed in the middle
    of a several-MiB file, with its size, header and first and last MiB kept (and its mtime
    put back), is another model. The identity once hashed only those, and kept serving the
    earlier conversion."""
    monkeypatch.setenv("KVSERVE_MODEL_DIR", str(models_dir))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the digest records
    big = {**CONFIG, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8}
    path = write_gguf(tmp_path / "m.gguf", "llama", big, weights(big), default_kind=T.F32)
    size = path.stat().st_size
    assert size > 3 << 20
    first = ensure_converted(path)
    assert ensure_converted(path) == first  # unchanged: the same directory, not converted again
    data = bytearray(path.read_bytes())
    data[size // 2] ^= 1  # the lowest bit of one F32 weight
    stat = path.stat()
    with open(path, "r+b") as f:  # in place: the same inode
        f.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = ensure_converted(path)
    assert second != first and is_converted(second)


def test_config_from_metadata(tmp_path):
    cfg = {**CONFIG, "num_key_value_heads": 1}
    path = write_gguf(
        tmp_path / "m.gguf",
        "llama",
        cfg,
        weights(cfg),
        kinds={"model.embed_tokens.weight": T.Q8_0},
        default_kind=T.Q4_0,
    )
    plan = plan_conversion(read_header(path))
    c = plan.config
    assert c["model_type"] == "llama" and c["num_hidden_layers"] == 2
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 1, 16)
    assert c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 10000.0
    assert c["max_position_embeddings"] == 512 and c["vocab_size"] == 300
    assert c["tie_word_embeddings"] is True  # no output.weight
    assert c["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    assert c["torch_dtype"] == "float16"
    assert c["eos_token_id"] == 299 and c["bos_token_id"] == 298  # the two control tokens
    assert plan.names["blk.1.ffn_down.weight"] == "model.layers.1.mlp.down_proj.weight"
    assert plan.names["token_embd.weight"] == "model.embed_tokens.weight"


# -- the tokenizer ----------------------------------------------------------------------------


def reference_encode(
    text: str, tokens: list[str], types: list[int], merges: list[str], exprs
) -> list[int]:
    """llama.cpp's BPE, plainly: control tokens matched whole, each remaining span split by
    each expression in turn (matches and the gaps between them both kept), each piece's bytes
    mapped to GPT-2's alphabet and merged lowest rank first."""
    ids = {t: i for i, t in enumerate(tokens)}
    rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    specials = sorted(
        (t for t, k in zip(tokens, types, strict=True) if k == 3), key=len, reverse=True
    )
    alphabet = byte_alphabet()
    out: list[int] = []
    spans = [text]
    if specials:
        spans = regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text)
    for span in spans:
        if span in specials:
            out.append(ids[span])
            continue
        pieces = [span] if span else []
        for expr in exprs:
            nxt = []
            for piece in pieces:
                last = 0
                for m in regex.finditer(expr, piece):
                    if m.start() > last:
                        nxt.append(piece[last : m.start()])
                    if m.end() > m.start():
                        nxt.append(m.group())
                    last = m.end()
                if last < len(piece):
                    nxt.append(piece[last:])
            pieces = nxt
        for piece in pieces:
            symbols = [alphabet[b] for b in piece.encode()]
            while len(symbols) > 1:
                pairs = [
                    (rank.get((a, b), 1 << 30), i)
                    for i, (a, b) in enumerate(itertools.pairwise(symbols))
                ]
                best, i = min(pairs)
                if best == 1 << 30:
                    break
                symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
            out.extend(ids[s] for s in symbols)
    return out


@pytest.fixture(scope="module")
def smollm_tokenizer(tmp_path_factory):
    header = read_header(default_gguf())
    files = tokenizer_files(header, 8192)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(json.dumps(files["tokenizer.json"]))
    return header, HFTokenizer.from_file(str(path)), files["tokenizer_config.json"]


def test_default_model_tokenizer_matches_the_reference_bpe(smollm_tokenizer):
    header, tok, _ = smollm_tokenizer
    meta = header.metadata
    tokens, types, merges = (
        meta["tokenizer.ggml.tokens"],
        meta["tokenizer.ggml.token_type"],
        meta["tokenizer.ggml.merges"],
    )
    exprs = PRE_TOKENIZERS[meta["tokenizer.ggml.pre"]]
    for text in TEXTS:
        ours = tok.encode(text).ids
        assert ours == reference_encode(text, tokens, types, merges, exprs), text
        assert tok.decode(ours, skip_special_tokens=False) == text


def test_default_model_tokenizer_config(smollm_tokenizer):
    _, tok, config = smollm_tokenizer
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] == "<|im_start|>"
    assert config["model_max_length"] == 8192 and config["add_bos_token"] is False
    assert "<|im_start|>" in config["chat_template"]
    assert tok.encode("Hi").ids == [tok.token_to_id("Hi")]  # no BOS: add_bos_token is false
    # Digits split one by one (SmolLM2's pre-tokenizer), a space before them on its own.
    assert [tok.id_to_token(i) for i in tok.encode(" 2026").ids] == ["Ġ", "2", "0", "2", "6"]


def test_every_supported_pre_tokenizer_compiles(tmp_path):
    """A typo in an expression would only show on a model that uses it."""
    for pre in sorted(set(PRE_TOKENIZERS)):
        path = write_gguf(tmp_path / f"{pre}.gguf", "llama", CONFIG, weights(CONFIG), pre=pre)
        files = tokenizer_files(read_header(path), 512)
        (tmp_path / "tokenizer.json").write_text(json.dumps(files["tokenizer.json"]))
        tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
        header = read_header(path)
        meta = header.metadata
        for text in TEXTS:
            expect = reference_encode(
                text,
                meta["tokenizer.ggml.tokens"],
                meta["tokenizer.ggml.token_type"],
                meta["tokenizer.ggml.merges"],
                PRE_TOKENIZERS[pre],
            )
            assert tok.encode(text).ids == expect, (pre, text)
