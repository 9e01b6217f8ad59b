"""A GGUF file's tokenizer as Hugging Face ``tokenizer.json`` and ``tokenizer_config.json``.

GGUF carries a byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) as its token list,
token types, merges and the name of its pre-tokenizer (``tokenizer.ggml.pre``). llama.cpp splits
text with a list of regular expressions chosen by that name (``llama-vocab.cpp``: each expression
splits the pieces the previous one left, keeping what matched and what did not), then merges by
rank within each piece. The same tokenizer in the ``tokenizers`` library: one ``Split`` with
``Isolated`` behaviour per expression, then ``ByteLevel`` without its own regex; the BPE model
with the GGUF's vocabulary and merges.

Only the pre-tokenizers named in :data:`PRE_TOKENIZERS` are built; another name is refused with
one line (a wrong split gives valid-looking but different token ids, and so different outputs,
with no error anywhere). SentencePiece vocabularies (``"llama"``) are refused too: their merges
must be rebuilt from scores, and no file here to test that against.

Token types (llama.cpp's ``llama_token_type``): 3 is a control token (special), 4 user-defined
(matched whole in text, not special), 1 normal.
"""

from __future__ import annotations

from typing import Any

from kvserve_model.errors import ModelLoadError
from kvserve_model.gguf_file import GGUFHeader

CONTROL, USER_DEFINED = 3, 4

# llama.cpp's expressions (llama-vocab.cpp, llm_tokenizer_bpe), by family of names.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_FAMILIES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"): (_GPT2,),
    ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"): (
        r"\p{N}",
        _GPT2,
    ),
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"): (_LLAMA3,),
    ("qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan"): (_QWEN2,),
}
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    name: exprs for names, exprs in _FAMILIES.items() for name in names
}
# llama.cpp looks a whole piece up before merging for these (``ignore_merges``).
IGNORE_MERGES = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"))


def tokenizer_files(header: GGUFHeader, context: int) -> dict[str, dict[str, Any]]:
    """``tokenizer.json`` and ``tokenizer_config.json`` for ``header``'s tokenizer; raises
    ModelLoadError (one line) for one this module does not build."""
    meta = header.metadata
    pre, tokens, merges, types = _vocabulary(header)
    added = _added_tokens(tokens, types)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    splits = [
        {"type": "Split", "pattern": {"Regex": e}, "behavior": "Isolated", "invert": False}
        for e in PRE_TOKENIZERS[pre]
    ]
    special = _special_tokens(header, tokens)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and "bos_token" in special
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [*splits, {**byte_level, "use_regex": False}],
        },
        "post_processor": _post_processor(meta["tokenizer.ggml.bos_token_id"], tokens)
        if add_bos
        else None,
        "decoder": {**byte_level, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre in IGNORE_MERGES,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": merges,
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
        "added_tokens_decoder": {
            str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added
        },
    }
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


def _vocabulary(header: GGUFHeader) -> tuple[str, list[str], list[str], list[int]]:
    """The tokenizer's pre-tokenizer name, tokens, merges and token types, checked: a
    byte-level BPE with a known pre-tokenizer and a complete vocabulary, or ModelLoadError."""
    meta = header.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        what = "none" if kind is None else repr(kind)
        raise ModelLoadError(
            f"{header.path.name}: tokenizer model {what} is not supported "
            "(byte-level BPE, tokenizer.ggml.model 'gpt2', is)"
        )
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{header.path.name}: pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens", []))
    merges: list[str] = list(meta.get("tokenizer.ggml.merges", []))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if not tokens or not merges or len(types) != len(tokens):
        raise ModelLoadError(f"{header.path.name}: incomplete tokenizer (tokens, types, merges)")
    return pre, tokens, merges, types


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    """The control (special) and user-defined tokens, matched whole in text."""
    return [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": types[i] == CONTROL,
        }
        for i in range(len(tokens))
        if types[i] in (CONTROL, USER_DEFINED)
    ]


def _special_tokens(header: GGUFHeader, tokens: list[str]) -> dict[str, str]:
    found = {}
    for role in ("bos", "eos", "unk", "pad"):
        token_id = header.metadata.get(f"tokenizer.ggml.{role}_token_id")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            found[f"{role}_token"] = tokens[token_id]
    return found


def _post_processor(bos_id: int, tokens: list[str]) -> dict[str, Any]:
    """The BOS a tokenizer with ``add_bos_token`` puts in front of every encoding."""
    bos = tokens[bos_id]
    return {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
