"""The tier decision's start-up bound: the parameters a prefill token multiplies through, and
the matmul rate of the model's own kind of product (worker.tier.speed)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama, mixtral

from worker.tier.speed import matmul_flops, prefill_parameters, prefill_s_per_token

LLAMA = dict(
    model_type="llama",
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=1000,
    tie_word_embeddings=False,
)


def layer_weights(model: nn.Module) -> int:
    """What a token multiplies through, counted by hand: every decoder layer's parameters."""
    return sum(v.size for layer in model.layers for _, v in tree_flatten(layer.parameters()))


def test_counts_the_decoder_layers_not_the_embedding_or_the_head() -> None:
    model = llama.Model(llama.ModelArgs.from_dict(LLAMA))
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    params, quantized = prefill_parameters(model)
    assert quantized is None
    assert params == layer_weights(model)
    assert total - params == 2 * 1000 * 128 + 128  # embedding, head, final norm


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_model_counts_its_logical_weights(bits: int) -> None:
    model = llama.Model(llama.ModelArgs.from_dict(LLAMA))
    dense, _ = prefill_parameters(model)
    nn.quantize(model, group_size=64, bits=bits)
    words = sum(v.size for layer in model.layers for _, v in tree_flatten(layer.parameters()))
    params, quantized = prefill_parameters(model)
    assert quantized == (64, bits, "affine")
    assert params == dense  # not the packed words, scales and biases
    assert words < dense


def test_experts_count_the_share_a_token_is_routed_to() -> None:
    args = dict(LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    model = mixtral.Model(mixtral.ModelArgs.from_dict(args))
    params, _ = prefill_parameters(model)
    experts = sum(
        v.size
        for layer in model.layers
        for k, v in tree_flatten(layer.parameters())
        if k.startswith("block_sparse_moe.switch_mlp")
    )
    assert experts > 0
    assert params == layer_weights(model) - experts // 2
    nn.quantize(model, group_size=64, bits=4)
    assert prefill_parameters(model)[0] == params


def test_the_matmul_rate_of_either_kind_and_the_bound() -> None:
    dense = matmul_flops(mx.float32, n=256, repeats=2)
    q = matmul_flops(mx.float32, n=256, repeats=2, quantized=(64, 4, "affine"))
    assert dense > 0 and q > 0
    assert prefill_s_per_token(1000, 2e9) == pytest.approx(1e-6)
    assert prefill_s_per_token(0, 2e9) is None
