"""Every model family of the installed mlx-lm as a tiny seeded fp32 model, and its class.

A family is a module of ``mlx_lm.models`` that defines ``Model`` and ``ModelArgs``. Its tiny
config is :data:`BASE` (one value for each size field under every name families use for it;
``ModelArgs.from_dict`` keeps only the fields the family has), with the family's entry of
:data:`OVERRIDES` on top. Wrappers that read a ``text_config`` get the same tiny config there.

:func:`classify` sorts a family into one of three classes:

- ``paged``: every layer speaks the KV-cache protocol; ``worker.model.spec.probe`` accepts it.
- ``recurrent``: recurrent or hybrid layers (``ArraysCache``, ``MambaCache``, ...) whose state
  blocks of K/V cannot hold; ``probe`` refuses to page it (RecurrentStateError) and the worker
  serves it with the dense per-sequence runner (``worker.model.dense_runner``).
- ``unsupported``: not built here, with the reason (:data:`UNSUPPORTED`), or built but refused
  by ``probe`` for another reason (its message).

Used by ``tests/worker/test_family_sweep.py`` and ``scripts/model_sweep.py``.
"""

from __future__ import annotations

import importlib
import pathlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache

from worker.errors import UnsupportedModelError
from worker.model.spec import probe

VOCAB = 128
EMB_STD = 1.0  # large enough that a token's embedding, not the norms' bias, steers the output
# Tied-embedding families whose residual stream a unit-scale embedding dominates, so that greedy
# decoding repeats the last token: a smaller embedding lets the layers steer.
EMB_STDS = {"cohere": 0.3, "gemma": 0.3, "gemma2": 0.1, "olmo2": 0.3, "olmo3": 0.3, "openelm": 0.3}
# Families whose greedy output repeats the prompt's last token whatever the init tried (their
# logits still depend on the context, so the logit criterion still tests them).
GREEDY_COLLAPSES = {
    "gemma3n": "greedy repeats the last token under every embedding scale tried (AltUp streams)"
}
WEIGHT_GAIN = 1.5  # weights ~ N(0, gain^2 / fan_in): activations neither vanish nor saturate

# One tiny value per size field, under every name the families use for it.
_SIZES: dict[str, Any] = {
    # widths
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "hidden_dim": 64,
    "model_dim": 64,
    "dim": 64,
    # MLP widths
    "intermediate_size": 128,
    "ffn_hidden_size": 128,
    "n_inner": 128,
    "ff_intermediate_size": 128,
    "intermediate_size_mlp": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    # depth
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layers": 2,
    "n_layer": 2,
    "num_transformer_layers": 2,
    # heads
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "num_query_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "n_kv_heads": 2,
    "head_dim": 16,
    # vocabulary and positions
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "n_positions": 512,
    "n_ctx": 512,
    "model_max_length": 512,
    # norms
    "rms_norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "norm_eps": 1e-5,
    "layernorm_epsilon": 1e-5,
    # rotary
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "partial_rotary_factor": 1.0,
    # mixture of experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "num_shared_expert": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_layer_freq": 1,
    # MLA (multi-head latent attention)
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    # flags that must be given and have an obvious off
    "attention_bias": False,
    "mlp_bias": False,
    "use_bias": False,
    "use_qkv_bias": False,
    "tie_word_embeddings": False,
}

BASE: dict[str, Any] = {**_SIZES, "sliding_window": 16}  # windows shorter than the prompts

_SLIDING_FULL = ["sliding_attention", "full_attention"]
_ROPE = {"rope_theta": 10000.0, "rope_type": "default"}
_LFM2 = {
    "conv_bias": False,
    "conv_L_cache": 3,
    "block_dim": 64,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False,
    "layer_types": ["conv", "full_attention"],
}
_GEMMA4 = {
    "num_hidden_layers": 4,
    "sliding_window_pattern": 2,
    "num_kv_shared_layers": 0,
    "global_head_dim": 32,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
}

# Per-family fields on top of BASE: what a family needs that BASE does not give it.
_QWEN3_5: dict[str, Any] = {
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "full_attention_interval": 2,
}

