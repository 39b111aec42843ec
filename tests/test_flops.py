"""Model FLOPs per token as MaxText and PaLM count them."""

from shardplug.flops import TransformerShape


def test_the_input_embedding_is_not_counted_and_causal_attention_is_halved():
    gpt125m = TransformerShape(layers=12, width=768, sequence=1024, vocab=50304)
    blocks = 12 * (4 * 768 * 768 + 2 * 768 * 3072)
    assert gpt125m.matmul_params == blocks + 768 * 50304  # the unembedding, not the embedding
    flops = gpt125m.flops_per_token()
    assert flops["matmul"] == 6 * gpt125m.matmul_params
    assert flops["attention"] == 12 * 12 * 1024 * 768 / 2
    full = TransformerShape(12, 768, 1024, 50304, causal=False).flops_per_token()
    assert full["attention"] == 2 * flops["attention"]
    # counting 6 x every parameter (embedding and positions too) overstates it by 37%
    every = blocks + 2 * 768 * 50304 + 1024 * 768
    assert round((6 * every + 12 * 12 * 1024 * 768) / flops["total"], 2) == 1.37
