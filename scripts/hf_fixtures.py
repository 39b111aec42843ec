"""Write the pretrained-checkpoint fixtures: tiny random models by the reference
implementation (Hugging Face ``transformers`` on torch), with a batch of token ids and the
reference's logits for it, one directory per family under ``tests/fixtures/hf/``.

Run once, by hand, in an environment that has the reference (it is not a dependency of
shardplug or of its tests; the files it writes are committed)::

    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.13.0 transformers safetensors
    /tmp/hf/bin/python scripts/hf_fixtures.py            # every family, and the text's
    /tmp/hf/bin/python scripts/hf_fixtures.py phi3       # one family alone (NAME ...)
    /tmp/hf/bin/pip install peft && /tmp/hf/bin/python scripts/hf_fixtures.py --lora

Each directory holds what ``save_pretrained`` writes (``config.json``, safetensors, for
``llama`` split into shards with an index) and ``reference.npz``: ``tokens`` (2, 24) int32
``logits`` (2, 24, vocab) float32 and ``loss``, the reference's next-token loss on them.
Every weight, norms included, is drawn at random, so a weight loaded into the wrong place
shows in the logits. ``llama`` also gets the fine-tuning text's fixture: a tokenizer
(``tokenizer.json``, a small BPE trained by ``tokenizers`` on ``tests/fixtures/hf/text``) and
``text_reference.npz``: every packed row of that text (``tokens``, ``loss_mask``) and the
reference's summed loss and counted targets on each. ``llama``'s config is rewritten the way
transformers 4.x wrote it (``rope_theta`` and ``rope_scaling`` at the top level); the others
keep 5.x's ``rope_parameters``.
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

#: how transformers builds each registered family's fixture: its config and model classes
#: and what its config sets beyond SMALL (a family the registry has and this lacks is refused)
RECIPES = {
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
    # Gemma 3: a sliding layer (window 8 < the batch's 24 tokens, its own rotary base) then a
    # full one (linear rotary scaling); query scale and logit cap of its own
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            attn_implementation="eager",
        ),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    # Phi-3: q, k and v stored as one fused qkv_proj, gate and up as one gate_up_proj; rotary
    # on half of each head's dimensions (partial_rotary_factor, as Phi-4-mini has)
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            eos_token_id=2,
            pad_token_id=0,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
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
    config_class, model_class, extra = RECIPES[name]
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


TEXT = ROOT / "text"
SEQUENCE = 24


def documents() -> list[str]:
    """The fixture's documents as shardplug reads ``--data text:DIR/*``: files in name order,
    a ``.jsonl`` file's lines each a document (its ``text``), any other file one document."""
    out = []
    for path in sorted(TEXT.iterdir()):
        if path.suffix == ".jsonl":
            out += [json.loads(line)["text"] for line in path.read_text().splitlines() if line]
        else:
            out.append(path.read_text())
    return out