OVERRIDES: dict[str, dict[str, Any]] = {
    "afm7": {"num_kv_reuse_layers": 1, "num_layers": 3},
    "afmoe": {"layer_types": _SLIDING_FULL, "num_dense_layers": 1},
    "apertus": {"post_norm": False, "qk_norm": True},
    "baichuan_m1": {"sliding_window_layers": [0], "conv_window": 2},
    "bailing_hybrid": {"layer_group_size": 2, "group_norm_size": 1, "head_dim": 32},
    "bailing_moe_linear": {"layer_group_size": 2, "group_norm_size": 1},
    "cohere2": {"num_hidden_layers": 4, "sliding_window_pattern": 2},
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "deepseek_v2": {"rope_scaling": {"factor": 1.0, "mscale_all_dim": 0}},
    "exaone4": {"sliding_window_pattern": "LG", "head_dim": 16},
    "exaone_moe": {"layer_types": _SLIDING_FULL, "is_moe_layer": [False, True]},
    "gear": {"layer_types": _SLIDING_FULL},
    "gemma3": {"text_config": {"num_hidden_layers": 4, "sliding_window_pattern": 2}},
    "gemma3_text": {"num_hidden_layers": 4, "sliding_window_pattern": 2},
    "glm4_moe": {"use_qk_norm": True},
    "glm_moe_dsa": {
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 8,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "rope_parameters": _ROPE,
    },
    "gpt_neox": {"rotary_emb_base": 10000, "rotary_pct": 0.5},
    "gptj": {"rotary_dim": 8},
    "granite": {
        "logits_scaling": 1.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
    },
    "granitemoe": {
        "logits_scaling": 1.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
    },
    "granitemoehybrid": {
        "logits_scaling": 1.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "layer_types": ["mamba", "attention"],
        "num_local_experts": None,
        "shared_intermediate_size": 128,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_proj_bias": False,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
    },
    "jamba": {
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_d_conv": 4,
        "mamba_d_state": 8,
        "mamba_expand": 2,
    },
    "kimi_linear": {
        "linear_attn_config": {
            "kda_layers": [1],
            "full_attn_layers": [2],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        "num_experts": 4,
    },
    "lfm2": _LFM2,
    "lfm2_moe": {
        "use_expert_bias": True,
        "num_dense_layers": 1,
        "conv_bias": False,
        "conv_L_cache": 3,
        "layer_types": ["conv", "full_attention"],
    },
    "lille-130m": {"block_size": 512},
    "llama4": {
        "text_config": {
            "attention_chunk_size": 16,
            "interleave_moe_layer_step": 1,
            "use_qk_norm": True,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
        }
    },
    "llama4_text": {"no_rope_layers": [1, 0], "use_qk_norm": True},
    "longcat_flash": {
        "attention_method": "MLA",
        "zero_expert_type": "identity",
        "zero_expert_num": 1,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
    },
    "longcat_flash_ngram": {
        "zero_expert_num": 1,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
    },
    "mamba": {"state_size": 8, "conv_kernel": 4, "use_conv_bias": True, "time_step_rank": 4},
    "mamba2": {
        "num_heads": 8,
        "head_dim": 16,
        "state_size": 8,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_conv_bias": True,
        "time_step_limit": (0.0, 1e9),
        "time_step_rank": 4,
    },
    "mellum": {
        "layer_types": _SLIDING_FULL,
        "rope_parameters": {"sliding_attention": _ROPE, "full_attention": _ROPE},
    },
    "minicpm": {"dim_model_base": 64, "scale_depth": 1.4, "scale_emb": 1.0},
    "minimax": {"rotary_dim": 8},
    "ministral3": {
        "rope_parameters": {
            **_ROPE,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 512,
        }
    },
    "nemotron": {"hidden_act": "relu2"},
    "nemotron-nas": {
        "block_configs": [
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"n_heads_in_group": 4}, "ffn": {"ffn_mult": 2.0}},
        ]
    },
    "nemotron_h": {
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_conv_bias": True,
        "hybrid_override_pattern": ["M", "*", "-"],
    },
    "olmo3": {"layer_types": _SLIDING_FULL},
    "olmo_hybrid": {
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_allow_neg_eigval": False,
        "layer_types": ["linear_attention", "full_attention"],
    },
    "openelm": {
        "ffn_dim_divisor": 16,
        "num_query_heads": [4, 4],
        "num_kv_heads": [2, 2],
        "ffn_multipliers": [2.0, 2.0],
    },
    "phi3small": {"dense_attention_every_n_layers": 2, "gegelu_limit": 20.0},
    "phixtral": {"rotary_dim": 8, "num_local_experts": 4},
    "plamo": {"n_shared_head": 2},
    "qwen": {"kv_channels": 16},
    "qwen3_next": {
        "linear_num_value_heads": 2,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "partial_rotary_factor": 0.5,
    },
    # Two layers: one linear-attention layer, one full-attention layer (mlx-lm's default
    # interval of 4 leaves the tiny model no full-attention layer, and its mask lookup fails).
    "qwen3_5": {"text_config": _QWEN3_5},
    "qwen3_5_moe": {"text_config": _QWEN3_5},
    "recurrent_gemma": {
        "conv1d_width": 4,
        "logits_soft_cap": 30.0,
        "attention_window_size": 16,
        "block_types": ["recurrent", "attention"],
    },
    "rwkv7": {
        "a_low_rank_dim": 8,
        "v_low_rank_dim": 8,
        "gate_low_rank_dim": 8,
        "decay_low_rank_dim": 8,
    },
    "spark2_5": {
        "layer_types": _SLIDING_FULL,
        "rope_parameters": {"sliding_attention": _ROPE, "full_attention": _ROPE},
    },
    "step3p5": {"num_attention_groups": 2, "moe_num_experts": 4, "moe_top_k": 2},
    "hunyuan": {
        "use_mixed_mlp_moe": True,
        "use_qk_norm": True,
        "use_cla": False,
        "cla_share_factor": 2,
        "moe_intermediate_size": 32,
        "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
    },
    "minicpm3": {
        "dim_model_base": 64,
        "scale_depth": 1.4,
        "scale_emb": 1.0,
        "rope_scaling": {"original_max_position_embeddings": 512},
    },
    "mistral4": {
        "rope_parameters": {
            **_ROPE,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 512,
        }
    },
    "minimax_m3_vl": {"text_config": {"moe_layer_freq": [0, 1], "rotary_dim": 8}},
    "kimi_k3": {
        "text_config": {
            "linear_attn_config": {
                "kda_layers": [1],
                "num_heads": 4,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
            },
            "q_lora_rank": None,
            "num_experts": 4,
            "num_experts_per_token": 2,  # mlx-lm's default (16) exceeds the tiny 4 experts
            "moe_intermediate_size": 32,
        }
    },
    "lfm2-vl": {"text_model_type": "lfm2", "text_config": _LFM2},
    "mimo_v2_flash": {
        "hybrid_layer_pattern": [1, 0],
        "moe_layer_freq": [0, 1],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "sliding_window_size": 16,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "swa_rope_theta": 10000.0,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 16,
        "swa_v_head_dim": 16,
        "partial_rotary_factor": 1,
    },
    "muse_spark": {
        "text_config": {
            "post_norm_eps": 1e-5,
            "rope_parameters": _ROPE,
            "layer_rope_theta": [10000.0, 10000.0],
            "layer_types": _SLIDING_FULL,
            "final_logit_softcapping": 30.0,
            "output_multiplier": 1.0,
            "moe_hidden_size": 32,
            "num_shared_experts": 0,
        }
    },
    "gemma4_text": _GEMMA4,
    "gemma4": {"text_config": _GEMMA4},
    "gemma3n": {
        "text_config": {
            "num_hidden_layers": 4,
            "num_kv_shared_layers": 0,
            "vocab_size_per_layer_input": VOCAB,
            "rope_local_base_freq": 10000.0,
            "final_logit_softcapping": 30.0,
            "layer_types": _SLIDING_FULL * 2,
            "activation_sparsity_pattern": [0.0] * 4,
            "hidden_size_per_layer_input": 16,
            "altup_num_inputs": 2,
            "altup_coef_clip": 120.0,
            "altup_correct_scale": False,  # True scales the layers by a zero-init vector
            "altup_active_idx": 0,
            "laurel_rank": 8,
        }
    },
}

