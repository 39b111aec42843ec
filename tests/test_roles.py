"""Each weight's role read from the traced loss (shardplug.weight_roles), and LoRA's and
float8's default targets chosen by it, not by names: a GPT's attention output projection
named ``out``, Linen's auto-named head ``Dense_0``, a head tied to the embedding, a
mixture's router and experts. Traces only: nothing is compiled."""

from __future__ import annotations

import collections
import pathlib
import sys

import numpy as np
import pytest

import shardplug
from shardplug import pretrained
from shardplug.errors import ShardplugWarning

ROOT = pathlib.Path(__file__).parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"


def by_kind(roles):
    out = collections.defaultdict(set)
    for path, role in roles.items():
        out[role.kind].add(path)
    return out


def gpt_task():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_mfu

    return gpu_mfu.task("smoke")


def test_the_reference_models_weights_by_their_use():
    task = shardplug.get_model("transformer").task("nnx")
    kinds = by_kind(shardplug.weight_roles(task.adapter, task.loss_fn, next(iter(task.batches()))))
    assert kinds["head"] == {"unembed"} and kinds["embedding"] == {"embed"}
    assert kinds["linear"] == {f"blocks/{w}" for w in ("wq", "wk", "wv", "wo", "wi", "wf")}
    assert "blocks/norm1/scale" in kinds["elementwise"] and "position" in kinds["elementwise"]
    # the classifier's accuracy reads argmax of its logits: a metric, not a router
    classifier = shardplug.get_model("classifier")
    batch = next(iter(classifier.batches(classifier.batch_size, 0)))
    kinds = by_kind(shardplug.weight_roles(classifier.adapter("linen"), classifier.loss_fn, batch))
    assert not kinds["router"] and len(kinds["head"]) == 1
    cnn = shardplug.get_model("cnn")
    batch = next(iter(cnn.batches(cnn.batch_size, 0)))
    kinds = by_kind(shardplug.weight_roles(cnn.adapter("equinox"), cnn.loss_fn, batch))
    assert len(kinds["convolution"]) == 2 and len(kinds["head"]) == 1 and not kinds["linear"]


def test_a_mixtures_router_and_experts_and_linens_unnamed_head():
    sys.path.insert(0, str(ROOT / "tests"))
    import llama_models
    import switch_moe

    adapter = shardplug.from_nnx(lambda rngs: switch_moe.SwitchLM(rngs))
    kinds = by_kind(shardplug.weight_roles(adapter, switch_moe.loss_fn,
                                           next(switch_moe.batches())))  # fmt: skip
    assert kinds["router"] == {"router/kernel"} and kinds["grouped"] == {"w_in", "w_out"}
    assert kinds["head"] == {"head/kernel"} and kinds["embedding"] == {"embed/embedding"}
    adapter, loss = llama_models.adapter("linen")
    kinds = by_kind(shardplug.weight_roles(adapter, loss, next(iter(llama_models.batches()))))
    assert kinds["head"] == {"Dense_0/kernel"}  # named as any other layer: found by its use
    assert len(kinds["linear"]) == 7 and all(p.startswith("blocks/") for p in kinds["linear"])


@pytest.mark.parametrize("family", ["gemma3", "mixtral", "qwen2"])
def test_the_pretrained_families_in_every_framework(family):
    """gemma3's and qwen2's heads are their embeddings (tied): a head, read by a product."""
    model = pretrained.load(FIXTURES / family)
    tokens = np.load(FIXTURES / family / "reference.npz")["tokens"]
    for framework in ("nnx", "linen", "equinox"):
        kinds = by_kind(shardplug.weight_roles(model.adapter(framework), model.loss_fn,
                                               {"tokens": tokens}))  # fmt: skip
        assert len(kinds["head"]) == 1, (framework, kinds)
        tied = family in ("gemma3", "qwen2")
        assert ("embed" in next(iter(kinds["head"]))) == tied
        assert len(kinds["embedding"]) == (0 if tied else 1)
        experts = 3 if family == "mixtral" else 0
        assert len(kinds["grouped"]) == experts and len(kinds["router"]) == experts // 3
        assert len(kinds["linear"]) == (4 if experts else 7), (framework, kinds)