def write_text() -> None:
    """The tokenizer (a small BPE trained on the fixture's text), then the reference's loss
    on its packed rows (:func:`write_text_reference`)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(
        documents(),
        trainers.BpeTrainer(
            vocab_size=SMALL["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"]
        ),
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(ROOT / "llama" / "tokenizer.json"))
    write_text_reference()


def write_text_reference() -> None:
    """The reference's loss on every packed row of the fixture's text, packed as shardplug
    packs it: each document's ids (the tokenizer adds ``<s>``) then ``</s>``, all
    concatenated and cut into rows of SEQUENCE + 1 tokens overlapping by one; a target that
    starts a new document does not count, and each document is on its own: every piece of a
    row that one document holds runs through the model alone, at its positions in its
    document (``position_ids``), so no document attends to another."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(ROOT / "llama" / "tokenizer.json"))
    ids, owner, place = [], [], []
    for n, doc in enumerate(documents()):
        piece = [*tok.encode(doc).ids, 2]
        ids += piece
        owner += [n] * len(piece)
        place += list(range(len(piece)))
    ids, owner, place = np.array(ids, np.int32), np.array(owner), np.array(place)
    rows = (len(ids) - 1) // SEQUENCE
    window = [slice(r * SEQUENCE, r * SEQUENCE + SEQUENCE + 1) for r in range(rows)]
    tokens = np.stack([ids[w] for w in window])
    docs = np.stack([owner[w] for w in window])
    places = np.stack([place[w] for w in window])
    mask = (docs[:, 1:] == docs[:, :-1]).astype(np.int32)
    model = transformers.LlamaForCausalLM.from_pretrained(ROOT / "llama").eval()
    losses = np.zeros((rows, SEQUENCE), np.float32)
    with torch.no_grad():
        for r in range(rows):
            inputs, targets = tokens[r, :-1], tokens[r, 1:]
            start = 0
            while start < SEQUENCE:  # each document's piece of the row alone
                end = start
                while end < SEQUENCE and docs[r, end] == docs[r, start]:
                    end += 1
                logits = model(
                    torch.from_numpy(inputs[None, start:end]).long(),
                    position_ids=torch.from_numpy(places[r, None, start:end]).long(),
                ).logits.float()[0]
                losses[r, start:end] = torch.nn.functional.cross_entropy(
                    logits, torch.from_numpy(targets[start:end]).long(), reduction="none"
                ).numpy()
                start = end
    np.savez(
        ROOT / "llama" / "text_reference.npz",
        tokens=tokens,
        loss_mask=mask,
        loss_sum=(losses * mask).sum(1).astype(np.float32),
        counted=mask.sum(1),
    )
    print("text", len(ids), "tokens,", rows, "rows,", tok.get_vocab_size(), "in the vocabulary")


LORA = {"r": 4, "lora_alpha": 8}


def write_lora() -> None:
    """``llama_lora/``: low-rank adapters on the written llama by the reference (PEFT), every
    projection of every layer, both factors drawn at random (``init_lora_weights=False``), as
    ``save_pretrained`` writes them (``adapter_config.json``, ``adapter_model.safetensors``),
    and ``reference.npz``: the adapted model's logits on llama's tokens."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(ROOT / "llama").eval()
    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = peft.get_peft_model(model, peft.LoraConfig(
        **LORA, target_modules=targets, lora_dropout=0.0, init_lora_weights=False,
        task_type="CAUSAL_LM"))  # fmt: skip
    out = ROOT / "llama_lora"
    shutil.rmtree(out, ignore_errors=True)
    adapted.save_pretrained(out)
    config = json.loads((out / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "tests/fixtures/hf/llama"  # not this machine's path
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out / "README.md").unlink(missing_ok=True)
    tokens = np.load(ROOT / "llama" / "reference.npz")["tokens"]
    with torch.no_grad():
        logits = adapted(torch.from_numpy(tokens).long()).logits.float().numpy()
    np.savez(out / "reference.npz", tokens=tokens, logits=logits)
    print("llama_lora", sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    import sys

    # --text: the text fixture alone, from the written llama; --text-reference: its
    # reference's loss alone, from the written tokenizer; --lora: the adapters' alone;
    # NAME ...: those families alone
    from shardplug.pretrained.families import MODULES  # the registry: each gets a fixture

    FAMILIES = [m.__name__.rpartition(".")[2] for m in MODULES]
    lacking = sorted(set(FAMILIES) - set(RECIPES))
    if lacking:
        sys.exit(f"hf_fixtures: no recipe for the registered {', '.join(lacking)}: add "
                 "its transformers classes to RECIPES")
    names = [a for a in sys.argv[1:] if a in RECIPES]
    if "--text-reference" in sys.argv:
        write_text_reference()
        sys.exit()
    if "--text" not in sys.argv and "--lora" not in sys.argv:
        for family in names or FAMILIES:  # the registry's families
            write(family)
    if "--text" in sys.argv or (not names and "--lora" not in sys.argv):
        write_text()
    if "--lora" in sys.argv or (not names and "--text" not in sys.argv):
        write_lora()