# Families not built here, and why.
UNSUPPORTED: dict[str, str] = {
    "olmo": "needs the ai2-olmo package (mlx_lm.models.olmo exits on import without it)",
    "prism_hadamard_qwen35": (
        "loads only 2-bit Hadamard-quantized packs of qwen3_5 (no fp32 tiny build); "
        "its base qwen3_5 is recurrent/hybrid"
    ),
}

CLASSES = ("paged", "recurrent", "unsupported")
_RECURRENT_CACHES = ("ArraysCache", "MambaCache")  # state that is not per-token K/V


def families() -> tuple[str, ...]:
    """Modules of the installed mlx-lm that define a ``Model`` and a ``ModelArgs``, sorted."""
    found = []
    for path in sorted(pathlib.Path(mlx_lm.models.__file__).parent.glob("*.py")):
        source = path.read_text()
        if "\nclass Model(" in source and "\nclass ModelArgs" in source:
            found.append(path.stem)
    return tuple(found)


def config(family: str) -> dict[str, Any]:
    """The tiny config of ``family``: BASE, its overrides, and the same in ``text_config``."""
    cfg = {**BASE, "model_type": family, **OVERRIDES.get(family, {})}
    text = {**BASE, "model_type": cfg.get("text_model_type", family), **cfg.get("text_config", {})}
    cfg["text_config"] = text
    return cfg


