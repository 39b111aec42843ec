"""Write the pretrained-checkpoint fixtures: tiny random models by the reference
implementation (Hugging Face ``transformers`` on torch), with a batch of token ids and the
reference's logits for it, one directory per family under ``tests/fixtures/hf/``.

Run once, by hand, in an environment that has the reference (it is not a dependency of
shardplug or of its tests; the files it writes are committed)::

    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.13.0 transformers safetensors
    /tmp/hf/bin/python scripts/hf_fixtures.py

Each directory holds what ``save_pretrained`` writes (``config.json``, safetensors, for
``llama`` split into shards with an index) and ``reference.npz``: ``tokens`` (2, 24) int32
``logits`` (2, 24, vocab) float32 and ``loss``, the reference's next-token loss on them.
Every weight, norms included, is drawn at random, so a weight loaded into the wrong place
shows in the logits. ``llama``'s config is rewritten the way transformers 4.x wrote it
(``rope_theta`` and ``rope_scaling`` at the top level); the others keep 5.x's
``rope_parameters``.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-5)  # fmt: skip

FAMILIES = {
    # Llama 3.1/3.2: rope scaling of type llama3
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=4096),
    ),
    # Qwen2: biases on q, k and v; the embedding tied to the output
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True),
    ),
    # Qwen3: RMSNorm on each head's queries and keys; head_dim not hidden / heads
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=16)),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
}


def as_written_by_4x(config: dict) -> dict:
    """transformers 4.x's form of a config: ``rope_theta`` and ``rope_scaling`` on top."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    config["transformers_version"] = "4.46.0"
    return config


def write(name: str) -> None:
    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(0)
    model = model_class(config_class(**SMALL, **extra)).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # norms too, so each weight's place matters
            parameter.add_(0.2 * torch.randn_like(parameter))
    out = ROOT / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, max_shard_size="40KB" if name == "llama" else "10GB")
    if name == "llama":
        path = out / "config.json"
        path.write_text(json.dumps(as_written_by_4x(json.loads(path.read_text())), indent=2))
    tokens = np.random.default_rng(0).integers(0, SMALL["vocab_size"], (2, 24), np.int32)
    with torch.no_grad():
        ids = torch.from_numpy(tokens).long()
        result = model(ids, labels=ids)  # the loss: next-token cross-entropy, mean
    np.savez(
        out / "reference.npz",
        tokens=tokens,
        logits=result.logits.float().numpy(),
        loss=np.float32(result.loss.item()),
    )
    (out / "generation_config.json").unlink(missing_ok=True)
    print(name, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    for family in FAMILIES:
        write(family)