def test_loras_default_targets_are_the_linear_layers_whatever_their_names():
    """The GPT's attention output projection ``out`` was left out by name; by its use it is
    a linear layer like the rest, and its head ``unembed`` is the head."""
    task = gpt_task()
    targets = shardplug.with_lora(task, rank=2).adapter.targets()
    layers = {p.split("/")[-2] for p in targets}
    assert layers == {"qkv", "out", "up", "down"} and len(targets) == 4 * 2
    assert not any("embed" in p for p in targets)
    # a name still chooses, as before
    named = shardplug.with_lora(task, rank=2, targets=r"/(qkv|up)/").adapter.targets()
    assert {p.split("/")[-2] for p in named} == {"qkv", "up"}


def test_a_task_whose_data_is_one_iterator_keeps_its_batches_and_chooses_by_name(monkeypatch):
    monkeypatch.setattr(shardplug.errors, "_SAID", set())  # said afresh
    task = gpt_task()
    batches = task.data()
    first = next(iter(task.data()))
    one = shardplug.Task(task.adapter, task.loss_fn, task.optimizer, batches)
    with pytest.warns(ShardplugWarning, match=r"lora: the default targets are chosen by name "
                      r"\(its data is one iterator"):  # fmt: skip
        targets = shardplug.with_lora(one, rank=2).adapter.targets()
    assert not any("/out/" in p for p in targets)  # by name, as before
    assert np.array_equal(next(batches)["tokens"], first["tokens"])  # nothing was read


def _roles_of(loss, params, batch):
    """Roles of a loss written in plain JAX, ``loss(params, batch)``."""
    import jax

    from shardplug.core.operations.roles import roles_in

    closed = jax.make_jaxpr(loss)(params, batch)
    return {p: r.kind for p, r in roles_in(closed, sorted(params)).items()}


def test_roles_by_use_where_names_and_simple_rules_mislead():
    """A loss written as an einsum with one-hot labels (a product by no weight) still has its
    head; a one-hot matmul is a lookup; a weight scaled, normalised or concatenated before
    its product is still that product's; an activation penalty on a layer's output makes it
    no head; a sort that carries the activations along chooses by its keys alone."""
    import jax
    import jax.numpy as jnp

    V, D = 11, 8
    p = {k: jnp.ones(s) for k, s in {"embed": (V, D), "g": (D,), "head": (D, V),
                                     "v": (D, D), "wk": (D, D), "wq": (D, D)}.items()}  # fmt: skip
    tokens = jnp.zeros((2, 5), jnp.int32)

    def loss(p, tokens):
        x = jax.nn.one_hot(tokens, V) @ p["embed"]  # a lookup written as a product
        w = p["g"][None] * p["v"] / jnp.linalg.norm(p["v"], axis=0)[None]  # weight norm
        x = x @ w
        qk = x @ jnp.concatenate([p["wq"], p["wk"]], axis=1)
        x = x + qk[..., :D] * qk[..., D:]
        keys = jnp.broadcast_to(tokens[..., None], x.shape).astype(x.dtype)
        x = x + jax.lax.sort((keys, x), num_keys=1)[1]  # x rides along: it chooses nothing
        logp = jax.nn.log_softmax(x @ p["head"])
        penalty = 1e-3 * jnp.mean(qk**2)  # on a layer's output: no head for it
        return -jnp.einsum("bsv,bsv->", logp, jax.nn.one_hot(tokens, V)) + penalty

    assert _roles_of(loss, p, tokens) == {"embed": "embedding", "g": "linear", "head": "head",
                                          "v": "linear", "wk": "linear", "wq": "linear"}