def build(family: str, seed: int = 0) -> nn.Module:
    """``family``'s tiny model in fp32 with seeded weights whose greedy output follows the
    context (see :data:`EMB_STD`)."""
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)  # parameters kept at their construction values are seeded too
    model = module.Model(module.ModelArgs.from_dict(config(family)))
    rng = np.random.default_rng(seed)
    embeddings = {
        f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Embedding)
    }
    params: list[tuple[str, mx.array]] = []
    flat: Any = tree_flatten(model.parameters())
    for name, value in flat:
        new: np.ndarray
        if not mx.issubdtype(value.dtype, mx.floating):
            continue  # packed or index tensors keep their construction values
        if value.ndim < 2 or name.endswith("bias"):
            new = np.asarray(value, dtype=np.float32)  # the family's own init: norms, biases
        elif name in embeddings:
            new = rng.standard_normal(value.shape) * EMB_STDS.get(family, EMB_STD)
        else:
            new = rng.standard_normal(value.shape) * (WEIGHT_GAIN / np.sqrt(value.shape[-1]))
        params.append((name, mx.array(new.astype(np.float32))))
    model.update(tree_unflatten(params))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


@dataclass(frozen=True, slots=True)
class Classified:
    family: str
    kind: str  # one of CLASSES
    reason: str  # why recurrent or unsupported; "" for paged
    model: nn.Module | None  # built model (paged and recurrent families)


def classify(family: str) -> Classified:
    """Build ``family`` and sort it by what the worker's ``probe`` says of it."""
    if family in UNSUPPORTED:
        return Classified(family, "unsupported", UNSUPPORTED[family], None)
    try:
        model = build(family)
    except (Exception, SystemExit) as e:  # any failure to build is the reason, reported as such
        return Classified(family, "unsupported", f"cannot build tiny: {_error(e)}", None)
    caches = sorted({_describe(c) for c in make_prompt_cache(model)})
    try:
        probe(model)
    except UnsupportedModelError as e:
        kind = (
            "recurrent" if any(r in c for c in caches for r in _RECURRENT_CACHES) else "unsupported"
        )
        return Classified(family, kind, f"refused by probe: {e}; caches {', '.join(caches)}", model)
    except Exception as e:  # the probe itself crashed: refused, but not cleanly
        return Classified(family, "unsupported", f"probe crashed: {_error(e)}", model)
    return Classified(family, "paged", "", model)


def _describe(cache: Any) -> str:
    inner = getattr(cache, "caches", None)
    name = type(cache).__name__
    return f"{name}({','.join(_describe(c) for c in inner)})" if inner else name


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
