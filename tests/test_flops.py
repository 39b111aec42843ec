"""Model FLOPs per token as MaxText and PaLM count them."""

import itertools

import pytest

from shardplug.core.flops import TransformerShape


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


def test_model_flops_are_one_count_for_one_model_and_batch_under_every_strategy():
    """A task without ``flops_per_sample`` had the strategy's step counted as the model's: a
    pipeline's idle ticks and microbatch work made pp+dp's "model FLOPs" 3.3x dp's.
    :func:`model_flops` counts the model alone: 3 x its forward pass, under no strategy."""
    import shardplug
    from shardplug.core.flops import model_flops, step_flops

    model = shardplug.get_model("transformer")
    batch = next(iter(model.batches(batch_size=16, seed=0)))
    steps, counted = {}, {}
    for name in ("dp", "pp+dp", "pp+fsdp", "fsdp"):
        trainer = model.task("nnx", batch_size=16, layers=4).trainer(strategy=name,
                                                                     allocate=False)  # fmt: skip
        if name in ("dp", "pp+dp"):
            trainer.compile(batch)
            steps[name] = step_flops(trainer.jaxpr)
        counted[name] = model_flops(trainer.adapter, trainer.loss_fn, batch, trainer.mesh)
    assert steps["pp+dp"] > 3 * steps["dp"]  # the pipeline's step: not the model's count
    assert set(counted.values()) == {steps["dp"]}  # dp's step is forward + twice it, nothing more


def test_the_rows_model_flops_are_one_count_under_every_strategy():
    """Training rows without ``flops_per_sample`` report the model's count (model_flops), not
    the strategy's step: model_tflops x step_time is one figure under dp and pp+dp."""
    import optax

    import shardplug

    model = shardplug.get_model("transformer")
    batches = list(itertools.islice(model.batches(16, 0), 2))
    per_step = {}
    for name in ("dp", "pp+dp"):
        trainer = shardplug.Trainer(model.adapter("nnx", layers=4), loss_fn=model.loss_fn,
                                    optimizer=optax.adam(1e-3), strategy=name)  # fmt: skip
        row = trainer.fit(batches, steps=2)[-1]
        per_step[name] = row["model_tflops"] * row["step_time"]
        assert row["step_tflops"] * row["step_time"] >= per_step[name] * (name == "dp")
    assert per_step["pp+dp"] == pytest.approx(per_step["dp"], rel=1e-9)
